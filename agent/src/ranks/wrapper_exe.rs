//! The agent's own executable, which every rank's wrapper runs (`wrapper`), held open from
//! start-up. A rank of a job that names a user is started as that user, and an exec by path
//! would then need that user to search every directory above the executable: an agent installed
//! (or built) under a private directory, such as root's home, could not start a single such
//! rank. Executed through the descriptor instead (execveat(2) with `AT_EMPTY_PATH`, what
//! fexecve(3) does), the rank's user needs execute permission on the file alone; where even
//! that is missing, the agent says so at start-up and refuses such a launch naming the file and
//! the fix (README, "The running system": a job's `user`).

use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use crate::error::AgentError;
use crate::ranks::users::Account;

/// The executable, open `O_PATH | O_CLOEXEC`: every child the agent forks has the descriptor
/// until its exec, and none keeps it past that (the wrapper, and so its rank, never sees it).
#[derive(Debug)]
pub struct WrapperExe {
    file: OwnedFd,
    /// Where it was when opened, for messages (and the wrapper's argv[0]).
    path: PathBuf,
}

impl WrapperExe {
    /// This process's own executable: the file /proc/self/exe leads to, even if it has been
    /// renamed or replaced on disk since the agent started.
    pub fn own() -> Result<WrapperExe, AgentError> {
        let exe = Path::new("/proc/self/exe");
        let path = std::fs::read_link(exe).map_err(|err| AgentError::Io {
            what: "finding this executable (the rank wrapper)",
            path: exe.into(),
            err,
        })?;
        WrapperExe::open_as(exe, path)
    }

    /// The executable at `path` (tests run other programs as the "wrapper").
    pub fn open(path: &Path) -> Result<WrapperExe, AgentError> {
        WrapperExe::open_as(path, path.to_path_buf())
    }

    fn open_as(open: &Path, path: PathBuf) -> Result<WrapperExe, AgentError> {
        let file = rustix::fs::open(open, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()).map_err(|e| AgentError::Io {
            what: "opening the rank wrapper",
            path: path.clone(),
            err: e.into(),
        })?;
        Ok(WrapperExe { file, path })
    }

    /// Where the executable was when the agent opened it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its mode bits, owner and group now (an operator may fix them while the agent runs).
    fn stat(&self) -> Result<(u32, u32, u32), String> {
        let st = rustix::fs::fstat(&self.file).map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok((st.st_mode & 0o7777, st.st_uid, st.st_gid))
    }

    /// Why `account` cannot execute the wrapper, naming the file and the fix; None when it can.
    /// The bits exec(2) checks: the owner's for its owner, the group's for a member of its
    /// group, the others' for everyone else.
    pub fn not_runnable_by(&self, account: &Account) -> Option<String> {
        let (mode, uid, gid) = match self.stat() {
            Ok(s) => s,
            Err(e) => return Some(format!("the rank wrapper: {e}")),
        };
        let bit = match () {
            _ if account.uid == 0 => mode & 0o111,
            _ if account.uid == uid => mode & 0o100,
            _ if account.gid == gid || account.groups.contains(&gid) => mode & 0o010,
            _ => mode & 0o001,
        };
        (bit == 0).then(|| {
            format!(
                "the job's user '{}' (uid {}) cannot execute the agent's executable {} (mode {mode:04o}, owner uid {uid} gid {gid}), \
                 which runs each rank's wrapper; let ranks' users execute it (chmod o+x {}), or install the agent where they may",
                account.name,
                account.uid,
                self.path.display(),
                self.path.display()
            )
        })
    }

    /// What a root agent says at start-up when ranks of other users will not be able to start:
    /// the executable is not executable by others. None when it is.
    pub fn startup_warning(&self) -> Option<String> {
        match self.stat() {
            Ok((mode, uid, gid)) if mode & 0o001 == 0 => Some(format!(
                "{} (mode {mode:04o}, owner uid {uid} gid {gid}) is not executable by others: ranks of jobs whose user is not its owner \
                 or in its group cannot start (each rank's wrapper runs this executable as the job's user); run chmod o+x {}",
                self.path.display(),
                self.path.display()
            )),
            Ok(_) => None,
            Err(e) => Some(format!("the rank wrapper: {e}")),
        }
    }

    /// Make `cmd`'s child execute the wrapper through the descriptor, with `cmd`'s arguments
    /// and environment: its last step before exec (`pre_exec` closures run in the order they
    /// were added, after the child's stdio, directory and process group are set), so call this
    /// after every other `pre_exec`. `cmd` must have had `env_clear`: the environment passed
    /// is the variables it sets, and nothing of the agent's own.
    pub fn exec_through(&self, cmd: &mut tokio::process::Command) -> Result<(), String> {
        let std = cmd.as_std();
        let c = |s: &OsStr| CString::new(s.as_bytes()).map_err(|_| format!("{:?} holds a NUL byte", s));
        let mut argv = vec![c(self.path.as_os_str())?];
        for a in std.get_args() {
            argv.push(c(a)?);
        }
        let mut envp = vec![];
        for (k, v) in std.get_envs() {
            if let Some(v) = v {
                let mut kv = k.to_os_string();
                kv.push("=");
                kv.push(v);
                envp.push(c(&kv)?);
            }
        }
        let exec = Exec::new(self.file.as_raw_fd(), argv, envp);
        // SAFETY: the closure makes two system calls on memory prepared before the fork (no
        // allocation, no locks); on success the second does not return.
        unsafe {
            cmd.pre_exec(move || exec.run());
        }
        Ok(())
    }
}

