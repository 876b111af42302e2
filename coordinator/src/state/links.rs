//! The live link matrix (docs/network.md): what agents measured of the links between nodes,
//! per (node, node, NIC kind), with a short history, and the NICs' achieved rates. In memory
//! only: agents measure again and report in their heartbeats, so a new leader rebuilds it
//! within a few probe periods (docs/state.md). The agents' sessions (`service::agent`) write
//! here; planning, the job's life (`life::network`) and the APIs read.
//!
//! A probe shares its link with training's traffic, and a link's capacity is what matters to
//! the planner: contention only ever lowers a probe's reading. So a link's estimate is the
//! highest of its last `ESTIMATE_SAMPLES` samples, and a change is a change of that estimate.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use motley_solver::bandwidth::{BandwidthSpec, PairSpec};
use serde::Serialize;

/// Samples kept per link (older ones drop out, as do samples older than the history's age).
pub const HISTORY_SAMPLES: usize = 64;
/// The estimate is the best of this many newest samples.
pub const ESTIMATE_SAMPLES: usize = 3;
/// Samples older than this many base intervals drop out of the history (10 minutes at the
/// default 1 s interval): a link no launch uses any more ages out.
pub const HISTORY_INTERVALS: u32 = 600;
/// NICs kept per node.
pub const MAX_NICS_PER_NODE: usize = 64;

/// A link: two nodes (`a` < `b`) and the kind of NIC between them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, utoipa::ToSchema)]
pub struct LinkKey {
    pub a: String,
    pub b: String,
    pub nic_kind: String,
}

impl LinkKey {
    /// The link between `x` and `y` over `nic_kind`, in either order.
    pub fn new(x: &str, y: &str, nic_kind: &str) -> LinkKey {
        let (a, b) = if x <= y { (x, y) } else { (y, x) };
        LinkKey { a: a.to_string(), b: b.to_string(), nic_kind: nic_kind.to_string() }
    }
}

impl std::fmt::Display for LinkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{} ({})", self.a, self.b, self.nic_kind)
    }
}

/// One probe's result, as the measuring node reported it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Sample {
    pub at_unix_ms: i64,
    pub gb_per_s: f64,
    pub latency_ms: f64,
}

/// A link as `motley net show` and the planner see it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct LinkView {
    #[serde(flatten)]
    pub key: LinkKey,
    /// The estimate: the best of the newest `ESTIMATE_SAMPLES` samples (GB/s).
    pub gb_per_s: f64,
    /// The lowest round trip among those samples (ms).
    pub latency_ms: f64,
    pub samples: usize,
    pub updated_unix_ms: i64,
    /// Oldest first.
    pub history: Vec<Sample>,
}

/// A NIC's achieved rates from its byte counters.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct NicView {
    pub node: String,
    pub name: String,
    pub kind: String,
    pub tx_gb_per_s: f64,
    pub rx_gb_per_s: f64,
    pub at_unix_ms: i64,
}

/// The live link matrix.
pub struct Links {
    max_age_ms: i64,
    links: Mutex<BTreeMap<LinkKey, VecDeque<Sample>>>,
    nics: Mutex<BTreeMap<(String, String), NicView>>,
}

impl Links {
    /// A matrix whose history reaches `HISTORY_INTERVALS` base intervals back.
    pub fn new(base: Duration) -> Links {
        Links { max_age_ms: (base * HISTORY_INTERVALS).as_millis() as i64, links: Mutex::default(), nics: Mutex::default() }
    }

    /// `node` measured its link to `peer`. Nonsense (not finite, not positive, a node paired
    /// with itself) is dropped: an agent's report is not trusted to be sane.
    pub fn record(&self, node: &str, peer: &str, nic_kind: &str, sample: Sample) {
        if node == peer || !(sample.gb_per_s.is_finite() && sample.gb_per_s > 0.0) || !sample.latency_ms.is_finite() {
            return;
        }
        let key = LinkKey::new(node, peer, nic_kind);
        let mut links = self.links.lock().expect("links");
        let history = links.entry(key).or_default();
        // In time order: a late report from the other end goes where it belongs.
        let at = history.iter().rposition(|s| s.at_unix_ms <= sample.at_unix_ms).map_or(0, |i| i + 1);
        history.insert(at, sample);
        while history.len() > HISTORY_SAMPLES {
            history.pop_front();
        }
        let oldest = sample.at_unix_ms.max(history.back().map_or(0, |s| s.at_unix_ms)) - self.max_age_ms;
        while history.front().is_some_and(|s| s.at_unix_ms < oldest) {
            history.pop_front();
        }
    }

