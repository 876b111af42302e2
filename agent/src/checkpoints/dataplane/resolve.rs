//! Where a requested file is on this node: the ranks' checkpoint directories and the restore
//! directory under each root (memory tier first, then the work dir), and the files this node
//! is itself still fetching (`Arriving`), which it serves as a relay once they are complete.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use motley_checkpoint::manifest::step_dir_name;
use tokio::sync::watch;

use super::pace::Pacer;
use super::protocol::FileKey;

/// A file found: its path, and the pacer that emulates its tier's read rate, if any.
#[derive(Clone, Debug)]
pub struct Located {
    pub path: PathBuf,
    pub read_pacer: Option<Arc<Pacer>>,
    /// The root it was found under: `open` reaches it from there.
    root: PathBuf,
}

impl Located {
    /// The file, opened beneath its root without following a link at any step (`safe_fs`): a
    /// rank that swaps its `ckpt` or a step directory for a link once `locate` found the file
    /// gets a refusal, never another file of this node.
    pub fn open(&self) -> std::io::Result<std::fs::File> {
        let refused = |e: crate::error::AgentError| match e {
            crate::error::AgentError::Io { err, .. } => err,
            e => std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string()),
        };
        let rel = self.path.strip_prefix(&self.root).map_err(std::io::Error::other)?;
        crate::safe_fs::Dir::open(&self.root).and_then(|d| d.open_file(rel)).map_err(refused)
    }
}

/// A file this node is fetching: `done` turns `true` once it is complete under its final name
/// (its sender dropped without that: the fetch failed); wait for it at most `timeout`.
#[derive(Debug)]
pub struct Pending {
    pub done: watch::Receiver<bool>,
    pub timeout: Duration,
}

/// Finds requested files for the server.
pub trait Resolve: Send + Sync {
    /// The file, if this node holds it whole.
    fn locate(&self, key: &FileKey) -> Option<Located>;
    /// The file, if this node is fetching it: the server waits for it, then locates it.
    fn pending(&self, _key: &FileKey) -> Option<Pending> {
        None
    }
}

/// One directory tree to look in.
#[derive(Clone, Debug)]
pub struct Root {
    pub dir: PathBuf,
    pub read_pacer: Option<Arc<Pacer>>,
}

/// Looks for `ROOT/jobs/{job}/{generation}/ckpt/step-{S:08}/{file}` (where ranks write their
/// checkpoints, `steps::ckpt_dir`) and then `ROOT/restore/{job}/{generation}/step-{S:08}/{file}`
/// (files fetched for a restore) under each root in order.
#[derive(Debug, Default)]
pub struct DirResolver {
    roots: Vec<Root>,
    arriving: Option<Arc<Arriving>>,
}

impl DirResolver {
    pub fn new(roots: Vec<Root>) -> DirResolver {
        DirResolver { roots, arriving: None }
    }

    /// Also serves, once complete, the files registered in `arriving`.
    pub fn with_arriving(mut self, arriving: Arc<Arriving>) -> DirResolver {
        self.arriving = Some(arriving);
        self
    }
}

/// Where the ranks of `key`'s launch wrote it under `root`.
pub fn ckpt_path(root: &Path, key: &FileKey) -> PathBuf {
    let generation_dir = root.join("jobs").join(key.job.to_string()).join(key.generation.to_string());
    crate::checkpoints::steps::ckpt_dir(&generation_dir).join(step_dir_name(key.step)).join(&key.file)
}

/// Where a restore puts `key` under `root` (the path `fetch_to_path` is given).
pub fn restore_path(root: &Path, key: &FileKey) -> PathBuf {
    root.join("restore").join(key.job.to_string()).join(key.generation.to_string()).join(step_dir_name(key.step)).join(&key.file)
}

