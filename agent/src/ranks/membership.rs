//! A job's membership after a lost replica (`Membership`, docs/keep-going.md): the agent writes
//! the coordinator's document into the launch directory, where every rank looks once per step
//! (MOTLEY_MEMBERSHIP; `motley_torch.distributed.membership`), written like a preemption notice
//! (`notice::write_numbered`: renamed into place, the rank's, a newer epoch never replaced by an
//! older one).

use std::path::{Path, PathBuf};

use motley_proto::v1::Membership;

use crate::error::{AgentError, Result};
use crate::ranks::notice::write_numbered;

/// The environment variable naming the membership file.
pub const ENV: &str = "MOTLEY_MEMBERSHIP";

const NAME: &str = "membership.json";

/// The membership file of the launch in `dir` (`WORK_DIR/jobs/JOB/GEN`).
pub fn path(dir: &Path) -> PathBuf {
    dir.join(NAME)
}

/// Put membership `m` where the ranks of its launch look. Its document must be a JSON object
/// whose `epoch` is `m.epoch` (what the ranks and the next write compare).
pub fn write(work_dir: &Path, m: &Membership) -> Result<PathBuf> {
    let bad = |message: String| AgentError::BadMembership { job: m.job, epoch: m.epoch, message };
    let doc: serde_json::Value = serde_json::from_str(&m.document).map_err(|e| bad(format!("the document is not JSON ({e})")))?;
    if doc["epoch"].as_i64() != Some(m.epoch) {
        return Err(bad(format!("the document's epoch is not {}", m.epoch)));
    }
    write_numbered(work_dir, m.job, m.generation, NAME, "epoch", m.epoch, &m.document)
        .map_err(|e| e.stale(|newer| AgentError::StaleMembership { job: m.job, generation: m.generation, given: m.epoch, newer }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workdir;
    use std::os::unix::fs::PermissionsExt;

    fn membership(epoch: i64) -> Membership {
        let document = serde_json::json!({"epoch": epoch, "replicas": [0, 2], "lost": [1]}).to_string();
        Membership { job: 5, generation: 1, epoch, document, stop_ranks: vec![3] }
    }

    #[test]
    fn a_membership_lands_whole_and_private_and_an_older_epoch_is_refused() {
        let root = std::env::temp_dir().join(format!("motley-membership-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(workdir::generation_dir(&root, 5, 1)).unwrap();
        let file = write(&root, &membership(2)).unwrap();
        assert_eq!(file, path(&workdir::generation_dir(&root, 5, 1)));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(v["replicas"], serde_json::json!([0, 2]));
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        let err = write(&root, &membership(1)).unwrap_err().to_string();
        assert!(err.contains("epoch 2 is newer"), "{err}");
        write(&root, &membership(3)).unwrap();
        let mut bad = membership(4);
        bad.document = "{\"epoch\": 5}".into();
        let err = write(&root, &bad).unwrap_err().to_string();
        assert!(err.contains("epoch is not 4"), "{err}");
        bad.document = "not json".into();
        assert!(write(&root, &bad).unwrap_err().to_string().contains("not JSON"));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