    /// `node`'s NIC's achieved rates. A node's NICs beyond `MAX_NICS_PER_NODE` names are
    /// dropped: an agent cannot grow the matrix (or the metrics' labels) without bound.
    pub fn record_nic(&self, nic: NicView) {
        let mut nics = self.nics.lock().expect("nics");
        let key = (nic.node.clone(), nic.name.clone());
        if !nics.contains_key(&key) && nics.keys().filter(|(n, _)| *n == nic.node).count() >= MAX_NICS_PER_NODE {
            return;
        }
        nics.insert(key, nic);
    }

    /// Drop what is older than the history's age at `now_ms`: the links no launch probes any
    /// more and the NICs of agents that went away (the leader calls it every interval).
    pub fn forget_before(&self, now_ms: i64) {
        let oldest = now_ms - self.max_age_ms;
        let mut links = self.links.lock().expect("links");
        for history in links.values_mut() {
            while history.front().is_some_and(|s| s.at_unix_ms < oldest) {
                history.pop_front();
            }
        }
        links.retain(|_, h| !h.is_empty());
        self.nics.lock().expect("nics").retain(|_, n| n.at_unix_ms >= oldest);
    }

    /// Every link (of `node`, if given) with its estimate and history, in key order.
    pub fn links(&self, node: Option<&str>) -> Vec<LinkView> {
        let links = self.links.lock().expect("links");
        links.iter().filter(|(k, h)| !h.is_empty() && node.is_none_or(|n| k.a == n || k.b == n)).map(|(k, h)| view(k, h)).collect()
    }

    /// One link's view, if it was measured.
    pub fn link(&self, key: &LinkKey) -> Option<LinkView> {
        let links = self.links.lock().expect("links");
        links.get(key).filter(|h| !h.is_empty()).map(|h| view(key, h))
    }

    /// The estimate between two nodes: the slowest NIC kind measured between them (a plan's
    /// flows between them take whatever path they are given; the slowest is the safe price).
    pub fn between(&self, x: &str, y: &str) -> Option<LinkView> {
        let (a, b) = if x <= y { (x, y) } else { (y, x) };
        let links = self.links.lock().expect("links");
        // Keys sort by (a, b, kind): the pair's kinds are one range.
        let from = LinkKey { a: a.to_string(), b: b.to_string(), nic_kind: String::new() };
        links
            .range(from..)
            .take_while(|(k, _)| k.a == a && k.b == b)
            .filter(|(_, h)| !h.is_empty())
            .map(|(k, h)| view(k, h))
            .min_by(|p, q| p.gb_per_s.total_cmp(&q.gb_per_s))
    }

    /// NICs (of `node`, if given), by node then name.
    pub fn nics(&self, node: Option<&str>) -> Vec<NicView> {
        let nics = self.nics.lock().expect("nics");
        nics.values().filter(|n| node.is_none_or(|x| n.node == x)).cloned().collect()
    }

    /// The measured links among `nodes`, in the `--bandwidth` file's schema (pairs), for the
    /// planner (`Cluster::with_measurements`); None when none of them was measured.
    pub fn bandwidth_spec(&self, nodes: &[String]) -> Option<BandwidthSpec> {
        let wanted: std::collections::HashSet<&str> = nodes.iter().map(String::as_str).collect();
        // One pass: per pair, its slowest kind's estimate.
        let mut slowest: BTreeMap<(&str, &str), f64> = BTreeMap::new();
        let links = self.links.lock().expect("links");
        for (k, h) in links.iter() {
            if h.is_empty() || !wanted.contains(k.a.as_str()) || !wanted.contains(k.b.as_str()) {
                continue;
            }
            let v = estimate(h);
            let e = slowest.entry((k.a.as_str(), k.b.as_str())).or_insert(v);
            *e = e.min(v);
        }
        let pairs: Vec<PairSpec> =
            slowest.into_iter().map(|((a, b), gb_per_s)| PairSpec { a: a.to_string(), b: b.to_string(), gb_per_s }).collect();
        (!pairs.is_empty()).then(|| BandwidthSpec { pairs, ..BandwidthSpec::default() })
    }
}

