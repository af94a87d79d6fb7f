//! Caller identity: which application route a request belongs to (`[auth] mode`).
//!
//! - `none`: every request is the default route (a sidecar on loopback).
//! - `bearer`: `Authorization: Bearer <key>`, as SDKs send `AWS_BEARER_TOKEN_BEDROCK` (and the
//!   OpenAI SDK its `api_key`), or `x-api-key: <key>`, as the Anthropic SDK sends its `api_key`:
//!   the same proxy-issued key either way (both headers with different keys are refused). The
//!   config holds each route's key as a SHA-256; the presented key is hashed and compared with
//!   every route's hash in constant time.
//! - `sigv4`: the SDK signs with a key pair the proxy issued to the route; [`sigv4`] verifies the
//!   signature exactly as AWS would (double-encoded path, `host` or HTTP/2 `:authority`, ±5
//!   minutes, payload hash), comparing in constant time. The OpenAI and Anthropic APIs also take
//!   a route's bearer key there (their SDKs cannot sign): a request to them that is not SigV4
//!   signed is identified as in `bearer` mode. The native operations take signatures only.
//!
//! Every mode identifies the caller from the request head, before any body byte is read
//! ([`Authenticator::identify`]): in `sigv4` mode the `Authorization` header must parse and sign
//! `host` and `x-amz-date`, the date must be within the skew window, the access key id must be a
//! route's, and the credential scope must name the call's service (`bedrock`, or `sagemaker` for an
//! endpoint call) and a Region this proxy serves.
//! Only then is the body read, and the signature checked over head and body
//! ([`Authenticator::verify_body`]). So an unknown caller costs a header parse, never a buffered
//! body.
//!
//! InvokeModelWithBidirectionalStream is identified from its head alone
//! ([`Authenticator::identify_stream`]): its body is a stream of events, each signed in `sigv4`
//! mode and checked as it arrives ([`event_stream`]).
//!
//! A request that fails gets a 403 that does not say which part failed: `UnrecognizedClientException`
//! for an access key id the proxy never issued (what AWS answers), `AccessDeniedException`
//! otherwise. The reason is counted in `tokengate_auth_failures_total{mode,reason}` and logged at
//! debug level.

pub mod amz_date;
pub mod event_stream;
pub mod sigv4;

use std::{collections::HashMap, sync::Arc, time::SystemTime};

use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::{
    bedrock::{BedrockError, ErrorCode, Operation, operation::raw_path_and_query},
    config::{AuthConfig, AuthMode, RouteConfig, Secret},
    metrics::Metrics,
};
use event_stream::{ChainVerifier, FrameSignatureError};
use sigv4::{Payload, SigV4Error, constant_time_eq};

/// Why identification failed: the `reason` label; never sent to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization` header.
    Missing,
    /// An `Authorization` header of the wrong scheme or shape.
    Malformed,
    /// A SigV4 access key id the proxy did not issue.
    UnknownKey,
    /// `X-Amz-Date` more than 5 minutes from the proxy's clock.
    Expired,
    /// The signature does not match (wrong secret, altered request).
    Signature,
    /// `x-amz-content-sha256` does not match the body.
    PayloadHash,
    /// A bearer key that no route holds.
    BadToken,
    /// A SigV4 credential scope for another service, or a Region this proxy does not serve.
    Scope,
}

impl AuthFailure {
    pub const ALL: [AuthFailure; 8] = [
        AuthFailure::Missing,
        AuthFailure::Malformed,
        AuthFailure::UnknownKey,
        AuthFailure::Expired,
        AuthFailure::Signature,
        AuthFailure::PayloadHash,
        AuthFailure::BadToken,
        AuthFailure::Scope,
    ];

    pub fn label(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing",
            AuthFailure::Malformed => "malformed",
            AuthFailure::UnknownKey => "unknown_key",
            AuthFailure::Expired => "expired",
            AuthFailure::Signature => "signature",
            AuthFailure::PayloadHash => "payload_hash",
            AuthFailure::BadToken => "bad_token",
            AuthFailure::Scope => "scope",
        }
    }

    /// The answer the caller gets: deliberately vague.
    fn error(self) -> BedrockError {
        match self {
            AuthFailure::UnknownKey => BedrockError::new(
                ErrorCode::UnrecognizedClient,
                "The security token included in the request is invalid.",
            ),
            _ => BedrockError::new(
                ErrorCode::AccessDenied,
                "tokengate could not authenticate this request: check the credentials (or bearer key) the client uses for this endpoint",
            ),
        }
    }
}

