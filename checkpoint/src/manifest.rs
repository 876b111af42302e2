//! The manifest of one checkpoint step, its pieces (one per rank), names of files, and the
//! completeness rule: a step is restorable only once every unit is reported.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::crc::{verify_file, FileEntry};
use crate::error::{io, CkptError, Result};
use crate::layout::TensorSpec;

/// The `format` of manifests, pieces and unit headers.
pub const FORMAT: &str = "motley-checkpoint/1";
/// The chunk over which one crc32c is taken.
pub const CHUNK_BYTES: u64 = 16 << 20;
/// The merged manifest in a step directory.
pub const MANIFEST: &str = "manifest.json";
/// The largest manifest piece a reader takes (docs/checkpoint.md, "Limits"): agents read every
/// piece on their node, and report what it lists over a bounded message.
pub const MAX_PIECE_BYTES: u64 = 8 << 20;
/// The largest merged manifest a reader takes (every rank's piece in one).
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// What part of the model a unit holds: the embeddings (token and position), one transformer
/// layer, or the head (final norm and output projection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Block {
    Embed,
    Layer(u32),
    Head,
}

impl fmt::Display for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Block::Embed => f.write_str("embed"),
            Block::Layer(l) => write!(f, "layer.{l}"),
            Block::Head => f.write_str("head"),
        }
    }
}

impl FromStr for Block {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "embed" => Ok(Block::Embed),
            "head" => Ok(Block::Head),
            _ => s
                .strip_prefix("layer.")
                .and_then(|l| l.parse().ok())
                .map(Block::Layer)
                .ok_or_else(|| format!("block {s:?}: expected embed, head or layer.N")),
        }
    }
}

impl Serialize for Block {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Block {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// The model's parameters or their optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    Model,
    Optimizer,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Part::Model => "model",
            Part::Optimizer => "optimizer",
        })
    }
}

impl FromStr for Part {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "model" => Ok(Part::Model),
            "optimizer" => Ok(Part::Optimizer),
            _ => Err(format!("part {s:?}: expected model or optimizer")),
        }
    }
}

/// Which unit: (block, part, TP rank, TP size) of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct UnitKey {
    pub block: Block,
    pub part: Part,
    pub tp_rank: u32,
    pub tp_size: u32,
}

impl fmt::Display for UnitKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} tp {}/{}", self.block, self.part, self.tp_rank, self.tp_size)
    }
}

/// `step-00000010`: a step's directory under `MOTLEY_CKPT_DIR`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// `layer.00003.model.tp0-2.safetensors`, `embed.optimizer.tp0-1.safetensors`.
pub fn unit_file_name(key: &UnitKey) -> String {
    let block = match key.block {
        Block::Layer(l) => format!("layer.{l:05}"),
        b => b.to_string(),
    };
    format!("{block}.{}.tp{}-{}.safetensors", key.part, key.tp_rank, key.tp_size)
}

/// `rank.00003.safetensors`: a rank's state that is not per layer.
pub fn rank_file_name(rank: u32) -> String {
    format!("rank.{rank:05}.safetensors")
}

/// `manifest.rank.00003.json`: the piece of the manifest one rank wrote.
pub fn piece_file_name(rank: u32) -> String {
    format!("manifest.rank.{rank:05}.json")
}

/// One unit in the manifest: which, its file, and every tensor's global spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitEntry {
    #[serde(flatten)]
    pub key: UnitKey,
    #[serde(flatten)]
    pub file: FileEntry,
    pub tensors: BTreeMap<String, TensorSpec>,
}

/// One rank's state file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEntry {
    pub rank: u32,
    #[serde(flatten)]
    pub file: FileEntry,
}

/// A step's manifest, or one rank's piece of it (the same form, listing what that rank wrote).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// Optimizer steps taken: a restore resumes at this step.
    pub step: u64,
    /// Transformer layers of the model (units: embed, layer.0 .. layer.{layers-1}, head).
    pub layers: u32,
    /// Ranks of the plan that wrote the step (one rank file each).
    pub world_size: u32,
    #[serde(default)]
    pub units: Vec<UnitEntry>,
    #[serde(default)]
    pub ranks: Vec<RankEntry>,
    /// Ranks of the plan that wrote no piece: their replica was lost and the job kept going
    /// (docs/keep-going.md). The epoch's leader wrote their rank files, so a complete step still
    /// has one per rank; a node's agent takes a step as whole without their pieces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost_ranks: Vec<u32>,
}

