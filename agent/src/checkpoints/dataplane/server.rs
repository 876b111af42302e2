//! Serves checkpoint files to peers: one task per connection, one request per connection, at
//! most `Access::max_connections` at once and `Access::max_per_source` from one address, each
//! given `DataKey::request_deadline` to bring its request line; each request allowed by its
//! capability only, over TLS wherever the agent has a certificate (docs/recovery.md, "Who may
//! fetch"). Its bounds shared with `access` and `probe` are `limits`'; the asking end of a
//! probe is `probe`. Calls `access`, `limits`, `pace`, `protocol`, `resolve`.

use std::fs::File;
use std::net::IpAddr;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::access::{Access, DataKey, Stream};
use super::limits::{MAX_PROBE_BYTES, PROBE_CHUNK, PROBE_ZEROS};
use super::pace::{take_all, Pacer};
use super::protocol::{
    check_ranges, line, read_line, Asked, FrameHeader, ProbeRequest, Reply, Transport, FRAME_HEADER_BYTES, FRAME_MAX, MAX_LINE,
};
use super::resolve::{Located, Resolve};

/// How long a peer may take to take one frame, or to wait for a file arriving here, before the
/// connection is dropped: a stalled peer must not hold a file open forever.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a probe may take, from its request to its last byte taken, before the server
/// closes the connection: a probe is at most `limits::MAX_PROBE_BYTES` sized to take tens of
/// milliseconds, so a peer that reads it slower than this is cut rather than holding one of the
/// `limits::MAX_CONNECTIONS` slots for as long as it trickles.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(10);

/// Serves every connection `listener` accepts, forever: `access` says which requests are
/// allowed and whether over TLS; `egress` is the node's NIC pacer, shared by every flow.
pub async fn serve(listener: TcpListener, resolver: Arc<dyn Resolve>, access: Access, egress: Arc<Pacer>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(access.max_connections.max(1)));
    let sources = Sources::default();
    let acceptor = access.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    loop {
        // A slot before the connection is taken: nothing of a connection beyond the bound is read.
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: wait rather than spin.
                tracing::warn!("checkpoint data plane: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Closed unread (its slot given back at once) when its address holds its share already.
        let Some(share) = sources.take(peer.ip(), access.max_per_source.max(1)) else {
            tracing::debug!("checkpoint data plane: peer {peer}: its address holds {} connections already; closed", access.max_per_source);
            continue;
        };
        let deadline = access.key.request_deadline();
        let (resolver, key, egress, acceptor) = (resolver.clone(), access.key.clone(), egress.clone(), acceptor.clone());
        let probes = (access.node.clone(), access.probe_pacer.clone());
        tokio::spawn(async move {
            let (_slot, _share) = (slot, share);
            let _ = tcp.set_nodelay(true);
            let opened = tokio::time::timeout(deadline, open_request(tcp, acceptor)).await;
            let (stream, request_line) = match opened {
                Err(_) => return tracing::debug!("checkpoint data plane: peer {peer}: no request within {deadline:?}; closed"),
                Ok(Err(e)) => return tracing::debug!("checkpoint data plane: peer {peer}: {e}"),
                Ok(Ok(opened)) => opened,
            };
            if let Err(e) = handle(stream, request_line, &*resolver, &key, &egress, probes).await {
                tracing::warn!("checkpoint data plane: peer {peer}: {e}");
            }
        });
    }
}

/// The connections each source address holds now.
#[derive(Clone, Default)]
struct Sources(Arc<std::sync::Mutex<std::collections::HashMap<IpAddr, usize>>>);

/// One connection of `ip`'s, given back when dropped.
struct SourceShare {
    sources: Sources,
    ip: IpAddr,
}

impl Sources {
    /// A share for one more connection from `ip` (an IPv4 address mapped into IPv6 counted as
    /// itself), unless it holds `max` already.
    fn take(&self, ip: IpAddr, max: usize) -> Option<SourceShare> {
        let ip = ip.to_canonical();
        let mut held = self.0.lock().expect("data-plane sources lock");
        let n = held.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(SourceShare { sources: self.clone(), ip })
    }
}

