//! The OpenAI Chat Completions, OpenAI Responses and Anthropic Messages APIs through the proxy,
//! on the wire (tests/python drives them with the openai and anthropic SDKs): every call settles
//! what the simulator charged; a streamed Chat Completions call gets exactly the stream it asked
//! for; refusals come in each API's own error shape with the retry headers its SDK reads; bad
//! input says what to change. Credentials and ceilings: `apis_auth.rs`.

use crate::common::{apis::*, *};
use bytes::Bytes;
use serde_json::{Value, json};

fn pools() -> String {
    format!(
        "{}\n{}",
        gpt_pool(1_000_000, ""),
        sonnet_pool(1_000_000, 16)
    )
}

async fn post(addr: std::net::SocketAddr, path: &str, body: &Value) -> RawResponse {
    raw_request(addr, "POST", path, body.to_string(), false).await
}

fn json_of(r: &RawResponse) -> Value {
    serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&r.body)))
}

fn charged(stack: &Stack, pool: &str) -> u64 {
    metric(
        &stack.proxy,
        "tokengate_charged_tokens_total",
        &[("pool", pool)],
    ) as u64
}

fn settled(stack: &Stack, pool: &str, rule: &str) -> u64 {
    settlements(&stack.proxy, pool, rule)
}

fn chat(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}], "max_completion_tokens": 200})
}

#[tokio::test]
async fn every_api_settles_what_the_simulator_charged() {
    let stack = Stack::start(FAST_SIM, &pools(), "").await;
    let addr = stack.proxy.addr;
    let text = "hello [sim:output=12]";
    let stream = |mut v: Value| {
        v["stream"] = json!(true);
        v
    };
    let mut with_usage = stream(chat(GPT, text));
    with_usage["stream_options"] = json!({"include_usage": true});
    let responses =
        json!({"model": GPT, "input": text, "instructions": "be brief", "max_output_tokens": 100});
    let messages = json!({"model": SONNET_US, "max_tokens": 100, "system": "sim",
        "messages": [{"role": "user", "content": text}]});
    let calls = [
        (CHAT, chat(GPT, text)),
        ("/v1/chat/completions", chat(GPT, text)),
        (CHAT, stream(chat(GPT, text))),
        (CHAT, with_usage),
        (RESPONSES, responses.clone()),
        (RESPONSES, stream(responses)),
        (MESSAGES, messages.clone()),
        (MESSAGES, stream(messages)),
    ];
    for (path, body) in &calls {
        let r = post(addr, path, body).await;
        assert_eq!(r.status, 200, "{path} {body}: {:?}", r.body);
    }
    // Over HTTP/2 (prior knowledge) too, streaming and not.
    let r = raw_request(addr, "POST", MESSAGES, messages_body(text), true).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let body = stream(chat(GPT, text)).to_string();
    let r = raw_request(addr, "POST", CHAT, body, true).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let streamed = chunks(&r.body);
    assert!(!streamed.is_empty() && streamed.iter().all(|c| c["usage"].is_null()));
    stack.assert_ledger_zero().await;
    let (gpt, sonnet) = (
        settled(&stack, "gpt", "usage"),
        settled(&stack, "sonnet4-us", "usage"),
    );
    assert_eq!((gpt, sonnet), (7, 3), "every call settled on its usage");
    let sim = stack.sim.simulator.stats().tokens_charged();
    assert_eq!(charged(&stack, "gpt") + charged(&stack, "sonnet4-us"), sim);
    let pools: Value = json_of(&raw_request(addr, "GET", "/v1/pools", "", false).await);
    let apis = &pools["pools"][0]["apis"];
    assert_eq!(apis["openai_chat"]["admitted"], 5, "{apis}");
    assert_eq!(apis["openai_responses"]["admitted"], 2, "{apis}");
    assert_eq!(
        pools["pools"][1]["apis"]["anthropic_messages"]["admitted"],
        3
    );
    assert_eq!(apis["bedrock"]["admitted"], 0);
    let metrics = scrape(addr).await;
    let admitted = |api, op| {
        metrics.get(
            "tokengate_requests_total",
            &[
                ("pool", "gpt"),
                ("api", api),
                ("operation", op),
                ("outcome", "admitted"),
            ],
        )
    };
    assert_eq!(admitted("openai_chat", "OpenAIChatCompletions"), 5.0);
    assert_eq!(admitted("openai_responses", "OpenAIResponses"), 2.0);
}

fn messages_body(text: &str) -> String {
    json!({"model": SONNET_US, "max_tokens": 50, "messages": [{"role": "user", "content": text}]})
        .to_string()
}

/// The data of every chunk, `[DONE]` apart.
fn chunks(body: &Bytes) -> Vec<Value> {
    sse_events(body)
        .into_iter()
        .map(|(_, data)| data)
        .filter(Value::is_object)
        .collect()
}

