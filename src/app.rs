//! The axum router and its layers, in one place.
//!
//! | path | what |
//! |---|---|
//! | `GET /healthz` | liveness: the process serves HTTP |
//! | `GET /readyz` | readiness: started, credentials resolved, not draining, ledger reachable (or a local share serving) |
//! | `GET /metrics` | Prometheus text exposition |
//! | `GET /v1/pools` | live ledger state per pool, JSON |
//! | `GET /v1/quota-report` | what each pool needed over the report's window ([`crate::observe::report`]), JSON or `?format=markdown` |
//! | anything else | the `bedrock-runtime` API, proxied ([`crate::proxy::handle`]) |
//!
//! With `server.admin_listen`, a second listener serves the admin endpoints alone
//! ([`admin_router`]; anything else there is a 404, never proxied), and the proxy listener keeps
//! only `/healthz` ([`Admin::Elsewhere`]): route names, shares, usage and the reasons
//! authentication failed are not for whoever can reach the proxy port, while a probe that can
//! only reach that port (a sidecar's liveness check) still gets an answer that says nothing.
//! Without `admin_listen` every admin endpoint is on the proxy listener ([`Admin::Here`]).
//!
//! No layers wrap the proxy path: admission is the load shedding (it answers at once, before any
//! upstream work), bodies are bounded where they are read, and timeouts belong to the upstream
//! call, because a generation can legitimately run for many minutes.

use std::sync::{Arc, atomic::Ordering};

use axum::{
    Json, Router,
    extract::{Query, State},
    response::{IntoResponse, Response},
    routing::get,
};
use http::{StatusCode, header};
use serde_json::json;

pub use crate::state::{AppState, Policy};

/// Where the admin endpoints are served, seen from the proxy listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admin {
    /// On the proxy listener too (no `server.admin_listen`).
    Here,
    /// On `server.admin_listen` only; the proxy listener keeps `/healthz`.
    Elsewhere,
}

/// The proxy listener's router: the API, and the admin endpoints unless they live elsewhere.
pub fn router(state: Arc<AppState>, admin: Admin) -> Router {
    let routes = match admin {
        Admin::Here => admin_routes(),
        Admin::Elsewhere => Router::new().route("/healthz", get(healthz)),
    };
    routes.fallback(crate::proxy::handle).with_state(state)
}

/// The admin endpoints only, for `server.admin_listen`.
pub fn admin_router(state: Arc<AppState>) -> Router {
    admin_routes().with_state(state)
}

async fn healthz() -> &'static str {
    "ok\n"
}

fn admin_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/pools", get(pools))
        .route("/v1/quota-report", get(quota_report))
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
    let policy = state.policy();
    let admission = &policy.admission;
    crate::observe::publish::ledger(
        &state.metrics,
        admission.ledger().as_ref(),
        &state.ledger_publications,
    );
    crate::observe::publish::upstream(&state.metrics, &state.upstream.h2_views());
    // Refresh the gauges so a scrape sees the pools as they are now.
    let views = admission.pool_views().await;
    policy.observer.publish_pools(admission, &views);
    policy
        .observer
        .publish_budgets(&admission.budget_views().await);
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
    let pools = admission.pool_views().await;
    let budgets = admission.budget_views().await;
    Json(json!({
        "ledger": admission.ledger().backend(),
        "unsettled_reservations": admission.ledger().stats().unsettled_drops(),
        "pools": pools,
        "budgets": budgets,
    }))
    .into_response()
}

#[derive(Debug, serde::Deserialize)]
struct ReportQuery {
    format: Option<String>,
}

async fn quota_report(
    State(state): State<Arc<AppState>>,
    Query(query): Query<ReportQuery>,
) -> Response {
    let policy = state.policy();
    let report = state.telemetry.report.report(policy.admission.pools());
    match query.format.as_deref().unwrap_or("json") {
        "json" => Json(report).into_response(),
        "markdown" => (
            [(header::CONTENT_TYPE, "text/markdown; charset=utf-8")],
            crate::observe::report::markdown::render(&report),
        )
            .into_response(),
        other => (
            StatusCode::BAD_REQUEST,
            Json(json!({
                "message": format!("format {other:?} is not known; use format=json or format=markdown"),
            })),
        )
            .into_response(),
    }
}
