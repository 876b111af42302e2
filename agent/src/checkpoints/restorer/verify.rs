//! Checking a restored file against its manifest entry: whole files by length or chunk crcs,
//! and, for a copy assembled from several sources, the first corrupt chunk fetched again from
//! a holder that did not send it.

use std::fs::File;
use std::path::Path;

use motley_checkpoint::FileEntry;
use motley_proto::v1::{FetchSource, RestoreFile};

use super::sources::{describe, CloudSide, Sent};
use super::{Restorer, Tally};
use crate::checkpoints::dataplane::FileKey;

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
        if entry.crc32c.is_empty() {
            return Ok(()); // no crcs reported: the length is all there is to check (done by set_len)
        }
        let mut tries: Vec<&FetchSource> = f.fallbacks.iter().collect();
        let mut failed: Option<String> = None;
        loop {
            file.sync_data().map_err(|e| format!("{}: {e}", tmp.display()))?;
            let bad = bad_chunk(tmp, entry)?;
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

/// Whether `path` holds exactly the manifest's copy.
pub(super) fn verifies(path: &Path, entry: &FileEntry) -> bool {
    if entry.crc32c.is_empty() {
        return std::fs::metadata(path).is_ok_and(|m| m.len() == entry.bytes);
    }
    motley_checkpoint::crc::verify_file(path, entry).is_ok()
}

/// The first chunk of `path` whose crc is not the manifest's: (index, start, end).
fn bad_chunk(path: &Path, entry: &FileEntry) -> Result<Option<(usize, u64, u64)>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let chunk = entry.chunk_bytes.max(1);
    let crcs = motley_checkpoint::crc::chunk_crcs(&bytes, chunk);
    if crcs.len() != entry.crc32c.len() {
        return Ok(Some((0, 0, entry.bytes)));
    }
    Ok(crcs.iter().zip(&entry.crc32c).position(|(a, b)| a != b).map(|i| {
        let start = i as u64 * chunk;
        (i, start, (start + chunk).min(entry.bytes))
    }))
}
