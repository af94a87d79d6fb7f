//! InvokeModelWithBidirectionalStream through the proxy where the SDK cannot say what the test
//! needs: raw HTTP/2 sessions whose heads and events the test signs, forges or leaves unsigned,
//! an HTTP/1.1 call, and a client that drops its connection mid-session. In front of the
//! simulator, which verifies the proxy's own signatures; every test ends with the ledger at zero.

use crate::common::{sonic::*, sonic_raw::*, *};
use serde_json::json;
use tokengate::simulator::BucketStats;

const SIM: &str = SONIC_SIM;
const POOL: &str = "sonic";
const RESERVATION: u64 = 1_000;
const KEY_ID: &str = "AKIAROUTESONIC000001";
const SECRET: &str = "route-secret";

fn sonic_pool() -> String {
    format!(
        "[[pools]]\nname = \"{POOL}\"\nmodels = [\"{SONIC}\"]\ntokens_per_minute = 100000\n\
         max_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = {RESERVATION}\n"
    )
}

/// A proxy in `sigv4` mode with one route holding `KEY_ID`.
async fn sigv4_stack() -> Stack {
    let auth = format!(
        "[auth]\nmode = \"sigv4\"\n\n[[routes]]\nname = \"voice\"\naccess_key_id = \"{KEY_ID}\"\n\
         secret_access_key = \"{SECRET}\"\n"
    );
    Stack::start(SIM, &sonic_pool(), &auth).await
}

fn bucket(stack: &Stack) -> BucketStats {
    sonic_bucket(&stack.sim)
}

async fn upstream_idle(stack: &Stack) {
    sonic_upstream_idle(&stack.sim).await;
}

async fn auth_failures(stack: &Stack, reason: &str) -> f64 {
    scrape(stack.proxy.addr).await.get(
        "tokengate_auth_failures_total",
        &[("mode", "sigv4"), ("reason", reason)],
    )
}

#[tokio::test]
async fn http_1_1_is_refused_with_a_validation_exception() {
    let stack = Stack::start(SIM, &sonic_pool(), "").await;
    let response = raw_request(stack.proxy.addr, "POST", SONIC_PATH, "", false).await;
    assert_eq!(response.status, 400);
    assert_eq!(response.error_type(), "ValidationException");
    assert!(
        response.message().contains("needs HTTP/2"),
        "{}",
        response.message()
    );
    assert_eq!(
        stack.sim.simulator.stats().operations.values().sum::<u64>(),
        0
    );
    stack.assert_ledger_zero().await;
}

/// `sigv4` mode: the SDK's own session verifies, head and events; a forged event ends the stream
/// in-band (saying no more than any failed identification), and a bare event too.
#[tokio::test]
async fn every_event_of_a_sigv4_caller_is_verified_then_re_signed() {
    let stack = sigv4_stack().await;
    let client = h2c_client(stack.proxy.addr, "us-east-1", KEY_ID, SECRET);
    let (caller, mut session) = open(&client, 100).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "signed [sim:output=4]").await;
    assert_eq!(until_usage(&mut session).await.len(), 5);
    drop(caller);
    while session.body.recv().await.unwrap().is_some() {}
    stack.assert_ledger_zero().await;
    let sigv4 = stack.sim.simulator.stats().sigv4;
    assert_eq!(
        sigv4.access_key_ids.into_iter().collect::<Vec<_>>(),
        [PROXY_KEY_ID]
    );
    assert_eq!(sigv4.events_rejected, 0);
    // sessionStart, promptStart, the turn's 3 events, the end envelope.
    assert_eq!(sigv4.events_verified, 6);

    // A head signed with the events marker; the second event signed with another secret.
    let host = stack.proxy.addr.to_string();
    let marker = Head::Marker {
        key_id: KEY_ID,
        secret: SECRET,
        marker: "STREAMING-AWS4-HMAC-SHA256-EVENTS",
    };
    let (headers, seed) = head(&host, marker);
    let mut signer = EventSigner::new(KEY_ID, SECRET, &seed);
    let mut forger = EventSigner::new(KEY_ID, "not-the-secret", &seed);
    let start = raw_chunk("sessionStart", json!({}));
    let mut raw = RawSession::open(stack.proxy.addr, &headers, &[signer.sign(Some(&start))]).await;
    assert_eq!(raw.status, 200);
    let prompt = raw_chunk("promptStart", json!({"promptName": "p"}));
    raw.send(forger.sign(Some(&prompt))).await;
    let end = raw.rest().await;
    assert_eq!(end.len(), 1, "{end:?}");
    assert_eq!(end[0].message_type, "exception");
    assert_eq!(end[0].kind, "accessDeniedException");
    let said = String::from_utf8_lossy(&end[0].payload).to_string();
    assert!(said.contains("could not authenticate"), "{said}");
    assert!(
        !said.contains("signature"),
        "says which check failed: {said}"
    );
    assert_eq!(auth_failures(&stack, "signature").await, 1.0);
    stack.assert_ledger_zero().await;
    upstream_idle(&stack).await;

    // A bare event after a good head.
    let (headers, _) = head(
        &host,
        Head::EmptyPayload {
            key_id: KEY_ID,
            secret: SECRET,
        },
    );
    let mut bare = RawSession::open(stack.proxy.addr, &headers, &[start]).await;
    assert_eq!(bare.status, 200);
    let end = bare.rest().await;
    assert_eq!(end[0].kind, "accessDeniedException");
    assert_eq!(auth_failures(&stack, "missing").await, 1.0);
    stack.assert_ledger_zero().await;
    upstream_idle(&stack).await;
    // Upstream never saw an event the caller had not signed.
    assert_eq!(stack.sim.simulator.stats().sigv4.events_rejected, 0);
}

