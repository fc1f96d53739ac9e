//! Authorization: [`Rules`] parsed from text, the [`Policy`] a broker enforces, and one
//! principal's compiled [`Access`].
//!
//! Syntax (the `FELIX_RULES` setting): rules are separated by `;` or newlines; blank rules and
//! `#` comments (to the end of the line) are ignored. A rule is three whitespace-separated
//! fields, `PRINCIPAL PERMISSIONS STREAMS`:
//!
//! - PRINCIPAL: a principal name, or `*` for every principal (`anonymous` included);
//! - PERMISSIONS: a comma list of `publish`, `subscribe`, `admin`, `all`;
//! - STREAMS: a comma list of patterns over the stream-name alphabet `[A-Za-z0-9._-]` plus `*`,
//!   which matches any run of characters (possibly empty, dots included).
//!
//! Permissions are additive: a principal's permissions on a stream are the union over every
//! rule that names it (or `*`) and has a pattern matching the stream. There are no deny rules.

use std::fmt;
use std::sync::Arc;

use crate::{Operation, Permissions, Principal, RuleError};

/// Longest stream pattern in bytes: the longest stream name the broker accepts by default
/// (`Limits::max_name_bytes`, 255), so a literal pattern can name any stream.
pub const STREAM_PATTERN_BYTES_MAX: usize = 255;

/// A parsed, valid rule set. Equal rule sets print the same canonical text.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Rules {
    rules: Vec<Rule>,
}

/// One rule: who, what, where.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Rule {
    /// `None` is `*`: every principal.
    principal: Option<Principal>,
    permissions: Permissions,
    /// At least one, each valid (see [`check_pattern`]).
    patterns: Vec<Arc<str>>,
}

impl Rules {
    /// Parses rule text; the error names the first bad rule (1-based among the non-blank
    /// rules), its text and why.
    pub fn parse(text: &str) -> Result<Rules, RuleError> {
        let mut rules = Vec::new();
        for line in text.lines() {
            let line = line
                .split_once('#')
                .map_or(line, |(before, _comment)| before);
            for rule_text in line.split(';').map(str::trim) {
                if rule_text.is_empty() {
                    continue;
                }
                let rule = Rule::parse(rule_text).map_err(|reason| RuleError {
                    index: rules.len() + 1,
                    text: rule_text.to_owned(),
                    reason,
                })?;
                rules.push(rule);
            }
        }
        Ok(Rules { rules })
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.rules.len()
    }
}

impl Rule {
    fn parse(text: &str) -> Result<Rule, String> {
        let fields: Vec<&str> = text.split_whitespace().collect();
        let [principal, permissions, streams] = fields[..] else {
            return Err(format!(
                "expected 3 fields (PRINCIPAL PERMISSIONS STREAMS), found {}",
                fields.len()
            ));
        };
        let principal = match principal {
            "*" => None,
            name => Some(Principal::new(name).map_err(|error| error.to_string())?),
        };
        let mut granted = Permissions::NONE;
        for word in permissions.split(',') {
            let permission = Permissions::from_word(word).ok_or_else(|| {
                format!("unknown permission {word:?} (expected publish, subscribe, admin or all)")
            })?;
            granted = granted.union(permission);
        }
        let patterns = streams
            .split(',')
            .map(|pattern| check_pattern(pattern).map(|()| Arc::from(pattern)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Rule {
            principal,
            permissions: granted,
            patterns,
        })
    }

    fn applies_to(&self, principal: &Principal) -> bool {
        self.principal
            .as_ref()
            .is_none_or(|named| named == principal)
    }
}

/// Why `pattern` is not a stream pattern, if it is not.
fn check_pattern(pattern: &str) -> Result<(), String> {
    if pattern.is_empty() {
        return Err("empty stream pattern".to_owned());
    }
    if pattern.len() > STREAM_PATTERN_BYTES_MAX {
        return Err(format!(
            "stream pattern of {} bytes (at most {STREAM_PATTERN_BYTES_MAX})",
            pattern.len()
        ));
    }
    match pattern
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '*')))
    {
        Some(c) => Err(format!(
            "stream pattern {pattern:?} contains {c:?} (expected letters, digits, '.', '_', '-' \
             or '*')"
        )),
        None => Ok(()),
    }
}

