//! A request body as admission reads it: `admission::body::read`, the one pass every model call
//! goes through (`maxTokens` and the input estimate, without a `Value` tree), checked against
//! the `Value` path it must agree with: `serde_json::from_slice::<Value>`, then
//! `requested_max_tokens` and `estimate_input_tokens`, for every operation and model family.
//!
//! Properties: never panics; `read` refuses exactly what `from_slice::<Value>` refuses, with the
//! same message, and any JSON that is not an object; on an object, `maxTokens` (or its error) is
//! the `Value` path's; the estimate is the `Value` path's, except that a member name repeated
//! within one object counts each time in the one pass (a `Value` keeps the last), so with
//! repeats it may only be higher; and it is at least the per-request overhead.

#![no_main]

use std::collections::HashSet;

#[path = "families.rs"]
mod families;

use families::PROVIDERS;
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use tokengate::{
    admission::{
        body::{BodyError, read},
        estimate::{PER_REQUEST_TOKENS, estimate_input_tokens},
    },
    bedrock::{Operation, max_tokens::requested_max_tokens},
};

fn run(body: &[u8]) {
    let parsed = serde_json::from_slice::<Value>(body);
    let repeats = parsed.is_ok() && has_repeated_member(body);
    for operation in Operation::ALL {
        for provider in PROVIDERS {
            let raw = read(operation, provider, body);
            let json = match &parsed {
                Err(expected) => {
                    match raw {
                        Err(BodyError::NotJson(e)) => {
                            assert_eq!(e.to_string(), expected.to_string())
                        }
                        other => panic!("{operation} {provider:?}: {other:?}, not {expected}"),
                    }
                    continue;
                }
                Ok(json) => json,
            };
            if !json.is_object() {
                assert!(matches!(raw, Err(BodyError::NotObject)), "{raw:?}");
                continue;
            }
            let estimate = estimate_input_tokens(operation, json);
            match (raw, requested_max_tokens(operation, provider, json)) {
                (Ok(facts), Ok(max_tokens)) => {
                    assert_eq!(facts.max_tokens, max_tokens, "{operation} {provider:?}");
                    assert!(facts.input_tokens >= PER_REQUEST_TOKENS);
                    if repeats {
                        assert!(facts.input_tokens >= estimate, "{operation}");
                    } else {
                        assert_eq!(facts.input_tokens, estimate, "{operation}");
                    }
                }
                (Err(BodyError::MaxTokens(raw)), Err(expected)) => assert_eq!(raw, expected),
                (raw, expected) => panic!("{operation} {provider:?}: {raw:?} against {expected:?}"),
            }
        }
    }
}

/// Whether some object in `body` (valid JSON) names a member twice.
fn has_repeated_member(body: &[u8]) -> bool {
    let mut de = serde_json::Deserializer::from_slice(body);
    Repeats::deserialize(&mut de).is_ok_and(|r| r.0)
}

/// Walks any JSON value, noting whether an object repeats a member name.
struct Repeats(bool);

impl<'de> Deserialize<'de> for Repeats {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(RepeatsVisitor)
    }
}

struct RepeatsVisitor;

impl<'de> Visitor<'de> for RepeatsVisitor {
    type Value = Repeats;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Repeats, E> {
        Ok(Repeats(false))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Repeats, E> {
        Ok(Repeats(false))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Repeats, E> {
        Ok(Repeats(false))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Repeats, E> {
        Ok(Repeats(false))
    }
    fn visit_str<E>(self, _: &str) -> Result<Repeats, E> {
        Ok(Repeats(false))
    }
    fn visit_unit<E>(self) -> Result<Repeats, E> {
        Ok(Repeats(false))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Repeats, A::Error> {
        let mut any = false;
        while let Some(r) = seq.next_element::<Repeats>()? {
            any |= r.0;
        }
        Ok(Repeats(any))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Repeats, A::Error> {
        let (mut seen, mut any) = (HashSet::new(), false);
        while let Some(key) = map.next_key::<String>()? {
            any |= !seen.insert(key);
            any |= map.next_value::<Repeats>()?.0;
        }
        Ok(Repeats(any))
    }
}

fuzz_target!(|body: &[u8]| run(body));
