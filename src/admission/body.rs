//! What admission reads from a model call's body, in one pass: `maxTokens`
//! ([`crate::bedrock::max_tokens`]) and the input estimate ([`super::estimate`]); for the OpenAI
//! and Anthropic APIs also the `model`, `stream` and Chat Completions'
//! `stream_options.include_usage` ([`ApiBody`]), each of which must appear once, with the right
//! type (the proxy meters by them: `stream` decides how the response is read).
//!
//! The body is parsed by `serde_json` straight into those two, without building a `Value`: the
//! tree's allocations were most of an admission decision's cost. Its UTF-8 is checked once, whole,
//! so the parser need not check each string again. It is validated exactly as
//! `serde_json::from_slice::<Value>` validates it (same parser, every value read, the same
//! recursion limit of 128, so deep nesting is an error, never a stack overflow), and the answers
//! are those of [`crate::bedrock::max_tokens::requested_max_tokens`] and
//! [`super::estimate::estimate_input_tokens`] on the parsed body, with one difference: a member
//! `maxTokens` is read from (any of the fields, or `inferenceConfig` / `textGenerationConfig`)
//! that appears twice is refused, where a parsed body would keep the last one (and upstream might
//! keep either). Other repeated members count each time for the estimate (see its note).
//!
//! CountTokens bodies, which admission never counts, are parsed into a `Value` and estimated on
//! the document they wrap.

use serde::de::{DeserializeSeed, MapAccess, SeqAccess};
use serde_json::Value;

use super::estimate::{
    Tally,
    walk::{self, Handler, KeySeed, Members, Seed, Taken},
};
use crate::bedrock::{
    Operation,
    max_tokens::{MaxTokensError, MaxTokensFields},
};

/// What admission needs from a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyFacts {
    /// The `maxTokens` the body asks for, `None` if it does not say.
    pub max_tokens: Option<u64>,
    /// The conservative input estimate, before calibration.
    pub input_tokens: u64,
    /// The OpenAI and Anthropic APIs' model and streaming; `None` for the other operations.
    pub api: Option<ApiBody>,
    /// The service tier the body names, as Bedrock names it: Converse's `serviceTier.type`, or
    /// the OpenAI and Anthropic APIs' `service_tier` (their `auto`, and Anthropic's
    /// `standard_only`, read as `default`).
    pub service_tier: Option<String>,
}

/// What an OpenAI or Anthropic API body says besides its cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiBody {
    /// `model`: a model id, inference profile id or ARN, as sent (no percent-decoding).
    pub model: String,
    /// `stream` (absent: false).
    pub stream: bool,
    /// Chat Completions' `stream_options.include_usage` (`None` when absent).
    pub include_usage: Option<bool>,
}

/// A body admission cannot read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("not valid JSON ({0})")]
    NotJson(#[source] serde_json::Error),
    #[error("not a JSON object")]
    NotObject,
    #[error(transparent)]
    MaxTokens(#[from] MaxTokensError),
    /// A field of an OpenAI or Anthropic API body that is missing, repeated or mistyped.
    #[error("{field} {problem}")]
    Field {
        field: &'static str,
        problem: &'static str,
    },
}

/// Reads `maxTokens` and the input estimate from a request body for `operation`;
/// `provider` is the model's provider, for model-native bodies.
pub fn read(
    operation: Operation,
    provider: Option<&str>,
    body: &[u8],
) -> Result<BodyFacts, BodyError> {
    if operation == Operation::CountTokens {
        return read_count_tokens(body);
    }
    let mut top = TopLevel {
        api: operation.model_in_body().then(ApiMembers::default),
        tier_member: tier_member(operation),
        ..TopLevel::default()
    };
    // One UTF-8 check of the whole body costs a fraction of the parser's check of each string.
    // A body that fails it is not JSON; parsing its bytes reports where, as the parser would.
    let is_object = match std::str::from_utf8(body) {
        Ok(text) => top.read(serde_json::Deserializer::from_str(text)),
        Err(_) => top.read(serde_json::Deserializer::from_slice(body)),
    }
    .map_err(BodyError::NotJson)?;
    if !is_object {
        return Err(BodyError::NotObject);
    }
    let api = top
        .api
        .as_ref()
        .map(|api| api.resolve(operation))
        .transpose()?;
    Ok(BodyFacts {
        max_tokens: top.fields.resolve(operation, provider)?,
        input_tokens: top.tally.tokens(),
        api,
        service_tier: top.service_tier.as_ref().and_then(tier_type),
    })
}

/// The member a body of `operation` names its service tier in, if it can.
pub(super) fn tier_member(operation: Operation) -> Option<&'static str> {
    if matches!(operation, Operation::Converse | Operation::ConverseStream) {
        Some("serviceTier")
    } else if operation.model_in_body() {
        Some("service_tier")
    } else {
        None
    }
}

