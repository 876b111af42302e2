//! Who may use the data plane, and over what (docs/recovery.md, "Who may fetch"): this node's
//! own data-plane key it checks capabilities with, the cluster's probe key, how many
//! connections one peer may hold, and TLS on both ends wherever the agent has a certificate.
//! Below `server`, `client` and `probe`; calls `limits`, `pace` and `protocol`.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use motley_server::capability::{self, KEY_BYTES};
use motley_server::ServerError;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

use super::limits::{MAX_CONNECTIONS, MAX_PER_SOURCE, REQUEST_TIMEOUT};
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

/// What a registration gives this agent's data plane (`RegisterReply`).
#[derive(Clone, Copy, Debug)]
pub struct Issued<'a> {
    /// This node's own key (`capability::node_key` of the cluster key and this node's name): it
    /// checks the capabilities peers show for this node's files.
    pub node_key: &'a [u8],
    /// The cluster's probe key (`capability::probe_key`): this agent mints its probe tokens with
    /// it and checks the tokens of peers probing it.
    pub probe_key: &'a [u8],
    /// The coordinator's base interval, every timeout's unit: a connection's request deadline
    /// (`request_deadline`) and the old key's grace (`capability::key_grace`) derive from it.
    pub base: Duration,
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Keys {
    node: [u8; KEY_BYTES],
    probe: [u8; KEY_BYTES],
}

#[derive(Default)]
struct Held {
    current: Option<Keys>,
    /// The keys before the last change, accepted until the instant beside the new ones.
    previous: Option<(Keys, Instant)>,
    base: Option<Duration>,
}

/// This agent's data-plane keys: in memory only, from its coordinator's `RegisterReply`; none
/// until the first registration, and then every request is refused. When a registration
/// brings other keys (the cluster key changed), the previous ones are accepted beside them for
/// `capability::key_grace` (one restore timeout), then forgotten.
#[derive(Clone, Default)]
pub struct DataKey(Arc<RwLock<Held>>);

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.read().map(|k| k.current.is_some()).unwrap_or(false);
        write!(f, "DataKey({})", if set { "set" } else { "none" })
    }
}

const NO_KEY_YET: &str = "this agent has no data-plane key yet (it gets one when it registers with its coordinator)";

/// The request deadline before any registration said the base interval (every request is
/// refused then anyway): the coordinator's default base of one second.
const DEFAULT_BASE: Duration = Duration::from_secs(1);

impl DataKey {
    /// Take the keys the coordinator sent; keys of another length are refused (and the old
    /// ones, if any, kept).
    pub fn set(&self, issued: Issued<'_>) -> Result<(), String> {
        let length = |what: &str, key: &[u8]| -> Result<[u8; KEY_BYTES], String> {
            key.try_into().map_err(|_| {
                format!(
                    "the coordinator sent a data-plane {what} of {} bytes, not {KEY_BYTES}; run a coordinator of this agent's version",
                    key.len()
                )
            })
        };
        let keys = Keys { node: length("key", issued.node_key)?, probe: length("probe key", issued.probe_key)? };
        let now = Instant::now();
        let mut held = self.0.write().expect("data-plane key lock");
        held.base = Some(issued.base);
        match held.current {
            Some(old) if old != keys => {
                held.previous = Some((old, now + capability::key_grace(issued.base)));
                tracing::info!(
                    "the data-plane keys changed; the previous ones are accepted beside them for {:?}",
                    capability::key_grace(issued.base)
                );
            }
            _ => {}
        }
        held.current = Some(keys);
        Ok(())
    }

    /// The keys to check with now: the current ones, then the previous ones within their grace.
    fn keys(&self) -> Result<Vec<Keys>, String> {
        let held = self.0.read().expect("data-plane key lock");
        let current = held.current.ok_or_else(|| NO_KEY_YET.to_string())?;
        let previous = held.previous.filter(|(_, until)| Instant::now() < *until).map(|(k, _)| k);
        Ok(std::iter::once(current).chain(previous).collect())
    }

    /// How long a new connection may take for its TLS handshake and request line: two base
    /// intervals, within 1 to 10 s (`limits::REQUEST_TIMEOUT`). A client sends its line as soon
    /// as it is connected, so a connection that has said nothing by then holds its slot for
    /// nothing.
    pub fn request_deadline(&self) -> Duration {
        let base = self.0.read().expect("data-plane key lock").base.unwrap_or(DEFAULT_BASE);
        (base * 2).clamp(Duration::from_secs(1), REQUEST_TIMEOUT)
    }