/// A history's estimate: the best of its newest `ESTIMATE_SAMPLES` samples.
fn estimate(history: &VecDeque<Sample>) -> f64 {
    history.iter().rev().take(ESTIMATE_SAMPLES).map(|s| s.gb_per_s).fold(0.0, f64::max)
}

fn view(key: &LinkKey, history: &VecDeque<Sample>) -> LinkView {
    let gb_per_s = estimate(history);
    let latency_ms = history.iter().rev().take(ESTIMATE_SAMPLES).map(|s| s.latency_ms).fold(f64::INFINITY, f64::min);
    LinkView {
        key: key.clone(),
        gb_per_s,
        latency_ms,
        samples: history.len(),
        updated_unix_ms: history.back().map_or(0, |s| s.at_unix_ms),
        history: history.iter().copied().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(at: i64, gb: f64) -> Sample {
        Sample { at_unix_ms: at, gb_per_s: gb, latency_ms: 0.5 }
    }

    #[test]
    fn a_link_is_one_whichever_end_measured_it_and_its_estimate_is_the_best_of_the_newest() {
        let l = Links::new(Duration::from_secs(1));
        l.record("n1", "n0", "eth", s(1000, 1.0));
        l.record("n0", "n1", "eth", s(3000, 0.4));
        l.record("n1", "n0", "eth", s(2000, 0.6)); // late: goes between
        l.record("n0", "n1", "eth", s(4000, 0.5));
        let all = l.links(None);
        assert_eq!(all.len(), 1);
        let v = &all[0];
        assert_eq!(v.key, LinkKey::new("n0", "n1", "eth"));
        let at: Vec<i64> = v.history.iter().map(|s| s.at_unix_ms).collect();
        assert_eq!(at, [1000, 2000, 3000, 4000]);
        // The newest three are 0.6, 0.4, 0.5: the estimate is 0.6, not the old 1.0.
        assert_eq!(v.gb_per_s, 0.6);
        assert_eq!(v.updated_unix_ms, 4000);
        assert_eq!(l.between("n1", "n0").map(|v| v.gb_per_s), Some(0.6));
        assert!(l.links(Some("n2")).is_empty());
    }

    #[test]
    fn nonsense_is_dropped_and_old_samples_age_out() {
        let l = Links::new(Duration::from_millis(10)); // history: 6 s
        l.record("n0", "n0", "eth", s(1, 1.0));
        l.record("n0", "n1", "eth", s(1, f64::NAN));
        l.record("n0", "n1", "eth", s(1, -1.0));
        assert!(l.links(None).is_empty());
        l.record("n0", "n1", "eth", s(1_000, 1.0));
        l.record("n0", "n1", "eth", s(10_000, 2.0));
        let v = l.link(&LinkKey::new("n0", "n1", "eth")).expect("measured");
        assert_eq!(v.samples, 1);
        assert_eq!(v.gb_per_s, 2.0);
        for i in 0..(HISTORY_SAMPLES as i64 + 5) {
            l.record("n0", "n1", "eth", s(10_000 + i, 1.0));
        }
        assert_eq!(l.link(&LinkKey::new("n0", "n1", "eth")).expect("measured").samples, HISTORY_SAMPLES);
        l.record_nic(NicView {
            node: "n0".into(),
            name: "eth0".into(),
            kind: "eth".into(),
            tx_gb_per_s: 0.1,
            rx_gb_per_s: 0.1,
            at_unix_ms: 10_000,
        });
        l.forget_before(10_000 + 6_000);
        assert_eq!(l.nics(None).len(), 1);
        l.forget_before(20_000 + 6_000);
        assert!(l.links(None).is_empty() && l.nics(None).is_empty());
    }

    #[test]
    fn the_planner_gets_the_slowest_kind_between_each_pair_in_the_bandwidth_files_schema() {
        let l = Links::new(Duration::from_secs(1));
        l.record("a", "b", "ib", s(1, 20.0));
        l.record("a", "b", "eth", s(1, 2.0));
        l.record("b", "c", "eth", s(1, 1.5));
        let spec = l.bandwidth_spec(&["a".into(), "b".into(), "c".into()]).expect("measured");
        assert_eq!(
            spec.pairs,
            vec![PairSpec { a: "a".into(), b: "b".into(), gb_per_s: 2.0 }, PairSpec { a: "b".into(), b: "c".into(), gb_per_s: 1.5 }]
        );
        assert!(l.bandwidth_spec(&["a".into(), "x".into()]).is_none());
    }
}
