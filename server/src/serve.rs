//! HTTPS for Motley's HTTP services, one implementation for the coordinator's REST API and the
//! agent's log service: a certificate chain and key (PEM files, `--tls-cert`/`--tls-key`)
//! read and checked at start-up (a bad certificate is a start-up error, not a failed handshake
//! later), and a serving loop with rustls (ring provider) in front of an axum router.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

use crate::error::ServerError;

fn tls_error(flag: &'static str, message: impl Into<String>) -> ServerError {
    ServerError::Tls { flag, message: message.into() }
}

/// The certificate chain and key, as given.
#[derive(Clone, Debug, PartialEq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// Both files or neither: one alone is a mistake worth naming.
    pub fn from_flags(cert: Option<PathBuf>, key: Option<PathBuf>) -> Result<Option<TlsFiles>, ServerError> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key })),
            (None, None) => Ok(None),
            (Some(_), None) => Err(tls_error("--tls-key", "--tls-cert needs its private key (PEM) too; give both or neither")),
            (None, Some(_)) => Err(tls_error("--tls-cert", "--tls-key needs its certificate chain (PEM) too; give both or neither")),
        }
    }

    fn read(path: &Path, flag: &'static str) -> Result<Vec<u8>, ServerError> {
        std::fs::read(path).map_err(|e| tls_error(flag, format!("cannot read {}: {e}", path.display())))
    }

    /// The PEM texts (tonic's `Identity` takes them).
    pub fn pem(&self) -> Result<(Vec<u8>, Vec<u8>), ServerError> {
        Ok((Self::read(&self.cert, "--tls-cert")?, Self::read(&self.key, "--tls-key")?))
    }

    /// A rustls server configuration (HTTP/1.1 and HTTP/2 offered by ALPN).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, ServerError> {
        let (cert, key) = self.pem()?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<_, _>>()
            .map_err(|e| tls_error("--tls-cert", format!("{}: not a PEM certificate chain: {e}", self.cert.display())))?;
        if chain.is_empty() {
            return Err(tls_error("--tls-cert", format!("{}: no certificate in it", self.cert.display())));
        }
        let key = PrivateKeyDer::from_pem_slice(&key)
            .map_err(|e| tls_error("--tls-key", format!("{}: not a PEM private key: {e}", self.key.display())))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("--tls-cert", e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| tls_error("--tls-key", format!("does not match --tls-cert: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Serve the router over TLS until the process stops. A failed handshake ends only its own
/// connection; `what` names the service in the logs.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    config: Arc<ServerConfig>,
    what: &'static str,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            // Out of file descriptors, say: wait and go on rather than stop serving.
            Err(e) => {
                tracing::warn!("{what}: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            // A client that never finishes its handshake does not hold a task forever.
            let tls = match tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return tracing::debug!(%peer, "{what}: TLS handshake failed: {e}"),
                Err(_) => return tracing::debug!(%peer, "{what}: TLS handshake timed out"),
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            let builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            if let Err(e) = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), service).await {
                tracing::debug!(%peer, "{what}: connection: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_files_or_neither_and_the_error_names_the_missing_one() {
        assert_eq!(TlsFiles::from_flags(None, None).unwrap(), None);
        let (c, k) = (PathBuf::from("c.pem"), PathBuf::from("k.pem"));
        assert_eq!(TlsFiles::from_flags(Some(c.clone()), Some(k.clone())).unwrap(), Some(TlsFiles { cert: c.clone(), key: k.clone() }));
        let e = TlsFiles::from_flags(Some(c), None).unwrap_err();
        assert!(matches!(e, ServerError::Tls { flag: "--tls-key", .. }), "{e:?}");
        assert!(e.to_string().starts_with("--tls-key: --tls-cert needs its private key"), "{e}");
        let e = TlsFiles::from_flags(None, Some(k)).unwrap_err();
        assert!(matches!(e, ServerError::Tls { flag: "--tls-cert", .. }), "{e:?}");
        assert!(e.to_string().starts_with("--tls-cert: --tls-key needs its certificate chain"), "{e}");
    }

    #[test]
    fn unreadable_or_wrong_files_name_the_flag() {
        let files = TlsFiles { cert: "/nonexistent/cert.pem".into(), key: "/nonexistent/key.pem".into() };
        let e = files.server_config().unwrap_err().to_string();
        assert!(e.starts_with("--tls-cert: cannot read /nonexistent/cert.pem"), "{e}");
        let dir = std::env::temp_dir().join(format!("motley-serve-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("empty.pem"), "not pem\n").unwrap();
        let files = TlsFiles { cert: dir.join("empty.pem"), key: dir.join("empty.pem") };
        let e = files.server_config().unwrap_err().to_string();
        assert!(e.starts_with("--tls-cert:") && e.contains("no certificate in it"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
