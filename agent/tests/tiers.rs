//! The checkpoint tiers on real files in temporary directories: memory to disk (verified,
//! pruned, refused when half-written, corrupt or the disk is full), the cloud through a file://
//! store (order, restart, corruption on the way down), and the holdings of each tier.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use motley_agent::checkpoints::cloud::{self, Cloud};
use motley_agent::checkpoints::holdings::Holdings;
use motley_agent::checkpoints::steps::ckpt_dir;
use motley_agent::checkpoints::tiers::{Space, Tierer};
use motley_checkpoint::manifest::{piece_file_name, rank_file_name, step_dir_name, unit_file_name};
use motley_checkpoint::{Block, Manifest, Part, RankEntry, UnitEntry, UnitKey, FORMAT};
use motley_proto::v1::Launch;

use crate::common;
use common::scratch;

const CHUNK: u64 = 64;

fn gen_dir(root: &Path, job: i64, generation: i64) -> PathBuf {
    root.join(format!("jobs/{job}/{generation}"))
}

fn step_dir(root: &Path, job: i64, generation: i64, step: u64) -> PathBuf {
    ckpt_dir(&gen_dir(root, job, generation)).join(step_dir_name(step))
}

/// Rank `rank`'s share of `step` under `root` as a rank writes it: its unit (`bytes` long, a
/// pattern of the step), its rank file, then its piece with the real chunk crcs; `manifest`:
/// also the merged manifest.
fn write_step(root: &Path, job: i64, step: u64, rank: u32, bytes: usize, manifest: bool) -> PathBuf {
    let dir = step_dir(root, job, 1, step);
    std::fs::create_dir_all(&dir).unwrap();
    let key = UnitKey { block: Block::Layer(rank), part: Part::Model, tp_rank: 0, tp_size: 1 };
    let unit = unit_file_name(&key);
    let data: Vec<u8> = (0..bytes).map(|i| (i as u64 * 7 + step) as u8).collect();
    std::fs::write(dir.join(&unit), &data).unwrap();
    let rank_file = rank_file_name(rank);
    std::fs::write(dir.join(&rank_file), b"rank state").unwrap();
    let piece = Manifest {
        format: FORMAT.into(),
        step,
        layers: 2,
        world_size: 2,
        units: vec![UnitEntry { key, file: motley_checkpoint::crc::file_entry(&unit, &data, CHUNK), tensors: Default::default() }],
        ranks: vec![RankEntry { rank, file: motley_checkpoint::crc::file_entry(&rank_file, b"rank state", CHUNK) }],
        lost_ranks: vec![],
    };
    let text = serde_json::to_vec(&piece).unwrap();
    std::fs::write(dir.join(piece_file_name(rank)), &text).unwrap();
    if manifest {
        std::fs::write(dir.join("manifest.json"), &text).unwrap();
    }
    dir
}

/// The launch directory with the records of this node's ranks (each writes a piece).
fn launch_dir(work: &Path, job: i64, ranks: &[u32]) {
    let g = gen_dir(work, job, 1);
    std::fs::create_dir_all(&g).unwrap();
    for r in ranks {
        std::fs::write(g.join(format!("rank-{r}.json")), b"{}").unwrap();
    }
}

fn launch(job: i64, envs: &[(&str, &str)]) -> Launch {
    Launch { job, generation: 1, envs: envs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), ..Default::default() }
}

fn steps_in(root: &Path, job: i64) -> Vec<u64> {
    motley_agent::checkpoints::steps::step_dirs(root).into_iter().filter(|s| s.job == job).map(|s| s.step).collect()
}

