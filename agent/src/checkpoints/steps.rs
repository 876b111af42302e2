//! Where checkpoint steps are on a tier's root: `ROOT/jobs/JOB/GENERATION/ckpt/step-SSSSSSSS`
//! (docs/checkpoint.md, "Files on disk"), the manifest pieces in a step and the files they
//! list. Read by the holdings report, the tiers, the cloud upload, the data plane and the
//! supervisor (where ranks write): the layout they share, calling nothing of theirs.

use std::path::{Path, PathBuf};

use motley_checkpoint::{FileEntry, Manifest};

/// Where a launch's ranks write their checkpoints.
pub fn ckpt_dir(generation_dir: &Path) -> PathBuf {
    generation_dir.join("ckpt")
}

/// A step directory under a tier's root: `ROOT/jobs/JOB/GENERATION/ckpt/step-SSSSSSSS`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StepDir {
    pub job: i64,
    pub generation: i64,
    pub step: u64,
    pub dir: PathBuf,
}

/// The entries of `dir` that are directories, listed through its handle (not through a
/// symbolic link: a rank running as another user owns its checkpoint directory and could
/// plant one pointing anywhere). `dir`'s last `depth` components are in a rank's directory
/// (`safe_fs::open_under`); 0: it is all the agent's (`ROOT/jobs`, `ROOT/jobs/JOB`).
fn sub_dirs(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let handle = if depth == 0 { crate::safe_fs::Dir::open(dir) } else { crate::safe_fs::open_under(dir, depth) };
    let entries = handle.and_then(|h| h.entries()).unwrap_or_default();
    entries.into_iter().filter(|(_, t)| *t == rustix::fs::FileType::Directory).map(|(n, _)| dir.join(n)).collect()
}

fn number<T: std::str::FromStr>(p: &Path) -> Option<T> {
    p.file_name()?.to_str()?.parse().ok()
}

/// The generation directories under `root/jobs`: (job, generation, dir), sorted.
pub fn generation_dirs(root: &Path) -> Vec<(i64, i64, PathBuf)> {
    let mut out = vec![];
    for job_dir in sub_dirs(&root.join("jobs"), 0) {
        let Some(job) = number::<i64>(&job_dir) else { continue };
        for gen_dir in sub_dirs(&job_dir, 0) {
            if let Some(generation) = number::<i64>(&gen_dir) {
                out.push((job, generation, gen_dir));
            }
        }
    }
    out.sort();
    out
}

/// The step directories of one generation directory, oldest first.
pub fn step_dirs_of(job: i64, generation: i64, gen_dir: &Path) -> Vec<StepDir> {
    // `ckpt` is in the launch directory, which is the rank's.
    let mut out: Vec<StepDir> = sub_dirs(&ckpt_dir(gen_dir), 1)
        .into_iter()
        .filter_map(|dir| {
            let step = dir.file_name()?.to_str()?.strip_prefix("step-")?.parse().ok()?;
            Some(StepDir { job, generation, step, dir })
        })
        .collect();
    out.sort();
    out
}

/// Every step directory under `root`, sorted by (job, generation, step).
pub fn step_dirs(root: &Path) -> Vec<StepDir> {
    generation_dirs(root).into_iter().flat_map(|(j, g, d)| step_dirs_of(j, g, &d)).collect()
}

/// The manifest pieces in `step_dir` (paths, sorted), listed through its handle
/// (`ROOT/jobs/JOB/GEN/ckpt/step-S`: its last two components are the rank's).
pub fn piece_paths(step_dir: &Path) -> Vec<PathBuf> {
    let entries = crate::safe_fs::open_under(step_dir, 2).and_then(|d| d.entries()).unwrap_or_default();
    let mut out: Vec<PathBuf> = entries
        .into_iter()
        .filter(|(f, t)| *t != rustix::fs::FileType::Directory && f.starts_with("manifest.rank.") && f.ends_with(".json"))
        .map(|(f, _)| step_dir.join(f))
        .collect();
    out.sort();
    out
}

/// Every file a piece lists (units, then rank files).
pub fn piece_files(m: &Manifest) -> impl Iterator<Item = &FileEntry> {
    m.units.iter().map(|u| &u.file).chain(m.ranks.iter().map(|r| &r.file))
}
