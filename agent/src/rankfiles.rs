//! A rank's files under `WORK_DIR/jobs/JOB/GENERATION/`, which let a restarted agent find its
//! ranks again: `rank-R.json` (the record: node, job, generation, rank, process group, boot id
//! and the wrapper's start time, log), `rank-R.exit` (the exit code, written by the rank's
//! wrapper), `rank-R.reported` (the coordinator acknowledged the rank's end, so a later agent
//! does not report it again), `rank-R.stopping`, `rank-R.groups.json`, `rank-R.log`; and the
//! work directory itself (`open_work_dir`: absolute, 0700, locked by one agent).
//!
//! Every file is written whole or not at all (a temporary file in the same directory, then a
//! rename or a link), so a crash never leaves a half-written record that a later agent could
//! take for a whole one; a record that does not parse is skipped with a note all the same.
//! Records, exit codes and markers are fsync'd (file and directory): they must survive a power
//! loss. Every file is 0600 and every directory 0700: plans carry the job's settings, logs
//! whatever the rank prints. Two exceptions, for ranks that run as the job's user (see
//! `users`): the launch directory and the rank's own files (plan, groups, log, exit) belong to
//! that user, and the directories above it (the work directory, `jobs/`, `jobs/JOB/`) are 0711
//! once such a rank was launched, so the user can reach its launch directory by name but list
//! nothing; the lease file (a deadline, no secret) is 0644 so the rank's wrapper can read it.
//! Records stay the agent's: a record not owned by the agent's user is never trusted (a rank
//! can write in its own launch directory, and a forged record would have the agent signal a
//! process group of its choosing).

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{AgentError, Result};

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

pub fn generation_dir(work_dir: &Path, job: i64, generation: i64) -> PathBuf {
    work_dir.join("jobs").join(job.to_string()).join(generation.to_string())
}

pub fn rank_file(dir: &Path, rank: i64, ext: &str) -> PathBuf {
    dir.join(format!("rank-{rank}.{ext}"))
}

/// Files the agent writes hold job settings and logs (secrets, often): owner only.
pub const FILE_MODE: u32 = 0o600;
/// Directories under the work directory, and the work directory itself.
pub const DIR_MODE: u32 = 0o700;
/// The directories above a launch directory whose ranks run as another user: reachable by
/// name, not listable.
pub const PASS_MODE: u32 = 0o711;

/// Create `dir` and its missing parents with mode 0700.
pub fn create_dirs(dir: &Path) -> Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir).map_err(|err| AgentError::Io {
        what: "creating",
        path: dir.to_path_buf(),
        err,
    })
}

/// Open `path` for writing, created with mode 0600 (and set to 0600 if it was there before:
/// the mode of an existing file is not changed by `create`). Never through a symbolic link: a
/// rank running as another user can plant one in its launch directory.
pub fn create_file(path: &Path) -> Result<std::fs::File> {
    let io = |err| AgentError::Io { what: "writing", path: path.to_path_buf(), err };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io)?;
    f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE)).map_err(io)?;
    Ok(f)
}

fn temp_for(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// The temporary file for `path`, written (mode 0600) and, if `durable`, on disk.
fn write_temp(path: &Path, bytes: &[u8], durable: bool) -> Result<PathBuf> {
    let tmp = temp_for(path);
    let io = |err| AgentError::Io { what: "writing", path: path.to_path_buf(), err };
    let mut f = create_file(&tmp)?;
    f.write_all(bytes).map_err(io)?;
    if durable {
        f.sync_all().map_err(io)?;
    }
    Ok(tmp)
}

/// The directory entry of a renamed or linked file survives a power loss only once its
/// directory is on disk too.
fn sync_dir(path: &Path) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let io = |err| AgentError::Io { what: "syncing", path: dir.to_path_buf(), err };
    std::fs::File::open(dir).map_err(io)?.sync_all().map_err(io)
}

/// Write `bytes` to `path` atomically and durably (file and directory fsync'd: records, exit
/// codes and `reported` markers must survive a power loss), replacing what is there.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_owned(path, bytes, None)
}

/// `write_atomic`, the file given to `owner` (uid, gid) before it takes its name: whoever reads
/// it by name never finds it still the agent's.
pub fn write_atomic_owned(path: &Path, bytes: &[u8], owner: Option<(u32, u32)>) -> Result<()> {
    let tmp = write_temp(path, bytes, true)?;
    if let Some((uid, gid)) = owner {
        if let Err(e) = hand_over(&tmp, uid, gid) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    }
    std::fs::rename(&tmp, path).map_err(|err| AgentError::Io { what: "writing", path: path.to_path_buf(), err })?;
    sync_dir(path)
}

