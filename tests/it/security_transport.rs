//! What an unauthenticated peer can make the listener hold (issue #14, points 2 and 13): raw TCP
//! and hand-written HTTP/2 frames against the connection timeouts, the connection cap, HTTP/2
//! stream and keep-alive limits, and the limits of a request head. Each test ends with nothing
//! held: the ledger at zero, and no request body in memory.
//!
//! Timeouts are set to a second or two; every wait on the proxy is bounded far above them, only
//! against hangs.

use crate::common;
use std::time::Duration;

use crate::common::{h2raw, wire::*, *};
use tokengate::{config::Config, gateway::Gateway, simulator::SimulatorHandle};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
/// Bounds every wait for the proxy to act: far above the timeouts the tests set.
const BOUND: Duration = Duration::from_secs(15);
const HOUR: Duration = Duration::from_secs(3600);

/// A simulator and a proxy with `server` edits applied to its config.
async fn stack(server: impl FnOnce(&mut Config)) -> (SimulatorHandle, Gateway) {
    let sim = start_simulator(FAST_SIM).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    server(&mut config);
    (sim, start_proxy(config).await)
}

fn timeouts(proxy: &Gateway, kind: &str) -> u64 {
    common::metric(
        proxy,
        "tokengate_connection_timeouts_total",
        &[("listener", "proxy"), ("kind", kind)],
    ) as u64
}

fn open_connections(proxy: &Gateway) -> i64 {
    common::metric(
        proxy,
        "tokengate_open_connections",
        &[("listener", "proxy")],
    ) as i64
}

/// Request-body bytes the proxy holds now (`tokengate_buffered_body_bytes`).
fn buffered(proxy: &Gateway) -> usize {
    common::metric(proxy, "tokengate_buffered_body_bytes", &[]) as usize
}

/// A converse call over HTTP/1.1 that must succeed.
async fn real_call(proxy: &Gateway) {
    let body = converse_body("[sim:output=5] still served", Some(10));
    let path = model_path(SONNET_US, "converse");
    let r = raw_request(proxy.addr, "POST", &path, body, false).await;
    assert_eq!(r.status, 200, "{}", r.message());
}

/// A POST whose body never comes: the head and `sent` of `declared` bytes.
async fn stalled_post(proxy: &Gateway, declared: usize, sent: usize) -> TcpStream {
    let addr = proxy.addr;
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = post_head(addr, &model_path(SONNET_US, "converse"), declared);
    stream.write_all(head.as_bytes()).await.expect("head");
    stream.write_all(&vec![b' '; sent]).await.expect("part");
    stream
}

#[tokio::test]
async fn connections_that_send_no_whole_first_request_are_closed_after_the_header_timeout() {
    let (_sim, proxy) = stack(|c| {
        c.process.server.header_read_timeout = Duration::from_secs(1);
        c.process.server.idle_timeout = HOUR;
    })
    .await;
    let addr = proxy.addr;
    let authority = addr.to_string();
    let mut attackers = Vec::new();
    // HTTP/2 connections that sent only the preface and settings (they stayed open for good).
    for _ in 0..20 {
        attackers.push(h2raw::connect(addr).await);
    }
    // A HEADERS frame cut short, and one whose CONTINUATION never comes.
    let block = h2raw::header_block(&h2raw::request(&authority, "GET", "/healthz", &[]));
    let whole = h2raw::frame(h2raw::HEADERS, h2raw::END_HEADERS, 1, &block);
    let mut cut = h2raw::connect(addr).await;
    cut.write_all(&whole[..whole.len() - 5])
        .await
        .expect("part");
    attackers.push(cut);
    let mut unfinished = h2raw::connect(addr).await;
    let no_end = h2raw::frame(h2raw::HEADERS, h2raw::END_STREAM, 1, &block);
    unfinished.write_all(&no_end).await.expect("headers");
    attackers.push(unfinished);
    // A silent TCP connection and an HTTP/1.1 head sent in part.
    attackers.push(TcpStream::connect(addr).await.expect("connect"));
    let mut partial = TcpStream::connect(addr).await.expect("connect");
    let head = format!("GET /healthz HTTP/1.1\r\nhost: {addr}\r\n");
    partial.write_all(head.as_bytes()).await.expect("part");
    attackers.push(partial);
    // After a whole request, an HTTP/1.1 head sent in part: the head timeout, not the idle one.
    let mut second = TcpStream::connect(addr).await.expect("connect");
    let get = format!("GET /healthz HTTP/1.1\r\nhost: {addr}\r\n\r\n");
    second.write_all(get.as_bytes()).await.expect("request");
    let (status, _, _) = read_head(&mut second).await;
    assert_eq!(status, 200);
    second.write_all(head.as_bytes()).await.expect("part");

    real_call(&proxy).await;
    for (i, stream) in attackers.iter_mut().enumerate() {
        assert!(
            closed_within(stream, BOUND).await,
            "connection {i} still open"
        );
    }
    assert!(
        closed_within(&mut second, BOUND).await,
        "the half-sent second head"
    );
    assert_eq!(timeouts(&proxy, "first_request"), 24);
    assert_eq!(timeouts(&proxy, "header"), 1);
    assert_eq!(timeouts(&proxy, "idle"), 0);
    assert_nothing_held(&proxy).await;
}