/// The tier named: Converse's `{"type": ...}`, or an API's string (`auto` and `standard_only`
/// being its default tier).
fn tier_type(tier: &Value) -> Option<String> {
    let name = match tier {
        Value::String(name) => name.as_str(),
        named => named.get("type")?.as_str()?,
    };
    Some(match name {
        "auto" | "standard_only" => "default".to_string(),
        other => other.to_string(),
    })
}

/// The `modelId` of a StartAsyncInvoke body (`None` when absent: upstream then refuses the call
/// itself). A body that names it twice is refused: the proxy would check one and upstream might
/// run the other.
pub fn async_invoke_model_id(body: &[u8]) -> Result<Option<String>, BodyError> {
    #[derive(serde::Deserialize)]
    struct AsyncInvoke {
        #[serde(rename = "modelId")]
        model_id: Option<String>,
    }
    // serde's derived reader refuses a repeated field ("duplicate field `modelId`").
    serde_json::from_slice::<AsyncInvoke>(body)
        .map(|b| b.model_id)
        .map_err(BodyError::NotJson)
}

fn read_count_tokens(body: &[u8]) -> Result<BodyFacts, BodyError> {
    let json: Value = serde_json::from_slice(body).map_err(BodyError::NotJson)?;
    if !json.is_object() {
        return Err(BodyError::NotObject);
    }
    let mut tally = Tally::default();
    tally.count_tokens_input(&json);
    Ok(BodyFacts {
        max_tokens: None,
        input_tokens: tally.tokens(),
        api: None,
        service_tier: None,
    })
}

/// The whole body: an object walked for the estimate while its `maxTokens` members are gathered;
/// anything else is read through (so a syntax error is still reported as one) and refused.
#[derive(Default)]
struct TopLevel {
    tally: Tally,
    fields: MaxTokensFields,
    /// For the OpenAI and Anthropic APIs.
    api: Option<ApiMembers>,
    /// The member the body may name its tier in ([`tier_member`]), and what it names.
    tier_member: Option<&'static str>,
    service_tier: Option<Value>,
}

impl TopLevel {
    /// Reads the whole body; whether it is an object.
    fn read<'de, R: serde_json::de::Read<'de>>(
        &mut self,
        mut de: serde_json::Deserializer<R>,
    ) -> serde_json::Result<bool> {
        let is_object = Seed(self).deserialize(&mut de)?;
        de.end()?;
        Ok(is_object)
    }
}

impl<'de> Handler<'de> for &mut TopLevel {
    /// Whether the body is an object.
    type Out = bool;

    fn depth(&self) -> usize {
        0
    }

    fn scalar(self, _: Value) -> bool {
        false
    }

    fn string(self, _: &str) -> bool {
        false
    }

    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<bool, A::Error> {
        walk::skip_seq(seq, 0).map(|()| false)
    }

    fn map<A: MapAccess<'de>>(self, map: A) -> Result<bool, A::Error> {
        let mut capture = Capture {
            fields: &mut self.fields,
            api: self.api.as_mut(),
            tier: self.tier_member.map(|key| (key, &mut self.service_tier)),
        };
        walk::object(&mut self.tally, 1, map, &mut capture).map(|()| true)
    }
}

/// Gathers the top-level members `maxTokens` can come from (and an API body's own).
struct Capture<'a> {
    fields: &'a mut MaxTokensFields,
    api: Option<&'a mut ApiMembers>,
    /// The tier member's name and what it names (not model input: the tally skips it).
    tier: Option<(&'static str, &'a mut Option<Value>)>,
}

