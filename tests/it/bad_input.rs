//! Bad input, table-driven: every case gets a clear 4xx in Bedrock's shape (`x-amzn-ErrorType`,
//! `{"message"}`, `x-amzn-RequestId`), over HTTP/1.1 and HTTP/2, and leaves the ledger at zero.
//! What the proxy can judge it answers itself, before any upstream work; what only Bedrock can
//! judge (the shape of `messages`) it forwards, and Bedrock's 400 is passed on, not charged.
//!
//! Heads too large are refused by hyper with a bare 431 before the proxy sees them: not
//! Bedrock-shaped, but the right status, and SDKs do not retry it.

use crate::common::{wire::*, *};
use tokengate::gateway::Gateway;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
const POOL: &str = "sonnet4-us";
const BODY_LIMIT: usize = 64 * 1024;

/// Who answers a bad request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    /// The proxy, before admission or upstream.
    Proxy,
    /// Upstream (Bedrock, here the simulator): forwarded, refused there, not charged.
    Upstream,
}

struct Case {
    name: &'static str,
    method: &'static str,
    path: String,
    body: Vec<u8>,
    status: u16,
    error_type: &'static str,
    /// A piece of the message that tells the caller what to change.
    says: &'static str,
    by: By,
    /// Sent over HTTP/2 (`true`), HTTP/1.1 (`false`), or both.
    over: &'static [bool],
}

fn case(
    name: &'static str,
    path: &str,
    body: impl Into<Vec<u8>>,
    (status, error_type): (u16, &'static str),
    says: &'static str,
    by: By,
) -> Case {
    Case {
        name,
        method: "POST",
        path: path.to_string(),
        body: body.into(),
        status,
        error_type,
        says,
        by,
        over: &[false, true],
    }
}

const VALIDATION: (u16, &str) = (400, "ValidationException");
const UNKNOWN_OP: (u16, &str) = (404, "UnknownOperationException");

/// A Converse body whose `inferenceConfig` is `config` (raw JSON).
fn with_config(config: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":[{{"text":"x"}}]}}],"inferenceConfig":{config}}}"#
    )
}

