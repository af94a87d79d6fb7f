//! `maxTokens` from request bodies: Converse `inferenceConfig.maxTokens`, and per model family for
//! InvokeModel bodies.
//!
//! # Rules
//! - Converse / ConverseStream: `inferenceConfig.maxTokens`.
//! - InvokeModel / InvokeModelWithResponseStream, by the model id's provider segment:
//!   `anthropic` `max_tokens` (legacy text completions `max_tokens_to_sample`); `amazon` Titan
//!   (a body with `inputText` or `textGenerationConfig`) `textGenerationConfig.maxTokenCount`,
//!   otherwise Nova `inferenceConfig.maxTokens` (older `inferenceConfig.max_new_tokens`); `meta`
//!   `max_gen_len`; `ai21` Jurassic `maxTokens`, Jamba `max_tokens`; `mistral`, `cohere`,
//!   `deepseek`, `openai`, `qwen`, `writer` `max_tokens` then `max_completion_tokens`. Any other
//!   or unknown provider: every name above in a fixed order ([`UNKNOWN_FIELDS`]).
//! - OpenAI Chat Completions: `max_completion_tokens` and the older `max_tokens`; when both are
//!   present the larger counts (which one upstream obeys is not documented: reserving the larger
//!   errs high). OpenAI Responses: `max_output_tokens`. Anthropic Messages: `max_tokens`.
//! - Other operations (CountTokens, guardrails, async jobs, bidirectional streams): `Ok(None)`.
//!
//! The first listed field present decides; `null` counts as absent. A present value must be a
//! positive integer no larger than 2^31-1 (a float with no fraction, `1024.0`, is accepted as
//! the integer it is); anything else is a [`MaxTokensError`] naming the field. Read member by
//! member ([`MaxTokensFields`]), a field or config object that appears twice is an error too.
//!
//! (Long: the field rules of every model family, and their clamp, side by side so that a family is
//! read and changed in one place.)

use serde_json::{Number, Value};

use super::Operation;

/// The largest `maxTokens` accepted: Bedrock's Integer shapes are 32-bit.
pub const MAX_TOKENS_LIMIT: u64 = i32::MAX as u64;

const CONVERSE_FIELDS: &[&str] = &["inferenceConfig.maxTokens"];
const ANTHROPIC_FIELDS: &[&str] = &["max_tokens", "max_tokens_to_sample"];
const TITAN_FIELDS: &[&str] = &["textGenerationConfig.maxTokenCount"];
const NOVA_FIELDS: &[&str] = &[
    "inferenceConfig.maxTokens",
    "inferenceConfig.max_new_tokens",
];
const LLAMA_FIELDS: &[&str] = &["max_gen_len"];
const AI21_FIELDS: &[&str] = &["maxTokens", "max_tokens"];
const OPENAI_STYLE_FIELDS: &[&str] = &["max_tokens", "max_completion_tokens"];
const CHAT_FIELDS: &[&str] = &["max_completion_tokens", "max_tokens"];
const RESPONSES_FIELDS: &[&str] = &["max_output_tokens"];
const MESSAGES_FIELDS: &[&str] = &["max_tokens"];
/// Every field any body is read for: [`UNKNOWN_FIELDS`], then the Responses API's.
const FIELDS: [&str; 9] = [
    "max_tokens",
    "max_completion_tokens",
    "inferenceConfig.maxTokens",
    "inferenceConfig.max_new_tokens",
    "textGenerationConfig.maxTokenCount",
    "max_gen_len",
    "maxTokens",
    "max_tokens_to_sample",
    "max_output_tokens",
];
/// The order tried when the provider is unknown: every field a native family reads.
pub const UNKNOWN_FIELDS: &[&str] = FIELDS.as_slice().split_at(8).0;
/// The names of the fields inside config objects (after the dot in the paths above).
#[cfg(test)]
const CONFIG_MEMBERS: [&str; 3] = ["maxTokens", "max_new_tokens", "maxTokenCount"];

/// A `maxTokens` field that is present but unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {problem}")]
pub struct MaxTokensError {
    /// The JSON path of the field, e.g. `inferenceConfig.maxTokens`.
    pub field: String,
    /// What is wrong with it, e.g. `must be a positive integer, got -3`.
    pub problem: String,
}