impl Resolve for DirResolver {
    fn locate(&self, key: &FileKey) -> Option<Located> {
        // A name of the format only, and a regular file reached from the root without following
        // a link at any step (`safe_fs`): a link a rank left in its directory, its `ckpt` or a
        // `step-*` directory included, must not let a peer read another file of this node.
        crate::safe_fs::check_name(&key.file).ok()?;
        for root in &self.roots {
            let Ok(top) = crate::safe_fs::Dir::open(&root.dir) else { continue };
            for path in [ckpt_path(&root.dir, key), restore_path(&root.dir, key)] {
                let Ok(rel) = path.strip_prefix(&root.dir) else { continue };
                if top.open_file(rel).is_ok() {
                    return Some(Located { path, read_pacer: root.read_pacer.clone(), root: root.dir.clone() });
                }
            }
        }
        None
    }

    fn pending(&self, key: &FileKey) -> Option<Pending> {
        self.arriving.as_ref()?.pending(key)
    }
}

/// The files this node is fetching, so that a peer asking for one waits for it rather than
/// being refused (a relay: the restore plan may route a file through this node).
#[derive(Debug)]
pub struct Arriving {
    timeout: Duration,
    keys: Mutex<HashMap<FileKey, watch::Sender<bool>>>,
}

impl Arriving {
    /// A peer asking for an arriving file waits at most `timeout` for it.
    pub fn new(timeout: Duration) -> Arc<Arriving> {
        Arc::new(Arriving { timeout, keys: Mutex::new(HashMap::new()) })
    }

    /// Registers `key` as being fetched; the guard's `complete` (after the file is under its
    /// final name) releases the waiters, dropping it without that tells them it is not coming.
    pub fn begin(self: &Arc<Self>, key: FileKey) -> Arrival {
        let (tx, _) = watch::channel(false);
        self.keys().insert(key.clone(), tx);
        Arrival { arriving: self.clone(), key: Some(key) }
    }

    /// Whether `key` is arriving, and how to wait for it.
    pub fn pending(&self, key: &FileKey) -> Option<Pending> {
        self.keys().get(key).map(|tx| Pending { done: tx.subscribe(), timeout: self.timeout })
    }

    fn finish(&self, key: &FileKey, complete: bool) {
        if let Some(tx) = self.keys().remove(key) {
            tx.send_replace(complete);
        }
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<FileKey, watch::Sender<bool>>> {
        // A poisoned map is still a valid map.
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A file being fetched (`Arriving::begin`).
#[derive(Debug)]
pub struct Arrival {
    arriving: Arc<Arriving>,
    key: Option<FileKey>,
}

impl Arrival {
    /// The file is complete under its final name: peers waiting for it get it.
    pub fn complete(mut self) {
        if let Some(key) = self.key.take() {
            self.arriving.finish(&key, true);
        }
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.arriving.finish(&key, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    #[test]
    fn a_step_directory_swapped_for_a_link_after_locate_is_refused() {
        let root = std::env::temp_dir().join(format!("motley-resolve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let key = FileKey { job: 1, generation: 1, step: 1, file: "manifest.json".into() };
        let path = ckpt_path(&root, &key);
        let step = path.parent().unwrap().to_path_buf();
        std::fs::create_dir_all(&step).unwrap();
        std::fs::write(&path, "mine").unwrap();
        let elsewhere = root.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("manifest.json"), "not the rank's").unwrap();
        let resolver = DirResolver::new(vec![Root { dir: root.clone(), read_pacer: None }]);
        let at = resolver.locate(&key).expect("held");
        let mut text = String::new();
        at.open().unwrap().read_to_string(&mut text).unwrap();
        assert_eq!(text, "mine");
        // The rank swaps its step directory for a link once the file was found.
        std::fs::rename(&step, root.join("moved")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &step).unwrap();
        assert_eq!(at.open().unwrap_err().kind(), std::io::ErrorKind::PermissionDenied);
        assert!(resolver.locate(&key).is_none(), "not held through a link");
        // Nor a name outside the format, even where such a file is.
        std::fs::write(root.join("moved/secret"), "s").unwrap();
        std::fs::remove_file(&step).unwrap();
        std::fs::rename(root.join("moved"), &step).unwrap();
        assert!(resolver.locate(&FileKey { file: "secret".into(), ..key.clone() }).is_none());
        assert!(resolver.locate(&key).is_some());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
