//! Metis's inputs as Metis users have them: a directory of `DeviceType.<TYPE>_tp<T>_bs<B>.json`
//! profiles, a hostfile (`<ip> slots=<n>` per node) and a clusterfile (per-ip type, memory and
//! bandwidths). Field meanings and units are in `../shared/anchors/metis/DATA.md`; this file
//! reads only the fields Metis's planner reads, and names the file and field of anything wrong.
//!
//! The caller does the I/O: profiles arrive as `(file name, contents)` pairs.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use crate::error::{BaselineError, Result};

/// One measurement: a whole-model iteration on one GPU type at (tp, bs).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceProfile {
    /// Forward+backward ms of every layer for one micro-batch of `bs` samples (TP inside).
    pub layer_ms: Vec<f64>,
    /// `forward_backward_time_ms - sum(layer_ms)`: the non-layer time of fwd/bwd.
    pub fb_sync_ms: f64,
    /// Per-layer memory, MiB.
    pub memory_mb: Vec<f64>,
}

/// Model-level constants that Metis takes from one file only (see `MetisProfiles::load`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConstants {
    /// The file they came from.
    pub source: String,
    /// `optimizer_time_ms * 2`, as Metis's loader doubles it.
    pub optimizer_ms: f64,
    pub batch_generator_ms: f64,
    /// Bytes of the embedding layer, of every transformer layer, of the output layer (unsharded).
    pub params_first: f64,
    pub params_layer: f64,
    pub params_last: f64,
}

/// Every profile of a directory, indexed by GPU type, tp and bs.
#[derive(Debug, Clone, PartialEq)]
pub struct MetisProfiles {
    /// GPU type names in sorted order; a type's index is its id everywhere below.
    pub types: Vec<String>,
    pub layers: usize,
    pub constants: ModelConstants,
    pub max_tp: u32,
    pub max_bs: u32,
    table: HashMap<(usize, u32, u32), DeviceProfile>,
}

/// `DeviceType.<TYPE>_tp<T>_bs<B>.json` -> (TYPE, T, B), the way Metis's regexes read it.
pub fn parse_profile_name(name: &str) -> Option<(String, u32, u32)> {
    let stem = name.strip_suffix(".json")?;
    let rest = stem.strip_prefix("DeviceType.")?;
    let (ty, rest) = rest.split_once("_tp")?;
    let (tp, bs) = rest.split_once("_bs")?;
    if ty.is_empty() || !ty.chars().all(|c| c.is_ascii_alphanumeric()) {
        return None;
    }
    Some((ty.to_string(), tp.parse().ok()?, bs.parse().ok()?))
}

fn field<'v>(v: &'v Value, file: &str, path: &[&str]) -> Result<&'v Value> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p).ok_or_else(|| {
            BaselineError::invalid(format!("{file}: {}", path.join(".")), "missing; Metis profile files carry it (see DATA.md)")
        })?;
    }
    Ok(cur)
}

fn number(v: &Value, file: &str, path: &[&str]) -> Result<f64> {
    field(v, file, path)?
        .as_f64()
        .filter(|x| x.is_finite())
        .ok_or_else(|| BaselineError::invalid(format!("{file}: {}", path.join(".")), "must be a finite number"))
}

fn numbers(v: &Value, file: &str, path: &[&str], len: usize) -> Result<Vec<f64>> {
    let bad = |why: String| BaselineError::invalid(format!("{file}: {}", path.join(".")), why);
    let arr = field(v, file, path)?.as_array().ok_or_else(|| bad("must be an array of numbers".into()))?;
    if arr.len() != len {
        return Err(bad(format!("has {} entries but the model has {len} layers (--layers)", arr.len())));
    }
    arr.iter().map(|x| x.as_f64().filter(|x| x.is_finite()).ok_or_else(|| bad("must hold only finite numbers".into()))).collect()
}

