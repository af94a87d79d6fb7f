//! SigV4 verification: the configured key, for the service `bedrock`; key ids are recorded.

use aws_sdk_bedrockruntime::error::ProvideErrorMetadata;
use tokengate::simulator::SimulatorHandle;

use super::{SONNET, client, instant_config, post, post_with, start, user, verifying};
use crate::common::signing::{Signing, signed_headers};

#[tokio::test]
async fn sigv4_verification() {
    let sim = start(verifying(instant_config())).await;
    let arn_profile =
        format!("arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.{SONNET}");
    client(&sim, "secret")
        .converse()
        .model_id(arn_profile)
        .messages(user("signed"))
        .send()
        .await
        .unwrap();
    let err = client(&sim, "wrong")
        .converse()
        .model_id(SONNET)
        .messages(user("signed"))
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 403);
    assert_eq!(err.code(), Some("InvalidSignatureException"));

    let stats = sim.simulator.stats().sigv4;
    assert_eq!(
        (
            stats.verified,
            stats.rejected,
            stats.authorization_headers_seen
        ),
        (1, 1, 2)
    );
    assert!(stats.access_key_ids.contains("AKIDTEST"));
    // Unsigned requests are refused too.
    let (status, _, _) = post(&sim, &format!("/model/{SONNET}/converse"), b"{}").await;
    assert_eq!(status, 403);
    // So is a signature with the right key for another service.
    let path = format!("/model/{SONNET}/converse");
    let body = br#"{"messages":[{"role":"user","content":[{"text":"x"}]}]}"#;
    for (service, expected) in [("bedrock", 200), ("bedrock-runtime", 403)] {
        let headers = signed_for(&sim, service, &path, body);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let (status, _, bytes) = post_with(&sim, &path, &headers, body).await;
        assert_eq!(
            status,
            expected,
            "{service}: {}",
            String::from_utf8_lossy(&bytes)
        );
    }
}

/// SigV4 headers for a POST of `body` to `path`, signed with the test key for `service`.
fn signed_for(
    sim: &SimulatorHandle,
    service: &str,
    path: &str,
    body: &[u8],
) -> Vec<(String, String)> {
    let signing = Signing {
        service,
        ..Signing::new("AKIDTEST", "secret")
    };
    signed_headers(signing, &sim.addr.to_string(), path, body, &[])
}
