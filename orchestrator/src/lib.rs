//! dflash-orch: plans per-epoch batches and runs DFlash drafter training across worker processes.
//!
//! The binary is a thin shell over [`cli::run`]; everything else is a library so tests can drive it
//! in-process.

pub mod charts;
pub mod cli;
pub mod commands;
pub mod error;
pub mod format;
pub mod fsutil;
pub mod ingest;
pub mod model_dir;
pub mod observe;
pub mod options;
pub mod parallel;
mod parsers_never_panic;
pub mod planner;
pub mod runtime;
pub mod signals;
pub mod store;
pub mod workload;
