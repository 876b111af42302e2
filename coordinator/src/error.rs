//! The coordinator's one error type. Every variant maps to one gRPC status code and one HTTP
//! status (the service layers translate with `grpc_code` / `http_status`, so the two APIs
//! always agree), and its message names what to fix.

/// Errors of the coordinator's domain and store.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// A field of a request or file is missing, malformed or inconsistent.
    #[error("{field}: {message}")]
    InvalidInput { field: String, message: String },
    /// The named thing does not exist.
    #[error("{what} not found")]
    NotFound { what: String },
    /// The request does not fit the current state (a transition not allowed from here).
    #[error("{0}")]
    Conflict(String),
    /// A launch or a move onto GPUs another job's launch took meanwhile: plan again on what is
    /// free now.
    #[error("{0}")]
    GpusHeld(String),
    /// An instruction or report of an older launch: the job has moved on.
    #[error("job {job}: generation {given} is stale; the current generation is {current}")]
    StaleGeneration { job: i64, given: i64, current: i64 },
    /// An agent session older than the node's latest registration.
    #[error("node {node}: agent epoch {given} is stale; the node re-registered as epoch {current}")]
    StaleAgent { node: String, given: i64, current: i64 },
    /// This coordinator is a standby: the control API and agents go to the leader.
    #[error("this coordinator is a standby; the leader is at {}", if rest_url.is_empty() { "(not known yet: retry in a few seconds)" } else { rest_url.as_str() })]
    NotLeader { rest_url: String, grpc_url: String },
    /// Something the answer needs (an agent, say) cannot be reached now; retry.
    #[error("{0}")]
    Unavailable(String),
    /// No credential, or a wrong one.
    #[error("{0}")]
    Unauthenticated(String),
    /// A credential that does not open this door (the agents' token on the control API).
    #[error("{0}")]
    PermissionDenied(String),
    /// A request bigger than the API takes (a body, a URI).
    #[error("{0}")]
    TooLarge(String),
    /// Work that has a deadline (planning) did not finish within it.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The database failed or is unreachable.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The database's migrations failed.
    #[error("database migration: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
}

impl CoordinatorError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        CoordinatorError::InvalidInput { field: field.into(), message: message.into() }
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        CoordinatorError::NotFound { what: what.into() }
    }

    /// The gRPC status code (numeric values of `google.rpc.Code`).
    pub fn grpc_code(&self) -> i32 {
        match self {
            CoordinatorError::InvalidInput { .. } => 3, // INVALID_ARGUMENT
            CoordinatorError::NotFound { .. } => 5,     // NOT_FOUND
            CoordinatorError::Conflict(_) => 9,         // FAILED_PRECONDITION
            CoordinatorError::StaleGeneration { .. } | CoordinatorError::StaleAgent { .. } | CoordinatorError::GpusHeld(_) => 10, // ABORTED
            CoordinatorError::Unauthenticated(_) => 16, // UNAUTHENTICATED
            CoordinatorError::PermissionDenied(_) => 7, // PERMISSION_DENIED
            CoordinatorError::TooLarge(_) => 8,         // RESOURCE_EXHAUSTED
            CoordinatorError::DeadlineExceeded(_) => 4, // DEADLINE_EXCEEDED
            CoordinatorError::Database(_)
            | CoordinatorError::Migration(_)
            | CoordinatorError::NotLeader { .. }
            | CoordinatorError::Unavailable(_) => 14, // UNAVAILABLE
        }
    }

    /// The HTTP status of the same error.
    pub fn http_status(&self) -> u16 {
        match self {
            CoordinatorError::InvalidInput { .. } => 400,
            CoordinatorError::NotFound { .. } => 404,
            CoordinatorError::Conflict(_)
            | CoordinatorError::GpusHeld(_)
            | CoordinatorError::StaleGeneration { .. }
            | CoordinatorError::StaleAgent { .. } => 409,
            CoordinatorError::Unauthenticated(_) => 401,
            CoordinatorError::PermissionDenied(_) => 403,
            CoordinatorError::TooLarge(_) => 413,
            CoordinatorError::DeadlineExceeded(_) => 504,
            CoordinatorError::Database(_)
            | CoordinatorError::Migration(_)
            | CoordinatorError::NotLeader { .. }
            | CoordinatorError::Unavailable(_) => 503,
        }
    }
}

pub type Result<T> = std::result::Result<T, CoordinatorError>;
