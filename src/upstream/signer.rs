//! SigV4 re-signing with the proxy's own credentials, for each request's Region, with the
//! derived signing key cached per day and Region ([`super::sign`]).
//! (Over 500 lines: its tests hold the cached signing to aws-sigv4's, byte for byte.)
//!
//! The canonical path is the path sent, double-encoded as `bedrock-runtime` wants and never
//! normalised (`aws-sigv4` would remove dot segments by default): the path signed is byte for
//! byte the path admitted and forwarded. (Paths with dot or empty segments never get this far:
//! [`crate::bedrock::Target::parse`] refuses them.)
//!
//! An event stream (InvokeModelWithBidirectionalStream) is signed as aws-sdk-rust signs it: the
//! head over an empty payload ([`Signer::sign_event_stream`]), then every event in an envelope
//! whose signature chains from the one before, the head's first ([`EventSigner`]).
//!
//! Credentials come from a provider (the AWS default chain in production: environment, profile,
//! web identity (IRSA), container credentials (EKS Pod Identity, ECS), IMDS). They are cached
//! and refreshed five minutes before they expire, once, however many requests are waiting.

use std::{
    sync::RwLock,
    time::{Duration, SystemTime},
};

use aws_credential_types::{
    Credentials, provider::ProvideCredentials, provider::SharedCredentialsProvider,
};
use aws_sigv4::{
    event_stream::{sign_empty_message, sign_message},
    sign::v4,
};
use aws_smithy_runtime_api::client::identity::Identity;
use aws_smithy_types::event_stream::Message;

use super::{UpstreamError, sign::SigningKeys};

/// Refresh credentials this long before they expire.
const REFRESH_MARGIN: Duration = Duration::from_secs(300);
pub use crate::auth::sigv4::SIGNING_NAME;
/// The SigV4 signing name of sagemaker-runtime and the SageMaker control plane.
pub const SAGEMAKER_SIGNING_NAME: &str = "sagemaker";

#[derive(Debug)]
pub struct Signer {
    provider: SharedCredentialsProvider,
    /// `upstream.region`: the Region of requests no pool names one for.
    default_region: String,
    /// The service the signature is scoped to: `bedrock` unless [`Signer::for_service`] says.
    service: &'static str,
    cached: RwLock<Option<Credentials>>,
    refresh: tokio::sync::Mutex<()>,
    /// Derived signing keys, per Region ([`super::sign`]).
    keys: SigningKeys,
}

impl Signer {
    /// Signs with `provider`'s credentials; `default_region` is `upstream.region`.
    pub fn new(provider: SharedCredentialsProvider, default_region: impl Into<String>) -> Signer {
        Signer {
            provider,
            default_region: default_region.into(),
            service: SIGNING_NAME,
            cached: RwLock::new(None),
            refresh: tokio::sync::Mutex::new(()),
            keys: SigningKeys::default(),
        }
    }

    /// The Region of requests that no pool names one for (`upstream.region`).
    pub fn default_region(&self) -> &str {
        &self.default_region
    }

    /// Signs for `service` instead of `bedrock` (`sagemaker` for endpoint calls).
    pub fn for_service(mut self, service: &'static str) -> Signer {
        self.service = service;
        self
    }

    fn fresh(&self) -> Option<Credentials> {
        let cached = self.cached.read().unwrap_or_else(|p| p.into_inner());
        cached
            .as_ref()
            .filter(|c| {
                c.expiry()
                    .is_none_or(|e| e > SystemTime::now() + REFRESH_MARGIN)
            })
            .cloned()
    }

    /// Current credentials, fetched or refreshed when needed.
    pub async fn credentials(&self) -> Result<Credentials, UpstreamError> {
        if let Some(c) = self.fresh() {
            return Ok(c);
        }
        let _one_refresh = self.refresh.lock().await;
        if let Some(c) = self.fresh() {
            return Ok(c);
        }
        let creds = self.provider.provide_credentials().await.map_err(|e| {
            UpstreamError::Credentials(format!(
                "{e}: {}",
                aws_smithy_types::error::display::DisplayErrorContext(&e)
            ))
        })?;
        *self.cached.write().unwrap_or_else(|p| p.into_inner()) = Some(creds.clone());
        Ok(creds)
    }

    /// Signs `request` in place for `region` (adds `authorization`, `x-amz-date` and, for
    /// temporary credentials, `x-amz-security-token`). The request must already carry its final
    /// `host`.
    pub async fn sign(
        &self,
        region: &str,
        request: &mut http::Request<bytes::Bytes>,
    ) -> Result<(), UpstreamError> {
        let credentials = self.credentials().await?;
        self.keys
            .sign(
                &credentials,
                (region, self.service),
                SystemTime::now(),
                request,
            )
            .map(|_| ())
    }

