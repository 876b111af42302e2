//! One RDMA transfer, both sides: the holder registers the file's requested span and offers
//! it, the reader connects its queue pair, READs every range and says done (the protocol in
//! this module's parent, steps 1 to 5).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr;
use std::time::Duration;

use rdma_sys::ibv_access_flags;

use super::control::{abort, recv, send, split_reads, Control, Region};
use super::verbs::{errno, Backing, Verbs};
use super::PIECE;
use crate::checkpoints::dataplane::Stream;
use crate::AgentError;

/// How long a side waits for each handshake message.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the holder waits for "done": the handshake limit plus the transfer at 50 MB/s.
fn done_timeout(bytes: u64) -> Duration {
    HANDSHAKE_TIMEOUT + Duration::from_secs(bytes / 50_000_000)
}

fn peer_err(device: &str, what: &str, why: String) -> AgentError {
    AgentError::Rdma { device: device.into(), message: format!("{what}: {why}") }
}

/// Holder side. `stream` is the connection (TCP, or TLS over it) of a data-plane request whose JSON header asked
/// for transport rdma; the header exchange is done. `file` is the file the data plane opened
/// (beneath its root, never through a link: `dataplane::resolve::Located::open`); `path` only
/// names it in errors. Register the file's bytes (mmap of `file`, read-only) as a memory region, send the peer over `stream` what it needs for one-sided READs
/// (QP number, LID/GID, PSN, the MR's address, length and rkey, and the ranges), wait for the
/// peer's "done" message, deregister. Errors name the device, the file and the fix.
pub async fn serve(stream: &mut dyn Stream, file: &File, path: &Path, ranges: &[(u64, u64)]) -> Result<(), AgentError> {
    if ranges.is_empty() {
        return Ok(()); // nothing to read; `fetch` returns at once too
    }
    let file_err = |device: &str, message: String| AgentError::Rdma {
        device: device.into(),
        message: format!("serving {}: {message}", path.display()),
    };
    // The device's errors, with the file named.
    let in_file = |e: AgentError| match e {
        AgentError::Rdma { device, message } => file_err(&device, message),
        other => other,
    };
    let mut verbs = match Verbs::open() {
        Ok(v) => v,
        Err(e) => return abort(stream, in_file(e)).await,
    };
    let device = verbs.device.clone();
    // The span of the ranges, page-aligned at its start for mmap: the region covers only it.
    let start = ranges.iter().map(|r| r.0).min().unwrap_or(0);
    let end = ranges.iter().map(|r| r.0.saturating_add(r.1)).max().unwrap_or(0);
    let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if end > file_len {
        let message = format!("ranges reach byte {end} but the file has {file_len}: ask for ranges inside it");
        return abort(stream, file_err(&device, message)).await;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let map_off = start / page * page;
    let map_len = (end - map_off) as usize;
    // SAFETY: a fresh read-only shared mapping of an open file within its length; it is owned by
    // the region's backing and unmapped after deregistration (or at once if that fails).
    let addr = unsafe { libc::mmap(ptr::null_mut(), map_len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), map_off as i64) };
    if addr == libc::MAP_FAILED {
        return abort(stream, file_err(&device, format!("cannot map {map_len} bytes of the file ({})", errno()))).await;
    }
    // Remote READ only: no local write access, so the read-only mapping can be pinned.
    let access = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    // SAFETY: the mapping is `map_len` bytes and stays until the region is deregistered.
    let registered = unsafe { verbs.register(addr, map_len, access, Backing::Map { addr, len: map_len }) };
    let (mr_addr, _, rkey) = match registered {
        Ok(r) => r,
        Err(e) => return abort(stream, in_file(e)).await,
    };
    let region = Region { addr: mr_addr, len: map_len as u64, rkey, offset: map_off };
    let offer = Control::Offer { endpoint: verbs.local.clone(), region, ranges: ranges.to_vec() };
    send(stream, &offer).await.map_err(|e| file_err(&device, format!("cannot send the offer to the reader ({e})")))?;
    let remote = match recv(stream, HANDSHAKE_TIMEOUT).await {
        Ok(Control::Accept { endpoint }) => endpoint,
        Ok(Control::Error { message }) => return Err(file_err(&device, format!("the reader cannot READ over RDMA: {message}"))),
        Ok(other) => return abort(stream, file_err(&device, format!("the reader sent {other:?} instead of its queue pair"))).await,
        Err(why) => return Err(file_err(&device, format!("waiting for the reader's queue pair: {why}"))),
    };
    if let Err(e) = verbs.connect(&remote) {
        return abort(stream, in_file(e)).await;
    }
    send(stream, &Control::Ready {}).await.map_err(|e| file_err(&device, format!("cannot tell the reader to start ({e})")))?;
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let result = match recv(stream, done_timeout(total)).await {
        Ok(Control::Done { .. }) => Ok(()),
        Ok(Control::Error { message }) => Err(file_err(&device, format!("the reader stopped: {message}"))),
        Ok(other) => Err(file_err(&device, format!("the reader sent {other:?} instead of done"))),
        Err(why) => Err(file_err(&device, format!("waiting for the reader's done: {why}"))),
    };
    // Destroy the QP, deregister and unmap off the async threads.
    let _ = tokio::task::spawn_blocking(move || drop(verbs)).await;
    result
}

