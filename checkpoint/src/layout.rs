//! How a tensor is laid out over a TP group, and re-slicing shards of TP degree t into shards
//! of TP degree t' (docs/checkpoint.md, "Layouts").
//!
//! A shard is the row-major bytes of its local tensor. Along the layout's axis every shard holds
//! a list of runs of global indices, in its local order: one run for a plain split, one per
//! sub-block for a fused tensor (QKV, SwiGLU gate+up), the padded run of a vocabulary split.
//! Re-slicing copies, for every index before the axis, the runs of the target shard from the
//! source shards that hold them; nothing is ever materialised whole.

use serde::{Deserialize, Serialize};

use crate::error::{CkptError, Result};
use crate::Dtype;

/// A tensor's layout over the TP group that holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Layout {
    /// Every TP rank holds the whole tensor.
    Replicated,
    /// Split along `axis`. The axis is cut into consecutive sub-blocks (`blocks`, their lengths;
    /// empty: one block, the whole axis) and every sub-block is split evenly over the TP ranks,
    /// rank r's shard being its piece of each sub-block, concatenated in order (fused QKV:
    /// `[q, k, v]`; SwiGLU's fused gate+up: `[ffn, ffn]`). Each piece is a whole number of
    /// `granule`s (a head's `head_dim` rows; a KV group's rows for Megatron's interleaved QKV),
    /// so a TP degree must divide every sub-block's granule count.
    Split {
        axis: usize,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        blocks: Vec<u64>,
        #[serde(default = "one", skip_serializing_if = "is_one")]
        granule: u64,
    },
    /// A vocabulary split along `axis` (Megatron's VocabParallelEmbedding / head): the global
    /// shape holds the real vocabulary V; at TP degree t the axis is padded with zero rows to
    /// a multiple of `multiple * t` and split evenly, so the padding depends on t.
    Vocab {
        axis: usize,
        #[serde(default = "one", skip_serializing_if = "is_one")]
        multiple: u64,
    },
}

fn one() -> u64 {
    1
}

fn is_one(x: &u64) -> bool {
    *x == 1
}

/// A run [lo, hi) of global indices along the axis (for a vocabulary split, indices >= V are
/// zero padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    lo: u64,
    hi: u64,
}

impl Layout {
    /// Whether `shape` can be laid out this way at TP degree `tp`.
    pub fn check(&self, tensor: &str, shape: &[u64], tp: u32) -> Result<()> {
        let bad = |field: &'static str, message: String| CkptError::Layout { tensor: tensor.into(), field, message };
        if tp == 0 {
            return Err(bad("tp", "a TP degree is at least 1".into()));
        }
        match self {
            Layout::Replicated => Ok(()),
            Layout::Split { axis, granule, .. } => {
                if *axis >= shape.len() {
                    return Err(bad("axis", format!("{axis} is out of range for shape {shape:?}")));
                }
                if *granule == 0 {
                    return Err(bad("granule", "must be at least 1".into()));
                }
                let len = shape[*axis];
                let blocks = self.blocks_of(len);
                if blocks.iter().sum::<u64>() != len {
                    return Err(bad("blocks", format!("{blocks:?} sum to {}, the axis {axis} is {len} long", blocks.iter().sum::<u64>())));
                }
                for (i, b) in blocks.iter().enumerate() {
                    if b % granule != 0 {
                        return Err(bad("granule", format!("sub-block {i} ({b}) is not a multiple of {granule}")));
                    }
                    if (b / granule) % u64::from(tp) != 0 {
                        return Err(CkptError::Granule {
                            tensor: tensor.into(),
                            axis: *axis,
                            block: if blocks.len() > 1 { format!(" in sub-block {i}") } else { String::new() },
                            count: b / granule,
                            granule: *granule,
                            tp,
                        });
                    }
                }
                Ok(())
            }
            Layout::Vocab { axis, multiple } => {
                if *axis >= shape.len() {
                    return Err(bad("axis", format!("{axis} is out of range for shape {shape:?}")));
                }
                if *multiple == 0 {
                    return Err(bad("multiple", "must be at least 1".into()));
                }
                Ok(())
            }
        }
    }

    fn blocks_of(&self, len: u64) -> Vec<u64> {
        match self {
            Layout::Split { blocks, .. } if !blocks.is_empty() => blocks.clone(),
            _ => vec![len],
        }
    }

