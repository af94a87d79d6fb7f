//! HTTP/2 upstream (issue #19): the proxy speaking h2 to the simulator (`upstream.http =
//! "http2"`, prior knowledge over plain http, as it speaks h2 to Bedrock over TLS), with more
//! streams open at once than one connection carries. A server caps each connection's streams
//! (`SETTINGS_MAX_CONCURRENT_STREAMS`); hyper's pooled client never opens a second HTTP/2
//! connection to a host, so calls past that cap waited inside it, invisibly, holding their
//! reservations. Each test ends with the ledger at zero.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::common::*;
use tokengate::gateway::Gateway;

/// An instant simulator whose streams stall (for ten minutes) half-way, so they stay open, and
/// that allows `streams` concurrent streams per HTTP/2 connection.
fn stalling_sim(streams: u32) -> String {
    format!(
        "time_to_first_token_ms = 0\ntokens_per_second = 0\nstall_ms = 600000\n\
         default_tokens_per_minute = 100000000\nh2_max_concurrent_streams = {streams}\n"
    )
}

/// Streams the simulator has open (its buckets' in-flight calls).
fn sim_in_flight(stack: &Stack) -> u64 {
    let stats = stack.sim.simulator.stats();
    stats.buckets.values().map(|b| b.in_flight).sum()
}

/// What a call does once its stream is open.
#[derive(Clone)]
enum Then {
    /// Holds the stream until the token is cancelled, then drops it: the caller hangs up.
    HangUpAt(CancellationToken),
    /// Reads events until the stream breaks; a clean end fails the test.
    ReadUntilBroken,
}

/// `n` ConverseStream calls through the proxy with the Rust SDK, each counted in the returned
/// counter once its head arrived, then doing `then`.
fn open_streams(stack: &Stack, n: usize, then: &Then) -> (Arc<AtomicUsize>, JoinSet<()>) {
    let opened = Arc::new(AtomicUsize::new(0));
    let mut calls = JoinSet::new();
    for i in 0..n {
        let (client, opened, then) = (stack.client(), opened.clone(), then.clone());
        calls.spawn(async move {
            let mut output = client
                .converse_stream()
                .model_id(SONNET_US)
                .messages(user_message(&format!("[sim:fault=stall] call {i}")))
                .inference_config(max_tokens(100))
                .send()
                .await
                .expect("the stream opens");
            opened.fetch_add(1, Ordering::SeqCst);
            match then {
                Then::HangUpAt(hang_up) => {
                    hang_up.cancelled().await;
                    drop(output);
                }
                Then::ReadUntilBroken => loop {
                    match output.stream.recv().await {
                        Ok(Some(_)) => continue,
                        Ok(None) => panic!("the stream ended cleanly"),
                        Err(_) => return,
                    }
                },
            }
        });
    }
    (opened, calls)
}

/// More streams than the simulator allows on one connection all open at once through the proxy
/// (the bug: on hyper's pooled client only the first `h2_max_concurrent_streams` did), and when
/// their callers hang up every upstream stream is reset and every reservation settled.
#[tokio::test]
async fn more_streams_than_one_connection_allows_all_open_at_once() {
    const LIMIT: u32 = 4;
    const STREAMS: usize = 10;
    let stack = Stack::start(
        &stalling_sim(LIMIT),
        &sonnet_pool(100_000_000, 64),
        "http = \"http2\"\n",
    )
    .await;
    let hang_up = CancellationToken::new();
    // One first, so that the connection is up and its SETTINGS known; then the rest at once.
    let (first, mut first_call) = open_streams(&stack, 1, &Then::HangUpAt(hang_up.clone()));
    eventually(Duration::from_secs(20), "the first stream", || {
        first.load(Ordering::SeqCst) == 1
    })
    .await;
    let (opened, mut calls) = open_streams(&stack, STREAMS - 1, &Then::HangUpAt(hang_up.clone()));
    eventually(
        Duration::from_secs(20),
        "every stream's head through the proxy",
        || opened.load(Ordering::SeqCst) == STREAMS - 1,
    )
    .await;
    assert_eq!(sim_in_flight(&stack), STREAMS as u64, "all open upstream");
    let pools = stack.proxy.admission().pool_views().await;
    let in_flight = pools[0].ledger.as_ref().map(|l| l.in_flight_requests);
    assert_eq!(in_flight, Some(STREAMS as u32), "all admitted and open");
    hang_up.cancel();
    for call in [first_call.join_next().await, calls.join_next().await] {
        call.expect("a call").expect("call task");
    }
    while let Some(call) = calls.join_next().await {
        call.expect("call task");
    }
    eventually(
        Duration::from_secs(10),
        "the upstream streams to be reset",
        || sim_in_flight(&stack) == 0,
    )
    .await;
    stack.assert_ledger_zero().await;
}