    /// A probe token for `node`'s data plane, valid `capability::PROBE_EXPIRY_S` from now
    /// (`dataplane::probe`), under the cluster's probe key; none before the first registration.
    pub fn mint_probe(&self, node: &str) -> Result<String, String> {
        let keys = self.keys()?;
        let grant =
            capability::ProbeGrant { node: node.to_string(), expires_unix_s: capability::now_unix_s() + capability::PROBE_EXPIRY_S };
        capability::mint_probe(&keys[0].probe, &grant)
    }

    /// Whether `token` lets its holder probe `node` (this agent's node) now; else why not.
    pub fn check_probe(&self, token: Option<&str>, node: &str) -> Result<(), String> {
        let keys = self.keys()?;
        let Some(token) = token.filter(|c| !c.is_empty()) else {
            return Err("no probe token: a probe shows one minted under the cluster's probe key".into());
        };
        first_ok(keys.iter().map(|k| capability::check_probe(&k.probe, token, capability::now_unix_s(), node).map(|_| ())))
    }

    /// Whether `capability` lets its holder read `key` from this node now; else why not.
    pub fn check(&self, capability: Option<&str>, key: &FileKey) -> Result<(), String> {
        let keys = self.keys().map_err(|e| format!("{e}; fetch from another holder"))?;
        let Some(capability) = capability.filter(|c| !c.is_empty()) else {
            return Err("no capability: a fetch shows the capability its Restore carries for the file and this holder \
                        (FetchSource.capability)"
                .into());
        };
        let now = capability::now_unix_s();
        first_ok(keys.iter().map(|k| capability::check(&k.node, capability, now, key.job, key.generation, key.step, &key.file)))
    }
}

