//! The checkpoint files this node holds, reported to the coordinator's checkpoint-location
//! bitmap (issue 15). Ranks write their checkpoint into `MOTLEY_CKPT_DIR`, which the agent sets
//! to `WORK_DIR/jobs/JOB/GENERATION/ckpt` (docs/checkpoint.md). A file counts once the rank's
//! manifest piece (`manifest.rank.R.json`, written after its files, each through a temporary
//! name) lists it and the file has the length the piece says: never a half-written one.
//!
//! The whole list is sent in a session's first message and whenever it changed
//! (`AgentStatus.holdings`, `holdings_sent`), and counts as told once acknowledged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use motley_checkpoint::Manifest;
use motley_proto::v1::CkptHolding;

/// Where a launch's ranks write their checkpoints.
pub fn ckpt_dir(generation_dir: &Path) -> PathBuf {
    generation_dir.join("ckpt")
}

/// A manifest piece as last read: its length and modification time, the files it lists that
/// were held then, and whether that was all of them.
pub struct Piece {
    stamp: (u64, Option<SystemTime>),
    held: Vec<CkptHolding>,
    all_held: bool,
}

/// Every checkpoint file under `WORK_DIR/jobs/*/*/ckpt/step-*`, sorted. `cache` keeps each
/// piece by path: one unchanged since it was read, and whose files were all there then, is not
/// read again nor are its files looked at (a rank writes its files before its piece, and they
/// go only with their launch directory), so a scan of a quiet node lists directories only.
pub fn scan(work_dir: &Path, cache: &mut BTreeMap<PathBuf, Piece>) -> Vec<CkptHolding> {
    let mut out = vec![];
    let mut seen = std::collections::BTreeSet::new();
    let list = |d: &Path| -> Vec<PathBuf> { std::fs::read_dir(d).map(|r| r.flatten().map(|e| e.path()).collect()).unwrap_or_default() };
    for job_dir in list(&work_dir.join("jobs")) {
        let Some(job) = job_dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse::<i64>().ok()) else { continue };
        for gen_dir in list(&job_dir) {
            let Some(generation) = gen_dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse::<i64>().ok()) else { continue };
            for step_dir in list(&ckpt_dir(&gen_dir)) {
                let name = step_dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                if !name.starts_with("step-") {
                    continue;
                }
                for piece_path in list(&step_dir) {
                    let file = piece_path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                    if !(file.starts_with("manifest.rank.") && file.ends_with(".json")) {
                        continue;
                    }
                    let Ok(meta) = std::fs::metadata(&piece_path) else { continue };
                    let stamp = (meta.len(), meta.modified().ok());
                    if cache.get(&piece_path).is_none_or(|p| p.stamp != stamp || !p.all_held) {
                        match motley_checkpoint::manifest::read_json::<Manifest>(&piece_path) {
                            Ok(m) => {
                                cache.insert(piece_path.clone(), read_piece(&m, &step_dir, job, generation, stamp));
                            }
                            Err(e) => {
                                tracing::warn!("{}: not a manifest piece ({e}); its files are not reported", piece_path.display());
                                continue;
                            }
                        }
                    }
                    seen.insert(piece_path.clone());
                    out.extend(cache[&piece_path].held.iter().cloned());
                }
            }
        }
    }
    cache.retain(|p, _| seen.contains(p));
    out.sort_by(|a, b| (a.job, a.generation, a.step, &a.file).cmp(&(b.job, b.generation, b.step, &b.file)));
    out.dedup_by(|a, b| (a.job, a.generation, a.step, &a.file) == (b.job, b.generation, b.step, &b.file));
    out
}

/// The files a piece lists that are in `step_dir` at the length it says.
fn read_piece(m: &Manifest, step_dir: &Path, job: i64, generation: i64, stamp: (u64, Option<SystemTime>)) -> Piece {
    let is_held = |f: &motley_checkpoint::FileEntry| std::fs::metadata(step_dir.join(&f.file)).is_ok_and(|x| x.len() == f.bytes);
    let base = CkptHolding {
        job,
        generation,
        step: m.step,
        tier: "disk".into(),
        rank: -1,
        layers: m.layers,
        world_size: m.world_size,
        ..Default::default()
    };
    let mut held = vec![];
    for u in m.units.iter().filter(|u| is_held(&u.file)) {
        held.push(CkptHolding {
            file: u.file.file.clone(),
            bytes: u.file.bytes,
            block: u.key.block.to_string(),
            part: u.key.part.to_string(),
            tp_rank: u.key.tp_rank,
            tp_size: u.key.tp_size,
            ..base.clone()
        });
    }
    for r in m.ranks.iter().filter(|r| is_held(&r.file)) {
        held.push(CkptHolding { file: r.file.file.clone(), bytes: r.file.bytes, rank: r.rank as i64, ..base.clone() });
    }
    let all_held = held.len() == m.units.len() + m.ranks.len();
    Piece { stamp, held, all_held }
}

/// What was reported, and what is to be.
#[derive(Default)]
pub struct Holdings {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    cache: BTreeMap<PathBuf, Piece>,
    /// The list the coordinator acknowledged in this session.
    told: Option<Vec<CkptHolding>>,
    /// The list sent in message `seq`, not yet acknowledged.
    sent: Option<(u64, Vec<CkptHolding>)>,
}

impl Holdings {
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
        let now = scan(work_dir, &mut s.cache);
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
