//! One module per `dflash-orch` subcommand.

pub mod inspect;
pub mod plan;
pub mod prepare;
