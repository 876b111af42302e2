//! `motley dev up --emulate`: a cluster file's GPU types at their relative speeds on this
//! machine's CPUs (docs/emulation.md). Each node entry without an `emulate:` of its own gets
//! `emulate: {cpu: F}`, F proportional to its GPU type's peak for the cluster's precision, scaled
//! so that every rank together takes at most `BUDGET` of the machine's cores and no rank more
//! than one core.

use motley_solver::{Cluster, ClusterSpec};

use crate::inputs::InputError;

/// The share of the machine's cores all emulated ranks may take together: the rest is for the
/// coordinator, the agents and the ranks' own communication threads.
pub const BUDGET: f64 = 0.8;

/// The kernel's smallest CPU quota is 1 ms of each 100 ms period.
const LEAST_SHARE: f64 = 0.01;

/// Fill in `emulate` for every entry of `spec` that has none, for a machine of `cores` cores;
/// `(GPU type, share of one core per GPU)` for each type filled in, fastest first.
pub fn fill(spec: &mut ClusterSpec, cores: usize) -> Result<Vec<(String, f64)>, InputError> {
    let cluster = Cluster::from_spec(spec).map_err(|e| InputError(e.to_string()))?;
    let precision = cluster.auto_precision();
    let peak = |gpu: &str| {
        let class = cluster.classes.iter().find(|c| c.gpu.name.eq_ignore_ascii_case(gpu)).expect("a validated node's GPU type has a class");
        class.gpu.peak_tflops(precision).unwrap_or(class.gpu.tflops)
    };
    let gpus = |n: &motley_solver::hardware::NodeSpec| f64::from(n.count.unwrap_or(1) * n.gpus);
    let open: Vec<usize> = (0..spec.nodes.len()).filter(|&i| spec.nodes[i].emulate.is_none()).collect();
    let Some(fastest) = open.iter().map(|&i| peak(&spec.nodes[i].gpu)).reduce(f64::max) else { return Ok(vec![]) };
    let fixed: f64 = spec.nodes.iter().filter_map(|n| n.emulate.map(|e| e.cpu * gpus(n))).sum();
    let budget = BUDGET * cores as f64 - fixed;
    let weight: f64 = open.iter().map(|&i| gpus(&spec.nodes[i]) * peak(&spec.nodes[i].gpu) / fastest).sum();
    let scale = (budget / weight).min(1.0);
    if scale * (open.iter().map(|&i| peak(&spec.nodes[i].gpu)).reduce(f64::min).unwrap_or(fastest) / fastest) < LEAST_SHARE {
        return Err(InputError(format!(
            "--emulate: {} GPUs at their relative speeds do not fit in {:.1} of this machine's {cores} cores (the slowest would get under 1% of a core); emulate fewer nodes or give them emulate: {{cpu: F}} yourself",
            weight.round(),
            budget.max(0.0)
        )));
    }
    let mut shares: Vec<(String, f64)> = vec![];
    for i in open {
        let share = ((peak(&spec.nodes[i].gpu) / fastest * scale) * 1000.0).floor() / 1000.0;
        spec.nodes[i].emulate = Some(motley_solver::hardware::Emulate { cpu: share });
        if !shares.iter().any(|(g, _)| g.eq_ignore_ascii_case(&spec.nodes[i].gpu)) {
            shares.push((spec.nodes[i].gpu.clone(), share));
        }
    }
    shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(shares)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> ClusterSpec {
        serde_norway::from_str(text).unwrap()
    }

    #[test]
    fn shares_follow_the_peaks_and_fit_the_machine() {
        // fp16 (a V100 has no bf16): A100 312, V100 125 TFLOPS.
        let mut s = spec("name: m\nnodes:\n  - {name: a, gpu: A100-80G, gpus: 2}\n  - {name: v, gpu: V100-32G, gpus: 2}\n");
        let shares = fill(&mut s, 2).unwrap();
        let (a, v) = (s.nodes[0].emulate.unwrap().cpu, s.nodes[1].emulate.unwrap().cpu);
        assert!((a / v - 312.0 / 125.0).abs() < 0.02, "{a} {v}");
        assert!(2.0 * a + 2.0 * v <= BUDGET * 2.0 + 1e-9, "{a} {v}");
        assert_eq!(shares, vec![("A100-80G".to_string(), a), ("V100-32G".to_string(), v)]);
        // On a big machine no rank takes more than one core.
        let mut s = spec("name: m\nnodes:\n  - {name: a, gpu: A100-80G, gpus: 2}\n  - {name: v, gpu: V100-32G, gpus: 2}\n");
        fill(&mut s, 64).unwrap();
        assert_eq!(s.nodes[0].emulate.unwrap().cpu, 1.0);
    }

    #[test]
    fn an_entry_with_its_own_share_keeps_it_and_the_rest_fit_around_it() {
        let mut s =
            spec("name: m\nnodes:\n  - {name: a, gpu: A100-80G, gpus: 1, emulate: {cpu: 0.6}}\n  - {name: v, gpu: V100-32G, gpus: 2}\n");
        let shares = fill(&mut s, 2).unwrap();
        assert_eq!(s.nodes[0].emulate.unwrap().cpu, 0.6);
        assert_eq!(shares.len(), 1);
        assert!(0.6 + 2.0 * s.nodes[1].emulate.unwrap().cpu <= BUDGET * 2.0 + 1e-9);
    }

    #[test]
    fn too_many_gpus_for_the_machine_are_refused() {
        let mut s = spec("name: m\nnodes:\n  - {name: a, gpu: A100-80G, gpus: 8, count: 40}\n  - {name: t, gpu: T4, gpus: 8, count: 10}\n");
        let e = fill(&mut s, 2).unwrap_err().0;
        assert!(e.starts_with("--emulate:") && e.contains("do not fit"), "{e}");
    }
}
