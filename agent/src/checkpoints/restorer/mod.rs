//! Restores on this node (docs/recovery.md, "A recovery, step by step", step 6): a `Restore`
//! instruction names every checkpoint file of one step the ranks of the job's next launch load
//! here, and where each of its byte ranges comes from (this node's own tiers, a peer's data plane,
//! the cloud). The restorer fetches them, verifies every chunk's CRC-32C against the manifest, cuts
//! the units the new plan shards differently (`MakeUnit`, `motley_checkpoint::reslice_unit`),
//! writes the list the ranks read (`MOTLEY_CKPT_RESTORE`) and reports a `RestoreResult` until
//! acknowledged.
//!
//! Files land in `WORK_DIR/restore/JOB/SOURCE_GENERATION/step-S/` (where the data plane serves
//! them to peers that relay through this node) through a temporary name, never half-written
//! under the final one. A file already there that verifies is kept (a restore resumed after a
//! coordinator failover skips it). A source that fails mid-way, or a copy whose chunk does not
//! verify, is replaced by the next holder in the instruction's fallbacks, then the cloud; each
//! repair is reported. A restore for a generation older than one this agent was already asked
//! to restore for the job is refused. Before fetching, the free space of the work directory
//! must hold what is missing.
//!
//! This file holds the restorer's state and what the coordinator exchanges with it (reports,
//! acknowledgements); `run` orchestrates one restore, `sources` fetches bytes, `verify` checks
//! them (and has a corrupt chunk fetched again by `sources`), `budget` is the memory and the
//! blocking threads both work through, `kept` is what survives an agent restart.

mod budget;
mod kept;
mod run;
mod sources;
mod verify;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use motley_checkpoint::manifest::step_dir_name;
use motley_proto::v1::{Restore, RestoreResult};

use crate::checkpoints::dataplane::{Arriving, Pacer, Resolve};

/// The launch environment variable the coordinator sets on a recovery's launch: the step its
/// ranks resume from (the agent then points MOTLEY_CKPT_RESTORE at `launch_list`).
pub const RESTORE_STEP_ENV: &str = "MOTLEY_CKPT_RESTORE_STEP";
/// Finished restores by (job, generation), with the message that last carried each.
type Results = BTreeMap<(i64, i64), (RestoreResult, Option<u64>)>;

/// This node's side of restores.
#[derive(Clone)]
pub struct Restorer {
    inner: Arc<Inner>,
}

struct Inner {
    work_dir: PathBuf,
    node: String,
    /// This agent's TLS client where it has TLS: peers are then fetched from over TLS only.
    tls: Option<crate::checkpoints::dataplane::ClientTls>,
    /// Where this node's own copies are (its memory tier, its disk).
    resolver: Arc<dyn Resolve>,
    arriving: Arc<Arriving>,
    /// The node's NIC (peer and cloud bytes in) and its disk reads.
    nic_in: Arc<Pacer>,
    disk_read: Arc<Pacer>,
    /// Finished restores not yet acknowledged, by (job, generation); the message that last
    /// carried each in this session.
    results: Mutex<Results>,
    running: Mutex<BTreeSet<(i64, i64)>>,
    /// An ask that came while a restore of its launch ran: it runs next.
    queued: Mutex<HashMap<(i64, i64), Restore>>,
    /// The newest generation each job was restored for: older ones are refused.
    newest: Mutex<HashMap<i64, i64>>,
    changed: tokio::sync::Notify,
    /// The tiers: a step being restored from is pinned (never pruned meanwhile).
    tierer: Option<Arc<crate::checkpoints::tiers::Tierer>>,
    /// This node can READ over RDMA (built with the feature, a device present).
    rdma: bool,
    /// The free bytes of a directory's file system (`crate::node::load::free_bytes`; tests inject a
    /// full disk).
    free_bytes: fn(&Path) -> Option<u64>,
}

