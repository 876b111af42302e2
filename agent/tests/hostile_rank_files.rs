//! Hostile ranks against the files the root agent reads and writes in their launch directory
//! (docs/state.md, "What a rank can and cannot do to its node"): an exit code that is a FIFO or
//! a link to a large file of root's, a forged record read by a restarted agent, a temporary
//! name made before the agent's, a tree nested thousands of levels deep. After each, the
//! agent is live, its peak memory grew by less than 64 MiB, and a fresh job runs. The harness
//! is `hostile_ranks/node.rs`.

use crate::hostile_ranks::node;

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use motley_proto::v1::instruction;
use node::{until, Node};

/// What a rank may cost the agent's memory, at most.
const MEMORY_SLACK: u64 = 64 << 20;

/// The code a rank is reported with whose exit file is no exit code (`rankfiles::BAD_EXIT`).
const BAD_EXIT: i64 = -1;

/// After an attack: the agent lives, its peak memory grew by less than `MEMORY_SLACK` since
/// `peak`, and job `job` runs.
fn unharmed(node: &Node, peak: u64, job: i64) {
    let grown = node.peak_rss().saturating_sub(peak);
    assert!(grown < MEMORY_SLACK, "the agent's peak memory grew by {} MiB", grown >> 20);
    node.still_serves(job);
}

/// The rank makes its exit file a FIFO and kills its wrapper, so nobody writes it: the agent
/// reports the rank ended (a bad exit code, said in its log) instead of hanging a worker on
/// the FIFO for good; and again after a restart (adoption reads it too).
#[test]
fn an_exit_file_that_is_a_fifo_is_refused_without_a_hang() {
    let Some(mut node) = Node::start("exit-fifo", None) else { return };
    let peak = node.peak_rss();
    node.launch(1, "rm -f rank-0.exit && mkfifo rank-0.exit && kill -9 $PPID");
    assert_eq!(node.exited(1), Some(BAD_EXIT), "{}", node.agent_log());
    let log = node.agent_log();
    assert!(log.contains("rank-0.exit: not an exit code") && log.contains("not a regular file"), "{log}");
    unharmed(&node, peak, 2);
    // A restarted agent reads it again when it adopts the rank (its end may not be acknowledged).
    let _ = std::fs::remove_file(node.work.join("jobs/1/1/rank-0.reported"));
    node.restart();
    let peak = node.peak_rss();
    unharmed(&node, peak, 3);
}

/// The rank links its exit file to a large file of root's (it cannot read it, the agent could)
/// and kills its wrapper: the agent refuses the link, reads nothing of the file, and reports a
/// bad exit code.
#[test]
fn an_exit_file_linked_to_a_large_file_of_roots_is_not_read() {
    let Some(node) = Node::start("exit-link", None) else { return };
    let big = node.dir.join("root-only.img");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(1 << 30).unwrap(); // sparse: a gigabyte of zeros, read whole it would be resident
    std::fs::set_permissions(&big, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let peak = node.peak_rss();
    node.launch(1, &format!("rm -f rank-0.exit && ln -s {} rank-0.exit && kill -9 $PPID", big.display()));
    assert_eq!(node.exited(1), Some(BAD_EXIT), "{}", node.agent_log());
    assert!(node.agent_log().contains("rank-0.exit: not an exit code"), "{}", node.agent_log());
    unharmed(&node, peak, 2);
}

/// A record the rank put in its launch directory in place of the agent's, naming a live
/// process group of root's (a stand-in for any victim) as the rank's: a restarted agent does
/// not trust it, and a stop of the job signals nothing.
#[test]
fn a_forged_record_is_never_trusted_after_a_restart() {
    let Some(mut node) = Node::start("forged-record", None) else { return };
    let mut victim = std::process::Command::new("sleep").arg("600").process_group(0).spawn().unwrap();
    let pid = victim.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let start: u64 = stat.rsplit_once(") ").unwrap().1.split_whitespace().nth(19).unwrap().parse().unwrap();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim().to_string();
    let record = format!(
        r#"{{"node":"n0","job":1,"generation":1,"rank":0,"pgid":{pid},"log":"/dev/null","boot_id":"{boot}","start_time":{start}}}"#
    );
    // The rank waits for the agent's record, then swaps its own in and kills its wrapper (no
    // exit code), so a restarted agent would find a "running" rank of that group.
    let run = format!(
        "until [ -e rank-0.json ]; do sleep 0.05; done; printf '%s' '{record}' > forged && mv -f forged rank-0.json && kill -9 $PPID"
    );
    node.launch(1, &run);
    node.exited(1);
    // What the rank could still do with a process left behind: its end never told.
    let dir = node.work.join("jobs/1/1");
    let _ = std::fs::remove_file(dir.join("rank-0.reported"));
    let _ = std::fs::remove_file(dir.join("rank-0.exit"));
    assert_eq!(std::fs::metadata(dir.join("rank-0.json")).unwrap().uid(), 65534, "the rank's forged record is in place");
    node.restart();
    let peak = node.peak_rss();
    let log = until("the restarted agent's note on the record", || {
        Some(node.agent_log()).filter(|l| l.contains("owned by uid 65534, not by the agent's user; not trusted"))
    });
    assert!(!log.contains("adopted, Running"), "{log}");
    node.send(instruction::Kind::Stop(motley_proto::v1::Stop { job: 1, generation: 1, ..Default::default() }));
    std::thread::sleep(Duration::from_millis(500));
    assert!(victim.try_wait().unwrap().is_none(), "the group the forged record names was not signalled");
    unharmed(&node, peak, 2);
    let _ = victim.kill();
    let _ = victim.wait();
}

/// The rank makes the agent's temporary name for its `reported` marker first (the agent's pid
/// is no secret), a file of its own: the agent's marker is made new, root's, not the rank's.
#[test]
fn a_temporary_made_first_by_the_rank_is_never_reused() {
    let Some(node) = Node::start("pre-temp", None) else { return };
    let peak = node.peak_rss();
    let run = format!("touch .rank-0.reported.tmp-{pid} && chmod 666 .rank-0.reported.tmp-{pid}", pid = node.agent.id());
    node.launch(1, &run);
    assert_eq!(node.exited(1), Some(0), "{}", node.agent_log());
    let marker = node.work.join("jobs/1/1/rank-0.reported");
    let meta = until("the reported marker", || std::fs::symlink_metadata(&marker).ok());
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o600), "the marker is the agent's own file");
    unharmed(&node, peak, 2);
}

/// The rank nests directories 5,000 deep in its launch directory: pruning its ended launch
/// removes them all (no recursion, a few descriptors), and the agent lives on.
#[test]
fn a_tree_thousands_of_levels_deep_is_pruned() {
    // Ended launches go after 7 seconds untouched, looked for every 2.
    let Some(node) = Node::start_with("deep-tree", None, &["--keep-finished-hours", "0.002"]) else { return };
    let peak = node.peak_rss();
    // perl: a shell's `cd` takes minutes at such depths.
    node.launch(1, r#"perl -e 'for (1..5000) { mkdir "d" or die; chdir "d" or die } print "deep\n"'"#);
    assert_eq!(node.exited(1), Some(0), "{}", node.agent_log());
    let dir = node.work.join("jobs/1/1");
    let start = Instant::now();
    while dir.exists() {
        assert!(start.elapsed() < Duration::from_secs(60), "the deep launch directory was never pruned:\n{}", node.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(node.agent_log().contains("job 1 generation 1: ended, files removed"), "{}", node.agent_log());
    unharmed(&node, peak, 2);
}
