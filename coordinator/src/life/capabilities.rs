//! The capabilities a `Restore` carries (docs/recovery.md, "Who may fetch"): one per file, each
//! letting the node read that file of the step from any peer's data plane and nothing else,
//! until an expiry derived from the restore's time limit. Signed with the cluster's data-plane
//! key (`Store::data_plane_key`), which agents get at registration to check them.

use std::time::Duration;

use motley_contract::capability::{mint, Grant, KEY_BYTES};
use motley_proto::v1::Restore;

use crate::error::{CoordinatorError, Result};

/// Added to a capability's lifetime for the nodes' clocks, which may differ from this
/// coordinator's by this much before a restore's fetches are refused as expired.
pub const CLOCK_SLACK: Duration = Duration::from_secs(60);

/// The cluster's data-plane key. Its `Debug` shows nothing of it: settings are logged.
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
}

/// Sign every file of `r` for the node it goes to: a capability for (job, the file's source
/// generation, step, the file), valid until `now_unix_s` plus twice `r.timeout_s` (the restore
/// runs within it, and may first wait for an earlier restore of its launch) plus `CLOCK_SLACK`.
pub fn grant(r: &mut Restore, key: &DataPlaneKey, now_unix_s: u64) -> Result<()> {
    let expires_unix_s = now_unix_s + 2 * u64::from(r.timeout_s) + CLOCK_SLACK.as_secs();
    for f in &mut r.files {
        let grant = Grant { job: r.job, generation: f.source_generation, step: r.step, files: vec![f.file.clone()], expires_unix_s };
        f.capability = mint(&key.0, &grant).map_err(CoordinatorError::Conflict)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use motley_contract::capability::check;
    use motley_proto::v1::RestoreFile;

    #[test]
    fn each_file_of_a_restore_carries_a_capability_for_exactly_that_file() {
        let key = DataPlaneKey([9; KEY_BYTES]);
        let file = |g: i64, name: &str| RestoreFile { source_generation: g, file: name.into(), ..Default::default() };
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
            let ok = |job, g, step, name: &str, at| check(&key.0, &f.capability, at, job, g, step, name);
            assert_eq!(ok(4, f.source_generation, 50, &f.file, expires - 1), Ok(()), "{}", f.file);
            assert!(ok(4, f.source_generation, 50, &f.file, expires).unwrap_err().contains("expired"));
            assert!(ok(5, f.source_generation, 50, &f.file, 1_000).unwrap_err().contains("not job 5"));
            assert!(ok(4, 3 - f.source_generation, 50, &f.file, 1_000).unwrap_err().contains("generation"));
            assert!(ok(4, f.source_generation, 49, &f.file, 1_000).unwrap_err().contains("not step 49"));
            for other in r.files.iter().filter(|o| o.file != f.file) {
                assert!(ok(4, f.source_generation, 50, &other.file, 1_000).unwrap_err().contains("does not list file"));
            }
            assert!(check(&[8; KEY_BYTES], &f.capability, 1_000, 4, f.source_generation, 50, &f.file)
                .unwrap_err()
                .contains("bad signature"));
        }
        assert!(format!("{key:?}") == "DataPlaneKey(..)");
        assert!(DataPlaneKey::from_slice(&[1; 16]).unwrap_err().to_string().contains("16 bytes, not 32"));
    }
}
