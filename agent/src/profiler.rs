//! Layer profiling on this node: a `Profile` instruction runs `python -m motley_torch.profile`
//! (the Python the operator named with `--python`) on the GPUs it names, and its entry, or why
//! it failed, is reported to the coordinator (`AgentStatus.profiles`) until acknowledged.
//!
//! Each run works in `WORK_DIR/profiles/REQUEST/` (the model file, the profiler's output and
//! log). Its outcome is written to `WORK_DIR/profiles/REQUEST.result.json` (0600, through a
//! temporary name) before it is reported, so an agent restarted before the acknowledgement
//! reports it again; both are removed once acknowledged. A result is sent once per session: a
//! new session sends every unacknowledged one again.

use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use motley_proto::v1::{Profile, ProfileResult};
use serde::{Deserialize, Serialize};

use crate::error::{AgentError, Result};

/// How much of a failed run's log the error carries.
const LOG_TAIL_BYTES: usize = 2000;

#[derive(Clone)]
pub struct Profiler {
    inner: Arc<Inner>,
    /// On an emulating node, the runs are held to the ranks' CPU share (docs/emulation.md):
    /// a profile measures the emulated device, not the whole machine.
    confine: Option<crate::ranks::confine::Confine>,
}

struct Inner {
    python: String,
    dir: PathBuf,
    node: String,
    /// Finished runs not yet acknowledged, by request; with the message that last carried them
    /// in this session.
    results: Mutex<BTreeMap<i64, (Stored, Option<u64>)>>,
    /// Requests running now.
    running: Mutex<std::collections::BTreeSet<i64>>,
    changed: tokio::sync::Notify,
}

/// A finished run as kept on disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Stored {
    request: i64,
    profile_json: String,
    error: String,
}

