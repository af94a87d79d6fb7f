//! The OpenAI and Anthropic APIs on the paths that go wrong: a route's allow-list, an upstream
//! that does not answer, a stream cut mid-way (by upstream or by the client), each settled and
//! answered in the API's own shape; and their access-log lines, which name the API and the model
//! the body gave.

use crate::common::{apis::*, log_capture::Capture, wire::try_request, *};
use serde_json::{Value, json};

fn chat_stream(text: &str) -> String {
    json!({"model": GPT, "stream": true, "max_completion_tokens": 400,
        "messages": [{"role": "user", "content": text}]})
    .to_string()
}

#[tokio::test]
async fn a_model_off_the_routes_list_is_refused_in_the_apis_shape() {
    let extra = format!(
        "[auth]\nmode = \"none\"\ndefault_route = \"app\"\n\n[[routes]]\nname = \"app\"\nmodels = [\"{SONNET_US}\"]\n"
    );
    let pools = format!("{}\n{}", gpt_pool(100_000, ""), sonnet_pool(100_000, 4));
    let stack = Stack::start(FAST_SIM, &pools, &extra).await;
    let r = raw_request(stack.proxy.addr, "POST", CHAT, chat_stream("hi"), false).await;
    assert_eq!((r.status, r.error_type()), (403, "AccessDeniedException"));
    let v: Value = serde_json::from_slice(&r.body).expect("json");
    let message = v["error"]["message"].as_str().expect("a message");
    assert!(
        message.contains(&format!("not allowed to call model {GPT:?}")),
        "{message}"
    );
    assert_eq!(
        stack.sim.simulator.stats().calls(),
        0,
        "nothing went upstream"
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn an_upstream_that_does_not_answer_is_a_retryable_503_in_the_apis_shape() {
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let proxy = start_proxy(proxy_config(closed, &sonnet_pool(100_000, 4), "")).await;
    let body = json!({"model": SONNET_US, "max_tokens": 10, "messages": []}).to_string();
    let r = raw_request(proxy.addr, "POST", MESSAGES, body, false).await;
    assert_eq!(
        (r.status, r.error_type()),
        (503, "ServiceUnavailableException")
    );
    let v: Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(v["error"]["type"], "overloaded_error", "{v}");
    assert!(r.header("retry-after-ms").is_some() && r.header("retry-after").is_some());
    assert_eq!(r.header("x-should-retry"), Some("true"));
    assert_eq!(settlements(&proxy, "sonnet4-us", "not_charged"), 1);
    assert_ledger_zero(&proxy).await;
}

#[tokio::test]
async fn a_stream_cut_by_upstream_is_cut_for_the_client_and_settled() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 2000\nstream_cut_rate = 1.0\n\
               default_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &gpt_pool(1_000_000, ""), "").await;
    // Not asked for usage: the filtered stream is cut too, and what it held is dropped.
    let r = try_request(stack.proxy.addr, CHAT, chat_stream("long [sim:output=300]")).await;
    assert_eq!(r.status, 200);
    assert!(r.body.is_err(), "the client sees the stream end early");
    stack.assert_ledger_zero().await;
    assert_eq!(settlements(&stack.proxy, "gpt", "no_usage"), 1);
    let cut = metric(
        &stack.proxy,
        "tokengate_upstream_errors_total",
        &[("pool", "gpt"), ("kind", "stream_cut")],
    );
    assert_eq!(cut, 1.0);
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_releases_its_reservation() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 50\ndefault_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &gpt_pool(1_000_000, ""), "").await;
    let body = chat_stream("slow [sim:output=400]");
    let mut stream = wire::raw_post(stack.proxy.addr, CHAT, body.as_bytes()).await;
    let (status, _, _) = wire::read_head(&mut stream).await;
    assert_eq!(status, 200);
    assert_eq!(in_flight(&stack.proxy, "gpt"), 1);
    drop(stream);
    stack.assert_ledger_zero().await;
    assert_eq!(settlements(&stack.proxy, "gpt", "no_usage"), 1);
}

// A current-thread runtime: the proxy's tasks run on this thread, under the thread's subscriber.
#[tokio::test]
async fn access_log_lines_name_the_api_and_the_model_the_body_gave() {
    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.subscriber());
    let stack = Stack::start(FAST_SIM, &gpt_pool(1_000_000, ""), "").await;
    let addr = stack.proxy.addr;
    let admitted = raw_request(addr, "POST", CHAT, chat_stream("hi [sim:output=4]"), false).await;
    let body = json!({"model": "openai.unpooled", "input": "x"}).to_string();
    let unknown = raw_request(addr, "POST", RESPONSES, body, false).await;
    assert_eq!((admitted.status, unknown.status), (200, 400));
    stack.assert_ledger_zero().await;
    // Written at settlement (the ledger is back to zero) and at the answer.
    let lines = capture.access_lines();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    let a = &lines[0];
    assert_eq!(
        (&a["api"], &a["operation"], &a["model"]),
        (
            &json!("openai_chat"),
            &json!("OpenAIChatCompletions"),
            &json!(GPT)
        ),
        "{a}"
    );
    assert_eq!(
        (&a["decision"], &a["rule"]),
        (&json!("admitted"), &json!("usage"))
    );
    assert_eq!(a["output_tokens"], 4);
    let u = &lines[1];
    assert_eq!(
        (&u["api"], &u["model"], &u["decision"]),
        (
            &json!("openai_responses"),
            &json!("openai.unpooled"),
            &json!("invalid")
        ),
        "{u}"
    );
}
