use super::*;
use crate::checkpoints::steps::ckpt_dir;
use motley_checkpoint::{Block, FileEntry, Part, RankEntry, UnitEntry, UnitKey, FORMAT};

fn write_step(gen_dir: &Path, step: u64, rank: u32, bytes: u64) {
    let dir = ckpt_dir(gen_dir).join(motley_checkpoint::manifest::step_dir_name(step));
    std::fs::create_dir_all(&dir).unwrap();
    let key = UnitKey { block: Block::Layer(rank), part: Part::Model, tp_rank: 0, tp_size: 1 };
    let unit = motley_checkpoint::manifest::unit_file_name(&key);
    std::fs::write(dir.join(&unit), vec![7u8; bytes as usize]).unwrap();
    let rank_file = motley_checkpoint::manifest::rank_file_name(rank);
    std::fs::write(dir.join(&rank_file), b"r").unwrap();
    let entry = |file: &str, bytes| FileEntry { file: file.into(), bytes, chunk_bytes: 16 << 20, crc32c: vec![] };
    let piece = Manifest {
        format: FORMAT.into(),
        step,
        layers: 2,
        world_size: 2,
        units: vec![UnitEntry { key, file: entry(&unit, bytes), tensors: Default::default() }],
        ranks: vec![RankEntry { rank, file: entry(&rank_file, 1) }],
        lost_ranks: vec![],
    };
    let path = dir.join(motley_checkpoint::manifest::piece_file_name(rank));
    std::fs::write(path, serde_json::to_vec(&piece).unwrap()).unwrap();
}

#[test]
fn a_report_over_the_limit_keeps_the_newest_steps_whole_and_says_what_it_left_out() {
    let h = |step: u64, file: &str| CkptHolding {
        job: 7,
        generation: 1,
        step,
        file: file.into(),
        tier: "disk".into(),
        crc32c: vec![1; 100],
        ..Default::default()
    };
    let list: Vec<CkptHolding> = [10, 20, 30].iter().flat_map(|&s| [h(s, "a"), h(s, "b")]).collect();
    let one = encoded_bound(&list[0]);
    // The bound holds for the real encoding, and so for a whole list's.
    assert!(one >= prost_len(&list[0]), "{one}");
    let all = motley_proto::v1::AgentStatus { holdings: list.clone(), ..Default::default() };
    assert!(6 * one >= motley_proto::Message::encoded_len(&all));
    assert_eq!(bounded(list.clone(), 6 * one), (list.clone(), None));
    // Room for two steps and a half: steps 30 and 20 whole, step 10 left out and named.
    let (kept, what) = bounded(list.clone(), 5 * one);
    assert_eq!(kept.iter().map(|x| (x.step, x.file.as_str())).collect::<Vec<_>>(), [(20, "a"), (20, "b"), (30, "a"), (30, "b")]);
    let what = what.unwrap();
    assert!(what.contains("shared between 1 job: 2 files of 1 steps left out (oldest first: job 7 generation 1 step 10)"), "{what}");
}

/// Holdings of `job`'s `steps`, each of `files` files with `crcs` chunk crcs.
fn held(job: i64, steps: &[u64], files: usize, crcs: usize) -> Vec<CkptHolding> {
    let h = |step: u64, i: usize| CkptHolding {
        job,
        generation: 1,
        step,
        file: format!("f{i}"),
        tier: "disk".into(),
        crc32c: vec![u32::MAX; crcs],
        ..Default::default()
    };
    steps.iter().flat_map(|&s| (0..files).map(move |i| h(s, i))).collect()
}

fn steps_of(list: &[CkptHolding], job: i64) -> BTreeSet<u64> {
    list.iter().filter(|x| x.job == job).map(|x| x.step).collect()
}

/// A job's share of the report is its own: a job whose holdings fit its share keeps all of
/// them however many (or however numbered) steps another job reports, and what it leaves
/// unused goes to the jobs that need more.
#[test]
fn each_job_keeps_its_newest_steps_within_its_share_of_the_report() {
    let small = held(1, &[10, 20], 2, 100);
    let huge = held(2, &[1 << 62], 60, 1000);
    let one = encoded_bound(&huge[0]);
    let list: Vec<CkptHolding> = small.iter().chain(&huge).cloned().collect();
    let small_bytes: usize = small.iter().map(encoded_bound).sum();
    // Job 2's one step fits the report alone, but not beside job 1's: job 2 loses it, never job 1.
    let limit = 60 * one + small_bytes / 2;
    let (kept, what) = bounded(list.clone(), limit);
    assert_eq!(steps_of(&kept, 1), BTreeSet::from([10, 20]), "job 1 whole");
    assert!(steps_of(&kept, 2).is_empty());
    let what = what.unwrap();
    assert!(what.contains("shared between 2 jobs: 60 files of 1 steps left out"), "{what}");
    assert!(what.contains(&format!("job 2 generation 1 step {}", 1u64 << 62)), "{what}");
    // Three jobs, one far over its share: the two small ones whole, the big one its newest
    // steps within what they leave (an equal share would be a third).
    let big = held(3, &[1, 2, 3, 4, 5, 6], 10, 1000);
    let step_bytes: usize = big[..10].iter().map(encoded_bound).sum();
    let list: Vec<CkptHolding> = small.iter().chain(&held(4, &[7], 1, 0)).chain(&big).cloned().collect();
    let fixed: usize = list.iter().filter(|x| x.job != 3).map(encoded_bound).sum();
    let (kept, what) = bounded(list, fixed + 4 * step_bytes + step_bytes / 2);
    assert_eq!((steps_of(&kept, 1), steps_of(&kept, 4)), (BTreeSet::from([10, 20]), BTreeSet::from([7])));
    assert_eq!(steps_of(&kept, 3), BTreeSet::from([3, 4, 5, 6]), "job 3's newest four steps");
    assert!(what.unwrap().contains("(oldest first: job 3 generation 1 step 1, job 3 generation 1 step 2)"));
}

