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

/// The tiers' roots: the work directory (disk) and the memory root, if ranks write there.
#[derive(Clone, Debug)]
pub struct Roots<'a> {
    pub disk: &'a Path,
    pub memory: Option<&'a Path>,
}

type Stamp = (u64, Option<SystemTime>);

fn stamp_of(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()))
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
            // The cloud copies this disk step's marker records (memory steps are not uploaded).
            let uploaded = if tier == "disk" {
                let marker = s.dir.join(cloud::MARKER);
                match stamp_of(&marker) {
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
            let dir_time = std::fs::metadata(&s.dir).and_then(|m| m.modified()).ok();
            // The step directory is the rank's: its pieces and files are read and looked at
            // through a handle that reached it without a link (`safe_fs`), never by path, so a
            // FIFO cannot hang the scan (and the heartbeat that waits for it) and a linked `ckpt`
            // does not report another job's files as this one's.
            let Ok(handle) = crate::safe_fs::open_under(&s.dir, 5) else { continue };
            for piece_path in piece_paths(&s.dir) {
                let Some(stamp) = stamp_of(&piece_path).map(|st| (st, dir_time)) else { continue };
                if cache.pieces.get(&piece_path).is_none_or(|p| p.stamp != stamp || !p.all_held) {
                    // Bounded (MAX_PIECE_BYTES): a piece is read whole into memory.
                    let name = piece_path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    let piece = handle
                        .read(&name, motley_checkpoint::manifest::MAX_PIECE_BYTES)
                        .map_err(|e| e.to_string())
                        .and_then(|bytes| serde_json::from_slice::<Manifest>(&bytes).map_err(|e| e.to_string()));
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

/// Every file a piece lists, as a holding of `tier`, and which are in the step directory at
/// the length the piece says.
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
        step: m.step,
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

/// The most bytes of holdings one status message carries (docs/recovery.md, "Limits"): the
/// coordinator takes messages of up to 4 MiB (tonic's default), and one over it would end
/// every session of the node, its lease and its ranks with it. The rest of the message (ranks,
/// load, results) has the other MiB.
pub const MAX_REPORT_BYTES: usize = 3 << 20;

/// One holding's bytes within `AgentStatus.holdings`: its encoding, its tag and length prefix
/// (at most 5 bytes).
pub fn encoded_bound(h: &CkptHolding) -> usize {
    use motley_proto::Message;
    1 + 5 + h.encoded_len()
}

/// `list` cut to at most `limit` bytes (`encoded_bound`): whole steps, the newest first (the
/// one a recovery restores), the oldest left out; and what was left out, to say so.
pub fn bounded(list: Vec<CkptHolding>, limit: usize) -> (Vec<CkptHolding>, Option<String>) {
    let total: usize = list.iter().map(encoded_bound).sum();
    if total <= limit {
        return (list, None);
    }
    // Steps by (step, job, generation), newest first; a step is kept whole or not at all.
    let mut steps: BTreeMap<(std::cmp::Reverse<u64>, i64, i64), Vec<CkptHolding>> = BTreeMap::new();
    for h in list {
        steps.entry((std::cmp::Reverse(h.step), h.job, h.generation)).or_default().push(h);
    }
    let (mut kept, mut used, mut dropped, mut files) = (vec![], 0usize, vec![], 0usize);
    for ((std::cmp::Reverse(step), job, generation), held) in steps {
        let size: usize = held.iter().map(encoded_bound).sum();
        if used + size <= limit {
            used += size;
            kept.extend(held);
        } else {
            files += held.len();
            dropped.push(format!("job {job} generation {generation} step {step}"));
        }
    }
    let key = |a: &CkptHolding| (a.job, a.generation, a.step, a.file.clone(), a.tier.clone());
    kept.sort_by_key(key);
    let what = format!(
        "checkpoint holdings of {total} bytes exceed the {limit} bytes one report may carry: {files} files of {} steps left out \
         (oldest first: {}); prune old steps (checkpoint.keep) so the coordinator knows of every copy",
        dropped.len(),
        dropped.iter().rev().take(8).cloned().collect::<Vec<_>>().join(", ")
    );
    (kept, Some(what))
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
mod tests {
    use super::*;
    use crate::checkpoints::steps::ckpt_dir;
    use motley_checkpoint::{Block, FileEntry, Part, RankEntry, UnitEntry, UnitKey, FORMAT};

    fn write_step(gen_dir: &Path, step: u64, rank: u32, bytes: u64) {
        let dir = ckpt_dir(gen_dir).join(motley_checkpoint::manifest::step_dir_name(step));
        std::fs::create_dir_all(&dir).unwrap();
        let key = UnitKey { block: Block::Layer(rank), part: Part::Model, tp_rank: 0, tp_size: 1 };
        let unit = motley_checkpoint::manifest::unit_file_name(&key);
        std::fs::write(dir.join(&unit), vec![7u8; bytes as usize]).unwrap();
        let rank_file = motley_checkpoint::manifest::rank_file_name(rank);
        std::fs::write(dir.join(&rank_file), b"r").unwrap();
        let entry = |file: &str, bytes| FileEntry { file: file.into(), bytes, chunk_bytes: 16 << 20, crc32c: vec![] };
        let piece = Manifest {
            format: FORMAT.into(),
            step,
            layers: 2,
            world_size: 2,
            units: vec![UnitEntry { key, file: entry(&unit, bytes), tensors: Default::default() }],
            ranks: vec![RankEntry { rank, file: entry(&rank_file, 1) }],
        };
        let path = dir.join(motley_checkpoint::manifest::piece_file_name(rank));
        std::fs::write(path, serde_json::to_vec(&piece).unwrap()).unwrap();
    }

    #[test]
    fn a_report_over_the_limit_keeps_the_newest_steps_whole_and_says_what_it_left_out() {
        let h = |step: u64, file: &str| CkptHolding {
            job: 7,
            generation: 1,
            step,
            file: file.into(),
            tier: "disk".into(),
            crc32c: vec![1; 100],
            ..Default::default()
        };
        let list: Vec<CkptHolding> = [10, 20, 30].iter().flat_map(|&s| [h(s, "a"), h(s, "b")]).collect();
        let one = encoded_bound(&list[0]);
        // The bound holds for the real encoding, and so for a whole list's.
        assert!(one >= prost_len(&list[0]), "{one}");
        let all = motley_proto::v1::AgentStatus { holdings: list.clone(), ..Default::default() };
        assert!(6 * one >= motley_proto::Message::encoded_len(&all));
        assert_eq!(bounded(list.clone(), 6 * one), (list.clone(), None));
        // Room for two steps and a half: steps 30 and 20 whole, step 10 left out and named.
        let (kept, what) = bounded(list.clone(), 5 * one);
        assert_eq!(kept.iter().map(|x| (x.step, x.file.as_str())).collect::<Vec<_>>(), [(20, "a"), (20, "b"), (30, "a"), (30, "b")]);
        let what = what.unwrap();
        assert!(what.contains("2 files of 1 steps left out (oldest first: job 7 generation 1 step 10)"), "{what}");
    }

    #[test]
    fn a_piece_over_the_size_limit_is_skipped_and_the_others_reported() {
        let work = std::env::temp_dir().join(format!("motley-holdings-big-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        let gen_dir = work.join("jobs/7/2");
        write_step(&gen_dir, 4, 0, 100);
        write_step(&gen_dir, 4, 1, 100);
        // Rank 1's piece padded (valid JSON) past the limit: refused unread, its files unreported.
        let piece = ckpt_dir(&gen_dir).join("step-00000004").join(motley_checkpoint::manifest::piece_file_name(1));
        let mut text = std::fs::read(&piece).unwrap();
        text.resize(motley_checkpoint::manifest::MAX_PIECE_BYTES as usize + 1, b' ');
        std::fs::write(&piece, text).unwrap();
        let list = Holdings::default().report(&work, 1).expect("a list");
        let files: Vec<&str> = list.iter().map(|x| x.file.as_str()).collect();
        assert_eq!(files, ["layer.00000.model.tp0-1.safetensors", "rank.00000.safetensors"]);
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// A rank's step directory is read through handles: a FIFO named as a piece is refused
    /// without hanging the scan, and a `ckpt` linked to another job's checkpoints reports none
    /// of that job's files as this one's.
    #[test]
    fn a_fifo_piece_and_a_linked_ckpt_are_not_followed() {
        let work = std::env::temp_dir().join(format!("motley-holdings-hostile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        write_step(&work.join("jobs/7/2"), 4, 0, 100);
        let fifo_step = ckpt_dir(&work.join("jobs/8/1")).join("step-00000004");
        std::fs::create_dir_all(&fifo_step).unwrap();
        use std::os::unix::ffi::OsStringExt;
        let fifo =
            std::ffi::CString::new(fifo_step.join(motley_checkpoint::manifest::piece_file_name(0)).into_os_string().into_vec()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let linked = work.join("jobs/9/1");
        std::fs::create_dir_all(&linked).unwrap();
        std::os::unix::fs::symlink(ckpt_dir(&work.join("jobs/7/2")), ckpt_dir(&linked)).unwrap();
        let (done, report) = std::sync::mpsc::channel();
        let w = work.clone();
        std::thread::spawn(move || done.send(Holdings::default().report(&w, 1)).unwrap());
        let list = report.recv_timeout(std::time::Duration::from_secs(60)).expect("the scan ended").expect("a list");
        let jobs: Vec<i64> = list.iter().map(|x| x.job).collect();
        assert_eq!(jobs, [7, 7], "job 7's own two files only: {list:?}");
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// The encoded length of one holding as an `AgentStatus.holdings` entry.
    fn prost_len(h: &CkptHolding) -> usize {
        use motley_proto::{v1::AgentStatus, Message};
        AgentStatus { holdings: vec![h.clone()], ..Default::default() }.encoded_len()
    }

    #[test]
    fn files_a_piece_lists_whole_are_reported_once_until_they_change() {
        let work = std::env::temp_dir().join(format!("motley-holdings-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        let gen_dir = work.join("jobs/7/2");
        write_step(&gen_dir, 4, 0, 100);
        let h = Holdings::default();
        let first = h.report(&work, 1).expect("the first list");
        let files: Vec<&str> = first.iter().map(|x| x.file.as_str()).collect();
        assert_eq!(files, ["layer.00000.model.tp0-1.safetensors", "rank.00000.safetensors"]);
        assert_eq!((first[0].job, first[0].generation, first[0].step, first[0].bytes), (7, 2, 4, 100));
        assert_eq!((first[0].block.as_str(), first[0].part.as_str(), first[0].rank, first[1].rank), ("layer.0", "model", -1, 0));
        assert!(h.report(&work, 2).is_none(), "sent, not yet acknowledged: not again");
        h.ack(1);
        assert!(h.report(&work, 3).is_none(), "told");
        // A unit the piece lists at another length (half-written): not held.
        write_step(&gen_dir, 8, 1, 50);
        let unit = ckpt_dir(&gen_dir).join("step-00000008/layer.00001.model.tp0-1.safetensors");
        std::fs::write(&unit, [0u8; 10]).unwrap();
        let next = h.report(&work, 4).expect("changed");
        assert_eq!(next.len(), 3, "{next:?}");
        assert!(next.iter().all(|x| x.file != "layer.00001.model.tp0-1.safetensors"));
        // A new session sends the whole list again.
        h.ack(4);
        h.new_session();
        assert_eq!(h.report(&work, 1).unwrap().len(), 3);
        std::fs::remove_dir_all(&work).unwrap();
    }
}
