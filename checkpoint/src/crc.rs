//! crc32c per chunk of a file, as the manifest records it: a file's entry (name, size, chunk
//! crcs), made from bytes and checked against bytes or a file. Below the manifest: it calls
//! nothing of this crate but `error`.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{io, CkptError, Result};

/// A file of the step: its name in the step directory, its bytes, a crc32c per chunk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub file: String,
    pub bytes: u64,
    pub chunk_bytes: u64,
    pub crc32c: Vec<u32>,
}

/// One crc32c (Castagnoli) per `chunk` bytes of `bytes` (the last chunk may be shorter; an empty
/// file has no chunk).
pub fn chunk_crcs(bytes: &[u8], chunk: u64) -> Vec<u32> {
    bytes.chunks(chunk.max(1) as usize).map(crc32c::crc32c).collect()
}

/// The manifest entry of `bytes` stored as `file`.
pub fn file_entry(file: &str, bytes: &[u8], chunk: u64) -> FileEntry {
    FileEntry { file: file.into(), bytes: bytes.len() as u64, chunk_bytes: chunk, crc32c: chunk_crcs(bytes, chunk) }
}

/// Checks `bytes` (the contents of `entry.file`) against the entry: size, then every chunk.
pub fn verify_bytes(entry: &FileEntry, bytes: &[u8]) -> Result<()> {
    if bytes.len() as u64 != entry.bytes {
        return Err(CkptError::Size { file: entry.file.clone(), got: bytes.len() as u64, want: entry.bytes });
    }
    let got = chunk_crcs(bytes, entry.chunk_bytes);
    if got.len() != entry.crc32c.len() {
        return Err(CkptError::Format {
            path: entry.file.clone().into(),
            message: format!(
                "the manifest lists {} chunk crcs, {} bytes in chunks of {} make {}",
                entry.crc32c.len(),
                entry.bytes,
                entry.chunk_bytes,
                got.len()
            ),
        });
    }
    for (i, (g, w)) in got.iter().zip(&entry.crc32c).enumerate() {
        if g != w {
            let start = i as u64 * entry.chunk_bytes;
            return Err(CkptError::Crc {
                file: entry.file.clone(),
                chunk: i,
                start,
                end: (start + entry.chunk_bytes).min(entry.bytes),
                got: *g,
                want: *w,
            });
        }
    }
    Ok(())
}

/// Checks the file at `path` against `entry`, one chunk in memory at a time.
pub fn verify_file(path: &Path, entry: &FileEntry) -> Result<()> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let len = f.metadata().map_err(io(path))?.len();
    if len != entry.bytes {
        return Err(CkptError::Size { file: entry.file.clone(), got: len, want: entry.bytes });
    }
    let chunk = entry.chunk_bytes.max(1);
    let mut buf = vec![0u8; chunk.min(len.max(1)) as usize];
    let mut crcs = Vec::new();
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk) as usize;
        f.read_exact(&mut buf[..n]).map_err(io(path))?;
        crcs.push(crc32c::crc32c(&buf[..n]));
        left -= n as u64;
    }
    // Same comparison as for bytes in memory, on the crcs just computed.
    let fake = FileEntry { crc32c: crcs, ..entry.clone() };
    for (i, (g, w)) in fake.crc32c.iter().zip(&entry.crc32c).enumerate() {
        if g != w {
            let start = i as u64 * chunk;
            return Err(CkptError::Crc { file: entry.file.clone(), chunk: i, start, end: (start + chunk).min(len), got: *g, want: *w });
        }
    }
    if fake.crc32c.len() != entry.crc32c.len() {
        return Err(CkptError::Format {
            path: path.into(),
            message: format!("the manifest lists {} chunk crcs, the file has {} chunks", entry.crc32c.len(), fake.crc32c.len()),
        });
    }
    Ok(())
}
