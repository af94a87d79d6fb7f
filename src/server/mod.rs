//! The listener: HTTP/1.1 and HTTP/2 (h2c prior knowledge, or ALPN `h2` over TLS) on one port,
//! served by hyper-util's auto builder, with graceful shutdown.
//!
//! Tests own the socket: they bind `127.0.0.1:0`, read the address, and pass the listener in.
//!
//! # Slow and idle clients
//! A connection must send its first byte (or finish its TLS handshake) and every request head
//! within `header_read_timeout`; an HTTP/1.1 keep-alive connection idle that long is closed.
//! Request bodies are bounded where they are read ([`crate::proxy`]).
//!
//! # Shutdown
//! The server stops accepting at once and lets open connections finish their in-flight requests
//! up to `drain`. At that deadline it cancels [`ServeOptions::deadline`]: every response still in
//! flight ends (a stream with an exception frame), settles, and gets a moment to flush; then
//! whatever is left is closed.

use std::{future::Future, io, path::Path, sync::Arc, time::Duration};

use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Largest request head (request line and headers) accepted; larger answers 431.
const MAX_HEADER_BYTES: usize = 64 * 1024;

/// Builds a TLS acceptor offering `h2` and `http/1.1` from PEM certificate chain and key files.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError(format!("server.tls_cert {}: {e}", cert.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!(
            "server.tls_cert {}: no certificate found",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| TlsError(format!("server.tls_key {}: {e}", key.display())))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError(format!("server.tls_cert/tls_key: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The TLS certificate or key could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("TLS: {0}")]
pub struct TlsError(String);

/// How the server treats slow clients, and how it shuts down.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// How long a connection may take to send its first byte (or finish its TLS handshake), and
    /// each request head; an idle HTTP/1.1 keep-alive connection is closed after it too.
    pub header_read_timeout: Duration,
    /// Once shutdown starts, how long in-flight requests and streams may finish.
    pub drain: Duration,
    /// Cancelled when the drain deadline passes: responses still in flight end at once (a stream
    /// with an exception frame, see [`crate::upstream::body`]) and settle.
    pub deadline: CancellationToken,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            header_read_timeout: Duration::from_secs(30),
            drain: Duration::from_secs(30),
            deadline: CancellationToken::new(),
        }
    }
}

/// After the drain deadline, how long responses that were told to end may take to flush theirs.
const FLUSH_AFTER_DEADLINE: Duration = Duration::from_secs(2);

/// Serves `service` on `listener` until `shutdown` resolves, then drains (see [`ServeOptions`]).
///
/// A service error closes its connection without an answer (the simulator uses this to play a
/// connection reset); the proxy's router never fails.
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send,
    options: ServeOptions,
) -> io::Result<()>
where
    S: tower::Service<http::Request<Incoming>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .max_buf_size(MAX_HEADER_BYTES.max(8192))
        .keep_alive(true)
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    builder
        .http2()
        .max_header_list_size(MAX_HEADER_BYTES as u32);
    let builder = Arc::new(builder);
    let first_byte = options.header_read_timeout;
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(service.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            // hyper's header timeout starts once it knows the protocol, which takes a first byte
            // (or a TLS handshake): a client that connects and says nothing is closed here.
            let result = match tls {
                None => {
                    match tokio::time::timeout(first_byte, stream.peek(&mut [0u8; 1])).await {
                        Ok(Ok(n)) if n > 0 => {}
                        Ok(_) => return,
                        Err(_) => {
                            tracing::debug!(%peer, "no request within the header read timeout; closing");
                            return;
                        }
                    }
                    let conn =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => {
                    match tokio::time::timeout(first_byte, acceptor.accept(stream)).await {
                        Ok(Ok(tls_stream)) => {
                            let conn = builder
                                .serve_connection_with_upgrades(TokioIo::new(tls_stream), service);
                            watcher.watch(conn.into_owned()).await
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake not done within the header read timeout");
                            return;
                        }
                    }
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection closed with error");
            }
        });
    }
    drop(listener);
    let drained = graceful.shutdown();
    tokio::pin!(drained);
    tokio::select! {
        () = &mut drained => {}
        () = tokio::time::sleep(options.drain) => {
            tracing::warn!(drain_secs = options.drain.as_secs_f64(), "drain deadline passed; ending the responses still in flight");
            options.deadline.cancel();
            if tokio::time::timeout(FLUSH_AFTER_DEADLINE, &mut drained).await.is_err() {
                tracing::warn!("connections still open after the drain deadline; closing them");
            }
        }
    }
    Ok(())
}