/// The RDMA device this agent READs through, if it was built with the `rdma` feature and the
/// host has one.
pub fn rdma_device() -> Option<String> {
    #[cfg(feature = "rdma")]
    {
        crate::checkpoints::rdma::available().ok()
    }
    #[cfg(not(feature = "rdma"))]
    {
        None
    }
}

/// The directory a restore's files of `source_generation` land in.
pub fn restore_dir(work_dir: &Path, job: i64, source_generation: i64, step: u64) -> PathBuf {
    work_dir.join("restore").join(job.to_string()).join(source_generation.to_string()).join(step_dir_name(step))
}

/// The list of files launch `generation` of `job` loads (`MOTLEY_CKPT_RESTORE`).
pub fn launch_list(work_dir: &Path, job: i64, generation: i64) -> PathBuf {
    work_dir.join("restore").join(job.to_string()).join(format!("launch-{generation}.json"))
}

/// Job `job` ended here (every launch directory of it pruned): the copies its restores left
/// go (`restore/JOB/SOURCE_GENERATION/` and the launch lists); its fence (`newest`) and
/// results not yet acknowledged stay. Returns what was removed, for the log.
pub fn remove_copies(work_dir: &Path, job: i64) -> Vec<String> {
    let dir = work_dir.join("restore").join(job.to_string());
    let entries = std::fs::read_dir(&dir).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
    let mut removed = vec![];
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let done = if name.parse::<i64>().is_ok() {
            std::fs::remove_dir_all(e.path())
        } else if name.starts_with("launch-") && name.ends_with(".json") {
            std::fs::remove_file(e.path())
        } else {
            continue;
        };
        match done {
            Ok(()) => removed.push(format!("job {job}: ended, its restored copy {} removed", e.path().display())),
            Err(err) => tracing::warn!("{}: {err}; a restored copy of an ended job stays", e.path().display()),
        }
    }
    removed
}

/// Give every file launch list `list` names to the rank's user (an agent running as root
/// restores files as root; ranks run as the job's user and only read them). The list stays
/// the agent's (made readable, 0644): it is read again for each rank of the launch, so a rank
/// that could rewrite it could name any file of the node for the next hand-over. It is read
/// only if the agent owns it, and only files of the job's own restore directory (the list's
/// directory, `restore/JOB/`) are handed over.
pub fn hand_over(work_dir: &Path, list: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("{}: {why}", list.display()));
    let mut f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC).open(list)?;
    let meta = f.metadata()?;
    if !meta.is_file() || meta.nlink() != 1 || meta.uid() != crate::safe_fs::euid() {
        return Err(refuse("not a launch list of the agent's own (a regular file it owns)".into()));
    }
    let mut bytes = vec![];
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut f, 64 << 20), &mut bytes)?;
    let paths: Vec<String> = serde_json::from_slice(&bytes).map_err(std::io::Error::other)?;
    let own = list.parent().ok_or_else(|| refuse("has no directory".into()))?;
    for p in paths.iter().map(PathBuf::from) {
        let inside = p.strip_prefix(own).is_ok_and(|rel| rel.components().all(|c| matches!(c, std::path::Component::Normal(_))));
        if !inside {
            return Err(refuse(format!("names {}, outside the job's restore directory {}", p.display(), own.display())));
        }
        // Passable (0711, not listable) directories down to it, the file its own.
        crate::workdir::open_passage(work_dir, &p).map_err(std::io::Error::other)?;
        crate::workdir::hand_over(&p, uid, gid).map_err(std::io::Error::other)?;
    }
    crate::workdir::open_passage(work_dir, list).map_err(std::io::Error::other)?;
    if meta.mode() & 0o777 != 0o644 {
        f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    }
    Ok(())
}

/// Every file name restore `r` joins to a directory (its files, the units it cuts and their
/// sources) is one checkpoint file name (`safe_fs::check_name`): a name a forged piece or
/// cloud marker slipped into the coordinator's plan must not write as root outside the step's
/// restore directory.
pub(super) fn check_names(r: &Restore) -> Result<(), String> {
    let names = r.files.iter().map(|f| &f.file).chain(r.make.iter().flat_map(|m| std::iter::once(&m.file).chain(&m.sources)));
    for name in names {
        crate::safe_fs::check_name(name).map_err(|e| format!("refused: the restore of step {} names {e}", r.step))?;
    }
    Ok(())
}

