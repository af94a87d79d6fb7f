//! `POST /_sim/daily`: lets tests move through quota days without waiting for them.
//!
//! The body is a JSON object:
//! - `{"new_day": true}` starts a new day for every bucket and Region (the clock's day number
//!   plus one);
//! - `{"model": ID, "region": R, "tokens_used": N}` sets the day's use of the on-demand bucket
//!   `ID` lands in when called in Region `R` (default: the simulator's `region`);
//! - `{"region": R, "tokens_used": N}` (no model) sets the account-wide use of Region `R`, when
//!   `account_tokens_per_day` is set.
//!
//! `new_day` may come with either. The answer is `GET /_sim/stats`'s; a body that asks nothing
//! or something impossible is a 400 `ValidationException` saying what to send. Like
//! `/_sim/stats`, it needs no credentials.

use axum::Json;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;

use super::Simulator;
use super::charge::Call;
use crate::bedrock::BedrockError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Daily {
    #[serde(default)]
    new_day: bool,
    model: Option<String>,
    region: Option<String>,
    tokens_used: Option<u64>,
}

pub(super) fn daily(sim: &Simulator, body: &Bytes) -> Response {
    match apply(sim, body) {
        Ok(()) => Json(sim.stats()).into_response(),
        Err(message) => BedrockError::validation(message).into_response(),
    }
}

fn apply(sim: &Simulator, body: &Bytes) -> Result<(), String> {
    let usage = "send {\"new_day\": true}, {\"model\": ID, \"region\": R, \"tokens_used\": N} or {\"region\": R, \"tokens_used\": N}";
    let d: Daily =
        serde_json::from_slice(body).map_err(|e| format!("/_sim/daily: {e}; {usage}"))?;
    let inner = &sim.inner;
    if d.new_day {
        inner.start_new_day();
    }
    let region = d.region.as_deref().unwrap_or(&inner.config.region);
    match (d.model, d.tokens_used) {
        (Some(model), Some(used)) => {
            let model = inner.config.resolve(&model, region);
            let bucket = Call::bucket(inner, &model);
            bucket.set_used_on(inner.day(), used);
        }
        (None, Some(used)) => {
            let limit = inner.config.account_tokens_per_day.ok_or(
                "/_sim/daily: there is no account-wide day to set: set simulator.account_tokens_per_day",
            )?;
            inner
                .buckets
                .account(region, limit)
                .set_used(inner.day(), used);
        }
        (Some(_), None) => return Err(format!("/_sim/daily: tokens_used is missing; {usage}")),
        (None, None) if !d.new_day => return Err(format!("/_sim/daily: nothing to do; {usage}")),
        (None, None) => {}
    }
    Ok(())
}
