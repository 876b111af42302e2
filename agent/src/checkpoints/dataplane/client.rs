//! Fetches checkpoint files, or ranges of them, from a peer's data plane: over TLS when this
//! agent has TLS (and then only over TLS), each request with the file's capability.

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use motley_checkpoint::FileEntry;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::access::{ClientTls, Stream, TLS_SCHEME};
use super::pace::{take_all, Pacer};
use super::protocol::{
    check_ranges, line, read_line, FileKey, FrameHeader, Reply, Request, Transport, FRAME_HEADER_BYTES, FRAME_MAX, VERSION,
};
use crate::error::AgentError;

/// One peer to fetch from, and how.
#[derive(Clone, Copy, Debug)]
pub struct Peer<'a> {
    /// The peer's data plane as it registered it: `HOST:PORT`, or `tls://HOST:PORT`.
    pub addr: &'a str,
    /// The file's capability (`RestoreFile.capability`); `None`: the peer refuses the fetch.
    pub capability: Option<&'a str>,
    /// This agent's TLS client, given where the agent has TLS: then only `tls://` peers are
    /// fetched from (never plain TCP), else only plain ones.
    pub tls: Option<&'a ClientTls>,
    pub transport: Transport,
    /// Pacers on this node's side (its NIC ingress, the restore's share); the peer paces too.
    pub pacers: &'a [Arc<Pacer>],
    /// The flow's planned rate, asked of the peer; `None`: as fast as its pacers allow.
    pub rate_bytes_s: Option<f64>,
    /// The longest wait to connect, and for each read once connected.
    pub timeout: Duration,
}

/// Fetches `ranges` of `key` from the peer at `addr` over plain TCP into `dest`, each frame at its
/// offset; returns the bytes received. Every frame's crc32c is checked on arrival and every
/// requested byte must arrive exactly once; on any error the ranges' bytes in `dest` are not
/// to be trusted: fetch them from another holder.
#[allow(clippy::too_many_arguments)] // the signature the restore flow was written against; `Peer` groups them
pub async fn fetch(
    addr: &str,
    capability: Option<&str>,
    key: &FileKey,
    ranges: &[(u64, u64)],
    dest: &File,
    pacers: &[Arc<Pacer>],
    rate_bytes_s: Option<f64>,
    timeout: Duration,
) -> Result<u64, AgentError> {
    Peer { addr, capability, tls: None, transport: Transport::Tcp, pacers, rate_bytes_s, timeout }.fetch(key, ranges, dest).await
}

/// Fetches the whole of `key` over plain TCP to `path`, which ends up holding exactly the copy the
/// manifest's `entry` describes or nothing: see `Peer::fetch_to_path`.
#[allow(clippy::too_many_arguments)] // as `fetch`
pub async fn fetch_to_path(
    addr: &str,
    capability: Option<&str>,
    key: &FileKey,
    entry: &FileEntry,
    path: &Path,
    pacers: &[Arc<Pacer>],
    rate_bytes_s: Option<f64>,
    timeout: Duration,
) -> Result<u64, AgentError> {
    Peer { addr, capability, tls: None, transport: Transport::Tcp, pacers, rate_bytes_s, timeout }.fetch_to_path(key, entry, path).await
}

