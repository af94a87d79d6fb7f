//! Step 2: who is calling. The caller's route comes from the request head in auth modes `none`
//! and `bearer`, and from the SDK's own SigV4 signature, over the head and the body, in `sigv4`
//! ([`crate::auth`]). A route name the policy does not know is refused.

use std::sync::Arc;

use http::{HeaderMap, request::Parts};

use crate::{admission::Caller, answer, bedrock::BedrockError, state::Policy};

/// The route named by the head alone, when the auth mode needs no body.
pub fn identify_head(policy: &Policy, parts: &Parts) -> Result<Option<Arc<str>>, BedrockError> {
    policy.auth.identify_head(parts).transpose()
}

/// The caller: the route named by the head, or verified from the signed request (signed for
/// `service`: `bedrock`, or `sagemaker` for an endpoint call).
pub fn identify(
    policy: &Policy,
    from_head: Option<Arc<str>>,
    parts: &Parts,
    body: &[u8],
    service: &str,
) -> Result<Caller, BedrockError> {
    let name = match from_head {
        Some(name) => name,
        None => policy.auth.identify_signed(parts, body, service)?,
    };
    let route = policy
        .admission
        .routes()
        .get(&name)
        .cloned()
        .ok_or_else(answer::no_route)?;
    Ok(Caller {
        route,
        retry: sdk_attempt(&parts.headers) > 1,
    })
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
}
