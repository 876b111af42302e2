//! Unit files: safetensors files whose `__metadata__["motley"]` is the unit's header (format,
//! step, block, part, tp_rank, tp_size, every tensor's global spec, and the generation of the
//! launch that wrote it where the writer knew it), written to a temporary name, fsynced and
//! renamed; and re-slicing whole units and steps (a cut unit keeps its sources' generation).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::crc::{file_entry, verify_file};
use crate::error::{io, CkptError, Result};
use crate::layout::{reslice_rank, Layout, TensorSpec};
use crate::manifest::{unit_file_name, Manifest, UnitEntry, UnitKey, CHUNK_BYTES, FORMAT, MANIFEST};
use crate::Dtype;

/// The key of a unit file's safetensors metadata that holds its header.
pub const META_KEY: &str = "motley";

#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    step: u64,
    /// The launch whose ranks wrote it (`MOTLEY_GENERATION`); absent from files written
    /// outside an agent's launch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    generation: Option<i64>,
    #[serde(flatten)]
    key: UnitKey,
    tensors: BTreeMap<String, TensorSpec>,
}

/// A unit in memory: every tensor's global spec and its shard's bytes (row-major, local shape
/// `spec.layout.shard_shape(spec.shape, key.tp_size)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    pub step: u64,
    /// The generation that wrote it, when its header records one.
    pub generation: Option<i64>,
    pub key: UnitKey,
    pub tensors: BTreeMap<String, (TensorSpec, Vec<u8>)>,
}

struct Raw<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl safetensors::View for &Raw<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

impl Unit {
    /// The unit as a safetensors file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut raws = Vec::new();
        for (name, (spec, data)) in &self.tensors {
            let want = spec.shard_bytes(name, self.key.tp_size)?;
            if data.len() as u64 != want {
                return Err(CkptError::ShardSize {
                    tensor: name.clone(),
                    rank: self.key.tp_rank,
                    tp: self.key.tp_size,
                    got: data.len(),
                    want: want as usize,
                    shape: spec.layout.shard_shape(&spec.shape, self.key.tp_size),
                });
            }
            let shape = spec.layout.shard_shape(&spec.shape, self.key.tp_size).iter().map(|&x| x as usize).collect();
            raws.push((name.clone(), Raw { dtype: spec.dtype, shape, data }));
        }
        let header = Header {
            format: FORMAT.into(),
            step: self.step,
            generation: self.generation,
            key: self.key,
            tensors: self.tensors.iter().map(|(k, (s, _))| (k.clone(), s.clone())).collect(),
        };
        let meta = HashMap::from([(META_KEY.to_string(), serde_json::to_string(&header).expect("header serialises"))]);
        safetensors::serialize(raws.iter().map(|(n, r)| (n.as_str(), r)), Some(meta))
            .map_err(|e| CkptError::Format { path: unit_file_name(&self.key).into(), message: format!("safetensors: {e}") })
    }

    /// A unit from a safetensors file's bytes (`path` names it in errors).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Unit> {
        let bad = |message: String| CkptError::Format { path: path.into(), message };
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(format!("safetensors: {e}")))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(format!("safetensors: {e}")))?;
        let text =
            meta.metadata().as_ref().and_then(|m| m.get(META_KEY)).ok_or_else(|| bad(format!("no __metadata__.{META_KEY} header")))?;
        let header: Header = serde_json::from_str(text).map_err(|e| bad(format!("__metadata__.{META_KEY}: {e}")))?;
        if header.format != FORMAT {
            return Err(bad(format!("format {:?}, expected {FORMAT:?}", header.format)));
        }
        let mut tensors = BTreeMap::new();
        for (name, spec) in header.tensors {
            let view = st.tensor(&name).map_err(|e| bad(format!("tensor {name}: {e}")))?;
            spec.layout.check(&name, &spec.shape, header.key.tp_size)?;
            let want = spec.layout.shard_shape(&spec.shape, header.key.tp_size);
            let got: Vec<u64> = view.shape().iter().map(|&x| x as u64).collect();
            if got != want || view.dtype() != spec.dtype {
                return Err(bad(format!(
                    "tensor {name}: stored {:?} {got:?}, its header says {:?} with local shape {want:?}",
                    view.dtype(),
                    spec.dtype
                )));
            }
            tensors.insert(name, (spec, view.data().to_vec()));
        }
        if st.len() != tensors.len() {
            return Err(bad(format!("{} tensors stored, {} in the header", st.len(), tensors.len())));
        }
        Ok(Unit { step: header.step, generation: header.generation, key: header.key, tensors })
    }

    /// Reads a unit file.
    pub fn read(path: &Path) -> Result<Unit> {
        let bytes = std::fs::read(path).map_err(io(path))?;
        Unit::from_bytes(path, &bytes)
    }

    /// Writes the unit as `step_dir/<unit file name>` (temporary name, fsync, rename) and
    /// returns its manifest entry.
    pub fn write(&self, step_dir: &Path) -> Result<UnitEntry> {
        let bytes = self.to_bytes()?;
        let name = unit_file_name(&self.key);
        write_atomic(&step_dir.join(&name), &bytes)?;
        Ok(UnitEntry {
            key: self.key,
            file: file_entry(&name, &bytes, CHUNK_BYTES),
            tensors: self.tensors.iter().map(|(k, (s, _))| (k.clone(), s.clone())).collect(),
        })
    }

    /// Whether every tensor is replicated (such a unit is written once, as TP rank 0 of 1, and
    /// serves every TP rank).
    pub fn replicated(&self) -> bool {
        self.tensors.values().all(|(s, _)| s.layout == Layout::Replicated)
    }
}