impl<'de> Members<'de> for Capture<'_> {
    fn member<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<Taken, A::Error> {
        if self.api.is_some() && ApiMembers::wants(key) {
            return Ok(Taken::Value(map.next_value()?));
        }
        if self.tier.as_ref().is_some_and(|(member, _)| key == *member) {
            return Ok(Taken::Value(map.next_value()?));
        }
        let fields = &mut *self.fields;
        fields.saw_member(key);
        if MaxTokensFields::is_config(key) {
            // `inferenceConfig` / `textGenerationConfig`: not model input, so the tally skips it.
            let config = Config { fields, outer: key };
            map.next_value_seed(Seed(config))?;
            return Ok(Taken::Consumed);
        }
        if MaxTokensFields::is_field(key) {
            return Ok(Taken::Value(map.next_value()?));
        }
        Ok(Taken::No)
    }

    fn keep(&mut self, key: &str, value: Value) {
        match (&mut self.api, &mut self.tier) {
            (Some(api), _) if ApiMembers::wants(key) => api.set(key, value),
            (_, Some((member, tier))) if key == *member => **tier = Some(value),
            _ => self.fields.set(None, key, value),
        }
    }
}

/// The top-level `model`, `stream` and `stream_options` of an OpenAI or Anthropic API body.
#[derive(Debug, Default)]
struct ApiMembers {
    model: Option<Value>,
    stream: Option<Value>,
    stream_options: Option<Value>,
    /// The first of them seen twice.
    duplicate: Option<&'static str>,
}

impl ApiMembers {
    const NAMES: [&'static str; 3] = ["model", "stream", "stream_options"];

    fn wants(key: &str) -> bool {
        Self::NAMES.contains(&key)
    }

    fn set(&mut self, key: &str, value: Value) {
        let (slot, name) = match key {
            "model" => (&mut self.model, Self::NAMES[0]),
            "stream" => (&mut self.stream, Self::NAMES[1]),
            "stream_options" => (&mut self.stream_options, Self::NAMES[2]),
            _ => return,
        };
        if slot.replace(value).is_some() {
            self.duplicate.get_or_insert(name);
        }
    }

    fn resolve(&self, operation: Operation) -> Result<ApiBody, BodyError> {
        let problem = |field, problem| BodyError::Field { field, problem };
        if let Some(field) = self.duplicate {
            return Err(problem(
                field,
                "appears more than once in the body; send it once",
            ));
        }
        let model = match &self.model {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            None | Some(Value::Null) => {
                return Err(problem(
                    "model",
                    "is required: name a Bedrock model id, inference profile id or ARN \
                     (e.g. \"openai.gpt-oss-120b-1:0\" or \"us.anthropic.claude-sonnet-4-20250514-v1:0\")",
                ));
            }
            Some(_) => {
                return Err(problem(
                    "model",
                    "must be a non-empty string naming a Bedrock model id, inference profile id or ARN",
                ));
            }
        };
        let stream = match &self.stream {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(problem("stream", "must be true or false")),
        };
        let include_usage = match (operation, &self.stream_options) {
            (Operation::OpenAIChatCompletions, Some(Value::Object(options))) => {
                match options.get("include_usage") {
                    None | Some(Value::Null) => None,
                    Some(Value::Bool(b)) => Some(*b),
                    Some(_) => {
                        return Err(problem(
                            "stream_options.include_usage",
                            "must be true or false",
                        ));
                    }
                }
            }
            (Operation::OpenAIChatCompletions, Some(Value::Null) | None) => None,
            (Operation::OpenAIChatCompletions, Some(_)) => {
                return Err(problem("stream_options", "must be an object"));
            }
            _ => None,
        };
        Ok(ApiBody {
            model,
            stream,
            include_usage,
        })
    }
}

/// A config object (`inferenceConfig`, `textGenerationConfig`): its `maxTokens` fields.
struct Config<'a, 'k> {
    fields: &'a mut MaxTokensFields,
    outer: &'k str,
}

impl<'de> Handler<'de> for Config<'_, '_> {
    type Out = ();

    fn depth(&self) -> usize {
        1
    }

    fn scalar(self, _: Value) {}

    fn string(self, _: &str) {}

    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        walk::skip_seq(seq, 1)
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if MaxTokensFields::is_config_field(self.outer, &key) {
                let value: Value = map.next_value()?;
                self.fields.set(Some(self.outer), &key, value);
            } else {
                map.next_value_seed(Seed(walk::Skip { depth: 2 }))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "body_tests.rs"]
mod tests;
