// Over 500 lines with its tests: the client, its endpoints and request building are one piece.
//! The transport to `bedrock-runtime`: header hygiene ([`headers`]), SigV4 re-signing
//! ([`signer`]) and the connections. It knows nothing of quotas: the pipeline meters what comes
//! back ([`crate::proxy::meter`]).
//!
//! Each request is authorized with the proxy's own credential ([`Upstream::authorize`]): SigV4
//! from the default chain, or, with `upstream.api_key_env`, the Bedrock API key as
//! `Authorization: Bearer` on every operation that accepts one (all but
//! InvokeModelWithBidirectionalStream, which stays SigV4). The caller's own credentials never
//! get here ([`headers`] forwards none).
//!
//! The request body is forwarded byte for byte (never re-serialised, so fields this proxy does not
//! know pass through untouched); the raw, percent-encoded path is forwarded unchanged and signed
//! as it is sent (no normalisation: the path signed is the path admitted). Response bodies stream
//! through frame by frame; nothing buffers a whole response.
//!
//! Every request is sent for a Region (its pool's, [`crate::config::PoolConfig::region`]): signed
//! for it (the SigV4 credential scope) and, with the AWS endpoint, sent to that Region's
//! `https://bedrock-runtime.{region}.amazonaws.com`. With an explicit endpoint URL (a VPC
//! endpoint, the simulator) every Region goes to that URL, and the signature's scope says which
//! Region is meant.
//!
//! # Connections (`upstream.http`)
//! HTTP/2 goes over [`h2_connections`]: several connections per host, each carrying at most
//! `upstream.h2_streams_per_connection` streams (fewer if the server says so), another opened
//! when all are full, so no call waits inside the client for a stream. `"auto"` (the default)
//! uses it for https hosts whose TLS picks `h2` (AWS does) and hyper's pooled client for the
//! rest (HTTP/1.1: plain http, or a server that picks `http/1.1`); `"http2"` uses it for every
//! host (prior knowledge over plain http); `"http1"` never. A call that gets no response head
//! within `response_timeout` (connecting included) or by the drain deadline fails with
//! [`UpstreamError`]; a response body that ends early is the pipeline's to settle.
//!
//! InvokeModelWithBidirectionalStream goes over a connection set of its own that speaks only
//! HTTP/2 (ALPN `h2` over TLS, prior knowledge over plain HTTP), because both directions stream
//! at once
//! ([`Upstream::open_duplex`]): its request body is handed over as a stream of frames, each
//! signed on its way ([`signer::EventSigner`]), while the response streams back. Errors never
//! show the upstream URL's userinfo (config refuses it; [`redact_userinfo`] guards the messages anyway).

pub mod body;
mod connect;
pub mod h2_connections;
#[cfg(test)]
mod h2_connections_tests;
pub mod headers;
mod pass_writes;
pub mod sagemaker;
pub mod sign;
pub mod signer;

use std::{
    collections::HashMap,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use dashmap::DashMap;
use http::{
    HeaderMap, HeaderValue, Method, Request, Response, Uri, header,
    uri::{Authority, Scheme},
};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use tokio_util::sync::CancellationToken;

pub use body::PooledBody;
pub use h2_connections::HostView;
pub use signer::{EventSigner, SAGEMAKER_SIGNING_NAME, Signer};

use connect::{Alpn, POOL_IDLE_TIMEOUT, connector, legacy_client, replay};
use h2_connections::{ConnectionSet, Sent};

/// The request body of a duplex call: frames as they come.
pub type DuplexBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Connector = HttpsConnector<HttpConnector>;

use crate::{
    bedrock::Operation,
    config::{UpstreamHttp, upstream::DEFAULT_H2_STREAMS_PER_CONNECTION},
};

/// Why a request got no response from upstream.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("no AWS credentials for signing upstream requests: {0}")]
    Credentials(String),
    #[error("could not sign the upstream request: {0}")]
    Signing(String),
    #[error("upstream {0} could not be reached: {1}")]
    Connect(String, String),
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
    #[error("tokengate is shutting down and upstream did not answer within the drain deadline")]
    ShuttingDown,
}

impl UpstreamError {
    /// The `kind` label of `tokengate_upstream_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Credentials(_) => "credentials",
            UpstreamError::Signing(_) => "signing",
            UpstreamError::Connect(..) => "connect",
            UpstreamError::Timeout(_) => "timeout",
            UpstreamError::ShuttingDown => "shutdown",
        }
    }
}

/// The one redaction of a URL's userinfo, shared with the config's messages.
pub use crate::config::upstream::redact_userinfo;

