//! What a peer can make the proxy buffer (issue #14, points 1b and 12): request bodies against
//! the global budget of buffered bytes, and event streams that upstream cuts in the middle of a
//! frame. Each test ends with the ledger at zero and no request body held.

use crate::common;
use std::{net::SocketAddr, time::Duration};

use crate::common::{wire::*, *};
use aws_sdk_bedrockruntime::types::{ConverseStreamOutput, error::ConverseStreamOutputError};
use tokengate::bedrock::{ErrorCode, eventstream::event_frame};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
const POOL: &str = "sonnet4-us";
const KIB: usize = 1024;
/// Bounds every wait for the proxy to act, only against hangs.
const BOUND: Duration = Duration::from_secs(15);

/// A proxy whose bodies may be 300 KiB each and 512 KiB together.
async fn budget_stack(body_read_timeout: Duration) -> Stack {
    let sim = start_simulator(FAST_SIM).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    config.process.server.max_body_bytes = 300 * KIB;
    config.process.server.max_buffered_body_bytes = 512 * KIB;
    config.process.server.body_read_timeout = body_read_timeout;
    Stack {
        proxy: start_proxy(config).await,
        sim,
    }
}

/// The head of a chunked POST and its first chunk of `first` bytes.
async fn chunked_post(addr: SocketAddr, first: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let path = model_path(SONNET_US, "converse");
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("head");
    send_chunk(&mut stream, first).await;
    stream
}

async fn send_chunk(stream: &mut TcpStream, n: usize) {
    let chunk = format!("{n:x}\r\n{}\r\n", " ".repeat(n));
    stream.write_all(chunk.as_bytes()).await.expect("chunk");
}

/// The head of a POST declaring `declared` bytes, and `sent` of them.
async fn stalled_post(addr: SocketAddr, declared: usize, sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = post_head(addr, &model_path(SONNET_US, "converse"), declared);
    stream.write_all(head.as_bytes()).await.expect("head");
    stream.write_all(&vec![b' '; sent]).await.expect("part");
    stream
}

