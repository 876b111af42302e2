//! The checkpoint files this node holds, reported to the coordinator's checkpoint-location
//! bitmap (README, "Checkpoint locations"). Ranks write their checkpoint into `MOTLEY_CKPT_DIR`, which the agent sets
//! to `MEMORY_ROOT/jobs/JOB/GENERATION/ckpt` (the memory tier, `--shm-dir`) or, without one,
//! `WORK_DIR/jobs/JOB/GENERATION/ckpt` (docs/checkpoint.md); `tiers` copies steps from memory
//! to the same place on disk and uploads them to the cloud. A file counts once the rank's
//! manifest piece (`manifest.rank.R.json`, written after its files, each through a temporary
//! name) lists it and the file has the length the piece says: never a half-written one. Each
//! is reported with its tier: `memory`, `disk`, and `cloud` for a file the disk step's
//! `.cloud.json` marker records as uploaded (kept after the disk copy is pruned).
//!
//! The whole list is sent in a session's first message and whenever it changed
//! (`AgentStatus.holdings`, `holdings_sent`), and counts as told once acknowledged.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use motley_checkpoint::{FileEntry, Manifest};
use motley_proto::v1::CkptHolding;

use crate::checkpoints::cloud;
use crate::checkpoints::steps::{piece_paths, step_dirs, StepDir};

mod share;
pub use share::{bounded, encoded_bound, MAX_REPORT_BYTES};

/// The tiers' roots: the work directory (disk) and the memory root, if ranks write there.
#[derive(Clone, Debug)]
pub struct Roots<'a> {
    pub disk: &'a Path,
    pub memory: Option<&'a Path>,
}

type Stamp = (u64, Option<SystemTime>);

/// `name`'s length and modification time in the step directory `dir`, through its handle and
/// not following a link (the step is the rank's).
fn stamp_of(dir: &crate::safe_fs::Dir, name: &str) -> Option<Stamp> {
    let st = dir.stat(name)?;
    Some((st.st_size as u64, Some(mtime(&st))))
}

fn mtime(st: &rustix::fs::Stat) -> SystemTime {
    SystemTime::UNIX_EPOCH + std::time::Duration::new(st.st_mtime.max(0) as u64, st.st_mtime_nsec as u32)
}

/// A manifest piece as last read: its length and modification time, every file it lists (as a
/// holding of the piece's tier), which of them were held then, and whether that was all.
pub struct Piece {
    /// The piece's stamp and its step directory's modification time (files pruned from the
    /// step change the directory, not the piece).
    stamp: (Stamp, Option<SystemTime>),
    listed: Vec<CkptHolding>,
    held: Vec<bool>,
    all_held: bool,
}

/// What one scan remembers for the next: the pieces, and the cloud markers (by path).
#[derive(Default)]
pub struct ScanCache {
    pieces: BTreeMap<PathBuf, Piece>,
    markers: BTreeMap<PathBuf, (Stamp, BTreeSet<String>)>,
}

/// Every checkpoint file under `ROOT/jobs/*/*/ckpt/step-*` of both roots, sorted. `cache`
/// keeps each piece by path: one unchanged since it was read, and whose files were all there
/// then, is not read again nor are its files looked at (a rank writes its files before its
/// piece, and the tierer copies files before pieces; a pruned file changes the step
/// directory's time), so a scan of a quiet node lists directories only.
pub fn scan(roots: &Roots<'_>, cache: &mut ScanCache) -> Vec<CkptHolding> {
    let mut out = vec![];
    let mut seen = BTreeSet::new();
    let mut markers_seen = BTreeSet::new();
    let tiers = [(Some(roots.disk), "disk"), (roots.memory, "memory")];
    for (root, tier) in tiers.into_iter().filter_map(|(r, t)| Some((r?, t))) {
        for s in step_dirs(root) {
            // The step directory is the rank's: its pieces and files are read and looked at
            // through a handle that reached it without a link (`safe_fs`), never by path, so a
            // FIFO cannot hang the scan (and the heartbeat that waits for it) and a linked `ckpt`
            // does not report another job's files as this one's.
            let Ok(handle) = crate::safe_fs::open_under(&s.dir, 5) else { continue };
            // The cloud copies this disk step's marker records (memory steps are not uploaded).
            let uploaded = if tier == "disk" {
                let marker = s.dir.join(cloud::MARKER);
                match stamp_of(&handle, cloud::MARKER) {
                    Some(stamp) => {
                        if cache.markers.get(&marker).is_none_or(|(st, _)| *st != stamp) {
                            let files = cloud::read_marker(&s.dir).map(|m| m.uploaded.into_iter().collect()).unwrap_or_default();
                            cache.markers.insert(marker.clone(), (stamp, files));
                        }
                        markers_seen.insert(marker.clone());
                        cache.markers[&marker].1.clone()
                    }
                    None => BTreeSet::new(),
                }
            } else {
                BTreeSet::new()
            };
            let dir_time = handle.own_stat().ok().map(|st| mtime(&st));
            for piece_path in piece_paths(&s.dir) {
                let name = piece_path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let Some(stamp) = stamp_of(&handle, &name).map(|st| (st, dir_time)) else { continue };
                if cache.pieces.get(&piece_path).is_none_or(|p| p.stamp != stamp || !p.all_held) {
                    // Bounded (MAX_PIECE_BYTES): a piece is read whole into memory.
                    let piece = handle
                        .read(&name, motley_checkpoint::manifest::MAX_PIECE_BYTES)
                        .map_err(|e| e.to_string())
                        .and_then(|bytes| serde_json::from_slice::<Manifest>(&bytes).map_err(|e| e.to_string()))
                        .and_then(|m| same_step(m, s.step));
                    match piece {
                        Ok(m) => {
                            cache.pieces.insert(piece_path.clone(), read_piece(&m, &s, &handle, tier, stamp));
                        }
                        Err(e) => {
                            tracing::warn!("{}: not a manifest piece ({e}); its files are not reported", piece_path.display());
                            // Said once: an empty piece stands for it until the file changes.
                            cache.pieces.insert(piece_path.clone(), Piece { stamp, listed: vec![], held: vec![], all_held: true });
                        }
                    }
                }
                seen.insert(piece_path.clone());
                let p = &cache.pieces[&piece_path];
                out.extend(p.listed.iter().zip(&p.held).filter(|(_, &h)| h).map(|(x, _)| x.clone()));
                // Cloud names pass the one name check too (`read_marker` checks them; a piece's
                // names are the rank's).
                out.extend(
                    p.listed
                        .iter()
                        .filter(|x| uploaded.contains(&x.file) && crate::safe_fs::check_name(&x.file).is_ok())
                        .map(|x| CkptHolding { tier: "cloud".into(), ..x.clone() }),
                );
            }
        }
    }
    cache.pieces.retain(|p, _| seen.contains(p));
    cache.markers.retain(|p, _| markers_seen.contains(p));
    let key = |a: &CkptHolding| (a.job, a.generation, a.step, a.file.clone(), a.tier.clone());
    out.sort_by_key(key);
    out.dedup_by(|a, b| key(a) == key(b));
    out
}