    /// The signing keys derived so far, per Region.
    pub fn keys(&self) -> &SigningKeys {
        &self.keys
    }

    /// Signs the head of an event stream in place, over an empty payload (`request`'s body must
    /// be empty), and returns the signer of the events that follow. The session keeps the
    /// credentials it started with, as the SDKs do.
    pub async fn sign_event_stream(
        &self,
        region: &str,
        request: &mut http::Request<bytes::Bytes>,
    ) -> Result<EventSigner, UpstreamError> {
        let credentials = self.credentials().await?;
        let seed = self.keys.sign(
            &credentials,
            (region, self.service),
            SystemTime::now(),
            request,
        )?;
        let identity: Identity = credentials.into();
        Ok(EventSigner {
            identity,
            region: region.to_string(),
            prior: seed,
        })
    }
}

/// Signs the events of one stream, each chained from the signature before it.
#[derive(Debug)]
pub struct EventSigner {
    identity: Identity,
    region: String,
    /// The last signature made (the head's to begin with), hex.
    prior: String,
}

impl EventSigner {
    /// `event` wrapped in an envelope signed now (`:date`, `:chunk-signature`).
    pub fn sign(&mut self, event: &Message) -> Result<Message, UpstreamError> {
        let params = self.params()?;
        let signed = sign_message(event, &self.prior, &params)
            .map_err(|e| UpstreamError::Signing(e.to_string()))?;
        Ok(self.chain(signed))
    }

    /// The envelope with an empty payload that ends the stream.
    pub fn sign_end(&mut self) -> Result<Message, UpstreamError> {
        let params = self.params()?;
        let signed = sign_empty_message(&self.prior, &params)
            .map_err(|e| UpstreamError::Signing(e.to_string()))?;
        Ok(self.chain(signed))
    }

