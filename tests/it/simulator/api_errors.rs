//! The body-model APIs' errors, each in its API's own shape, and API keys.

use serde_json::{Value, json};
use tokengate::simulator::{QuotaOverride, SimulatorConfig};

use super::apis::{GPT, call, chat, json_call};
use super::{SONNET, instant_config, post_with, start};

#[tokio::test]
async fn errors_come_in_each_api_s_shape() {
    let sim = start(SimulatorConfig {
        quotas: vec![QuotaOverride {
            model: GPT.into(),
            region: None,
            tokens_per_minute: Some(100),
            tokens_per_day: None,
            reserved_tokens_per_minute: None,
        }],
        ..instant_config()
    })
    .await;
    let mut big = chat(GPT, "x");
    big["max_tokens"] = json!(200);
    let (status, h, bytes) = call(&sim, "/openai/v1/chat/completions", &[], big.clone()).await;
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        (status, h["x-amzn-errortype"].to_str().unwrap()),
        (429, "ThrottlingException")
    );
    assert_eq!(
        v,
        json!({"error": {"message": "Too many tokens, please wait before trying again.", "type": "tokens", "param": null, "code": "rate_limit_exceeded"}})
    );
    let (status, v) = json_call(&sim, "/anthropic/v1/messages", big).await;
    assert_eq!(status, 429);
    assert_eq!(
        v,
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "Too many tokens, please wait before trying again."}})
    );

    let cases = [
        (
            "/openai/v1/chat/completions",
            json!({"messages": []}),
            400,
            "model is required",
        ),
        (
            "/openai/v1/chat/completions",
            chat("gpt-4o", "x"),
            404,
            "does not exist",
        ),
        (
            "/openai/v1/responses",
            json!({"model": GPT}),
            400,
            "input is required",
        ),
        (
            "/openai/v1/responses",
            json!({"model": GPT, "input": "x", "background": true}),
            400,
            "background",
        ),
        (
            "/openai/v1/embeddings",
            json!({"model": GPT}),
            404,
            "Unknown request URL",
        ),
        (
            "/openai/v1/chat/completions",
            json!({"model": GPT, "messages": [{"role": "user", "content": "x"}], "service_tier": "scale"}),
            400,
            "service tier",
        ),
        (
            "/openai/v1/chat/completions",
            json!({"model": GPT, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            400,
            "max_tokens",
        ),
    ];
    for (path, body, expected, needle) in cases {
        let (status, v) = json_call(&sim, path, body).await;
        assert_eq!(status, expected, "{path} {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
        assert!(v["error"]["type"].is_string());
    }
    let (status, v) = json_call(&sim, "/anthropic/v1/complete", json!({})).await;
    assert_eq!(
        (status, &v["type"], &v["error"]["type"]),
        (404, &json!("error"), &json!("not_found_error"))
    );
    let (status, v) = json_call(
        &sim,
        "/anthropic/v1/messages",
        json!({"model": "claude-x", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(
        (status, &v["error"]["type"]),
        (404, &json!("not_found_error"))
    );
    let (status, _, bytes) = post_with(
        &sim,
        "/openai/v1/chat/completions",
        &[("content-type", "text/plain")],
        b"hi",
    )
    .await;
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("application/json")
    );
    assert_eq!(
        sim.simulator.stats().buckets[&format!("{GPT}@us-east-1")].throttled,
        2
    );
}

#[tokio::test]
async fn api_keys_are_checked_when_configured() {
    let sim = start(SimulatorConfig {
        api_keys: vec!["good-key".into()],
        ..instant_config()
    })
    .await;
    let body = chat(GPT, "x [sim:output=1]");
    let (status, _, _) = call(
        &sim,
        "/openai/v1/chat/completions",
        &[("authorization", "Bearer good-key")],
        body.clone(),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _, _) = call(
        &sim,
        "/anthropic/v1/messages",
        &[("x-api-key", "good-key")],
        body.clone(),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _, bytes) = call(
        &sim,
        "/openai/v1/chat/completions",
        &[("authorization", "Bearer bad")],
        body.clone(),
    )
    .await;
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        (status, &v["error"]["code"]),
        (403, &json!("invalid_api_key"))
    );
    let (status, _, _) = call(&sim, "/anthropic/v1/messages", &[], body).await;
    assert_eq!(status, 403, "no credential at all");
    // Native operations take the same keys.
    let converse =
        json!({"messages": [{"role": "user", "content": [{"text": "x [sim:output=1]"}]}]});
    let (status, _, _) = call(
        &sim,
        &format!("/model/{SONNET}/converse"),
        &[("authorization", "Bearer good-key")],
        converse,
    )
    .await;
    assert_eq!(status, 200);
    let keys = sim.simulator.stats().api_keys;
    assert_eq!((keys.seen, keys.accepted, keys.rejected), (4, 3, 1));
}
