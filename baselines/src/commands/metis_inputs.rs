//! The inputs every `motley-baselines metis` command reads (Metis's profile directory, hostfile and
//! clusterfile, and its model settings), as flags and as loaded. Below `metis` and
//! `metis_motley`, which both price what is loaded here; calls only `inputs`.

use std::path::{Path, PathBuf};

use crate::metis::{self, MetisCluster, MetisModel, MetisProfiles, MetisSettings, Quirks};
use clap::Args;

use motley::inputs::{InputError, Output};

/// The inputs every `motley-baselines metis` command reads, named as Metis names them.
#[derive(Args)]
pub struct MetisInputs {
    /// Metis profile directory (DeviceType.<TYPE>_tp<T>_bs<B>.json files).
    #[arg(long, env = "MOTLEY_METIS_PROFILES")]
    pub profiles: PathBuf,
    /// Metis hostfile: one `<ip> slots=<gpus>` line per node.
    #[arg(long, env = "MOTLEY_METIS_HOSTFILE")]
    pub hostfile: PathBuf,
    /// Metis clusterfile (JSON: ip -> instance_type, memory GB, bandwidths MiB/ms).
    #[arg(long, env = "MOTLEY_METIS_CLUSTERFILE")]
    pub clusterfile: PathBuf,
    /// Layers of the model, embedding and head included (Metis's --num_layers).
    #[arg(long)]
    pub layers: usize,
    /// Samples per iteration (Metis's --gbs).
    #[arg(long)]
    pub global_batch: u32,
    #[arg(long, default_value_t = 4096)]
    pub hidden: u32,
    #[arg(long, default_value_t = 1024)]
    pub seq_len: u32,
    #[arg(long, default_value_t = 51200)]
    pub vocab: u32,
    /// Profile file whose model-level constants (optimizer, batch generator, parameter bytes)
    /// are used; default: the largest (tp, bs) file of the first GPU type by name.
    #[arg(long)]
    pub constants_from: Option<String>,
    /// Price with Metis's bugs fixed (inter-node bandwidth read, mixed replicas at their
    /// slowest GPU, memory from the stage's own type) instead of as Metis's code does.
    #[arg(long)]
    pub fix_quirks: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, env = "MOTLEY_OUTPUT")]
    pub output: Output,
}

/// Metis's inputs, read and parsed: what every `motley-baselines metis` command prices or searches.
pub struct Loaded {
    pub profiles: MetisProfiles,
    pub cluster: MetisCluster,
    pub settings: MetisSettings,
    pub quirks: Quirks,
}

impl Loaded {
    pub fn model(&self) -> MetisModel<'_> {
        MetisModel { profiles: &self.profiles, cluster: &self.cluster, settings: self.settings, quirks: self.quirks }
    }
}

pub(crate) fn read(path: &Path, what: &str) -> Result<String, InputError> {
    std::fs::read_to_string(path).map_err(|e| InputError(format!("{}: cannot read the {what}: {e}", path.display())))
}

/// Reads and checks the files and numbers `i` names.
pub fn load(i: &MetisInputs) -> Result<Loaded, InputError> {
    if i.global_batch == 0 {
        return Err(InputError("--global-batch: must be at least 1".into()));
    }
    for (flag, v) in [("--hidden", i.hidden), ("--seq-len", i.seq_len), ("--vocab", i.vocab)] {
        if v == 0 {
            return Err(InputError(format!("{flag}: must be at least 1")));
        }
    }
    let dir = std::fs::read_dir(&i.profiles)
        .map_err(|e| InputError(format!("{}: cannot list the profile directory: {e}", i.profiles.display())))?;
    let mut files = vec![];
    for entry in dir {
        let p = entry.map_err(|e| InputError(format!("{}: {e}", i.profiles.display())))?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if metis::input::parse_profile_name(&name).is_some() {
            files.push((name, read(&p, "profile")?));
        }
    }
    let at = |e: crate::BaselineError| InputError(format!("{}: {e}", i.profiles.display()));
    let profiles = MetisProfiles::load(&files, i.layers, i.constants_from.as_deref()).map_err(at)?;
    let cluster = MetisCluster::parse(&read(&i.hostfile, "hostfile")?, &read(&i.clusterfile, "clusterfile")?, &profiles)
        .map_err(|e| InputError(format!("{} / {}: {e}", i.hostfile.display(), i.clusterfile.display())))?;
    let settings = MetisSettings {
        global_batch: i.global_batch,
        layers: i.layers,
        hidden: i.hidden as f64,
        seq: i.seq_len as f64,
        vocab: i.vocab as f64,
    };
    let quirks = if i.fix_quirks { Quirks::fixed() } else { Quirks::default() };
    Ok(Loaded { profiles, cluster, settings, quirks })
}