/// An execveat(2)'s arguments, made before the fork: the child may not allocate.
struct Exec {
    fd: i32,
    _strings: (Vec<CString>, Vec<CString>),
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
}

// SAFETY: the pointers point into the CStrings `_strings` owns, which live (and never move
// their bytes) as long as the pointers do; only a forked child reads them.
unsafe impl Send for Exec {}
unsafe impl Sync for Exec {}

impl Exec {
    fn new(fd: i32, argv: Vec<CString>, envp: Vec<CString>) -> Exec {
        let ptrs = |v: &[CString]| v.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect::<Vec<_>>();
        let (argv_p, envp_p) = (ptrs(&argv), ptrs(&envp));
        Exec { fd, _strings: (argv, envp), argv: argv_p, envp: envp_p }
    }

    fn run(&self) -> std::io::Result<()> {
        // Nothing the agent holds beyond the wrapper's stdin, stdout and stderr reaches the
        // rank, whoever opened it without O_CLOEXEC (the agent's own parent included): every
        // other descriptor closes at the exec. A kernel without close_range(2) (before 5.11)
        // leaves them as they are. The system calls themselves: glibc wraps both only since 2.34.
        // SAFETY: close_range takes plain values; execveat a descriptor, an empty NUL-terminated
        // path and NULL-terminated arrays of NUL-terminated strings, all alive for the call.
        unsafe {
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
            libc::syscall(libc::SYS_execveat, self.fd, c"".as_ptr(), self.argv.as_ptr(), self.envp.as_ptr(), libc::AT_EMPTY_PATH);
        }
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn account(uid: u32, gid: u32, groups: &[u32]) -> Account {
        Account { name: "alice".into(), uid, gid, home: "/home/alice".into(), groups: groups.to_vec() }
    }

    #[test]
    fn who_may_execute_the_wrapper_follows_the_mode_bits_exec_checks() {
        let dir = std::env::temp_dir().join(format!("motley-wrapper-exe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("motley-agent");
        std::fs::write(&file, "").unwrap();
        let exe = WrapperExe::open(&file).unwrap();
        let (_, uid, gid) = exe.stat().unwrap();
        let (owner, member, other) = (account(uid, 4242, &[4242]), account(4243, 4243, &[gid, 4243]), account(4244, 4244, &[4244]));
        let mode = |m: u32| std::fs::set_permissions(&file, std::fs::Permissions::from_mode(m)).unwrap();

        mode(0o755);
        assert!([&owner, &member, &other].iter().all(|a| exe.not_runnable_by(a).is_none()));
        assert_eq!(exe.startup_warning(), None);

        mode(0o750);
        assert!(exe.not_runnable_by(&owner).is_none() && exe.not_runnable_by(&member).is_none());
        let why = exe.not_runnable_by(&other).expect("others may not");
        let path = file.display().to_string();
        assert!(why.contains("'alice' (uid 4244)") && why.contains(&path) && why.contains("mode 0750"), "{why}");
        assert!(why.contains(&format!("chmod o+x {path}")), "{why}");
        let warning = exe.startup_warning().expect("others may not");
        assert!(warning.contains(&path) && warning.contains(&format!("chmod o+x {path}")), "{warning}");

        mode(0o705);
        assert!(exe.not_runnable_by(&member).is_some(), "the group's bits, not the others', for a member");
        assert!(exe.not_runnable_by(&other).is_none());
        mode(0o010);
        assert!(exe.not_runnable_by(&account(0, 0, &[0])).is_none(), "root needs any execute bit");
        mode(0o600);
        assert!(exe.not_runnable_by(&account(0, 0, &[0])).is_some(), "but one");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The child runs the program through the descriptor with the command's arguments and
    /// only the environment the command sets, and holds no descriptor but its stdio: neither
    /// the executable's nor one the parent left open without O_CLOEXEC.
    #[tokio::test]
    async fn the_child_executes_the_file_through_its_descriptor() {
        let exe = WrapperExe::open(Path::new("/bin/sh")).unwrap();
        // SAFETY: dup(2) of stdin: a descriptor without O_CLOEXEC, closed below.
        let inheritable = unsafe { libc::dup(0) };
        assert!(inheritable > 2);
        let mut cmd = tokio::process::Command::new("/nonexistent/never-run-by-path");
        cmd.arg("-c").arg(r#"echo "$0 $1 X=$X HOME=$HOME"; ls /proc/$$/fd"#).arg("one").arg("two");
        cmd.env_clear().env("X", "y").stdout(std::process::Stdio::piped());
        exe.exec_through(&mut cmd).unwrap();
        let out = cmd.output().await.unwrap();
        // SAFETY: the descriptor dup'd above.
        unsafe { libc::close(inheritable) };
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "one two X=y HOME=\n0\n1\n2\n");

        // A file it may not execute: the spawn fails with the exec's error.
        let dir = std::env::temp_dir().join(format!("motley-wrapper-noexec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy("/bin/true", dir.join("true")).unwrap();
        std::fs::set_permissions(dir.join("true"), std::fs::Permissions::from_mode(0o644)).unwrap();
        let exe = WrapperExe::open(&dir.join("true")).unwrap();
        let mut cmd = tokio::process::Command::new(exe.path());
        cmd.env_clear();
        exe.exec_through(&mut cmd).unwrap();
        assert_eq!(cmd.spawn().unwrap_err().kind(), std::io::ErrorKind::PermissionDenied);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