/// The key a request presents: `Authorization: Bearer KEY` or `x-api-key: KEY` (the Anthropic
/// SDK's header). Both with different keys, an `Authorization` of another scheme, or an empty
/// key is malformed.
fn presented_key(headers: &http::HeaderMap) -> Result<&str, AuthFailure> {
    let text = |name| {
        headers
            .get(name)
            .map(|v| {
                v.to_str()
                    .map(str::trim)
                    .map_err(|_| AuthFailure::Malformed)
            })
            .transpose()
    };
    let bearer = text(http::header::AUTHORIZATION.as_str())?
        .map(|v| {
            v.split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, token)| token.trim())
                .ok_or(AuthFailure::Malformed)
        })
        .transpose()?;
    let api_key = text(X_API_KEY)?;
    let key = match (bearer, api_key) {
        (Some(b), Some(k)) if b != k => return Err(AuthFailure::Malformed),
        (Some(key), _) | (None, Some(key)) => key,
        (None, None) => return Err(AuthFailure::Missing),
    };
    if key.is_empty() {
        return Err(AuthFailure::Malformed);
    }
    Ok(key)
}

/// The Anthropic SDK's credential header.
pub const X_API_KEY: &str = "x-api-key";

/// Whether the request carries a SigV4 `Authorization` header.
fn is_signed(parts: &Parts) -> bool {
    parts
        .headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with(sigv4::ALGORITHM))
}

impl From<&SigV4Error> for AuthFailure {
    fn from(e: &SigV4Error) -> Self {
        match e {
            SigV4Error::Missing => AuthFailure::Missing,
            SigV4Error::Malformed(_) => AuthFailure::Malformed,
            SigV4Error::UnknownKey(_) => AuthFailure::UnknownKey,
            SigV4Error::ClockSkew { .. } => AuthFailure::Expired,
            SigV4Error::PayloadHashMismatch | SigV4Error::UnsignedPayload => {
                AuthFailure::PayloadHash
            }
            SigV4Error::SignatureMismatch => AuthFailure::Signature,
        }
    }
}

/// The caller, as far as the request head shows it.
#[derive(Debug)]
pub struct Identity {
    pub route: Arc<str>,
    /// SigV4: the signature still to check over the body.
    pending: Option<PendingSignature>,
}

#[derive(Debug)]
struct PendingSignature {
    /// When the head was checked: the body's verification judges the date by the same clock.
    checked_at: SystemTime,
    /// The caller's `SignedHeaders`.
    signed_headers: String,
}

impl Identity {
    /// For a SigV4 caller, the headers it signed (`SignedHeaders`, `;`-separated); `None` in the
    /// other modes.
    pub fn signed_headers(&self) -> Option<&str> {
        self.pending.as_ref().map(|p| p.signed_headers.as_str())
    }
}

/// Maps requests to route names.
#[derive(Debug)]
pub struct Authenticator {
    mode: AuthMode,
    default_route: Arc<str>,
    /// SigV4: access key id -> (secret, route).
    keys: HashMap<String, (Secret, Arc<str>)>,
    /// SigV4: the Regions a credential scope may name.
    regions: Vec<String>,
    /// Bearer: SHA-256 of the key -> route, scanned in full for every request.
    bearer: Vec<([u8; 32], Arc<str>)>,
    metrics: Arc<Metrics>,
}

impl Authenticator {
    pub fn new(auth: &AuthConfig, routes: &[RouteConfig], metrics: Arc<Metrics>) -> Self {
        let keys = routes
            .iter()
            .filter_map(|r| {
                let id = r.access_key_id.clone()?;
                let secret = r.secret_access_key.clone()?;
                Some((id, (secret, Arc::from(r.name.as_str()))))
            })
            .collect();
        let bearer = routes
            .iter()
            .filter_map(|r| Some((r.bearer_token_sha256?, Arc::from(r.name.as_str()))))
            .collect();
        for reason in AuthFailure::ALL {
            metrics
                .auth_failures
                .with_label_values(&[auth.mode.label(), reason.label()]);
        }
        Authenticator {
            mode: auth.mode,
            default_route: Arc::from(auth.default_route.as_str()),
            keys,
            regions: auth.regions.clone(),
            bearer,
            metrics,
        }
    }

    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// Identifies the caller of `operation` from the request head alone, before any body byte is
    /// read. In mode `sigv4` the signature itself is checked later, by
    /// [`Authenticator::verify_body`], and its credential scope must name `service` (`bedrock`,
    /// or `sagemaker` for an endpoint call).
    pub fn identify(
        &self,
        parts: &Parts,
        operation: Operation,
        service: &str,
    ) -> Result<Identity, BedrockError> {
        let known = |route: Arc<str>| Identity {
            route,
            pending: None,
        };
        let by_key = || {
            self.bearer_route(parts)
                .map(known)
                .map_err(|f| self.fail(f))
        };
        match self.mode {
            AuthMode::None => Ok(known(self.default_route.clone())),
            AuthMode::Bearer => by_key(),
            // The OpenAI and Anthropic SDKs send keys, not signatures.
            AuthMode::SigV4 if operation.model_in_body() && !is_signed(parts) => by_key(),
            AuthMode::SigV4 => self.signed_head(parts, SystemTime::now(), Payload::Body, service),
        }
    }

    /// Finishes identification once the body is read: a SigV4 caller's signature over the head
    /// and `body`. Nothing to do in the other modes.
    pub fn verify_body(
        &self,
        identity: &Identity,
        parts: &Parts,
        body: &[u8],
    ) -> Result<(), BedrockError> {
        let Some(pending) = &identity.pending else {
            return Ok(());
        };
        self.verify_signature(parts, pending.checked_at, Payload::Body, body)
            .map(|_| ())
    }