impl Peer<'_> {
    /// As the free function `fetch`, over `self.transport`.
    pub async fn fetch(&self, key: &FileKey, ranges: &[(u64, u64)], dest: &File) -> Result<u64, AgentError> {
        self.fetch_checked(key, ranges, dest, None).await
    }

    /// Fetches the whole of `key` into `PATH.tmp.PID` (mode 0600, missing parent directories
    /// made 0700), fsyncs it, checks its length and every chunk's crc32c against `entry`, and
    /// only then renames it to `path` and fsyncs the directory. On any error the temporary
    /// file is removed: there is never a half-written or corrupt file under the final name.
    pub async fn fetch_to_path(&self, key: &FileKey, entry: &FileEntry, path: &Path) -> Result<u64, AgentError> {
        if entry.file != key.file {
            return Err(self.error(key, format!("the manifest entry given is {}'s; pass the entry of the file fetched", entry.file)));
        }
        let tmp = temporary_path(path);
        let dest = blocking({
            let tmp = tmp.clone();
            move || {
                if let Some(parent) = tmp.parent() {
                    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(parent)?;
                }
                std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).mode(0o600).open(&tmp)
            }
        })
        .await
        .map_err(|e| self.error(key, format!("cannot create {}: {e}", tmp.display())))?;
        let placed = self.place(key, entry, &dest, &tmp, path).await;
        if placed.is_err() {
            // Nothing half-written stays behind; the final name was never touched.
            let _ = std::fs::remove_file(&tmp);
        }
        placed
    }

    /// Fetches into the open temporary file, then syncs, verifies and renames it.
    async fn place(&self, key: &FileKey, entry: &FileEntry, dest: &File, tmp: &Path, path: &Path) -> Result<u64, AgentError> {
        let ranges: Vec<(u64, u64)> = if entry.bytes == 0 { vec![] } else { vec![(0, entry.bytes)] };
        let got = self.fetch_checked(key, &ranges, dest, Some(entry.bytes)).await?;
        let dest = dest.try_clone().map_err(|e| self.error(key, format!("{}: {e}", tmp.display())))?;
        let (entry, tmp, path) = (entry.clone(), tmp.to_path_buf(), path.to_path_buf());
        let checked = blocking(move || -> std::io::Result<Result<(), String>> {
            dest.sync_all()?;
            if let Err(e) = motley_checkpoint::crc::verify_file(&tmp, &entry) {
                return Ok(Err(e.to_string()));
            }
            std::fs::rename(&tmp, &path)?;
            if let Some(parent) = path.parent() {
                File::open(parent)?.sync_all()?;
            }
            Ok(Ok(()))
        })
        .await;
        match checked {
            Ok(Ok(())) => Ok(got),
            Ok(Err(corrupt)) => Err(self.error(key, corrupt)),
            Err(e) => Err(self.error(key, format!("placing the copy: {e}"))),
        }
    }

    /// The fetch; `expected_len`: the length the file must have at the peer.
    async fn fetch_checked(&self, key: &FileKey, ranges: &[(u64, u64)], dest: &File, expected_len: Option<u64>) -> Result<u64, AgentError> {
        if let Err(e) = crate::safe_fs::check_name(&key.file).map_err(|e| e.to_string()).and_then(|()| check_ranges(ranges, expected_len)) {
            return Err(self.error(key, e));
        }
        if self.transport == Transport::Rdma && !cfg!(feature = "rdma") {
            return Err(self.error(key, "this agent was built without RDMA (cargo feature rdma); use tcp".into()));
        }
        let stream = self.connect().await.map_err(|e| self.error(key, e))?;
        let mut reader = BufReader::new(stream);
        let request = Request {
            v: VERSION,
            capability: self.capability.map(Into::into),
            job: key.job,
            generation: key.generation,
            step: key.step,
            file: key.file.clone(),
            ranges: ranges.to_vec(),
            rate_bytes_s: self.rate_bytes_s,
            transport: self.transport,
        };
        let sent = async {
            // Flushed: over TLS the line may otherwise wait in the session's buffer.
            let stream = reader.get_mut();
            stream.write_all(&line(&request)).await?;
            stream.flush().await
        };
        self.io(key, "sending the request", sent).await?;
        let reply = self.io(key, "reading the reply", read_line(&mut reader)).await?;
        let reply: Reply = match reply.as_deref().map(serde_json::from_str) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                return Err(self.error(key, format!("the reply is not the data plane's: {e}; is {} an agent of this version?", self.addr)))
            }
            None => return Err(self.error(key, "the peer closed the connection without a reply".into())),
        };
        let file_len = match reply {
            Reply { ok: true, bytes: Some(len), .. } => len,
            Reply { error, .. } => {
                let why = error.unwrap_or_else(|| "refused without a reason".into());
                return Err(self.error(key, format!("refused: {why}")));
            }
        };
        if let Some(want) = expected_len.filter(|&want| want != file_len) {
            return Err(
                self.error(key, format!("the peer's copy has {file_len} bytes, the manifest says {want}; fetch it from another holder"))
            );
        }
        if self.transport == Transport::Rdma {
            #[cfg(feature = "rdma")]
            {
                // The server sends nothing after its reply line on its own, so the buffer is empty.
                let mut stream = reader.into_inner();
                return crate::checkpoints::rdma::fetch(&mut *stream, ranges, dest).await;
            }
        }
        self.receive(key, ranges, dest, &mut reader).await
    }

    /// Reads frames until the end frame, each in its range's order, writing each at its offset.
    async fn receive(
        &self,
        key: &FileKey,
        ranges: &[(u64, u64)],
        dest: &File,
        reader: &mut BufReader<Box<dyn Stream>>,
    ) -> Result<u64, AgentError> {
        let dest = Arc::new(dest.try_clone().map_err(|e| self.error(key, format!("the destination file: {e}")))?);
        let pacers: Vec<&Pacer> = self.pacers.iter().map(|p| &**p).collect();
        let mut range = 0;
        let mut at = ranges.first().map_or(0, |r| r.0);
        let mut received = 0u64;
        let mut payload = Vec::new();
        loop {
            let mut header = [0u8; FRAME_HEADER_BYTES];
            self.io(key, "reading a frame", reader.read_exact(&mut header)).await?;
            let frame = FrameHeader::from_bytes(&header);
            if frame.len == 0 {
                break;
            }
            let end = frame.offset.saturating_add(u64::from(frame.len));
            // Frames come in the ranges' order, each range in consecutive frames: anything
            // else is a byte twice, a byte not asked for, or a gap.
            let expected = ranges.get(range).map(|&(offset, len)| (at, offset + len));
            match expected {
                Some((want_at, range_end)) if frame.len <= FRAME_MAX && frame.offset == want_at && end <= range_end => {}
                _ => {
                    let want = expected.map_or("the end frame".into(), |(a, e)| format!("bytes from {a} up to {e}"));
                    return Err(self.error(
                        key,
                        format!("frame of bytes {}..{end} where {want} were due; the peer does not speak this protocol", frame.offset),
                    ));
                }
            }
            take_all(&pacers, u64::from(frame.len)).await;
            payload.resize(frame.len as usize, 0);
            self.io(key, "reading a frame", reader.read_exact(&mut payload)).await?;
            let crc = crc32c::crc32c(&payload);
            if crc != frame.crc32c {
                return Err(self.error(
                    key,
                    format!(
                        "bytes {}..{end} arrived with crc32c {crc:08x}, the frame says {:08x}; corrupt in flight or at the peer: fetch the range from another holder",
                        frame.offset, frame.crc32c
                    ),
                ));
            }
            let file = dest.clone();
            let offset = frame.offset;
            payload = blocking(move || file.write_all_at(&payload, offset).map(|()| payload))
                .await
                .map_err(|e| self.error(key, format!("writing bytes {offset}..{end} to the destination: {e}")))?;
            received += u64::from(frame.len);
            at = end;
            if ranges.get(range).is_some_and(|&(offset, len)| at == offset + len) {
                range += 1;
                at = ranges.get(range).map_or(at, |r| r.0);
            }
        }
        if let Some(&(offset, len)) = ranges.get(range) {
            return Err(self.error(
                key,
                format!("the stream ended at byte {at} of range {offset}..{}; fetch the rest from another holder", offset + len),
            ));
        }
        Ok(received)
    }

    /// A connection to the peer: TCP, then TLS where `self.tls` is given. The peer's scheme
    /// must match: a TLS agent never falls back to plain TCP (its capabilities would cross the
    /// network in the clear), and a plain one cannot check a TLS peer.
    async fn connect(&self) -> Result<Box<dyn Stream>, String> {
        self.connect_from().await.map(|(stream, _)| stream)
    }

    /// `connect`, and the local address of its TCP socket (the NIC a probe crossed here).
    pub(super) async fn connect_from(&self) -> Result<(Box<dyn Stream>, Option<std::net::SocketAddr>), String> {
        let (tls, hostport) = match (self.addr.strip_prefix(TLS_SCHEME), self.tls) {
            (Some(hostport), Some(tls)) => (Some(tls), hostport),
            (None, None) => (None, self.addr),
            (Some(_), None) => {
                return Err("the peer serves its data plane over TLS and this agent has no TLS: give it --tls-cert/--tls-key (and --ca-cert, the CA that signed the agents' certificates)".into())
            }
            (None, Some(_)) => {
                return Err("the peer serves its data plane without TLS and this agent fetches over TLS only: give every agent --tls-cert/--tls-key".into())
            }
        };
        let tcp = match tokio::time::timeout(self.timeout, TcpStream::connect(hostport)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("cannot connect: {e}; is the peer's agent up and its data plane port reachable?")),
            Err(_) => return Err(format!("no connection within {:?}; is the peer reachable?", self.timeout)),
        };
        let _ = tcp.set_nodelay(true);
        let local = tcp.local_addr().ok();
        let Some(tls) = tls else { return Ok((Box::new(tcp), local)) };
        let host = hostport.rsplit_once(':').map_or(hostport, |(host, _)| host);
        match tokio::time::timeout(self.timeout, tls.connect(host, tcp)).await {
            Ok(connected) => connected.map(|stream| (stream, local)),
            Err(_) => Err(format!("no TLS handshake within {:?}; the peer stalled", self.timeout)),
        }
    }

    /// Runs `op` with the idle timeout, naming `what` was under way if it fails.
    async fn io<T>(&self, key: &FileKey, what: &str, op: impl std::future::Future<Output = std::io::Result<T>>) -> Result<T, AgentError> {
        match tokio::time::timeout(self.timeout, op).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.error(key, format!("{what}: {e}; fetch it from another holder"))),
            Err(_) => {
                Err(self.error(key, format!("{what}: nothing for {:?}; the peer stalled: fetch it from another holder", self.timeout)))
            }
        }
    }

    fn error(&self, key: &FileKey, message: String) -> AgentError {
        AgentError::DataPlane { peer: self.addr.to_string(), file: key.to_string(), message }
    }
}

/// Runs blocking file work off the async runtime.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(std::io::Error::other(e)))
}

/// `PATH.tmp.PID`: where `fetch_to_path` writes before the rename (exposed for tests and clean-up).
pub fn temporary_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!("{name}.tmp.{}", std::process::id()))
}
