//! `tokengate healthcheck`: the probe a container runtime runs inside the image, which has no
//! shell and no curl (distroless). One plain-HTTP `GET` of the readiness endpoint over loopback,
//! bounded by a timeout; healthy means a `2xx` answer.
//!
//! It speaks HTTP/1.1 over a blocking `std` socket on purpose: no runtime to start, nothing to
//! configure, a few milliseconds per probe. It does not speak TLS: with `server.tls_cert` set,
//! probe from outside (Kubernetes `httpGet` with `scheme: HTTPS`). The same GET ([`get`]) reads
//! the admin endpoints for `tokengate report` and `tokengate top`.

use std::{
    io::{self, Read, Write},
    net::{TcpStream, ToSocketAddrs},
    time::{Duration, Instant},
};

/// The probe's URL when none is given: the readiness endpoint of the image's config.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080/readyz";

/// Why the probe failed.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("{0:?} is not a plain-HTTP URL like http://127.0.0.1:8080/readyz")]
    BadUrl(String),
    #[error("cannot connect to {authority}: {source}")]
    Connect {
        authority: String,
        source: io::Error,
    },
    #[error("no answer from {authority}: {source}")]
    Io {
        authority: String,
        source: io::Error,
    },
    #[error("{authority} did not answer with an HTTP status line")]
    BadResponse { authority: String },
    #[error("{authority} answered {status}")]
    Unhealthy { authority: String, status: u16 },
}

/// GETs `url` and returns its status if it is a `2xx`. The whole probe (resolving, connecting,
/// writing, reading the answer) takes at most about `timeout`.
pub fn check(url: &str, timeout: Duration) -> Result<u16, HealthError> {
    let answer = get(url, timeout)?;
    if (200..300).contains(&answer.status) {
        Ok(answer.status)
    } else {
        Err(HealthError::Unhealthy {
            authority: answer.authority,
            status: answer.status,
        })
    }
}

/// An answer to [`get`].
#[derive(Debug)]
pub struct Answer {
    pub authority: String,
    pub status: u16,
    pub body: Vec<u8>,
}

/// The largest answer [`get`] reads (the admin endpoints answer a few KiB).
const MAX_ANSWER: usize = 16 * 1024 * 1024;

/// GETs `url` (plain HTTP) within about `timeout`, whatever the status: the probe, and the
/// admin endpoints `tokengate report` and `tokengate top` read.
pub fn get(url: &str, timeout: Duration) -> Result<Answer, HealthError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|_| HealthError::BadUrl(url.to_string()))?;
    let (Some("http"), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(HealthError::BadUrl(url.to_string()));
    };
    let authority = authority.as_str().to_string();
    let host_port = match uri.port_u16() {
        Some(_) => authority.clone(),
        None => format!("{authority}:80"),
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let deadline = Instant::now() + timeout;
    let remaining = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let io_error = |source| HealthError::Io {
        authority: authority.clone(),
        source,
    };

    let addr = host_port
        .to_socket_addrs()
        .and_then(|mut addrs| {
            addrs
                .next()
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
        })
        .map_err(|source| HealthError::Connect {
            authority: authority.clone(),
            source,
        })?;
    let mut stream =
        TcpStream::connect_timeout(&addr, remaining()).map_err(|source| HealthError::Connect {
            authority: authority.clone(),
            source,
        })?;
    stream
        .set_write_timeout(Some(remaining()))
        .map_err(io_error)?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: tokengate\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).map_err(io_error)?;

    // `Connection: close`: the answer ends when the server closes.
    let mut raw = Vec::with_capacity(1024);
    let mut buf = [0u8; 8192];
    while raw.len() < MAX_ANSWER {
        stream
            .set_read_timeout(Some(remaining()))
            .map_err(io_error)?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            // A status line is enough for the probe when the server keeps the connection.
            Err(_) if status_code(&raw).is_some() && timed_out(deadline) => break,
            Err(e) => return Err(io_error(e)),
        }
    }
    let bad = || HealthError::BadResponse {
        authority: authority.clone(),
    };
    let status = status_code(&raw).ok_or_else(bad)?;
    let body = body_of(&raw).ok_or_else(bad)?;
    Ok(Answer {
        authority,
        status,
        body,
    })
}

