//! SigV4 signature verification (`AWS4-HMAC-SHA256` in the `Authorization` header).
//! (Over 500 lines: verification, and the canonical form the upstream signer shares with it.)
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
//! - **Payload hash**: the SHA-256 of the body; an `x-amz-content-sha256` header must equal it
//!   (`UNSIGNED-PAYLOAD` and `STREAMING-*` markers are refused: the body would go unchecked).
//!   The one exception is an event stream's head ([`Payload::EventStream`]): it is signed over an
//!   empty payload, or the `STREAMING-AWS4-HMAC-SHA256-EVENTS` marker, and each event frame then
//!   carries its own signature ([`super::event_stream`]).
//! - **Signed headers**: must include `host` and `x-amz-date`.
//! - **Time**: `X-Amz-Date` within ±5 minutes of `now`, and its day equal to the credential
//!   scope's.
//!
//! [`SignedHead::check`] does everything the head alone can show (shape, signed headers, date,
//! payload marker), so that a caller can be refused before its body is read; [`SignedHead::verify`]
//! then checks the signature over the whole request. The credential scope's Region and service
//! are returned for the caller to check against what it serves.

use std::time::{Duration, SystemTime};

use aws_sigv4::sign::v4::{calculate_signature, generate_signing_key};

use super::amz_date::parse_amz_date;
use http::{HeaderMap, Method};
use percent_encoding::{AsciiSet, CONTROLS, percent_decode_str, utf8_percent_encode};
use sha2::{Digest, Sha256};

pub const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// The SigV4 signing name of bedrock-runtime.
pub const SIGNING_NAME: &str = "bedrock";
/// Largest accepted difference between the request's `X-Amz-Date` and our clock.
pub const MAX_SKEW: Duration = Duration::from_secs(5 * 60);
/// The payload marker of an event stream whose events are signed one by one.
pub const STREAMING_EVENTS: &str = "STREAMING-AWS4-HMAC-SHA256-EVENTS";
/// The SHA-256 of no bytes.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

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
pub(crate) const PATH_SET: &AsciiSet = &QUERY_SET.remove(b'/');

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
    #[error(
        "x-amz-content-sha256 is not a SHA-256 (UNSIGNED-PAYLOAD and STREAMING-* leave the body unsigned)"
    )]
    UnsignedPayload,
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
    let head = SignedHead::check(headers, now)?;
    let secret = secret_for(head.auth.access_key_id)
        .ok_or_else(|| SigV4Error::UnknownKey(head.auth.access_key_id.to_string()))?;
    head.verify(
        &SignedRequest {
            method,
            raw_path_and_query,
            authority,
            headers,
            body,
        },
        &secret,
    )
}

/// The request a signature covers.
#[derive(Debug, Clone, Copy)]
pub struct SignedRequest<'a> {
    pub method: &'a Method,
    /// The path and query exactly as received.
    pub raw_path_and_query: &'a str,
    /// The request URI's authority (HTTP/2 `:authority`), for a request without `host`.
    pub authority: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

/// What a request's payload hash covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// The whole body: its SHA-256 is signed (every operation but one).
    Body,
    /// An event stream's head (InvokeModelWithBidirectionalStream): signed over an empty payload,
    /// as aws-sdk-rust signs it, or over the `STREAMING-AWS4-HMAC-SHA256-EVENTS` marker declared
    /// in `x-amz-content-sha256`; the events that follow are signed one by one, chained from
    /// this signature ([`super::event_stream`]). Any other marker is refused.
    EventStream,
}

/// What a signed request's head says, checked before its body is read: a well-formed
/// `Authorization` that signs `host` and `x-amz-date`, an `X-Amz-Date` within [`MAX_SKEW`] of the
/// clock and of the credential scope's day, and no unsigned-payload marker.
#[derive(Debug, Clone)]
pub struct SignedHead<'a> {
    pub auth: Authorization<'a>,
    amz_date: &'a str,
    signed_at: SystemTime,
    payload: Payload,
}