impl MetisProfiles {
    /// Read a profile directory's files. `layers` is Metis's `--num_layers` and must equal
    /// every array's length. Metis takes the model-level constants (optimizer and batch
    /// generator time, parameter bytes) from whichever file `os.listdir` returns first; we
    /// take them from `constants_from` when given, else from the largest (tp, bs) file of the
    /// first type in name order, which reproduces Metis's published runs.
    pub fn load(files: &[(String, String)], layers: usize, constants_from: Option<&str>) -> Result<MetisProfiles> {
        if layers < 3 {
            return Err(BaselineError::invalid("layers", "Metis models have an embedding, >= 1 transformer layer and a head: use >= 3"));
        }
        let mut parsed: BTreeMap<(String, u32, u32), (String, Value)> = BTreeMap::new();
        for (name, text) in files {
            let Some(key) = parse_profile_name(name) else { continue };
            if key.1 == 0 || key.2 == 0 {
                return Err(BaselineError::invalid(name.clone(), "tp and bs in the file name must be positive"));
            }
            let v: Value = serde_json::from_str(text)
                .map_err(|e| BaselineError::invalid(name.clone(), format!("not valid JSON ({e}); was the file cut short?")))?;
            parsed.insert(key, (name.clone(), v));
        }
        if parsed.is_empty() {
            return Err(BaselineError::invalid(
                "profiles",
                "no DeviceType.<TYPE>_tp<T>_bs<B>.json file found: point --profiles at a Metis profile directory",
            ));
        }
        let types: Vec<String> = {
            let mut t: Vec<String> = parsed.keys().map(|k| k.0.clone()).collect();
            t.dedup();
            t
        };
        let source = match constants_from {
            Some(c) => parsed
                .values()
                .find(|(n, _)| n == c)
                .ok_or_else(|| BaselineError::invalid("constants-from", format!("{c} is not among the profile files")))?,
            None => {
                let first = &types[0];
                parsed.iter().filter(|(k, _)| &k.0 == first).max_by_key(|(k, _)| (k.1, k.2)).map(|(_, v)| v).expect("non-empty")
            }
        };
        let (sname, sv) = source;
        let params = numbers(sv, sname, &["model", "parameters", "parameters_per_layer_bytes"], layers)?;
        let constants = ModelConstants {
            source: sname.clone(),
            optimizer_ms: 2.0 * number(sv, sname, &["execution_time", "optimizer_time_ms"])?,
            batch_generator_ms: number(sv, sname, &["execution_time", "batch_generator_time_ms"])?,
            params_first: params[0],
            params_layer: params[1],
            params_last: params[layers - 1],
        };
        let mut table = HashMap::new();
        let (mut max_tp, mut max_bs) = (0, 0);
        for ((ty, tp, bs), (name, v)) in &parsed {
            let layer_ms = numbers(v, name, &["execution_time", "layer_compute_total_ms"], layers)?;
            let fb = number(v, name, &["execution_time", "forward_backward_time_ms"])?;
            let memory_mb = numbers(v, name, &["execution_memory", "layer_memory_total_mb"], layers)?;
            let fb_sync_ms = fb - layer_ms.iter().sum::<f64>();
            let ti = types.iter().position(|t| t == ty).expect("type listed");
            table.insert((ti, *tp, *bs), DeviceProfile { layer_ms, fb_sync_ms, memory_mb });
            max_tp = max_tp.max(*tp);
            max_bs = max_bs.max(*bs);
        }
        Ok(MetisProfiles { types, layers, constants, max_tp, max_bs, table })
    }

    pub fn type_index(&self, name: &str) -> Option<usize> {
        self.types.iter().position(|t| t == name)
    }

    pub fn get(&self, ty: usize, tp: u32, bs: u32) -> Option<&DeviceProfile> {
        self.table.get(&(ty, tp, bs))
    }
}

/// Per GPU type: what the clusterfile says about it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetisGpuType {
    pub name: String,
    /// GB per GPU (Metis multiplies by 1024 and compares with MiB).
    pub memory_gb: f64,
    /// MiB per ms, of the first node of the type (Metis's `_get_intra_bandwidth`).
    pub intra_bw: f64,
    /// Slowest inter-node MiB per ms over the nodes of the type.
    pub inter_bw: f64,
    /// Slowest intra-node MiB per ms over the nodes of the type (what Metis's buggy
    /// `get_inter_bandwidth` returns).
    pub intra_bw_min: f64,
    pub gpus: u32,
}