/// The pooled, signing client for one upstream.
#[derive(Debug)]
pub struct Upstream {
    /// hyper's pooled client: HTTP/1.1 (and, over TLS with `upstream.http = "auto"`, a host
    /// whose ALPN picks it).
    client: Client<Connector, Full<Bytes>>,
    /// The HTTP/2 connections (`upstream.http` "http2" for every host, "auto" for https ones).
    h2: Option<ConnectionSet<Full<Bytes>>>,
    /// Whether `h2` serves plain-http hosts too (prior knowledge: "http2").
    h2_plain_http: bool,
    /// HTTP/2 only (prior knowledge over plain http), for the bidirectional stream: its own
    /// connections, as many as the sessions in flight need.
    duplex: ConnectionSet<DuplexBody>,
    endpoints: Endpoints,
    signer: Signer,
    /// `Authorization: Bearer <key>`, with `upstream.api_key_env`: for every Region without a
    /// key of its own.
    api_key: Option<HeaderValue>,
    /// The Regions' own keys (`upstream.api_key_env_by_region`).
    region_api_keys: HashMap<String, HeaderValue>,
    response_timeout: Duration,
    pub idle_timeout: Duration,
    connect_timeout: Duration,
    /// Cancelled when the shutdown drain deadline passes: requests and responses in flight end.
    deadline: CancellationToken,
}

/// Where a Region's requests go.
#[derive(Debug)]
enum Endpoints {
    /// One URL for every Region (an explicit endpoint, the simulator).
    Fixed(Arc<Endpoint>),
    /// Each Region's own AWS endpoint, built on first use.
    Aws(DashMap<String, Arc<Endpoint>>),
}

/// One upstream base URL.
#[derive(Debug)]
struct Endpoint {
    /// The base URL's scheme and authority, kept apart so that each request's URI is put together
    /// from them and its path without printing and parsing the base again.
    scheme: Scheme,
    authority: Authority,
    /// `base` for messages, userinfo redacted.
    shown: String,
    host: HeaderValue,
}

impl Endpoint {
    fn new(base: &Uri) -> Result<Endpoint, UpstreamError> {
        let shown = redact_userinfo(&base.to_string()).into_owned();
        let authority = base
            .authority()
            .ok_or_else(|| UpstreamError::Connect(shown.clone(), "the URL has no host".into()))?;
        if authority.as_str().contains('@') {
            return Err(UpstreamError::Connect(
                shown,
                "the URL carries credentials (user:password@); tokengate signs with SigV4 instead"
                    .into(),
            ));
        }
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|e| UpstreamError::Connect(shown.clone(), e.to_string()))?;
        let scheme = base
            .scheme()
            .cloned()
            .ok_or_else(|| UpstreamError::Connect(shown.clone(), "the URL has no scheme".into()))?;
        Ok(Endpoint {
            scheme,
            authority: authority.clone(),
            shown,
            host,
        })
    }
}

impl Upstream {
    /// `base` is scheme and authority only (`https://bedrock-runtime.us-east-1.amazonaws.com`):
    /// every Region's requests go there ([`Upstream::with_aws_endpoints`] sends each to its own).
    /// It speaks `upstream.http = "auto"` with the default streams per connection until
    /// [`Upstream::with_http`] says otherwise (SageMaker's clients keep that).
    pub fn new(
        base: Uri,
        signer: Signer,
        connect_timeout: Duration,
        response_timeout: Duration,
        idle_timeout: Duration,
    ) -> Result<Upstream, UpstreamError> {
        let endpoint = Endpoint::new(&base)?;
        let Clients {
            client,
            h2,
            h2_plain_http,
            duplex,
        } = Clients::new(
            UpstreamHttp::Auto,
            DEFAULT_H2_STREAMS_PER_CONNECTION,
            connect_timeout,
            &endpoint.shown,
        )?;
        Ok(Upstream {
            client,
            h2,
            h2_plain_http,
            duplex,
            endpoints: Endpoints::Fixed(Arc::new(endpoint)),
            signer,
            api_key: None,
            region_api_keys: HashMap::new(),
            response_timeout,
            idle_timeout,
            connect_timeout,
            deadline: CancellationToken::new(),
        })
    }

    /// Speaks `http` upstream (`upstream.http`), with at most `h2_streams_per_connection`
    /// streams on one HTTP/2 connection ([`h2_connections`]).
    pub fn with_http(
        mut self,
        http: UpstreamHttp,
        h2_streams_per_connection: u32,
    ) -> Result<Upstream, UpstreamError> {
        let shown = self.shown();
        let clients = Clients::new(
            http,
            h2_streams_per_connection,
            self.connect_timeout,
            &shown,
        )?;
        self.client = clients.client;
        self.h2 = clients.h2;
        self.h2_plain_http = clients.h2_plain_http;
        self.duplex = clients.duplex;
        Ok(self)
    }

