//! InvokeModelWithBidirectionalStream through the proxy, driven by aws-sdk-bedrockruntime over
//! h2c, in front of the simulator (which verifies the proxy's SigV4 on the head and on every
//! re-signed event): sessions answered turn by turn while the caller's side is open, charged what
//! the simulator charged, refused before the stream or in it, and settled on every path by which
//! a session ends. Every test ends with the ledger at zero.

use std::time::Duration;

use crate::common::{sonic::*, *};
use aws_sdk_bedrockruntime::types::InvokeModelWithBidirectionalStreamOutput;
use serde_json::{Value, json};
use tokengate::simulator::BucketStats;

const SIM: &str = SONIC_SIM;
const POOL: &str = "sonic";
/// What a session reserves in the proxy's pool (`bidirectional_reservation`).
const RESERVATION: u64 = 1_000;

fn sonic_pool(tokens_per_minute: u64, max_concurrency: u32, extra: &str) -> String {
    format!(
        "[[pools]]\nname = \"{POOL}\"\nmodels = [\"{SONIC}\"]\ntokens_per_minute = {tokens_per_minute}\n\
         max_concurrency = {max_concurrency}\noutput_burndown = 1\ndefault_max_tokens = 500\n\
         bidirectional_reservation = {RESERVATION}\n{extra}"
    )
}

fn client(stack: &Stack) -> aws_sdk_bedrockruntime::Client {
    h2c_client(
        stack.proxy.addr,
        "us-east-1",
        CLIENT_KEY_ID,
        "application-secret",
    )
}

fn bucket(stack: &Stack) -> BucketStats {
    sonic_bucket(&stack.sim)
}

/// The pool's settlements by `rule`, and the tokens charged.
async fn settlements(stack: &Stack, rule: &str) -> (f64, f64) {
    let s = scrape(stack.proxy.addr).await;
    (
        s.get(
            "tokengate_settlements_total",
            &[("pool", POOL), ("rule", rule)],
        ),
        s.get("tokengate_charged_tokens_total", &[("pool", POOL)]),
    )
}

async fn upstream_idle(stack: &Stack) {
    sonic_upstream_idle(&stack.sim).await;
}

#[tokio::test]
async fn a_session_is_relayed_turn_by_turn_and_charged_what_upstream_charged() {
    let stack = Stack::start(SIM, &sonic_pool(100_000, 4, ""), "").await;
    let (caller, mut session) = open(&client(&stack), 300).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "hello sonic [sim:output=20]").await;
    // The second input goes only once the first answer is in: a proxy that held the input
    // until the caller's side ended would never answer.
    let first = until_usage(&mut session).await;
    assert_eq!(names(&first), FIRST_TURN);
    assert_eq!(totals(&first[4]), (7, 20));
    // Mid-session: one permit and the session's reservation held in the proxy; upstream holds
    // the session's own maxTokens.
    assert_eq!(in_flight(&stack.proxy, POOL), 1);
    let held = stack.proxy.admission().pools()[0].load.reserved_tokens();
    assert_eq!(held, RESERVATION);
    let b = bucket(&stack);
    assert_eq!((b.in_flight, b.tokens_reserved_in_flight), (1, 300));

    caller.user_text("t2", "again [sim:output=30]").await;
    let second = until_usage(&mut session).await;
    assert_eq!(
        names(&second),
        ["contentStart", "textOutput", "contentEnd", "usageEvent"]
    );
    assert_eq!(totals(&second[3]), (13, 50));
    caller.send("promptEnd", json!({"promptName": "p1"})).await;
    caller.send("sessionEnd", json!({})).await;
    drop(caller);
    let mut rest = Vec::new();
    while let Some(InvokeModelWithBidirectionalStreamOutput::Chunk(part)) =
        session.body.recv().await.unwrap()
    {
        rest.push(serde_json::from_slice::<Value>(part.bytes().unwrap().as_ref()).unwrap());
    }
    assert_eq!(names(&rest), ["completionEnd"]);

    stack.assert_ledger_zero().await;
    // Input 13 + output 50 (burndown 1), on both sides.
    let b = bucket(&stack);
    assert_eq!((b.completed, b.tokens_charged), (1, 63));
    assert_eq!(settlements(&stack, "usage").await, (1.0, 63.0));
    let sigv4 = stack.sim.simulator.stats().sigv4;
    assert_eq!(
        sigv4.access_key_ids.into_iter().collect::<Vec<_>>(),
        [PROXY_KEY_ID],
        "upstream saw only the proxy's credentials"
    );
    // The head, then sessionStart .. sessionEnd re-signed by the proxy, each verified.
    assert_eq!(sigv4.verified, 1);
    assert_eq!((sigv4.events_verified, sigv4.events_rejected), (10, 0));
    let s = scrape(stack.proxy.addr).await;
    s.expect(
        "tokengate_requests_total",
        &[
            ("pool", POOL),
            ("api", "bedrock"),
            ("operation", "InvokeModelWithBidirectionalStream"),
            ("outcome", "admitted"),
        ],
        1.0,
    );
}

