//! The supervisor's reports: each message to the coordinator has a number in its session
//! (`seq`); the ranks it reports are in flight under that number until the coordinator
//! acknowledges it. Only then is the state told, and an end marked `rank-R.reported` on disk
//! (a later agent does not report it again): an agent that dies in between reports it again.
//! Unacknowledged reports are sent again after one base interval, and every session opens with
//! every rank (`full`).

use std::collections::BTreeMap;
use std::time::Instant;

use motley_proto::v1::RankStatus;

use super::{Key, Report, Supervisor};
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
        let resend_after = *self.interval.lock().expect("interval lock");
        let mut ranks = self.lock();
        let (mut out, mut flying) = (vec![], vec![]);
        let now = Instant::now();
        for (&key, r) in ranks.iter_mut() {
            let report = r.state.report();
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
            let (state, exit_code) = match report {
                Report::Running => ("running", None),
                Report::Exited(code) => ("exited", Some(code)),
                Report::Lost => ("lost", None),
            };
            out.push(RankStatus { job: key.0, generation: key.1, rank: key.2, state: state.into(), exit_code });
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
                if r.state.report() != report || r.told == Some(report) {
                    continue;
                }
                r.told = Some(report);
                if report != Report::Running {
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
}