fn conflict(field: impl Into<String>, a: impl fmt::Display, b: impl fmt::Display) -> CkptError {
    CkptError::Conflict { field: field.into(), a: a.to_string(), b: b.to_string() }
}

impl Manifest {
    /// The union of the pieces of one step (units written twice must agree).
    pub fn merge(pieces: impl IntoIterator<Item = Manifest>) -> Result<Manifest> {
        let mut pieces = pieces.into_iter();
        let Some(first) = pieces.next() else {
            return Err(CkptError::Units("no manifest pieces to merge".into()));
        };
        let mut units: BTreeMap<UnitKey, UnitEntry> = BTreeMap::new();
        let mut ranks: BTreeMap<u32, RankEntry> = BTreeMap::new();
        let mut lost_ranks = std::collections::BTreeSet::new();
        let header = |m: &Manifest| (m.format.clone(), m.step, m.layers, m.world_size);
        let h0 = header(&first);
        for m in std::iter::once(first).chain(pieces) {
            let h = header(&m);
            for (field, a, b) in [
                ("format", h0.0.clone(), h.0.clone()),
                ("step", h0.1.to_string(), h.1.to_string()),
                ("layers", h0.2.to_string(), h.2.to_string()),
                ("world_size", h0.3.to_string(), h.3.to_string()),
            ] {
                if a != b {
                    return Err(conflict(field, a, b));
                }
            }
            for u in m.units {
                if let Some(old) = units.get(&u.key) {
                    if *old != u {
                        return Err(conflict(format!("unit {}", u.key), &old.file.file, &u.file.file));
                    }
                }
                units.insert(u.key, u);
            }
            for r in m.ranks {
                if let Some(old) = ranks.get(&r.rank) {
                    if *old != r {
                        return Err(conflict(format!("rank {}", r.rank), &old.file.file, &r.file.file));
                    }
                }
                ranks.insert(r.rank, r);
            }
            lost_ranks.extend(m.lost_ranks);
        }
        Ok(Manifest {
            format: h0.0,
            step: h0.1,
            layers: h0.2,
            world_size: h0.3,
            units: units.into_values().collect(),
            ranks: ranks.into_values().collect(),
            lost_ranks: lost_ranks.into_iter().collect(),
        })
    }

    /// Every block (embed, each layer, head) has both parts at one TP size with every TP rank
    /// present, and every rank of the plan has its rank file.
    pub fn check_complete(&self) -> Result<()> {
        let incomplete = |what: String| CkptError::Incomplete { step: self.step, what };
        if self.format != FORMAT {
            return Err(incomplete(format!("format {:?} is not {FORMAT:?}", self.format)));
        }
        let mut have: BTreeMap<(Block, Part), (u32, Vec<bool>)> = BTreeMap::new();
        for u in &self.units {
            let k = u.key;
            if k.tp_size == 0 || k.tp_rank >= k.tp_size {
                return Err(incomplete(format!("unit {k} has tp_rank outside its tp_size")));
            }
            if let Block::Layer(l) = k.block {
                if l >= self.layers {
                    return Err(incomplete(format!("unit {k} is past the model's {} layers", self.layers)));
                }
            }
            let e = have.entry((k.block, k.part)).or_insert_with(|| (k.tp_size, vec![false; k.tp_size as usize]));
            if e.0 != k.tp_size {
                return Err(incomplete(format!("{} {} has units of tp size {} and {}", k.block, k.part, e.0, k.tp_size)));
            }
            e.1[k.tp_rank as usize] = true;
        }
        let blocks = std::iter::once(Block::Embed).chain((0..self.layers).map(Block::Layer)).chain([Block::Head]);
        for b in blocks {
            for p in [Part::Model, Part::Optimizer] {
                match have.get(&(b, p)) {
                    None => return Err(incomplete(format!("unit {b} {p} was never reported"))),
                    Some((t, seen)) => {
                        if let Some(r) = seen.iter().position(|x| !x) {
                            return Err(incomplete(format!("unit {b} {p} tp {r}/{t} was never reported")));
                        }
                    }
                }
            }
        }
        let ranks: std::collections::BTreeSet<u32> = self.ranks.iter().map(|r| r.rank).collect();
        if let Some(r) = (0..self.world_size).find(|r| !ranks.contains(r)) {
            return Err(incomplete(format!("the rank file of rank {r} was never reported")));
        }
        Ok(())
    }

