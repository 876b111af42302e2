//! Step 2 of a restore: what each node of the new plan must hold. For every rank, the units
//! of its blocks (its layers, the embedding on a first stage, the head on a last) at its TP
//! shard, and a rank file; a unit written at another TP degree needs every shard it was
//! written in, and the node re-slices it (`MakeUnit`).

use std::collections::BTreeMap;

use motley_contract::{GpuRef, RankPlacement};
use motley_proto::v1::MakeUnit;

use super::{index, NodeNeeds, StepFile};
use crate::error::{CoordinatorError, Result};
use crate::store::Holding;

/// Every node's needs under the new plan's placements.
pub fn needs(files: &[Holding], placements: &[(GpuRef, RankPlacement)]) -> Result<BTreeMap<String, NodeNeeds>> {
    let idx = index(files);
    // (block, part) -> the files of the unit, by TP rank, at the degree it was written.
    let mut units: BTreeMap<(String, String), Vec<&StepFile>> = BTreeMap::new();
    let mut rank_files: BTreeMap<i64, &String> = BTreeMap::new();
    for (name, f) in &idx {
        if f.rank >= 0 {
            rank_files.insert(f.rank, name);
        } else {
            units.entry((f.block.clone(), f.part.clone())).or_default().push(f);
        }
    }
    let mut out: BTreeMap<String, NodeNeeds> = BTreeMap::new();
    for (gpu, p) in placements {
        let need = out.entry(gpu.node.clone()).or_default();
        let mut blocks: Vec<String> = (p.layers[0]..p.layers[1]).map(|l| format!("layer.{l}")).collect();
        if p.stage == 0 {
            blocks.push("embed".into());
        }
        if p.stage + 1 == p.pp_size {
            blocks.push("head".into());
        }
        for block in blocks {
            for part in ["model", "optimizer"] {
                let Some(unit) = units.get(&(block.clone(), part.to_string())) else {
                    return Err(CoordinatorError::Conflict(format!(
                        "the checkpoint has no {block} {part} unit, which rank {} loads: it is of another model or plan",
                        p.rank
                    )));
                };
                let written = unit[0].tp_size;
                if written == p.tp_size {
                    let f = unit.iter().find(|f| f.tp_rank == p.tp_rank).expect("a complete step has every TP rank");
                    *need.files.entry(f.entry.file.clone()).or_default() += 1;
                    continue;
                }
                // Another degree: every written shard comes, and the node cuts its own.
                for f in unit {
                    *need.files.entry(f.entry.file.clone()).or_default() += 1;
                }
                let target = motley_checkpoint::manifest::unit_file_name(&motley_checkpoint::UnitKey {
                    block: block.parse().map_err(|e| CoordinatorError::Conflict(format!("{block}: {e}")))?,
                    part: part.parse().map_err(|e| CoordinatorError::Conflict(format!("{part}: {e}")))?,
                    tp_rank: p.tp_rank,
                    tp_size: p.tp_size,
                });
                if !need.make.iter().any(|m| m.file == target) {
                    let mut sources: Vec<&StepFile> = unit.clone();
                    sources.sort_by_key(|f| f.tp_rank);
                    need.make.push(MakeUnit {
                        file: target,
                        sources: sources.iter().map(|f| f.entry.file.clone()).collect(),
                        tp_size: p.tp_size,
                        tp_rank: p.tp_rank,
                    });
                }
            }
        }
        // The rank's own rank file, else the lowest one (same data position and scheduler).
        let rf = rank_files.get(&i64::from(p.rank)).or_else(|| rank_files.values().next()).copied();
        if let Some(rf) = rf {
            *need.files.entry(rf.clone()).or_default() += 1;
        }
    }
    Ok(out)
}
