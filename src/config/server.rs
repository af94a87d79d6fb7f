//! The `[server]` section: the listener, its limits and its timeouts, validated.
//!
//! What each limit does at the wire is in `crate::server` (connections, timeouts, HTTP/2) and
//! `crate::body_budget` (buffered request bodies); SECURITY.md lists them with their defaults.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use serde::Deserialize;

use super::{ConfigError, invalid, positive};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: String,
    pub admin_listen: Option<String>,
    pub tls_cert: Option<String>,
    pub tls_key: Option<String>,
    pub max_body_bytes: Option<u64>,
    pub drain_secs: Option<u64>,
    pub accept_grace_secs: Option<u64>,
    pub header_read_timeout_secs: Option<u64>,
    pub body_read_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
    pub max_connections: Option<u64>,
    pub max_buffered_body_bytes: Option<u64>,
    pub h2_max_concurrent_streams: Option<u64>,
    pub h2_keep_alive_interval_secs: Option<u64>,
    pub h2_keep_alive_timeout_secs: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// A second, plain-HTTP listener serving only the admin endpoints (health, readiness,
    /// metrics, `/v1/pools`), so that the proxy itself can stay on loopback.
    pub admin_listen: Option<SocketAddr>,
    pub tls: Option<TlsFiles>,
    /// Largest request body accepted (413-free: answered as a `ValidationException`).
    pub max_body_bytes: usize,
    /// Request-body bytes all requests together may hold in memory at once; past it, a request
    /// gets a retryable 503 at once.
    pub max_buffered_body_bytes: usize,
    /// How long shutdown waits for in-flight requests and streams.
    pub drain: Duration,
    /// On shutdown, how long the listener keeps accepting while `/readyz` answers 503.
    pub accept_grace: Duration,
    /// How long a connection may take to send its first request, and an HTTP/1.1 request head
    /// from its first byte.
    pub header_read_timeout: Duration,
    /// How long a request body may take to arrive, whole.
    pub body_read_timeout: Duration,
    /// How long a connection may stay open with no request in flight (both protocols).
    pub idle_timeout: Duration,
    /// Open connections on the proxy listener; past it, idle ones are closed to make room.
    pub max_connections: usize,
    /// Concurrent streams one HTTP/2 connection may open.
    pub h2_max_concurrent_streams: u32,
    /// How often an HTTP/2 connection that has sent nothing is pinged.
    pub h2_keep_alive_interval: Duration,
    /// How long a ping may go unanswered before its connection is closed.
    pub h2_keep_alive_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

const DEFAULT_MAX_BODY: u64 = 26 * 1024 * 1024;
const DEFAULT_MAX_BUFFERED_BODY: u64 = 256 * 1024 * 1024;
const DEFAULT_HEADER_READ_TIMEOUT_SECS: u64 = 30;
const DEFAULT_BODY_READ_TIMEOUT_SECS: u64 = 60;
const DEFAULT_IDLE_TIMEOUT_SECS: u64 = 60;
/// Room for the 2,000 open streams a 128 MiB sidecar holds (see README, Sizing), with idle pooled
/// connections beside them; idle connections at the cap cost tens of MiB (see SECURITY.md).
const DEFAULT_MAX_CONNECTIONS: u64 = 4096;
/// The value most HTTP/2 servers advertise (RFC 9113 recommends at least 100).
const DEFAULT_H2_MAX_CONCURRENT_STREAMS: u64 = 100;
const DEFAULT_H2_KEEP_ALIVE_INTERVAL_SECS: u64 = 30;
const DEFAULT_H2_KEEP_ALIVE_TIMEOUT_SECS: u64 = 20;

/// Validates `[server]`; every error names its key.
pub(super) fn validate(raw: RawServer) -> Result<ServerConfig, ConfigError> {
    let secs = |key: &str, value: Option<u64>, default: u64| {
        positive(key, value.unwrap_or(default)).map(Duration::from_secs)
    };
    let (max_body_bytes, max_buffered_body_bytes) = body_limits(&raw)?;
    Ok(ServerConfig {
        listen: address("server.listen", &raw.listen, "127.0.0.1:8080")?,
        admin_listen: raw
            .admin_listen
            .as_deref()
            .map(|a| address("server.admin_listen", a, "0.0.0.0:9090"))
            .transpose()?,
        tls: tls_files(raw.tls_cert, raw.tls_key)?,
        max_body_bytes,
        max_buffered_body_bytes,
        drain: Duration::from_secs(raw.drain_secs.unwrap_or(30)),
        accept_grace: Duration::from_secs(raw.accept_grace_secs.unwrap_or(0)),
        header_read_timeout: secs(
            "server.header_read_timeout_secs",
            raw.header_read_timeout_secs,
            DEFAULT_HEADER_READ_TIMEOUT_SECS,
        )?,
        body_read_timeout: secs(
            "server.body_read_timeout_secs",
            raw.body_read_timeout_secs,
            DEFAULT_BODY_READ_TIMEOUT_SECS,
        )?,
        idle_timeout: secs(
            "server.idle_timeout_secs",
            raw.idle_timeout_secs,
            DEFAULT_IDLE_TIMEOUT_SECS,
        )?,
        max_connections: positive(
            "server.max_connections",
            raw.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
        )? as usize,
        h2_max_concurrent_streams: h2_streams(raw.h2_max_concurrent_streams)?,
        h2_keep_alive_interval: secs(
            "server.h2_keep_alive_interval_secs",
            raw.h2_keep_alive_interval_secs,
            DEFAULT_H2_KEEP_ALIVE_INTERVAL_SECS,
        )?,
        h2_keep_alive_timeout: secs(
            "server.h2_keep_alive_timeout_secs",
            raw.h2_keep_alive_timeout_secs,
            DEFAULT_H2_KEEP_ALIVE_TIMEOUT_SECS,
        )?,
    })
}

