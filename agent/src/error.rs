//! The agent library's one error type: each variant names the flag, file or field at fault
//! and, where there is one, the fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A file the operator pointed at (config, inventory) cannot be read.
    #[error("{flag}: cannot read {}: {err}", path.display())]
    Read { flag: &'static str, path: PathBuf, err: std::io::Error },
    /// The inventory file is not a node entry.
    #[error("{}: not YAML: {message}", path.display())]
    Inventory { path: PathBuf, message: String },
    /// Discovery found hardware the coordinator will not accept as it is.
    #[error("discovery: {0}; declare the node's hardware with --inventory FILE (a cluster-file node entry) instead")]
    Discovery(String),
    /// The log service's certificate or key (`--tls-cert`, `--tls-key`) is missing or unusable.
    #[error("{flag}: {message}")]
    Tls { flag: &'static str, message: String },
    /// A file or directory under the work directory.
    #[error("{what} {}: {err}", path.display())]
    Io { what: &'static str, path: PathBuf, err: std::io::Error },
    /// Another agent holds the work directory's lock: two agents on one directory would take
    /// each other's ranks.
    #[error(
        "--work-dir {}: another motley-agent is running on this directory (it holds agent.lock); stop it, or give this agent its own --work-dir",
        path.display()
    )]
    WorkDirBusy { path: PathBuf },
    /// The checkpoint data plane's RDMA path (feature `rdma`): the device (or that there is
    /// none), the file, what failed and the fix.
    #[error("RDMA ({device}): {message}")]
    Rdma { device: String, message: String },
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;
