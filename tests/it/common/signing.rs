//! Requests signed as the AWS SDKs sign them (`aws-sigv4`, every SDK's signer), for tests that
//! send raw HTTP: a signature that verifies, or one bent the way a test needs (another Region or
//! service, an old date, headers left unsigned through `settings`).

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::{
    http_request::{SignableBody, SignableRequest, SigningSettings, sign},
    sign::v4::SigningParams,
};

/// How to sign.
pub struct Signing<'a> {
    pub key_id: &'a str,
    pub secret: &'a str,
    pub region: &'a str,
    pub service: &'a str,
    pub at: SystemTime,
    pub settings: SigningSettings,
}

impl<'a> Signing<'a> {
    /// Signing with this key pair for `bedrock` in us-east-1, now, with the SDKs' settings.
    pub fn new(key_id: &'a str, secret: &'a str) -> Signing<'a> {
        Signing {
            key_id,
            secret,
            region: "us-east-1",
            service: "bedrock",
            at: SystemTime::now(),
            settings: SigningSettings::default(),
        }
    }
}

/// The headers of a POST of `body` to `path` on `host`: `host`, `content-type:
/// application/json`, `headers`, and the signature.
pub fn signed_headers(
    s: Signing<'_>,
    host: &str,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Vec<(String, String)> {
    let identity = Credentials::new(s.key_id, s.secret, None, None, "tests").into();
    let params = SigningParams::builder()
        .identity(&identity)
        .region(s.region)
        .name(s.service)
        .time(s.at)
        .settings(s.settings)
        .build()
        .expect("signing params")
        .into();
    let mut base = vec![("host", host), ("content-type", "application/json")];
    base.extend_from_slice(headers);
    let request = SignableRequest::new(
        "POST",
        format!("http://{host}{path}"),
        base.iter().copied(),
        SignableBody::Bytes(body),
    )
    .expect("signable request");
    let (instructions, _) = sign(request, &params).expect("sign").into_parts();
    base.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain(
            instructions
                .headers()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        )
        .collect()
}
