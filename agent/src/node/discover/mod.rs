//! What hardware this node has, as a cluster-file node entry (the same schema `--inventory FILE`
//! takes): GPUs from NVML (`nvml.rs`), NICs from sysfs under a root the caller chooses (`/sys`
//! in production, a fake tree in tests).
//!
//! NICs:
//! * every port of every RDMA device in `class/infiniband/DEV/ports/P` whose state is ACTIVE
//!   (ports with no `state` file are taken): `link_layer` InfiniBand -> `ib`, Ethernet ->
//!   `roce`; the rate from the port's `rate` ("100 Gb/sec (4X EDR)"), else from the speed of
//!   the HCA's netdev (`DEV/device/net/*`); for RoCE the GID index is the lowest one whose type
//!   is "RoCE v2" and whose GID is IPv4-mapped (else any non-zero RoCE v2 GID; else left out,
//!   so the planner's default 3 applies).
//! * every netdev in `class/net` with a `device` link (so not `lo`, bridges, veths, bonds) of
//!   type 1 (Ethernet; IPoIB is type 32) that does not belong to an RDMA device (a RoCE port is
//!   listed once, as `roce`): `ethernet` at `speed` Mb/s / 1000. A netdev whose speed is
//!   unknown (-1, unreadable: the link is down) is skipped with a note.
//!
//! Which GPUs are close: a NIC's `gpus` (its rail) are the GPUs behind the same PCIe switch,
//! from the canonical PCI paths (`devices/pci0000:00/ROOT_PORT/SWITCH_UP/...`): two devices
//! share a switch when both sit at least two bridges below the root port and their paths agree
//! down to the switch's upstream port, which also names the NIC's `pcie_switch`. When no GPU
//! shares the NIC's switch, the GPUs on the NIC's NUMA node are taken instead, unless every GPU
//! is on it (that says nothing) or NUMA is unknown (-1).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use motley_contract::cluster::{gpu_catalog, ClusterSpec, IntraLink, NicKind, NicSpec, NodeSpec};

use crate::error::{AgentError, Result};

/// One GPU as NVML reports it (index = NVML's index, PCI bus order).
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    /// NVML's product name, e.g. "NVIDIA A100-SXM4-80GB".
    pub name: String,
    pub memory_bytes: u64,
    /// NVML's PCI bus id ("00000000:3B:00.0"); None when NVML did not give it.
    pub pci_bus_id: Option<String>,
    /// Active NVLinks; None when NVML cannot tell (not supported or an error).
    pub nvlinks: Option<u32>,
}

/// A discovery's result: the entry and what the operator should know about how it was made.
#[derive(Debug, Clone)]
pub struct Discovered {
    pub entry: NodeSpec,
    pub notes: Vec<String>,
}

/// The solver's catalogue name for an NVML product name, when there is one. Matched on whole
/// words of the name (so H200 is not H20), memory telling the A100 and V100 sizes apart.
pub fn catalog_gpu(nvml_name: &str, memory_bytes: u64) -> Option<&'static str> {
    let upper = nvml_name.to_ascii_uppercase();
    let words: Vec<&str> = upper.split([' ', '-', '_']).filter(|w| !w.is_empty()).collect();
    let has = |w: &str| words.contains(&w);
    let gib = memory_bytes as f64 / (1u64 << 30) as f64;
    Some(match () {
        _ if has("A100") => {
            if gib > 60.0 {
                "A100-80G"
            } else {
                "A100-40G"
            }
        }
        _ if has("H100") => "H100",
        _ if has("H200") => "H200",
        _ if has("H800") => "H800",
        _ if has("H20") => "H20",
        _ if has("V100") || has("V100S") => {
            if gib > 20.0 {
                "V100-32G"
            } else {
                "V100-16G"
            }
        }
        _ if has("A6000") => "A6000",
        _ if has("A30") => "A30",
        _ if has("3090") => "RTX3090",
        _ if has("A4000") => "A4000",
        _ if has("L20") => "L20",
        _ if has("4090") => "RTX4090",
        _ if has("T4") => "T4",
        _ if has("P100") => "P100",
        _ => return None,
    })
}

