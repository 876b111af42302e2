//! A restore's orchestration: the ask fenced against older generations and earlier answers,
//! one restore per launch at a time (a newer ask waits for the running one), the free space
//! checked, every file fetched (`sources`) and verified (`verify`) a few hundred at a time,
//! units the new plan shards differently cut, and the launch list written for the ranks.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use motley_checkpoint::Unit;
use motley_proto::v1::{MakeUnit, Restore, RestoreFile, RestoreResult};

use super::budget::blocking;
use super::kept::result_path;
use super::sources::{rate, CloudSide};
use super::verify::{check_ask, entry_of, verifies};
use super::{launch_list, merge, restore_dir, Restorer, Tally};
use crate::checkpoints::dataplane::{self, FileKey, Pacer};

/// Files fetched at once: all of them, as the plan's rates assume (each flow is paced to its
/// share), up to this bound on open connections and files. Their memory is bounded apart: every
/// buffer they read or write through is within `budget::BUFFER_BUDGET_MIB`.
const PARALLEL_FILES: usize = 256;
/// Bytes kept free beyond what a restore writes.
const FREE_MARGIN: u64 = 64 << 20;

impl Restorer {
    /// Start a restore in the background (one already running or reported is not run again).
    pub fn start(&self, r: Restore) {
        let key = (r.job, r.generation);
        {
            let mut newest = self.inner.newest.lock().expect("newest");
            let seen = newest.get(&r.job).copied().unwrap_or(i64::MIN);
            if r.generation < seen {
                let why = format!(
                    "refused: a restore for generation {} of job {} is stale (this node was asked for generation {seen})",
                    r.generation, r.job
                );
                drop(newest);
                self.finish(RestoreResult {
                    job: r.job,
                    generation: r.generation,
                    step: r.step,
                    error: why,
                    request: r.request,
                    ..Default::default()
                });
                return;
            }
            newest.insert(r.job, r.generation);
            // Kept on disk (`kept::read_back` reads it), so a restarted agent still refuses older asks.
            self.keep_newest(r.job, r.generation);
        }
        // The answer to this very ask, not yet acknowledged, stands (sent again). Any other
        // result of the launch is an earlier ask's: forgotten, and this one runs (files in place
        // that verify are kept, so asking again costs little).
        {
            let mut results = self.inner.results.lock().expect("restore results");
            match results.get(&key) {
                Some((done, _)) if done.request == r.request && done.error.is_empty() => {
                    results.get_mut(&key).expect("present").1 = None;
                    drop(results);
                    self.inner.changed.notify_one();
                    return;
                }
                Some(_) => {
                    results.remove(&key);
                    let _ = std::fs::remove_file(result_path(&self.inner.work_dir, r.job, r.generation));
                }
                None => {}
            }
        }
        // One restore of a launch at a time (they write the same files): a newer ask waits for
        // the running one and then runs.
        if !self.inner.running.lock().expect("running").insert(key) {
            self.inner.queued.lock().expect("queued").insert(key, r);
            return;
        }
        let this = self.clone();
        tokio::spawn(async move { this.run_to_result(r).await });
    }

    /// Run restore `r` within its time limit, its source step pinned in the tiers meanwhile;
    /// then its result, unless a newer ask for the launch came meanwhile (that one runs next).
    async fn run_to_result(self, r: Restore) {
        let began = Instant::now();
        let timeout = Duration::from_secs(u64::from(r.timeout_s.max(10)));
        let mut tally = Tally::default();
        if let Some(t) = &self.inner.tierer {
            t.pin(r.job, r.step);
        }
        let outcome = match tokio::time::timeout(timeout, self.run(&r, &mut tally)).await {
            Ok(o) => o,
            Err(_) => Err(format!("the restore took longer than its {} s", timeout.as_secs())),
        };
        if let Some(t) = &self.inner.tierer {
            t.unpin(r.job, r.step);
        }
        let error = outcome.err().unwrap_or_default();
        if error.is_empty() {
            self.sweep_older(&r);
            tracing::info!(node = %self.inner.node, job = r.job, generation = r.generation, step = r.step,
                "restored in {:.2} s (local {} B, peer {} B, cloud {} B)", began.elapsed().as_secs_f64(), tally.local, tally.peer, tally.cloud);
        } else {
            tracing::warn!(node = %self.inner.node, job = r.job, generation = r.generation, "restore failed: {error}");
        }
        // No longer running before the result is out: an ask arriving once the result is
        // acknowledged (or, failed, forgotten) must run, not find this one still running
        // and be dropped without a result.
        self.inner.running.lock().expect("running").remove(&(r.job, r.generation));
        let next = self.inner.queued.lock().expect("queued").remove(&(r.job, r.generation));
        if let Some(next) = next {
            // A newer ask came meanwhile: this result answers nobody.
            self.start(next);
            return;
        }
        self.finish(RestoreResult {
            request: r.request,
            job: r.job,
            generation: r.generation,
            step: r.step,
            error,
            local_bytes: tally.local,
            peer_bytes: tally.peer,
            cloud_bytes: tally.cloud,
            transfer_s: began.elapsed().as_secs_f64(),
            repaired: tally.repaired,
            skipped: tally.skipped,
        });
    }