/// Write `bytes` to `path` atomically, without waiting for the disk: for files rewritten
/// every heartbeat (the lease), whose loss in a power cut does not matter (nothing runs after
/// one).
pub fn replace(path: &Path, bytes: &[u8]) -> Result<()> {
    replace_with_mode(path, bytes, FILE_MODE)
}

/// `replace`, the file with `mode` (set before it takes the name, so it is never readable by
/// more than `mode` says, nor by fewer).
pub fn replace_with_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let tmp = write_temp(path, bytes, false)?;
    let io = |err| AgentError::Io { what: "writing", path: path.to_path_buf(), err };
    if mode != FILE_MODE {
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)
}

/// Give `path` (a file or directory the agent made, never followed if it is a link) to the
/// user a rank runs as.
pub fn hand_over(path: &Path, uid: u32, gid: u32) -> Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).map_err(|err| AgentError::Io {
        what: "changing the owner of",
        path: path.to_path_buf(),
        err,
    })
}

/// Let ranks running as other users reach their launch directory `dir` (under
/// `WORK_DIR/jobs/JOB/`): the directories from the work directory down to the job's are
/// made 0711 (passable, not listable).
pub fn open_passage(work_dir: &Path, dir: &Path) -> Result<()> {
    let mut at = dir.parent();
    while let Some(d) = at.filter(|d| d.starts_with(work_dir)) {
        let io = |err| AgentError::Io { what: "setting the mode of", path: d.to_path_buf(), err };
        let mode = std::fs::symlink_metadata(d).map_err(io)?.permissions().mode() & 0o777;
        if mode != PASS_MODE {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(PASS_MODE)).map_err(io)?;
        }
        at = d.parent();
    }
    Ok(())
}

/// Write `bytes` to `path` atomically unless it exists (then nothing changes): for the agent's
/// own exit code of a rank it had to kill, which must not overwrite the wrapper's.
pub fn write_once(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = write_temp(path, bytes, true)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            Err(AgentError::Io { what: "writing", path: path.to_path_buf(), err: e })
        }
        Err(_) => Ok(()),
        Ok(()) => sync_dir(path),
    }
}

/// The agent's work directory, ready: created (0700), its mode tightened if it was looser,
/// made absolute (ranks run in their launch's directory, so every path handed to them must
/// be absolute), and locked (`agent.lock`, held while the returned file is open) so that a
/// second agent on the same directory stops at once instead of taking the first one's ranks.
pub fn open_work_dir(dir: &Path) -> Result<(PathBuf, std::fs::File)> {
    let io = |what, err| AgentError::Io { what, path: dir.to_path_buf(), err };
    create_dirs(dir)?;
    let mode = std::fs::metadata(dir).map_err(|e| io("reading", e))?.permissions().mode();
    // Passable (0711) is how an agent leaves it once ranks ran as other users (see the module's
    // doc); anything more is closed.
    if mode & 0o066 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE)).map_err(|e| io("setting the mode of", e))?;
    }
    let dir = std::fs::canonicalize(dir).map_err(|e| io("resolving", e))?;
    let path = dir.join("agent.lock");
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .open(&path)
        .map_err(|err| AgentError::Io { what: "opening", path: path.clone(), err })?;
    match lock.try_lock() {
        Ok(()) => Ok((dir, lock)),
        Err(std::fs::TryLockError::WouldBlock) => Err(AgentError::WorkDirBusy { path: dir }),
        Err(std::fs::TryLockError::Error(err)) => Err(AgentError::Io { what: "locking", path, err }),
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
                // (`rank-N.groups.json` is the rank's groups file, not a record.)
                let number = name.strip_prefix("rank-").and_then(|n| n.strip_suffix(".json"));
                if !number.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) {
                    continue;
                }
                // Only the agent's own records: a rank running as another user may write in its
                // launch directory, and must not tell the agent which process group to signal.
                let owner = std::fs::symlink_metadata(&f).map(|m| std::os::unix::fs::MetadataExt::uid(&m)).ok();
                if let Some(uid) = owner.filter(|&u| u != crate::users::euid()) {
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

/// This boot's id: a record written in another boot names processes that are gone.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// The fields of /proc/PID/stat after the command name (which may hold spaces and ')'): the
/// state is [0], the process group [2], the start time [19] (field 22 of the whole line).
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    Some(after.split_whitespace().map(str::to_string).collect())
}