    /// Upstream HTTP/2 connections and streams per host, now (the bidirectional sessions'
    /// included).
    pub fn h2_views(&self) -> Vec<HostView> {
        let mut views = self.h2.as_ref().map_or_else(Vec::new, ConnectionSet::views);
        for duplex in self.duplex.views() {
            match views.iter_mut().find(|v| v.host == duplex.host) {
                Some(view) => {
                    view.connections += duplex.connections;
                    view.streams += duplex.streams;
                }
                None => views.push(duplex),
            }
        }
        views.sort_by(|a, b| a.host.cmp(&b.host));
        views
    }

    /// The fixed endpoint's URL for messages, or what the AWS endpoints are.
    fn shown(&self) -> String {
        match &self.endpoints {
            Endpoints::Fixed(endpoint) => endpoint.shown.clone(),
            Endpoints::Aws(_) => "https://bedrock-runtime.{region}.amazonaws.com".into(),
        }
    }

    /// Sends `key` (a Bedrock API key) as `Authorization: Bearer` on every operation that accepts
    /// one, instead of signing, in every Region without a key of its own.
    pub fn with_api_key(mut self, key: &str) -> Result<Upstream, UpstreamError> {
        self.api_key = Some(bearer(key)?);
        Ok(self)
    }

    /// Sends `key` in place of the one of [`Upstream::with_api_key`] (or of a signature) to
    /// `region`.
    pub fn with_region_api_key(
        mut self,
        region: &str,
        key: &str,
    ) -> Result<Upstream, UpstreamError> {
        self.region_api_keys
            .insert(region.to_string(), bearer(key)?);
        Ok(self)
    }

    fn api_key_for(&self, region: &str) -> Option<&HeaderValue> {
        self.region_api_keys.get(region).or(self.api_key.as_ref())
    }

    /// Adds the proxy's credential to `request` (which must carry its final `host`): the API
    /// key where configured and accepted, else a SigV4 signature for `region`.
    pub async fn authorize(
        &self,
        request: &mut Request<Bytes>,
        operation: Operation,
        region: &str,
    ) -> Result<(), UpstreamError> {
        match self.api_key_for(region) {
            Some(key) if operation.accepts_api_key() => {
                request
                    .headers_mut()
                    .insert(header::AUTHORIZATION, key.clone());
                Ok(())
            }
            _ => self.signer.sign(region, request).await,
        }
    }

    /// Ends requests and responses in flight when `deadline` is cancelled (the server's drain
    /// deadline, [`crate::server::ServeOptions::deadline`]).
    pub fn with_deadline(mut self, deadline: CancellationToken) -> Upstream {
        self.deadline = deadline;
        self
    }

    pub fn deadline(&self) -> &CancellationToken {
        &self.deadline
    }

    /// Sends each Region's requests to its own AWS endpoint ([`Upstream::aws_endpoint`]).
    pub fn with_aws_endpoints(mut self) -> Upstream {
        self.endpoints = Endpoints::Aws(DashMap::new());
        self
    }

    /// The default AWS endpoint of a Region.
    pub fn aws_endpoint(region: &str) -> Result<Uri, http::uri::InvalidUri> {
        format!("https://bedrock-runtime.{region}.amazonaws.com").parse()
    }

    /// Where `region`'s requests go.
    fn endpoint(&self, region: &str) -> Result<Arc<Endpoint>, UpstreamError> {
        let regional = match &self.endpoints {
            Endpoints::Fixed(endpoint) => return Ok(endpoint.clone()),
            Endpoints::Aws(regional) => regional,
        };
        if let Some(endpoint) = regional.get(region) {
            return Ok(endpoint.clone());
        }
        let uri = Upstream::aws_endpoint(region).map_err(|e| {
            UpstreamError::Connect(format!("the endpoint of Region {region:?}"), e.to_string())
        })?;
        let endpoint = Arc::new(Endpoint::new(&uri)?);
        regional.insert(region.to_string(), endpoint.clone());
        Ok(endpoint)
    }

    pub fn signer(&self) -> &Signer {
        &self.signer
    }

