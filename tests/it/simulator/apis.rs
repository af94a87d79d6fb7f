//! The body-model APIs on the wire (what the openai and anthropic SDKs hide; tests/python drives
//! them with those SDKs): one quota with the native operations, each API's SSE framing and
//! usage, stop reasons at the cap. Errors and API keys: `api_errors.rs`.

use bytes::Bytes;
use serde_json::{Value, json};
use tokengate::simulator::{SimulatorConfig, SimulatorHandle};

use crate::common::apis::sse_events;

use super::{SONNET, client, instant_config, post_with, start, user};

pub(super) const GPT: &str = "openai.gpt-oss-120b-1:0";

pub(super) async fn call(
    sim: &SimulatorHandle,
    path: &str,
    headers: &[(&str, &str)],
    body: Value,
) -> (u16, http::HeaderMap, Bytes) {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    post_with(sim, path, &all, body.to_string().as_bytes()).await
}

pub(super) async fn json_call(sim: &SimulatorHandle, path: &str, body: Value) -> (u16, Value) {
    let (status, _, bytes) = call(sim, path, &[], body).await;
    (status, serde_json::from_slice(&bytes).unwrap())
}

pub(super) fn chat(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn converse_and_every_body_model_api_drain_one_bucket() {
    let sim = start(instant_config()).await;
    // "one quota [sim:output=4]" = 24 bytes -> 6 + 3 for one message = 9 input tokens.
    let text = "one quota [sim:output=4]";
    let out = client(&sim, "secret")
        .converse()
        .model_id(format!("us.{SONNET}"))
        .messages(user(text))
        .send()
        .await
        .unwrap();
    assert_eq!(out.usage().unwrap().input_tokens(), 9);
    let model = format!("us.{SONNET}");
    let (status, v) = json_call(&sim, "/openai/v1/chat/completions", chat(&model, text)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 9);
    let (status, v) = json_call(&sim, "/v1/chat/completions", chat(&model, text)).await;
    assert_eq!((status, &v["object"]), (200, &json!("chat.completion")));
    let (status, v) = json_call(
        &sim,
        "/openai/v1/responses",
        json!({"model": model, "input": text}),
    )
    .await;
    assert_eq!(
        (status, &v["usage"]["input_tokens"]),
        (200, &json!(9)),
        "{v}"
    );
    let (status, v) = json_call(&sim, "/anthropic/v1/messages", chat(&model, text)).await;
    assert_eq!(
        (status, &v["usage"]["input_tokens"]),
        (200, &json!(9)),
        "{v}"
    );

    let stats = sim.simulator.stats();
    let b = &stats.buckets[&format!("{SONNET}@geo:us")];
    assert_eq!(stats.buckets.len(), 1, "one bucket");
    // Each call: 9 input + 4 output x burndown 5.
    assert_eq!((b.requests, b.completed, b.tokens_charged), (5, 5, 5 * 29));
    for api in [
        "Converse",
        "OpenAIChatCompletions",
        "OpenAIResponses",
        "AnthropicMessages",
    ] {
        let expected = if api == "OpenAIChatCompletions" {
            2 * 29
        } else {
            29
        };
        assert_eq!(stats.apis[api].tokens_charged, expected, "{api}");
    }
    assert_eq!(stats.operations["OpenAIChatCompletions"], 2);
}

#[tokio::test]
async fn caps_and_absent_caps_reserve_like_native_calls_and_stop_reasons_say_so() {
    let sim = start(SimulatorConfig {
        default_tokens_per_minute: 1_000_000,
        ..instant_config()
    })
    .await;
    let text = "cap me [sim:output=50]";
    let mut body = chat(SONNET, text);
    body["max_completion_tokens"] = json!(20);
    body["max_tokens"] = json!(999);
    let (_, v) = json_call(&sim, "/openai/v1/chat/completions", body).await;
    assert_eq!(
        (
            &v["choices"][0]["finish_reason"],
            &v["usage"]["completion_tokens"]
        ),
        (&json!("length"), &json!(20))
    );
    let (_, v) = json_call(
        &sim,
        "/openai/v1/responses",
        json!({"model": SONNET, "input": text, "max_output_tokens": 20}),
    )
    .await;
    assert_eq!(
        (&v["status"], &v["incomplete_details"]["reason"]),
        (&json!("incomplete"), &json!("max_output_tokens"))
    );
    let mut body = chat(SONNET, text);
    body["max_tokens"] = json!(20);
    let (_, v) = json_call(&sim, "/anthropic/v1/messages", body).await;
    assert_eq!(
        (&v["stop_reason"], &v["usage"]["output_tokens"]),
        (&json!("max_tokens"), &json!(20))
    );
    // Natively: Converse and every InvokeModel family say the cap stopped them, each its way.
    let converse = json!({"messages": [{"role": "user", "content": [{"text": text}]}], "inferenceConfig": {"maxTokens": 20}});
    let native = [
        (
            SONNET,
            "converse",
            converse,
            "/stopReason",
            json!("max_tokens"),
        ),
        (
            "amazon.nova-lite-v1:0",
            "invoke",
            json!({"messages": [{"role": "user", "content": [{"text": text}]}], "inferenceConfig": {"maxTokens": 20}}),
            "/stopReason",
            json!("max_tokens"),
        ),
        (
            "amazon.titan-text-express-v1",
            "invoke",
            json!({"inputText": text, "textGenerationConfig": {"maxTokenCount": 20}}),
            "/results/0/completionReason",
            json!("LENGTH"),
        ),
        (
            "meta.llama3-3-70b-instruct-v1:0",
            "invoke",
            json!({"prompt": text, "max_gen_len": 20}),
            "/stop_reason",
            json!("length"),
        ),
        (
            "mistral.mistral-large-2407-v1:0",
            "invoke",
            json!({"prompt": text, "max_tokens": 20}),
            "/choices/0/finish_reason",
            json!("length"),
        ),
    ];
    for (model, op, body, pointer, stop) in native {
        let (status, v) = json_call(&sim, &format!("/model/{model}/{op}"), body).await;
        assert_eq!(
            (status, v.pointer(pointer)),
            (200, Some(&stop)),
            "{model}: {v}"
        );
    }

    // No cap: the model's maximum (64,000 for Sonnet 4) is reserved while the call runs.
    let slow = start(SimulatorConfig {
        default_tokens_per_minute: 1_000_000,
        time_to_first_token_ms: 60_000,
        ..SimulatorConfig::default()
    })
    .await;
    let addr = slow.addr;
    let pending = tokio::spawn(async move {
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<Bytes>>();
        let req = http::Request::post(format!("http://{addr}/openai/v1/chat/completions"))
            .body(http_body_util::Full::new(Bytes::from(
                chat(SONNET, "no cap").to_string(),
            )))
            .unwrap();
        http.request(req).await
    });
    let key = format!("{SONNET}@us-east-1");
    // Polled until the call is in flight (bounded: a hang guard, not a timing assertion).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(b) = slow.simulator.stats().buckets.get(&key)
            && b.in_flight == 1
        {
            // "no cap" = 6 bytes -> 2 + 3 = 5 input tokens.
            assert_eq!(b.tokens_reserved_in_flight, 5 + 64_000);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the call never arrived"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    pending.abort();
}

#[tokio::test]
async fn streams_frame_usage_as_each_api_does() {
    let sim = start(instant_config()).await;
    let text = "stream [sim:output=12]";
    let input = 3 + 6; // 22 bytes -> 6, + 3 for the message
    // Chat without include_usage: no usage anywhere, then [DONE].
    let mut body = chat(GPT, text);
    body["stream"] = json!(true);
    let (status, h, bytes) = call(&sim, "/openai/v1/chat/completions", &[], body.clone()).await;
    assert_eq!(
        (status, h["content-type"].to_str().unwrap()),
        (200, "text/event-stream; charset=utf-8")
    );
    let events = sse_events(&bytes);
    assert_eq!(
        events.last().unwrap(),
        &(String::new(), Value::Null),
        "ends with [DONE]"
    );
    assert!(events.iter().all(|(_, d)| d.get("usage").is_none()));
    let finish = &events[events.len() - 2].1["choices"][0]["finish_reason"];
    assert_eq!(finish, "stop");
    let streamed: String = events
        .iter()
        .filter_map(|(_, d)| d["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed.len().div_ceil(4), 12);
    // With include_usage: a last chunk with empty choices carries it; others carry null.
    body["stream_options"] = json!({"include_usage": true});
    let (_, _, bytes) = call(&sim, "/openai/v1/chat/completions", &[], body).await;
    let events = sse_events(&bytes);
    let usage_chunk = &events[events.len() - 2].1;
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], input);
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 12);
    assert!(
        events[..events.len() - 2]
            .iter()
            .all(|(_, d)| d["usage"].is_null())
    );

    // Responses: ends with response.completed carrying response.usage.
    let (_, _, bytes) = call(
        &sim,
        "/openai/v1/responses",
        &[],
        json!({"model": GPT, "input": text, "stream": true}),
    )
    .await;
    let events = sse_events(&bytes);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(names.last(), Some(&"response.completed"));
    assert!(names.contains(&"response.output_text.delta"));
    let last = &events.last().unwrap().1;
    assert_eq!(
        (
            &last["response"]["usage"]["output_tokens"],
            &last["response"]["usage"]["input_tokens"]
        ),
        (&json!(12), &json!(input))
    );
    let sequence: Vec<u64> = events
        .iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
    // Capped: the stream ends with response.incomplete.
    let (_, _, bytes) = call(
        &sim,
        "/openai/v1/responses",
        &[],
        json!({"model": GPT, "input": text, "stream": true, "max_output_tokens": 5}),
    )
    .await;
    let last = sse_events(&bytes).pop().unwrap();
    assert_eq!(
        (
            last.0.as_str(),
            &last.1["response"]["incomplete_details"]["reason"]
        ),
        ("response.incomplete", &json!("max_output_tokens"))
    );

    // Anthropic: message_start has the input; message_delta the cumulative output and stop reason.
    let mut body = chat(GPT, text);
    body["stream"] = json!(true);
    body["max_tokens"] = json!(10);
    let (_, _, bytes) = call(&sim, "/anthropic/v1/messages", &[], body).await;
    let events = sse_events(&bytes);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..3],
        ["message_start", "content_block_start", "ping"]
    );
    assert_eq!(
        &names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], input);
    let delta = &events[names.len() - 2].1;
    assert_eq!(
        (
            &delta["usage"]["output_tokens"],
            &delta["delta"]["stop_reason"]
        ),
        (&json!(10), &json!("max_tokens"))
    );
    // Five calls, burndown 1 for gpt-oss: outputs 12, 12, 12, 5 and 10.
    assert_eq!(
        sim.simulator.stats().buckets[&format!("{GPT}@us-east-1")].tokens_charged,
        5 * input + 12 + 12 + 12 + 5 + 10
    );
}