/// When process `pid` started (clock ticks after boot); None if there is no such process.
pub fn start_time(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Whether `pgid` is still the group a rank's wrapper led: its leader is alive (not a zombie)
/// and started when the record says. A pid reused by another process, after a reboot or a
/// wrap-around, starts at another time; a group whose leader is gone cannot be told apart
/// from a foreign one and is not taken for the rank's.
pub fn is_rank_group(pgid: i32, start: u64) -> bool {
    start != 0 && stat_fields(pgid).is_some_and(|f| f.len() > 19 && f[0] != "Z" && f[2] == pgid.to_string() && f[19] == start.to_string())
}

/// The live (not zombie) processes of group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(procs) = std::fs::read_dir("/proc") else { return vec![] };
    let pgid = pgid.to_string();
    procs
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| stat_fields(pid).is_some_and(|f| f.len() > 2 && f[0] != "Z" && f[2] == pgid))
        .collect()
}

/// Whether any process of the group still runs. Zombies do not count: under an init that
/// does not reap (some containers), an orphaned wrapper killed with its rank stays a zombie,
/// and kill(2) still finds its group.
pub fn group_alive(pgid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks; no memory is shared.
    if pgid <= 0 || unsafe { libc::kill(-pgid, 0) } != 0 {
        return false;
    }
    if std::fs::metadata("/proc/self/stat").is_err() {
        return true; // no /proc to tell zombies apart
    }
    !group_members(pgid).is_empty()
}

/// Signal a rank's process group, only if it is still the one its wrapper leads (see
/// `is_rank_group`); whether it was signalled.
pub fn signal_group(pgid: i32, start: u64, signal: i32) -> bool {
    if pgid <= 0 || !is_rank_group(pgid, start) {
        return false;
    }
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is shared.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

extern "C" fn ignore(_: libc::c_int) {}

/// `motley-agent __rank-wrapper EXIT_FILE [--lease LEASE_FILE] -- PROGRAM ARGS...`: runs the
/// rank as its child in the same process group and writes its exit code (128 + signal when
/// killed) to EXIT_FILE atomically, so an agent that is not its parent (restarted since)
/// learns how it ended. SIGTERM, SIGINT and SIGHUP sent to the group are meant for the rank:
/// the wrapper catches them with a handler that does nothing (a handler, unlike SIG_IGN, is
/// not inherited across exec, so the rank sees them) and waits for the rank to end.
///
/// With a lease file (see `lease`), the wrapper is the node's dead-man switch: once the
/// agent's lease has run out, it stops the rank itself (SIGTERM to the group, SIGKILL after
/// the lease's grace period), so a host whose agent died does not keep training alone.
pub fn wrapper_main(exit_file: &Path, lease_file: Option<&Path>, program: &str, args: &[String]) -> i32 {
    for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: installs an async-signal-safe handler that does nothing.
        unsafe {
            libc::signal(s, ignore as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
    let mut child = match std::process::Command::new(program).args(args).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("motley-agent: cannot start {program}: {e}");
            return finish_wrapper(exit_file, 127);
        }
    };
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(lease) = lease_file {
        let (lease, pid, fired) = (lease.to_path_buf(), child.id() as i32, fired.clone());
        std::thread::spawn(move || crate::lease::switch(&lease, pid, &fired));
    }
    let code = match child.wait() {
        Ok(s) => s.code().unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0)),
        Err(e) => {
            eprintln!("motley-agent: waiting for {program}: {e}");
            -1
        }
    };
    if fired.load(std::sync::atomic::Ordering::SeqCst) {
        // What the rank started and left behind is stopped with it: its process group now,
        // and, its code written, everything in its cgroup (the wrapper too).
        crate::lease::kill_rest_of_group();
        let code = finish_wrapper(exit_file, code);
        crate::cgroup::kill_own_rank_cgroup();
        return code;
    }
    finish_wrapper(exit_file, code)
}

fn finish_wrapper(exit_file: &Path, code: i32) -> i32 {
    if let Err(e) = write_atomic(exit_file, format!("{code}\n").as_bytes()) {
        eprintln!("motley-agent: {e}");
    }
    code
}
