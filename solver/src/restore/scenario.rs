//! The restore scenario (a contract: `motley restore-plan --scenario FILE`, docs/restore.md):
//! nodes with their rates, the units of the step and their sizes, who holds which shards in
//! which tier, and which shards each node of the new plan must hold. Checked here, with errors
//! that name the field and the fix.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SolverError};

/// Rates are in MB/s (10^6 bytes per second), sizes in bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreScenario {
    /// A name for reports.
    #[serde(default)]
    pub name: String,
    pub cloud: CloudSpec,
    pub units: UnitSizes,
    pub nodes: Vec<NodeRates>,
    /// Who holds which shards, in which tier (memory: `/dev/shm`; disk: local NVMe).
    #[serde(default)]
    pub holdings: Vec<Holding>,
    /// What each node of the new plan must hold; a node may be listed once per rank group
    /// (a shard two of its replicas need is still read once; the cloud-only baseline counts it
    /// twice, as every rank fetches its own).
    pub demands: Vec<Demand>,
    /// Bytes a relay receives before it forwards (the checksum chunk), for the schedule's
    /// pipeline lag. Default 16 MiB.
    #[serde(default)]
    pub chunk_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudSpec {
    /// The object store's egress, shared by all nodes (MB/s).
    pub egress_mb_s: f64,
    /// Whether the whole step is in the cloud (its manifest committed). Default true.
    #[serde(default = "yes")]
    pub holds_step: bool,
}

fn yes() -> bool {
    true
}

/// The units of one step: `layers` transformer layers, and optionally the embedding and the
/// head; each has a model part and an optimizer part. Bytes are a whole unit's (all TP shards
/// together); a shard of `tp_size` t holds `1/t` of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnitSizes {
    pub layers: u32,
    pub layer: PartBytes,
    #[serde(default)]
    pub embed: Option<PartBytes>,
    #[serde(default)]
    pub head: Option<PartBytes>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartBytes {
    pub model: u64,
    pub optimizer: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRates {
    pub name: String,
    /// What the NIC receives (MB/s): peers' and the cloud's bytes.
    pub nic_in_mb_s: f64,
    /// What the NIC sends (MB/s); default `nic_in_mb_s`.
    #[serde(default)]
    pub nic_out_mb_s: Option<f64>,
    /// Local disk reads (MB/s).
    pub disk_read_mb_s: f64,
    /// Copies out of local memory (`/dev/shm`) into place (MB/s).
    pub mem_copy_mb_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Memory,
    Disk,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    Model,
    Optimizer,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holding {
    pub node: String,
    pub tier: Tier,
    pub shards: Vec<ShardSet>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Demand {
    pub node: String,
    pub shards: Vec<ShardSet>,
}

/// A set of shards: `layers` is a list such as `"embed,0-9,head"` or `"all"`; `parts`
/// defaults to both; `tp_ranks` (such as `"0-3"`) defaults to every rank of `tp_size`
/// (default 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardSet {
    pub layers: String,
    #[serde(default)]
    pub parts: Option<Vec<Part>>,
    #[serde(default = "one")]
    pub tp_size: u32,
    #[serde(default)]
    pub tp_ranks: Option<String>,
}

fn one() -> u32 {
    1
}

/// The largest TP degree a shard may name.
pub const MAX_TP: u32 = 1024;
/// The finest slicing of one unit (the least common multiple of the TP degrees that name it).
pub const MAX_SLICES: u64 = 4096;
/// The most layers a scenario may have.
pub const MAX_LAYERS: u32 = 100_000;

/// A unit: position (0 = embed, 1..=layers = layer i-1, layers+1 = head) and part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitId {
    pub pos: u32,
    pub part: Part,
}

/// One shard of a unit, expanded from a [`ShardSet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard {
    pub unit: UnitId,
    pub tp_rank: u32,
    pub tp_size: u32,
}

impl UnitSizes {
    /// The unit's bytes, or `None` if the scenario has no such unit.
    pub fn bytes(&self, u: UnitId) -> Option<u64> {
        let pb = if u.pos == 0 {
            self.embed?
        } else if u.pos <= self.layers {
            self.layer
        } else if u.pos == self.layers + 1 {
            self.head?
        } else {
            return None;
        };
        Some(match u.part {
            Part::Model => pb.model,
            Part::Optimizer => pb.optimizer,
        })
    }

    /// How a unit is named in reports: `embed`, `head` or the layer index.
    pub fn label(&self, pos: u32) -> String {
        if pos == 0 {
            "embed".into()
        } else if pos == self.layers + 1 {
            "head".into()
        } else {
            (pos - 1).to_string()
        }
    }
}

fn parse_list(text: &str, field: &str, what: &str, mut each: impl FnMut(&str) -> Result<Vec<u32>>) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for item in text.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(SolverError::invalid(field, format!("'{text}' has an empty item; write {what}")));
        }
        out.extend(each(item)?);
    }
    Ok(out)
}

fn parse_range(item: &str, field: &str, what: &str, limit: u32) -> Result<Vec<u32>> {
    let bad = || SolverError::invalid(field, format!("'{item}' is not {what}"));
    let (lo, hi) = match item.split_once('-') {
        Some((a, b)) => (a.trim().parse::<u32>().map_err(|_| bad())?, b.trim().parse::<u32>().map_err(|_| bad())?),
        None => {
            let v = item.parse::<u32>().map_err(|_| bad())?;
            (v, v)
        }
    };
    if lo > hi || hi >= limit {
        return Err(SolverError::invalid(field, format!("'{item}' is out of range: {what} (0 to {})", limit.saturating_sub(1))));
    }
    Ok((lo..=hi).collect())
}

