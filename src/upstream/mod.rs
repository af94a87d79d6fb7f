//! The transport to `bedrock-runtime`: header hygiene ([`headers`]), SigV4 re-signing
//! ([`signer`]) and the pooled client. It knows nothing of quotas: the pipeline meters what comes
//! back ([`crate::proxy::meter`]).
//!
//! The request body is forwarded byte for byte (never re-serialised, so fields this proxy does not
//! know pass through untouched); the raw, percent-encoded path is forwarded unchanged and signed
//! as it is sent (no normalisation: the path signed is the path admitted). Response bodies stream
//! through frame by frame; nothing buffers a whole response. Errors never show the upstream
//! URL's userinfo (config refuses it; [`redact_userinfo`] guards the messages anyway).

pub mod headers;
pub mod sagemaker;
pub mod signer;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tokio_util::sync::CancellationToken;

pub use signer::{SAGEMAKER_SIGNING_NAME, Signer};

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

/// The pooled, signing client for one upstream.
#[derive(Debug)]
pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    base: Uri,
    /// `base` for messages, userinfo redacted.
    shown: String,
    host: HeaderValue,
    signer: Signer,
    response_timeout: Duration,
    pub idle_timeout: Duration,
    /// Cancelled when the shutdown drain deadline passes: requests and responses in flight end.
    deadline: CancellationToken,
}

impl Upstream {
    /// `base` is scheme and authority only (`https://bedrock-runtime.us-east-1.amazonaws.com`).
    pub fn new(
        base: Uri,
        signer: Signer,
        connect_timeout: Duration,
        response_timeout: Duration,
        idle_timeout: Duration,
    ) -> Result<Upstream, UpstreamError> {
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
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        http.set_keepalive(Some(Duration::from_secs(60)));
        let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(provider)
            .map_err(|e| UpstreamError::Connect(shown.clone(), e.to_string()))?
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .build(https);
        Ok(Upstream {
            client,
            base,
            shown,
            host,
            signer,
            response_timeout,
            idle_timeout,
            deadline: CancellationToken::new(),
        })
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

    /// The default AWS endpoint of a Region.
    pub fn aws_endpoint(region: &str) -> Result<Uri, http::uri::InvalidUri> {
        format!("https://bedrock-runtime.{region}.amazonaws.com").parse()
    }

    pub fn signer(&self) -> &Signer {
        &self.signer
    }

    /// Sends one request upstream and waits for the response head. `headers` go as they are
    /// (choose them with [`headers::Api::forwarded`]); the proxy adds `host` and its signature.
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let uri = format!(
            "{}{}",
            self.base.to_string().trim_end_matches('/'),
            path_and_query
        );
        let mut request = Request::builder()
            .method(method)
            .uri(&uri)
            .body(body)
            .map_err(|e| UpstreamError::Signing(format!("bad upstream URI {uri}: {e}")))?;
        *request.headers_mut() = headers.clone();
        request
            .headers_mut()
            .insert(header::HOST, self.host.clone());
        self.signer.sign(&mut request).await?;
        // `host` is signed but hyper derives it (or `:authority`) from the URI.
        request.headers_mut().remove(header::HOST);
        let request = request.map(Full::new);
        let call = tokio::time::timeout(self.response_timeout, self.client.request(request));
        let answer = tokio::select! {
            answer = call => answer,
            () = self.deadline.cancelled() => return Err(UpstreamError::ShuttingDown),
        };
        match answer {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) => Err(UpstreamError::Connect(self.shown.clone(), error_chain(&e))),
            Err(_) => Err(UpstreamError::Timeout(self.response_timeout)),
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
