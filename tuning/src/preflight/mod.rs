//! Preflight: the checks a node must pass before it takes load (`felix preflight [--json]`).
//!
//! Each check looks at one property of the host that the broker's performance or durability
//! depends on (NIC MTU, the path MTU to a peer, the data volume's filesystem and RAID layout,
//! disk write rate with fdatasync, free space, clock synchronization) and returns one
//! [`Check`]: a name, an [`Outcome`] and a one-line detail saying what was found and, on
//! failure, what is wrong. The parsing parts take their inputs as text (the contents of
//! `/proc/self/mountinfo`, sysfs files) so they are unit-tested without the host; thin
//! wrappers read the real files. Nothing here changes the host: the only side effects are ICMP
//! echo requests and a temporary probe file that is removed again.
//!
//! [`render_lines`] and [`render_json`] format a list of checks; [`failed`] says whether any
//! failed (the command's exit status).

mod clock;
mod disk;
mod net;
mod volume;

pub use clock::clock_sync;
pub use disk::{
    WriteRate, fdatasync_latency, free_space, free_space_bytes, write_probe, write_rate,
};
pub use net::{df_probe, mtu, mtu_check, nic_mtu};
pub use volume::{data_volume, data_volume_check, read_sys_block};

/// The result of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The host meets the requirement.
    Pass,
    /// Not a failure, but worth an operator's look.
    Warn,
    /// The node should not take load until this is fixed.
    Fail,
    /// The check could not run here (unsupported, no permission); says nothing about the host.
    Skip,
}

impl Outcome {
    /// The upper-case label used in [`render_lines`] and [`render_json`]: `PASS`, `WARN`,
    /// `FAIL` or `SKIP`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Warn => "WARN",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "SKIP",
        }
    }
}

/// One check's result: what was checked, how it came out, and a one-line explanation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// What was checked, e.g. `mtu eth0`.
    pub name: String,
    /// How it came out.
    pub outcome: Outcome,
    /// One line (no newline): what was found, and on failure what is wrong.
    pub detail: String,
}

impl Check {
    /// A check named `name` with `outcome` and `detail`.
    pub fn new(name: impl Into<String>, outcome: Outcome, detail: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            outcome,
            detail: detail.into(),
        }
    }
}

/// The text of `felix preflight`: one `LABEL  name: detail` line per check, with the details
/// aligned in one column, e.g. `PASS  mtu eth0: 3900 (required 3900)`.
pub fn render_lines(checks: &[Check]) -> String {
    let width = checks
        .iter()
        .map(|check| check.name.chars().count() + 1)
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for check in checks {
        let name = format!("{}:", check.name);
        out.push_str(&format!(
            "{}  {name:<width$} {}\n",
            check.outcome.label(),
            one_line(&check.detail)
        ));
    }
    out
}

/// The text of `felix preflight --json`: a JSON array of
/// `{"name":..,"outcome":"PASS"|"WARN"|"FAIL"|"SKIP","detail":..}` objects, one per check, in
/// order, followed by a newline.
pub fn render_json(checks: &[Check]) -> String {
    let items: Vec<String> = checks
        .iter()
        .map(|check| {
            format!(
                "{{\"name\":{},\"outcome\":{},\"detail\":{}}}",
                json_string(&check.name),
                json_string(check.outcome.label()),
                json_string(&check.detail)
            )
        })
        .collect();
    format!("[{}]\n", items.join(","))
}

/// Whether any check failed ([`Outcome::Fail`]); warnings and skips do not count.
pub fn failed(checks: &[Check]) -> bool {
    checks.iter().any(|check| check.outcome == Outcome::Fail)
}

/// `text` with line breaks replaced by spaces, so each check stays on one line.
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `bytes` in the largest binary unit that keeps the number >= 1, one decimal: `3.5 GiB`.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Check> {
        vec![
            Check::new("mtu eth0", Outcome::Pass, "3900 (required 3900)"),
            Check::new("clock sync", Outcome::Fail, "not \"synced\"\nat all"),
            Check::new("x", Outcome::Skip, "tab\there \\ \u{1}"),
        ]
    }

    #[test]
    fn lines_are_aligned() {
        assert_eq!(
            render_lines(&sample()),
            "PASS  mtu eth0:   3900 (required 3900)\n\
             FAIL  clock sync: not \"synced\" at all\n\
             SKIP  x:          tab\there \\ \u{1}\n"
        );
        assert_eq!(
            render_lines(&sample()[..1]),
            "PASS  mtu eth0: 3900 (required 3900)\n"
        );
        assert_eq!(render_lines(&[]), "");
    }

    #[test]
    fn json_is_escaped() {
        assert_eq!(
            render_json(&sample()),
            "[{\"name\":\"mtu eth0\",\"outcome\":\"PASS\",\"detail\":\"3900 (required 3900)\"},\
             {\"name\":\"clock sync\",\"outcome\":\"FAIL\",\"detail\":\"not \\\"synced\\\"\\nat all\"},\
             {\"name\":\"x\",\"outcome\":\"SKIP\",\"detail\":\"tab\\there \\\\ \\u0001\"}]\n"
        );
        assert_eq!(render_json(&[]), "[]\n");
    }

    #[test]
    fn failed_counts_only_fail() {
        assert!(failed(&sample()));
        assert!(!failed(&sample()[..1]));
        assert!(!failed(&[Check::new("w", Outcome::Warn, "")]));
    }

    #[test]
    fn human_bytes_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 * 1024 * 1024 * 1024 / 2), "1.5 GiB");
    }
}
