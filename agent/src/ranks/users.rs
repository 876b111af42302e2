//! Whom a rank runs as (README, "The running system": a job's `user`). An agent running as root runs each rank —
//! its wrapper and everything under it — as the user its job names (`user:` in the job file,
//! `Launch.user`): that user's uid, primary gid and supplementary groups, with HOME, USER and
//! LOGNAME set. A job that names no user is refused on a root agent unless its operator set
//! `allow_root_ranks` (a job file alone must never be enough to run code as root on every
//! node), and so is a job naming a uid-0 account. An agent running as another user cannot
//! switch users: it runs ranks as itself and refuses a job naming anyone else. A refused rank
//! is reported exited with `REFUSED` and the reason in its log, as is one whose user may not
//! execute the agent's own executable, which runs each rank's wrapper (`wrapper_exe`).

use std::ffi::{CStr, CString};

/// The exit code of a rank the agent refused to start as the job asked (the shell's "found
/// but cannot run").
pub const REFUSED: i64 = 126;

/// A user a rank runs as, as the node's user database has it.
#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    /// Every group the user is in (the primary one included), as initgroups(3) would set.
    pub groups: Vec<u32>,
}

/// The user `name` on this node (getpwnam_r, getgrouplist), or None if there is none.
pub fn lookup(name: &str) -> Result<Option<Account>, String> {
    let c_name = CString::new(name).map_err(|_| format!("user '{}': holds a NUL character", name.escape_default()))?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: an all-zero passwd is a valid value for getpwnam_r to fill in.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `buf` outlives the use of `pwd`'s strings.
        let rc = unsafe { libc::getpwnam_r(c_name.as_ptr(), &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
        if rc == libc::ERANGE && buf.len() < (1 << 20) {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 {
            return Err(format!("looking up user '{name}': {}", std::io::Error::from_raw_os_error(rc)));
        }
        if found.is_null() {
            return Ok(None);
        }
        // SAFETY: getpwnam_r found the user: pw_dir points into `buf`, NUL-terminated (or is null).
        let home = if pwd.pw_dir.is_null() { String::new() } else { unsafe { CStr::from_ptr(pwd.pw_dir) }.to_string_lossy().into_owned() };
        let groups = group_list(&c_name, pwd.pw_gid);
        return Ok(Some(Account { name: name.to_string(), uid: pwd.pw_uid, gid: pwd.pw_gid, home, groups }));
    }
}

/// The user's groups (getgrouplist(3)); at least the primary one.
fn group_list(name: &CStr, gid: libc::gid_t) -> Vec<u32> {
    let mut n: libc::c_int = 32;
    loop {
        let mut groups: Vec<libc::gid_t> = vec![0; n as usize];
        let asked = n;
        // SAFETY: `groups` holds `n` entries; getgrouplist writes at most that many and sets `n`.
        let rc = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
        if rc >= 0 {
            groups.truncate(n.max(0) as usize);
            if !groups.contains(&gid) {
                groups.insert(0, gid);
            }
            return groups;
        }
        // Too small: `n` now says how many there are (grown anyway, in case it does not).
        if n <= asked {
            n = asked * 2;
        }
        if n > 65_536 {
            return vec![gid];
        }
    }
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid(2) only reads.
    unsafe { libc::geteuid() }
}

/// Whom a launch's ranks run as: None, as the agent itself; an account, as that user; or the
/// reason they are refused (for the rank's log). `euid` is the agent's, `node` names it in
/// the messages, `find` is `lookup` (a parameter so the rules are tested without a user
/// database).
pub fn run_as(
    euid: u32,
    user: &str,
    allow_root_ranks: bool,
    node: &str,
    find: impl Fn(&str) -> Result<Option<Account>, String>,
) -> Result<Option<Account>, String> {
    if user.is_empty() {
        return match euid == 0 && !allow_root_ranks {
            true => Err("the agent runs as root and the job names no user; add user: NAME to the job file, \
                 or set allow_root_ranks = true in the agent config"
                .into()),
            false => Ok(None),
        };
    }
    let Some(account) = find(user)? else {
        return Err(format!(
            "the job's user '{user}' does not exist on node {node}; create it there, or name another user in the job file"
        ));
    };
    if euid != 0 {
        return match account.uid == euid {
            true => Ok(None),
            false => Err(format!(
                "the job's user '{user}' (uid {}) is not the agent's (uid {euid}), and an agent that does not run as root cannot \
                 switch users; run the agent as root, or as '{user}', or drop user: from the job file",
                account.uid
            )),
        };
    }
    if account.uid == 0 && !allow_root_ranks {
        return Err(format!(
            "the job's user '{user}' is root (uid 0); name an unprivileged user in the job file, \
             or set allow_root_ranks = true in the agent config"
        ));
    }
    Ok(Some(account))
}

/// Drop to `account` in a freshly forked child, before exec: supplementary groups, then the
/// gid, then the uid (the order that still has the privilege each step needs). Only system
/// calls, no allocation: the parent may have other threads holding locks.
pub fn become_user(account: &Account) -> impl FnMut() -> std::io::Result<()> + Send + Sync + 'static {
    let (uid, gid, groups) = (account.uid, account.gid, account.groups.clone());
    move || {
        let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
        // SAFETY: setgroups/setgid/setuid take plain values and a pointer to `groups`, alive here.
        unsafe {
            check(libc::setgroups(groups.len() as _, groups.as_ptr()))?;
            check(libc::setgid(gid))?;
            check(libc::setuid(uid))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(name: &str, uid: u32) -> Account {
        Account { name: name.into(), uid, gid: uid, home: format!("/home/{name}"), groups: vec![uid] }
    }

    fn db(name: &str) -> Result<Option<Account>, String> {
        Ok(match name {
            "alice" => Some(account("alice", 1000)),
            "toor" => Some(account("toor", 0)),
            _ => None,
        })
    }

    #[test]
    fn a_root_agent_runs_ranks_as_the_jobs_user_and_never_as_root_unless_allowed() {
        assert_eq!(run_as(0, "alice", false, "n", db), Ok(Some(account("alice", 1000))));
        let e = run_as(0, "", false, "n", db).unwrap_err();
        assert!(e.contains("the agent runs as root and the job names no user") && e.contains("allow_root_ranks = true"), "{e}");
        assert_eq!(run_as(0, "", true, "n", db), Ok(None), "allowed: as the agent, root");
        let e = run_as(0, "toor", false, "n", db).unwrap_err();
        assert!(e.contains("'toor' is root (uid 0)"), "{e}");
        assert_eq!(run_as(0, "toor", true, "n", db), Ok(Some(account("toor", 0))));
        let e = run_as(0, "bob", true, "node-7", db).unwrap_err();
        assert!(e.contains("'bob' does not exist on node node-7"), "{e}");
    }

    #[test]
    fn an_unprivileged_agent_runs_ranks_as_itself_and_refuses_other_users() {
        assert_eq!(run_as(1000, "", false, "n", db), Ok(None));
        assert_eq!(run_as(1000, "alice", false, "n", db), Ok(None), "its own user: nothing to switch");
        let e = run_as(2000, "alice", true, "n", db).unwrap_err();
        assert!(e.contains("(uid 1000) is not the agent's (uid 2000)") && e.contains("cannot switch users"), "{e}");
        assert!(run_as(2000, "bob", false, "n", db).unwrap_err().contains("does not exist"));
    }

    #[test]
    fn lookup_reads_the_user_database() {
        let root = lookup("root").unwrap().expect("root exists");
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0), "{root:?}");
        assert_eq!(lookup("motley-no-such-user").unwrap(), None);
        assert!(lookup("a\0b").is_err());
    }
}