#[test]
fn a_whole_memory_step_moves_to_disk_verified_and_the_older_memory_step_goes() {
    let (work, shm) = (scratch("move-work"), scratch("move-shm"));
    launch_dir(&work, 7, &[0]);
    let t = Tierer::new(work.clone(), Some(shm.clone()));
    let mem10 = write_step(&shm, 7, 10, 0, 200, true);
    let notes = t.tier_pass();
    assert!(notes.iter().any(|n| n.contains("step 10") && n.contains("copied from memory to disk, verified")), "{notes:?}");
    let disk10 = step_dir(&work, 7, 1, 10);
    for f in ["layer.00000.model.tp0-1.safetensors", "rank.00000.safetensors", "manifest.rank.00000.json", "manifest.json"] {
        assert_eq!(std::fs::read(disk10.join(f)).unwrap(), std::fs::read(mem10.join(f)).unwrap(), "{f}");
        assert_eq!(std::fs::metadata(disk10.join(f)).unwrap().permissions().mode() & 0o777, 0o600, "{f}");
    }
    assert_eq!(std::fs::metadata(&disk10).unwrap().permissions().mode() & 0o777, 0o700);
    assert!(motley_checkpoint::Manifest::load(&disk10).unwrap().verify(&disk10).is_ok());
    assert!(std::fs::read_dir(&disk10).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().contains(".tmp.")));
    assert_eq!(steps_in(&shm, 7), [10], "the newest whole step stays in memory");
    assert!(t.tier_pass().is_empty(), "nothing new: nothing copied again");

    write_step(&shm, 7, 20, 0, 300, false);
    let notes = t.tier_pass();
    assert!(notes.iter().any(|n| n.contains("step 10: removed from memory (on disk)")), "{notes:?}");
    assert_eq!(steps_in(&shm, 7), [20]);
    assert_eq!(steps_in(&work, 7), [10, 20]);

    // The launch pruned from disk: its memory goes too.
    std::fs::remove_dir_all(gen_dir(&work, 7, 1)).unwrap();
    t.tier_pass();
    assert!(steps_in(&shm, 7).is_empty());
}

#[test]
fn a_step_without_the_pieces_of_a_lost_replicas_ranks_is_whole_when_the_members_name_them() {
    // This node ran ranks 0 and 1; rank 1's replica was lost and the job kept going, so rank 1
    // wrote no piece of step 10 (docs/keep-going.md). Rank 0's piece names it lost: the step is
    // whole here. Step 20 lacks rank 1's piece and names nobody lost: not whole, not moved.
    let (work, shm) = (scratch("lost-work"), scratch("lost-shm"));
    launch_dir(&work, 8, &[0, 1]);
    let t = Tierer::new(work.clone(), Some(shm.clone()));
    let mem10 = write_step(&shm, 8, 10, 0, 200, false);
    let piece = mem10.join(piece_file_name(0));
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&piece).unwrap()).unwrap();
    m.lost_ranks = vec![1];
    std::fs::write(&piece, serde_json::to_vec(&m).unwrap()).unwrap();
    write_step(&shm, 8, 20, 0, 200, false);
    let notes = t.tier_pass();
    assert!(notes.iter().any(|n| n.contains("step 10") && n.contains("copied from memory to disk, verified")), "{notes:?}");
    assert_eq!(steps_in(&work, 8), [10], "{notes:?}");
    let merged = Manifest::load(&step_dir(&work, 8, 1, 10)).unwrap();
    assert_eq!(merged.lost_ranks, [1], "the lost ranks survive the copy and the merge");
}

#[test]
fn keep_prunes_disk_but_never_the_newest_whole_step_nor_a_pinned_one() {
    let work = scratch("keep");
    launch_dir(&work, 3, &[0]);
    let t = Tierer::new(work.clone(), None);
    let err = t.launched(&launch(3, &[("MOTLEY_CKPT_KEEP", "0")])).unwrap_err().to_string();
    assert!(err.contains("MOTLEY_CKPT_KEEP=0") && err.contains(">= 1"), "{err}");
    t.launched(&launch(3, &[("MOTLEY_CKPT_KEEP", "2")])).unwrap();
    for step in [10, 20, 30, 40] {
        write_step(&work, 3, step, 0, 100, false);
    }
    // Newer, not whole: a unit shorter than its piece says (still being written).
    let partial = write_step(&work, 3, 50, 0, 100, false);
    std::fs::write(partial.join("layer.00000.model.tp0-1.safetensors"), [1u8; 10]).unwrap();
    t.pin(3, 10);
    let notes = t.tier_pass();
    assert_eq!(steps_in(&work, 3), [10, 30, 40, 50], "{notes:?}");
    assert!(notes.iter().any(|n| n.contains("step 20: removed from disk (keep 2)")), "{notes:?}");
    t.unpin(3, 10);
    t.tier_pass();
    assert_eq!(steps_in(&work, 3), [30, 40, 50]);
    // keep 1: the newest whole step stays though a newer, unfinished one is there.
    t.launched(&launch(3, &[("MOTLEY_CKPT_KEEP", "1")])).unwrap();
    t.tier_pass();
    assert_eq!(steps_in(&work, 3), [40, 50]);
    // The unfinished one finishes: it is the newest whole step, 40 goes.
    write_step(&work, 3, 50, 0, 100, false);
    t.tier_pass();
    assert_eq!(steps_in(&work, 3), [50]);
}