/// Writes `bytes` to `path` through `path.tmp.<pid>`: written, fsynced, renamed, the directory
/// fsynced; a reader sees the old file, no file, or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io(dir))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    // Weights and optimizer state are the job's own: owner only.
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// The `tp_out` units of one (block, part) from all its units at one TP degree (any order). A
/// unit whose tensors are all replicated is returned as it is (TP rank 0 of 1).
pub fn reslice_unit(units: &[Unit], tp_out: u32) -> Result<Vec<Unit>> {
    let Some(first) = units.first() else {
        return Err(CkptError::Units("no units given".into()));
    };
    let (block, part, tp_in, step, generation) = (first.key.block, first.key.part, first.key.tp_size, first.step, first.generation);
    let mut by_rank: Vec<Option<&Unit>> = vec![None; tp_in as usize];
    for u in units {
        // Shards of one step written by two launches are not one unit (docs/recovery.md).
        if u.generation != generation {
            return Err(CkptError::Units(format!(
                "{} was written by generation {:?} and {} by generation {generation:?}: re-slice the shards of one generation",
                u.key, u.generation, first.key
            )));
        }
        if (u.key.block, u.key.part, u.key.tp_size, u.step) != (block, part, tp_in, step) {
            return Err(CkptError::Units(format!(
                "{} (step {}) is not of {block} {part} at tp {tp_in}, step {step}: re-slice one block and part at a time",
                u.key, u.step
            )));
        }
        if u.tensors.keys().ne(first.tensors.keys()) {
            return Err(CkptError::Units(format!("{} and {} hold different tensors", u.key, first.key)));
        }
        by_rank[u.key.tp_rank as usize] = Some(u);
    }
    if tp_in == 1 && first.replicated() {
        return Ok(vec![first.clone()]);
    }
    if let Some(r) = by_rank.iter().position(Option::is_none) {
        return Err(CkptError::Units(format!("{block} {part}: the unit of tp rank {r} of {tp_in} is missing; fetch every tp rank's unit")));
    }
    let by_rank: Vec<&Unit> = by_rank.into_iter().map(|u| u.expect("checked")).collect();
    let mut out = Vec::new();
    for r in 0..tp_out {
        let mut tensors = BTreeMap::new();
        for (name, (spec, _)) in &first.tensors {
            let shards: Vec<&[u8]> = by_rank.iter().map(|u| u.tensors[name].1.as_slice()).collect();
            tensors.insert(name.clone(), (spec.clone(), reslice_rank(name, spec, &shards, tp_in, tp_out, r)?));
        }
        out.push(Unit { step, generation, key: UnitKey { block, part, tp_rank: r, tp_size: tp_out }, tensors });
    }
    Ok(out)
}

/// Re-slices a whole step: verifies `src` (complete, every crc), re-slices every (block, part)
/// not already at `tp_out` (units of replicated tensors only stay TP 0 of 1), copies the rank
/// files, and writes the new step with its `manifest.json` (last) into `dst`.
pub fn reslice_step(src: &Path, dst: &Path, tp_out: u32) -> Result<Manifest> {
    let m = Manifest::load(src)?;
    m.check_complete()?;
    m.verify(src)?;
    for u in &m.units {
        for (name, spec) in &u.tensors {
            spec.layout.check(name, &spec.shape, tp_out)?;
        }
    }
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    let mut groups: BTreeMap<_, Vec<&UnitEntry>> = BTreeMap::new();
    for u in &m.units {
        groups.entry((u.key.block, u.key.part)).or_default().push(u);
    }
    let mut units = Vec::new();
    for entries in groups.values() {
        let loaded = entries.iter().map(|e| Unit::read(&src.join(&e.file.file))).collect::<Result<Vec<_>>>()?;
        for u in reslice_unit(&loaded, tp_out)? {
            units.push(u.write(dst)?);
        }
    }
    let mut ranks = Vec::new();
    for r in &m.ranks {
        let from = src.join(&r.file.file);
        let bytes = std::fs::read(&from).map_err(io(&from))?;
        write_atomic(&dst.join(&r.file.file), &bytes)?;
        ranks.push(r.clone());
    }
    let out = Manifest { units, ranks, ..m };
    out.check_complete()?;
    let text = serde_json::to_vec_pretty(&out).expect("manifest serialises");
    write_atomic(&dst.join(MANIFEST), &text)?;
    for f in out.units.iter().map(|u| &u.file).chain(out.ranks.iter().map(|r| &r.file)) {
        verify_file(&dst.join(&f.file), f)?;
    }
    Ok(out)
}
