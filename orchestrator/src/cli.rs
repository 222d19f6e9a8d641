//! Command-line entry: argument parsing, logging, error reporting and exit codes.

use std::process::ExitCode;

use clap::{ArgAction, Parser, Subcommand};

use crate::commands;
use crate::error::CliError;

const AFTER_HELP: &str = "\
Exit codes:
  0  success
  1  the command failed while working (I/O error, ...)
  2  invalid arguments or input (the message names the option, file and line)
  130  interrupted (SIGINT, SIGTERM, or SIGHUP for launch); nothing half-written is left

Logging goes to stderr: -v for more detail, or RUST_LOG (e.g. RUST_LOG=dflash_orch=debug).";

/// Plans and runs DFlash drafter training on one multi-GPU machine.
#[derive(Debug, Parser)]
#[command(name = "dflash-orch", version, after_help = AFTER_HELP)]
pub struct Cli {
    /// More log output on stderr (-v info, -vv debug, -vvv trace).
    #[arg(short, long, action = ArgAction::Count, global = true)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Convert training data (JSONL, Parquet, save_to_disk, conversations) into a dataset store.
    Prepare(commands::prepare::PrepareArgs),
    /// Show what a dataset store holds: samples, tokens, lengths, what prepare skipped.
    Inspect(commands::inspect::InspectArgs),
    /// Plan the batches of one epoch and show what they look like (buckets, padding, runs).
    Plan(commands::plan::PlanArgs),
    /// Start a run (or resume one): one worker per GPU, fed through shared memory.
    Launch(Box<commands::launch::LaunchArgs>),
    /// Show the live run: progress and every worker's state.
    Status(commands::status::StatusArgs),
    /// Restart one worker of the live run.
    Restart(commands::restart::RestartArgs),
    /// Stop the live run cleanly.
    Stop(commands::stop::StopArgs),
    /// Remove a dead run's shared-memory segments.
    Clean(commands::clean::CleanArgs),
    /// Write a small random-weight Qwen3 target (for tests and the demo; no downloads).
    InitTiny(commands::init_tiny::InitTinyArgs),
    /// A live terminal view of every worker: state, GPU power and utilization, throughput,
    /// restarts; restart the selected worker with a key.
    Top(commands::top::TopArgs),
    /// Write one self-contained HTML page about a run: loss and accuracy, throughput, buckets, GPU
    /// power and utilization, restarts.
    Report(commands::report::ReportArgs),
    /// Measure a drafter's served acceptance (τ) and speedup by greedy speculative decoding with
    /// the target, and check the output equals plain greedy decoding.
    Eval(commands::eval::EvalArgs),
    /// Regenerate a dataset's responses with the target (training data written by the model
    /// the drafter will serve), on our workers or an OpenAI-compatible server; resumable.
    Generate(commands::generate::GenerateArgs),
    /// Train a DFlash drafter end to end on this machine's CPUs: a tiny target writes the
    /// training replies (generate), prepare, launch, then served acceptance before and after
    /// training by speculative decoding (eval) (a few minutes; no GPU, no downloads).
    Demo(commands::demo::DemoArgs),
}

fn init_logging(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // A second initialisation (in-process tests) is harmless: keep the first subscriber.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

/// Parses a command line; `launch` learns which options were given on it (for `--resume`).
pub fn parse<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().try_get_matches_from(args)?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    if let (Command::Launch(launch), Some(sub)) =
        (&mut cli.command, matches.subcommand_matches("launch"))
    {
        launch.given = sub
            .ids()
            .filter(|id| {
                sub.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine)
            })
            .map(|id| id.as_str().replace('_', "-"))
            .collect();
    }
    Ok(cli)
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Prepare(args) => commands::prepare::run(args),
        Command::Inspect(args) => commands::inspect::run(args),
        Command::Plan(args) => commands::plan::run(args),
        Command::Launch(args) => commands::launch::run(*args),
        Command::Status(args) => commands::status::run(args),
        Command::Restart(args) => commands::restart::run(args),
        Command::Stop(args) => commands::stop::run(args),
        Command::Clean(args) => commands::clean::run(args),
        Command::InitTiny(args) => commands::init_tiny::run(args),
        Command::Demo(args) => commands::demo::run(args),
        Command::Eval(args) => commands::eval::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Top(args) => commands::top::run(args),
        Command::Report(args) => commands::report::run(args),
    }
}

/// The binary's `main`: parse, log, run, map the outcome to an exit code.
pub fn main() -> ExitCode {
    let cli = parse(std::env::args_os()).unwrap_or_else(|e| e.exit());
    init_logging(cli.verbose);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
