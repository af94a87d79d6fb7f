//! Tests of `maxTokens` reading and clamping.

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
    let body = json!({"messages": [], "inferenceConfig": {"maxTokens": 512, "temperature": 0.2}});
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
    let mut converse = serde_json::json!({"messages": [], "inferenceConfig": {"maxTokens": 4000}});
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
        (
            Operation::OpenAIChatCompletions,
            Some("openai"),
            None,
            Some(CHAT_FIELDS[0]),
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
    assert_eq!(&FIELDS[..UNKNOWN_FIELDS.len()], UNKNOWN_FIELDS);
    for (at, path) in FIELDS.iter().enumerate() {
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
    for path in [CHAT_FIELDS, RESPONSES_FIELDS, MESSAGES_FIELDS].concat() {
        assert!(FIELDS.contains(&path), "{path} is read by an API");
    }
}

#[test]
fn the_openai_and_anthropic_apis_read_their_own_cap() {
    let read = |op, body: Value| requested_max_tokens(op, None, &body);
    let chat = Operation::OpenAIChatCompletions;
    assert_eq!(
        read(chat, json!({"max_completion_tokens": 80})),
        Ok(Some(80))
    );
    assert_eq!(read(chat, json!({"max_tokens": 70})), Ok(Some(70)));
    // Both: the larger, whichever upstream obeys.
    let both = json!({"max_completion_tokens": 80, "max_tokens": 900});
    assert_eq!(read(chat, both), Ok(Some(900)));
    assert_eq!(read(chat, json!({"max_output_tokens": 5})), Ok(None));
    assert!(
        message(read(
            chat,
            json!({"max_completion_tokens": 8, "max_tokens": -1})
        ))
        .starts_with("max_tokens ")
    );
    let responses = Operation::OpenAIResponses;
    assert_eq!(
        read(responses, json!({"max_output_tokens": 64})),
        Ok(Some(64))
    );
    assert_eq!(read(responses, json!({"max_tokens": 64})), Ok(None));
    let messages = Operation::AnthropicMessages;
    assert_eq!(read(messages, json!({"max_tokens": 1024})), Ok(Some(1024)));
    assert_eq!(
        read(messages, json!({"max_completion_tokens": 9})),
        Ok(None)
    );
}

#[test]
fn clamp_writes_each_api_s_own_field() {
    let chat = Operation::OpenAIChatCompletions;
    let mut both = json!({"max_completion_tokens": 50, "max_tokens": 5000});
    assert_eq!(clamp_max_tokens(chat, None, &mut both, 100), Ok(true));
    assert_eq!(
        both,
        json!({"max_completion_tokens": 50, "max_tokens": 100})
    );
    let mut absent = json!({"messages": []});
    assert_eq!(clamp_max_tokens(chat, None, &mut absent, 100), Ok(true));
    assert_eq!(absent["max_completion_tokens"], 100);
    let mut under = json!({"max_tokens": 10});
    assert_eq!(clamp_max_tokens(chat, None, &mut under, 100), Ok(false));
    let mut responses = json!({"input": "hi"});
    assert_eq!(
        clamp_max_tokens(Operation::OpenAIResponses, None, &mut responses, 300),
        Ok(true)
    );
    assert_eq!(responses["max_output_tokens"], 300);
    let mut messages = json!({"max_tokens": 4096});
    assert_eq!(
        clamp_max_tokens(Operation::AnthropicMessages, None, &mut messages, 300),
        Ok(true)
    );
    assert_eq!(messages["max_tokens"], 300);
}
