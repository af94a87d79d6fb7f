//! `[upstream]`: where requests go (AWS, the built-in simulator, or a base URL), how long to
//! wait for it, and the proxy's own upstream credential.
//!
//! The proxy signs upstream requests with SigV4 (service `bedrock`), with the AWS credentials of
//! the default chain. With `api_key_env`, it sends the Bedrock API key held in that environment
//! variable as `Authorization: Bearer` instead, on every operation that accepts one: all but
//! InvokeModelWithBidirectionalStream, which takes SigV4 only (V, BEDROCK-APIS.md), and stays
//! signed with the default chain's credentials ([`notes`] says so when a pool serves such a
//! model). A short-term key is valid in one Region only: `api_key_env_by_region` names each
//! Region's own key, which that Region's calls carry in place of `api_key_env`'s ([`notes`]
//! names the Regions that would get `api_key_env`'s key).

use std::{collections::BTreeMap, time::Duration};

use http::Uri;
use serde::Deserialize;

use super::{ConfigError, Env, PoolConfig, Secret, invalid, positive};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub region: String,
    pub endpoint: Option<String>,
    pub connect_timeout_secs: Option<u64>,
    pub response_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
    /// The name of an environment variable holding a Bedrock API key for upstream requests.
    pub api_key_env: Option<String>,
    /// Per Region, the name of an environment variable holding that Region's Bedrock API key (a
    /// short-term key is valid in the one Region it was made for).
    pub api_key_env_by_region: Option<BTreeMap<String, String>>,
    /// `"auto"`, `"http1"` or `"http2"`.
    pub http: Option<String>,
    pub h2_streams_per_connection: Option<u64>,
}

/// Which HTTP version goes upstream (`upstream.http`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamHttp {
    /// Over TLS, ALPN with `h2` preferred (HTTP/1.1 if the server picks it); over plain http,
    /// HTTP/1.1.
    #[default]
    Auto,
    /// HTTP/1.1 only.
    Http1,
    /// HTTP/2 only: ALPN `h2` over TLS, prior knowledge (h2c) over plain http.
    Http2,
}

/// RFC 9113 (6.5.2) recommends that servers allow at least 100 concurrent streams.
pub const DEFAULT_H2_STREAMS_PER_CONNECTION: u32 = 100;

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `https://bedrock-runtime.{region}.amazonaws.com`
    Aws,
    /// The built-in simulator, started in the same process.
    Simulated,
    /// An explicit base URL (`http://127.0.0.1:9000`, a VPC endpoint, ...).
    Url(Uri),
}

#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamConfig {
    pub region: String,
    pub endpoint: Endpoint,
    pub connect_timeout: Duration,
    /// Longest wait for the response head. Non-streaming generations answer only when done.
    pub response_timeout: Duration,
    /// Longest silence between two body chunks of a response.
    pub idle_timeout: Duration,
    /// A Bedrock API key (`upstream.api_key_env`), sent as `Authorization: Bearer` by every
    /// operation that accepts one, in every Region without a key of its own; `None`: SigV4 there.
    pub api_key: Option<UpstreamApiKey>,
    /// The Regions' own keys (`upstream.api_key_env_by_region`), in place of `api_key` there.
    pub region_api_keys: BTreeMap<String, UpstreamApiKey>,
    /// The HTTP version upstream (`upstream.http`).
    pub http: UpstreamHttp,
    /// Streams one upstream HTTP/2 connection carries at most before another is opened
    /// (`upstream.h2_streams_per_connection`; fewer if the server allows fewer).
    pub h2_streams_per_connection: u32,
}

/// The upstream Bedrock API key and the variable it came from (for messages; the key itself is
/// never printed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamApiKey {
    pub env: String,
    pub key: Secret,
}