    fn axis(&self) -> Option<usize> {
        match self {
            Layout::Replicated => None,
            Layout::Split { axis, .. } | Layout::Vocab { axis, .. } => Some(*axis),
        }
    }

    /// The runs of global axis indices rank `rank` of `tp` holds, in its local order.
    fn runs(&self, len: u64, tp: u32, rank: u32) -> Vec<Run> {
        let (t, r) = (u64::from(tp), u64::from(rank));
        match self {
            Layout::Replicated => vec![Run { lo: 0, hi: len }],
            Layout::Split { .. } => {
                let mut off = 0;
                let mut out = Vec::new();
                for b in self.blocks_of(len) {
                    let piece = b / t;
                    out.push(Run { lo: off + r * piece, hi: off + (r + 1) * piece });
                    off += b;
                }
                out
            }
            Layout::Vocab { multiple, .. } => {
                let local = padded(len, multiple * t) / t;
                vec![Run { lo: r * local, hi: (r + 1) * local }]
            }
        }
    }

    /// The local shape of one shard at TP degree `tp` (after `check`).
    pub fn shard_shape(&self, shape: &[u64], tp: u32) -> Vec<u64> {
        let mut s = shape.to_vec();
        if let Some(a) = self.axis() {
            s[a] = self.runs(shape[a], tp, 0).iter().map(|x| x.hi - x.lo).sum();
        }
        s
    }
}

fn padded(len: u64, multiple: u64) -> u64 {
    len.div_ceil(multiple) * multiple
}

fn elem_bytes(tensor: &str, dtype: Dtype) -> Result<u64> {
    let bits = dtype.bitsize();
    if !bits.is_multiple_of(8) {
        return Err(CkptError::Dtype { tensor: tensor.into(), dtype: format!("{dtype:?}"), bits });
    }
    Ok((bits / 8) as u64)
}

/// A tensor as the manifest describes it: global shape, dtype, layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    /// The global (unsharded) shape; a vocabulary split's real vocabulary, unpadded.
    pub shape: Vec<u64>,
    pub dtype: Dtype,
    pub layout: Layout,
}

impl TensorSpec {
    /// Bytes of one shard at TP degree `tp`.
    pub fn shard_bytes(&self, tensor: &str, tp: u32) -> Result<u64> {
        self.layout.check(tensor, &self.shape, tp)?;
        let n: u64 = self.layout.shard_shape(&self.shape, tp).iter().product();
        Ok(n * self.dtype.bitsize() as u64 / 8)
    }
}

/// Rank `rank_out`'s shard at TP degree `tp_out`, from all `shards.len()` (= `tp_in`) shards of
/// `tensor` at TP degree `tp_in`, in TP-rank order (a replicated tensor needs only one).
pub fn reslice_rank(tensor: &str, spec: &TensorSpec, shards: &[&[u8]], tp_in: u32, tp_out: u32, rank_out: u32) -> Result<Vec<u8>> {
    spec.layout.check(tensor, &spec.shape, tp_out)?;
    if rank_out >= tp_out {
        return Err(CkptError::Units(format!("tensor {tensor}: target rank {rank_out} is not below tp {tp_out}")));
    }
    let sources = sources(tensor, spec, shards, tp_in)?;
    let Some(axis) = spec.layout.axis() else {
        return Ok(shards[0].to_vec());
    };
    let len = spec.shape[axis];
    let runs = spec.layout.runs(len, tp_out, rank_out);
    let local_out = spec.layout.shard_shape(&spec.shape, tp_out)[axis];
    copy_runs(spec, axis, &sources, &runs, local_out)
}

/// The shards' runs: (run, shard, offset of the run in the shard, shard's local axis length),
/// sorted by global index; checks the shards' count and sizes.
type Source<'a> = (Run, &'a [u8], u64, u64);

