//! The rule of docs/state.md ("What a rank can and cannot do to its node") made structural:
//! whatever the agent reads, writes, renames or removes inside a directory a rank can write
//! goes through `safe_fs` (a handle, `openat2` beneath it, no link followed, a size limit), never
//! through a path. This test reads every source file of the agent (test code left out) and
//! fails on any path-based file-system call that is not on the allow-list below; each entry
//! says why its path is the agent's alone. An entry that matches nothing fails the test too, so
//! the list stays true. Entries match by file (or a folder, for code that is moving between
//! files) and a piece of the call's line, never by line number.

use std::path::{Path, PathBuf};

/// The calls that take a path (std's and tokio's file systems alike).
const CALLS: &[&str] = &[
    "fs::read(",
    "fs::read_to_string(",
    "fs::read_dir(",
    "fs::read_link(",
    "fs::write(",
    "fs::copy(",
    "fs::rename(",
    "fs::hard_link(",
    "fs::remove_file(",
    "fs::remove_dir(",
    "fs::remove_dir_all(",
    "fs::create_dir(",
    "fs::create_dir_all(",
    "fs::metadata(",
    "fs::symlink_metadata(",
    "fs::set_permissions(",
    "fs::canonicalize(",
    "fs::chown(",
    "fs::symlink(",
    "File::open(",
    "File::create(",
    "OpenOptions::new(",
    "DirBuilder::new(",
];

