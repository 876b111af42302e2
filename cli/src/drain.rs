//! `motley node drain NODE... --deadline D --wait`: a preemption notice given to several nodes at
//! once (a whole Slurm allocation about to end, docs/slurm.md) and waited out. Each launched job
//! with a rank on those nodes saves its next step on the notice (docs/recovery.md, "Preemption
//! notices"); the command returns once every such job has moved off the nodes (`recovering`:
//! the coordinator took its save, or the deadline passed) with its newest complete step whole in
//! its checkpoint cloud when it names one (the nodes' disks go with the allocation), or has
//! ended. A job that saved nothing newer than before the drain is named (it resumes from its
//! older step), as is one no notice moves (no checkpoint, no `max_preemptions`). Past the
//! deadline and a few seconds for the upload it gives up.

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
    let mut all_saved = true;
    loop {
        let mut left = vec![];
        for job in saving {
            match saved(c, &job)? {
                Some((line, new)) => {
                    lines.push(line);
                    all_saved &= new;
                }
                None => left.push(job),
            }
        }
        saving = left;
        if saving.is_empty() {
            return Ok((lines.join("\n"), all_saved));
        }
        if Instant::now() >= until {
            for job in &saving {
                lines.push(format!(
                    "job {}: not moved off the nodes with a step newer than {} whole in its cloud by the deadline and {} s more",
                    job.id,
                    job.before,
                    UPLOAD_GRACE.as_secs()
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

/// A job's drain once it is done with, and whether it saved a new step: `None` while it is not.
fn saved(c: &Client, job: &Saving) -> Result<Option<(String, bool)>, InputError> {
    let view = c.call("GET", &format!("/jobs/{}", job.id), None)?;
    let state = view["state"].as_str().unwrap_or("");
    if ["succeeded", "failed", "cancelled"].contains(&state) {
        return Ok(Some((format!("job {}: {state}", job.id), true)));
    }
    if view["spec"]["checkpoint"].is_null() || view["spec"]["max_preemptions"].as_u64().unwrap_or(0) == 0 {
        let why = "a notice does not move it (it needs checkpoint: and max_preemptions of at least 1): nothing is saved";
        return Ok(Some((format!("job {}: {why}", job.id), false)));
    }
    // Until the coordinator takes a save (or the deadline passes) the job stays where it is: a
    // periodic step finished meanwhile is not the notice's.
    if state != "recovering" {
        return Ok(None);
    }
    let step = newest_complete(c, job.id)?;
    let new = step > job.before;
    let what = if new {
        format!("step {step} saved")
    } else {
        format!("nothing newer than step {} saved: it resumes from step {step}", job.before)
    };
    if view["checkpoint_cloud"].is_null() {
        return Ok(Some((format!("job {}: {what} (on its nodes' disks: the job names no checkpoint cloud)", job.id), new)));
    }
    let grid = c.call("GET", &format!("/jobs/{}/checkpoints/grid?step={step}", job.id), None)?;
    Ok(whole_in_cloud(&grid).then(|| (format!("job {}: {what}, whole in its checkpoint cloud", job.id), new)))
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
