//! The access log: exactly one `tokengate::access` line per request, whatever its fate, with the
//! request id the client received and the admission and settlement facts; no bodies, no
//! credentials.

use crate::common::{log_capture::Capture, *};
use aws_sdk_bedrockruntime::operation::RequestId;
use serde_json::Value;

/// The first token comes after `FIRST_TOKEN_MS`: a floor under every admitted line's `ttft_ms`.
const SIM: &str =
    "time_to_first_token_ms = 50\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
const FIRST_TOKEN_MS: f64 = 50.0;
const SECRET: &str = "SECRET-PROMPT-MARKER";

fn request_id(r: &RawResponse) -> String {
    r.header("x-amzn-requestid")
        .expect("every answer has a request id")
        .to_string()
}

// A current-thread runtime: the proxy's tasks run on this thread, under the thread's subscriber.
#[tokio::test]
async fn one_line_per_request_with_its_decision_charge_and_request_id() {
    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.subscriber());

    let pools = format!("{}max_wait_ms = 0\n", sonnet_pool(2_000, 4));
    let extra = "[admission]\nunknown_models = \"pass\"\n";
    let stack = Stack::start(SIM, &pools, extra).await;
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    let converse = |text: String, max: u64| {
        raw_request(addr, "POST", &path, converse_body(&text, Some(max)), false)
    };

    // Admitted, charged about 1500 of the 2000 bucket: the next large one does not fit.
    let admitted = converse(format!("[sim:output=300] {SECRET}"), 1_500).await;
    assert_eq!(admitted.status, 200);
    let usage: Value = serde_json::from_slice(&admitted.body).expect("json");
    let rejected = converse("again".into(), 1_000).await;
    assert_eq!(rejected.status, 429);
    let never = converse("huge".into(), 500_000).await;
    assert_eq!(never.status, 400);
    let unknown_path = raw_request(addr, "POST", "/nope", "{}", false).await;
    assert_eq!(unknown_path.status, 404);
    let passed = raw_request(
        addr,
        "POST",
        &model_path(HAIKU, "converse"),
        converse_body("hi", Some(10)),
        false,
    )
    .await;
    assert_eq!(passed.status, 200);
    // A signed SDK call (its Authorization header must not be logged).
    let sdk = stack
        .client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=3] sdk"))
        .inference_config(max_tokens(20))
        .send()
        .await
        .expect("sdk call");
    stack.assert_ledger_zero().await;

    let lines = capture.access_lines();
    assert_eq!(lines.len(), 6, "one line per request: {lines:#?}");
    let line = |id: &str| -> &Value {
        let found: Vec<_> = lines.iter().filter(|l| l["request_id"] == id).collect();
        assert_eq!(found.len(), 1, "one line for {id}: {lines:#?}");
        found[0]
    };

    let a = line(&request_id(&admitted));
    let input = usage["usage"]["inputTokens"].as_u64().expect("input");
    assert_eq!(a["pool"], "sonnet4-us");
    assert_eq!(a["operation"], "Converse");
    assert_eq!(a["model"], SONNET_US);
    assert_eq!(a["decision"], "admitted");
    assert_eq!(a["status"], 200);
    assert_eq!(a["rule"], "usage");
    assert_eq!(a["max_tokens"], 1_500);
    assert_eq!(a["output_tokens"], 300);
    assert_eq!(a["input_tokens"], input);
    assert_eq!(a["charged"], input + 300 * 5);
    assert!(a["reserved"].as_u64().expect("reserved") > 1_500, "{a}");
    let (latency, ttft) = (
        a["latency_ms"].as_f64().expect("latency"),
        a["ttft_ms"].as_f64().expect("ttft"),
    );
    // A non-streamed answer's first token is its body, which the simulator sends no sooner than
    // its time to first token; the line's latency includes it.
    assert!(ttft >= FIRST_TOKEN_MS && ttft <= latency, "{a}");

    let r = line(&request_id(&rejected));
    assert_eq!(
        (&r["decision"], &r["status"], &r["pool"]),
        (&"rejected".into(), &429.into(), &"sonnet4-us".into())
    );
    assert!(
        r.get("reserved").is_none() && r.get("charged").is_none(),
        "{r}"
    );

    let n = line(&request_id(&never));
    assert_eq!(
        (&n["decision"], &n["status"]),
        (&"invalid".into(), &400.into())
    );
    assert_eq!(n["pool"], "sonnet4-us");

    let u = line(&request_id(&unknown_path));
    assert_eq!(
        (&u["decision"], &u["status"]),
        (&"invalid".into(), &404.into())
    );
    assert!(
        u.get("operation").is_none() && u.get("pool").is_none(),
        "{u}"
    );

    let p = line(&request_id(&passed));
    assert_eq!(
        (&p["decision"], &p["status"]),
        (&"passthrough".into(), &200.into())
    );
    assert_eq!(p["model"], HAIKU);
    assert!(p.get("pool").is_none(), "{p}");

    let s = line(sdk.request_id().expect("the SDK reads x-amzn-RequestId"));
    assert_eq!(
        (&s["decision"], &s["output_tokens"]),
        (&"admitted".into(), &3.into())
    );

    let everything = capture.text();
    for secret in [SECRET, CLIENT_KEY_ID, "application-secret", PROXY_SECRET] {
        assert!(!everything.contains(secret), "{secret} was logged");
    }
}
