//! The solver's one error type. Every variant names the offending field and the fix, so the
//! CLI can print it as a one-line message.

/// Errors raised while validating inputs or planning.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SolverError {
    /// An input field is missing, malformed or inconsistent.
    #[error("{field}: {message}")]
    InvalidInput { field: String, message: String },
    /// No plan in the search space fits in the cluster's memory.
    #[error("model does not fit: {0}")]
    DoesNotFit(String),
}

impl SolverError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        SolverError::InvalidInput { field: field.into(), message: message.into() }
    }
}

/// A document's own check (the cluster file's) is the planner's invalid input, in the same words.
impl From<motley_contract::ContractError> for SolverError {
    fn from(e: motley_contract::ContractError) -> Self {
        match e {
            motley_contract::ContractError::Invalid { field, message } => SolverError::InvalidInput { field, message },
        }
    }
}

pub type Result<T> = std::result::Result<T, SolverError>;
