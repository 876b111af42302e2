//! Passive measurement: the node's NICs' byte counters read each heartbeat interval, and the
//! rates achieved since the last reading (docs/network.md, "Measure (agents)").
//!
//! * every interface in `class/net` but `lo`: `statistics/tx_bytes` and `rx_bytes`, named by
//!   the interface, its kind that of the RDMA device it belongs to (RoCE, IPoIB) or `eth`;
//! * every port of every RDMA device in `class/infiniband` (`node::discover::rdma_ports`):
//!   `ports/P/counters/port_xmit_data` and `port_rcv_data`, which count 4-byte words, named
//!   `DEV:P`, its kind `ib` or `roce`. (A RoCE port's RDMA traffic shows here, not always in
//!   its interface's counters; the two are reported apart.)
//!
//! A rate is the counter's increase over the time between two readings; a counter that went
//! down (reset, wrapped, the device replaced) gives no rate that interval, nor does the first
//! reading of a NIC.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use motley_contract::cluster::NicKind;
use motley_proto::v1::NicRate;

use crate::node::discover::{netdev_kind, rdma_ports};

/// The kind as the agent protocol spells it (`LinkSample.nic_kind`, `NicRate.kind`).
pub fn kind_name(kind: NicKind) -> &'static str {
    match kind {
        NicKind::Ib => "ib",
        NicKind::Roce => "roce",
        NicKind::Ethernet => "eth",
    }
}

/// One NIC's counters at one moment, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reading {
    pub name: String,
    pub kind: &'static str,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

/// Every NIC's counters under `sysfs` now.
pub fn read(sysfs: &Path) -> Vec<Reading> {
    let ports = rdma_ports(sysfs);
    let mut out = vec![];
    let net = sysfs.join("class/net");
    for ifname in entries(&net) {
        if ifname == "lo" {
            continue;
        }
        let stats = net.join(&ifname).join("statistics");
        if let (Some(tx), Some(rx)) = (number(&stats.join("tx_bytes")), number(&stats.join("rx_bytes"))) {
            out.push(Reading { kind: kind_name(netdev_kind(&ports, &ifname)), name: ifname, tx_bytes: tx, rx_bytes: rx });
        }
    }
    for p in &ports {
        let counters = sysfs.join("class/infiniband").join(&p.device).join("ports").join(p.port.to_string()).join("counters");
        let words = |f: &str| number(&counters.join(f)).map(|w| w.saturating_mul(4));
        if let (Some(tx), Some(rx)) = (words("port_xmit_data"), words("port_rcv_data")) {
            out.push(Reading { name: format!("{}:{}", p.device, p.port), kind: kind_name(p.kind), tx_bytes: tx, rx_bytes: rx });
        }
    }
    out
}

/// The readings of the last interval, to take rates against.
#[derive(Debug)]
pub struct Counters {
    sysfs: PathBuf,
    last: HashMap<String, (Reading, Instant)>,
}

impl Counters {
    /// Counters under the sysfs root `sysfs` (`/sys`; tests give a fake tree).
    pub fn new(sysfs: &Path) -> Counters {
        Counters { sysfs: sysfs.to_path_buf(), last: HashMap::new() }
    }

    /// Reads every NIC's counters at `now` and gives the rates since the last reading, stamped
    /// `at_unix_ms`.
    pub fn sample(&mut self, now: Instant, at_unix_ms: i64) -> Vec<NicRate> {
        let readings = read(&self.sysfs);
        let mut rates = vec![];
        let mut last = HashMap::with_capacity(readings.len());
        for r in readings {
            if let Some((before, then)) = self.last.get(&r.name) {
                let secs = now.saturating_duration_since(*then).as_secs_f64();
                let (tx, rx) = (r.tx_bytes.checked_sub(before.tx_bytes), r.rx_bytes.checked_sub(before.rx_bytes));
                if let (Some(tx), Some(rx), true) = (tx, rx, secs > 0.0) {
                    rates.push(NicRate {
                        name: r.name.clone(),
                        kind: r.kind.to_string(),
                        tx_gb_per_s: tx as f64 / secs / 1e9,
                        rx_gb_per_s: rx as f64 / secs / 1e9,
                        at_unix_ms,
                    });
                }
            }
            last.insert(r.name.clone(), (r, now));
        }
        // NICs gone since are forgotten.
        self.last = last;
        rates
    }
}