    /// Sends one request of `operation` upstream for `region` and waits for the response head.
    /// `headers` go as they are (choose them with [`headers::Api::forwarded`]); the proxy adds
    /// `host` and its credential for `region` ([`Upstream::authorize`]). `None` for a call that is
    /// no proxied operation (SageMaker's control plane): always signed with SigV4.
    pub async fn send(
        &self,
        operation: impl Into<Option<Operation>>,
        region: &str,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        let endpoint = self.endpoint(region)?;
        let mut request = request(&endpoint, method, path_and_query, headers, body)?;
        match operation.into() {
            Some(operation) => self.authorize(&mut request, operation, region).await?,
            None => self.signer.sign(region, &mut request).await?,
        }
        // `host` is signed but hyper derives it (or `:authority`) from the URI.
        request.headers_mut().remove(header::HOST);
        self.answer(self.dispatch(&endpoint, request.map(Full::new)))
            .await
    }

    /// Sends `request` over the HTTP/2 connections where they serve `endpoint`, else (or if
    /// the host turned out to speak HTTP/1.1) over hyper's pooled client.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps each argument twice while the call waits (rust-lang/rust#62958)"
    )]
    fn dispatch(
        &self,
        endpoint: &Endpoint,
        request: Request<Full<Bytes>>,
    ) -> impl Future<Output = Result<Response<PooledBody>, UpstreamError>> {
        async move {
            let failed = |e: String| UpstreamError::Connect(endpoint.shown.clone(), e);
            let h2 = self
                .h2
                .as_ref()
                .filter(|_| self.h2_plain_http || endpoint.scheme == Scheme::HTTPS);
            let request = match h2 {
                None => request,
                Some(set) => {
                    let copy = replay(&request);
                    match set.send(request, Some(copy)).await {
                        Ok(Sent::Answered(response)) => return Ok(response),
                        Ok(Sent::Http1(request)) => request,
                        Err(e) => return Err(failed(e.to_string())),
                    }
                }
            };
            match self.client.request(request).await {
                Ok(response) => Ok(response.map(PooledBody::plain)),
                Err(e) => Err(failed(error_chain(&e))),
            }
        }
    }

    /// Opens an event stream both ways over HTTP/2 (InvokeModelWithBidirectionalStream): signs
    /// the head over an empty payload (always SigV4: the operation takes no API key, whatever
    /// `upstream.api_key_env` says), builds the request body with `body` around the signer of
    /// its events, and waits for the response head while that body streams upstream.
    pub async fn open_duplex(
        &self,
        region: &str,
        path_and_query: &str,
        headers: &HeaderMap,
        body: impl FnOnce(EventSigner) -> DuplexBody,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        let endpoint = self.endpoint(region)?;
        let mut request = request(
            &endpoint,
            Method::POST,
            path_and_query,
            headers,
            Bytes::new(),
        )?;
        let events = self.signer.sign_event_stream(region, &mut request).await?;
        request.headers_mut().remove(header::HOST);
        let request = request.map(|_| body(events));
        let failed = |e: String| UpstreamError::Connect(endpoint.shown.clone(), e);
        self.answer(async {
            match self.duplex.send(request, None).await {
                Ok(Sent::Answered(response)) => Ok(response),
                Ok(Sent::Http1(_)) => Err(failed(
                    "the host chose HTTP/1.1; InvokeModelWithBidirectionalStream needs HTTP/2"
                        .into(),
                )),
                Err(e) => Err(failed(e.to_string())),
            }
        })
        .await
    }

    /// Waits for the response head of `call`, within the response timeout and the drain
    /// deadline.
    fn answer<F>(&self, call: F) -> Answer<'_, F>
    where
        F: Future<Output = Result<Response<PooledBody>, UpstreamError>>,
    {
        Answer {
            call: tokio::time::timeout(self.response_timeout, call),
            shutdown: self.deadline.cancelled(),
            limit: self.response_timeout,
        }
    }
}

pin_project_lite::pin_project! {
    /// [`Upstream::answer`]: a call's wait for its response head, with its timeout and the drain
    /// deadline. A future of its own rather than an `async fn`, which keeps its argument (the
    /// call, kilobytes of state) beside the copy it awaits for as long as the call waits
    /// (rust-lang/rust#62958).
    struct Answer<'a, F> {
        #[pin]
        call: tokio::time::Timeout<F>,
        #[pin]
        shutdown: tokio_util::sync::WaitForCancellationFuture<'a>,
        limit: Duration,
    }
}