fn address(key: &str, text: &str, example: &str) -> Result<SocketAddr, ConfigError> {
    text.parse().map_err(|_| {
        invalid(
            key,
            format!("{text:?} is not an address; write \"{example}\""),
        )
    })
}

fn tls_files(cert: Option<String>, key: Option<String>) -> Result<Option<TlsFiles>, ConfigError> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(TlsFiles {
            cert: cert.into(),
            key: key.into(),
        })),
        (None, None) => Ok(None),
        _ => Err(invalid(
            "server.tls_cert",
            "tls_cert and tls_key go together; set both or neither",
        )),
    }
}

/// `max_body_bytes` and `max_buffered_body_bytes`: the budget must hold the largest body.
fn body_limits(raw: &RawServer) -> Result<(usize, usize), ConfigError> {
    let max_body = positive(
        "server.max_body_bytes",
        raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY),
    )?;
    let max_buffered = positive(
        "server.max_buffered_body_bytes",
        raw.max_buffered_body_bytes
            .unwrap_or(DEFAULT_MAX_BUFFERED_BODY),
    )?;
    if max_buffered < max_body {
        return Err(invalid(
            "server.max_buffered_body_bytes",
            format!(
                "{max_buffered} is less than server.max_body_bytes ({max_body}): a body of the largest \
                 allowed size could never be read; raise it (a few times max_body_bytes) or lower max_body_bytes"
            ),
        ));
    }
    Ok((max_body as usize, max_buffered as usize))
}

/// `h2_max_concurrent_streams`: positive, and a valid HTTP/2 setting (31 bits).
fn h2_streams(value: Option<u64>) -> Result<u32, ConfigError> {
    let key = "server.h2_max_concurrent_streams";
    let streams = positive(key, value.unwrap_or(DEFAULT_H2_MAX_CONCURRENT_STREAMS))?;
    u32::try_from(streams)
        .ok()
        .filter(|n| *n <= i32::MAX as u32)
        .ok_or_else(|| {
            invalid(
                key,
                "must be at most 2147483647; 100 suits almost every client",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    const BASE: &str = "[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n";

    fn server(lines: &str) -> Result<ServerConfig, ConfigError> {
        let text = format!("[server]\nlisten = \"127.0.0.1:8080\"\n{lines}\n{BASE}");
        Config::parse(&text).map(|c| c.process.server)
    }

    #[test]
    fn listener_limits_have_defaults() {
        let s = server("").expect("defaults");
        assert_eq!(s.max_buffered_body_bytes, 256 * 1024 * 1024);
        assert_eq!(s.max_connections, 4096);
        assert_eq!(s.h2_max_concurrent_streams, 100);
        assert_eq!(s.idle_timeout, Duration::from_secs(60));
        assert_eq!(s.h2_keep_alive_interval, Duration::from_secs(30));
        assert_eq!(s.h2_keep_alive_timeout, Duration::from_secs(20));
    }

    #[test]
    fn each_bad_listener_limit_names_its_key() {
        let cases = [
            (
                "max_connections = 0",
                "server.max_connections: must be greater than zero",
            ),
            (
                "idle_timeout_secs = 0",
                "server.idle_timeout_secs: must be greater than zero",
            ),
            (
                "h2_max_concurrent_streams = 0",
                "server.h2_max_concurrent_streams: must be greater than zero",
            ),
            (
                "h2_max_concurrent_streams = 4294967296",
                "server.h2_max_concurrent_streams: must be at most 2147483647",
            ),
            (
                "h2_keep_alive_interval_secs = 0",
                "server.h2_keep_alive_interval_secs: must be greater than zero",
            ),
            (
                "h2_keep_alive_timeout_secs = 0",
                "server.h2_keep_alive_timeout_secs: must be greater than zero",
            ),
            (
                "max_buffered_body_bytes = 0",
                "server.max_buffered_body_bytes: must be greater than zero",
            ),
            (
                "max_body_bytes = 2000\nmax_buffered_body_bytes = 1000",
                "server.max_buffered_body_bytes: 1000 is less than server.max_body_bytes (2000)",
            ),
        ];
        for (lines, expected) in cases {
            let error = server(lines).expect_err(lines).to_string();
            assert!(error.starts_with(expected), "{lines}: {error}");
        }
    }
}
