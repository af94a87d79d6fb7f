//! SigV4 signing of a whole request, with the derived signing key cached per day, Region and
//! service.
//!
//! The signing key is four chained HMACs of the secret, the day, the Region and the service; it
//! changes only when one of those does. Every request used to derive it afresh; now each Region's
//! key is kept with the day and the credentials it was derived from, and derived again when any
//! of them changes (a new UTC day, rotated credentials).
//!
//! The canonical request is built exactly as `aws-sigv4` builds it with the proxy's settings
//! (double-encoded path, never normalised; no `x-amz-content-sha256` header; the session token
//! signed; `authorization`, `user-agent`, `x-amzn-trace-id` and `transfer-encoding` unsigned;
//! header values trimmed, inner runs of spaces collapsed, repeated headers joined with `,`;
//! headers whose values are not visible ASCII left out of the signature, as before). A test signs
//! the same requests with both and compares the headers byte for byte.

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
    time::SystemTime,
};

use aws_credential_types::Credentials;
use aws_sigv4::sign::v4::{calculate_signature, generate_signing_key};
use http::{HeaderName, HeaderValue, header};
use percent_encoding::utf8_percent_encode;

use super::UpstreamError;
use crate::auth::{
    amz_date::format_amz_date,
    sigv4::{ALGORITHM, PATH_SET, canonical_query, sha256_hex, trim_all},
};

/// Headers never signed (they may change on the way: `aws-sigv4`'s default exclusions).
const UNSIGNED: [&str; 4] = [
    "authorization",
    "user-agent",
    "x-amzn-trace-id",
    "transfer-encoding",
];
const X_AMZ_DATE: HeaderName = HeaderName::from_static("x-amz-date");
const X_AMZ_SECURITY_TOKEN: HeaderName = HeaderName::from_static("x-amz-security-token");

/// A derived signing key and what it was derived from.
#[derive(Debug)]
struct DerivedKey {
    day: String,
    service: &'static str,
    access_key_id: String,
    secret: String,
    key: Vec<u8>,
}

/// Signing keys per Region, each for the day and the credentials it was derived with.
#[derive(Debug, Default)]
pub struct SigningKeys {
    by_region: RwLock<HashMap<String, Arc<DerivedKey>>>,
    /// Keys derived so far (for tests: how often the cache missed).
    derived: std::sync::atomic::AtomicU64,
}

impl SigningKeys {
    /// The key for `region` on `day` with `credentials`: cached, or derived and kept.
    fn key(
        &self,
        credentials: &Credentials,
        (region, service): (&str, &'static str),
        day: &str,
        at: SystemTime,
    ) -> Arc<DerivedKey> {
        let fits = |k: &DerivedKey| {
            k.day == day
                && k.service == service
                && k.access_key_id == credentials.access_key_id()
                && k.secret == credentials.secret_access_key()
        };
        let read = self.by_region.read().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = read.get(region).filter(|k| fits(k)) {
            return k.clone();
        }
        drop(read);
        let key = generate_signing_key(credentials.secret_access_key(), at, region, service);
        let derived = Arc::new(DerivedKey {
            day: day.to_string(),
            service,
            access_key_id: credentials.access_key_id().to_string(),
            secret: credentials.secret_access_key().to_string(),
            key: key.as_ref().to_vec(),
        });
        self.derived
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.by_region
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(region.to_string(), derived.clone());
        derived
    }

    /// How many keys were derived (cache misses) so far.
    pub fn derived(&self) -> u64 {
        self.derived.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Signs `request` (which carries its final `host`) in place, scoped to `(region, service)`,
    /// at `at`: adds `x-amz-date`, `x-amz-security-token` for temporary credentials, and
    /// `authorization`. Returns the signature (hex), the seed of an event stream's chain.
    pub fn sign(
        &self,
        credentials: &Credentials,
        (region, service): (&str, &'static str),
        at: SystemTime,
        request: &mut http::Request<bytes::Bytes>,
    ) -> Result<String, UpstreamError> {
        let (date_time, day) = format_amz_date(at);
        let headers = request.headers_mut();
        headers.insert(X_AMZ_DATE, header_value(&date_time)?);
        if let Some(token) = credentials.session_token() {
            let mut token = header_value(token)?;
            token.set_sensitive(true);
            headers.insert(X_AMZ_SECURITY_TOKEN, token);
        }
        let (canonical, signed_headers) = canonical_request(request);
        let string_to_sign = format!(
            "{ALGORITHM}\n{date_time}\n{day}/{region}/{service}/aws4_request\n{}",
            sha256_hex(canonical.as_bytes())
        );
        let key = self.key(credentials, (region, service), &day, at);
        let signature = calculate_signature(&key.key, string_to_sign.as_bytes());
        let authorization = format!(
            "{ALGORITHM} Credential={}/{day}/{region}/{service}/aws4_request, SignedHeaders={signed_headers}, Signature={signature}",
            credentials.access_key_id()
        );
        let mut authorization = header_value(&authorization)?;
        authorization.set_sensitive(true);
        request
            .headers_mut()
            .insert(header::AUTHORIZATION, authorization);
        Ok(signature)
    }
}

fn header_value(text: &str) -> Result<HeaderValue, UpstreamError> {
    HeaderValue::from_str(text)
        .map_err(|e| UpstreamError::Signing(format!("not a header value: {e}")))
}

/// The canonical request of `request` and its signed-headers list.
fn canonical_request(request: &http::Request<bytes::Bytes>) -> (String, String) {
    let uri = request.uri();
    let mut names: Vec<&str> = request
        .headers()
        .keys()
        .map(HeaderName::as_str)
        .filter(|n| !UNSIGNED.contains(n))
        .filter(|n| {
            request
                .headers()
                .get_all(*n)
                .iter()
                .any(|v| v.to_str().is_ok())
        })
        .collect();
    names.sort_unstable();
    let mut out = String::with_capacity(512);
    out.push_str(request.method().as_str());
    out.push('\n');
    out.extend(utf8_percent_encode(uri.path(), PATH_SET));
    out.push('\n');
    out.push_str(&canonical_query(uri.query().unwrap_or("")));
    out.push('\n');
    for name in &names {
        let values: Vec<String> = request
            .headers()
            .get_all(*name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(trim_all)
            .collect();
        out.push_str(name);
        out.push(':');
        out.push_str(&values.join(","));
        out.push('\n');
    }
    let signed = names.join(";");
    out.push('\n');
    out.push_str(&signed);
    out.push('\n');
    out.push_str(&sha256_hex(request.body()));
    (out, signed)
}