pub(super) fn validate(raw: RawUpstream, env: &Env) -> Result<UpstreamConfig, ConfigError> {
    let region = region("upstream.region", raw.region)?;
    let endpoint = parse_endpoint("upstream.endpoint", raw.endpoint.as_deref())?;
    Ok(UpstreamConfig {
        http: http_version(raw.http.as_deref())?,
        h2_streams_per_connection: h2_streams_per_connection(raw.h2_streams_per_connection)?,
        api_key: api_key("upstream.api_key_env", raw.api_key_env.as_deref(), env)?,
        region_api_keys: region_api_keys(raw.api_key_env_by_region.unwrap_or_default(), env)?,
        region,
        endpoint,
        connect_timeout: Duration::from_secs(positive(
            "upstream.connect_timeout_secs",
            raw.connect_timeout_secs.unwrap_or(5),
        )?),
        response_timeout: Duration::from_secs(positive(
            "upstream.response_timeout_secs",
            raw.response_timeout_secs.unwrap_or(3600),
        )?),
        idle_timeout: Duration::from_secs(positive(
            "upstream.idle_timeout_secs",
            raw.idle_timeout_secs.unwrap_or(300),
        )?),
    })
}

/// `upstream.http`: absent is `"auto"`.
fn http_version(value: Option<&str>) -> Result<UpstreamHttp, ConfigError> {
    match value {
        None | Some("auto") => Ok(UpstreamHttp::Auto),
        Some("http1") => Ok(UpstreamHttp::Http1),
        Some("http2") => Ok(UpstreamHttp::Http2),
        Some(other) => Err(invalid(
            "upstream.http",
            format!(
                "{other:?}: write \"auto\" (HTTP/2 where TLS negotiates it, else HTTP/1.1), \"http1\" \
                 or \"http2\" (HTTP/2 only; prior knowledge over plain http)"
            ),
        )),
    }
}

/// `upstream.h2_streams_per_connection`: positive, and a valid HTTP/2 stream count (31 bits).
fn h2_streams_per_connection(value: Option<u64>) -> Result<u32, ConfigError> {
    let key = "upstream.h2_streams_per_connection";
    let value = positive(
        key,
        value.unwrap_or(DEFAULT_H2_STREAMS_PER_CONNECTION.into()),
    )?;
    u32::try_from(value)
        .ok()
        .filter(|v| *v <= i32::MAX as u32)
        .ok_or_else(|| invalid(key, "must be at most 2147483647"))
}

/// `region` if it looks like a Region name.
pub(super) fn region(key: &str, region: String) -> Result<String, ConfigError> {
    let ok = !region.is_empty()
        && region
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(region)
    } else {
        Err(invalid(
            key,
            format!("{region:?} is not a Region name like \"us-east-1\""),
        ))
    }
}

/// A base URL: absent for AWS, `"simulated"`, or a URL without a path or credentials.
pub(super) fn parse_endpoint(key: &str, value: Option<&str>) -> Result<Endpoint, ConfigError> {
    let Some(url) = value else {
        return Ok(Endpoint::Aws);
    };
    if url == "simulated" {
        return Ok(Endpoint::Simulated);
    }
    // Never echo what may be a password.
    let shown = redact_userinfo(url);
    let uri: Uri = url
        .parse()
        .map_err(|_| invalid(key, format!("{shown:?} is not a URL")))?;
    match (uri.scheme_str(), uri.authority()) {
        (_, Some(authority)) if authority.as_str().contains('@') => Err(invalid(
            key,
            format!(
                "{shown:?} carries credentials (user:password@): tokengate signs upstream requests \
                 with its own AWS credentials (SigV4) and never sends these; write the URL without them"
            ),
        )),
        (Some("http" | "https"), Some(_)) if uri.path() == "/" || uri.path().is_empty() => {
            Ok(Endpoint::Url(uri))
        }
        _ => Err(invalid(
            key,
            format!(
                "{shown:?}: write \"simulated\" or a base URL such as \"http://127.0.0.1:9000\" (no path)"
            ),
        )),
    }
}

