//! How a setting's raw text (from the file, the environment or a flag) becomes a typed value,
//! and how a typed value is written back as text for `felix config`.
//!
//! "Parse, don't validate": a value that parses is in range; the caller turns `None` into a
//! [`crate::ConfigError::Invalid`] naming the variable.

use std::net::SocketAddr;
use std::path::PathBuf;

pub(crate) const KIB: u64 = 1 << 10;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;
pub(crate) const TIB: u64 = 1 << 40;

/// Binary suffixes a byte size may carry, largest first (rendering picks the largest exact one).
const SIZE_SUFFIXES: [(&str, u64); 4] = [("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)];

/// What a setting accepts. Bounds are inclusive.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    /// Bytes: a plain integer or one with a binary suffix (`64MiB`).
    Size { min: u64, max: u64 },
    /// A plain whole number (no suffixes: these count records, not bytes).
    Count { min: u64, max: u64 },
    /// `0`, `1`, `true` or `false`.
    Bool,
    /// An IP socket address, `ip:port`.
    Addr,
    /// An IP socket address, or `off`.
    AddrOrOff,
    /// A required path, taken as given (relative paths stay relative).
    Path,
    /// An optional path; the empty string means unset.
    OptionalPath,
    /// Free text that must not be blank; `what` names it in messages.
    Text { what: &'static str },
    /// One of a fixed set of words (exact spelling).
    Choice { options: &'static [&'static str] },
    /// Free text, possibly empty, that a config file may also give as an array of strings
    /// (joined one per line). Control characters other than tab and line breaks are refused: they
    /// belong to no rule and would garble logs. `what` names it in messages.
    TextList { what: &'static str },
    /// A credential, possibly empty (unset), never shown: `felix config` and error messages
    /// print `(hidden)` instead. Printable ASCII without spaces, at most
    /// [`SECRET_BYTES_MAX`] bytes. `what` names it in messages.
    Secret { what: &'static str },
}

/// What a secret value is replaced with wherever it would be shown.
pub(crate) const HIDDEN: &str = "(hidden)";

/// The protocol's bound on a Hello token (felix_wire::TOKEN_BYTES_MAX): a longer one could
/// never be sent.
pub(crate) const SECRET_BYTES_MAX: usize = 1024;

impl Kind {
    /// What this kind accepts, in words: the reference's "Accepted" column and the tail of
    /// every invalid-value message.
    pub(crate) fn accepts(self) -> String {
        match self {
            Kind::Size { min, max } => {
                format!(
                    "a byte size from {} to {}",
                    format_size(min),
                    format_size(max)
                )
            }
            Kind::Count { min, max } => format!("a whole number from {min} to {max}"),
            Kind::Bool => "0, 1, true or false".to_owned(),
            Kind::Addr => "an IP socket address (ip:port)".to_owned(),
            Kind::AddrOrOff => "an IP socket address (ip:port) or off".to_owned(),
            Kind::Path => "a non-empty path".to_owned(),
            Kind::OptionalPath => "a path, or empty for unset".to_owned(),
            Kind::Text { what } => what.to_owned(),
            Kind::Choice { options } => format!("one of {}", options.join(", ")),
            Kind::TextList { what } | Kind::Secret { what } => what.to_owned(),
        }
    }

    /// Whether values of this kind must never be shown.
    pub(crate) fn is_secret(self) -> bool {
        matches!(self, Kind::Secret { .. })
    }

    /// Example spellings for an error message, taken from the setting's default so that they
    /// are always valid, e.g. `67108864 or 64MiB`.
    pub(crate) fn examples(self, default: &str) -> Option<String> {
        if default.is_empty() {
            return None;
        }
        match self {
            Kind::Size { .. } => {
                let bytes = parse_size(default)?;
                let suffixed = format_size(bytes);
                if suffixed == bytes.to_string() {
                    Some(suffixed)
                } else {
                    Some(format!("{bytes} or {suffixed}"))
                }
            }
            Kind::Count { .. } | Kind::Addr | Kind::Text { .. } | Kind::Choice { .. } => {
                Some(default.to_owned())
            }
            Kind::AddrOrOff => Some(format!("{default} or off")),
            Kind::Bool
            | Kind::Path
            | Kind::OptionalPath
            | Kind::TextList { .. }
            | Kind::Secret { .. } => None,
        }
    }
}

/// A field type of [`crate::Config`] that a [`Kind`] can fill.
pub(crate) trait FieldValue: Sized {
    /// The typed value, or `None` when `kind` does not accept `raw`.
    fn parse(kind: Kind, raw: &str) -> Option<Self>;
    /// The value as it would be written in the environment.
    fn render(&self, kind: Kind) -> String;
}

/// The settings table paired a kind with a field type it cannot fill: a programmer error that
/// the defaults test catches, since every default is parsed by its setting's kind.
fn kind_mismatch(kind: Kind, field_type: &str) -> ! {
    unreachable!("settings table pairs kind {kind:?} with a {field_type} field")
}

impl FieldValue for u64 {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::Size { min, max } => parse_size(raw).filter(|v| (min..=max).contains(v)),
            Kind::Count { min, max } => parse_whole(raw.trim()).filter(|v| (min..=max).contains(v)),
            _ => kind_mismatch(kind, "u64"),
        }
    }

    fn render(&self, kind: Kind) -> String {
        match kind {
            Kind::Size { .. } => format_size(*self),
            _ => self.to_string(),
        }
    }
}

impl FieldValue for u32 {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        // Bounds of u32 settings sit inside u32 (asserted in settings.rs), so try_from only
        // fails for values the range check has already refused.
        u64::parse(kind, raw).and_then(|v| u32::try_from(v).ok())
    }

    fn render(&self, kind: Kind) -> String {
        u64::from(*self).render(kind)
    }
}

