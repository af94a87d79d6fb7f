//! Which HTTP a connection speaks, and the connection served in it: HTTP/2 if its first bytes are
//! HTTP/2's preface (h2c prior knowledge, or `h2` over TLS), HTTP/1.1 otherwise.
//!
//! hyper-util's auto builder tells the two apart the same way, but then hands hyper's HTTP/1.1
//! reader the 24 bytes it read as a first read of their own. hyper reads in 8 KiB steps and grows
//! its buffer whenever less than that is free, so its second read doubled every HTTP/1.1
//! connection's read buffer to 16 KiB, held for the connection's life: 16 MiB with 2,000 open
//! streams (loadtest/RESULTS.md, issue #19). Here hyper's first read gets those bytes and whatever
//! the socket holds behind them ([`Rewind`]), so a request that arrived whole is read whole and
//! the buffer stays at 8 KiB.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use hyper::{
    body::Incoming,
    server::conn::{http1, http2},
    service::HttpService,
};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{BoxError, ResponseBody, ServeOptions, service};

/// HTTP/2's connection preface, which a client speaking HTTP/2 sends first.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// hyper's settings for either protocol.
#[derive(Debug)]
pub(super) struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

impl Protocols {
    pub(super) fn new(options: &ServeOptions) -> Protocols {
        let mut http1 = http1::Builder::new();
        http1
            .max_buf_size(service::HYPER_MAX_HEAD_BYTES)
            .max_headers(service::HYPER_MAX_HEADER_FIELDS)
            .keep_alive(true)
            .timer(TokioTimer::new())
            // Head and idle timeouts are the connection task's (hyper's would close an idle
            // keep-alive connection at the header timeout).
            .header_read_timeout(None);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2
            .max_header_list_size(service::HYPER_MAX_HEAD_BYTES as u32)
            .max_concurrent_streams(options.h2_max_concurrent_streams)
            .keep_alive_interval(options.h2_keep_alive_interval)
            .keep_alive_timeout(options.h2_keep_alive_timeout)
            .timer(TokioTimer::new());
        Protocols { http1, http2 }
    }

    /// Serves `io` until it ends (see [`Connection::graceful_shutdown`]).
    pub(super) fn serve<I, S>(self: &Arc<Self>, io: I, service: S) -> Connection<I, S>
    where
        S: HttpService<Incoming>,
    {
        Connection::Reading {
            io: Some(io),
            prefix: Prefix::new(),
            service: Some(service),
            protocols: self.clone(),
        }
    }
}

type Io<I> = TokioIo<Rewind<I>>;

pin_project_lite::pin_project! {
    /// One connection being served: a future that ends with it.
    ///
    /// A state machine rather than an `async fn`: an `async fn` kept room for both protocols'
    /// connections side by side, and for its arguments beside what they were moved into, and
    /// every connection's task carries this future.
    #[project = ConnectionProj]
    pub(super) enum Connection<I, S>
    where
        S: HttpService<Incoming>,
    {
        Reading {
            io: Option<I>,
            prefix: Prefix,
            service: Option<S>,
            protocols: Arc<Protocols>,
        },
        Http1 {
            #[pin]
            conn: http1::UpgradeableConnection<Io<I>, S>,
        },
        // On the heap: HTTP/2's connection state is more than twice HTTP/1.1's, and HTTP/2
        // clients open few connections.
        Http2 {
            conn: Pin<Box<http2::Connection<Io<I>, S, TokioExecutor>>>,
        },
        Closed,
    }
}

impl<I, S> Connection<I, S>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming, Error = BoxError, Future: Send + 'static> + Send + 'static,
    S::ResBody: ResponseBody,
{
    /// Closes the connection gracefully: one still reading its first bytes ends at once, one
    /// being served after the response in flight (HTTP/1.1) or with `GOAWAY` (HTTP/2).
    pub(super) fn graceful_shutdown(mut self: Pin<&mut Self>) {
        match self.as_mut().project() {
            ConnectionProj::Http1 { conn } => conn.graceful_shutdown(),
            ConnectionProj::Http2 { conn } => conn.as_mut().graceful_shutdown(),
            ConnectionProj::Reading { .. } | ConnectionProj::Closed => {}
        }
        if matches!(*self, Connection::Reading { .. }) {
            self.set(Connection::Closed);
        }
    }
}

