//! The node's load, sampled for every interval heartbeat: GPU utilisation and memory (NVML),
//! free space in the work directory (statvfs), the load average and available memory (/proc).
//! A source that cannot be read contributes nothing (zeros or no GPUs) rather than stopping
//! the heartbeat, which is the node's lease.

use std::path::Path;

use motley_proto::v1::NodeLoad;

/// How often the node is sampled.
pub const SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The latest sample and when it was taken.
pub type Latest = tokio::sync::watch::Receiver<Option<(NodeLoad, std::time::Instant)>>;

/// Sample the node every `SAMPLE_EVERY`, one sample at a time and off the async workers, into
/// a watch channel the heartbeat reads without waiting: a work directory on a hung network
/// file system (or a stuck driver) stalls this loop and leaves the load stale (the heartbeat
/// then sends none), never the heartbeat, which is the node's lease.
pub fn sampler(work_dir: std::path::PathBuf, ranks_running: impl Fn() -> u32 + Send + 'static) -> Latest {
    let (tx, rx) = tokio::sync::watch::channel(None);
    tokio::spawn(async move {
        loop {
            let (dir, running) = (work_dir.clone(), ranks_running());
            match tokio::task::spawn_blocking(move || sample(&dir, running)).await {
                Ok(load) => {
                    if tx.send(Some((load, std::time::Instant::now()))).is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!("load sample: {e}"),
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    });
    rx
}

/// Sample the node now.
pub fn sample(work_dir: &Path, ranks_running: u32) -> NodeLoad {
    let proc_text = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    NodeLoad {
        gpus: crate::node::nvml::gpu_loads(),
        work_dir_free_bytes: free_bytes(work_dir).unwrap_or(0),
        load_1m: load_1m(&proc_text("/proc/loadavg")).unwrap_or(0.0),
        mem_available_bytes: mem_available(&proc_text("/proc/meminfo")).unwrap_or(0),
        ranks_running,
    }
}

/// Bytes an unprivileged writer may still use on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    space(dir).ok().map(|s| s.free)
}

/// A file system's free and total bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Space {
    pub free: u64,
    pub total: u64,
}

/// statvfs(2) of the file system holding `path`: bytes an unprivileged writer may still use,
/// and its size.
pub fn space(path: &Path) -> std::io::Result<Space> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a valid C string and a zeroed out-struct the call fills.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let frsize = if s.f_frsize > 0 { s.f_frsize } else { s.f_bsize } as u64;
    Ok(Space { free: s.f_bavail as u64 * frsize, total: s.f_blocks as u64 * frsize })
}

/// The first field of /proc/loadavg.
fn load_1m(text: &str) -> Option<f64> {
    text.split_whitespace().next()?.parse().ok()
}

/// MemAvailable of /proc/meminfo, in bytes.
fn mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_parse() {
        assert_eq!(load_1m("0.52 0.58 0.59 1/467 12345\n"), Some(0.52));
        assert_eq!(load_1m(""), None);
        let meminfo = "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn this_machine_has_free_disk_and_memory() {
        let l = sample(&std::env::temp_dir(), 3);
        assert!(l.work_dir_free_bytes > 0 && l.mem_available_bytes > 0, "{l:?}");
        assert_eq!(l.ranks_running, 3);
        assert_eq!(free_bytes(Path::new("/no/such/dir")), None);
    }
}
