//! The HTTP/2 connection set against real servers on `127.0.0.1:0`: the simulator (h2c), and a
//! bare `h2` server for what the simulator never does (refusing a stream).

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};

use super::{
    Alpn, connector,
    h2_connections::{ConnectionSet, HostView, Sent, Settings},
};

fn set(idle_timeout: Duration) -> ConnectionSet<Full<Bytes>> {
    set_with(idle_timeout, Duration::from_secs(5))
}

fn set_with(idle_timeout: Duration, connect_timeout: Duration) -> ConnectionSet<Full<Bytes>> {
    let connector = connector(Alpn::H2, connect_timeout, "test").expect("connector");
    ConnectionSet::new(
        connector,
        Settings {
            streams_per_connection: 100,
            connect_timeout,
            idle_timeout,
        },
    )
}

fn get(addr: SocketAddr, path: &str) -> Request<Full<Bytes>> {
    Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .expect("request")
}

/// The response of `sent`, read to its end.
async fn answered(sent: Sent<Full<Bytes>>) -> (u16, Bytes) {
    let Sent::Answered(response) = sent else {
        panic!("HTTP/2 over prior knowledge")
    };
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.expect("body");
    (status, body.to_bytes())
}

/// Polls `views` of `set` (10 ms apart, 10 s at most) until `done` holds.
async fn until(set: &ConnectionSet<Full<Bytes>>, what: &str, done: impl Fn(&[HostView]) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done(&set.views()) {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn an_idle_connection_closes_after_the_idle_timeout() {
    let sim = crate::simulator::spawn(Default::default(), SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("simulator");
    let set = set(Duration::from_millis(100));
    let sent = set.send(get(sim.addr, "/_sim/stats"), None).await;
    let (status, _) = answered(sent.expect("sent")).await;
    assert_eq!(status, 200);
    let host = format!("http://{}", sim.addr);
    let open = |connections| {
        vec![HostView {
            host: host.clone(),
            connections,
            streams: 0,
        }]
    };
    // The body was read to its end: the stream is no longer counted.
    assert_eq!(set.views(), open(1));
    until(&set, "the idle connection to close", |v| v == open(0)).await;
    // The next call opens another.
    let sent = set.send(get(sim.addr, "/_sim/stats"), None).await;
    assert_eq!(answered(sent.expect("sent")).await.0, 200);
    assert_eq!(set.views(), open(1));
}

/// A bare HTTP/2 server that resets its first `refuse` streams with `reason` and answers the
/// rest 200, over every connection it accepts; counts the streams it sees.
async fn refusing_server(refuse: usize, reason: h2::Reason) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(AtomicUsize::new(0));
    let counted = seen.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((_, mut respond))) = conn.accept().await {
                    if counted.fetch_add(1, Ordering::SeqCst) < refuse {
                        respond.send_reset(reason);
                    } else {
                        let _ = respond.send_response(Response::new(()), true);
                    }
                }
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn a_refused_stream_is_sent_again_once() {
    let (addr, seen) = refusing_server(1, h2::Reason::REFUSED_STREAM).await;
    let set = set(Duration::from_secs(60));
    let copy = get(addr, "/");
    let sent = set.send(get(addr, "/"), Some(copy)).await.expect("sent");
    assert_eq!(answered(sent).await.0, 200);
    assert_eq!(seen.load(Ordering::SeqCst), 2, "refused, then answered");
    let view = &set.views()[0];
    assert_eq!(view.streams, 0, "both streams' counts came back");
    assert_eq!(view.connections, 2, "sent again on another connection");
}

#[tokio::test]
async fn a_refused_stream_without_a_copy_or_a_processed_one_is_not_sent_again() {
    let (addr, seen) = refusing_server(1, h2::Reason::REFUSED_STREAM).await;
    let set = set(Duration::from_secs(60));
    let e = set.send(get(addr, "/"), None).await.expect_err("no copy");
    assert!(e.to_string().contains("refused"), "{e}");
    assert_eq!(seen.load(Ordering::SeqCst), 1);

    // INTERNAL_ERROR: the server may have acted on it.
    let (addr, seen) = refusing_server(1, h2::Reason::INTERNAL_ERROR).await;
    let copy = get(addr, "/");
    let e = set
        .send(get(addr, "/"), Some(copy))
        .await
        .expect_err("not retried");
    assert!(e.to_string().contains("internal error"), "{e}");
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert!(
        set.views().iter().all(|v| v.streams == 0),
        "{:?}",
        set.views()
    );
}

/// A server that accepts TCP and never speaks HTTP/2: five calls at once wait for one attempt to
/// open a connection, which times out (no SETTINGS), and all five fail with it; the server saw
/// one connection, not five tried in turn.
#[tokio::test]
async fn calls_waiting_for_a_connection_that_fails_fail_with_it() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            held.push(socket);
        }
    });
    let set = set_with(Duration::from_secs(60), Duration::from_millis(300));
    let calls = (0..5).map(|_| set.send(get(addr, "/"), None));
    for result in futures_util::future::join_all(calls).await {
        let e = result.expect_err("no HTTP/2 there");
        assert!(e.to_string().contains("connect timeout"), "{e}");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}