/// Discover this node's entry and check it as the coordinator will (`ClusterSpec::check`): a
/// node the coordinator would refuse (no GPU, an unknown or mixed GPU type) is an error that
/// names the way out, `--inventory FILE`; `motley-agent discover` still prints what it saw.
pub fn discover(node: &str, sysfs: &Path, gpus: &[Gpu]) -> (Discovered, Result<()>) {
    let mut notes = vec![];
    let nics = nics(sysfs, gpus, &mut notes);
    let mut problem = None;
    let gpu_name = match gpus.first() {
        None => {
            problem = Some("no GPU found (NVML reported none); the coordinator takes only nodes with at least one GPU".to_string());
            String::new()
        }
        Some(first) => {
            let names: BTreeSet<&str> = gpus.iter().map(|g| g.name.as_str()).collect();
            if names.len() > 1 {
                problem = Some(format!("GPUs of different types in one node ({}); a node entry has one gpu type", join(&names)));
            }
            match catalog_gpu(&first.name, first.memory_bytes) {
                Some(c) => c.to_string(),
                None => {
                    problem.get_or_insert(format!("GPU '{}' is not in the planner's catalogue", first.name));
                    first.name.clone()
                }
            }
        }
    };
    let entry = NodeSpec {
        name: node.to_string(),
        count: None,
        intra: intra(&gpu_name, gpus),
        gpu: gpu_name,
        gpus: gpus.len() as u32,
        nics,
        rdma_domain: None,
        spot: false,
        price_per_gpu_hour: None,
        pcie_switch_gbit: None,
        emulate: None,
    };
    let checked = match problem {
        Some(p) => Err(AgentError::Discovery(p)),
        None => ClusterSpec { name: "discovered".into(), nodes: vec![entry.clone()], gpu_types: vec![] }
            .check()
            .map(|_| ())
            .map_err(|e| AgentError::Discovery(e.to_string().replace("nodes[0]", "node"))),
    };
    (Discovered { entry, notes }, checked)
}

fn join(names: &BTreeSet<&str>) -> String {
    names.iter().copied().collect::<Vec<_>>().join(", ")
}

/// NVLink when every GPU has an active link and the GPU type has NVLink at all; PCIe when NVML
/// answered for every GPU and one has none; otherwise left to the planner's default by type.
fn intra(gpu: &str, gpus: &[Gpu]) -> Option<IntraLink> {
    if gpus.len() < 2 || gpus.iter().any(|g| g.nvlinks.is_none()) {
        return None;
    }
    let type_has_nvlink = gpu_catalog().iter().any(|t| t.name == gpu && t.nvlink_gbps > 0.0);
    Some(if type_has_nvlink && gpus.iter().all(|g| g.nvlinks > Some(0)) { IntraLink::Nvlink } else { IntraLink::Pcie })
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// A PCI device's place in the tree: the components of its canonical path below `devices/`.
#[derive(Debug, Clone)]
struct PciPlace {
    path: Vec<String>,
    numa: Option<i64>,
}

impl PciPlace {
    fn of(link: &Path) -> Option<PciPlace> {
        let real = std::fs::canonicalize(link).ok()?;
        let comps: Vec<String> = real.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
        let root = comps.iter().position(|c| c.starts_with("pci"))?;
        let numa = read(&real.join("numa_node")).and_then(|s| s.parse::<i64>().ok()).filter(|&n| n >= 0);
        Some(PciPlace { path: comps[root..].to_vec(), numa })
    }

    /// The upstream port of the PCIe switch the device sits behind (`pciDDDD:BB`, root port,
    /// switch upstream port, switch downstream port, device: five components at least).
    fn switch(&self) -> Option<&str> {
        (self.path.len() >= 5).then(|| self.path[2].as_str())
    }
}

/// The sysfs name of an NVML bus id: NVML pads the domain to 8 hex digits, sysfs to 4.
fn sysfs_bus_id(nvml: &str) -> String {
    let lower = nvml.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => lower,
    }
}

