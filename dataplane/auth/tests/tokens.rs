//! Bearer tokens end to end: generate, append to a tokens file, load, verify (and its cache),
//! refusals, revocation, and the tokens-file errors. Few Argon2 hashes: each costs tens of
//! milliseconds.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use felix_auth::{
    AuthError, Checked, Principal, TOKEN_PREFIX, TokenFile, TokenRefusal, TokenStore,
    VerifiedToken, append_token, generate_token, revoke_tokens,
};

fn principal(name: &str) -> Principal {
    Principal::new(name).expect("a valid test principal")
}

/// A syntactically valid Argon2id PHC string (not the hash of anything), for file tests that
/// need no real verification.
fn fake_hash(seed: char) -> String {
    // Unpadded B64 of 16 and 32 bytes: the last character carries zero bits, `A` is 0.
    let salt = seed.to_string().repeat(21) + "A";
    let output = seed.to_string().repeat(42) + "A";
    format!("$argon2id$v=19$m=19456,t=2,p=1${salt}${output}")
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o777
}

fn file_error(result: Result<TokenFile, AuthError>) -> (usize, String) {
    match result {
        Err(AuthError::TokenFile { line, reason, .. }) => (line, reason),
        other => panic!("expected a tokens-file error, got {other:?}"),
    }
}

/// Generate -> append -> load -> verify succeeds once through Argon2, then from the cache;
/// a wrong secret, an unknown id and malformed tokens are refused.
#[test]
fn generate_append_load_verify() {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let path = directory.path().join("tokens");
    let alice = principal("alice");
    let new = generate_token(&alice).expect("a token");
    assert_eq!(new.id.len(), 16);
    assert_eq!(new.token.len(), 87);
    assert!(new.token.starts_with(&format!("{TOKEN_PREFIX}{}_", new.id)));
    assert!(
        new.line
            .starts_with(&format!("{} alice $argon2id$v=19$m=19456,t=2,p=1$", new.id))
    );
    let debug = format!("{new:?}");
    let secret = &new.token[23..];
    assert!(!debug.contains(secret), "{debug}");
    assert!(!debug.contains(&new.token));

    append_token(&path, &new).expect("append");
    assert_eq!(mode(&path), 0o600);
    let file = TokenFile::load(&path).expect("load");
    assert_eq!(file.entries.len(), 1);
    assert_eq!(file.entries[0].id, new.id);
    assert_eq!(file.entries[0].principal, alice);

    let store = TokenStore::new(file);
    assert_eq!(store.len(), 1);
    assert!(store.contains_id(&new.id));
    assert_eq!(store.principal_of(&new.id), Some(&alice));
    let expected = VerifiedToken {
        id: new.id.clone(),
        principal: alice.clone(),
    };
    assert_eq!(
        store.check_fast(new.token.as_bytes()),
        Ok(Checked::NeedsHash)
    );
    assert_eq!(store.verify(new.token.as_bytes()), Ok(expected.clone()));
    assert_eq!(store.argon2_checks(), 1);
    // The second check hits the cache: no Argon2.
    assert_eq!(
        store.check_fast(new.token.as_bytes()),
        Ok(Checked::Verified(expected.clone()))
    );
    assert_eq!(store.verify(new.token.as_bytes()), Ok(expected));
    assert_eq!(store.argon2_checks(), 1);

    // A wrong secret for a verified id is refused from the cached digest, without Argon2.
    let mut wrong = new.token.clone().into_bytes();
    let last = wrong.len() - 1;
    wrong[last] = if wrong[last] == b'0' { b'1' } else { b'0' };
    assert_eq!(store.check_fast(&wrong), Err(TokenRefusal::Wrong));
    assert_eq!(store.verify(&wrong), Err(TokenRefusal::Wrong));
    assert_eq!(store.argon2_checks(), 1);

    let unknown = format!("felix_{}_{}", "0".repeat(16), "0".repeat(64));
    assert_eq!(store.verify(unknown.as_bytes()), Err(TokenRefusal::Unknown));
    for malformed in [&b""[..], b"felix_", b"Bearer x", &new.token.as_bytes()[1..]] {
        assert_eq!(store.verify(malformed), Err(TokenRefusal::Malformed));
    }
    assert_eq!(store.argon2_checks(), 1);
    assert_eq!(
        TokenRefusal::Malformed.to_string(),
        "the token is malformed (expected felix_<16 hex>_<64 hex>)"
    );

    // A wrong secret before any success needs Argon2 (in a fresh store: a reload) and fails.
    let reloaded = TokenStore::new(TokenFile::load(&path).expect("reload"));
    assert_eq!(reloaded.check_fast(&wrong), Ok(Checked::NeedsHash));
    assert_eq!(reloaded.verify(&wrong), Err(TokenRefusal::Wrong));
    assert_eq!(reloaded.argon2_checks(), 1);
    assert_eq!(reloaded.check_fast(&wrong), Ok(Checked::NeedsHash));
}

