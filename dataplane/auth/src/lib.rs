//! Felix authentication and authorization: who a connection acts as ([`Principal`]), what it
//! may do ([`Rules`] compiled into a [`Policy`], then into one principal's [`Access`]), bearer
//! tokens (generation, the tokens file, verification against Argon2id hashes in a
//! [`TokenStore`]) and the principal a client certificate names ([`certificate_principal`]).
//!
//! Threads: none of its own. Everything is pure (no socket, thread or clock) except the
//! tokens-file functions ([`TokenFile::load`], [`append_token`], [`revoke_tokens`]), which
//! read and write files on the caller's thread. Rules and [`Access`] are evaluated on the
//! data-plane core that owns a connection (once per stream name, never per record); a
//! [`TokenStore`] is shared by every core (`Send + Sync`) and [`TokenStore::verify`] runs the
//! deliberately slow Argon2 check, so callers run it off the event loop (on the loop they
//! use [`TokenStore::check_fast`], which never runs Argon2). The CLI (`felix token add/list/revoke`) uses the file
//! functions from its main thread.
//!
//! Network input (a presented token, a peer's certificate, a stream name) never panics: every
//! length is checked before use and every failure is a value.

#![forbid(unsafe_code)]

mod certificate;
mod error;
mod permissions;
mod principal;
mod rules;
mod token;

pub use certificate::certificate_principal;
pub use error::{AuthError, RuleError};
pub use permissions::{Operation, Permissions};
pub use principal::{ANONYMOUS, PRINCIPAL_BYTES_MAX, Principal};
pub use rules::{Access, Policy, Rules, STREAM_PATTERN_BYTES_MAX, glob_match};
pub use token::{
    Checked, NewToken, TOKEN_BYTES_MAX, TOKEN_ID_HEX_LEN, TOKEN_PREFIX, TOKEN_SECRET_HEX_LEN,
    TokenEntry, TokenFile, TokenRefusal, TokenStore, VerifiedToken, append_token, generate_token,
    revoke_tokens,
};
