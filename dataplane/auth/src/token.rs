//! Bearer tokens: generation, the tokens file, and verification in a [`TokenStore`].
//!
//! A presented token is `felix_<ID>_<SECRET>`: ID is 16 lowercase hex characters (8 random
//! bytes), SECRET 64 (32 random bytes). At rest only an Argon2id hash (a PHC string) of the
//! SECRET as written (its 64 hex characters) is kept, in the tokens file (`FELIX_TOKENS_FILE`):
//! UTF-8 lines, blank lines and `#` lines ignored, every other line `<ID> <PRINCIPAL> <HASH>`
//! separated by whitespace.
//!
//! Verification is deliberately slow (Argon2id with the `argon2` crate's defaults: m=19456
//! KiB, t=2, p=1; tens of milliseconds). After a token's first successful check the store
//! keeps a SHA-256 digest of its secret, so the next handshakes with the same token cost a
//! hash and a constant-time comparison.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::{Algorithm, Argon2, Params};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{AuthError, Principal};

/// Longest presented token the broker reads (the wire carries it in `Hello`): far above the
/// 87 bytes of a v1 token, leaving room for a longer format later, small enough to refuse
/// junk before looking at it.
pub const TOKEN_BYTES_MAX: usize = 1024;
/// Every token starts with this, so a leaked one is recognisable (secret scanners).
pub const TOKEN_PREFIX: &str = "felix_";
/// Length of a token id: 8 random bytes in lowercase hex. Ids are not secret (`felix token
/// list` shows them); 64 bits keep them unique in any real tokens file and short to type.
pub const TOKEN_ID_HEX_LEN: usize = 16;
/// Length of a token secret: 32 random bytes (256 bits, beyond guessing) in lowercase hex.
pub const TOKEN_SECRET_HEX_LEN: usize = 64;
/// A whole v1 token: prefix, id, `_`, secret.
const TOKEN_LEN: usize = TOKEN_PREFIX.len() + TOKEN_ID_HEX_LEN + 1 + TOKEN_SECRET_HEX_LEN;
/// Argon2 salt length: the PHC recommendation (16 bytes).
const SALT_BYTES: usize = 16;
/// SHA-256 output, the size of a cached secret digest.
const DIGEST_BYTES: usize = 32;

/// A freshly generated token. `token` is the only copy of the secret: show it once.
pub struct NewToken {
    pub id: String,
    pub principal: Principal,
    /// The full `felix_<id>_<secret>`.
    pub token: String,
    /// The tokens-file line, without a newline.
    pub line: String,
}

/// Leaves the secret out.
impl fmt::Debug for NewToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewToken")
            .field("id", &self.id)
            .field("principal", &self.principal)
            .field("line", &self.line)
            .finish_non_exhaustive()
    }
}

/// Generates a token for `principal` from the operating system's CSPRNG (through `rand`'s
/// thread generator, seeded from it) and hashes its secret with Argon2id.
pub fn generate_token(principal: &Principal) -> Result<NewToken, AuthError> {
    let mut rng = rand::rng();
    let mut id = [0u8; TOKEN_ID_HEX_LEN / 2];
    let mut secret = [0u8; TOKEN_SECRET_HEX_LEN / 2];
    let mut salt = [0u8; SALT_BYTES];
    rng.fill_bytes(&mut id);
    rng.fill_bytes(&mut secret);
    rng.fill_bytes(&mut salt);
    let id = hex(&id);
    let secret = hex(&secret);
    let salt = SaltString::encode_b64(&salt).map_err(|error| AuthError::Hash(error.to_string()))?;
    let hash = Argon2::default()
        .hash_password(secret.as_bytes(), &salt)
        .map_err(|error| AuthError::Hash(error.to_string()))?
        .to_string();
    Ok(NewToken {
        line: format!("{id} {principal} {hash}"),
        token: format!("{TOKEN_PREFIX}{id}_{secret}"),
        id,
        principal: principal.clone(),
    })
}

/// Lowercase hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        // Both indexes are < 16: a nibble.
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    text
}

fn is_lower_hex(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .all(|byte| matches!(byte, b'0'..=b'9' | b'a'..=b'f'))
}