/// The proxy's upstream HTTP/2 connections and streams to the simulator, from `/metrics`.
async fn upstream_gauges(stack: &Stack) -> (f64, f64) {
    let host = format!("http://{}", stack.sim.addr);
    let m = scrape(stack.proxy.addr).await;
    (
        m.get("tokengate_upstream_connections", &[("host", &host)]),
        m.get("tokengate_upstream_streams", &[("host", &host)]),
    )
}

/// Ends every call: cancels `hang_up` and waits for the tasks.
async fn hang_up_all(hang_up: &CancellationToken, mut calls: JoinSet<()>) {
    hang_up.cancel();
    while let Some(call) = calls.join_next().await {
        call.expect("call task");
    }
}

/// With `h2_streams_per_connection = 3` (the server allowing 100), a burst of 10 streams opens
/// exactly four connections (another only when all are full), and every stream's count comes
/// back when its caller hangs up.
#[tokio::test]
async fn streams_spread_over_connections_at_the_configured_limit() {
    const STREAMS: usize = 10;
    let stack = Stack::start(
        &stalling_sim(100),
        &sonnet_pool(100_000_000, 64),
        "http = \"http2\"\nh2_streams_per_connection = 3\n",
    )
    .await;
    let hang_up = CancellationToken::new();
    // All at once: the connections are opened while the calls wait, one at a time.
    let (opened, calls) = open_streams(&stack, STREAMS, &Then::HangUpAt(hang_up.clone()));
    eventually(Duration::from_secs(20), "every stream's head", || {
        opened.load(Ordering::SeqCst) == STREAMS
    })
    .await;
    assert_eq!(upstream_gauges(&stack).await, (4.0, STREAMS as f64));
    hang_up_all(&hang_up, calls).await;
    eventually(
        Duration::from_secs(10),
        "the upstream streams to end",
        || sim_in_flight(&stack) == 0,
    )
    .await;
    stack.assert_ledger_zero().await;
    assert_eq!(
        upstream_gauges(&stack).await,
        (4.0, 0.0),
        "idle, still open"
    );
}

