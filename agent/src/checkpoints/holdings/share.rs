//! The holdings report's bound (docs/recovery.md, "Limits"): one status message carries at most
//! `MAX_REPORT_BYTES` of holdings, shared fairly between the jobs whose checkpoints are on the
//! node. A report replaces every row the coordinator held for the node, so what one job's
//! ranks write (a piece listing thousands of files, a step numbered 2^62) must never push
//! another job's steps out of it: each job keeps its newest steps whole within its share, and
//! only a job over its share loses any, and only its own oldest.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use motley_proto::v1::CkptHolding;

/// The most bytes of holdings one status message carries (docs/recovery.md, "Limits"): the
/// coordinator takes messages of up to 4 MiB (tonic's default), and one over it would end
/// every session of the node, its lease and its ranks with it. The rest of the message (ranks,
/// load, results) has the other MiB.
pub const MAX_REPORT_BYTES: usize = 3 << 20;

/// One holding's bytes within `AgentStatus.holdings`: its encoding, its tag and length prefix
/// (at most 5 bytes).
pub fn encoded_bound(h: &CkptHolding) -> usize {
    use motley_proto::Message;
    1 + 5 + h.encoded_len()
}

/// One job's holdings by step (a step of one generation), newest first.
type JobSteps = BTreeMap<(Reverse<u64>, i64), Vec<CkptHolding>>;

/// `list` cut to at most `limit` bytes (`encoded_bound`), and what was left out, to say so.
///
/// Each job has an equal share of `limit`, and what a job does not use goes to the jobs that
/// need more (max-min fairness: jobs are served smallest first, each taking at most what is
/// left over the jobs not yet served). A job keeps whole steps, the newest first (the one a
/// recovery restores), within its share; a step is kept whole or not at all. So a job whose
/// holdings fit its share keeps all of them, whatever the other jobs' ranks write.
pub fn bounded(list: Vec<CkptHolding>, limit: usize) -> (Vec<CkptHolding>, Option<String>) {
    let total: usize = list.iter().map(encoded_bound).sum();
    if total <= limit {
        return (list, None);
    }
    let mut jobs: BTreeMap<i64, JobSteps> = BTreeMap::new();
    for h in list {
        jobs.entry(h.job).or_default().entry((Reverse(h.step), h.generation)).or_default().push(h);
    }
    let size = |held: &[CkptHolding]| held.iter().map(encoded_bound).sum::<usize>();
    let mut order: Vec<(usize, i64)> = jobs.iter().map(|(&job, steps)| (steps.values().map(|h| size(h)).sum(), job)).collect();
    order.sort_unstable();
    let (mut kept, mut left, mut dropped, mut files) = (vec![], limit, vec![], 0usize);
    let count = order.len();
    for (served, (_, job)) in order.into_iter().enumerate() {
        let share = left / (count - served);
        let mut used = 0usize;
        for ((Reverse(step), generation), held) in jobs.remove(&job).unwrap_or_default() {
            let bytes = size(&held);
            if used + bytes <= share {
                used += bytes;
                kept.extend(held);
            } else {
                files += held.len();
                dropped.push((job, step, generation));
            }
        }
        left -= used;
    }
    let key = |a: &CkptHolding| (a.job, a.generation, a.step, a.file.clone(), a.tier.clone());
    kept.sort_by_key(key);
    // Named by job, each job's oldest first.
    dropped.sort_unstable();
    let named: Vec<String> = dropped.iter().take(8).map(|(j, s, g)| format!("job {j} generation {g} step {s}")).collect();
    let what = format!(
        "checkpoint holdings of {total} bytes exceed the {limit} bytes one report may carry, shared between {count} \
         job{}: {files} files of {} steps left out (oldest first: {}); prune old steps (checkpoint.keep) so the coordinator knows of every copy",
        if count == 1 { "" } else { "s" },
        dropped.len(),
        named.join(", ")
    );
    (kept, Some(what))
}
