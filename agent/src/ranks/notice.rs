//! Preemption notices (`SaveNow`, docs/recovery.md): one of a launch's nodes goes away at a
//! deadline, so its ranks should save a checkpoint at their next step. The agent writes the
//! notice into the launch directory, where every rank looks once per step
//! (MOTLEY_CKPT_NOTICE; `motley_torch.components.save_notice.SaveNotice`):
//!
//! ```json
//! {"notice": 1764000000000, "deadline_unix_ms": 1764000120000}
//! ```
//!
//! Written to a temporary name and renamed, so a rank never reads half of one; owned like the
//! launch directory (the rank's user, 0600). A newer notice replaces an older one; the ranks
//! save once per notice number.

use std::path::{Path, PathBuf};

use motley_proto::v1::SaveNow;

use crate::error::{AgentError, Result};
use crate::ranks::users;
use crate::safe_fs::{self, Dir, Temp};
use crate::workdir;

/// The environment variable naming the notice file.
pub const ENV: &str = "MOTLEY_CKPT_NOTICE";

/// The notice file of the launch in `dir` (`WORK_DIR/jobs/JOB/GEN`).
pub fn path(dir: &Path) -> PathBuf {
    dir.join(NAME)
}

const NAME: &str = "notice.json";

/// The most of a notice or membership file the agent reads for its number: the number comes
/// first in what it writes, and a larger file is not one it wrote.
const NOTICE_LIMIT: u64 = 1 << 20;

/// Put notice `s` where the ranks of its launch look. Refused when the launch has no
/// directory here (never launched on this node, or pruned) or the notice is older than the
/// one there. The launch directory is the rank's: the notice there is read and written through
/// its handle (`safe_fs`; docs/state.md), so a link, a FIFO or a huge file planted under its
/// name is refused (and replaced), never followed, waited on or read whole.
pub fn write(work_dir: &Path, s: &SaveNow) -> Result<PathBuf> {
    let body = serde_json::json!({"notice": s.notice, "deadline_unix_ms": s.deadline_unix_ms}).to_string();
    write_numbered(work_dir, s.job, s.generation, NAME, "notice", s.notice, &body)
        .map_err(|e| e.stale(|newer| AgentError::StaleNotice { job: s.job, generation: s.generation, given: s.notice, newer }))
}

/// Why a numbered file was not written: its launch directory's problem, or a newer number there.
pub(crate) enum NotWritten {
    Failed(AgentError),
    Newer(i64),
}

impl NotWritten {
    pub(crate) fn stale(self, newer: impl FnOnce(i64) -> AgentError) -> AgentError {
        match self {
            NotWritten::Failed(e) => e,
            NotWritten::Newer(n) => newer(n),
        }
    }
}

impl From<AgentError> for NotWritten {
    fn from(e: AgentError) -> NotWritten {
        NotWritten::Failed(e)
    }
}

/// Put `body` (JSON whose `key` is `number`) as `name` in launch (job, generation)'s directory,
/// where its ranks look: the notice, and the membership (`membership`). Refused when the
/// launch has no directory here or the file there holds a higher number. The launch directory
/// is the rank's: the file is read and written through its handle (`safe_fs`; docs/state.md),
/// so a link, a FIFO or a huge file planted under its name is refused (and replaced), never
/// followed, waited on or read whole.
pub(crate) fn write_numbered(
    work_dir: &Path,
    job: i64,
    generation: i64,
    name: &str,
    key: &str,
    number: i64,
    body: &str,
) -> Result<PathBuf, NotWritten> {
    let dir = workdir::generation_dir(work_dir, job, generation);
    let launch = match safe_fs::open_under(&dir, 3) {
        Err(AgentError::Io { err, .. }) => {
            return Err(AgentError::Io { what: "finding the launch directory", path: dir, err }.into());
        }
        other => other?,
    };
    let meta = launch.own_stat()?;
    if let Some(newer) = read(&launch, name, key).filter(|&n| n > number) {
        return Err(NotWritten::Newer(newer));
    }
    // The rank runs as the launch directory's owner: the file is theirs before it has its name.
    let owner = (meta.st_uid != users::euid()).then_some((meta.st_uid, meta.st_gid));
    launch.write_renamed(name, body.as_bytes(), &Temp { mode: workdir::FILE_MODE, owner, durable: true })?;
    Ok(dir.join(name))
}

/// The number under `key` in the launch directory's file `name`, if it holds one (a file that
/// is not a regular one, or too large, holds none).
fn read(launch: &Dir, name: &str, key: &str) -> Option<i64> {
    let bytes = launch.read(name, NOTICE_LIMIT).ok()?;
    serde_json::from_slice::<serde_json::Value>(&bytes).ok()?[key].as_i64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

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
        assert_eq!(read(&Dir::open(file.parent().unwrap()).unwrap(), NAME, "notice"), Some(9));
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

    /// The rank's own launch directory: it makes `notice.json` a FIFO, a link to /dev/zero
    /// (endless) or to a large file of root's. Each is refused without a wait or a whole read,
    /// and the notice takes its name all the same; the link's target is untouched.
    #[test]
    fn a_planted_notice_fifo_or_link_neither_hangs_nor_fills_the_agent() {
        let root = std::env::temp_dir().join(format!("motley-notice-planted-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let big = root.join("big");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(&big, vec![b'{'; 8 << 20]).unwrap();
        for (job, plant) in [(1, "fifo"), (2, "/dev/zero"), (3, "big")] {
            let dir = workdir::generation_dir(&root, job, 1);
            std::fs::create_dir_all(&dir).unwrap();
            match plant {
                "fifo" => {
                    let fifo = std::ffi::CString::new(path(&dir).as_os_str().as_encoded_bytes()).unwrap();
                    // SAFETY: a valid NUL-terminated path.
                    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
                }
                "big" => std::os::unix::fs::symlink(&big, path(&dir)).unwrap(),
                target => std::os::unix::fs::symlink(target, path(&dir)).unwrap(),
            }
            // Bounded by the test alone: today a FIFO would block here for good.
            let (tx, rx) = std::sync::mpsc::channel();
            let work = root.clone();
            std::thread::spawn(move || {
                tx.send(write(&work, &SaveNow { job, generation: 1, notice: 4, deadline_unix_ms: 9 }).map_err(|e| e.to_string()))
            });
            let written = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the notice does not hang on a planted file");
            let file = written.unwrap();
            let meta = std::fs::symlink_metadata(&file).unwrap();
            assert!(meta.is_file() && meta.len() < 100, "{plant}: the notice replaced it");
        }
        assert_eq!(std::fs::metadata(&big).unwrap().len(), 8 << 20, "the link's target is untouched");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
