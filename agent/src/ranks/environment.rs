//! What of the agent's own environment a rank inherits: an allow-list, never the whole of it.
//!
//! The agent runs as root beside every job of every user, and its environment holds what is
//! the agent's alone: its settings (`MOTLEY_*`, the coordinator token among them) and the cloud
//! credentials its checkpoint tier uses (`AWS_*`, `GOOGLE_*`, `AZURE_*`, docs/state.md). A rank
//! gets the variables named here (PATH, the locale, the time zone and the like), the ones the
//! operator adds (`--rank-env`), then the job's own `envs:` and the agent's `MOTLEY_*` and
//! torchrun variables for its place in the plan.

use std::ffi::OsString;

/// Inherited by every rank: what a program needs to find its tools and speak the node's
/// language, and nothing that grants anything.
pub const DEFAULT_ALLOWED: &[&str] = &["PATH", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "TMPDIR"];

/// Inherited as well when the rank runs as the agent's own user (a job that names no `user`):
/// then they describe the rank's user too. Otherwise the launch sets them to the job's user's.
pub const SAME_USER_ALLOWED: &[&str] = &["HOME", "USER", "LOGNAME", "SHELL"];

/// One allowed name (`NCCL_SOCKET_IFNAME`) or prefix (`NCCL_*`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Allowed {
    Name(String),
    Prefix(String),
}

impl Allowed {
    fn matches(&self, key: &str) -> bool {
        match self {
            Allowed::Name(n) => key == n,
            Allowed::Prefix(p) => key.starts_with(p.as_str()),
        }
    }
}

/// The allow-list a supervisor applies to every rank it launches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    allowed: Vec<Allowed>,
    same_user: Vec<Allowed>,
}

impl Default for RankEnv {
    fn default() -> RankEnv {
        let parse = |names: &[&str]| names.iter().map(|n| parse_one(n).expect("the built-in names are valid")).collect();
        RankEnv { allowed: parse(DEFAULT_ALLOWED), same_user: parse(SAME_USER_ALLOWED) }
    }
}

impl RankEnv {
    /// The defaults plus the operator's names (`--rank-env`): each a variable name, or a prefix
    /// ending in `*`. Names of the agent's own settings (`MOTLEY_*`) are refused: they carry
    /// its token.
    pub fn with_extra<S: AsRef<str>>(extra: &[S]) -> Result<RankEnv, String> {
        let mut env = RankEnv::default();
        for name in extra {
            let name = name.as_ref().trim();
            if name.is_empty() {
                continue;
            }
            env.allowed.push(parse_one(name)?);
        }
        Ok(env)
    }

    /// The agent's variables (`vars`, normally `std::env::vars_os()`) a rank inherits.
    pub fn inherited(&self, vars: impl IntoIterator<Item = (OsString, OsString)>, as_agent_user: bool) -> Vec<(OsString, OsString)> {
        vars.into_iter()
            .filter(|(k, _)| {
                let Some(k) = k.to_str() else { return false };
                if k.starts_with("MOTLEY_") {
                    return false;
                }
                self.allowed.iter().any(|a| a.matches(k)) || (as_agent_user && self.same_user.iter().any(|a| a.matches(k)))
            })
            .collect()
    }
}

fn parse_one(name: &str) -> Result<Allowed, String> {
    let (stem, prefix) = match name.strip_suffix('*') {
        Some(stem) => (stem, true),
        None => (name, false),
    };
    let valid = !stem.is_empty()
        && stem.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && stem.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(format!(
            "rank_env: {name:?} is not a variable name or a prefix ending in '*' (e.g. LD_LIBRARY_PATH or NCCL_*); \
             a bare '*' is refused, since it would hand the agent's credentials to every rank"
        ));
    }
    if "MOTLEY_".starts_with(stem) || stem.starts_with("MOTLEY_") {
        return Err(format!(
            "rank_env: {name:?} would pass the agent's own settings (MOTLEY_*, its token among them) to ranks; \
             set what a job needs in its `envs:` instead"
        ));
    }
    Ok(if prefix { Allowed::Prefix(stem.to_string()) } else { Allowed::Name(stem.to_string()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs.iter().map(|(k, v)| (OsString::from(k), OsString::from(v))).collect()
    }

    fn keys(v: Vec<(OsString, OsString)>) -> Vec<String> {
        let mut k: Vec<_> = v.into_iter().map(|(k, _)| k.into_string().unwrap()).collect();
        k.sort();
        k
    }

    #[test]
    fn only_allowed_variables_reach_a_rank() {
        let agent = vars(&[
            ("PATH", "/usr/bin"),
            ("LC_ALL", "C.UTF-8"),
            ("TZ", "UTC"),
            ("HOME", "/root"),
            ("MOTLEY_TOKEN", "secret"),
            ("AWS_SECRET_ACCESS_KEY", "k"),
            ("GOOGLE_APPLICATION_CREDENTIALS", "/etc/key.json"),
            ("AZURE_STORAGE_ACCESS_KEY", "k"),
            ("LD_PRELOAD", "/tmp/x.so"),
            ("NCCL_SOCKET_IFNAME", "eth0"),
        ]);
        let env = RankEnv::default();
        assert_eq!(keys(env.inherited(agent.clone(), false)), ["LC_ALL", "PATH", "TZ"]);
        assert_eq!(keys(env.inherited(agent.clone(), true)), ["HOME", "LC_ALL", "PATH", "TZ"], "the agent's own user keeps HOME");
        let env = RankEnv::with_extra(&["NCCL_*", "LD_LIBRARY_PATH"]).unwrap();
        assert_eq!(keys(env.inherited(agent, false)), ["LC_ALL", "NCCL_SOCKET_IFNAME", "PATH", "TZ"]);
    }

    #[test]
    fn operator_names_are_checked() {
        for bad in ["*", "MOTLEY_*", "MOT*", "MOTLEY_TOKEN", "1X", "A-B", "A*B*"] {
            let err = RankEnv::with_extra(&[bad]).unwrap_err();
            assert!(err.starts_with("rank_env: "), "{bad}: {err}");
        }
        assert!(RankEnv::with_extra(&["CUDA_*", " ", "X"]).is_ok());
    }
}