#[test]
fn a_half_written_or_corrupt_memory_step_is_not_moved() {
    let (work, shm) = (scratch("half-work"), scratch("half-shm"));
    launch_dir(&work, 4, &[0, 1]);
    let t = Tierer::new(work.clone(), Some(shm.clone()));
    // Rank 0's unit at another length than its piece says.
    let dir = write_step(&shm, 4, 10, 0, 200, false);
    write_step(&shm, 4, 10, 1, 200, false);
    std::fs::write(dir.join("layer.00000.model.tp0-1.safetensors"), [0u8; 50]).unwrap();
    t.tier_pass();
    assert!(!step_dir(&work, 4, 1, 10).exists(), "a half-written step is not moved");
    // Rank 1 of this node has not written its piece of step 20.
    write_step(&shm, 4, 20, 0, 200, false);
    t.tier_pass();
    assert!(!step_dir(&work, 4, 1, 20).exists(), "a step missing a local rank's piece is not moved");
    // Whole lengths, one byte flipped: refused naming the chunk, nothing placed.
    write_step(&shm, 4, 20, 1, 200, false);
    let unit = step_dir(&shm, 4, 1, 20).join("layer.00001.model.tp0-1.safetensors");
    let mut bytes = std::fs::read(&unit).unwrap();
    bytes[130] ^= 0xff;
    std::fs::write(&unit, bytes).unwrap();
    let notes = t.tier_pass();
    assert!(notes.iter().any(|n| n.contains("step 20: not moved to disk") && n.contains("chunk 2 (bytes 128..192)")), "{notes:?}");
    let disk20 = step_dir(&work, 4, 1, 20);
    assert!(!disk20.join("layer.00001.model.tp0-1.safetensors").exists());
    assert!(!disk20.join("manifest.rank.00001.json").exists(), "no piece names a file not placed");
}

#[test]
fn a_full_disk_refuses_with_the_numbers_and_keeps_the_previous_step() {
    let (work, shm) = (scratch("full-work"), scratch("full-shm"));
    launch_dir(&work, 5, &[0]);
    write_step(&shm, 5, 10, 0, 1000, false);
    Tierer::new(work.clone(), Some(shm.clone())).tier_pass();
    assert_eq!(steps_in(&work, 5), [10]);
    let full = Tierer::new(work.clone(), Some(shm.clone())).with_space(|_| Ok(Space { free: 1500, total: 10_000 }));
    write_step(&shm, 5, 20, 0, 1000, false);
    let notes = full.tier_pass();
    let piece = std::fs::metadata(step_dir(&shm, 5, 1, 20).join("manifest.rank.00000.json")).unwrap().len();
    let need = 1000 + 10 + piece;
    let note = notes.iter().find(|n| n.contains("step 20: not moved to disk")).unwrap_or_else(|| panic!("{notes:?}"));
    assert!(note.contains(&format!("needs {need} bytes plus a margin of 500")) && note.contains("1500 free"), "{note}");
    assert_eq!(steps_in(&work, 5), [10], "the previous step stays the restore point");
    assert!(step_dir(&shm, 5, 1, 20).is_dir(), "the newest step stays in memory");
}

type BoxStream<T> = Pin<Box<dyn tokio_stream::Stream<Item = T> + Send + 'static>>;

/// A local store that records each object's name once its put completed.
#[derive(Debug)]
struct Recorder {
    inner: object_store::local::LocalFileSystem,
    log: Arc<Mutex<Vec<String>>>,
}

impl std::fmt::Display for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recorder({})", self.inner)
    }
}

use object_store::path::Path as Key;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMultipartOptions, PutOptions, PutPayload,
    PutResult,
};

