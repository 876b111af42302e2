//! Reading the cluster, model and profile files, with errors that name the file, the field
//! and the fix.

use std::path::Path;

use motley_solver::{model, Calibration, ClusterSpec, ModelSpec, ProfileSet, SolverError};

/// `-o table|json`: tables for people, JSON for scripts (every command).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// `--search auto|exact|fast`: the planner's mode.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Auto,
    Exact,
    Fast,
}

impl From<Mode> for motley_solver::SearchMode {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Auto => motley_solver::SearchMode::Auto,
            Mode::Exact => motley_solver::SearchMode::Exact,
            Mode::Fast => motley_solver::SearchMode::Fast,
        }
    }
}

/// A problem with what the user gave us: printed on one line, exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InputError(pub String);

fn read(path: &Path, what: &str) -> Result<String, InputError> {
    std::fs::read_to_string(path).map_err(|e| InputError(format!("{}: cannot read {what} file: {e}", path.display())))
}

/// Parse YAML (JSON is YAML too) into `T`, reporting the path of the field that failed.
pub fn parse_yaml<T: serde::de::DeserializeOwned>(text: &str, origin: &str) -> Result<T, InputError> {
    let de = serde_norway::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        let hint = if inner.contains("missing field") {
            "; add it"
        } else if inner.contains("unknown field") {
            "; remove it or fix its spelling"
        } else {
            ""
        };
        if path == "." || path.is_empty() || inner.starts_with(&path) {
            InputError(format!("{origin}: {inner}{hint}"))
        } else {
            InputError(format!("{origin}: {path}: {inner}{hint}"))
        }
    })
}

/// Attach the file name to a validation error of the solver.
pub fn in_file(origin: &str, e: SolverError) -> InputError {
    InputError(format!("{origin}: {e}"))
}

pub fn load_cluster(path: &Path) -> Result<motley_solver::Cluster, InputError> {
    parse_cluster(&read(path, "cluster")?, &path.display().to_string())
}

/// Parse and validate a cluster file's text; `origin` names it in errors.
pub fn parse_cluster(text: &str, origin: &str) -> Result<motley_solver::Cluster, InputError> {
    let spec: ClusterSpec = parse_yaml(text, origin)?;
    motley_solver::Cluster::from_spec(&spec).map_err(|e| in_file(origin, e))
}

/// `--model` is a catalog name, a Hugging Face model directory (or its config.json) or a
/// YAML file.
pub fn load_model(name_or_file: &str, seq_len: Option<u64>) -> Result<motley_solver::Model, InputError> {
    let (spec, origin) = load_model_spec(name_or_file)?;
    motley_solver::Model::new(spec, seq_len).map_err(|e| in_file(&origin, e))
}

/// The spec `--model` names, unvalidated, and how errors name where it came from.
pub fn load_model_spec(name_or_file: &str) -> Result<(ModelSpec, String), InputError> {
    let path = Path::new(name_or_file);
    if let Some(m) = model::model_by_name(name_or_file) {
        Ok((m, format!("model {name_or_file}")))
    } else if let Some(hf) = hf_model(path) {
        hf
    } else if path.exists() {
        let origin = path.display().to_string();
        Ok((parse_yaml::<ModelSpec>(&read(path, "model")?, &origin)?, origin))
    } else {
        let known: Vec<String> = model::model_catalog().into_iter().map(|m| m.name).collect();
        Err(InputError(format!(
            "--model: '{name_or_file}' is neither a built-in model ({}) nor a readable file; pass one of those names, a Hugging Face model directory or a path to a model YAML",
            known.join(", ")
        )))
    }
}

/// A Hugging Face model: a directory holding `config.json`, or the path of a `config.json`;
/// the spec is named after the directory. None when `path` is neither.
pub fn hf_model(path: &Path) -> Option<Result<(ModelSpec, String), InputError>> {
    let (dir, file) = if path.is_dir() {
        (path.to_path_buf(), path.join("config.json"))
    } else if path.is_file() && path.file_name().is_some_and(|f| f == "config.json") {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        (dir.to_path_buf(), path.to_path_buf())
    } else {
        return None;
    };
    let origin = file.display().to_string();
    let load = || {
        if !file.is_file() {
            return Err(InputError(format!(
                "{origin}: no such file; a Hugging Face model directory holds config.json (or pass a model YAML)"
            )));
        }
        let config: serde_json::Value = serde_json::from_str(&read(&file, "model config")?)
            .map_err(|e| InputError(format!("{origin}: is not JSON ({e}); give a Hugging Face model's config.json")))?;
        let name = dir.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()));
        let name = name.or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "model".into());
        let spec = model::hf::spec_from_config(&config, &name).map_err(|e| in_file(&origin, e))?;
        Ok((spec, origin.clone()))
    };
    Some(load())
}

pub fn load_profiles(path: Option<&Path>) -> Result<ProfileSet, InputError> {
    let Some(path) = path else { return Ok(ProfileSet::default()) };
    let origin = path.display().to_string();
    let set: ProfileSet = parse_yaml(&read(path, "profile")?, &origin)?;
    set.validate().map_err(|e| in_file(&origin, e))?;
    Ok(set)
}

/// `--calibration FILE`: per-GPU-type efficiency, checked against the catalog and the
/// cluster's own GPU types.
pub fn load_calibration(path: &Path, cluster: &motley_solver::Cluster) -> Result<Calibration, InputError> {
    let origin = path.display().to_string();
    let cal: Calibration = parse_yaml(&read(path, "calibration")?, &origin)?;
    let mut known: Vec<String> = motley_solver::hardware::gpu_catalog().into_iter().map(|g| g.name).collect();
    for c in &cluster.classes {
        if !known.iter().any(|k| k.eq_ignore_ascii_case(&c.gpu.name)) {
            known.push(c.gpu.name.clone());
        }
    }
    cal.validate(Some(&known)).map_err(|e| in_file(&origin, e))?;
    Ok(cal)
}
