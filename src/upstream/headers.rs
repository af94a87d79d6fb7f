//! Header hygiene: which of a client's request headers go upstream, and which of upstream's
//! response headers come back.
//!
//! Upstream receives only the headers the API defines ([`Api::request_headers`], one table per
//! API: bedrock-runtime's own, OpenAI's, Anthropic's; [`table`]), never the client's credentials
//! (`Authorization`, `x-api-key`), cookies, SDK bookkeeping or anything else: whatever goes
//! upstream is signed with the proxy's own credentials, so a header let through would be vouched
//! for by the proxy. A SigV4 caller's headers must also be among those it signed, so nobody
//! between the caller and the proxy can add one.
//!
//! Hop-by-hop headers (RFC 9110 7.6.1) stop here in both directions: the fixed set, and every
//! header a `Connection` header names.

use http::{HeaderMap, HeaderName, header};

/// One API's request headers that may be forwarded upstream, lowercase.
#[derive(Debug, Clone, Copy)]
pub struct Api {
    pub name: &'static str,
    pub request_headers: &'static [&'static str],
}

/// `bedrock-runtime`: every request member with `"location": "header"` in botocore's service
/// model (`botocore/data/bedrock-runtime/2023-09-30/service-2.json`, botocore 1.44.8), plus
/// `content-type` and `accept`, the content negotiation every operation uses. `Host`, the
/// signature and the length are set by the proxy itself.
pub const BEDROCK_RUNTIME: Api = Api {
    name: "bedrock-runtime",
    request_headers: &[
        "accept",
        "content-type",
        "x-amzn-bedrock-accept",
        "x-amzn-bedrock-guardrailidentifier",
        "x-amzn-bedrock-guardrailversion",
        "x-amzn-bedrock-performanceconfig-latency",
        "x-amzn-bedrock-projectidentifier",
        "x-amzn-bedrock-request-metadata",
        "x-amzn-bedrock-service-tier",
        "x-amzn-bedrock-trace",
    ],
};

/// `sagemaker-runtime`: every request member with `"location": "header"` of InvokeEndpoint and
/// InvokeEndpointWithResponseStream in botocore's service model
/// (`botocore/data/sagemaker-runtime/2017-05-13/service-2.json`, botocore 1.44.8), with
/// `content-type` and `accept` (InvokeEndpoint's `ContentType` and `Accept` members).
pub const SAGEMAKER_RUNTIME: Api = Api {
    name: "sagemaker-runtime",
    request_headers: &[
        "accept",
        "content-type",
        "x-amzn-sagemaker-accept",
        "x-amzn-sagemaker-custom-attributes",
        "x-amzn-sagemaker-enable-explanations",
        "x-amzn-sagemaker-inference-component",
        "x-amzn-sagemaker-inference-id",
        "x-amzn-sagemaker-prefix-aware-id",
        "x-amzn-sagemaker-session-id",
        "x-amzn-sagemaker-target-container-hostname",
        "x-amzn-sagemaker-target-model",
        "x-amzn-sagemaker-target-variant",
    ],
};

/// OpenAI Chat Completions and Responses on `bedrock-runtime`: content negotiation only. The
/// OpenAI SDK's own headers (`openai-organization`, `openai-project`, `x-stainless-*`, ...) mean
/// nothing to Bedrock, and its `Authorization` is the caller's credential.
pub const OPENAI: Api = Api {
    name: "openai",
    request_headers: &["accept", "content-type"],
};

/// Anthropic Messages on `bedrock-runtime`: content negotiation and the API's own version and
/// beta headers. `x-api-key` is the caller's credential and stays here.
pub const ANTHROPIC: Api = Api {
    name: "anthropic",
    request_headers: &[
        "accept",
        "anthropic-beta",
        "anthropic-version",
        "content-type",
    ],
};

/// The table of `api`'s requests.
pub fn table(api: crate::bedrock::Api) -> &'static Api {
    match api {
        crate::bedrock::Api::Bedrock => &BEDROCK_RUNTIME,
        crate::bedrock::Api::OpenAIChat | crate::bedrock::Api::OpenAIResponses => &OPENAI,
        crate::bedrock::Api::AnthropicMessages => &ANTHROPIC,
        crate::bedrock::Api::SageMaker => &SAGEMAKER_RUNTIME,
    }
}

/// Hop-by-hop headers whatever `Connection` says (RFC 9110 7.6.1, and the legacy ones proxies
/// still meet), as names (no string to parse per response).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

