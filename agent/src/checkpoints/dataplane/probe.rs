//! Link probes over the data plane (docs/network.md, "Measure (agents)"): a peer asks for up to
//! `MAX_PROBE_BYTES` bytes with a probe token naming this node and times them. The asking end
//! is here (the serving end is `server::serve_probe`); when and how large probes are is
//! `net::probe`'s. Calls `access`, `client` (the connection a fetch makes), `limits` and
//! `protocol`.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::time::Instant;

use super::access::ClientTls;
use super::client::Peer;
use super::limits::{MAX_PROBE_BYTES, PROBE_CHUNK};
use super::protocol::{line, read_line, ProbeAsk, ProbeRequest, Reply, Transport, VERSION};
use crate::error::AgentError;

/// One probe to make: the peer's data plane as it registered it (`HOST:PORT` or
/// `tls://HOST:PORT`), its token, this agent's TLS client where it has TLS, and the longest
/// wait to connect and for each read.
#[derive(Clone, Copy, Debug)]
pub struct Probe<'a> {
    pub addr: &'a str,
    pub token: Option<&'a str>,
    pub tls: Option<&'a ClientTls>,
    pub timeout: Duration,
}

/// What a probe measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Payload bytes received: those asked, or fewer when the probe was cut at its limit
    /// (`Probe::run_within`).
    pub bytes: u64,
    /// From the request line sent to the reply line received: one round trip (and the peer's
    /// token check).
    pub latency: Duration,
    /// Payload bytes per second: all the payload bytes received over the time from the request
    /// sent to the last payload byte received. The round trip is counted (an underestimate by
    /// one round trip of a probe's duration: small at a probe's 50 ms target), so bytes the
    /// kernel had queued while this task was not running cannot make an absurd rate. `None`
    /// for a probe of 0 bytes.
    pub rate_bytes_s: Option<f64>,
    /// The local address of the probe's TCP socket.
    pub local: Option<SocketAddr>,
}

/// A failed probe: why, and how many payload bytes had arrived (a probe that moved none barely
/// used the link).
#[derive(Debug)]
pub struct ProbeFailed {
    pub error: AgentError,
    pub moved: u64,
}

impl std::fmt::Display for ProbeFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl Probe<'_> {
    /// Asks the peer for `bytes` (at most `MAX_PROBE_BYTES`) and times them, however long they
    /// take (each read within `timeout`).
    pub async fn run(&self, bytes: u64) -> Result<Measured, ProbeFailed> {
        self.exchange(bytes, None).await
    }

    /// Asks the peer for `bytes` (at most `MAX_PROBE_BYTES`) and times them, reading for at
    /// most `limit` from the request sent: at `limit` the probe stops reading and, if some
    /// payload had arrived, measures what did (`Measured::bytes` then fewer than asked; the
    /// rate is a rate all the same); if none had, it fails. Connecting (and the TLS handshake)
    /// keeps its own bound, `timeout`.
    pub async fn run_within(&self, bytes: u64, limit: Duration) -> Result<Measured, ProbeFailed> {
        self.exchange(bytes, Some(limit)).await
    }

    async fn exchange(&self, bytes: u64, limit: Option<Duration>) -> Result<Measured, ProbeFailed> {
        let fail = |message: String, moved: u64| ProbeFailed { error: AgentError::Probe { peer: self.addr.to_string(), message }, moved };
        if bytes > MAX_PROBE_BYTES {
            return Err(fail(format!("a probe of {bytes} bytes; at most {MAX_PROBE_BYTES}"), 0));
        }
        let peer = Peer {
            addr: self.addr,
            capability: None,
            tls: self.tls,
            transport: Transport::Tcp,
            pacers: &[],
            rate_bytes_s: None,
            timeout: self.timeout,
        };
        let (stream, local) = peer.connect_from().await.map_err(|e| fail(e, 0))?;
        let mut reader = BufReader::new(stream);
        let request = ProbeRequest { v: VERSION, probe: ProbeAsk { bytes }, capability: self.token.map(Into::into) };
        let sent = Instant::now();
        let deadline = limit.and_then(|l| sent.checked_add(l));
        let wrote = async {
            let stream = reader.get_mut();
            stream.write_all(&line(&request)).await?;
            stream.flush().await
        };
        self.io(wrote, deadline).await.map_err(|e| fail(format!("sending the request: {e}"), 0))?;
        let reply = self.io(read_line(&mut reader), deadline).await.map_err(|e| fail(format!("reading the reply: {e}"), 0))?;
        let replied = Instant::now();
        match reply.as_deref().map(serde_json::from_str::<Reply>) {
            Some(Ok(Reply { ok: true, bytes: Some(n), .. })) if n == bytes => {}
            Some(Ok(Reply { ok: true, bytes: offered, .. })) => {
                return Err(fail(format!("the peer offers {offered:?} bytes for a probe of {bytes}; is it an agent of this version?"), 0))
            }
            Some(Ok(Reply { error, .. })) => {
                return Err(fail(format!("refused: {}", error.unwrap_or_else(|| "no reason given".into())), 0))
            }
            Some(Err(e)) => return Err(fail(format!("the reply is not the data plane's: {e}"), 0)),
            None => return Err(fail("the peer closed the connection without a reply".into(), 0)),
        }
        // Payload bytes that came with the reply line arrived with it.
        let buffered = reader.buffer().len() as u64;
        if buffered > bytes {
            return Err(fail(format!("the peer sent more than the {bytes} bytes asked"), bytes));
        }
        reader.consume(buffered as usize);
        let mut got = buffered;
        let mut last = replied;
        let mut buf = vec![0u8; PROBE_CHUNK.min(bytes as usize)];
        while got < bytes {
            let want = (bytes - got).min(PROBE_CHUNK as u64) as usize;
            let n = match self.io(reader.read(&mut buf[..want]), deadline).await {
                Ok(0) => return Err(fail(format!("the stream ended after {got} of {bytes} bytes"), got)),
                Ok(n) => n as u64,
                // Cut at the limit: what arrived is the measurement.
                Err(Stop::Limit) if got > 0 => break,
                Err(e) => return Err(fail(format!("reading the payload: {e}"), got)),
            };
            got += n;
            last = Instant::now();
        }
        let rate_bytes_s = (got > 0).then(|| got as f64 / (last - sent).as_secs_f64().max(1e-9));
        Ok(Measured { bytes: got, latency: replied - sent, rate_bytes_s, local })
    }

    /// Runs `op` within `timeout`, and ending by `deadline` where there is one.
    async fn io<T>(&self, op: impl std::future::Future<Output = std::io::Result<T>>, deadline: Option<Instant>) -> Result<T, Stop> {
        let stall = Instant::now() + self.timeout;
        let until = deadline.map_or(stall, |d| d.min(stall));
        match tokio::time::timeout_at(until, op).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Stop::Io(e.to_string())),
            Err(_) if deadline.is_some_and(|d| d <= stall) => Err(Stop::Limit),
            Err(_) => Err(Stop::Stalled(self.timeout)),
        }
    }
}

/// Why an exchange of a probe stopped early.
#[derive(Debug)]
enum Stop {
    Io(String),
    Stalled(Duration),
    Limit,
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Io(e) => f.write_str(e),
            Stop::Stalled(t) => write!(f, "nothing for {t:?}; the peer stalled"),
            Stop::Limit => f.write_str("past the probe's time limit"),
        }
    }
}

#[cfg(test)]
mod tests;
