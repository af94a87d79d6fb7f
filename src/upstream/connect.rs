//! Making upstream connections: the TCP and TLS connector (what ALPN offers), and hyper's pooled
//! client over it. A connect that fails or passes `upstream.connect_timeout_secs` fails the call
//! that asked for it.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use super::{Connector, UpstreamError};

/// How long an upstream connection with nothing in flight stays open.
pub(super) const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The protocols a connector offers over TLS (ALPN), and speaks over plain http.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Alpn {
    /// `h2` then `http/1.1` over TLS; HTTP/1.1 over plain http.
    Both,
    H1,
    /// `h2` only; prior knowledge over plain http.
    H2,
}

/// The TCP (and TLS) connector: `connect_timeout`, no Nagle, TCP keep-alive, webpki roots.
pub(super) fn connector(
    alpn: Alpn,
    connect_timeout: Duration,
    shown: &str,
) -> Result<Connector, UpstreamError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(provider)
        .map_err(|e| UpstreamError::Connect(shown.to_string(), e.to_string()))?
        .https_or_http();
    Ok(match alpn {
        Alpn::Both => https.enable_http1().enable_http2().wrap_connector(http),
        Alpn::H1 => https.enable_http1().wrap_connector(http),
        Alpn::H2 => https.enable_http2().wrap_connector(http),
    })
}

/// hyper's pooled client over `connector`.
pub(super) fn legacy_client(connector: Connector) -> Client<Connector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(1024)
        .build(connector)
}

/// A copy of `request` to send again if upstream did not process it.
pub(super) fn replay(request: &Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    let mut copy = Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.headers_mut() = request.headers().clone();
    copy
}
