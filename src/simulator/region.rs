//! The Region a request is made in. One simulator process serves every Region, each with its own
//! buckets, and tells them apart the way Bedrock's endpoints would:
//!
//! 1. the Region of the SigV4 credential scope (`Credential=AKID/20260101/us-west-2/bedrock/...`):
//!    what an SDK, or a proxy signing for a pool's Region, produces;
//! 2. else the Host (HTTP/2 `:authority`) `bedrock-runtime.{region}.amazonaws.com` (also
//!    `bedrock-runtime-fips.`, `bedrock-mantle.{region}.api.aws`): what a bearer-key caller that
//!    keeps the real host name sends;
//! 3. else the simulator's `region` (default `us-east-1`).
//!
//! A name that does not look like a Region (`us-east-1`, `eu-central-2`, `us-gov-west-1`) is
//! ignored and the next rule applies. An ARN names its own Region, which wins for the bucket (see
//! [`super::model_id`]).

use http::{HeaderMap, header};

use crate::auth::sigv4::Authorization;

/// The Region of a request (see the module doc).
pub fn of_request<'a>(
    headers: &'a HeaderMap,
    authority: Option<&'a str>,
    default: &'a str,
) -> &'a str {
    signed_region(headers)
        .or_else(|| host_region(headers, authority))
        .unwrap_or(default)
}

fn signed_region(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let region = Authorization::parse(value).ok()?.region;
    is_region(region).then_some(region)
}

fn host_region<'a>(headers: &'a HeaderMap, authority: Option<&'a str>) -> Option<&'a str> {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or(authority)?;
    let host = host.split(':').next().unwrap_or(host);
    let mut labels = host.split('.');
    let service = labels.next()?;
    let region = labels.next()?;
    let domain: Vec<&str> = labels.collect();
    let aws_domain = matches!(domain[..], ["amazonaws", "com"] | ["api", "aws"]);
    (service.starts_with("bedrock") && aws_domain && is_region(region)).then_some(region)
}

/// `{area}-{direction}-{n}` with an optional partition word: `us-east-1`, `us-gov-west-1`.
pub fn is_region(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let Some((number, words)) = parts.split_last() else {
        return false;
    };
    (2..=3).contains(&words.len())
        && !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit())
        && words
            .iter()
            .all(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    const SIGNED_WEST: &str = "AWS4-HMAC-SHA256 Credential=AKID/20260101/us-west-2/bedrock/aws4_request, SignedHeaders=host;x-amz-date, Signature=abc";

    #[test]
    fn credential_scope_then_host_then_default() {
        let h = headers(&[
            ("authorization", SIGNED_WEST),
            ("host", "bedrock-runtime.eu-west-1.amazonaws.com"),
        ]);
        assert_eq!(of_request(&h, None, "us-east-1"), "us-west-2");
        let h = headers(&[("host", "bedrock-runtime.eu-west-1.amazonaws.com")]);
        assert_eq!(of_request(&h, None, "us-east-1"), "eu-west-1");
        let h = headers(&[("authorization", "Bearer abc")]);
        assert_eq!(
            of_request(
                &h,
                Some("bedrock-runtime-fips.us-gov-west-1.amazonaws.com:443"),
                "us-east-1"
            ),
            "us-gov-west-1"
        );
        assert_eq!(
            of_request(
                &HeaderMap::new(),
                Some("bedrock-mantle.ap-northeast-1.api.aws"),
                "x-1"
            ),
            "ap-northeast-1"
        );
        let h = headers(&[("host", "127.0.0.1:9000")]);
        assert_eq!(of_request(&h, None, "us-east-1"), "us-east-1");
        let h = headers(&[("host", "bedrock-runtime.evil.example.com")]);
        assert_eq!(of_request(&h, None, "us-east-1"), "us-east-1");
    }

    #[test]
    fn region_shapes() {
        for r in [
            "us-east-1",
            "eu-central-2",
            "us-gov-west-1",
            "ap-southeast-7",
        ] {
            assert!(is_region(r), "{r}");
        }
        for r in [
            "",
            "us",
            "us-east",
            "US-EAST-1",
            "us-east-x",
            "a-b-c-d-1",
            "us--1",
        ] {
            assert!(!is_region(r), "{r}");
        }
    }
}