fn number(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Tree {
            let root = std::env::temp_dir().join(format!("motley-counters-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            Tree(root)
        }
        fn file(&self, rel: &str, text: &str) {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        fn netdev(&self, name: &str, tx: u64, rx: u64) {
            self.file(&format!("class/net/{name}/statistics/tx_bytes"), &format!("{tx}\n"));
            self.file(&format!("class/net/{name}/statistics/rx_bytes"), &format!("{rx}\n"));
        }
        fn port(&self, dev: &str, port: u32, layer: &str, xmit_words: u64, rcv_words: u64) {
            let p = format!("class/infiniband/{dev}/ports/{port}");
            self.file(&format!("{p}/link_layer"), &format!("{layer}\n"));
            self.file(&format!("{p}/counters/port_xmit_data"), &format!("{xmit_words}\n"));
            self.file(&format!("{p}/counters/port_rcv_data"), &format!("{rcv_words}\n"));
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn by_name(rates: &[NicRate], name: &str) -> NicRate {
        rates.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("no rate for {name} in {rates:?}")).clone()
    }

    #[test]
    fn counter_rates_are_bytes_over_the_interval_with_each_nics_kind() {
        let t = Tree::new("rates");
        t.netdev("lo", 0, 0);
        t.netdev("eth0", 1_000, 2_000);
        // A RoCE device's interface is roce; an IPoIB one ib.
        t.netdev("ens1np0", 0, 0);
        t.netdev("ib0", 0, 0);
        t.port("mlx5_0", 1, "Ethernet", 100, 0);
        t.file("class/infiniband/mlx5_0/device/net/ens1np0/ifindex", "3\n");
        t.port("mlx5_1", 1, "InfiniBand", 0, 0);
        t.port("mlx5_1", 2, "InfiniBand", 0, 0);
        t.file("class/infiniband/mlx5_1/device/net/ib0/ifindex", "4\n");
        let mut c = Counters::new(&t.0);
        let t0 = Instant::now();
        // The first reading has nothing to compare with.
        assert_eq!(c.sample(t0, 1), vec![]);
        t.netdev("eth0", 1_000 + 3_000_000_000, 2_000 + 1_500_000_000);
        t.netdev("ens1np0", 500_000_000, 0);
        t.port("mlx5_0", 1, "Ethernet", 100 + 250_000_000, 0);
        // 2.5e9 words = 10 GB received on port 2 of the IB device.
        t.port("mlx5_1", 2, "InfiniBand", 0, 2_500_000_000);
        let rates = c.sample(t0 + Duration::from_secs(2), 2);
        let names: Vec<&str> = rates.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["ens1np0", "eth0", "ib0", "mlx5_0:1", "mlx5_1:1", "mlx5_1:2"], "loopback is left out");
        let eth0 = by_name(&rates, "eth0");
        assert_eq!((eth0.kind.as_str(), eth0.tx_gb_per_s, eth0.rx_gb_per_s, eth0.at_unix_ms), ("eth", 1.5, 0.75, 2));
        let roce = by_name(&rates, "ens1np0");
        assert_eq!((roce.kind.as_str(), roce.tx_gb_per_s), ("roce", 0.25));
        assert_eq!(by_name(&rates, "ib0").kind, "ib");
        // Words of 4 bytes: 250e6 words in 2 s = 0.5 GB/s.
        let port = by_name(&rates, "mlx5_0:1");
        assert_eq!((port.kind.as_str(), port.tx_gb_per_s, port.rx_gb_per_s), ("roce", 0.5, 0.0));
        let ib = by_name(&rates, "mlx5_1:2");
        assert_eq!((ib.kind.as_str(), ib.rx_gb_per_s), ("ib", 5.0));
    }

    #[test]
    fn a_counter_that_went_down_gives_no_rate_and_a_vanished_nic_is_forgotten() {
        let t = Tree::new("reset");
        t.netdev("eth0", 5_000, 5_000);
        t.netdev("eth1", 0, 0);
        let mut c = Counters::new(&t.0);
        let t0 = Instant::now();
        c.sample(t0, 0);
        t.netdev("eth0", 10, 6_000);
        t.netdev("eth1", 1_000_000_000, 0);
        let rates = c.sample(t0 + Duration::from_secs(1), 0);
        assert_eq!(rates.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["eth1"], "eth0's tx went down: no rate");
        // The next interval counts from the reset.
        t.netdev("eth0", 1_000_000_010, 6_000);
        std::fs::remove_dir_all(t.0.join("class/net/eth1")).unwrap();
        let rates = c.sample(t0 + Duration::from_secs(2), 0);
        assert_eq!(rates.len(), 1);
        assert_eq!((by_name(&rates, "eth0").tx_gb_per_s, by_name(&rates, "eth0").rx_gb_per_s), (1.0, 0.0));
        // No time between readings: no rate (never a division by zero).
        assert_eq!(c.sample(t0 + Duration::from_secs(2), 0), vec![]);
    }

    #[test]
    fn unreadable_or_garbled_counters_are_skipped() {
        let t = Tree::new("garbled");
        t.file("class/net/eth0/statistics/tx_bytes", "lots\n");
        t.file("class/net/eth0/statistics/rx_bytes", "1\n");
        t.file("class/net/eth1/statistics/tx_bytes", "1\n");
        t.port("mlx5_0", 1, "OPA", 1, 1);
        assert_eq!(read(&t.0), vec![]);
        assert_eq!(read(&t.0.join("absent")), vec![]);
    }
}