impl Drop for SourceShare {
    fn drop(&mut self) {
        let mut held = self.sources.0.lock().expect("data-plane sources lock");
        if let Some(n) = held.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// The connection (over TLS when `acceptor` is given) and its request line, or why there is
/// none: a failed handshake (a plain-TCP client of a TLS data plane), a closed connection.
async fn open_request(
    tcp: TcpStream,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
) -> Result<(Box<dyn Stream>, Result<String, String>), String> {
    let stream: Box<dyn Stream> = match acceptor {
        Some(acceptor) => Box::new(acceptor.accept(tcp).await.map_err(|e| format!("TLS handshake failed: {e}"))?),
        None => Box::new(tcp),
    };
    let mut reader = BufReader::new(stream);
    let request_line = match read_line(&mut reader).await {
        Ok(None) => return Err("closed without a request".into()),
        Ok(Some(l)) => Ok(l),
        Err(e) => Err(format!("request: {e}")),
    };
    // A client sends nothing after its request line until it has the reply, so nothing is
    // left in the buffer and the bare stream can carry the rest.
    Ok((reader.into_inner(), request_line))
}

/// One connection: the request checked, the reply, the bytes.
async fn handle(
    mut stream: Box<dyn Stream>,
    request_line: Result<String, String>,
    resolver: &dyn Resolve,
    data_key: &DataKey,
    egress: &Pacer,
    (node, probe_pacer): (Option<String>, Option<Arc<Pacer>>),
) -> Result<(), String> {
    let stream = &mut stream;
    let request = match request_line.and_then(|l| Asked::parse(&l)) {
        Ok(Asked::Fetch(r)) => r,
        Ok(Asked::Probe(p)) => return serve_probe(stream, p, data_key, node.as_deref(), probe_pacer.as_deref()).await,
        Err(e) => return refuse(stream, e).await,
    };
    let key = request.key();
    // The capability first: a request it does not allow learns nothing of what is held here.
    if let Err(e) = data_key.check(request.capability.as_deref(), &key) {
        return refuse(stream, format!("file {key}: refused: {e}")).await;
    }
    if request.transport == Transport::Rdma && !cfg!(feature = "rdma") {
        return refuse(stream, "this agent was built without RDMA (cargo feature rdma); use tcp".into()).await;
    }
    if let Err(e) = crate::safe_fs::check_name(&key.file).map_err(|e| e.to_string()).and_then(|()| check_ranges(&request.ranges, None)) {
        return refuse(stream, format!("file {key}: {e}")).await;
    }
    let located = match find(resolver, &key).await {
        Ok(l) => l,
        Err(e) => return refuse(stream, format!("file {key}: {e}; fetch it from another holder")).await,
    };
    let opened = open(&located).await;
    let (file, file_len) = match opened {
        Ok(f) => f,
        Err(e) => return refuse(stream, format!("file {key}: held here but cannot be read: {e}")).await,
    };
    if let Err(e) = check_ranges(&request.ranges, Some(file_len)) {
        return refuse(stream, format!("file {key}: {e}")).await;
    }
    send(stream, &line(&Reply::ok(file_len))).await?;

    if request.transport == Transport::Rdma {
        #[cfg(feature = "rdma")]
        crate::checkpoints::rdma::serve(&mut **stream, &file, &located.path, &request.ranges)
            .await
            .map_err(|e| format!("file {key} over RDMA: {e}"))?;
        return Ok(());
    }
    let rate = Pacer::flow(request.rate_bytes_s.unwrap_or(0.0));
    let mut pacers: Vec<&Pacer> = vec![egress, &rate];
    pacers.extend(located.read_pacer.as_deref());
    for &(offset, len) in &request.ranges {
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(u64::from(FRAME_MAX));
            take_all(&pacers, n).await;
            let frame = read_frame(file.clone(), at, n as usize).await.map_err(|e| format!("file {key}: read at {at}: {e}"))?;
            send(stream, &frame).await.map_err(|e| format!("file {key}: {e}"))?;
            at += n;
        }
    }
    send(stream, &FrameHeader::END.to_bytes()).await?;
    stream.shutdown().await.map_err(|e| format!("file {key}: closing: {e}"))
}

/// Serves one probe: the token checked (signed under the cluster's probe key in the probe domain,
/// unexpired, naming `node`), then the reply line and `bytes` zero bytes, paced by `pacer`;
/// all within `PROBE_DEADLINE` of the request, else the connection is closed where it is.
async fn serve_probe(
    stream: &mut Box<dyn Stream>,
    request: ProbeRequest,
    key: &DataKey,
    node: Option<&str>,
    pacer: Option<&Pacer>,
) -> Result<(), String> {
    let Some(node) = node else {
        return refuse(stream, "probe refused: this data plane serves no probes (it was started without its node's name)".into()).await;
    };
    if let Err(e) = key.check_probe(request.capability.as_deref(), node) {
        return refuse(stream, format!("probe refused: {e}")).await;
    }
    let bytes = request.probe.bytes;
    if bytes > MAX_PROBE_BYTES {
        return refuse(stream, format!("probe of {bytes} bytes refused: at most {MAX_PROBE_BYTES} bytes")).await;
    }
    let served = async {
        send(stream, &line(&Reply::ok(bytes))).await?;
        let pacers: Vec<&Pacer> = pacer.into_iter().collect();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(PROBE_CHUNK as u64);
            take_all(&pacers, n).await;
            send(stream, &PROBE_ZEROS[..n as usize]).await.map_err(|e| format!("probe: {e}"))?;
            left -= n;
        }
        stream.shutdown().await.map_err(|e| format!("probe: closing: {e}"))
    };
    match tokio::time::timeout(PROBE_DEADLINE, served).await {
        Ok(served) => served,
        // Dropping the stream (by the caller) closes the connection.
        Err(_) => Err(format!("probe of {bytes} bytes: not taken within {PROBE_DEADLINE:?}; connection closed")),
    }
}