/// The maximum output tokens the request asks for, `Ok(None)` if it does not say.
/// `provider` is the model's provider (`anthropic`, `amazon`, `meta`, ...) for InvokeModel bodies.
pub fn requested_max_tokens(
    operation: Operation,
    provider: Option<&str>,
    body: &Value,
) -> Result<Option<u64>, MaxTokensError> {
    MaxTokensFields::of(body).resolve(operation, provider)
}

/// The members of a body that `maxTokens` can come from: gathered from a parsed `Value`
/// ([`MaxTokensFields::of`]) or member by member while a body is parsed in one pass (admission's
/// reader), then resolved per operation and provider by the same code.
///
/// Gathered member by member, a field (or a config object) that appears twice is remembered and
/// [`MaxTokensFields::resolve`] refuses the body: the proxy would reserve one value while upstream
/// might read the other. (A parsed `Value` has already kept the last one, so [`Self::of`] cannot
/// tell.)
#[derive(Debug, Default)]
pub struct MaxTokensFields {
    /// Each field of [`FIELDS`] (which names every field any operation reads), in its order.
    values: [Option<Value>; FIELDS.len()],
    /// The body has `inputText` or `textGenerationConfig`: an Amazon body is Titan, not Nova.
    titan: bool,
    /// `inferenceConfig`, `textGenerationConfig` seen.
    configs: [bool; 2],
    /// The first field or config object seen twice.
    duplicate: Option<&'static str>,
}

impl MaxTokensFields {
    /// The fields of a parsed body.
    pub fn of(body: &Value) -> MaxTokensFields {
        let mut fields = MaxTokensFields {
            titan: titan_shaped(body),
            ..MaxTokensFields::default()
        };
        for (slot, path) in fields.values.iter_mut().zip(FIELDS) {
            *slot = lookup(body, path).cloned();
        }
        fields
    }

    /// Whether a top-level member named `key` is itself one of the fields (`max_tokens`, ...).
    pub fn is_field(key: &str) -> bool {
        Self::slot(None, key).is_some()
    }

    /// Whether a top-level member named `key` is an object holding fields (`inferenceConfig`,
    /// `textGenerationConfig`).
    pub fn is_config(key: &str) -> bool {
        matches!(key, "inferenceConfig" | "textGenerationConfig")
    }

    /// Whether `inner` of the config object `outer` is one of the fields.
    pub fn is_config_field(outer: &str, inner: &str) -> bool {
        Self::slot(Some(outer), inner).is_some()
    }

    /// A top-level member was seen (before its value is read).
    pub fn saw_member(&mut self, key: &str) {
        let config = match key {
            "inputText" => {
                self.titan = true;
                return;
            }
            "inferenceConfig" => 0,
            "textGenerationConfig" => {
                self.titan = true;
                1
            }
            _ => return,
        };
        if std::mem::replace(&mut self.configs[config], true) {
            self.duplicate
                .get_or_insert(["inferenceConfig", "textGenerationConfig"][config]);
        }
    }

    /// Records a top-level field (`outer = None`) or a field of the config object `outer`.
    pub fn set(&mut self, outer: Option<&str>, key: &str, value: Value) {
        if let Some(at) = Self::slot(outer, key)
            && self.values[at].replace(value).is_some()
        {
            self.duplicate.get_or_insert(FIELDS[at]);
        }
    }

    /// The position of a field in [`FIELDS`], spelled out because this runs for every
    /// top-level member of every body (a test keeps the two in step).
    fn slot(outer: Option<&str>, key: &str) -> Option<usize> {
        Some(match (outer, key) {
            (None, "max_tokens") => 0,
            (None, "max_completion_tokens") => 1,
            (Some("inferenceConfig"), "maxTokens") => 2,
            (Some("inferenceConfig"), "max_new_tokens") => 3,
            (Some("textGenerationConfig"), "maxTokenCount") => 4,
            (None, "max_gen_len") => 5,
            (None, "maxTokens") => 6,
            (None, "max_tokens_to_sample") => 7,
            (None, "max_output_tokens") => 8,
            _ => return None,
        })
    }

    fn get(&self, path: &str) -> Option<&Value> {
        let at = FIELDS.iter().position(|p| *p == path)?;
        self.values[at].as_ref()
    }