/// The events marker is allowed for this operation only, and only that marker.
#[tokio::test]
async fn other_payload_markers_and_other_operations_are_refused_from_the_head() {
    let stack = sigv4_stack().await;
    let host = stack.proxy.addr.to_string();
    let trailer = Head::Marker {
        key_id: KEY_ID,
        secret: SECRET,
        marker: "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
    };
    let (headers, _) = head(&host, trailer);
    let refused = RawSession::open(stack.proxy.addr, &headers, &[]).await;
    assert_eq!(refused.status, 403);
    assert_eq!(auth_failures(&stack, "payload_hash").await, 1.0);

    // A Converse signed with the events marker: its body would go unchecked.
    let path = model_path(SONIC, "converse");
    let events_marker = Head::Marker {
        key_id: KEY_ID,
        secret: SECRET,
        marker: "STREAMING-AWS4-HMAC-SHA256-EVENTS",
    };
    let (signed, _) = signed_head(&host, &path, "application/json", events_marker);
    let headers: Vec<(&str, &str)> = signed
        .iter()
        .filter(|(k, _)| k != "host" && k != "content-type")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let body = converse_body("hi", Some(10));
    let response = raw_request_with(stack.proxy.addr, "POST", &path, body, false, &headers).await;
    assert_eq!(response.status, 403);
    assert_eq!(auth_failures(&stack, "payload_hash").await, 2.0);
    assert_eq!(bucket(&stack).requests, 0);
    stack.assert_ledger_zero().await;
}

/// `bearer` mode: a raw client's bare events are relayed; upstream still gets SigV4 only, the
/// proxy's, on the head and on every event; the client's END_STREAM becomes the proxy's signed
/// end envelope.
#[tokio::test]
async fn bare_events_of_a_bearer_caller_go_upstream_signed_by_the_proxy() {
    let key = "voice-team-key";
    let auth = format!(
        "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n[[routes]]\nname = \"voice\"\n\
         bearer_token_sha256 = \"{}\"\n",
        sha256_hex(key)
    );
    let stack = Stack::start(SIM, &sonic_pool(), &auth).await;
    let headers = vec![
        (
            "content-type".to_string(),
            "application/vnd.amazon.eventstream".to_string(),
        ),
        ("authorization".to_string(), format!("Bearer {key}")),
    ];
    let mut frames = raw_session(Some(100), "bare [sim:output=3]");
    frames.pop(); // no sessionEnd: the session ends with the input.
    let mut raw = RawSession::open(stack.proxy.addr, &headers, &frames).await;
    assert_eq!(raw.status, 200);
    raw.close_input();
    let out = raw.rest().await;
    assert!(out.iter().all(|f| f.kind == "chunk"), "{out:?}");
    assert_eq!(out.len(), 6, "a turn and completionEnd");
    stack.assert_ledger_zero().await;
    // "bare [sim:output=3]" = 19 bytes, 5 input tokens; 3 output.
    let b = bucket(&stack);
    assert_eq!((b.completed, b.tokens_charged), (1, 8));
    let sim = stack.sim.simulator.stats();
    assert_eq!(sim.api_keys.seen, 0, "the bearer key never left the proxy");
    assert_eq!(sim.sigv4.verified, 1);
    // sessionStart .. promptEnd, and the end envelope.
    assert_eq!(
        (sim.sigv4.events_verified, sim.sigv4.events_rejected),
        (7, 0)
    );
    let s = scrape(stack.proxy.addr).await;
    s.expect("tokengate_charged_tokens_total", &[("pool", POOL)], 8.0);
}

