//! Hostile ranks (docs/state.md): a real agent running as root, jobs running as `nobody`, each
//! rank a small shell script that attacks what the agent touches as root in the rank's own
//! directories: a link where the tier copy writes, a link as its log, a memory-tier root made
//! before the agent, forged cloud markers and restore names. Each attack is refused or has no
//! effect outside the rank's own directory, and the agent stays live for its other jobs. A
//! scratch directory stands in for /etc: nothing here touches the real one. The harness is `hostile_ranks/node.rs`; attacks on the
//! rank files the agent reads and writes (exit codes, records, temporaries, deep trees) are in
//! `hostile_rank_files.rs`.

use crate::common;
pub(crate) mod node;

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use common::scratch;
use motley_proto::v1::{instruction, FetchRange, FetchSource, Restore, RestoreFile};
use node::{fake_etc, listing, until, Node};

/// The tier copy: a rank links its launch directory's `ckpt/step-00000001` to "/etc" and lists
/// a file `shadow` in its memory step; another step lists a proper name through the same link.
/// Neither lands outside the rank's directory nor changes an owner there.
#[test]
fn a_rank_cannot_redirect_the_tier_copy() {
    let Some(node) = Node::start("tiercopy", None) else { return };
    let etc = fake_etc(&node);
    let before = listing(&etc);
    let shadow_piece = node.piece(1, &[("shadow", b"evil1")]);
    let good_piece = node.piece(2, &[("rank.00000.safetensors", b"evil2")]);
    let run = format!(
        r#"set -e
        mkdir -p ckpt && ln -s {etc} ckpt/step-00000001 && ln -s {etc} ckpt/step-00000002
        for s in 1 2; do mkdir -p "$MOTLEY_CKPT_DIR/step-0000000$s"; done
        printf evil1 > "$MOTLEY_CKPT_DIR/step-00000001/shadow"
        cp {shadow_piece} "$MOTLEY_CKPT_DIR/step-00000001/manifest.rank.00000.json"
        printf evil2 > "$MOTLEY_CKPT_DIR/step-00000002/rank.00000.safetensors"
        cp {good_piece} "$MOTLEY_CKPT_DIR/step-00000002/manifest.rank.00000.json""#,
        etc = etc.display(),
        shadow_piece = shadow_piece.display(),
        good_piece = good_piece.display()
    );
    node.launch(1, &run);
    assert_eq!(node.exited(1), Some(0), "{}", node.agent_log());
    // The tier pass says what it did with step 2; step 1 came first in the same pass.
    let log = until("the tier pass over step 2", || Some(node.agent_log()).filter(|l| l.contains("generation 1 step 2:")));
    assert_eq!(listing(&etc), before, "nothing written into, or given away in, the stand-in for /etc");
    assert!(log.contains("step 2: not moved to disk") && log.contains("symbolic link"), "{log}");
    assert_eq!(std::fs::read_to_string(etc.join("shadow")).unwrap(), "root:secret\n");
    assert_eq!(std::fs::metadata(&etc).unwrap().uid(), 0);
    node.still_serves(2);
}

