//! Token buckets in bytes per second: a flow's planned rate, the node's NIC egress, the
//! emulated read rate of the disk tier. A flow passes bytes only when every pacer on its path
//! lets them (`take_all`).

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::protocol::FRAME_MAX;

/// A token bucket shared by every flow it paces (`Arc<Pacer>`). A taker reserves its bytes at
/// once and sleeps off the debt, so concurrent takers are served in the order they asked and
/// the sum of their rates is the bucket's.
#[derive(Debug)]
pub struct Pacer {
    /// Bytes per second; `None` lets everything through.
    rate: Option<f64>,
    /// The largest burst: 1/20 s worth of bytes or one frame, whichever is larger (a smaller
    /// bucket could never pass a whole frame without waiting).
    burst: f64,
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    /// Bytes that may pass now; negative while takers sleep off their reservations.
    tokens: f64,
    last: Instant,
}

impl Pacer {
    /// A bucket of `bytes_per_s`; 0, negative, NaN or infinite mean unlimited.
    pub fn new(bytes_per_s: f64) -> Pacer {
        let rate = (bytes_per_s.is_finite() && bytes_per_s > 0.0).then_some(bytes_per_s);
        let burst = rate.map_or(0.0, |r| (r / 20.0).max(FRAME_MAX as f64));
        Pacer { rate, burst, bucket: Mutex::new(Bucket { tokens: burst, last: Instant::now() }) }
    }

    /// The pacer of one flow at its planned rate: it starts empty and bursts at most 1/20 s worth,
    /// so a flow of B bytes takes B / rate however small it is (a node's shared bucket starts
    /// full instead: an idle NIC may send at once).
    pub fn flow(bytes_per_s: f64) -> Pacer {
        let rate = (bytes_per_s.is_finite() && bytes_per_s > 0.0).then_some(bytes_per_s);
        let burst = rate.map_or(0.0, |r| r / 20.0);
        Pacer { rate, burst, bucket: Mutex::new(Bucket { tokens: 0.0, last: Instant::now() }) }
    }

    /// A pacer that never waits.
    pub fn unlimited() -> Pacer {
        Pacer::new(0.0)
    }

    /// The rate in bytes per second, `None` when unlimited.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// Waits until `n` bytes may pass.
    pub async fn take(&self, n: u64) {
        let wait = self.reserve(n);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Reserves `n` bytes now and says how long the caller must wait before sending them.
    fn reserve(&self, n: u64) -> Duration {
        let Some(rate) = self.rate else { return Duration::ZERO };
        // A poisoned lock only means another taker panicked; the bucket's numbers are still valid.
        let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refill = now.saturating_duration_since(b.last).as_secs_f64() * rate;
        b.tokens = (b.tokens + refill).min(self.burst) - n as f64;
        b.last = now;
        if b.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-b.tokens / rate)
        }
    }
}

/// Waits until every pacer lets `n` bytes pass: each one is charged, and the flow waits for the
/// slowest.
pub async fn take_all(pacers: &[&Pacer], n: u64) {
    let wait = pacers.iter().map(|p| p.reserve(n)).max().unwrap_or_default();
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const MIB: u64 = 1 << 20;

    /// Seconds of (paused, auto-advancing) tokio time `f` takes.
    async fn timed(f: impl std::future::Future<Output = ()>) -> f64 {
        let start = Instant::now();
        f.await;
        start.elapsed().as_secs_f64()
    }

    #[tokio::test(start_paused = true)]
    async fn a_flows_own_pacer_starts_empty_so_small_flows_take_their_time() {
        // 100 KB at 1 MB/s: 0.1 s, not free (a node's bucket would let it through at once).
        let p = Pacer::flow(1e6);
        let t = timed(p.take(100_000)).await;
        assert!((t - 0.1).abs() < 0.01, "{t}");
        let t = timed(async { Pacer::new(1e6).take(100_000).await }).await;
        assert!(t < 0.01, "{t}");
        assert!(Pacer::flow(0.0).rate().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_flow_passes_at_the_pacers_rate_after_one_burst() {
        let pacer = Pacer::new(10.0 * MIB as f64);
        // 100 MiB at 10 MiB/s, less the 1 MiB burst (one frame > 1/20 s's 0.5 MiB) that passes at once.
        let secs = timed(async {
            for _ in 0..100 {
                pacer.take(MIB).await;
            }
        })
        .await;
        assert!((secs - 9.9).abs() < 0.01, "{secs} s");
    }

    #[tokio::test(start_paused = true)]
    async fn the_burst_is_a_twentieth_of_a_second_when_that_is_more_than_a_frame() {
        let pacer = Pacer::new(100.0 * MIB as f64);
        // 5 MiB pass at once, then 95 MiB at 100 MiB/s.
        let secs = timed(async {
            for _ in 0..100 {
                pacer.take(MIB).await;
            }
        })
        .await;
        assert!((secs - 0.95).abs() < 0.001, "{secs} s");
    }

    #[tokio::test(start_paused = true)]
    async fn flows_sharing_a_pacer_share_its_rate() {
        let nic = Arc::new(Pacer::new(8.0 * MIB as f64));
        let flow = |nic: Arc<Pacer>| async move {
            for _ in 0..40 {
                nic.take(MIB).await;
            }
        };
        let secs = timed(async {
            let (a, b) = tokio::join!(tokio::spawn(flow(nic.clone())), tokio::spawn(flow(nic.clone())));
            a.unwrap();
            b.unwrap();
        })
        .await;
        // 80 MiB at 8 MiB/s, less the 1 MiB burst.
        assert!((secs - 79.0 / 8.0).abs() < 0.01, "{secs} s");
    }

    #[tokio::test(start_paused = true)]
    async fn the_slowest_of_several_pacers_sets_the_pace() {
        let planned = Pacer::new(4.0 * MIB as f64);
        let nic = Pacer::new(40.0 * MIB as f64);
        let disk = Pacer::new(2.0 * MIB as f64);
        let secs = timed(async {
            for _ in 0..21 {
                take_all(&[&planned, &nic, &disk], MIB).await;
            }
        })
        .await;
        // 21 MiB at the disk's 2 MiB/s, less its 1 MiB burst.
        assert!((secs - 10.0).abs() < 0.01, "{secs} s");
    }

    #[tokio::test(start_paused = true)]
    async fn an_unlimited_pacer_never_waits() {
        for rate in [0.0, f64::INFINITY, -1.0, f64::NAN] {
            let pacer = Pacer::new(rate);
            assert_eq!(pacer.rate(), None);
            let secs = timed(async {
                for _ in 0..1000 {
                    take_all(&[&pacer, &Pacer::unlimited()], 1 << 30).await;
                }
            })
            .await;
            assert_eq!(secs, 0.0);
        }
    }
}
