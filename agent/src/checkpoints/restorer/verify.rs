//! Checking a restored file against its manifest entry: every chunk's CRC-32C, always (a file
//! the ask gives no crcs for is refused, docs/recovery.md step 6), read through one fixed
//! buffer off the async workers, so a multi-GB unit costs neither its size in memory nor a
//! worker thread the heartbeat needs; and, for a copy assembled from several sources, the first
//! corrupt chunk fetched again from a holder that did not send it (through `sources`). Its
//! buffers are `budget`'s.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use motley_checkpoint::FileEntry;
use motley_proto::v1::{FetchSource, Restore, RestoreFile};

use super::budget::{blocking, buffer, IO_BUFFER};
use super::sources::{describe, CloudSide, Sent};
use super::{Restorer, Tally};
use crate::checkpoints::dataplane::FileKey;

/// Refuse an ask a restore cannot carry out safely: files of more than one generation (a step
/// is restored as one generation wrote it), or a file without a crc32c for every chunk (every
/// restored chunk is verified).
pub(super) fn check_ask(r: &Restore) -> Result<(), String> {
    let mut generations: Vec<i64> = r.files.iter().map(|f| f.source_generation).collect();
    generations.sort_unstable();
    generations.dedup();
    if generations.len() > 1 {
        return Err(format!(
            "refused: the restore of step {} names files of generations {generations:?}; a step is restored from the files of one \
             generation (a coordinator that keeps generations apart sends one)",
            r.step
        ));
    }
    for f in &r.files {
        let chunks = if f.chunk_bytes == 0 { None } else { Some(f.bytes.div_ceil(f.chunk_bytes)) };
        if chunks != Some(f.crc32c.len() as u64) {
            return Err(format!(
                "refused: file {} ({} bytes) comes with chunk_bytes {} and {} crc32c values, not one per chunk; every restored chunk \
                 is verified: the coordinator must send the crcs its holder's manifest piece lists",
                f.file,
                f.bytes,
                f.chunk_bytes,
                f.crc32c.len()
            ));
        }
    }
    Ok(())
}

impl Restorer {
    /// Verify the assembled copy; a corrupt chunk is fetched again from the next source.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn repair(
        &self,
        key: &FileKey,
        f: &RestoreFile,
        file: &File,
        entry: &FileEntry,
        tmp: &Path,
        mut sent: Vec<Sent>,
        cloud: &CloudSide,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let mut tries: Vec<&FetchSource> = f.fallbacks.iter().collect();
        let mut failed: Option<String> = None;
        loop {
            let (synced, path, e) = (file.try_clone().map_err(|e| format!("{}: {e}", tmp.display()))?, tmp.to_path_buf(), entry.clone());
            let bad = {
                let _buffer = buffer(1).await;
                blocking(move || {
                    synced.sync_data().map_err(|err| format!("{}: {err}", path.display()))?;
                    bad_chunk(&path, &e)
                })
                .await?
            };
            let Some((chunk, start, end)) = bad else { return Ok(()) };
            // Whoever sent that chunk's bytes (a fallback, if the planned source failed; more
            // than one, if a range boundary cuts it). A sole sender is not asked again; of
            // several, which one is corrupt is unknown: the next whole chunk tells.
            let culprits = senders(&sent, start, end);
            if let [culprit] = culprits.as_slice() {
                tries.retain(|s| *s != culprit);
            }
            // A holder that cannot send it (gone meanwhile, or the one whose range failed) is
            // passed over for the next.
            let next = loop {
                let Some(next) = (!tries.is_empty()).then(|| tries.remove(0)) else {
                    return Err(format!(
                        "{}: chunk {chunk} (bytes {start}..{end}) does not verify against the manifest and no other holder is left{}",
                        f.file,
                        failed.map(|e| format!(" (last refetch: {e})")).unwrap_or_default()
                    ));
                };
                match self.fetch_range(key, next, start, end - start, None, file, cloud, tally).await {
                    Ok(()) => break next,
                    Err(e) => failed = Some(format!("{}: {e}", describe(next))),
                }
            };
            sent.push((start, end - start, next.clone()));
            tally.repaired.push(format!(
                "{} chunk {chunk} (bytes {start}..{end}) from {} was corrupt; fetched again from {}",
                f.file,
                culprits.iter().map(describe).collect::<Vec<_>>().join(" and "),
                describe(next)
            ));
        }
    }
}

