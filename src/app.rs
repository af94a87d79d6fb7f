//! The axum router and its layers, in one place.
//!
//! | path | what |
//! |---|---|
//! | `GET /healthz` | liveness: the process serves HTTP |
//! | `GET /readyz` | readiness: started, credentials resolved, not draining, ledger reachable (or a local share serving) |
//! | `GET /metrics` | Prometheus text exposition |
//! | `GET /v1/pools` | live ledger state per pool, JSON |
//! | anything else | the `bedrock-runtime` API, proxied ([`crate::proxy::handle`]) |
//!
//! With `server.admin_listen`, a second listener serves the admin endpoints alone
//! ([`admin_router`]); anything else there is a 404, never proxied.
//!
//! No layers wrap the proxy path: admission is the load shedding (it answers at once, before any
//! upstream work), bodies are bounded where they are read, and timeouts belong to the upstream
//! call, because a generation can legitimately run for many minutes.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{
    Json, Router,
    extract::State,
    response::{IntoResponse, Response},
    routing::get,
};
use http::{StatusCode, header};
use prometheus::Registry;
use serde_json::json;

use arc_swap::ArcSwap;

use crate::{admission::Admission, auth::Authenticator, metrics::Metrics, upstream::Upstream};

/// What a config reload replaces: pools, routes and who may call. A request loads it once, at
/// its start, and keeps that generation to the end (its reservation settles in the same ledger
/// whatever was reloaded meanwhile).
#[derive(Debug)]
pub struct Policy {
    pub admission: Arc<Admission>,
    pub auth: Arc<Authenticator>,
}

/// Everything a request handler needs.
#[derive(Debug)]
pub struct AppState {
    pub policy: ArcSwap<Policy>,
    pub upstream: Arc<Upstream>,
    pub metrics: Arc<Metrics>,
    pub registry: Registry,
    pub max_body_bytes: usize,
    /// Request-body bytes held in memory by all requests (`server.max_buffered_body_bytes`).
    pub body_budget: Arc<crate::body_budget::BodyBudget>,
    /// How long a request body may take to arrive (`server.body_read_timeout_secs`).
    pub body_read_timeout: std::time::Duration,
    /// False until started, and again once draining.
    pub ready: Arc<AtomicBool>,
}

impl AppState {
    /// The policy in force now.
    pub fn policy(&self) -> Arc<Policy> {
        self.policy.load_full()
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    admin_routes()
        .fallback(crate::proxy::handle)
        .with_state(state)
}

/// The admin endpoints only, for `server.admin_listen`.
pub fn admin_router(state: Arc<AppState>) -> Router {
    admin_routes().with_state(state)
}

fn admin_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/pools", get(pools))
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let mode = state.policy().admission.ledger().mode();
    if !state.ready.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    } else if !mode.ready() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: ledger unavailable\n",
        )
            .into_response()
    } else {
        (
            StatusCode::OK,
            format!("ready (ledger: {})\n", mode.label()),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    state.metrics.unsettled_reservations.reset();
    state
        .metrics
        .unsettled_reservations
        .inc_by(crate::ledger::unsettled_drops());
    let admission = state.policy().admission.clone();
    let mode = admission.ledger().mode();
    for m in crate::ledger::LedgerMode::ALL {
        state
            .metrics
            .ledger_mode
            .with_label_values(&[m.label()])
            .set(i64::from(m == mode));
    }
    // Refresh the bucket gauges so a scrape sees the ledger as it is now.
    let _ = admission.pool_states().await;
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render(&state.registry),
    )
        .into_response()
}

async fn pools(State(state): State<Arc<AppState>>) -> Response {
    let admission = state.policy().admission.clone();
    let pools = admission.pool_states().await;
    Json(json!({
        "ledger": admission.ledger().backend(),
        "unsettled_reservations": crate::ledger::unsettled_drops(),
        "pools": pools,
    }))
    .into_response()
}
