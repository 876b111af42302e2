//! The config files under `/etc/motley/` (`coordinator.toml`, `agent.toml`): one loader for
//! every binary. A file's keys are the long flags' names with `_` for `-` (`heartbeat_ms = 500`
//! is `--heartbeat-ms 500`). Precedence: flag > `MOTLEY_*` environment > file > built-in
//! default. A key that names no option is an error naming the key, the file and the keys
//! there are (a misspelt key silently ignored would run with a default the operator thought
//! they had changed). The default path may be missing; a path given with `--config` (or
//! `MOTLEY_CONFIG`) must exist.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, Parser};

use crate::error::ServerError;

/// Parse the command line, filling what it and the environment leave at their defaults from
/// the `config` file (the option with id `config`, `default_path` when not given).
pub fn parse<T: Parser>(default_path: &str) -> Result<T, ServerError> {
    parse_from::<T>(std::env::args_os().collect(), default_path)
}

pub fn parse_from<T: Parser>(argv: Vec<OsString>, default_path: &str) -> Result<T, ServerError> {
    let command = T::command();
    let matches = command.clone().get_matches_from(argv.clone());
    let from_matches = |m: &ArgMatches| T::from_arg_matches(m).map_err(|e| ServerError::Config(e.to_string()));
    let path: PathBuf = matches.get_one::<PathBuf>("config").cloned().unwrap_or_else(|| default_path.into());
    let explicit = given(&matches, "config");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return from_matches(&matches),
        Err(e) => return Err(ServerError::Config(format!("--config: cannot read {}: {e}", path.display()))),
    };
    let table: toml::Table = toml::from_str(&text).map_err(|e: toml::de::Error| {
        let line = e.span().map_or(0, |s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        ServerError::Config(format!("{}: line {line}: {}", path.display(), e.message()))
    })?;
    let known: Vec<String> = command.get_arguments().filter(|a| a.get_long().is_some()).map(|a| a.get_id().to_string()).collect();
    let mut extra: Vec<OsString> = vec![];
    for (key, value) in &table {
        if key == "config" || !known.contains(key) {
            return Err(ServerError::Config(format!("{}: unknown key '{key}'; the keys are {}", path.display(), known.join(", "))));
        }
        // Given on the command line or in the environment: that wins.
        if given(&matches, key) {
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            toml::Value::Boolean(true) => extra.push(flag.into()),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => extra.push(format!("{flag}={s}").into()),
            toml::Value::Integer(i) => extra.push(format!("{flag}={i}").into()),
            toml::Value::Float(f) => extra.push(format!("{flag}={f}").into()),
            other => {
                return Err(ServerError::Config(format!(
                    "{}: '{key}' must be a string, number or boolean, not {}",
                    path.display(),
                    other.type_str()
                )))
            }
        }
    }
    // Right after the program name: the file's settings belong to the top level, before any
    // subcommand.
    let mut full = argv;
    let at = full.len().min(1);
    full.splice(at..at, extra);
    let matches = command.try_get_matches_from(full).map_err(|e| ServerError::Config(format!("{}: {e}", path.display())))?;
    from_matches(&matches)
}

/// Whether the operator set the value (a flag or the environment), here or in a subcommand.
fn given(m: &ArgMatches, id: &str) -> bool {
    let source = m.try_get_raw(id).ok().flatten().and_then(|_| m.value_source(id));
    let here = matches!(source, Some(ValueSource::CommandLine | ValueSource::EnvVariable));
    here || m.subcommand().is_some_and(|(_, sub)| given(sub, id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Subcommand;

    #[derive(Parser, Debug)]
    struct Opts {
        #[arg(long, env = "MOTLEY_CONFIG_TEST_PORT", default_value_t = 1)]
        port: u16,
        #[arg(long, env = "MOTLEY_CONFIG_TEST_NAME", default_value = "default", global = true)]
        name: String,
        #[arg(long)]
        verbose: bool,
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(subcommand)]
        command: Option<Sub>,
    }

    #[derive(Subcommand, Debug)]
    enum Sub {
        Show,
    }

    fn file(text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("motley-config-{}-{}.toml", std::process::id(), text.len()));
        std::fs::write(&p, text).unwrap();
        p
    }

    fn parse(args: &[&str]) -> Result<Opts, ServerError> {
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
        let o = parse(&["--config", f.to_str().unwrap(), "show"]).unwrap();
        assert_eq!((o.port, o.name.as_str(), o.command.is_some()), (7, "from-file", true), "also with a subcommand");
        let o = parse(&["--config", f.to_str().unwrap(), "show", "--name", "flag"]).unwrap();
        assert_eq!(o.name, "flag", "a global flag given after the subcommand wins over the file");
    }

    #[test]
    fn unknown_keys_bad_values_and_missing_explicit_files_are_named() {
        let f = file("prot = 7\n");
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.contains("unknown key 'prot'") && e.contains("port"), "{e}");
        let e = parse(&["--config", "/nonexistent/x.toml"]).unwrap_err().to_string();
        assert!(e.starts_with("--config: cannot read /nonexistent/x.toml"), "{e}");
        // The default path may be absent.
        assert_eq!(parse(&[]).unwrap().port, 1);
        let f = file("port = [1, 2]\n");
        assert!(parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string().contains("'port' must be"));
        let f = file("port = \"many\"\n");
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.contains("many") && e.contains("--port"), "{e}");
        let f = file("port = \n");
        assert!(parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string().contains("line 1"));
    }
}
