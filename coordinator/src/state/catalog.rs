//! The GPU types this coordinator knows: the planner's built-in catalog, plus the types its
//! configuration declares (`--gpu-types FILE`: the cluster file's `gpu_types:` section, as
//! `motley plan` reads it from a cluster file). Set once at start-up, before any request is
//! served; a node entry naming a type neither knows is refused when it registers.

use std::sync::OnceLock;

use motley_solver::hardware::GpuType;
use motley_solver::{Cluster, ClusterSpec};

use crate::error::{CoordinatorError, Result};

static DECLARED: OnceLock<Vec<GpuType>> = OnceLock::new();

/// The GPU types the configuration declared (none by default).
pub fn declared() -> Vec<GpuType> {
    DECLARED.get().cloned().unwrap_or_default()
}

/// Declare the configuration's GPU types, once (a second call is refused).
pub fn declare(types: Vec<GpuType>) -> Result<()> {
    DECLARED.set(types).map_err(|_| CoordinatorError::Conflict("the GPU types are declared once, at start-up".into()))
}

/// The `gpu_types:` list of a YAML file (a cluster file will do: its other keys are ignored),
/// each entry checked as a cluster file's are. `flag` names the setting in errors.
pub fn read(text: &str, flag: &str) -> Result<Vec<GpuType>> {
    let value: serde_norway::Value = serde_norway::from_str(text).map_err(|e| CoordinatorError::invalid(flag, format!("{e}")))?;
    let Some(list) = value.get("gpu_types") else {
        return Err(CoordinatorError::invalid(flag, "has no gpu_types: list; write the cluster file's gpu_types section"));
    };
    let types: Vec<GpuType> = serde_norway::from_value(list.clone())
        .map_err(|e| CoordinatorError::invalid(format!("{flag}: gpu_types"), format!("{e}; see the cluster file format in README.md")))?;
    let Some(first) = types.first() else { return Ok(types) };
    // The cluster file's own checks, on a one-node cluster of the first type.
    let probe = format!("{{name: probe, gpu: '{}', gpus: 1}}", first.name.replace('\'', "''"));
    let node =
        serde_norway::from_str(&probe).map_err(|e| CoordinatorError::invalid(format!("{flag}: gpu_types[0].name"), format!("{e}")))?;
    Cluster::from_spec(&ClusterSpec { name: "gpu-types".into(), nodes: vec![node], gpu_types: types.clone() })
        .map_err(|e| CoordinatorError::invalid(format!("{flag}: {e}"), "see the cluster file format in README.md"))?;
    Ok(types)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_types_file_is_read_and_checked_naming_the_field() {
        let text = "name: lab\nnodes: []\ngpu_types:\n  - {name: Toy-1, memory_gib: 8, tflops: 20, mem_bw_gbps: 300}\n";
        let types = read(text, "--gpu-types").unwrap();
        assert_eq!(types.len(), 1);
        assert_eq!(types[0].name, "Toy-1");
        let e = read("gpu_types:\n  - {name: Toy-1, memory_gib: -8, tflops: 20, mem_bw_gbps: 300}\n", "--gpu-types").unwrap_err();
        assert!(e.to_string().contains("gpu_types[0].memory_gib"), "{e}");
        let e = read("nodes: []\n", "--gpu-types").unwrap_err();
        assert!(e.to_string().contains("--gpu-types") && e.to_string().contains("gpu_types"), "{e}");
        let e = read("gpu_types:\n  - {name: Toy-1, colour: red}\n", "--gpu-types").unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
        assert!(read("gpu_types: []\n", "--gpu-types").unwrap().is_empty());
    }
}
