//! `/etc/motley/agent.toml`: every flag of `motley-agent` may be set there, under its long
//! name with '_' for '-' (`work_dir = "/var/lib/motley-agent"`). Precedence: flag, then
//! `MOTLEY_*` environment, then the file, then the built-in default. A missing default file is
//! fine (no settings); a file named with `--config`/`MOTLEY_CONFIG` must exist. Unknown keys
//! are an error that names them: a misspelt key silently ignored would run the agent with a
//! default the operator thought they had changed.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{AgentError, Result};

pub const DEFAULT_PATH: &str = "/etc/motley/agent.toml";

#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub coordinator: Option<String>,
    pub node: Option<String>,
    pub inventory: Option<PathBuf>,
    pub token: Option<String>,
    pub work_dir: Option<PathBuf>,
    pub address: Option<String>,
    pub logs_listen: Option<String>,
    pub sysfs_root: Option<PathBuf>,
    pub rdma_domain: Option<String>,
    pub ca_cert: Option<PathBuf>,
    pub keep_finished_hours: Option<f64>,
    pub allow_root_ranks: Option<bool>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

/// Read the config file; `explicit` when the operator named it (then it must exist).
pub fn load(path: &Path, explicit: bool) -> Result<FileConfig> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return Ok(FileConfig::default()),
        Err(err) => return Err(AgentError::Read { flag: "--config", path: path.to_path_buf(), err }),
    };
    parse(&text).map_err(|message| AgentError::Config { path: path.to_path_buf(), message })
}

/// The file's settings, or the parser's message (which names an unknown key and its line).
pub fn parse(text: &str) -> std::result::Result<FileConfig, String> {
    toml::from_str(text).map_err(|e: toml::de::Error| {
        let line = e.span().map_or(0, |s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        format!("line {line}: {}", e.message())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_read_and_an_unknown_one_is_named() {
        let c = parse("coordinator = \"http://c:7071\"\nwork_dir = \"/w\"\nlogs_listen = \"127.0.0.1:0\"\n").unwrap();
        assert_eq!(c.coordinator.as_deref(), Some("http://c:7071"));
        assert_eq!(c.work_dir, Some(PathBuf::from("/w")));
        assert_eq!(c.logs_listen.as_deref(), Some("127.0.0.1:0"));
        assert_eq!(parse("allow_root_ranks = true\n").unwrap().allow_root_ranks, Some(true));
        let c = parse("tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\n").unwrap();
        assert_eq!((c.tls_cert, c.tls_key), (Some(PathBuf::from("/c.pem")), Some(PathBuf::from("/k.pem"))));
        let e = parse("work_dri = \"/w\"\n").unwrap_err();
        assert!(e.contains("work_dri"), "{e}");
        let e = parse("address = 7\n").unwrap_err();
        assert!(e.contains("address") || e.contains("string"), "{e}");
    }

    #[test]
    fn a_missing_default_file_is_no_settings_but_a_named_one_is_an_error() {
        let p = Path::new("/nonexistent/motley/agent.toml");
        assert_eq!(load(p, false).unwrap(), FileConfig::default());
        let e = load(p, true).unwrap_err().to_string();
        assert!(e.starts_with("--config: cannot read /nonexistent/motley/agent.toml"), "{e}");
    }
}
