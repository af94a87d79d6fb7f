//! `[[endpoints]]`: SageMaker real-time endpoints (or inference components on them) admitted by
//! concurrency per model copy, with an optional token envelope.
//!
//! Each entry becomes a pool ([`EndpointConfig::pool`]) whose binding limit is concurrency
//! (`copies x max_concurrency_per_copy`) and whose token bucket is the envelope
//! (`copies x tokens_per_second_per_copy` a second) or, without one, too large to bind. It is
//! found by endpoint name and inference component instead of model id, and shares the queue,
//! priorities, routes and retry hints of every pool: `routes[].shares` and `routes[].models` name
//! it by its `name`.

use std::time::Duration;

use serde::Deserialize;

use super::{
    ConfigError, Endpoint, InputEstimate, PoolConfig, PoolTier, Source, WhenMaxTokensMissing,
    invalid, pools, pools::FactSources, upstream,
};
use crate::sagemaker::operation::is_name;

/// A bucket that never binds: an endpoint without a token envelope is limited by concurrency
/// alone. The largest limit the Redis ledger computes exactly.
pub const UNLIMITED_TOKENS_PER_MINUTE: u64 = pools::MAX_TOKENS_PER_MINUTE;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEndpoint {
    pub name: String,
    pub endpoint: String,
    pub inference_component: Option<String>,
    pub region: Option<String>,
    pub copies: u32,
    pub max_concurrency_per_copy: u32,
    pub refresh_secs: Option<u64>,
    pub tokens_per_second_per_copy: Option<u64>,
    pub default_max_tokens: Option<u64>,
    pub max_wait_ms: Option<u64>,
    pub max_queue: Option<usize>,
    pub shadow: Option<bool>,
    pub runtime_url: Option<String>,
    pub control_url: Option<String>,
}

/// One endpoint pool.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointConfig {
    /// The pool's name: metrics label, `routes[].shares` key, `routes[].models` entry.
    pub name: String,
    /// The SageMaker endpoint.
    pub endpoint: String,
    /// The inference component, for calls that name it (`X-Amzn-SageMaker-Inference-Component`).
    pub inference_component: Option<String>,
    pub region: String,
    /// Copies serving at start (instances of a single-model endpoint, or the component's copies);
    /// what the control plane says from then on, with `refresh`.
    pub copies: u32,
    pub max_concurrency_per_copy: u32,
    /// How often the copies are read from the control plane; `None`: the config's count stays.
    pub refresh: Option<Duration>,
    /// The token envelope: generated tokens per second one copy sustains.
    pub tokens_per_second_per_copy: Option<u64>,
    /// With an envelope: reserved when a request names no output cap.
    pub default_max_tokens: u64,
    pub max_wait: Duration,
    pub max_queue: usize,
    pub shadow: bool,
    /// sagemaker-runtime: AWS (`runtime.sagemaker.{region}.amazonaws.com`), the simulator, a URL.
    pub runtime: Endpoint,
    /// The control plane: AWS (`api.sagemaker.{region}.amazonaws.com`), the simulator, a URL.
    pub control: Endpoint,
}

impl EndpointConfig {
    /// Its pool: concurrency binds, the envelope (or an unbounded bucket) holds tokens.
    pub fn pool(&self) -> PoolConfig {
        PoolConfig {
            name: self.name.clone(),
            // The key a route's allow-list names it by (never matched against model ids).
            models: vec![self.name.clone()],
            region: self.region.clone(),
            tokens_per_minute: self.tokens_per_minute(self.copies),
            requests_per_minute: None,
            max_concurrency: self.max_concurrency(self.copies),
            output_burndown: 1,
            // An endpoint's container has no catalogue entry: a call that names no cap
            // reserves the pool's default (`endpoint_estimate`), never this.
            max_output_tokens: self.default_max_tokens,
            sources: FactSources {
                output_burndown: Source::Config,
                max_output_tokens: Source::Config,
            },
            default_max_tokens: self.default_max_tokens,
            when_max_tokens_missing: WhenMaxTokensMissing::ReserveModelMax,
            tokens_per_day: None,
            tier: PoolTier::OnDemand,
            // Never used: an endpoint is called by sagemaker-runtime, never by a Bedrock stream.
            bidirectional_reservation: self.default_max_tokens,
            headroom: 0.0,
            input_estimate: InputEstimate::Heuristic,
            max_wait: self.max_wait,
            max_queue: self.max_queue,
            retry_reserve: 0.0,
            shadow: self.shadow,
            // Endpoint calls never spill (they name no model to rewrite).
            spill_to: Vec::new(),
            spill_cached: true,
            endpoint: Some(self.clone()),
        }
    }