#[tokio::test]
async fn a_streamed_chat_gets_exactly_the_stream_it_asked_for() {
    let sim = start_simulator(FAST_SIM).await;
    let tap = tap::Tap::start(sim.addr, &[]).await;
    let proxy = start_proxy(proxy_config(tap.addr, &gpt_pool(1_000_000, ""), "")).await;
    let mut body = chat(GPT, "stream me [sim:output=9]");
    body["stream"] = json!(true);

    // Not asked for: upstream is asked on the client's behalf, and the client sees none of it.
    let proxied = post(proxy.addr, CHAT, &body).await;
    let direct = post(sim.addr, CHAT, &body).await;
    assert_eq!(proxied.status, 200);
    let forwarded: Value = serde_json::from_slice(&tap.seen()[0].body).unwrap();
    assert_eq!(forwarded["stream_options"], json!({"include_usage": true}));
    let (got, want) = (chunks(&proxied.body), chunks(&direct.body));
    assert_eq!(
        got.len(),
        want.len(),
        "the chunks a client that did not ask gets"
    );
    // The same chunks (the generated text apart, which differs from call to call).
    let shape = |v: &Value| {
        let mut v = v.clone();
        for key in ["id", "created"] {
            v[key] = Value::Null;
        }
        if let Some(content) = v.pointer_mut("/choices/0/delta/content") {
            *content = json!(content.as_str().is_some());
        }
        v
    };
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(shape(g), shape(w), "no usage member: {g}");
    }
    assert!(!String::from_utf8_lossy(&proxied.body).contains("usage"));
    assert!(proxied.body.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(proxy_usage_settlements(&proxy), 1);

    // Asked for: forwarded as sent, and the usage chunk reaches the client.
    body["stream_options"] = json!({"include_usage": true});
    let proxied = post(proxy.addr, CHAT, &body).await;
    assert_eq!(tap.seen()[1].body, Bytes::from(body.to_string()));
    let got = chunks(&proxied.body);
    let last = got.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 9);
    assert!(got[..got.len() - 1].iter().all(|c| c["usage"].is_null()));
    assert_eq!(proxy_usage_settlements(&proxy), 2);
    assert_ledger_zero(&proxy).await;
}

fn proxy_usage_settlements(proxy: &tokengate::gateway::Gateway) -> u64 {
    settlements(proxy, "gpt", "usage")
}