impl FieldValue for u16 {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        // As for u32: the bounds of u16 settings sit inside u16 (asserted in settings.rs).
        u64::parse(kind, raw).and_then(|v| u16::try_from(v).ok())
    }

    fn render(&self, kind: Kind) -> String {
        u64::from(*self).render(kind)
    }
}

impl FieldValue for bool {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::Bool => match raw.trim() {
                "1" | "true" => Some(true),
                "0" | "false" => Some(false),
                _ => None,
            },
            _ => kind_mismatch(kind, "bool"),
        }
    }

    fn render(&self, _kind: Kind) -> String {
        if *self { "1" } else { "0" }.to_owned()
    }
}

impl FieldValue for SocketAddr {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::Addr => raw.trim().parse().ok(),
            _ => kind_mismatch(kind, "SocketAddr"),
        }
    }

    fn render(&self, _kind: Kind) -> String {
        self.to_string()
    }
}

impl FieldValue for Option<SocketAddr> {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::AddrOrOff => match raw.trim() {
                "off" => Some(None),
                addr => addr.parse().ok().map(Some),
            },
            _ => kind_mismatch(kind, "Option<SocketAddr>"),
        }
    }

    fn render(&self, _kind: Kind) -> String {
        self.map_or_else(|| "off".to_owned(), |addr| addr.to_string())
    }
}

/// A NUL byte cannot appear in a Unix path; refusing it here beats a confusing error from the
/// first `open`.
fn path_text_ok(raw: &str) -> bool {
    !raw.contains('\0')
}

impl FieldValue for PathBuf {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::Path => (!raw.is_empty() && path_text_ok(raw)).then(|| PathBuf::from(raw)),
            _ => kind_mismatch(kind, "PathBuf"),
        }
    }

    fn render(&self, _kind: Kind) -> String {
        self.display().to_string()
    }
}

impl FieldValue for Option<PathBuf> {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::OptionalPath if raw.is_empty() => Some(None),
            Kind::OptionalPath => path_text_ok(raw).then(|| Some(PathBuf::from(raw))),
            _ => kind_mismatch(kind, "Option<PathBuf>"),
        }
    }

    fn render(&self, _kind: Kind) -> String {
        self.as_ref()
            .map_or_else(String::new, |path| path.display().to_string())
    }
}

impl FieldValue for String {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::Text { .. } => (!raw.trim().is_empty()).then(|| raw.to_owned()),
            Kind::Choice { options } => options.contains(&raw).then(|| raw.to_owned()),
            Kind::TextList { .. } => raw
                .chars()
                .all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r'))
                .then(|| raw.to_owned()),
            _ => kind_mismatch(kind, "String"),
        }
    }

    fn render(&self, _kind: Kind) -> String {
        self.clone()
    }
}

impl FieldValue for Option<String> {
    fn parse(kind: Kind, raw: &str) -> Option<Self> {
        match kind {
            Kind::Secret { .. } if raw.is_empty() => Some(None),
            Kind::Secret { .. } => (raw.len() <= SECRET_BYTES_MAX
                && raw.bytes().all(|b| b.is_ascii_graphic()))
            .then(|| Some(raw.to_owned())),
            _ => kind_mismatch(kind, "Option<String>"),
        }
    }

    /// Never the secret itself: `(hidden)` when set, empty (unset) when not.
    fn render(&self, _kind: Kind) -> String {
        self.as_ref()
            .map_or_else(String::new, |_| HIDDEN.to_owned())
    }
}

/// Digits only: no sign, no spaces, no `_`; `None` on overflow.
fn parse_whole(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A byte size: `67108864`, `64MiB` or `64 MiB` (suffixes KiB, MiB, GiB, TiB, case as written).
/// `None` for anything else, including values that overflow u64.
pub(crate) fn parse_size(raw: &str) -> Option<u64> {
    let text = raw.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(digits_end);
    let number = parse_whole(digits)?;
    let multiplier = match suffix.trim_start() {
        "" => 1,
        suffix => SIZE_SUFFIXES.iter().find(|(name, _)| *name == suffix)?.1,
    };
    number.checked_mul(multiplier)
}

/// A byte size with the largest binary suffix that divides it exactly (`64MiB`), else plain.
pub(crate) fn format_size(bytes: u64) -> String {
    if bytes == 0 {
        return "0".to_owned();
    }
    SIZE_SUFFIXES
        .iter()
        .find(|(_, unit)| bytes.is_multiple_of(*unit))
        .map_or_else(
            || bytes.to_string(),
            |(name, unit)| format!("{}{name}", bytes / unit),
        )
}
