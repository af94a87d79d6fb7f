//! Client faults over raw TCP: hang-ups mid-body and while waiting for the answer, a reader that
//! stalls on a stream of many MB (bounded buffering), idle and half-sent connections. Each ends
//! with the ledger at zero.
//!
//! Also here: a raw-TCP client that hangs up while its call waits in the admission queue.
//! Already covered elsewhere: an SDK client that drops a stream mid-way (`tests/admission.rs`),
//! the queue's own bookkeeping when a waiter goes (`tests/queue.rs`, in process).

use crate::common;
use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use crate::common::{wire::*, *};
use tokengate::gateway::Gateway;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpSocket, TcpStream},
};

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
const POOL: &str = "sonnet4-us";

fn settled(proxy: &Gateway, rule: &str) -> u64 {
    common::settlements(proxy, POOL, rule)
}

fn in_flight(proxy: &Gateway) -> u64 {
    common::in_flight(proxy, POOL)
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_body_reaches_nothing_and_holds_nothing() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), "").await;
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    // The part that arrives is a whole, valid request: a proxy that took end-of-file for the end
    // of the body would forward it.
    let part = converse_body("[sim:output=5] hello", Some(10));
    let declared = part.len() + 500;

    // A half-close (FIN): the proxy sees end-of-file mid-body and closes the connection.
    let mut half = TcpStream::connect(addr).await.expect("connect");
    half.write_all(post_head(addr, &path, declared).as_bytes())
        .await
        .expect("head");
    half.write_all(part.as_bytes()).await.expect("part");
    half.shutdown().await.expect("half-close");
    assert!(closed_within(&mut half, Duration::from_secs(5)).await);

    // Chunked, then a hard reset (RST).
    let mut reset = TcpStream::connect(addr).await.expect("connect");
    let chunked = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\n\r\n{:x}\r\n{part}\r\n",
        part.len()
    );
    reset.write_all(chunked.as_bytes()).await.expect("chunk");
    reset.set_zero_linger().expect("SO_LINGER 0");
    drop(reset);

    // The proxy still serves, and nothing of the two reached upstream or the ledger.
    let ok = raw_request(addr, "POST", &path, part.clone(), false).await;
    assert_eq!(ok.status, 200);
    stack.assert_ledger_zero().await;
    let m = common::scrape(addr).await;
    m.expect(
        "tokengate_requests_total",
        &[
            ("pool", POOL),
            ("api", "bedrock"),
            ("operation", "Converse"),
            ("outcome", "admitted"),
        ],
        1.0,
    );
    let calls = stack
        .sim
        .simulator
        .stats()
        .operations
        .get("Converse")
        .copied();
    assert_eq!(calls, Some(1), "only the whole request went upstream");
}

#[tokio::test]
async fn a_client_that_hangs_up_while_waiting_for_the_answer_is_charged_its_reservation() {
    // The answer would take ten minutes; the client leaves after it was admitted.
    let sim = "time_to_first_token_ms = 600000\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &sonnet_pool(1_000_000, 8), "").await;
    let body = converse_body("[sim:output=5] wait for me", Some(100));
    let stream = raw_post(
        stack.proxy.addr,
        &model_path(SONNET_US, "converse"),
        body.as_bytes(),
    )
    .await;
    eventually(Duration::from_secs(5), "admission", || {
        in_flight(&stack.proxy) == 1
    })
    .await;
    drop(stream);
    eventually(Duration::from_secs(5), "settlement", || {
        in_flight(&stack.proxy) == 0
    })
    .await;
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "abandoned"), 1);
    let m = common::scrape(stack.proxy.addr).await;
    assert_eq!(
        m.get("tokengate_charged_tokens_total", &[("pool", POOL)]),
        m.get("tokengate_reserved_tokens_total", &[("pool", POOL)]),
        "abandoned charges the reservation: the call may still run upstream"
    );
}

