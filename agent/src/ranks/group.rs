//! A rank's process group as /proc and kill(2) see it: which boot this is, when a process
//! started, whether a group is still the one a rank's wrapper leads, who is in it, and a
//! signal to it only if it is.

/// This boot's id: a record written in another boot names processes that are gone.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// The fields of /proc/PID/stat after the command name (which may hold spaces and ')'): the
/// state is [0], the process group [2], the start time [19] (field 22 of the whole line).
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    Some(after.split_whitespace().map(str::to_string).collect())
}

/// When process `pid` started (clock ticks after boot); None if there is no such process.
pub fn start_time(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Whether `pgid` is still the group a rank's wrapper led: its leader is alive (not a zombie)
/// and started when the record says. A pid reused by another process, after a reboot or a
/// wrap-around, starts at another time; a group whose leader is gone cannot be told apart
/// from a foreign one and is not taken for the rank's.
pub fn is_rank_group(pgid: i32, start: u64) -> bool {
    start != 0 && stat_fields(pgid).is_some_and(|f| f.len() > 19 && f[0] != "Z" && f[2] == pgid.to_string() && f[19] == start.to_string())
}

/// The live (not zombie) processes of group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(procs) = std::fs::read_dir("/proc") else { return vec![] };
    let pgid = pgid.to_string();
    procs
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| stat_fields(pid).is_some_and(|f| f.len() > 2 && f[0] != "Z" && f[2] == pgid))
        .collect()
}

/// Whether any process of the group still runs. Zombies do not count: under an init that
/// does not reap (some containers), an orphaned wrapper killed with its rank stays a zombie,
/// and kill(2) still finds its group.
pub fn group_alive(pgid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks; no memory is shared.
    if pgid <= 0 || unsafe { libc::kill(-pgid, 0) } != 0 {
        return false;
    }
    if std::fs::metadata("/proc/self/stat").is_err() {
        return true; // no /proc to tell zombies apart
    }
    !group_members(pgid).is_empty()
}

/// Signal a rank's process group, only if it is still the one its wrapper leads (see
/// `is_rank_group`); whether it was signalled.
pub fn signal_group(pgid: i32, start: u64, signal: i32) -> bool {
    if pgid <= 0 || !is_rank_group(pgid, start) {
        return false;
    }
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is shared.
    unsafe { libc::kill(-pgid, signal) == 0 }
}
