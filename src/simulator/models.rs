//! Per-model facts, by base model id: the maximum output tokens (what an absent `maxTokens`
//! reserves), the output burndown rate and the InvokeModel body family. Which bucket a model id
//! lands in is [`super::model_id`]'s.
//!
//! | model (base id contains) | max output | burndown |
//! |---|---|---|
//! | `claude-sonnet-5`, `claude-opus-5` | 128000 | 10 |
//! | `claude-opus-4-6`, `-4-7`, `-4-8`, `claude-sonnet-4-6` | 128000 | 5 |
//! | `claude-opus-4-5` | 64000 | 5 |
//! | `claude-opus-4`, `claude-opus-4-1` | 32000 | 5 |
//! | `claude-sonnet-4*` (but 4.6), `claude-3-7-sonnet` | 64000 | 5 |
//! | `claude-haiku-4-5` | 64000 | 5 |
//! | `claude-3-5-haiku`, `claude-3-5-sonnet` | 8192 | 1 |
//! | `claude-3-haiku`, other Claude 3 | 4096 | 1 |
//! | `amazon.nova` | 10000 | 1 |
//! | `amazon.titan-text` | 8192 | 1 |
//! | `meta.llama` | 8192 | 1 |
//! | anything else | 4096 | 1 |
//!
//! Burndown is 5 for Claude 3.7 Sonnet and the Claude 4 family, 1 for everything else
//! (AWS, "How tokens are counted in Amazon Bedrock"); 10 for Claude 5 (uncertain: one guide says so).
//! Maximum outputs as `../shared/BEDROCK-APIS.md` lists them (Anthropic's model pages).

/// The maximum output tokens of a model (the reservation when `maxTokens` is absent).
pub fn max_output_tokens(base_model: &str) -> u64 {
    let m = base_model;
    let newest = [
        "claude-opus-4-6",
        "claude-opus-4-7",
        "claude-opus-4-8",
        "claude-sonnet-4-6",
        "claude-sonnet-5",
        "claude-opus-5",
    ];
    if newest.iter().any(|n| m.contains(n)) {
        128_000
    } else if m.contains("claude-opus-4-5") {
        64_000
    } else if m.contains("claude-opus-4") {
        32_000
    } else if m.contains("claude-sonnet-4")
        || m.contains("claude-3-7-sonnet")
        || m.contains("claude-haiku-4")
    {
        64_000
    } else if m.contains("claude-3-5-") {
        8_192
    } else if m.contains("amazon.nova") {
        10_000
    } else if m.contains("amazon.titan-text") || m.contains("meta.llama") {
        8_192
    } else {
        4_096
    }
}

/// Tokens charged per output token at settlement.
pub fn burndown(base_model: &str) -> u64 {
    let m = base_model;
    let claude4 = ["claude-sonnet-4", "claude-haiku-4", "claude-opus-4"];
    if m.contains("claude-sonnet-5") || m.contains("claude-opus-5") {
        10
    } else if m.contains("claude-3-7-sonnet") || claude4.iter().any(|c| m.contains(c)) {
        5
    } else {
        1
    }
}

/// The InvokeModel body family of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Anthropic Messages API (`anthropic_version`, `max_tokens` required).
    Anthropic,
    /// Amazon Nova (`messages`, `inferenceConfig.maxTokens`).
    Nova,
    /// Amazon Titan Text (`inputText`, `textGenerationConfig.maxTokenCount`).
    Titan,
    /// Meta Llama (`prompt`, `max_gen_len`).
    Llama,
    /// Mistral, Cohere, DeepSeek, OpenAI-style: `max_tokens` / `max_completion_tokens`.
    Generic,
}

impl Family {
    pub fn of(base_model: &str) -> Family {
        if base_model.starts_with("anthropic.") {
            Family::Anthropic
        } else if base_model.starts_with("amazon.nova") {
            Family::Nova
        } else if base_model.starts_with("amazon.titan") {
            Family::Titan
        } else if base_model.starts_with("meta.") {
            Family::Llama
        } else {
            Family::Generic
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burndown_table() {
        for m in [
            "anthropic.claude-3-7-sonnet-20250219-v1:0",
            "anthropic.claude-sonnet-4-20250514-v1:0",
            "anthropic.claude-sonnet-4-5-20250929-v1:0",
            "anthropic.claude-haiku-4-5-20251001-v1:0",
            "anthropic.claude-opus-4-1-20250805-v1:0",
            "anthropic.claude-opus-4-6-v1",
        ] {
            assert_eq!(burndown(m), 5, "{m}");
        }
        for m in [
            "anthropic.claude-3-haiku-20240307-v1:0",
            "anthropic.claude-3-5-sonnet-20241022-v2:0",
            "amazon.nova-pro-v1:0",
            "meta.llama3-3-70b-instruct-v1:0",
            "mistral.mistral-large-2407-v1:0",
        ] {
            assert_eq!(burndown(m), 1, "{m}");
        }
    }

    #[test]
    fn max_output_table() {
        assert_eq!(
            max_output_tokens("anthropic.claude-sonnet-4-20250514-v1:0"),
            64_000
        );
        assert_eq!(
            max_output_tokens("anthropic.claude-3-7-sonnet-20250219-v1:0"),
            64_000
        );
        assert_eq!(
            max_output_tokens("anthropic.claude-opus-4-1-20250805-v1:0"),
            32_000
        );
        assert_eq!(
            max_output_tokens("anthropic.claude-opus-4-20250514-v1:0"),
            32_000
        );
        assert_eq!(max_output_tokens("anthropic.claude-opus-4-6-v1"), 128_000);
        assert_eq!(max_output_tokens("anthropic.claude-sonnet-4-6"), 128_000);
        assert_eq!(
            max_output_tokens("anthropic.claude-opus-4-5-20251101-v1:0"),
            64_000
        );
        assert_eq!(burndown("anthropic.claude-opus-5-v1"), 10);
        assert_eq!(
            max_output_tokens("anthropic.claude-3-haiku-20240307-v1:0"),
            4_096
        );
        assert_eq!(max_output_tokens("amazon.nova-lite-v1:0"), 10_000);
        assert_eq!(max_output_tokens("cohere.command-r-v1:0"), 4_096);
    }

    #[test]
    fn families() {
        assert_eq!(Family::of("amazon.nova-pro-v1:0"), Family::Nova);
        assert_eq!(Family::of("amazon.titan-text-express-v1"), Family::Titan);
        assert_eq!(
            Family::of("anthropic.claude-3-haiku-20240307-v1:0"),
            Family::Anthropic
        );
        assert_eq!(Family::of("meta.llama3-3-70b-instruct-v1:0"), Family::Llama);
        assert_eq!(Family::of("openai.gpt-oss-120b-1:0"), Family::Generic);
    }
}