/// The API key in the environment variable `name`, if one is named (at config key `key`).
fn api_key(
    key: &str,
    name: Option<&str>,
    env: &Env,
) -> Result<Option<UpstreamApiKey>, ConfigError> {
    let Some(name) = name else { return Ok(None) };
    if name.is_empty() {
        return Err(invalid(
            key,
            "name the environment variable that holds the Bedrock API key (e.g. \"AWS_BEARER_TOKEN_BEDROCK\")",
        ));
    }
    let value = env(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());
    let value = value.ok_or_else(|| {
        invalid(
            key,
            format!(
                "the environment variable {name} is not set (or is empty); set it to a Bedrock API key, \
                 or remove {key} to sign with SigV4"
            ),
        )
    })?;
    if value.chars().any(|c| c.is_ascii_control()) {
        return Err(invalid(
            key,
            format!("the value of {name} holds control characters; it cannot be sent as a header"),
        ));
    }
    let key = value;
    Ok(Some(UpstreamApiKey {
        env: name.to_string(),
        key: Secret(key),
    }))
}

/// `upstream.api_key_env_by_region`: each Region's key, from the variable it names.
fn region_api_keys(
    raw: BTreeMap<String, String>,
    env: &Env,
) -> Result<BTreeMap<String, UpstreamApiKey>, ConfigError> {
    raw.into_iter()
        .map(|(region_name, name)| {
            let at = format!("upstream.api_key_env_by_region.{region_name}");
            let region_name = region(&at, region_name)?;
            let key = api_key(&at, Some(&name), env)?.ok_or_else(|| invalid(&at, "no key"))?;
            Ok((region_name, key))
        })
        .collect()
}

impl UpstreamConfig {
    /// The API key calls to `region` carry, if any.
    pub fn api_key_for(&self, region: &str) -> Option<&UpstreamApiKey> {
        self.region_api_keys.get(region).or(self.api_key.as_ref())
    }
}

/// What `check-config` says about a valid config's upstream credentials: with an API key,
/// InvokeModelWithBidirectionalStream (SigV4 only) still needs the default chain's credentials
/// for every pool whose models serve it (Nova Sonic: an id naming `sonic`); and the default key
/// goes to every Region without a key of its own, where a short-term key is refused.
pub fn notes(upstream: &UpstreamConfig, pools: &[PoolConfig]) -> Vec<String> {
    let sonic = pools
        .iter()
        .flat_map(|pool| pool.models.iter().map(move |m| (pool, m)))
        .filter(|(_, model)| model.contains("sonic"))
        .filter_map(|(pool, model)| {
            let key = upstream.api_key_for(&pool.region)?;
            Some(format!(
                "{} ({}): pool {:?} lists {model:?}, whose InvokeModelWithBidirectionalStream \
                 accepts only SigV4: those calls are signed with the AWS credentials of the default chain, and \
                 fail without them",
                key_setting(upstream, &pool.region),
                key.env,
                pool.name
            ))
        });
    let elsewhere = upstream.api_key.iter().flat_map(|key| {
        let mut regions: Vec<&str> = pools
            .iter()
            .map(|p| p.region.as_str())
            .filter(|r| *r != upstream.region && !upstream.region_api_keys.contains_key(*r))
            .collect();
        regions.sort_unstable();
        regions.dedup();
        regions.into_iter().map(move |region| {
            format!(
                "upstream.api_key_env ({}): pools in {region} send this key too; a short-term Bedrock API key \
                 is valid only in the Region it was made for, so if it is one, name a key for {region} in \
                 upstream.api_key_env_by_region",
                key.env
            )
        })
    });
    sonic.chain(elsewhere).collect()
}

/// The setting a Region's key came from, for messages.
fn key_setting(upstream: &UpstreamConfig, region: &str) -> String {
    if upstream.region_api_keys.contains_key(region) {
        format!("upstream.api_key_env_by_region.{region}")
    } else {
        "upstream.api_key_env".into()
    }
}

/// `url` with any userinfo (`user:password@`) replaced by `***@`, for messages and logs. Errs on
/// the side of hiding: everything from the scheme to the last `@` goes (a password may itself
/// hold `/`, `?` or `#`).
pub fn redact_userinfo(url: &str) -> std::borrow::Cow<'_, str> {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].rfind('@') {
        Some(at) => format!(
            "{}***@{}",
            &url[..after_scheme],
            &url[after_scheme + at + 1..]
        )
        .into(),
        None => url.into(),
    }
}
