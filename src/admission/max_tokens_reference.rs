//! The `maxTokens` rules of `bedrock/max_tokens.rs` written a second time, from its module doc
//! (the native families and the OpenAI and Anthropic APIs),
//! for the tests of `body.rs`: the oracle that both the one-pass read and the parsed-`Value`
//! path are checked against. It shares no code with them (they share `MaxTokensFields::resolve`,
//! so comparing them with each other cannot catch a mistake in it).

use serde_json::Value;

use crate::bedrock::Operation;

/// What a body's `maxTokens` comes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// No field the family reads is present (or each is `null`).
    Absent,
    /// The deciding field holds this positive integer.
    Value(u64),
    /// The deciding field (its dotted path) holds something else.
    Unusable(String),
}

/// Every field any family reads, in the order tried for an unknown provider.
const ANY_FAMILY: [&str; 8] = [
    "max_tokens",
    "max_completion_tokens",
    "inferenceConfig.maxTokens",
    "inferenceConfig.max_new_tokens",
    "textGenerationConfig.maxTokenCount",
    "max_gen_len",
    "maxTokens",
    "max_tokens_to_sample",
];

/// The fields a request's family reads, in order; `None` for operations without `maxTokens`.
fn fields(operation: Operation, provider: Option<&str>, body: &Value) -> Option<Vec<&'static str>> {
    match operation {
        Operation::OpenAIChatCompletions => {
            return Some(vec!["max_completion_tokens", "max_tokens"]);
        }
        Operation::OpenAIResponses => return Some(vec!["max_output_tokens"]),
        Operation::AnthropicMessages => return Some(vec!["max_tokens"]),
        _ => {}
    }
    let converse = matches!(operation, Operation::Converse | Operation::ConverseStream);
    let invoke = matches!(
        operation,
        Operation::InvokeModel | Operation::InvokeModelWithResponseStream
    );
    if converse {
        return Some(vec!["inferenceConfig.maxTokens"]);
    }
    if !invoke {
        return None;
    }
    let titan = body.get("inputText").is_some() || body.get("textGenerationConfig").is_some();
    Some(match provider {
        Some("anthropic") => vec!["max_tokens", "max_tokens_to_sample"],
        Some("amazon") if titan => vec!["textGenerationConfig.maxTokenCount"],
        Some("amazon") => vec![
            "inferenceConfig.maxTokens",
            "inferenceConfig.max_new_tokens",
        ],
        Some("meta") => vec!["max_gen_len"],
        Some("ai21") => vec!["maxTokens", "max_tokens"],
        Some("mistral" | "cohere" | "deepseek" | "openai" | "qwen" | "writer") => {
            vec!["max_tokens", "max_completion_tokens"]
        }
        _ => ANY_FAMILY.to_vec(),
    })
}

/// A positive integer no larger than 2^31-1, or a float with no fraction in that range.
fn usable(value: &Value) -> Option<u64> {
    const LIMIT: u64 = 2_147_483_647;
    let Value::Number(n) = value else {
        return None;
    };
    if let Some(u) = n.as_u64() {
        return (1..=LIMIT).contains(&u).then_some(u);
    }
    if n.is_i64() {
        return None;
    }
    let f = n.as_f64()?;
    (f.fract() == 0.0 && (1.0..=LIMIT as f64).contains(&f)).then_some(f as u64)
}

/// The first field of the family present and not `null` decides; for Chat Completions, the
/// larger of the two (each must be usable).
pub fn max_tokens(operation: Operation, provider: Option<&str>, body: &Value) -> Expected {
    let Some(fields) = fields(operation, provider, body) else {
        return Expected::Absent;
    };
    if operation == Operation::OpenAIChatCompletions {
        let mut largest = Expected::Absent;
        for field in fields {
            match (body.get(field), &largest) {
                (None | Some(Value::Null), _) => {}
                (Some(v), Expected::Absent | Expected::Value(_)) => match usable(v) {
                    None => return Expected::Unusable(field.to_string()),
                    Some(n) => {
                        let before = if let Expected::Value(m) = largest {
                            m
                        } else {
                            0
                        };
                        largest = Expected::Value(n.max(before));
                    }
                },
                (Some(_), Expected::Unusable(_)) => {}
            }
        }
        return largest;
    }
    for field in fields {
        let mut value = Some(body);
        for key in field.split('.') {
            value = value.and_then(|v| v.get(key));
        }
        match value {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return usable(v)
                    .map_or_else(|| Expected::Unusable(field.to_string()), Expected::Value);
            }
        }
    }
    Expected::Absent
}