fn is_token_id(id: &str) -> bool {
    id.len() == TOKEN_ID_HEX_LEN && is_lower_hex(id.as_bytes())
}

/// One line of a tokens file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenEntry {
    pub id: String,
    pub principal: Principal,
    /// The Argon2id PHC string of the secret.
    pub hash: String,
}

/// A parsed tokens file: its entries in file order, ids unique.
#[derive(Clone, Debug, Default)]
pub struct TokenFile {
    pub entries: Vec<TokenEntry>,
}

impl TokenFile {
    /// Parses the text of a tokens file; `path` only names it in errors. Bad ids, principals
    /// and hashes (not a PHC string, not Argon2id) and duplicate ids are errors naming the
    /// line.
    pub fn parse(text: &str, path: &Path) -> Result<TokenFile, AuthError> {
        let mut entries = Vec::new();
        // Token id -> the 1-based line it was first seen on.
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            let error = |reason: String| AuthError::TokenFile {
                path: path.to_owned(),
                line: number,
                reason,
            };
            let Some(fields) = entry_fields(line) else {
                continue;
            };
            let entry = parse_entry(&fields).map_err(error)?;
            // `parse_entry` succeeded, so there are exactly three fields.
            if let Some(first) = seen.insert(fields[0], number) {
                return Err(error(format!(
                    "duplicate token id {} (first on line {first})",
                    entry.id
                )));
            }
            entries.push(entry);
        }
        Ok(TokenFile { entries })
    }

    /// Reads and parses the tokens file at `path`. A missing file is an error (the caller
    /// decides whether that is fatal).
    pub fn load(path: &Path) -> Result<TokenFile, AuthError> {
        let text = fs::read_to_string(path).map_err(|source| AuthError::io(path, source))?;
        TokenFile::parse(&text, path)
    }
}

/// The whitespace-separated fields of an entry line, or `None` for a blank or comment line.
fn entry_fields(line: &str) -> Option<Vec<&str>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    Some(line.split_whitespace().collect())
}

fn parse_entry(fields: &[&str]) -> Result<TokenEntry, String> {
    let [id, principal, hash] = fields[..] else {
        return Err(format!(
            "expected <ID> <PRINCIPAL> <HASH>, found {} fields",
            fields.len()
        ));
    };
    if !is_token_id(id) {
        return Err(format!(
            "bad token id {id:?} (expected {TOKEN_ID_HEX_LEN} lowercase hex characters)"
        ));
    }
    let principal = Principal::new(principal).map_err(|error| error.to_string())?;
    check_hash(hash)?;
    Ok(TokenEntry {
        id: id.to_owned(),
        principal,
        hash: hash.to_owned(),
    })
}

/// Why `hash` is not an Argon2id PHC string Argon2 can verify against, if it is not.
fn check_hash(hash: &str) -> Result<(), String> {
    let parsed = PasswordHash::new(hash)
        .map_err(|error| format!("the hash is not a PHC string ({error})"))?;
    if Algorithm::try_from(parsed.algorithm) != Ok(Algorithm::Argon2id) {
        return Err(format!(
            "the hash is {}, expected argon2id",
            parsed.algorithm
        ));
    }
    Params::try_from(&parsed).map_err(|error| format!("bad argon2id parameters ({error})"))?;
    if parsed.salt.is_none() || parsed.hash.is_none() {
        return Err("the hash has no salt or no output".to_owned());
    }
    Ok(())
}

