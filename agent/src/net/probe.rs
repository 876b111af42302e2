//! Active measurement: short probes over the data plane to the peers the running launches name
//! (`Meter::peers`), one at a time, round-robin, paced so that probing holds at most `duty` of
//! this agent's time on the wire (docs/network.md, "Measure (agents)").
//!
//! The bound: a probe is sized to take about `target` at the link's last measured rate
//! (between `MIN_PROBE_BYTES` and `dataplane::MAX_PROBE_BYTES`; `MIN_PROBE_BYTES` when the link
//! has no rate yet), and after a probe that took `d` no next probe starts, to any peer, before
//! `d * (1/duty - 1)` has passed. So from each probe's start to the next one's at least
//! `d / duty` passes, of which the probe held the wire `d`: over any stretch of time, probes
//! of this agent are on the wire at most `duty` of it (plus the one under way). A probe that
//! failed before any payload byte arrived (refused, unreachable, no key yet) moved almost
//! nothing and is charged `min(d, target)` instead, so a dead peer does not stall the others'
//! probes for long.

use std::collections::HashMap;
use std::future::Future;
#[cfg(test)]
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use motley_proto::v1::LinkSample;
use tokio::time::Instant;

use super::counters::kind_name;
use super::{Meter, PeerPlane};
use crate::checkpoints::dataplane::{ClientTls, DataKey, Measured, Probe, ProbeFailed, MAX_PROBE_BYTES};
use crate::node::discover::{netdev_kind, rdma_ports};

/// The smallest probe: enough for a rate that is not all round trip.
pub const MIN_PROBE_BYTES: u64 = 64 << 10;
/// How long a probe waits to connect, and for each read, before it fails.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// With no peer to probe, how often the peers are looked at again (also on every launch).
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// How much probing: the share of time on the wire and each probe's target duration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pacing {
    /// In (0, 1]; 0 (or anything not above 0) disables probing.
    pub duty: f64,
    pub target: Duration,
}

impl Default for Pacing {
    fn default() -> Pacing {
        Pacing { duty: 0.01, target: Duration::from_millis(50) }
    }
}

impl Pacing {
    pub fn enabled(&self) -> bool {
        self.duty > 0.0 && self.duty.is_finite()
    }

    /// The bytes of a probe of a link last measured at `rate_bytes_s`.
    pub fn size(&self, rate_bytes_s: Option<f64>) -> u64 {
        match rate_bytes_s.filter(|r| r.is_finite() && *r > 0.0) {
            Some(rate) => ((rate * self.target.as_secs_f64()) as u64).clamp(MIN_PROBE_BYTES, MAX_PROBE_BYTES),
            None => MIN_PROBE_BYTES,
        }
    }

    /// The time a probe that took `took` counts for: all of it, but at most `target` when it
    /// moved no payload byte.
    pub fn charge(&self, took: Duration, moved: u64) -> Duration {
        if moved == 0 {
            took.min(self.target)
        } else {
            took
        }
    }

    /// The wait after a probe charged `charge` before the next may start.
    pub fn gap(&self, charge: Duration) -> Duration {
        if !self.enabled() {
            return Duration::MAX;
        }
        charge.mul_f64(1.0 / self.duty.min(1.0) - 1.0)
    }
}

/// Which peer is next: the one after the last probed, by node name, round and round.
#[derive(Debug, Default)]
struct Rotation {
    last: Option<String>,
}

impl Rotation {
    fn next<'a>(&mut self, peers: &'a [PeerPlane]) -> Option<&'a PeerPlane> {
        let next = match &self.last {
            Some(last) => peers.iter().find(|p| p.node > *last).or(peers.first()),
            None => peers.first(),
        }?;
        self.last = Some(next.node.clone());
        Some(next)
    }
}

/// A successful probe: what it measured and the kind of NIC it crossed here.
#[derive(Clone, Debug, PartialEq)]
pub struct Probed {
    pub measured: Measured,
    pub nic_kind: &'static str,
}

/// Probes the meter's peers for ever with `probe` (the data plane in production, a fake in
/// tests), paced by `pacing`; each success becomes a `LinkSample` in the meter. `running`
/// says which launches still have ranks here: launches that have none are forgotten first.
pub async fn probe_loop<P, F>(meter: &Meter, pacing: Pacing, running: impl Fn() -> std::collections::BTreeSet<(i64, i64)>, mut probe: P)
where
    P: FnMut(&PeerPlane, u64) -> F,
    F: Future<Output = Result<Probed, ProbeFailed>>,
{
    if !pacing.enabled() {
        return std::future::pending().await;
    }
    let mut rotation = Rotation::default();
    let mut rates: HashMap<String, f64> = HashMap::new();
    loop {
        meter.retain_running(&running());
        let peers = meter.peers();
        rates.retain(|node, _| peers.iter().any(|p| p.node == *node));
        let Some(peer) = rotation.next(&peers) else {
            let _ = tokio::time::timeout(IDLE_CHECK, meter.peers_changed()).await;
            continue;
        };
        let bytes = pacing.size(rates.get(&peer.node).copied());
        let start = Instant::now();
        let result = probe(peer, bytes).await;
        let took = start.elapsed();
        let charge = match result {
            Ok(Probed { measured, nic_kind }) => {
                if let Some(rate) = measured.rate_bytes_s {
                    rates.insert(peer.node.clone(), rate);
                }
                meter.push_link(LinkSample {
                    peer: peer.node.clone(),
                    nic_kind: nic_kind.to_string(),
                    gb_per_s: measured.rate_bytes_s.unwrap_or(0.0) / 1e9,
                    latency_ms: measured.latency.as_secs_f64() * 1e3,
                    at_unix_ms: super::now_unix_ms(),
                });
                took
            }
            Err(failed) => {
                tracing::debug!(peer = %peer.node, "{failed}");
                pacing.charge(took, failed.moved)
            }
        };
        tokio::time::sleep(pacing.gap(charge)).await;
    }
}

/// Probes the meter's peers over the data plane: tokens minted with `key` (none before the
/// first registration: those probes fail), over TLS with `tls` where the agent has it; each
/// probe's NIC kind from the interface of its socket's local address under `sysfs`.
pub async fn run(
    meter: Arc<Meter>,
    pacing: Pacing,
    key: DataKey,
    tls: Option<ClientTls>,
    running: impl Fn() -> std::collections::BTreeSet<(i64, i64)>,
) {
    let sysfs = meter.sysfs.clone();
    let probe = |peer: &PeerPlane, bytes: u64| {
        let (key, tls, sysfs) = (key.clone(), tls.clone(), sysfs.clone());
        let peer = peer.clone();
        async move {
            let failed =
                |message: String| ProbeFailed { error: crate::error::AgentError::Probe { peer: peer.data_url.clone(), message }, moved: 0 };
            let token = key.mint_probe(&peer.node).map_err(failed)?;
            let probe = Probe { addr: &peer.data_url, token: Some(&token), tls: tls.as_ref(), timeout: PROBE_TIMEOUT };
            let measured = probe.run(bytes).await?;
            let nic_kind = measured
                .local
                .and_then(|a| super::local::interface_of(a.ip()))
                .map_or("eth", |ifname| kind_name(netdev_kind(&rdma_ports(&sysfs), &ifname)));
            Ok(Probed { measured, nic_kind })
        }
    };
    probe_loop(&meter, pacing, running, probe).await
}

#[cfg(test)]
mod tests;