/// Reader side: exchange QP info over `stream`, post RDMA READs of `ranges` (in pieces of at
/// most 1 MiB) into a registered local buffer, write each piece at its offset into `dest`
/// (positional writes), send "done"; returns bytes read. The caller verifies the manifest crc32c
/// of the whole file afterwards.
pub async fn fetch(stream: &mut dyn Stream, ranges: &[(u64, u64)], dest: &File) -> Result<u64, AgentError> {
    if ranges.is_empty() {
        return Ok(0); // `serve` sends nothing for no ranges
    }
    let mut verbs = match Verbs::open() {
        Ok(v) => v,
        Err(e) => return abort(stream, e).await,
    };
    let device = verbs.device.clone();
    let (holder, region, offered) = match recv(stream, HANDSHAKE_TIMEOUT).await {
        Ok(Control::Offer { endpoint, region, ranges }) => (endpoint, region, ranges),
        Ok(Control::Error { message }) => return Err(peer_err(&device, "the holder cannot serve over RDMA", message)),
        Ok(other) => return abort(stream, peer_err(&device, "the holder's first message", format!("{other:?} instead of an offer"))).await,
        Err(why) => return Err(peer_err(&device, "waiting for the holder's offer", why)),
    };
    // Every requested byte must be inside a range the holder offered (its region's rkey allows
    // nothing else; checking here names the range instead of a remote access error).
    let outside = ranges.iter().find(|&&(o, l)| !offered.iter().any(|&(oo, ol)| o >= oo && o.saturating_add(l) <= oo.saturating_add(ol)));
    if let Some((o, l)) = outside {
        let why = format!("range (offset {o}, length {l}) is not among the offered ranges {offered:?}");
        return abort(stream, peer_err(&device, "the holder's offer", why)).await;
    }
    if let Err(e) = send(stream, &Control::Accept { endpoint: verbs.local.clone() }).await {
        return Err(peer_err(&device, "cannot send the queue pair to the holder", e.to_string()));
    }
    if let Err(e) = verbs.connect(&holder) {
        return abort(stream, e).await;
    }
    match recv(stream, HANDSHAKE_TIMEOUT).await {
        Ok(Control::Ready {}) => {}
        Ok(Control::Error { message }) => return Err(peer_err(&device, format!("the holder ({})", holder.device).as_str(), message)),
        Ok(other) => return abort(stream, peer_err(&device, "the holder", format!("sent {other:?} instead of ready"))).await,
        Err(why) => return Err(peer_err(&device, "waiting for the holder to be ready", why)),
    }
    let pieces = split_reads(ranges, PIECE);
    let dest = match dest.try_clone() {
        Ok(f) => f,
        Err(e) => return abort(stream, peer_err(&device, "cannot duplicate the destination file", e.to_string())).await,
    };
    let read = tokio::task::spawn_blocking(move || {
        let r = verbs.read_all(&region, &pieces, &dest);
        drop(verbs);
        r
    })
    .await
    .unwrap_or_else(|e| Err(peer_err(&device, "the READ thread failed", e.to_string())));
    match read {
        Ok(bytes) => {
            send(stream, &Control::Done { bytes })
                .await
                .map_err(|e| peer_err(&device, "cannot tell the holder the READs are done", e.to_string()))?;
            Ok(bytes)
        }
        Err(e) => abort(stream, e).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this host has an RDMA device, per sysfs (independent of libibverbs).
    fn host_has_device() -> bool {
        std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rdma_serve_and_fetch_without_a_device_fail_cleanly() {
        if host_has_device() {
            return; // the verbs path itself is exercised on RDMA hardware only (README "RDMA")
        }
        let dir = std::env::temp_dir().join(format!("motley-rdma-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("shard.bin");
        std::fs::write(&src, vec![7u8; 3 << 20]).unwrap();
        let dest = File::create(dir.join("copy.bin")).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ranges = vec![(0u64, 1u64 << 20), (2 << 20, 1 << 20)];
        let holder = {
            let (src, ranges) = (src.clone(), ranges.clone());
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                serve(&mut s, &File::open(&src).unwrap(), &src, &ranges).await
            })
        };
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let both = async { (fetch(&mut client, &ranges, &dest).await, holder.await.unwrap()) };
        let (fetched, served) = tokio::time::timeout(Duration::from_secs(20), both).await.expect("no hang");
        let (fetch_err, serve_err) = (fetched.unwrap_err().to_string(), served.unwrap_err().to_string());
        eprintln!("fetch: {fetch_err}\nserve: {serve_err}");
        for err in [&fetch_err, &serve_err] {
            assert!(err.starts_with("RDMA (no device):"), "{err}");
            assert!(err.contains("no RDMA device on this host") && err.contains("transport tcp"), "{err}");
        }
        assert!(serve_err.contains(&src.display().to_string()), "names the file: {serve_err}");
        // Nothing was written.
        assert_eq!(dest.metadata().unwrap().len(), 0);
        // A request for no ranges needs no device on either side.
        assert_eq!(fetch(&mut client, &[], &dest).await.unwrap(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