/// (file or folder under agent/src, a piece of the call's line, why the path is the agent's).
const ALLOWED: &[(&str, &str, &str)] = &[
    // Hardware and kernel facts: /sys and /proc, which no rank writes.
    ("node/discover/mod.rs", "std::fs::read_to_string(p)", "/sys attributes of GPUs and NICs"),
    ("node/discover/mod.rs", "std::fs::read_dir(dir)", "/sys class directories"),
    ("node/discover/mod.rs", "std::fs::canonicalize(link)", "/sys device links"),
    ("node/load.rs", "std::fs::read_to_string(p)", "/proc/loadavg and /proc/meminfo"),
    ("net/counters.rs", "std::fs::read_to_string(p)", "/sys/class/net counters"),
    ("net/counters.rs", "std::fs::read_dir(dir)", "/sys/class/net"),
    ("checkpoints/rdma/verbs.rs", "std::fs::read_to_string(types)", "/sys/class/infiniband GID types"),
    ("ranks/group.rs", "/proc/sys/kernel/random/boot_id", "/proc"),
    ("ranks/group.rs", "format!(\"/proc/{pid}/stat\")", "/proc"),
    ("ranks/group.rs", "std::fs::read_dir(\"/proc\")", "/proc"),
    ("ranks/group.rs", "std::fs::metadata(\"/proc/self/stat\")", "/proc"),
    ("ranks/wrapper_exe.rs", "std::fs::read_link(exe)", "/proc/self/exe"),
    ("bin/motley-agent/settings.rs", "/proc/sys/kernel/hostname", "/proc"),
    // The cgroup file system: the agent's subtree, which it makes (ranks/cgroup.rs); a rank's
    // own cgroup is given to its user, but cgroupfs holds no links, FIFOs or large files.
    ("ranks/cgroup.rs", "/proc/self/mountinfo", "/proc"),
    ("ranks/cgroup.rs", "/proc/self/cgroup", "/proc"),
    ("ranks/cgroup.rs", "std::fs::create_dir(&root)", "the agent's cgroup subtree"),
    ("ranks/cgroup.rs", "std::fs::remove_dir(&root)", "the agent's cgroup subtree"),
    ("ranks/cgroup.rs", "std::fs::create_dir_all(&dir)", "a rank's cgroup, made by the agent"),
    ("ranks/cgroup.rs", "cgroup.kill", "cgroupfs control file"),
    ("ranks/cgroup.rs", "cgroup.events", "cgroupfs control file"),
    ("ranks/cgroup.rs", "std::fs::remove_dir(&dir)", "cgroupfs: rmdir of an empty cgroup"),
    ("ranks/cgroup.rs", "std::fs::remove_dir(root)", "cgroupfs: rmdir of an empty cgroup"),
    ("ranks/cgroup.rs", "std::os::unix::fs::chown(dir.join(file)", "a rank's cgroup files, given to its user: cgroupfs has no links"),
    ("ranks/cgroup.rs", "std::fs::read_to_string(&control)", "cgroupfs: the agent's own cgroup's cgroup.subtree_control"),
    ("ranks/cgroup.rs", "cgroup.subtree_control", "cgroupfs control file of the agent's cgroup subtree"),
    ("ranks/cgroup.rs", "cpu.max", "cgroupfs: a rank's CPU limit, written by the agent before the rank starts"),
    // An emulating node's v1 cpu hierarchy (ranks/cpu_share.rs): the agent's subtree alone; of a
    // rank's v1 cgroup only its cgroup.procs is given to the rank's user (to enter it), never
    // the directory or its quota.
    ("ranks/cpu_share.rs", "/proc/self/mountinfo", "/proc"),
    ("ranks/cpu_share.rs", "/proc/self/cgroup", "/proc"),
    ("ranks/cpu_share.rs", "std::fs::create_dir_all(&root)", "the agent's v1 cpu cgroup subtree"),
    ("ranks/cpu_share.rs", "std::fs::create_dir_all(&probe)", "the agent's v1 cpu cgroup subtree"),
    ("ranks/cpu_share.rs", "std::fs::remove_dir(&probe)", "cgroupfs: rmdir of an empty cgroup"),
    ("ranks/cpu_share.rs", "std::fs::remove_dir(&root)", "cgroupfs: rmdir of an empty cgroup"),
    ("ranks/cpu_share.rs", "std::fs::remove_dir(root)", "cgroupfs: rmdir of an empty cgroup"),
    ("ranks/cpu_share.rs", "std::fs::create_dir_all(dir)", "a rank's (or the profiler's) v1 cpu cgroup, made by the agent"),
    ("ranks/cpu_share.rs", "cpu.cfs_period_us", "cgroupfs control file"),
    ("ranks/cpu_share.rs", "cpu.cfs_quota_us", "cgroupfs control file"),
    ("ranks/cpu_share.rs", "std::fs::remove_dir(&dir)", "cgroupfs: rmdir of an empty cgroup"),
    ("ranks/cpu_share.rs", "std::os::unix::fs::chown(&procs", "cgroupfs: a rank's cgroup.procs, given to its user: cgroupfs has no links"),
    ("ranks/cpu_share.rs", "std::fs::read_to_string(&procs)", "cgroupfs: whether a rank's cgroup holds a process"),
    ("ranks/cpu_share.rs", "std::fs::write(&procs", "cgroupfs: the agent moves a rank's processes into its share"),
    // The operator's files, named on the command line or in the agent's configuration.
    ("bin/motley-agent/main.rs", "std::fs::read(ca)", "--ca-cert"),
    ("bin/motley-agent/session.rs", "std::fs::read(p)", "--ca-cert"),
    ("bin/motley-agent/settings.rs", "std::fs::read_to_string(path)", "--inventory"),
    ("safe_fs.rs", "std::fs::symlink_metadata(path)", "--shm-dir, said why it is refused"),
    // A separate program: the probe runs as the rank, with the rank's rights, not as the agent.
    ("bin/rank_probe.rs", "std::fs::read_to_string(&p)", "runs as the rank"),
    // The work directory's root, made and locked by the agent at start (workdir), and the
    // agent's own files directly in it (the lease, the draining flag): no rank writes there.
    ("workdir.rs", "std::fs::DirBuilder::new()", "create_dirs: the work directory and the directories above a launch"),
    ("workdir.rs", "std::fs::metadata(dir)", "open_work_dir"),
    ("workdir.rs", "std::fs::set_permissions(dir", "open_work_dir"),
    ("workdir.rs", "std::fs::canonicalize(dir)", "open_work_dir"),
    ("workdir.rs", "std::fs::OpenOptions::new()", "open_work_dir: agent.lock"),
    ("ranks/lease.rs", "std::fs::read_to_string(path)", "WORK_DIR/lease.json, the agent's"),
    ("ranks/lease.rs", "std::fs::remove_file(&file)", "WORK_DIR/lease.json, the agent's"),
    ("bin/motley-agent/session.rs", "std::fs::remove_file(&flag)", "WORK_DIR's draining flag, the agent's"),
    // The profiler's directory (WORK_DIR/profiles): the agent's, its profiles run as the agent.
    ("profiler.rs", "std::fs::read_dir(&dir)", "WORK_DIR/profiles"),
    ("profiler.rs", "std::fs::read(&path)", "WORK_DIR/profiles"),
    ("profiler.rs", "std::fs::remove_file(self.inner.dir", "WORK_DIR/profiles"),
    ("profiler.rs", "std::fs::remove_dir_all(self.inner.dir", "WORK_DIR/profiles"),
    ("profiler.rs", "std::fs::remove_file(&output)", "WORK_DIR/profiles"),
    ("profiler.rs", "std::fs::read(path)", "WORK_DIR/profiles"),
    ("profiler.rs", "std::fs::read_to_string(output)", "WORK_DIR/profiles"),
    // The restore directory (WORK_DIR/restore): the agent's own; the files restored in it are
    // handed to the rank's user, its directories never (docs/recovery.md). Code there is moving
    // between files: whole folders, by call.
    ("checkpoints/restorer/", "std::fs::", "WORK_DIR/restore, the agent's"),
    ("checkpoints/restorer/", "File::open(", "WORK_DIR/restore, the agent's"),
    ("checkpoints/dataplane/", "std::fs::", "fetched files land in WORK_DIR/restore, the agent's"),
    ("checkpoints/dataplane/", "File::open(", "fetched files land in WORK_DIR/restore, the agent's"),
    ("checkpoints/cloud.rs", "tokio::fs::OpenOptions::new()", "cloud_get_to_path: into WORK_DIR/restore"),
    ("checkpoints/cloud.rs", "std::fs::remove_file(&tmp)", "cloud_get_to_path: into WORK_DIR/restore"),
    ("checkpoints/cloud.rs", "std::fs::rename(&tmp, dest)", "cloud_get_to_path: into WORK_DIR/restore"),
    ("checkpoints/cloud.rs", "std::fs::File::open(dir)", "cloud_get_to_path: into WORK_DIR/restore"),
    ("checkpoints/cloud.rs", "tokio::fs::File::open(path)", "put_file: the caller's own staged file; a rank's go through put_opened"),
];