/// A raw-TCP client whose call waits in the admission queue hangs up: the proxy counts it
/// `cancelled` (as `/metrics` shows), it never reached upstream or the ledger, and the call
/// holding the pool's only slot is unaffected.
#[tokio::test]
async fn a_client_that_hangs_up_while_queued_is_counted_and_holds_nothing() {
    // The first token would take ten minutes: the holder keeps the only slot until it leaves.
    let sim = "time_to_first_token_ms = 600000\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
    let pool = format!("{}max_wait_ms = 20000\n", sonnet_pool(1_000_000, 1));
    let stack = Stack::start(sim, &pool, "").await;
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    let body = converse_body("[sim:output=5] wait for me", Some(100));
    let holder = raw_post(addr, &path, body.as_bytes()).await;
    eventually(Duration::from_secs(5), "the holder admitted", || {
        in_flight(&stack.proxy) == 1
    })
    .await;
    let held = stack.proxy.admission().pool_views().await[0]
        .ledger
        .as_ref()
        .expect("ledger")
        .reserved_tokens;
    let queued = raw_post(addr, &path, body.as_bytes()).await;
    let metric = |m: &scrape::Scrape, name: &str, labels: &[(&str, &str)]| m.get(name, labels);
    let outcome = |m: &scrape::Scrape, outcome: &str| {
        metric(
            m,
            "tokengate_queue_outcomes_total",
            &[("pool", POOL), ("outcome", outcome)],
        )
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(
        &scrape(addr).await,
        "tokengate_queue_depth",
        &[("pool", POOL)],
    ) != 1.0
    {
        assert!(Instant::now() < deadline, "the second call never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(queued);
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = scrape(addr).await;
        if outcome(&m, "cancelled") == 1.0 {
            break m;
        }
        assert!(Instant::now() < deadline, "the hang-up was not counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        metric(&m, "tokengate_queue_depth", &[("pool", POOL)]),
        0.0,
        "it left the queue"
    );
    for other in ["admitted", "timed_out", "shutdown"] {
        assert_eq!(outcome(&m, other), 0.0, "{other}");
    }
    let ledger = stack.proxy.admission().pool_views().await[0]
        .ledger
        .clone()
        .expect("ledger");
    assert_eq!(
        (ledger.in_flight_requests, ledger.reserved_tokens),
        (1, held),
        "only the holder holds anything"
    );
    assert_eq!(
        stack.sim.simulator.stats().calls(),
        1,
        "only the holder went upstream"
    );
    drop(holder);
    stack.assert_ledger_zero().await;
    assert_eq!(
        settled(&stack.proxy, "abandoned"),
        1,
        "the holder, and only it"
    );
}

/// Bytes in the kernel's queues on both ends of the TCP connection `a` <-> `b`.
fn queued_between(a: SocketAddr, b: SocketAddr) -> u64 {
    kernel_queued(a, b).unwrap_or(0) + kernel_queued(b, a).unwrap_or(0)
}

/// Reads exactly `n` bytes (or to the end), returning how many were read.
async fn read_bytes(stream: &mut TcpStream, n: usize, pause: Duration) -> usize {
    let mut buf = vec![0u8; 64 * 1024];
    let mut read = 0;
    while read < n {
        let want = buf.len().min(n - read);
        let got = stream.read(&mut buf[..want]).await.expect("read");
        if got == 0 {
            break;
        }
        read += got;
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
    read
}

/// Samples `value` until it has not moved for `quiet`; returns it.
async fn settled_value(quiet: Duration, within: Duration, mut value: impl FnMut() -> u64) -> u64 {
    let deadline = Instant::now() + within;
    let (mut last, mut since) = (value(), Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = value();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= quiet {
            return now;
        }
        assert!(Instant::now() < deadline, "never settled: {now}");
    }
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_slow_reader_holds_upstream_back_instead_of_filling_the_proxys_memory() {
    // A 32 MiB stream (8M tokens of 4 bytes, in 640 KB frames), produced far faster than a
    // client that stops reading takes it.
    const TOKENS: u64 = 8_000_000;
    const MIB: u64 = 1024 * 1024;
    let sim = format!(
        "time_to_first_token_ms = 0\ntokens_per_second = 3200000\n\
         default_tokens_per_minute = 1000000000\nmax_output_tokens = {TOKENS}\n"
    );
    let sim = start_simulator(&sim).await;
    let proxy = start_proxy(proxy_config(sim.addr, &sonnet_pool(1_000_000_000, 8), "")).await;
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(64 * 1024).expect("SO_RCVBUF");
    let mut stream = socket.connect(proxy.addr).await.expect("connect");
    let body = converse_body(&format!("[sim:output={TOKENS}] at length"), Some(TOKENS));
    let path = model_path(SONNET_US, "converse-stream");
    let mut request = post_head(proxy.addr, &path, body.len()).into_bytes();
    request.extend_from_slice(body.as_bytes());
    stream.write_all(&request).await.expect("request");
    let (status, _, early) = read_head(&mut stream).await;
    assert_eq!(status, 200);

    // Read 1 MiB, then stop reading until the pipeline stands still.
    let mut read =
        early.len() as u64 + read_bytes(&mut stream, MIB as usize, Duration::ZERO).await as u64;
    let stats = || sim.simulator.stats().stream_bytes_sent;
    let sent = settled_value(Duration::from_millis(500), Duration::from_secs(20), stats).await;
    let client = stream.local_addr().expect("local addr");
    let upstream_conns = connections_from(sim.addr);
    assert_eq!(upstream_conns.len(), 1, "one upstream connection");
    let kernel = queued_between(client, proxy.addr) + queued_between(sim.addr, upstream_conns[0]);
    let held = sent.saturating_sub(read + kernel);
    eprintln!(
        "stream {} MiB; simulator sent {:.1} MiB, client read {:.1} MiB, kernel socket queues {:.1} MiB, \
         in user space {:.2} MiB",
        TOKENS * 4 / MIB,
        sent as f64 / MIB as f64,
        read as f64 / MIB as f64,
        kernel as f64 / MIB as f64,
        held as f64 / MIB as f64
    );
    assert!(
        held < 4 * MIB,
        "{held} bytes between the simulator and the client are in neither socket queue: the proxy buffers"
    );
    assert!(
        sent < TOKENS * 4,
        "the simulator sent the whole stream to a client that stopped reading"
    );

    // Reading on lets the stream move on: a crawl, not a deadlock. How much must be read before
    // the simulator sends again depends on the kernel's socket buffers (autotuned, up to about
    // 10 MiB here), so read a MiB at a time until it does.
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats() <= sent {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the simulator to send more"
        );
        read += read_bytes(&mut stream, MIB as usize, Duration::ZERO).await as u64;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(read > MIB);

    // The client gives up: the stream settles without usage.
    drop(stream);
    assert_ledger_zero(&proxy).await;
    assert_eq!(settled(&proxy, "no_usage"), 1);
}

/// Long enough for the setup below (a thousand connects) on a loaded machine.
const HEADER_TIMEOUT: Duration = Duration::from_secs(3);

/// Whether the proxy has neither sent anything on `stream` nor closed it.
fn still_open(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(stream.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

#[tokio::test]
async fn idle_and_half_sent_connections_do_not_stop_requests_and_are_closed_after_their_timeouts() {
    let sim = start_simulator(FAST_SIM).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    // Silent and half-sent connections close at the header timeout, the kept-alive one at the
    // idle timeout.
    config.process.server.header_read_timeout = HEADER_TIMEOUT;
    config.process.server.idle_timeout = HEADER_TIMEOUT;
    let proxy = start_proxy(config).await;
    let addr = proxy.addr;
    let opened = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..1000 {
        idle.push(TcpStream::connect(addr).await.expect("connect"));
    }
    // A head sent in part, and a keep-alive connection left idle after its answer.
    let mut partial = TcpStream::connect(addr).await.expect("connect");
    partial
        .write_all(format!("POST /model/x/converse HTTP/1.1\r\nhost: {addr}\r\n").as_bytes())
        .await
        .expect("partial head");
    let body = converse_body("[sim:output=5] kept alive", Some(10));
    let mut kept = raw_post(addr, &model_path(SONNET_US, "converse"), body.as_bytes()).await;
    let (status, head, _) = read_head(&mut kept).await;
    assert_eq!(status, 200, "{head}");

    // A normal call while they all sit there.
    let r = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=5] hello", Some(10)),
        false,
    )
    .await;
    assert_eq!(r.status, 200);
    // The call was served while every one of them was open (none has answered or closed yet).
    let open = idle
        .iter()
        .chain([&partial])
        .filter(|s| still_open(s))
        .count();
    assert_eq!(open, 1001, "connections the call met open");

    // Every one of them is closed by the proxy once its timeout passes.
    idle.push(partial);
    idle.push(kept);
    let closes = idle.iter_mut().map(|s| async move {
        let closed = closed_within(s, Duration::from_secs(10)).await;
        (closed, Instant::now())
    });
    let results = futures_util::future::join_all(closes).await;
    let open = results.iter().filter(|(closed, _)| !closed).count();
    assert_eq!(open, 0, "connections left open past their timeouts");
    let earliest = results.iter().map(|(_, at)| *at).min().expect("results");
    // A lower bound: a busy machine can only make the closes later.
    assert!(
        earliest.duration_since(opened) >= HEADER_TIMEOUT - Duration::from_millis(100),
        "closed before the timeout"
    );
    assert_ledger_zero(&proxy).await;
}

/// A client that sends a head and part of its body, then stalls, gets a clear 400 once
/// `server.body_read_timeout_secs` passes; nothing reaches upstream or the ledger.
#[tokio::test]
async fn a_body_that_stalls_is_answered_when_it_is_overdue() {
    let sim = start_simulator(FAST_SIM).await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nbody_read_timeout_secs = 1\n\n[upstream]\nregion = \"us-east-1\"\n\
         endpoint = \"http://{}\"\n\n{}",
        sim.addr,
        sonnet_pool(1_000_000, 8)
    );
    let proxy = start_proxy(tokengate::config::Config::parse(&text).expect("config")).await;
    let addr = proxy.addr;
    let path = model_path(SONNET_US, "converse");
    let part = converse_body("[sim:output=5] hello", Some(10));
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(post_head(addr, &path, part.len() + 100).as_bytes())
        .await
        .expect("head");
    stream.write_all(part.as_bytes()).await.expect("part");
    let started = Instant::now();
    let (status, head, mut body) = read_head(&mut stream).await;
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "not before the timeout"
    );
    assert_eq!(status, 400, "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("x-amzn-errortype: validationexception"),
        "{head}"
    );
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&body).contains('}') {
        match tokio::time::timeout(Duration::from_secs(2), stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => body.extend_from_slice(&chunk[..n]),
            _ => break,
        }
    }
    let body = String::from_utf8_lossy(&body);
    assert!(
        body.contains("body_read_timeout_secs"),
        "says which setting: {body}"
    );
    assert_ledger_zero(&proxy).await;
    assert_eq!(sim.simulator.stats().calls(), 0, "nothing went upstream");
}