impl<I, S> Future for Connection<I, S>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming, Error = BoxError, Future: Send + 'static> + Send + 'static,
    S::ResBody: ResponseBody,
{
    type Output = Result<(), BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project() {
                ConnectionProj::Reading {
                    io,
                    prefix,
                    service,
                    protocols,
                } => {
                    let Some(reading) = io.as_mut() else {
                        return Poll::Ready(Ok(()));
                    };
                    ready!(prefix.poll_read(reading, cx))?;
                    let (Some(io), Some(service)) = (io.take(), service.take()) else {
                        return Poll::Ready(Ok(()));
                    };
                    let is_http2 = prefix.is_http2();
                    let io = TokioIo::new(Rewind::new(std::mem::take(prefix), io));
                    if is_http2 {
                        Connection::Http2 {
                            conn: Box::pin(protocols.http2.serve_connection(io, service)),
                        }
                    } else {
                        Connection::Http1 {
                            conn: protocols
                                .http1
                                .serve_connection(io, service)
                                .with_upgrades(),
                        }
                    }
                }
                ConnectionProj::Http1 { conn } => return conn.poll(cx).map_err(Into::into),
                ConnectionProj::Http2 { conn } => {
                    return conn.as_mut().poll(cx).map_err(Into::into);
                }
                ConnectionProj::Closed => return Poll::Ready(Ok(())),
            };
            self.set(next);
        }
    }
}

/// The first bytes of a connection: read until they stop matching HTTP/2's preface, or match it
/// whole.
#[derive(Debug, Default)]
pub(super) struct Prefix {
    bytes: [u8; H2_PREFACE.len()],
    len: usize,
    /// Read to its end: its bytes depart from the preface, or are all of it, or the connection
    /// ended.
    done: bool,
}

impl Prefix {
    fn new() -> Prefix {
        Prefix::default()
    }

    /// Reads until the prefix is done.
    fn poll_read<I: AsyncRead + Unpin>(
        &mut self,
        io: &mut I,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while !self.done {
            let start = self.len;
            let mut buf = ReadBuf::new(&mut self.bytes[start..]);
            ready!(Pin::new(&mut *io).poll_read(cx, &mut buf))?;
            let n = buf.filled().len();
            self.len += n;
            self.done = n == 0
                || self.len == H2_PREFACE.len()
                || self.bytes[start..self.len] != H2_PREFACE[start..self.len];
        }
        Poll::Ready(Ok(()))
    }

    #[cfg(test)]
    async fn read<I: AsyncRead + Unpin>(io: &mut I) -> io::Result<Prefix> {
        let mut prefix = Prefix::new();
        std::future::poll_fn(|cx| prefix.poll_read(io, cx)).await?;
        Ok(prefix)
    }

    fn is_http2(&self) -> bool {
        self.bytes[..self.len] == H2_PREFACE[..]
    }
}

pin_project_lite::pin_project! {
    /// A connection's byte stream with its first bytes, already read, given back to the first
    /// reads, the first of them together with what the socket holds behind them.
    struct Rewind<I> {
        prefix: Prefix,
        given: usize,
        // An error the socket returned on the read that also gave back the prefix; the next
        // read reports it.
        error: Option<io::Error>,
        #[pin]
        inner: I,
    }
}

impl<I> Rewind<I> {
    fn new(prefix: Prefix, inner: I) -> Rewind<I> {
        Rewind {
            prefix,
            given: 0,
            error: None,
            inner,
        }
    }
}

impl<I: AsyncRead> AsyncRead for Rewind<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        if let Some(e) = this.error.take() {
            return Poll::Ready(Err(e));
        }
        let left = &this.prefix.bytes[*this.given..this.prefix.len];
        if left.is_empty() {
            return this.inner.poll_read(cx, buf);
        }
        let n = left.len().min(buf.remaining());
        buf.put_slice(&left[..n]);
        *this.given += n;
        if *this.given == this.prefix.len && buf.remaining() > 0 {
            // The read has made progress whatever the socket answers: nothing there yet (the
            // socket will wake the task when there is) or its end are for the next read.
            if let Poll::Ready(Err(e)) = this.inner.poll_read(cx, buf) {
                *this.error = Some(e);
            }
        }
        Poll::Ready(Ok(()))
    }
}

