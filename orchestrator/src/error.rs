//! The error every command returns, and the exit code each kind maps to.

use dflash_common::exit_code;

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

/// A chart failure as a command reports it: data that cannot be placed on axes is bad input.
impl From<crate::charts::ChartError> for CliError {
    fn from(e: crate::charts::ChartError) -> Self {
        match e {
            crate::charts::ChartError::OutOfRange(why) => CliError::Invalid(why),
            e @ crate::charts::ChartError::Draw(_) => CliError::Failed(e.to_string()),
        }
    }
}
