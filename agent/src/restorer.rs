//! Restores on this node (issue 15, docs/recovery.md): a `Restore` instruction names every
//! checkpoint file of one step the ranks of the job's next launch load here, and where each of
//! its byte ranges comes from (this node's own tiers, a peer's data plane, the cloud). The
//! restorer fetches them, verifies every chunk's CRC-32C against the manifest, cuts the units
//! the new plan shards differently (`MakeUnit`, `motley_checkpoint::reslice_unit`), writes
//! the list the ranks read (`MOTLEY_CKPT_RESTORE`) and reports a `RestoreResult` until
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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_checkpoint::manifest::step_dir_name;
use motley_checkpoint::{FileEntry, Unit};
use motley_proto::v1::{FetchSource, Restore, RestoreFile, RestoreResult};
use serde::{Deserialize, Serialize};

use crate::dataplane::{self, Arriving, FileKey, Pacer, Peer, Resolve, Transport};

/// The launch environment variable the coordinator sets on a recovery's launch: the step its
/// ranks resume from (the agent then points MOTLEY_CKPT_RESTORE at `launch_list`).
pub const RESTORE_STEP_ENV: &str = "MOTLEY_CKPT_RESTORE_STEP";

/// Files fetched at once: all of them, as the plan's rates assume (each flow is paced to its
/// share), up to this bound on open connections and files.
const PARALLEL_FILES: usize = 256;
/// Bytes of one ranged read from the cloud.
const CLOUD_PIECE: u64 = 8 << 20;
/// Bytes kept free beyond what a restore writes.
const FREE_MARGIN: u64 = 64 << 20;

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
    token: Option<String>,
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
    tierer: Option<Arc<crate::tiers::Tierer>>,
    /// This node can READ over RDMA (built with the feature, a device present).
    rdma: bool,
    /// The free bytes of a directory's file system (`crate::load::free_bytes`; tests inject a
    /// full disk).
    free_bytes: fn(&Path) -> Option<u64>,
}

/// A finished restore as kept on disk until acknowledged.
#[derive(Serialize, Deserialize)]
struct Stored {
    job: i64,
    generation: i64,
    step: u64,
    error: String,
    local_bytes: u64,
    peer_bytes: u64,
    cloud_bytes: u64,
    transfer_s: f64,
    repaired: Vec<String>,
    skipped: u32,
    #[serde(default)]
    request: i64,
}

impl From<&RestoreResult> for Stored {
    fn from(r: &RestoreResult) -> Stored {
        Stored {
            job: r.job,
            generation: r.generation,
            step: r.step,
            error: r.error.clone(),
            local_bytes: r.local_bytes,
            peer_bytes: r.peer_bytes,
            cloud_bytes: r.cloud_bytes,
            transfer_s: r.transfer_s,
            repaired: r.repaired.clone(),
            skipped: r.skipped,
            request: r.request,
        }
    }
}

impl From<Stored> for RestoreResult {
    fn from(s: Stored) -> RestoreResult {
        RestoreResult {
            job: s.job,
            generation: s.generation,
            step: s.step,
            error: s.error,
            local_bytes: s.local_bytes,
            peer_bytes: s.peer_bytes,
            cloud_bytes: s.cloud_bytes,
            transfer_s: s.transfer_s,
            repaired: s.repaired,
            skipped: s.skipped,
            request: s.request,
        }
    }
}