#[tokio::test]
async fn a_session_that_does_not_fit_is_turned_away_before_the_stream() {
    let pool = sonic_pool(100_000, 1, "max_wait_ms = 0\n");
    let stack = Stack::start(SIM, &pool, "").await;
    let client = client(&stack);
    let (held, mut session) = open(&client, 300).await;
    // The first session holds the pool's one permit for as long as it is open.
    let (_caller, refused) = try_open(&client, 300).await;
    let error = refused.expect_err("no permit left").into_service_error();
    assert!(error.is_throttling_exception(), "{error:?}");
    assert_eq!(
        bucket(&stack).requests,
        1,
        "the refused one never reached upstream"
    );

    held.send("sessionEnd", json!({})).await;
    drop(held);
    while session.body.recv().await.unwrap().is_some() {}
    stack.assert_ledger_zero().await;
    // No usage event: nothing was said, nothing was charged upstream.
    assert_eq!(bucket(&stack).tokens_charged, 0);
    assert_eq!(
        settlements(&stack, "no_usage").await,
        (1.0, RESERVATION as f64)
    );
}

#[tokio::test]
async fn upstream_s_in_band_throttle_is_passed_on_uncharged_and_shrinks_the_pool() {
    // Upstream's bucket cannot hold the session's maxTokens; the proxy's pool can.
    let sim = format!("{SIM}default_tokens_per_minute = 1000\n");
    let stack = Stack::start(&sim, &sonic_pool(100_000, 4, ""), "").await;
    let (_caller, mut session) = open(&client(&stack), 1_001).await;
    let error = stream_error(&mut session).await;
    assert!(error.is_throttling_exception(), "{error:?}");
    stack.assert_ledger_zero().await;
    assert_eq!(settlements(&stack, "not_charged").await, (1.0, 0.0));
    let s = scrape(stack.proxy.addr).await;
    s.expect("tokengate_upstream_throttles_total", &[("pool", POOL)], 1.0);
    let views = stack.proxy.admission().pool_views().await;
    assert!(views[0].learned.effective_limit_factor < 1.0);
    assert_eq!(bucket(&stack).throttled, 1);
}

#[tokio::test]
async fn upstream_s_session_limit_ends_the_stream_and_it_settles_to_the_totals() {
    let sim = format!("{SIM}bidirectional_session_secs = 1\n");
    let stack = Stack::start(&sim, &sonic_pool(100_000, 4, ""), "").await;
    let (caller, mut session) = open(&client(&stack), 100).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "hold [sim:output=5]").await;
    assert_eq!(until_usage(&mut session).await.len(), 5);
    // The caller stays: upstream ends the session at its limit.
    let error = stream_error(&mut session).await;
    assert!(error.is_model_timeout_exception(), "{error:?}");
    stack.assert_ledger_zero().await;
    // "hold [sim:output=5]" = 19 bytes, 5 input tokens; 5 output.
    let b = bucket(&stack);
    assert_eq!((b.completed, b.tokens_charged), (1, 10));
    assert_eq!(settlements(&stack, "usage").await, (1.0, 10.0));
    drop(caller);
}

