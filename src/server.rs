//! The listener: HTTP/1.1 and HTTP/2 (h2c prior knowledge, or ALPN `h2` over TLS) on one port,
//! served by hyper-util's auto builder, with graceful shutdown.
//!
//! Tests own the socket: they bind `127.0.0.1:0`, read the address, and pass the listener in.
//! On shutdown the server stops accepting at once, lets open connections finish their in-flight
//! requests up to `drain`, then closes what is left.

use std::{future::Future, io, path::Path, sync::Arc, time::Duration};

use axum::Router;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

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

/// Serves `router` on `listener` until `shutdown` resolves, then drains for up to `drain`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .max_buf_size(MAX_HEADER_BYTES.max(8192))
        .keep_alive(true);
    builder
        .http2()
        .max_header_list_size(MAX_HEADER_BYTES as u32);
    let builder = Arc::new(builder);
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
        let service = TowerToHyperService::new(router.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            let result = match tls {
                None => {
                    let conn =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(tls_stream) => {
                        let conn = builder
                            .serve_connection_with_upgrades(TokioIo::new(tls_stream), service);
                        watcher.watch(conn.into_owned()).await
                    }
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                },
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection closed with error");
            }
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(drain_secs = drain.as_secs_f64(), "drain deadline passed; closing remaining connections");
        }
    }
    Ok(())
}