super::write_through!(Rewind);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What `Prefix::read` and `Rewind` make of `sent` written in `pieces`, and what the first
    /// read after the prefix returns.
    async fn first_read(pieces: &[&[u8]]) -> (bool, Vec<u8>) {
        let (mut client, mut server) = tokio::io::duplex(1024);
        for piece in pieces {
            client.write_all(piece).await.unwrap();
        }
        let prefix = Prefix::read(&mut server).await.unwrap();
        let is_http2 = prefix.is_http2();
        let mut rewind = Rewind::new(prefix, server);
        let mut buf = [0u8; 512];
        let n = rewind.read(&mut buf).await.unwrap();
        (is_http2, buf[..n].to_vec())
    }

    #[tokio::test]
    async fn a_request_that_arrived_whole_is_given_back_in_one_read() {
        let request = b"POST /model/m/converse HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}";
        let (is_http2, read) = first_read(&[request]).await;
        assert!(!is_http2);
        assert_eq!(
            read, request,
            "the prefix and what followed it, in one read"
        );
    }

    #[tokio::test]
    async fn http2_s_preface_is_told_from_http1() {
        let (is_http2, read) = first_read(&[H2_PREFACE, b"\0\0\0\x04\0\0\0\0\0"]).await;
        assert!(is_http2);
        assert_eq!(&read[..24], H2_PREFACE);
        assert_eq!(
            read.len(),
            33,
            "the SETTINGS frame behind the preface is in the same read"
        );
        // A request that starts like the preface and then departs from it is HTTP/1.1.
        let (is_http2, read) = first_read(&[b"PRI", b"NCIPAL / HTTP/1.1\r\n\r\n"]).await;
        assert!(!is_http2);
        assert_eq!(read, b"PRINCIPAL / HTTP/1.1\r\n\r\n");
    }

    #[tokio::test]
    async fn a_connection_closed_before_a_byte_reads_as_its_end() {
        let (client, mut server) = tokio::io::duplex(64);
        drop(client);
        let prefix = Prefix::read(&mut server).await.unwrap();
        assert!(!prefix.is_http2());
        let mut rewind = Rewind::new(prefix, server);
        let mut buf = [0u8; 16];
        assert_eq!(rewind.read(&mut buf).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_small_read_takes_the_prefix_in_pieces() {
        let (mut client, mut server) = tokio::io::duplex(64);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let prefix = Prefix::read(&mut server).await.unwrap();
        let mut rewind = Rewind::new(prefix, server);
        let mut all = Vec::new();
        let mut buf = [0u8; 5];
        while all.len() < 18 {
            let n = rewind.read(&mut buf).await.unwrap();
            all.extend_from_slice(&buf[..n]);
        }
        assert_eq!(all, b"GET / HTTP/1.1\r\n\r\n");
    }
}

#[cfg(test)]
mod connection_tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn protocols() -> Arc<Protocols> {
        Arc::new(Protocols::new(&ServeOptions::default()))
    }

    fn service() -> impl HttpService<
        Incoming,
        ResBody = http_body_util::Full<bytes::Bytes>,
        Error = BoxError,
        Future: Send + 'static,
    > + Send
    + 'static {
        hyper::service::service_fn(|request: http::Request<Incoming>| async move {
            let body = format!(
                "{} {}",
                request.version() == http::Version::HTTP_2,
                request.uri().path()
            );
            Ok::<_, BoxError>(http::Response::new(http_body_util::Full::new(body.into())))
        })
    }

    #[tokio::test]
    async fn an_http1_request_is_served_and_a_graceful_shutdown_ends_the_connection() {
        let (mut client, server) = tokio::io::duplex(4096);
        let conn = protocols().serve(server, service());
        tokio::pin!(conn);
        client
            .write_all(b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = [0u8; 256];
        let n = tokio::select! {
            n = client.read(&mut answer) => n.unwrap(),
            _ = conn.as_mut() => panic!("the connection ended before answering"),
        };
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("false /ping"), "{answer}");
        conn.as_mut().graceful_shutdown();
        conn.await.unwrap();
    }

    #[tokio::test]
    async fn a_connection_that_sent_nothing_ends_at_a_graceful_shutdown() {
        let (_client, server) = tokio::io::duplex(64);
        let conn = protocols().serve(server, service());
        tokio::pin!(conn);
        let pending = std::future::poll_fn(|cx| Poll::Ready(conn.as_mut().poll(cx).is_pending()));
        assert!(pending.await, "a connection waits for its first bytes");
        conn.as_mut().graceful_shutdown();
        conn.await.unwrap();
    }
}