#[tokio::test]
async fn a_quiet_upstream_ends_the_session_at_the_idle_timeout() {
    // (Extra lines land in the [upstream] table.)
    let stack = Stack::start(SIM, &sonic_pool(100_000, 4, ""), "idle_timeout_secs = 1\n").await;
    // A session that says nothing after sessionStart: upstream has nothing to answer.
    let (caller, mut session) = open(&client(&stack), 100).await;
    let error = stream_error(&mut session).await;
    assert!(error.is_model_stream_error_exception(), "{error:?}");
    stack.assert_ledger_zero().await;
    assert_eq!(
        settlements(&stack, "no_usage").await,
        (1.0, RESERVATION as f64)
    );
    // The proxy reset the upstream stream: upstream's session ended too.
    upstream_idle(&stack).await;
    drop(caller);
}

#[tokio::test]
async fn a_session_cut_short_by_shutdown_ends_in_band_and_settles() {
    let sim = start_simulator(SIM).await;
    let mut config = proxy_config(sim.addr, &sonic_pool(100_000, 4, ""), "");
    config.process.server.drain = Duration::from_secs(1);
    let proxy = start_proxy(config).await;
    let addr = proxy.addr;
    let client = h2c_client(addr, "us-east-1", CLIENT_KEY_ID, "application-secret");
    let (caller, mut session) = open(&client, 300).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "long one [sim:output=40]").await;
    assert_eq!(until_usage(&mut session).await.len(), 5);
    let stopping = tokio::spawn(proxy.shutdown());
    // Still talking when the drain deadline comes: the stream ends with its exception.
    let error = stream_error(&mut session).await;
    assert!(error.is_service_unavailable_exception(), "{error:?}");
    let report = stopping.await.expect("join").expect("shutdown");
    assert!(report.is_clean(), "{report:?}");
    sonic_upstream_idle(&sim).await;
    drop(caller);
}

#[tokio::test]
async fn a_route_ceiling_holds_for_the_session_s_max_tokens() {
    let routes = "[[routes]]\nname = \"app\"\nmax_tokens_ceiling = 200\n";
    let stack = Stack::start(SIM, &sonic_pool(100_000, 4, ""), routes).await;
    let (caller, mut session) = open(&client(&stack), 5_000).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "clamp me [sim:output=10]").await;
    until_usage(&mut session).await;
    // The sessionStart upstream read asks for the ceiling; the proxy reserved no more.
    assert_eq!(bucket(&stack).tokens_reserved_in_flight, 200);
    assert_eq!(
        stack.proxy.admission().pools()[0].load.reserved_tokens(),
        200
    );
    drop(caller);
    while session.body.recv().await.unwrap().is_some() {}
    stack.assert_ledger_zero().await;

    let reject =
        "[[routes]]\nname = \"app\"\nmax_tokens_ceiling = 200\nmax_tokens_policy = \"reject\"\n";
    let stack = Stack::start(SIM, &sonic_pool(100_000, 4, ""), reject).await;
    let (_caller, mut session) = open(&client(&stack), 5_000).await;
    let error = stream_error(&mut session).await;
    assert!(error.is_validation_exception(), "{error:?}");
    let message = error.meta().message().unwrap_or_default().to_string();
    assert!(
        message.contains("maxTokens 5000 is above the ceiling of 200"),
        "{message}"
    );
    stack.assert_ledger_zero().await;
    upstream_idle(&stack).await;
    assert_eq!(
        bucket(&stack).requests,
        0,
        "no sessionStart reached upstream"
    );
}