#[tokio::test]
async fn connections_idle_after_their_requests_close_after_the_idle_timeout_on_both_protocols() {
    let (_sim, proxy) = stack(|c| {
        c.process.server.header_read_timeout = HOUR;
        c.process.server.idle_timeout = Duration::from_secs(1);
    })
    .await;
    let addr = proxy.addr;
    // HTTP/1.1 keep-alive: two requests on one connection, then nothing.
    let mut h1 = TcpStream::connect(addr).await.expect("connect");
    for _ in 0..2 {
        let get = format!("GET /healthz HTTP/1.1\r\nhost: {addr}\r\n\r\n");
        h1.write_all(get.as_bytes()).await.expect("request");
        let (status, _, mut body) = read_head(&mut h1).await;
        assert_eq!(status, 200);
        while body.len() < 3 {
            let mut more = [0u8; 16];
            let n = h1.read(&mut more).await.expect("body");
            assert!(n > 0, "closed before the body");
            body.extend_from_slice(&more[..n]);
        }
    }
    // HTTP/2: a request, its answer, then nothing.
    let mut h2 = h2raw::connect(addr).await;
    let authority = addr.to_string();
    let fields = h2raw::request(&authority, "GET", "/healthz", &[]);
    h2.write_all(&h2raw::headers(1, &fields, true))
        .await
        .expect("request");
    let end = h2raw::read_until(&mut h2, BOUND, |f| {
        f.stream == 1 && f.flags & h2raw::END_STREAM != 0
    })
    .await;
    assert!(end.is_some(), "answered");

    assert!(closed_within(&mut h1, BOUND).await, "HTTP/1.1 kept open");
    let goaway = h2raw::read_until(&mut h2, BOUND, |f| f.kind == h2raw::GOAWAY).await;
    assert!(goaway.is_some(), "HTTP/2 closes gracefully, with a GOAWAY");
    assert!(closed_within(&mut h2, BOUND).await, "HTTP/2 kept open");
    assert_eq!(timeouts(&proxy, "idle"), 2);
    assert_nothing_held(&proxy).await;
}

#[tokio::test]
async fn an_http2_peer_that_stops_answering_pings_is_closed_with_its_stream_in_flight() {
    let (_sim, proxy) = stack(|c| {
        c.process.server.h2_keep_alive_interval = Duration::from_secs(1);
        c.process.server.h2_keep_alive_timeout = Duration::from_secs(1);
        c.process.server.header_read_timeout = HOUR;
        c.process.server.idle_timeout = HOUR;
        c.process.server.body_read_timeout = HOUR;
    })
    .await;
    let mut h2 = h2raw::connect(proxy.addr).await;
    let authority = proxy.addr.to_string();
    let path = model_path(SONNET_US, "converse");
    let extra = [
        ("content-length", "100"),
        ("content-type", "application/json"),
    ];
    let fields = h2raw::request(&authority, "POST", &path, &extra);
    h2.write_all(&h2raw::headers(1, &fields, false))
        .await
        .expect("headers");
    // The request waits for its body: in flight, so no idle timeout applies.
    eventually(BOUND, "the request in flight", || buffered(&proxy) == 100).await;
    let ping = h2raw::read_until(&mut h2, BOUND, |f| {
        f.kind == h2raw::PING && f.flags & h2raw::ACK == 0
    })
    .await;
    assert!(ping.is_some(), "the server pings a silent peer");
    assert!(
        closed_within(&mut h2, BOUND).await,
        "an unanswered ping closes it"
    );
    assert_nothing_held(&proxy).await;
}

