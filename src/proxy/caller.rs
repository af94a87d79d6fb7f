//! Step 2: who is calling. Every auth mode names the caller's route from the request head, before
//! any body byte is read ([`crate::auth::Authenticator::identify`]); in `sigv4` the signature is
//! then checked over head and body. A route name the policy does not know is refused.
//!
//! The caller's call is a retry (it may use the pool's retry reserve) only if the SDK says so
//! (`amz-sdk-request: attempt=N`, N > 1; `x-stainless-retry-count: N`, N > 0) and this proxy
//! turned the same call away ([`crate::admission::retries`]).

use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, request::Parts};

use crate::{
    admission::{
        Caller,
        retries::{CallId, RecentRejections},
    },
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
/// whether this is a retry of `call` turned away.
pub fn identify(
    policy: &Policy,
    identity: &Identity,
    parts: &Parts,
    body: &[u8],
    call: Option<&CallId>,
    rejections: &RecentRejections,
) -> Result<Caller, BedrockError> {
    policy.auth.verify_body(identity, parts, body)?;
    caller_of(policy, identity, parts, call, rejections)
}

/// The caller of an identified request (its signature, if any, checked already): the route
/// looked up, and whether this is a retry of `call` turned away.
pub fn caller_of(
    policy: &Policy,
    identity: &Identity,
    parts: &Parts,
    call: Option<&CallId>,
    rejections: &RecentRejections,
) -> Result<Caller, BedrockError> {
    let route = policy
        .admission
        .routes()
        .get(&identity.route)
        .cloned()
        .ok_or_else(answer::no_route)?;
    let retry = call.is_some_and(|call| {
        says_retry(&parts.headers, call) && rejections.take(&route.name, call, Instant::now())
    });
    Ok(Caller { route, retry })
}

/// What names this call across its SDK's attempts: its `amz-sdk-invocation-id`; else, from an SDK
/// that counts its retries in `x-stainless-retry-count` (OpenAI's and Anthropic's), its `body`,
/// which every attempt repeats. `None` for a call no retry could be told from.
pub fn call_id(headers: &HeaderMap, body: Option<&Bytes>) -> Option<CallId> {
    if let Some(id) = invocation_id(headers) {
        return Some(CallId::Invocation(id.to_owned()));
    }
    let counted = headers.contains_key(STAINLESS_RETRY_COUNT);
    body.filter(|body| counted && !body.is_empty())
        .map(|body| CallId::Body(body.clone()))
}

/// Whether the SDK says this attempt is a retry, in the header that goes with how `call` is named.
fn says_retry(headers: &HeaderMap, call: &CallId) -> bool {
    match call {
        CallId::Invocation(_) => sdk_attempt(headers) > 1,
        CallId::Body(_) => stainless_retries(headers) > 0,
    }
}

/// The OpenAI and Anthropic SDKs' count of retries taken before this attempt.
const STAINLESS_RETRY_COUNT: &str = "x-stainless-retry-count";

/// The retries taken before this attempt, from `x-stainless-retry-count: N` (0 when absent or
/// unreadable).
fn stainless_retries(headers: &HeaderMap) -> u32 {
    headers
        .get(STAINLESS_RETRY_COUNT)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
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

    #[test]
    fn a_call_is_named_by_its_id_else_by_its_body_when_its_sdk_counts_retries() {
        let body = Bytes::from_static(b"{\"messages\":[]}");
        let mut h = HeaderMap::new();
        assert_eq!(call_id(&h, Some(&body)), None, "no id, no retry count");
        h.insert(STAINLESS_RETRY_COUNT, "0".parse().unwrap());
        let by_body = call_id(&h, Some(&body)).unwrap();
        assert_eq!(by_body, CallId::Body(body.clone()));
        assert!(!says_retry(&h, &by_body), "a first attempt");
        h.insert(STAINLESS_RETRY_COUNT, "2".parse().unwrap());
        assert!(says_retry(&h, &by_body));
        assert_eq!(call_id(&h, Some(&Bytes::new())), None, "an empty body");
        assert_eq!(call_id(&h, None), None, "a body never read");
        h.insert(STAINLESS_RETRY_COUNT, "two".parse().unwrap());
        assert!(!says_retry(&h, &by_body), "unreadable");
        h.insert("amz-sdk-invocation-id", "abc".parse().unwrap());
        let by_id = call_id(&h, Some(&body)).unwrap();
        assert_eq!(by_id, CallId::Invocation("abc".into()));
        h.insert(STAINLESS_RETRY_COUNT, "3".parse().unwrap());
        assert!(!says_retry(&h, &by_id), "an id goes with amz-sdk-request");
        h.insert("amz-sdk-request", "attempt=2; max=3".parse().unwrap());
        assert!(says_retry(&h, &by_id));
    }
}
