//! Serves checkpoint files to peers: one task per connection, one request per connection.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::pace::{take_all, Pacer};
use super::protocol::{
    check_file_name, check_ranges, line, read_line, token_matches, FrameHeader, Reply, Request, Transport, FRAME_HEADER_BYTES, FRAME_MAX,
    MAX_LINE,
};
use super::resolve::{Located, Resolve};

/// How long a peer may take to send its request, or to take one frame, before the connection
/// is dropped: a stalled peer must not hold a file open forever.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Serves every connection `listener` accepts, forever. `token`: the one peers must present
/// (`None`: any); `egress`: the node's NIC pacer, shared by every flow.
pub async fn serve(listener: TcpListener, resolver: Arc<dyn Resolve>, token: Option<String>, egress: Arc<Pacer>) {
    let token: Option<Arc<str>> = token.map(Into::into);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: wait rather than spin.
                tracing::warn!("checkpoint data plane: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (resolver, token, egress) = (resolver.clone(), token.clone(), egress.clone());
        tokio::spawn(async move {
            if let Err(e) = handle(stream, &*resolver, token.as_deref(), &egress).await {
                tracing::warn!("checkpoint data plane: peer {peer}: {e}");
            }
        });
    }
}

/// One connection: the request, the reply, the bytes.
async fn handle(stream: TcpStream, resolver: &dyn Resolve, token: Option<&str>, egress: &Pacer) -> Result<(), String> {
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream);
    let line_read = tokio::time::timeout(IDLE_TIMEOUT, read_line(&mut reader)).await;
    let request_line = match line_read {
        Err(_) => return Err(format!("no request within {IDLE_TIMEOUT:?}")),
        Ok(Err(e)) => return refuse(reader.get_mut(), format!("request: {e}")).await,
        Ok(Ok(None)) => return Ok(()),
        Ok(Ok(Some(l))) => l,
    };
    // A client sends nothing after its request line until it has the reply, so nothing is
    // left in the buffer and the bare stream can carry the rest.
    let mut stream = reader.into_inner();
    let request = match Request::parse(&request_line) {
        Ok(r) => r,
        Err(e) => return refuse(&mut stream, e).await,
    };
    let key = request.key();
    if let Some(expected) = token {
        if !token_matches(request.token.as_deref(), expected) {
            return refuse(&mut stream, format!("file {key}: bad token; give the cluster's data plane token")).await;
        }
    }
    if request.transport == Transport::Rdma && !cfg!(feature = "rdma") {
        return refuse(&mut stream, "this agent was built without RDMA (cargo feature rdma); use tcp".into()).await;
    }
    if let Err(e) = check_file_name(&key.file).and_then(|()| check_ranges(&request.ranges, None)) {
        return refuse(&mut stream, format!("file {key}: {e}")).await;
    }
    let located = match find(resolver, &key).await {
        Ok(l) => l,
        Err(e) => return refuse(&mut stream, format!("file {key}: {e}; fetch it from another holder")).await,
    };
    let opened = open(&located.path).await;
    let (file, file_len) = match opened {
        Ok(f) => f,
        Err(e) => return refuse(&mut stream, format!("file {key}: held here but cannot be read: {e}")).await,
    };
    if let Err(e) = check_ranges(&request.ranges, Some(file_len)) {
        return refuse(&mut stream, format!("file {key}: {e}")).await;
    }
    send(&mut stream, &line(&Reply::ok(file_len))).await?;

    if request.transport == Transport::Rdma {
        #[cfg(feature = "rdma")]
        crate::checkpoints::rdma::serve(&mut stream, &located.path, &request.ranges)
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
            send(&mut stream, &frame).await.map_err(|e| format!("file {key}: {e}"))?;
            at += n;
        }
    }
    send(&mut stream, &FrameHeader::END.to_bytes()).await?;
    stream.shutdown().await.map_err(|e| format!("file {key}: closing: {e}"))
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

/// Opens a located file without following a symbolic link, and gives its length.
async fn open(path: &Path) -> std::io::Result<(Arc<File>, u64)> {
    let path = path.to_path_buf();
    let opened = tokio::task::spawn_blocking(move || {
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path)?;
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

async fn send(stream: &mut TcpStream, bytes: &[u8]) -> Result<(), String> {
    match tokio::time::timeout(IDLE_TIMEOUT, stream.write_all(bytes)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("send: {e}")),
        Err(_) => Err(format!("the peer took nothing for {IDLE_TIMEOUT:?}")),
    }
}

/// Answers `{"ok":false,"error":...}` and ends the connection; the refusal is the peer's to
/// report, so it is logged here only at debug level.
async fn refuse(stream: &mut TcpStream, message: String) -> Result<(), String> {
    tracing::debug!("checkpoint data plane: refused: {message}");
    send(stream, &line(&Reply::error(message))).await?;
    let _ = stream.shutdown().await;
    // Closing with the peer's bytes unread (a request cut off at the line cap) would reset the
    // connection and could lose the reply on its way: take what it still sends, briefly.
    let (mut unread, mut sink) = ((&mut *stream).take(MAX_LINE as u64 * 4), tokio::io::sink());
    let _ = tokio::time::timeout(Duration::from_secs(1), tokio::io::copy(&mut unread, &mut sink)).await;
    Ok(())
}
