//! A rank's files under `WORK_DIR/jobs/JOB/GENERATION/`, which let a restarted agent find its
//! ranks again: `rank-R.json` (the record: job, generation, rank, process group, log),
//! `rank-R.exit` (the exit code, written by the rank's wrapper), `rank-R.reported` (the exit
//! was sent to a coordinator, so a later agent does not adopt it again), `rank-R.log`.
//!
//! Every file is written whole or not at all (a temporary file in the same directory, then a
//! rename or a link), so a crash never leaves a half-written record that a later agent could
//! take for a whole one; a record that does not parse is skipped with a note all the same.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{AgentError, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankRecord {
    pub job: i64,
    pub generation: i64,
    pub rank: i64,
    /// The wrapper's pid, which leads the rank's process group.
    pub pgid: i32,
    pub log: PathBuf,
}

pub fn generation_dir(work_dir: &Path, job: i64, generation: i64) -> PathBuf {
    work_dir.join("jobs").join(job.to_string()).join(generation.to_string())
}

pub fn rank_file(dir: &Path, rank: i64, ext: &str) -> PathBuf {
    dir.join(format!("rank-{rank}.{ext}"))
}

fn temp_for(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Write `bytes` to `path` atomically, replacing what is there.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_for(path);
    let io = |err| AgentError::Io { what: "writing", path: path.to_path_buf(), err };
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Write `bytes` to `path` atomically unless it exists (then nothing changes): for the agent's
/// own exit code of a rank it had to kill, which must not overwrite the wrapper's.
pub fn write_once(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_for(path);
    let io = |err| AgentError::Io { what: "writing", path: path.to_path_buf(), err };
    std::fs::write(&tmp, bytes).map_err(io)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(io(e)),
        _ => Ok(()),
    }
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
                if !(name.starts_with("rank-") && name.ends_with(".json")) {
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

/// Whether any process of the group still runs. Zombies do not count: under an init that
/// does not reap (some containers), an orphaned wrapper killed with its rank stays a zombie,
/// and kill(2) still finds its group.
pub fn group_alive(pgid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks; no memory is shared.
    if pgid <= 0 || unsafe { libc::kill(-pgid, 0) } != 0 {
        return false;
    }
    let Ok(procs) = std::fs::read_dir("/proc") else { return true };
    procs.filter_map(|e| e.ok()).any(|e| {
        // /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and ')'.
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { return false };
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return false };
        let f: Vec<&str> = after.split_whitespace().collect();
        f.len() > 2 && f[0] != "Z" && f[2] == pgid.to_string()
    })
}

pub fn signal_group(pgid: i32, signal: i32) {
    if pgid > 0 {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is shared.
        unsafe {
            libc::kill(-pgid, signal);
        }
    }
}

extern "C" fn ignore(_: libc::c_int) {}

/// `motley-agent __rank-wrapper EXIT_FILE -- PROGRAM ARGS...`: runs the rank as its child in
/// the same process group and writes its exit code (128 + signal when killed) to EXIT_FILE
/// atomically, so an agent that is not its parent (restarted since) learns how it ended.
/// SIGTERM, SIGINT and SIGHUP sent to the group are meant for the rank: the wrapper catches
/// them with a handler that does nothing (a handler, unlike SIG_IGN, is not inherited across
/// exec, so the rank sees them) and waits for the rank to end.
pub fn wrapper_main(exit_file: &Path, program: &str, args: &[String]) -> i32 {
    for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: installs an async-signal-safe handler that does nothing.
        unsafe {
            libc::signal(s, ignore as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
    let code = match std::process::Command::new(program).args(args).status() {
        Ok(s) => s.code().unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0)),
        Err(e) => {
            eprintln!("motley-agent: cannot start {program}: {e}");
            127
        }
    };
    if let Err(e) = write_atomic(exit_file, format!("{code}\n").as_bytes()) {
        eprintln!("motley-agent: {e}");
    }
    code
}
