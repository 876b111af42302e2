//! `motley-rank-probe [--sleep-ms N] [--timeout-ms N]`: a job's `run` for tests and smoke runs.
//! It checks the environment a rank gets (the torchrun variables, CUDA_VISIBLE_DEVICES and
//! Motley's own) and meets the other ranks at MASTER_ADDR:MASTER_PORT: rank 0 listens and
//! waits for WORLD_SIZE-1 distinct ranks, each of which connects (retrying until the timeout)
//! and sends "RANK\n"; rank 0 answers each with "ok\n". Exit 0 only if all of that held; else
//! every problem is printed and the exit code is 1 (2 for bad flags). `--sleep-ms` sleeps after
//! the rendezvous, so a test can stop a running job.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

struct Env {
    rank: u32,
    world: u32,
    addr: String,
    port: u16,
}

/// Read and check every variable; the problems found, or what the rendezvous needs.
fn check_env(var: impl Fn(&str) -> Option<String>) -> Result<Env, Vec<String>> {
    let mut bad = vec![];
    let mut num = |name: &str| -> Option<i64> {
        match var(name).map(|v| v.parse::<i64>()) {
            Some(Ok(n)) if n >= 0 => Some(n),
            Some(_) => {
                bad.push(format!("{name}={:?} is not a non-negative integer", var(name).unwrap_or_default()));
                None
            }
            None => {
                bad.push(format!("{name} is not set"));
                None
            }
        }
    };
    let (rank, world, local, local_world) = (num("RANK"), num("WORLD_SIZE"), num("LOCAL_RANK"), num("LOCAL_WORLD_SIZE"));
    let (port, _job, _gen) = (num("MASTER_PORT"), num("MOTLEY_JOB"), num("MOTLEY_GENERATION"));
    let (start, end) = (num("MOTLEY_LAYER_START"), num("MOTLEY_LAYER_END"));
    if let (Some(r), Some(w)) = (rank, world) {
        if r >= w {
            bad.push(format!("RANK={r} is not below WORLD_SIZE={w}"));
        }
    }
    if let (Some(l), Some(lw)) = (local, local_world) {
        if l >= lw {
            bad.push(format!("LOCAL_RANK={l} is not below LOCAL_WORLD_SIZE={lw}"));
        }
    }
    if let (Some(lw), Some(w)) = (local_world, world) {
        if lw > w {
            bad.push(format!("LOCAL_WORLD_SIZE={lw} is above WORLD_SIZE={w}"));
        }
    }
    if let (Some(s), Some(e)) = (start, end) {
        if s >= e {
            bad.push(format!("MOTLEY_LAYER_START={s} is not below MOTLEY_LAYER_END={e}"));
        }
    }
    if port.is_some_and(|p| p == 0 || p > 65535) {
        bad.push(format!("MASTER_PORT={} is not a port", port.unwrap_or(0)));
    }
    let addr = var("MASTER_ADDR").unwrap_or_default();
    if addr.is_empty() {
        bad.push("MASTER_ADDR is not set".into());
    }
    match var("CUDA_VISIBLE_DEVICES") {
        Some(v) if !v.is_empty() && v.split(',').all(|d| d.trim().parse::<u32>().is_ok() || d.trim().starts_with("GPU-")) => {}
        other => bad.push(format!("CUDA_VISIBLE_DEVICES={other:?} is not a list of GPU indices")),
    }
    match var("MOTLEY_PLAN") {
        None => bad.push("MOTLEY_PLAN is not set".into()),
        Some(p) => match std::fs::read_to_string(&p) {
            Err(e) => bad.push(format!("MOTLEY_PLAN={p}: {e}")),
            Ok(t) => {
                if let Err(e) = serde_json::from_str::<serde_json::Value>(&t) {
                    bad.push(format!("MOTLEY_PLAN={p} is not JSON: {e}"));
                }
            }
        },
    }
    match (bad.is_empty(), rank, world, port) {
        (true, Some(rank), Some(world), Some(port)) => Ok(Env { rank: rank as u32, world: world as u32, addr, port: port as u16 }),
        _ => Err(bad),
    }
}

