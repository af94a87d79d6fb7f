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
/// The order tried when the provider is unknown.
pub const UNKNOWN_FIELDS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "inferenceConfig.maxTokens",
    "inferenceConfig.max_new_tokens",
    "textGenerationConfig.maxTokenCount",
    "max_gen_len",
    "maxTokens",
    "max_tokens_to_sample",
];
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
    /// Each field of [`UNKNOWN_FIELDS`] (which names every field any family reads), in its order.
    values: [Option<Value>; UNKNOWN_FIELDS.len()],
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
        for (slot, path) in fields.values.iter_mut().zip(UNKNOWN_FIELDS) {
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
            self.duplicate.get_or_insert(UNKNOWN_FIELDS[at]);
        }
    }

    /// The position of a field in [`UNKNOWN_FIELDS`], spelled out because this runs for every
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
            _ => return None,
        })
    }

    fn get(&self, path: &str) -> Option<&Value> {
        let at = UNKNOWN_FIELDS.iter().position(|p| *p == path)?;
        self.values[at].as_ref()
    }

    /// The maximum output tokens these fields ask for, `Ok(None)` if they do not say.
    pub fn resolve(
        &self,
        operation: Operation,
        provider: Option<&str>,
    ) -> Result<Option<u64>, MaxTokensError> {
        let fields = match operation {
            Operation::Converse | Operation::ConverseStream => CONVERSE_FIELDS,
            Operation::InvokeModel | Operation::InvokeModelWithResponseStream => {
                native_fields(provider, self.titan)
            }
            _ => return Ok(None),
        };
        if let Some(field) = self.duplicate {
            return Err(MaxTokensError {
                field: field.to_string(),
                problem: "appears more than once in the body; send it once".to_string(),
            });
        }
        for field in fields {
            match self.get(field) {
                None | Some(Value::Null) => continue,
                Some(value) => return validate(field, value).map(Some),
            }
        }
        Ok(None)
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
    let fields = match operation {
        Operation::Converse | Operation::ConverseStream => CONVERSE_FIELDS,
        Operation::InvokeModel | Operation::InvokeModelWithResponseStream => {
            native_fields(provider, titan_shaped(body))
        }
        _ => return Ok(false),
    };
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
            map.insert(key.to_string(), Value::from(ceiling));
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

/// The field a request of `operation` should name its maximum output tokens in (the first of its
/// family's), for a message telling the caller what to send; `None` for an unknown family or an
/// operation with no such field. `body`, when parsed, tells Titan from Nova.
pub fn field_to_set(
    operation: Operation,
    provider: Option<&str>,
    body: Option<&Value>,
) -> Option<&'static str> {
    let fields = match operation {
        Operation::Converse | Operation::ConverseStream => CONVERSE_FIELDS,
        Operation::InvokeModel | Operation::InvokeModelWithResponseStream => {
            native_fields(provider, body.is_some_and(titan_shaped))
        }
        _ => return None,
    };
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
mod tests {
    use serde_json::json;

    use super::*;

    fn invoke(provider: &str, body: Value) -> Result<Option<u64>, MaxTokensError> {
        requested_max_tokens(Operation::InvokeModel, Some(provider), &body)
    }

    fn message(result: Result<Option<u64>, MaxTokensError>) -> String {
        match result {
            Err(e) => e.to_string(),
            Ok(v) => panic!("expected an error, got {v:?}"),
        }
    }

    #[test]
    fn converse_reads_inference_config() {
        let body =
            json!({"messages": [], "inferenceConfig": {"maxTokens": 512, "temperature": 0.2}});
        for op in [Operation::Converse, Operation::ConverseStream] {
            assert_eq!(
                requested_max_tokens(op, Some("anthropic"), &body),
                Ok(Some(512))
            );
        }
        let absent = json!({"messages": [], "inferenceConfig": {"temperature": 0.2}});
        assert_eq!(
            requested_max_tokens(Operation::Converse, None, &absent),
            Ok(None)
        );
        // Converse ignores model-native names.
        let native = json!({"max_tokens": 100});
        assert_eq!(
            requested_max_tokens(Operation::Converse, None, &native),
            Ok(None)
        );
    }

    #[test]
    fn each_family_reads_its_own_field() {
        let cases = [
            (
                "anthropic",
                json!({"anthropic_version": "bedrock-2023-05-31", "max_tokens": 1024, "messages": []}),
                Some(1024),
            ),
            (
                "anthropic",
                json!({"prompt": "\n\nHuman: hi\n\nAssistant:", "max_tokens_to_sample": 300}),
                Some(300),
            ),
            (
                "amazon",
                json!({"inputText": "hi", "textGenerationConfig": {"maxTokenCount": 256}}),
                Some(256),
            ),
            ("amazon", json!({"inputText": "embed me"}), None),
            (
                "amazon",
                json!({"schemaVersion": "messages-v1", "messages": [], "inferenceConfig": {"maxTokens": 300}}),
                Some(300),
            ),
            (
                "amazon",
                json!({"messages": [], "inferenceConfig": {"max_new_tokens": 200}}),
                Some(200),
            ),
            (
                "meta",
                json!({"prompt": "hi", "max_gen_len": 128}),
                Some(128),
            ),
            (
                "mistral",
                json!({"prompt": "<s>[INST] hi [/INST]", "max_tokens": 64}),
                Some(64),
            ),
            (
                "cohere",
                json!({"message": "hi", "max_tokens": 99}),
                Some(99),
            ),
            (
                "deepseek",
                json!({"prompt": "hi", "max_tokens": 4000}),
                Some(4000),
            ),
            (
                "openai",
                json!({"messages": [], "max_completion_tokens": 800}),
                Some(800),
            ),
            ("qwen", json!({"messages": [], "max_tokens": 77}), Some(77)),
            (
                "writer",
                json!({"messages": [], "max_tokens": 55}),
                Some(55),
            ),
            ("ai21", json!({"prompt": "hi", "maxTokens": 200}), Some(200)),
            (
                "ai21",
                json!({"messages": [], "max_tokens": 210}),
                Some(210),
            ),
            ("meta", json!({"prompt": "hi", "max_tokens": 128}), None),
        ];
        for (provider, body, expected) in cases {
            assert_eq!(
                invoke(provider, body.clone()),
                Ok(expected),
                "{provider}: {body}"
            );
        }
        let stream = requested_max_tokens(
            Operation::InvokeModelWithResponseStream,
            Some("meta"),
            &json!({"max_gen_len": 5}),
        );
        assert_eq!(stream, Ok(Some(5)));
    }

    #[test]
    fn unknown_providers_try_the_common_names_in_order() {
        let body = json!({"maxTokens": 7, "max_gen_len": 9});
        assert_eq!(
            requested_max_tokens(Operation::InvokeModel, None, &body),
            Ok(Some(9))
        );
        assert_eq!(
            invoke("acme", json!({"inferenceConfig": {"maxTokens": 11}})),
            Ok(Some(11))
        );
        assert_eq!(invoke("acme", json!({"prompt": "x"})), Ok(None));
    }

    #[test]
    fn operations_without_max_tokens_say_none() {
        let body = json!({"input": {"converse": {"inferenceConfig": {"maxTokens": 5}}}});
        for op in [
            Operation::CountTokens,
            Operation::ApplyGuardrail,
            Operation::StartAsyncInvoke,
        ] {
            assert_eq!(requested_max_tokens(op, Some("anthropic"), &body), Ok(None));
        }
    }

    #[test]
    fn null_is_absent_and_whole_floats_are_integers() {
        assert_eq!(invoke("anthropic", json!({"max_tokens": null})), Ok(None));
        assert_eq!(
            invoke("anthropic", json!({"max_tokens": 1024.0})),
            Ok(Some(1024))
        );
        assert_eq!(
            invoke("anthropic", json!({"max_tokens": 2147483647})),
            Ok(Some(2147483647))
        );
    }

    #[test]
    fn unusable_values_are_errors_that_say_what_to_write() {
        let converse = |v: Value| {
            requested_max_tokens(
                Operation::Converse,
                None,
                &json!({"inferenceConfig": {"maxTokens": v}}),
            )
        };
        let cases = [
            (
                json!(-3),
                "inferenceConfig.maxTokens must be a positive integer, got -3",
            ),
            (
                json!(0),
                "inferenceConfig.maxTokens must be a positive integer, got 0",
            ),
            (
                json!(10.5),
                "inferenceConfig.maxTokens must be a positive integer, got 10.5",
            ),
            (
                json!(0.0),
                "inferenceConfig.maxTokens must be a positive integer, got 0.0",
            ),
            (
                json!(-2.0),
                "inferenceConfig.maxTokens must be a positive integer, got -2.0",
            ),
            (
                json!(2147483648u64),
                "inferenceConfig.maxTokens must be a positive integer no larger than 2147483647, got 2147483648",
            ),
            (
                json!(1e300),
                "inferenceConfig.maxTokens must be a positive integer no larger than 2147483647, got 1e+300",
            ),
            (
                json!("100"),
                "inferenceConfig.maxTokens must be a positive integer, got the string \"100\" (write the number without quotes)",
            ),
            (
                json!("lots"),
                "inferenceConfig.maxTokens must be a positive integer, got the string \"lots\"",
            ),
            (
                json!(true),
                "inferenceConfig.maxTokens must be a positive integer, got true",
            ),
            (
                json!([1]),
                "inferenceConfig.maxTokens must be a positive integer, got an array",
            ),
            (
                json!({"n": 1}),
                "inferenceConfig.maxTokens must be a positive integer, got an object",
            ),
        ];
        for (value, expected) in cases {
            assert_eq!(message(converse(value)), expected);
        }
    }

    #[test]
    fn errors_name_the_family_field() {
        let e = invoke(
            "amazon",
            json!({"inputText": "x", "textGenerationConfig": {"maxTokenCount": -1}}),
        );
        assert_eq!(
            e,
            Err(MaxTokensError {
                field: "textGenerationConfig.maxTokenCount".into(),
                problem: "must be a positive integer, got -1".into(),
            })
        );
        assert!(message(invoke("meta", json!({"max_gen_len": "64"}))).starts_with("max_gen_len "));
        let long = "x".repeat(100);
        assert!(message(invoke("mistral", json!({"max_tokens": long}))).ends_with("xxx..."));
    }

    #[test]
    fn clamp_lowers_or_inserts_the_deciding_field() {
        let mut converse =
            serde_json::json!({"messages": [], "inferenceConfig": {"maxTokens": 4000}});
        assert_eq!(
            clamp_max_tokens(Operation::Converse, None, &mut converse, 1000),
            Ok(true)
        );
        assert_eq!(converse["inferenceConfig"]["maxTokens"], 1000);
        let mut small = serde_json::json!({"inferenceConfig": {"maxTokens": 10}});
        assert_eq!(
            clamp_max_tokens(Operation::Converse, None, &mut small, 1000),
            Ok(false)
        );
        let mut absent = serde_json::json!({"messages": []});
        assert_eq!(
            clamp_max_tokens(Operation::ConverseStream, None, &mut absent, 500),
            Ok(true)
        );
        assert_eq!(absent["inferenceConfig"]["maxTokens"], 500);
        let mut claude = serde_json::json!({"anthropic_version": "bedrock-2023-05-31"});
        assert_eq!(
            clamp_max_tokens(Operation::InvokeModel, Some("anthropic"), &mut claude, 300),
            Ok(true)
        );
        assert_eq!(claude["max_tokens"], 300);
        let mut titan = serde_json::json!({"inputText": "hi", "textGenerationConfig": null});
        assert_eq!(
            clamp_max_tokens(Operation::InvokeModel, Some("amazon"), &mut titan, 300),
            Ok(true)
        );
        assert_eq!(titan["textGenerationConfig"]["maxTokenCount"], 300);
        let mut unknown = serde_json::json!({"prompt": "hi"});
        assert!(clamp_max_tokens(Operation::InvokeModel, Some("acme"), &mut unknown, 300).is_err());
        let mut bad = serde_json::json!({"inferenceConfig": 3});
        assert!(clamp_max_tokens(Operation::Converse, None, &mut bad, 300).is_err());
    }

    #[test]
    fn the_field_to_set_is_the_familys_first() {
        let titan = json!({"inputText": "hi"});
        let cases = [
            (
                Operation::Converse,
                Some("meta"),
                None,
                Some("inferenceConfig.maxTokens"),
            ),
            (
                Operation::InvokeModel,
                Some("anthropic"),
                None,
                Some("max_tokens"),
            ),
            (
                Operation::InvokeModel,
                Some("amazon"),
                Some(&titan),
                Some("textGenerationConfig.maxTokenCount"),
            ),
            (
                Operation::InvokeModel,
                Some("amazon"),
                None,
                Some("inferenceConfig.maxTokens"),
            ),
            (
                Operation::InvokeModelWithResponseStream,
                Some("meta"),
                None,
                Some("max_gen_len"),
            ),
            (Operation::InvokeModel, Some("acme"), None, None),
            (Operation::CountTokens, Some("anthropic"), None, None),
        ];
        for (op, provider, body, expected) in cases {
            assert_eq!(
                field_to_set(op, provider, body),
                expected,
                "{op:?} {provider:?}"
            );
        }
    }

    #[test]
    fn slots_follow_the_unknown_fields_order() {
        for (at, path) in UNKNOWN_FIELDS.iter().enumerate() {
            let (outer, key) = match path.split_once('.') {
                Some((outer, key)) => (Some(outer), key),
                None => (None, *path),
            };
            assert_eq!(MaxTokensFields::slot(outer, key), Some(at), "{path}");
            assert_eq!(MaxTokensFields::is_field(path), outer.is_none(), "{path}");
            if let Some(outer) = outer {
                assert!(MaxTokensFields::is_config(outer), "{path}");
                assert!(CONFIG_MEMBERS.contains(&key), "{path}");
            }
        }
        let families = [
            CONVERSE_FIELDS,
            ANTHROPIC_FIELDS,
            TITAN_FIELDS,
            NOVA_FIELDS,
            LLAMA_FIELDS,
            AI21_FIELDS,
            OPENAI_STYLE_FIELDS,
        ];
        for path in families.concat() {
            assert!(UNKNOWN_FIELDS.contains(&path), "{path} is read by a family");
        }
    }
}
