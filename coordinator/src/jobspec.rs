//! The job file (YAML, shaped like a SkyPilot task) and its validation.
//!
//! ```yaml
//! name: hello
//! model: gpt3-1.3b            # a catalog name, or a model entry {name, layers, hidden, ...}
//! global_batch: 16
//! resources:
//!   gpus: 8                   # at most this many GPUs (optional)
//!   nodes: [a100-0, a100-1]   # only these nodes (optional)
//! run: python train.py        # started once per rank
//! envs: {DATA: /data/c4}
//! max_restarts: 0             # relaunches after a rank fails
//! max_preemptions: 3          # relaunches after a node is lost
//! ```

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::error::{CoordinatorError, Result};
use motley_solver::{Model, ModelSpec};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelRef {
    Name(String),
    Spec(ModelSpec),
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    #[serde(default)]
    pub gpus: Option<u32>,
    #[serde(default)]
    pub nodes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub name: String,
    pub model: ModelRef,
    pub global_batch: u32,
    #[serde(default)]
    pub resources: Resources,
    pub run: String,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub max_restarts: u32,
    #[serde(default)]
    pub max_preemptions: u32,
}

/// Variables the agent sets for every rank; a job may not override them.
const RESERVED: [&str; 7] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"];

impl JobSpec {
    /// Parse and validate a job file; errors name the field and the fix.
    pub fn parse(text: &str) -> Result<JobSpec> {
        let spec: JobSpec = parse_yaml(serde_norway::Deserializer::from_str(text), "job file")?;
        spec.validate()?;
        Ok(spec)
    }

    pub fn validate(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            return Err(CoordinatorError::invalid("name", "a job needs a name"));
        }
        if self.global_batch == 0 {
            return Err(CoordinatorError::invalid("global_batch", "must be at least 1"));
        }
        if self.run.trim().is_empty() {
            return Err(CoordinatorError::invalid("run", "the command each rank runs must not be empty"));
        }
        if self.resources.gpus == Some(0) {
            return Err(CoordinatorError::invalid("resources.gpus", "must be at least 1; leave it out to allow any number"));
        }
        for key in self.envs.keys() {
            let ok = !key.is_empty()
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !key.starts_with(|c: char| c.is_ascii_digit());
            if !ok {
                return Err(CoordinatorError::invalid(format!("envs.{key}"), "is not a valid environment variable name"));
            }
            if RESERVED.contains(&key.as_str()) || key.starts_with("MOTLEY_") {
                return Err(CoordinatorError::invalid(format!("envs.{key}"), "is set by the agent for every rank; remove it"));
            }
        }
        self.model()?;
        Ok(())
    }

    /// The model, from the catalog or the inline entry.
    pub fn model(&self) -> Result<Model> {
        let spec = match &self.model {
            ModelRef::Name(n) => motley_solver::model::model_by_name(n).ok_or_else(|| {
                let known: Vec<String> = motley_solver::model::model_catalog().into_iter().map(|m| m.name).collect();
                CoordinatorError::invalid("model", format!("unknown model '{n}'; use one of {} or an inline model entry", known.join(", ")))
            })?,
            ModelRef::Spec(s) => s.clone(),
        };
        Model::new(spec, None).map_err(|e| CoordinatorError::invalid("model", e.to_string()))
    }
}

/// serde_norway with the path of the failing field in the message.
/// Deserialize YAML (JSON is YAML too) into `T`; the error names `what` and the path of the
/// failing field, as the CLI's `inputs::parse_yaml` does.
pub fn parse_yaml<'de, T: Deserialize<'de>>(de: impl serde::Deserializer<'de>, what: &str) -> Result<T> {
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.into_inner().to_string();
        let hint = if msg.contains("missing field") {
            "; add it"
        } else if msg.contains("unknown field") {
            "; remove it or fix its spelling"
        } else {
            ""
        };
        // serde_norway's message may already start with the path.
        if path == "." || path.is_empty() || msg.starts_with(&path) {
            CoordinatorError::invalid(what, format!("{msg}{hint}"))
        } else {
            CoordinatorError::invalid(format!("{what}: {path}"), format!("{msg}{hint}"))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "name: hello\nmodel: gpt3-1.3b\nglobal_batch: 16\nrun: python train.py\nenvs: {DATA: /data}\n";

    #[test]
    fn a_good_file_parses() {
        let j = JobSpec::parse(GOOD).unwrap();
        assert_eq!((j.name.as_str(), j.global_batch, j.max_restarts), ("hello", 16, 0));
        assert_eq!(j.model().unwrap().spec.name, "gpt3-1.3b");
    }

    #[test]
    fn bad_files_name_the_field() {
        let err = |t: &str| JobSpec::parse(t).unwrap_err().to_string();
        assert!(err("name: x\nglobal_batch: 1\nrun: a\n").contains("missing field `model`"));
        assert!(err(&GOOD.replace("global_batch: 16", "global_batch: 0")).starts_with("global_batch:"));
        assert!(err(&GOOD.replace("gpt3-1.3b", "gpt-9000")).starts_with("model: unknown model 'gpt-9000'"));
        assert!(err(&GOOD.replace("DATA", "RANK")).starts_with("envs.RANK: is set by the agent"));
        assert!(err(&GOOD.replace("DATA", "MOTLEY_X")).starts_with("envs.MOTLEY_X"));
        assert!(err(&GOOD.replace("DATA", "1BAD")).starts_with("envs.1BAD: is not a valid"));
        assert!(err(&format!("{GOOD}colour: red\n")).contains("unknown field `colour`"));
        assert!(err(&GOOD.replace("python train.py", "\"  \"")).starts_with("run:"));
    }
}
