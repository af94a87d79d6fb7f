//! Tests of operations and their paths.

use super::*;

fn post(path: &str) -> Result<Target, TargetError> {
    Target::parse(&Method::POST, path)
}

#[test]
fn model_operations_decode_the_model_id_once() {
    let t = post("/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse-stream").unwrap();
    assert_eq!(t.operation, Operation::ConverseStream);
    assert_eq!(
        t.model_id.as_deref(),
        Some("us.anthropic.claude-sonnet-4-20250514-v1:0")
    );

    let arn = "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Ainference-profile%2Fus.anthropic.claude-3-haiku-20240307-v1%3A0/invoke";
    let t = post(arn).unwrap();
    assert_eq!(t.operation, Operation::InvokeModel);
    assert_eq!(
        t.model_id.as_deref(),
        Some(
            "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-3-haiku-20240307-v1:0"
        )
    );
    // A doubly-encoded sequence would name another model to a server that decodes again.
    assert!(matches!(
        post("/model/a%253Ab/count-tokens"),
        Err(TargetError::UnsafePath { .. })
    ));
}

#[test]
fn every_model_operation_routes() {
    for (seg, op) in [
        ("converse", Operation::Converse),
        ("converse-stream", Operation::ConverseStream),
        ("invoke", Operation::InvokeModel),
        (
            "invoke-with-response-stream",
            Operation::InvokeModelWithResponseStream,
        ),
        (
            "invoke-with-bidirectional-stream",
            Operation::InvokeModelWithBidirectionalStream,
        ),
        ("count-tokens", Operation::CountTokens),
    ] {
        assert_eq!(post(&format!("/model/m/{seg}")).unwrap().operation, op);
    }
}

#[test]
fn other_operations_route() {
    assert_eq!(
        post("/guardrail/gr1/version/3/apply").unwrap().operation,
        Operation::ApplyGuardrail
    );
    assert_eq!(
        post("/guardrail-checks/invoke").unwrap().operation,
        Operation::InvokeGuardrailChecks
    );
    assert_eq!(
        post("/async-invoke").unwrap().operation,
        Operation::StartAsyncInvoke
    );
    let get = |p| Target::parse(&Method::GET, p);
    assert_eq!(
        get("/async-invoke").unwrap().operation,
        Operation::ListAsyncInvokes
    );
    assert_eq!(
        get("/async-invoke/arn%3Aaws%3Ax").unwrap().operation,
        Operation::GetAsyncInvoke
    );
}

#[test]
fn the_openai_and_anthropic_apis_route_with_the_model_in_the_body() {
    for (path, op) in [
        (
            "/openai/v1/chat/completions",
            Operation::OpenAIChatCompletions,
        ),
        ("/v1/chat/completions", Operation::OpenAIChatCompletions),
        ("/openai/v1/responses", Operation::OpenAIResponses),
        ("/anthropic/v1/messages", Operation::AnthropicMessages),
    ] {
        let t = post(path).unwrap();
        assert_eq!((t.operation, t.model_id), (op, None), "{path}");
        assert!(op.model_in_body() && op.consumes_quota(), "{path}");
        assert!(Target::parse(&Method::GET, path).is_err(), "{path}");
    }
    for path in [
        "/openai/v1/models",
        "/openai/v1/chat/completions/x",
        "/anthropic/v1/messages/count_tokens",
        "/v1/responses",
    ] {
        assert!(
            matches!(post(path), Err(TargetError::UnknownOperation { .. })),
            "{path}"
        );
    }
    assert!(matches!(
        post("/openai/v1/../v1/chat/completions"),
        Err(TargetError::UnsafePath { .. })
    ));
    assert_eq!(Operation::Converse.api(), Api::Bedrock);
    assert!(!Operation::InvokeModel.model_in_body());
}

#[test]
fn every_operation_but_guardrail_checks_has_an_iam_action() {
    for op in Operation::ALL {
        let expected = op != Operation::InvokeGuardrailChecks;
        assert_eq!(op.iam_action().is_some(), expected, "{op}");
    }
    // The Converse API is authorized by the InvokeModel actions, not by actions of its own.
    assert_eq!(
        Operation::Converse.iam_action(),
        Operation::InvokeModel.iam_action()
    );
    assert_eq!(
        Operation::ConverseStream.iam_action(),
        Operation::InvokeModelWithResponseStream.iam_action()
    );
}

#[test]
fn bad_paths_are_refused() {
    assert!(matches!(
        post("/model/m/chat"),
        Err(TargetError::UnknownOperation { .. })
    ));
    assert!(matches!(
        post("/model//converse"),
        Err(TargetError::UnsafePath { .. })
    ));
    for path in [
        "/model/a/../b/converse",
        "/model/./m/converse",
        "/model/m/./converse",
        "/model/m/%2E%2E/converse",
        "/model/a%2F..%2Fb/converse",
        "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2F%2Fm/converse",
        "//model/m/converse",
        "/model/m/converse/",
        "/model/%2525/converse",
    ] {
        assert!(
            matches!(post(path), Err(TargetError::UnsafePath { .. })),
            "{path}"
        );
    }
    let get = |p| Target::parse(&Method::GET, p);
    assert!(matches!(
        get("/async-invoke/x/../../model/m/converse"),
        Err(TargetError::UnsafePath { .. })
    ));
    assert!(matches!(
        get("/async-invoke/"),
        Err(TargetError::UnsafePath { .. })
    ));
    assert!(matches!(
        post("/model/a%G1/converse"),
        Err(TargetError::BadModelIdEncoding)
    ));
    assert!(matches!(
        post("/model/a%/converse"),
        Err(TargetError::BadModelIdEncoding)
    ));
    assert!(matches!(
        post("/model/%FF%FE/converse"),
        Err(TargetError::BadModelIdEncoding)
    ));
    assert!(Target::parse(&Method::GET, "/model/m/converse").is_err());
    assert!(post("/guardrail/x/version//apply").is_err());
    assert!(post("/").is_err());
}
