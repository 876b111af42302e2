//! `motley-ckpt`: check and re-slice a checkpoint step on disk (docs/checkpoint.md).
//!
//!     motley-ckpt verify STEP_DIR                     # complete? every chunk's crc32c
//!     motley-ckpt reslice STEP_DIR --tp T --out DIR   # every unit re-cut for TP degree T
//!
//! Each prints one JSON line (step, units, ranks, bytes); an error exits 1 with its message.

use std::path::PathBuf;
use std::process::ExitCode;

use motley_checkpoint::{reslice_step, Manifest};

const USAGE: &str = "usage: motley-ckpt verify STEP_DIR | motley-ckpt reslice STEP_DIR --tp T --out DIR";

fn summary(m: &Manifest) -> String {
    let bytes: u64 = m.units.iter().map(|u| u.file.bytes).chain(m.ranks.iter().map(|r| r.file.bytes)).sum();
    serde_json::json!({"step": m.step, "layers": m.layers, "units": m.units.len(), "ranks": m.ranks.len(), "bytes": bytes}).to_string()
}

fn run(args: &[String]) -> Result<String, String> {
    match args {
        [cmd, dir] if cmd == "verify" => {
            let dir = PathBuf::from(dir);
            let m = Manifest::load(&dir).map_err(|e| e.to_string())?;
            m.check_complete().map_err(|e| e.to_string())?;
            m.verify(&dir).map_err(|e| e.to_string())?;
            Ok(summary(&m))
        }
        [cmd, dir, rest @ ..] if cmd == "reslice" => {
            let (mut tp, mut out) = (None, None);
            let mut it = rest.iter();
            while let Some(flag) = it.next() {
                let value = it.next().ok_or_else(|| format!("{flag}: needs a value\n{USAGE}"))?;
                match flag.as_str() {
                    "--tp" => {
                        tp = Some(
                            value
                                .parse::<u32>()
                                .ok()
                                .filter(|t| *t > 0)
                                .ok_or_else(|| format!("--tp: {value:?} is not a positive integer (the new TP degree)"))?,
                        )
                    }
                    "--out" => out = Some(PathBuf::from(value)),
                    _ => return Err(format!("{flag}: unknown flag\n{USAGE}")),
                }
            }
            let tp = tp.ok_or_else(|| format!("--tp: required\n{USAGE}"))?;
            let out = out.ok_or_else(|| format!("--out: required (the new step directory)\n{USAGE}"))?;
            let m = reslice_step(&PathBuf::from(dir), &out, tp).map_err(|e| e.to_string())?;
            Ok(summary(&m))
        }
        _ => Err(USAGE.into()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("motley-ckpt: {e}");
            ExitCode::FAILURE
        }
    }
}
