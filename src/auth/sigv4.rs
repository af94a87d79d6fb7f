//! SigV4 signature verification (`AWS4-HMAC-SHA256` in the `Authorization` header).
//!
//! Rebuilds the canonical request exactly as `aws-sigv4` (what every AWS SDK signs with) builds
//! it for a non-S3 service, then compares signatures in constant time:
//!
//! - **Canonical URI**: the raw path as received (already percent-encoded by the SDK), dot
//!   segments removed, then percent-encoded *again* (`%3A` becomes `%253A`): SigV4 double-encodes
//!   for every service but S3.
//! - **Canonical query**: pairs decoded, re-encoded, sorted.
//! - **Canonical headers**: exactly the `SignedHeaders`, lowercase names, values trimmed with
//!   inner runs of spaces collapsed, repeated headers joined with `,`. Over HTTP/2 there is no
//!   `host` header; pass the request URI's authority to [`verify_with_authority`].
//! - **Payload hash**: `x-amz-content-sha256` when present (it must match the body unless it is
//!   `UNSIGNED-PAYLOAD` or a streaming marker), else the SHA-256 of the body.
//! - **Time**: `X-Amz-Date` within ±5 minutes of `now`, and its day equal to the credential
//!   scope's.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sigv4::sign::v4::{calculate_signature, generate_signing_key};
use http::{HeaderMap, Method};
use percent_encoding::{AsciiSet, CONTROLS, percent_decode_str, utf8_percent_encode};
use sha2::{Digest, Sha256};

const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// Largest accepted difference between the request's `X-Amz-Date` and our clock.
pub const MAX_SKEW: Duration = Duration::from_secs(5 * 60);

/// Exactly the characters `aws-smithy-http` percent-encodes (its `BASE_SET`), minus `/` for paths.
const QUERY_SET: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'/')
    .add(b':')
    .add(b',')
    .add(b'?')
    .add(b'#')
    .add(b'[')
    .add(b']')
    .add(b'{')
    .add(b'}')
    .add(b'|')
    .add(b'@')
    .add(b'!')
    .add(b'$')
    .add(b'&')
    .add(b'\'')
    .add(b'(')
    .add(b')')
    .add(b'*')
    .add(b'+')
    .add(b';')
    .add(b'=')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'"')
    .add(b'^')
    .add(b'`')
    .add(b'\\');
const PATH_SET: &AsciiSet = &QUERY_SET.remove(b'/');

/// Who signed a request that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedSignature {
    pub access_key_id: String,
    pub region: String,
    pub service: String,
}

/// Why a request's signature does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SigV4Error {
    #[error("the request carries no Authorization header")]
    Missing,
    #[error("malformed SigV4 authorization: {0}")]
    Malformed(String),
    #[error("the access key id {0:?} is not known")]
    UnknownKey(String),
    #[error(
        "signature expired or not yet valid: X-Amz-Date {amz_date} is more than 5 minutes from the server's time"
    )]
    ClockSkew { amz_date: String },
    #[error("x-amz-content-sha256 does not match the SHA-256 of the body")]
    PayloadHashMismatch,
    #[error("the request signature does not match the signature computed for it")]
    SignatureMismatch,
}

/// The parts of an `Authorization: AWS4-HMAC-SHA256 ...` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorization<'a> {
    pub access_key_id: &'a str,
    pub date: &'a str,
    pub region: &'a str,
    pub service: &'a str,
    pub signed_headers: &'a str,
    pub signature: &'a str,
}

