//! The coordinator's REST client every remote command uses (`motley node`, `job`, `ckpt`,
//! `profile`, `net`): coordinator address(es) and token come from flags or `MOTLEY_COORDINATOR`
//! (a comma-separated list, tried in order; a standby's answer sends it to the leader) and
//! `MOTLEY_TOKEN`, else `motley-data/token` when a local coordinator runs in this directory.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::inputs::{InputError, Output};

#[derive(clap::Args, Clone)]
pub struct Remote {
    /// Coordinator URL(s), comma-separated; the first that answers is used.
    #[arg(long, env = "MOTLEY_COORDINATOR", default_value = "http://127.0.0.1:7070")]
    coordinator: String,
    /// Bearer token (default: motley-data/token if a local coordinator wrote one).
    #[arg(long, env = "MOTLEY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, env = "MOTLEY_OUTPUT")]
    pub(crate) output: Output,
    /// The CA certificate (PEM) an https coordinator's certificate is checked against
    /// (default: the public web roots).
    #[arg(long, env = "MOTLEY_CA_CERT")]
    ca_cert: Option<PathBuf>,
    /// Seconds one request may take, connecting and reading the whole answer included, before
    /// the coordinator counts as not answering (`job watch` and `logs -f` poll, so this bounds
    /// each poll, not the watch).
    #[arg(long, env = "MOTLEY_TIMEOUT", default_value_t = DEFAULT_TIMEOUT_S)]
    timeout: f64,
}

/// `--timeout`'s default, seconds: far above what any answer of a healthy coordinator takes,
/// short enough that a frozen one does not hang a script.
pub const DEFAULT_TIMEOUT_S: f64 = 30.0;

pub struct Client {
    bases: Vec<String>,
    token: Option<String>,
    agent: ureq::Agent,
    timeout: Duration,
}

impl Client {
    /// A client of one coordinator URL without a token (`--insecure` coordinators).
    pub fn local(url: &str) -> Result<Client, InputError> {
        Client::new(&Remote { coordinator: url.to_string(), token: None, output: Output::Table, ca_cert: None, timeout: DEFAULT_TIMEOUT_S })
    }

    pub(crate) fn new(r: &Remote) -> Result<Client, InputError> {
        let bases: Vec<String> =
            r.coordinator.split(',').map(|s| s.trim().trim_end_matches('/').to_string()).filter(|s| !s.is_empty()).collect();
        if bases.is_empty() {
            return Err(InputError("--coordinator: give at least one URL, e.g. http://127.0.0.1:7070".into()));
        }
        let token = r
            .token
            .clone()
            .or_else(|| std::fs::read_to_string("motley-data/token").ok().map(|t| t.trim().to_string()))
            .filter(|t| !t.is_empty());
        let timeout = Duration::try_from_secs_f64(r.timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| InputError(format!("--timeout: {} is not a positive number of seconds, e.g. 30", r.timeout)))?;
        // ureq's global timeout is per call of the agent (a new budget for every request):
        // exactly one request's bound, while polling commands run as long as their job.
        let mut config = ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(timeout));
        if let Some(path) = &r.ca_cert {
            let pem = std::fs::read(path).map_err(|e| InputError(format!("--ca-cert: cannot read {}: {e}", path.display())))?;
            let cert = ureq::tls::Certificate::from_pem(&pem)
                .map_err(|e| InputError(format!("--ca-cert: {}: not a PEM certificate: {e}", path.display())))?;
            let roots = ureq::tls::RootCerts::new_with_certs(&[cert]);
            config = config.tls_config(ureq::tls::TlsConfig::builder().root_certs(roots).build());
        }
        let agent: ureq::Agent = config.build().into();
        Ok(Client { bases, token, agent, timeout })
    }

    /// One call, trying each coordinator until one answers; errors carry the server's message.
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> Result<Value, InputError> {
        let (status, bytes) = self.request(method, path, body)?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        if status >= 400 {
            let msg = v.get("error").and_then(Value::as_str).unwrap_or(&text).to_string();
            return Err(InputError(format!("coordinator ({status}): {msg}")));
        }
        Ok(v)
    }

    /// The raw answer (status, body). A standby's 503 names the leader: the call goes there.
    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> Result<(u16, Vec<u8>), InputError> {
        let mut last = String::new();
        let mut bases = self.bases.clone();
        let mut i = 0;
        while i < bases.len() {
            let base = bases[i].clone();
            i += 1;
            let url = format!("{base}/api/v1{path}");
            let auth = self.token.as_ref().map(|t| format!("Bearer {t}"));
            let result = match (method, body) {
                ("GET" | "DELETE", _) => {
                    let mut r = if method == "GET" { self.agent.get(&url) } else { self.agent.delete(&url) };
                    if let Some(a) = &auth {
                        r = r.header("Authorization", a);
                    }
                    r.call()
                }
                (m, b) => {
                    let mut r = if m == "PUT" { self.agent.put(&url) } else { self.agent.post(&url) };
                    if let Some(a) = &auth {
                        r = r.header("Authorization", a);
                    }
                    r.send(b.unwrap_or(""))
                }
            };
            match result {
                Ok(mut resp) => {
                    let status = resp.status().as_u16();
                    let bytes = match resp.body_mut().with_config().limit(64 << 20).read_to_vec() {
                        Ok(b) => b,
                        Err(e) => return Err(InputError(format!("{url}: {}", self.describe(e)))),
                    };
                    if status == 503 {
                        let leader = serde_json::from_slice::<Value>(&bytes).ok().and_then(|v| v["leader"].as_str().map(str::to_string));
                        if let Some(l) = leader.filter(|l| !l.is_empty()) {
                            // Next, unless it is already ahead in the list (the loop ends: every
                            // address is tried at most once).
                            if !bases[i..].contains(&l) && !bases[..i].contains(&l) {
                                bases.insert(i, l);
                            }
                            last = format!("{base}: a standby");
                            continue;
                        }
                    }
                    return Ok((status, bytes));
                }
                Err(e) => last = format!("{base}: {}", self.describe(e)),
            }
        }
        Err(InputError(format!("no coordinator answered ({last}); check --coordinator / MOTLEY_COORDINATOR")))
    }

    /// A transport error for people: a timeout says how long was waited and which flag sets it.
    fn describe(&self, e: ureq::Error) -> String {
        let timed_out = match &e {
            ureq::Error::Timeout(_) => true,
            ureq::Error::Io(io) => io.kind() == std::io::ErrorKind::TimedOut,
            _ => false,
        };
        if timed_out {
            format!("no answer within {} s (--timeout / MOTLEY_TIMEOUT)", self.timeout.as_secs_f64())
        } else {
            e.to_string()
        }
    }
}

/// A node name as one URL path segment, percent-encoded: a name such as `../jobs/1` or `a?b`
/// must reach `/nodes/{name}` (to be refused there), never another route.
pub(crate) fn path_segment(name: &str) -> String {
    if name == "." || name == ".." {
        return name.replace('.', "%2E");
    }
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
