//! The `bedrock-runtime` wire format, shared by the proxy and the simulator.
//!
//! Everything here is pure: parsing paths and model ids, reading `maxTokens` and usage out of
//! request and response bytes (the native operations', and the OpenAI and Anthropic APIs' that
//! bedrock-runtime serves too: [`api`]), encoding and decoding event-stream frames, reading
//! server-sent events ([`sse`]), and shaping errors the way Bedrock (restJson1), OpenAI and
//! Anthropic shape them. No I/O, no quota arithmetic.

pub mod api;
pub mod catalogue;
pub mod error;
pub mod eventstream;
pub mod max_tokens;
pub mod model_id;
pub mod operation;
pub mod session_start;
pub mod sse;
pub mod tier;
pub mod usage;

pub use api::{Api, Dialect};
pub use error::{BedrockError, ErrorCode};
pub use model_id::{InferenceRoute, ModelRef};
pub use operation::{Operation, Target, TargetError};
pub use usage::{Usage, UsageObserver};
