//! What a run found: a row per case (outcome, time, health check, memory after it), the
//! broker's memory samples, the failures and the undocumented behaviours, as a text table.

use std::fmt::Write as _;
use std::time::Duration;

use crate::Target;
use crate::cases::{Basis, Case};

/// One reading of the broker's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RssSample {
    /// When it was taken (`before`, a case's name, a point inside a case, `after`).
    pub label: String,
    /// `VmRSS` in bytes.
    pub rss: u64,
    /// `VmHWM` (the peak resident size so far) in bytes.
    pub hwm: u64,
}

/// How a case ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    /// The broker's behaviour differs from the expected one (described).
    Failed(String),
    /// Failed, and listed as a known broker defect.
    KnownFailure(String),
    /// Listed as a known defect, yet passed: the list is stale (or the defect is fixed).
    FixedKnownFailure,
    /// Not run (a limit it needs is unknown, ...).
    Skipped(String),
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Outcome::Passed => "ok",
            Outcome::Failed(_) => "FAILED",
            Outcome::KnownFailure(_) => "known-failure",
            Outcome::FixedKnownFailure => "FIXED?",
            Outcome::Skipped(_) => "skipped",
        }
    }
}

/// One case of one round.
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub name: &'static str,
    pub round: u32,
    /// The case's own seed (replays it alone).
    pub seed: u64,
    pub basis: Basis,
    pub outcome: Outcome,
    pub elapsed: Duration,
    /// The health check after the case: its duration, or what failed.
    pub health: Result<Duration, String>,
    /// The broker's `VmRSS` after the case and its health check.
    pub rss_after: Option<u64>,
    /// Observations (measurements, undocumented details) the case recorded.
    pub notes: Vec<String>,
}

impl CaseReport {
    pub(crate) fn skipped(case: &Case, round: u32, reason: &str) -> CaseReport {
        CaseReport {
            name: case.name,
            round,
            seed: 0,
            basis: case.basis,
            outcome: Outcome::Skipped(reason.to_owned()),
            elapsed: Duration::ZERO,
            health: Ok(Duration::ZERO),
            rss_after: None,
            notes: Vec::new(),
        }
    }

    /// One line: outcome, name, time, health, memory.
    #[must_use]
    pub fn line(&self) -> String {
        format!(
            "{:<13} {:<52} {:>8} {:>10} {:>10}  {}",
            self.outcome.label(),
            self.name,
            format!("{:.1}s", self.elapsed.as_secs_f64()),
            match &self.health {
                Ok(took) => format!("{}ms", took.as_millis()),
                Err(_) => "UNHEALTHY".to_owned(),
            },
            self.rss_after.map_or_else(|| "-".to_owned(), mib),
            match self.basis {
                Basis::Documented(_) => "documented",
                Basis::Undocumented(_) => "UNDOCUMENTED",
            }
        )
    }

    fn failed(&self) -> bool {
        matches!(
            self.outcome,
            Outcome::Failed(_) | Outcome::FixedKnownFailure
        ) || self.health.is_err()
    }
}

/// Everything a run found.
#[derive(Debug, Clone)]
pub struct SuiteReport {
    pub seed: u64,
    pub cases: Vec<CaseReport>,
    /// Memory readings in order (empty without a pid).
    pub rss: Vec<RssSample>,
    pub elapsed: Duration,
    /// The run could not start (no healthy client before the first case).
    pub setup_error: Option<String>,
}

impl SuiteReport {
    pub(crate) fn new(seed: u64) -> SuiteReport {
        SuiteReport {
            seed,
            cases: Vec::new(),
            rss: Vec::new(),
            elapsed: Duration::ZERO,
            setup_error: None,
        }
    }

    /// Reads the broker's memory now (if its pid is known); returns `VmRSS`.
    pub(crate) fn sample(&mut self, target: &Target, label: &str) -> Option<u64> {
        let (rss, hwm) = crate::rss_of(target.pid?)?;
        self.rss.push(RssSample {
            label: label.to_owned(),
            rss,
            hwm,
        });
        Some(rss)
    }

