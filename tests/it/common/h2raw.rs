//! Hand-written HTTP/2 frames over a TCP socket, for tests that misbehave as no client library
//! would: a preface and nothing more, a `HEADERS` frame cut short, pings left unanswered, more
//! streams than the server allows. Header blocks are HPACK literals without indexing or Huffman
//! coding (RFC 7541, 6.2.2), which every decoder accepts; responses are read as frames only.

use std::{net::SocketAddr, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;

pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;

pub const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
pub const REFUSED_STREAM: u32 = 0x7;

/// One frame as read from the wire.
#[derive(Debug, Clone)]
pub struct H2Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl H2Frame {
    /// A `SETTINGS` frame's value for `id`.
    pub fn setting(&self, id: u16) -> Option<u32> {
        self.payload.chunks_exact(6).find_map(|s| {
            (u16::from_be_bytes([s[0], s[1]]) == id)
                .then(|| u32::from_be_bytes([s[2], s[3], s[4], s[5]]))
        })
    }

    /// A `RST_STREAM` or `GOAWAY` frame's error code.
    pub fn error_code(&self) -> Option<u32> {
        let at = match self.kind {
            RST_STREAM => 0,
            GOAWAY => 4,
            _ => return None,
        };
        let b = self.payload.get(at..at + 4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// A frame: 9-byte header, then `payload`.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// An HPACK integer with a 7-bit prefix.
fn hpack_int(out: &mut Vec<u8>, mut n: usize) {
    if n < 127 {
        out.push(n as u8);
        return;
    }
    out.push(127);
    n -= 127;
    while n >= 128 {
        out.push((n % 128) as u8 | 0x80);
        n /= 128;
    }
    out.push(n as u8);
}

/// A header block of literal fields (names lower-case).
pub fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0x00);
        hpack_int(&mut out, name.len());
        out.extend_from_slice(name.as_bytes());
        hpack_int(&mut out, value.len());
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// The request pseudo-headers for `method path` on `addr`, then `extra`.
pub fn request<'a>(
    addr: &'a str,
    method: &'a str,
    path: &'a str,
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut fields = vec![
        (":method", method),
        (":scheme", "http"),
        (":authority", addr),
        (":path", path),
    ];
    fields.extend_from_slice(extra);
    fields
}

/// A whole `HEADERS` frame.
pub fn headers(stream: u32, fields: &[(&str, &str)], end_stream: bool) -> Vec<u8> {
    let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
    frame(HEADERS, flags, stream, &header_block(fields))
}

/// Connects and sends the client preface and an empty `SETTINGS` frame.
pub async fn connect(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut hello = PREFACE.to_vec();
    hello.extend_from_slice(&frame(SETTINGS, 0, 0, &[]));
    stream.write_all(&hello).await.expect("preface");
    stream
}

/// The next frame, `None` once the peer closes (end of file or reset); panics after `within`.
pub async fn read_frame(stream: &mut TcpStream, within: Duration) -> Option<H2Frame> {
    let read = async {
        let mut head = [0u8; 9];
        stream.read_exact(&mut head).await.ok()?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).await.ok()?;
        Some(H2Frame {
            kind: head[3],
            flags: head[4],
            stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
            payload,
        })
    };
    tokio::time::timeout(within, read)
        .await
        .expect("a frame or the end within the bound")
}

/// Reads frames until one matches `wanted`; `None` if the peer closes first.
pub async fn read_until(
    stream: &mut TcpStream,
    within: Duration,
    wanted: impl Fn(&H2Frame) -> bool,
) -> Option<H2Frame> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let frame = read_frame(stream, left).await?;
        if wanted(&frame) {
            return Some(frame);
        }
    }
}

/// Whether the server still serves this connection: it answers a ping.
pub async fn answers_ping(stream: &mut TcpStream) -> bool {
    let payload = *b"tg-alive";
    if stream
        .write_all(&frame(PING, 0, 0, &payload))
        .await
        .is_err()
    {
        return false;
    }
    read_until(stream, Duration::from_secs(10), |f| {
        f.kind == PING && f.flags & ACK != 0 && f.payload == payload
    })
    .await
    .is_some()
}