/// Appends `token`'s line to the tokens file at `path`, creating it (mode 0600, owned by the
/// caller) when it does not exist, and fsyncs it (and, for a new file, its directory). An
/// existing file must parse, and must not hold the token's id already.
pub fn append_token(path: &Path, token: &NewToken) -> Result<(), AuthError> {
    let existing = match fs::read_to_string(path) {
        Ok(text) => Some(text),
        Err(error) if error.kind() == io::ErrorKind::NotFound => None,
        Err(source) => return Err(AuthError::io(path, source)),
    };
    let text = existing.as_deref().unwrap_or_default();
    let file = TokenFile::parse(text, path)?;
    let new_line_number = text.lines().count() + 1;
    let line_error = |reason: String| AuthError::TokenFile {
        path: path.to_owned(),
        line: new_line_number,
        reason,
    };
    let fields = entry_fields(&token.line)
        .ok_or_else(|| line_error("the new token's line is blank".to_owned()))?;
    let entry = parse_entry(&fields).map_err(line_error)?;
    if let Some(first) = file.entries.iter().position(|old| old.id == entry.id) {
        let first_line = line_of_entry(text, first);
        return Err(line_error(format!(
            "duplicate token id {} (first on line {first_line})",
            entry.id
        )));
    }
    let mut output = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| AuthError::io(path, source))?;
    let mut bytes = String::with_capacity(token.line.len() + 2);
    if !text.is_empty() && !text.ends_with('\n') {
        bytes.push('\n');
    }
    bytes.push_str(&token.line);
    bytes.push('\n');
    output
        .write_all(bytes.as_bytes())
        .and_then(|()| output.sync_all())
        .map_err(|source| AuthError::io(path, source))?;
    if existing.is_none() {
        sync_directory_of(path)?;
    }
    Ok(())
}

/// The 1-based line number of the `entry`-th (0-based) entry line of `text`.
fn line_of_entry(text: &str, entry: usize) -> usize {
    text.lines()
        .enumerate()
        .filter(|(_, line)| entry_fields(line).is_some())
        .nth(entry)
        .map_or(0, |(index, _)| index + 1)
}

/// Removes every entry whose id is `id_or_principal`, or whose principal is, from the tokens
/// file at `path`, keeping comments, blank lines and other entries as they were. Returns how
/// many entries it removed; when none, the file is left untouched.
///
/// The file must parse first. It is rewritten atomically: a temporary file in the same
/// directory with the original's mode and owner, fsynced, renamed over the original (a
/// symbolic link is followed, so the file it points to is replaced), then the directory
/// fsynced.
pub fn revoke_tokens(path: &Path, id_or_principal: &str) -> Result<usize, AuthError> {
    let text = fs::read_to_string(path).map_err(|source| AuthError::io(path, source))?;
    TokenFile::parse(&text, path)?;
    let mut kept = String::with_capacity(text.len());
    let mut removed = 0;
    for line in text.lines() {
        // An entry line's first two fields are its id and principal.
        let revoked = entry_fields(line)
            .is_some_and(|fields| fields.iter().take(2).any(|field| *field == id_or_principal));
        if revoked {
            removed += 1;
        } else {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if removed > 0 {
        let target = fs::canonicalize(path).map_err(|source| AuthError::io(path, source))?;
        replace_file(&target, kept.as_bytes())?;
    }
    Ok(removed)
}

/// Atomically replaces the file at `target` (a canonical path) with `contents`, keeping its
/// mode and owner.
fn replace_file(target: &Path, contents: &[u8]) -> Result<(), AuthError> {
    let metadata = fs::metadata(target).map_err(|source| AuthError::io(target, source))?;
    let directory = target.parent().unwrap_or(Path::new("/"));
    let name = target
        .file_name()
        .map_or_else(|| "tokens".into(), |name| name.to_string_lossy());
    let mut suffix = [0u8; 8];
    rand::rng().fill_bytes(&mut suffix);
    let temporary = directory.join(format!(".{name}.{}.tmp", hex(&suffix)));
    let result = write_new_file(&temporary, contents, &metadata).and_then(|()| {
        fs::rename(&temporary, target).map_err(|source| AuthError::io(target, source))
    });
    if result.is_err() {
        // Best effort: the error that matters is the one returned.
        let _ = fs::remove_file(&temporary);
    }
    result?;
    sync_directory_of(target)
}

/// Creates `path` (which must not exist) with `like`'s mode and owner, writes `contents` and
/// fsyncs it.
fn write_new_file(path: &Path, contents: &[u8], like: &fs::Metadata) -> Result<(), AuthError> {
    let io_error = |source| AuthError::io(path, source);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io_error)?;
    let created = file.metadata().map_err(io_error)?;
    if (created.uid(), created.gid()) != (like.uid(), like.gid()) {
        std::os::unix::fs::fchown(&file, Some(like.uid()), Some(like.gid())).map_err(io_error)?;
    }
    file.set_permissions(like.permissions()).map_err(io_error)?;
    file.write_all(contents).map_err(io_error)?;
    file.sync_all().map_err(io_error)
}

/// Fsyncs the directory holding `path`, so a created or renamed entry survives a crash.
fn sync_directory_of(path: &Path) -> Result<(), AuthError> {
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
        _ => PathBuf::from("."),
    };
    File::open(&directory)
        .and_then(|file| file.sync_all())
        .map_err(|source| AuthError::io(directory, source))
}

