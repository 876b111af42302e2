//! Data-plane capabilities (docs/recovery.md, "Who may fetch"): what a fetching agent shows a
//! serving agent's data plane instead of any credential of its own. The coordinator mints one
//! per file and serving node of each `Restore` it sends (`FetchSource.capability`: one per
//! generation could list more files than a request line holds), scoped to the job, the
//! generation that wrote the file, the step and the file name, and valid until an expiry; the
//! serving agent checks it with its own key. One place for the format, so that the two sides
//! cannot drift.
//!
//! The keys: the cluster key is 32 random bytes the coordinator generates once and keeps in its
//! database (HA coordinators share it); it never leaves the coordinators. Each node's data plane
//! gets its own key, derived from it ([`node_key`]: HMAC-SHA256 under the cluster key of
//! [`NODE_KEY_LABEL`] and the node's name), in `RegisterReply` over the authenticated session,
//! and keeps it in memory only. A capability for a file on node A is signed with A's key, so
//! root on node B, which holds only B's key, can sign only for files B already holds.
//!
//! The text: `v1.PAYLOAD.MAC`, both parts base64url without padding; `PAYLOAD` is the JSON of
//! [`Grant`], `MAC` is HMAC-SHA256 under the serving node's key of [`DOMAIN`] followed by
//! `v1.PAYLOAD`. A capability seen on the wire lets its holder read those files of that step
//! from that node until it expires, and nothing else: it is not the agent's coordinator
//! credential.
//!
//! Probe tokens (docs/network.md, "Measure (agents)"): the same text, but under the cluster's
//! probe key ([`probe_key`], derived under [`PROBE_KEY_LABEL`], which every agent holds: any
//! agent may probe any other), the MAC over [`PROBE_DOMAIN`] and the payload a [`ProbeGrant`]
//! naming the probed node. A probing agent mints its own token for each probe, valid
//! [`PROBE_EXPIRY_S`], and the probed node checks it with the same probe key. A probe token never
//! reads a file: file capabilities are checked only under a node key, which no label makes equal
//! to the probe key, and the two domains differ, so a probe token never verifies as a file
//! capability nor a file capability as a probe token even under one key. A probe token lets its
//! holder make the named node send at most one probe's bytes per connection until it expires.
//!
//! Rotation: a new cluster key (its row deleted and the coordinators restarted; docs/recovery.md)
//! gives every node a new key when it registers again. The agent accepts its previous key
//! beside the new one for [`key_grace`] (one restore timeout), so a restore in flight across
//! the change still fetches; after it only the new key signs.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// The key's length: 32 random bytes (HMAC-SHA256's block is 64; its output 32).
pub const KEY_BYTES: usize = 32;
/// Prefixed to every MAC'd text: this key signs nothing else, and no other use of HMAC-SHA256
/// under it can be replayed as a capability.
pub const DOMAIN: &[u8] = b"motley data-plane capability\0";
/// Prefixed to every MAC'd probe token: a file capability is never a probe token, nor the
/// reverse.
pub const PROBE_DOMAIN: &[u8] = b"motley data-plane probe\0";
/// Derives a node's key from the cluster key (`node_key`): a node's key signs nothing else.
pub const NODE_KEY_LABEL: &[u8] = b"motley data-plane node key\0";
/// Derives the cluster's probe key from the cluster key (`probe_key`).
pub const PROBE_KEY_LABEL: &[u8] = b"motley data-plane probe key\0";
/// How long a probe token a probing agent mints lasts: long enough for a probe and any clock
/// skew between agents of one cluster, short enough that one seen on the wire is soon worthless.
pub const PROBE_EXPIRY_S: u64 = 60;
/// The format's version, the text's first field.
const VERSION: &str = "v1";

/// What a capability allows: reading `files` of `step` written by launch `generation` of
/// `job`, until `expires_unix_s` (seconds since the Unix epoch, by the server's clock).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    pub job: i64,
    pub generation: i64,
    pub step: u64,
    pub files: Vec<String>,
    pub expires_unix_s: u64,
}

