//! The checkpoint shard store's tiers on one node (docs/recovery.md, "Where checkpoint bytes
//! live"): ranks write a step into memory (`MEMORY_ROOT/jobs/J/G/ckpt/step-S`, tmpfs: the write
//! costs the training loop least); the tierer copies each step whose local pieces are whole to disk
//! (`WORK_DIR/jobs/J/G/ckpt/step-S`, the same layout), keeps the newest whole step in memory, the
//! last `keep` whole steps of each job on disk, and uploads disk steps to the cloud (`cloud`) when
//! the launch names one.
//!
//! Durable: the disk steps (every file written through `NAME.tmp.PID`, verified against its
//! piece's chunk crcs while copied, fsynced, renamed, the directory fsynced; the pieces after
//! the files they list, `manifest.json` last, so a piece on disk means its files are), the
//! cloud objects and each disk step's `.cloud.json` marker, and each launch's `tiers.json`
//! (its keep and cloud, from `launched`). Rebuilt at every pass from the directories
//! themselves: which steps are whole, what is to copy, prune or upload; pins (a restore
//! re-pins what it still reads) and the uploads under way live in memory only.
//!
//! A step is whole on this node when every piece here lists only files present at their length
//! and, where the launch directory has the ranks' records, every rank of this node has its
//! piece (ranks of other nodes write elsewhere; their pieces are theirs to report).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use motley_checkpoint::{FileEntry, Manifest};
use motley_proto::v1::Launch;
use serde::{Deserialize, Serialize};

use crate::checkpoints::cloud;
use crate::checkpoints::steps::{self, StepDir};
use crate::error::{AgentError, Result};
use crate::workdir::generation_dir;

pub use crate::node::load::{space, Space};

/// Disk steps kept per job unless the launch says `MOTLEY_CKPT_KEEP`.
pub const KEEP_DEFAULT: usize = 2;
/// A launch's policy, in its generation directory.
pub const POLICY: &str = "tiers.json";
/// The free-space margin: 5% of the file system, at most this.
pub const MARGIN_MAX: u64 = 1 << 30;

/// What a launch asks of the tiers (its `MOTLEY_CKPT_KEEP` and `MOTLEY_CKPT_CLOUD`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub keep: usize,
    pub cloud: Option<String>,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy { keep: KEEP_DEFAULT, cloud: None }
    }
}

impl Policy {
    /// From a launch's envs; a keep that is not a count of 1 or more, or a cloud URL this agent
    /// cannot use, is an error naming the variable.
    pub fn from_envs(job: i64, envs: &HashMap<String, String>) -> Result<Policy> {
        let keep = match envs.get("MOTLEY_CKPT_KEEP").map(|v| v.trim()) {
            None | Some("") => KEEP_DEFAULT,
            Some(v) => v.parse().ok().filter(|&k| k >= 1).ok_or_else(|| AgentError::CkptKeep { job, value: v.into() })?,
        };
        let cloud = envs.get("MOTLEY_CKPT_CLOUD").map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        if let Some(url) = &cloud {
            cloud::Cloud::open(url)?;
        }
        Ok(Policy { keep, cloud })
    }
}

/// Sources are opened without following a symbolic link: ranks (maybe another user) own the
/// memory step directories.
fn open_source(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> AgentError {
    let path = path.to_path_buf();
    move |err| AgentError::Io { what, path, err }
}

/// A disk copy belongs to whoever owns its memory original, so a rank running as the job's
/// user can read it back on a restore. Only root can give files away; otherwise they are the
/// agent's, which is also the ranks'.
fn own_like(path: &Path, like: &std::fs::Metadata) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::os::unix::fs::lchown(path, Some(like.uid()), Some(like.gid())).map_err(io("changing the owner of", path))?;
    }
    Ok(())
}

fn make_dir(dir: &Path, like: &std::fs::Metadata) -> Result<()> {
    if !dir.is_dir() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io("creating", dir))?;
        own_like(dir, like)?;
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io("syncing", dir))
}

