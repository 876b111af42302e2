//! The capabilities a `Restore` carries (docs/recovery.md, "Who may fetch"): one per file and
//! peer it may come from, each letting the node read that file of the step from that peer's
//! data plane and nothing else, until an expiry derived from the restore's time limit. Each is
//! signed with the serving node's own key (`capability::node_key` of the cluster's data-plane
//! key, `Store::data_plane_key`, and the node's name), which that node's agent gets at
//! registration to check them: a node's key signs only for the files it serves.

use std::collections::BTreeMap;
use std::time::Duration;

use motley_proto::v1::Restore;
use motley_server::capability::{mint, node_key, Grant, KEY_BYTES};

use crate::error::{CoordinatorError, Result};

/// Added to a capability's lifetime for the nodes' clocks, which may differ from this
/// coordinator's by this much before a restore's fetches are refused as expired.
pub const CLOCK_SLACK: Duration = Duration::from_secs(60);

/// The cluster's data-plane key: it never leaves the coordinators; each node gets the key
/// derived for it (`for_node`). Its `Debug` shows nothing of it: settings are logged.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DataPlaneKey(pub [u8; KEY_BYTES]);

impl std::fmt::Debug for DataPlaneKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataPlaneKey(..)")
    }
}

impl DataPlaneKey {
    /// The key from its stored bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<DataPlaneKey> {
        let key: [u8; KEY_BYTES] = bytes
            .try_into()
            .map_err(|_| CoordinatorError::Conflict(format!("the data-plane key has {} bytes, not {KEY_BYTES}", bytes.len())))?;
        Ok(DataPlaneKey(key))
    }

    /// `node`'s own key: what its agent checks capabilities for its files with, and what they
    /// are minted with.
    pub fn for_node(&self, node: &str) -> Result<[u8; KEY_BYTES]> {
        node_key(&self.0, node).map_err(CoordinatorError::Conflict)
    }

    /// The probe key every agent mints and checks link-probe tokens with.
    pub fn for_probes(&self) -> Result<[u8; KEY_BYTES]> {
        motley_server::capability::probe_key(&self.0).map_err(CoordinatorError::Conflict)
    }
}

/// Sign every peer source of every file of `r` for the node it goes to: a capability for (job,
/// the file's source generation, step, the file) under the peer's own key, valid until
/// `now_unix_s` plus twice `r.timeout_s` (the restore runs within it, and may first wait for an
/// earlier restore of its launch) plus `CLOCK_SLACK`. Local and cloud sources carry none.
pub fn grant(r: &mut Restore, key: &DataPlaneKey, now_unix_s: u64) -> Result<()> {
    let expires_unix_s = now_unix_s + 2 * u64::from(r.timeout_s) + CLOCK_SLACK.as_secs();
    let mut keys: BTreeMap<String, [u8; KEY_BYTES]> = BTreeMap::new();
    for f in &mut r.files {
        let grant = Grant { job: r.job, generation: f.source_generation, step: r.step, files: vec![f.file.clone()], expires_unix_s };
        let sources = f.ranges.iter_mut().filter_map(|x| x.source.as_mut()).chain(f.fallbacks.iter_mut());
        for source in sources.filter(|s| s.kind == "peer") {
            let node_key = match keys.get(&source.node) {
                Some(k) => *k,
                None => {
                    let k = key.for_node(&source.node)?;
                    keys.insert(source.node.clone(), k);
                    k
                }
            };
            source.capability = mint(&node_key, &grant).map_err(CoordinatorError::Conflict)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use motley_proto::v1::{FetchRange, FetchSource, RestoreFile};
    use motley_server::capability::check;

    fn source(kind: &str, node: &str) -> FetchSource {
        FetchSource { kind: kind.into(), node: node.into(), ..Default::default() }
    }

    /// Each peer source of each file carries a capability for exactly that file, under that
    /// peer's own key: node b's data plane refuses the one minted for node a, and so does a
    /// check under the cluster key itself.
    #[test]
    fn each_peer_source_of_a_file_carries_a_capability_under_that_peers_key_for_exactly_that_file() {
        let key = DataPlaneKey([9; KEY_BYTES]);
        let range = |src: FetchSource| FetchRange { source: Some(src), ..Default::default() };
        let file = |g: i64, name: &str| RestoreFile {
            source_generation: g,
            file: name.into(),
            ranges: vec![range(source("peer", "a")), range(source("local", "")), range(source("peer", "b"))],
            fallbacks: vec![source("peer", "b"), source("peer", "c"), source("cloud", "")],
            ..Default::default()
        };
        let mut r = Restore {
            job: 4,
            generation: 3,
            step: 50,
            timeout_s: 100,
            files: vec![file(1, "manifest.json"), file(2, "rank.00000.safetensors"), file(2, "layer.00000.model.tp0-1.safetensors")],
            ..Default::default()
        };
        grant(&mut r, &key, 1_000).unwrap();
        let expires = 1_000 + 200 + CLOCK_SLACK.as_secs();
        for f in &r.files {
            let sources: Vec<&FetchSource> = f.ranges.iter().filter_map(|x| x.source.as_ref()).chain(&f.fallbacks).collect();
            assert!(sources.iter().filter(|s| s.kind != "peer").all(|s| s.capability.is_empty()), "local and cloud carry none");
            // The planned source and the same peer as a fallback carry the same capability.
            assert_eq!(f.ranges[2].source.as_ref().unwrap().capability, f.fallbacks[0].capability);
            for s in sources.iter().filter(|s| s.kind == "peer") {
                let own = key.for_node(&s.node).unwrap();
                let ok = |k: &[u8], job, g, step, name: &str, at| check(k, &s.capability, at, job, g, step, name);
                assert_eq!(ok(&own, 4, f.source_generation, 50, &f.file, expires - 1), Ok(()), "{} from {}", f.file, s.node);
                assert!(ok(&own, 4, f.source_generation, 50, &f.file, expires).unwrap_err().contains("expired"));
                assert!(ok(&own, 5, f.source_generation, 50, &f.file, 1_000).unwrap_err().contains("not job 5"));
                assert!(ok(&own, 4, 3 - f.source_generation, 50, &f.file, 1_000).unwrap_err().contains("generation"));
                assert!(ok(&own, 4, f.source_generation, 49, &f.file, 1_000).unwrap_err().contains("not step 49"));
                for other in r.files.iter().filter(|o| o.file != f.file) {
                    assert!(ok(&own, 4, f.source_generation, 50, &other.file, 1_000).unwrap_err().contains("does not list file"));
                }
                // No other node's key, nor the cluster key, nor the probe key takes it.
                let others = ["a", "b", "c"].into_iter().filter(|n| *n != s.node).map(|n| key.for_node(n).unwrap());
                for k in others.chain([key.0, key.for_probes().unwrap()]) {
                    assert!(ok(&k, 4, f.source_generation, 50, &f.file, 1_000).unwrap_err().contains("bad signature"));
                }
            }
        }
        assert!(format!("{key:?}") == "DataPlaneKey(..)");
        assert!(DataPlaneKey::from_slice(&[1; 16]).unwrap_err().to_string().contains("16 bytes, not 32"));
    }
}
