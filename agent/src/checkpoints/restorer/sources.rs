//! Where a restored file's bytes come from: this node's own copy (its memory tier or disk),
//! a peer's data plane (over RDMA where both nodes can, else TCP), or the job's cloud store;
//! each range paced to its planned rate, a failing one taken from the next fallback holder.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use motley_proto::v1::{FetchSource, RestoreFile};

use super::budget::{blocking, buffer, IO_BUFFER};
use super::{merge, Restorer, Tally};
use crate::checkpoints::dataplane::{self, FileKey, Located, Pacer, Peer, Transport};

/// Bytes of one ranged read from the cloud.
const CLOUD_PIECE: u64 = 8 << 20;

/// The job's object store for one restore, and the node's share of its egress (see
/// `Restore.cloud_share_mb_s`) that unplanned reads are held to together.
pub(super) struct CloudSide {
    pub(super) url: String,
    /// Why this agent does not read `url` for the job (`file_roots`), if it does not.
    pub(super) refused: Option<String>,
    pub(super) share: Option<Arc<Pacer>>,
}

/// Bytes `offset..offset + bytes` of a file were written by this source (later ones over earlier).
pub(super) type Sent = (u64, u64, FetchSource);

impl Restorer {
    /// Copy `k` of a file fetched again for another rank (the cloud-only baseline), discarded.
    pub(super) async fn scratch_copy(
        &self,
        key: &FileKey,
        f: &RestoreFile,
        tmp: &Path,
        k: u32,
        cloud: &CloudSide,
    ) -> Result<Tally, String> {
        let path = PathBuf::from(format!("{}.copy{k}", tmp.display()));
        let scratch = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let mut t = Tally::default();
        let mut result = Ok(());
        for r in &f.ranges {
            let src = r.source.clone().unwrap_or_default();
            result = self.fetch_range(key, &src, r.offset, r.bytes, rate(r.rate_mb_s), &scratch, cloud, &mut t).await;
            if result.is_err() {
                break;
            }
        }
        let _ = std::fs::remove_file(&path);
        result.map(|()| t)
    }

