//! `motley node drain NODE... --deadline D --wait`: a preemption notice given to several nodes at
//! once (a whole Slurm allocation about to end, docs/slurm.md) and waited out. Each launched job
//! with a rank on those nodes saves its next step on the notice (docs/recovery.md, "Preemption
//! notices"); the command returns once every such job has a complete step newer than the newest
//! it had before the drain, whole in its checkpoint cloud when it names one (the nodes' disks go
//! with the allocation), or has ended. Past the deadline (and a few seconds for the upload) it
//! gives up, naming each job that saved nothing new: that job resumes from its older step.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::client::{path_segment, Client};
use crate::inputs::InputError;
use crate::table::escape;

/// After the deadline, the time a save just made is given to reach the cloud.
const UPLOAD_GRACE: Duration = Duration::from_secs(15);
/// How often the jobs are looked at.
const POLL: Duration = Duration::from_millis(500);

/// A job the drain asks to save: its id and the newest complete step before the drain (-1: none).
struct Saving {
    id: i64,
    before: i64,
}

/// Drain `names` with `deadline`, then wait for the saves; the lines to print and whether every
/// job saved (or ended).
pub fn drain_and_wait(c: &Client, names: &[String], deadline: Duration) -> Result<(String, bool), InputError> {
    // The steps before the drain, read first: a save the notice causes is newer than these.
    let mut saving = jobs_on(c, names)?;
    let mut lines = vec![];
    for name in names {
        let query = format!("?deadline_s={}", deadline.as_secs_f64().ceil().max(1.0) as u64);
        let v = c.call("POST", &format!("/nodes/{}/drain{query}", path_segment(name)), None)?;
        let text = |field: &str| escape(v[field].as_str().unwrap_or_default()).into_owned();
        lines.push(format!("node {} is {}", text("name"), text("state")));
    }
    let until = Instant::now() + deadline + UPLOAD_GRACE;
    loop {
        let mut left = vec![];
        for job in saving {
            match saved(c, &job)? {
                Some(line) => lines.push(line),
                None => left.push(job),
            }
        }
        saving = left;
        if saving.is_empty() {
            return Ok((lines.join("\n"), true));
        }
        if Instant::now() >= until {
            for job in &saving {
                lines.push(format!(
                    "job {}: no step newer than {} saved (and whole in its cloud) by the deadline; it resumes from its newest complete step",
                    job.id, job.before
                ));
            }
            return Ok((lines.join("\n"), false));
        }
        std::thread::sleep(POLL);
    }
}

/// The launched jobs with a rank on one of `nodes`, each with its newest complete step.
fn jobs_on(c: &Client, nodes: &[String]) -> Result<Vec<Saving>, InputError> {
    let mut out = vec![];
    for job in c.call("GET", "/jobs", None)?.as_array().into_iter().flatten() {
        if !["launching", "running", "degraded"].contains(&job["state"].as_str().unwrap_or("")) {
            continue;
        }
        let id = job["id"].as_i64().unwrap_or(0);
        let plan = c.call("GET", &format!("/jobs/{id}/plan"), None)?;
        let here =
            plan["ranks"].as_array().into_iter().flatten().any(|r| nodes.iter().any(|n| r["assignment"]["node"].as_str() == Some(n)));
        if here {
            out.push(Saving { id, before: newest_complete(c, id)? });
        }
    }
    Ok(out)
}

fn newest_complete(c: &Client, id: i64) -> Result<i64, InputError> {
    let steps = c.call("GET", &format!("/jobs/{id}/checkpoints"), None)?;
    Ok(steps.as_array().into_iter().flatten().filter(|st| st["complete"] == true).filter_map(|st| st["step"].as_i64()).max().unwrap_or(-1))
}

/// What a job's save came to, once it is done: `None` while it is not.
fn saved(c: &Client, job: &Saving) -> Result<Option<String>, InputError> {
    let view = c.call("GET", &format!("/jobs/{}", job.id), None)?;
    let state = view["state"].as_str().unwrap_or("");
    if ["succeeded", "failed", "cancelled"].contains(&state) {
        return Ok(Some(format!("job {}: {state}", job.id)));
    }
    if view["spec"]["checkpoint"].is_null() {
        return Ok(Some(format!("job {}: does not checkpoint (no checkpoint: in its job file): nothing to save", job.id)));
    }
    let step = newest_complete(c, job.id)?;
    if step <= job.before {
        return Ok(None);
    }
    if view["checkpoint_cloud"].is_null() {
        return Ok(Some(format!("job {}: step {step} saved (on its nodes' disks: the job names no checkpoint cloud)", job.id)));
    }
    let grid = c.call("GET", &format!("/jobs/{}/checkpoints/grid?step={step}", job.id), None)?;
    Ok(whole_in_cloud(&grid).then(|| format!("job {}: step {step} saved, whole in its checkpoint cloud", job.id)))
}

/// Every file of a step's grid has a copy in the cloud.
fn whole_in_cloud(grid: &Value) -> bool {
    let rows = grid["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
    !rows.is_empty()
        && rows.iter().all(|r| {
            r["held"].as_object().is_some_and(|held| held.values().flat_map(|t| t.as_array().into_iter().flatten()).any(|t| t == "cloud"))
        })
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    #[test]
    fn a_step_is_whole_in_the_cloud_only_when_every_file_has_a_cloud_copy() {
        let row = |tiers: Value| json!({"file": "f", "unit": "layer.0", "bytes": 1, "held": tiers});
        let grid = |rows: Vec<Value>| json!({"step": 3, "rows": rows});
        assert!(super::whole_in_cloud(&grid(vec![row(json!({"n0": ["disk"], "cloud": ["cloud"]})), row(json!({"cloud": ["cloud"]}))])));
        assert!(!super::whole_in_cloud(&grid(vec![
            row(json!({"n0": ["disk"], "cloud": ["cloud"]})),
            row(json!({"n0": ["memory", "disk"]}))
        ])));
        assert!(!super::whole_in_cloud(&grid(vec![])), "a step without files is not saved");
    }
}
