//! The shell's part of authentication (docs/security.md): the client certificate a TLS
//! handshake verified, read from s2n-quic's events ([`PeerIdentity`]); the tokens file, loaded
//! at start-up and re-read on SIGHUP ([`TokenReloader`]) and handed to every core as an
//! `Arc<TokenStore>` through a watch channel; and each core's token task, which runs the
//! argon2 checks off the core's event loop, one at a time, and closes the connections a
//! reload revoked. The decisions (who a connection is, what it may do) are the state
//! machine's (`felix_core::security`).
//!
//! Threads: [`PeerIdentity`] runs inside each core's s2n-quic endpoint; the token task is a
//! `spawn_local` task on each core, whose argon2 checks run on tokio's blocking pool; the
//! [`TokenReloader`] is called from the signal thread.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use felix_auth::{Principal, TokenFile, TokenRefusal, TokenStore};
use felix_core::StreamId;
use felix_wire::ErrorCode;
use s2n_quic::provider::event::{ConnectionInfo, ConnectionMeta, Subscriber, events};
use tokio::sync::watch;

use crate::BrokerError;
use crate::shell::Shell;

/// s2n-quic event subscriber keeping the leaf of the client certificate chain TLS verified
/// (mutual TLS), read by the connection task once the connection is accepted.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PeerIdentity;

/// Per-connection: the verified client certificate's leaf (DER), if one was presented.
#[derive(Debug, Default)]
pub(crate) struct PeerCertificate {
    leaf: Option<Vec<u8>>,
}

impl Subscriber for PeerIdentity {
    type ConnectionContext = PeerCertificate;

    fn create_connection_context(
        &mut self,
        _meta: &ConnectionMeta,
        _info: &ConnectionInfo,
    ) -> Self::ConnectionContext {
        PeerCertificate::default()
    }

    fn on_tls_exporter_ready(
        &mut self,
        context: &mut Self::ConnectionContext,
        _meta: &ConnectionMeta,
        event: &events::TlsExporterReady,
    ) {
        // The chain s2n-tls verified against FELIX_CLIENT_CA, leaf first; empty (or an error)
        // when the client presented no certificate.
        if let Ok(chain) = event.session.peer_cert_chain_der() {
            context.leaf = chain.into_iter().next();
        }
    }
}

/// The principal of a connection's verified client certificate: `Ok(None)` without one, `Err`
/// with the reason when its names make no principal (the connection is then refused).
pub(crate) fn peer_principal(
    connection: &s2n_quic::connection::Connection,
) -> Result<Option<Principal>, String> {
    let leaf = connection
        .query_event_context(|context: &PeerCertificate| context.leaf.clone())
        .map_err(|error| format!("cannot read the TLS session: {error}"))?;
    match leaf {
        None => Ok(None),
        Some(der) => felix_auth::certificate_principal(&der)
            .map(Some)
            .map_err(|error| error.to_string()),
    }
}

/// Reads FELIX_TOKENS_FILE (an error names the variable and the line).
pub fn load_tokens(path: &Path) -> Result<TokenStore, BrokerError> {
    let file = TokenFile::load(path).map_err(|error| BrokerError::Setting {
        env: "FELIX_TOKENS_FILE",
        value: path.display().to_string(),
        reason: felix_storage::ErrorChain(&error).to_string(),
    })?;
    Ok(TokenStore::new(file))
}

/// Re-reads the tokens file on demand (SIGHUP) and hands the new store to every core, which
/// closes the connections of tokens no longer in it. Cheap to clone; any thread.
#[derive(Clone)]
pub struct TokenReloader {
    path: Option<PathBuf>,
    sender: Arc<watch::Sender<Arc<TokenStore>>>,
}

impl std::fmt::Debug for TokenReloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReloader")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl TokenReloader {
    /// The store of FELIX_TOKENS_FILE (empty when unset), and its reloader.
    pub(crate) fn start(
        path: Option<&Path>,
    ) -> Result<(TokenReloader, watch::Receiver<Arc<TokenStore>>), BrokerError> {
        let store = match path {
            Some(path) => load_tokens(path)?,
            None => TokenStore::empty(),
        };
        let (sender, receiver) = watch::channel(Arc::new(store));
        Ok((
            TokenReloader {
                path: path.map(Path::to_path_buf),
                sender: Arc::new(sender),
            },
            receiver,
        ))
    }

    /// Re-reads the file; on success every core gets the new tokens (and closes connections
    /// of removed ones) and the count is returned. On error the old tokens stay in force.
    pub fn reload(&self) -> Result<usize, BrokerError> {
        let Some(path) = &self.path else {
            return Ok(0);
        };
        let store = load_tokens(path)?;
        let count = store.len();
        self.sender.send_replace(Arc::new(store));
        Ok(count)
    }

    /// Tokens in force now.
    #[must_use]
    pub fn count(&self) -> usize {
        self.sender.borrow().len()
    }
}

/// A token whose check needs argon2 (its id was not verified since the last reload).
pub(crate) struct SlowCheck {
    pub stream: StreamId,
    pub token: Bytes,
    pub store: Arc<TokenStore>,
}

/// One core's token task: runs the slow checks the shell queued, one at a time on the
/// blocking pool (a burst of bogus tokens costs one hashing thread per core, and the core's
/// event loop keeps serving), and applies reloads: connections whose token is gone, or now
/// names another principal, are closed with `Unauthenticated`.
pub(crate) async fn token_task(shell: Rc<Shell>, mut tokens: watch::Receiver<Arc<TokenStore>>) {
    let mut watching = true;
    loop {
        tokio::select! {
            changed = tokens.changed(), if watching => match changed {
                Ok(()) => {
                    let store = Arc::clone(&tokens.borrow_and_update());
                    let revoked = shell.input(|core, _| {
                        core.handle_tokens_reloaded(|id, principal| {
                            store.principal_of(id) == Some(principal)
                        })
                    });
                    for connection in revoked {
                        tracing::info!(core = shell.index, ?connection, "token revoked: closing its connection");
                        shell.close_connection(connection, ErrorCode::Unauthenticated);
                    }
                }
                // The reloader is gone (shutdown): no more reloads.
                Err(_) => watching = false,
            },
            () = shell.token_work.notified() => {}
        }
        loop {
            let next = shell.slow_checks.borrow_mut().pop_front();
            let Some(check) = next else { break };
            let SlowCheck {
                stream,
                token,
                store,
            } = check;
            let verdict = tokio::task::spawn_blocking(move || store.verify(&token))
                .await
                .unwrap_or_else(|error| {
                    tracing::error!(%error, "token check failed; refusing the token");
                    Err(TokenRefusal::Wrong)
                });
            shell.input(|core, now| core.handle_token_checked(now, stream, verdict));
        }
    }
}