    /// The maximum output tokens these fields ask for, `Ok(None)` if they do not say.
    pub fn resolve(
        &self,
        operation: Operation,
        provider: Option<&str>,
    ) -> Result<Option<u64>, MaxTokensError> {
        let Some(fields) = fields_of(operation, provider, self.titan) else {
            return Ok(None);
        };
        if let Some(field) = self.duplicate {
            return Err(MaxTokensError {
                field: field.to_string(),
                problem: "appears more than once in the body; send it once".to_string(),
            });
        }
        let mut present = fields.iter().filter_map(|f| match self.get(f) {
            None | Some(Value::Null) => None,
            Some(value) => Some(validate(f, value)),
        });
        if operation != Operation::OpenAIChatCompletions {
            return present.next().transpose();
        }
        present.try_fold(None, |most: Option<u64>, n| {
            Ok(Some(most.unwrap_or(0).max(n?)))
        })
    }
}

/// Lowers the request's maximum output tokens to `ceiling` in place: the field that decides (see
/// the rules above) when it is above the ceiling, or the family's first field when the body does
/// not say (Bedrock would otherwise use the model's maximum). Returns whether the body changed;
/// `Err` when the body's family is unknown and no field is present, so there is no field to set.
pub fn clamp_max_tokens(
    operation: Operation,
    provider: Option<&str>,
    body: &mut Value,
    ceiling: u64,
) -> Result<bool, MaxTokensError> {
    let Some(fields) = fields_of(operation, provider, titan_shaped(body)) else {
        return Ok(false);
    };
    if operation == Operation::OpenAIChatCompletions {
        return clamp_every_field(fields, body, ceiling);
    }
    let present = fields
        .iter()
        .find(|f| !matches!(lookup(body, f), None | Some(Value::Null)));
    let field = match present {
        Some(field) => {
            let current = lookup(body, field)
                .map(|v| validate(field, v))
                .transpose()?;
            if current.is_some_and(|n| n <= ceiling) {
                return Ok(false);
            }
            *field
        }
        None if std::ptr::eq(fields, UNKNOWN_FIELDS) => {
            return Err(MaxTokensError {
                field: "maxTokens".to_string(),
                problem: "is absent and this model family's field is unknown; set it explicitly"
                    .to_string(),
            });
        }
        None => fields[0],
    };
    set_field(body, field, ceiling)
}

/// Chat Completions: lowers each present field above `ceiling`, or sets the first when none is
/// present (so upstream obeys the ceiling whichever field it reads).
fn clamp_every_field(
    fields: &[&'static str],
    body: &mut Value,
    ceiling: u64,
) -> Result<bool, MaxTokensError> {
    let mut changed = false;
    let mut any = false;
    for field in fields {
        let current = match lookup(body, field) {
            None | Some(Value::Null) => continue,
            Some(value) => validate(field, value)?,
        };
        any = true;
        if current > ceiling {
            changed |= set_field(body, field, ceiling)?;
        }
    }
    match (any, fields.first()) {
        (false, Some(first)) => set_field(body, first, ceiling),
        _ => Ok(changed),
    }
}

/// Sets the field at the dotted path `field` to `value`, creating its parent object if absent.
fn set_field(body: &mut Value, field: &str, value: u64) -> Result<bool, MaxTokensError> {
    let mut target = body;
    let mut parts = field.split('.').peekable();
    while let Some(key) = parts.next() {
        let Value::Object(map) = target else {
            return Err(MaxTokensError {
                field: field.to_string(),
                problem: "cannot be set: its parent is not an object".to_string(),
            });
        };
        if parts.peek().is_none() {
            map.insert(key.to_string(), Value::from(value));
            return Ok(true);
        }
        let next = map
            .entry(key.to_string())
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if next.is_null() {
            *next = Value::Object(serde_json::Map::new());
        }
        target = next;
    }
    Ok(false)
}

/// The name of `operation`'s output cap, for messages that say what to change (`maxTokens` for
/// the native operations, whose field depends on the family).
pub fn cap_field_name(operation: Operation) -> &'static str {
    match operation {
        Operation::OpenAIChatCompletions => "max_completion_tokens",
        Operation::OpenAIResponses => "max_output_tokens",
        Operation::AnthropicMessages => "max_tokens",
        _ => "maxTokens",
    }
}

