//! `motley-baselines`: the planners Motley is compared with, on their own inputs (`metis`,
//! `espresso`). Research tools, apart from the operator's `motley`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use motley::Outcome;
use motley_baselines::commands::{espresso, metis};

#[derive(Parser)]
#[command(
    name = "motley-baselines",
    version,
    about = "Metis's and Espresso's planners on their own inputs, beside Motley's",
    after_help = "Exit codes: 0 success, 2 bad input or usage."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Metis's profiles, hostfile and clusterfile: price plans as Metis does, search its space.
    Metis(metis::MetisArgs),
    /// Espresso's job, model and GPU files: price plans as Espresso does, search its space exactly.
    Espresso(espresso::EspressoArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Espresso(e) => match e.command {
            espresso::EspressoCommand::Eval(a) => espresso::run_eval(a),
            espresso::EspressoCommand::Search(a) => espresso::run_search(a),
        },
        Command::Metis(m) => match m.command {
            metis::MetisCommand::Eval(a) => metis::run_eval(a),
            metis::MetisCommand::Search(a) => metis::run_search(a),
        },
    }
    .map(Outcome::from);
    Outcome::finish(result)
}