/// An empty store knows no token, and a store is shareable across threads.
#[test]
fn empty_store() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TokenStore>();
    let store = TokenStore::empty();
    assert_eq!(store.len(), 0);
    assert!(store.is_empty());
    let token = format!("felix_{}_{}", "a".repeat(16), "b".repeat(64));
    assert_eq!(
        store.check_fast(token.as_bytes()),
        Err(TokenRefusal::Unknown)
    );
}

/// Revoking by id, then by principal, keeps comments, blank lines and other entries, and
/// the file's 0600 mode; revoking nothing leaves the file untouched.
#[test]
fn revoke_by_id_and_by_principal() {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let path = directory.path().join("tokens");
    let text = format!(
        "# Felix tokens\n\
         \n\
         aaaaaaaaaaaaaaaa alice {a}\n\
         # bob's laptop\n\
         bbbbbbbbbbbbbbbb bob   {b}\n\
         cccccccccccccccc alice {c}\n\
         dddddddddddddddd carol {d}",
        a = fake_hash('a'),
        b = fake_hash('b'),
        c = fake_hash('c'),
        d = fake_hash('d'),
    );
    fs::write(&path, &text).expect("write");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod");

    assert_eq!(revoke_tokens(&path, "bbbbbbbbbbbbbbbb").expect("revoke"), 1);
    let after = fs::read_to_string(&path).expect("read");
    assert_eq!(
        after,
        format!(
            "# Felix tokens\n\
             \n\
             aaaaaaaaaaaaaaaa alice {a}\n\
             # bob's laptop\n\
             cccccccccccccccc alice {c}\n\
             dddddddddddddddd carol {d}\n",
            a = fake_hash('a'),
            c = fake_hash('c'),
            d = fake_hash('d'),
        )
    );
    assert_eq!(mode(&path), 0o600);

    assert_eq!(revoke_tokens(&path, "alice").expect("revoke"), 2);
    let after = fs::read_to_string(&path).expect("read");
    assert_eq!(
        after,
        format!(
            "# Felix tokens\n\n# bob's laptop\ndddddddddddddddd carol {}\n",
            fake_hash('d')
        )
    );
    assert_eq!(mode(&path), 0o600);

    assert_eq!(revoke_tokens(&path, "nobody").expect("revoke"), 0);
    assert_eq!(fs::read_to_string(&path).expect("read"), after);
    // No temporary file is left behind.
    let names: Vec<_> = fs::read_dir(directory.path())
        .expect("list")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["tokens"]);
    assert!(matches!(
        revoke_tokens(&directory.path().join("missing"), "alice"),
        Err(AuthError::Io { .. })
    ));
}

