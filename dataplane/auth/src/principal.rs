//! [`Principal`]: the name a connection acts as.

use std::fmt;
use std::sync::Arc;

use crate::AuthError;

/// The principal of a connection that presented neither a token nor a client certificate.
pub const ANONYMOUS: &str = "anonymous";

/// Longest principal name in UTF-8 bytes: a DNS name (at most 253 bytes) or an e-mail
/// address fits, and a name stays printable on one log line.
pub const PRINCIPAL_BYTES_MAX: usize = 255;

/// Who a connection acts as. Cheap to clone.
///
/// A name is 1..=[`PRINCIPAL_BYTES_MAX`] bytes of UTF-8 without whitespace, control
/// characters, `;`, `,` or `#` (they separate or end rules and tokens-file fields); `*` alone is
/// refused (in rules it means every principal).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Principal(Arc<str>);

impl Principal {
    /// Checks and wraps `name`.
    pub fn new(name: &str) -> Result<Principal, AuthError> {
        check_name(name).map_err(|reason| AuthError::Principal(format!("{name:?}: {reason}")))?;
        Ok(Principal(Arc::from(name)))
    }

    /// The principal of an unauthenticated connection, [`ANONYMOUS`].
    #[must_use]
    pub fn anonymous() -> Principal {
        Principal(Arc::from(ANONYMOUS))
    }

    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    #[must_use]
    pub fn is_anonymous(&self) -> bool {
        &*self.0 == ANONYMOUS
    }
}

/// Why `name` is not a principal name, if it is not.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("is empty".to_owned());
    }
    if name.len() > PRINCIPAL_BYTES_MAX {
        return Err(format!(
            "is {} bytes long (at most {PRINCIPAL_BYTES_MAX})",
            name.len()
        ));
    }
    if name == "*" {
        return Err("is reserved (in rules, `*` means every principal)".to_owned());
    }
    match name.chars().find(|c| forbidden(*c)) {
        Some(c) => Err(format!(
            "contains {c:?} (whitespace, control characters, ';', ',' and '#' are not allowed)"
        )),
        None => Ok(()),
    }
}

fn forbidden(c: char) -> bool {
    c.is_whitespace() || c.is_control() || matches!(c, ';' | ',' | '#')
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names of every allowed kind are accepted and read back unchanged.
    #[test]
    fn accepts_plain_names() {
        for name in [
            "alice",
            "svc.orders-writer_1",
            "bob@example.com",
            "spiffe://prod/ns/orders",
            "10.0.0.1",
            "zoë",
            "a*b",
            ANONYMOUS,
        ] {
            let principal = Principal::new(name).expect(name);
            assert_eq!(principal.as_str(), name);
            assert_eq!(principal.to_string(), name);
        }
        let longest = "a".repeat(PRINCIPAL_BYTES_MAX);
        assert!(Principal::new(&longest).is_ok());
    }

    /// Empty, too long, `*` and names with separators or blanks are refused with a reason.
    #[test]
    fn refuses_bad_names() {
        let too_long = "a".repeat(PRINCIPAL_BYTES_MAX + 1);
        for name in [
            "", "*", "al ice", "al\tice", "a;b", "a,b", "a#b", "a\u{7f}", "a\nb", &too_long,
        ] {
            assert!(
                matches!(Principal::new(name), Err(AuthError::Principal(_))),
                "{name:?}"
            );
        }
        let message = Principal::new("al ice").expect_err("a blank").to_string();
        assert_eq!(
            message,
            "invalid principal \"al ice\": contains ' ' (whitespace, control characters, ';', \
             ',' and '#' are not allowed)"
        );
    }

    /// The anonymous principal is the name `anonymous`, whichever way it is made.
    #[test]
    fn anonymous_is_a_name() {
        assert!(Principal::anonymous().is_anonymous());
        assert_eq!(Principal::new(ANONYMOUS).ok(), Some(Principal::anonymous()));
        assert!(!Principal::new("alice").expect("valid").is_anonymous());
        assert_eq!(format!("{:?}", Principal::anonymous()), "\"anonymous\"");
    }
}
