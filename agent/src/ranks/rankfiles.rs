//! A rank's files under `WORK_DIR/jobs/JOB/GENERATION/`, which let a restarted agent find its
//! ranks again: `rank-R.json` (the record: node, job, generation, rank, process group, boot id
//! and the wrapper's start time, log), `rank-R.exit` (the exit code, written by the rank's
//! wrapper), `rank-R.reported` (the coordinator acknowledged the rank's end, so a later agent
//! does not report it again), `rank-R.stopping`, `rank-R.groups.json`, `rank-R.log`, and the
//! rank's own `rank-R.rejoined` (what a joining rank copied from its peers). Each is written
//! whole or not at all (`workdir`); a record that does not parse is skipped with a note all the
//! same.
//!
//! Records stay the agent's: a record not owned by the agent's user is never trusted (a rank
//! can write in its own launch directory, and a forged record would have the agent signal a
//! process group of its choosing).

use std::path::{Path, PathBuf};

use rustix::fs::FileType;
use serde::{Deserialize, Serialize};

use crate::error::{AgentError, Result};
use crate::ranks::users;
use crate::safe_fs::Dir;
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

/// The most of an exit file the agent reads: a code and a newline.
pub const EXIT_LIMIT: u64 = 64;

/// The code a rank is reported with whose exit file is there but is no exit code: something
/// other than a regular file (a FIFO, a link: refused without reading), over `EXIT_LIMIT`, or
/// not a number. The rank wrote it (the wrapper writes a number whole), and ended for it.
pub const BAD_EXIT: i64 = -1;

/// What a launch directory's `rank-R.exit` holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Exit {
    /// No exit file yet.
    None,
    Code(i64),
    /// There, but not an exit code: why (for the agent's log); reported as `BAD_EXIT`.
    Bad(String),
}

impl Exit {
    /// The code to report, if the rank ended; a bad file is said in the agent's log.
    pub fn code(self, node: &str) -> Option<i64> {
        match self {
            Exit::None => None,
            Exit::Code(c) => Some(c),
            Exit::Bad(why) => {
                tracing::warn!(node = %node, "{why}; the rank is reported as exited with {BAD_EXIT}");
                Some(BAD_EXIT)
            }
        }
    }
}

/// The exit code the wrapper (or the agent) wrote in the launch directory `dir`
/// (`WORK_DIR/jobs/JOB/GEN`). The rank can write there: the file is read through the
/// directory's handle, a regular file only, opened without blocking and at most
/// `EXIT_LIMIT` bytes of it (docs/state.md), so a FIFO, a link to /dev/zero or to a large file
/// of root's is refused, never waited on or read whole.
pub fn read_exit(dir: &Path, rank: i64) -> Exit {
    let name = format!("rank-{rank}.exit");
    let path = dir.join(&name);
    let bytes = match crate::safe_fs::open_under(dir, 3).and_then(|d| d.read(&name, EXIT_LIMIT)) {
        Ok(b) => b,
        Err(AgentError::Io { err, .. }) if err.kind() == std::io::ErrorKind::NotFound => return Exit::None,
        Err(e) => return Exit::Bad(format!("{}: not an exit code ({e})", path.display())),
    };
    match std::str::from_utf8(&bytes).ok().and_then(|t| t.trim().parse().ok()) {
        Some(code) => Exit::Code(code),
        None => Exit::Bad(format!("{}: not an exit code ({:?})", path.display(), String::from_utf8_lossy(&bytes))),
    }
}

/// `read_exit` on a blocking thread: the watchers run on the runtime's workers, which a slow
/// disk must not stall.
pub async fn read_exit_off(dir: &Path, rank: i64) -> Exit {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || read_exit(&dir, rank)).await.unwrap_or_else(|e| Exit::Bad(format!("reading the exit file: {e}")))
}

/// The environment variable naming the rank's `rank-R.rejoined` file.
pub const REJOINED_ENV: &str = "MOTLEY_REJOINED";

/// The most of a rejoined file the agent reads: one JSON line of four numbers.
pub const REJOINED_LIMIT: u64 = 1024;

pub fn rejoined_name(rank: i64) -> String {
    format!("rank-{rank}.rejoined")
}

/// What a rank of a joining replica copied from the members' live state (docs/keep-going.md,
/// "Back to full strength"), as the rank wrote it (renamed into place):
/// `{"epoch": 3, "bytes": 2613248, "seconds": 4.1, "copy_seconds": 0.07}`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Rejoined {
    pub epoch: i64,
    pub bytes: u64,
    pub seconds: f64,
    pub copy_seconds: f64,
}

/// The rank's rejoined file in launch directory `dir`: None while there is none; an error
/// naming what is wrong when it is not one. The rank writes it, so it is read like an exit
/// file (through the directory's handle, a regular file, within a limit) and checked: a
/// positive epoch, finite non-negative seconds.
pub fn read_rejoined(dir: &Path, rank: i64) -> std::result::Result<Option<Rejoined>, String> {
    let name = rejoined_name(rank);
    let path = dir.join(&name);
    let bytes = match crate::safe_fs::open_under(dir, 3).and_then(|d| d.read(&name, REJOINED_LIMIT)) {
        Ok(b) => b,
        Err(AgentError::Io { err, .. }) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: not read ({e})", path.display())),
    };
    let r: Rejoined =
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: not {{epoch, bytes, seconds, copy_seconds}} ({e})", path.display()))?;
    let seconds_ok = |x: f64| x.is_finite() && x >= 0.0;
    if r.epoch < 1 || !seconds_ok(r.seconds) || !seconds_ok(r.copy_seconds) {
        return Err(format!("{}: epoch must be 1 or more and the seconds finite and not negative ({r:?})", path.display()));
    }
    Ok(Some(r))
}

