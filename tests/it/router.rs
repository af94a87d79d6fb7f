//! The router without a socket: requests handed to `app::router` with `oneshot`, for everything
//! that is answered before anything goes upstream: the admin endpoints, where they are served,
//! and every refusal of a request's path, body or model. The upstream is a closed port that no
//! test here reaches.

use std::sync::{Arc, atomic::Ordering};

use axum::{Router, body::Body};
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tokengate::{
    app::{Admin, admin_router, router},
    config::Config,
    gateway::{GatewayOptions, assemble},
    state::AppState,
};
use tower::ServiceExt;

use crate::common::{HAIKU, SONNET_US, model_path, proxy_credentials};

const POOLS: &str = "[[pools]]\nname = \"sonnet4-us\"\nmodels = [\"us.anthropic.claude-sonnet-4-20250514-v1:0\"]\n\
                     tokens_per_minute = 10000\nmax_concurrency = 4\noutput_burndown = 5\ndefault_max_tokens = 1000\n";

/// The state of a proxy whose upstream nobody listens on (port 9, discard, closed here).
async fn state(extra: &str) -> Arc<AppState> {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://127.0.0.1:9\"\n{extra}\n{POOLS}"
    );
    let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let options = GatewayOptions {
        credentials: Some(proxy_credentials()),
        ..Default::default()
    };
    let assembled = assemble(&config, options).await.expect("assembles");
    assembled.state.ready.store(true, Ordering::Release);
    assembled.state
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn error_type(&self) -> &str {
        self.headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    fn message(&self) -> String {
        let json: Value = serde_json::from_slice(&self.body).unwrap_or_default();
        json["message"].as_str().unwrap_or_default().to_string()
    }
}

async fn call(app: &Router, method: Method, path: &str, body: &str) -> Answer {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes().to_vec();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

fn converse(max_tokens: u64) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":[{{"text":"hi"}}]}}],"inferenceConfig":{{"maxTokens":{max_tokens}}}}}"#
    )
}

#[tokio::test]
async fn admin_endpoints_answer_on_the_proxy_router_when_no_admin_listener_is_set() {
    let app = router(state("").await, Admin::Here);
    let health = call(&app, Method::GET, "/healthz", "").await;
    assert_eq!(
        (health.status, health.body.as_slice()),
        (StatusCode::OK, &b"ok\n"[..])
    );
    let ready = call(&app, Method::GET, "/readyz", "").await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(
        String::from_utf8_lossy(&ready.body),
        "ready (ledger: memory)\n"
    );
    let metrics = call(&app, Method::GET, "/metrics", "").await;
    assert_eq!(metrics.status, StatusCode::OK);
    assert_eq!(
        metrics.headers.get("content-type").map(|v| v.as_bytes()),
        Some(&b"text/plain; version=0.0.4; charset=utf-8"[..])
    );
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("tokengate_configured_tokens_per_minute{pool=\"sonnet4-us\"} 10000"),
        "{text}"
    );
    let pools = call(&app, Method::GET, "/v1/pools", "").await;
    let json: Value = serde_json::from_slice(&pools.body).expect("json");
    assert_eq!(json["ledger"], "memory");
    assert_eq!(json["pools"][0]["name"], "sonnet4-us");
    assert_eq!(json["pools"][0]["tokens_per_minute"], 10000);
}

#[tokio::test]
async fn with_an_admin_listener_the_proxy_router_keeps_only_healthz() {
    let state = state("").await;
    let app = router(state.clone(), Admin::Elsewhere);
    assert_eq!(
        call(&app, Method::GET, "/healthz", "").await.status,
        StatusCode::OK
    );
    for path in ["/readyz", "/metrics", "/v1/pools"] {
        let a = call(&app, Method::GET, path, "").await;
        assert_eq!(
            (a.status, a.error_type()),
            (StatusCode::NOT_FOUND, "UnknownOperationException"),
            "{path}"
        );
    }
    let admin = admin_router(state);
    for path in ["/healthz", "/readyz", "/metrics", "/v1/pools"] {
        assert_eq!(
            call(&admin, Method::GET, path, "").await.status,
            StatusCode::OK,
            "{path}"
        );
    }
    let proxied = call(
        &admin,
        Method::POST,
        &model_path(SONNET_US, "converse"),
        "{}",
    )
    .await;
    assert_eq!(
        proxied.status,
        StatusCode::NOT_FOUND,
        "the admin listener never proxies"
    );
}

