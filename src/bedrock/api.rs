//! The inference APIs `bedrock-runtime` serves, and whose error shapes each path speaks.
//!
//! Besides its own operations (`/model/{modelId}/...`), `bedrock-runtime` serves three APIs whose
//! body names the model (V, BEDROCK-APIS.md): OpenAI Chat Completions (`POST
//! /openai/v1/chat/completions`, also `POST /v1/chat/completions`), OpenAI Responses (`POST
//! /openai/v1/responses`) and Anthropic Messages (`POST /anthropic/v1/messages`). One quota
//! serves them all.
//!
//! [`Api`] is the family an operation belongs to (the `api` label of metrics, `/v1/pools` and the
//! access log). [`Dialect`] is the error shape a path's clients understand: Bedrock's restJson1,
//! OpenAI's `{"error": {...}}` or Anthropic's `{"type": "error", "error": {...}}`. Any path under
//! `/openai/` or `/v1/` speaks OpenAI, any under `/anthropic/` Anthropic, even one that names no
//! operation, so that an SDK pointed at the wrong path still reads the error.

use super::Operation;

/// An inference API family: the `api` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `bedrock-runtime`'s own operations (Converse, InvokeModel, ...), whatever the client
    /// (boto3, the AWS SDKs, `AnthropicBedrock`).
    Bedrock,
    OpenAIChat,
    OpenAIResponses,
    AnthropicMessages,
    /// `sagemaker-runtime`'s calls to real-time endpoints (endpoint pools). Its error shape is
    /// restJson1 as Bedrock's, with the service's own error names
    /// ([`crate::sagemaker::error::own_answer`]).
    SageMaker,
}

impl Api {
    pub const ALL: [Api; 5] = [
        Api::Bedrock,
        Api::OpenAIChat,
        Api::OpenAIResponses,
        Api::AnthropicMessages,
        Api::SageMaker,
    ];

    /// The `api` label value.
    pub fn label(self) -> &'static str {
        match self {
            Api::Bedrock => "bedrock",
            Api::OpenAIChat => "openai_chat",
            Api::OpenAIResponses => "openai_responses",
            Api::AnthropicMessages => "anthropic_messages",
            Api::SageMaker => "sagemaker",
        }
    }

    /// The position of this API in [`Api::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The error shape its clients read.
    pub fn dialect(self) -> Dialect {
        match self {
            Api::Bedrock | Api::SageMaker => Dialect::Bedrock,
            Api::OpenAIChat | Api::OpenAIResponses => Dialect::OpenAI,
            Api::AnthropicMessages => Dialect::Anthropic,
        }
    }
}

/// Whose error shape a response takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// restJson1: `{"message": ...}` and `x-amzn-ErrorType`.
    Bedrock,
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAI,
    /// `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl Dialect {
    /// The dialect of a raw request path (see the module doc).
    pub fn of_path(raw_path: &str) -> Dialect {
        if raw_path.starts_with("/openai/") || raw_path.starts_with("/v1/") {
            Dialect::OpenAI
        } else if raw_path.starts_with("/anthropic/") {
            Dialect::Anthropic
        } else {
            Dialect::Bedrock
        }
    }
}

/// The body-model operation served at `raw_path` (POST only), if any.
pub fn body_model_operation(raw_path: &str) -> Option<Operation> {
    match raw_path {
        "/openai/v1/chat/completions" | "/v1/chat/completions" => {
            Some(Operation::OpenAIChatCompletions)
        }
        "/openai/v1/responses" => Some(Operation::OpenAIResponses),
        "/anthropic/v1/messages" => Some(Operation::AnthropicMessages),
        _ => None,
    }
}

/// What a client of `dialect` should call instead of an unknown path.
pub fn served_paths(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Bedrock => "e.g. POST /model/{modelId}/converse",
        Dialect::OpenAI => {
            "POST /openai/v1/chat/completions (or /v1/chat/completions) and POST /openai/v1/responses \
             (an OpenAI client's base_url ends in /openai/v1)"
        }
        Dialect::Anthropic => {
            "POST /anthropic/v1/messages (an Anthropic client's base_url ends in /anthropic)"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_speak_their_clients_dialect() {
        for (path, dialect) in [
            ("/openai/v1/chat/completions", Dialect::OpenAI),
            ("/openai/v1/models", Dialect::OpenAI),
            ("/v1/chat/completions", Dialect::OpenAI),
            ("/anthropic/v1/messages", Dialect::Anthropic),
            ("/anthropic/v1/complete", Dialect::Anthropic),
            ("/model/m/converse", Dialect::Bedrock),
            ("/openai", Dialect::Bedrock),
            ("/", Dialect::Bedrock),
        ] {
            assert_eq!(Dialect::of_path(path), dialect, "{path}");
        }
    }

    #[test]
    fn every_api_has_its_label_and_dialect() {
        let labels: Vec<&str> = Api::ALL.iter().map(|a| a.label()).collect();
        assert_eq!(
            labels,
            [
                "bedrock",
                "openai_chat",
                "openai_responses",
                "anthropic_messages",
                "sagemaker"
            ]
        );
        for (i, api) in Api::ALL.into_iter().enumerate() {
            assert_eq!(api.index(), i);
        }
        assert_eq!(Api::AnthropicMessages.dialect(), Dialect::Anthropic);
        assert_eq!(Api::OpenAIResponses.dialect(), Dialect::OpenAI);
        assert_eq!(Api::SageMaker.dialect(), Dialect::Bedrock);
    }
}