/// Why a presented token is refused. Expected outcomes of a handshake, not faults.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenRefusal {
    #[error("the token is malformed (expected felix_<16 hex>_<64 hex>)")]
    Malformed,
    /// Well formed, but no entry has its id.
    #[error("unknown token")]
    Unknown,
    /// The id is known but the secret does not match.
    #[error("wrong token")]
    Wrong,
}

/// A token that passed verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifiedToken {
    pub id: String,
    pub principal: Principal,
}

/// What [`TokenStore::check_fast`] could decide without Argon2. A secret that differs from a
/// cached digest is `Err(TokenRefusal::Wrong)`, so there is no "refused" variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checked {
    /// The secret matches the digest cached after an earlier successful check.
    Verified(VerifiedToken),
    /// Well formed and the id is known, but nothing is cached: run [`TokenStore::verify`]
    /// (off the event loop).
    NeedsHash,
}

/// The tokens a broker accepts: built from a [`TokenFile`], replaced as a whole on reload
/// (which also empties the digest cache). `Send + Sync`: one store serves every core.
pub struct TokenStore {
    /// Token id -> its entry. A std `HashMap` (SipHash, random keys): lookups use ids taken
    /// from network input.
    entries: HashMap<String, StoredToken>,
    /// Token id -> SHA-256 of the secret that passed Argon2. Touched once per handshake,
    /// never per record; at most one digest per entry.
    verified: Mutex<HashMap<String, [u8; DIGEST_BYTES]>>,
    /// Argon2 verifications run (a metric; tests read it to see the cache work).
    argon2_checks: AtomicU64,
}

struct StoredToken {
    principal: Principal,
    hash: String,
}

impl fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenStore")
            .field("tokens", &self.entries.len())
            .finish_non_exhaustive()
    }
}

impl TokenStore {
    /// The store of `file`'s entries. Should an id appear twice (a hand-built file; parsing
    /// refuses it), its first entry counts.
    #[must_use]
    pub fn new(file: TokenFile) -> TokenStore {
        let mut entries = HashMap::with_capacity(file.entries.len());
        for entry in file.entries {
            if let Entry::Vacant(slot) = entries.entry(entry.id) {
                slot.insert(StoredToken {
                    principal: entry.principal,
                    hash: entry.hash,
                });
            }
        }
        TokenStore {
            entries,
            verified: Mutex::new(HashMap::new()),
            argon2_checks: AtomicU64::new(0),
        }
    }

