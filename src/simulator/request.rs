//! Reading requests: the input-token rule, `maxTokens` per body family, the Converse
//! `serviceTier`, and `[sim:...]` directives.
//!
//! # The input-token rule
//! `input = ceil(B / 4) + 3 x M`, at least 1, where `B` is the UTF-8 byte length of every JSON
//! string value under the prompt fields (`messages`, `system`, `prompt`, `inputText`), except the
//! values of `role` and `type` keys, and `M` is the number of `messages` (1 for a `prompt` or
//! `inputText` body). The same rule serves Converse, every InvokeModel family and CountTokens.

use base64::Engine;
use serde_json::Value;

use super::models::Family;
use super::tier::Tier;

/// What the simulator needs from a model call's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub input_tokens: u64,
    /// The requested maximum output, `None` when absent.
    pub max_tokens: Option<u64>,
    /// The service tier the body asks for (Converse `serviceTier`), `None` when absent.
    pub tier: Option<Tier>,
}

/// A request the simulator refuses with a 400 `ValidationException`.
pub type Invalid = String;

const PROMPT_FIELDS: [&str; 4] = ["messages", "system", "prompt", "inputText"];

/// Applies the input-token rule to a body object.
pub fn input_tokens(body: &Value) -> u64 {
    let mut messages = 0;
    let texts = PROMPT_FIELDS.iter().filter_map(|field| {
        let v = body.get(*field)?;
        messages += match (*field, v) {
            ("messages", Value::Array(a)) => a.len() as u64,
            ("prompt" | "inputText", _) => 1,
            _ => 0,
        };
        Some(v)
    });
    let texts: Vec<&Value> = texts.collect();
    input_tokens_of(texts, messages)
}

/// The input-token rule over the given values: `ceil(string bytes / 4) + 3 x messages`, at
/// least 1 (the Responses API's `input` and `instructions` use it directly).
pub fn input_tokens_of<'a>(texts: impl IntoIterator<Item = &'a Value>, messages: u64) -> u64 {
    let mut bytes = 0usize;
    for v in texts {
        text_bytes(v, &mut bytes);
    }
    (bytes.div_ceil(4) as u64 + 3 * messages).max(1)
}

fn text_bytes(v: &Value, total: &mut usize) {
    match v {
        Value::String(s) => *total += s.len(),
        Value::Array(items) => items.iter().for_each(|i| text_bytes(i, total)),
        Value::Object(map) => {
            for (k, v) in map {
                if k != "role" && k != "type" {
                    text_bytes(v, total);
                }
            }
        }
        _ => {}
    }
}

pub(crate) fn parse_object(body: &[u8]) -> Result<Value, Invalid> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("Malformed input request: the body must be a JSON object, please reformat your input and try again.".into()),
        Err(e) => Err(format!("Malformed input request: {e}, please reformat your input and try again.")),
    }
}

/// The value at a path of keys, if present and not null.
pub(crate) fn at<'a>(body: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter()
        .try_fold(body, |v, k| v.get(k))
        .filter(|v| !v.is_null())
}

/// A positive integer at `path`, `Ok(None)` when absent.
pub(crate) fn positive(body: &Value, path: &[&str], name: &str) -> Result<Option<u64>, Invalid> {
    match at(body, path) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(format!(
                "{name} must be an integer greater than or equal to 1."
            )),
        },
    }
}

/// Refuses a maximum above the model's.
pub(crate) fn check_max(max_tokens: Option<u64>, model_max: u64) -> Result<Option<u64>, Invalid> {
    match max_tokens {
        Some(n) if n > model_max => Err(format!(
            "The maximum tokens you requested exceeds the model limit of {model_max}. Try again with a maximum tokens value that is lower than {model_max}."
        )),
        other => Ok(other),
    }
}

/// A Converse or ConverseStream body.
pub fn converse(body: &[u8], model_max: u64) -> Result<Prompt, Invalid> {
    let v = parse_object(body)?;
    converse_value(&v, model_max)
}