impl<'a> SignedHead<'a> {
    /// Checks everything the head alone can show, for a request whose body is signed whole.
    pub fn check(headers: &'a HeaderMap, now: SystemTime) -> Result<SignedHead<'a>, SigV4Error> {
        SignedHead::check_for(headers, now, Payload::Body)
    }

    /// [`SignedHead::check`] for a request whose payload is signed as `payload` says.
    pub fn check_for(
        headers: &'a HeaderMap,
        now: SystemTime,
        payload: Payload,
    ) -> Result<SignedHead<'a>, SigV4Error> {
        let value = headers
            .get(http::header::AUTHORIZATION)
            .ok_or(SigV4Error::Missing)?
            .to_str()
            .map_err(|_| SigV4Error::Malformed("Authorization is not visible ASCII".into()))?;
        let auth = Authorization::parse(value)?;
        for required in ["host", "x-amz-date"] {
            if !auth.signed_headers.split(';').any(|h| h == required) {
                return Err(SigV4Error::Malformed(format!(
                    "SignedHeaders must include {required}"
                )));
            }
        }
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
        // The body must be signed: its SHA-256, never `UNSIGNED-PAYLOAD` or a `STREAMING-*`
        // marker (bedrock-runtime's request bodies are whole documents), but for the event
        // stream's own marker where the events are signed one by one.
        if let Some(declared) = header_str(headers, "x-amz-content-sha256") {
            let sha256 = declared.len() == 64 && declared.bytes().all(|b| b.is_ascii_hexdigit());
            let allowed = match payload {
                Payload::Body => sha256,
                Payload::EventStream => declared == STREAMING_EVENTS || declared == EMPTY_SHA256,
            };
            if !allowed {
                return Err(SigV4Error::UnsignedPayload);
            }
        }
        Ok(SignedHead {
            auth,
            amz_date,
            signed_at,
            payload,
        })
    }

    /// Checks the signature over the whole request, body included (an event stream's head:
    /// without its body), with the key's `secret`.
    pub fn verify(
        &self,
        request: &SignedRequest<'_>,
        secret: &str,
    ) -> Result<VerifiedSignature, SigV4Error> {
        let auth = &self.auth;
        let payload_hash = match self.payload {
            Payload::Body => payload_hash(request.headers, request.body)?,
            // The head was checked: the marker if declared, else the hash of no payload.
            Payload::EventStream => header_str(request.headers, "x-amz-content-sha256")
                .unwrap_or(EMPTY_SHA256)
                .to_string(),
        };
        let canonical = canonical_request(request, auth.signed_headers, &payload_hash)?;
        let string_to_sign = format!(
            "{ALGORITHM}\n{}\n{}/{}/{}/aws4_request\n{}",
            self.amz_date,
            auth.date,
            auth.region,
            auth.service,
            sha256_hex(canonical.as_bytes())
        );
        let key = generate_signing_key(secret, self.signed_at, auth.region, auth.service);
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
}

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn payload_hash(headers: &HeaderMap, body: &[u8]) -> Result<String, SigV4Error> {
    let computed = sha256_hex(body);
    match header_str(headers, "x-amz-content-sha256") {
        None => Ok(computed),
        Some(declared) if declared.eq_ignore_ascii_case(&computed) => Ok(declared.to_string()),
        Some(_) => Err(SigV4Error::PayloadHashMismatch),
    }
}

fn canonical_request(
    request: &SignedRequest<'_>,
    signed_headers: &str,
    payload_hash: &str,
) -> Result<String, SigV4Error> {
    let SignedRequest {
        method,
        raw_path_and_query,
        authority,
        headers,
        ..
    } = *request;
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

pub(crate) fn canonical_query(query: &str) -> String {
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
pub(crate) fn trim_all(value: &str) -> String {
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

/// `bytes` in lowercase hex, as SigV4 writes hashes and signatures. (`hex::encode` collects
/// an iterator of `char`s: about 2,200 instructions for a digest, against 450 here; signing a
/// proxied call writes two digests here, and `aws-sigv4` the signature.)
pub(crate) fn hex_lower(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// The lowercase hex of `data`'s SHA-256.
pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex_lower(&Sha256::digest(data))
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
#[path = "sigv4_tests.rs"]
mod tests;