    fn params(&self) -> Result<aws_sigv4::event_stream::SigningParams<'_>, UpstreamError> {
        v4::SigningParams::builder()
            .identity(&self.identity)
            .region(&self.region)
            .name(SIGNING_NAME)
            .time(SystemTime::now())
            .settings(())
            .build()
            .map_err(|e| UpstreamError::Signing(e.to_string()))
    }

    fn chain(&mut self, signed: aws_sigv4::SigningOutput<Message>) -> Message {
        let (message, signature) = signed.into_parts();
        self.prior = signature;
        message
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    };

    use aws_credential_types::provider::future;
    use aws_sigv4::http_request::{
        PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
        UriPathNormalizationMode, sign,
    };

    use super::*;

    /// What the proxy signed with before the key cache: `aws-sigv4` itself, double-encoded and
    /// never normalised. The reference the cached signing must equal.
    fn reference_sign(
        identity: &Identity,
        (region, service): (&str, &str),
        at: SystemTime,
        request: &mut http::Request<bytes::Bytes>,
    ) -> String {
        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Double;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        let params = v4::SigningParams::builder()
            .identity(identity)
            .region(region)
            .name(service)
            .time(at)
            .settings(settings)
            .build()
            .unwrap()
            .into();
        let uri = request.uri().to_string();
        let headers = request
            .headers()
            .iter()
            .filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str(), v)));
        let signable = SignableRequest::new(
            request.method().as_str(),
            uri,
            headers,
            SignableBody::Bytes(request.body()),
        )
        .unwrap();
        let (instructions, signature) = sign(signable, &params).unwrap().into_parts();
        instructions.apply_to_request_http1x(request);
        signature
    }

    /// Hands out credentials that expire `lifetime` from now, counting calls.
    #[derive(Debug)]
    struct Rotating {
        calls: Arc<AtomicU32>,
        lifetime: Duration,
    }

    impl ProvideCredentials for Rotating {
        fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
        where
            Self: 'a,
        {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            let expiry = SystemTime::now() + self.lifetime;
            future::ProvideCredentials::ready(Ok(Credentials::new(
                format!("AKID{n}"),
                "secret",
                None,
                Some(expiry),
                "test",
            )))
        }
    }

    fn signer(lifetime: Duration) -> (Signer, Arc<AtomicU32>) {
        let calls = Arc::new(AtomicU32::new(0));
        let provider = SharedCredentialsProvider::new(Rotating {
            calls: calls.clone(),
            lifetime,
        });
        (Signer::new(provider, "us-east-1"), calls)
    }

    #[tokio::test]
    async fn credentials_are_cached_until_near_expiry() {
        let (signer, calls) = signer(Duration::from_secs(3600));
        for _ in 0..5 {
            assert_eq!(signer.credentials().await.unwrap().access_key_id(), "AKID0");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn rotated_credentials_are_used_as_they_come() {
        // Inside the refresh margin: every use fetches afresh.
        let (signer, calls) = signer(Duration::from_secs(60));
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(
                signer
                    .credentials()
                    .await
                    .unwrap()
                    .access_key_id()
                    .to_string(),
            );
        }
        assert_eq!(seen, ["AKID0", "AKID1", "AKID2"]);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn signing_replaces_nothing_but_adds_the_signature() {
        let (signer, _) = signer(Duration::from_secs(3600));
        let mut request = http::Request::builder()
            .method("POST")
            .uri("https://bedrock-runtime.us-east-1.amazonaws.com/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse")
            .header("host", "bedrock-runtime.us-east-1.amazonaws.com")
            .header("content-type", "application/json")
            .body(bytes::Bytes::from_static(b"{}"))
            .unwrap();
        signer.sign("us-east-1", &mut request).await.unwrap();
        let auth = request.headers()["authorization"].to_str().unwrap();
        assert!(
            auth.starts_with("AWS4-HMAC-SHA256 Credential=AKID0/"),
            "{auth}"
        );
        assert!(auth.contains("/us-east-1/bedrock/aws4_request"), "{auth}");
        assert!(request.headers().contains_key("x-amz-date"));
        let verified = crate::auth::sigv4::verify(
            request.method(),
            request.uri().path(),
            request.headers(),
            request.body(),
            |id| (id == "AKID0").then(|| "secret".to_string()),
            SystemTime::now(),
        );
        assert!(verified.is_ok(), "{verified:?}");
    }

    /// The path is signed as it is sent: a verifier that normalises (as AWS does) rejects a
    /// signature over `/a/./b` made for `/a/b`, so the proxy can never sign one resource while
    /// sending another. A normal path verifies, double-encoded.
    #[test]
    fn the_path_is_signed_as_sent_never_normalised() {
        let credentials = Credentials::new("AKID0", "secret", None, None, "test");
        let keys = SigningKeys::default();
        let at = SystemTime::now();
        let signed = |path: &str| {
            let mut request = http::Request::builder()
                .method("POST")
                .uri(format!(
                    "https://bedrock-runtime.us-east-1.amazonaws.com{path}"
                ))
                .header("host", "bedrock-runtime.us-east-1.amazonaws.com")
                .body(bytes::Bytes::from_static(b"{}"))
                .unwrap();
            keys.sign(&credentials, ("us-east-1", SIGNING_NAME), at, &mut request)
                .unwrap();
            request
        };
        let verify = |request: &http::Request<bytes::Bytes>, path: &str| {
            crate::auth::sigv4::verify(
                request.method(),
                path,
                request.headers(),
                request.body(),
                |id| (id == "AKID0").then(|| "secret".to_string()),
                at,
            )
        };
        let plain = "/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse";
        assert!(verify(&signed(plain), plain).is_ok());
        let dotted = "/model/x/./converse";
        assert_eq!(
            verify(&signed(dotted), dotted),
            Err(crate::auth::sigv4::SigV4Error::SignatureMismatch),
            "signed over the path as sent, not its normal form"
        );
    }

    /// The head of an event stream verifies as an event-stream head, and the events signed after
    /// it verify in a chain seeded with the head's signature (as bedrock-runtime checks them).
    #[tokio::test]
    async fn an_event_stream_is_signed_head_first_then_event_by_event() {
        use crate::auth::{
            event_stream::ChainVerifier,
            sigv4::{Payload, SignedHead, SignedRequest},
        };
        let (signer, _) = signer(Duration::from_secs(3600));
        let path = "/model/amazon.nova-sonic-v1%3A0/invoke-with-bidirectional-stream";
        let mut request = http::Request::builder()
            .method("POST")
            .uri(format!(
                "https://bedrock-runtime.us-east-1.amazonaws.com{path}"
            ))
            .header("host", "bedrock-runtime.us-east-1.amazonaws.com")
            .body(bytes::Bytes::new())
            .unwrap();
        let mut events = signer
            .sign_event_stream("us-east-1", &mut request)
            .await
            .unwrap();
        assert!(!request.headers().contains_key("x-amz-content-sha256"));
        let now = SystemTime::now();
        let head = SignedHead::check_for(request.headers(), now, Payload::EventStream).unwrap();
        let signed = SignedRequest {
            method: request.method(),
            raw_path_and_query: path,
            authority: None,
            headers: request.headers(),
            body: b"",
        };
        head.verify(&signed, "secret").unwrap();
        let mut verifier = ChainVerifier::new(
            crate::config::Secret("secret".into()),
            "us-east-1",
            SIGNING_NAME,
            head.auth.signature,
        );
        let first = events.sign(&Message::new(&b"one"[..])).unwrap();
        let second = events.sign(&Message::new(&b"two"[..])).unwrap();
        let end = events.sign_end().unwrap();
        for envelope in [&first, &second] {
            assert!(!verifier.verify(envelope, now).unwrap().is_empty());
        }
        assert!(verifier.verify(&end, now).unwrap().is_empty());
    }

    /// The cached signing gives exactly what `aws-sigv4` gives, header for header: paths with
    /// encoded characters, queries, temporary credentials, odd spacing, repeated and unsigned
    /// headers, any Region, either service.
    #[test]
    fn cached_signing_equals_aws_sigv4() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_600_000);
        let permanent = Credentials::new("AKID0", "secret", None, None, "test");
        let temporary = Credentials::new("ASIA1", "secret2", Some("token/+=".into()), None, "t");
        let requests = [
            (
                "POST",
                "/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse",
                "us-east-1",
            ),
            (
                "POST",
                "/model/arn%3Aaws%3Abedrock%3Aus-west-2%3A%3Afoundation-model%2Fm/invoke",
                "us-west-2",
            ),
            (
                "GET",
                "/async-invoke?maxResults=2&statusEquals=Completed&nextToken=a%2Fb",
                "eu-west-1",
            ),
            ("POST", "/openai/v1/chat/completions", "ap-southeast-2"),
        ];
        let cases = [&permanent, &temporary]
            .into_iter()
            .flat_map(|c| [(c, SIGNING_NAME), (c, SAGEMAKER_SIGNING_NAME)]);
        for (credentials, service) in cases {
            let keys = SigningKeys::default();
            for (method, path, region) in requests {
                let host = format!("bedrock-runtime.{region}.amazonaws.com");
                let build = || {
                    http::Request::builder()
                        .method(method)
                        .uri(format!("https://{host}{path}"))
                        .header("host", &host)
                        .header("content-type", "application/json")
                        .header("x-amzn-bedrock-trace", "  two   spaces  ")
                        .header("x-amzn-bedrock-guardrailversion", "1")
                        .header("accept", "a")
                        .header("accept", "b")
                        .header("user-agent", "not signed")
                        .body(bytes::Bytes::from_static(b"{\"a\": 1}"))
                        .unwrap()
                };
                let (mut ours, mut theirs) = (build(), build());
                let signature = keys
                    .sign(credentials, (region, service), at, &mut ours)
                    .unwrap();
                let identity: Identity = credentials.clone().into();
                let expected = reference_sign(&identity, (region, service), at, &mut theirs);
                assert_eq!(signature, expected, "{method} {path}");
                assert_eq!(ours.headers(), theirs.headers(), "{method} {path}");
            }
        }
    }

    /// One key per Region and day: derived once, then reused, and derived again for a new day
    /// or rotated credentials.
    #[test]
    fn the_signing_key_is_derived_once_per_day_and_region() {
        let keys = SigningKeys::default();
        let credentials = Credentials::new("AKID0", "secret", None, None, "test");
        let day = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_600_000);
        let sign = |credentials: &Credentials, region: &str, at: SystemTime| {
            let mut request = http::Request::builder()
                .method("POST")
                .uri("https://h/model/m/converse")
                .header("host", "h")
                .body(bytes::Bytes::new())
                .unwrap();
            keys.sign(credentials, (region, SIGNING_NAME), at, &mut request)
                .unwrap();
        };
        for _ in 0..3 {
            sign(&credentials, "us-east-1", day);
            sign(&credentials, "us-west-2", day + Duration::from_secs(60));
        }
        assert_eq!(keys.derived(), 2, "one per Region");
        sign(&credentials, "us-east-1", day + Duration::from_secs(86_400));
        assert_eq!(keys.derived(), 3, "a new day");
        let rotated = Credentials::new("AKID1", "secret1", None, None, "test");
        sign(&rotated, "us-east-1", day + Duration::from_secs(86_400));
        assert_eq!(keys.derived(), 4, "rotated credentials");
    }
}
