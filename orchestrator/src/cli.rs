//! Command-line entry: argument parsing, logging, error reporting and exit codes.

use std::process::ExitCode;

use clap::{ArgAction, Parser, Subcommand};
use dflash_common::exit_code;

use crate::commands;

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

/// A failure of a command, with the exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad arguments or bad input data: exit code 2.
    #[error("{0}")]
    Invalid(String),
    /// The command failed while working: exit code 1.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The command failed while working, with a message of its own: exit code 1.
    #[error("{0}")]
    Failed(String),
    /// Stopped by SIGINT or SIGTERM before finishing: exit code 130.
    #[error("interrupted: {0}")]
    Interrupted(String),
}

impl CliError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CliError::Io {
            context: context.into(),
            source,
        }
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Invalid(_) => exit_code::INVALID,
            CliError::Io { .. } | CliError::Failed(_) => exit_code::FAILURE,
            CliError::Interrupted(_) => exit_code::INTERRUPTED,
        }
    }
}

impl From<crate::planner::PlanError> for CliError {
    fn from(e: crate::planner::PlanError) -> Self {
        CliError::Invalid(e.to_string())
    }
}

/// Prints a command's result on stdout: `value` as one JSON line with `--json`, else `text()`.
pub fn print_result<T: serde::Serialize>(
    json: bool,
    value: &T,
    text: impl FnOnce() -> String,
) -> Result<(), CliError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let printed = if json {
        serde_json::to_writer(&mut out, value)
            .map_err(std::io::Error::from)
            .and_then(|()| writeln!(out))
    } else {
        out.write_all(text().as_bytes())
    };
    printed.map_err(|e| CliError::io("failed to write to stdout", e))
}

/// SIGINT and SIGTERM set the returned flag: the command stops cleanly at its next chance (no
/// half-written output, workers stopped). A second signal ends the process at once with 130.
pub fn watch_stop_signals() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    use std::sync::Arc;
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let code = i32::from(exit_code::INTERRUPTED);
        let _ = signal_hook::flag::register_conditional_shutdown(signal, code, Arc::clone(&flag));
        let _ = signal_hook::flag::register(signal, Arc::clone(&flag));
    }
    flag
}

/// Counts SIGINT, SIGTERM and SIGHUP (a closed terminal) for a run, which stops cleanly at the first and at once at the second
/// (the run still removes its workers and shared memory); a third ends the process where it is.
pub fn count_stop_signals() -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let signals = [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ];
    if let Ok(mut incoming) = signal_hook::iterator::Signals::new(signals) {
        let seen = std::sync::Arc::clone(&count);
        let _ = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for _ in incoming.forever() {
                    if seen.fetch_add(1, Ordering::SeqCst) + 1 >= 3 {
                        std::process::exit(i32::from(exit_code::INTERRUPTED));
                    }
                }
            });
    }
    count
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