impl Profiler {
    /// A profiler running `python` (a path or a command on PATH), working under
    /// `WORK_DIR/profiles`; results an earlier agent left unacknowledged are picked up.
    pub fn new(python: &str, work_dir: &Path, node: &str) -> Result<Profiler> {
        let dir = work_dir.join("profiles");
        crate::workdir::create_dirs(&dir)?;
        let mut results = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).map_err(|err| AgentError::Io { what: "profiles directory", path: dir.clone(), err })?.flatten()
        {
            let path = entry.path();
            if !path.to_string_lossy().ends_with(".result.json") {
                continue;
            }
            match std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Stored>(&b).ok()) {
                Some(s) => {
                    results.insert(s.request, (s, None));
                }
                // Written through a temporary name: a file that does not read was not ours.
                None => tracing::warn!(node, "{}: not a profile result; ignored", path.display()),
            }
        }
        let inner = Inner {
            python: python.to_string(),
            dir,
            node: node.to_string(),
            results: Mutex::new(results),
            running: Mutex::default(),
            changed: tokio::sync::Notify::new(),
        };
        Ok(Profiler { inner: Arc::new(inner), confine: None })
    }

    /// Resolves when a run finished (its result is to be reported).
    pub async fn changed(&self) {
        self.inner.changed.notified().await
    }

    /// A new session: every unacknowledged result is sent again.
    pub fn new_session(&self) {
        for (_, sent) in self.inner.results.lock().expect("profile results").values_mut() {
            *sent = None;
        }
    }

    /// The results not yet sent in this session, marked as sent in message `seq`.
    pub fn report(&self, seq: u64) -> Vec<ProfileResult> {
        let mut results = self.inner.results.lock().expect("profile results");
        let mut out = vec![];
        for (s, sent) in results.values_mut().filter(|(_, sent)| sent.is_none()) {
            *sent = Some(seq);
            out.push(ProfileResult { request: s.request, profile_json: s.profile_json.clone(), error: s.error.clone() });
        }
        out
    }

    /// The coordinator holds what message `seq` said: its results are done with.
    pub fn ack(&self, seq: u64) {
        let done: Vec<i64> = {
            let mut results = self.inner.results.lock().expect("profile results");
            let done: Vec<i64> = results.iter().filter(|(_, (_, sent))| *sent == Some(seq)).map(|(r, _)| *r).collect();
            for r in &done {
                results.remove(r);
            }
            done
        };
        for r in done {
            let _ = std::fs::remove_file(self.inner.dir.join(format!("{r}.result.json")));
            let _ = std::fs::remove_dir_all(self.inner.dir.join(r.to_string()));
        }
    }

    /// Hold every run to this CPU share (`Supervisor::cpu_confine`).
    pub fn confined(mut self, confine: Option<crate::ranks::confine::Confine>) -> Profiler {
        self.confine = confine;
        self
    }

    /// Start a run (in the background); a request running or finished already is not run again.
    pub fn start(&self, p: Profile) {
        let fresh = !self.inner.results.lock().expect("profile results").contains_key(&p.request)
            && self.inner.running.lock().expect("profile runs").insert(p.request);
        if !fresh {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let request = p.request;
            tracing::info!(node = %this.inner.node, request, "profiling {} tp {} micro-batch {} on GPUs {:?}", p.gpu, p.tp, p.micro_batch, p.gpus);
            let (profile_json, error) = match this.run(&p).await {
                Ok(entry) => (entry, String::new()),
                Err(e) => (String::new(), e),
            };
            if !error.is_empty() {
                tracing::warn!(node = %this.inner.node, request, "profile run failed: {error}");
            }
            let stored = Stored { request, profile_json, error };
            let path = this.inner.dir.join(format!("{request}.result.json"));
            let bytes = serde_json::to_vec(&stored).expect("a result serialises");
            if let Err(e) = crate::workdir::write_atomic(&path, &bytes) {
                // Reported all the same; only a restart before the ack would lose it.
                tracing::warn!(node = %this.inner.node, "{e}");
            }
            this.inner.results.lock().expect("profile results").insert(request, (stored, None));
            this.inner.running.lock().expect("profile runs").remove(&request);
            this.inner.changed.notify_one();
        });
    }

    /// Run the profiler in its CPU share when there is one (its cgroup removed after); the
    /// entry it wrote (JSON), or why not.
    async fn run(&self, p: &Profile) -> std::result::Result<String, String> {
        let Some(confine) = &self.confine else { return self.run_in(p, None).await };
        let (dir, procs) =
            confine.create(&format!("profile-{}", p.request)).map_err(|e| format!("the profiler's CPU share (emulate.cpu): {e}"))?;
        let itself = confine.enters_itself();
        let result = self.run_in(p, Some((procs, itself))).await.and_then(|entry| {
            // Timings taken outside the share would be the machine's, not the emulated device's.
            if itself && !log_says(&self.log_path(p), crate::ranks::cpu_share::ENTERED_LINE) {
                return Err(format!(
                    "the profiler never entered its CPU share (${}): a motley_torch older than this agent? its timings would not be the emulated device's",
                    crate::ranks::cpu_share::ENTER_ENV
                ));
            }
            Ok(entry)
        });
        confine.clear(dir).await;
        result
    }

    /// A run's log (its standard output and error), in the run's directory.
    fn log_path(&self, p: &Profile) -> PathBuf {
        self.inner.dir.join(p.request.to_string()).join("profile.log")
    }

    /// One run in the cgroup whose `cgroup.procs` is `procs`, if any: entered before `exec`, or
    /// by the profiler itself once started (`true`: `cpu_share::ENTER_ENV`).
    async fn run_in(&self, p: &Profile, procs: Option<(std::ffi::CString, bool)>) -> std::result::Result<String, String> {
        let dir = self.inner.dir.join(p.request.to_string());
        crate::workdir::create_dirs(&dir).map_err(|e| e.to_string())?;
        let model = dir.join("model.json");
        crate::workdir::replace(&model, p.model_json.as_bytes()).map_err(|e| e.to_string())?;
        let output = dir.join("profiles.yaml");
        let _ = std::fs::remove_file(&output);
        let log_path = self.log_path(p);
        let log = crate::workdir::create_file(&log_path).map_err(|e| e.to_string())?;
        let err_log = log.try_clone().map_err(|e| e.to_string())?;
        let gpus: Vec<String> = p.gpus.iter().map(u32::to_string).collect();
        let mut cmd = tokio::process::Command::new(&self.inner.python);
        cmd.args(["-m", "motley_torch.profile", "--model"])
            .arg(&model)
            .args(["--tp", &p.tp.to_string(), "--micro-batch", &p.micro_batch.to_string(), "--seq-len", &p.seq_len.to_string()])
            .args(["--gpu", &p.gpu, "--dtype", &p.dtype, "--output"])
            .arg(&output)
            .env("CUDA_VISIBLE_DEVICES", gpus.join(","))
            .current_dir(&dir)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(err_log)
            // Its own process group: a timeout ends the TP workers it started too.
            .process_group(0)
            .kill_on_drop(true);
        if let Some((procs, itself)) = procs {
            // An emulated GPU is a CPU share the kernel enforces by stopping the process: only
            // the wall clock sees it (the profiler's CPU default counts the thread's CPU time).
            // Its mean over many runs: a pass of a few ms may fall between two throttlings or
            // across one, and only the mean converges on the share (a median sees the lucky runs).
            cmd.args(["--clock", "wall", "--runs", "20"]);
            if itself {
                cmd.env(crate::ranks::cpu_share::ENTER_ENV, std::ffi::OsStr::from_bytes(procs.as_bytes()));
            } else {
                // SAFETY: `enter` makes system calls only (no allocation, no locks).
                unsafe {
                    cmd.pre_exec(move || crate::ranks::cgroup::enter(&procs));
                }
            }
        }
        let mut child = cmd.spawn().map_err(|e| format!("cannot start {} (--python): {e}", self.inner.python))?;
        let pid = child.id();
        let limit = Duration::from_secs(u64::from(p.timeout_s.max(1)));
        let status = match tokio::time::timeout(limit, child.wait()).await {
            Ok(s) => s.map_err(|e| e.to_string())?,
            Err(_) => {
                if let Some(pid) = pid {
                    // SAFETY: signalling a process group this agent created; no memory is touched.
                    unsafe { libc::killpg(pid as i32, libc::SIGKILL) };
                }
                let _ = child.wait().await;
                return Err(format!("the profiler ran longer than {} s and was killed; {}", limit.as_secs(), tail(&log_path)));
            }
        };
        if !status.success() {
            return Err(format!("the profiler exited with {status}: {}", tail(&log_path)));
        }
        entry_of(&output, p)
    }
}

