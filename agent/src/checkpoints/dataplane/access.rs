//! Who may use the data plane, and over what (docs/recovery.md, "Who may fetch"): the
//! cluster's data-plane key this agent checks capabilities with, and TLS on both ends wherever
//! the agent has a certificate.

use std::sync::{Arc, RwLock};

use motley_contract::capability::{self, KEY_BYTES};
use motley_contract::serve::TlsError;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

use super::protocol::FileKey;
use crate::error::AgentError;

/// The data plane's TLS application protocol: an HTTPS client that reaches the port by mistake
/// is refused in the handshake, and a data-plane client never talks to another TLS service.
pub const ALPN: &[u8] = b"motley-data/1";
/// The scheme a data plane served over TLS has in its `data_url`: `tls://HOST:PORT`.
pub const TLS_SCHEME: &str = "tls://";

/// A connection of the data plane, plain TCP or TLS over it.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// The cluster's data-plane key as this agent holds it: in memory only, from its coordinator's
/// `RegisterReply`; none until the first registration, and then every request is refused.
#[derive(Clone, Default)]
pub struct DataKey(Arc<RwLock<Option<[u8; KEY_BYTES]>>>);

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.read().map(|k| k.is_some()).unwrap_or(false);
        write!(f, "DataKey({})", if set { "set" } else { "none" })
    }
}

impl DataKey {
    /// Take the key the coordinator sent; one of another length is refused (and the old one, if
    /// any, kept).
    pub fn set(&self, key: &[u8]) -> Result<(), String> {
        let key: [u8; KEY_BYTES] = key.try_into().map_err(|_| {
            format!(
                "the coordinator sent a data-plane key of {} bytes, not {KEY_BYTES}; run a coordinator of this agent's version",
                key.len()
            )
        })?;
        *self.0.write().expect("data-plane key lock") = Some(key);
        Ok(())
    }

    /// A probe token for `node`'s data plane, valid `capability::PROBE_EXPIRY_S` from now
    /// (`dataplane::probe`); none before the first registration.
    pub fn mint_probe(&self, node: &str) -> Result<String, String> {
        let Some(secret) = *self.0.read().expect("data-plane key lock") else {
            return Err("this agent has no data-plane key yet (it gets one when it registers with its coordinator)".into());
        };
        let grant =
            capability::ProbeGrant { node: node.to_string(), expires_unix_s: capability::now_unix_s() + capability::PROBE_EXPIRY_S };
        capability::mint_probe(&secret, &grant)
    }

    /// Whether `token` lets its holder probe `node` (this agent's node) now; else why not.
    pub fn check_probe(&self, token: Option<&str>, node: &str) -> Result<(), String> {
        let Some(secret) = *self.0.read().expect("data-plane key lock") else {
            return Err("this agent has no data-plane key yet (it gets one when it registers with its coordinator)".into());
        };
        let Some(token) = token.filter(|c| !c.is_empty()) else {
            return Err("no probe token: a probe shows one minted under the cluster's data-plane key".into());
        };
        capability::check_probe(&secret, token, capability::now_unix_s(), node).map(|_| ())
    }

    /// Whether `capability` lets its holder read `key` now; else why not.
    pub fn check(&self, capability: Option<&str>, key: &FileKey) -> Result<(), String> {
        let Some(secret) = *self.0.read().expect("data-plane key lock") else {
            return Err("this agent has no data-plane key yet (it gets one when it registers with its coordinator); \
                        fetch from another holder"
                .into());
        };
        let Some(capability) = capability.filter(|c| !c.is_empty()) else {
            return Err("no capability: a fetch shows the capability its Restore carries for the file (RestoreFile.capability)".into());
        };
        capability::check(&secret, capability, capability::now_unix_s(), key.job, key.generation, key.step, &key.file)
    }
}

/// The agent's server configuration (`--tls-cert`/`--tls-key`) speaking the data plane's ALPN.
pub fn server_config(config: &ServerConfig) -> Arc<ServerConfig> {
    let mut config = config.clone();
    config.alpn_protocols = vec![ALPN.to_vec()];
    Arc::new(config)
}

/// The fetching side's TLS: peers' certificates checked against a CA (the agent's
/// `--ca-cert`, the one it checks its coordinator with) or the system's roots.
#[derive(Clone)]
pub struct ClientTls {
    connector: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls")
    }
}

