//! tokengate: an admission-control proxy for Amazon Bedrock's `bedrock-runtime` API.
//!
//! Unmodified AWS SDK clients point `endpoint_url` at tokengate. For every model call it reserves
//! `input + maxTokens` of tokens-per-minute quota in the right pool (exactly as Bedrock deducts at
//! request start), enforces concurrency and request-rate limits, forwards the call re-signed with
//! its own credentials without buffering the response, and settles the reservation to Bedrock's
//! own end-of-request charge. What does not fit is turned away with a Bedrock-shaped, retryable
//! `ThrottlingException` carrying a jittered retry hint computed from the ledger.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | [`config`] | raw TOML config, validation into typed config, error messages that name the key |
//! | [`bedrock`] | the wire format: operations and paths, modelId parsing, maxTokens and usage extraction, event-stream frames, AWS error shapes |
//! | [`sagemaker`] | the `sagemaker-runtime` wire format (endpoint paths, container payloads, error names) and the control plane's describe calls |
//! | [`admission`] | pool resolution, estimates, the admit/reject decision, retry hints, reconciliation |
//! | [`ledger`] | the [`ledger::Ledger`] trait, bucket arithmetic, the memory and Redis backends, the local-share fallback |
//! | [`upstream`] | SigV4 re-signing, the pooled HTTPS client, metered streaming pass-through |
//! | [`auth`] | caller identity; SigV4 signature verification |
//! | [`metrics`] | the Prometheus registry and every `tokengate_*` metric |
//! | [`simulator`] | a faithful stand-in for `bedrock-runtime` with Bedrock's own quota arithmetic |
//! | [`app`] | the axum router and the layer stack, in one place |
//! | [`proxy`] | the life of a proxied request: target, caller, decide, answer or forward, meter |
//! | [`answer`] | the one map from a decision (or upstream's outcome) to the Bedrock-shaped answer |
//! | [`observe`] | what happened, recorded: metrics, the access log, the quota report, CloudWatch EMF lines, OpenTelemetry spans |
//! | [`state`] | what request handlers share: the reloadable policy and the process-wide parts |
//! | [`calendar`] | UTC dates from day counts and back, for SigV4's dates and the quota report's minutes |
//! | [`body_budget`] | the bytes of request bodies held in memory, bounded for all requests together |
//! | [`gateway`] | assembling a running proxy from a config |
//! | [`copies`] | following endpoint pools' copies from the SageMaker control plane |
//! | [`server`] | the listener: HTTP/1.1 and h2c on one port, optional TLS, the connection cap, timeouts and header limits, graceful shutdown |
//! | [`healthcheck`] | `tokengate healthcheck`: the container image's probe (no shell, no curl); the plain-HTTP GET `report` and `top` use |
//! | [`top`] | `tokengate top`: the pools of a running proxy in a terminal |

pub mod admission;
pub mod answer;
pub mod app;
pub mod auth;
pub mod bedrock;
pub mod body_budget;
pub mod calendar;
pub mod config;
pub mod copies;
pub mod gateway;
pub mod healthcheck;
pub mod ledger;
pub mod metrics;
pub mod observe;
pub(crate) mod own_wake;
pub mod proxy;
pub mod sagemaker;
pub mod server;
pub mod simulator;
pub mod state;
pub mod top;
pub mod upstream;