/// What a probe token allows: asking `node`'s data plane for probe bytes until `expires_unix_s`
/// (seconds since the Unix epoch, by the probed node's clock).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeGrant {
    pub node: String,
    pub expires_unix_s: u64,
}

/// Seconds since the Unix epoch now (0 if the clock is before it).
pub fn now_unix_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn mac(key: &[u8], domain: &[u8], signed: &str) -> Result<Hmac<Sha256>, String> {
    if key.len() != KEY_BYTES {
        return Err(format!(
            "the data-plane key has {} bytes, not {KEY_BYTES}; the coordinator hands each agent its keys at registration",
            key.len()
        ));
    }
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).map_err(|e| format!("data-plane key: {e}"))?;
    mac.update(domain);
    mac.update(signed.as_bytes());
    Ok(mac)
}

/// The key `node`'s data plane checks file capabilities with, and the coordinator mints them
/// for that node's files with: HMAC-SHA256 under `cluster_key` of `NODE_KEY_LABEL` and the
/// node's name (a pseudo-random function of the name, as HKDF's expand step is), so one node's
/// key tells nothing of another's or of the cluster key.
pub fn node_key(cluster_key: &[u8], node: &str) -> Result<[u8; KEY_BYTES], String> {
    if node.is_empty() {
        return Err("a node key needs the node's name (the agent's --node)".into());
    }
    Ok(mac(cluster_key, NODE_KEY_LABEL, node)?.finalize().into_bytes().into())
}

/// The key every agent mints and checks probe tokens with (`mint_probe`): HMAC-SHA256 under
/// `cluster_key` of `PROBE_KEY_LABEL`. It checks no file capability.
pub fn probe_key(cluster_key: &[u8]) -> Result<[u8; KEY_BYTES], String> {
    Ok(mac(cluster_key, PROBE_KEY_LABEL, "")?.finalize().into_bytes().into())
}

/// How long an agent accepts its previous key beside a new one: one restore timeout, as the
/// coordinator gives the shortest (`max(60 s, 10 base intervals)`, docs/recovery.md "A
/// recovery, step by step"): a restore sent under the old key fetches on, and the coordinator
/// that changed the key sends its restores again with fresh capabilities.
pub fn key_grace(base: std::time::Duration) -> std::time::Duration {
    (base * 10).max(std::time::Duration::from_secs(60))
}

/// The capability for `grant` under `key` (`KEY_BYTES` long): the serving node's key.
pub fn mint(key: &[u8], grant: &Grant) -> Result<String, String> {
    sign(key, DOMAIN, grant)
}

/// The grant of `capability` if `key` signed it and it has not expired at `now_unix_s`.
pub fn verify(key: &[u8], capability: &str, now_unix_s: u64) -> Result<Grant, String> {
    let grant: Grant = open(key, DOMAIN, capability, "fetch with the Restore's capability")?;
    unexpired("capability", grant.expires_unix_s, now_unix_s, "the coordinator issues fresh ones with each Restore")?;
    Ok(grant)
}

/// The probe token for `grant` under `key` (`KEY_BYTES` long).
pub fn mint_probe(key: &[u8], grant: &ProbeGrant) -> Result<String, String> {
    sign(key, PROBE_DOMAIN, grant)
}

/// Whether `token` lets its holder probe `node` at `now_unix_s`: signed under `key` as a probe
/// token, unexpired, naming `node`; else why not.
pub fn check_probe(key: &[u8], token: &str, now_unix_s: u64, node: &str) -> Result<ProbeGrant, String> {
    let grant: ProbeGrant = open(key, PROBE_DOMAIN, token, "probe with a token minted under the cluster's probe key")?;
    unexpired("probe token", grant.expires_unix_s, now_unix_s, "the probing agent mints a fresh one for each probe")?;
    if grant.node != node {
        return Err(format!("the probe token is for node {:?}, not {node:?}", grant.node));
    }
    Ok(grant)
}

