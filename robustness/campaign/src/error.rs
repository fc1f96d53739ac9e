//! The crate's single error type: what stops a campaign from running (not what it finds;
//! findings go into the campaign's report).

use std::path::PathBuf;

/// Everything that can stop a campaign or its helpers.
#[derive(Debug, thiserror::Error)]
pub enum CampaignError {
    /// A file or process operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The broker did not start, or died when it should not have.
    #[error("broker: {0}")]
    Broker(String),
    /// A client call failed where the campaign needs it to succeed.
    #[error("{what}: {source}")]
    Client {
        what: String,
        source: felix_client::ClientError,
    },
    /// Something the campaign waits for did not happen within its deadline.
    #[error("timed out: {0}")]
    Timeout(String),
    /// A small file system could not be set up (the ENOSPC test skips on this).
    #[error("small file system: {0}")]
    Mount(String),
    /// A bad campaign setting.
    #[error("invalid setting: {0}")]
    Invalid(String),
}

impl CampaignError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CampaignError::Io {
            what,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn client(what: impl Into<String>, source: felix_client::ClientError) -> Self {
        CampaignError::Client {
            what: what.into(),
            source,
        }
    }
}
