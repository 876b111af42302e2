//! The checkpoint-location bitmap as people and the recovery read it: per job, the steps whose
//! files some node holds, whether each is complete (every unit and rank file of the step held
//! somewhere, docs/checkpoint.md "Restorable"), and per step a grid of units by nodes with the
//! tier each holds it in. What agents report is stored by `store::checkpoints`.

use std::collections::{BTreeMap, BTreeSet};

use motley_checkpoint::{FileEntry, Manifest, RankEntry, UnitEntry, UnitKey, FORMAT};
use serde::Serialize;

use crate::error::{CoordinatorError, Result};
use crate::store::{Holding, Store};

/// One step of a job's checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StepView {
    pub step: i64,
    /// The launches whose ranks wrote it.
    pub generations: Vec<i64>,
    /// Distinct files held (units and rank files), and their bytes (one copy each).
    pub files: usize,
    pub bytes: i64,
    pub nodes: Vec<String>,
    /// Every unit and rank file of the step is held somewhere: it can be restored.
    pub complete: bool,
    /// Why not, when it is not: the first file never reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing: Option<String>,
}

/// A step's grid: a row per file, the tier each node holds it in.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StepGrid {
    #[serde(flatten)]
    pub step: StepView,
    /// The copies of one generation: the one a restore would take (the newest that holds the
    /// step whole), else the newest (a step saved by two launches is two copies, never mixed).
    pub generation: i64,
    pub rows: Vec<GridRow>,
}

#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct GridRow {
    pub file: String,
    /// embed | layer.N | head, with part and TP shard ("layer.3 model tp 0/2"), or "rank R".
    pub unit: String,
    pub bytes: i64,
    /// node -> tiers (memory, disk, cloud).
    pub held: BTreeMap<String, Vec<String>>,
}

/// Whether a step's held files (each file once) make it complete; the first file missing if not.
pub(crate) fn completeness(files: &[&Holding]) -> Option<String> {
    let Some(first) = files.first() else { return Some("no file of the step is held".into()) };
    let mut m = Manifest {
        format: FORMAT.into(),
        step: first.step as u64,
        layers: first.layers as u32,
        world_size: first.world_size as u32,
        units: vec![],
        ranks: vec![],
        lost_ranks: vec![],
    };
    let entry = |h: &Holding| FileEntry { file: h.file.clone(), bytes: h.bytes as u64, chunk_bytes: 0, crc32c: vec![] };
    for h in files {
        if h.rank >= 0 {
            m.ranks.push(RankEntry { rank: h.rank as u32, file: entry(h) });
            continue;
        }
        let (Ok(block), Ok(part)) = (h.block.parse(), h.part.parse()) else {
            return Some(format!("file {} names no unit this coordinator knows ({} {})", h.file, h.block, h.part));
        };
        let key = UnitKey { block, part, tp_rank: h.tp_rank as u32, tp_size: h.tp_size as u32 };
        m.units.push(UnitEntry { key, file: entry(h), tensors: Default::default() });
    }
    m.check_complete().err().map(|e| e.to_string())
}

fn step_view(step: i64, files: &[&Holding]) -> StepView {
    let distinct: BTreeMap<&str, &Holding> = files.iter().map(|h| (h.file.as_str(), *h)).collect();
    let unique: Vec<&Holding> = distinct.values().copied().collect();
    // Complete as one generation wrote it, with the crcs a restore verifies (the recovery's
    // rule, `restore_plan::choose_step`): the newest generation's verdict when none is whole.
    let mut by_generation: BTreeMap<i64, BTreeMap<&str, &Holding>> = BTreeMap::new();
    for h in files.iter().filter(|h| h.has_crcs()) {
        by_generation.entry(h.generation).or_default().insert(h.file.as_str(), *h);
    }
    let verdicts: Vec<Option<String>> =
        by_generation.values().rev().map(|g| completeness(&g.values().copied().collect::<Vec<_>>())).collect();
    let missing = match verdicts.iter().any(Option::is_none) {
        true => None,
        false => Some(verdicts.into_iter().flatten().next().unwrap_or_else(|| "no file of the step was reported with crcs".into())),
    };
    StepView {
        step,
        generations: files.iter().map(|h| h.generation).collect::<BTreeSet<_>>().into_iter().collect(),
        files: unique.len(),
        bytes: unique.iter().map(|h| h.bytes).sum(),
        nodes: files.iter().map(|h| h.node.clone()).collect::<BTreeSet<_>>().into_iter().collect(),
        complete: missing.is_none(),
        missing,
    }
}

/// The newest complete step of `job` (-1: none).
pub async fn newest_complete(store: &Store, job: i64) -> Result<i64> {
    Ok(steps(store, job).await?.iter().filter(|s| s.complete).map(|s| s.step).max().unwrap_or(-1))
}

/// A job's steps, newest first.
pub async fn steps(store: &Store, job: i64) -> Result<Vec<StepView>> {
    store.job(job).await?;
    let all = store.holdings(job).await?;
    let mut by_step: BTreeMap<i64, Vec<&Holding>> = BTreeMap::new();
    for h in &all {
        by_step.entry(h.step).or_default().push(h);
    }
    Ok(by_step.iter().rev().map(|(s, files)| step_view(*s, files)).collect())
}

