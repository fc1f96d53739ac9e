//! [`Permissions`] a rule grants and the [`Operation`]s that need them.

use std::fmt;

/// A set of permissions on a stream: publish, subscribe, admin (create and delete).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
pub struct Permissions(u8);

impl Permissions {
    pub const NONE: Permissions = Permissions(0);
    pub const PUBLISH: Permissions = Permissions(1);
    pub const SUBSCRIBE: Permissions = Permissions(2);
    /// Create and delete streams.
    pub const ADMIN: Permissions = Permissions(4);
    pub const ALL: Permissions = Permissions(1 | 2 | 4);

    /// Every single permission with its name, in display order.
    const NAMED: [(Permissions, &'static str); 3] = [
        (Permissions::PUBLISH, "publish"),
        (Permissions::SUBSCRIBE, "subscribe"),
        (Permissions::ADMIN, "admin"),
    ];

    /// Whether every permission of `other` is in `self` (true for an empty `other`).
    #[must_use]
    pub fn contains(self, other: Permissions) -> bool {
        self.0 & other.0 == other.0
    }

    #[must_use]
    pub fn union(self, other: Permissions) -> Permissions {
        Permissions(self.0 | other.0)
    }

    #[must_use]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// One permission word of the rule syntax: `publish`, `subscribe`, `admin` or `all`.
    pub(crate) fn from_word(word: &str) -> Option<Permissions> {
        match word {
            "all" => Some(Permissions::ALL),
            _ => Permissions::NAMED
                .iter()
                .find(|(_, name)| *name == word)
                .map(|(permission, _)| *permission),
        }
    }
}

/// `publish,subscribe` style (the rule syntax); `none` when empty.
impl fmt::Display for Permissions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        let mut separator = "";
        for (permission, name) in Permissions::NAMED {
            if self.contains(permission) {
                write!(f, "{separator}{name}")?;
                separator = ",";
            }
        }
        Ok(())
    }
}

/// What a request does, for the authorization check.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Operation {
    Publish,
    Subscribe,
    Create,
    Delete,
    Describe,
    List,
}

impl Operation {
    /// Stable lower-case name, for error messages, logs and metrics labels.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Operation::Publish => "publish",
            Operation::Subscribe => "subscribe",
            Operation::Create => "create",
            Operation::Delete => "delete",
            Operation::Describe => "describe",
            Operation::List => "list",
        }
    }

    /// The permissions the operation needs on its stream. [`Permissions::NONE`] (describe,
    /// list) means "any permission on the stream": see [`crate::Access::allows`].
    #[must_use]
    pub fn required(self) -> Permissions {
        match self {
            Operation::Publish => Permissions::PUBLISH,
            Operation::Subscribe => Permissions::SUBSCRIBE,
            Operation::Create | Operation::Delete => Permissions::ADMIN,
            Operation::Describe | Operation::List => Permissions::NONE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set operations and the display form, including `none` and the full set.
    #[test]
    fn set_operations_and_display() {
        let both = Permissions::PUBLISH.union(Permissions::SUBSCRIBE);
        assert!(both.contains(Permissions::PUBLISH));
        assert!(both.contains(Permissions::NONE));
        assert!(!both.contains(Permissions::ADMIN));
        assert!(Permissions::ALL.contains(both.union(Permissions::ADMIN)));
        assert!(Permissions::NONE.is_empty());
        assert_eq!(Permissions::default(), Permissions::NONE);
        assert_eq!(both.to_string(), "publish,subscribe");
        assert_eq!(Permissions::NONE.to_string(), "none");
        assert_eq!(Permissions::ALL.to_string(), "publish,subscribe,admin");
        assert_eq!(Permissions::ADMIN.to_string(), "admin");
    }

    /// Each operation's name and the permission it needs.
    #[test]
    fn operations_need_their_permission() {
        let table = [
            (Operation::Publish, "publish", Permissions::PUBLISH),
            (Operation::Subscribe, "subscribe", Permissions::SUBSCRIBE),
            (Operation::Create, "create", Permissions::ADMIN),
            (Operation::Delete, "delete", Permissions::ADMIN),
            (Operation::Describe, "describe", Permissions::NONE),
            (Operation::List, "list", Permissions::NONE),
        ];
        for (operation, name, required) in table {
            assert_eq!(operation.name(), name);
            assert_eq!(operation.required(), required);
        }
    }

    /// The rule words map to their permissions; anything else is unknown.
    #[test]
    fn words() {
        assert_eq!(Permissions::from_word("all"), Some(Permissions::ALL));
        assert_eq!(Permissions::from_word("admin"), Some(Permissions::ADMIN));
        assert_eq!(Permissions::from_word("Publish"), None);
        assert_eq!(Permissions::from_word("none"), None);
    }
}