    /// Every file's size and chunk crcs, read from `step_dir`.
    pub fn verify(&self, step_dir: &Path) -> Result<()> {
        for f in self.units.iter().map(|u| &u.file).chain(self.ranks.iter().map(|r| &r.file)) {
            verify_file(&step_dir.join(&f.file), f)?;
        }
        Ok(())
    }

    /// The step's manifest from `step_dir`: `manifest.json` when present, else the merge of
    /// every `manifest.rank.*.json` piece.
    pub fn load(step_dir: &Path) -> Result<Manifest> {
        let merged = step_dir.join(MANIFEST);
        if merged.exists() {
            return read_json(&merged);
        }
        let mut pieces = Vec::new();
        for e in std::fs::read_dir(step_dir).map_err(io(step_dir))? {
            let p = e.map_err(io(step_dir))?.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.starts_with("manifest.rank.") && name.ends_with(".json") {
                pieces.push(read_piece(&p)?);
            }
        }
        if pieces.is_empty() {
            return Err(CkptError::Format { path: step_dir.into(), message: format!("no {MANIFEST} and no manifest.rank.*.json pieces") });
        }
        Manifest::merge(pieces)
    }
}

/// Reads a JSON document (a manifest or a piece) of at most `MAX_MANIFEST_BYTES`.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    read_bounded(path, "manifest", MAX_MANIFEST_BYTES)
}

/// Reads one rank's manifest piece, refused over `MAX_PIECE_BYTES` (before it is read whole).
pub fn read_piece(path: &Path) -> Result<Manifest> {
    read_bounded(path, "manifest piece", MAX_PIECE_BYTES)
}

fn read_bounded<T: serde::de::DeserializeOwned>(path: &Path, what: &'static str, limit: u64) -> Result<T> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(io(path))?;
    let mut text = Vec::new();
    // One byte past the limit tells a file over it, even one growing while it is read.
    f.take(limit + 1).read_to_end(&mut text).map_err(io(path))?;
    if text.len() as u64 > limit {
        let bytes = std::fs::metadata(path).map_or(text.len() as u64, |m| m.len());
        return Err(CkptError::TooLarge { path: path.into(), what, bytes, limit });
    }
    serde_json::from_slice(&text).map_err(|e| CkptError::Format { path: path.into(), message: e.to_string() })
}

#[cfg(test)]
mod bounded_tests {
    use super::*;

    #[test]
    fn a_piece_over_the_limit_is_refused_naming_its_size_and_the_limit() {
        let dir = std::env::temp_dir().join(format!("motley-piece-limit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("manifest.rank.00000.json");
        // Valid JSON whitespace, one byte past the limit.
        let mut text = br#"{"format": "motley-checkpoint/1", "step": 1, "layers": 1, "world_size": 1}"#.to_vec();
        std::fs::write(&p, &text).unwrap();
        assert_eq!(read_piece(&p).unwrap().step, 1);
        text.resize(MAX_PIECE_BYTES as usize + 1, b' ');
        std::fs::write(&p, &text).unwrap();
        let e = read_piece(&p).unwrap_err().to_string();
        assert!(e.contains(&format!("{} bytes, over the {MAX_PIECE_BYTES} bytes a manifest piece may be", MAX_PIECE_BYTES + 1)), "{e}");
        // The merged manifest's own, larger limit takes it.
        assert_eq!(read_json::<Manifest>(&p).unwrap().step, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod lost_rank_tests {
    use super::*;

    fn piece(rank: u32, lost: Vec<u32>) -> Manifest {
        let file = FileEntry { file: rank_file_name(rank), bytes: 1, chunk_bytes: 16, crc32c: vec![0] };
        Manifest {
            format: FORMAT.into(),
            step: 4,
            layers: 1,
            world_size: 4,
            units: vec![],
            ranks: vec![RankEntry { rank, file }],
            lost_ranks: lost,
        }
    }

    #[test]
    fn the_lost_ranks_of_a_steps_pieces_merge_and_are_absent_where_none_were_lost() {
        let m = Manifest::merge([piece(0, vec![2, 3]), piece(1, vec![2, 3])]).unwrap();
        assert_eq!(m.lost_ranks, [2, 3]);
        let text = serde_json::to_string(&piece(0, vec![])).unwrap();
        assert!(!text.contains("lost_ranks"), "a step of every rank reads as before: {text}");
        let back: Manifest = serde_json::from_str(&text).unwrap();
        assert!(back.lost_ranks.is_empty());
    }
}
