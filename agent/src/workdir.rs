//! The agent's work directory: where things are in it (`jobs/JOB/GENERATION/`, a rank's
//! `rank-R.EXT` files there) and how the agent writes a file or directory in it. The bottom
//! of the agent: every room writes through here, and it calls nothing of theirs.
//!
//! Every file is written whole or not at all (a temporary file in the same directory, then a
//! rename or a link), so a crash never leaves a half-written file that a later agent could
//! take for a whole one. Records, exit codes and markers are fsync'd (file and directory):
//! they must survive a power loss. Every file is 0600 and every directory 0700: plans carry
//! the job's settings, logs whatever the rank prints. Two exceptions, for ranks that run as
//! the job's user (see `ranks::users`): the launch directory and the rank's own files (plan,
//! groups, log, exit) belong to that user, and the directories above it (the work directory,
//! `jobs/`, `jobs/JOB/`) are 0711 once such a rank was launched, so the user can reach its
//! launch directory by name but list nothing; the lease file (a deadline, no secret) is 0644
//! so the rank's wrapper can read it.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{AgentError, Result};
use crate::safe_fs::{Dir, Temp};

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

/// The directory of `path` (opened without following a link as its last step) and the name
/// in it: every file the agent writes is written through its directory's handle (`safe_fs`),
/// since that directory may be a rank's (its launch directory: docs/state.md).
fn parent_of(path: &Path) -> Result<(Dir, String)> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| AgentError::Unsafe { path: path.to_path_buf() })?;
    Ok((Dir::open(dir)?, name.to_string()))
}

/// Open `path` for writing, created with mode 0600 (and set to 0600 if it was there before),
/// emptied: for the agent's own log, written again under the same name. Never through a
/// symbolic link (a rank running as another user can plant one in its launch directory), nor
/// blocking on a FIFO planted there, nor emptying a file with another hard link (one planted
/// there could be a file of root's): such a name is refused before anything in it changes
/// (`safe_fs::Dir::create_or_empty`).
pub fn create_file(path: &Path) -> Result<std::fs::File> {
    let (dir, name) = parent_of(path)?;
    dir.create_or_empty(&name, FILE_MODE)
}

/// Write `bytes` to `path` atomically and durably (file and directory fsync'd: records, exit
/// codes and `reported` markers must survive a power loss), replacing what is there.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_owned(path, bytes, None)
}

/// `write_atomic`, the file given to `owner` (uid, gid) before it takes its name: whoever reads
/// it by name never finds it still the agent's. The temporary file is made new, never one a
/// rank planted under its name (`safe_fs::Dir::write_renamed`).
pub fn write_atomic_owned(path: &Path, bytes: &[u8], owner: Option<(u32, u32)>) -> Result<()> {
    let (dir, name) = parent_of(path)?;
    dir.write_renamed(&name, bytes, &Temp { mode: FILE_MODE, owner, durable: true })
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
    let (dir, name) = parent_of(path)?;
    dir.write_renamed(&name, bytes, &Temp { mode, owner: None, durable: false })
}

/// Give `path` (a file or directory the agent made) to the user a rank runs as: through a
/// handle opened without following a link (nor blocking on a FIFO), and never a file with
/// another hard link (the name may be in the rank's directory, where a link to a file of
/// root's could have taken its place).
pub fn hand_over(path: &Path, uid: u32, gid: u32) -> Result<()> {
    let (dir, name) = parent_of(path)?;
    dir.chown_entry(&name, uid, gid)
}

