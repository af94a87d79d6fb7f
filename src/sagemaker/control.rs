//! The SageMaker control plane calls that say how many copies an endpoint runs: their requests
//! and the part of their answers tokengate reads.
//!
//! The control plane (`api.sagemaker.{region}.amazonaws.com`, SigV4 signing name `sagemaker`) is
//! awsJson1_1: `POST /`, `Content-Type: application/x-amz-json-1.1`,
//! `X-Amz-Target: SageMaker.{Operation}`, a JSON body; errors are a status with
//! `{"__type": "...", "message": "..."}` (botocore's `sagemaker` 2017-07-24 service model).
//!
//! | call | request | copies |
//! |---|---|---|
//! | DescribeEndpoint | `{"EndpointName": ...}` | the sum of `ProductionVariants[].CurrentInstanceCount` (one model copy per instance) |
//! | DescribeInferenceComponent | `{"InferenceComponentName": ...}` | `RuntimeConfig.CurrentCopyCount` |
//!
//! The *current* count is what serves now; the *desired* one is what scaling asked for and has
//! not arrived yet (new instances take minutes), so admission follows the current one.

use serde::Deserialize;

/// `Content-Type` of every control plane call.
pub const CONTENT_TYPE: &str = "application/x-amz-json-1.1";
/// The header naming the operation.
pub const TARGET_HEADER: &str = "x-amz-target";

/// One describe call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Describe<'a> {
    /// DescribeEndpoint: the instances of every production variant.
    Endpoint(&'a str),
    /// DescribeInferenceComponent: the component's copies.
    InferenceComponent(&'a str),
}

/// How many copies serve, and how many scaling asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copies {
    pub current: u32,
    pub desired: Option<u32>,
}

/// A control plane answer tokengate cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("the {operation} answer is not the expected JSON: {error}")]
    Shape {
        operation: &'static str,
        error: String,
    },
    #[error("the {operation} answer names no current copy count ({missing})")]
    NoCount {
        operation: &'static str,
        missing: &'static str,
    },
}

impl Describe<'_> {
    pub fn operation(&self) -> &'static str {
        match self {
            Describe::Endpoint(_) => "DescribeEndpoint",
            Describe::InferenceComponent(_) => "DescribeInferenceComponent",
        }
    }

    /// The `X-Amz-Target` value.
    pub fn target(&self) -> String {
        format!("SageMaker.{}", self.operation())
    }

    /// The request body.
    pub fn body(&self) -> Vec<u8> {
        let body = match self {
            Describe::Endpoint(name) => serde_json::json!({ "EndpointName": name }),
            Describe::InferenceComponent(name) => {
                serde_json::json!({ "InferenceComponentName": name })
            }
        };
        body.to_string().into_bytes()
    }

    /// The copies in a successful answer.
    pub fn copies(&self, answer: &[u8]) -> Result<Copies, ControlError> {
        let operation = self.operation();
        let shape = |e: serde_json::Error| ControlError::Shape {
            operation,
            error: e.to_string(),
        };
        match self {
            Describe::Endpoint(_) => {
                let d: DescribeEndpoint = serde_json::from_slice(answer).map_err(shape)?;
                let variants = d.production_variants.unwrap_or_default();
                let current = variants
                    .iter()
                    .map(|v| v.current_instance_count)
                    .try_fold(0u32, |sum, n| n.map(|n| sum.saturating_add(n)))
                    .filter(|_| !variants.is_empty())
                    .ok_or(ControlError::NoCount {
                        operation,
                        missing: "ProductionVariants[].CurrentInstanceCount",
                    })?;
                let desired = variants
                    .iter()
                    .map(|v| v.desired_instance_count)
                    .try_fold(0u32, |sum, n| n.map(|n| sum.saturating_add(n)));
                Ok(Copies { current, desired })
            }
            Describe::InferenceComponent(_) => {
                let d: DescribeInferenceComponent =
                    serde_json::from_slice(answer).map_err(shape)?;
                let runtime = d.runtime_config.unwrap_or_default();
                let current = runtime.current_copy_count.ok_or(ControlError::NoCount {
                    operation,
                    missing: "RuntimeConfig.CurrentCopyCount",
                })?;
                Ok(Copies {
                    current,
                    desired: runtime.desired_copy_count,
                })
            }
        }
    }
}

