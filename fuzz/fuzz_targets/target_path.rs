//! The request line: `Target::parse` on any method and raw path, then `ModelRef::parse` and the
//! application-profile id of whatever modelId it decodes.
//!
//! Properties: never panics; a decoded modelId is never empty; encoding it again the way the
//! SDKs do (`:` as `%3A`, `/` as `%2F`) and parsing gives back the same target.

#![no_main]

use http::Method;
use libfuzzer_sys::fuzz_target;
use tokengate::bedrock::{ModelRef, Target, model_id::application_profile_id};

/// What SDKs leave unencoded in a path segment (the proxy's own CountTokens path uses the same).
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

fuzz_target!(|input: (u8, &str)| {
    let (selector, path) = input;
    let method = match selector % 4 {
        0 => Method::POST,
        1 => Method::GET,
        2 => Method::PUT,
        _ => Method::DELETE,
    };
    let Ok(target) = Target::parse(&method, path) else {
        return;
    };
    let Some(model_id) = &target.model_id else {
        return;
    };
    assert!(!model_id.is_empty());
    let model = ModelRef::parse(model_id);
    let _ = (model.provider(), model.route.label(), &model.base_model);
    let _ = application_profile_id(model_id);

    // Round trip: the modelId, encoded as an SDK would, parses back to the same target.
    let (_, segment) = path
        .rsplit_once('/')
        .expect("a model path has an operation segment");
    let encoded = percent_encoding::utf8_percent_encode(model_id, SEGMENT);
    let again = Target::parse(&method, &format!("/model/{encoded}/{segment}"));
    assert_eq!(again.as_ref(), Ok(&target), "{path:?}");
});