fn converse_value(v: &Value, model_max: u64) -> Result<Prompt, Invalid> {
    match v.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => {}
        Some(Value::Array(_)) => {
            return Err("A conversation must start with a user message. Try again with a conversation that starts with a user message.".into());
        }
        _ => {
            return Err("1 validation error detected: Value null at 'messages' failed to satisfy constraint: Member must not be null".into());
        }
    }
    // Structures of the wrong JSON type are refused, as Bedrock's deserializer refuses them.
    for (key, is_type, kind) in [
        (
            "inferenceConfig",
            Value::is_object as fn(&Value) -> bool,
            "a structure",
        ),
        ("system", Value::is_array, "a list"),
    ] {
        if at(v, &[key]).is_some_and(|x| !is_type(x)) {
            return Err(format!(
                "1 validation error detected: Value at '{key}' failed to satisfy constraint: Member must be {kind}"
            ));
        }
    }
    let max = positive(
        v,
        &["inferenceConfig", "maxTokens"],
        "inferenceConfig.maxTokens",
    )?;
    Ok(Prompt {
        input_tokens: input_tokens(v),
        max_tokens: check_max(max, model_max)?,
        tier: converse_tier(v)?,
    })
}

/// `"serviceTier": {"type": "priority" | "default" | "flex" | "reserved"}`.
fn converse_tier(v: &Value) -> Result<Option<Tier>, Invalid> {
    let Some(tier) = at(v, &["serviceTier"]) else {
        return Ok(None);
    };
    match tier.get("type").and_then(Value::as_str) {
        Some(name) => Tier::parse(name).map(Some).map_err(|_| tier_error(name, "serviceTier.type")),
        None => Err("1 validation error detected: Value null at 'serviceTier.type' failed to satisfy constraint: Member must not be null".into()),
    }
}

/// Bedrock's message for a tier name outside the enum.
pub fn tier_error(name: &str, at: &str) -> Invalid {
    format!(
        "1 validation error detected: Value '{name}' at '{at}' failed to satisfy constraint: Member must satisfy enum value set: [priority, default, flex, reserved]"
    )
}

fn required(v: &Value, key: &str) -> Result<(), Invalid> {
    if at(v, &[key]).is_none() {
        return Err(format!(
            "Malformed input request: #: required key [{key}] not found, please reformat your input and try again."
        ));
    }
    Ok(())
}

/// An InvokeModel or InvokeModelWithResponseStream body of the model's family.
pub fn invoke(family: Family, body: &[u8], model_max: u64) -> Result<Prompt, Invalid> {
    let v = parse_object(body)?;
    let max = match family {
        Family::Anthropic => {
            required(&v, "anthropic_version")?;
            required(&v, "max_tokens")?;
            required(&v, "messages")?;
            positive(&v, &["max_tokens"], "max_tokens")?
        }
        Family::Nova => {
            required(&v, "messages")?;
            match positive(
                &v,
                &["inferenceConfig", "maxTokens"],
                "inferenceConfig.maxTokens",
            )? {
                Some(n) => Some(n),
                None => positive(
                    &v,
                    &["inferenceConfig", "max_new_tokens"],
                    "inferenceConfig.max_new_tokens",
                )?,
            }
        }
        Family::Titan => {
            required(&v, "inputText")?;
            positive(
                &v,
                &["textGenerationConfig", "maxTokenCount"],
                "textGenerationConfig.maxTokenCount",
            )?
        }
        Family::Llama => {
            required(&v, "prompt")?;
            positive(&v, &["max_gen_len"], "max_gen_len")?
        }
        Family::Generic => {
            if at(&v, &["messages"]).is_none() && at(&v, &["prompt"]).is_none() {
                required(&v, "messages")?;
            }
            match positive(&v, &["max_tokens"], "max_tokens")? {
                Some(n) => Some(n),
                None => positive(&v, &["max_completion_tokens"], "max_completion_tokens")?,
            }
        }
    };
    Ok(Prompt {
        input_tokens: input_tokens(&v),
        max_tokens: check_max(max, model_max)?,
        tier: None,
    })
}