/// The fields `operation` reads its maximum output from; `None` for operations without one.
fn fields_of(
    operation: Operation,
    provider: Option<&str>,
    titan: bool,
) -> Option<&'static [&'static str]> {
    Some(match operation {
        Operation::Converse | Operation::ConverseStream => CONVERSE_FIELDS,
        Operation::InvokeModel | Operation::InvokeModelWithResponseStream => {
            native_fields(provider, titan)
        }
        Operation::OpenAIChatCompletions => CHAT_FIELDS,
        Operation::OpenAIResponses => RESPONSES_FIELDS,
        Operation::AnthropicMessages => MESSAGES_FIELDS,
        _ => return None,
    })
}

/// The field a request of `operation` should name its maximum output tokens in (the first of its
/// family's), for a message telling the caller what to send; `None` for an unknown family or an
/// operation with no such field. `body`, when parsed, tells Titan from Nova.
pub fn field_to_set(
    operation: Operation,
    provider: Option<&str>,
    body: Option<&Value>,
) -> Option<&'static str> {
    let fields = fields_of(operation, provider, body.is_some_and(titan_shaped))?;
    (!std::ptr::eq(fields, UNKNOWN_FIELDS)).then(|| fields[0])
}

/// Where a model-native body of this provider keeps its maximum output tokens.
fn native_fields(provider: Option<&str>, titan: bool) -> &'static [&'static str] {
    match provider {
        Some("anthropic") => ANTHROPIC_FIELDS,
        Some("amazon") if titan => TITAN_FIELDS,
        Some("amazon") => NOVA_FIELDS,
        Some("meta") => LLAMA_FIELDS,
        Some("ai21") => AI21_FIELDS,
        Some("mistral" | "cohere" | "deepseek" | "openai" | "qwen" | "writer") => {
            OPENAI_STYLE_FIELDS
        }
        _ => UNKNOWN_FIELDS,
    }
}

/// Whether an Amazon body is Titan's (`inputText` or `textGenerationConfig`), not Nova's.
fn titan_shaped(body: &Value) -> bool {
    body.get("inputText").is_some() || body.get("textGenerationConfig").is_some()
}

/// Follows a dotted path through objects.
fn lookup<'a>(body: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(body, |value, key| value.get(key))
}

fn validate(field: &str, value: &Value) -> Result<u64, MaxTokensError> {
    let problem = match value {
        Value::Number(n) => match positive_integer(n) {
            Ok(n) => return Ok(n),
            Err(problem) => problem,
        },
        Value::String(s) if s.trim().parse::<u64>().is_ok() => format!(
            "must be a positive integer, got the string {} (write the number without quotes)",
            value
        ),
        Value::String(_) => format!("must be a positive integer, got the string {}", clip(value)),
        Value::Bool(b) => format!("must be a positive integer, got {b}"),
        Value::Array(_) => "must be a positive integer, got an array".to_string(),
        Value::Object(_) => "must be a positive integer, got an object".to_string(),
        Value::Null => "must be a positive integer, got null".to_string(),
    };
    Err(MaxTokensError {
        field: field.to_string(),
        problem,
    })
}

fn positive_integer(n: &Number) -> Result<u64, String> {
    let got = || format!("must be a positive integer, got {n}");
    let too_large =
        || format!("must be a positive integer no larger than {MAX_TOKENS_LIMIT}, got {n}");
    if let Some(u) = n.as_u64() {
        return match u {
            0 => Err(got()),
            u if u > MAX_TOKENS_LIMIT => Err(too_large()),
            u => Ok(u),
        };
    }
    if n.is_i64() {
        return Err(got());
    }
    // A float: whole and in range is fine (`1024.0`), anything else is not.
    match n.as_f64() {
        Some(f) if f.fract() != 0.0 || f < 1.0 => Err(got()),
        Some(f) if f > MAX_TOKENS_LIMIT as f64 => Err(too_large()),
        // In 1..=2^31-1 with no fraction, so the cast is exact.
        Some(f) => Ok(f as u64),
        None => Err(got()),
    }
}

/// A JSON value for an error message, cut to a readable length.
fn clip(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(40) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

#[cfg(test)]
#[path = "max_tokens_tests.rs"]
mod tests;
