//! Who may call: SigV4 (service `bedrock`) or a Bedrock API key, as `bedrock-runtime` accepts.
//!
//! - With neither `verify_sigv4` nor `api_keys` set, every request is accepted (key ids seen are
//!   recorded either way).
//! - `Authorization: Bearer KEY` or `x-api-key: KEY` (the Anthropic SDK's header) is checked
//!   against `api_keys` when that is set; with only `verify_sigv4` set it is refused like any
//!   request that is not signed with that key (as before API keys were simulated).
//! - Anything else is SigV4-verified with `verify_sigv4` when that is set, and must be signed for
//!   the service `bedrock`.
//! - InvokeModelWithBidirectionalStream takes SigV4 only (V): a bearer or `x-api-key` request
//!   is refused with 403 whatever is configured. Its head is signed without its body (an empty
//!   payload, or `STREAMING-AWS4-HMAC-SHA256-EVENTS`); with `verify_sigv4` set, [`check_stream`]
//!   verifies it and returns the verifier of the events that follow, chained from its signature.
//!
//! Refusals are 403s in Bedrock's shape; the body-model APIs reshape them into their own.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use http::header;
use http::request::Parts;

use super::Inner;
use super::stats::ApiKeyStats;
use crate::auth::event_stream::ChainVerifier;
use crate::auth::sigv4::{self, Payload, SigV4Error, SignedHead};
use crate::bedrock::error::X_AMZN_ERROR_TYPE;
use crate::bedrock::{BedrockError, ErrorCode};
use crate::config::Secret;

/// Bearer and `x-api-key` counters.
#[derive(Debug, Default)]
pub(crate) struct ApiKeyCounters {
    seen: AtomicU64,
    accepted: AtomicU64,
    rejected: AtomicU64,
}

impl ApiKeyCounters {
    pub fn snapshot(&self) -> ApiKeyStats {
        ApiKeyStats {
            seen: self.seen.load(Relaxed),
            accepted: self.accepted.load(Relaxed),
            rejected: self.rejected.load(Relaxed),
        }
    }
}

/// The API key a request carries, if any.
fn api_key(parts: &Parts) -> Option<&str> {
    let bearer = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    bearer.or_else(|| parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// Checks the request's credential; `body` is what the payload hash covers.
pub(crate) fn check(sim: &Inner, parts: &Parts, body: &[u8]) -> Result<(), BedrockError> {
    check_as(sim, parts, body, Payload::Body, "bedrock").map(|_| ())
}

/// [`check`] for a request that must be signed for `service` (`sagemaker` for endpoints).
pub(crate) fn check_for(
    sim: &Inner,
    parts: &Parts,
    body: &[u8],
    service: &str,
) -> Result<(), BedrockError> {
    check_as(sim, parts, body, Payload::Body, service).map(|_| ())
}

/// Checks a bidirectional stream's head (SigV4 only); with `verify_sigv4` set, returns the
/// verifier of its events.
pub(crate) fn check_stream(
    sim: &Inner,
    parts: &Parts,
) -> Result<Option<ChainVerifier>, BedrockError> {
    check_as(sim, parts, &[], Payload::EventStream, "bedrock")
}

fn check_as(
    sim: &Inner,
    parts: &Parts,
    body: &[u8],
    payload: Payload,
    service: &str,
) -> Result<Option<ChainVerifier>, BedrockError> {
    let sigv4_only = payload == Payload::EventStream;
    let authorization = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    sim.sigv4.observe(authorization);
    if let Some(key) = api_key(parts) {
        sim.api_keys.seen.fetch_add(1, Relaxed);
        if sigv4_only {
            sim.api_keys.rejected.fetch_add(1, Relaxed);
            return Err(BedrockError::new(
                ErrorCode::AccessDenied,
                "InvokeModelWithBidirectionalStream accepts only SigV4-signed requests, not API keys.",
            ));
        }
        if !sim.config.api_keys.is_empty() {
            let accepted = sim.config.api_keys.iter().any(|k| k == key);
            let counter = if accepted {
                &sim.api_keys.accepted
            } else {
                &sim.api_keys.rejected
            };
            counter.fetch_add(1, Relaxed);
            return match accepted {
                true => Ok(None),
                false => Err(BedrockError::new(
                    ErrorCode::AccessDenied,
                    "The API key in the request is not valid. Check the Bedrock API key you sent.",
                )),
            };
        }
    }
    let Some(key) = sim.config.verify_sigv4.as_ref() else {
        if sim.config.api_keys.is_empty() {
            return Ok(None);
        }
        // Only API keys are configured: a request must carry one.
        return Err(
            BedrockError::new(ErrorCode::AccessDenied, "Missing Authentication Token")
                .with_header(X_AMZN_ERROR_TYPE, "MissingAuthenticationTokenException"),
        );
    };
    let request = sigv4::SignedRequest {
        method: &parts.method,
        raw_path_and_query: parts.uri.path_and_query().map_or("/", |p| p.as_str()),
        authority: parts.uri.authority().map(|a| a.as_str()),
        headers: &parts.headers,
        body,
    };
    let result = SignedHead::check_for(&parts.headers, std::time::SystemTime::now(), payload)
        .and_then(|head| {
            let auth = &head.auth;
            if auth.access_key_id != key.access_key_id {
                return Err(SigV4Error::UnknownKey(auth.access_key_id.to_string()));
            }
            head.verify(&request, &key.secret_access_key)?;
            // Signed for another service (e.g. `bedrock-runtime`): refused, as AWS refuses it.
            if auth.service != service {
                return Err(SigV4Error::Malformed(format!(
                    "Credential should be scoped to correct service: '{service}', not '{}'.",
                    auth.service
                )));
            }
            let secret = Secret(key.secret_access_key.clone());
            Ok((payload == Payload::EventStream)
                .then(|| ChainVerifier::new(secret, auth.region, auth.service, auth.signature)))
        });
    sim.sigv4.record(result.is_ok());
    result.map_err(refusal)
}

/// The 403 for a request whose signature does not verify.
fn refusal(e: SigV4Error) -> BedrockError {
    match e {
        SigV4Error::Missing => {
            BedrockError::new(ErrorCode::AccessDenied, "Missing Authentication Token")
                .with_header(X_AMZN_ERROR_TYPE, "MissingAuthenticationTokenException")
        }
        SigV4Error::UnknownKey(_) => BedrockError::new(
            ErrorCode::UnrecognizedClient,
            "The security token included in the request is invalid.",
        ),
        SigV4Error::SignatureMismatch => BedrockError::new(
            ErrorCode::AccessDenied,
            "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.",
        )
        .with_header(X_AMZN_ERROR_TYPE, "InvalidSignatureException"),
        other => BedrockError::new(ErrorCode::AccessDenied, other.to_string())
            .with_header(X_AMZN_ERROR_TYPE, "InvalidSignatureException"),
    }
}