/// Bytes by where they came from, and what was repaired on the way.
#[derive(Default)]
struct Tally {
    local: u64,
    peer: u64,
    cloud: u64,
    repaired: Vec<String>,
    skipped: u32,
}
impl Restorer {
    /// `resolver` finds this node's own copies; `arriving` is the data plane's registry of
    /// files being fetched (served to relaying peers once complete). Unacknowledged results
    /// an earlier agent left are picked up.
    pub fn new(
        work_dir: &Path,
        node: &str,
        tls: Option<crate::checkpoints::dataplane::ClientTls>,
        resolver: Arc<dyn Resolve>,
        arriving: Arc<Arriving>,
        nic_in: Arc<Pacer>,
        disk_read: Arc<Pacer>,
    ) -> Restorer {
        let (results, newest) = kept::read_back(work_dir);
        Restorer {
            inner: Arc::new(Inner {
                work_dir: work_dir.to_path_buf(),
                node: node.to_string(),
                tls,
                resolver,
                arriving,
                nic_in,
                disk_read,
                results: Mutex::new(results),
                running: Mutex::default(),
                queued: Mutex::default(),
                newest: Mutex::new(newest),
                changed: tokio::sync::Notify::new(),
                tierer: None,
                rdma: rdma_device().is_some(),
                free_bytes: crate::node::load::free_bytes,
            }),
        }
    }

    /// Pin the steps restores read from in these tiers while they run.
    pub fn with_tierer(mut self, tierer: Arc<crate::checkpoints::tiers::Tierer>) -> Restorer {
        Arc::get_mut(&mut self.inner).expect("configured before it is shared").tierer = Some(tierer);
        self
    }

    /// Measure free space with `free_bytes` instead of `crate::node::load::free_bytes` (tests: a full disk).
    pub fn with_free_bytes(mut self, free_bytes: fn(&Path) -> Option<u64>) -> Restorer {
        Arc::get_mut(&mut self.inner).expect("configured before it is shared").free_bytes = free_bytes;
        self
    }

    /// Resolves when a restore finished (its result is to be reported).
    pub async fn changed(&self) {
        self.inner.changed.notified().await
    }

    /// A new session: every unacknowledged result is sent again.
    pub fn new_session(&self) {
        for (_, sent) in self.inner.results.lock().expect("restore results").values_mut() {
            *sent = None;
        }
    }

    /// The results not yet sent in this session, marked as sent in message `seq`.
    pub fn report(&self, seq: u64) -> Vec<RestoreResult> {
        let mut results = self.inner.results.lock().expect("restore results");
        let mut out = vec![];
        for (r, sent) in results.values_mut().filter(|(_, sent)| sent.is_none()) {
            *sent = Some(seq);
            out.push(r.clone());
        }
        out
    }

    /// The coordinator holds what message `seq` said.
    pub fn ack(&self, seq: u64) {
        let mut results = self.inner.results.lock().expect("restore results");
        let done: Vec<(i64, i64)> = results.iter().filter(|(_, (_, sent))| *sent == Some(seq)).map(|(k, _)| *k).collect();
        for (job, generation) in done {
            results.remove(&(job, generation));
            let _ = std::fs::remove_file(kept::result_path(&self.inner.work_dir, job, generation));
        }
    }
}

