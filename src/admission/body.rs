//! What admission reads from a model call's body, in one pass: `maxTokens`
//! ([`crate::bedrock::max_tokens`]) and the input estimate ([`super::estimate`]).
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyFacts {
    /// The `maxTokens` the body asks for, `None` if it does not say.
    pub max_tokens: Option<u64>,
    /// The conservative input estimate, before calibration.
    pub input_tokens: u64,
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
    let mut top = TopLevel::default();
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
    Ok(BodyFacts {
        max_tokens: top.fields.resolve(operation, provider)?,
        input_tokens: top.tally.tokens(),
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
    })
}

/// The whole body: an object walked for the estimate while its `maxTokens` members are gathered;
/// anything else is read through (so a syntax error is still reported as one) and refused.
#[derive(Default)]
struct TopLevel {
    tally: Tally,
    fields: MaxTokensFields,
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
        let mut capture = Capture(&mut self.fields);
        walk::object(&mut self.tally, 1, map, &mut capture).map(|()| true)
    }
}

/// Gathers the top-level members `maxTokens` can come from.
struct Capture<'a>(&'a mut MaxTokensFields);

impl<'de> Members<'de> for Capture<'_> {
    fn member<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<Taken, A::Error> {
        self.0.saw_member(key);
        if MaxTokensFields::is_config(key) {
            // `inferenceConfig` / `textGenerationConfig`: not model input, so the tally skips it.
            let config = Config {
                fields: &mut *self.0,
                outer: key,
            };
            map.next_value_seed(Seed(config))?;
            return Ok(Taken::Consumed);
        }
        if MaxTokensFields::is_field(key) {
            return Ok(Taken::Value(map.next_value()?));
        }
        Ok(Taken::No)
    }

    fn keep(&mut self, key: &str, value: Value) {
        self.0.set(None, key, value);
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
