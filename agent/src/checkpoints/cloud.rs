//! The checkpoint cloud tier: a launch whose envs carry `MOTLEY_CKPT_CLOUD=URL` has its whole
//! disk steps uploaded (by `tiers::Tierer::cloud_pass`) to
//! `URL/jobs/{job}/{generation}/step-{S:08}/{file}` through `object_store`: `file:///ABS/PATH`
//! always, `s3://`, `gs://`, `az://` with the features `cloud-s3`, `cloud-gcs`, `cloud-azure`
//! (credentials from the agent's environment, as each store's builder reads them:
//! `AWS_ACCESS_KEY_ID`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_KEY`, ...).
//!
//! Order is the commit protocol: every file a node's pieces list first (a few at a time), then
//! the pieces, then `manifest.json` where this node has one. A reader that finds a piece finds
//! every file it lists; one that finds `manifest.json` finds the whole step. What went up is
//! recorded in the disk step's `.cloud.json` (written atomically after each object), so an
//! agent that restarts neither uploads again nor forgets what it holds in the cloud.
//!
//! Every byte is checked against the piece's chunk crcs on its way up and on its way down
//! (`cloud_get_to_path`): a corrupt copy is never uploaded nor placed.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use motley_checkpoint::{CkptError, FileEntry, Manifest};
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, ObjectStoreScheme, WriteMultipart};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;

use crate::error::{AgentError, Result};

/// The marker in a disk step directory recording what of it is in the cloud.
pub const MARKER: &str = ".cloud.json";
/// Files at most this long go up in one request; longer ones in parts of this size (S3 takes
/// parts of 5 MiB or more).
pub const PART_BYTES: usize = 16 << 20;
/// Uploads of one step at a time.
pub const CONCURRENCY: usize = 4;

/// What of a disk step is in the cloud, and where.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    /// The `MOTLEY_CKPT_CLOUD` they went to: a job given another URL uploads again.
    pub url: String,
    /// The files uploaded, in the order they completed.
    pub uploaded: Vec<String>,
    /// Every file of the step this node has is up, pieces and manifest included.
    #[serde(default)]
    pub complete: bool,
}

/// The marker of `step_dir` (`ROOT/jobs/J/G/ckpt/step-S`), if there is one that parses and
/// is the agent's: the step directory may be the ranks' (a rank that forged one would have the
/// agent report, and restore from the cloud, files it names), so it is read without following a
/// link (`safe_fs`), only a regular file of the agent's own uid with no other link counts, and
/// every name in it must be a checkpoint file name.
pub fn read_marker(step_dir: &Path) -> Option<Marker> {
    let dir = crate::safe_fs::open_under(step_dir, 5).ok()?;
    let f = dir.open_file(MARKER).ok()?;
    let meta = f.metadata().ok()?;
    let (uid, links) = (std::os::unix::fs::MetadataExt::uid(&meta), std::os::unix::fs::MetadataExt::nlink(&meta));
    if uid != crate::safe_fs::euid() || links != 1 {
        tracing::warn!("{}: not the agent's own marker (uid {uid}, {links} links); ignored", step_dir.join(MARKER).display());
        return None;
    }
    let m: Marker = serde_json::from_reader(std::io::BufReader::new(f)).ok()?;
    if let Some(e) = m.uploaded.iter().find_map(|n| crate::safe_fs::check_name(n).err()) {
        tracing::warn!("{}: {e}; the marker is ignored", step_dir.join(MARKER).display());
        return None;
    }
    Some(m)
}

/// Written through a temporary name, fsynced, renamed, 0600, in the step directory reached
/// without following a link (`safe_fs`).
pub fn write_marker(step_dir: &Path, m: &Marker) -> Result<()> {
    let text = serde_json::to_vec(m).expect("a marker serializes");
    crate::safe_fs::open_under(step_dir, 5)?.write_atomic(MARKER, &text)
}

/// An object store and the prefix the URL names in it.
#[derive(Clone, Debug)]
pub struct Cloud {
    pub url: String,
    pub store: Arc<dyn ObjectStore>,
    pub prefix: Key,
    /// See `PART_BYTES` (smaller in tests, to go through the multipart path).
    pub part_bytes: usize,
}

