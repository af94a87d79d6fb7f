//! Wire-level helpers for fault tests: requests whose body may fail, raw HTTP/1.1 over a TCP
//! socket (to hang up, stall or read slowly on purpose), event-stream frames, and the kernel's
//! socket queues (`/proc/net/tcp`).

use std::{net::SocketAddr, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tokengate::bedrock::eventstream::{Frame, FrameReader};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// A response whose body may have failed part-way (an aborted connection).
#[derive(Debug)]
pub struct TryResponse {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Result<Bytes, String>,
}

impl TryResponse {
    pub fn error_type(&self) -> &str {
        self.headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

/// Sends one request; the response head must arrive, its body may fail.
pub async fn try_request(addr: SocketAddr, path: &str, body: impl Into<Bytes>) -> TryResponse {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .expect("request");
    let response = client.request(request).await.expect("a response head");
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| format!("{e:?}"));
    TryResponse {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

/// Every whole event-stream frame in `bytes`; panics on corrupt framing.
pub fn frames(bytes: &[u8]) -> Vec<Frame> {
    let mut reader = FrameReader::new();
    reader.push(bytes);
    let mut out = Vec::new();
    while let Some(frame) = reader.next_frame().expect("valid event-stream framing") {
        out.push(frame);
    }
    assert_eq!(reader.pending(), 0, "a partial frame at the end");
    out
}

/// The head of an HTTP/1.1 POST with a JSON body of `content_length` bytes.
pub fn post_head(addr: SocketAddr, path: &str, content_length: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {content_length}\r\n\r\n"
    )
}

/// Opens a raw connection and writes a whole POST.
pub async fn raw_post(addr: SocketAddr, path: &str, body: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut request = post_head(addr, path, body.len()).into_bytes();
    request.extend_from_slice(body);
    stream.write_all(&request).await.expect("write request");
    stream
}

/// Reads up to the end of the response head; returns the status, the head, and the body bytes
/// read past it.
pub async fn read_head(stream: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .expect("a status line");
            return (status, head, buf[end + 4..].to_vec());
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("a response head within 10 s")
            .expect("read");
        assert!(n > 0, "connection closed before a response head: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Whether the peer closes `stream` within `within` (a read returns end-of-file or a reset),
/// discarding anything it sends first.
pub async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Bytes sitting in the kernel's send and receive queues of the IPv4 TCP socket `local` ->
/// `remote` (Linux, `/proc/net/tcp`); `None` if there is no such socket.
pub fn kernel_queued(local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let (l, r) = (proc_addr(local)?, proc_addr(remote)?);
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) != Some(&l.as_str()) || fields.get(2) != Some(&r.as_str()) {
            return None;
        }
        let (tx, rx) = fields.get(4)?.split_once(':')?;
        Some(u64::from_str_radix(tx, 16).ok()? + u64::from_str_radix(rx, 16).ok()?)
    })
}

/// Every IPv4 TCP connection whose local end is `local`: its remote address.
pub fn connections_from(local: SocketAddr) -> Vec<SocketAddr> {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return Vec::new();
    };
    let Some(l) = proc_addr(local) else {
        return Vec::new();
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // State 01 is ESTABLISHED.
            if fields.get(1) != Some(&l.as_str()) || fields.get(3) != Some(&"01") {
                return None;
            }
            parse_proc_addr(fields.get(2)?)
        })
        .collect()
}

/// `127.0.0.1:8080` as `/proc/net/tcp` writes it: `0100007F:1F90`.
fn proc_addr(addr: SocketAddr) -> Option<String> {
    let SocketAddr::V4(v4) = addr else {
        return None;
    };
    let ip = u32::from_le_bytes(v4.ip().octets());
    Some(format!("{ip:08X}:{:04X}", v4.port()))
}

fn parse_proc_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let ip = u32::from_str_radix(ip, 16).ok()?.to_le_bytes();
    let port = u16::from_str_radix(port, 16).ok()?;
    Some(SocketAddr::from((ip, port)))
}