impl<'a> Authorization<'a> {
    /// Parses the header value.
    pub fn parse(value: &'a str) -> Result<Authorization<'a>, SigV4Error> {
        let malformed = |m: &str| SigV4Error::Malformed(m.to_string());
        let rest = value
            .strip_prefix(ALGORITHM)
            .ok_or_else(|| malformed("the algorithm is not AWS4-HMAC-SHA256"))?;
        let (mut credential, mut signed_headers, mut signature) = (None, None, None);
        for part in rest.split(',') {
            let (k, v) = part
                .trim()
                .split_once('=')
                .ok_or_else(|| malformed("expected key=value pairs"))?;
            match k {
                "Credential" => credential = Some(v),
                "SignedHeaders" => signed_headers = Some(v),
                "Signature" => signature = Some(v),
                _ => {}
            }
        }
        let credential = credential.ok_or_else(|| malformed("Credential is missing"))?;
        let mut scope = credential.split('/');
        let fields = (
            scope.next(),
            scope.next(),
            scope.next(),
            scope.next(),
            scope.next(),
            scope.next(),
        );
        let (Some(key), Some(date), Some(region), Some(service), Some("aws4_request"), None) =
            fields
        else {
            return Err(malformed(
                "Credential must be AKID/YYYYMMDD/region/service/aws4_request",
            ));
        };
        if key.is_empty() || date.len() != 8 || region.is_empty() || service.is_empty() {
            return Err(malformed("Credential scope has an empty or bad field"));
        }
        Ok(Authorization {
            access_key_id: key,
            date,
            region,
            service,
            signed_headers: signed_headers.ok_or_else(|| malformed("SignedHeaders is missing"))?,
            signature: signature.ok_or_else(|| malformed("Signature is missing"))?,
        })
    }
}

/// Verifies a request whose `host` is in its headers (HTTP/1.1).
pub fn verify(
    method: &Method,
    raw_path_and_query: &str,
    headers: &HeaderMap,
    body: &[u8],
    secret_for: impl Fn(&str) -> Option<String>,
    now: SystemTime,
) -> Result<VerifiedSignature, SigV4Error> {
    verify_with_authority(
        method,
        raw_path_and_query,
        None,
        headers,
        body,
        secret_for,
        now,
    )
}

/// Verifies a request; `authority` (the request URI's, e.g. HTTP/2 `:authority`) stands in for a
/// missing `host` header.
pub fn verify_with_authority(
    method: &Method,
    raw_path_and_query: &str,
    authority: Option<&str>,
    headers: &HeaderMap,
    body: &[u8],
    secret_for: impl Fn(&str) -> Option<String>,
    now: SystemTime,
) -> Result<VerifiedSignature, SigV4Error> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .ok_or(SigV4Error::Missing)?
        .to_str()
        .map_err(|_| SigV4Error::Malformed("Authorization is not visible ASCII".into()))?;
    let auth = Authorization::parse(value)?;
    let amz_date = header_str(headers, "x-amz-date")
        .ok_or_else(|| SigV4Error::Malformed("X-Amz-Date is missing".into()))?;
    let signed_at = parse_amz_date(amz_date).ok_or_else(|| {
        SigV4Error::Malformed(format!("X-Amz-Date {amz_date:?} is not YYYYMMDDTHHMMSSZ"))
    })?;
    if !amz_date.starts_with(auth.date) {
        return Err(SigV4Error::Malformed(
            "the Credential date differs from X-Amz-Date".into(),
        ));
    }
    let skew = now
        .duration_since(signed_at)
        .unwrap_or_else(|e| e.duration());
    if skew > MAX_SKEW {
        return Err(SigV4Error::ClockSkew {
            amz_date: amz_date.to_string(),
        });
    }
    let secret = secret_for(auth.access_key_id)
        .ok_or_else(|| SigV4Error::UnknownKey(auth.access_key_id.to_string()))?;

    let payload_hash = payload_hash(headers, body)?;
    let canonical = canonical_request(
        method,
        raw_path_and_query,
        authority,
        headers,
        auth.signed_headers,
        &payload_hash,
    )?;
    let string_to_sign = format!(
        "{ALGORITHM}\n{amz_date}\n{}/{}/{}/aws4_request\n{}",
        auth.date,
        auth.region,
        auth.service,
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let key = generate_signing_key(&secret, signed_at, auth.region, auth.service);
    let expected = calculate_signature(key, string_to_sign.as_bytes());
    if !constant_time_eq(expected.as_bytes(), auth.signature.as_bytes()) {
        return Err(SigV4Error::SignatureMismatch);
    }
    Ok(VerifiedSignature {
        access_key_id: auth.access_key_id.to_string(),
        region: auth.region.to_string(),
        service: auth.service.to_string(),
    })
}

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn payload_hash(headers: &HeaderMap, body: &[u8]) -> Result<String, SigV4Error> {
    let computed = || hex::encode(Sha256::digest(body));
    match header_str(headers, "x-amz-content-sha256") {
        None => Ok(computed()),
        Some(declared) if declared == "UNSIGNED-PAYLOAD" || declared.starts_with("STREAMING-") => {
            Ok(declared.to_string())
        }
        Some(declared) if declared.eq_ignore_ascii_case(&computed()) => Ok(declared.to_string()),
        Some(_) => Err(SigV4Error::PayloadHashMismatch),
    }
}

fn canonical_request(
    method: &Method,
    raw_path_and_query: &str,
    authority: Option<&str>,
    headers: &HeaderMap,
    signed_headers: &str,
    payload_hash: &str,
) -> Result<String, SigV4Error> {
    let (path, query) = raw_path_and_query
        .split_once('?')
        .unwrap_or((raw_path_and_query, ""));
    let mut out = String::with_capacity(512);
    out.push_str(method.as_str());
    out.push('\n');
    out.extend(utf8_percent_encode(&normalize_path(path), PATH_SET));
    out.push('\n');
    out.push_str(&canonical_query(query));
    out.push('\n');
    for name in signed_headers.split(';') {
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(SigV4Error::Malformed(format!(
                "SignedHeaders entry {name:?} is not a lowercase header name"
            )));
        }
        let values: Vec<&str> = headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        let joined = match (values.is_empty(), name) {
            (false, _) => values
                .iter()
                .map(|v| trim_all(v))
                .collect::<Vec<_>>()
                .join(","),
            (true, "host") => authority
                .map(str::to_string)
                .ok_or_else(|| SigV4Error::Malformed("the signed header host is missing".into()))?,
            (true, _) => {
                return Err(SigV4Error::Malformed(format!(
                    "the signed header {name} is missing"
                )));
            }
        };
        out.push_str(name);
        out.push(':');
        out.push_str(&joined);
        out.push('\n');
    }
    out.push('\n');
    out.push_str(signed_headers);
    out.push('\n');
    out.push_str(payload_hash);
    Ok(out)
}

