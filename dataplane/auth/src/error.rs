//! The crate's error type, and the error of one bad rule.

use std::io;
use std::path::PathBuf;

/// Everything that can fail in this crate, except a refused token ([`crate::TokenRefusal`],
/// which is an expected outcome of a handshake, not a fault).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// A principal name that is empty, too long, `*`, or holds a forbidden character; the
    /// reason quotes the name.
    #[error("invalid principal {0}")]
    Principal(String),
    /// The authorization rules do not parse.
    #[error("invalid authorization rules")]
    Rules(#[from] RuleError),
    /// A line of a tokens file is wrong.
    #[error("{}:{line}: {reason}", path.display())]
    TokenFile {
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        reason: String,
    },
    /// Reading, writing, syncing or renaming a file failed.
    #[error("cannot access {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Argon2 could not hash a secret.
    #[error("cannot hash the token secret: {0}")]
    Hash(String),
    /// A client certificate that does not parse or names no usable principal.
    #[error("no principal in the client certificate: {0}")]
    Certificate(String),
}

impl AuthError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> AuthError {
        AuthError::Io {
            path: path.into(),
            source,
        }
    }
}

/// One rule of a rule set that does not parse: which (1-based, counting non-blank rules),
/// its text, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rule {index} {text:?}: {reason}")]
pub struct RuleError {
    /// 1-based position among the non-blank rules.
    pub index: usize,
    /// The rule as written, without its comment and surrounding whitespace.
    pub text: String,
    pub reason: String,
}
