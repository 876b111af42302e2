//! The crate's one error, each variant naming what to fix: a config file, flag or key, or a
//! TLS flag.

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServerError {
    /// A configuration refused; the message names the file, flag or key.
    #[error("{0}")]
    Config(String),
    /// The TLS settings are wrong, naming the flag to fix.
    #[error("{flag}: {message}")]
    Tls { flag: &'static str, message: String },
}