impl<F> Future for Answer<'_, F>
where
    F: Future<Output = Result<Response<PooledBody>, UpstreamError>>,
{
    type Output = Result<Response<PooledBody>, UpstreamError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(answer) = this.call.poll(cx) {
            return Poll::Ready(answer.unwrap_or(Err(UpstreamError::Timeout(*this.limit))));
        }
        match this.shutdown.poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(UpstreamError::ShuttingDown)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The request to `path_and_query` at `endpoint`, with `headers` and `host`, unsigned.
fn request(
    endpoint: &Endpoint,
    method: Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Request<Bytes>, UpstreamError> {
    let bad = |e: http::Error| {
        UpstreamError::Signing(format!(
            "bad upstream URI {}{path_and_query}: {e}",
            endpoint.shown.trim_end_matches('/')
        ))
    };
    let uri = Uri::builder()
        .scheme(endpoint.scheme.clone())
        .authority(endpoint.authority.clone())
        .path_and_query(path_and_query)
        .build()
        .map_err(bad)?;
    let mut request = Request::builder()
        .method(method)
        .uri(uri)
        .body(body)
        .map_err(bad)?;
    *request.headers_mut() = headers.clone();
    request
        .headers_mut()
        .insert(header::HOST, endpoint.host.clone());
    Ok(request)
}

/// `Authorization: Bearer <key>`, marked sensitive (never logged by hyper or `Debug`).
fn bearer(key: &str) -> Result<HeaderValue, UpstreamError> {
    let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
        UpstreamError::Signing("the upstream API key is not valid header text".into())
    })?;
    value.set_sensitive(true);
    Ok(value)
}

/// The clients that carry requests upstream, for one `upstream.http`.
struct Clients {
    client: Client<Connector, Full<Bytes>>,
    h2: Option<ConnectionSet<Full<Bytes>>>,
    h2_plain_http: bool,
    duplex: ConnectionSet<DuplexBody>,
}

impl Clients {
    fn new(
        http: UpstreamHttp,
        streams: u32,
        timeout: Duration,
        shown: &str,
    ) -> Result<Clients, UpstreamError> {
        let settings = h2_settings(streams, timeout);
        let (h1, h2) = match http {
            UpstreamHttp::Auto => (Alpn::Both, Some(Alpn::Both)),
            UpstreamHttp::Http1 => (Alpn::H1, None),
            UpstreamHttp::Http2 => (Alpn::H2, Some(Alpn::H2)),
        };
        let h2 = match h2 {
            Some(alpn) => Some(ConnectionSet::new(
                connector(alpn, timeout, shown)?,
                settings,
            )),
            None => None,
        };
        Ok(Clients {
            client: legacy_client(connector(h1, timeout, shown)?),
            h2,
            h2_plain_http: http == UpstreamHttp::Http2,
            duplex: ConnectionSet::new(connector(Alpn::H2, timeout, shown)?, settings),
        })
    }
}

/// How a connection set behaves with `streams` per connection.
fn h2_settings(streams: u32, connect_timeout: Duration) -> h2_connections::Settings {
    h2_connections::Settings {
        streams_per_connection: usize::try_from(streams).unwrap_or(usize::MAX),
        connect_timeout,
        idle_timeout: POOL_IDLE_TIMEOUT,
    }
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use aws_credential_types::{Credentials, provider::SharedCredentialsProvider};

    use super::*;

    fn upstream(base: &str) -> Upstream {
        let provider =
            SharedCredentialsProvider::new(Credentials::new("AKID", "secret", None, None, "test"));
        let second = Duration::from_secs(1);
        Upstream::new(
            base.parse().unwrap(),
            Signer::new(provider, "us-east-1"),
            second,
            second,
            second,
        )
        .unwrap()
    }

    /// The URI a Converse request to `endpoint` is sent to.
    fn sent_to(endpoint: &Endpoint) -> String {
        let built = request(
            endpoint,
            Method::POST,
            "/model/m/converse",
            &HeaderMap::new(),
            Bytes::new(),
        );
        built.unwrap().uri().to_string()
    }

    #[test]
    fn with_aws_endpoints_each_region_goes_to_its_own_host() {
        let up = upstream("https://bedrock-runtime.us-east-1.amazonaws.com").with_aws_endpoints();
        for region in ["us-west-2", "eu-central-1", "us-west-2"] {
            let endpoint = up.endpoint(region).unwrap();
            let host = format!("bedrock-runtime.{region}.amazonaws.com");
            assert_eq!(
                sent_to(&endpoint),
                format!("https://{host}/model/m/converse")
            );
            assert_eq!(endpoint.host, host.as_str());
        }
        let Endpoints::Aws(built) = &up.endpoints else {
            panic!("regional")
        };
        assert_eq!(built.len(), 2, "built once per Region");
    }

    #[test]
    fn an_explicit_url_serves_every_region() {
        let up = upstream("http://127.0.0.1:9");
        for region in ["us-east-1", "eu-west-1"] {
            let endpoint = up.endpoint(region).unwrap();
            assert_eq!(sent_to(&endpoint), "http://127.0.0.1:9/model/m/converse");
        }
    }
}