impl Cloud {
    /// The store `url` names. A scheme whose feature this build lacks is an error naming it.
    pub fn open(url: &str) -> Result<Cloud> {
        let bad = |message: String| AgentError::CloudUrl { url: url.into(), message };
        let parsed = url::Url::parse(url).map_err(|e| bad(format!("not a URL ({e})")))?;
        let (scheme, prefix) = ObjectStoreScheme::parse(&parsed).map_err(|e| bad(e.to_string()))?;
        let feature =
            |feature: &'static str, on: bool| if on { Ok(()) } else { Err(AgentError::CloudFeature { url: url.into(), feature }) };
        let store: Arc<dyn ObjectStore> = match scheme {
            // fsync: a checkpoint is committed only once its bytes are on the medium.
            ObjectStoreScheme::Local => Arc::new(object_store::local::LocalFileSystem::new().with_fsync(true)),
            ObjectStoreScheme::AmazonS3 => {
                feature("cloud-s3", cfg!(feature = "cloud-s3"))?;
                from_env(&parsed).map_err(|e| bad(e.to_string()))?
            }
            ObjectStoreScheme::GoogleCloudStorage => {
                feature("cloud-gcs", cfg!(feature = "cloud-gcs"))?;
                from_env(&parsed).map_err(|e| bad(e.to_string()))?
            }
            ObjectStoreScheme::MicrosoftAzure => {
                feature("cloud-azure", cfg!(feature = "cloud-azure"))?;
                from_env(&parsed).map_err(|e| bad(e.to_string()))?
            }
            other => return Err(bad(format!("{other:?} is not a checkpoint cloud"))),
        };
        Ok(Cloud { url: url.into(), store, prefix, part_bytes: PART_BYTES })
    }

    /// `PREFIX/jobs/{job}/{generation}/step-{S:08}/{file}`.
    pub fn key(&self, job: i64, generation: i64, step: u64, file: &str) -> Key {
        let mut k = self.prefix.clone();
        for part in ["jobs".to_string(), job.to_string(), generation.to_string(), motley_checkpoint::manifest::step_dir_name(step)] {
            k = k.clone().join(part);
        }
        k.join(file)
    }

    /// Bytes `range` of the object at `key`.
    pub async fn get_range(&self, key: &Key, range: Range<u64>) -> Result<Bytes> {
        self.store.get_range(key, range).await.map_err(|err| AgentError::Cloud { op: "get_range", key: key.to_string(), err })
    }

    /// Uploads `path` to `key`, checked against `entry` (if given) while it is read.
    pub async fn put_file(&self, path: &Path, key: &Key, entry: Option<&FileEntry>) -> Result<u64> {
        let f = tokio::fs::File::open(path).await.map_err(|err| AgentError::Io { what: "reading", path: path.to_path_buf(), err })?;
        self.put_opened(f, path, key, entry).await
    }

    /// `put_file` of a file already open (`path` names it in messages only).
    pub async fn put_opened(&self, mut f: tokio::fs::File, path: &Path, key: &Key, entry: Option<&FileEntry>) -> Result<u64> {
        let io = |err| AgentError::Io { what: "reading", path: path.to_path_buf(), err };
        let len = f.metadata().await.map_err(io)?.len();
        let mut verify = entry.map(Verifier::new);
        let cloud = |op, err| AgentError::Cloud { op, key: key.to_string(), err };
        let corrupt = |err| AgentError::Corrupt { what: path.display().to_string(), err };
        if len as usize <= self.part_bytes {
            let mut buf = Vec::with_capacity(len as usize);
            f.read_to_end(&mut buf).await.map_err(io)?;
            if let Some(v) = verify.as_mut() {
                v.feed(&buf).map_err(corrupt)?;
            }
            if let Some(v) = verify {
                v.finish().map_err(corrupt)?;
            }
            self.store.put(key, Bytes::from(buf).into()).await.map_err(|e| cloud("put", e))?;
            return Ok(len);
        }
        let upload = self.store.put_multipart(key).await.map_err(|e| cloud("put_multipart", e))?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, self.part_bytes);
        let mut buf = vec![0u8; self.part_bytes];
        let checked: std::result::Result<(), AgentError> = async {
            loop {
                let n = f.read(&mut buf).await.map_err(io)?;
                if n == 0 {
                    break;
                }
                if let Some(v) = verify.as_mut() {
                    v.feed(&buf[..n]).map_err(corrupt)?;
                }
                w.wait_for_capacity(2).await.map_err(|e| cloud("put_part", e))?;
                w.write(&buf[..n]);
            }
            match verify {
                Some(v) => v.finish().map_err(corrupt),
                None => Ok(()),
            }
        }
        .await;
        match checked {
            Ok(()) => {
                w.finish().await.map_err(|e| cloud("complete", e))?;
                Ok(len)
            }
            Err(e) => {
                let _ = w.abort().await; // no half object left behind
                Err(e)
            }
        }
    }
}

