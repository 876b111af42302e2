//! The supervisor's reports: each message to the coordinator has a number in its session
//! (`seq`); the ranks it reports are in flight under that number until the coordinator
//! acknowledges it. Only then is the state told, and an end marked `rank-R.reported` on disk
//! (a later agent does not report it again): an agent that dies in between reports it again.
//! Unacknowledged reports are sent again after one base interval, and every session opens with
//! every rank (`full`).

use std::collections::BTreeMap;
use std::time::Instant;

use motley_proto::v1::{RankRejoined, RankStatus};

use super::State;
use super::{Key, Report, Supervisor};
use crate::ranks::rankfiles;
use crate::workdir::{self, rank_file};

/// The ranks (and the states) each unacknowledged message reported, by seq.
pub(super) type InFlight = BTreeMap<u64, Vec<(Key, Report)>>;

/// Messages in flight are bounded: a coordinator that never acknowledges (an older one) must
/// not grow the agent's memory; what falls out is sent again anyway.
const MAX_IN_FLIGHT: usize = 1024;

impl Supervisor {
    /// A new session (its seq numbers start again at 1): what was in flight is forgotten, and
    /// everything not acknowledged is sent again.
    pub fn new_session(&self) {
        let mut ranks = self.lock();
        for r in ranks.values_mut() {
            r.sent = None;
        }
        self.in_flight.lock().expect("in-flight lock").clear();
    }

    /// The ranks message `seq` reports: with `full` (a session's first message) every rank,
    /// acknowledged or not; otherwise those whose state the coordinator has not acknowledged
    /// and that were not sent in that state within the last interval. They are in flight under
    /// `seq` until `ack(seq)`.
    pub fn report(&self, seq: u64, full: bool) -> Vec<RankStatus> {
        self.look_for_rejoins();
        let resend_after = *self.interval.lock().expect("interval lock");
        let mut ranks = self.lock();
        let (mut out, mut flying) = (vec![], vec![]);
        let now = Instant::now();
        for (&key, r) in ranks.iter_mut() {
            let report = r.report();
            let due = match r.sent {
                _ if full => true,
                _ if r.settled() => false,
                Some((sent, at)) => sent != report || now.duration_since(at) >= resend_after,
                None => true,
            };
            if !due {
                continue;
            }
            r.sent = Some((report, now));
            flying.push((key, report));
            let (state, exit_code, rejoined) = match report {
                Report::Running(rejoined) => ("running", None, rejoined),
                Report::Exited(code) => ("exited", Some(code), None),
                Report::Lost => ("lost", None, None),
            };
            let rejoined =
                rejoined.map(|x| RankRejoined { epoch: x.epoch, bytes: x.bytes, seconds: x.seconds, copy_seconds: x.copy_seconds });
            out.push(RankStatus { job: key.0, generation: key.1, rank: key.2, state: state.into(), exit_code, rejoined });
        }
        if !flying.is_empty() {
            let mut in_flight = self.in_flight.lock().expect("in-flight lock");
            in_flight.insert(seq, flying);
            while in_flight.len() > MAX_IN_FLIGHT {
                in_flight.pop_first();
            }
        }
        out
    }

    /// The coordinator holds what message `seq` said: the ranks it reported are told, unless
    /// their state changed since (then the newer state is still to be told), and the ends are
    /// marked on disk so that a later agent does not report them again.
    pub fn ack(&self, seq: u64) {
        let mut ended = vec![];
        {
            let mut ranks = self.lock();
            let Some(flown) = self.in_flight.lock().expect("in-flight lock").remove(&seq) else { return };
            for (key, report) in flown {
                let Some(r) = ranks.get_mut(&key) else { continue };
                if r.report() != report || r.told == Some(report) {
                    continue;
                }
                r.told = Some(report);
                if !matches!(report, Report::Running(_)) {
                    ended.push((key, r.dir.clone()));
                }
            }
        }
        // Off the rank lock: each marker is fsync'd.
        for (key, dir) in ended {
            if let Err(e) = workdir::write_atomic(&rank_file(&dir, key.2, "reported"), b"") {
                tracing::warn!(node = %self.node, "{e}; a restarted agent will report this end again");
            }
        }
    }