impl ShardSet {
    /// The shards of this set; `field` names it in errors.
    pub fn expand(&self, units: &UnitSizes, field: &str) -> Result<Vec<Shard>> {
        let t = self.tp_size;
        if t == 0 || t > MAX_TP {
            return Err(SolverError::invalid(format!("{field}.tp_size"), format!("{t} is not a TP degree; use 1 to {MAX_TP}")));
        }
        let what = "a list of layer indices and ranges, embed, head or all (\"embed,0-9\")";
        let lf = format!("{field}.layers");
        let positions = parse_list(&self.layers, &lf, what, |item| match item {
            "all" => {
                let mut v: Vec<u32> = units.embed.map(|_| 0).into_iter().collect();
                v.extend(1..=units.layers);
                v.extend(units.head.map(|_| units.layers + 1));
                Ok(v)
            }
            "embed" if units.embed.is_some() => Ok(vec![0]),
            "head" if units.head.is_some() => Ok(vec![units.layers + 1]),
            "embed" | "head" => {
                Err(SolverError::invalid(&lf, format!("the scenario's units have no {item}; add units.{item} or remove it")))
            }
            _ => Ok(parse_range(item, &lf, what, units.layers)?.into_iter().map(|l| l + 1).collect()),
        })?;
        let rf = format!("{field}.tp_ranks");
        let ranks = match &self.tp_ranks {
            None => (0..t).collect(),
            Some(r) => parse_list(r, &rf, "a list of TP ranks and ranges (\"0-3\")", |item| {
                parse_range(item, &rf, &format!("a TP rank below tp_size {t}"), t)
            })?,
        };
        let parts = self.parts.clone().unwrap_or_else(|| vec![Part::Model, Part::Optimizer]);
        if parts.is_empty() {
            return Err(SolverError::invalid(format!("{field}.parts"), "is empty; list model, optimizer or both, or leave it out"));
        }
        let mut out = Vec::new();
        for &pos in &positions {
            for &part in &parts {
                for &r in &ranks {
                    out.push(Shard { unit: UnitId { pos, part }, tp_rank: r, tp_size: t });
                }
            }
        }
        Ok(out)
    }
}

impl NodeRates {
    pub fn nic_out(&self) -> f64 {
        self.nic_out_mb_s.unwrap_or(self.nic_in_mb_s)
    }
}

fn check_rate(v: f64, field: &str) -> Result<()> {
    if !v.is_finite() || v <= 0.0 || v > 1e9 {
        return Err(SolverError::invalid(field, format!("{v} is not a rate; give MB/s above 0 (at most 1e9)")));
    }
    Ok(())
}

impl RestoreScenario {
    /// Checks every field that the expansion does not; errors name the field and the fix.
    pub fn validate(&self) -> Result<()> {
        check_rate(self.cloud.egress_mb_s, "cloud.egress_mb_s")?;
        if self.units.layers == 0 || self.units.layers > MAX_LAYERS {
            return Err(SolverError::invalid("units.layers", format!("{} is not a layer count; use 1 to {MAX_LAYERS}", self.units.layers)));
        }
        let sizes = [("units.layer", Some(self.units.layer)), ("units.embed", self.units.embed), ("units.head", self.units.head)];
        for (f, pb) in sizes {
            if let Some(pb) = pb {
                if pb.model == 0 || pb.optimizer == 0 || pb.model > 1 << 50 || pb.optimizer > 1 << 50 {
                    return Err(SolverError::invalid(f, "model and optimizer bytes must be above 0 and at most 2^50"));
                }
            }
        }
        if self.nodes.is_empty() {
            return Err(SolverError::invalid("nodes", "is empty; list the nodes of the new plan and those holding shards"));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let f = format!("nodes[{i}]");
            if n.name.trim().is_empty() {
                return Err(SolverError::invalid(format!("{f}.name"), "is empty; name the node"));
            }
            if !seen.insert(n.name.as_str()) {
                return Err(SolverError::invalid(format!("{f}.name"), format!("'{}' is listed twice; give each node one entry", n.name)));
            }
            check_rate(n.nic_in_mb_s, &format!("{f}.nic_in_mb_s"))?;
            check_rate(n.nic_out(), &format!("{f}.nic_out_mb_s"))?;
            check_rate(n.disk_read_mb_s, &format!("{f}.disk_read_mb_s"))?;
            check_rate(n.mem_copy_mb_s, &format!("{f}.mem_copy_mb_s"))?;
        }
        if self.demands.is_empty() {
            return Err(SolverError::invalid("demands", "is empty; list what each node of the new plan must hold"));
        }
        if let Some(c) = self.chunk_bytes {
            if c == 0 {
                return Err(SolverError::invalid("chunk_bytes", "must be above 0; leave it out for 16 MiB"));
            }
        }
        Ok(())
    }

    /// The node's index, or an error naming `field`.
    pub fn node_index(&self, name: &str, field: &str) -> Result<usize> {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .ok_or_else(|| SolverError::invalid(field, format!("'{name}' is not in nodes; add it there (with its rates) or fix the name")))
    }
}