impl Api {
    /// The client's headers to send upstream: those in this API's table, not named by a
    /// `Connection` header, and, for a SigV4 caller (`signed` = its `SignedHeaders`, e.g.
    /// `content-type;host;x-amz-date`), among the headers it signed.
    pub fn forwarded(&self, client: &HeaderMap, signed: Option<&str>) -> HeaderMap {
        let connection = connection_names(client);
        let mut out = HeaderMap::new();
        for (name, value) in client {
            let n = name.as_str();
            let wanted = self.request_headers.contains(&n)
                && !connection.iter().any(|c| c == name)
                && signed.is_none_or(|s| s.split(';').any(|h| h == n));
            if wanted {
                out.append(name.clone(), value.clone());
            }
        }
        out
    }
}

/// Removes a response's hop-by-hop headers: the fixed set and every one `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most responses have no `Connection` header: then nothing is collected.
    if headers.contains_key(header::CONNECTION) {
        for name in connection_names(headers) {
            headers.remove(name);
        }
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The header names listed by every `Connection` header (comma-separated tokens).
fn connection_names(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn names(h: &HeaderMap) -> Vec<&str> {
        let mut n: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        n.sort_unstable();
        n
    }

    #[test]
    fn only_the_api_headers_go_upstream() {
        let client = headers(&[
            ("content-type", "application/json"),
            ("x-amzn-bedrock-trace", "ENABLED"),
            ("authorization", "AWS4-HMAC-SHA256 ..."),
            ("cookie", "session=1"),
            ("x-amz-target", "AmazonBedrock.Other"),
            ("x-amzn-bedrock-made-up", "1"),
            ("amz-sdk-invocation-id", "abc"),
            ("accept-encoding", "gzip"),
            ("user-agent", "boto3"),
        ]);
        let out = BEDROCK_RUNTIME.forwarded(&client, None);
        assert_eq!(names(&out), ["content-type", "x-amzn-bedrock-trace"]);
    }

    #[test]
    fn each_api_forwards_its_own_headers() {
        let client = headers(&[
            ("content-type", "application/json"),
            ("x-amzn-sagemaker-inference-component", "ic-1"),
            ("x-amzn-sagemaker-custom-attributes", "trace=1"),
            ("x-amzn-bedrock-trace", "ENABLED"),
            ("x-amzn-sagemaker-made-up", "1"),
        ]);
        let out = SAGEMAKER_RUNTIME.forwarded(&client, None);
        assert_eq!(
            names(&out),
            [
                "content-type",
                "x-amzn-sagemaker-custom-attributes",
                "x-amzn-sagemaker-inference-component"
            ]
        );
        let out = BEDROCK_RUNTIME.forwarded(&client, None);
        assert_eq!(names(&out), ["content-type", "x-amzn-bedrock-trace"]);
        assert_eq!(
            table(crate::bedrock::Api::SageMaker).name,
            SAGEMAKER_RUNTIME.name
        );
    }

    #[test]
    fn the_openai_and_anthropic_apis_forward_their_own_headers_and_no_credential() {
        let client = headers(&[
            ("content-type", "application/json"),
            ("authorization", "Bearer caller-key"),
            ("x-api-key", "caller-key"),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "tools-2024-04-04"),
            ("openai-organization", "org-1"),
            ("x-stainless-retry-count", "0"),
            ("x-amzn-bedrock-trace", "ENABLED"),
        ]);
        let anthropic = table(crate::bedrock::Api::AnthropicMessages).forwarded(&client, None);
        assert_eq!(
            names(&anthropic),
            ["anthropic-beta", "anthropic-version", "content-type"]
        );
        let openai = table(crate::bedrock::Api::OpenAIChat).forwarded(&client, None);
        assert_eq!(names(&openai), ["content-type"]);
        assert_eq!(
            table(crate::bedrock::Api::Bedrock).name,
            BEDROCK_RUNTIME.name
        );
    }

    #[test]
    fn a_sigv4_caller_s_unsigned_headers_stay_behind() {
        let client = headers(&[
            ("content-type", "application/json"),
            ("x-amzn-bedrock-trace", "ENABLED"),
            ("accept", "application/json"),
        ]);
        let out = BEDROCK_RUNTIME.forwarded(&client, Some("accept;content-type;host;x-amz-date"));
        assert_eq!(names(&out), ["accept", "content-type"]);
    }

    #[test]
    fn headers_named_in_connection_are_hop_by_hop_both_ways() {
        let client = headers(&[
            ("connection", "keep-alive, X-Amzn-Bedrock-Trace"),
            ("connection", "accept"),
            ("content-type", "application/json"),
            ("x-amzn-bedrock-trace", "ENABLED"),
            ("accept", "*/*"),
        ]);
        assert_eq!(
            names(&BEDROCK_RUNTIME.forwarded(&client, None)),
            ["content-type"]
        );
        let mut response = headers(&[
            ("connection", "x-secret"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("x-amzn-requestid", "r"),
        ]);
        strip_hop_by_hop(&mut response);
        assert_eq!(names(&response), ["x-amzn-requestid"]);
    }
}