impl Restorer {
    /// Restore `r` succeeded: what earlier restores of its job left goes (each recovery would
    /// otherwise leave a full copy behind): every step directory under `restore/JOB/` this
    /// restore does not read, and the launch lists of older generations (their ranks were
    /// replaced by this generation's). Not while a newer generation of the job was asked for
    /// (that one sweeps).
    pub(super) fn sweep_older(&self, r: &Restore) {
        if self.inner.newest.lock().expect("newest").get(&r.job).is_some_and(|&g| g > r.generation) {
            return;
        }
        let used: BTreeSet<i64> = r.files.iter().map(|f| f.source_generation).collect();
        let job_dir = self.inner.work_dir.join("restore").join(r.job.to_string());
        let entries = std::fs::read_dir(&job_dir).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let stale = if let Ok(g) = name.parse::<i64>() {
                // A source generation: its steps other than this restore's go.
                let steps = std::fs::read_dir(e.path()).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
                for s in steps.iter().filter(|s| !(used.contains(&g) && s.file_name() == step_dir_name(r.step).as_str())) {
                    self.remove_restored(&s.path());
                }
                let _ = std::fs::remove_dir(e.path()); // only if empty
                false
            } else {
                name.strip_prefix("launch-")
                    .and_then(|n| n.strip_suffix(".json"))
                    .and_then(|n| n.parse::<i64>().ok())
                    .is_some_and(|g| g < r.generation)
            };
            if stale {
                self.remove_restored(&e.path());
            }
        }
    }

    fn remove_restored(&self, path: &Path) {
        let removed = if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
        match removed {
            Ok(()) => tracing::info!(node = %self.inner.node, "{}: an earlier restore's copy, removed", path.display()),
            Err(e) => tracing::warn!(node = %self.inner.node, "{}: {e}; an earlier restore's copy stays", path.display()),
        }
    }
}

fn merge(into: &mut Tally, t: Tally) {
    into.local += t.local;
    into.peer += t.peer;
    into.cloud += t.cloud;
    into.skipped += t.skipped;
    into.repaired.extend(t.repaired);
}

#[cfg(test)]
mod hand_over_tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    /// The launch list is read again for each rank of a launch: a list the rank's user could
    /// rewrite (not the agent's), or one naming a file outside the job's restore directory,
    /// hands nothing over; the agent's own list gives its files to the user and stays the
    /// agent's, readable.
    #[test]
    fn only_the_agents_own_list_of_the_jobs_own_files_is_handed_over() {
        if !crate::root_only::can_run("only_the_agents_own_list_of_the_jobs_own_files_is_handed_over", &[crate::root_only::Need::Root]) {
            return;
        }
        let work = std::env::temp_dir().join(format!("motley-hand-over-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        let list = launch_list(&work, 5, 2);
        let step = list.parent().unwrap().join("1/step-00000001");
        std::fs::create_dir_all(&step).unwrap();
        let file = step.join("rank.00000.safetensors");
        std::fs::write(&file, b"r").unwrap();
        let outside = work.join("agent-secret");
        std::fs::write(&outside, b"s").unwrap();
        let write_list = |paths: &[&Path]| std::fs::write(&list, serde_json::to_vec(&paths).unwrap()).unwrap();

        write_list(&[&file, &outside]);
        let err = hand_over(&work, &list, 65534, 65534).unwrap_err().to_string();
        assert!(err.contains("outside the job's restore directory"), "{err}");
        write_list(&[&step.join("../../../../agent-secret")]);
        assert!(hand_over(&work, &list, 65534, 65534).is_err(), "a path with .. is refused");
        assert_eq!(std::fs::metadata(&outside).unwrap().uid(), 0, "the agent's file stays its own");

        write_list(&[&file]);
        std::os::unix::fs::chown(&list, Some(65534), Some(65534)).unwrap();
        let err = hand_over(&work, &list, 65534, 65534).unwrap_err().to_string();
        assert!(err.contains("not a launch list of the agent's own"), "{err}");

        std::os::unix::fs::chown(&list, Some(0), Some(0)).unwrap();
        hand_over(&work, &list, 65534, 65534).unwrap();
        assert_eq!(std::fs::metadata(&file).unwrap().uid(), 65534, "the restored file is the rank's user's");
        let meta = std::fs::metadata(&list).unwrap();
        assert_eq!((meta.uid(), meta.permissions().mode() & 0o777), (0, 0o644), "the list stays the agent's, readable");
        std::fs::remove_dir_all(&work).unwrap();
    }
}