/// The agent's sources: `agent/src`, test files left out.
fn sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (mut out, mut todo) = (vec![], vec![root]);
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                todo.push(p);
            } else if name.ends_with(".rs") && name != "tests.rs" && !name.ends_with("_tests.rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// `text` without its comments and its `#[cfg(test)]` items (a `mod tests { ... }`, a test
/// helper function): what is left is what the agent runs.
fn runtime_code(text: &str) -> String {
    let mut out = String::new();
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if text[i..].starts_with("#[cfg(test)]") {
            i = skip_item(b, i + "#[cfg(test)]".len());
            continue;
        }
        if text[i..].starts_with("//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if let Some(end) = literal_end(b, i) {
            // A string or a character: copied whole (a call may quote a path), never taken for
            // a comment or a brace.
            out.push_str(&text[i..end]);
            i = end;
            continue;
        }
        let c = text[i..].chars().next().unwrap();
        out.push(c);
        i += c.len_utf8();
    }
    out
}

/// The index after the item that starts at `i`: up to its first `;` outside braces, or its
/// block's closing brace.
fn skip_item(b: &[u8], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < b.len() {
        if let Some(end) = literal_end(b, i) {
            i = end;
            continue;
        }
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        match b[i] {
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            b';' if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Where the string or character literal starting at `i` ends, if one does: `"..."`,
/// `r#"..."#`, `'c'`, `'\n'` (a lifetime is not one).
fn literal_end(b: &[u8], i: usize) -> Option<usize> {
    let ident_before = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
    if !ident_before && b[i..].starts_with(b"r#\"") {
        let close = b[i + 3..].windows(2).position(|w| w == b"\"#")?;
        return Some(i + 3 + close + 2);
    }
    match b[i] {
        b'"' => {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            Some((j + 1).min(b.len()))
        }
        b'\'' if b.get(i + 2) == Some(&b'\'') => Some(i + 3),
        b'\'' if b.get(i + 1) == Some(&b'\\') && b.get(i + 3) == Some(&b'\'') => Some(i + 4),
        _ => None,
    }
}

/// Every path-based call in the agent's runtime code: (file under agent/src, its line).
fn findings() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = vec![];
    for file in sources() {
        let rel = file.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
        let code = runtime_code(&std::fs::read_to_string(&file).unwrap());
        for line in code.lines() {
            let line = line.trim();
            if CALLS.iter().any(|c| line.contains(c)) {
                out.push((rel.clone(), line.to_string()));
            }
        }
    }
    out
}

fn allows(entry: &(&str, &str, &str), file: &str, line: &str) -> bool {
    let (at, call, _) = entry;
    let in_place = if at.ends_with('/') { file.starts_with(at) } else { file == *at };
    in_place && line.contains(call)
}

#[test]
fn no_path_based_file_call_outside_the_allow_list() {
    let found = findings();
    assert!(found.len() > 20, "the scan finds the agent's sources: {found:?}");
    let refused: Vec<_> = found.iter().filter(|(f, l)| !ALLOWED.iter().any(|e| allows(e, f, l))).collect();
    assert!(
        refused.is_empty(),
        "path-based file calls in the agent (a rank's directory must be reached through safe_fs, docs/state.md; \
         or, if the path is the agent's alone, add it to ALLOWED saying why):\n{}",
        refused.iter().map(|(f, l)| format!("  agent/src/{f}: {l}")).collect::<Vec<_>>().join("\n")
    );
    let stale: Vec<_> = ALLOWED.iter().filter(|e| !found.iter().any(|(f, l)| allows(e, f, l))).collect();
    assert!(stale.is_empty(), "allow-list entries that match no call any more (remove them): {stale:?}");
}

#[test]
fn the_scan_sees_calls_and_leaves_out_comments_strings_and_test_code() {
    let text = "fn a() { std::fs::read(p); }\n// std::fs::read(q)\nlet s = \"std::fs::write(\";\n#[cfg(test)]\nmod tests {\n fn t() { std::fs::write(p, \"}\"); }\n}\nfn b() { File::open(x); }\n";
    let code = runtime_code(text);
    let calls: Vec<&str> = code.lines().filter(|l| CALLS.iter().any(|c| l.contains(c))).collect();
    // The string's text is kept (a call may quote a path): a call written in a string counts.
    assert_eq!(calls, ["fn a() { std::fs::read(p); }", "let s = \"std::fs::write(\";", "fn b() { File::open(x); }"]);
}