/// "100 Gb/sec (4X EDR)" -> 100.
fn parse_rate(s: &str) -> Option<f64> {
    s.split_whitespace().next()?.parse::<f64>().ok().filter(|r| *r > 0.0)
}

/// A netdev's `speed` (Mb/s) in Gbit/s; None when unknown (-1, or unreadable while down).
fn netdev_gbps(net: &Path) -> Option<f64> {
    read(&net.join("speed"))?.parse::<f64>().ok().filter(|s| *s > 0.0).map(|s| s / 1000.0)
}

fn roce_gid_index(port: &Path) -> Option<u32> {
    let mut v2 = vec![];
    for idx in entries(&port.join("gid_attrs/types")) {
        let is_v2 = read(&port.join("gid_attrs/types").join(&idx)).is_some_and(|t| t.eq_ignore_ascii_case("RoCE v2"));
        let gid = read(&port.join("gids").join(&idx)).unwrap_or_default();
        let zero = gid.chars().all(|c| c == '0' || c == ':');
        if let (true, false, Ok(i)) = (is_v2, zero, idx.parse::<u32>()) {
            v2.push((!gid.starts_with("0000:0000:0000:0000:0000:ffff:"), i));
        }
    }
    // IPv4-mapped first (what NCCL on a routed RoCEv2 fabric wants), then the lowest index.
    v2.into_iter().min().map(|(_, i)| i)
}

/// An RDMA port's kind from its `link_layer`: InfiniBand -> ib, Ethernet -> roce; else the
/// layer it names.
fn port_kind(port: &Path) -> std::result::Result<NicKind, String> {
    match read(&port.join("link_layer")).unwrap_or_default().as_str() {
        "InfiniBand" => Ok(NicKind::Ib),
        "Ethernet" => Ok(NicKind::Roce),
        other => Err(other.to_string()),
    }
}

/// One port of an RDMA device, whatever its state: its kind and the device's netdevs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaPort {
    /// The device (`class/infiniband/DEV`).
    pub device: String,
    pub port: u32,
    pub kind: NicKind,
    /// The device's netdevs (`DEV/device/net/*`): the RoCE interface, or IPoIB's.
    pub netdevs: Vec<String>,
}

/// Every port of every RDMA device sysfs shows whose link layer is InfiniBand or Ethernet, as
/// the node's NICs are classified (`nics`), active or not.
pub fn rdma_ports(sysfs: &Path) -> Vec<RdmaPort> {
    let ib = sysfs.join("class/infiniband");
    let mut out = vec![];
    for dev in entries(&ib) {
        let d = ib.join(&dev);
        let netdevs = entries(&d.join("device/net"));
        for p in entries(&d.join("ports")) {
            let (Ok(port), Ok(kind)) = (p.parse::<u32>(), port_kind(&d.join("ports").join(&p))) else { continue };
            out.push(RdmaPort { device: dev.clone(), port, kind, netdevs: netdevs.clone() });
        }
    }
    out
}

/// The kind of the interface `netdev` as the planner names NICs: that of its RDMA device's
/// first port when it belongs to one (RoCE, IPoIB), else Ethernet.
pub fn netdev_kind(ports: &[RdmaPort], netdev: &str) -> NicKind {
    ports.iter().find(|p| p.netdevs.iter().any(|n| n == netdev)).map_or(NicKind::Ethernet, |p| p.kind)
}

