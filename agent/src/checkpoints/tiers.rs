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
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use motley_checkpoint::{FileEntry, Manifest};
use motley_proto::v1::Launch;
use rustix::fs::FileType;
use serde::{Deserialize, Serialize};

use crate::checkpoints::cloud;
use crate::checkpoints::steps::{self, StepDir};
use crate::error::{AgentError, Result};
use crate::safe_fs::{self, Dir};
use crate::workdir::generation_dir;

pub use crate::node::load::{space, Space};

/// Disk steps kept per job unless the launch says `MOTLEY_CKPT_KEEP`.
pub const KEEP_DEFAULT: usize = 2;
/// A launch's policy, in its generation directory.
pub const POLICY: &str = "tiers.json";
/// The free-space margin: 5% of the file system, at most this.
pub const MARGIN_MAX: u64 = 1 << 30;
/// The largest manifest piece, and merged manifest, the tierer reads whole: the format's bounds
/// (a rank's larger file is not a checkpoint's).
const PIECE_MAX: u64 = motley_checkpoint::manifest::MAX_PIECE_BYTES;
const MANIFEST_MAX: u64 = motley_checkpoint::manifest::MAX_MANIFEST_BYTES;

/// What a launch asks of the tiers (its `MOTLEY_CKPT_KEEP` and `MOTLEY_CKPT_CLOUD`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub keep: usize,
    pub cloud: Option<String>,
    /// Whether the launch's ranks run as the agent's own uid (None: a file from before this
    /// was recorded): a root agent uses a file:// cloud of another user's job only under a
    /// `--cloud-file-root` (`file_roots`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks_as_agent: Option<bool>,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy { keep: KEEP_DEFAULT, cloud: None, ranks_as_agent: None }
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
        Ok(Policy { keep, cloud, ranks_as_agent: None })
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> AgentError {
    let path = path.to_path_buf();
    move |err| AgentError::Io { what, path, err }
}

/// A disk copy belongs to whoever owns its memory original, so a rank running as the job's
/// user can read it back on a restore. Only root can give files away; otherwise they are the
/// agent's, which is also the ranks'. Given through the handle the agent made it with, never
/// by path (the directory is the rank's: a path could be a link it planted).
fn own_like(f: Option<&std::fs::File>, dir: Option<&Dir>, like: (u32, u32), path: &Path) -> Result<()> {
    if safe_fs::euid() == 0 {
        if let Some(f) = f {
            safe_fs::chown_file(f, like.0, like.1, path)?;
        }
        if let Some(d) = dir {
            d.chown(like.0, like.1)?;
        }
    }
    Ok(())
}

/// The directory `name` in `parent`: made (0700, given like its memory original) or, there
/// already, a real directory (never a link a rank planted: `safe_fs`).
fn make_dir(parent: &Dir, name: &str, like: (u32, u32)) -> Result<Dir> {
    let (dir, made) = parent.create_dir(name, 0o700)?;
    if made {
        own_like(None, Some(&dir), like, dir.path())?;
    }
    Ok(dir)
}

