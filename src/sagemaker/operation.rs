//! The two `sagemaker-runtime` invocations tokengate admits, and their REST paths.
//!
//! `POST /endpoints/{EndpointName}/invocations` (InvokeEndpoint) and
//! `POST /endpoints/{EndpointName}/invocations-response-stream` (InvokeEndpointWithResponseStream),
//! with the inference component, when there is one, in the `X-Amzn-SageMaker-Inference-Component`
//! header (botocore's `sagemaker-runtime` 2017-05-13 service model). Endpoint and component names
//! are letters, digits and hyphens, so the path needs no decoding: a name outside that pattern is
//! refused rather than guessed at. The raw path is forwarded upstream unchanged.

use http::{HeaderMap, Method};

use crate::bedrock::Operation;

/// The path prefix of every sagemaker-runtime endpoint operation.
pub const PATH_PREFIX: &str = "/endpoints/";
/// The header naming the inference component a call is for.
pub const INFERENCE_COMPONENT: &str = "x-amzn-sagemaker-inference-component";
/// The longest endpoint or inference component name (the service model's `max`).
const MAX_NAME: usize = 63;

/// What an endpoint call addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointTarget {
    /// [`Operation::InvokeEndpoint`] or [`Operation::InvokeEndpointWithResponseStream`].
    pub operation: Operation,
    pub endpoint: String,
    /// From `X-Amzn-SageMaker-Inference-Component`, when the call names one.
    pub inference_component: Option<String>,
}

/// Why a path under `/endpoints/` is not a call tokengate forwards.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointTargetError {
    #[error(
        "tokengate forwards InvokeEndpoint and InvokeEndpointWithResponseStream, not {method} {path} \
         (InvokeEndpointAsync and other calls go to sagemaker-runtime directly)"
    )]
    UnknownOperation { method: String, path: String },
    #[error(
        "{0:?} is not an endpoint name: 1 to 63 letters, digits and hyphens, starting and ending with a letter or digit"
    )]
    BadEndpointName(String),
    #[error(
        "X-Amzn-SageMaker-Inference-Component {0:?} is not an inference component name: 1 to 63 letters, digits and hyphens, \
         starting and ending with a letter or digit"
    )]
    BadInferenceComponent(String),
}

impl EndpointTarget {
    /// Parses a request line and its inference component header. `None` when the path is not
    /// under `/endpoints/` (the call is not for sagemaker-runtime).
    pub fn parse(
        method: &Method,
        raw_path: &str,
        headers: &HeaderMap,
    ) -> Option<Result<EndpointTarget, EndpointTargetError>> {
        let rest = raw_path.strip_prefix(PATH_PREFIX)?;
        Some(Self::parse_rest(method, raw_path, rest, headers))
    }

    fn parse_rest(
        method: &Method,
        raw_path: &str,
        rest: &str,
        headers: &HeaderMap,
    ) -> Result<EndpointTarget, EndpointTargetError> {
        let unknown = || EndpointTargetError::UnknownOperation {
            method: method.to_string(),
            path: raw_path.to_string(),
        };
        let (endpoint, segment) = rest.split_once('/').ok_or_else(unknown)?;
        let operation = match segment {
            "invocations" => Operation::InvokeEndpoint,
            "invocations-response-stream" => Operation::InvokeEndpointWithResponseStream,
            _ => return Err(unknown()),
        };
        if method != Method::POST {
            return Err(unknown());
        }
        if !is_name(endpoint) {
            return Err(EndpointTargetError::BadEndpointName(endpoint.to_string()));
        }
        let inference_component = match headers.get(INFERENCE_COMPONENT) {
            None => None,
            Some(value) => {
                let text = value.to_str().unwrap_or_default().trim();
                if !is_name(text) {
                    return Err(EndpointTargetError::BadInferenceComponent(
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    ));
                }
                Some(text.to_string())
            }
        };
        Ok(EndpointTarget {
            operation,
            endpoint: endpoint.to_string(),
            inference_component,
        })
    }
}

/// An endpoint, variant or inference component name: `[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?`,
/// at most 63 characters.
pub fn is_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let edge = |b: Option<&u8>| b.is_some_and(u8::is_ascii_alphanumeric);
    bytes.len() <= MAX_NAME
        && edge(bytes.first())
        && edge(bytes.last())
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(
        method: Method,
        path: &str,
        component: Option<&str>,
    ) -> Option<Result<EndpointTarget, EndpointTargetError>> {
        let mut headers = HeaderMap::new();
        if let Some(c) = component {
            headers.insert(INFERENCE_COMPONENT, c.parse().unwrap());
        }
        EndpointTarget::parse(&method, path, &headers)
    }

    #[test]
    fn both_invocations_route_with_their_component() {
        let t = parse(Method::POST, "/endpoints/llm-1/invocations", None)
            .unwrap()
            .unwrap();
        assert_eq!(t.operation, Operation::InvokeEndpoint);
        assert_eq!(t.endpoint, "llm-1");
        assert_eq!(t.inference_component, None);
        let t = parse(
            Method::POST,
            "/endpoints/llm-1/invocations-response-stream",
            Some("ic-summarize"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.operation, Operation::InvokeEndpointWithResponseStream);
        assert_eq!(t.inference_component.as_deref(), Some("ic-summarize"));
    }

    #[test]
    fn other_paths_are_not_sagemaker_or_are_refused() {
        assert!(parse(Method::POST, "/model/m/converse", None).is_none());
        let refused = |path: &str, method: Method, component: Option<&str>| {
            parse(method, path, component).unwrap().unwrap_err()
        };
        assert!(matches!(
            refused("/endpoints/e/async-invocations", Method::POST, None),
            EndpointTargetError::UnknownOperation { .. }
        ));
        assert!(matches!(
            refused("/endpoints/e/invocations", Method::GET, None),
            EndpointTargetError::UnknownOperation { .. }
        ));
        assert!(matches!(
            refused("/endpoints/e", Method::POST, None),
            EndpointTargetError::UnknownOperation { .. }
        ));
        for bad in ["", "-e", "e-", "e%2Fx", "e_x", &"e".repeat(64)] {
            assert!(
                matches!(
                    refused(&format!("/endpoints/{bad}/invocations"), Method::POST, None),
                    EndpointTargetError::BadEndpointName(_)
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            refused("/endpoints/e/invocations", Method::POST, Some("bad name")),
            EndpointTargetError::BadInferenceComponent(_)
        ));
    }

    #[test]
    fn names_follow_the_service_model_pattern() {
        for good in ["a", "A-1", "llm--x", &"e".repeat(63)] {
            assert!(is_name(good), "{good:?}");
        }
        for bad in ["", "-", "a-", "-a", "a.b", "a b", &"e".repeat(64)] {
            assert!(!is_name(bad), "{bad:?}");
        }
    }
}
