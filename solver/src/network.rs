//! The communication groups of a placed plan: for every TP group, pipeline hop and gradient
//! ring, the GPUs, the transport and NICs it uses, the NCCL settings that select them, and
//! what it costs per iteration. The JSON shape (`kind`, `gpus`, `transport`, `nics`, `env`)
//! is a contract (docs/plan.md, `comm_groups`); fields may be added, never renamed.
//!
//! Rules (Holmes, section 3): a TP group stays inside a node (NVLink or PCIe); a pipeline hop
//! between two nodes uses the best transport both ends share, Ethernet (sockets) between RDMA
//! islands; a gradient ring uses RDMA only when every pair of its nodes shares one RDMA kind
//! in one RDMA domain, so no ring ever mixes InfiniBand and RoCE: such a ring runs over
//! sockets. NICs are the members' rail-local NICs of the chosen kind where the cluster file
//! says which GPUs a NIC serves, all NICs of that kind otherwise.
//!
//! How a rank uses them: NCCL reads most of its environment once per communicator
//! initialisation, and the network plugin's device list (`NCCL_IB_HCA`, `NCCL_SOCKET_IFNAME`)
//! once per process. So a rank (1) starts with the union of the `env` of every group it
//! belongs to for the device lists, then (2) creates its communicators in `comm_groups` order,
//! setting each group's `env` just before that group's `ncclCommInitRank` (or
//! `new_group`) and passing `nccl_net` as `ncclConfig_t.netName` where the NCCL binding
//! exposes it, which is the one per-communicator network switch NCCL honours after the first
//! initialisation, plus its node's `node_env` where the group has one. Every member of a group
//! applies the same settings for it. `NCCL_IB_DISABLE=1` is never emitted: NCCL caches it
//! for the process, so it would switch RDMA off for the rank's later groups.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::cost::CostModel;
use crate::hardware::{Cluster, IntraLink, NicKind};
use crate::placement::{GpuId, Placement};
use crate::plan::PlanStructure;

pub use motley_contract::plan::{CommGroupDoc, GroupKind, Transport};

/// Every communication group of a placed plan, in the order ranks should create them:
/// TP groups, then pipeline hops, then gradient rings.
pub fn comm_groups(cm: &CostModel, plan: &PlanStructure, placement: &Placement) -> Vec<CommGroupDoc> {
    let net = Net::new(cm.cluster);
    let mut out = vec![];
    let (s, h) = (cm.model.seq_len as f64, cm.model.hidden());
    // TP groups: two all-reduces of the layer's activations forward, two backward.
    for (ri, r) in plan.replicas.iter().enumerate() {
        for (si, st) in r.stages.iter().enumerate() {
            let t = st.kind.tp as f64;
            if st.kind.tp < 2 {
                continue;
            }
            let m = plan.micro_batch as f64 / st.kind.dp as f64;
            let layers = (st.layers.1 - st.layers.0) as f64;
            let bytes = 4.0 * 2.0 * (t - 1.0) / t * m * s * h * 2.0 * layers * r.micro_batches as f64;
            for g in placement.gpus[ri][si].chunks(st.kind.tp as usize) {
                out.push(net.group(GroupKind::Tp, g.to_vec(), Some(ri as u32), Some(si as u32), [st.layers.0, st.layers.1], bytes, 1.0));
            }
        }
    }
    // Pipeline hops: one micro-batch's activations forward and their gradients back.
    let hop_bytes = 2.0 * plan.micro_batch as f64 * s * h * 2.0;
    for (ri, r) in plan.replicas.iter().enumerate() {
        for si in 0..r.stages.len().saturating_sub(1) {
            let gpus: Vec<GpuId> = placement.gpus[ri][si].iter().chain(&placement.gpus[ri][si + 1]).cloned().collect();
            let b = r.stages[si].layers.1;
            out.push(net.group(GroupKind::Pp, gpus, Some(ri as u32), Some(si as u32), [b, b], hop_bytes * r.micro_batches as f64, 1.0));
        }
    }
    // Gradient rings: per layer segment (every stage boundary of every replica cuts one) and
    // TP rank, the GPUs of that rank in every TP group holding the segment.
    let layers = cm.model.layers();
    let mut cuts: BTreeSet<u32> = [0, layers].into();
    for r in &plan.replicas {
        cuts.extend(r.stages.iter().map(|s| s.layers.0));
    }
    let cuts: Vec<u32> = cuts.into_iter().collect();
    // One tp per plan (the plan model's rule; `replan` refuses plan files that mix them).
    let Some(tp) = plan.replicas.first().and_then(|r| r.stages.first()).map(|s| s.kind.tp) else { return out };
    for w in cuts.windows(2) {
        let (l0, l1) = (w[0], w[1]);
        let params = (l1 - l0) as f64 * cm.model.layer_params + cm.model.ends_params(l0 == 0, l1 == layers);
        for j in 0..tp as usize {
            let mut gpus = vec![];
            for (ri, r) in plan.replicas.iter().enumerate() {
                let si = r.stages.iter().position(|st| st.layers.0 <= l0 && l0 < st.layers.1).expect("stages cover every layer");
                gpus.extend(placement.gpus[ri][si].chunks(tp as usize).map(|g| g[j].clone()));
            }
            let n = gpus.len() as f64;
            if n < 2.0 {
                continue;
            }
            // fp16 gradients of one TP shard; the TP shards' rings share each node's NICs.
            let bytes = 2.0 * (n - 1.0) / n * 2.0 * params / tp as f64;
            out.push(net.group(GroupKind::Dp, gpus, None, None, [l0, l1], bytes, tp as f64));
        }
    }
    out
}

