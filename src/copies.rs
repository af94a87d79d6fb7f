//! Following an endpoint's copies: for each endpoint pool with `refresh_secs`, a task asks the
//! SageMaker control plane how many copies serve (DescribeInferenceComponent for a pool with an
//! inference component, else DescribeEndpoint) at once and then every `refresh_secs`, and sets
//! them on the pool ([`crate::admission::Pool::set_copies`]): its limits follow from the next
//! decision on.
//!
//! # Failure semantics
//! A call that fails (no answer within [`CALL_TIMEOUT`], an error status, an answer without a
//! current count) leaves the copies as they were, is counted on the pool (`refresh_errors` in
//! `/v1/pools`, `tokengate_endpoint_copy_refreshes_total{result="error"}`) and logged; the next
//! tick tries again. A task ends when its pool is gone (a reload replaced it and its last request
//! settled) or when the gateway stops.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method};
use http_body_util::{BodyExt, Limited};
use tokio_util::sync::CancellationToken;

use crate::{
    admission::{Admission, Pool},
    sagemaker::control::{self, Copies, Describe},
    upstream::sagemaker::{SageMakerUpstreams, Service},
};

/// The longest one describe call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest describe answer read.
const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// Starts a refresher for every endpoint pool of `admission` that asks for one.
pub fn follow(
    admission: &Admission,
    upstreams: &Arc<SageMakerUpstreams>,
    stop: &CancellationToken,
) {
    for pool in admission.pools() {
        let Some(every) = pool.endpoint_config().and_then(|e| e.refresh) else {
            continue;
        };
        let (pool, upstreams, stop) = (Arc::downgrade(pool), upstreams.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = stop.cancelled() => return,
                }
                if !refresh(&pool, &upstreams).await {
                    return;
                }
            }
        });
    }
}

/// One refresh of `pool`; false when the pool is gone.
async fn refresh(pool: &Weak<Pool>, upstreams: &SageMakerUpstreams) -> bool {
    let Some(pool) = pool.upgrade() else {
        return false;
    };
    match describe(&pool, upstreams).await {
        Ok(update) => pool.set_copies(update),
        Err(e) => {
            tracing::warn!(pool = %pool.name, error = %e, "reading the endpoint's copies failed; they stay as they were");
            pool.copies_refresh_failed(e);
        }
    }
    true
}

/// Asks the control plane how many copies serve `pool`'s endpoint.
pub async fn describe(pool: &Pool, upstreams: &SageMakerUpstreams) -> Result<Copies, String> {
    let config = pool
        .endpoint_config()
        .ok_or_else(|| format!("pool {:?} is not an endpoint pool", pool.name))?;
    let call = match &config.inference_component {
        Some(ic) => Describe::InferenceComponent(ic),
        None => Describe::Endpoint(&config.endpoint),
    };
    let client = upstreams
        .client(Service::Control, &config.control, &config.region)
        .map_err(|e| e.to_string())?;
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(control::CONTENT_TYPE),
    );
    let target = HeaderValue::from_str(&call.target()).map_err(|e| e.to_string())?;
    headers.insert(control::TARGET_HEADER, target);
    let answer = async {
        let response = client
            .send(
                None,
                client.signer().default_region(),
                Method::POST,
                "/",
                &headers,
                Bytes::from(call.body()),
            )
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| format!("reading the {} answer: {e}", call.operation()))?
            .to_bytes();
        Ok::<_, String>((status, body))
    };
    let (status, body) = tokio::time::timeout(CALL_TIMEOUT, answer)
        .await
        .map_err(|_| {
            format!(
                "{} did not answer within {CALL_TIMEOUT:?}",
                call.operation()
            )
        })??;
    if !status.is_success() {
        return Err(format!(
            "{} answered {status}: {}",
            call.operation(),
            control::error_message(&body)
        ));
    }
    call.copies(&body).map_err(|e| e.to_string())
}
