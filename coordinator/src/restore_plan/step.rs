//! Step 1 of a restore: the newest checkpoint step whose every file is held where it can be
//! read now (a live node's memory or disk, or the cloud), by the format's own rule.

use std::collections::BTreeMap;

use super::StepChoice;
use crate::store::Holding;

/// Whether a copy can be read now: in the cloud, or on a live node.
fn usable(h: &Holding, live: &dyn Fn(&str) -> bool) -> bool {
    h.tier == "cloud" || ((h.tier == "memory" || h.tier == "disk") && live(&h.node))
}

/// The newest step every file of which has a usable copy.
pub fn choose_step(all: &[Holding], live: &dyn Fn(&str) -> bool) -> StepChoice {
    if all.is_empty() {
        return StepChoice::Fresh;
    }
    let mut steps: BTreeMap<i64, Vec<&Holding>> = BTreeMap::new();
    for h in all {
        steps.entry(h.step).or_default().push(h);
    }
    let mut why = vec![];
    for (step, held) in steps.iter().rev() {
        let usable_files: Vec<&Holding> = held.iter().copied().filter(|h| usable(h, live)).collect();
        if usable_files.is_empty() {
            why.push(format!("step {step}: no file of it is held"));
            continue;
        }
        // The format's rule (`checkpoints::completeness`) over each file once.
        let distinct: BTreeMap<&str, &Holding> = usable_files.iter().map(|h| (h.file.as_str(), *h)).collect();
        match crate::checkpoints::completeness(&distinct.into_values().collect::<Vec<_>>()) {
            None => return StepChoice::Restore { step: *step, files: usable_files.into_iter().cloned().collect() },
            Some(e) => why.push(format!("step {step}: {e}")),
        }
    }
    StepChoice::Lost(format!("no checkpoint step has every file on a live node or in the cloud ({})", why.join("; ")))
}