#[tokio::test]
async fn at_the_connection_cap_idle_connections_make_room_oldest_first_and_busy_ones_refuse() {
    let (_sim, proxy) = stack(|c| {
        c.process.server.max_connections = 4;
        c.process.server.header_read_timeout = HOUR;
        c.process.server.body_read_timeout = HOUR;
    })
    .await;
    let addr = proxy.addr;
    let mut idle = Vec::new();
    for n in 1..=4 {
        idle.push(h2raw::connect(addr).await);
        eventually(BOUND, "the connection counted", || {
            open_connections(&proxy) == n
        })
        .await;
    }
    // At the cap, a real call gets in: the oldest idle connection makes room.
    real_call(&proxy).await;
    assert!(
        closed_within(&mut idle[0], BOUND).await,
        "the oldest closed"
    );
    eventually(BOUND, "the call's connection gone", || {
        open_connections(&proxy) == 3
    })
    .await;
    idle.push(h2raw::connect(addr).await);
    eventually(BOUND, "at the cap again", || open_connections(&proxy) == 4).await;
    let health = raw_request(addr, "GET", "/healthz", "", true).await;
    assert_eq!(health.status, 200, "/healthz over HTTP/2 at the cap");
    assert!(closed_within(&mut idle[1], BOUND).await, "the next oldest");
    for stream in &mut idle[2..] {
        assert!(
            h2raw::answers_ping(stream).await,
            "newer idle ones are kept"
        );
    }
    let shed = |action: &str| {
        common::metric(
            &proxy,
            "tokengate_connections_shed_total",
            &[("listener", "proxy"), ("action", action)],
        ) as u64
    };
    assert_eq!((shed("closed_idle"), shed("refused")), (2, 0));

    // Every connection busy (a body on its way): a newcomer is refused, none is cut short.
    drop(idle);
    eventually(BOUND, "the idle ones gone", || {
        open_connections(&proxy) == 0
    })
    .await;
    let mut busy = Vec::new();
    for _ in 0..4 {
        busy.push(stalled_post(&proxy, 1000, 10).await);
    }
    eventually(BOUND, "four requests in flight", || {
        buffered(&proxy) == 4000
    })
    .await;
    let mut newcomer = TcpStream::connect(addr).await.expect("the kernel accepts");
    assert!(closed_within(&mut newcomer, BOUND).await, "refused");
    assert_eq!((shed("closed_idle"), shed("refused")), (2, 1));
    assert_eq!(open_connections(&proxy), 4, "the busy ones are all kept");
    drop(busy);
    assert_nothing_held(&proxy).await;
}

#[tokio::test]
async fn http2_streams_past_the_concurrency_limit_are_refused() {
    let (_sim, proxy) = stack(|c| {
        c.process.server.h2_max_concurrent_streams = 3;
        c.process.server.body_read_timeout = HOUR;
    })
    .await;
    let mut h2 = h2raw::connect(proxy.addr).await;
    let settings = h2raw::read_until(&mut h2, BOUND, |f| {
        f.kind == h2raw::SETTINGS && f.flags & h2raw::ACK == 0
    })
    .await
    .expect("server settings");
    assert_eq!(
        settings.setting(h2raw::SETTINGS_MAX_CONCURRENT_STREAMS),
        Some(3),
        "advertised"
    );
    // Four requests whose bodies never come, ignoring the advertised limit.
    let authority = proxy.addr.to_string();
    let path = model_path(SONNET_US, "converse");
    let extra = [("content-length", "10")];
    let fields = h2raw::request(&authority, "POST", &path, &extra);
    for stream in [1, 3, 5, 7] {
        h2.write_all(&h2raw::headers(stream, &fields, false))
            .await
            .expect("headers");
    }
    let reset = h2raw::read_until(&mut h2, BOUND, |f| f.kind == h2raw::RST_STREAM)
        .await
        .expect("a stream reset");
    assert_eq!(
        (reset.stream, reset.error_code()),
        (7, Some(h2raw::REFUSED_STREAM))
    );
    eventually(BOUND, "three streams in flight", || buffered(&proxy) == 30).await;
    drop(h2);
    assert_nothing_held(&proxy).await;
}

#[tokio::test]
async fn heads_over_the_limits_get_a_bedrock_shaped_answer_on_both_protocols() {
    let (_sim, proxy) = stack(|_| {}).await;
    let path = model_path(SONNET_US, "converse");
    let body = converse_body("[sim:output=5] x", Some(10));
    let big = "a".repeat(80_000);
    let many: Vec<(String, String)> = (0..150).map(|i| (format!("x-h{i}"), "v".into())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    for h2 in [false, true] {
        for (what, headers, says) in [
            (
                "an 80 KB header",
                vec![("x-big", big.as_str())],
                "at most 65536",
            ),
            ("150 headers", many.clone(), "at most 100"),
        ] {
            let r = raw_request_with(proxy.addr, "POST", &path, body.clone(), h2, &headers).await;
            let message = r.message();
            assert_eq!(
                (r.status, r.error_type()),
                (400, "ValidationException"),
                "{what} (h2 {h2}): {message}"
            );
            assert!(message.contains(says), "{what} (h2 {h2}): {message}");
        }
    }
    // Within the limits, the same call goes through on both.
    for h2 in [false, true] {
        let headers = [("x-big", &big[..50_000])];
        let r = raw_request_with(proxy.addr, "POST", &path, body.clone(), h2, &headers).await;
        assert_eq!(r.status, 200, "{}", r.message());
    }
    assert_nothing_held(&proxy).await;
}
