//! Step 2: who is calling. Every auth mode names the caller's route from the request head, before
//! any body byte is read ([`crate::auth::Authenticator::identify`]); in `sigv4` the signature is
//! then checked over head and body. A route name the policy does not know is refused.
//!
//! The caller's call is a retry (it may use the pool's retry reserve) only if the SDK says so
//! (`amz-sdk-request: attempt=N`, N > 1) and this proxy turned the same invocation away
//! ([`crate::admission::retries`]).

use std::time::Instant;

use http::{HeaderMap, request::Parts};

use crate::{
    admission::{Caller, retries::RecentRejections},
    answer,
    auth::Identity,
    bedrock::{BedrockError, Operation},
    state::Policy,
    upstream::{SAGEMAKER_SIGNING_NAME, signer::SIGNING_NAME},
};

/// Who is calling `operation`, from the head alone; a SigV4 caller must have signed for the
/// operation's service (`bedrock`, or `sagemaker` for an endpoint call).
pub fn identify_head(
    policy: &Policy,
    parts: &Parts,
    operation: Operation,
) -> Result<Identity, BedrockError> {
    let service = if operation.is_endpoint() {
        SAGEMAKER_SIGNING_NAME
    } else {
        SIGNING_NAME
    };
    policy.auth.identify(parts, operation, service)
}

/// The caller, once the body is read: a SigV4 signature checked over it, the route looked up, and
/// whether this is a retry of a call turned away.
pub fn identify(
    policy: &Policy,
    identity: &Identity,
    parts: &Parts,
    body: &[u8],
    rejections: &RecentRejections,
) -> Result<Caller, BedrockError> {
    policy.auth.verify_body(identity, parts, body)?;
    caller_of(policy, identity, parts, rejections)
}

/// The caller of an identified request (its signature, if any, checked already): the route
/// looked up, and whether this is a retry of a call turned away.
pub fn caller_of(
    policy: &Policy,
    identity: &Identity,
    parts: &Parts,
    rejections: &RecentRejections,
) -> Result<Caller, BedrockError> {
    let route = policy
        .admission
        .routes()
        .get(&identity.route)
        .cloned()
        .ok_or_else(answer::no_route)?;
    let retry = sdk_attempt(&parts.headers) > 1
        && invocation_id(&parts.headers)
            .is_some_and(|id| rejections.take(&route.name, id, Instant::now()));
    Ok(Caller { route, retry })
}

/// A call's `amz-sdk-invocation-id`, if it sent one.
pub fn invocation_id(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("amz-sdk-invocation-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|id| !id.is_empty())
}

/// The attempt number from `amz-sdk-request: attempt=N; max=M` (1 when absent or unreadable).
pub fn sdk_attempt(headers: &HeaderMap) -> u32 {
    headers
        .get("amz-sdk-request")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.split(';')
                .filter_map(|part| part.trim().strip_prefix("attempt="))
                .find_map(|n| n.trim().parse::<u32>().ok())
        })
        .unwrap_or(1)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempt_from_the_sdk_header() {
        let mut h = HeaderMap::new();
        assert_eq!(sdk_attempt(&h), 1);
        h.insert("amz-sdk-request", "attempt=3; max=5".parse().unwrap());
        assert_eq!(sdk_attempt(&h), 3);
        h.insert(
            "amz-sdk-request",
            "ttl=20240101T000000Z; attempt=2; max=3".parse().unwrap(),
        );
        assert_eq!(sdk_attempt(&h), 2);
        h.insert("amz-sdk-request", "attempt=zero".parse().unwrap());
        assert_eq!(sdk_attempt(&h), 1);
    }

    #[test]
    fn the_invocation_id_from_the_sdk_header() {
        let mut h = HeaderMap::new();
        assert_eq!(invocation_id(&h), None);
        h.insert("amz-sdk-invocation-id", " abc ".parse().unwrap());
        assert_eq!(invocation_id(&h), Some("abc"));
    }
}
