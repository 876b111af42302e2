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
    #[error(transparent)]
    Tls(#[from] motley_server::ServerError),
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
    /// A checkpoint file could not be fetched from a peer (refused, unreachable, stalled,
    /// corrupt in flight, or not the manifest's copy). `message` says why and what to do; in
    /// every case the bytes from this peer are not to be used: fetch from another holder.
    #[error("checkpoint data plane: peer {peer}, file {file}: {message}")]
    DataPlane { peer: String, file: String, message: String },
    /// A link probe to a peer's data plane failed (refused, unreachable, stalled, not the
    /// protocol): no measurement of that link this time.
    #[error("link probe to {peer}: {message}")]
    Probe { peer: String, message: String },
    /// A launch's `MOTLEY_CKPT_KEEP` that is not a count of steps.
    #[error("job {job}: MOTLEY_CKPT_KEEP={value}: not a number of checkpoint steps of at least 1; set checkpoint: {{keep: N}} with N >= 1 (default 2)")]
    CkptKeep { job: i64, value: String },
    /// A launch's `MOTLEY_CKPT_CLOUD` that is not an object store URL this agent can use.
    #[error(
        "MOTLEY_CKPT_CLOUD={url}: {message}; give file:///ABSOLUTE/PATH, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX"
    )]
    CloudUrl { url: String, message: String },
    /// A file:// cloud a root agent does not use for a job whose ranks run as another user
    /// (`checkpoints::file_roots`): uploads to it are skipped, restores from it fail.
    #[error(
        "job {job}: checkpoint cloud {url}: refused: {why}; a root agent writes or reads a file:// cloud for a job of another user \
         only under a directory named by --cloud-file-root (MOTLEY_CLOUD_FILE_ROOT): give the agent one and the job a URL under it, \
         or use s3://, gs:// or az://. The job's checkpoints stay on this node's tiers"
    )]
    CloudFileRefused { url: String, job: i64, why: String },
    /// A `--cloud-file-root` the agent cannot keep others' links out of.
    #[error("--cloud-file-root {}: {why}; give an absolute directory of the agent's own user that no one else can write (e.g. chown root DIR && chmod 700 DIR), or drop it from the flag", path.display())]
    CloudFileRoot { path: PathBuf, why: String },
    /// A cloud scheme whose object store this agent was built without.
    #[error("MOTLEY_CKPT_CLOUD={url}: this motley-agent was built without the {feature} feature; build it with `cargo build -p motley-agent --features {feature}`, or use a file:// URL")]
    CloudFeature { url: String, feature: &'static str },
    /// An object store operation that failed (network, credentials, a missing object).
    #[error("cloud {op} {key}: {err}")]
    Cloud { op: &'static str, key: String, err: object_store::Error },
    /// A copy whose length or chunk crc is not what the manifest piece says: not kept.
    #[error("{what}: {err}")]
    Corrupt { what: String, err: motley_checkpoint::CkptError },
    /// Not enough free space on the disk tier for a step.
    #[error(
        "{}: step {step} of job {job} needs {need} bytes plus a margin of {margin}, the file system has {free} free; \
         the step stays in memory and the previous step on disk stays the restore point: free space or lower checkpoint: {{keep}}",
        path.display()
    )]
    NoSpace { path: PathBuf, job: i64, step: u64, need: u64, margin: u64, free: u64 },
    /// A file name from a manifest piece, a restore, a cloud marker or a peer that is not one
    /// the checkpoint format makes (`safe_fs::check_name`): it could name a file outside its
    /// step directory.
    #[error(
        "file {name:?} is not a checkpoint file name (a unit like layer.00003.model.tp0-2.safetensors, \
         rank.00000.safetensors, manifest.rank.00000.json or manifest.json; docs/checkpoint.md); refused"
    )]
    FileName { name: String },
    /// A path in a directory a rank can write that goes through a symbolic link or out of the
    /// directory: the agent, as root, does not follow it (`safe_fs`).
    #[error("{}: refused: a symbolic link or a path out of its directory, where the agent acts as root; the rank's checkpoints or logs must be plain files and directories", path.display())]
    Unsafe { path: PathBuf },
    /// What should be a regular file (a log, a checkpoint file, a marker) is something else.
    #[error("{}: not a regular file; refused", path.display())]
    NotAFile { path: PathBuf },
    /// A file a rank wrote that is larger than the agent reads whole.
    #[error("{}: over the {limit} bytes the agent reads of such a file; refused", path.display())]
    TooLarge { path: PathBuf, limit: u64 },
    /// A directory the agent must own alone (the memory tier's root) that someone else made
    /// or may write.
    #[error("{}: {why}; it must be a directory of the agent's own that nobody else can write: remove it (another user may have made it to read the checkpoints), or give --shm-dir another directory", path.display())]
    NotPrivate { path: PathBuf, why: String },
    /// The checkpoint data plane's RDMA path (feature `rdma`): the device (or that there is
    /// none), the file, what failed and the fix.
    #[error("RDMA ({device}): {message}")]
    Rdma { device: String, message: String },
    /// A preemption notice older than the one the launch already has (instructions crossing).
    #[error("preemption notice {given} of job {job} generation {generation}: notice {newer} is newer; ignored")]
    StaleNotice { job: i64, generation: i64, given: i64, newer: i64 },
    /// A membership whose document the coordinator did not write as the ranks read it.
    #[error("membership epoch {epoch} of job {job}: {message}")]
    BadMembership { job: i64, epoch: i64, message: String },
    /// A membership older than the one the launch already has (instructions crossing).
    #[error("membership epoch {given} of job {job} generation {generation}: epoch {newer} is newer; ignored")]
    StaleMembership { job: i64, generation: i64, given: i64, newer: i64 },
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;