struct Net<'a> {
    cluster: &'a Cluster,
    node_of: HashMap<&'a str, usize>,
}

impl<'a> Net<'a> {
    fn new(cluster: &'a Cluster) -> Self {
        Net { cluster, node_of: cluster.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect() }
    }

    /// A group over `gpus`; `nic_sharers` rings of the same kind share each NIC when it
    /// crosses nodes.
    #[allow(clippy::too_many_arguments)]
    fn group(
        &self,
        kind: GroupKind,
        gpus: Vec<GpuId>,
        replica: Option<u32>,
        stage: Option<u32>,
        layers: [u32; 2],
        bytes: f64,
        nic_sharers: f64,
    ) -> CommGroupDoc {
        let nodes: BTreeSet<usize> = gpus.iter().map(|g| self.node_of[g.node.as_str()]).collect();
        let classes: BTreeSet<usize> = nodes.iter().map(|&n| self.cluster.nodes[n].class).collect();
        let (transport, bw) = if nodes.len() == 1 {
            let c = *classes.iter().next().expect("one node");
            let t = match self.cluster.classes[c].intra {
                IntraLink::Nvlink => Transport::Nvlink,
                IntraLink::Pcie => Transport::Pcie,
            };
            (t, self.cluster.intra_bw(c))
        } else {
            self.inter(&nodes, &classes, nic_sharers)
        };
        let Settings { nics, env, node_env, nccl_net } = self.settings(transport, &gpus);
        CommGroupDoc {
            kind,
            gpus,
            transport,
            nics,
            env,
            node_env,
            nccl_net,
            replica,
            stage,
            layers,
            link_gb_per_s: bw,
            bytes_per_iteration: bytes,
            seconds_per_iteration: bytes / (bw * 1e9),
        }
    }

    /// Transport and GB/s between a set of nodes (`Cluster::common_link`: RDMA only if every
    /// node has the same kind in one domain; the slowest pair sets the speed).
    fn inter(&self, nodes: &BTreeSet<usize>, classes: &BTreeSet<usize>, nic_sharers: f64) -> (Transport, f64) {
        let cls: Vec<usize> = classes.iter().copied().collect();
        let multi: Vec<bool> = cls.iter().map(|&c| nodes.iter().filter(|&&n| self.cluster.nodes[n].class == c).count() > 1).collect();
        let (kind, bw) = self.cluster.common_link(&cls, &multi);
        let transport = match kind {
            NicKind::Ib => Transport::Ib,
            NicKind::Roce => Transport::Roce,
            NicKind::Ethernet => Transport::Socket,
        };
        (transport, bw / nic_sharers)
    }