/// One step's grid (default: the newest complete step, else the newest).
pub async fn grid(store: &Store, job: i64, step: Option<i64>) -> Result<StepGrid> {
    let views = steps(store, job).await?;
    let chosen = match step {
        Some(s) => views.iter().find(|v| v.step == s).cloned().ok_or_else(|| {
            let held: Vec<String> = views.iter().map(|v| v.step.to_string()).collect();
            CoordinatorError::not_found(format!(
                "step {s} of job {job}'s checkpoints (held: {})",
                if held.is_empty() { "none".into() } else { held.join(", ") }
            ))
        })?,
        None => views
            .iter()
            .find(|v| v.complete)
            .or(views.first())
            .cloned()
            .ok_or_else(|| CoordinatorError::not_found(format!("checkpoints of job {job}: no node reported any")))?,
    };
    let all = store.holdings(job).await?;
    let generation = shown_generation(all.iter().filter(|h| h.step == chosen.step));
    let mut rows: BTreeMap<String, GridRow> = BTreeMap::new();
    for h in all.iter().filter(|h| h.step == chosen.step && h.generation == generation) {
        let unit = if h.rank >= 0 { format!("rank {}", h.rank) } else { format!("{} {} tp {}/{}", h.block, h.part, h.tp_rank, h.tp_size) };
        let row =
            rows.entry(h.file.clone()).or_insert_with(|| GridRow { file: h.file.clone(), unit, bytes: h.bytes, held: BTreeMap::new() });
        row.held.entry(h.node.clone()).or_default().push(h.tier.clone());
    }
    Ok(StepGrid { step: chosen, generation, rows: rows.into_values().collect() })
}

/// Of one step's copies, the generation a restore would take (the newest whose copies with
/// crcs make the step whole), else the newest reported.
fn shown_generation<'a>(files: impl Iterator<Item = &'a Holding>) -> i64 {
    let mut by_generation: BTreeMap<i64, BTreeMap<&str, &Holding>> = BTreeMap::new();
    for h in files {
        let g = by_generation.entry(h.generation).or_default();
        if h.has_crcs() {
            g.insert(h.file.as_str(), h);
        }
    }
    let whole = by_generation.iter().rev().find(|(_, f)| !f.is_empty() && completeness(&f.values().copied().collect::<Vec<_>>()).is_none());
    whole.or(by_generation.iter().next_back()).map_or(-1, |(g, _)| *g)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(file: &str, block: &str, part: &str, tp: (i64, i64), rank: i64) -> Holding {
        Holding {
            job_id: 1,
            generation: 1,
            step: 4,
            file: file.into(),
            node: "n0".into(),
            tier: "disk".into(),
            bytes: 10,
            block: block.into(),
            part: part.into(),
            tp_rank: tp.0,
            tp_size: tp.1,
            rank,
            layers: 1,
            world_size: 1,
            chunk_bytes: 0,
            crc32c: "[]".into(),
        }
    }

    #[test]
    fn a_step_is_complete_only_with_every_unit_and_rank_file() {
        let mut files = vec![];
        for block in ["embed", "layer.0", "head"] {
            for part in ["model", "optimizer"] {
                files.push(h(&format!("{block}.{part}"), block, part, (0, 1), -1));
            }
        }
        let refs: Vec<&Holding> = files.iter().collect();
        assert!(completeness(&refs).unwrap().contains("rank file of rank 0"));
        files.push(h("rank.00000.safetensors", "", "", (0, 0), 0));
        let refs: Vec<&Holding> = files.iter().collect();
        assert_eq!(completeness(&refs), None);
        let without_head: Vec<&Holding> = files.iter().filter(|x| x.block != "head").collect();
        assert!(completeness(&without_head).unwrap().contains("head"), "{:?}", completeness(&without_head));
    }

    #[test]
    fn the_grid_shows_the_generation_a_restore_takes() {
        // Generation 1 whole (with crcs), generation 2 without its rank file: generation 1's
        // copies; generation 2 whole too: generation 2's; copies without crcs never count.
        let whole = |generation: i64| -> Vec<Holding> {
            let mut files = vec![];
            for block in ["embed", "layer.0", "head"] {
                for part in ["model", "optimizer"] {
                    files.push(h(&format!("{block}.{part}"), block, part, (0, 1), -1));
                }
            }
            files.push(h("rank.00000.safetensors", "", "", (0, 0), 0));
            files.into_iter().map(|x| Holding { generation, chunk_bytes: 16, crc32c: "[1]".into(), ..x }).collect()
        };
        let mut two: Vec<Holding> = whole(2);
        two.retain(|x| x.rank < 0);
        let all: Vec<Holding> = whole(1).into_iter().chain(two).collect();
        assert_eq!(shown_generation(all.iter()), 1);
        let all: Vec<Holding> = whole(1).into_iter().chain(whole(2)).collect();
        assert_eq!(shown_generation(all.iter()), 2);
        let no_crcs: Vec<Holding> = whole(3).into_iter().map(|x| Holding { crc32c: "[]".into(), ..x }).chain(whole(1)).collect();
        assert_eq!(shown_generation(no_crcs.iter()), 1);
    }
}