#[async_trait::async_trait]
impl ObjectStore for Recorder {
    async fn put_opts(&self, location: &Key, payload: PutPayload, opts: PutOptions) -> object_store::Result<PutResult> {
        let r = self.inner.put_opts(location, payload, opts).await?;
        self.log.lock().unwrap().push(location.filename().unwrap_or_default().to_string());
        Ok(r)
    }
    async fn put_multipart_opts(&self, location: &Key, opts: PutMultipartOptions) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.log.lock().unwrap().push(format!("multipart {location}"));
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(&self, location: &Key, options: GetOptions) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }
    fn delete_stream(&self, locations: BoxStream<object_store::Result<Key>>) -> BoxStream<object_store::Result<Key>> {
        self.inner.delete_stream(locations)
    }
    fn list(&self, prefix: Option<&Key>) -> BoxStream<object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(&self, prefix: Option<&Key>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(&self, from: &Key, to: &Key, options: CopyOptions) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

fn pieces_of(dir: &Path) -> Vec<(PathBuf, Manifest)> {
    motley_agent::checkpoints::steps::piece_paths(dir)
        .into_iter()
        .map(|p| {
            let m = motley_checkpoint::manifest::read_json(&p).unwrap();
            (p, m)
        })
        .collect()
}

#[tokio::test]
async fn cloud_upload_goes_units_then_pieces_then_manifest_and_a_marker_survives_a_restart() {
    let (work, bucket) = (scratch("order-work"), scratch("order-bucket"));
    let dir = write_step(&work, 8, 10, 0, 300, false);
    write_step(&work, 8, 10, 1, 300, true);
    let url = format!("file://{}/ckpts", bucket.display());
    let log = Arc::new(Mutex::new(vec![]));
    let store = Recorder { inner: object_store::local::LocalFileSystem::new(), log: log.clone() };
    let cloud = Cloud { store: Arc::new(store), ..Cloud::open(&url).unwrap() };
    let up = cloud::upload_step(&cloud, 8, 1, 10, &dir, &pieces_of(&dir)).await.unwrap();
    assert_eq!(up.files, 7);
    let order = log.lock().unwrap().clone();
    let at = |f: &str| order.iter().position(|x| x == f).unwrap_or_else(|| panic!("{f} not uploaded: {order:?}"));
    for data in
        ["layer.00000.model.tp0-1.safetensors", "layer.00001.model.tp0-1.safetensors", "rank.00000.safetensors", "rank.00001.safetensors"]
    {
        assert!(at(data) < at("manifest.rank.00000.json") && at(data) < at("manifest.rank.00001.json"), "{order:?}");
    }
    assert_eq!(order.last().map(String::as_str), Some("manifest.json"), "the commit marker last: {order:?}");
    let object = bucket.join("ckpts/jobs/8/1/step-00000010/layer.00001.model.tp0-1.safetensors");
    assert_eq!(std::fs::read(&object).unwrap(), std::fs::read(dir.join("layer.00001.model.tp0-1.safetensors")).unwrap());
    let marker = cloud::read_marker(&dir).unwrap();
    assert!(marker.complete && marker.uploaded.len() == 7, "{marker:?}");
    assert_eq!(std::fs::metadata(dir.join(".cloud.json")).unwrap().permissions().mode() & 0o777, 0o600);
    // Again (a restarted agent reads the marker): nothing goes up.
    log.lock().unwrap().clear();
    assert_eq!(cloud::upload_step(&cloud, 8, 1, 10, &dir, &pieces_of(&dir)).await.unwrap().files, 0);
    assert!(log.lock().unwrap().is_empty());
}

#[tokio::test]
async fn the_cloud_pass_uploads_whole_disk_steps_once_and_the_restore_refuses_a_corrupt_object() {
    let (work, bucket) = (scratch("pass-work"), scratch("pass-bucket"));
    launch_dir(&work, 9, &[0]);
    let url = format!("file://{}", bucket.display());
    let t = Tierer::new(work.clone(), None).with_part_bytes(100);
    t.launched(&launch(9, &[("MOTLEY_CKPT_CLOUD", &url)])).unwrap();
    let dir = write_step(&work, 9, 10, 0, 1000, false);
    let notes = t.cloud_pass().await;
    assert!(notes.iter().any(|n| n.contains("step 10: 3 files") && n.contains(&url)), "{notes:?}");
    // A restarted agent: nothing again.
    let again = Tierer::new(work.clone(), None);
    assert!(again.cloud_pass().await.is_empty());

    let m: Manifest = motley_checkpoint::manifest::read_json(&dir.join("manifest.rank.00000.json")).unwrap();
    let entry = &m.units[0].file;
    // Whole through the multipart path, fetched and verified.
    let dest = scratch("pass-restore").join("sub/unit");
    cloud::cloud_get_to_path(&url, 9, 1, 10, entry, &dest).await.unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), std::fs::read(dir.join(&entry.file)).unwrap());
    let range = cloud::cloud_get_range(&url, 9, 1, 10, &entry.file, 64..128).await.unwrap();
    assert_eq!(&range[..], &std::fs::read(dir.join(&entry.file)).unwrap()[64..128]);
    // One byte flipped in the store: refused naming the chunk, nothing placed.
    let object = bucket.join("jobs/9/1/step-00000010").join(&entry.file);
    let mut bytes = std::fs::read(&object).unwrap();
    bytes[700] ^= 1;
    std::fs::write(&object, bytes).unwrap();
    let dest2 = dest.with_file_name("unit2");
    let err = cloud::cloud_get_to_path(&url, 9, 1, 10, entry, &dest2).await.unwrap_err().to_string();
    assert!(err.contains("chunk 10 (bytes 640..704)") && err.contains("corrupt"), "{err}");
    assert!(!dest2.exists());
    assert!(std::fs::read_dir(dest2.parent().unwrap()).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().contains(".tmp.")));
}