/// The most of a record the agent reads: a few hundred bytes are a record.
const RECORD_LIMIT: u64 = 64 << 10;

/// Every record under the work directory, and a note for each file that is not a whole one.
/// Each job's and generation's directory through a handle, each record opened once: its owner
/// is that of the file read (a rank could swap a forged one in between a look and a read), and
/// it is read within a limit.
pub fn scan(work_dir: &Path) -> (Vec<RankRecord>, Vec<String>) {
    let (mut out, mut notes) = (vec![], vec![]);
    let Ok(Some(jobs)) = Dir::open(work_dir).and_then(|w| w.dir_if_any("jobs")) else { return (out, notes) };
    let dirs = |d: &Dir| -> Vec<Dir> {
        let names = d.entries().unwrap_or_default();
        names.into_iter().filter(|(_, t)| *t == FileType::Directory).filter_map(|(n, _)| d.dir(&n).ok()).collect()
    };
    for job in dirs(&jobs) {
        for generation in dirs(&job) {
            for (name, _) in generation.entries().unwrap_or_default() {
                // Only `rank-N.json`: temporaries start with '.', and are never a record.
                // (`rank-N.groups.json` is the rank's groups file, not a record.)
                let number = name.strip_prefix("rank-").and_then(|n| n.strip_suffix(".json"));
                if !number.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) {
                    continue;
                }
                match read_record(&generation, &name) {
                    Ok(r) => out.push(r),
                    Err(note) => notes.push(note),
                }
            }
        }
    }
    (out, notes)
}

/// The record `name` in a launch directory, if it is the agent's own: a rank running as another
/// user may write in its launch directory, and must not tell the agent which process group to
/// signal. Opened once; the owner is the descriptor's, and so is what is read.
fn read_record(dir: &Dir, name: &str) -> std::result::Result<RankRecord, String> {
    let path = dir.path().join(name);
    let skipped = |e: String| format!("{}: not a rank record, skipped ({e})", path.display());
    let f = dir.open_file(name).map_err(|e| skipped(e.to_string()))?;
    let uid = std::os::unix::fs::MetadataExt::uid(&f.metadata().map_err(|e| skipped(e.to_string()))?);
    if uid != users::euid() {
        return Err(format!("{}: owned by uid {uid}, not by the agent's user; not trusted, skipped", path.display()));
    }
    let mut bytes = vec![];
    std::io::Read::read_to_end(&mut std::io::Read::take(f, RECORD_LIMIT + 1), &mut bytes).map_err(|e| skipped(e.to_string()))?;
    if bytes.len() as u64 > RECORD_LIMIT {
        return Err(skipped(format!("over {RECORD_LIMIT} bytes")));
    }
    serde_json::from_slice::<RankRecord>(&bytes).map_err(|e| skipped(e.to_string()))
}

/// Whether no entry of the launch directory `dir` was modified within `keep` (a rank's log
/// grows while it runs); looked at through its handle, links not followed.
pub fn untouched_for(dir: &Dir, keep: std::time::Duration) -> bool {
    let Ok(entries) = dir.entries() else { return false };
    let now = std::time::SystemTime::now();
    entries.iter().filter_map(|(name, _)| dir.stat(name)).all(|st| {
        let modified = std::time::UNIX_EPOCH + std::time::Duration::new(st.st_mtime.max(0) as u64, st.st_mtime_nsec as u32);
        now.duration_since(modified).is_ok_and(|age| age >= keep)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank swaps a forged record of its own with the agent's (RENAME_EXCHANGE) over and over
    /// while the agent scans: the owner the agent checks is always that of the bytes it reads,
    /// so the forged process group is never taken.
    #[test]
    fn a_record_swapped_in_between_a_look_and_a_read_is_never_trusted() {
        if !crate::root_only::can_run("a_record_swapped_in_between_a_look_and_a_read_is_never_trusted", &[crate::root_only::Need::Root]) {
            return;
        }
        let work = std::env::temp_dir().join(format!("motley-rankfiles-swap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        let dir = crate::workdir::generation_dir(&work, 1, 1);
        std::fs::create_dir_all(&dir).unwrap();
        let record = |pgid| RankRecord {
            node: "n".into(),
            job: 1,
            generation: 1,
            rank: 0,
            pgid,
            log: dir.join("rank-0.log"),
            boot_id: "b".into(),
            start_time: 1,
        };
        write_record(&dir, &record(100)).unwrap();
        let forged = dir.join("forged");
        std::fs::write(&forged, serde_json::to_string(&record(666)).unwrap()).unwrap();
        std::os::unix::fs::chown(&forged, Some(65534), Some(65534)).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let (d, stop) = (Dir::open(&dir).unwrap(), stop.clone());
            std::thread::spawn(move || {
                let fd = rustix::fs::open(d.path(), rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY, rustix::fs::Mode::empty())
                    .unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    rustix::fs::renameat_with(&fd, "forged", &fd, "rank-0.json", rustix::fs::RenameFlags::EXCHANGE).unwrap();
                }
            })
        };
        let (mut trusted, mut refused) = (0, 0);
        for _ in 0..3000 {
            let (records, notes) = scan(&work);
            assert!(records.iter().all(|r| r.pgid == 100), "a forged record was trusted: {records:?}");
            trusted += records.len();
            refused += notes.len();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        assert!(trusted > 0 && refused > 0, "both were seen: {trusted} trusted, {refused} refused");
        std::fs::remove_dir_all(&work).unwrap();
    }
}
