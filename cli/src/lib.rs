//! The `motley` CLI's library half: reading input files and rendering plans, so tests can
//! reach them without spawning the binary.

pub mod ckpt;
pub mod client;
pub mod dev;
pub mod drain;
pub mod emulate;
pub mod inputs;
pub mod model;
pub mod net;
pub mod plan;
pub mod profile;
pub mod provision;
pub mod remote;
pub mod restore;
pub mod table;

/// `motley`'s exit codes. A script running `motley job watch` or `motley dev up` must be able
/// to tell a job that failed from one that was cancelled and from a CLI that could not do its
/// work, so each has its own code (documented in `--help` and the README).
pub mod exit {
    /// The command did its work; for `job watch` and `dev up`, the job succeeded.
    pub const SUCCESS: u8 = 0;
    /// `job watch` / `dev up`: the job ended failed; `profile run --wait`: the run failed.
    pub const JOB_FAILED: u8 = 1;
    /// Bad input or usage, an error answer from the coordinator, no coordinator answering.
    pub const ERROR: u8 = 2;
    /// `job watch` / `dev up`: the job ended cancelled (also after Ctrl-C in `dev up`).
    pub const JOB_CANCELLED: u8 = 3;
    /// `job watch`, and deploy/slurm/motley.sbatch: preempted, and resumable (EX_TEMPFAIL). The
    /// watch was stopped by SIGTERM or SIGUSR1 (what Slurm, Kubernetes and spot clouds send
    /// before they take the machine) while the job was not over: the coordinator keeps it, and
    /// it resumes from its newest complete step. Worth retrying (Slurm's `RequeueExit`,
    /// SkyPilot's `recover_on_exit_codes`, a Kubernetes Job's `podFailurePolicy`); no other
    /// non-zero code is (docs/slurm.md, "Exit codes").
    pub const PREEMPTED: u8 = 75;

    /// The code for a job that ended in `state` (`succeeded`, `failed`, `cancelled`).
    pub fn for_job_state(state: &str) -> u8 {
        match state {
            "succeeded" => SUCCESS,
            "cancelled" => JOB_CANCELLED,
            _ => JOB_FAILED,
        }
    }

    /// The codes for `--help`.
    pub const HELP: &str = "Exit codes: 0 success (for `job watch` and `dev up`: the job succeeded), \
                            1 the watched job failed, 2 bad input, usage or a coordinator error, 3 the watched job was cancelled, \
                            75 the watch was stopped by SIGTERM or SIGUSR1 while the job was not over (preempted: retry).";
}

/// What a command prints on standard output, and the process's exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub text: String,
    pub code: u8,
}

impl Outcome {
    /// A command's end as a process's: its text on standard output and its code, or its error
    /// on one line of standard error and exit code 2 (`exit::ERROR`). For `motley` and
    /// `motley-baselines` alike.
    pub fn finish<E: std::fmt::Display>(result: Result<Outcome, E>) -> std::process::ExitCode {
        match result {
            Ok(Outcome { text, code }) => {
                use std::io::Write;
                // A closed pipe (`motley plan ... | head`) is not an error worth a panic.
                let _ = writeln!(std::io::stdout().lock(), "{text}");
                std::process::ExitCode::from(code)
            }
            Err(e) => {
                // Errors quote names and messages from files and the coordinator: escaped like tables.
                eprintln!("error: {}", table::escape(&e.to_string()));
                std::process::ExitCode::from(exit::ERROR)
            }
        }
    }
}

impl From<String> for Outcome {
    fn from(text: String) -> Outcome {
        Outcome { text, code: exit::SUCCESS }
    }
}
