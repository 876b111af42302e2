//! Every error of the crate, each naming what is at fault and how to fix it.

use std::path::PathBuf;

/// The crate's one error type.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    /// A TP degree does not divide a split tensor's granules (heads, KV groups, rows).
    #[error(
        "tensor {tensor}: tp {tp} does not divide the {count} granules of {granule} along axis {axis}{block}; \
         use a tp that divides {count}"
    )]
    Granule {
        tensor: String,
        axis: usize,
        /// "" for a one-block split, " in sub-block i" otherwise.
        block: String,
        count: u64,
        granule: u64,
        tp: u32,
    },
    /// A layout field that cannot describe the tensor (axis out of range, sub-blocks that do not sum up).
    #[error("tensor {tensor}: layout.{field}: {message}")]
    Layout { tensor: String, field: &'static str, message: String },
    /// Fewer shards than the source TP degree.
    #[error(
        "tensor {tensor}: shard {rank} of tp {tp} is missing ({given} given); pass all {tp} shards of the unit, \
         in tp-rank order"
    )]
    MissingShard { tensor: String, rank: u32, tp: u32, given: usize },
    /// A shard whose byte length is not the one its layout gives.
    #[error(
        "tensor {tensor}: shard {rank} of tp {tp} has {got} bytes, its layout needs {want} (local shape {shape:?}); \
         the shard belongs to another tensor or TP degree"
    )]
    ShardSize { tensor: String, rank: u32, tp: u32, got: usize, want: usize, shape: Vec<u64> },
    /// Sub-byte dtypes (F4, F6) cannot be cut on element boundaries by bytes.
    #[error("tensor {tensor}: dtype {dtype} is {bits} bits wide; re-slicing needs whole bytes per element")]
    Dtype { tensor: String, dtype: String, bits: usize },
    /// A chunk whose crc32c is not the manifest's.
    #[error(
        "unit {file}: chunk {chunk} (bytes {start}..{end}) has crc32c {got:08x}, the manifest says {want:08x}; \
         this copy is corrupt: fetch the unit again from another holder"
    )]
    Crc { file: String, chunk: usize, start: u64, end: u64, got: u32, want: u32 },
    /// A file whose length is not the manifest's.
    #[error(
        "unit {file}: {got} bytes, the manifest says {want}; the copy is truncated or of another step: \
         fetch it again"
    )]
    Size { file: String, got: u64, want: u64 },
    /// A manifest whose units do not cover the model.
    #[error("step {step} is not restorable: {what}; restore the previous complete step")]
    Incomplete { step: u64, what: String },
    /// Manifest pieces (or units) that contradict one another.
    #[error("{field}: {a} here, {b} there; pieces of different steps or jobs were mixed")]
    Conflict { field: String, a: String, b: String },
    /// Units handed to the re-slicer that do not form one (block, part) at one TP degree.
    #[error("units to re-slice: {0}")]
    Units(String),
    /// A manifest or piece larger than the format allows (`MAX_PIECE_BYTES`, `MAX_MANIFEST_BYTES`).
    #[error("{path}: {bytes} bytes, over the {limit} bytes a {what} may be (docs/checkpoint.md, \"Limits\"); not read")]
    TooLarge { path: PathBuf, what: &'static str, bytes: u64, limit: u64 },
    /// A file that is not what the format says.
    #[error("{path}: not a Motley checkpoint file: {message}")]
    Format { path: PathBuf, message: String },
    /// An operating-system error on a path.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The crate's result type.
pub type Result<T, E = CkptError> = std::result::Result<T, E>;

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> CkptError {
    let path = path.into();
    move |source| CkptError::Io { path, source }
}