/// Every NIC sysfs shows, with the GPUs close to it.
fn nics(sysfs: &Path, gpus: &[Gpu], notes: &mut Vec<String>) -> Vec<NicSpec> {
    let gpu_places: Vec<Option<PciPlace>> = gpus
        .iter()
        .map(|g| g.pci_bus_id.as_deref().and_then(|id| PciPlace::of(&sysfs.join("bus/pci/devices").join(sysfs_bus_id(id)))))
        .collect();
    let mut out = vec![];
    let mut hca_netdevs = BTreeSet::new();
    let ib = sysfs.join("class/infiniband");
    for dev in entries(&ib) {
        let d = ib.join(&dev);
        let netdevs = entries(&d.join("device/net"));
        hca_netdevs.extend(netdevs.iter().cloned());
        for p in entries(&d.join("ports")) {
            let port = d.join("ports").join(&p);
            let Ok(port_no) = p.parse::<u32>() else { continue };
            if let Some(state) = read(&port.join("state")) {
                if !state.contains("ACTIVE") {
                    notes.push(format!("{dev} port {p}: skipped, state {state}"));
                    continue;
                }
            }
            let kind = match port_kind(&port) {
                Ok(kind) => kind,
                Err(other) => {
                    notes.push(format!("{dev} port {p}: skipped, link layer '{other}'"));
                    continue;
                }
            };
            let gbps = read(&port.join("rate"))
                .and_then(|r| parse_rate(&r))
                .or_else(|| netdevs.iter().find_map(|n| netdev_gbps(&sysfs.join("class/net").join(n))));
            let Some(gbps) = gbps else {
                notes.push(format!("{dev} port {p}: skipped, rate unknown"));
                continue;
            };
            let mut nic = NicSpec::new(&dev, kind, gbps);
            nic.port = (port_no != 1).then_some(port_no);
            if kind == NicKind::Roce {
                nic.gid_index = roce_gid_index(&port);
            }
            place(&mut nic, PciPlace::of(&d.join("device")), &gpu_places);
            out.push(nic);
        }
    }
    let net = sysfs.join("class/net");
    for ifname in entries(&net) {
        let n = net.join(&ifname);
        // Virtual interfaces (lo, bridges, veths, bonds, tunnels) have no device behind them.
        if ifname == "lo" || !n.join("device").exists() || hca_netdevs.contains(&ifname) {
            continue;
        }
        if read(&n.join("type")).is_some_and(|t| t != "1") {
            continue; // not Ethernet (IPoIB is 32; its HCA is listed above)
        }
        let Some(gbps) = netdev_gbps(&n) else {
            notes.push(format!("{ifname}: skipped, speed unknown (link down?)"));
            continue;
        };
        let mut nic = NicSpec::new(&ifname, NicKind::Ethernet, gbps);
        place(&mut nic, PciPlace::of(&n.join("device")), &gpu_places);
        out.push(nic);
    }
    out
}

/// The NIC's rail (`gpus`) and `pcie_switch`, see the module comment.
fn place(nic: &mut NicSpec, at: Option<PciPlace>, gpus: &[Option<PciPlace>]) {
    let Some(at) = at else { return };
    if let Some(sw) = at.switch() {
        nic.pcie_switch = Some(sw.to_string());
        nic.gpus = (0..gpus.len() as u32)
            .filter(|&i| gpus[i as usize].as_ref().is_some_and(|g| g.switch().is_some() && g.path[..3] == at.path[..3]))
            .collect();
    }
    if nic.gpus.is_empty() {
        if let Some(numa) = at.numa {
            let near: Vec<u32> =
                (0..gpus.len() as u32).filter(|&i| gpus[i as usize].as_ref().is_some_and(|g| g.numa == Some(numa))).collect();
            if near.len() < gpus.len() {
                nic.gpus = near;
            }
        }
    }
}

/// The entry as a cluster file would be written: fields left unset (null) are left out.
pub fn entry_value(entry: &NodeSpec) -> serde_json::Value {
    let mut v = serde_json::to_value(entry).expect("a node entry serialises");
    if let Some(m) = v.as_object_mut() {
        m.retain(|_, x| !x.is_null());
    }
    v
}

/// The sysfs root discovery reads (tests point it at a fake tree).
pub fn default_sysfs() -> PathBuf {
    PathBuf::from("/sys")
}

#[cfg(test)]
mod tests;