#[tokio::test]
async fn readiness_follows_the_state() {
    let state = state("").await;
    let app = router(state.clone(), Admin::Here);
    state.ready.store(false, Ordering::Release);
    let a = call(&app, Method::GET, "/readyz", "").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(String::from_utf8_lossy(&a.body), "not ready\n");
}

#[tokio::test]
async fn refusals_before_upstream_are_bedrock_shaped_and_say_what_to_change() {
    let app = router(state("").await, Admin::Here);
    let sonnet = model_path(SONNET_US, "converse");
    let cases: [(Method, String, String, StatusCode, &str, &str); 7] = [
        (
            Method::POST,
            "/model/x/unknown-op".into(),
            "{}".into(),
            StatusCode::NOT_FOUND,
            "UnknownOperationException",
            "e.g. POST /model/{modelId}/converse",
        ),
        (
            Method::POST,
            "/model/%E0%A4%A/converse".into(),
            "{}".into(),
            StatusCode::BAD_REQUEST,
            "ValidationException",
            "percent-encoded once",
        ),
        (
            Method::POST,
            "/model/a/../b/converse".into(),
            "{}".into(),
            StatusCode::BAD_REQUEST,
            "ValidationException",
            "",
        ),
        (
            Method::POST,
            model_path(HAIKU, "converse"),
            converse(10),
            StatusCode::BAD_REQUEST,
            "ValidationException",
            "has no quota pool for model",
        ),
        (
            Method::POST,
            sonnet.clone(),
            "{not json".into(),
            StatusCode::BAD_REQUEST,
            "ValidationException",
            "is not valid JSON",
        ),
        (
            Method::POST,
            sonnet.clone(),
            converse(20_000),
            StatusCode::BAD_REQUEST,
            "ValidationException",
            "can never be admitted; set maxTokens to at most",
        ),
        (
            Method::POST,
            sonnet,
            r#"{"inferenceConfig":{"maxTokens":10,"maxTokens":20}}"#.into(),
            StatusCode::BAD_REQUEST,
            "ValidationException",
            "maxTokens",
        ),
    ];
    for (method, path, body, status, error_type, says) in cases {
        let a = call(&app, method, &path, &body).await;
        assert_eq!(
            (a.status, a.error_type()),
            (status, error_type),
            "{path} {body}"
        );
        assert!(
            a.message().contains(says),
            "{path}: {:?} lacks {says:?}",
            a.message()
        );
        assert!(a.headers.contains_key("x-amzn-requestid"), "{path}");
    }
}

#[tokio::test]
async fn a_route_s_allow_list_refuses_other_models_with_access_denied() {
    let routes = "[[routes]]\nname = \"app\"\nmodels = [\"us.anthropic.claude-sonnet-4-20250514-v1:0\"]\n\
                  [[routes]]\nname = \"other\"\nmodels = [\"global.x.y\"]\n\
                  [auth]\ndefault_route = \"other\"\n[[pools]]\nname = \"g\"\nmodels = [\"global.x.y\"]\n\
                  tokens_per_minute = 10000\nmax_concurrency = 4\noutput_burndown = 1\nmax_output_tokens = 100\ndefault_max_tokens = 100\n";
    let app = router(state(routes).await, Admin::Here);
    let a = call(
        &app,
        Method::POST,
        &model_path(SONNET_US, "converse"),
        &converse(10),
    )
    .await;
    assert_eq!(
        (a.status, a.error_type()),
        (StatusCode::FORBIDDEN, "AccessDeniedException")
    );
    assert!(
        a.message().contains("route \"other\" is not allowed"),
        "{}",
        a.message()
    );
}
