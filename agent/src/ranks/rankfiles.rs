//! A rank's files under `WORK_DIR/jobs/JOB/GENERATION/`, which let a restarted agent find its
//! ranks again: `rank-R.json` (the record: node, job, generation, rank, process group, boot id
//! and the wrapper's start time, log), `rank-R.exit` (the exit code, written by the rank's
//! wrapper), `rank-R.reported` (the coordinator acknowledged the rank's end, so a later agent
//! does not report it again), `rank-R.stopping`, `rank-R.groups.json`, `rank-R.log`. Each is
//! written whole or not at all (`workdir`); a record that does not parse is skipped with a
//! note all the same.
//!
//! Records stay the agent's: a record not owned by the agent's user is never trusted (a rank
//! can write in its own launch directory, and a forged record would have the agent signal a
//! process group of its choosing).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::ranks::users;
use crate::workdir::{rank_file, write_atomic};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankRecord {
    /// The node whose agent started the rank: an agent adopts only its own node's ranks (two
    /// agents pointed at one work directory must not take each other's). Empty in records of
    /// agents older than the field; those are never adopted.
    #[serde(default)]
    pub node: String,
    pub job: i64,
    pub generation: i64,
    pub rank: i64,
    /// The wrapper's pid, which leads the rank's process group.
    pub pgid: i32,
    pub log: PathBuf,
    /// The boot the wrapper ran in (/proc/sys/kernel/random/boot_id) and its start time
    /// (clock ticks after boot, /proc/PID/stat field 22): together with `pgid` they name one
    /// process for good, so a pid reused after a reboot or a wrap-around is never signalled.
    /// Empty / 0 in older records: those are never taken for running.
    #[serde(default)]
    pub boot_id: String,
    #[serde(default)]
    pub start_time: u64,
}

pub fn write_record(dir: &Path, r: &RankRecord) -> Result<()> {
    write_atomic(&rank_file(dir, r.rank, "json"), serde_json::to_string(r).expect("a record serialises").as_bytes())
}

/// The exit code the wrapper (or the agent) wrote; None while there is none.
pub fn read_exit(dir: &Path, rank: i64) -> Option<i64> {
    std::fs::read_to_string(rank_file(dir, rank, "exit")).ok()?.trim().parse().ok()
}

/// Every record under the work directory, and a note for each file that is not a whole one.
pub fn scan(work_dir: &Path) -> (Vec<RankRecord>, Vec<String>) {
    let (mut out, mut notes) = (vec![], vec![]);
    let sorted = |p: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(p).map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect()).unwrap_or_default();
        v.sort();
        v
    };
    for job in sorted(&work_dir.join("jobs")) {
        for generation in sorted(&job) {
            for f in sorted(&generation) {
                let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                // Only `rank-N.json`: temporaries start with '.', and are never a record.
                // (`rank-N.groups.json` is the rank's groups file, not a record.)
                let number = name.strip_prefix("rank-").and_then(|n| n.strip_suffix(".json"));
                if !number.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) {
                    continue;
                }
                // Only the agent's own records: a rank running as another user may write in its
                // launch directory, and must not tell the agent which process group to signal.
                let owner = std::fs::symlink_metadata(&f).map(|m| std::os::unix::fs::MetadataExt::uid(&m)).ok();
                if let Some(uid) = owner.filter(|&u| u != users::euid()) {
                    notes.push(format!("{}: owned by uid {uid}, not by the agent's user; not trusted, skipped", f.display()));
                    continue;
                }
                match std::fs::read_to_string(&f)
                    .map_err(|e| e.to_string())
                    .and_then(|t| serde_json::from_str::<RankRecord>(&t).map_err(|e| e.to_string()))
                {
                    Ok(r) => out.push(r),
                    Err(e) => notes.push(format!("{}: not a rank record, skipped ({e})", f.display())),
                }
            }
        }
    }
    (out, notes)
}

/// Whether no file in `dir` was modified within `keep` (a rank's log grows while it runs).
pub fn untouched_for(dir: &Path, keep: std::time::Duration) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.filter_map(|e| e.ok()?.metadata().ok()?.modified().ok()).all(|m| m.elapsed().is_ok_and(|age| age >= keep))
}