/// A unit piece of `entries` empty units, each listing `crcs` chunk crcs (a piece that says
/// little on disk but much in a report), in `step_dir`, naming step `claimed`.
fn write_bloated_piece(step_dir: &Path, claimed: u64, entries: u32, crcs: usize) {
    std::fs::create_dir_all(step_dir).unwrap();
    let units = (0..entries)
        .map(|i| {
            let key = UnitKey { block: Block::Layer(i), part: Part::Model, tp_rank: 0, tp_size: 1 };
            let file = motley_checkpoint::manifest::unit_file_name(&key);
            std::fs::write(step_dir.join(&file), b"").unwrap();
            let file = FileEntry { file, bytes: 0, chunk_bytes: 16 << 20, crc32c: vec![u32::MAX; crcs] };
            UnitEntry { key, file, tensors: Default::default() }
        })
        .collect();
    let piece = Manifest { format: FORMAT.into(), step: claimed, layers: entries, world_size: 1, units, ranks: vec![], lost_ranks: vec![] };
    std::fs::write(step_dir.join(motley_checkpoint::manifest::piece_file_name(0)), serde_json::to_vec(&piece).unwrap()).unwrap();
}

/// One job's ranks write a piece of nearly the whole report's size under a huge step number,
/// once in a directory of that number and once in an ordinary one: the other job's holdings
/// are still reported (and so stay in the coordinator's bitmap, which a report replaces), and
/// a step is the one its directory names.
#[test]
fn a_huge_step_number_in_a_piece_does_not_push_another_jobs_holdings_out_of_the_report() {
    let work = std::env::temp_dir().join(format!("motley-holdings-huge-step-{}", std::process::id()));
    let huge = 1u64 << 62;
    for dir_step in [huge, 4] {
        let _ = std::fs::remove_dir_all(&work);
        // Job 7's own step: one unit file of 12,000 chunks' crcs (about 60 KB in a report).
        write_step(&work.join("jobs/7/2"), 4, 0, 100);
        let piece = ckpt_dir(&work.join("jobs/7/2")).join("step-00000004").join(motley_checkpoint::manifest::piece_file_name(0));
        let mut m: Manifest = serde_json::from_slice(&std::fs::read(&piece).unwrap()).unwrap();
        m.units[0].file.crc32c = vec![u32::MAX; 12_000];
        std::fs::write(&piece, serde_json::to_vec(&m).unwrap()).unwrap();
        // Job 8's: 62 units of 10,000 crcs each (about 3.1 of the report's 3 MiB).
        let step_dir = ckpt_dir(&work.join("jobs/8/1")).join(motley_checkpoint::manifest::step_dir_name(dir_step));
        write_bloated_piece(&step_dir, huge, 62, 10_000);
        let list = Holdings::default().report(&work, 1).expect("a list");
        assert_eq!(steps_of(&list, 7), BTreeSet::from([4]), "job 7's step is reported (job 8's in a directory of step {dir_step})");
        assert_eq!(list.iter().filter(|x| x.job == 7).count(), 2);
        assert!(list.iter().all(|x| x.step != huge), "never reported under the piece's step alone");
        let bytes: usize = list.iter().map(encoded_bound).sum();
        assert!(bytes <= MAX_REPORT_BYTES, "{bytes}");
    }
    std::fs::remove_dir_all(&work).unwrap();
}