    /// Identifies the caller of an event-stream request (InvokeModelWithBidirectionalStream)
    /// from its head, which is all its own signature covers. In mode `sigv4` the head must be
    /// signed as [`Payload::EventStream`] says and its signature is checked at once; the
    /// [`ChainVerifier`] returned checks each event that follows. The other modes identify the
    /// caller as for any request, and return no verifier. `service` is the credential scope's
    /// service the caller must have signed for (`bedrock`).
    pub fn identify_stream(
        &self,
        parts: &Parts,
        service: &str,
    ) -> Result<(Identity, Option<ChainVerifier>), BedrockError> {
        if self.mode != AuthMode::SigV4 {
            return self
                .identify(
                    parts,
                    Operation::InvokeModelWithBidirectionalStream,
                    service,
                )
                .map(|identity| (identity, None));
        }
        let now = SystemTime::now();
        let identity = self.signed_head(parts, now, Payload::EventStream, service)?;
        let verifier = self.verify_signature(parts, now, Payload::EventStream, &[])?;
        Ok((identity, verifier))
    }

    /// Counts an input event of a stream that did not verify, and says so as vaguely as any
    /// other failed identification.
    pub fn event_refused(&self, e: &FrameSignatureError) -> BedrockError {
        tracing::debug!(error = %e, "event signature verification failed");
        let failure = match e {
            FrameSignatureError::Unsigned => AuthFailure::Missing,
            FrameSignatureError::Malformed(_) => AuthFailure::Malformed,
            FrameSignatureError::ClockSkew => AuthFailure::Expired,
            FrameSignatureError::Mismatch | FrameSignatureError::Broken => AuthFailure::Signature,
        };
        self.fail(failure)
    }

    /// Checks a SigV4 caller's signature (head checked at `checked_at`) over `body`; for an event
    /// stream, returns the verifier of the events, chained from this signature.
    fn verify_signature(
        &self,
        parts: &Parts,
        checked_at: SystemTime,
        payload: Payload,
        body: &[u8],
    ) -> Result<Option<ChainVerifier>, BedrockError> {
        let request = sigv4::SignedRequest {
            method: &parts.method,
            raw_path_and_query: raw_path_and_query(&parts.uri),
            authority: parts.uri.authority().map(|a| a.as_str()),
            headers: &parts.headers,
            body,
        };
        let verified =
            sigv4::SignedHead::check_for(&parts.headers, checked_at, payload).and_then(|head| {
                let (secret, _) = self
                    .keys
                    .get(head.auth.access_key_id)
                    .ok_or_else(|| SigV4Error::UnknownKey(head.auth.access_key_id.into()))?;
                head.verify(&request, &secret.0)?;
                let auth = &head.auth;
                Ok((payload == Payload::EventStream).then(|| {
                    ChainVerifier::new(secret.clone(), auth.region, auth.service, auth.signature)
                }))
            });
        verified.map_err(|e| self.sigv4_failed(&e))
    }

    /// Mode `sigv4`, head only: the header's shape and date, a known key, a scope we serve.
    fn signed_head(
        &self,
        parts: &Parts,
        now: SystemTime,
        payload: Payload,
        service: &str,
    ) -> Result<Identity, BedrockError> {
        let head = sigv4::SignedHead::check_for(&parts.headers, now, payload)
            .map_err(|e| self.sigv4_failed(&e))?;
        let auth = &head.auth;
        let (_, route) = self
            .keys
            .get(auth.access_key_id)
            .ok_or_else(|| self.sigv4_failed(&SigV4Error::UnknownKey(auth.access_key_id.into())))?;
        if auth.service != service || !self.regions.iter().any(|r| r == auth.region) {
            tracing::debug!(
                region = auth.region,
                service = auth.service,
                "SigV4 credential scope not served"
            );
            return Err(self.fail(AuthFailure::Scope));
        }
        Ok(Identity {
            route: route.clone(),
            pending: Some(PendingSignature {
                checked_at: now,
                signed_headers: auth.signed_headers.to_string(),
            }),
        })
    }

    fn sigv4_failed(&self, e: &SigV4Error) -> BedrockError {
        tracing::debug!(error = %e, "SigV4 verification failed");
        self.fail(AuthFailure::from(e))
    }

    fn bearer_route(&self, parts: &Parts) -> Result<Arc<str>, AuthFailure> {
        let token = presented_key(&parts.headers)?;
        let presented: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // Compare with every route's hash, without stopping at a match.
        let mut found = None;
        for (hash, route) in &self.bearer {
            if constant_time_eq(hash, &presented) {
                found = Some(route.clone());
            }
        }
        found.ok_or(AuthFailure::BadToken)
    }

    fn fail(&self, failure: AuthFailure) -> BedrockError {
        self.metrics
            .auth_failures
            .with_label_values(&[self.mode.label(), failure.label()])
            .inc();
        tracing::debug!(
            mode = self.mode.label(),
            reason = failure.label(),
            "request failed identification"
        );
        failure.error()
    }
}