/// The first success, else the first error (the current key's: what a fresh capability would
/// be refused for).
fn first_ok(results: impl Iterator<Item = Result<(), String>>) -> Result<(), String> {
    let mut first = None;
    for r in results {
        match r {
            Ok(()) => return Ok(()),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    Err(first.unwrap_or_else(|| NO_KEY_YET.to_string()))
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
        let bad = |message: String| AgentError::Tls(ServerError::Tls { flag: "--ca-cert", message });
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
    /// Connections one source address may hold at once (`limits::MAX_PER_SOURCE`); one more
    /// from it is closed at once, so no one peer holds every slot.
    pub max_per_source: usize,
    /// This agent's node: a probe's token must name it. `None`: probes are refused.
    pub node: Option<String>,
    /// Paces the probe bytes this server sends (tests, emulated links); `None`: unpaced. Probes
    /// measure the link, so the node's checkpoint egress pacer does not pace them.
    pub probe_pacer: Option<Arc<super::pace::Pacer>>,
}

impl Access {
    pub fn new(key: DataKey, tls: Option<Arc<ServerConfig>>) -> Access {
        Access { key, tls, max_connections: MAX_CONNECTIONS, max_per_source: MAX_PER_SOURCE, node: None, probe_pacer: None }
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

    const CLUSTER: [u8; KEY_BYTES] = [1; KEY_BYTES];
    const BASE: Duration = Duration::from_secs(1);

    /// Keys as the coordinator issues them to `node` under `cluster`.
    fn issue(data: &DataKey, cluster: &[u8], node: &str, base: Duration) -> Result<(), String> {
        let (node_key, probe_key) = (capability::node_key(cluster, node)?, capability::probe_key(cluster)?);
        data.set(Issued { node_key: &node_key, probe_key: &probe_key, base })
    }

    fn grant_of(key: &FileKey) -> capability::Grant {
        capability::Grant {
            job: key.job,
            generation: key.generation,
            step: key.step,
            files: vec![key.file.clone()],
            expires_unix_s: u64::MAX,
        }
    }

    #[test]
    fn without_a_key_or_a_capability_everything_is_refused() {
        let key = FileKey { job: 1, generation: 2, step: 3, file: "manifest.json".into() };
        let data = DataKey::default();
        assert!(data.check(Some("v1.a.b"), &key).unwrap_err().contains("no data-plane key yet"));
        assert!(data.mint_probe("n1").unwrap_err().contains("no data-plane key yet"));
        let bad = data.set(Issued { node_key: &[1; 16], probe_key: &[1; KEY_BYTES], base: BASE }).unwrap_err();
        assert!(bad.contains("key of 16 bytes, not 32"), "{bad}");
        let bad = data.set(Issued { node_key: &[1; KEY_BYTES], probe_key: &[], base: BASE }).unwrap_err();
        assert!(bad.contains("probe key of 0 bytes"), "{bad}");
        assert!(format!("{data:?}").contains("none"));
        issue(&data, &CLUSTER, "n1", BASE).unwrap();
        assert!(format!("{data:?}").contains("set") && !format!("{data:?}").contains('1'));
        for none in [None, Some("")] {
            assert!(data.check(none, &key).unwrap_err().contains("no capability"));
        }
        let cap = capability::mint(&capability::node_key(&CLUSTER, "n1").unwrap(), &grant_of(&key)).unwrap();
        assert_eq!(data.check(Some(&cap), &key), Ok(()));
        assert!(data.check(Some(&cap), &FileKey { job: 9, ..key }).unwrap_err().contains("not job 9"));
    }

    /// A node checks file capabilities with its own key only: one minted for another node's
    /// files, or under the cluster key itself, or under the probe key, is refused; probe tokens
    /// go under the cluster's probe key, which every node holds.
    #[test]
    fn a_node_accepts_capabilities_under_its_own_key_only_and_probe_tokens_under_the_probe_key() {
        let key = FileKey { job: 1, generation: 2, step: 3, file: "manifest.json".into() };
        let (a, b) = (DataKey::default(), DataKey::default());
        issue(&a, &CLUSTER, "a", BASE).unwrap();
        issue(&b, &CLUSTER, "b", BASE).unwrap();
        let for_a = capability::mint(&capability::node_key(&CLUSTER, "a").unwrap(), &grant_of(&key)).unwrap();
        assert_eq!(a.check(Some(&for_a), &key), Ok(()));
        let e = b.check(Some(&for_a), &key).unwrap_err();
        assert!(e.contains("not one this cluster's coordinator for this node issued (bad signature)"), "{e}");
        for other in [CLUSTER, capability::probe_key(&CLUSTER).unwrap()] {
            let cap = capability::mint(&other, &grant_of(&key)).unwrap();
            assert!(a.check(Some(&cap), &key).unwrap_err().contains("bad signature"));
        }
        // Node a probes node b with a token it minted; the token reads no file on b.
        let token = a.mint_probe("b").unwrap();
        assert_eq!(b.check_probe(Some(&token), "b"), Ok(()));
        assert!(b.check(Some(&token), &key).unwrap_err().contains("bad signature"));
    }

    /// When a registration brings new keys (the cluster key changed), the previous ones are
    /// accepted beside them for one restore timeout, then refused; the same keys again change
    /// nothing.
    #[tokio::test(start_paused = true)]
    async fn the_previous_keys_are_accepted_beside_new_ones_for_one_restore_timeout() {
        let key = FileKey { job: 1, generation: 2, step: 3, file: "manifest.json".into() };
        let data = DataKey::default();
        let base = Duration::from_secs(30);
        issue(&data, &CLUSTER, "n1", base).unwrap();
        let old = capability::mint(&capability::node_key(&CLUSTER, "n1").unwrap(), &grant_of(&key)).unwrap();
        let old_probe = data.mint_probe("n1").unwrap();
        let rotated = [2; KEY_BYTES];
        issue(&data, &rotated, "n1", base).unwrap();
        let new = capability::mint(&capability::node_key(&rotated, "n1").unwrap(), &grant_of(&key)).unwrap();
        let grace = capability::key_grace(base);
        assert_eq!(grace, Duration::from_secs(300));
        // Within the grace both generations, capabilities and probe tokens alike.
        tokio::time::advance(grace - Duration::from_secs(1)).await;
        assert_eq!((data.check(Some(&old), &key), data.check(Some(&new), &key)), (Ok(()), Ok(())));
        assert_eq!(data.check_probe(Some(&old_probe), "n1"), Ok(()));
        // Registering again with the same keys neither drops the old ones nor extends their grace.
        issue(&data, &rotated, "n1", base).unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(data.check(Some(&old), &key).unwrap_err().contains("bad signature"), "past the grace");
        assert!(data.check_probe(Some(&old_probe), "n1").unwrap_err().contains("bad signature"));
        assert_eq!(data.check(Some(&new), &key), Ok(()));
        assert_eq!(data.check_probe(Some(&data.mint_probe("n1").unwrap()), "n1"), Ok(()));
    }

    #[test]
    fn a_connection_has_two_base_intervals_for_its_request_within_1_to_10_s() {
        let data = DataKey::default();
        assert_eq!(data.request_deadline(), Duration::from_secs(2), "the default base before a registration");
        for (base_ms, want_ms) in [(100, 1000), (1000, 2000), (3000, 6000), (60_000, 10_000)] {
            issue(&data, &CLUSTER, "n1", Duration::from_millis(base_ms)).unwrap();
            assert_eq!(data.request_deadline(), Duration::from_millis(want_ms), "base {base_ms} ms");
        }
    }

    #[test]
    fn a_ca_file_without_a_certificate_names_the_flag() {
        let err = ClientTls::new(Some(b"not pem\n")).unwrap_err().to_string();
        assert!(err.starts_with("--ca-cert:") && err.contains("no certificate"), "{err}");
    }
}