/// The sources whose bytes are in `start..end` now: the latest writes first, down to one that
/// covered it all.
fn senders(sent: &[Sent], start: u64, end: u64) -> Vec<FetchSource> {
    let mut out: Vec<FetchSource> = vec![];
    for (off, len, src) in sent.iter().rev() {
        if *off < end && start < off + len && !out.contains(src) {
            out.push(src.clone());
        }
        if *off <= start && end <= off + len {
            break;
        }
    }
    out
}

pub(super) fn entry_of(f: &RestoreFile) -> FileEntry {
    FileEntry { file: f.file.clone(), bytes: f.bytes, chunk_bytes: f.chunk_bytes, crc32c: f.crc32c.clone() }
}

/// Whether `path` holds exactly the manifest's copy (off the async workers, in the budget).
pub(super) async fn verifies(path: &Path, entry: &FileEntry) -> bool {
    let (path, entry): (PathBuf, FileEntry) = (path.to_path_buf(), entry.clone());
    let _buffer = buffer(1).await;
    blocking(move || Ok(std::fs::metadata(&path).is_ok_and(|m| m.len() == entry.bytes) && bad_chunk(&path, &entry)?.is_none()))
        .await
        .unwrap_or(false)
}

/// The first chunk of `path` whose crc is not the manifest's: (index, start, end); the whole
/// file when its length or its number of crcs is not the manifest's. Reads through one
/// `IO_BUFFER`, whatever the chunk size.
pub(super) fn bad_chunk(path: &Path, entry: &FileEntry) -> Result<Option<(usize, u64, u64)>, String> {
    let mut f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let len = f.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
    let chunk = entry.chunk_bytes.max(1);
    if len != entry.bytes || len.div_ceil(chunk) != entry.crc32c.len() as u64 {
        return Ok(Some((0, 0, entry.bytes)));
    }
    let mut buf = vec![0u8; IO_BUFFER.min(len.max(1) as usize)];
    let mut at = 0u64;
    for (i, want) in entry.crc32c.iter().enumerate() {
        let end = (at + chunk).min(len);
        let mut crc = 0u32;
        while at < end {
            let n = ((end - at) as usize).min(buf.len());
            f.read_exact(&mut buf[..n]).map_err(|e| format!("{} bytes {at}..: {e}", path.display()))?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            at += n as u64;
        }
        if crc != *want {
            let start = i as u64 * chunk;
            return Ok(Some((i, start, end)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_corrupt_chunk_of_a_large_file_is_found_reading_through_a_small_buffer() {
        // 3 chunks of 3 MiB (each read in 1 MiB pieces) and a 1 KiB tail; one byte of chunk 2
        // flipped: chunk 2 is named, whole.
        let dir = std::env::temp_dir().join(format!("motley-verify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("unit");
        let chunk = 3u64 << 20;
        let mut bytes: Vec<u8> = (0..3 * chunk + 1024).map(|i| (i * 7 % 251) as u8).collect();
        let entry = motley_checkpoint::crc::file_entry("unit", &bytes, chunk);
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(bad_chunk(&path, &entry).unwrap(), None);
        bytes[(2 * chunk + 5) as usize] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(bad_chunk(&path, &entry).unwrap(), Some((2, 2 * chunk, 3 * chunk)));
        // The tail chunk too, and a file of another length is bad from its start.
        bytes[(2 * chunk + 5) as usize] ^= 1;
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(bad_chunk(&path, &entry).unwrap(), Some((3, 3 * chunk, 3 * chunk + 1024)));
        std::fs::write(&path, &bytes[..10]).unwrap();
        assert_eq!(bad_chunk(&path, &entry).unwrap(), Some((0, 0, entry.bytes)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_ask_with_two_generations_or_without_crcs_is_refused() {
        let f = |g: i64, crcs: Vec<u32>| RestoreFile {
            source_generation: g,
            file: format!("f{g}"),
            bytes: 10,
            chunk_bytes: 4,
            crc32c: crcs,
            ..Default::default()
        };
        let ask = |files| Restore { step: 20, files, ..Default::default() };
        assert_eq!(check_ask(&ask(vec![f(3, vec![1, 2, 3]), f(3, vec![4, 5, 6])])), Ok(()));
        let e = check_ask(&ask(vec![f(3, vec![1, 2, 3]), f(4, vec![1, 2, 3])])).unwrap_err();
        assert!(e.contains("names files of generations [3, 4]"), "{e}");
        let e = check_ask(&ask(vec![f(3, vec![])])).unwrap_err();
        assert!(e.contains("file f3 (10 bytes) comes with chunk_bytes 4 and 0 crc32c values"), "{e}");
    }
}