/// The simulator stops with streams open on its connection: each stream ends (the SDK sees an
/// error, the reservation settles), the dead connection leaves the set, and once a simulator
/// listens there again the next call opens a new connection.
#[tokio::test]
async fn a_dead_connection_is_replaced_and_its_streams_settle() {
    let sim_toml = stalling_sim(100);
    let stack = Stack::start(
        &sim_toml,
        &sonnet_pool(100_000_000, 64),
        "http = \"http2\"\n",
    )
    .await;
    let (opened, mut calls) = open_streams(&stack, 3, &Then::ReadUntilBroken);
    eventually(Duration::from_secs(20), "three streams", || {
        opened.load(Ordering::SeqCst) == 3
    })
    .await;
    assert_eq!(upstream_gauges(&stack).await, (1.0, 3.0));
    let Stack { sim, proxy } = stack;
    let addr = sim.addr;
    sim.shutdown().await;
    while let Some(call) = calls.join_next().await {
        call.expect("the stream broke");
    }
    assert_ledger_zero(&proxy).await;
    assert_eq!(
        settlements(&proxy, "sonnet4-us", "no_usage"),
        3,
        "cut streams"
    );
    let cut = metric(
        &proxy,
        "tokengate_upstream_errors_total",
        &[("pool", "sonnet4-us"), ("kind", "stream_cut")],
    );
    assert_eq!(cut, 3.0);
    // The same address again (the proxy's upstream URL).
    let config: tokengate::simulator::SimulatorConfig = toml::from_str(&sim_toml).expect("toml");
    let sim = tokengate::simulator::spawn(config, addr)
        .await
        .expect("the simulator listens on its address again");
    let stack = Stack { sim, proxy };
    let answer = stack
        .client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("after the restart"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect("a call over a new connection");
    assert!(answer.usage().is_some());
    assert_eq!(
        upstream_gauges(&stack).await,
        (1.0, 0.0),
        "the dead one dropped"
    );
    stack.assert_ledger_zero().await;
}

/// `upstream.http = "auto"` (the default) keeps HTTP/1.1 to a plain-http endpoint: no HTTP/2
/// connection is made, and none is reported.
#[tokio::test]
async fn auto_keeps_http1_over_plain_http() {
    let stack = Stack::start(&stalling_sim(100), &sonnet_pool(100_000_000, 64), "").await;
    stack
        .client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("over HTTP/1.1"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect("answered");
    let metrics = scrape(stack.proxy.addr).await;
    assert!(!metrics.0.contains_key("tokengate_upstream_connections"));
    stack.assert_ledger_zero().await;
}

/// A Converse answer as Bedrock gives it, with its usage.
const CONVERSE_ANSWER: &str = r#"{"output":{"message":{"role":"assistant","content":[{"text":"ok"}]}},"stopReason":"end_turn","usage":{"inputTokens":5,"outputTokens":1,"totalTokens":6},"metrics":{"latencyMs":1}}"#;

/// How [`serve_one_call_per_connection`] ends each connection after its first answer.
#[derive(Clone, Copy)]
enum AfterOne {
    /// A graceful GOAWAY (as AWS front ends send when they rotate connections); the connection
    /// closes once its stream is done.
    SendAway,
    /// The connection stays, and refuses every further stream with `REFUSED_STREAM` (RFC 9113
    /// 8.7: not processed, safe to send again).
    RefuseMore,
}

/// Reads a call's body and answers it with [`CONVERSE_ANSWER`].
async fn answer_converse(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
) {
    let mut body = request.into_body();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let head = http::Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(())
        .expect("response head");
    if let Ok(mut send) = respond.send_response(head, false) {
        let answer = bytes::Bytes::from_static(CONVERSE_ANSWER.as_bytes());
        let _ = send.send_data(answer, true);
    }
}

/// An HTTP/2 server (prior knowledge) that answers the first call of each connection with
/// [`CONVERSE_ANSWER`], then does `after`; counts the connections it accepted.
async fn serve_one_call_per_connection(
    listener: tokio::net::TcpListener,
    accepted: Arc<AtomicUsize>,
    after: AfterOne,
) {
    while let Ok((socket, _)) = listener.accept().await {
        accepted.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let Ok(mut connection) = h2::server::handshake(socket).await else {
                return;
            };
            let mut answered = false;
            while let Some(Ok((request, mut respond))) = connection.accept().await {
                if answered {
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                    continue;
                }
                answer_converse(request, respond).await;
                answered = true;
                if let AfterOne::SendAway = after {
                    connection.graceful_shutdown();
                }
            }
        });
    }
}

/// A proxy speaking HTTP/2 to a [`serve_one_call_per_connection`] server; the count of its
/// connections.
async fn one_call_per_connection(after: AfterOne) -> (Gateway, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let upstream = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    tokio::spawn(serve_one_call_per_connection(
        listener,
        accepted.clone(),
        after,
    ));
    let config = proxy_config(upstream, &sonnet_pool(100_000_000, 8), "http = \"http2\"\n");
    (start_proxy(config).await, accepted)
}

async fn converse_call(proxy: &Gateway, i: usize) {
    converse_call_at(proxy.addr, i).await;
}

async fn converse_call_at(proxy: std::net::SocketAddr, i: usize) {
    let body = converse_body(&format!("call {i}"), Some(100));
    let r = raw_request(
        proxy,
        "POST",
        &model_path(SONNET_US, "converse"),
        body,
        false,
    )
    .await;
    assert_eq!(r.status, 200, "call {i}: {}", r.message());
}