impl ClientTls {
    /// `ca_pem`: the CA certificate(s), PEM; `None`: the system's roots.
    pub fn new(ca_pem: Option<&[u8]>) -> Result<ClientTls, AgentError> {
        let bad = |message: String| AgentError::Tls(TlsError { flag: "--ca-cert", message });
        let mut roots = RootCertStore::empty();
        match ca_pem {
            Some(pem) => {
                let certs: Vec<CertificateDer<'static>> =
                    CertificateDer::pem_slice_iter(pem).collect::<Result<_, _>>().map_err(|e| bad(format!("not PEM: {e}")))?;
                if certs.is_empty() {
                    return Err(bad("no certificate in it; give the CA that signed the agents' --tls-cert".into()));
                }
                for cert in certs {
                    roots.add(cert).map_err(|e| bad(format!("not a CA certificate: {e}")))?;
                }
            }
            None => {
                for cert in rustls_native_certs::load_native_certs().certs {
                    // A system root rustls cannot use is skipped, as tonic's native roots do.
                    let _ = roots.add(cert);
                }
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(ClientTls { connector: tokio_rustls::TlsConnector::from(Arc::new(config)) })
    }

    /// TLS over `tcp` to the data plane at `host` (its certificate must name it).
    pub(super) async fn connect(&self, host: &str, tcp: tokio::net::TcpStream) -> Result<Box<dyn Stream>, String> {
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(name.to_string()).map_err(|e| format!("{host} is not a host name or address: {e}"))?;
        match self.connector.connect(name, tcp).await {
            Ok(tls) => Ok(Box::new(tls)),
            Err(e) => {
                Err(format!("TLS handshake failed: {e}; is the peer's certificate signed by the CA of --ca-cert and made for {host}?"))
            }
        }
    }
}

/// What the serving side needs: the key it checks capabilities with, TLS where the agent has
/// it, how many connections it serves at once, and whom probes must name.
#[derive(Clone, Debug)]
pub struct Access {
    pub key: DataKey,
    /// `Some`: only TLS is served (a plain-TCP client fails the handshake).
    pub tls: Option<Arc<ServerConfig>>,
    /// Connections served at once; more wait, unread, in the listen queue.
    pub max_connections: usize,
    /// This agent's node: a probe's token must name it. `None`: probes are refused.
    pub node: Option<String>,
    /// Paces the probe bytes this server sends (tests, emulated links); `None`: unpaced. Probes
    /// measure the link, so the node's checkpoint egress pacer does not pace them.
    pub probe_pacer: Option<Arc<super::pace::Pacer>>,
}

impl Access {
    pub fn new(key: DataKey, tls: Option<Arc<ServerConfig>>) -> Access {
        Access { key, tls, max_connections: super::server::MAX_CONNECTIONS, node: None, probe_pacer: None }
    }

    /// Serve probes whose token names `node`.
    pub fn with_node(mut self, node: &str) -> Access {
        self.node = Some(node.to_string());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_key_or_a_capability_everything_is_refused() {
        let key = FileKey { job: 1, generation: 2, step: 3, file: "manifest.json".into() };
        let data = DataKey::default();
        assert!(data.check(Some("v1.a.b"), &key).unwrap_err().contains("no data-plane key yet"));
        assert!(data.set(&[1; 16]).unwrap_err().contains("16 bytes, not 32"));
        assert!(format!("{data:?}").contains("none"));
        data.set(&[1; KEY_BYTES]).unwrap();
        assert!(format!("{data:?}").contains("set") && !format!("{data:?}").contains('1'));
        for none in [None, Some("")] {
            assert!(data.check(none, &key).unwrap_err().contains("no capability"));
        }
        let grant = capability::Grant { job: 1, generation: 2, step: 3, files: vec!["manifest.json".into()], expires_unix_s: u64::MAX };
        let cap = capability::mint(&[1; KEY_BYTES], &grant).unwrap();
        assert_eq!(data.check(Some(&cap), &key), Ok(()));
        assert!(data.check(Some(&cap), &FileKey { job: 9, ..key }).unwrap_err().contains("not job 9"));
    }

    #[test]
    fn a_ca_file_without_a_certificate_names_the_flag() {
        let err = ClientTls::new(Some(b"not pem\n")).unwrap_err().to_string();
        assert!(err.starts_with("--ca-cert:") && err.contains("no certificate"), "{err}");
    }
}