fn timed_out(deadline: Instant) -> bool {
    Instant::now() >= deadline
}

/// The body of a whole HTTP/1.1 answer: after the head, de-chunked when it is chunked. A
/// truncated answer gives what arrived.
fn body_of(raw: &[u8]) -> Option<Vec<u8>> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split])
        .ok()?
        .to_ascii_lowercase();
    let mut body = &raw[split + 4..];
    if !head.contains("\r\ntransfer-encoding: chunked") {
        return Some(body.to_vec());
    }
    let mut out = Vec::with_capacity(body.len());
    loop {
        let line_end = body.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&body[..line_end]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        let chunk = body.get(..size)?;
        out.extend_from_slice(chunk);
        body = body.get(size + 2..).unwrap_or_default();
    }
}

/// The status code of an `HTTP/1.x NNN reason` line.
fn status_code(head: &[u8]) -> Option<u16> {
    let line = head.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use std::{net::TcpListener, thread};

    use super::*;

    /// A one-shot server on 127.0.0.1:0 that reads the request head and writes `answer`; returns
    /// its URL and the request it received.
    fn serve_once(answer: &'static [u8]) -> (String, thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/readyz", listener.local_addr().unwrap());
        let handle = thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 512];
            while !request.ends_with(b"\r\n\r\n") {
                let n = conn.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&buf[..n]);
            }
            conn.write_all(answer).unwrap();
            String::from_utf8(request).unwrap()
        });
        (url, handle)
    }

    #[test]
    fn a_2xx_answer_is_healthy() {
        let (url, server) = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nready\n");
        assert_eq!(check(&url, Duration::from_secs(5)).unwrap(), 200);
        let request = server.join().unwrap();
        assert!(request.starts_with("GET /readyz HTTP/1.1\r\n"), "{request}");
        assert!(request.contains("\r\nHost: 127.0.0.1:"), "{request}");
    }

    #[test]
    fn a_503_is_unhealthy_and_says_so() {
        let (url, server) = serve_once(b"HTTP/1.1 503 Service Unavailable\r\n\r\nnot ready\n");
        let err = check(&url, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(err, HealthError::Unhealthy { status: 503, .. }),
            "{err}"
        );
        server.join().unwrap();
    }

    #[test]
    fn garbage_and_silence_are_unhealthy() {
        let (url, server) = serve_once(b"SSH-2.0-OpenSSH\r\n");
        assert!(matches!(
            check(&url, Duration::from_secs(5)),
            Err(HealthError::BadResponse { .. })
        ));
        server.join().unwrap();

        // Accepts, never answers: the timeout bounds the probe.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/readyz", listener.local_addr().unwrap());
        let started = Instant::now();
        let err = check(&url, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, HealthError::Io { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(listener);
    }

    #[test]
    fn nothing_listening_and_bad_urls_are_errors() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let err = check(
            &format!("http://127.0.0.1:{port}/readyz"),
            Duration::from_secs(2),
        )
        .unwrap_err();
        assert!(matches!(err, HealthError::Connect { .. }), "{err}");
        for bad in [
            "https://127.0.0.1:8080/readyz",
            "127.0.0.1:8080",
            "not a url",
        ] {
            assert!(
                matches!(
                    check(bad, Duration::from_secs(1)),
                    Err(HealthError::BadUrl(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn bodies_are_read_whole_and_dechunked() {
        let (url, server) = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nready\n");
        assert_eq!(get(&url, Duration::from_secs(5)).unwrap().body, b"ready\n");
        server.join().unwrap();
        let chunked = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n7;x=y\r\n, world\r\n0\r\n\r\n";
        let (url, server) = serve_once(chunked);
        let answer = get(&url, Duration::from_secs(5)).unwrap();
        assert_eq!(
            (answer.status, answer.body.as_slice()),
            (404, &b"hello, world"[..])
        );
        server.join().unwrap();
        assert_eq!(body_of(b"HTTP/1.1 200 OK\r\n"), None);
    }

    #[test]
    fn status_lines_parse() {
        assert_eq!(status_code(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(status_code(b"HTTP/1.0 503\r\n"), Some(503));
        assert_eq!(status_code(b"HTTP/2 200\r\n"), None);
        assert_eq!(status_code(b""), None);
    }
}