    /// No failure: the run started, every case passed, was skipped or failed as a known
    /// defect, and every health check passed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.setup_error.is_none() && !self.cases.iter().any(CaseReport::failed)
    }

    /// The cases that failed (their own check, or the health check after them).
    #[must_use]
    pub fn failures(&self) -> Vec<&CaseReport> {
        self.cases.iter().filter(|case| case.failed()).collect()
    }

    /// The largest `VmRSS` sampled.
    #[must_use]
    pub fn peak_rss(&self) -> Option<&RssSample> {
        self.rss.iter().max_by_key(|sample| sample.rss)
    }

    /// The largest `VmHWM` read: the broker's peak resident size, between samples included.
    #[must_use]
    pub fn high_water_mark(&self) -> Option<u64> {
        self.rss.iter().map(|sample| sample.hwm).max()
    }

    /// Every behaviour the documentation does not state, as `case: what the broker does`.
    #[must_use]
    pub fn undocumented(&self) -> Vec<String> {
        let mut seen = std::collections::BTreeSet::new();
        let mut out = Vec::new();
        for case in &self.cases {
            if let Basis::Undocumented(what) = case.basis
                && seen.insert((case.name, what.to_owned()))
            {
                out.push(format!("{}: {what}", case.name));
            }
            for note in &case.notes {
                if let Some(what) = note.strip_prefix(crate::cases::UNDOCUMENTED)
                    && seen.insert((case.name, what.to_owned()))
                {
                    out.push(format!("{}: {what}", case.name));
                }
            }
        }
        out
    }

    /// The per-case table.
    #[must_use]
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<13} {:<52} {:>8} {:>10} {:>10}  {}\n",
            "outcome", "case", "time", "health", "rss after", "basis"
        );
        for case in &self.cases {
            out.push_str(&case.line());
            out.push('\n');
        }
        out
    }
}

impl std::fmt::Display for SuiteReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "felix-hostile: {} case runs in {:.1}s (seed {:#x})",
            self.cases.len(),
            self.elapsed.as_secs_f64(),
            self.seed
        );
        if let Some(error) = &self.setup_error {
            let _ = writeln!(out, "SETUP FAILED: {error}");
        }
        out.push_str(&self.table());
        if let (Some(first), Some(peak)) = (self.rss.first(), self.peak_rss()) {
            let _ = writeln!(
                out,
                "\nbroker memory: {} before, peak sampled {} (at {}), high-water mark {}, {} \
                 after",
                mib(first.rss),
                mib(peak.rss),
                peak.label,
                self.high_water_mark().map_or_else(|| "-".to_owned(), mib),
                self.rss
                    .last()
                    .map_or_else(|| "-".to_owned(), |s| mib(s.rss)),
            );
        }
        let failures = self.failures();
        if !failures.is_empty() {
            let _ = writeln!(out, "\nFAILURES");
            for case in failures {
                let _ = writeln!(
                    out,
                    "- {} (round {}, case seed {:#x}):",
                    case.name, case.round, case.seed
                );
                if let Outcome::Failed(error) = &case.outcome {
                    let _ = writeln!(out, "    {error}");
                }
                if case.outcome == Outcome::FixedKnownFailure {
                    let _ = writeln!(out, "    listed as a known failure, but passed");
                }
                if let Err(error) = &case.health {
                    let _ = writeln!(out, "    health check after it: {error}");
                }
            }
        }
        let known: Vec<_> = self
            .cases
            .iter()
            .filter_map(|case| match &case.outcome {
                Outcome::KnownFailure(error) => Some((case.name, error)),
                _ => None,
            })
            .collect();
        if !known.is_empty() {
            let _ = writeln!(out, "\nKNOWN FAILURES (broker defects, not counted)");
            for (name, error) in known {
                let _ = writeln!(out, "- {name}: {error}");
            }
        }
        let skipped: Vec<_> = self
            .cases
            .iter()
            .filter_map(|case| match &case.outcome {
                Outcome::Skipped(reason) => Some((case.name, reason)),
                _ => None,
            })
            .collect();
        if !skipped.is_empty() {
            let _ = writeln!(out, "\nSKIPPED");
            for (name, reason) in skipped {
                let _ = writeln!(out, "- {name}: {reason}");
            }
        }
        let undocumented = self.undocumented();
        if !undocumented.is_empty() {
            let _ = writeln!(out, "\nUNDOCUMENTED (asserted as the broker behaves today)");
            for line in undocumented {
                let _ = writeln!(out, "- {line}");
            }
        }
        let notes: Vec<_> = self
            .cases
            .iter()
            .flat_map(|case| {
                case.notes
                    .iter()
                    .filter(|note| !note.starts_with(crate::cases::UNDOCUMENTED))
                    .map(move |note| (case.name, note))
            })
            .collect();
        if !notes.is_empty() {
            let _ = writeln!(out, "\nNOTES");
            for (name, note) in notes {
                let _ = writeln!(out, "- {name}: {note}");
            }
        }
        f.write_str(&out)
    }
}

/// Bytes as MiB with one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / f64::from(1u32 << 20))
}
