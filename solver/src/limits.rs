//! The largest inputs the planner accepts. Every size a file or a request carries that the
//! planner turns into memory or work (nodes after `count` expansion, GPUs, batch sizes,
//! sequence length, layers, pipeline depth) is checked against these before anything is
//! allocated: a typo such as `count: 100000000` is refused in microseconds, naming the field,
//! instead of growing the process to many gigabytes (solver/README.md, "Limits"). The
//! coordinator plans through the same checks, so a job file is bounded the same way.
//!
//! The limits sit far above the largest inputs the benchmarks use (BENCHMARKS.md: 20,000 nodes
//! of 8 x H100, 160,000 GPUs, global batch 8192) and above real training runs, and far below
//! what would exhaust a machine. They are stated in `solver/README.md`.

use crate::error::{Result, SolverError};

// The cluster file's sizes are checked where the file is (`motley_contract::cluster`), by
// these same numbers.
pub use motley_contract::cluster::{MAX_GPUS, MAX_GPUS_PER_NODE, MAX_NODES};
/// Sequences per iteration (real runs use a few thousand; the batch split is linear in it).
pub const MAX_GLOBAL_BATCH: u32 = 1 << 20;
/// Sequences per micro-batch.
pub const MAX_MICRO_BATCH: u32 = 1 << 16;
/// Tokens per sequence.
pub const MAX_SEQ_LEN: u64 = 1 << 22;
/// Transformer layers of a model (the largest published models have about 130).
pub const MAX_LAYERS: u32 = 4096;
/// Pipeline stages the search may consider (`--max-stages`; never more than the layers).
pub const MAX_STAGES: u32 = MAX_LAYERS;

/// Allocations `motley provision` may consider (every one within the quotas is listed and
/// bounded before the search; the product of `quota / gpus_per_node + 1` over the offers).
pub const MAX_ALLOCATIONS: f64 = 5e6;

// BENCHMARKS.md's stress run (20,000 nodes of 8 GPUs, global batch 8192) stays within the
// limits: lowering one below it fails the build.
const _: () = assert!(MAX_NODES >= 20_000 && MAX_GPUS >= 160_000 && MAX_GLOBAL_BATCH >= 8192 && MAX_GPUS_PER_NODE >= 16);

use motley_contract::cluster::LIMIT_FIX as FIX;

/// `value` of `field` must be at most `max` `what`.
pub(crate) fn at_most(field: impl Into<String>, value: u64, max: u64, what: &str) -> Result<()> {
    if value > max {
        return Err(SolverError::invalid(field, format!("{value} is more than the {max} {what}; {FIX}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_over_a_limit_are_refused_with_the_field() {
        assert!(at_most("x", MAX_NODES, MAX_NODES, "nodes").is_ok());
        let e = at_most("nodes[3].count", 100_000_000, MAX_NODES, "nodes a cluster may have").unwrap_err().to_string();
        assert!(e.starts_with("nodes[3].count: 100000000 is more than the 65536 nodes a cluster may have; fix"), "{e}");
    }
}