    /// NICs, NCCL environment, per-node overrides and `netName` of a group using `transport`.
    fn settings(&self, transport: Transport, gpus: &[GpuId]) -> Settings {
        let mut env = BTreeMap::new();
        let kind = match transport {
            Transport::Nvlink | Transport::Pcie => {
                let level = if transport == Transport::Nvlink { "NVL" } else { "PHB" };
                env.insert("NCCL_P2P_DISABLE".into(), "0".into());
                env.insert("NCCL_P2P_LEVEL".into(), level.into());
                return Settings { nics: vec![], env, node_env: BTreeMap::new(), nccl_net: None };
            }
            Transport::Ib => NicKind::Ib,
            Transport::Roce => NicKind::Roce,
            Transport::Socket => NicKind::Ethernet,
        };
        let mut nics = BTreeSet::new();
        // GID index per node: a property of the local port, so nodes may differ.
        let mut gid: BTreeMap<String, u32> = BTreeMap::new();
        // Rail-aligned: every member uses NICs of the same names (its rail-local ones where the
        // cluster file says which GPUs a NIC serves), so rings need not cross rails.
        let mut rails: BTreeSet<Vec<String>> = BTreeSet::new();
        let mut undeclared = false;
        for g in gpus {
            let class = &self.cluster.classes[self.cluster.nodes[self.node_of[g.node.as_str()]].class];
            let of_kind: Vec<_> = class.nics.iter().filter(|n| n.kind == kind).collect();
            undeclared |= of_kind.is_empty();
            let local: Vec<_> = of_kind.iter().filter(|n| n.gpus.contains(&g.index)).copied().collect();
            let chosen = if local.is_empty() { of_kind } else { local };
            rails.insert(chosen.iter().map(|n| n.name.clone()).collect());
            for n in chosen {
                nics.insert(if kind == NicKind::Ethernet { n.name.clone() } else { n.hca() });
                gid.entry(g.node.clone()).or_insert(n.gid_index.unwrap_or(3));
            }
        }
        let nics: Vec<String> = nics.into_iter().collect();
        let mut node_env: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        // NCCL_IB_DISABLE is never set to 1 here: NCCL reads it once per process, so a socket
        // group created first would switch RDMA off for the rank's later RDMA groups. NCCL_NET
        // (and `netName`) selects the network per communicator instead.
        if kind == NicKind::Ethernet {
            env.insert("NCCL_NET".into(), "Socket".into());
            // With a node that declares no interface, naming the others' would leave it none.
            if !nics.is_empty() && !undeclared {
                // `=` makes NCCL match the names exactly (eth1 does not also pick eth10).
                env.insert("NCCL_SOCKET_IFNAME".into(), format!("={}", nics.join(",")));
            }
            return Settings { nics, env, node_env, nccl_net: Some("Socket".into()) };
        }
        env.insert("NCCL_NET".into(), "IB".into());
        env.insert("NCCL_IB_DISABLE".into(), "0".into());
        env.insert("NCCL_IB_HCA".into(), format!("={}", nics.join(",")));
        env.insert("NCCL_CROSS_NIC".into(), if rails.len() == 1 { "0" } else { "1" }.into());
        if kind == NicKind::Roce {
            // The most common index goes in `env`; nodes that differ get their own.
            let mut count: BTreeMap<u32, usize> = BTreeMap::new();
            for &g in gid.values() {
                *count.entry(g).or_insert(0) += 1;
            }
            let common = count.iter().max_by_key(|(g, c)| (**c, std::cmp::Reverse(**g))).map_or(3, |(g, _)| *g);
            env.insert("NCCL_IB_GID_INDEX".into(), common.to_string());
            for (node, g) in gid.into_iter().filter(|(_, g)| *g != common) {
                node_env.entry(node).or_default().insert("NCCL_IB_GID_INDEX".into(), g.to_string());
            }
        }
        Settings { nics, env, node_env, nccl_net: Some("IB".into()) }
    }
}