    /// A store that accepts no token.
    #[must_use]
    pub fn empty() -> TokenStore {
        TokenStore::new(TokenFile::default())
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    #[must_use]
    pub fn contains_id(&self, id: &str) -> bool {
        self.entries.contains_key(id)
    }

    #[must_use]
    pub fn principal_of(&self, id: &str) -> Option<&Principal> {
        self.entries.get(id).map(|stored| &stored.principal)
    }

    /// How many Argon2 verifications this store has run.
    #[must_use]
    pub fn argon2_checks(&self) -> u64 {
        self.argon2_checks.load(Ordering::Relaxed)
    }

    /// Fast checks only (no Argon2): `Err(Malformed)` or `Err(Unknown)` for a malformed token
    /// or an unknown id; once the token's secret has been verified, `Ok(Verified)` when the
    /// presented secret's SHA-256 equals the cached one (compared in constant time) and
    /// `Err(Wrong)` when it differs; else `Ok(NeedsHash)`.
    pub fn check_fast(&self, presented: &[u8]) -> Result<Checked, TokenRefusal> {
        let (id, secret) = split_token(presented)?;
        let stored = self.entries.get(id).ok_or(TokenRefusal::Unknown)?;
        let cached = self.cache().get(id).copied();
        let Some(cached) = cached else {
            return Ok(Checked::NeedsHash);
        };
        if bool::from(digest(secret).ct_eq(&cached)) {
            Ok(Checked::Verified(VerifiedToken {
                id: id.to_owned(),
                principal: stored.principal.clone(),
            }))
        } else {
            Err(TokenRefusal::Wrong)
        }
    }

    /// The full check: [`TokenStore::check_fast`], else Argon2 verification of the secret
    /// (tens of milliseconds by design: run it off the event loop). A success is cached.
    ///
    /// Until a token has been verified once, every attempt with its (not secret) id costs an
    /// Argon2 run: callers bound how many run at once.
    pub fn verify(&self, presented: &[u8]) -> Result<VerifiedToken, TokenRefusal> {
        if let Checked::Verified(verified) = self.check_fast(presented)? {
            return Ok(verified);
        }
        let (id, secret) = split_token(presented)?;
        let stored = self.entries.get(id).ok_or(TokenRefusal::Unknown)?;
        self.argon2_checks.fetch_add(1, Ordering::Relaxed);
        // A hash that does not parse (a hand-built entry) verifies nothing.
        let hash = PasswordHash::new(&stored.hash).map_err(|_| TokenRefusal::Wrong)?;
        Argon2::default()
            .verify_password(secret, &hash)
            .map_err(|_| TokenRefusal::Wrong)?;
        self.cache().insert(id.to_owned(), digest(secret));
        Ok(VerifiedToken {
            id: id.to_owned(),
            principal: stored.principal.clone(),
        })
    }

    /// The digest cache. A panic while it was held cannot leave it inconsistent (every
    /// operation on it is a single map call), so a poisoned lock is used as is.
    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<String, [u8; DIGEST_BYTES]>> {
        self.verified.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn digest(secret: &[u8]) -> [u8; DIGEST_BYTES] {
    Sha256::digest(secret).into()
}

/// The id and secret of a presented v1 token, checked for shape only.
fn split_token(presented: &[u8]) -> Result<(&str, &[u8]), TokenRefusal> {
    if presented.len() != TOKEN_LEN {
        return Err(TokenRefusal::Malformed);
    }
    let rest = presented
        .strip_prefix(TOKEN_PREFIX.as_bytes())
        .ok_or(TokenRefusal::Malformed)?;
    let (id, rest) = rest
        .split_at_checked(TOKEN_ID_HEX_LEN)
        .ok_or(TokenRefusal::Malformed)?;
    let secret = rest.strip_prefix(b"_").ok_or(TokenRefusal::Malformed)?;
    if !is_lower_hex(id) || !is_lower_hex(secret) {
        return Err(TokenRefusal::Malformed);
    }
    // Lowercase hex is ASCII, so this cannot fail; refusing keeps the path panic-free.
    let id = std::str::from_utf8(id).map_err(|_| TokenRefusal::Malformed)?;
    Ok((id, secret))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hex encoding is lowercase, two digits a byte.
    #[test]
    fn hex_encoding() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert!(is_lower_hex(b"0123456789abcdef"));
        assert!(!is_lower_hex(b"ABCDEF"));
    }

    /// Only the exact v1 shape splits; everything else is malformed.
    #[test]
    fn split_checks_the_shape() {
        let id = "0123456789abcdef";
        let secret = "ab".repeat(32);
        let token = format!("felix_{id}_{secret}");
        assert_eq!(split_token(token.as_bytes()), Ok((id, secret.as_bytes())));
        let upper = token.to_uppercase();
        let long = "x".repeat(TOKEN_BYTES_MAX + 1);
        let wrong_prefix = token.replacen("felix_", "felic_", 1);
        let wrong_separator = format!("felix_{id}-{secret}");
        let short_id = format!("felix_{}_{}0", &id[1..], secret);
        for bad in [
            "",
            "felix_",
            &token[..TOKEN_LEN - 1],
            &format!("{token}0"),
            &upper,
            &long,
            &wrong_prefix,
            &wrong_separator,
            &short_id,
        ] {
            assert_eq!(
                split_token(bad.as_bytes()),
                Err(TokenRefusal::Malformed),
                "{bad:?}"
            );
        }
        let mut not_utf8 = token.into_bytes();
        not_utf8[7] = 0xff;
        assert_eq!(split_token(&not_utf8), Err(TokenRefusal::Malformed));
    }
}
