//! Contracts shared by the orchestrator and its workers: what crosses the process boundary or
//! lands on disk, versioned, and nothing else.

pub mod dflash;
pub mod eval;
pub mod python;
pub mod ring;
pub mod run_dir;
pub mod wire;

/// Exit codes of both binaries; documented in each `--help`.
pub mod exit_code {
    /// The command did what was asked.
    pub const SUCCESS: u8 = 0;
    /// The command failed while working (I/O error, lost peer, ...).
    pub const FAILURE: u8 = 1;
    /// Invalid arguments or input: the message names the option, file and line.
    pub const INVALID: u8 = 2;
    /// Stopped by SIGINT or SIGTERM (128 + SIGINT, as shells report it).
    pub const INTERRUPTED: u8 = 130;
}