    /// Concurrent requests `copies` serve.
    pub fn max_concurrency(&self, copies: u32) -> u32 {
        copies.saturating_mul(self.max_concurrency_per_copy)
    }

    /// The token bucket of `copies`: the envelope per minute, or one that never binds.
    pub fn tokens_per_minute(&self, copies: u32) -> u64 {
        match self.tokens_per_second_per_copy {
            Some(tps) => tps
                .saturating_mul(60)
                .saturating_mul(u64::from(copies))
                .min(UNLIMITED_TOKENS_PER_MINUTE),
            None => UNLIMITED_TOKENS_PER_MINUTE,
        }
    }

    /// `endpoint` or `endpoint/inference_component`, for messages.
    pub fn target(&self) -> String {
        match &self.inference_component {
            Some(ic) => format!("{}/{ic}", self.endpoint),
            None => self.endpoint.clone(),
        }
    }
}

/// Validates `[[endpoints]]`. `upstream` is `upstream.endpoint`: a simulated upstream serves
/// endpoints too, unless an entry says otherwise.
pub fn validate(
    raw: Vec<RawEndpoint>,
    default_region: &str,
    upstream: &Endpoint,
) -> Result<Vec<EndpointConfig>, ConfigError> {
    let mut out: Vec<EndpointConfig> = Vec::with_capacity(raw.len());
    for (i, entry) in raw.into_iter().enumerate() {
        let endpoint = validate_one(i, entry, default_region, upstream)?;
        let same = out.iter().find(|e| {
            e.endpoint == endpoint.endpoint
                && e.inference_component == endpoint.inference_component
                && e.region == endpoint.region
        });
        if let Some(other) = same {
            return Err(invalid(
                format!("endpoints[{i}] ({}).endpoint", endpoint.name),
                format!(
                    "{} in {} is already endpoint pool {:?}; give each endpoint (or inference component) one entry",
                    endpoint.target(),
                    endpoint.region,
                    other.name
                ),
            ));
        }
        out.push(endpoint);
    }
    Ok(out)
}

fn validate_one(
    i: usize,
    raw: RawEndpoint,
    default_region: &str,
    upstream: &Endpoint,
) -> Result<EndpointConfig, ConfigError> {
    let key = |field: &str| {
        if raw.name.is_empty() {
            format!("endpoints[{i}].{field}")
        } else {
            format!("endpoints[{i}] ({}).{field}", raw.name)
        }
    };
    let name_rule = "1 to 63 letters, digits and hyphens, starting and ending with a letter or digit, as SageMaker names it";
    if !pools::is_pool_name(&raw.name) {
        return Err(invalid(
            key("name"),
            "must be non-empty letters, digits, '-', '_' or '.'",
        ));
    }
    if !is_name(&raw.endpoint) {
        return Err(invalid(
            key("endpoint"),
            format!("{:?} is not an endpoint name: {name_rule}", raw.endpoint),
        ));
    }
    if let Some(ic) = raw.inference_component.as_deref().filter(|ic| !is_name(ic)) {
        return Err(invalid(
            key("inference_component"),
            format!("{ic:?} is not an inference component name: {name_rule}"),
        ));
    }
    if raw.max_concurrency_per_copy == 0 {
        return Err(invalid(
            key("max_concurrency_per_copy"),
            "must be greater than zero: the requests one copy of the model serves at once",
        ));
    }
    let refresh = match raw.refresh_secs {
        Some(0) => return Err(invalid(key("refresh_secs"), "must be greater than zero")),
        secs => secs.map(Duration::from_secs),
    };
    if raw.copies == 0 && refresh.is_none() {
        return Err(invalid(
            key("copies"),
            "is 0 and refresh_secs is not set, so nothing would ever be admitted: set the copies, \
             or refresh_secs to follow the control plane (an inference component scaled to zero)",
        ));
    }
    let default_max_tokens = envelope_default(&key, &raw)?;
    let (max_wait, max_queue) = pools::queue_settings(raw.max_wait_ms, raw.max_queue, &key)?;
    let region = match raw.region {
        Some(r) => upstream::region(&key("region"), r)?,
        None => default_region.to_string(),
    };
    let inherited = |url: Option<&str>, field: &str| match url {
        None if *upstream == Endpoint::Simulated => Ok(Endpoint::Simulated),
        url => upstream::parse_endpoint(&key(field), url),
    };
    Ok(EndpointConfig {
        runtime: inherited(raw.runtime_url.as_deref(), "runtime_url")?,
        control: inherited(raw.control_url.as_deref(), "control_url")?,
        name: raw.name,
        endpoint: raw.endpoint,
        inference_component: raw.inference_component,
        region,
        copies: raw.copies,
        max_concurrency_per_copy: raw.max_concurrency_per_copy,
        refresh,
        tokens_per_second_per_copy: raw.tokens_per_second_per_copy,
        default_max_tokens,
        max_wait,
        max_queue,
        shadow: raw.shadow.unwrap_or(false),
    })
}