/// Asserts a response head is the budget's refusal: a retryable 503 with a jittered hint.
fn assert_budget_refusal(status: u16, head: &str) {
    let head = head.to_ascii_lowercase();
    assert_eq!(status, 503, "{head}");
    assert!(
        head.contains("x-amzn-errortype: serviceunavailableexception"),
        "{head}"
    );
    let hint = head
        .lines()
        .find_map(|l| l.strip_prefix("x-amz-retry-after: "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .expect("x-amz-retry-after");
    assert!((1_000..=5_000).contains(&hint), "{hint} ms");
    assert!(head.contains("retry-after: "), "{head}");
}

/// Request-body bytes the proxy holds now, as `/metrics` exposes them.
fn buffered(proxy: &tokengate::gateway::Gateway) -> usize {
    common::metric(proxy, "tokengate_buffered_body_bytes", &[]) as usize
}

#[tokio::test]
async fn bodies_past_the_buffer_budget_are_refused_at_once_and_the_budget_returns_to_zero() {
    let stack = budget_stack(Duration::from_secs(3600)).await;
    let (proxy, addr) = (&stack.proxy, stack.proxy.addr);
    let held = || buffered(proxy);
    // A declared length is charged whole, before its bytes arrive.
    let declared = stalled_post(addr, 256 * KIB, KIB).await;
    eventually(BOUND, "the declared length charged", || held() == 256 * KIB).await;
    // A chunked body is charged as its chunks arrive.
    let mut chunked = chunked_post(addr, 200 * KIB).await;
    eventually(BOUND, "the chunks charged", || held() == 456 * KIB).await;

    // A declared length that cannot fit is refused before a byte of its body is sent.
    let mut refused = stalled_post(addr, 100 * KIB, 0).await;
    let (status, head, _) = read_head(&mut refused).await;
    assert_budget_refusal(status, &head);
    // The chunked body grows past the budget: refused, and what it held is given back.
    send_chunk(&mut chunked, 60 * KIB).await;
    let (status, head, _) = read_head(&mut chunked).await;
    assert_budget_refusal(status, &head);
    eventually(BOUND, "the refused body given back", || held() == 256 * KIB).await;
    let refusals = common::metric(proxy, "tokengate_body_budget_refusals_total", &[]);
    assert_eq!(refusals, 2.0);

    // A client that hangs up gives its charge back; the proxy serves on.
    drop(declared);
    eventually(BOUND, "the hung-up body given back", || held() == 0).await;
    let body = converse_body("[sim:output=5] fits", Some(10));
    let r = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        body,
        false,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_nothing_held(proxy).await;
    assert_eq!(
        stack.sim.simulator.stats().calls(),
        1,
        "only the whole call"
    );
}

#[tokio::test]
async fn a_body_that_times_out_or_is_cut_gives_its_budget_back() {
    let stack = budget_stack(Duration::from_secs(1)).await;
    let (proxy, addr) = (&stack.proxy, stack.proxy.addr);
    let held = || buffered(proxy);
    let mut slow = stalled_post(addr, 10 * KIB, KIB).await;
    let reset = chunked_post(addr, 8 * KIB).await;
    eventually(BOUND, "both charged", || held() == 18 * KIB).await;
    // One hard reset mid-body, one stall past body_read_timeout_secs.
    reset.set_zero_linger().expect("SO_LINGER 0");
    drop(reset);
    let (status, head, _) = read_head(&mut slow).await;
    assert_eq!(status, 400, "{head}");
    assert_nothing_held(proxy).await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(BOUND, slow.read_to_end(&mut rest)).await;
    assert_eq!(stack.sim.simulator.stats().calls(), 0);
}

#[tokio::test]
async fn a_body_is_given_back_once_forwarded_while_its_stream_runs_on() {
    // A stream of about ten seconds: it outlives the body it was asked with.
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 20\ndefault_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &sonnet_pool(1_000_000, 8), "").await;
    let prompt = format!("[sim:output=200] {}", "words ".repeat(20_000));
    let body = converse_body(&prompt, Some(300));
    let path = model_path(SONNET_US, "converse-stream");
    let mut stream = raw_post(stack.proxy.addr, &path, body.as_bytes()).await;
    let (status, _, _) = read_head(&mut stream).await;
    assert_eq!(status, 200);
    let in_flight = || common::in_flight(&stack.proxy, POOL);
    assert_eq!(in_flight(), 1, "the stream runs");
    eventually(BOUND, "the forwarded body given back", || {
        buffered(&stack.proxy) == 0
    })
    .await;
    assert_eq!(in_flight(), 1, "while the stream still runs");
    drop(stream);
    assert_nothing_held(&stack.proxy).await;
}

/// An upstream that answers every call 200 with an event stream: two whole frames and the first
/// half of a third, then either cuts the connection or ends the body cleanly (`clean_end`).
async fn mid_frame_upstream(clean_end: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut stream_bytes =
        event_frame("messageStart", br#"{"p":"abc","role":"assistant"}"#).to_vec();
    let delta = br#"{"contentBlockIndex":0,"delta":{"text":"Hello"},"p":"abcdefgh"}"#;
    stream_bytes.extend_from_slice(&event_frame("contentBlockDelta", delta));
    let third = event_frame("contentBlockDelta", delta);
    stream_bytes.extend_from_slice(&third[..third.len() / 2]);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let bytes = stream_bytes.clone();
            tokio::spawn(async move {
                read_request(&mut conn).await;
                let mut answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/vnd.amazon.eventstream\r\n\
                     x-amzn-requestid: mid-frame\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
                    bytes.len()
                )
                .into_bytes();
                answer.extend_from_slice(&bytes);
                answer.extend_from_slice(b"\r\n");
                if clean_end {
                    answer.extend_from_slice(b"0\r\n\r\n");
                }
                let _ = conn.write_all(&answer).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    addr
}

/// Reads one request (head and `content-length` body) off `conn`.
async fn read_request(conn: &mut TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return;
            }
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

#[tokio::test]
async fn a_stream_cut_inside_a_frame_reaches_the_sdk_as_a_clean_model_stream_error() {
    for (clean_end, kind) in [(false, "stream_cut"), (true, "bad_frame")] {
        let upstream = mid_frame_upstream(clean_end).await;
        let proxy = start_proxy(proxy_config(upstream, &sonnet_pool(1_000_000, 8), "")).await;

        // The SDK decodes every frame and gets the modelled exception, not a checksum error.
        let client = sdk_client(proxy.addr, 1);
        let mut output = client
            .converse_stream()
            .model_id(SONNET_US)
            .messages(user_message("hello"))
            .inference_config(max_tokens(100))
            .send()
            .await
            .expect("the stream starts");
        let mut events = Vec::new();
        let error = loop {
            match output.stream.recv().await {
                Ok(Some(event)) => events.push(event),
                Ok(None) => panic!("the stream ended without an error after {events:?}"),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(events[0], ConverseStreamOutput::MessageStart(_)),
            "{events:?}"
        );
        assert!(
            matches!(events[1], ConverseStreamOutput::ContentBlockDelta(_)),
            "{events:?}"
        );
        assert_eq!(
            events.len(),
            2,
            "the partial third frame never reaches the client"
        );
        assert!(
            matches!(
                error.as_service_error(),
                Some(ConverseStreamOutputError::ModelStreamErrorException(_))
            ),
            "clean_end {clean_end}: {error:?}"
        );

        // On the wire: whole frames, the exception last.
        let path = model_path(SONNET_US, "converse-stream");
        let r = try_request(proxy.addr, &path, converse_body("hello", Some(100))).await;
        let bytes = r.body.expect("the proxy ends the stream in-band");
        let frames = frames(&bytes);
        let last = frames.last().expect("frames");
        assert_eq!(frames.len(), 3);
        assert_eq!(
            (last.message_type.as_str(), last.kind.as_str()),
            (
                "exception",
                ErrorCode::ModelStreamError.event_member().as_str()
            )
        );

        assert_ledger_zero(&proxy).await;
        let m = common::scrape(proxy.addr).await;
        m.expect(
            "tokengate_settlements_total",
            &[("pool", POOL), ("rule", "no_usage")],
            2.0,
        );
        m.expect(
            "tokengate_upstream_errors_total",
            &[("pool", POOL), ("kind", kind)],
            2.0,
        );
        proxy.shutdown().await.expect("shutdown");
    }
}