/// The piece if it is one of step `step` (its directory's): the step a holding is reported
/// under is the directory's, never what a rank wrote into the piece, and a piece that names
/// another step is not this step's (docs/checkpoint.md, "Files on disk").
fn same_step(m: Manifest, step: u64) -> Result<Manifest, String> {
    if m.step != step {
        return Err(format!("it names step {}, but it is in the directory of step {step}", m.step));
    }
    Ok(m)
}

/// Every file a piece lists, as a holding of `tier` and of its directory's step, and which are
/// in the step directory at the length the piece says.
fn read_piece(m: &Manifest, s: &StepDir, dir: &crate::safe_fs::Dir, tier: &str, stamp: (Stamp, Option<SystemTime>)) -> Piece {
    let is_held = |f: &FileEntry| {
        crate::safe_fs::check_name(&f.file).is_ok()
            && dir.stat(&f.file).is_some_and(|st| {
                rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile && st.st_size as u64 == f.bytes
            })
    };
    let base = CkptHolding {
        job: s.job,
        generation: s.generation,
        step: s.step,
        tier: tier.into(),
        rank: -1,
        layers: m.layers,
        world_size: m.world_size,
        ..Default::default()
    };
    let of = |f: &FileEntry| CkptHolding {
        file: f.file.clone(),
        bytes: f.bytes,
        chunk_bytes: f.chunk_bytes,
        crc32c: f.crc32c.clone(),
        ..base.clone()
    };
    let mut listed = vec![];
    let mut held = vec![];
    for u in &m.units {
        listed.push(CkptHolding {
            block: u.key.block.to_string(),
            part: u.key.part.to_string(),
            tp_rank: u.key.tp_rank,
            tp_size: u.key.tp_size,
            ..of(&u.file)
        });
        held.push(is_held(&u.file));
    }
    for r in &m.ranks {
        listed.push(CkptHolding { rank: r.rank as i64, ..of(&r.file) });
        held.push(is_held(&r.file));
    }
    let all_held = held.iter().all(|&h| h);
    Piece { stamp, listed, held, all_held }
}

/// What was reported, and what is to be.
#[derive(Default)]
pub struct Holdings {
    /// The memory tier's root, scanned with the work directory.
    memory: Option<PathBuf>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    cache: ScanCache,
    /// The list the coordinator acknowledged in this session.
    told: Option<Vec<CkptHolding>>,
    /// The list sent in message `seq`, not yet acknowledged.
    sent: Option<(u64, Vec<CkptHolding>)>,
    /// What the last report left out to stay within `MAX_REPORT_BYTES`.
    left_out: Option<String>,
}

impl Holdings {
    /// Holdings of the work directory and of the memory root ranks write to
    /// (`Supervisor::memory_root`).
    pub fn with_memory_root(memory: Option<PathBuf>) -> Holdings {
        Holdings { memory, ..Default::default() }
    }

    /// A new session: the whole list goes out again.
    pub fn new_session(&self) {
        let mut s = self.state.lock().expect("holdings");
        s.told = None;
        s.sent = None;
    }

    /// The list to carry in message `seq`, if it differs from what was told (or sent and not
    /// yet acknowledged).
    pub fn report(&self, work_dir: &Path, seq: u64) -> Option<Vec<CkptHolding>> {
        let mut s = self.state.lock().expect("holdings");
        let roots = Roots { disk: work_dir, memory: self.memory.as_deref() };
        let (now, left_out) = bounded(scan(&roots, &mut s.cache), MAX_REPORT_BYTES);
        if let Some(what) = left_out {
            // Said when the list changes, not every scan.
            if s.left_out.as_ref() != Some(&what) {
                tracing::warn!("{what}");
            }
            s.left_out = Some(what);
        } else {
            s.left_out = None;
        }
        let pending = s.sent.as_ref().map(|(_, l)| l).or(s.told.as_ref());
        if pending == Some(&now) {
            return None;
        }
        s.sent = Some((seq, now.clone()));
        Some(now)
    }

    /// The coordinator holds what message `seq` said.
    pub fn ack(&self, seq: u64) {
        let mut s = self.state.lock().expect("holdings");
        if s.sent.as_ref().is_some_and(|(q, _)| *q == seq) {
            s.told = s.sent.take().map(|(_, l)| l);
        }
    }
}

#[cfg(test)]
mod tests;
