//! One module per `dflash-orch` subcommand.

pub mod clean;
pub mod demo;
pub mod eval;
pub mod generate;
pub mod init_tiny;
pub mod inspect;
pub mod launch;
pub mod plan;
pub mod prepare;
pub mod report;
pub mod restart;
pub mod status;
pub mod stop;
pub mod top;
