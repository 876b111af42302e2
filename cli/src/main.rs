//! `motley`, the operator's CLI: `motley plan`, `motley replan`, `motley provision` and `motley
//! restore-plan`, which work offline, and `motley node|job|ckpt|net|profile|model|dev`, which talk
//! to a coordinator. The research tools (Metis's and Espresso's planners) are `motley-baselines`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use motley::{exit, Outcome};

#[derive(Parser)]
#[command(name = "motley", version, about = "Plan and run LLM training on clusters of mixed GPUs", after_help = motley::exit::HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Find the fastest data/tensor/pipeline-parallel plan for a model on a cluster (offline).
    Plan(motley::plan::PlanArgs),
    /// Price the running plan on newly measured bandwidth, plan afresh, and say whether to switch.
    Replan(motley::plan::ReplanArgs),
    /// Which GPUs to rent, and how many, to meet an iteration-time SLO for the least money.
    Provision(motley::provision::ProvisionArgs),
    /// Plan the restore of a checkpoint step onto a new plan: transfers and their lower bound (offline).
    RestorePlan(motley::restore::RestorePlanArgs),
    /// The coordinator's inventory: list, describe, add, drain, undrain, remove.
    #[command(subcommand)]
    Node(motley::remote::NodeCommand),
    /// Jobs on the coordinator: submit, list, show, watch, logs, cancel.
    #[command(subcommand, after_help = motley::exit::HELP)]
    Job(motley::remote::JobCommand),
    /// A job's checkpoints: which file of which step each node holds (list, show).
    #[command(subcommand)]
    Ckpt(motley::ckpt::CkptCommand),
    /// The links agents measure between nodes, beside the declared rates: show.
    #[command(subcommand)]
    Net(motley::net::NetCommand),
    /// Measured layer profiles on the coordinator: list, show, run, runs.
    #[command(subcommand)]
    Profile(motley::profile::ProfileCommand),
    /// The built-in models, and what a model file resolves to: list, show.
    #[command(subcommand)]
    Model(motley::model::ModelCommand),
    /// The whole system on this machine: `motley dev up CLUSTER JOB`.
    #[command(subcommand, after_help = motley::exit::HELP)]
    Dev(motley::dev::DevCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<Outcome, _> = match cli.command {
        Command::Plan(args) => motley::plan::run_plan(args).map(Outcome::from),
        Command::Replan(args) => motley::plan::run_replan(args).map(Outcome::from),
        Command::Provision(a) => motley::provision::run(a).map(Outcome::from),
        Command::RestorePlan(a) => motley::restore::run(a).map(Outcome::from),
        Command::Node(c) => motley::remote::run_node(c),
        Command::Job(c) => motley::remote::run_job(c),
        Command::Dev(c) => motley::dev::run(c),
        Command::Model(c) => motley::model::run(c).map(Outcome::from),
        Command::Ckpt(c) => motley::ckpt::run(c).map(Outcome::from),
        Command::Net(c) => motley::net::run(c).map(Outcome::from),
        Command::Profile(c) => {
            motley::profile::run(c).map(|(text, ok)| Outcome { text, code: if ok { exit::SUCCESS } else { exit::JOB_FAILED } })
        }
    };
    Outcome::finish(result)
}
