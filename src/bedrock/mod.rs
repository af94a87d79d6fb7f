//! The `bedrock-runtime` wire format, shared by the proxy and the simulator.
//!
//! Everything here is pure: parsing paths and model ids, reading `maxTokens` and usage out of
//! request and response bytes, encoding and decoding event-stream frames, and shaping errors the
//! way Bedrock (restJson1) shapes them. No I/O, no quota arithmetic.

pub mod catalogue;
pub mod error;
pub mod eventstream;
pub mod max_tokens;
pub mod model_id;
pub mod operation;
pub mod session_start;
pub mod usage;

pub use error::{BedrockError, ErrorCode};
pub use model_id::{InferenceRoute, ModelRef};
pub use operation::{Operation, Target, TargetError};
pub use usage::{Usage, UsageObserver};