/// `default_max_tokens`: required with a token envelope, meaningless without one.
fn envelope_default(key: &dyn Fn(&str) -> String, raw: &RawEndpoint) -> Result<u64, ConfigError> {
    match (raw.tokens_per_second_per_copy, raw.default_max_tokens) {
        (Some(0), _) => Err(invalid(
            key("tokens_per_second_per_copy"),
            "must be greater than zero: the generated tokens per second one copy sustains at its concurrency cap",
        )),
        (Some(_), None) => Err(invalid(
            key("default_max_tokens"),
            "a token envelope (tokens_per_second_per_copy) needs default_max_tokens: what a request that names no \
             max_tokens or parameters.max_new_tokens reserves",
        )),
        (Some(_), Some(0)) => Err(invalid(
            key("default_max_tokens"),
            "must be greater than zero",
        )),
        (Some(_), Some(n)) => Ok(n),
        (None, Some(_)) => Err(invalid(
            key("default_max_tokens"),
            "only a token envelope uses it: set tokens_per_second_per_copy, or remove default_max_tokens",
        )),
        (None, None) => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    const BASE: &str = r#"
[server]
listen = "127.0.0.1:8080"

[upstream]
region = "us-east-1"
endpoint = "simulated"

[[endpoints]]
name = "summarizer"
endpoint = "llm-prod"
inference_component = "ic-llama"
copies = 2
max_concurrency_per_copy = 4
"#;

    fn parse(extra: &str) -> Result<Config, ConfigError> {
        Config::parse(&format!("{BASE}{extra}"))
    }

    #[test]
    fn an_endpoint_is_a_pool_bound_by_concurrency() {
        let config = parse("refresh_secs = 30\n").unwrap();
        let e = &config.policy.endpoints[0];
        assert_eq!(e.region, "us-east-1");
        assert_eq!(
            e.runtime,
            Endpoint::Simulated,
            "inherits a simulated upstream"
        );
        assert_eq!(e.refresh, Some(Duration::from_secs(30)));
        let pool = e.pool();
        assert_eq!(pool.max_concurrency, 8);
        assert_eq!(pool.tokens_per_minute, UNLIMITED_TOKENS_PER_MINUTE);
        assert_eq!(pool.models, ["summarizer"]);
        assert_eq!(config.policy.admission_pools().len(), 1);
        assert!(config.policy.pools.is_empty());

        let config = parse("tokens_per_second_per_copy = 50\ndefault_max_tokens = 512\n").unwrap();
        let pool = config.policy.endpoints[0].pool();
        assert_eq!(
            pool.tokens_per_minute,
            50 * 60 * 2,
            "the envelope of two copies"
        );
        assert_eq!(pool.default_max_tokens, 512);
        assert_eq!(config.policy.endpoints[0].tokens_per_minute(0), 0);
    }

    #[test]
    fn an_aws_upstream_sends_endpoints_to_aws_unless_told_otherwise() {
        let text = BASE.replace("endpoint = \"simulated\"\n", "");
        let config = Config::parse(&text).unwrap();
        assert_eq!(config.policy.endpoints[0].runtime, Endpoint::Aws);
        let config = Config::parse(&format!(
            "{text}runtime_url = \"http://127.0.0.1:9000\"\ncontrol_url = \"simulated\"\n"
        ))
        .unwrap();
        assert!(matches!(
            config.policy.endpoints[0].runtime,
            Endpoint::Url(_)
        ));
        assert_eq!(config.policy.endpoints[0].control, Endpoint::Simulated);
    }

    #[test]
    fn each_invalid_setting_names_its_key() {
        let cases = [
            (
                BASE.replace("copies = 2", "copies = 0"),
                "endpoints[0] (summarizer).copies: is 0 and refresh_secs is not set",
            ),
            (
                BASE.replace(
                    "max_concurrency_per_copy = 4",
                    "max_concurrency_per_copy = 0",
                ),
                "endpoints[0] (summarizer).max_concurrency_per_copy: must be greater than zero",
            ),
            (
                BASE.replace("\"llm-prod\"", "\"llm_prod\""),
                "endpoints[0] (summarizer).endpoint: \"llm_prod\" is not an endpoint name",
            ),
            (
                BASE.replace("\"ic-llama\"", "\"ic-\""),
                "endpoints[0] (summarizer).inference_component: \"ic-\" is not an inference component name",
            ),
            (
                format!("{BASE}tokens_per_second_per_copy = 50\n"),
                "endpoints[0] (summarizer).default_max_tokens: a token envelope",
            ),
            (
                format!("{BASE}default_max_tokens = 50\n"),
                "endpoints[0] (summarizer).default_max_tokens: only a token envelope uses it",
            ),
            (
                format!("{BASE}refresh_secs = 0\n"),
                "endpoints[0] (summarizer).refresh_secs: must be greater than zero",
            ),
            (
                format!("{BASE}max_wait_ms = 60000\n"),
                "endpoints[0] (summarizer).max_wait_ms: 60000 is longer than",
            ),
            (
                format!("{BASE}region = \"US\"\n"),
                "endpoints[0] (summarizer).region: \"US\" is not a Region name",
            ),
            (
                format!("{BASE}runtime_url = \"ftp://x\"\n"),
                "endpoints[0] (summarizer).runtime_url: \"ftp://x\"",
            ),
            (
                format!("{BASE}colour = \"blue\"\n"),
                "unknown field `colour`",
            ),
            (
                format!(
                    "{BASE}\n[[endpoints]]\nname = \"again\"\nendpoint = \"llm-prod\"\ninference_component = \"ic-llama\"\ncopies = 1\nmax_concurrency_per_copy = 1\n"
                ),
                "endpoints[1] (again).endpoint: llm-prod/ic-llama in us-east-1 is already endpoint pool \"summarizer\"",
            ),
            (
                format!(
                    "{BASE}\n[[pools]]\nname = \"summarizer\"\nmodels = [\"m\"]\ntokens_per_minute = 1000\nmax_concurrency = 1\noutput_burndown = 1\nmax_output_tokens = 10\ndefault_max_tokens = 10\n"
                ),
                "endpoints[0].name: \"summarizer\" names two pools",
            ),
            (
                format!(
                    "{BASE}\n[[routes]]\nname = \"app\"\n[routes.shares]\nsummarizer = {{ min = 0.5 }}\n"
                ),
                "routes[0] (app).shares.summarizer: shares divide a pool's tokens, and endpoint pool \"summarizer\" has no token envelope",
            ),
        ];
        for (text, expected) in cases {
            let error = Config::parse(&text).expect_err(expected).to_string();
            assert!(error.contains(expected), "{error}\n  expected: {expected}");
        }
    }

    #[test]
    fn routes_name_endpoint_pools_in_allow_lists_and_shares() {
        let config = parse(
            "tokens_per_second_per_copy = 50\ndefault_max_tokens = 512\n\n[[routes]]\nname = \"app\"\nmodels = [\"summarizer\"]\n[routes.shares]\nsummarizer = { min = 0.5 }\n",
        )
        .unwrap();
        assert_eq!(config.policy.routes[0].shares["summarizer"].min, 0.5);
    }
}