    /// Read the rejoined file (`rankfiles::read_rejoined`) of each running rank that has not
    /// told one: a rank of a joining replica writes it once it copied its state from its peers,
    /// and the report that carries it is what lets the coordinator call the job whole again.
    /// The files are read off the ranks' lock; a bad one is said once in the agent's log (and
    /// read again at each report, as a missing one is).
    fn look_for_rejoins(&self) {
        let running = |s: &State| match *s {
            State::Running { pgid, start, .. } => Some((pgid, start)),
            _ => None,
        };
        let waiting: Vec<(Key, (i32, u64), std::path::PathBuf)> = self
            .lock()
            .iter()
            .filter(|(_, r)| r.rejoined.is_none())
            .filter_map(|(&k, r)| running(&r.state).map(|p| (k, p, r.dir.clone())))
            .collect();
        for (key, process, dir) in waiting {
            let read = rankfiles::read_rejoined(&dir, key.2);
            let mut ranks = self.lock();
            // The same process still (a joining launch may have started the rank afresh since).
            let Some(r) = ranks.get_mut(&key).filter(|r| running(&r.state) == Some(process)) else { continue };
            match read {
                Ok(found) => r.rejoined = found,
                Err(why) if !r.rejoined_bad => {
                    tracing::warn!(node = %self.node, job = key.0, rank = key.2, "{why}; the rank's rejoin is not reported");
                    r.rejoined_bad = true;
                }
                Err(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use super::super::{Rank, State, Supervisor};
    use crate::workdir::generation_dir;

    /// A joining rank's copy (docs/keep-going.md): the rank writes `rank-R.rejoined` once it
    /// copied its peers' state; the next report carries it (a change of what is told, sent
    /// and acknowledged like a state), a session's first message carries it again, and a file
    /// that is not one is said once and never reported.
    #[test]
    fn a_rejoined_file_is_reported_with_its_running_rank_and_a_bad_one_never() {
        let work = std::env::temp_dir().join(format!("motley-ranks-{}-rejoined", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        let s = Supervisor::new(work.clone(), "n".into(), crate::ranks::wrapper_exe::WrapperExe::open(Path::new("/bin/false")).unwrap());
        s.set_interval(Duration::from_secs(3600));
        let dir = generation_dir(&work, 5, 1);
        std::fs::create_dir_all(&dir).unwrap();
        for rank in [0, 1] {
            s.lock().insert((5, 1, rank), Rank::new(State::Running { pgid: i32::MAX, start: 1, stopping: false }, dir.clone()));
        }
        let sent = s.report(1, false);
        assert!(sent.len() == 2 && sent.iter().all(|r| r.state == "running" && r.rejoined.is_none()), "{sent:?}");
        s.ack(1);
        assert!(s.report(2, false).is_empty(), "told");

        std::fs::write(dir.join("rank-0.rejoined"), r#"{"epoch": 3, "bytes": 2613248, "seconds": 4.5, "copy_seconds": 0.07}"#).unwrap();
        std::fs::write(dir.join("rank-1.rejoined"), r#"{"epoch": 0, "bytes": 1, "seconds": 1, "copy_seconds": 1}"#).unwrap();
        let sent = s.report(3, false);
        assert_eq!(sent.len(), 1, "only the good file: {sent:?}");
        let told = sent[0].rejoined.expect("rank 0's copy");
        assert_eq!((sent[0].rank, told.epoch, told.bytes, told.seconds, told.copy_seconds), (0, 3, 2_613_248, 4.5, 0.07));
        s.ack(3);
        assert!(s.report(4, false).is_empty(), "told; the bad file is not reported");
        let full = s.report(5, true);
        assert_eq!(full.iter().map(|r| (r.rank, r.rejoined.as_ref().map(|x| x.epoch))).collect::<Vec<_>>(), [(0, Some(3)), (1, None)]);

        // Over the limit, or a link (to a good file even): refused, never read through.
        std::fs::write(dir.join("rank-2.rejoined"), vec![b' '; 4096]).unwrap();
        std::fs::write(dir.join("good"), r#"{"epoch": 3, "bytes": 1, "seconds": 1, "copy_seconds": 1}"#).unwrap();
        std::os::unix::fs::symlink("good", dir.join("rank-3.rejoined")).unwrap();
        let s2 = Supervisor::new(work.clone(), "n".into(), crate::ranks::wrapper_exe::WrapperExe::open(Path::new("/bin/false")).unwrap());
        for rank in [2, 3] {
            s2.lock().insert((5, 1, rank), Rank::new(State::Running { pgid: i32::MAX, start: 1, stopping: false }, dir.clone()));
        }
        let sent = s2.report(1, true);
        assert!(sent.len() == 2 && sent.iter().all(|r| r.rejoined.is_none()), "{sent:?}");
        // The rank writes a good one after all: read at the next report.
        std::fs::remove_file(dir.join("rank-2.rejoined")).unwrap();
        std::fs::rename(dir.join("good"), dir.join("rank-2.rejoined")).unwrap();
        let sent = s2.report(2, true);
        assert_eq!(sent.iter().map(|r| (r.rank, r.rejoined.map(|x| x.epoch))).collect::<Vec<_>>(), [(2, Some(3)), (3, None)]);
        std::fs::remove_dir_all(&work).unwrap();
    }
}
