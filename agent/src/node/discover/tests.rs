//! Discovery on fake sysfs trees built in a temporary directory, laid out as the kernel lays
//! out the real one (class entries linking into `devices/pci...`).

use super::*;
use std::os::unix::fs::symlink;

struct Tree(PathBuf);

impl Tree {
    fn new(name: &str) -> Tree {
        let root = std::env::temp_dir().join(format!("motley-sysfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        Tree(root)
    }
    fn file(&self, rel: &str, text: &str) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    /// A PCI device at `path` (below `devices/`) on NUMA node `numa`.
    fn pci(&self, path: &str, numa: i32) -> PathBuf {
        self.file(&format!("devices/{path}/numa_node"), &format!("{numa}\n"));
        self.0.join("devices").join(path)
    }
    fn link(&self, rel: &str, to: &Path) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        symlink(to, p).unwrap();
    }
    fn gpu(&self, bus: &str, path: &str, numa: i32) -> Gpu {
        let dev = self.pci(path, numa);
        self.link(&format!("bus/pci/devices/{bus}"), &dev);
        Gpu {
            name: "NVIDIA A100-SXM4-80GB".into(),
            memory_bytes: 80 << 30,
            pci_bus_id: Some(format!("0000{}", bus.to_uppercase())),
            nvlinks: Some(12),
        }
    }
    fn hca(&self, dev: &str, path: &str, numa: i32, port: u32, layer: &str, rate: &str) {
        let pci = self.pci(path, numa);
        self.link(&format!("class/infiniband/{dev}/device"), &pci);
        let p = format!("class/infiniband/{dev}/ports/{port}");
        self.file(&format!("{p}/link_layer"), &format!("{layer}\n"));
        self.file(&format!("{p}/rate"), &format!("{rate}\n"));
        self.file(&format!("{p}/state"), "4: ACTIVE\n");
    }
    fn netdev(&self, name: &str, device: Option<&Path>, speed: &str) {
        self.file(&format!("class/net/{name}/speed"), &format!("{speed}\n"));
        self.file(&format!("class/net/{name}/type"), "1\n");
        if let Some(d) = device {
            self.link(&format!("class/net/{name}/device"), d);
        }
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Two switches, each with two GPUs and one IB HCA; a RoCE HCA and an Ethernet NIC on the
/// root ports of NUMA node 1; plus what must be skipped.
fn dgx_like() -> (Tree, Vec<Gpu>) {
    let t = Tree::new("dgx");
    let sw = |s: u32, dev: &str| format!("pci0000:00/0000:00:0{s}.0/0000:1{s}:00.0/0000:2{s}:0{dev}.0/0000:3{s}:00.0");
    let gpus = vec![
        t.gpu("0000:31:00.0", &sw(1, "1"), 0),
        t.gpu("0000:41:00.0", &sw(1, "2").replace("0000:31:00.0", "0000:41:00.0"), 0),
        t.gpu("0000:32:00.0", &sw(2, "1"), 1),
        t.gpu("0000:42:00.0", &sw(2, "2").replace("0000:32:00.0", "0000:42:00.0"), 1),
    ];
    t.hca("mlx5_0", &sw(1, "3").replace("0000:31:00.0", "0000:51:00.0"), 0, 1, "InfiniBand", "200 Gb/sec (4X HDR)");
    t.hca("mlx5_1", &sw(2, "3").replace("0000:32:00.0", "0000:52:00.0"), 1, 1, "InfiniBand", "200 Gb/sec (4X HDR)");
    // RoCE on a root port of NUMA node 1, its netdev beside it; GID 1 is RoCE v1, 2 a
    // link-local v2, 3 the IPv4-mapped v2.
    t.hca("mlx5_2", "pci0000:80/0000:80:01.0/0000:81:00.0", 1, 1, "Ethernet", "100 Gb/sec (4X EDR)");
    t.file("class/infiniband/mlx5_2/device/net/ens1f0/x", "");
    let p = "class/infiniband/mlx5_2/ports/1";
    for (i, ty, gid) in [
        (1, "IB/RoCE v1", "fe80:0000:0000:0000:0000:0000:0000:0001"),
        (2, "RoCE v2", "fe80:0000:0000:0000:0000:0000:0000:0001"),
        (3, "RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:0001"),
        (4, "RoCE v2", "0000:0000:0000:0000:0000:0000:0000:0000"),
    ] {
        t.file(&format!("{p}/gid_attrs/types/{i}"), &format!("{ty}\n"));
        t.file(&format!("{p}/gids/{i}"), &format!("{gid}\n"));
    }
    let ens1f0 = t.0.join("devices/pci0000:80/0000:80:01.0/0000:81:00.0");
    t.netdev("ens1f0", Some(&ens1f0), "100000");
    let eth = t.pci("pci0000:80/0000:80:02.0/0000:82:00.0", 1);
    t.netdev("eno1", Some(&eth), "25000");
    t.netdev("lo", None, "-1");
    t.netdev("docker0", None, "10000"); // virtual: no device
    let down = t.pci("pci0000:80/0000:80:03.0/0000:83:00.0", 1);
    t.netdev("eno2", Some(&down), "-1"); // link down
    let ipoib = t.pci("pci0000:80/0000:80:04.0/0000:84:00.0", 1);
    t.netdev("ib9", Some(&ipoib), "100000");
    t.file("class/net/ib9/type", "32\n");
    // A down IB port is skipped.
    t.hca("mlx5_3", "pci0000:80/0000:80:05.0/0000:85:00.0", 1, 1, "InfiniBand", "200 Gb/sec (4X HDR)");
    t.file("class/infiniband/mlx5_3/ports/1/state", "1: DOWN\n");
    (t, gpus)
}

#[test]
fn kinds_rates_rails_and_gid_index_come_from_sysfs() {
    let (t, gpus) = dgx_like();
    let (d, checked) = discover("n0", &t.0, &gpus);
    checked.unwrap();
    let e = &d.entry;
    assert_eq!((e.gpu.as_str(), e.gpus, e.intra), ("A100-80G", 4, Some(IntraLink::Nvlink)));
    let by: BTreeMap<&str, &NicSpec> = e.nics.iter().map(|n| (n.name.as_str(), n)).collect();
    assert_eq!(by.keys().copied().collect::<Vec<_>>(), ["eno1", "mlx5_0", "mlx5_1", "mlx5_2"], "{:#?}\n{:?}", e.nics, d.notes);
    let ib0 = by["mlx5_0"];
    assert_eq!((ib0.kind, ib0.gbps, ib0.gpus.clone(), ib0.pcie_switch.as_deref()), (NicKind::Ib, 200.0, vec![0, 1], Some("0000:11:00.0")));
    assert_eq!((by["mlx5_1"].gpus.clone(), by["mlx5_1"].pcie_switch.as_deref()), (vec![2, 3], Some("0000:12:00.0")));
    let roce = by["mlx5_2"];
    assert_eq!((roce.kind, roce.gbps, roce.gid_index, roce.port), (NicKind::Roce, 100.0, Some(3), None));
    // No switch in common with a GPU: the GPUs of its NUMA node.
    assert_eq!((roce.gpus.clone(), roce.pcie_switch.clone()), (vec![2, 3], None));
    assert_eq!((by["eno1"].kind, by["eno1"].gbps), (NicKind::Ethernet, 25.0));
    assert!(d.notes.iter().any(|n| n.contains("eno2") && n.contains("speed unknown")), "{:?}", d.notes);
    assert!(d.notes.iter().any(|n| n.contains("mlx5_3") && n.contains("DOWN")), "{:?}", d.notes);
}

use std::collections::BTreeMap;

#[test]
fn no_gpu_or_an_unknown_one_names_the_inventory_flag() {
    let (t, mut gpus) = dgx_like();
    let (d, checked) = discover("n0", &t.0, &[]);
    assert_eq!(d.entry.gpus, 0);
    let e = checked.unwrap_err().to_string();
    assert!(e.contains("no GPU found") && e.contains("--inventory FILE"), "{e}");
    gpus[1].name = "NVIDIA H200".into();
    let e = discover("n0", &t.0, &gpus).1.unwrap_err().to_string();
    assert!(e.contains("different types") && e.contains("--inventory FILE"), "{e}");
    for g in &mut gpus {
        g.name = "NVIDIA L40S".into();
    }
    let e = discover("n0", &t.0, &gpus).1.unwrap_err().to_string();
    assert!(e.contains("'NVIDIA L40S' is not in the planner's catalogue"), "{e}");
}

#[test]
fn nvml_names_map_to_the_catalogue() {
    let gib = |g: u64| g << 30;
    for (name, mem, want) in [
        ("NVIDIA A100-SXM4-80GB", gib(80), Some("A100-80G")),
        ("NVIDIA A100-PCIE-40GB", gib(40), Some("A100-40G")),
        ("NVIDIA H100 80GB HBM3", gib(80), Some("H100")),
        ("NVIDIA H800", gib(80), Some("H800")),
        ("NVIDIA H20", gib(96), Some("H20")),
        ("NVIDIA H200", gib(140), Some("H200")),
        ("Tesla V100-SXM2-32GB", gib(32), Some("V100-32G")),
        ("Tesla V100-PCIE-16GB", gib(16), Some("V100-16G")),
        ("NVIDIA RTX A6000", gib(48), Some("A6000")),
        ("NVIDIA GeForce RTX 3090", gib(24), Some("RTX3090")),
        ("NVIDIA GeForce RTX 4090", gib(24), Some("RTX4090")),
        ("Tesla T4", gib(16), Some("T4")),
        ("NVIDIA L20", gib(48), Some("L20")),
        ("NVIDIA L40S", gib(48), None),
    ] {
        assert_eq!(catalog_gpu(name, mem), want, "{name}");
    }
}

#[test]
fn pcie_gpus_without_nvlink_are_pcie_and_unknown_links_are_left_to_the_planner() {
    let (t, mut gpus) = dgx_like();
    gpus[0].nvlinks = Some(0);
    assert_eq!(discover("n0", &t.0, &gpus).0.entry.intra, Some(IntraLink::Pcie));
    gpus[0].nvlinks = None;
    assert_eq!(discover("n0", &t.0, &gpus).0.entry.intra, None);
}

#[test]
fn an_ib_port_two_and_a_rate_from_the_netdev() {
    let t = Tree::new("port2");
    t.hca("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0", -1, 2, "InfiniBand", "400 Gb/sec (4X NDR)");
    t.hca("mlx5_1", "pci0000:00/0000:00:02.0/0000:02:00.0", -1, 1, "Ethernet", "garbage");
    t.file("class/infiniband/mlx5_1/device/net/ens2/x", "");
    let dev = t.0.join("devices/pci0000:00/0000:00:02.0/0000:02:00.0");
    t.netdev("ens2", Some(&dev), "25000");
    let gpu = t.gpu("0000:03:00.0", "pci0000:00/0000:00:03.0/0000:03:00.0", -1);
    let (d, checked) = discover("n1", &t.0, &[gpu]);
    checked.unwrap();
    let nics = &d.entry.nics;
    assert_eq!(nics.len(), 2, "{nics:#?}");
    assert_eq!((nics[0].name.as_str(), nics[0].port, nics[0].gbps), ("mlx5_0", Some(2), 400.0));
    // RoCE rate from the netdev; no GID table: the planner's default applies; NUMA unknown.
    assert_eq!((nics[1].kind, nics[1].gbps, nics[1].gid_index, nics[1].gpus.len()), (NicKind::Roce, 25.0, None, 0));
    assert_eq!(d.entry.intra, None, "one GPU: nothing to say");
}