/// The hostfile + clusterfile pair.
#[derive(Debug, Clone, PartialEq)]
pub struct MetisCluster {
    /// Indexed like `MetisProfiles::types`; types without nodes have `gpus == 0`.
    pub types: Vec<MetisGpuType>,
    /// GPUs per node (Metis uses the first node's count for every node).
    pub gpus_per_node: u32,
}

impl MetisCluster {
    pub fn parse(hostfile: &str, clusterfile: &str, profiles: &MetisProfiles) -> Result<MetisCluster> {
        let info: BTreeMap<String, Value> = serde_json::from_str(clusterfile)
            .map_err(|e| BaselineError::invalid("clusterfile", format!("must be a JSON object of ip -> node info ({e})")))?;
        let mut types: Vec<MetisGpuType> = profiles
            .types
            .iter()
            .map(|n| MetisGpuType {
                name: n.clone(),
                memory_gb: 0.0,
                intra_bw: 0.0,
                inter_bw: f64::INFINITY,
                intra_bw_min: f64::INFINITY,
                gpus: 0,
            })
            .collect();
        let mut gpus_per_node = None;
        for (i, line) in hostfile.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let f = format!("hostfile line {}", i + 1);
            let mut parts = line.split_whitespace();
            let ip = parts.next().unwrap_or_default();
            let slots = parts
                .next()
                .and_then(|s| s.strip_prefix("slots="))
                .and_then(|s| s.parse::<u32>().ok())
                .filter(|&s| s > 0)
                .ok_or_else(|| BaselineError::invalid(&f, "must read `<ip> slots=<gpus>` with gpus >= 1"))?;
            let node = info.get(ip).ok_or_else(|| BaselineError::invalid(&f, format!("ip {ip} is not in the clusterfile: add it")))?;
            let cf = |k: &str| format!("clusterfile[{ip}].{k}");
            let ty =
                node.get("instance_type").and_then(Value::as_str).ok_or_else(|| BaselineError::invalid(cf("instance_type"), "missing"))?;
            let ti = profiles.type_index(&ty.to_ascii_uppercase()).ok_or_else(|| {
                BaselineError::invalid(cf("instance_type"), format!("{ty} has no profile file (have {})", profiles.types.join(", ")))
            })?;
            let num = |k: &str| {
                node.get(k)
                    .and_then(Value::as_f64)
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| BaselineError::invalid(cf(k), "must be a positive number"))
            };
            let t = &mut types[ti];
            if t.gpus == 0 {
                t.intra_bw = num("intra_bandwidth")?;
            }
            t.intra_bw_min = t.intra_bw_min.min(num("intra_bandwidth")?);
            t.inter_bw = t.inter_bw.min(num("inter_bandwidth")?);
            t.gpus += slots;
            gpus_per_node.get_or_insert(slots);
        }
        let gpus_per_node = gpus_per_node.ok_or_else(|| BaselineError::invalid("hostfile", "lists no node"))?;
        // Metis looks a type's memory up by exact instance_type, first clusterfile entry wins.
        for t in types.iter_mut().filter(|t| t.gpus > 0) {
            let mem = info.iter().find(|(_, v)| v.get("instance_type").and_then(Value::as_str) == Some(t.name.as_str()));
            t.memory_gb = mem.and_then(|(_, v)| v.get("memory")).and_then(Value::as_f64).filter(|m| *m > 0.0).ok_or_else(|| {
                BaselineError::invalid(
                    format!("clusterfile (type {})", t.name),
                    "needs an upper-case instance_type entry with memory in GB",
                )
            })?;
        }
        if types.iter().any(|t| t.gpus % gpus_per_node != 0) {
            return Err(BaselineError::invalid("hostfile", "every node must have the same slots (Metis uses the first node's)"));
        }
        Ok(MetisCluster { types, gpus_per_node })
    }

    pub fn total_gpus(&self) -> u32 {
        self.types.iter().map(|t| t.gpus).sum()
    }

    /// Types that have GPUs, as indices.
    pub fn present(&self) -> Vec<usize> {
        (0..self.types.len()).filter(|&i| self.types[i].gpus > 0).collect()
    }
}
