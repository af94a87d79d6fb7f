//! `[simulator]`: the built-in simulator's settings (latency, output lengths, faults, quotas per
//! minute, per day and reserved, Regions, application profiles, credential checks). Only the data
//! lives here; what the simulator does with it is in [`crate::simulator`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `[simulator]` settings. Every key is optional; the defaults suit a newcomer trying the proxy
/// against a plausible Bedrock (200 ms to first token, 150 tokens/s, no faults).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SimulatorConfig {
    /// The Region of requests that name none (see `simulator::region`). Default `us-east-1`.
    pub region: String,
    /// Tokens per minute of every bucket without an override. Default 200000.
    pub default_tokens_per_minute: u64,
    /// Tokens per day of every on-demand bucket without an override. Default: the bucket's
    /// tokens per minute x 1440.
    pub default_tokens_per_day: Option<u64>,
    /// Tokens per day across every model of one Region (U: some quota pages list an account-wide
    /// daily quota). Default: none.
    pub account_tokens_per_day: Option<u64>,
    /// Length of a quota day, in seconds, counted from the Unix epoch (86400: days end at UTC
    /// midnight). Tests shorten it, or start a new day with `POST /_sim/daily`. Default 86400.
    pub day_secs: u64,
    /// Per-model overrides, `[[simulator.quotas]]`.
    pub quotas: Vec<QuotaOverride>,
    /// Application inference profiles (ARN or the id at its end) = the model id they were made
    /// from, whose bucket they share. An unmapped one has capacity of its own.
    pub application_profiles: BTreeMap<String, String>,
    /// Bedrock API keys accepted as `Authorization: Bearer KEY` or `x-api-key: KEY`. When this or
    /// `verify_sigv4` is set, every request must carry an accepted credential.
    pub api_keys: Vec<String>,
    /// How long an InvokeModelWithBidirectionalStream session may stay open. Default 480 (the
    /// 8 minutes Bedrock allows).
    pub bidirectional_session_secs: u64,
    /// Seed of the output-length and fault draws. Default 0.
    pub seed: u64,
    /// Output length range (uniform, inclusive) when the prompt has no `[sim:output=N]`.
    /// Defaults 50 and 400.
    pub output_tokens_min: u32,
    pub output_tokens_max: u32,
    /// Delay before the first token. Default 200.
    pub time_to_first_token_ms: u64,
    /// Generation speed; 0 means instant. Default 150.
    pub tokens_per_second: f64,
    /// Fraction of quota-counted calls answered 503 `ServiceUnavailableException`. Default 0.
    pub error_503_rate: f64,
    /// Fraction of quota-counted calls answered 500 `InternalServerException`. Default 0.
    pub error_500_rate: f64,
    /// Fraction of quota-counted calls whose connection closes before any response. Default 0.
    pub reset_rate: f64,
    /// Fraction of streaming calls cut mid-way (the connection aborts). Default 0.
    pub stream_cut_rate: f64,
    /// Fraction of streaming calls that pause for `stall_ms` mid-way. Default 0.
    pub stall_rate: f64,
    /// Length of a stall. Default 5000.
    pub stall_ms: u64,
    /// Replaces every model's maximum output tokens (for tests that need streams of many MB).
    /// Default: each model's own (`simulator::models::max_output_tokens`).
    pub max_output_tokens: Option<u64>,
    /// When set, every request must be SigV4-signed (service `bedrock`) with this key.
    pub verify_sigv4: Option<SigV4Key>,
    /// SageMaker endpoints, `[[simulator.endpoints]]` (`simulator::sagemaker`).
    pub endpoints: Vec<EndpointSimConfig>,
    /// Concurrent streams per HTTP/2 connection the simulator's listener allows (its
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`; more are refused with `REFUSED_STREAM`). Bedrock's own
    /// figure is not documented; AWS front ends commonly advertise 128. Default 100.
    pub h2_max_concurrent_streams: u32,
}

impl Default for SimulatorConfig {
    fn default() -> Self {
        SimulatorConfig {
            region: "us-east-1".into(),
            default_tokens_per_minute: 200_000,
            default_tokens_per_day: None,
            account_tokens_per_day: None,
            day_secs: 86_400,
            quotas: Vec::new(),
            application_profiles: BTreeMap::new(),
            api_keys: Vec::new(),
            bidirectional_session_secs: 480,
            seed: 0,
            output_tokens_min: 50,
            output_tokens_max: 400,
            time_to_first_token_ms: 200,
            tokens_per_second: 150.0,
            error_503_rate: 0.0,
            error_500_rate: 0.0,
            reset_rate: 0.0,
            stream_cut_rate: 0.0,
            stall_rate: 0.0,
            stall_ms: 5000,
            max_output_tokens: None,
            verify_sigv4: None,
            endpoints: Vec::new(),
            h2_max_concurrent_streams: 100,
        }
    }
}

/// `[[simulator.quotas]]`: the quotas of the bucket a model id (as callers send it) lands in,
/// in every Region or in `region` only (which wins over an entry for every Region).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QuotaOverride {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
    /// Reserved-tier capacity of the model (its own bucket); none = the tier is not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_tokens_per_minute: Option<u64>,
}

/// `verify_sigv4 = { access_key_id = "...", secret_access_key = "..." }`
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SigV4Key {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl std::fmt::Debug for SigV4Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigV4Key")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .finish()
    }
}

/// One simulated endpoint, or one inference component on an endpoint.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointSimConfig {
    /// The endpoint name.
    pub name: String,
    /// The inference component: calls must name it (`X-Amzn-SageMaker-Inference-Component`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_component: Option<String>,
    /// Copies serving at start (instances of a single-model endpoint).
    pub copies: u32,
    /// Requests one copy serves at once; past that on every copy, a call is refused as the
    /// container refuses it (429 inside a `ModelError`).
    pub max_concurrency_per_copy: u32,
    /// Delay before the first token. Default 200.
    #[serde(default = "default_ttft_ms")]
    pub time_to_first_token_ms: u64,
    /// Generation speed of one request, in tokens per second (0: instant). Default 50.
    #[serde(default = "default_tokens_per_second")]
    pub tokens_per_second: f64,
    /// How long copies asked for by `POST /_sim/sagemaker` take to arrive or leave (new
    /// instances take minutes on AWS). Default 0.
    #[serde(default)]
    pub scale_delay_ms: u64,
    /// The output cap of a request that names none. Default 1024.
    #[serde(default = "default_max_new_tokens")]
    pub default_max_new_tokens: u64,
}

fn default_ttft_ms() -> u64 {
    200
}

fn default_tokens_per_second() -> f64 {
    50.0
}

fn default_max_new_tokens() -> u64 {
    1024
}