/// A client that drops its connection mid-session: the proxy settles by `no_usage` and resets
/// the upstream stream, so upstream stops the session too.
#[tokio::test]
async fn a_client_that_hangs_up_mid_session_holds_nothing() {
    let stack = Stack::start(SIM, &sonic_pool(), "").await;
    let (headers, _) = head(&stack.proxy.addr.to_string(), Head::Unsigned);
    let mut frames = raw_session(Some(100), "hang on [sim:output=6]");
    frames.truncate(5); // sessionStart, promptStart, the user's turn.
    let mut raw = RawSession::open(stack.proxy.addr, &headers, &frames).await;
    assert_eq!(raw.status, 200);
    let mut seen = Vec::new();
    while seen.len() < 5 {
        seen.push(raw.next().await.expect("the turn's answer"));
    }
    assert_eq!(in_flight(&stack.proxy, POOL), 1);
    assert_eq!(bucket(&stack).in_flight, 1);
    raw.hang_up();
    stack.assert_ledger_zero().await;
    upstream_idle(&stack).await;
    let s = scrape(stack.proxy.addr).await;
    s.expect(
        "tokengate_settlements_total",
        &[("pool", POOL), ("rule", "no_usage")],
        1.0,
    );
    // The larger of the reservation and the totals seen (6 input + 6 output).
    s.expect(
        "tokengate_charged_tokens_total",
        &[("pool", POOL)],
        RESERVATION as f64,
    );
}

/// Upstream refuses the session with an error status (a model without speech): the answer is
/// passed on before the stream, nothing is charged, and the input relay stops.
#[tokio::test]
async fn an_upstream_error_status_is_passed_on_uncharged() {
    let pools = format!(
        "{}[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 100000\n\
         max_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 500\n",
        sonic_pool()
    );
    let stack = Stack::start(SIM, &pools, "").await;
    let (headers, _) = head(&stack.proxy.addr.to_string(), Head::Unsigned);
    let path = model_path(HAIKU, "invoke-with-bidirectional-stream");
    let frames = raw_session(Some(100), "not a speech model");
    let refused = RawSession::open_at(stack.proxy.addr, &path, &headers, &frames).await;
    assert_eq!(refused.status, 400);
    assert_eq!(
        refused
            .headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok()),
        Some("ValidationException")
    );
    let said = String::from_utf8_lossy(&refused.body().await).to_string();
    assert!(said.contains("Nova Sonic"), "{said}");
    stack.assert_ledger_zero().await;
    scrape(stack.proxy.addr).await.expect(
        "tokengate_settlements_total",
        &[("pool", "haiku"), ("rule", "not_charged")],
        1.0,
    );
}

/// An input that ends inside an event frame is refused, not cut silently: the client is told,
/// and upstream's stream is reset rather than ended as if the session were complete.
#[tokio::test]
async fn an_input_that_ends_inside_a_frame_is_refused() {
    let stack = Stack::start(SIM, &sonic_pool(), "").await;
    let (headers, _) = head(&stack.proxy.addr.to_string(), Head::Unsigned);
    let start = raw_chunk("sessionStart", json!({}));
    let prompt = raw_chunk("promptStart", json!({"promptName": "p"}));
    let half = prompt.slice(..prompt.len() / 2);
    let mut raw = RawSession::open(stack.proxy.addr, &headers, &[start, half]).await;
    assert_eq!(raw.status, 200);
    raw.close_input();
    let end = raw.rest().await;
    assert_eq!(end.len(), 1, "{end:?}");
    assert_eq!(end[0].kind, "validationException");
    let said = String::from_utf8_lossy(&end[0].payload).to_string();
    assert!(said.contains("ended inside an event frame"), "{said}");
    stack.assert_ledger_zero().await;
    upstream_idle(&stack).await;
    assert_eq!(
        bucket(&stack).completed,
        0,
        "upstream never saw a clean end"
    );
}