    /// Every range from its planned source, or the first fallback that serves it. Returns who
    /// sent each range: (offset, bytes, source).
    pub(super) async fn fill(
        &self,
        key: &FileKey,
        f: &RestoreFile,
        file: &File,
        cloud: &CloudSide,
        tally: &mut Tally,
    ) -> Result<Vec<Sent>, String> {
        let mut flows = vec![];
        for r in &f.ranges {
            let planned = r.source.clone().unwrap_or_default();
            flows.push((planned, r.offset, r.bytes, rate(r.rate_mb_s)));
        }
        // Ranges run at once (each is paced to its own planned rate).
        let results = futures_util::future::join_all(flows.iter().map(|(src, off, len, rate)| {
            let mut t = Tally::default();
            async move {
                let res = self.fetch_range(key, src, *off, *len, *rate, file, cloud, &mut t).await;
                (res, t, src.clone(), *off, *len)
            }
        }))
        .await;
        let mut sent = vec![];
        for (res, t, src, off, len) in results {
            merge(tally, t);
            if res.is_ok() {
                sent.push((off, len, src.clone()));
            }
            if let Err(first) = res {
                let mut last = first.clone();
                let mut done = false;
                for fb in f.fallbacks.iter().filter(|fb| **fb != src) {
                    match self.fetch_range(key, fb, off, len, None, file, cloud, tally).await {
                        Ok(()) => {
                            sent.push((off, len, fb.clone()));
                            tally.repaired.push(format!(
                                "{} bytes {off}..{}: {} failed ({first}); fetched from {}",
                                f.file,
                                off + len,
                                describe(&src),
                                describe(fb)
                            ));
                            done = true;
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                if !done {
                    return Err(format!("{}: no holder could send bytes {off}..{} (last: {last})", f.file, off + len));
                }
            }
        }
        Ok(sent)
    }

    /// `len` bytes of `key` from `offset` on, from `src`, into `dest` at the same offset.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn fetch_range(
        &self,
        key: &FileKey,
        src: &FetchSource,
        offset: u64,
        len: u64,
        rate: Option<f64>,
        dest: &File,
        cloud: &CloudSide,
        tally: &mut Tally,
    ) -> Result<(), String> {
        match src.kind.as_str() {
            "local" => {
                let Some(at) = self.inner.resolver.locate(key) else {
                    return Err(format!("{}: not held on this node", key.file));
                };
                let pacer = at.read_pacer.clone().or_else(|| (src.tier == "disk").then(|| self.inner.disk_read.clone()));
                copy_range(&at, offset, len, dest, pacer, rate).await?;
                tally.local += len;
                Ok(())
            }
            "peer" => {
                let pacers = [self.inner.nic_in.clone()];
                let mut peer = Peer {
                    addr: &src.data_url,
                    // Minted for this peer's files under its own key: no other peer takes it.
                    capability: Some(src.capability.as_str()).filter(|c| !c.is_empty()),
                    tls: self.inner.tls.as_ref(),
                    transport: Transport::Tcp,
                    pacers: &pacers,
                    rate_bytes_s: rate,
                    timeout: Duration::from_secs(30),
                };
                // One-sided READs when the coordinator found both nodes in one RDMA domain; TCP
                // when that fails (a device gone, a port down) or this build has no RDMA.
                if src.transport == "rdma" && self.inner.rdma {
                    peer.transport = Transport::Rdma;
                    // A flow receives through one frame (at most a MiB) at a time: its MiB of the budget.
                    let _buffer = buffer(1).await;
                    match peer.fetch(key, &[(offset, len)], dest).await {
                        Ok(_) => {
                            tally.peer += len;
                            return Ok(());
                        }
                        Err(e) => tracing::warn!(node = %self.inner.node, "RDMA from {} failed ({e}); over TCP instead", src.node),
                    }
                    peer.transport = Transport::Tcp;
                }
                let _buffer = buffer(1).await;
                peer.fetch(key, &[(offset, len)], dest).await.map_err(|e| e.to_string())?;
                tally.peer += len;
                Ok(())
            }
            "cloud" => {
                if cloud.url.is_empty() {
                    return Err(format!("{}: the job has no checkpoint.cloud to fetch from", key.file));
                }
                if let Some(why) = &cloud.refused {
                    return Err(why.clone());
                }
                // Ranged reads of a few MiB, each paced through this node's NIC and the flow; the
                // store (an S3 client, say) opened once per flow.
                let store = crate::checkpoints::cloud::Cloud::open(&cloud.url).map_err(|e| e.to_string())?;
                let object = store.key(key.job, key.generation, key.step, &key.file);
                // A planned flow at its rate; anything else within the node's share.
                let flow = rate.map(Pacer::flow);
                let share = if flow.is_none() { cloud.share.as_deref() } else { None };
                let mut at = offset;
                while at < offset + len {
                    let n = (offset + len - at).min(CLOUD_PIECE);
                    let pacers: Vec<&Pacer> = std::iter::once(self.inner.nic_in.as_ref()).chain(flow.as_ref()).chain(share).collect();
                    dataplane::take_all(&pacers, n).await;
                    let _buffer = buffer((CLOUD_PIECE >> 20) as u32).await;
                    let bytes = store.get_range(&object, at..at + n).await.map_err(|e| e.to_string())?;
                    if bytes.len() as u64 != n {
                        return Err(format!("cloud {}: bytes {at}..{} came back {} long", key.file, at + n, bytes.len()));
                    }
                    let dest = dest.try_clone().map_err(|e| format!("the destination file: {e}"))?;
                    blocking(move || dest.write_all_at(&bytes, at).map_err(|e| format!("writing bytes {at}..: {e}"))).await?;
                    at += n;
                }
                tally.cloud += len;
                Ok(())
            }
            other => Err(format!("unknown source kind '{other}'")),
        }
    }
}

pub(super) fn rate(mb_s: f64) -> Option<f64> {
    (mb_s > 0.0 && mb_s.is_finite()).then_some(mb_s * 1e6)
}

pub(super) fn describe(s: &FetchSource) -> String {
    match s.kind.as_str() {
        "peer" => format!("peer {} ({})", s.node, s.tier),
        "local" => "this node's own copy".into(),
        other => other.to_string(),
    }
}

/// Copy `len` bytes at `offset` of `src` into `dest` at the same offset, paced: one
/// `IO_BUFFER` piece at a time, each read and written on the blocking pool within the
/// restore's buffer budget.
async fn copy_range(src: &Located, offset: u64, len: u64, dest: &File, pacer: Option<Arc<Pacer>>, rate: Option<f64>) -> Result<(), String> {
    // Through the handle rule (`Located::open`): the rank's directory may have changed since.
    let (located, path) = (src.clone(), src.path.clone());
    let from = blocking(move || located.open().map_err(|e| format!("{}: {e}", path.display()))).await?;
    let (from, dest) = (Arc::new(from), Arc::new(dest.try_clone().map_err(|e| format!("the destination file: {e}"))?));
    let flow = rate.map(|r| Arc::new(Pacer::flow(r)));
    let mut at = offset;
    let end = offset + len;
    while at < end {
        let n = ((end - at) as usize).min(IO_BUFFER);
        let pacers: Vec<&Pacer> = pacer.iter().map(|p| p.as_ref()).chain(flow.iter().map(|p| p.as_ref())).collect();
        dataplane::take_all(&pacers, n as u64).await;
        let _buffer = buffer(1).await;
        let (from, dest, name) = (from.clone(), dest.clone(), src.path.display().to_string());
        blocking(move || {
            let mut buf = vec![0u8; n];
            from.read_exact_at(&mut buf, at).map_err(|e| format!("{name} bytes {at}..{}: {e}", at + n as u64))?;
            dest.write_all_at(&buf, at).map_err(|e| format!("writing bytes {at}..: {e}"))
        })
        .await?;
        at += n as u64;
    }
    Ok(())
}
