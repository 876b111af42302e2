//! Preemption notices (`SaveNow`, docs/recovery.md): one of a launch's nodes goes away at a
//! deadline, so its ranks should save a checkpoint at their next step. The agent writes the
//! notice into the launch directory, where every rank looks once per step
//! (MOTLEY_CKPT_NOTICE; `motley_torch.checkpoint.SaveNotice`):
//!
//! ```json
//! {"notice": 1764000000000, "deadline_unix_ms": 1764000120000}
//! ```
//!
//! Written to a temporary name and renamed, so a rank never reads half of one; owned like the
//! launch directory (the rank's user, 0600). A newer notice replaces an older one; the ranks
//! save once per notice number.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use motley_proto::v1::SaveNow;

use crate::error::{AgentError, Result};
use crate::ranks::users;
use crate::workdir;

/// The environment variable naming the notice file.
pub const ENV: &str = "MOTLEY_CKPT_NOTICE";

/// The notice file of the launch in `dir` (`WORK_DIR/jobs/JOB/GEN`).
pub fn path(dir: &Path) -> PathBuf {
    dir.join("notice.json")
}

/// Put notice `s` where the ranks of its launch look. Refused when the launch has no
/// directory here (never launched on this node, or pruned) or the notice is older than the
/// one there.
pub fn write(work_dir: &Path, s: &SaveNow) -> Result<PathBuf> {
    let dir = workdir::generation_dir(work_dir, s.job, s.generation);
    let meta = std::fs::metadata(&dir).map_err(|err| AgentError::Io { what: "finding the launch directory", path: dir.clone(), err })?;
    let file = path(&dir);
    if let Some(newer) = read(&file).filter(|&n| n > s.notice) {
        return Err(AgentError::StaleNotice { job: s.job, generation: s.generation, given: s.notice, newer });
    }
    let body = serde_json::json!({"notice": s.notice, "deadline_unix_ms": s.deadline_unix_ms}).to_string();
    // The rank runs as the launch directory's owner: the notice is theirs before it has its name.
    let owner = (meta.uid() != users::euid()).then(|| (meta.uid(), meta.gid()));
    workdir::write_atomic_owned(&file, body.as_bytes(), owner)?;
    Ok(file)
}

/// The notice number in `file`, if it holds one.
fn read(file: &Path) -> Option<i64> {
    let text = std::fs::read_to_string(file).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["notice"].as_i64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn notice(n: i64) -> SaveNow {
        SaveNow { job: 3, generation: 2, notice: n, deadline_unix_ms: n + 60_000 }
    }

    #[test]
    fn a_notice_lands_whole_and_private_in_the_launch_directory_and_an_older_one_is_refused() {
        let root = std::env::temp_dir().join(format!("motley-notice-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let work = &root;
        let err = write(work, &notice(5)).unwrap_err().to_string();
        assert!(err.contains("finding the launch directory"), "{err}");
        std::fs::create_dir_all(workdir::generation_dir(work, 3, 2)).unwrap();
        let file = write(work, &notice(5)).unwrap();
        assert_eq!(file, path(&workdir::generation_dir(work, 3, 2)));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(v, serde_json::json!({"notice": 5, "deadline_unix_ms": 60_005}));
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        write(work, &notice(9)).unwrap();
        let err = write(work, &notice(7)).unwrap_err().to_string();
        assert!(err.contains("notice 9 is newer"), "{err}");
        assert_eq!(read(&file), Some(9));
        let names: Vec<_> = std::fs::read_dir(file.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        // A launch directory handed to the rank's user: the notice is theirs (as root, as agents
        // and CI run; an agent of another user owns its ranks' directories itself).
        if users::euid() == 0 {
            let dir = workdir::generation_dir(work, 4, 1);
            std::fs::create_dir_all(&dir).unwrap();
            std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
            let file = write(work, &SaveNow { job: 4, generation: 1, notice: 3, deadline_unix_ms: 9 }).unwrap();
            let meta = std::fs::metadata(&file).unwrap();
            assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