/// Canonical text: one rule per entry, joined by `"; "`; parses back to an equal [`Rules`].
impl fmt::Display for Rules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (position, rule) in self.rules.iter().enumerate() {
            if position > 0 {
                f.write_str("; ")?;
            }
            match &rule.principal {
                Some(principal) => write!(f, "{principal}")?,
                None => f.write_str("*")?,
            }
            write!(f, " {} ", rule.permissions)?;
            for (position, pattern) in rule.patterns.iter().enumerate() {
                if position > 0 {
                    f.write_str(",")?;
                }
                f.write_str(pattern)?;
            }
        }
        Ok(())
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of bytes (possibly empty) and
/// every other byte matches itself.
///
/// The classic two-pointer algorithm with star backtracking: on a mismatch it only retries
/// the most recent `*` one byte further, so the work is at most `pattern.len() * name.len()`
/// steps, never exponential (`a*a*a*a*b` against a long run of `a` stays fast).
#[must_use]
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let pattern = pattern.as_bytes();
    let name = name.as_bytes();
    let (mut p, mut n) = (0, 0);
    // After the most recent star: where the pattern resumes and where that star's match ends.
    let mut star: Option<(usize, usize)> = None;
    while let Some(&byte) = name.get(n) {
        match pattern.get(p) {
            Some(b'*') => {
                p += 1;
                star = Some((p, n));
            }
            Some(&expected) if expected == byte => {
                p += 1;
                n += 1;
            }
            _ => match star {
                Some((resume, end)) => {
                    // Let the star swallow one more byte and try the rest again.
                    p = resume;
                    n = end + 1;
                    star = Some((resume, end + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p.min(pattern.len())..]
        .iter()
        .all(|byte| *byte == b'*')
}

/// What the broker enforces: open (no rules configured: everyone may do everything), or the
/// rules.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    /// `None` is open; never an empty rule set.
    rules: Option<Arc<Rules>>,
}

impl Policy {
    #[must_use]
    pub fn open() -> Policy {
        Policy { rules: None }
    }

    /// Enforces `rules`; an empty rule set is the open policy.
    #[must_use]
    pub fn from_rules(rules: Rules) -> Policy {
        if rules.is_empty() {
            Policy::open()
        } else {
            Policy {
                rules: Some(Arc::new(rules)),
            }
        }
    }

    #[must_use]
    pub fn is_open(&self) -> bool {
        self.rules.is_none()
    }

    /// `principal`'s access: unrestricted under the open policy, else the rules naming it or
    /// `*` (none at all: it may do nothing).
    #[must_use]
    pub fn access(&self, principal: &Principal) -> Access {
        let Some(rules) = &self.rules else {
            return Access::unrestricted();
        };
        let mut everywhere = Permissions::NONE;
        let mut grants = Vec::new();
        for rule in rules.rules.iter().filter(|rule| rule.applies_to(principal)) {
            if rule.patterns.iter().any(|pattern| &**pattern == "*") {
                everywhere = everywhere.union(rule.permissions);
            } else {
                grants.push(Grant {
                    permissions: rule.permissions,
                    patterns: rule.patterns.clone(),
                });
            }
        }
        Access {
            grants: Some(Grants { everywhere, grants }),
        }
    }

    /// The enforced rules, `None` under the open policy.
    #[must_use]
    pub fn rules(&self) -> Option<&Rules> {
        self.rules.as_deref()
    }
}

/// One principal's compiled rules (only the rules naming it or `*`). Evaluated per stream
/// name (when a request names a stream, or to filter a listing), never per record.
#[derive(Clone, Debug)]
pub struct Access {
    /// `None` is unrestricted.
    grants: Option<Grants>,
}

#[derive(Clone, Debug)]
struct Grants {
    /// The union of the rules whose patterns include a bare `*`: granted on every stream.
    everywhere: Permissions,
    /// The other rules, in rule order.
    grants: Vec<Grant>,
}

#[derive(Clone, Debug)]
struct Grant {
    permissions: Permissions,
    patterns: Vec<Arc<str>>,
}

impl Access {
    /// Everything on every stream: the open policy.
    #[must_use]
    pub fn unrestricted() -> Access {
        Access { grants: None }
    }

    #[must_use]
    pub fn is_unrestricted(&self) -> bool {
        self.grants.is_none()
    }

    /// The union of the permissions every applicable rule grants on `stream`.
    #[must_use]
    pub fn permissions(&self, stream: &str) -> Permissions {
        let Some(grants) = &self.grants else {
            return Permissions::ALL;
        };
        let mut permissions = grants.everywhere;
        for grant in &grants.grants {
            if permissions == Permissions::ALL {
                break;
            }
            if !permissions.contains(grant.permissions)
                && grant
                    .patterns
                    .iter()
                    .any(|pattern| glob_match(pattern, stream))
            {
                permissions = permissions.union(grant.permissions);
            }
        }
        permissions
    }

    /// Whether `operation` on `stream` is allowed: its [`Operation::required`] permissions, or
    /// for describe and list (which require none) any permission at all on the stream. A list
    /// answer is filtered with [`Access::may_see`].
    #[must_use]
    pub fn allows(&self, operation: Operation, stream: &str) -> bool {
        let required = operation.required();
        if required.is_empty() {
            self.may_see(stream)
        } else {
            self.permissions(stream).contains(required)
        }
    }

    /// Whether the principal has any permission on `stream` (it may learn that it exists).
    #[must_use]
    pub fn may_see(&self, stream: &str) -> bool {
        !self.permissions(stream).is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    fn principal(name: &str) -> Principal {
        Principal::new(name).expect("a valid test principal")
    }

    fn parse(text: &str) -> Rules {
        Rules::parse(text).expect("valid test rules")
    }

    fn error(text: &str) -> String {
        Rules::parse(text)
            .expect_err("invalid test rules")
            .to_string()
    }

    /// Separators, blank rules and comments; the canonical text, which parses back equal.
    #[test]
    fn parses_and_prints_canonically() {
        let rules = parse(
            "# writers\n\
             alice   publish,subscribe  orders.*,audit ; ; \n\
             \t* subscribe public.*   # everyone reads public streams\n\
             ops all *;bob publish,publish x\r\n",
        );
        assert_eq!(rules.len(), 4);
        assert!(!rules.is_empty());
        let text = rules.to_string();
        assert_eq!(
            text,
            "alice publish,subscribe orders.*,audit; * subscribe public.*; \
             ops publish,subscribe,admin *; bob publish x"
        );
        assert_eq!(parse(&text), rules);
        assert!(parse("").is_empty());
        assert!(parse(" ; # nothing\n\n;").is_empty());
        assert_eq!(Rules::default(), parse("# only a comment"));
    }

    /// Each kind of bad rule is refused with its index, its text and the exact reason.
    #[test]
    fn refuses_bad_rules_with_exact_messages() {
        let table = [
            (
                "alice subscribe x; bob publsh orders.*",
                "rule 2 \"bob publsh orders.*\": unknown permission \"publsh\" (expected \
                 publish, subscribe, admin or all)",
            ),
            (
                "alice publish",
                "rule 1 \"alice publish\": expected 3 fields (PRINCIPAL PERMISSIONS STREAMS), \
                 found 2",
            ),
            (
                "; ;\n# c\nalice publish x y",
                "rule 1 \"alice publish x y\": expected 3 fields (PRINCIPAL PERMISSIONS \
                 STREAMS), found 4",
            ),
            (
                "alice publish, x",
                "rule 1 \"alice publish, x\": unknown permission \"\" (expected publish, \
                 subscribe, admin or all)",
            ),
            (
                "alice none x",
                "rule 1 \"alice none x\": unknown permission \"none\" (expected publish, \
                 subscribe, admin or all)",
            ),
            (
                "a publish x\nalice publish orders/eu",
                "rule 2 \"alice publish orders/eu\": stream pattern \"orders/eu\" contains \
                 '/' (expected letters, digits, '.', '_', '-' or '*')",
            ),
            (
                "alice publish a,,b",
                "rule 1 \"alice publish a,,b\": empty stream pattern",
            ),
            (
                "alice\u{7f} publish x",
                "rule 1 \"alice\\u{7f} publish x\": invalid principal \"alice\\u{7f}\": \
                 contains '\\u{7f}' (whitespace, control characters, ';', ',' and '#' are not \
                 allowed)",
            ),
        ];
        for (text, expected) in table {
            assert_eq!(error(text), expected, "{text:?}");
        }
        let long = "a".repeat(STREAM_PATTERN_BYTES_MAX + 1);
        let message = error(&format!("alice publish {long}"));
        assert!(
            message.ends_with(": stream pattern of 256 bytes (at most 255)"),
            "{message}"
        );
        assert!(Rules::parse(&format!("alice publish {}", &long[1..])).is_ok());
        let error = Rules::parse("x y").expect_err("two fields");
        assert_eq!((error.index, error.text.as_str()), (1, "x y"));
    }

    /// The glob table: `*` alone, prefixes, several stars, literal-only patterns.
    #[test]
    fn glob_matching_table() {
        let table = [
            ("*", "", true),
            ("*", "orders", true),
            ("*", "a.b.c", true),
            ("orders.*", "orders.eu", true),
            ("orders.*", "orders.eu.west", true),
            ("orders.*", "orders.", true),
            ("orders.*", "orders", false),
            ("orders.*", "ordersx", false),
            ("orders.*", "xorders.eu", false),
            ("orders", "orders", true),
            ("orders", "orders.eu", false),
            ("orders", "order", false),
            ("*.eu", "orders.eu", true),
            ("*.eu", "orders.eu.west", false),
            ("*.eu.*", "orders.eu.west", true),
            ("o*s.*.w*t", "orders.eu.west", true),
            ("o*s.*.w*t", "orders.eu.wes", false),
            ("a**b", "ab", true),
            ("a*b*c", "abbbc", true),
            ("a*b*c", "acb", false),
            ("*a", "banana", true),
            ("*an*an*", "banana", true),
            ("*an*an*an*", "banana", false),
            ("", "", true),
            ("", "a", false),
        ];
        for (pattern, name, expected) in table {
            assert_eq!(glob_match(pattern, name), expected, "{pattern:?} {name:?}");
        }
    }

    /// A pattern that makes naive backtracking exponential finishes in bounded time.
    #[test]
    fn pathological_pattern_is_fast() {
        let pattern = "a*".repeat(60) + "b";
        let name = "a".repeat(STREAM_PATTERN_BYTES_MAX);
        let started = Instant::now();
        for _ in 0..100 {
            assert!(!glob_match(&pattern, &name));
        }
        assert!(glob_match(&pattern, &(name + "b")));
        // About 100 * 255 * 121 byte steps; exponential backtracking would never finish.
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Permissions are the union of every applicable rule; other principals' rules do not
    /// count.
    #[test]
    fn access_is_the_union_of_matching_rules() {
        let policy = Policy::from_rules(parse(
            "alice publish orders.*; alice subscribe orders.eu.*,audit; bob all orders.*; \
             * subscribe public.*",
        ));
        let alice = policy.access(&principal("alice"));
        assert!(!alice.is_unrestricted());
        let both = Permissions::PUBLISH.union(Permissions::SUBSCRIBE);
        assert_eq!(alice.permissions("orders.eu.west"), both);
        assert_eq!(alice.permissions("orders.us"), Permissions::PUBLISH);
        assert_eq!(alice.permissions("audit"), Permissions::SUBSCRIBE);
        assert_eq!(alice.permissions("public.news"), Permissions::SUBSCRIBE);
        assert_eq!(alice.permissions("orders"), Permissions::NONE);
        assert_eq!(alice.permissions("secret"), Permissions::NONE);
        assert!(alice.allows(Operation::Publish, "orders.us"));
        assert!(!alice.allows(Operation::Subscribe, "orders.us"));
        assert!(!alice.allows(Operation::Create, "orders.us"));
        let bob = policy.access(&principal("bob"));
        assert_eq!(bob.permissions("orders.us"), Permissions::ALL);
        assert!(bob.allows(Operation::Delete, "orders.us"));
        assert!(!bob.allows(Operation::Delete, "audit"));
    }

    /// `*` rules apply to every principal, anonymous included; a principal no rule names may
    /// do nothing.
    #[test]
    fn star_principal_and_anonymous() {
        let policy = Policy::from_rules(parse("* subscribe public.*; ops admin *"));
        let anonymous = policy.access(&Principal::anonymous());
        assert!(anonymous.allows(Operation::Subscribe, "public.news"));
        assert!(!anonymous.allows(Operation::Publish, "public.news"));
        assert!(!anonymous.may_see("orders"));
        let ops = policy.access(&principal("ops"));
        assert!(ops.allows(Operation::Create, "anything.at.all"));
        assert!(ops.allows(Operation::Subscribe, "public.x"));
        assert!(!ops.allows(Operation::Publish, "public.x"));
        let only_named = Policy::from_rules(parse("alice publish x"));
        let carol = only_named.access(&principal("carol"));
        assert!(!carol.may_see("x"));
        assert!(!carol.allows(Operation::List, "x"));
        let named_anonymous = Policy::from_rules(parse("anonymous publish x"));
        assert!(
            named_anonymous
                .access(&Principal::anonymous())
                .allows(Operation::Publish, "x")
        );
    }

    /// Describe and list need some permission on the stream, whichever it is.
    #[test]
    fn describe_and_list_need_any_permission() {
        let policy = Policy::from_rules(parse("alice publish p; alice subscribe s; alice admin a"));
        let alice = policy.access(&principal("alice"));
        for stream in ["p", "s", "a"] {
            assert!(alice.may_see(stream));
            assert!(alice.allows(Operation::Describe, stream));
            assert!(alice.allows(Operation::List, stream));
        }
        assert!(!alice.allows(Operation::Describe, "other"));
        assert!(!alice.allows(Operation::List, "other"));
    }

    /// No rules (or an empty rule set) is the open policy: everyone may do everything.
    #[test]
    fn open_policy_allows_everything() {
        for policy in [
            Policy::open(),
            Policy::from_rules(Rules::default()),
            Policy::default(),
        ] {
            assert!(policy.is_open());
            assert!(policy.rules().is_none());
            let access = policy.access(&Principal::anonymous());
            assert!(access.is_unrestricted());
            assert_eq!(access.permissions("anything"), Permissions::ALL);
            assert!(access.allows(Operation::Delete, "anything"));
        }
        let unrestricted = Access::unrestricted();
        assert!(unrestricted.may_see(""));
        let closed = Policy::from_rules(parse("alice publish x"));
        assert!(!closed.is_open());
        assert_eq!(closed.rules().map(Rules::len), Some(1));
    }
}