/// The file if held, else, if it is arriving, the file once it has arrived; else why not.
async fn find(resolver: &dyn Resolve, key: &super::protocol::FileKey) -> Result<Located, String> {
    if let Some(located) = resolver.locate(key) {
        return Ok(located);
    }
    let Some(mut pending) = resolver.pending(key) else {
        // Also covers a fetch that completed between `locate` and `pending`.
        return resolver.locate(key).ok_or_else(|| "not held here".to_string());
    };
    let timed_out = tokio::time::timeout(pending.timeout, pending.done.wait_for(|done| *done)).await.is_err();
    match (resolver.locate(key), timed_out) {
        (Some(located), _) => Ok(located),
        (None, true) => Err(format!("still arriving at this node after {:?}", pending.timeout)),
        // Completed yet gone (removed meanwhile), or the fetch failed (sender dropped).
        (None, false) => Err("not held here (this node's own fetch of it failed)".to_string()),
    }
}

/// Opens a located file without following a symbolic link at any step (`Located::open`), and
/// gives its length.
async fn open(located: &Located) -> std::io::Result<(Arc<File>, u64)> {
    let located = located.clone();
    let opened = tokio::task::spawn_blocking(move || {
        let file = located.open()?;
        let len = file.metadata()?.len();
        Ok((Arc::new(file), len))
    })
    .await;
    opened.unwrap_or_else(|e| Err(std::io::Error::other(e)))
}

/// The frame of the `n` bytes at `offset`, read off the async runtime into one buffer.
async fn read_frame(file: Arc<File>, offset: u64, n: usize) -> std::io::Result<Vec<u8>> {
    let read = tokio::task::spawn_blocking(move || {
        let mut frame = vec![0u8; FRAME_HEADER_BYTES + n];
        let (header, payload) = frame.split_at_mut(FRAME_HEADER_BYTES);
        file.read_exact_at(payload, offset)?;
        header.copy_from_slice(&FrameHeader::for_payload(offset, payload).to_bytes());
        Ok(frame)
    })
    .await;
    read.unwrap_or_else(|e| Err(std::io::Error::other(e)))
}