/// Appending keeps what the file holds (adding a missing final newline), and refuses a
/// duplicate id naming the line it would have taken.
#[test]
fn append_keeps_the_file_and_refuses_duplicates() {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let path = directory.path().join("tokens");
    let old = format!("# hand written\naaaaaaaaaaaaaaaa alice {}", fake_hash('a'));
    fs::write(&path, &old).expect("write");
    let new = felix_auth::NewToken {
        id: "bbbbbbbbbbbbbbbb".to_owned(),
        principal: principal("bob"),
        token: String::new(),
        line: format!("bbbbbbbbbbbbbbbb bob {}", fake_hash('b')),
    };
    append_token(&path, &new).expect("append");
    assert_eq!(
        fs::read_to_string(&path).expect("read"),
        format!("{old}\n{}\n", new.line)
    );
    let error = append_token(&path, &new).expect_err("a duplicate");
    assert_eq!(
        error.to_string(),
        format!(
            "{}:4: duplicate token id bbbbbbbbbbbbbbbb (first on line 3)",
            path.display()
        )
    );
    assert_eq!(TokenFile::load(&path).expect("load").entries.len(), 2);
}

/// Every kind of bad line is an error naming the file and the line; a missing file is an
/// I/O error.
#[test]
fn tokens_file_errors_name_the_line() {
    let path = Path::new("/etc/felix/tokens");
    let good = format!("aaaaaaaaaaaaaaaa alice {}", fake_hash('a'));
    let duplicate = format!("# c\n{good}\n\n{good}\n");
    let (line, reason) = file_error(TokenFile::parse(&duplicate, path));
    assert_eq!(
        (line, reason.as_str()),
        (4, "duplicate token id aaaaaaaaaaaaaaaa (first on line 2)")
    );
    let error = TokenFile::parse(&duplicate, path).expect_err("a duplicate");
    assert_eq!(
        error.to_string(),
        "/etc/felix/tokens:4: duplicate token id aaaaaaaaaaaaaaaa (first on line 2)"
    );

    let table = [
        (
            format!("AAAAAAAAAAAAAAAA alice {}", fake_hash('a')),
            "bad token id \"AAAAAAAAAAAAAAAA\" (expected 16 lowercase hex characters)",
        ),
        (
            format!("aaaa alice {}", fake_hash('a')),
            "bad token id \"aaaa\" (expected 16 lowercase hex characters)",
        ),
        (
            format!("aaaaaaaaaaaaaaaa * {}", fake_hash('a')),
            "invalid principal \"*\": is reserved (in rules, `*` means every principal)",
        ),
        (
            "aaaaaaaaaaaaaaaa alice".to_owned(),
            "expected <ID> <PRINCIPAL> <HASH>, found 2 fields",
        ),
        (
            format!("aaaaaaaaaaaaaaaa alice {} extra", fake_hash('a')),
            "expected <ID> <PRINCIPAL> <HASH>, found 4 fields",
        ),
        (
            "aaaaaaaaaaaaaaaa alice not-a-hash".to_owned(),
            "the hash is not a PHC string (password hash string missing field)",
        ),
        (
            format!(
                "aaaaaaaaaaaaaaaa alice {}",
                fake_hash('a').replace("m=19456", "m=1")
            ),
            "bad argon2id parameters (invalid parameter value: value to short)",
        ),
        (
            format!(
                "aaaaaaaaaaaaaaaa alice {}",
                fake_hash('a').replace("$argon2id$v=19$m=19456,t=2,p=1", "$pbkdf2-sha256$i=1000")
            ),
            "the hash is pbkdf2-sha256, expected argon2id",
        ),
    ];
    for (line, expected) in table {
        let text = format!("# header\n{line}\n");
        let (number, reason) = file_error(TokenFile::parse(&text, path));
        assert_eq!((number, reason.as_str()), (2, expected), "{line}");
    }

    let file =
        TokenFile::parse(&format!("\n  # indented comment\n\t{good}  \r\n"), path).expect("valid");
    assert_eq!(file.entries.len(), 1);
    assert_eq!(file.entries[0].hash, fake_hash('a'));

    let directory = tempfile::tempdir().expect("a temporary directory");
    let missing = directory.path().join("missing");
    let error = TokenFile::load(&missing).expect_err("missing");
    assert!(
        matches!(&error, AuthError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    );
    assert_eq!(
        error.to_string(),
        format!("cannot access {}", missing.display())
    );
}