/// `name` from `from` to `to` through `NAME.tmp.PID` (0600, made new), checked chunk by chunk
/// against `entry` (if given) as it is read, fsynced, given like its original, renamed; the
/// caller fsyncs the directory. Both directories are handles: a rank cannot redirect either.
fn copy_file(from_dir: &Dir, to_dir: &Dir, name: &str, entry: Option<&FileEntry>) -> Result<u64> {
    let src = from_dir.path().join(name);
    let mut from = from_dir.open_file(name)?;
    let meta = from.metadata().map_err(io("reading", &src))?;
    let tmp = format!("{name}.tmp.{}", std::process::id());
    let tmp_path = to_dir.path().join(&tmp);
    to_dir.remove_file(&tmp)?;
    let copied = (|| -> Result<u64> {
        let mut to = to_dir.create_new(&tmp, 0o600)?;
        let mut verify = entry.map(cloud::Verifier::new);
        let corrupt = |err| AgentError::Corrupt { what: src.display().to_string(), err };
        let mut buf = vec![0u8; 1 << 20];
        let mut n_total = 0;
        loop {
            let n = from.read(&mut buf).map_err(io("reading", &src))?;
            if n == 0 {
                break;
            }
            if let Some(v) = verify.as_mut() {
                v.feed(&buf[..n]).map_err(corrupt)?;
            }
            to.write_all(&buf[..n]).map_err(io("writing", &tmp_path))?;
            n_total += n as u64;
        }
        if let Some(v) = verify {
            v.finish().map_err(corrupt)?;
        }
        to.sync_all().map_err(io("writing", &tmp_path))?;
        own_like(Some(&to), None, (meta.uid(), meta.gid()), &tmp_path)?;
        Ok(n_total)
    })();
    match copied {
        Ok(n) => {
            to_dir.rename(&tmp, name)?;
            Ok(n)
        }
        Err(e) => {
            let _ = to_dir.remove_file(&tmp);
            Err(e)
        }
    }
}

/// The step directory `s` under `root`, reached without following a link (`safe_fs`).
fn step_handle(s: &StepDir) -> Result<Dir> {
    safe_fs::open_under(&s.dir, 5)
}

/// The ranks of this node in a launch, from the records its ranks left in their launch
/// directory (`rank-R.json`): each writes a piece. Empty if there are none (then the pieces
/// present are all there is to go by).
fn local_ranks(disk_gen_dir: &Path) -> BTreeSet<u32> {
    let entries = safe_fs::open_under(disk_gen_dir, 3).and_then(|d| d.entries()).unwrap_or_default();
    entries.iter().filter_map(|(name, _)| name.strip_prefix("rank-")?.strip_suffix(".json")?.parse().ok()).collect()
}

