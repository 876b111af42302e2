//! The crate's one error: a document field that is missing, malformed or inconsistent, named
//! with the fix, so every binary prints it as one line (the planner's errors carry it as
//! their own invalid input, the same words).

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ContractError {
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

impl ContractError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ContractError::Invalid { field: field.into(), message: message.into() }
    }
}

pub type Result<T> = std::result::Result<T, ContractError>;