/// The message of an awsJson1_1 error answer (`message` or `Message`), with its `__type`.
pub fn error_message(body: &[u8]) -> String {
    let Ok(e) = serde_json::from_slice::<AwsJsonError>(body) else {
        return String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned();
    };
    let kind = e.kind.unwrap_or_default();
    let kind = kind.rsplit('#').next().unwrap_or_default();
    let message = e.message.or(e.message_upper).unwrap_or_default();
    format!("{kind}: {message}")
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DescribeEndpoint {
    production_variants: Option<Vec<VariantSummary>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct VariantSummary {
    current_instance_count: Option<u32>,
    desired_instance_count: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DescribeInferenceComponent {
    runtime_config: Option<RuntimeConfig>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RuntimeConfig {
    current_copy_count: Option<u32>,
    desired_copy_count: Option<u32>,
}

#[derive(Deserialize)]
struct AwsJsonError {
    #[serde(rename = "__type")]
    kind: Option<String>,
    message: Option<String>,
    #[serde(rename = "Message")]
    message_upper: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_name_their_operation_and_resource() {
        let d = Describe::InferenceComponent("ic-1");
        assert_eq!(d.target(), "SageMaker.DescribeInferenceComponent");
        assert_eq!(d.body(), br#"{"InferenceComponentName":"ic-1"}"#);
        assert_eq!(
            Describe::Endpoint("e").body(),
            br#"{"EndpointName":"e"}"#.to_vec()
        );
    }

    #[test]
    fn copies_from_each_answer() {
        // Shapes as botocore's service model has them (the fields tokengate does not read left in).
        let endpoint = br#"{"EndpointName":"e","EndpointArn":"arn:aws:sagemaker:us-east-1:111122223333:endpoint/e",
            "EndpointStatus":"Updating","CreationTime":1.7E9,"LastModifiedTime":1.7E9,
            "ProductionVariants":[{"VariantName":"a","CurrentInstanceCount":2,"DesiredInstanceCount":4,"CurrentWeight":1.0},
                                  {"VariantName":"b","CurrentInstanceCount":1,"DesiredInstanceCount":1}]}"#;
        assert_eq!(
            Describe::Endpoint("e").copies(endpoint),
            Ok(Copies {
                current: 3,
                desired: Some(5)
            })
        );
        let component = br#"{"InferenceComponentName":"ic","InferenceComponentStatus":"InService",
            "RuntimeConfig":{"DesiredCopyCount":6,"CurrentCopyCount":0}}"#;
        assert_eq!(
            Describe::InferenceComponent("ic").copies(component),
            Ok(Copies {
                current: 0,
                desired: Some(6)
            })
        );
    }

    #[test]
    fn answers_without_counts_are_errors() {
        let serverless = br#"{"ProductionVariants":[{"VariantName":"a","CurrentServerlessConfig":{"MemorySizeInMB":2048,"MaxConcurrency":5}}]}"#;
        assert!(matches!(
            Describe::Endpoint("e").copies(serverless),
            Err(ControlError::NoCount { .. })
        ));
        assert!(matches!(
            Describe::Endpoint("e").copies(br#"{"ProductionVariants":[]}"#),
            Err(ControlError::NoCount { .. })
        ));
        assert!(matches!(
            Describe::InferenceComponent("ic").copies(b"<html>"),
            Err(ControlError::Shape { .. })
        ));
        assert_eq!(
            error_message(br#"{"__type":"com.amazon#ValidationException","Message":"Could not find endpoint"}"#),
            "ValidationException: Could not find endpoint"
        );
    }
}
