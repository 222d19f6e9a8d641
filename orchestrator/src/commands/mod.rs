//! One module per `dflash-orch` subcommand.

pub mod plan;