fn sources<'a>(tensor: &str, spec: &TensorSpec, shards: &[&'a [u8]], tp_in: u32) -> Result<Vec<Source<'a>>> {
    let width = elem_bytes(tensor, spec.dtype)?;
    let layout = &spec.layout;
    layout.check(tensor, &spec.shape, tp_in)?;
    let need = if *layout == Layout::Replicated { 1 } else { tp_in as usize };
    if shards.len() < need {
        return Err(CkptError::MissingShard { tensor: tensor.into(), rank: shards.len() as u32, tp: tp_in, given: shards.len() });
    }
    let in_shape = layout.shard_shape(&spec.shape, tp_in);
    let want = in_shape.iter().product::<u64>() * width;
    for (r, s) in shards.iter().enumerate().take(need) {
        if s.len() as u64 != want {
            return Err(CkptError::ShardSize {
                tensor: tensor.into(),
                rank: r as u32,
                tp: tp_in,
                got: s.len(),
                want: want as usize,
                shape: in_shape.clone(),
            });
        }
    }
    let Some(axis) = layout.axis() else {
        return Ok(vec![]);
    };
    let mut src = Vec::new();
    for (r, shard) in shards.iter().enumerate().take(need) {
        let mut off = 0;
        for run in layout.runs(spec.shape[axis], tp_in, r as u32) {
            src.push((run, *shard, off, in_shape[axis]));
            off += run.hi - run.lo;
        }
    }
    src.sort_by_key(|x| x.0.lo);
    Ok(src)
}

/// For every index before the axis, the target's runs copied from the sources (indices past the
/// real length, a vocabulary split's padding, stay zero).
fn copy_runs(spec: &TensorSpec, axis: usize, src: &[Source<'_>], runs: &[Run], local_out: u64) -> Result<Vec<u8>> {
    let width = spec.dtype.bitsize() as u64 / 8;
    let len = spec.shape[axis];
    let outer: u64 = spec.shape[..axis].iter().product();
    let inner: u64 = spec.shape[axis + 1..].iter().product::<u64>() * width;
    let mut out = vec![0u8; (outer * local_out * inner) as usize];
    for o in 0..outer {
        let mut pos = 0u64;
        for run in runs {
            let mut g = run.lo;
            while g < run.hi {
                if g >= len {
                    pos += run.hi - g;
                    break;
                }
                let i = src.partition_point(|x| x.0.hi <= g);
                let (s, shard, off, local_in) = src[i];
                let n = run.hi.min(s.hi).min(len) - g;
                let from = ((o * local_in + off + (g - s.lo)) * inner) as usize;
                let to = ((o * local_out + pos) * inner) as usize;
                let bytes = (n * inner) as usize;
                out[to..to + bytes].copy_from_slice(&shard[from..from + bytes]);
                g += n;
                pos += n;
            }
        }
    }
    Ok(out)
}

/// All `tp_out` shards of `tensor` from its `tp_in` shards (see [`reslice_rank`]).
pub fn reslice(tensor: &str, spec: &TensorSpec, shards: &[&[u8]], tp_in: u32, tp_out: u32) -> Result<Vec<Vec<u8>>> {
    (0..tp_out).map(|r| reslice_rank(tensor, spec, shards, tp_in, tp_out, r)).collect()
}

/// The `tp` shards of the full tensor (its global shape, a vocabulary split unpadded).
pub fn shard_full(tensor: &str, spec: &TensorSpec, full: &[u8], tp: u32) -> Result<Vec<Vec<u8>>> {
    let width = elem_bytes(tensor, spec.dtype)?;
    spec.layout.check(tensor, &spec.shape, tp)?;
    let want = spec.shape.iter().product::<u64>() * width;
    if full.len() as u64 != want {
        return Err(CkptError::ShardSize {
            tensor: tensor.into(),
            rank: 0,
            tp: 1,
            got: full.len(),
            want: want as usize,
            shape: spec.shape.clone(),
        });
    }
    let Some(axis) = spec.layout.axis() else {
        return Ok(vec![full.to_vec(); tp as usize]);
    };
    let len = spec.shape[axis];
    let src = [(Run { lo: 0, hi: len }, full, 0, len)];
    let local_out = spec.layout.shard_shape(&spec.shape, tp)[axis];
    (0..tp).map(|r| copy_runs(spec, axis, &src, &spec.layout.runs(len, tp, r), local_out)).collect()
}

/// The full tensor (its global shape, a vocabulary split's padding dropped) from its `tp` shards.
pub fn unshard(tensor: &str, spec: &TensorSpec, shards: &[&[u8]], tp: u32) -> Result<Vec<u8>> {
    let src = sources(tensor, spec, shards, tp)?;
    let Some(axis) = spec.layout.axis() else {
        return Ok(shards[0].to_vec());
    };
    let len = spec.shape[axis];
    copy_runs(spec, axis, &src, &[Run { lo: 0, hi: len }], len)
}
