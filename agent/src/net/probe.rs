//! Active measurement: short probes over the data plane to the peers the running launches name
//! (`Meter::peers`), one at a time, round-robin, paced so that probing holds at most `duty` of
//! this agent's time on the wire (docs/network.md, "Measure (agents)").
//!
//! The bound: a probe is sized to take about `target` at the link's last measured rate
//! (between `MIN_PROBE_BYTES` and `dataplane::MAX_PROBE_BYTES`; `MIN_PROBE_BYTES` when the link
//! has no rate yet), and stops reading `Pacing::limit` (4 x `target`) after its request was
//! sent, measuring what arrived by then (so a link that dropped 100-fold costs one probe of
//! 4 x `target`, and the next is sized to the new rate). After a probe charged `c` no next
//! probe starts, to any peer, before `c * (1/duty - 1)` has passed, so from each probe's start
//! to the next one's at least `c / duty` passes: a successful probe is charged the time it took
//! (at most `limit`: its payload moves only after the request), a failed one `target` (between
//! `target` and `limit` if payload had moved), so over any stretch of time probes of this agent
//! are on the wire at most `duty` of it (plus the one under way), and a refusing peer is asked
//! at most once per `target / duty`. A peer whose probe failed is also skipped for a while:
//! `BACKOFF_FIRST`, doubling on each further failure up to `BACKOFF_MAX`, forgotten on a
//! success.

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
/// How long a peer whose probe failed is skipped; doubled on each further failure.
pub const BACKOFF_FIRST: Duration = Duration::from_secs(1);
/// The longest a failing peer is skipped.
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// The least duty that probes (`--probe-duty`; 0 disables probing).
pub const MIN_DUTY: f64 = 0.0001;
/// The most duty.
pub const MAX_DUTY: f64 = 0.5;
/// A probe's reading ends this many times its target after its request.
const LIMIT_TARGETS: u32 = 4;

/// How much probing: the share of time on the wire and each probe's target duration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pacing {
    /// 0 disables probing; else in [`MIN_DUTY`, `MAX_DUTY`] (`check_duty`; the gap treats a
    /// duty outside it as the nearest bound).
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

    /// How long a probe reads after its request: 4 x `target`.
    pub fn limit(&self) -> Duration {
        self.target.saturating_mul(LIMIT_TARGETS)
    }

    /// The time a probe that took `took` counts for: a success all of it up to `limit` (its
    /// payload moves only after the request, and for at most `limit`); a failure `target`, or
    /// what it took up to `limit` when payload had moved.
    pub fn charge(&self, took: Duration, ok: bool, moved: u64) -> Duration {
        match (ok, moved) {
            (true, _) => took.min(self.limit()),
            (false, 0) => self.target,
            (false, _) => took.clamp(self.target, self.limit()),
        }
    }

    /// The wait after a probe charged `charge` before the next may start.
    pub fn gap(&self, charge: Duration) -> Duration {
        if !self.enabled() {
            return Duration::MAX;
        }
        charge.mul_f64(1.0 / self.duty.clamp(MIN_DUTY, MAX_DUTY) - 1.0)
    }
}

/// Whether `duty` is a valid `--probe-duty`: 0 (no probes) or from `MIN_DUTY` to `MAX_DUTY`.
pub fn check_duty(duty: f64) -> Result<(), String> {
    if duty == 0.0 || (MIN_DUTY..=MAX_DUTY).contains(&duty) {
        Ok(())
    } else {
        Err(format!("--probe-duty (probe_duty): must be 0 (no probes) or from {MIN_DUTY} to {MAX_DUTY} (default 0.01), not {duty}"))
    }
}

/// The peers whose last probes failed: skipped until `until`, for `period` more on the next
/// failure.
#[derive(Debug, Default)]
struct Backoff {
    peers: HashMap<String, (Instant, Duration)>,
}

impl Backoff {
    fn failed(&mut self, node: &str, now: Instant) {
        let period = self.peers.get(node).map_or(BACKOFF_FIRST, |(_, p)| (*p * 2).min(BACKOFF_MAX));
        self.peers.insert(node.to_string(), (now + period, period));
    }

    fn succeeded(&mut self, node: &str) {
        self.peers.remove(node);
    }

    fn ready(&self, node: &str, now: Instant) -> bool {
        self.peers.get(node).is_none_or(|(until, _)| *until <= now)
    }

    /// When the first skipped peer may be probed again.
    fn next_ready(&self) -> Option<Instant> {
        self.peers.values().map(|(until, _)| *until).min()
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
/// tests) given the peer, the bytes and how long to read (`Pacing::limit`), paced by `pacing`;
/// each success becomes a `LinkSample` in the meter. `running`
/// says which launches still have ranks here: launches that have none are forgotten first.
pub async fn probe_loop<P, F>(meter: &Meter, pacing: Pacing, running: impl Fn() -> std::collections::BTreeSet<(i64, i64)>, mut probe: P)
where
    P: FnMut(&PeerPlane, u64, Duration) -> F,
    F: Future<Output = Result<Probed, ProbeFailed>>,
{
    if !pacing.enabled() {
        return std::future::pending().await;
    }
    let mut rotation = Rotation::default();
    let mut rates: HashMap<String, f64> = HashMap::new();
    let mut backoff = Backoff::default();
    loop {
        meter.retain_running(&running());
        let peers = meter.peers();
        rates.retain(|node, _| peers.iter().any(|p| p.node == *node));
        backoff.peers.retain(|node, _| peers.iter().any(|p| p.node == *node));
        let now = Instant::now();
        let ready: Vec<PeerPlane> = peers.into_iter().filter(|p| backoff.ready(&p.node, now)).collect();
        let Some(peer) = rotation.next(&ready) else {
            let wake = backoff.next_ready().map_or(now + IDLE_CHECK, |t| t.min(now + IDLE_CHECK));
            let _ = tokio::time::timeout_at(wake, meter.peers_changed()).await;
            continue;
        };
        let bytes = pacing.size(rates.get(&peer.node).copied());
        let start = Instant::now();
        let result = probe(peer, bytes, pacing.limit()).await;
        let took = start.elapsed();
        let charge = match result {
            Ok(Probed { measured, nic_kind }) => {
                backoff.succeeded(&peer.node);
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
                pacing.charge(took, true, measured.bytes)
            }
            Err(failed) => {
                tracing::debug!(peer = %peer.node, "{failed}");
                backoff.failed(&peer.node, Instant::now());
                pacing.charge(took, false, failed.moved)
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
    let probe = |peer: &PeerPlane, bytes: u64, limit: Duration| {
        let (key, tls, sysfs) = (key.clone(), tls.clone(), sysfs.clone());
        let peer = peer.clone();
        async move {
            let failed =
                |message: String| ProbeFailed { error: crate::error::AgentError::Probe { peer: peer.data_url.clone(), message }, moved: 0 };
            let token = key.mint_probe(&peer.node).map_err(failed)?;
            let probe = Probe { addr: &peer.data_url, token: Some(&token), tls: tls.as_ref(), timeout: PROBE_TIMEOUT };
            let measured = probe.run_within(bytes, limit).await?;
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