/// RFC 3986 5.2.4 dot-segment removal, as `aws-sigv4` does it (empty segments collapse).
fn normalize_path(path: &str) -> String {
    if path.is_empty() {
        return "/".into();
    }
    if !(path.contains('.') || path.contains("//")) {
        return path.to_string();
    }
    let mut segments: Vec<&str> = Vec::new();
    for segment in path.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = format!("/{}", segments.join("/"));
    let ends_with_slash = ["/", "/.", "/./", "/..", "/../"]
        .iter()
        .any(|s| path.ends_with(s));
    if ends_with_slash && !out.ends_with('/') {
        out.push('/');
    }
    out
}

fn canonical_query(query: &str) -> String {
    let decode = |s: &str| {
        let s = s.replace('+', " ");
        percent_decode_str(&s).decode_utf8_lossy().into_owned()
    };
    let mut pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                utf8_percent_encode(&decode(k), QUERY_SET).to_string(),
                utf8_percent_encode(&decode(v), QUERY_SET).to_string(),
            )
        })
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// Trims spaces and collapses inner runs of spaces to one.
fn trim_all(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut last_space = false;
    for c in value.trim_matches(' ').chars() {
        if c == ' ' && last_space {
            continue;
        }
        last_space = c == ' ';
        out.push(c);
    }
    out
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `YYYYMMDDTHHMMSSZ` to a time.
fn parse_amz_date(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        if !part.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        part.parse().ok()
    };
    let (y, mo, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (h, mi, se) = (num(9..11)?, num(11..13)?, num(13..15)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + se;
    u64::try_from(secs)
        .ok()
        .map(|s| UNIX_EPOCH + Duration::from_secs(s))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_credential_types::Credentials;
    use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
    use aws_sigv4::sign::v4::SigningParams;

    const PATH: &str = "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Ainference-profile%2Fus.anthropic.claude-sonnet-4-20250514-v1%3A0/converse";
    const BODY: &[u8] = br#"{"messages":[{"role":"user","content":[{"text":"hi"}]}]}"#;

    fn t0() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_767_225_600) // 2026-01-01T00:00:00Z
    }

    /// Signs like the SDK does and returns the headers to send.
    fn signed(secret: &str, path_and_query: &str, body: &[u8], at: SystemTime) -> HeaderMap {
        let identity = Credentials::new("AKIDTEST", secret, None, None, "test").into();
        let params = SigningParams::builder()
            .identity(&identity)
            .region("us-east-1")
            .name("bedrock")
            .time(at)
            .settings(SigningSettings::default())
            .build()
            .unwrap()
            .into();
        let base = [
            ("host", "127.0.0.1:8080"),
            ("content-type", "application/json"),
            ("x-custom", "  a   b  "),
        ];
        let uri = format!("http://127.0.0.1:8080{path_and_query}");
        let request =
            SignableRequest::new("POST", uri, base.into_iter(), SignableBody::Bytes(body)).unwrap();
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

    fn check(
        path: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<VerifiedSignature, SigV4Error> {
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
        assert_eq!(parse_amz_date("20260101T000000Z"), Some(t0()));
        assert_eq!(parse_amz_date("20260101T000000"), None);
        assert_eq!(parse_amz_date("2026010xT000000Z"), None);
        assert_eq!(normalize_path("/a/./b/../c//d"), "/a/c/d");
        assert_eq!(
            canonical_query("b=2&a=1&a=0&c=x%2Fy"),
            "a=0&a=1&b=2&c=x%2Fy"
        );
        assert_eq!(trim_all("  a   b "), "a b");
        assert!(constant_time_eq(b"ab", b"ab") && !constant_time_eq(b"ab", b"ac"));
    }
}