    /// Restore `r`: the free space checked, its files fetched, its units cut, its list written.
    async fn run(&self, r: &Restore, tally: &mut Tally) -> Result<(), String> {
        let work = &self.inner.work_dir;
        check_ask(r)?;
        super::check_names(r)?;
        self.check_space(r).await?;
        // The cloud, and this node's share of its egress for the reads no plan paced.
        let share = rate(r.cloud_share_mb_s).map(|b| Arc::new(Pacer::new(b)));
        // A file:// cloud a root agent may not read for this job's user (`file_roots`): its
        // reads fail with why, the other sources still serve.
        let ranks_as_agent = self.inner.tierer.as_ref().and_then(|t| t.policy(r.job).ranks_as_agent);
        let refused = crate::checkpoints::file_roots::admit(&r.cloud_url, r.job, ranks_as_agent).err().map(|e| e.to_string());
        if let Some(why) = &refused {
            tracing::warn!(node = %self.inner.node, job = r.job, "restore of generation {}: {why}", r.generation);
        }
        let cloud = Arc::new(CloudSide { url: r.cloud_url.clone(), refused, share });
        // Files, a few at a time.
        let mut paths: Vec<String> = vec![];
        let mut pending = r.files.iter();
        let mut running = tokio::task::JoinSet::new();
        loop {
            while running.len() < PARALLEL_FILES {
                let Some(f) = pending.next() else { break };
                let (this, f, job, step, cloud) = (self.clone(), f.clone(), r.job, r.step, cloud.clone());
                running.spawn(async move {
                    let mut t = Tally::default();
                    let res = this.restore_file(job, step, &f, &cloud, &mut t).await;
                    (res, t)
                });
            }
            let Some(done) = running.join_next().await else { break };
            let (res, t) = done.map_err(|e| format!("a file's restore task ended: {e}"))?;
            tally.local += t.local;
            tally.peer += t.peer;
            tally.cloud += t.cloud;
            tally.skipped += t.skipped;
            tally.repaired.extend(t.repaired);
            paths.push(res?);
        }
        // Units the new plan shards differently.
        for m in &r.make {
            paths.extend(make_unit(work, r, m).await?);
        }
        paths.sort();
        paths.dedup();
        let list = launch_list(work, r.job, r.generation);
        let text = serde_json::to_vec(&paths).expect("a list of paths serialises");
        crate::workdir::replace(&list, &text).map_err(|e| format!("{}: {e}", list.display()))?;
        Ok(())
    }

    /// Whether the work directory's free space holds what restore `r` still has to write.
    async fn check_space(&self, r: &Restore) -> Result<(), String> {
        let work = &self.inner.work_dir;
        // What is missing, against the free space.
        let mut missing = 0u64;
        for f in &r.files {
            let path = restore_dir(work, r.job, f.source_generation, r.step).join(&f.file);
            if !verifies(&path, &entry_of(f)).await {
                missing += f.bytes;
            }
        }
        let made: u64 = r.make.iter().map(|m| r.files.iter().filter(|f| m.sources.contains(&f.file)).map(|f| f.bytes).sum::<u64>()).sum();
        let need = missing + made / u64::from(r.make.first().map_or(1, |m| m.tp_size.max(1))) + FREE_MARGIN;
        if let Some(free) = (self.inner.free_bytes)(work) {
            if free < need {
                return Err(format!(
                    "disk full: the restore needs {need} bytes in {} and {free} are free; free space or give the agent another --work-dir",
                    work.display()
                ));
            }
        }
        Ok(())
    }