// One line per case reads as a table.
#[rustfmt::skip]
fn cases() -> Vec<Case> {
    use By::*;
    let converse = model_path(SONNET_US, "converse");
    let invoke = model_path(SONNET_US, "invoke");
    let deep_array = "[".repeat(10_000);
    let deep_object = format!(
        r#"{{"messages":[{{"role":"user","content":[{{"text":"x"}}]}}],"additionalModelRequestFields":{}1{}}}"#,
        r#"{"a":"#.repeat(200),
        "}".repeat(200)
    );
    let invalid_utf8 = &b"{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"\xff\xfe\"}]}]}"[..];
    let over_limit = converse_body(&"x".repeat(BODY_LIMIT), Some(10));
    let double_encoded = converse.replace("%3A", "%253A");
    let bidirectional = model_path(SONNET_US, "invoke-with-bidirectional-stream");
    let llama = model_path("meta.llama3-70b-instruct-v1:0", "converse");
    let mut cases = vec![
        // Operations and paths.
        case("unknown operation", "/model/x/chat", "{}", UNKNOWN_OP, "no bedrock-runtime operation", Proxy),
        case("unknown path", "/runtime/converse", "{}", UNKNOWN_OP, "POST /model/{modelId}/converse", Proxy),
        case("root", "/", "{}", UNKNOWN_OP, "no bedrock-runtime operation", Proxy),
        Case { over: &[false], ..case("bidirectional stream over HTTP/1.1", &bidirectional, "{}", VALIDATION, "needs HTTP/2", Proxy) },
        Case { over: &[true], ..case("bidirectional stream of a model without it", &bidirectional, "{}", VALIDATION, "Nova Sonic", Upstream) },
        // modelId encoding.
        case("bad escape", "/model/a%G1/converse", "{}", VALIDATION, "percent-encoded once", Proxy),
        case("trailing %", "/model/claude%/converse", "{}", VALIDATION, "percent-encoded once", Proxy),
        case("escape to invalid UTF-8", "/model/%FF%FE/converse", "{}", VALIDATION, "not valid percent-encoded UTF-8", Proxy),
        case("empty modelId", "/model//converse", "{}", VALIDATION, "has an empty segment", Proxy),
        case("double-encoded modelId", &double_encoded, "{}", VALIDATION, "percent-encoded twice", Proxy),
        case("unknown model", &llama, converse_body("x", Some(10)), VALIDATION, "[[pools]]", Proxy),
        // Bodies that are not a JSON object.
        case("malformed JSON", &converse, "{not json", VALIDATION, "not valid JSON", Proxy),
        case("empty body", &converse, "", VALIDATION, "not valid JSON", Proxy),
        case("a JSON array", &converse, "[]", VALIDATION, "must be a JSON object", Proxy),
        case("JSON null", &converse, "null", VALIDATION, "must be a JSON object", Proxy),
        case("invalid UTF-8", &converse, invalid_utf8, VALIDATION, "not valid JSON", Proxy),
        case("deeply nested array", &converse, deep_array, VALIDATION, "recursion limit", Proxy),
        case("deeply nested object", &converse, deep_object, VALIDATION, "recursion limit", Proxy),
        case("body over max_body_bytes", &converse, over_limit, VALIDATION, "max_body_bytes", Proxy),
        // maxTokens.
        case("maxTokens zero", &converse, with_config(r#"{"maxTokens":0}"#), VALIDATION, "maxTokens must be a positive integer", Proxy),
        case("maxTokens negative", &converse, with_config(r#"{"maxTokens":-5}"#), VALIDATION, "maxTokens must be a positive integer", Proxy),
        case("maxTokens fractional", &converse, with_config(r#"{"maxTokens":1.5}"#), VALIDATION, "maxTokens must be a positive integer", Proxy),
        case("maxTokens a string", &converse, with_config(r#"{"maxTokens":"12"}"#), VALIDATION, "without quotes", Proxy),
        case("maxTokens a boolean", &converse, with_config(r#"{"maxTokens":true}"#), VALIDATION, "maxTokens must be a positive integer", Proxy),
        case("maxTokens past u64", &converse, with_config(r#"{"maxTokens":18446744073709551616}"#), VALIDATION, "no larger than 2147483647", Proxy),
        case("maxTokens 1e30", &converse, with_config(r#"{"maxTokens":1e30}"#), VALIDATION, "no larger than 2147483647", Proxy),
        case("maxTokens past i32", &converse, with_config(r#"{"maxTokens":99999999999}"#), VALIDATION, "no larger than 2147483647", Proxy),
        case("max_tokens negative (InvokeModel)", &invoke, r#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":-1,"messages":[]}"#, VALIDATION, "max_tokens must be a positive integer", Proxy),
        case("never fits the pool", &converse, converse_body("x", Some(2_000_000)), VALIDATION, "can never be admitted; set maxTokens to at most", Proxy),
        // Shapes only Bedrock judges: forwarded, refused upstream, not charged.
        case("missing messages", &converse, "{}", VALIDATION, "'messages'", Upstream),
        case("messages a string", &converse, r#"{"messages":"hello"}"#, VALIDATION, "'messages'", Upstream),
        case("messages empty", &converse, r#"{"messages":[]}"#, VALIDATION, "must start with a user message", Upstream),
        case("inferenceConfig a string", &converse, with_config(r#""x""#), VALIDATION, "'inferenceConfig'", Upstream),
    ];
    for method in ["GET", "OPTIONS"] {
        cases.push(Case { method, ..case("wrong method", &converse, "", UNKNOWN_OP, "no bedrock-runtime operation", Proxy) });
    }
    cases
}

fn not_charged(proxy: &Gateway) -> u64 {
    crate::common::metric(
        proxy,
        "tokengate_settlements_total",
        &[("pool", POOL), ("rule", "not_charged")],
    ) as u64
}

fn upstream_calls(stack: &Stack) -> u64 {
    stack.sim.simulator.stats().operations.values().sum()
}

#[tokio::test]
async fn every_bad_request_gets_a_clear_bedrock_shaped_4xx_and_holds_nothing() {
    let sim = start_simulator(FAST_SIM).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    config.process.server.max_body_bytes = BODY_LIMIT;
    let stack = Stack {
        proxy: start_proxy(config).await,
        sim,
    };
    let mut forwarded = 0;
    for h2 in [false, true] {
        for c in cases().into_iter().filter(|c| c.over.contains(&h2)) {
            let calls = upstream_calls(&stack);
            let r = raw_request(stack.proxy.addr, c.method, &c.path, c.body.clone(), h2).await;
            let what = format!("{} (h2 {h2}): {} {:?}", c.name, r.status, r.message());
            assert_eq!(
                (r.status, r.error_type()),
                (c.status, c.error_type),
                "{what}"
            );
            assert!(r.message().contains(c.says), "{what}");
            assert!(r.header("x-amzn-requestid").is_some(), "{what}");
            let went_upstream = upstream_calls(&stack) - calls;
            assert_eq!(went_upstream, u64::from(c.by == By::Upstream), "{what}");
            forwarded += went_upstream;
        }
    }
    stack.assert_ledger_zero().await;
    assert_eq!(
        not_charged(&stack.proxy),
        forwarded,
        "every forwarded one, not charged"
    );
    let charged = stack
        .proxy
        .state
        .metrics
        .charged_tokens
        .with_label_values(&[POOL]);
    assert_eq!(charged.get(), 0);
}

/// Writes `request` (which asks for `connection: close`) on a fresh connection and reads until
/// the proxy closes it.
async fn exchange(stack: &Stack, request: &[u8]) -> String {
    let mut stream = tokio::net::TcpStream::connect(stack.proxy.addr)
        .await
        .expect("connect");
    // The proxy may answer and close before taking the whole request: ignore write errors.
    let _ = stream.write_all(request).await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_end(&mut answer),
    )
    .await;
    assert!(read.is_ok(), "the proxy answers and closes");
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn raw_wire_cases_heads_too_large_and_a_chunked_body_over_the_limit() {
    let sim = start_simulator(FAST_SIM).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    config.process.server.max_body_bytes = BODY_LIMIT;
    let stack = Stack {
        proxy: start_proxy(config).await,
        sim,
    };
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    let body = converse_body("[sim:output=5] x", Some(10));
    let head_with = |extra: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n{extra}content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // One header of 100 KB, and 200 small headers: over the documented limits, refused with
    // a ValidationException that says which.
    let big = head_with(&format!("x-big: {}\r\n", "a".repeat(100_000)));
    let many = head_with(
        &(0..200)
            .map(|i| format!("x-h{i}: v\r\n"))
            .collect::<String>(),
    );
    for (name, request, says) in [
        ("one big header", big, "at most 65536"),
        ("200 headers", many, "at most 100"),
    ] {
        let answer = exchange(&stack, request.as_bytes()).await;
        assert!(
            answer.starts_with("HTTP/1.1 400")
                && answer.contains("x-amzn-errortype: ValidationException")
                && answer.contains(says),
            "{name}: {answer}"
        );
    }
    // Far past them (over twice the documented size), hyper refuses the head itself.
    let huge = head_with(&format!("x-big: {}\r\n", "a".repeat(300_000)));
    let answer = exchange(&stack, huge.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large"),
        "{answer}"
    );

    // A chunked body (no content-length) that grows past the limit.
    let chunk = "x".repeat(16 * 1024);
    let mut chunked = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    for _ in 0..8 {
        chunked.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
    }
    chunked.push_str("0\r\n\r\n");
    let answer = exchange(&stack, chunked.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("x-amzn-errortype: ValidationException")
            && answer.contains("max_body_bytes"),
        "{answer}"
    );

    // A raw non-ASCII modelId (SDKs always encode): read as the model it names.
    let raw_path = head_with("").replacen(&path, "/model/\u{e9}/converse", 1);
    let answer = exchange(&stack, raw_path.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("no quota pool for model"),
        "{answer}"
    );

    // Nothing reached upstream, and a good request still goes through.
    assert_eq!(upstream_calls(&stack), 0);
    let ok = try_request(addr, &path, body.clone()).await;
    assert_eq!(ok.status, 200);
    stack.assert_ledger_zero().await;
}