/// `dst` through `dst.tmp.PID` (0600), checked chunk by chunk against `entry` (if given) as it
/// is read from `src`, fsynced, renamed; the caller fsyncs the directory.
fn copy_file(src: &Path, dst: &Path, entry: Option<&FileEntry>) -> Result<u64> {
    let mut from = open_source(src).map_err(io("reading", src))?;
    let meta = from.metadata().map_err(io("reading", src))?;
    let mut tmp = dst.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let copied = (|| -> Result<u64> {
        let mut to = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io("writing", &tmp))?;
        let mut verify = entry.map(cloud::Verifier::new);
        let corrupt = |err| AgentError::Corrupt { what: src.display().to_string(), err };
        let mut buf = vec![0u8; 1 << 20];
        let mut n_total = 0;
        loop {
            let n = from.read(&mut buf).map_err(io("reading", src))?;
            if n == 0 {
                break;
            }
            if let Some(v) = verify.as_mut() {
                v.feed(&buf[..n]).map_err(corrupt)?;
            }
            to.write_all(&buf[..n]).map_err(io("writing", &tmp))?;
            n_total += n as u64;
        }
        if let Some(v) = verify {
            v.finish().map_err(corrupt)?;
        }
        to.sync_all().map_err(io("writing", &tmp))?;
        own_like(&tmp, &meta)?;
        Ok(n_total)
    })();
    match copied {
        Ok(n) => {
            std::fs::rename(&tmp, dst).map_err(io("renaming into", dst))?;
            Ok(n)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The ranks of this node in a launch, from the records its ranks left in their launch
/// directory (`rank-R.json`): each writes a piece. Empty if there are none (then the pieces
/// present are all there is to go by).
fn local_ranks(disk_gen_dir: &Path) -> BTreeSet<u32> {
    let entries = std::fs::read_dir(disk_gen_dir).map(|r| r.flatten().collect::<Vec<_>>()).unwrap_or_default();
    entries.iter().filter_map(|e| e.file_name().to_str()?.strip_prefix("rank-")?.strip_suffix(".json")?.parse().ok()).collect()
}

/// The pieces of a step directory if the step is whole here (see the module doc), else why not.
fn whole(dir: &Path, ranks: &BTreeSet<u32>) -> std::result::Result<Vec<(PathBuf, Manifest)>, String> {
    let mut pieces = vec![];
    for path in steps::piece_paths(dir) {
        let m: Manifest = motley_checkpoint::manifest::read_json(&path).map_err(|e| e.to_string())?;
        for f in steps::piece_files(&m) {
            if !steps::plain_name(&f.file) {
                return Err(AgentError::BadFileName { path: path.clone(), file: f.file.clone() }.to_string());
            }
            let len = std::fs::symlink_metadata(dir.join(&f.file)).ok().filter(|m| m.is_file()).map(|m| m.len());
            if len != Some(f.bytes) {
                return Err(format!(
                    "{} is {} (its piece says {} bytes)",
                    f.file,
                    len.map_or("missing".into(), |l| format!("{l} bytes")),
                    f.bytes
                ));
            }
        }
        pieces.push((path, m));
    }
    if pieces.is_empty() {
        return Err("no manifest piece yet".into());
    }
    let have: BTreeSet<u32> = pieces.iter().flat_map(|(_, m)| m.ranks.iter().map(|r| r.rank)).collect();
    if let Some(r) = ranks.iter().find(|r| !have.contains(r)) {
        return Err(format!("rank {r} of this node has not written its piece"));
    }
    Ok(pieces)
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    matches!((std::fs::read(a), std::fs::read(b)), (Ok(x), Ok(y)) if x == y)
}

/// How a tier's free space is measured (`space`; a stand-in in tests).
type SpaceFn = Box<dyn Fn(&Path) -> std::io::Result<Space> + Send + Sync>;

/// The tiers of one node. Shared (`Arc`) by the tier pass (run off the async workers), the
/// cloud pass and the restore (pins).
pub struct Tierer {
    work_dir: PathBuf,
    memory: Option<PathBuf>,
    space: SpaceFn,
    /// Steps a restore reads, by (job, step), counted.
    pins: Mutex<BTreeMap<(i64, u64), u32>>,
    /// Disk steps being uploaded: not pruned under the upload.
    uploading: Mutex<BTreeSet<(i64, i64, u64)>>,
    /// One tier pass at a time.
    pass: Mutex<()>,
    /// One cloud pass at a time (a slow upload outlasts the interval).
    cloud_pass: tokio::sync::Mutex<()>,
    part_bytes: usize,
}

impl Tierer {
    /// Tiers under `work_dir` (disk) and `memory` (the root ranks write to, if any:
    /// `Supervisor::memory_root`).
    pub fn new(work_dir: PathBuf, memory: Option<PathBuf>) -> Tierer {
        Tierer {
            work_dir,
            memory,
            space: Box::new(space),
            pins: Mutex::default(),
            uploading: Mutex::default(),
            pass: Mutex::default(),
            cloud_pass: tokio::sync::Mutex::default(),
            part_bytes: cloud::PART_BYTES,
        }
    }

    /// How free space is measured (tests: a full disk).
    pub fn with_space(mut self, f: impl Fn(&Path) -> std::io::Result<Space> + Send + Sync + 'static) -> Tierer {
        self.space = Box::new(f);
        self
    }

    /// The part size of multipart uploads (tests: small, to go through the multipart path).
    pub fn with_part_bytes(mut self, n: usize) -> Tierer {
        self.part_bytes = n;
        self
    }

    /// A launch arrived: its keep and cloud go into its generation directory (`tiers.json`),
    /// where every later pass, also a restarted agent's, reads them. An unusable value is an
    /// error naming the variable; the launch then keeps the defaults (keep 2, no cloud).
    pub fn launched(&self, l: &Launch) -> Result<()> {
        let dir = generation_dir(&self.work_dir, l.job, l.generation);
        let policy = Policy::from_envs(l.job, &l.envs);
        let text = serde_json::to_vec(&policy.as_ref().cloned().unwrap_or_default()).expect("a policy serializes");
        crate::workdir::create_dirs(&dir)?;
        crate::workdir::write_atomic(&dir.join(POLICY), &text)?;
        policy.map(|_| ())
    }

    /// The job's policy: its newest generation's here, else the defaults.
    pub fn policy(&self, job: i64) -> Policy {
        let gens = steps::generation_dirs(&self.work_dir);
        gens.iter()
            .rev()
            .filter(|(j, _, _)| *j == job)
            .find_map(|(_, _, d)| serde_json::from_slice(&std::fs::read(d.join(POLICY)).ok()?).ok())
            .unwrap_or_default()
    }

    /// A restore reads step `step` of `job`: no tier deletes it until as many `unpin`s.
    pub fn pin(&self, job: i64, step: u64) {
        *self.pins.lock().expect("pins").entry((job, step)).or_default() += 1;
    }

    pub fn unpin(&self, job: i64, step: u64) {
        let mut pins = self.pins.lock().expect("pins");
        if let Some(n) = pins.get_mut(&(job, step)) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&(job, step));
            }
        }
    }

    fn pinned(&self, job: i64, step: u64) -> bool {
        self.pins.lock().expect("pins").contains_key(&(job, step))
    }

    /// One pass: memory steps to disk, memory and disk pruned. Blocking (copies, fsyncs): run
    /// it with `spawn_blocking`, every interval. Returns notes for the log.
    pub fn tier_pass(&self) -> Vec<String> {
        let _one = self.pass.lock().expect("tier pass");
        let mut notes = vec![];
        if let Some(memory) = &self.memory {
            for (job, generation, mem_gen) in steps::generation_dirs(memory) {
                self.memory_generation(job, generation, &mem_gen, &mut notes);
            }
        }
        self.prune_disk(&mut notes);
        notes
    }

    fn memory_generation(&self, job: i64, generation: i64, mem_gen: &Path, notes: &mut Vec<String>) {
        let disk_gen = generation_dir(&self.work_dir, job, generation);
        if !disk_gen.is_dir() {
            // The launch's directory was pruned (its ranks ended long ago): so goes its memory.
            if std::fs::remove_dir_all(mem_gen).is_ok() {
                notes.push(format!("job {job} generation {generation}: launch pruned, its memory checkpoints removed"));
            }
            return;
        }
        let ranks = local_ranks(&disk_gen);
        let steps = steps::step_dirs_of(job, generation, mem_gen);
        let mut newest_whole = None;
        let mut on_disk = BTreeSet::new();
        for s in &steps {
            let Ok(pieces) = whole(&s.dir, &ranks) else { continue };
            newest_whole = Some(s.step);
            let disk_step = steps::ckpt_dir(&disk_gen).join(motley_checkpoint::manifest::step_dir_name(s.step));
            match self.copy_step(s, &disk_step, &pieces) {
                Ok(0) => {
                    on_disk.insert(s.step);
                }
                Ok(n) => {
                    on_disk.insert(s.step);
                    notes
                        .push(format!("job {job} generation {generation} step {}: {n} bytes copied from memory to disk, verified", s.step));
                }
                Err(e) => notes.push(format!("job {job} generation {generation} step {}: not moved to disk: {e}", s.step)),
            }
        }
        // Only the newest whole step stays in memory. An older one goes once it is on disk, or
        // once a newer whole one supersedes it here (a full disk must not fill the node's RAM
        // too), or, not whole, when a newer whole step shows it was abandoned.
        let Some(newest) = newest_whole else { return };
        for s in steps.iter().filter(|s| s.step < newest && !self.pinned(job, s.step)) {
            match std::fs::remove_dir_all(&s.dir) {
                Ok(()) => {
                    let why = if on_disk.contains(&s.step) { "on disk" } else { "not on disk, superseded" };
                    notes.push(format!("job {job} generation {generation} step {}: removed from memory ({why})", s.step));
                }
                Err(e) => notes.push(format!("{}: {e}", s.dir.display())),
            }
        }
    }

    /// Copies the pieces of a whole memory step that the disk step lacks, each after the files
    /// it lists, `manifest.json` last. Returns the bytes copied (0: already on disk).
    fn copy_step(&self, s: &StepDir, disk_step: &Path, pieces: &[(PathBuf, Manifest)]) -> Result<u64> {
        let name = |p: &Path| p.file_name().map(|n| n.to_owned()).unwrap_or_default();
        let todo: Vec<&(PathBuf, Manifest)> = pieces.iter().filter(|(p, _)| !same_bytes(p, &disk_step.join(name(p)))).collect();
        let manifest = s.dir.join(motley_checkpoint::manifest::MANIFEST);
        let manifest = Some(manifest).filter(|m| m.is_file() && !same_bytes(m, &disk_step.join(motley_checkpoint::manifest::MANIFEST)));
        if todo.is_empty() && manifest.is_none() {
            return Ok(0);
        }
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        let need: u64 = todo.iter().map(|(p, m)| size(p) + steps::piece_files(m).map(|f| f.bytes).sum::<u64>()).sum::<u64>()
            + manifest.as_deref().map_or(0, size);
        let disk_gen = disk_step.parent().and_then(Path::parent).unwrap_or(&self.work_dir);
        let sp = (self.space)(disk_gen).map_err(io("measuring the free space of", disk_gen))?;
        let margin = (sp.total / 20).min(MARGIN_MAX);
        if sp.free < need.saturating_add(margin) {
            return Err(AgentError::NoSpace { path: disk_gen.to_path_buf(), job: s.job, step: s.step, need, margin, free: sp.free });
        }
        let like = std::fs::metadata(&s.dir).map_err(io("reading", &s.dir))?;
        make_dir(disk_step.parent().expect("a step directory has a parent"), &like)?;
        make_dir(disk_step, &like)?;
        let mut copied = 0;
        for (path, m) in &todo {
            for f in steps::piece_files(m) {
                copied += copy_file(&s.dir.join(&f.file), &disk_step.join(&f.file), Some(f))?;
            }
            // The files are on disk before the piece that lists them names them.
            sync_dir(disk_step)?;
            copied += copy_file(path, &disk_step.join(name(path)), None)?;
            sync_dir(disk_step)?;
        }
        if let Some(m) = manifest {
            copied += copy_file(&m, &disk_step.join(motley_checkpoint::manifest::MANIFEST), None)?;
            sync_dir(disk_step)?;
        }
        Ok(copied)
    }

    /// Per job, across its generations: the newest `keep` whole disk steps stay, and any pinned
    /// or being uploaded; older whole steps go (reduced to their pieces and cloud marker when
    /// the cloud has them all, so the node still reports its cloud copies), and so do steps
    /// older than the newest whole one that never became whole (abandoned writes).
    fn prune_disk(&self, notes: &mut Vec<String>) {
        let mut by_job: BTreeMap<i64, Vec<(StepDir, bool)>> = BTreeMap::new();
        for (job, generation, gen_dir) in steps::generation_dirs(&self.work_dir) {
            let ranks = local_ranks(&gen_dir);
            for s in steps::step_dirs_of(job, generation, &gen_dir) {
                let is_whole = whole(&s.dir, &ranks).is_ok();
                by_job.entry(job).or_default().push((s, is_whole));
            }
        }
        for (job, steps) in by_job {
            let keep = self.policy(job).keep.max(1);
            let mut wholes: Vec<&StepDir> = steps.iter().filter(|(_, w)| *w).map(|(s, _)| s).collect();
            wholes.sort_by_key(|s| (s.generation, s.step));
            let Some(newest) = wholes.last().map(|s| (s.generation, s.step)) else { continue };
            let kept: BTreeSet<(i64, u64)> = wholes.iter().rev().take(keep).map(|s| (s.generation, s.step)).collect();
            let uploading = self.uploading.lock().expect("uploading").clone();
            for (s, is_whole) in &steps {
                let at = (s.generation, s.step);
                if kept.contains(&at) || self.pinned(job, s.step) || uploading.contains(&(job, s.generation, s.step)) {
                    continue;
                }
                let in_cloud = cloud::read_marker(&s.dir).is_some_and(|m| m.complete);
                if !is_whole && (in_cloud || at > newest) {
                    continue; // a cloud record, or a step still being written
                }
                let done = if in_cloud { strip(&s.dir) } else { std::fs::remove_dir_all(&s.dir).map_err(io("removing", &s.dir)) };
                match done {
                    Ok(()) if *is_whole => notes.push(format!(
                        "job {job} generation {} step {}: removed from disk (keep {keep}){}",
                        s.generation,
                        s.step,
                        if in_cloud { ", its cloud copy stays" } else { "" }
                    )),
                    Ok(()) => notes.push(format!("job {job} generation {} step {}: never whole, removed from disk", s.generation, s.step)),
                    Err(e) => notes.push(e.to_string()),
                }
            }
        }
    }

    /// One pass of uploads: every whole disk step of a job whose launch names a cloud and that
    /// the cloud lacks, newest first. Async (object store I/O); run it as its own task every
    /// interval; a pass still running when the next is due makes that one return at once.
    pub async fn cloud_pass(&self) -> Vec<String> {
        let Ok(_one) = self.cloud_pass.try_lock() else { return vec![] };
        let mut notes = vec![];
        let mut todo = vec![];
        for (job, generation, gen_dir) in steps::generation_dirs(&self.work_dir) {
            let ranks = local_ranks(&gen_dir);
            for s in steps::step_dirs_of(job, generation, &gen_dir) {
                todo.push((s, ranks.clone()));
            }
        }
        todo.sort_by_key(|(s, _)| std::cmp::Reverse((s.generation, s.step)));
        let mut clouds: BTreeMap<i64, Option<cloud::Cloud>> = BTreeMap::new();
        for (s, ranks) in todo {
            let cloud = clouds.entry(s.job).or_insert_with(|| {
                let url = self.policy(s.job).cloud?;
                match cloud::Cloud::open(&url) {
                    Ok(c) => Some(cloud::Cloud { part_bytes: self.part_bytes, ..c }),
                    Err(e) => {
                        notes.push(format!("job {}: {e}", s.job));
                        None
                    }
                }
            });
            let Some(cloud) = cloud.as_ref() else { continue };
            if cloud::read_marker(&s.dir).is_some_and(|m| m.complete && m.url == cloud.url) {
                continue;
            }
            let key = (s.job, s.generation, s.step);
            self.uploading.lock().expect("uploading").insert(key);
            // Listed before the mark: a prune may have taken it in between.
            let pieces = if s.dir.is_dir() { whole(&s.dir, &ranks).ok() } else { None };
            if let Some(pieces) = pieces {
                match cloud::upload_step(cloud, s.job, s.generation, s.step, &s.dir, &pieces).await {
                    Ok(u) => notes.push(format!(
                        "job {} generation {} step {}: {} files ({} bytes) uploaded to {}",
                        s.job, s.generation, s.step, u.files, u.bytes, cloud.url
                    )),
                    Err(e) => notes.push(format!("job {} generation {} step {}: upload stopped: {e}", s.job, s.generation, s.step)),
                }
            }
            self.uploading.lock().expect("uploading").remove(&key);
        }
        notes
    }
}

/// A step the cloud holds whole, pruned from disk: every file but its pieces, `manifest.json`
/// and the marker goes (the node reports its cloud copies from them).
fn strip(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(io("listing", dir))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let keep = name == cloud::MARKER
            || name == motley_checkpoint::manifest::MANIFEST
            || (name.starts_with("manifest.rank.") && name.ends_with(".json"));
        if !keep {
            std::fs::remove_file(e.path()).map_err(io("removing", &e.path()))?;
        }
    }
    Ok(())
}