/// The log service: a rank replaces its log with a link to the agent's secrets, another with a
/// FIFO. The service refuses both (never the target's bytes, never a hang) and serves the
/// other jobs' logs.
#[test]
fn a_rank_cannot_read_the_agents_files_through_its_log() {
    let Some(node) = Node::start("logs", None) else { return };
    let secret = node.dir.join("agent.env");
    std::fs::write(&secret, "MOTLEY_TOKEN=s3cret-of-the-agent\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    node.launch(1, &format!("rm -f rank-0.log && ln -s {} rank-0.log", secret.display()));
    node.launch(2, "rm -f rank-0.log && mkfifo rank-0.log");
    assert_eq!(node.exited(1), Some(0), "{}", node.agent_log());
    assert_eq!(node.exited(2), Some(0), "{}", node.agent_log());
    for job in [1, 2] {
        let (status, body) = node.get_log(job);
        assert!(!body.contains("s3cret-of-the-agent"), "job {job}: {body}");
        assert_eq!(status, 403, "job {job}: {body}");
        assert!(body.contains("refused"), "job {job}: {body}");
    }
    node.still_serves(3);
}

/// The memory tier's root, made first by another user (its default name is predictable): the
/// agent refuses it, says which directory and what to do, and ranks write their checkpoints on
/// disk, so nothing of theirs lands in it.
#[test]
fn a_memory_root_someone_else_made_is_refused() {
    let dir = scratch("premade-shm");
    let shm = dir.join("shm-premade");
    std::fs::create_dir(&shm).unwrap();
    std::os::unix::fs::chown(&shm, Some(65534), Some(65534)).ok();
    std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o777)).unwrap();
    let Some(node) = Node::start("premade", Some(&shm)) else { return };
    let log = node.agent_log();
    assert!(log.contains(&shm.display().to_string()) && log.contains("--shm-dir") && log.contains("on disk"), "{log}");
    node.launch(1, r#"echo "ckpt=$MOTLEY_CKPT_DIR""#);
    assert_eq!(node.exited(1), Some(0));
    let (_, body) = node.get_log(1);
    assert_eq!(body, format!("ckpt={}\n", node.work.join("jobs/1/1/ckpt").display()), "checkpoints go to disk");
    assert!(std::fs::read_dir(&shm).unwrap().next().is_none(), "nothing of the agent's in the pre-made directory");
    assert_eq!(std::fs::metadata(&shm).unwrap().permissions().mode() & 0o777, 0o777, "not taken over");
    node.still_serves(2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Forged restore names: a rank writes a `.cloud.json` claiming its disk step is in the cloud
/// under names that climb out of the restore directory, and the coordinator (fooled, or
/// hostile) asks for a restore of such a name. The agent reports no cloud copy and no bad name,
/// refuses the restore naming the name, and writes nothing outside its directories.
#[test]
fn forged_cloud_markers_and_restore_names_have_no_effect() {
    let Some(node) = Node::start("forged", None) else { return };
    let piece = node.piece(1, &[("rank.00000.safetensors", b"abcde")]);
    let marker = r#"{"url":"file:///tmp","uploaded":["../../../../etc/cron.d/x","rank.00000.safetensors","manifest.rank.00000.json"],"complete":true}"#;
    let run = format!(
        r#"set -e; d=ckpt/step-00000001; mkdir -p $d
        printf abcde > $d/rank.00000.safetensors
        cp {piece} $d/manifest.rank.00000.json
        printf '%s' '{marker}' > $d/.cloud.json"#,
        piece = piece.display()
    );
    node.launch(1, &run);
    assert_eq!(node.exited(1), Some(0), "{}", node.agent_log());
    let held = until("the rank's disk step in the holdings", || {
        let s = node.fake.0.lock().unwrap();
        s.holdings.iter().any(|h| h.job == 1 && h.tier == "disk").then(|| s.holdings.clone())
    });
    assert!(held.iter().all(|h| h.tier != "cloud" && !h.file.contains('/')), "{held:?}");

    let target = node.dir.join("evil");
    let bad = "../../../../../evil";
    let source = FetchSource { kind: "cloud".into(), ..Default::default() };
    node.send(instruction::Kind::Restore(Restore {
        job: 1,
        generation: 2,
        step: 1,
        request: 1,
        timeout_s: 30,
        cloud_url: format!("file://{}", node.dir.display()),
        files: vec![RestoreFile {
            source_generation: 1,
            file: bad.into(),
            bytes: 5,
            chunk_bytes: 5,
            crc32c: vec![0],
            ranges: vec![FetchRange { offset: 0, bytes: 5, source: Some(source.clone()), ..Default::default() }],
            fallbacks: vec![source],
            copies: 1,
        }],
        ..Default::default()
    }));
    let result = until("the restore's result", || node.fake.0.lock().unwrap().restores.iter().find(|r| r.job == 1).cloned());
    assert!(result.error.contains("not a checkpoint file name") && result.error.contains(bad), "{result:?}");
    assert!(!target.exists() && !node.work.join("evil").exists(), "nothing written outside the restore directory");
    node.still_serves(2);
}

/// A job as nobody naming a file:// cloud outside every --cloud-file-root: nothing is written
/// there (the agent writes such a cloud as root), the refusal is logged, the step stays on disk
/// and a restore from that URL fails naming it; a job's URL under the root uploads.
#[test]
fn a_file_cloud_outside_the_cloud_file_roots_is_refused() {
    let scratch_root = scratch("fileroot-cloud");
    std::fs::set_permissions(&scratch_root, std::fs::Permissions::from_mode(0o700)).unwrap();
    let root = scratch_root.display().to_string();
    let Some(node) = Node::start_with("fileroot", None, &["--cloud-file-root", &root]) else { return };
    let fake = node.dir.join("fake-etc");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let piece = node.piece(1, &[("rank.00000.safetensors", b"abcde")]);
    let run = format!(
        r#"set -e; d=ckpt/step-00000001; mkdir -p $d
        printf abcde > $d/rank.00000.safetensors
        cp {piece} $d/manifest.rank.00000.json"#,
        piece = piece.display()
    );
    let outside = format!("file://{}", fake.display());
    node.launch_env(1, &run, &[("MOTLEY_CKPT_CLOUD", &outside)]);
    assert_eq!(node.exited(1), Some(0), "{}", node.agent_log());
    let refusal = format!("job 1: checkpoint cloud {outside}: refused");
    let log = until("the refusal in the agent's log", || Some(node.agent_log()).filter(|l| l.contains(&refusal)));
    assert!(log.contains("--cloud-file-root"), "{log}");

    let inside = format!("file://{root}/ckpts");
    node.launch_env(2, &run, &[("MOTLEY_CKPT_CLOUD", &inside)]);
    assert_eq!(node.exited(2), Some(0), "{}", node.agent_log());
    let held = until("job 2's step in the cloud", || {
        let s = node.fake.0.lock().unwrap();
        s.holdings.iter().any(|h| h.job == 2 && h.tier == "cloud").then(|| s.holdings.clone())
    });
    // Every pass goes over every job: job 1's step was passed over, never uploaded.
    assert!(held.iter().any(|h| h.job == 1 && h.tier == "disk") && !held.iter().any(|h| h.job == 1 && h.tier == "cloud"), "{held:?}");
    assert!(scratch_root.join("ckpts/jobs/2/1/step-00000001/rank.00000.safetensors").is_file());
    assert_eq!(std::fs::read_dir(&fake).unwrap().count(), 0, "nothing written outside the roots");

    let entry = motley_checkpoint::crc::file_entry("rank.00000.safetensors", b"abcde", 1 << 20);
    let source = FetchSource { kind: "cloud".into(), ..Default::default() };
    node.send(instruction::Kind::Restore(Restore {
        job: 1,
        generation: 2,
        step: 1,
        request: 1,
        timeout_s: 30,
        cloud_url: outside.clone(),
        files: vec![RestoreFile {
            source_generation: 1,
            file: entry.file.clone(),
            bytes: entry.bytes,
            chunk_bytes: entry.chunk_bytes,
            crc32c: entry.crc32c.clone(),
            ranges: vec![FetchRange { offset: 0, bytes: entry.bytes, source: Some(source.clone()), ..Default::default() }],
            fallbacks: vec![source],
            copies: 1,
        }],
        ..Default::default()
    }));
    let result = until("the restore's result", || node.fake.0.lock().unwrap().restores.iter().find(|r| r.job == 1).cloned());
    assert!(result.error.contains(&refusal), "{result:?}");
    node.still_serves(3);
    let _ = std::fs::remove_dir_all(&scratch_root);
}