/// The pieces of a step directory if the step is whole here (see the module doc), else why
/// not. Read through the directory's handle: the pieces and files are the ranks'.
fn whole(dir: &Dir, ranks: &BTreeSet<u32>) -> std::result::Result<Vec<(PathBuf, Manifest)>, String> {
    let mut pieces = vec![];
    let names = dir.entries().map_err(|e| e.to_string())?;
    for (name, _) in names.iter().filter(|(n, t)| *t != FileType::Directory && n.starts_with("manifest.rank.") && n.ends_with(".json")) {
        let path = dir.path().join(name);
        let bytes = dir.read(name, PIECE_MAX).map_err(|e| e.to_string())?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        for f in steps::piece_files(&m) {
            if let Err(e) = safe_fs::check_name(&f.file) {
                return Err(format!("{}: {e}; the piece is ignored", path.display()));
            }
            let len =
                dir.stat(&f.file).filter(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile).map(|st| st.st_size as u64);
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
    // A rank of this node whose replica was lost while the job kept going writes no piece; the
    // members' pieces name it (`lost_ranks`), and the leader wrote its rank file.
    let have: BTreeSet<u32> = pieces.iter().flat_map(|(_, m)| m.ranks.iter().map(|r| r.rank).chain(m.lost_ranks.iter().copied())).collect();
    if let Some(r) = ranks.iter().find(|r| !have.contains(r)) {
        return Err(format!("rank {r} of this node has not written its piece"));
    }
    Ok(pieces)
}

/// `s` whole here: its handle opened and its pieces read.
fn whole_step(s: &StepDir, ranks: &BTreeSet<u32>) -> std::result::Result<Vec<(PathBuf, Manifest)>, String> {
    whole(&step_handle(s).map_err(|e| e.to_string())?, ranks)
}

fn same_bytes(a: &Dir, b: &Dir, name: &str) -> bool {
    matches!((a.read(name, MANIFEST_MAX), b.read(name, MANIFEST_MAX)), (Ok(x), Ok(y)) if x == y)
}

/// The step directory `s` and all in it removed, through its parent's handle (the `ckpt`
/// directory may be a rank's: a link it swapped in is refused, never followed).
fn remove_step(s: &StepDir) -> Result<()> {
    let ckpt = s.dir.parent().ok_or_else(|| AgentError::Unsafe { path: s.dir.clone() })?;
    let name = steps_name(s);
    safe_fs::open_under(ckpt, 4)?.remove_tree(&name)
}

fn steps_name(s: &StepDir) -> String {
    s.dir.file_name().map_or_else(|| motley_checkpoint::manifest::step_dir_name(s.step), |n| n.to_string_lossy().into_owned())
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
    /// error naming the variable; the launch then keeps the defaults (keep 2, no cloud). Its
    /// ranks run as the agent's user where it names none (`launched_as` where that is known).
    pub fn launched(&self, l: &Launch) -> Result<()> {
        self.launched_as(l, l.user.is_empty())
    }

    /// `launched`, the launch's ranks running as the agent's own uid or not: a file:// cloud
    /// the agent may not use for it (`file_roots`) is an error naming the URL and the fix, and
    /// the launch keeps its keep but no cloud (its checkpoints stay on the tiers).
    pub fn launched_as(&self, l: &Launch, ranks_as_agent: bool) -> Result<()> {
        let dir = generation_dir(&self.work_dir, l.job, l.generation);
        let policy = Policy::from_envs(l.job, &l.envs);
        let refused = match &policy {
            Ok(Policy { cloud: Some(url), .. }) => crate::checkpoints::file_roots::admit(url, l.job, Some(ranks_as_agent)).err(),
            _ => None,
        };
        let mut kept = policy.as_ref().cloned().unwrap_or_default();
        if refused.is_some() {
            kept.cloud = None;
        }
        kept.ranks_as_agent = Some(ranks_as_agent);
        let text = serde_json::to_vec(&kept).expect("a policy serializes");
        crate::workdir::create_dirs(&dir)?;
        // The launch directory may be the rank's: written through its handle (`safe_fs`).
        safe_fs::open_under(&dir, 3)?.write_atomic(POLICY, &text)?;
        match refused {
            Some(e) => Err(e),
            None => policy.map(|_| ()),
        }
    }

    /// The job's policy: its newest generation's here, else the defaults. Only the agent's own
    /// file counts (the launch directory may be the rank's, which could forge one).
    pub fn policy(&self, job: i64) -> Policy {
        let read = |d: &Path| -> Option<Policy> {
            let f = safe_fs::open_under(d, 3).ok()?.open_file(POLICY).ok()?;
            let meta = f.metadata().ok()?;
            if meta.uid() != safe_fs::euid() || meta.nlink() != 1 {
                return None;
            }
            serde_json::from_reader(std::io::BufReader::new(f)).ok()
        };
        let gens = steps::generation_dirs(&self.work_dir);
        gens.iter().rev().filter(|(j, _, _)| *j == job).find_map(|(_, _, d)| read(d)).unwrap_or_default()
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
            // Through handles, any depth, links not followed: its `ckpt/` is the rank's.
            if safe_fs::remove_tree_at(mem_gen).is_ok() {
                notes.push(format!("job {job} generation {generation}: launch pruned, its memory checkpoints removed"));
            }
            return;
        }
        let ranks = local_ranks(&disk_gen);
        let steps = steps::step_dirs_of(job, generation, mem_gen);
        let mut newest_whole = None;
        let mut on_disk = BTreeSet::new();
        for s in &steps {
            let Ok(pieces) = whole_step(s, &ranks) else { continue };
            newest_whole = Some(s.step);
            match self.copy_step(s, &disk_gen, &pieces) {
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
            match remove_step(s) {
                Ok(()) => {
                    let why = if on_disk.contains(&s.step) { "on disk" } else { "not on disk, superseded" };
                    notes.push(format!("job {job} generation {generation} step {}: removed from memory ({why})", s.step));
                }
                Err(e) => notes.push(e.to_string()),
            }
        }
    }

    /// Copies the pieces of a whole memory step that the disk step lacks, each after the files
    /// it lists, `manifest.json` last, into `DISK_GEN/ckpt/step-S`. Returns the bytes copied
    /// (0: already on disk). Both sides are the ranks' directories: every file and directory is
    /// reached through a handle, never a link (`safe_fs`), and only what the agent made here is
    /// given to the rank's user.
    fn copy_step(&self, s: &StepDir, disk_gen: &Path, pieces: &[(PathBuf, Manifest)]) -> Result<u64> {
        let from = step_handle(s)?;
        let gen = safe_fs::open_under(disk_gen, 3)?;
        let step_name = motley_checkpoint::manifest::step_dir_name(s.step);
        let existing = gen.dir_if_any(Path::new("ckpt").join(&step_name))?;
        let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let on_disk = |n: &str| existing.as_ref().is_some_and(|d| same_bytes(&from, d, n));
        let todo: Vec<&(PathBuf, Manifest)> = pieces.iter().filter(|(p, _)| !on_disk(&name(p))).collect();
        let manifest_name = motley_checkpoint::manifest::MANIFEST;
        let is_file = |st: Option<rustix::fs::Stat>| st.is_some_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile);
        let manifest = is_file(from.stat(manifest_name)) && !on_disk(manifest_name);
        if todo.is_empty() && !manifest {
            return Ok(0);
        }
        let size = |n: &str| from.stat(n).map_or(0, |st| st.st_size as u64);
        let need: u64 = todo.iter().map(|(p, m)| size(&name(p)) + steps::piece_files(m).map(|f| f.bytes).sum::<u64>()).sum::<u64>()
            + if manifest { size(manifest_name) } else { 0 };
        let sp = (self.space)(disk_gen).map_err(io("measuring the free space of", disk_gen))?;
        let margin = (sp.total / 20).min(MARGIN_MAX);
        if sp.free < need.saturating_add(margin) {
            return Err(AgentError::NoSpace { path: disk_gen.to_path_buf(), job: s.job, step: s.step, need, margin, free: sp.free });
        }
        let st = from.own_stat()?;
        let like = (st.st_uid, st.st_gid);
        let ckpt = make_dir(&gen, "ckpt", like)?;
        let to = make_dir(&ckpt, &step_name, like)?;
        let mut copied = 0;
        for (path, m) in &todo {
            for f in steps::piece_files(m) {
                safe_fs::check_name(&f.file)?;
                copied += copy_file(&from, &to, &f.file, Some(f))?;
            }
            // The files are on disk before the piece that lists them names them.
            to.sync()?;
            copied += copy_file(&from, &to, &name(path), None)?;
            to.sync()?;
        }
        if manifest {
            copied += copy_file(&from, &to, manifest_name, None)?;
            to.sync()?;
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
                let is_whole = whole_step(&s, &ranks).is_ok();
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
                let done = if in_cloud { strip(s) } else { remove_step(s) };
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
                let policy = self.policy(s.job);
                let url = policy.cloud?;
                // Checked again here: a policy file an older agent wrote has no ranks_as_agent.
                match crate::checkpoints::file_roots::admit(&url, s.job, policy.ranks_as_agent).and_then(|_| cloud::Cloud::open(&url)) {
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
            let pieces = whole_step(&s, &ranks).ok();
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
/// and the marker goes (the node reports its cloud copies from them), through the step's handle.
fn strip(s: &StepDir) -> Result<()> {
    let dir = step_handle(s)?;
    for (name, _) in dir.entries()? {
        let keep = name == cloud::MARKER
            || name == motley_checkpoint::manifest::MANIFEST
            || (name.starts_with("manifest.rank.") && name.ends_with(".json"));
        if !keep {
            dir.remove_tree(&name)?;
        }
    }
    Ok(())
}