/// `v1.PAYLOAD.MAC` of `payload` under `key` and `domain`.
fn sign<T: Serialize>(key: &[u8], domain: &[u8], payload: &T) -> Result<String, String> {
    // Serializing a struct of plain fields cannot fail.
    let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(payload).map_err(|e| e.to_string())?);
    let signed = format!("{VERSION}.{payload}");
    let tag = URL_SAFE_NO_PAD.encode(mac(key, domain, &signed)?.finalize().into_bytes());
    Ok(format!("{signed}.{tag}"))
}

/// The payload of `text` if `key` signed it under `domain`; `hint`: what to do instead.
fn open<T: serde::de::DeserializeOwned>(key: &[u8], domain: &[u8], text: &str, hint: &str) -> Result<T, String> {
    let (what, whose) = if domain == PROBE_DOMAIN { ("probe token", "key") } else { ("capability", "coordinator for this node") };
    let not_one = |why: &str| format!("the {what} is not one this cluster's {whose} issued ({why}); {hint}");
    let mut parts = text.split('.');
    let (Some(version), Some(payload), Some(tag), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(not_one("not VERSION.PAYLOAD.MAC"));
    };
    if version != VERSION {
        return Err(format!("{what} version {version:?}: this agent knows {VERSION}; run agents of one Motley version"));
    }
    let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| not_one("its MAC is not base64url"))?;
    // Constant-time comparison (hmac's `verify_slice`): a forger learns nothing from timing.
    mac(key, domain, &format!("{version}.{payload}"))?.verify_slice(&tag).map_err(|_| not_one("bad signature"))?;
    let payload = URL_SAFE_NO_PAD.decode(payload).map_err(|_| not_one("its payload is not base64url"))?;
    serde_json::from_slice(&payload).map_err(|e| not_one(&format!("payload: {e}")))
}

fn unexpired(what: &str, expires_unix_s: u64, now_unix_s: u64, hint: &str) -> Result<(), String> {
    if expires_unix_s <= now_unix_s {
        return Err(format!("the {what} expired {} s ago (at {expires_unix_s} Unix time); {hint}", now_unix_s - expires_unix_s));
    }
    Ok(())
}