#[cfg(any(feature = "cloud-s3", feature = "cloud-gcs", feature = "cloud-azure"))]
fn from_env(url: &url::Url) -> std::result::Result<Arc<dyn ObjectStore>, object_store::Error> {
    // The stores' own variables (AWS_*, GOOGLE_*, AZURE_*) from the agent's environment: the
    // operator's credentials, never the job's.
    let (store, _) = object_store::parse_url_opts(url, std::env::vars())?;
    Ok(Arc::from(store))
}

#[cfg(not(any(feature = "cloud-s3", feature = "cloud-gcs", feature = "cloud-azure")))]
fn from_env(_url: &url::Url) -> std::result::Result<Arc<dyn ObjectStore>, object_store::Error> {
    unreachable!("a cloud scheme is refused before its store is made when no cloud feature is on")
}

/// The chunk crcs of a file checked as its bytes stream past, one chunk's state at a time.
pub struct Verifier<'a> {
    entry: &'a FileEntry,
    chunk: usize,
    in_chunk: u64,
    crc: u32,
    total: u64,
}

impl<'a> Verifier<'a> {
    pub fn new(entry: &'a FileEntry) -> Verifier<'a> {
        Verifier { entry, chunk: 0, in_chunk: 0, crc: 0, total: 0 }
    }

    fn chunk_bytes(&self) -> u64 {
        self.entry.chunk_bytes.max(1)
    }

    fn check(&self) -> std::result::Result<(), CkptError> {
        let e = self.entry;
        let Some(&want) = e.crc32c.get(self.chunk) else {
            return Err(CkptError::Format {
                path: e.file.clone().into(),
                message: format!("the manifest lists {} chunk crcs, the file has more chunks of {}", e.crc32c.len(), e.chunk_bytes),
            });
        };
        if self.crc != want {
            let start = self.chunk as u64 * self.chunk_bytes();
            return Err(CkptError::Crc {
                file: e.file.clone(),
                chunk: self.chunk,
                start,
                end: (start + self.chunk_bytes()).min(e.bytes),
                got: self.crc,
                want,
            });
        }
        Ok(())
    }

    /// The next bytes of the file.
    pub fn feed(&mut self, mut data: &[u8]) -> std::result::Result<(), CkptError> {
        while !data.is_empty() {
            let n = ((self.chunk_bytes() - self.in_chunk) as usize).min(data.len());
            self.crc = crc32c::crc32c_append(self.crc, &data[..n]);
            self.in_chunk += n as u64;
            self.total += n as u64;
            if self.total > self.entry.bytes {
                return Err(CkptError::Size { file: self.entry.file.clone(), got: self.total, want: self.entry.bytes });
            }
            if self.in_chunk == self.chunk_bytes() {
                self.check()?;
                (self.chunk, self.in_chunk, self.crc) = (self.chunk + 1, 0, 0);
            }
            data = &data[n..];
        }
        Ok(())
    }

    /// The file ended: its length, its last chunk, and the count of chunks.
    pub fn finish(mut self) -> std::result::Result<(), CkptError> {
        if self.total != self.entry.bytes {
            return Err(CkptError::Size { file: self.entry.file.clone(), got: self.total, want: self.entry.bytes });
        }
        if self.in_chunk > 0 {
            self.check()?;
            self.chunk += 1;
        }
        if self.chunk != self.entry.crc32c.len() {
            return Err(CkptError::Format {
                path: self.entry.file.clone().into(),
                message: format!("the manifest lists {} chunk crcs, the file has {} chunks", self.entry.crc32c.len(), self.chunk),
            });
        }
        Ok(())
    }
}

/// What `upload_step` did.
#[derive(Debug, Default, PartialEq)]
pub struct Uploaded {
    pub files: usize,
    pub bytes: u64,
}

/// Uploads what of `step_dir` (a whole disk step of this node) `cloud` lacks according to the
/// step's marker: the files `pieces` list (`CONCURRENCY` at a time), then the pieces, then
/// `manifest.json` if the step has one. Stops at the first failure, before any piece that
/// lists a file not uploaded; the marker keeps what did go up.
pub async fn upload_step(
    cloud: &Cloud,
    job: i64,
    generation: i64,
    step: u64,
    step_dir: &Path,
    pieces: &[(PathBuf, Manifest)],
) -> Result<Uploaded> {
    let mut marker = match read_marker(step_dir) {
        Some(m) if m.url == cloud.url => m,
        _ => Marker { url: cloud.url.clone(), ..Default::default() },
    };
    let mut done = Uploaded::default();
    let mut files: Vec<FileEntry> = pieces.iter().flat_map(|(_, m)| crate::checkpoints::steps::piece_files(m).cloned()).collect();
    files.sort_by(|a, b| a.file.cmp(&b.file));
    files.dedup_by(|a, b| a.file == b.file);
    files.retain(|f| !marker.uploaded.contains(&f.file));
    let sem = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    // The step directory may be the ranks': every file is opened through its handle, never a
    // link (`safe_fs`), each name the format's.
    let dir = crate::safe_fs::open_under(step_dir, 5)?;
    for f in files {
        crate::safe_fs::check_name(&f.file)?;
        let (cloud, sem) = (cloud.clone(), sem.clone());
        let path = step_dir.join(&f.file);
        let opened = tokio::fs::File::from_std(dir.open_file(&f.file)?);
        tasks.spawn(async move {
            let _slot = sem.acquire_owned().await.expect("the semaphore is never closed");
            let key = cloud.key(job, generation, step, &f.file);
            cloud.put_opened(opened, &path, &key, Some(&f)).await.map(|n| (f.file, n))
        });
    }
    let mut failed = None;
    while let Some(r) = tasks.join_next().await {
        match r.expect("an upload task does not panic") {
            Ok((file, n)) => {
                marker.uploaded.push(file);
                (done.files, done.bytes) = (done.files + 1, done.bytes + n);
                write_marker(step_dir, &marker)?;
            }
            // The others finish (or fail) first: what did go up is recorded.
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    // The commit order: pieces only once every file they list is up, the manifest last.
    let mut rest: Vec<PathBuf> = pieces.iter().map(|(p, _)| p.clone()).collect();
    let manifest = step_dir.join(motley_checkpoint::manifest::MANIFEST);
    if dir.stat(motley_checkpoint::manifest::MANIFEST).is_some() {
        rest.push(manifest);
    }
    for path in rest {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if marker.uploaded.contains(&name) {
            continue;
        }
        let opened = tokio::fs::File::from_std(dir.open_file(&name)?);
        let n = cloud.put_opened(opened, &path, &cloud.key(job, generation, step, &name), None).await?;
        marker.uploaded.push(name);
        (done.files, done.bytes) = (done.files + 1, done.bytes + n);
        write_marker(step_dir, &marker)?;
    }
    if !marker.complete {
        marker.complete = true;
        write_marker(step_dir, &marker)?;
    }
    Ok(done)
}

/// Bytes `range` of a checkpoint file in the cloud `url` names (the restore path's ranged read).
pub async fn cloud_get_range(url: &str, job: i64, generation: i64, step: u64, file: &str, range: Range<u64>) -> Result<Bytes> {
    let cloud = Cloud::open(url)?;
    cloud.get_range(&cloud.key(job, generation, step, file), range).await
}

/// Fetches `entry.file` of the step from the cloud to `dest`: through `dest.tmp.PID`, checked
/// chunk by chunk against `entry` as it arrives, fsynced, renamed, the directory fsynced
/// (directories made 0700, the file 0600). A corrupt or short object is refused naming the
/// chunk, and nothing is left at `dest`.
pub async fn cloud_get_to_path(url: &str, job: i64, generation: i64, step: u64, entry: &FileEntry, dest: &Path) -> Result<()> {
    let cloud = Cloud::open(url)?;
    let key = cloud.key(job, generation, step, &entry.file);
    let dir = dest.parent().unwrap_or(Path::new("."));
    crate::workdir::create_dirs(dir)?;
    let mut tmp = dest.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let got: Result<()> = async {
        let io = |err| AgentError::Io { what: "writing", path: tmp.clone(), err };
        let mut out = tokio::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).await.map_err(io)?;
        let cloud_err = |err| AgentError::Cloud { op: "get", key: key.to_string(), err };
        let mut stream = cloud.store.get(&key).await.map_err(cloud_err)?.into_stream();
        let mut verify = Verifier::new(entry);
        let corrupt = |err| AgentError::Corrupt { what: format!("{} (cloud {key})", entry.file), err };
        while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(cloud_err)?;
            verify.feed(&bytes).map_err(corrupt)?;
            out.write_all(&bytes).await.map_err(io)?;
        }
        verify.finish().map_err(corrupt)?;
        out.sync_all().await.map_err(io)?;
        Ok(())
    }
    .await;
    if let Err(e) = got {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, dest).map_err(|err| AgentError::Io { what: "renaming into", path: dest.to_path_buf(), err })?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|err| AgentError::Io { what: "syncing", path: dir.to_path_buf(), err })
}
