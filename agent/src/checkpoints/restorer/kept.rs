//! What of restores survives an agent restart: each finished restore's result, kept in
//! `WORK_DIR/restore/JOB/result-GEN.json` until the coordinator acknowledges it, and each job's
//! newest generation asked for (`restore/JOB/newest`, the fence against stale asks). Temporary
//! files an earlier agent's restore left half-written are swept at start.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use motley_proto::v1::RestoreResult;
use serde::{Deserialize, Serialize};

use super::{Restorer, Results};

/// A finished restore as kept on disk until acknowledged.
#[derive(Serialize, Deserialize)]
struct Stored {
    job: i64,
    generation: i64,
    step: u64,
    error: String,
    local_bytes: u64,
    peer_bytes: u64,
    cloud_bytes: u64,
    transfer_s: f64,
    repaired: Vec<String>,
    skipped: u32,
    #[serde(default)]
    request: i64,
}

impl From<&RestoreResult> for Stored {
    fn from(r: &RestoreResult) -> Stored {
        Stored {
            job: r.job,
            generation: r.generation,
            step: r.step,
            error: r.error.clone(),
            local_bytes: r.local_bytes,
            peer_bytes: r.peer_bytes,
            cloud_bytes: r.cloud_bytes,
            transfer_s: r.transfer_s,
            repaired: r.repaired.clone(),
            skipped: r.skipped,
            request: r.request,
        }
    }
}

impl From<Stored> for RestoreResult {
    fn from(s: Stored) -> RestoreResult {
        RestoreResult {
            job: s.job,
            generation: s.generation,
            step: s.step,
            error: s.error,
            local_bytes: s.local_bytes,
            peer_bytes: s.peer_bytes,
            cloud_bytes: s.cloud_bytes,
            transfer_s: s.transfer_s,
            repaired: s.repaired,
            skipped: s.skipped,
            request: s.request,
        }
    }
}

pub(super) fn result_path(work_dir: &Path, job: i64, generation: i64) -> PathBuf {
    work_dir.join("restore").join(job.to_string()).join(format!("result-{generation}.json"))
}

fn newest_path(work_dir: &Path, job: i64) -> PathBuf {
    work_dir.join("restore").join(job.to_string()).join("newest")
}

/// Remove what restores of an earlier agent process left half-written
/// (`restore/JOB/GEN/step-S/NAME.tmp.PID` and its `.copyK` scratch copies): nothing runs yet, and
/// a temporary name is never taken for a whole file, so they only hold disk space.
fn sweep_temporaries(root: &Path) {
    let dirs = |d: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(d).into_iter().flatten().flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()).collect()
    };
    for step_dir in dirs(root).iter().flat_map(|j| dirs(j)).flat_map(|g| dirs(&g)) {
        for f in std::fs::read_dir(&step_dir).into_iter().flatten().flatten() {
            if f.file_name().to_string_lossy().contains(".tmp.") {
                match std::fs::remove_file(f.path()) {
                    Ok(()) => tracing::info!("removed {}, left half-written by an earlier agent's restore", f.path().display()),
                    Err(e) => tracing::warn!("removing {}: {e}", f.path().display()),
                }
            }
        }
    }
}

/// What an earlier agent left under `work_dir/restore`: its unacknowledged results, and each
/// job's newest generation asked for (from those results and the fence files). Half-written
/// temporaries are removed first.
pub(super) fn read_back(work_dir: &Path) -> (Results, HashMap<i64, i64>) {
    let mut results = BTreeMap::new();
    let root = work_dir.join("restore");
    sweep_temporaries(&root);
    for job_dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(job_dir.path()).into_iter().flatten().flatten() {
            let name = f.file_name().to_string_lossy().to_string();
            if !(name.starts_with("result-") && name.ends_with(".json")) {
                continue;
            }
            if let Some(s) = std::fs::read(f.path()).ok().and_then(|b| serde_json::from_slice::<Stored>(&b).ok()) {
                results.insert((s.job, s.generation), (RestoreResult::from(s), None));
            }
        }
    }
    let mut newest = results.keys().fold(HashMap::new(), |mut m: HashMap<i64, i64>, (j, g)| {
        let e = m.entry(*j).or_insert(*g);
        *e = (*e).max(*g);
        m
    });
    // The fence survives a restart: each job's newest generation asked for, on disk.
    for job_dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let Some(job) = job_dir.file_name().to_str().and_then(|n| n.parse::<i64>().ok()) else { continue };
        let Some(g) = std::fs::read_to_string(newest_path(work_dir, job)).ok().and_then(|t| t.trim().parse::<i64>().ok()) else {
            continue;
        };
        let e = newest.entry(job).or_insert(g);
        *e = (*e).max(g);
    }
    (results, newest)
}

impl Restorer {
    /// Keep job `job`'s newest generation asked for on disk (`read_back` reads it), so a
    /// restarted agent still refuses older asks.
    pub(super) fn keep_newest(&self, job: i64, generation: i64) {
        let path = newest_path(&self.inner.work_dir, job);
        let kept = path
            .parent()
            .map_or(Ok(()), |d| crate::workdir::create_dirs(d).map_err(|e| e.to_string()))
            .and_then(|()| crate::workdir::replace(&path, format!("{generation}\n").as_bytes()).map_err(|e| e.to_string()));
        if let Err(e) = kept {
            tracing::warn!(node = %self.inner.node, "{}: {e}; an agent restart would forget this restore's generation", path.display());
        }
    }

    /// Keep the result on disk (a restarted agent reports it again), then report it.
    pub(super) fn finish(&self, r: RestoreResult) {
        let path = result_path(&self.inner.work_dir, r.job, r.generation);
        let bytes = serde_json::to_vec(&Stored::from(&r)).expect("a result serialises");
        if let Some(dir) = path.parent() {
            let _ = crate::workdir::create_dirs(dir);
        }
        if let Err(e) = crate::workdir::replace(&path, &bytes) {
            tracing::warn!(node = %self.inner.node, "{}: {e}; the restore's result is reported but would not survive a restart", path.display());
        }
        self.inner.results.lock().expect("restore results").insert((r.job, r.generation), (r, None));
        self.inner.changed.notify_one();
    }
}