/// Let ranks running as other users reach their launch directory `dir` (under
/// `WORK_DIR/jobs/JOB/`): the directories from the work directory down to the job's are
/// made 0711 (passable, not listable). Each through a handle opened from the work directory
/// without following a link (`safe_fs`), never by path: a mode set through a link would open
/// whatever it points at.
pub fn open_passage(work_dir: &Path, dir: &Path) -> Result<()> {
    let root = Dir::open(work_dir)?;
    let mut at = dir.parent();
    while let Some(d) = at.filter(|d| d.starts_with(work_dir)) {
        let rel = d.strip_prefix(work_dir).unwrap_or(Path::new(""));
        let handle = if rel.as_os_str().is_empty() { Dir::open(work_dir)? } else { root.dir(rel)? };
        if handle.own_stat()?.st_mode & 0o777 != PASS_MODE {
            handle.chmod(PASS_MODE)?;
        }
        at = d.parent();
    }
    Ok(())
}

/// Write `bytes` to `path` atomically unless it exists (then nothing changes): for the agent's
/// own exit code of a rank it had to kill, which must not overwrite the wrapper's.
pub fn write_once(path: &Path, bytes: &[u8]) -> Result<()> {
    let (dir, name) = parent_of(path)?;
    dir.write_once(&name, bytes, &Temp { mode: FILE_MODE, owner: None, durable: true }).map(drop)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_link_fifo_or_hard_link_is_never_written_through() {
        let dir = std::env::temp_dir().join(format!("motley-workdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("root-file");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, dir.join("sym.log")).unwrap();
        std::fs::hard_link(&target, dir.join("hard.log")).unwrap();
        let fifo = std::ffi::CString::new(dir.join("fifo.log").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(create_file(&dir.join("sym.log")).is_err());
        assert!(matches!(create_file(&dir.join("hard.log")), Err(AgentError::Unsafe { .. })));
        assert!(create_file(&dir.join("fifo.log")).is_err(), "refused at once, not blocked on a reader");
        assert!(hand_over(&dir.join("hard.log"), 65534, 65534).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        std::fs::write(dir.join("own.log"), "earlier life").unwrap();
        create_file(&dir.join("own.log")).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("own.log")).unwrap(), "", "the agent's own file is emptied");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A rank can write in its launch directory, so it can make the agent's temporary name
    /// (`.NAME.tmp-PID`) first: a file of its own (kept open, to change what the agent writes
    /// after the rename), a link or a FIFO. The agent's file is made new all the same.
    #[test]
    fn a_planted_temporary_is_never_reused() {
        use std::io::{Read, Seek};
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("motley-workdir-tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let tmp = |name: &str| dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let mut planted = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(tmp("rank-0.exit")).unwrap();
        std::fs::set_permissions(tmp("rank-0.exit"), std::fs::Permissions::from_mode(0o666)).unwrap();
        if crate::safe_fs::euid() == 0 {
            std::os::unix::fs::chown(tmp("rank-0.exit"), Some(65534), Some(65534)).unwrap();
        }
        let target = dir.join("root-file");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, tmp("rank-0.reported")).unwrap();
        let fifo = std::ffi::CString::new(tmp("lease").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);

        write_atomic(&dir.join("rank-0.exit"), b"137\n").unwrap();
        write_atomic(&dir.join("rank-0.reported"), b"").unwrap();
        replace_with_mode(&dir.join("lease"), b"{}", 0o644).unwrap();
        write_once(&dir.join("rank-1.exit"), b"0\n").unwrap();

        let (mine, theirs) = (std::fs::metadata(dir.join("rank-0.exit")).unwrap(), planted.metadata().unwrap());
        assert_ne!(mine.ino(), theirs.ino(), "the exit code is in a file of the agent's, not in the planted one");
        assert_eq!((mine.uid(), mine.mode() & 0o777), (crate::safe_fs::euid(), FILE_MODE));
        let mut seen = String::new();
        planted.rewind().unwrap();
        planted.read_to_string(&mut seen).unwrap();
        assert_eq!(seen, "", "nothing written into the planted file");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep", "nothing written through the planted link");
        assert_eq!(std::fs::metadata(dir.join("lease")).unwrap().mode() & 0o777, 0o644);
        assert_eq!(std::fs::read_to_string(dir.join("rank-1.exit")).unwrap(), "0\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