/// Whether a run's log holds `line`.
fn log_says(path: &Path, line: &str) -> bool {
    std::fs::read(path).is_ok_and(|b| String::from_utf8_lossy(&b).contains(line))
}

/// The end of a run's log, for the error.
fn tail(path: &Path) -> String {
    let text = std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let text = text.trim_end();
    let start = text.len().saturating_sub(LOG_TAIL_BYTES);
    let start = (start..=text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(text.len());
    if text.is_empty() {
        "its log is empty".into()
    } else {
        format!("its log ends: {}", &text[start..])
    }
}

/// The profiles file's entry for the run's (gpu, tp, micro-batch), as JSON.
fn entry_of(output: &Path, p: &Profile) -> std::result::Result<String, String> {
    let text = std::fs::read_to_string(output).map_err(|e| format!("the profiler wrote no {}: {e}", output.display()))?;
    let doc: serde_json::Value = serde_norway::from_str(&text).map_err(|e| format!("{}: not YAML: {e}", output.display()))?;
    let entries = doc.get("profiles").and_then(|v| v.as_array()).ok_or_else(|| format!("{}: no `profiles:` list", output.display()))?;
    let hit = entries.iter().find(|e| {
        e.get("tp").and_then(|v| v.as_u64()) == Some(u64::from(p.tp))
            && e.get("micro_batch").and_then(|v| v.as_u64()) == Some(u64::from(p.micro_batch))
            && e.get("gpu").and_then(|v| v.as_str()).is_some_and(|g| g.eq_ignore_ascii_case(&p.gpu))
    });
    let hit = hit.ok_or_else(|| format!("{}: no entry for {} tp {} micro-batch {}", output.display(), p.gpu, p.tp, p.micro_batch))?;
    Ok(hit.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for `python` that writes the profiles file `motley_torch.profile` would (or
    /// fails, or hangs), as the flags say.
    fn fake_python(dir: &Path, body: &str) -> String {
        let path = dir.join("python");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.to_string_lossy().into_owned()
    }

    fn request(n: i64, timeout_s: u32) -> Profile {
        Profile {
            request: n,
            gpu: "A100-80G".into(),
            model_json: "{\"name\":\"m\"}".into(),
            tp: 1,
            micro_batch: 2,
            seq_len: 16,
            dtype: "fp32".into(),
            gpus: vec![3],
            timeout_s,
        }
    }

    /// A fresh directory of this test's own.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("motley-profiler-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    async fn finished(p: &Profiler) -> Vec<ProfileResult> {
        for _ in 0..200 {
            let r = p.report(1);
            if !r.is_empty() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("no result");
    }

    #[tokio::test]
    async fn a_run_reports_its_entry_until_acknowledged_even_across_a_restart() {
        let tmp = scratch("ok");
        // Writes what it was asked for, with the GPUs it was given in `device`.
        let py = fake_python(
            &tmp,
            r#"out=""; while [ $# -gt 0 ]; do case "$1" in --output) out="$2"; shift;; esac; shift; done
printf 'profiles:\n  - {gpu: A100-80G, tp: 1, micro_batch: 2, fwd_ms: 1.5, bwd_ms: 3, device: "gpus %s"}\n' "$CUDA_VISIBLE_DEVICES" > "$out""#,
        );
        let p = Profiler::new(&py, &tmp, "n1").unwrap();
        p.start(request(7, 30));
        let r = finished(&p).await;
        assert_eq!(r.len(), 1);
        assert!(r[0].error.is_empty(), "{}", r[0].error);
        let entry: serde_json::Value = serde_json::from_str(&r[0].profile_json).unwrap();
        assert_eq!(entry["fwd_ms"], 1.5);
        assert_eq!(entry["device"], "gpus 3");
        assert!(p.report(2).is_empty(), "sent once per session");
        let file = tmp.join("profiles/7.result.json");
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        // A restarted agent finds it and sends it again; an ack of another message keeps it.
        let again = Profiler::new(&py, &tmp, "n1").unwrap();
        assert_eq!(again.report(5).len(), 1);
        again.ack(4);
        again.new_session();
        assert_eq!(again.report(6).len(), 1);
        again.ack(6);
        assert!(!file.exists() && !tmp.join("profiles/7").exists());
        again.new_session();
        assert!(again.report(7).is_empty());
        // A request already done is not run again.
        p.ack(1);
    }

    #[tokio::test]
    async fn on_an_emulating_node_a_run_is_held_to_the_share_in_a_cgroup_of_its_own() {
        let tmp = scratch("confined");
        let cpu = match crate::ranks::cpu_share::CpuV1::detect("prof", &tmp, 0.25) {
            Ok(c) => c,
            Err(why) => {
                // Root and the v1 cpu controller, as on the CI machine (which must run it).
                assert!(std::env::var_os("CI").is_none(), "this test needs root and the v1 cpu controller: {why}");
                return;
            }
        };
        let own = cpu.path(0, 0, 0).parent().unwrap().join("profile-9");
        // Writes the quota and period of the cgroup it runs in and its arguments, then the entry.
        let py = fake_python(
            &tmp,
            &format!(
                r#"echo 0 > "$MOTLEY_CPU_SHARE_PROCS" && echo "motley-cpu-share: entered $MOTLEY_CPU_SHARE_PROCS" >&2; cat {0}/cpu.cfs_quota_us {0}/cpu.cfs_period_us > quota.txt; echo "$@" > args.txt; grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup > cgroup.txt
out=""; while [ $# -gt 0 ]; do case "$1" in --output) out="$2"; shift;; esac; shift; done
printf 'profiles:
  - {{gpu: A100-80G, tp: 1, micro_batch: 2, fwd_ms: 1.5, bwd_ms: 3}}
' > "$out""#,
                own.display()
            ),
        );
        let p = Profiler::new(&py, &tmp, "n1").unwrap().confined(Some(crate::ranks::confine::Confine::V1(cpu)));
        p.start(request(9, 30));
        let r = finished(&p).await;
        assert!(r[0].error.is_empty(), "{}", r[0].error);
        let run = tmp.join("profiles/9");
        // A quarter of a core: 5 ms every 20 ms.
        assert_eq!(std::fs::read_to_string(run.join("quota.txt")).unwrap().split_whitespace().collect::<Vec<_>>(), ["5000", "20000"]);
        let args = std::fs::read_to_string(run.join("args.txt")).unwrap();
        assert!(args.contains("--clock wall"), "the emulated device is timed by the wall clock: {args}");
        assert!(std::fs::read_to_string(run.join("cgroup.txt")).unwrap().trim_end().ends_with("/profile-9"));
        assert!(!own.exists(), "the run's cgroup is removed after it: {}", own.display());
        let _ = std::fs::remove_dir(own.parent().unwrap());
    }

    #[tokio::test]
    async fn a_run_that_never_entered_its_share_is_refused() {
        let tmp = scratch("unconfined");
        let Ok(cpu) = crate::ranks::cpu_share::CpuV1::detect("prof", &tmp, 0.25) else {
            assert!(std::env::var_os("CI").is_none(), "this test needs root and the v1 cpu controller");
            return;
        };
        // Writes its entry without entering the share it was handed.
        let py = fake_python(
            &tmp,
            r#"out=""; while [ $# -gt 0 ]; do case "$1" in --output) out="$2"; shift;; esac; shift; done
printf 'profiles:\n  - {gpu: A100-80G, tp: 1, micro_batch: 2, fwd_ms: 1.5, bwd_ms: 3}\n' > "$out""#,
        );
        let own = cpu.path(0, 0, 0).parent().unwrap().join("profile-4");
        let p = Profiler::new(&py, &tmp, "n1").unwrap().confined(Some(crate::ranks::confine::Confine::V1(cpu)));
        p.start(request(4, 30));
        let r = finished(&p).await;
        assert!(r[0].error.contains("never entered its CPU share"), "{}", r[0].error);
        assert!(r[0].profile_json.is_empty(), "{}", r[0].profile_json);
        assert!(!own.exists(), "the run's cgroup is removed after it: {}", own.display());
        let _ = std::fs::remove_dir(own.parent().unwrap());
    }

    #[tokio::test]
    async fn a_failed_or_hung_run_reports_why() {
        let tmp = scratch("fails");
        let py = fake_python(&tmp, "echo 'ModuleNotFoundError: No module named motley_torch' >&2; exit 1");
        let p = Profiler::new(&py, &tmp, "n1").unwrap();
        p.start(request(1, 30));
        let r = finished(&p).await;
        assert!(r[0].profile_json.is_empty());
        assert!(r[0].error.contains("exited with") && r[0].error.contains("No module named motley_torch"), "{}", r[0].error);

        let hang = scratch("hangs");
        let py = fake_python(&hang, "sleep 30 & wait");
        let p = Profiler::new(&py, &hang, "n1").unwrap();
        p.start(request(2, 1));
        let r = finished(&p).await;
        assert!(r[0].error.contains("longer than 1 s"), "{}", r[0].error);

        let none = scratch("none");
        let p = Profiler::new("/nonexistent/python3", &none, "n1").unwrap();
        p.start(request(3, 30));
        assert!(finished(&p).await[0].error.contains("cannot start /nonexistent/python3 (--python)"));
    }
}
