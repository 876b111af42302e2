//! A job's life: submitted -> planning -> launching -> running -> succeeded | failed | cancelled,
//! and running (or launching) -> recovering -> launching when a node is lost or a rank fails and
//! the job has budget left (it resumes from a checkpoint under the next generation); running ->
//! degraded when a replica is lost and the others keep training (docs/keep-going.md).
//! Pure: the coordinator's store applies these rules inside its transactions; clients read the
//! states in job views (`views`).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Submitted,
    Planning,
    Launching,
    Running,
    /// A node was lost or drained, or a rank failed: re-planned on the nodes it can use and
    /// restored from its newest complete checkpoint before the next launch.
    Recovering,
    /// A replica was lost and the others keep training, the same global batch split among them
    /// (a membership epoch, docs/keep-going.md).
    Degraded,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 9] = [
        JobState::Submitted,
        JobState::Planning,
        JobState::Launching,
        JobState::Running,
        JobState::Recovering,
        JobState::Degraded,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Submitted => "submitted",
            JobState::Planning => "planning",
            JobState::Launching => "launching",
            JobState::Running => "running",
            JobState::Recovering => "recovering",
            JobState::Degraded => "degraded",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Its ranks are out on the nodes (launching, running, or running without a lost replica).
    pub fn is_launched(self) -> bool {
        matches!(self, JobState::Launching | JobState::Running | JobState::Degraded)
    }

    /// No way out: the job is over.
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }

    /// Whether `self -> to` is a step of the job's life. Any live state may fail or be
    /// cancelled; a launched job may go back to launching (a relaunch under a new generation)
    /// directly or through `recovering` (re-planned and restored from a checkpoint first).
    pub fn can_become(self, to: JobState) -> bool {
        use JobState::*;
        if self.is_terminal() {
            return false;
        }
        matches!(
            (self, to),
            (Submitted, Planning)
                | (Planning, Launching)
                | (Launching, Running)
                | (Running, Succeeded)
                | (Running, Degraded)
                | (Degraded, Succeeded)
                | (Degraded, Running)
                | (Degraded, Recovering)
                | (Running, Launching)
                | (Launching, Launching)
                | (Running | Launching, Recovering)
                | (Recovering, Launching)
                | (_, Failed)
                | (_, Cancelled)
        )
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobState::ALL.into_iter().find(|j| j.as_str() == s).ok_or_else(|| format!("unknown job state '{s}'"))
    }
}

#[cfg(test)]
mod tests {
    use super::JobState::*;
    use super::*;

    #[test]
    fn the_life_of_a_job() {
        assert!(Submitted.can_become(Planning));
        assert!(Planning.can_become(Launching));
        assert!(Launching.can_become(Running));
        assert!(Running.can_become(Succeeded));
        assert!(Running.can_become(Launching), "relaunch under a new generation");
        assert!(Running.can_become(Recovering) && Launching.can_become(Recovering) && Recovering.can_become(Launching));
        assert!(!Recovering.can_become(Running) && !Submitted.can_become(Recovering), "a recovery relaunches first");
        for s in [Submitted, Planning, Launching, Running, Recovering] {
            assert!(s.can_become(Failed) && s.can_become(Cancelled));
        }
        for s in [Succeeded, Failed, Cancelled] {
            for t in JobState::ALL {
                assert!(!s.can_become(t), "{s} is final, not -> {t}");
            }
        }
        assert!(!Submitted.can_become(Running), "no launch without a plan");
        assert!(!Submitted.can_become(Succeeded));
        for s in JobState::ALL {
            assert_eq!(s.as_str().parse::<JobState>().unwrap(), s);
        }
        assert!("nope".parse::<JobState>().is_err());
    }

    #[test]
    fn into_and_out_of_recovering_exactly() {
        // Every move into recovering, and every move out of it, as a table.
        for s in JobState::ALL {
            let into = matches!(s, Running | Launching | Degraded);
            assert_eq!(s.can_become(Recovering), into, "{s} -> recovering");
        }
        for t in JobState::ALL {
            let out = matches!(t, Launching | Failed | Cancelled);
            assert_eq!(Recovering.can_become(t), out, "recovering -> {t}");
        }
        assert!(!Recovering.is_terminal());
        assert_eq!(Recovering.to_string(), "recovering");
        assert_eq!(serde_json::to_string(&Recovering).unwrap(), "\"recovering\"");
        assert_eq!(serde_json::from_str::<JobState>("\"recovering\"").unwrap(), Recovering);
        assert_eq!(JobState::ALL.iter().filter(|s| **s == Recovering).count(), 1);
    }

    #[test]
    fn into_and_out_of_degraded_exactly() {
        // Only a running job loses a replica and keeps going; a degraded one ends, recovers
        // whole (the last replica lost), or runs whole again once its lost replicas rejoined
        // from the members' live state; it never relaunches directly.
        for s in JobState::ALL {
            assert_eq!(s.can_become(Degraded), s == Running, "{s} -> degraded");
        }
        for t in JobState::ALL {
            let out = matches!(t, Succeeded | Recovering | Running | Failed | Cancelled);
            assert_eq!(Degraded.can_become(t), out, "degraded -> {t}");
        }
        assert!(Degraded.is_launched() && Running.is_launched() && Launching.is_launched() && !Recovering.is_launched());
        assert_eq!(serde_json::to_string(&Degraded).unwrap(), "\"degraded\"");
        assert_eq!("degraded".parse::<JobState>().unwrap(), Degraded);
    }
}
