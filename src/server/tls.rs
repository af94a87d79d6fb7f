//! TLS for the listener: a rustls acceptor offering `h2` and `http/1.1` by ALPN.

use std::{path::Path, sync::Arc};

use tokio_rustls::TlsAcceptor;

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