/// Whether `capability` lets its holder read `file` of `step` written by launch `generation`
/// of `job` at `now_unix_s`; else why not, naming what differs.
pub fn check(key: &[u8], capability: &str, now_unix_s: u64, job: i64, generation: i64, step: u64, file: &str) -> Result<(), String> {
    let g = verify(key, capability, now_unix_s)?;
    if g.job != job {
        return Err(format!("the capability is for job {}, not job {job}", g.job));
    }
    if g.generation != generation {
        return Err(format!("the capability is for files written by generation {}, not generation {generation}", g.generation));
    }
    if g.step != step {
        return Err(format!("the capability is for step {}, not step {step}", g.step));
    }
    if !g.files.iter().any(|f| f == file) {
        return Err(format!("the capability does not list file {file:?} ({} files listed)", g.files.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; KEY_BYTES] = [7; KEY_BYTES];

    fn grant() -> Grant {
        Grant {
            job: 3,
            generation: 1,
            step: 20,
            files: vec!["manifest.json".into(), "rank.00000.safetensors".into()],
            expires_unix_s: 1000,
        }
    }

    #[test]
    fn a_minted_capability_verifies_for_exactly_its_scope() {
        let cap = mint(&KEY, &grant()).unwrap();
        assert!(cap.starts_with("v1.") && cap.split('.').count() == 3, "{cap}");
        assert_eq!(verify(&KEY, &cap, 999).unwrap(), grant());
        assert_eq!(check(&KEY, &cap, 999, 3, 1, 20, "manifest.json"), Ok(()));
        assert_eq!(check(&KEY, &cap, 0, 3, 1, 20, "rank.00000.safetensors"), Ok(()));
        let refused = |job, generation, step, file: &str| check(&KEY, &cap, 999, job, generation, step, file).unwrap_err();
        assert!(refused(4, 1, 20, "manifest.json").contains("for job 3, not job 4"));
        assert!(refused(3, 2, 20, "manifest.json").contains("generation 1, not generation 2"));
        assert!(refused(3, 1, 21, "manifest.json").contains("step 20, not step 21"));
        assert!(refused(3, 1, 20, "rank.00001.safetensors").contains("does not list file \"rank.00001.safetensors\""));
    }

    #[test]
    fn expired_forged_or_malformed_capabilities_are_refused() {
        let cap = mint(&KEY, &grant()).unwrap();
        assert!(verify(&KEY, &cap, 1000).unwrap_err().contains("expired 0 s ago"));
        assert!(verify(&KEY, &cap, 1061).unwrap_err().contains("expired 61 s ago"));
        assert!(verify(&[8; KEY_BYTES], &cap, 0).unwrap_err().contains("bad signature"));
        // Another payload under the first one's MAC: a widened grant is not signed.
        let wider = Grant { files: vec!["*".into()], expires_unix_s: u64::MAX, ..grant() };
        let forged = format!("v1.{}.{}", URL_SAFE_NO_PAD.encode(serde_json::to_vec(&wider).unwrap()), cap.rsplit('.').next().unwrap());
        assert!(verify(&KEY, &forged, 0).unwrap_err().contains("bad signature"));
        for bad in ["", "v1", "v1.a", "v1.a.b.c", "v1.%%%.AAAA", "v1.e30.!!"] {
            assert!(verify(&KEY, bad, 0).unwrap_err().contains("not one this cluster's coordinator for this node issued"), "{bad}");
        }
        assert!(verify(&KEY, &cap.replacen("v1", "v2", 1), 0).unwrap_err().contains("capability version \"v2\""));
        // A signed payload that is not a grant.
        let signed = format!("v1.{}", URL_SAFE_NO_PAD.encode(b"{\"job\":1}"));
        let tag = URL_SAFE_NO_PAD.encode(mac(&KEY, DOMAIN, &signed).unwrap().finalize().into_bytes());
        assert!(verify(&KEY, &format!("{signed}.{tag}"), 0).unwrap_err().contains("payload"));
    }

    #[test]
    fn a_probe_token_probes_only_its_node_until_it_expires() {
        let probe = ProbeGrant { node: "n1".into(), expires_unix_s: 1000 };
        let token = mint_probe(&KEY, &probe).unwrap();
        assert!(token.starts_with("v1.") && token.split('.').count() == 3, "{token}");
        assert_eq!(check_probe(&KEY, &token, 999, "n1").unwrap(), probe);
        assert!(check_probe(&KEY, &token, 999, "n2").unwrap_err().contains("for node \"n1\", not \"n2\""));
        assert!(check_probe(&KEY, &token, 1000, "n1").unwrap_err().contains("probe token expired 0 s ago"));
        assert!(check_probe(&[8; KEY_BYTES], &token, 0, "n1").unwrap_err().contains("bad signature"));
        // Another node under the first one's MAC is not signed.
        let other = ProbeGrant { node: "n2".into(), ..probe.clone() };
        let forged = format!("v1.{}.{}", URL_SAFE_NO_PAD.encode(serde_json::to_vec(&other).unwrap()), token.rsplit('.').next().unwrap());
        assert!(check_probe(&KEY, &forged, 0, "n2").unwrap_err().contains("bad signature"));
        for bad in ["", "v1.a", "v1.%%%.AAAA"] {
            assert!(check_probe(&KEY, bad, 0, "n1").unwrap_err().contains("not one this cluster's key issued"), "{bad}");
        }
    }

    #[test]
    fn a_probe_token_is_no_capability_and_a_capability_no_probe_token() {
        // The domains differ: neither verifies as the other, whatever its payload says.
        let token = mint_probe(&KEY, &ProbeGrant { node: "n1".into(), expires_unix_s: u64::MAX }).unwrap();
        assert!(verify(&KEY, &token, 0).unwrap_err().contains("bad signature"));
        let cap = mint(&KEY, &Grant { expires_unix_s: u64::MAX, ..grant() }).unwrap();
        assert!(check_probe(&KEY, &cap, 0, "n1").unwrap_err().contains("bad signature"));
        // A probe grant's payload signed under the file domain is still no probe token, and a
        // file grant's payload signed under the probe domain is no grant of files.
        let as_file = sign(&KEY, DOMAIN, &ProbeGrant { node: "n1".into(), expires_unix_s: u64::MAX }).unwrap();
        assert!(check_probe(&KEY, &as_file, 0, "n1").unwrap_err().contains("bad signature"));
        assert!(verify(&KEY, &as_file, 0).unwrap_err().contains("payload"));
        let as_probe = sign(&KEY, PROBE_DOMAIN, &Grant { expires_unix_s: u64::MAX, ..grant() }).unwrap();
        assert!(check_probe(&KEY, &as_probe, 0, "n1").unwrap_err().contains("payload"));
        assert!(verify(&KEY, &as_probe, 0).unwrap_err().contains("bad signature"));
    }

    /// Each node's key is its own: a capability minted under node A's key is refused under node
    /// B's (and under the cluster key itself), and the probe key verifies no file capability.
    #[test]
    fn a_capability_verifies_only_under_the_key_of_the_node_it_was_minted_for() {
        let (a, b, probe) = (node_key(&KEY, "a").unwrap(), node_key(&KEY, "b").unwrap(), probe_key(&KEY).unwrap());
        assert!(a != b && a != KEY && probe != a && probe != b && probe != KEY);
        // Derived, not random: the coordinator and the agent agree on it; another cluster key gives another.
        assert_eq!(node_key(&KEY, "a").unwrap(), a);
        assert_ne!(node_key(&[8; KEY_BYTES], "a").unwrap(), a);
        let cap = mint(&a, &grant()).unwrap();
        assert_eq!(check(&a, &cap, 999, 3, 1, 20, "manifest.json"), Ok(()));
        for other in [b, KEY, probe] {
            let e = check(&other, &cap, 999, 3, 1, 20, "manifest.json").unwrap_err();
            assert!(e.contains("not one this cluster's coordinator for this node issued (bad signature)"), "{e}");
        }
        // A token under the probe key, with a file grant's payload in the file domain, reads nothing.
        let under_probe_key = mint(&probe, &grant()).unwrap();
        assert!(check(&a, &under_probe_key, 999, 3, 1, 20, "manifest.json").unwrap_err().contains("bad signature"));
        let token = mint_probe(&probe, &ProbeGrant { node: "a".into(), expires_unix_s: u64::MAX }).unwrap();
        assert_eq!(check_probe(&probe, &token, 0, "a").map(|_| ()), Ok(()));
        assert!(check_probe(&a, &token, 0, "a").unwrap_err().contains("bad signature"));
        assert!(node_key(&KEY, "").unwrap_err().contains("the node's name"));
        assert!(node_key(&[1; 16], "a").unwrap_err().contains("has 16 bytes"));
    }

    #[test]
    fn the_previous_key_is_kept_for_one_restore_timeout_at_its_shortest() {
        use std::time::Duration;
        assert_eq!(key_grace(Duration::from_millis(1000)), Duration::from_secs(60));
        assert_eq!(key_grace(Duration::from_secs(30)), Duration::from_secs(300));
    }

    #[test]
    fn a_key_of_another_length_is_refused_by_name() {
        assert!(mint(&[1; 16], &grant()).unwrap_err().contains("has 16 bytes, not 32"));
        let cap = mint(&KEY, &grant()).unwrap();
        assert!(verify(&[], &cap, 0).unwrap_err().contains("has 0 bytes"));
        assert!(mint_probe(&[1; 16], &ProbeGrant { node: "n".into(), expires_unix_s: 1 }).unwrap_err().contains("has 16 bytes"));
    }
}