/// The RDMA device this agent READs through, if it was built with the `rdma` feature and the
/// host has one.
pub fn rdma_device() -> Option<String> {
    #[cfg(feature = "rdma")]
    {
        crate::rdma::available().ok()
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

/// Give launch list `list` and every file it names to the rank's user (an agent running as
/// root restores files as root; ranks run as the job's user and only read them).
pub fn hand_over(work_dir: &Path, list: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    let paths: Vec<String> = serde_json::from_slice(&std::fs::read(list)?).map_err(std::io::Error::other)?;
    for p in paths.iter().map(PathBuf::from).chain(std::iter::once(list.to_path_buf())) {
        // Passable (0711, not listable) directories down to it, the file its own.
        crate::rankfiles::open_passage(work_dir, &p).map_err(std::io::Error::other)?;
        crate::rankfiles::hand_over(&p, uid, gid).map_err(std::io::Error::other)?;
    }
    Ok(())
}

fn result_path(work_dir: &Path, job: i64, generation: i64) -> PathBuf {
    work_dir.join("restore").join(job.to_string()).join(format!("result-{generation}.json"))
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

/// Remove what restores of an earlier agent process left half-written
/// (`restore/JOB/GEN/step-S/NAME.tmp.PID` and its `.copyK` scratch copies): nothing runs yet, and
/// a temporary name is never taken for a whole file, so they only hold disk space.
fn sweep_temporaries(root: &Path) {
    let dirs = |d: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(d).into_iter().flatten().flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()).collect()
    };
    for step_dir in dirs(root).iter().flat_map(|j| dirs(j)).flat_map(|g| dirs(&g)) {
        for f in std::fs::read_dir(&step_dir).into_iter().flatten().flatten() {
            if f.file_name().to_string_lossy().contains(".tmp.") {
                match std::fs::remove_file(f.path()) {
                    Ok(()) => tracing::info!("removed {}, left half-written by an earlier agent's restore", f.path().display()),
                    Err(e) => tracing::warn!("removing {}: {e}", f.path().display()),
                }
            }
        }
    }
}

impl Restorer {
    /// `resolver` finds this node's own copies; `arriving` is the data plane's registry of
    /// files being fetched (served to relaying peers once complete). Unacknowledged results
    /// an earlier agent left are picked up.
    pub fn new(
        work_dir: &Path,
        node: &str,
        token: Option<String>,
        resolver: Arc<dyn Resolve>,
        arriving: Arc<Arriving>,
        nic_in: Arc<Pacer>,
        disk_read: Arc<Pacer>,
    ) -> Restorer {
        let mut results = BTreeMap::new();
        let root = work_dir.join("restore");
        sweep_temporaries(&root);
        for job_dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            for f in std::fs::read_dir(job_dir.path()).into_iter().flatten().flatten() {
                let name = f.file_name().to_string_lossy().to_string();
                if !(name.starts_with("result-") && name.ends_with(".json")) {
                    continue;
                }
                if let Some(s) = std::fs::read(f.path()).ok().and_then(|b| serde_json::from_slice::<Stored>(&b).ok()) {
                    results.insert((s.job, s.generation), (RestoreResult::from(s), None));
                }
            }
        }
        let mut newest = results.keys().fold(HashMap::new(), |mut m: HashMap<i64, i64>, (j, g)| {
            let e = m.entry(*j).or_insert(*g);
            *e = (*e).max(*g);
            m
        });
        // The fence survives a restart: each job's newest generation asked for, on disk.
        for job_dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let Some(job) = job_dir.file_name().to_str().and_then(|n| n.parse::<i64>().ok()) else { continue };
            let Some(g) = std::fs::read_to_string(job_dir.path().join("newest")).ok().and_then(|t| t.trim().parse::<i64>().ok()) else {
                continue;
            };
            let e = newest.entry(job).or_insert(g);
            *e = (*e).max(g);
        }
        Restorer {
            inner: Arc::new(Inner {
                work_dir: work_dir.to_path_buf(),
                node: node.to_string(),
                token,
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
                free_bytes: crate::load::free_bytes,
            }),
        }
    }

    /// Pin the steps restores read from in these tiers while they run.
    pub fn with_tierer(mut self, tierer: Arc<crate::tiers::Tierer>) -> Restorer {
        Arc::get_mut(&mut self.inner).expect("configured before it is shared").tierer = Some(tierer);
        self
    }

    /// Measure free space with `free_bytes` instead of `crate::load::free_bytes` (tests: a full disk).
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
            let _ = std::fs::remove_file(result_path(&self.inner.work_dir, job, generation));
        }
    }

    /// Start a restore in the background (one already running or reported is not run again).
    pub fn start(&self, r: Restore) {
        let key = (r.job, r.generation);
        {
            let mut newest = self.inner.newest.lock().expect("newest");
            let seen = newest.get(&r.job).copied().unwrap_or(i64::MIN);
            if r.generation < seen {
                let why = format!(
                    "refused: a restore for generation {} of job {} is stale (this node was asked for generation {seen})",
                    r.generation, r.job
                );
                drop(newest);
                self.finish(RestoreResult {
                    job: r.job,
                    generation: r.generation,
                    step: r.step,
                    error: why,
                    request: r.request,
                    ..Default::default()
                });
                return;
            }
            newest.insert(r.job, r.generation);
            // Kept on disk (`new` reads it back), so a restarted agent still refuses older asks.
            let path = self.inner.work_dir.join("restore").join(r.job.to_string()).join("newest");
            let kept = path
                .parent()
                .map_or(Ok(()), |d| crate::rankfiles::create_dirs(d).map_err(|e| e.to_string()))
                .and_then(|()| crate::rankfiles::replace(&path, format!("{}\n", r.generation).as_bytes()).map_err(|e| e.to_string()));
            if let Err(e) = kept {
                tracing::warn!(node = %self.inner.node, "{}: {e}; an agent restart would forget this restore's generation", path.display());
            }
        }
        // The answer to this very ask, not yet acknowledged, stands (sent again). Any other
        // result of the launch is an earlier ask's: forgotten, and this one runs (files in place
        // that verify are kept, so asking again costs little).
        {
            let mut results = self.inner.results.lock().expect("restore results");
            match results.get(&key) {
                Some((done, _)) if done.request == r.request && done.error.is_empty() => {
                    results.get_mut(&key).expect("present").1 = None;
                    drop(results);
                    self.inner.changed.notify_one();
                    return;
                }
                Some(_) => {
                    results.remove(&key);
                    let _ = std::fs::remove_file(result_path(&self.inner.work_dir, r.job, r.generation));
                }
                None => {}
            }
        }
        // One restore of a launch at a time (they write the same files): a newer ask waits for
        // the running one and then runs.
        if !self.inner.running.lock().expect("running").insert(key) {
            self.inner.queued.lock().expect("queued").insert(key, r);
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let began = Instant::now();
            let timeout = Duration::from_secs(u64::from(r.timeout_s.max(10)));
            let mut tally = Tally::default();
            if let Some(t) = &this.inner.tierer {
                t.pin(r.job, r.step);
            }
            let outcome = match tokio::time::timeout(timeout, this.run(&r, &mut tally)).await {
                Ok(o) => o,
                Err(_) => Err(format!("the restore took longer than its {} s", timeout.as_secs())),
            };
            if let Some(t) = &this.inner.tierer {
                t.unpin(r.job, r.step);
            }
            let error = outcome.err().unwrap_or_default();
            if error.is_empty() {
                tracing::info!(node = %this.inner.node, job = r.job, generation = r.generation, step = r.step,
                    "restored in {:.2} s (local {} B, peer {} B, cloud {} B)", began.elapsed().as_secs_f64(), tally.local, tally.peer, tally.cloud);
            } else {
                tracing::warn!(node = %this.inner.node, job = r.job, generation = r.generation, "restore failed: {error}");
            }
            // No longer running before the result is out: an ask arriving once the result is
            // acknowledged (or, failed, forgotten) must run, not find this one still running
            // and be dropped without a result.
            this.inner.running.lock().expect("running").remove(&(r.job, r.generation));
            let next = this.inner.queued.lock().expect("queued").remove(&(r.job, r.generation));
            if let Some(next) = next {
                // A newer ask came meanwhile: this result answers nobody.
                this.start(next);
                return;
            }
            this.finish(RestoreResult {
                request: r.request,
                job: r.job,
                generation: r.generation,
                step: r.step,
                error,
                local_bytes: tally.local,
                peer_bytes: tally.peer,
                cloud_bytes: tally.cloud,
                transfer_s: began.elapsed().as_secs_f64(),
                repaired: tally.repaired,
                skipped: tally.skipped,
            });
        });
    }

    /// Keep the result on disk (a restarted agent reports it again), then report it.
    fn finish(&self, r: RestoreResult) {
        let path = result_path(&self.inner.work_dir, r.job, r.generation);
        let bytes = serde_json::to_vec(&Stored::from(&r)).expect("a result serialises");
        if let Some(dir) = path.parent() {
            let _ = crate::rankfiles::create_dirs(dir);
        }
        if let Err(e) = crate::rankfiles::replace(&path, &bytes) {
            tracing::warn!(node = %self.inner.node, "{}: {e}; the restore's result is reported but would not survive a restart", path.display());
        }
        self.inner.results.lock().expect("restore results").insert((r.job, r.generation), (r, None));
        self.inner.changed.notify_one();
    }

    async fn run(&self, r: &Restore, tally: &mut Tally) -> Result<(), String> {
        let work = &self.inner.work_dir;
        // What is missing, against the free space.
        let mut missing = 0u64;
        for f in &r.files {
            let path = restore_dir(work, r.job, f.source_generation, r.step).join(&f.file);
            if !verifies(&path, &entry_of(f)) {
                missing += f.bytes;
            }
        }
        let made: u64 = r.make.iter().map(|m| r.files.iter().filter(|f| m.sources.contains(&f.file)).map(|f| f.bytes).sum::<u64>()).sum();
        let need = missing + made / u64::from(r.make.first().map_or(1, |m| m.tp_size.max(1))) + FREE_MARGIN;
        if let Some(free) = (self.inner.free_bytes)(work) {
            if free < need {
                return Err(format!(
                    "disk full: the restore needs {need} bytes in {} and {free} are free; free space or give the agent another --work-dir",
                    work.display()
                ));
            }
        }
        // The cloud, and this node's share of its egress for the reads no plan paced.
        let cloud = Arc::new(CloudSide { url: r.cloud_url.clone(), share: rate(r.cloud_share_mb_s).map(|b| Arc::new(Pacer::new(b))) });
        // Files, a few at a time.
        let mut paths: Vec<String> = vec![];
        let mut pending = r.files.iter();
        let mut running = tokio::task::JoinSet::new();
        loop {
            while running.len() < PARALLEL_FILES {
                let Some(f) = pending.next() else { break };
                let (this, f, job, step, cloud) = (self.clone(), f.clone(), r.job, r.step, cloud.clone());
                running.spawn(async move {
                    let mut t = Tally::default();
                    let res = this.restore_file(job, step, &f, &cloud, &mut t).await;
                    (res, t)
                });
            }
            let Some(done) = running.join_next().await else { break };
            let (res, t) = done.map_err(|e| format!("a file's restore task ended: {e}"))?;
            tally.local += t.local;
            tally.peer += t.peer;
            tally.cloud += t.cloud;
            tally.skipped += t.skipped;
            tally.repaired.extend(t.repaired);
            paths.push(res?);
        }
        // Units the new plan shards differently.
        for m in &r.make {
            let dir = |file: &str| {
                let g = r.files.iter().find(|f| f.file == file).map_or(0, |f| f.source_generation);
                restore_dir(work, r.job, g, r.step)
            };
            let Some(first) = m.sources.first() else { continue };
            let out_dir = dir(first);
            let units = m
                .sources
                .iter()
                .map(|s| Unit::read(&dir(s).join(s)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("re-slicing {}: {e}", m.file))?;
            let (out_dir2, sources) = (out_dir.clone(), units);
            let (tp_size, tp_rank, named) = (m.tp_size, m.tp_rank, m.file.clone());
            let written = tokio::task::spawn_blocking(move || -> Result<Option<PathBuf>, String> {
                let cut = motley_checkpoint::reslice_unit(&sources, tp_size).map_err(|e| e.to_string())?;
                // A unit of replicated tensors stays TP 0 of 1: its source serves every rank. (Only
                // that one: a unit cut for TP 1 from split shards is made like any other.)
                if sources.first().is_some_and(|u| u.key.tp_size == 1 && u.replicated()) {
                    return Ok(None);
                }
                let Some(mine) = cut.into_iter().find(|u| u.key.tp_rank == tp_rank) else {
                    return Err(format!("there is no tp rank {tp_rank} of {tp_size}"));
                };
                // The ranks load the unit under the name the coordinator planned for: the two agree.
                let name = motley_checkpoint::manifest::unit_file_name(&mine.key);
                if name != named {
                    return Err(format!("the restore names the cut unit {named}, but it is {name} (sources of another unit?)"));
                }
                let e = mine.write(&out_dir2).map_err(|e| e.to_string())?;
                Ok(Some(out_dir2.join(e.file.file)))
            })
            .await
            .map_err(|e| format!("re-slicing {}: {e}", m.file))?
            .map_err(|e| format!("re-slicing {}: {e}", m.file))?;
            paths.extend(written.map(|p| p.display().to_string()));
        }
        paths.sort();
        paths.dedup();
        let list = launch_list(work, r.job, r.generation);
        let text = serde_json::to_vec(&paths).expect("a list of paths serialises");
        crate::rankfiles::replace(&list, &text).map_err(|e| format!("{}: {e}", list.display()))?;
        Ok(())
    }

    /// One file: kept if it verifies; else fetched range by range from the planned sources,
    /// each failing range from the fallbacks in turn, verified, a corrupt chunk fetched again
    /// from the next source. Returns its absolute path.
    async fn restore_file(&self, job: i64, step: u64, f: &RestoreFile, cloud: &CloudSide, tally: &mut Tally) -> Result<String, String> {
        let entry = entry_of(f);
        let dir = restore_dir(&self.inner.work_dir, job, f.source_generation, step);
        let path = dir.join(&f.file);
        let key = FileKey { job, generation: f.source_generation, step, file: f.file.clone() };
        if verifies(&path, &entry) {
            tally.skipped += 1;
            return Ok(path.display().to_string());
        }
        crate::rankfiles::create_dirs(&dir).map_err(|e| e.to_string())?;
        let arrival = self.inner.arriving.begin(key.clone());
        let tmp = dataplane::temporary_path(&path);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        file.set_len(f.bytes).map_err(|e| format!("{}: {e}", tmp.display()))?;
        // The cloud-only baseline: every further rank of this node fetches its own copy, at the
        // same time as the first (each paced to its share of the cloud), into a scratch file.
        let extra = async {
            let copies: Vec<_> = (1..f.copies.max(1)).map(|k| self.scratch_copy(&key, f, &tmp, k, cloud)).collect();
            futures_util::future::join_all(copies).await
        };
        let (result, extra) = futures_util::future::join(self.fill(&key, f, &file, cloud, tally), extra).await;
        for copy in extra {
            let t = copy?;
            merge(tally, t);
        }
        let result = match result {
            Ok(sent) => self.repair(&key, f, &file, &entry, &tmp, sent, cloud, tally).await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        file.sync_all().map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        arrival.complete();
        Ok(path.display().to_string())
    }

    /// Copy `k` of a file fetched again for another rank (the cloud-only baseline), discarded.
    async fn scratch_copy(&self, key: &FileKey, f: &RestoreFile, tmp: &Path, k: u32, cloud: &CloudSide) -> Result<Tally, String> {
        let path = PathBuf::from(format!("{}.copy{k}", tmp.display()));
        let scratch = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let mut t = Tally::default();
        let mut result = Ok(());
        for r in &f.ranges {
            let src = r.source.clone().unwrap_or_default();
            result = self.fetch_range(key, &src, r.offset, r.bytes, rate(r.rate_mb_s), &scratch, cloud, &mut t).await;
            if result.is_err() {
                break;
            }
        }
        let _ = std::fs::remove_file(&path);
        result.map(|()| t)
    }

    /// Every range from its planned source, or the first fallback that serves it. Returns who
    /// sent each range: (offset, bytes, source).
    async fn fill(&self, key: &FileKey, f: &RestoreFile, file: &File, cloud: &CloudSide, tally: &mut Tally) -> Result<Vec<Sent>, String> {
        let mut flows = vec![];
        for r in &f.ranges {
            let planned = r.source.clone().unwrap_or_default();
            flows.push((planned, r.offset, r.bytes, rate(r.rate_mb_s)));
        }
        // Ranges run at once (each is paced to its own planned rate).
        let results = futures_util::future::join_all(flows.iter().map(|(src, off, len, rate)| {
            let mut t = Tally::default();
            async move {
                let res = self.fetch_range(key, src, *off, *len, *rate, file, cloud, &mut t).await;
                (res, t, src.clone(), *off, *len)
            }
        }))
        .await;
        let mut sent = vec![];
        for (res, t, src, off, len) in results {
            merge(tally, t);
            if res.is_ok() {
                sent.push((off, len, src.clone()));
            }
            if let Err(first) = res {
                let mut last = first.clone();
                let mut done = false;
                for fb in f.fallbacks.iter().filter(|fb| **fb != src) {
                    match self.fetch_range(key, fb, off, len, None, file, cloud, tally).await {
                        Ok(()) => {
                            sent.push((off, len, fb.clone()));
                            tally.repaired.push(format!(
                                "{} bytes {off}..{}: {} failed ({first}); fetched from {}",
                                f.file,
                                off + len,
                                describe(&src),
                                describe(fb)
                            ));
                            done = true;
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                if !done {
                    return Err(format!("{}: no holder could send bytes {off}..{} (last: {last})", f.file, off + len));
                }
            }
        }
        Ok(sent)
    }

    /// Verify the assembled copy; a corrupt chunk is fetched again from the next source.
    #[allow(clippy::too_many_arguments)]
    async fn repair(
        &self,
        key: &FileKey,
        f: &RestoreFile,
        file: &File,
        entry: &FileEntry,
        tmp: &Path,
        mut sent: Vec<Sent>,
        cloud: &CloudSide,
        tally: &mut Tally,
    ) -> Result<(), String> {
        if entry.crc32c.is_empty() {
            return Ok(()); // no crcs reported: the length is all there is to check (done by set_len)
        }
        let mut tries: Vec<&FetchSource> = f.fallbacks.iter().collect();
        let mut failed: Option<String> = None;
        loop {
            file.sync_data().map_err(|e| format!("{}: {e}", tmp.display()))?;
            let bad = bad_chunk(tmp, entry)?;
            let Some((chunk, start, end)) = bad else { return Ok(()) };
            // Whoever sent that chunk's bytes (a fallback, if the planned source failed; more
            // than one, if a range boundary cuts it). A sole sender is not asked again; of
            // several, which one is corrupt is unknown: the next whole chunk tells.
            let culprits = senders(&sent, start, end);
            if let [culprit] = culprits.as_slice() {
                tries.retain(|s| *s != culprit);
            }
            // A holder that cannot send it (gone meanwhile, or the one whose range failed) is
            // passed over for the next.
            let next = loop {
                let Some(next) = (!tries.is_empty()).then(|| tries.remove(0)) else {
                    return Err(format!(
                        "{}: chunk {chunk} (bytes {start}..{end}) does not verify against the manifest and no other holder is left{}",
                        f.file,
                        failed.map(|e| format!(" (last refetch: {e})")).unwrap_or_default()
                    ));
                };
                match self.fetch_range(key, next, start, end - start, None, file, cloud, tally).await {
                    Ok(()) => break next,
                    Err(e) => failed = Some(format!("{}: {e}", describe(next))),
                }
            };
            sent.push((start, end - start, next.clone()));
            tally.repaired.push(format!(
                "{} chunk {chunk} (bytes {start}..{end}) from {} was corrupt; fetched again from {}",
                f.file,
                culprits.iter().map(describe).collect::<Vec<_>>().join(" and "),
                describe(next)
            ));
        }
    }

    /// `len` bytes of `key` from `offset` on, from `src`, into `dest` at the same offset.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_range(
        &self,
        key: &FileKey,
        src: &FetchSource,
        offset: u64,
        len: u64,
        rate: Option<f64>,
        dest: &File,
        cloud: &CloudSide,
        tally: &mut Tally,
    ) -> Result<(), String> {
        match src.kind.as_str() {
            "local" => {
                let Some(at) = self.inner.resolver.locate(key) else {
                    return Err(format!("{}: not held on this node", key.file));
                };
                let pacer = at.read_pacer.clone().or_else(|| (src.tier == "disk").then(|| self.inner.disk_read.clone()));
                copy_range(&at.path, offset, len, dest, pacer, rate).await?;
                tally.local += len;
                Ok(())
            }
            "peer" => {
                let pacers = [self.inner.nic_in.clone()];
                let mut peer = Peer {
                    addr: &src.data_url,
                    token: self.inner.token.as_deref(),
                    transport: Transport::Tcp,
                    pacers: &pacers,
                    rate_bytes_s: rate,
                    timeout: Duration::from_secs(30),
                };
                // One-sided READs when the coordinator found both nodes in one RDMA domain; TCP
                // when that fails (a device gone, a port down) or this build has no RDMA.
                if src.transport == "rdma" && self.inner.rdma {
                    peer.transport = Transport::Rdma;
                    match peer.fetch(key, &[(offset, len)], dest).await {
                        Ok(_) => {
                            tally.peer += len;
                            return Ok(());
                        }
                        Err(e) => tracing::warn!(node = %self.inner.node, "RDMA from {} failed ({e}); over TCP instead", src.node),
                    }
                    peer.transport = Transport::Tcp;
                }
                peer.fetch(key, &[(offset, len)], dest).await.map_err(|e| e.to_string())?;
                tally.peer += len;
                Ok(())
            }
            "cloud" => {
                if cloud.url.is_empty() {
                    return Err(format!("{}: the job has no checkpoint.cloud to fetch from", key.file));
                }
                // Ranged reads of a few MiB, each paced through this node's NIC and the flow; the
                // store (an S3 client, say) opened once per flow.
                let store = crate::cloud::Cloud::open(&cloud.url).map_err(|e| e.to_string())?;
                let object = store.key(key.job, key.generation, key.step, &key.file);
                // A planned flow at its rate; anything else within the node's share.
                let flow = rate.map(Pacer::flow);
                let share = if flow.is_none() { cloud.share.as_deref() } else { None };
                let mut at = offset;
                while at < offset + len {
                    let n = (offset + len - at).min(CLOUD_PIECE);
                    let pacers: Vec<&Pacer> = std::iter::once(self.inner.nic_in.as_ref()).chain(flow.as_ref()).chain(share).collect();
                    dataplane::take_all(&pacers, n).await;
                    let bytes = store.get_range(&object, at..at + n).await.map_err(|e| e.to_string())?;
                    if bytes.len() as u64 != n {
                        return Err(format!("cloud {}: bytes {at}..{} came back {} long", key.file, at + n, bytes.len()));
                    }
                    dest.write_all_at(&bytes, at).map_err(|e| format!("writing bytes {at}..: {e}"))?;
                    at += n;
                }
                tally.cloud += len;
                Ok(())
            }
            other => Err(format!("unknown source kind '{other}'")),
        }
    }
}

/// The job's object store for one restore, and the node's share of its egress (see
/// `Restore.cloud_share_mb_s`) that unplanned reads are held to together.
struct CloudSide {
    url: String,
    share: Option<Arc<Pacer>>,
}

/// Bytes `offset..offset + bytes` of a file were written by this source (later ones over earlier).
type Sent = (u64, u64, FetchSource);

/// The sources whose bytes are in `start..end` now: the latest writes first, down to one that
/// covered it all.
fn senders(sent: &[Sent], start: u64, end: u64) -> Vec<FetchSource> {
    let mut out: Vec<FetchSource> = vec![];
    for (off, len, src) in sent.iter().rev() {
        if *off < end && start < off + len && !out.contains(src) {
            out.push(src.clone());
        }
        if *off <= start && end <= off + len {
            break;
        }
    }
    out
}

fn merge(into: &mut Tally, t: Tally) {
    into.local += t.local;
    into.peer += t.peer;
    into.cloud += t.cloud;
    into.skipped += t.skipped;
    into.repaired.extend(t.repaired);
}

fn rate(mb_s: f64) -> Option<f64> {
    (mb_s > 0.0 && mb_s.is_finite()).then_some(mb_s * 1e6)
}

fn describe(s: &FetchSource) -> String {
    match s.kind.as_str() {
        "peer" => format!("peer {} ({})", s.node, s.tier),
        "local" => "this node's own copy".into(),
        other => other.to_string(),
    }
}

fn entry_of(f: &RestoreFile) -> FileEntry {
    FileEntry { file: f.file.clone(), bytes: f.bytes, chunk_bytes: f.chunk_bytes, crc32c: f.crc32c.clone() }
}

/// Whether `path` holds exactly the manifest's copy.
fn verifies(path: &Path, entry: &FileEntry) -> bool {
    if entry.crc32c.is_empty() {
        return std::fs::metadata(path).is_ok_and(|m| m.len() == entry.bytes);
    }
    motley_checkpoint::crc::verify_file(path, entry).is_ok()
}

/// The first chunk of `path` whose crc is not the manifest's: (index, start, end).
fn bad_chunk(path: &Path, entry: &FileEntry) -> Result<Option<(usize, u64, u64)>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let chunk = entry.chunk_bytes.max(1);
    let crcs = motley_checkpoint::crc::chunk_crcs(&bytes, chunk);
    if crcs.len() != entry.crc32c.len() {
        return Ok(Some((0, 0, entry.bytes)));
    }
    Ok(crcs.iter().zip(&entry.crc32c).position(|(a, b)| a != b).map(|i| {
        let start = i as u64 * chunk;
        (i, start, (start + chunk).min(entry.bytes))
    }))
}

/// Copy `len` bytes at `offset` of `src` into `dest` at the same offset, paced.
async fn copy_range(src: &Path, offset: u64, len: u64, dest: &File, pacer: Option<Arc<Pacer>>, rate: Option<f64>) -> Result<(), String> {
    let from =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let flow = rate.map(|r| Arc::new(Pacer::flow(r)));
    let mut at = offset;
    let end = offset + len;
    let mut buf = vec![0u8; (1 << 20).min(len.max(1) as usize)];
    while at < end {
        let n = ((end - at) as usize).min(buf.len());
        let pacers: Vec<&Pacer> = pacer.iter().map(|p| p.as_ref()).chain(flow.iter().map(|p| p.as_ref())).collect();
        dataplane::take_all(&pacers, n as u64).await;
        from.read_exact_at(&mut buf[..n], at).map_err(|e| format!("{} bytes {at}..{}: {e}", src.display(), at + n as u64))?;
        dest.write_all_at(&buf[..n], at).map_err(|e| format!("writing bytes {at}..: {e}"))?;
        at += n as u64;
    }
    Ok(())
}
