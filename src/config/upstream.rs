//! `[upstream]`: where requests go (AWS, the built-in simulator, or a base URL) and how long to
//! wait for it.

use std::time::Duration;

use http::Uri;
use serde::Deserialize;

use super::{ConfigError, invalid, positive};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub region: String,
    pub endpoint: Option<String>,
    pub connect_timeout_secs: Option<u64>,
    pub response_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
}

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
}

pub(super) fn validate(raw: RawUpstream) -> Result<UpstreamConfig, ConfigError> {
    let region = region("upstream.region", raw.region)?;
    let endpoint = parse_endpoint("upstream.endpoint", raw.endpoint.as_deref())?;
    Ok(UpstreamConfig {
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

/// `url` with any userinfo (`user:password@`) replaced by `***`, for messages and logs.
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