/// A server that sends each connection away after one answer (and closes it once its stream is
/// done) never fails a call: a closed connection leaves the set and the next call opens another.
/// Every reservation settles on the usage of the answer.
#[tokio::test]
async fn connections_the_server_sends_away_fail_no_call() {
    let (proxy, accepted) = one_call_per_connection(AfterOne::SendAway).await;
    const CALLS: usize = 5;
    for i in 0..CALLS {
        converse_call(&proxy, i).await;
    }
    assert!(
        accepted.load(Ordering::SeqCst) >= 2,
        "the first connection was sent away: the calls after it went over another"
    );
    assert_ledger_zero(&proxy).await;
    assert_eq!(settlements(&proxy, "sonnet4-us", "usage"), CALLS as u64);
}

/// A stream the server refused (`REFUSED_STREAM`: not processed) is sent once more on another
/// connection, never on the one that refused it.
#[tokio::test]
async fn a_refused_stream_goes_again_on_another_connection() {
    let (proxy, accepted) = one_call_per_connection(AfterOne::RefuseMore).await;
    converse_call(&proxy, 0).await;
    // The first connection refuses this one: it goes again, on a second connection.
    converse_call(&proxy, 1).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_ledger_zero(&proxy).await;
    assert_eq!(settlements(&proxy, "sonnet4-us", "usage"), 2);
}

/// An HTTP/2 server (prior knowledge) that sends its first connection away (GOAWAY) as soon as
/// that connection's first call arrives, tells `held`, and answers that call only once `release`
/// is told; every other call it answers at once. Counts the calls it received.
async fn serve_sending_the_first_connection_away(
    listener: tokio::net::TcpListener,
    received: Arc<AtomicUsize>,
    held: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
) {
    let mut first_connection = true;
    while let Ok((socket, _)) = listener.accept().await {
        let mut send_away = std::mem::replace(&mut first_connection, false);
        let (received, held, release) = (received.clone(), held.clone(), release.clone());
        tokio::spawn(async move {
            let Ok(mut connection) = h2::server::handshake(socket).await else {
                return;
            };
            while let Some(Ok((request, respond))) = connection.accept().await {
                received.fetch_add(1, Ordering::SeqCst);
                if std::mem::replace(&mut send_away, false) {
                    connection.graceful_shutdown();
                    let (held, release) = (held.clone(), release.clone());
                    tokio::spawn(async move {
                        held.notify_one();
                        release.notified().await;
                        answer_converse(request, respond).await;
                    });
                } else {
                    tokio::spawn(answer_converse(request, respond));
                }
            }
        });
    }
}

/// A GOAWAY that arrives while a stream is in flight (AWS front ends send one when they rotate a
/// connection) lets that stream finish where it is: its answer reaches the caller, it is not sent
/// a second time, and its reservation settles on its usage. A call made meanwhile is answered.
#[tokio::test]
async fn a_stream_in_flight_when_its_connection_is_sent_away_finishes() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let upstream = listener.local_addr().expect("addr");
    let received = Arc::new(AtomicUsize::new(0));
    let (held, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    tokio::spawn(serve_sending_the_first_connection_away(
        listener,
        received.clone(),
        held.clone(),
        release.clone(),
    ));
    let config = proxy_config(upstream, &sonnet_pool(100_000_000, 8), "http = \"http2\"\n");
    let proxy = start_proxy(config).await;
    let first = tokio::spawn(converse_call_at(proxy.addr, 0));
    tokio::time::timeout(Duration::from_secs(20), held.notified())
        .await
        .expect("the first call reached the server");
    converse_call(&proxy, 1).await;
    release.notify_one();
    first
        .await
        .expect("the first call, answered after its connection was sent away");
    assert_eq!(received.load(Ordering::SeqCst), 2, "no call was sent twice");
    assert_ledger_zero(&proxy).await;
    assert_eq!(settlements(&proxy, "sonnet4-us", "usage"), 2);
}