/// A piece is reported under its directory's step; one that names another step is no piece of
/// that step, and its files are not reported.
#[test]
fn a_piece_naming_another_step_than_its_directory_is_not_reported() {
    let work = std::env::temp_dir().join(format!("motley-holdings-other-step-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    write_step(&work.join("jobs/7/2"), 4, 0, 100);
    write_bloated_piece(&ckpt_dir(&work.join("jobs/8/1")).join("step-00000004"), 5, 2, 1);
    write_bloated_piece(&ckpt_dir(&work.join("jobs/9/1")).join("step-00000006"), 6, 2, 1);
    let list = Holdings::default().report(&work, 1).expect("a list");
    let jobs: BTreeSet<(i64, u64)> = list.iter().map(|x| (x.job, x.step)).collect();
    assert_eq!(jobs, BTreeSet::from([(7, 4), (9, 6)]), "{list:?}");
    std::fs::remove_dir_all(&work).unwrap();
}

#[test]
fn a_piece_over_the_size_limit_is_skipped_and_the_others_reported() {
    let work = std::env::temp_dir().join(format!("motley-holdings-big-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let gen_dir = work.join("jobs/7/2");
    write_step(&gen_dir, 4, 0, 100);
    write_step(&gen_dir, 4, 1, 100);
    // Rank 1's piece padded (valid JSON) past the limit: refused unread, its files unreported.
    let piece = ckpt_dir(&gen_dir).join("step-00000004").join(motley_checkpoint::manifest::piece_file_name(1));
    let mut text = std::fs::read(&piece).unwrap();
    text.resize(motley_checkpoint::manifest::MAX_PIECE_BYTES as usize + 1, b' ');
    std::fs::write(&piece, text).unwrap();
    let list = Holdings::default().report(&work, 1).expect("a list");
    let files: Vec<&str> = list.iter().map(|x| x.file.as_str()).collect();
    assert_eq!(files, ["layer.00000.model.tp0-1.safetensors", "rank.00000.safetensors"]);
    std::fs::remove_dir_all(&work).unwrap();
}

/// A rank's step directory is read through handles: a FIFO named as a piece is refused
/// without hanging the scan, and a `ckpt` linked to another job's checkpoints reports none
/// of that job's files as this one's.
#[test]
fn a_fifo_piece_and_a_linked_ckpt_are_not_followed() {
    let work = std::env::temp_dir().join(format!("motley-holdings-hostile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    write_step(&work.join("jobs/7/2"), 4, 0, 100);
    let fifo_step = ckpt_dir(&work.join("jobs/8/1")).join("step-00000004");
    std::fs::create_dir_all(&fifo_step).unwrap();
    use std::os::unix::ffi::OsStringExt;
    let fifo = std::ffi::CString::new(fifo_step.join(motley_checkpoint::manifest::piece_file_name(0)).into_os_string().into_vec()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let linked = work.join("jobs/9/1");
    std::fs::create_dir_all(&linked).unwrap();
    std::os::unix::fs::symlink(ckpt_dir(&work.join("jobs/7/2")), ckpt_dir(&linked)).unwrap();
    let (done, report) = std::sync::mpsc::channel();
    let w = work.clone();
    std::thread::spawn(move || done.send(Holdings::default().report(&w, 1)).unwrap());
    let list = report.recv_timeout(std::time::Duration::from_secs(60)).expect("the scan ended").expect("a list");
    let jobs: Vec<i64> = list.iter().map(|x| x.job).collect();
    assert_eq!(jobs, [7, 7], "job 7's own two files only: {list:?}");
    std::fs::remove_dir_all(&work).unwrap();
}

/// The encoded length of one holding as an `AgentStatus.holdings` entry.
fn prost_len(h: &CkptHolding) -> usize {
    use motley_proto::{v1::AgentStatus, Message};
    AgentStatus { holdings: vec![h.clone()], ..Default::default() }.encoded_len()
}

#[test]
fn files_a_piece_lists_whole_are_reported_once_until_they_change() {
    let work = std::env::temp_dir().join(format!("motley-holdings-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let gen_dir = work.join("jobs/7/2");
    write_step(&gen_dir, 4, 0, 100);
    let h = Holdings::default();
    let first = h.report(&work, 1).expect("the first list");
    let files: Vec<&str> = first.iter().map(|x| x.file.as_str()).collect();
    assert_eq!(files, ["layer.00000.model.tp0-1.safetensors", "rank.00000.safetensors"]);
    assert_eq!((first[0].job, first[0].generation, first[0].step, first[0].bytes), (7, 2, 4, 100));
    assert_eq!((first[0].block.as_str(), first[0].part.as_str(), first[0].rank, first[1].rank), ("layer.0", "model", -1, 0));
    assert!(h.report(&work, 2).is_none(), "sent, not yet acknowledged: not again");
    h.ack(1);
    assert!(h.report(&work, 3).is_none(), "told");
    // A unit the piece lists at another length (half-written): not held.
    write_step(&gen_dir, 8, 1, 50);
    let unit = ckpt_dir(&gen_dir).join("step-00000008/layer.00001.model.tp0-1.safetensors");
    std::fs::write(&unit, [0u8; 10]).unwrap();
    let next = h.report(&work, 4).expect("changed");
    assert_eq!(next.len(), 3, "{next:?}");
    assert!(next.iter().all(|x| x.file != "layer.00001.model.tp0-1.safetensors"));
    // A new session sends the whole list again.
    h.ack(4);
    h.new_session();
    assert_eq!(h.report(&work, 1).unwrap().len(), 3);
    std::fs::remove_dir_all(&work).unwrap();
}
