//! Options from a TOML file under `/etc/motley/`, overridden by `MOTLEY_*` variables and flags.
//!
//! The file's keys are the long flags' names with `_` for `-` (`heartbeat_ms = 500` is
//! `--heartbeat-ms 500`). Precedence: flag > environment > file > built-in default. A key that
//! names no option is an error naming the key and the file. The default path may be missing;
//! a path given with `--config` (or `MOTLEY_CONFIG`) must exist.

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::Parser;

/// Parse the command line, filling what it and the environment leave at their defaults from
/// the `config` file (the option with id `config`).
pub fn parse<T: Parser>(default_path: &str) -> anyhow::Result<T> {
    parse_from::<T>(std::env::args_os().collect(), default_path)
}

pub fn parse_from<T: Parser>(argv: Vec<OsString>, default_path: &str) -> anyhow::Result<T> {
    let command = T::command();
    let matches = command.clone().get_matches_from(argv.clone());
    let path: PathBuf = matches.get_one::<PathBuf>("config").cloned().unwrap_or_else(|| default_path.into());
    let explicit = matches.value_source("config").is_some_and(|s| s != ValueSource::DefaultValue);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return Ok(T::from_arg_matches(&matches)?),
        Err(e) => return Err(e).with_context(|| format!("--config: cannot read {}", path.display())),
    };
    let table: toml::Table = toml::from_str(&text).with_context(|| format!("{}: not valid TOML", path.display()))?;
    let known: Vec<String> = command.get_arguments().filter(|a| a.get_long().is_some()).map(|a| a.get_id().to_string()).collect();
    let mut extra: Vec<OsString> = vec![];
    for (key, value) in &table {
        if key == "config" || !known.contains(key) {
            anyhow::bail!("{}: unknown key '{key}'; the keys are {}", path.display(), known.join(", "));
        }
        // Given on the command line or in the environment: that wins.
        if matches.value_source(key).is_some_and(|s| s != ValueSource::DefaultValue) {
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            toml::Value::Boolean(true) => extra.push(flag.into()),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => extra.push(format!("{flag}={s}").into()),
            toml::Value::Integer(i) => extra.push(format!("{flag}={i}").into()),
            toml::Value::Float(f) => extra.push(format!("{flag}={f}").into()),
            other => anyhow::bail!("{}: '{key}' must be a string, number or boolean, not {}", path.display(), other.type_str()),
        }
    }
    let mut full = argv;
    full.extend(extra);
    let matches = command.try_get_matches_from(full).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(T::from_arg_matches(&matches)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser, Debug)]
    struct Opts {
        #[arg(long, env = "MOTLEY_CONFIG_TEST_PORT", default_value_t = 1)]
        port: u16,
        #[arg(long, env = "MOTLEY_CONFIG_TEST_NAME", default_value = "default")]
        name: String,
        #[arg(long)]
        verbose: bool,
        #[arg(long)]
        config: Option<PathBuf>,
    }

    fn file(text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("motley-config-{}-{}.toml", std::process::id(), text.len()));
        std::fs::write(&p, text).unwrap();
        p
    }

    fn parse(args: &[&str]) -> anyhow::Result<Opts> {
        let argv = std::iter::once("x").chain(args.iter().copied()).map(OsString::from).collect();
        parse_from::<Opts>(argv, "/nonexistent/motley-test.toml")
    }

    #[test]
    fn the_file_fills_what_flags_leave_at_their_defaults() {
        let f = file("port = 7\nname = \"from-file\"\nverbose = true\n");
        let o = parse(&["--config", f.to_str().unwrap()]).unwrap();
        assert_eq!((o.port, o.name.as_str(), o.verbose), (7, "from-file", true));
        let o = parse(&["--config", f.to_str().unwrap(), "--port", "9"]).unwrap();
        assert_eq!((o.port, o.name.as_str()), (9, "from-file"), "a flag wins over the file");
    }

    #[test]
    fn unknown_keys_and_missing_explicit_files_are_named() {
        let f = file("prot = 7\n");
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.contains("unknown key 'prot'") && e.contains("port"), "{e}");
        let e = parse(&["--config", "/nonexistent/x.toml"]).unwrap_err().to_string();
        assert!(e.contains("--config: cannot read /nonexistent/x.toml"), "{e}");
        // The default path may be absent.
        assert_eq!(parse(&[]).unwrap().port, 1);
        let f = file("port = [1, 2]\n");
        assert!(parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string().contains("'port' must be"));
    }
}