async fn send(stream: &mut Box<dyn Stream>, bytes: &[u8]) -> Result<(), String> {
    // Flushed: over TLS the bytes may otherwise wait in the session's buffer.
    let sent = async {
        stream.write_all(bytes).await?;
        stream.flush().await
    };
    match tokio::time::timeout(IDLE_TIMEOUT, sent).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("send: {e}")),
        Err(_) => Err(format!("the peer took nothing for {IDLE_TIMEOUT:?}")),
    }
}

/// Answers `{"ok":false,"error":...}` and ends the connection; the refusal is the peer's to
/// report, so it is logged here only at debug level.
async fn refuse(stream: &mut Box<dyn Stream>, message: String) -> Result<(), String> {
    tracing::debug!("checkpoint data plane: refused: {message}");
    send(stream, &line(&Reply::error(message))).await?;
    let _ = stream.shutdown().await;
    // Closing with the peer's bytes unread (a request cut off at the line cap) would reset the
    // connection and could lose the reply on its way: take what it still sends, briefly.
    let (mut unread, mut sink) = ((&mut *stream).take(MAX_LINE as u64 * 4), tokio::io::sink());
    let _ = tokio::time::timeout(Duration::from_secs(1), tokio::io::copy(&mut unread, &mut sink)).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;
    use tokio::time::Instant;

    use super::*;
    use crate::checkpoints::dataplane::protocol::ProbeAsk;

    const KEY: [u8; motley_server::capability::KEY_BYTES] = [7; motley_server::capability::KEY_BYTES];

    /// Serves a probe of `MAX_PROBE_BYTES` to a reader that takes `per_second` bytes a second
    /// (0: nothing), on the paused clock; gives how long the server took and what it said.
    async fn serve_to_slow_reader(per_second: usize) -> (Duration, Result<(), String>, u64) {
        let key = DataKey::default();
        let probe_key = motley_server::capability::probe_key(&KEY).unwrap();
        let node_key = motley_server::capability::node_key(&KEY, "n1").unwrap();
        key.set(super::super::access::Issued { node_key: &node_key, probe_key: &probe_key, base: Duration::from_secs(1) }).unwrap();
        let token = key.mint_probe("n1").unwrap();
        let (server, mut client) = tokio::io::duplex(64 << 10);
        let mut stream: Box<dyn Stream> = Box::new(server);
        let request =
            ProbeRequest { v: super::super::protocol::VERSION, probe: ProbeAsk { bytes: MAX_PROBE_BYTES }, capability: Some(token) };
        let reader = tokio::spawn(async move {
            let mut got = 0u64;
            let mut buf = vec![0u8; per_second.max(1)];
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if per_second == 0 {
                    continue;
                }
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got += n as u64,
                }
            }
        });
        let start = Instant::now();
        let served = serve_probe(&mut stream, request, &key, Some("n1"), None).await;
        let took = start.elapsed();
        drop(stream);
        let got = if per_second == 0 {
            reader.abort();
            0
        } else {
            reader.await.unwrap()
        };
        (took, served, got)
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_too_slow_to_read_is_cut_at_its_deadline() {
        for per_second in [0, 1 << 10, 64 << 10] {
            let (took, served, got) = serve_to_slow_reader(per_second).await;
            assert!(took >= PROBE_DEADLINE && took < PROBE_DEADLINE + Duration::from_secs(1), "{per_second} B/s: {took:?}");
            let e = served.unwrap_err();
            assert!(e.contains("not taken within 10s"), "{e}");
            assert!(got < MAX_PROBE_BYTES, "{per_second} B/s: {got}");
        }
    }
}