/// A CountTokens body: `{"input":{"converse":{...}}}` or
/// `{"input":{"invokeModel":{"body":"<base64>"}}}`. Returns the input tokens.
pub fn count_tokens(family: Family, body: &[u8]) -> Result<u64, Invalid> {
    let v = parse_object(body)?;
    if let Some(c) = at(&v, &["input", "converse"]) {
        return converse_value(c, u64::MAX).map(|p| p.input_tokens);
    }
    if let Some(b) = at(&v, &["input", "invokeModel", "body"]) {
        let inner = b
            .as_str()
            .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
            .ok_or("input.invokeModel.body must be a base64-encoded model request body")?;
        return invoke(family, &inner, u64::MAX).map(|p| p.input_tokens);
    }
    Err("1 validation error detected: Value null at 'input' failed to satisfy constraint: Member must have exactly one of converse or invokeModel".into())
}

/// `[sim:...]` directives found anywhere in a body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Directives {
    /// `[sim:output=N]`: exactly N output tokens (still capped by maxTokens).
    pub output: Option<u64>,
    /// `[sim:fault=503|500|reset|cut|stall]`.
    pub fault: Option<ForcedFault>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForcedFault {
    Unavailable,
    Internal,
    Reset,
    Cut,
    Stall,
}

impl Directives {
    pub fn scan(body: &[u8]) -> Directives {
        let mut d = Directives::default();
        let mut rest = body;
        while let Some(i) = find(rest, b"[sim:") {
            rest = &rest[i + 5..];
            let Some(end) = rest.iter().position(|&c| c == b']') else {
                break;
            };
            match std::str::from_utf8(&rest[..end])
                .ok()
                .and_then(|s| s.split_once('='))
            {
                Some(("output", n)) => d.output = n.trim().parse().ok().or(d.output),
                Some(("fault", "503")) => d.fault = Some(ForcedFault::Unavailable),
                Some(("fault", "500")) => d.fault = Some(ForcedFault::Internal),
                Some(("fault", "reset")) => d.fault = Some(ForcedFault::Reset),
                Some(("fault", "cut")) => d.fault = Some(ForcedFault::Cut),
                Some(("fault", "stall")) => d.fault = Some(ForcedFault::Stall),
                _ => {}
            }
            rest = &rest[end..];
        }
        d
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_rule() {
        // "hello world" = 11 bytes -> 3, + 3 for one message.
        let b = br#"{"messages":[{"role":"user","content":[{"text":"hello world"}]}]}"#;
        assert_eq!(converse(b, 100).unwrap().input_tokens, 6);
        let b = br#"{"system":[{"text":"abcd"}],"messages":[{"role":"user","content":[{"text":"abcd"}]},{"role":"assistant","content":[{"text":"a"}]}]}"#;
        assert_eq!(converse(b, 100).unwrap().input_tokens, 3 + 6); // ceil(9/4) + 2x3
        // The same text costs the same through every family.
        let titan = br#"{"inputText":"hello world"}"#;
        assert_eq!(invoke(Family::Titan, titan, 100).unwrap().input_tokens, 6);
        let llama = br#"{"prompt":"hello world","max_gen_len":5}"#;
        assert_eq!(
            invoke(Family::Llama, llama, 100).unwrap(),
            Prompt {
                input_tokens: 6,
                max_tokens: Some(5),
                tier: None
            }
        );
        let anthropic = br#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":9,"messages":[{"role":"user","content":"hello world"}]}"#;
        assert_eq!(
            invoke(Family::Anthropic, anthropic, 100).unwrap(),
            Prompt {
                input_tokens: 6,
                max_tokens: Some(9),
                tier: None
            }
        );
        assert_eq!(input_tokens(&serde_json::json!({})), 1);
    }

    #[test]
    fn validation() {
        assert!(
            converse(b"{not json", 100)
                .unwrap_err()
                .starts_with("Malformed input request")
        );
        assert!(converse(b"{}", 100).unwrap_err().contains("'messages'"));
        let typed =
            br#"{"messages":[{"role":"user","content":[{"text":"x"}]}],"inferenceConfig":"x"}"#;
        assert!(
            converse(typed, 100)
                .unwrap_err()
                .contains("'inferenceConfig' failed to satisfy constraint")
        );
        let big = br#"{"messages":[{"role":"user","content":[{"text":"x"}]}],"inferenceConfig":{"maxTokens":101}}"#;
        assert!(
            converse(big, 100)
                .unwrap_err()
                .contains("model limit of 100")
        );
        let no_max = br#"{"anthropic_version":"bedrock-2023-05-31","messages":[]}"#;
        assert!(
            invoke(Family::Anthropic, no_max, 100)
                .unwrap_err()
                .contains("[max_tokens]")
        );
        let nova = br#"{"messages":[{"role":"user","content":[{"text":"x"}]}],"inferenceConfig":{"maxTokens":0}}"#;
        assert!(invoke(Family::Nova, nova, 100).is_err());
        let generic = br#"{"prompt":"x","max_tokens":7}"#;
        assert_eq!(
            invoke(Family::Generic, generic, 100).unwrap().max_tokens,
            Some(7)
        );
    }

    #[test]
    fn converse_service_tier() {
        let body = |tier: &str| {
            format!(
                r#"{{"messages":[{{"role":"user","content":[{{"text":"x"}}]}}],"serviceTier":{tier}}}"#
            )
        };
        assert_eq!(
            converse(body(r#"{"type":"flex"}"#).as_bytes(), 100)
                .unwrap()
                .tier,
            Some(Tier::Flex)
        );
        let err = converse(body(r#"{"type":"gold"}"#).as_bytes(), 100).unwrap_err();
        assert!(err.contains("Value 'gold' at 'serviceTier.type'"), "{err}");
        assert!(
            converse(body("{}").as_bytes(), 100)
                .unwrap_err()
                .contains("'serviceTier.type'")
        );
        assert_eq!(converse(body("null").as_bytes(), 100).unwrap().tier, None);
    }

    #[test]
    fn count_tokens_bodies() {
        let c = br#"{"input":{"converse":{"messages":[{"role":"user","content":[{"text":"hello world"}]}]}}}"#;
        assert_eq!(count_tokens(Family::Anthropic, c).unwrap(), 6);
        let inner = r#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":9,"messages":[{"role":"user","content":"hello world"}]}"#;
        let b64 = base64::engine::general_purpose::STANDARD.encode(inner);
        let i = format!(r#"{{"input":{{"invokeModel":{{"body":"{b64}"}}}}}}"#);
        assert_eq!(count_tokens(Family::Anthropic, i.as_bytes()).unwrap(), 6);
        assert!(count_tokens(Family::Anthropic, b"{}").is_err());
    }

    #[test]
    fn directives() {
        let d =
            Directives::scan(b"say [sim:output=42] and [sim:fault=cut] [sim:bogus] [sim:output=x");
        assert_eq!(
            d,
            Directives {
                output: Some(42),
                fault: Some(ForcedFault::Cut)
            }
        );
        for (text, fault) in [
            (&b"[sim:fault=503]"[..], ForcedFault::Unavailable),
            (b"[sim:fault=500]", ForcedFault::Internal),
            (b"[sim:fault=reset]", ForcedFault::Reset),
        ] {
            assert_eq!(Directives::scan(text).fault, Some(fault));
        }
        assert_eq!(Directives::scan(b"nothing"), Directives::default());
    }
}