#[test]
fn a_cloud_scheme_whose_feature_is_off_is_refused_by_name() {
    let t = Tierer::new(scratch("scheme"), None);
    let err = t.launched(&launch(1, &[("MOTLEY_CKPT_CLOUD", "s3://bucket/ckpt")])).unwrap_err().to_string();
    if !cfg!(feature = "cloud-s3") {
        assert!(err.contains("cloud-s3"), "{err}");
    }
    let err = Cloud::open("ftp://host/x").unwrap_err().to_string();
    assert!(err.contains("MOTLEY_CKPT_CLOUD=ftp://host/x"), "{err}");
}

#[tokio::test]
async fn holdings_report_memory_disk_and_cloud_with_crcs() {
    let (work, shm, bucket) = (scratch("hold-work"), scratch("hold-shm"), scratch("hold-bucket"));
    launch_dir(&work, 6, &[0]);
    let t = Tierer::new(work.clone(), Some(shm.clone()));
    t.launched(&launch(6, &[("MOTLEY_CKPT_CLOUD", &format!("file://{}", bucket.display()))])).unwrap();
    write_step(&shm, 6, 10, 0, 100, false);
    t.tier_pass();
    t.cloud_pass().await;
    write_step(&shm, 6, 20, 0, 100, false);
    let h = Holdings::with_memory_root(Some(shm.clone()));
    let list = h.report(&work, 1).unwrap();
    let tiers: Vec<(u64, &str, &str)> = list.iter().map(|x| (x.step, x.file.as_str(), x.tier.as_str())).collect();
    assert!(tiers.contains(&(10, "layer.00000.model.tp0-1.safetensors", "disk")), "{tiers:?}");
    assert!(tiers.contains(&(10, "layer.00000.model.tp0-1.safetensors", "memory")), "{tiers:?}");
    assert!(tiers.contains(&(10, "layer.00000.model.tp0-1.safetensors", "cloud")), "{tiers:?}");
    assert!(tiers.contains(&(20, "rank.00000.safetensors", "memory")), "{tiers:?}");
    assert!(!tiers.iter().any(|t| t.0 == 20 && t.2 != "memory"), "{tiers:?}");
    let unit = list.iter().find(|x| x.step == 20 && x.rank == -1).unwrap();
    let data: Vec<u8> = (0..100).map(|i| (i as u64 * 7 + 20) as u8).collect();
    assert_eq!((unit.chunk_bytes, unit.crc32c.clone()), (CHUNK, motley_checkpoint::crc::chunk_crcs(&data, CHUNK)));
    // Step 20 moves; pruned past keep 1 the disk copy of 10 goes, its cloud copy is still held.
    t.launched(&launch(6, &[("MOTLEY_CKPT_KEEP", "1"), ("MOTLEY_CKPT_CLOUD", &format!("file://{}", bucket.display()))])).unwrap();
    let notes = t.tier_pass();
    let list = h.report(&work, 2).unwrap();
    let at10: Vec<&str> = list.iter().filter(|x| x.step == 10).map(|x| x.tier.as_str()).collect();
    assert!(!at10.is_empty() && at10.iter().all(|t| *t == "cloud"), "{at10:?} {notes:?}");
}
