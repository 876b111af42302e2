//! The baselines' one error type: a field of a peer's input file that is missing, malformed or
//! inconsistent (named, with the fix), or the planner's own error where a baseline calls it.

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BaselineError {
    /// An input field is missing, malformed or inconsistent.
    #[error("{field}: {message}")]
    InvalidInput { field: String, message: String },
    /// The planner refused (Motley's view of a peer's inputs).
    #[error(transparent)]
    Solver(#[from] motley_solver::SolverError),
}

impl BaselineError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        BaselineError::InvalidInput { field: field.into(), message: message.into() }
    }
}

pub type Result<T> = std::result::Result<T, BaselineError>;