struct Settings {
    nics: Vec<String>,
    env: BTreeMap<String, String>,
    node_env: BTreeMap<String, BTreeMap<String, String>>,
    nccl_net: Option<String>,
}

// A rank's process environment from its groups' settings is the groups file's rule, read by
// the agent too (`motley_contract::groups`).
pub use motley_contract::groups::{process_env, unite_device_lists, EnvConflict, PROCESS_LISTS};

/// Refuses groups that would need contradicting process-wide NCCL settings on one rank
/// ([`process_env`]), naming the GPU, both groups (index in `groups` and kind) and the key.
pub fn check_process_env(groups: &[CommGroupDoc]) -> crate::Result<()> {
    let mut ranks: BTreeMap<&GpuId, Vec<usize>> = BTreeMap::new();
    for (i, g) in groups.iter().enumerate() {
        for m in &g.gpus {
            ranks.entry(m).or_default().push(i);
        }
    }
    for (gpu, idx) in ranks {
        let envs: Vec<BTreeMap<String, String>> = idx
            .iter()
            .map(|&i| {
                let mut env = groups[i].env.clone();
                if let Some(over) = groups[i].node_env.get(&gpu.node) {
                    env.extend(over.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                env
            })
            .collect();
        let refs: Vec<&BTreeMap<String, String>> = envs.iter().collect();
        if let Err(c) = process_env(&refs) {
            let (a, b) = (idx[c.first], idx[c.second]);
            return Err(crate::SolverError::invalid(
                "comm_groups",
                format!(
                    "GPU {}:{} is in group {a} ({}) with {}={} and group {b} ({}) with {}={}; NCCL reads {} once per process and the two lists cannot be united (exact vs prefix matching, or inclusion vs exclusion)",
                    gpu.node, gpu.index, groups[a].kind.name(), c.key, envs[c.first][&c.key], groups[b].kind.name(), c.key, envs[c.second][&c.key], c.key
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn groups_whose_lists_contradict_on_one_gpu_are_refused_naming_both_and_the_key() {
        let gpu = |node: &str, index| GpuId { node: node.into(), index };
        let group = |kind, gpus: Vec<GpuId>, e: BTreeMap<String, String>| CommGroupDoc {
            kind,
            gpus,
            transport: Transport::Ib,
            nics: vec![],
            env: e,
            node_env: BTreeMap::new(),
            nccl_net: Some("IB".into()),
            replica: None,
            stage: None,
            layers: [0, 1],
            link_gb_per_s: 1.0,
            bytes_per_iteration: 0.0,
            seconds_per_iteration: 0.0,
        };
        let mut groups = vec![
            group(GroupKind::Tp, vec![gpu("a", 0), gpu("a", 1)], env(&[("NCCL_P2P_LEVEL", "NVL")])),
            group(GroupKind::Pp, vec![gpu("a", 0), gpu("b", 0)], env(&[("NCCL_IB_HCA", "=mlx5_0:1")])),
            group(GroupKind::Dp, vec![gpu("a", 1), gpu("b", 1)], env(&[("NCCL_IB_HCA", "mlx5_1")])),
        ];
        check_process_env(&groups).unwrap();
        groups[2].gpus[0] = gpu("a", 0);
        let e = check_process_env(&groups).unwrap_err().to_string();
        assert!(e.contains("group 1 (pp)") && e.contains("group 2 (dp)") && e.contains("NCCL_IB_HCA") && e.contains("a:0"), "{e}");
        // A node's own override counts: there the lists agree again.
        groups[2].node_env.insert("a".into(), env(&[("NCCL_IB_HCA", "=mlx5_1:1")]));
        check_process_env(&groups).unwrap();
    }
}
