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

use crate::error::CliError;

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
