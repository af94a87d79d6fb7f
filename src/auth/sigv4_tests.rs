//! Tests for `sigv4.rs`: signatures made by `aws-sigv4` (what every AWS SDK signs with) verify,
//! and every way of departing from them is refused.

use super::*;
use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4::SigningParams;
use std::time::UNIX_EPOCH;

const PATH: &str = "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Ainference-profile%2Fus.anthropic.claude-sonnet-4-20250514-v1%3A0/converse";
const BODY: &[u8] = br#"{"messages":[{"role":"user","content":[{"text":"hi"}]}]}"#;

fn t0() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_767_225_600) // 2026-01-01T00:00:00Z
}

/// Signs like the SDK does and returns the headers to send.
fn signed(secret: &str, path_and_query: &str, body: &[u8], at: SystemTime) -> HeaderMap {
    signed_with(
        SigningSettings::default(),
        secret,
        path_and_query,
        SignableBody::Bytes(body),
        at,
    )
}

/// Signs with `settings` over `body` as `aws-sigv4` sees it.
fn signed_with(
    settings: SigningSettings,
    secret: &str,
    path_and_query: &str,
    body: SignableBody<'_>,
    at: SystemTime,
) -> HeaderMap {
    let identity = Credentials::new("AKIDTEST", secret, None, None, "test").into();
    let params = SigningParams::builder()
        .identity(&identity)
        .region("us-east-1")
        .name("bedrock")
        .time(at)
        .settings(settings)
        .build()
        .unwrap()
        .into();
    let base = [
        ("host", "127.0.0.1:8080"),
        ("content-type", "application/json"),
        ("x-custom", "  a   b  "),
    ];
    let uri = format!("http://127.0.0.1:8080{path_and_query}");
    let request = SignableRequest::new("POST", uri, base.into_iter(), body).unwrap();
    let (instructions, _) = sign(request, &params).unwrap().into_parts();
    let mut headers = HeaderMap::new();
    for (k, v) in base {
        headers.insert(k, v.parse().unwrap());
    }
    for (k, v) in instructions.headers() {
        headers.insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    headers
}

fn secrets(id: &str) -> Option<String> {
    (id == "AKIDTEST").then(|| "secret".to_string())
}

fn check(path: &str, headers: &HeaderMap, body: &[u8]) -> Result<VerifiedSignature, SigV4Error> {
    verify(&Method::POST, path, headers, body, secrets, t0())
}

#[test]
fn sdk_signatures_verify_for_an_encoded_arn_path_and_a_query() {
    let h = signed("secret", PATH, BODY, t0());
    let v = check(PATH, &h, BODY).unwrap();
    assert_eq!(v.access_key_id, "AKIDTEST");
    assert_eq!(v.region, "us-east-1");
    assert_eq!(v.service, "bedrock");

    let pq = "/async-invoke?maxResults=10&statusEquals=InProgress&nextToken=a%2Fb";
    let h = signed("secret", pq, b"", t0());
    check(pq, &h, b"").unwrap();
}

#[test]
fn http2_requests_without_host_use_the_authority() {
    let mut h = signed("secret", PATH, BODY, t0());
    h.remove("host");
    assert!(matches!(
        check(PATH, &h, BODY),
        Err(SigV4Error::Malformed(_))
    ));
    let ok = verify_with_authority(
        &Method::POST,
        PATH,
        Some("127.0.0.1:8080"),
        &h,
        BODY,
        secrets,
        t0(),
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn tampering_is_detected() {
    let h = signed("secret", PATH, BODY, t0());
    assert_eq!(
        check(PATH, &h, b"{}"),
        Err(SigV4Error::SignatureMismatch),
        "body changed, no x-amz-content-sha256"
    );
    let other = PATH.replace("converse", "converse-stream");
    assert_eq!(check(&other, &h, BODY), Err(SigV4Error::SignatureMismatch));
    let mut h2 = h.clone();
    h2.insert("content-type", "text/plain".parse().unwrap());
    assert_eq!(check(PATH, &h2, BODY), Err(SigV4Error::SignatureMismatch));
    let mut h3 = h.clone();
    h3.insert(
        "x-amz-content-sha256",
        hex::encode(Sha256::digest(b"x")).parse().unwrap(),
    );
    assert_eq!(check(PATH, &h3, BODY), Err(SigV4Error::PayloadHashMismatch));
    let wrong = signed("not-the-secret", PATH, BODY, t0());
    assert_eq!(
        check(PATH, &wrong, BODY),
        Err(SigV4Error::SignatureMismatch)
    );
}

#[test]
fn unknown_keys_skew_and_garbage_are_refused() {
    let h = signed("secret", PATH, BODY, t0());
    let none = |_: &str| None;
    assert_eq!(
        verify(&Method::POST, PATH, &h, BODY, none, t0()),
        Err(SigV4Error::UnknownKey("AKIDTEST".into()))
    );
    let late = signed("secret", PATH, BODY, t0() - Duration::from_secs(600));
    assert!(matches!(
        check(PATH, &late, BODY),
        Err(SigV4Error::ClockSkew { .. })
    ));
    let early = signed("secret", PATH, BODY, t0() + Duration::from_secs(600));
    assert!(matches!(
        check(PATH, &early, BODY),
        Err(SigV4Error::ClockSkew { .. })
    ));
    let near = signed("secret", PATH, BODY, t0() - Duration::from_secs(240));
    assert!(check(PATH, &near, BODY).is_ok());

    assert_eq!(
        check(PATH, &HeaderMap::new(), BODY),
        Err(SigV4Error::Missing)
    );
    for bad in [
        "Bearer abc",
        "AWS4-HMAC-SHA256 Credential=AKID/2026/us-east-1/bedrock/aws4_request, SignedHeaders=host, Signature=00",
        "AWS4-HMAC-SHA256 SignedHeaders=host, Signature=00",
        "AWS4-HMAC-SHA256 garbage",
    ] {
        let mut h = h.clone();
        h.insert("authorization", bad.parse().unwrap());
        assert!(
            matches!(check(PATH, &h, BODY), Err(SigV4Error::Malformed(_))),
            "{bad}"
        );
    }
}

#[test]
fn helpers() {
    assert_eq!(normalize_path("/a/./b/../c//d"), "/a/c/d");
    assert_eq!(
        canonical_query("b=2&a=1&a=0&c=x%2Fy"),
        "a=0&a=1&b=2&c=x%2Fy"
    );
    assert_eq!(trim_all("  a   b "), "a b");
    assert!(constant_time_eq(b"ab", b"ab") && !constant_time_eq(b"ab", b"ac"));
}

/// What AWS itself refuses is refused, each before the signature is even computed: a body left
/// unsigned (`UNSIGNED-PAYLOAD`, `STREAMING-*`), and `host` or `x-amz-date` left out of the
/// signature (so they could be changed in flight).
#[test]
fn unsigned_bodies_and_unsigned_host_or_date_are_refused() {
    use aws_sigv4::http_request::PayloadChecksumKind;
    let mut with_hash = SigningSettings::default();
    with_hash.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    // A declared hash that is the body's own is fine.
    let h = signed_with(
        with_hash.clone(),
        "secret",
        PATH,
        SignableBody::Bytes(BODY),
        t0(),
    );
    assert!(h.contains_key("x-amz-content-sha256"));
    check(PATH, &h, BODY).unwrap();
    // UNSIGNED-PAYLOAD: a valid signature that says nothing about the body.
    let h = signed_with(
        with_hash.clone(),
        "secret",
        PATH,
        SignableBody::UnsignedPayload,
        t0(),
    );
    assert_eq!(h["x-amz-content-sha256"], "UNSIGNED-PAYLOAD");
    assert_eq!(check(PATH, &h, b"{}"), Err(SigV4Error::UnsignedPayload));
    let mut streaming = h.clone();
    streaming.insert(
        "x-amz-content-sha256",
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD".parse().unwrap(),
    );
    assert_eq!(
        check(PATH, &streaming, BODY),
        Err(SigV4Error::UnsignedPayload)
    );
    for left_out in ["host", "x-amz-date"] {
        let mut settings = SigningSettings::default();
        settings
            .excluded_headers
            .get_or_insert_with(Vec::new)
            .push(left_out.into());
        let h = signed_with(settings, "secret", PATH, SignableBody::Bytes(BODY), t0());
        let auth = h["authorization"].to_str().unwrap();
        assert!(!auth.contains(&format!("{left_out};")), "{auth}");
        assert_eq!(
            check(PATH, &h, BODY),
            Err(SigV4Error::Malformed(format!(
                "SignedHeaders must include {left_out}"
            ))),
        );
    }
}

/// The head checks alone (no body, no secret) refuse what they can, and pass what is only wrong
/// in its body; the scope is returned for the caller to check.
#[test]
fn the_head_is_checked_before_the_body() {
    let h = signed("secret", PATH, BODY, t0());
    let head = SignedHead::check(&h, t0()).unwrap();
    assert_eq!(
        (head.auth.access_key_id, head.auth.region, head.auth.service),
        ("AKIDTEST", "us-east-1", "bedrock")
    );
    let request = SignedRequest {
        method: &Method::POST,
        raw_path_and_query: PATH,
        authority: None,
        headers: &h,
        body: b"{}",
    };
    assert_eq!(
        head.verify(&request, "secret"),
        Err(SigV4Error::SignatureMismatch)
    );
    let late = signed("secret", PATH, BODY, t0() - Duration::from_secs(600));
    assert!(matches!(
        SignedHead::check(&late, t0()),
        Err(SigV4Error::ClockSkew { .. })
    ));
}

/// An event stream's head: signed over no payload (aws-sdk-rust) or over the events marker, and
/// only when the caller asks for [`Payload::EventStream`].
#[test]
fn an_event_stream_head_is_signed_without_its_body() {
    use aws_sigv4::http_request::PayloadChecksumKind;
    const STREAM: &str = "/model/amazon.nova-sonic-v1%3A0/invoke-with-bidirectional-stream";
    let stream_check = |headers: &HeaderMap, body: &[u8]| {
        let request = SignedRequest {
            method: &Method::POST,
            raw_path_and_query: STREAM,
            authority: None,
            headers,
            body,
        };
        SignedHead::check_for(headers, t0(), Payload::EventStream)?.verify(&request, "secret")
    };
    let empty = signed("secret", STREAM, b"", t0());
    assert!(stream_check(&empty, b"").is_ok());
    // The events that follow are not the body the head's signature covers.
    assert!(stream_check(&empty, b"events").is_ok());

    let mut with_hash = SigningSettings::default();
    with_hash.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    let marked = signed_with(
        with_hash.clone(),
        "secret",
        STREAM,
        SignableBody::Precomputed(STREAMING_EVENTS.into()),
        t0(),
    );
    assert_eq!(marked["x-amz-content-sha256"], STREAMING_EVENTS);
    assert!(stream_check(&marked, b"").is_ok());
    assert_eq!(
        check(STREAM, &marked, b""),
        Err(SigV4Error::UnsignedPayload),
        "the events marker is refused for a whole-body operation"
    );
    let mut other = marked.clone();
    other.insert(
        "x-amz-content-sha256",
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER".parse().unwrap(),
    );
    assert_eq!(stream_check(&other, b""), Err(SigV4Error::UnsignedPayload));
    let wrong = signed("not-the-secret", STREAM, b"", t0());
    assert_eq!(
        stream_check(&wrong, b""),
        Err(SigV4Error::SignatureMismatch)
    );
}

#[test]
fn hex_lower_is_the_hex_crate_s_encoding() {
    let every_byte: Vec<u8> = (0..=255).collect();
    assert_eq!(hex_lower(&every_byte), hex::encode(&every_byte));
    assert_eq!(hex_lower(&[]), "");
    assert_eq!(
        sha256_hex(b""),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "the empty payload's hash, as AWS documents it"
    );
}
