//! Where a root agent keeps a `file://` checkpoint cloud for a job whose ranks run as another
//! user (docs/state.md, "What a rank can and cannot do to its node"). The object store writes
//! and reads such a URL as root, following links: a job naming `file:///etc/cron.d` would have
//! root write there, and a user who planted links under a shared directory would redirect it. So
//! such a URL is used only under one of the operator's `--cloud-file-root` directories: the
//! agent's own, writable by no one else, so that no user can reach, let alone plant a link in,
//! what the agent creates below it. Elsewhere (an agent that is not root, ranks that run as the
//! agent's own user) file:// URLs are used as given; s3://, gs://, az:// are never affected.

use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{AgentError, Result};
use crate::safe_fs::{self, Dir};

/// The operator's settings, fixed at start (`configure`).
#[derive(Clone, Debug, Default)]
struct Config {
    roots: Vec<PathBuf>,
    /// Jobs that name no user run as root here: whoever submits one already runs code as root,
    /// so a restore for a job this node never launched (its user unknown) is not held back.
    allow_root_ranks: bool,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The agent's `--cloud-file-root` directories, each checked (`check_root`), and its
/// `--allow-root-ranks`. Once per process; a later call changes nothing. Unconfigured, no
/// root is allowed and root ranks are not: a file:// URL of another user's job is refused.
pub fn configure(roots: &[PathBuf], allow_root_ranks: bool) -> Result<()> {
    for r in roots {
        check_root(r)?;
    }
    let _ = CONFIG.set(Config { roots: roots.to_vec(), allow_root_ranks });
    Ok(())
}

/// An absolute directory (not a link) of the agent's uid that no one else can write.
pub fn check_root(root: &Path) -> Result<()> {
    let bad = |why: String| AgentError::CloudFileRoot { path: root.to_path_buf(), why };
    if !root.is_absolute() || root.components().any(|c| matches!(c, Component::ParentDir | Component::CurDir)) {
        return Err(bad("not an absolute path without . or .. components".into()));
    }
    let dir = Dir::open(root).map_err(|e| bad(format!("not a directory the agent can open without following a link ({e})")))?;
    let st = dir.own_stat()?;
    if st.st_uid != safe_fs::euid() {
        return Err(bad(format!("it belongs to uid {}, not to the agent's uid {}", st.st_uid, safe_fs::euid())));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(bad(format!("its mode {:o} lets others write it", st.st_mode & 0o7777)));
    }
    Ok(())
}

/// Whether this agent may use `url` for job `job`: `ranks_as_agent` says whether the job's
/// ranks run as the agent's own uid (None: not known here, e.g. a restore on a node that never
/// launched the job). A refusal names the URL, the job and the fix.
pub fn admit(url: &str, job: i64, ranks_as_agent: Option<bool>) -> Result<()> {
    let config = CONFIG.get().cloned().unwrap_or_default();
    let guarded = safe_fs::euid() == 0 && !ranks_as_agent.unwrap_or(config.allow_root_ranks);
    admit_with(url, job, guarded, &config.roots)
}

/// `admit` with its inputs given: `guarded`, a root agent and a job of another user.
pub fn admit_with(url: &str, job: i64, guarded: bool, roots: &[PathBuf]) -> Result<()> {
    let Some(rest) = url.get(..7).filter(|s| s.eq_ignore_ascii_case("file://")).map(|_| &url[7..]) else { return Ok(()) };
    if !guarded {
        return Ok(());
    }
    let refuse = |why: String| AgentError::CloudFileRefused { url: url.into(), job, why };
    // Lexical, on the URL as given: parsing folds `..` (also percent-encoded, or split by a tab
    // the parser drops) away, so what would be folded is refused, not interpreted.
    if rest.split(['/', '\\']).any(|s| s == "." || s == "..") {
        return Err(refuse("it has a . or .. component".into()));
    }
    if rest.chars().any(|c| c.is_control() || c.is_whitespace() || matches!(c, '%' | '?' | '#')) {
        return Err(refuse("it has percent-encoding, white space, a query or a fragment".into()));
    }
    let path =
        url::Url::parse(url).ok().and_then(|u| u.to_file_path().ok()).ok_or_else(|| refuse("not an absolute path on this node".into()))?;
    if roots.is_empty() {
        return Err(refuse("this agent has no --cloud-file-root".into()));
    }
    if !roots.iter().any(|r| path.starts_with(r)) {
        let list: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
        return Err(refuse(format!("it is outside every --cloud-file-root ({})", list.join(", "))));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn roots() -> Vec<PathBuf> {
        vec![PathBuf::from("/srv/motley-cloud"), PathBuf::from("/data/ckpt")]
    }

    #[test]
    fn a_url_inside_a_root_is_admitted() {
        admit_with("file:///srv/motley-cloud", 1, true, &roots()).unwrap();
        admit_with("file:///srv/motley-cloud/team/a", 1, true, &roots()).unwrap();
        admit_with("file:///data/ckpt/x/", 1, true, &roots()).unwrap();
    }

    #[test]
    fn a_url_outside_every_root_is_refused_naming_url_job_and_fix() {
        for url in ["file:///etc/cron.d", "file:///srv/motley-cloud-evil/x", "file:///srv", "FILE:///tmp/x", "file://host/srv/motley-cloud"]
        {
            let e = admit_with(url, 7, true, &roots()).unwrap_err().to_string();
            assert!(e.contains(url) && e.contains("job 7") && e.contains("--cloud-file-root"), "{e}");
        }
    }

    #[test]
    fn dot_dot_and_encodings_are_refused() {
        for url in [
            "file:///srv/motley-cloud/../../etc",
            "file:///srv/motley-cloud/./x",
            "file:///srv/motley-cloud/%2e%2e/etc",
            "file:///srv/motley-cloud/.\t./etc",
            "file:///srv/motley-cloud\\..\\etc",
        ] {
            let e = admit_with(url, 1, true, &roots()).unwrap_err().to_string();
            assert!(e.contains("refused"), "{url}: {e}");
        }
    }

    #[test]
    fn no_roots_refuses_and_unguarded_or_other_schemes_pass() {
        let e = admit_with("file:///srv/motley-cloud/x", 1, true, &[]).unwrap_err().to_string();
        assert!(e.contains("no --cloud-file-root"), "{e}");
        admit_with("file:///etc/cron.d", 1, false, &[]).unwrap();
        admit_with("s3://bucket/../x", 1, true, &[]).unwrap();
        admit_with("gs://bucket/p", 1, true, &[]).unwrap();
    }

    #[test]
    fn a_root_others_can_write_or_not_a_directory_is_refused_at_start() {
        let dir = std::env::temp_dir().join(format!("motley-file-roots-{}", std::process::id()));
        let root = dir.join("cloud");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
        check_root(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_root(&root).unwrap_err().to_string();
        assert!(e.contains("--cloud-file-root") && e.contains("777"), "{e}");
        std::os::unix::fs::symlink(&root, dir.join("link")).unwrap();
        assert!(check_root(&dir.join("link")).is_err());
        assert!(check_root(Path::new("relative/dir")).is_err());
        assert!(check_root(&dir.join("cloud/../cloud")).is_err());
        // Only root can give the directory away.
        if crate::root_only::can_run(
            "a_root_others_can_write_or_not_a_directory_is_refused_at_start (another user's)",
            &[crate::root_only::Need::Root],
        ) {
            std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
            std::os::unix::fs::chown(&root, Some(65534), None).unwrap();
            let e = check_root(&root).unwrap_err().to_string();
            assert!(e.contains("uid 65534"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
