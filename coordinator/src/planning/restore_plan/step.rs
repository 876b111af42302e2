//! Step 1 of a restore: the newest checkpoint step whose every file, as one generation wrote
//! it, is held where it can be read now (a live node's memory or disk, or the cloud) with the
//! crcs a restore verifies it against, by the format's own rule.
//!
//! A step is restored from one generation only: a launch that lost a node mid-save leaves part
//! of a step, and the next launch may save the same step again (whole). Their files have the
//! same names but other bytes (the second launch trained on from a restore), so a mix of the
//! two is not a checkpoint. Of the generations that hold a step whole, the newest is taken.

use std::collections::BTreeMap;

use super::StepChoice;
use crate::store::Holding;

/// Whether a copy can be read now: in the cloud, or on a live node.
fn usable(h: &Holding, live: &dyn Fn(&str) -> bool) -> bool {
    h.tier == "cloud" || ((h.tier == "memory" || h.tier == "disk") && live(&h.node))
}

/// The format's rule (`checkpoints::completeness`) over each file once.
fn complete(files: &[&Holding]) -> Option<String> {
    let distinct: BTreeMap<&str, &Holding> = files.iter().map(|h| (h.file.as_str(), *h)).collect();
    crate::views::checkpoints::completeness(&distinct.into_values().collect::<Vec<_>>())
}

/// The newest step one generation of which has a usable copy of every file.
pub fn choose_step(all: &[Holding], live: &dyn Fn(&str) -> bool) -> StepChoice {
    if all.is_empty() {
        return StepChoice::Fresh;
    }
    // step -> generation -> its copies.
    let mut steps: BTreeMap<i64, BTreeMap<i64, Vec<&Holding>>> = BTreeMap::new();
    for h in all {
        steps.entry(h.step).or_default().entry(h.generation).or_default().push(h);
    }
    let mut why = vec![];
    for (step, generations) in steps.iter().rev() {
        let mut reasons = vec![];
        let mut every: Vec<&Holding> = vec![];
        for (generation, held) in generations.iter().rev() {
            let readable: Vec<&Holding> = held.iter().copied().filter(|h| usable(h, live)).collect();
            // A copy without crcs cannot be verified: never restored from.
            let (usable_files, unverifiable): (Vec<&Holding>, Vec<&Holding>) = readable.into_iter().partition(|h| h.has_crcs());
            every.extend(&usable_files);
            let skipped = unverifiable.first().map(|h| {
                format!(" ({} copies reported without a crc32c per chunk were skipped, e.g. {} on {})", unverifiable.len(), h.file, h.node)
            });
            if usable_files.is_empty() {
                reasons.push(format!("generation {generation}: no file of it is held{}", skipped.unwrap_or_default()));
                continue;
            }
            match complete(&usable_files) {
                None => {
                    return StepChoice::Restore { step: *step, generation: *generation, files: usable_files.into_iter().cloned().collect() }
                }
                Some(e) => reasons.push(format!("generation {generation}: {e}{}", skipped.unwrap_or_default())),
            }
        }
        if generations.len() > 1 && complete(&every).is_none() {
            reasons.push("whole only as a mix of generations, which is not restorable".into());
        }
        why.push(format!("step {step}: {}", reasons.join(", ")));
    }
    StepChoice::Lost(format!("no checkpoint step has every file of one generation on a live node or in the cloud ({})", why.join("; ")))
}