#[tokio::test]
async fn throttled_callers_get_their_own_apis_429_with_every_retry_header() {
    // 2,000 tokens a minute, no queue: a call reserving 1,500 leaves no room for another.
    let sim =
        "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
    let pools = format!(
        "{}\n[[pools]]\nname = \"sonnet4-us\"\nmodels = [\"{SONNET_US}\"]\ntokens_per_minute = 2000\n\
         max_concurrency = 8\noutput_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 0\n",
        gpt_pool(2000, "max_wait_ms = 0")
    );
    let stack = Stack::start(sim, &pools, "").await;
    let addr = stack.proxy.addr;
    let mut first = chat(GPT, "a long one [sim:output=1400]");
    first["max_completion_tokens"] = json!(1500);
    let first = post(addr, CHAT, &first).await;
    assert_eq!(first.status, 200);
    let mut second = chat(GPT, "x");
    second["max_completion_tokens"] = json!(1500);
    let r = post(addr, CHAT, &second).await;
    assert_eq!(r.status, 429);
    let v = json_of(&r);
    assert_eq!(v["error"]["type"], "tokens", "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("Too many tokens")
    );
    assert_eq!(r.error_type(), "ThrottlingException");
    let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    let amz: u64 = r.header("x-amz-retry-after").unwrap().parse().unwrap();
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(ms, amz);
    assert!(
        secs * 1000 >= ms && secs * 1000 < ms + 2000,
        "{secs} s for {ms} ms"
    );
    assert_eq!(r.header("x-should-retry"), Some("true"));
    assert_eq!(r.header("x-tokengate-reason"), Some("tokens"));

    let first = post(
        addr,
        MESSAGES,
        &json!({"model": SONNET_US, "max_tokens": 1500,
        "messages": [{"role": "user", "content": "long [sim:output=1400]"}]}),
    )
    .await;
    assert_eq!(first.status, 200);
    let r = post(
        addr,
        MESSAGES,
        &json!({"model": SONNET_US, "max_tokens": 1500, "messages": []}),
    )
    .await;
    assert_eq!(r.status, 429);
    let v = json_of(&r);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert!(r.header("retry-after-ms").is_some() && r.header("retry-after").is_some());
    let pools: Value = json_of(&raw_request(addr, "GET", "/v1/pools", "", false).await);
    assert_eq!(pools["pools"][0]["apis"]["openai_chat"]["rejected"], 1);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn bad_input_gets_each_apis_own_error_saying_what_to_change() {
    let stack = Stack::start(FAST_SIM, &gpt_pool(100_000, ""), "").await;
    let addr = stack.proxy.addr;
    let openai = |r: &RawResponse| json_of(r)["error"]["message"].as_str().unwrap().to_string();
    let anthropic = |r: &RawResponse| {
        let v = json_of(r);
        assert_eq!(v["type"], "error", "{v}");
        v["error"]["message"].as_str().unwrap().to_string()
    };

    let r = post(addr, CHAT, &json!({"messages": []})).await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert!(
        openai(&r).starts_with("model is required: name a Bedrock model id"),
        "{}",
        openai(&r)
    );
    let r = post(addr, MESSAGES, &json!({"max_tokens": 5, "messages": []})).await;
    assert!(anthropic(&r).starts_with("model is required"));
    let r = raw_request(addr, "POST", CHAT, r#"{"model": "a", "model": "b"}"#, false).await;
    assert!(
        openai(&r).contains("model appears more than once"),
        "{}",
        openai(&r)
    );

    let r = post(
        addr,
        RESPONSES,
        &json!({"model": "openai.gpt-9", "input": "hi"}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(
        openai(&r).contains("no quota pool for model \"openai.gpt-9\""),
        "{}",
        openai(&r)
    );
    let r = post(
        addr,
        MESSAGES,
        &json!({"model": "claude-3-opus", "max_tokens": 5, "messages": []}),
    )
    .await;
    assert!(anthropic(&r).contains("add it to the models list of a [[pools]] entry"));

    let r = raw_request_with(
        addr,
        "POST",
        CHAT,
        chat(GPT, "x").to_string(),
        false,
        &[("content-type", "text/plain")],
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(
        openai(&r).contains("send Content-Type: application/json"),
        "{}",
        openai(&r)
    );
    let r = raw_request_with(
        addr,
        "POST",
        MESSAGES,
        messages_body("x"),
        false,
        &[("content-type", "application/x-www-form-urlencoded")],
    )
    .await;
    assert!(anthropic(&r).contains("Content-Type: application/json"));

    let r = post(addr, "/openai/v1/models", &json!({})).await;
    assert_eq!(
        (r.status, r.error_type()),
        (404, "UnknownOperationException")
    );
    assert!(
        openai(&r).contains("POST /openai/v1/chat/completions"),
        "{}",
        openai(&r)
    );
    assert_eq!(json_of(&r)["error"]["code"], "unknown_url");
    let r = post(addr, "/anthropic/v1/complete", &json!({})).await;
    assert_eq!(r.status, 404);
    assert!(anthropic(&r).contains("POST /anthropic/v1/messages"));
    assert_eq!(json_of(&r)["error"]["type"], "not_found_error");
    let r = raw_request(addr, "GET", CHAT, "", false).await;
    assert_eq!(r.status, 404);
    let r = post(addr, "/openai/v1/../v1/chat/completions", &chat(GPT, "x")).await;
    assert_eq!(r.status, 400);
    assert!(openai(&r).contains("'.' or '..' segment"));

    let r = post(
        addr,
        CHAT,
        &json!({"model": GPT, "messages": [], "max_completion_tokens": 500_000}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(
        openai(&r).contains("set max_completion_tokens to at most"),
        "{}",
        openai(&r)
    );
    assert_eq!(r.header("x-should-retry"), Some("false"));
    let r = post(
        addr,
        CHAT,
        &json!({"model": GPT, "messages": [], "stream": "yes"}),
    )
    .await;
    assert!(openai(&r).contains("stream must be true or false"));
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn a_call_that_soon_fits_waits_in_the_queue_as_native_calls_do() {
    // 6,000 tokens a minute (100 a second), a 3 s queue: after a call charged about 5,860, a
    // 210-token one fits in about a second, and waits for it instead of being turned away.
    let pool = format!(
        "[[pools]]\nname = \"sonnet4-us\"\nmodels = [\"{SONNET_US}\"]\ntokens_per_minute = 6000\n\
         max_concurrency = 8\noutput_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 3000\n"
    );
    let stack = Stack::start(FAST_SIM, &pool, "").await;
    let addr = stack.proxy.addr;
    let drain = json!({"model": SONNET_US, "max_tokens": 5900,
        "messages": [{"role": "user", "content": "drain [sim:output=5850]"}]});
    assert_eq!(post(addr, MESSAGES, &drain).await.status, 200);
    let mut small = chat(SONNET_US, "then me [sim:output=5]");
    small["max_completion_tokens"] = json!(200);
    let r = post(addr, CHAT, &small).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let queued = metric(
        &stack.proxy,
        "tokengate_queue_outcomes_total",
        &[("pool", "sonnet4-us"), ("outcome", "admitted")],
    );
    assert_eq!(queued, 1.0, "admitted from the queue");
    stack.assert_ledger_zero().await;
}
