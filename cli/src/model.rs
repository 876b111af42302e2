//! `motley model list` and `motley model show NAME|FILE`: the built-in catalog and what a model
//! file resolves to, with every default filled in (`-o json` is a model file's fields, which
//! the rank library's trainer and profiler read for a catalog name).

use motley_solver::model::hf::default_seq_len_reason;
use motley_solver::model::{model_catalog, params_text, ModelSpec};

use crate::inputs::{load_model, InputError, Output};
use crate::table::escape;

#[derive(clap::Subcommand)]
pub enum ModelCommand {
    /// The built-in models.
    List {
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// One model (a catalog name, a model file or a Hugging Face directory), its defaults filled in.
    Show {
        /// A catalog name (`motley model list`), a model file (YAML) or a Hugging Face model
        /// directory (or its config.json).
        model: String,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

fn table(models: &[(ModelSpec, f64)]) -> String {
    let header = [
        "model",
        "family",
        "layers",
        "hidden",
        "heads",
        "kv heads",
        "ffn hidden",
        "mlp",
        "seq len",
        "max positions",
        "vocab",
        "parameters",
    ];
    let rows = models
        .iter()
        .map(|(m, params)| {
            vec![
                escape(&m.name).into_owned(),
                m.family.as_str().to_string(),
                m.layers.to_string(),
                m.hidden.to_string(),
                m.heads.to_string(),
                m.kv_heads.map_or_else(String::new, |k| k.to_string()),
                m.ffn_hidden.map_or_else(String::new, |f| f.to_string()),
                if m.gated_mlp { "gated (SwiGLU)" } else { "GELU" }.to_string(),
                m.seq_len.to_string(),
                m.max_position_embeddings.map_or_else(|| "-".to_string(), |p| p.to_string()),
                m.vocab.to_string(),
                params_text(*params),
            ]
        })
        .collect();
    let mut out = crate::table::simple(header.to_vec(), rows);
    // A model that states its longest sequence (a Hugging Face config) is not trained at it.
    if let Some((m, max)) = models.iter().find_map(|(m, _)| m.max_position_embeddings.map(|p| (m, p))) {
        out.push_str(&format!(
            "\nseq len {} is the length trained at unless --seq-len (motley plan) or a job file's seq_len says another; \
             max positions is the longest sequence the model takes. A Hugging Face model's seq len is {}.",
            m.seq_len,
            default_seq_len_reason(max, m.sliding_window)
        ));
    }
    out
}

pub fn run(cmd: ModelCommand) -> Result<String, InputError> {
    let described = |m: &motley_solver::Model| (m.spec.resolved(), m.total_params());
    Ok(match cmd {
        ModelCommand::List { output } => {
            let all =
                model_catalog().into_iter().map(|m| load_model(&m.name, None).map(|m| described(&m))).collect::<Result<Vec<_>, _>>()?;
            match output {
                Output::Table => table(&all),
                Output::Json => serde_json::to_string_pretty(&all.iter().map(|(m, _)| m).collect::<Vec<_>>()).expect("models serialise"),
            }
        }
        ModelCommand::Show { model, output } => {
            let one = described(&load_model(&model, None)?);
            match output {
                Output::Table => table(std::slice::from_ref(&one)),
                Output::Json => serde_json::to_string_pretty(&one.0).expect("a model serialises"),
            }
        }
    })
}
