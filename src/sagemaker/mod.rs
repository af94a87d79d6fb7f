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
pub use payload::PayloadUsage;
