//! The forwarded body, when it must say what the caller's does not: the one place the proxy
//! re-serialises a request body (parsed once into a `Value`, edited, written once).
//!
//! Three edits, each for what upstream reads (and a third, [`with_model`], once a call of the
//! OpenAI or Anthropic APIs spills to another pool: its `model`):
//! - the route's `max_tokens_ceiling` ([`super::ceiling`]) or, below it, the cap the route's
//!   `adaptive_max_tokens` learned ([`super::adaptive`]), written into the field the operation
//!   reads ([`crate::bedrock::max_tokens::clamp_max_tokens`]);
//! - a streamed Chat Completions call that did not ask for its usage
//!   (`stream_options.include_usage` absent or false) gets `include_usage: true`, so the stream
//!   ends with a usage chunk to settle on; the proxy takes that chunk out of what the client
//!   receives ([`crate::bedrock::sse::UsageChunkFilter`]), so the client gets the stream it asked
//!   for;
//! - a route's forced service tier (`routes[].service_tier`), as Converse's `serviceTier.type` or
//!   the OpenAI and Anthropic APIs' `service_tier` (InvokeModel's is a header:
//!   [`super::Admitted::service_tier_header`]).

use bytes::Bytes;
use serde_json::Value;

use super::Problem;
use crate::bedrock::{ModelRef, Operation, max_tokens::clamp_max_tokens, tier::ServiceTier};

/// What the forwarded body must say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Edits {
    /// Write this `maxTokens` ceiling (the route's, or its learned cap).
    pub ceiling: Option<u64>,
    /// Set `stream_options.include_usage` to true.
    pub ask_usage: bool,
    /// Name this tier in the body ([`super::body::tier_member`]).
    pub tier: Option<ServiceTier>,
}

impl Edits {
    fn is_empty(&self) -> bool {
        self.ceiling.is_none() && !self.ask_usage && self.tier.is_none()
    }
}

/// The body to forward instead of `body`, or `None` when nothing needs writing.
pub(super) fn apply(
    operation: Operation,
    model: &ModelRef<'_>,
    body: &Bytes,
    edits: Edits,
) -> Result<Option<Bytes>, Problem> {
    if edits.is_empty() {
        return Ok(None);
    }
    let failed = |reason: String| match edits.ceiling {
        Some(ceiling) => Problem::CannotClamp { ceiling, reason },
        None => Problem::CannotAskUsage { reason },
    };
    let mut json: Value =
        serde_json::from_slice(body).map_err(|e| failed(format!("the body is not JSON ({e})")))?;
    if let Some(ceiling) = edits.ceiling {
        clamp_max_tokens(operation, model.provider(), &mut json, ceiling)
            .map_err(|e| failed(e.to_string()))?;
    }
    if edits.ask_usage {
        ask_usage(&mut json).map_err(failed)?;
    }
    let member = super::body::tier_member(operation);
    if let (Some(tier), Some(member), Value::Object(top)) = (edits.tier, member, &mut json) {
        let named = match member {
            "serviceTier" => serde_json::json!({ "type": tier.label() }),
            _ => Value::String(tier.label().into()),
        };
        top.insert(member.into(), named);
    }
    let rewritten = serde_json::to_vec(&json).map_err(|e| failed(e.to_string()))?;
    Ok(Some(Bytes::from(rewritten)))
}

/// `body` (an OpenAI or Anthropic API call of `operation`) with its `model` set to `model_id`:
/// a call spilled to another pool ([`super::spill`]).
pub(super) fn with_model(
    operation: Operation,
    body: &Bytes,
    model_id: &str,
) -> Result<Bytes, Problem> {
    let mut json: Value = serde_json::from_slice(body).map_err(|e| Problem::NotJson {
        operation: operation.name(),
        error: e.to_string(),
    })?;
    let Value::Object(top) = &mut json else {
        return Err(Problem::NotObject {
            operation: operation.name(),
        });
    };
    top.insert("model".into(), Value::String(model_id.to_string()));
    let rewritten = serde_json::to_vec(&json).map_err(|e| Problem::NotJson {
        operation: operation.name(),
        error: e.to_string(),
    })?;
    Ok(Bytes::from(rewritten))
}

/// `stream_options.include_usage = true`, keeping any other stream option.
fn ask_usage(body: &mut Value) -> Result<(), String> {
    let Value::Object(top) = body else {
        return Err("the body is not a JSON object".into());
    };
    let options = top
        .entry("stream_options")
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    if options.is_null() {
        *options = Value::Object(serde_json::Map::new());
    }
    let Value::Object(options) = options else {
        return Err("stream_options is not an object".into());
    };
    options.insert("include_usage".into(), Value::Bool(true));
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn rewrite(body: Value, edits: Edits) -> Option<Value> {
        let model = ModelRef::parse("openai.gpt-oss-120b-1:0");
        let bytes = Bytes::from(body.to_string());
        apply(Operation::OpenAIChatCompletions, &model, &bytes, edits)
            .unwrap()
            .map(|b| serde_json::from_slice(&b).unwrap())
    }

    #[test]
    fn nothing_to_write_forwards_the_body_as_sent() {
        assert_eq!(rewrite(json!({"model": "m"}), Edits::default()), None);
    }

    #[test]
    fn usage_is_asked_for_keeping_other_stream_options() {
        let ask = Edits {
            ask_usage: true,
            ..Edits::default()
        };
        let body = json!({"model": "m", "stream": true});
        assert_eq!(
            rewrite(body, ask),
            Some(json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}}))
        );
        let body = json!({"stream": true, "stream_options": {"include_usage": false, "x": 1}});
        assert_eq!(
            rewrite(body, ask).unwrap()["stream_options"],
            json!({"include_usage": true, "x": 1})
        );
        let body = json!({"stream": true, "stream_options": null});
        assert_eq!(
            rewrite(body, ask).unwrap()["stream_options"],
            json!({"include_usage": true})
        );
    }

    #[test]
    fn both_edits_in_one_pass() {
        let edits = Edits {
            ceiling: Some(100),
            ask_usage: true,
            tier: None,
        };
        let body = json!({"stream": true, "max_tokens": 5000});
        assert_eq!(
            rewrite(body, edits),
            Some(
                json!({"stream": true, "max_tokens": 100, "stream_options": {"include_usage": true}})
            )
        );
    }

    #[test]
    fn a_forced_tier_replaces_the_one_converse_named() {
        let model = ModelRef::parse("anthropic.claude-sonnet-4-20250514-v1:0");
        let edits = Edits {
            tier: Some(ServiceTier::Flex),
            ..Edits::default()
        };
        for body in [
            json!({"messages": []}),
            json!({"messages": [], "serviceTier": {"type": "priority"}}),
        ] {
            let bytes = Bytes::from(body.to_string());
            let written = apply(Operation::Converse, &model, &bytes, edits).unwrap();
            let written: Value = serde_json::from_slice(&written.unwrap()).unwrap();
            assert_eq!(
                written,
                json!({"messages": [], "serviceTier": {"type": "flex"}})
            );
        }
        let body = json!({"model": "m", "service_tier": "auto"});
        assert_eq!(
            rewrite(body, edits),
            Some(json!({"model": "m", "service_tier": "flex"}))
        );
    }
}