    /// One file: kept if it verifies; else fetched range by range from the planned sources,
    /// each failing range from the fallbacks in turn, verified, a corrupt chunk fetched again
    /// from the next source. Returns its absolute path.
    async fn restore_file(&self, job: i64, step: u64, f: &RestoreFile, cloud: &CloudSide, tally: &mut Tally) -> Result<String, String> {
        let entry = entry_of(f);
        let dir = restore_dir(&self.inner.work_dir, job, f.source_generation, step);
        let path = dir.join(&f.file);
        let key = FileKey { job, generation: f.source_generation, step, file: f.file.clone() };
        if verifies(&path, &entry).await {
            tally.skipped += 1;
            return Ok(path.display().to_string());
        }
        crate::workdir::create_dirs(&dir).map_err(|e| e.to_string())?;
        let arrival = self.inner.arriving.begin(key.clone());
        let tmp = dataplane::temporary_path(&path);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        file.set_len(f.bytes).map_err(|e| format!("{}: {e}", tmp.display()))?;
        // The cloud-only baseline: every further rank of this node fetches its own copy, at the
        // same time as the first (each paced to its share of the cloud), into a scratch file.
        let extra = async {
            let copies: Vec<_> = (1..f.copies.max(1)).map(|k| self.scratch_copy(&key, f, &tmp, k, cloud)).collect();
            futures_util::future::join_all(copies).await
        };
        let (result, extra) = futures_util::future::join(self.fill(&key, f, &file, cloud, tally), extra).await;
        for copy in extra {
            let t = copy?;
            merge(tally, t);
        }
        let result = match result {
            Ok(sent) => self.repair(&key, f, &file, &entry, &tmp, sent, cloud, tally).await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        // Flushing a multi-GB file takes seconds: off the async workers.
        let (tmp2, path2) = (tmp.clone(), path.clone());
        blocking(move || {
            file.sync_all().map_err(|e| format!("{}: {e}", tmp2.display()))?;
            std::fs::rename(&tmp2, &path2).map_err(|e| format!("{}: {e}", path2.display()))?;
            if let Ok(d) = File::open(&dir) {
                let _ = d.sync_all();
            }
            Ok(())
        })
        .await?;
        arrival.complete();
        Ok(path.display().to_string())
    }
}

/// Cut unit `m` the new plan shards differently from its restored sources (`MakeUnit`,
/// `motley_checkpoint::reslice_unit`); the path it was written to, if one was (a unit of
/// replicated tensors is served by its source).
async fn make_unit(work: &Path, r: &Restore, m: &MakeUnit) -> Result<Option<String>, String> {
    let dir = |file: &str| {
        let g = r.files.iter().find(|f| f.file == file).map_or(0, |f| f.source_generation);
        restore_dir(work, r.job, g, r.step)
    };
    let Some(first) = m.sources.first() else { return Ok(None) };
    let out_dir = dir(first);
    let paths: Vec<PathBuf> = m.sources.iter().map(|s| dir(s).join(s)).collect();
    let out_dir2 = out_dir.clone();
    let (tp_size, tp_rank, named) = (m.tp_size, m.tp_rank, m.file.clone());
    // Reading and cutting whole units: on the blocking pool, never an async worker.
    let written = tokio::task::spawn_blocking(move || -> Result<Option<PathBuf>, String> {
        let sources = paths.iter().map(|p| Unit::read(p)).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
        let cut = motley_checkpoint::reslice_unit(&sources, tp_size).map_err(|e| e.to_string())?;
        // A unit of replicated tensors stays TP 0 of 1: its source serves every rank. (Only
        // that one: a unit cut for TP 1 from split shards is made like any other.)
        if sources.first().is_some_and(|u| u.key.tp_size == 1 && u.replicated()) {
            return Ok(None);
        }
        let Some(mine) = cut.into_iter().find(|u| u.key.tp_rank == tp_rank) else {
            return Err(format!("there is no tp rank {tp_rank} of {tp_size}"));
        };
        // The ranks load the unit under the name the coordinator planned for: the two agree.
        let name = motley_checkpoint::manifest::unit_file_name(&mine.key);
        if name != named {
            return Err(format!("the restore names the cut unit {named}, but it is {name} (sources of another unit?)"));
        }
        let e = mine.write(&out_dir2).map_err(|e| e.to_string())?;
        Ok(Some(out_dir2.join(e.file.file)))
    })
    .await
    .map_err(|e| format!("re-slicing {}: {e}", m.file))?
    .map_err(|e| format!("re-slicing {}: {e}", m.file))?;
    Ok(written.map(|p| p.display().to_string()))
}
