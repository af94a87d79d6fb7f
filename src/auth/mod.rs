//! Caller identity: which application route a request belongs to (`[auth] mode`).
//!
//! - `none`: every request is the default route (a sidecar on loopback).
//! - `bearer`: `Authorization: Bearer <key>`, as SDKs send `AWS_BEARER_TOKEN_BEDROCK`. The config
//!   holds each route's key as a SHA-256; the presented key is hashed and compared with every
//!   route's hash in constant time.
//! - `sigv4`: the SDK signs with a key pair the proxy issued to the route; [`sigv4`] verifies the
//!   signature exactly as AWS would (double-encoded path, `host` or HTTP/2 `:authority`, ±5
//!   minutes, payload hash), comparing in constant time.
//!
//! A request that fails gets a 403 that does not say which part failed: `UnrecognizedClientException`
//! for an access key id the proxy never issued (what AWS answers), `AccessDeniedException`
//! otherwise. The reason is counted in `tokengate_auth_failures_total{mode,reason}` and logged at
//! debug level.

pub mod sigv4;

use std::{collections::HashMap, sync::Arc, time::SystemTime};

use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::{
    bedrock::{BedrockError, ErrorCode},
    config::{AuthConfig, AuthMode, RouteConfig, Secret},
    metrics::Metrics,
};
use sigv4::{SigV4Error, constant_time_eq};

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
}

impl AuthFailure {
    pub const ALL: [AuthFailure; 7] = [
        AuthFailure::Missing,
        AuthFailure::Malformed,
        AuthFailure::UnknownKey,
        AuthFailure::Expired,
        AuthFailure::Signature,
        AuthFailure::PayloadHash,
        AuthFailure::BadToken,
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

impl From<&SigV4Error> for AuthFailure {
    fn from(e: &SigV4Error) -> Self {
        match e {
            SigV4Error::Missing => AuthFailure::Missing,
            SigV4Error::Malformed(_) => AuthFailure::Malformed,
            SigV4Error::UnknownKey(_) => AuthFailure::UnknownKey,
            SigV4Error::ClockSkew { .. } => AuthFailure::Expired,
            SigV4Error::PayloadHashMismatch => AuthFailure::PayloadHash,
            SigV4Error::SignatureMismatch => AuthFailure::Signature,
        }
    }
}

/// Maps requests to route names.
#[derive(Debug)]
pub struct Authenticator {
    mode: AuthMode,
    default_route: Arc<str>,
    /// SigV4: access key id -> (secret, route).
    keys: HashMap<String, (Secret, Arc<str>)>,
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
            bearer,
            metrics,
        }
    }

    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// Identifies from the request head alone: `Some` in modes `none` and `bearer`; `None` when
    /// the body is needed too (`sigv4`: [`Authenticator::identify_signed`]).
    pub fn identify_head(&self, parts: &Parts) -> Option<Result<Arc<str>, BedrockError>> {
        match self.mode {
            AuthMode::None => Some(Ok(self.default_route.clone())),
            AuthMode::Bearer => Some(self.bearer_route(parts).map_err(|f| self.fail(f))),
            AuthMode::SigV4 => None,
        }
    }

    /// Verifies the SDK's SigV4 signature over the head and `body`; its credential scope must
    /// name `service` (`bedrock`, or `sagemaker` for an endpoint call), as AWS requires.
    pub fn identify_signed(
        &self,
        parts: &Parts,
        body: &[u8],
        service: &str,
    ) -> Result<Arc<str>, BedrockError> {
        let path_and_query = parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |p| p.as_str());
        let authority = parts.uri.authority().map(|a| a.as_str());
        let verified = sigv4::verify_with_authority(
            &parts.method,
            path_and_query,
            authority,
            &parts.headers,
            body,
            |key| self.keys.get(key).map(|(secret, _)| secret.0.clone()),
            SystemTime::now(),
        )
        .map_err(|e| {
            tracing::debug!(error = %e, "SigV4 verification failed");
            self.fail(AuthFailure::from(&e))
        })?;
        if verified.service != service {
            tracing::debug!(signed = %verified.service, expected = service, "SigV4 scope names another service");
            return Err(self.fail(AuthFailure::Malformed));
        }
        self.keys
            .get(&verified.access_key_id)
            .map(|(_, route)| route.clone())
            .ok_or_else(|| self.fail(AuthFailure::UnknownKey))
    }

    fn bearer_route(&self, parts: &Parts) -> Result<Arc<str>, AuthFailure> {
        let value = parts
            .headers
            .get(http::header::AUTHORIZATION)
            .ok_or(AuthFailure::Missing)?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .filter(|t| !t.is_empty())
            .ok_or(AuthFailure::Malformed)?;
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
