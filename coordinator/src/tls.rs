//! TLS for both APIs when the coordinator is given a certificate and its key (PEM files):
//! gRPC through tonic's rustls support, REST through the same rustls (ring provider) in front
//! of the axum router.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

use crate::error::{CoordinatorError, Result};

/// The certificate chain and key, as given on the command line.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// Both files or neither: one alone is a mistake worth naming.
    pub fn from_flags(cert: Option<PathBuf>, key: Option<PathBuf>) -> Result<Option<TlsFiles>> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key })),
            (None, None) => Ok(None),
            (Some(_), None) => Err(CoordinatorError::invalid("--tls-key", "--tls-cert needs its private key (PEM) too")),
            (None, Some(_)) => Err(CoordinatorError::invalid("--tls-cert", "--tls-key needs its certificate chain (PEM) too")),
        }
    }

    fn read(path: &Path, flag: &str) -> Result<Vec<u8>> {
        std::fs::read(path).map_err(|e| CoordinatorError::invalid(flag, format!("cannot read {}: {e}", path.display())))
    }

    /// The PEM texts, for tonic's `Identity`.
    pub fn pem(&self) -> Result<(Vec<u8>, Vec<u8>)> {
        Ok((Self::read(&self.cert, "--tls-cert")?, Self::read(&self.key, "--tls-key")?))
    }

    /// A rustls server configuration (HTTP/1.1 and HTTP/2 offered by ALPN).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>> {
        let (cert, key) = self.pem()?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| CoordinatorError::invalid("--tls-cert", format!("{}: not a PEM certificate chain: {e}", self.cert.display())))?;
        if chain.is_empty() {
            return Err(CoordinatorError::invalid("--tls-cert", format!("{}: no certificate in it", self.cert.display())));
        }
        let key = PrivateKeyDer::from_pem_slice(&key)
            .map_err(|e| CoordinatorError::invalid("--tls-key", format!("{}: not a PEM private key: {e}", self.key.display())))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| CoordinatorError::invalid("--tls-cert", e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| CoordinatorError::invalid("--tls-key", format!("does not match --tls-cert: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Serve the router over TLS until the process stops. A failed handshake ends only its own
/// connection.
pub async fn serve_rest(listener: tokio::net::TcpListener, app: axum::Router, config: Arc<ServerConfig>) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            // Out of file descriptors, say: wait and go on rather than stop serving.
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            // A client that never finishes its handshake does not hold a task forever.
            let tls = match tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, "TLS handshake failed: {e}");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            let builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            if let Err(e) = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), service).await {
                tracing::debug!(%peer, "connection: {e}");
            }
        });
    }
}
