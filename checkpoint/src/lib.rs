//! Motley's checkpoint format (docs/checkpoint.md): one safetensors file per unit (step, block,
//! part, TP rank, TP size), a manifest per step with a crc32c per 16 MiB chunk of every file and
//! every tensor's global shape, dtype and layout, and re-slicing of shards from one TP degree to
//! another. Pure: files in and out, no async, no network.

pub mod crc;
pub mod error;
pub mod layout;
pub mod manifest;
pub mod unit;

pub use crc::FileEntry;
pub use error::{CkptError, Result};
pub use layout::{reslice, reslice_rank, shard_full, unshard, Layout, TensorSpec};
pub use manifest::{Block, Manifest, Part, RankEntry, UnitEntry, UnitKey, CHUNK_BYTES, FORMAT};
/// Element types, as safetensors names them (`F32`, `BF16`, ...).
pub use safetensors::Dtype;
pub use unit::{reslice_step, reslice_unit, write_atomic, Unit};
