//! The name of the cgroup directory an agent makes for its ranks, one rule for the cgroup v2
//! tree (`cgroup`) and the v1 cpu hierarchy (`cpu_share`): `PREFIX-NODE-HASH`, the hash a
//! short stable name for the agent's work directory, so two agents of one node (tests, a
//! second work directory) never share a directory.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `motley-n1-1a2b3c4d` for `prefix` `motley`, node `n1`.
pub(crate) fn agent_root(prefix: &str, node: &str, work_dir: &Path) -> String {
    format!("{prefix}-{node}-{:08x}", fnv1a(work_dir.as_os_str().as_bytes()))
}

/// FNV-1a, 32 bits (not a secret, no collision attack to fear: the directories are the
/// operator's own).
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_work_directory_one_name() {
        let a = agent_root("motley", "n1", Path::new("/var/lib/motley"));
        assert_eq!(a, agent_root("motley", "n1", Path::new("/var/lib/motley")));
        assert!(a.starts_with("motley-n1-") && a.len() == "motley-n1-".len() + 8, "{a}");
        assert_ne!(a, agent_root("motley", "n1", Path::new("/var/lib/motley2")));
        assert_eq!(fnv1a(b""), 0x811c_9dc5, "FNV-1a's offset basis");
        assert_eq!(fnv1a(b"a"), 0xe40c_292c, "FNV-1a 32 of 'a'");
    }
}