#[tokio::test]
async fn with_an_upstream_api_key_a_session_is_still_signed() {
    let sim = start_simulator(&format!("{SIM}api_keys = [\"up-key\"]\n")).await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\n\
         endpoint = \"http://{}\"\napi_key_env = \"TG_UPSTREAM_KEY\"\n\n{}\n{}",
        sim.addr,
        sonic_pool(100_000, 4, ""),
        sonnet_pool(100_000, 4)
    );
    let config = tokengate::config::Config::parse_with_env(&text, &|name| {
        (name == "TG_UPSTREAM_KEY").then(|| "up-key".to_string())
    })
    .expect("config");
    let stack = Stack {
        sim,
        proxy: start_proxy(config).await,
    };
    // A Converse call goes with the key; the session, which takes SigV4 only, is signed.
    stack
        .client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("hi [sim:output=3]"))
        .send()
        .await
        .expect("converse with the proxy's API key");
    let (caller, mut session) = open(&client(&stack), 300).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "hello sonic [sim:output=20]").await;
    assert_eq!(totals(&until_usage(&mut session).await[4]), (7, 20));
    caller.send("promptEnd", json!({"promptName": "p1"})).await;
    caller.send("sessionEnd", json!({})).await;
    drop(caller);
    while let Some(InvokeModelWithBidirectionalStreamOutput::Chunk(_)) =
        session.body.recv().await.unwrap()
    {}
    stack.assert_ledger_zero().await;
    let stats = stack.sim.simulator.stats();
    assert_eq!((stats.api_keys.accepted, stats.api_keys.rejected), (1, 0));
    assert_eq!((stats.sigv4.verified, stats.sigv4.rejected), (1, 0));
    assert!(stats.sigv4.events_verified > 0 && stats.sigv4.events_rejected == 0);
    assert_eq!(settlements(&stack, "usage").await.0, 1.0);
}

/// More sessions than upstream allows streams on one HTTP/2 connection: all of them open and
/// are answered at once, over a second connection (hyper's pooled client never opens one, so
/// the sessions past the server's `SETTINGS_MAX_CONCURRENT_STREAMS` waited, holding their
/// reservations, until the response timeout).
#[tokio::test]
async fn more_sessions_than_one_upstream_connection_allows_are_all_answered() {
    const LIMIT: u32 = 2;
    const SESSIONS: usize = 5;
    let sim = format!("{SIM}h2_max_concurrent_streams = {LIMIT}\n");
    let stack = Stack::start(&sim, &sonic_pool(100_000, 8, ""), "").await;
    let client = client(&stack);
    let turn = |n: usize| {
        let client = client.clone();
        async move {
            let (caller, mut session) = open(&client, 100).await;
            caller
                .send("promptStart", json!({"promptName": "p1"}))
                .await;
            caller
                .user_text("t1", &format!("session {n} [sim:output=5]"))
                .await;
            assert_eq!(until_usage(&mut session).await.len(), 5, "session {n}");
            (caller, session)
        }
    };
    let opened = tokio::time::timeout(
        HANG_GUARD,
        futures_util::future::join_all((0..SESSIONS).map(turn)),
    )
    .await
    .expect("every session answered its first turn");
    assert_eq!(
        bucket(&stack).in_flight,
        SESSIONS as u64,
        "all open upstream"
    );
    assert_eq!(in_flight(&stack.proxy, POOL), SESSIONS as u64);
    let s = scrape(stack.proxy.addr).await;
    let host = format!("http://{}", stack.sim.addr);
    let connections = s.get("tokengate_upstream_connections", &[("host", &host)]);
    assert!(connections >= 3.0, "{connections} connections");
    for (caller, session) in opened {
        caller.send("sessionEnd", json!({})).await;
        drop((caller, session));
    }
    upstream_idle(&stack).await;
    stack.assert_ledger_zero().await;
}