/// Rank 0: wait for every other rank once, answer each "ok".
fn serve(e: &Env, deadline: Instant) -> Result<(), String> {
    let listener =
        TcpListener::bind((e.addr.as_str(), e.port)).map_err(|x| format!("rank 0 cannot listen on {}:{}: {x}", e.addr, e.port))?;
    listener.set_nonblocking(true).map_err(|x| x.to_string())?;
    let mut seen = BTreeSet::new();
    while seen.len() + 1 < e.world as usize {
        let (stream, _) = match listener.accept() {
            Ok(s) => s,
            Err(x) if x.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(format!("rank 0 heard from ranks {seen:?} only, of 1..{} (timed out)", e.world));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(x) => return Err(format!("accept: {x}")),
        };
        stream.set_nonblocking(false).map_err(|x| x.to_string())?;
        stream
            .set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
            .map_err(|x| x.to_string())?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line).map_err(|x| format!("reading a rank: {x}"))?;
        let r: u32 = line.trim().parse().map_err(|_| format!("a peer sent {line:?}, not a rank"))?;
        if r == 0 || r >= e.world || !seen.insert(r) {
            return Err(format!("a peer sent rank {r}: not one of 1..{} not seen before", e.world));
        }
        (&stream).write_all(b"ok\n").map_err(|x| format!("answering rank {r}: {x}"))?;
    }
    Ok(())
}

/// Any other rank: connect (rank 0 may not listen yet), send the rank, expect "ok".
fn join(e: &Env, deadline: Instant) -> Result<(), String> {
    let target = format!("{}:{}", e.addr, e.port);
    let stream = loop {
        let addrs = target.to_socket_addrs().map_err(|x| format!("MASTER_ADDR {target}: {x}"))?;
        match addrs.into_iter().find_map(|a| TcpStream::connect_timeout(&a, Duration::from_millis(500)).ok()) {
            Some(s) => break s,
            None if Instant::now() > deadline => return Err(format!("rank {} could not reach rank 0 at {target} (timed out)", e.rank)),
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    stream
        .set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
        .map_err(|x| x.to_string())?;
    (&stream).write_all(format!("{}\n", e.rank).as_bytes()).map_err(|x| format!("sending to rank 0: {x}"))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(|x| format!("waiting for rank 0: {x}"))?;
    if line.trim() != "ok" {
        return Err(format!("rank 0 answered {line:?}, not ok"));
    }
    Ok(())
}

fn flag(args: &[String], name: &str, default: u64) -> Result<u64, String> {
    match args.iter().rposition(|a| a == name) {
        None => Ok(default),
        Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).ok_or_else(|| format!("{name} needs a number of milliseconds")),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (sleep, timeout) = match (flag(&args, "--sleep-ms", 0), flag(&args, "--timeout-ms", 30_000)) {
        (Ok(s), Ok(t)) => (s, t),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("motley-rank-probe: {e}");
            std::process::exit(2);
        }
    };
    let env = match check_env(|k| std::env::var(k).ok()) {
        Ok(e) => e,
        Err(bad) => {
            for b in bad {
                println!("motley-rank-probe: {b}");
            }
            std::process::exit(1);
        }
    };
    let deadline = Instant::now() + Duration::from_millis(timeout);
    let met = if env.rank == 0 { serve(&env, deadline) } else { join(&env, deadline) };
    if let Err(e) = met {
        println!("motley-rank-probe: rank {}: {e}", env.rank);
        std::process::exit(1);
    }
    println!("motley-rank-probe: rank {} of {}: environment and rendezvous ok", env.rank, env.world);
    std::thread::sleep(Duration::from_millis(sleep));
}
