//! `[auth]`: how callers identify themselves, and the route of a caller who does not.

use std::fmt;

use serde::Deserialize;

use super::{ConfigError, PoolConfig, RouteConfig, ServerConfig, UpstreamConfig, invalid};

const DEFAULT_ROUTE: &str = "default";

/// A secret from the config file or the environment; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    pub mode: Option<AuthMode>,
    pub default_route: Option<String>,
    pub allow_plaintext_bearer: Option<bool>,
}

/// How callers identify themselves (`auth.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// No identification: every request is the default route (a loopback sidecar).
    None,
    /// `Authorization: Bearer <key>`, the key's SHA-256 configured per route.
    Bearer,
    /// The SDK's own SigV4 signature, with a key pair issued per route.
    SigV4,
}

impl AuthMode {
    pub fn label(self) -> &'static str {
        match self {
            AuthMode::None => "none",
            AuthMode::Bearer => "bearer",
            AuthMode::SigV4 => "sigv4",
        }
    }
}

#[derive(Debug, Clone)]
pub struct AuthConfig {
    pub mode: AuthMode,
    /// The route of every request in mode `none`.
    pub default_route: String,
    /// The Regions this proxy serves (`upstream.region` and every pool's): a SigV4 credential
    /// scope must name one of them.
    pub regions: Vec<String>,
}

/// The route of every request in mode `none`: `auth.default_route`, the only route, or the
/// implicit `default` route of a config without `[[routes]]`.
pub(super) fn default_route(
    mode: AuthMode,
    named: Option<String>,
    routes: &[RouteConfig],
) -> Result<String, ConfigError> {
    match (mode, named, routes.len()) {
        (AuthMode::None, Some(name), _) => {
            if !routes.is_empty() && !routes.iter().any(|r| r.name == name) {
                return Err(invalid(
                    "auth.default_route",
                    format!("{name:?} is not the name of a [[routes]] entry"),
                ));
            }
            Ok(name)
        }
        (AuthMode::None, None, 0) => Ok(DEFAULT_ROUTE.to_string()),
        (AuthMode::None, None, 1) => Ok(routes[0].name.clone()),
        (AuthMode::None, None, _) => Err(invalid(
            "auth.default_route",
            "with auth.mode = \"none\" and several routes, name the route every request belongs to",
        )),
        (_, Some(_), _) => Err(invalid(
            "auth.default_route",
            "only applies to auth.mode = \"none\"; with keys, each key names its route",
        )),
        (_, None, 0) => Err(invalid(
            "routes",
            format!(
                "auth.mode = {:?} needs at least one [[routes]] entry with credentials",
                mode.label()
            ),
        )),
        (_, None, _) => Ok(String::new()),
    }
}

/// The Regions this proxy serves: `upstream.region`, then each pool's, once each.
pub(super) fn served_regions(upstream: &UpstreamConfig, pools: &[PoolConfig]) -> Vec<String> {
    let mut regions = vec![upstream.region.clone()];
    for pool in pools {
        if !regions.contains(&pool.region) {
            regions.push(pool.region.clone());
        }
    }
    regions
}

/// Bearer keys travel in the clear only to a loopback listener, and only when asked for.
pub(super) fn check_plaintext_bearer(
    mode: AuthMode,
    allowed: bool,
    server: &ServerConfig,
) -> Result<(), ConfigError> {
    if allowed && !server.listen.ip().is_loopback() {
        return Err(invalid(
            "auth.allow_plaintext_bearer",
            format!(
                "server.listen is {}, not a loopback address: bearer keys would cross the network in the clear; \
                 remove this key and set server.tls_cert and server.tls_key",
                server.listen
            ),
        ));
    }
    if mode == AuthMode::Bearer && server.tls.is_none() && !allowed {
        return Err(invalid(
            "auth.mode",
            "\"bearer\" sends keys in the clear without TLS (and boto3 refuses bearer auth over plain HTTP): \
             set server.tls_cert and server.tls_key, or auth.allow_plaintext_bearer = true for a loopback-only listener",
        ));
    }
    Ok(())
}
