//! A stand-in for SageMaker real-time endpoints: `[[simulator.endpoints]]` fleets of model
//! copies behind sagemaker-runtime's two invocations, and the control plane calls that say how
//! many copies serve.
//!
//! Written apart from the proxy, as the rest of the simulator is: it shares the invocation paths
//! ([`crate::sagemaker::operation`]), frames and the SigV4 verifier, never the proxy's reading of
//! payloads or its admission.
//!
//! # Rules
//! - **Copies and their cap** ([`fleet`]): a fleet of `copies`, each serving
//!   `max_concurrency_per_copy` requests at once (least-outstanding routing); a call past that is
//!   refused as the container refuses it: `424 ModelError`, `OriginalStatusCode` 429, which SDKs
//!   do not retry. An inference component with no copies answers `400 ValidationError`.
//! - **Service time grows with tokens generated** ([`invoke`]): `time_to_first_token_ms`, then
//!   `tokens_per_second` per request; the output length as the Bedrock simulator draws it (the
//!   seed and the body, `[sim:output=N]`, capped at the request's output cap), faults from the
//!   same rates and directives.
//! - **Scaling takes time**: `POST /_sim/sagemaker` `{"endpoint", "inference_component",
//!   "copies"}` sets the desired copies at once and the current ones after `scale_delay_ms`;
//!   `GET /_sim/sagemaker` reports every fleet (copies, in flight and its peak, calls served,
//!   refused past the cap, refused for no capacity, tokens generated).
//! - **Control plane** ([`control`]): `POST /` with `X-Amz-Target` DescribeEndpoint or
//!   DescribeInferenceComponent (awsJson1_1).
//! - **Credentials**: with `verify_sigv4`, invocations and the control plane must be signed for
//!   service `sagemaker`.

pub mod config;
mod control;
pub mod fleet;
mod invoke;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;

use super::{Inner, auth};
use crate::bedrock::Operation;
use crate::sagemaker::EndpointTarget;
use fleet::Fleet;

pub use config::EndpointSimConfig;
pub use fleet::FleetStats;

/// Every simulated fleet.
#[derive(Debug, Default)]
pub struct Fleets(Vec<Arc<Fleet>>);

impl Fleets {
    pub fn new(configs: &[EndpointSimConfig]) -> Fleets {
        Fleets(
            configs
                .iter()
                .cloned()
                .map(|c| Arc::new(Fleet::new(c)))
                .collect(),
        )
    }

    fn iter(&self) -> impl Iterator<Item = &Arc<Fleet>> {
        self.0.iter()
    }

    fn find(&self, endpoint: &str, component: Option<&str>) -> Option<&Arc<Fleet>> {
        self.iter().find(|f| {
            f.config.name == endpoint && f.config.inference_component.as_deref() == component
        })
    }

    /// Every fleet's figures, as `GET /_sim/sagemaker` reports them.
    pub fn stats(&self) -> Vec<FleetStats> {
        self.iter().map(|f| f.stats()).collect()
    }
}

/// The simulator's routes for SageMaker.
pub(super) fn routes(router: Router<Arc<Inner>>) -> Router<Arc<Inner>> {
    router
        .route("/endpoints/{name}/invocations", post(invocation))
        .route(
            "/endpoints/{name}/invocations-response-stream",
            post(invocation),
        )
        .route("/", post(control_plane))
        .route(
            "/_sim/sagemaker",
            get(|State(sim): State<Arc<Inner>>| async move { control::stats(&sim.fleets) }).post(
                |State(sim): State<Arc<Inner>>, body: Bytes| async move {
                    control::scale(&sim.fleets, &body)
                },
            ),
        )
}

async fn invocation(State(sim): State<Arc<Inner>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let target = match EndpointTarget::parse(&parts.method, parts.uri.path(), &parts.headers) {
        Some(Ok(target)) => target,
        Some(Err(e)) => return invoke::validation(&e.to_string()),
        None => return invoke::validation("not an endpoint path"),
    };
    let Ok(body) = axum::body::to_bytes(body, invoke::MAX_BODY_BYTES).await else {
        return invoke::validation("The request body could not be read or is larger than 6 MB.");
    };
    if let Err(refusal) = auth::check_for(&sim, &parts, &body, "sagemaker") {
        return refusal.into_response();
    }
    let component = target.inference_component.as_deref();
    let Some(fleet) = sim.fleets.find(&target.endpoint, component) else {
        return invoke::validation(&not_found(&sim.fleets, &target.endpoint, component));
    };
    let streaming = target.operation == Operation::InvokeEndpointWithResponseStream;
    invoke::invoke(
        &sim.config,
        fleet,
        &parts,
        &body,
        streaming,
        sim.next_arrival(),
    )
    .await
}

/// What SageMaker says when a call names no fleet the simulator runs.
fn not_found(fleets: &Fleets, endpoint: &str, component: Option<&str>) -> String {
    let on_endpoint: Vec<&Arc<Fleet>> = fleets
        .iter()
        .filter(|f| f.config.name == endpoint)
        .collect();
    match component {
        _ if on_endpoint.is_empty() => {
            format!("Endpoint {endpoint} of account 111122223333 not found.")
        }
        None => "Inference Component Name header is required for endpoints to which you plan to deploy inference components. \
                 Please include Inference Component Name header or consider using SageMaker models."
            .to_string(),
        Some(ic) => format!("Inference Component {ic} not found on endpoint {endpoint}."),
    }
}

async fn control_plane(State(sim): State<Arc<Inner>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, 1024 * 1024).await else {
        return invoke::validation("The request body could not be read.");
    };
    if let Err(refusal) = auth::check_for(&sim, &parts, &body, "sagemaker") {
        return refusal.into_response();
    }
    let target = parts
        .headers
        .get(crate::sagemaker::control::TARGET_HEADER)
        .and_then(|v| v.to_str().ok());
    control::describe(&sim.fleets, &sim.config.region, target, &body)
}
