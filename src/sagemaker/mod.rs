//! The `sagemaker-runtime` wire format (real-time endpoints) and the control plane calls that
//! say how many copies an endpoint runs.
//!
//! Everything here is pure: the invocation paths and the inference component header
//! ([`operation`]), the output cap and usage in the two container schemas tokengate reads
//! ([`payload`]), the service's error names and stream exceptions ([`error`]), and the
//! DescribeEndpoint / DescribeInferenceComponent requests and answers ([`control`]). No I/O, no
//! admission. The simulator shares the paths, the error names and the frames, never
//! [`payload`] (what a container request asks for and what its answer reports is read there
//! again, on its own).
//!
//! `SAGEMAKER.md` at the project root lists the wire facts relied on, and where they come from.

pub mod control;
pub mod error;
pub mod operation;
pub mod payload;

pub use operation::{EndpointTarget, EndpointTargetError};

/// IAM actions endpoint pools need beyond the invocations' own ([`crate::bedrock::Operation::iam_action`]):
/// the copies refresher's describe calls, and `sagemaker:InvokeEndpointWithResponseStream`, which
/// the Service Authorization Reference lists as an action of its own while the API reference
/// says the stream needs `sagemaker:InvokeEndpoint` (the README's policy grants both).
pub const IAM_ACTIONS: [&str; 3] = [
    "sagemaker:DescribeEndpoint",
    "sagemaker:DescribeInferenceComponent",
    "sagemaker:InvokeEndpointWithResponseStream",
];
pub use payload::PayloadUsage;
