//! felix-hostile owns the hostile-client suite: malformed, oversized, misplaced and abusive
//! clients run one after another against one real broker over QUIC, each checked against the
//! outcome docs/wire-protocol.md and docs/security.md document (the error code, and which
//! stream or connection ends), with a healthy felix-client served between every two cases and
//! the broker's resident memory sampled from /proc after each.
//!
//! The cases are data ([`cases`]): a name, what documents the expected outcome (or, where the
//! documentation is silent, what the broker does today), and an async fn returning
//! `Ok(())` or `Err(description)`. [`run_suite`] runs them against a [`Target`] and returns a
//! [`SuiteReport`] (a per-case table, the failures, the undocumented behaviours).
//! `dataplane/felix/tests/hostile.rs` runs it against a broker it starts; the `felix-hostile`
//! binary runs it against any broker. docs/hostile-clients.md describes the cases.
//!
//! Bounds: every case is bounded in count (connections, streams, datagrams, bytes) and in time
//! (each step has a deadline of tens of seconds, each case a budget); nothing here retries
//! forever. The suite is meant for loopback: it floods what it is told the broker's limits are.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::SeedableRng as _;

mod cases;
mod frames;
mod health;
mod raw;
mod report;

pub use cases::{Basis, Case, cases};
pub use health::{HEALTH_DEADLINE, HEALTH_STREAM, client_config};
pub use raw::{Closed, Next};
pub use report::{CaseReport, Outcome, RssSample, SuiteReport};

/// The broker under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// The shared QUIC port (what clients dial).
    pub quic_addr: SocketAddr,
    /// Each data-plane core's own port, by core index; empty: taken from `HelloOk.core_ports`
    /// on `quic_addr`'s IP address.
    pub core_addrs: Vec<SocketAddr>,
    /// PEM CA the broker's certificate chains to.
    pub ca_pem: PathBuf,
    /// TLS server name to verify (default `localhost`).
    pub server_name: String,
    /// The broker's process id, for its resident memory (`/proc/<pid>/status`); `None`: no
    /// memory samples.
    pub pid: Option<u32>,
    /// The broker's `/metrics` address, for the final leak check; `None`: skipped.
    pub metrics_addr: Option<SocketAddr>,
    /// The broker's settings that `HelloOk` does not announce.
    pub limits: BrokerLimits,
}

impl Target {
    /// A target with nothing known beyond its address and CA.
    #[must_use]
    pub fn new(quic_addr: SocketAddr, ca_pem: PathBuf) -> Target {
        Target {
            quic_addr,
            core_addrs: Vec::new(),
            ca_pem,
            server_name: "localhost".to_owned(),
            pid: None,
            metrics_addr: None,
            limits: BrokerLimits::default(),
        }
    }
}

/// Broker settings a client cannot learn from `HelloOk` (docs/configuration.md). `None`:
/// unknown; the cases that need the value are skipped (the floods) or use only sizes that give
/// the same outcome under every allowed setting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BrokerLimits {
    /// FELIX_MAX_CONNECTIONS_PER_CORE.
    pub connections_per_core: Option<u32>,
    /// FELIX_MAX_CONNECTIONS_PER_PRINCIPAL (0 = none).
    pub connections_per_principal: Option<u32>,
    /// FELIX_MAX_STREAMS_PER_CONNECTION.
    pub streams_per_connection: Option<u32>,
    /// FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION.
    pub subscriptions_per_connection: Option<u32>,
    /// FELIX_HELLO_TIMEOUT_MS.
    pub hello_timeout: Option<Duration>,
    /// FELIX_HELLO_MAX_BYTES.
    pub hello_max_bytes: Option<u32>,
    /// FELIX_SUBSCRIBER_QUEUE_MAX_BYTES.
    pub subscriber_queue_max_bytes: Option<u64>,
}

/// How to run the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// Seed of every random choice (bytes, sizes, mutations); each case derives its own from
    /// it, its name and the round, so a case replays alone with the same seed.
    pub seed: u64,
    /// Rounds over the whole list (round `r` uses seed + r).
    pub repeat: u32,
    /// Run only the cases whose name contains one of these (empty: all).
    pub only: Vec<String>,
    /// Cases expected to fail (known broker defects): their failure is reported, not counted.
    pub known_failures: Vec<String>,
    /// Print a line per case to stderr as it finishes.
    pub verbose: bool,
    /// After this many health checks failed in a row, the remaining cases are skipped.
    pub max_health_failures: u32,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            seed: 0x00fe_11c5,
            repeat: 1,
            only: Vec::new(),
            known_failures: Vec::new(),
            verbose: false,
            max_health_failures: 3,
        }
    }
}

impl Options {
    fn selects(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|part| name.contains(part.as_str()))
    }
}

/// The broker's resident memory and its high-water mark in bytes (`VmRSS`, `VmHWM` of
/// `/proc/<pid>/status`), or `None` if the process is gone or the file unreadable.
#[must_use]
pub fn rss_of(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().strip_suffix("kB"))
            .and_then(|kib| kib.trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Runs every selected case `options.repeat` times against `target`, a health check after
/// each, and reports.
pub async fn run_suite(target: &Target, options: &Options) -> SuiteReport {
    let started = Instant::now();
    let mut report = SuiteReport::new(options.seed);
    report.sample(target, "before");
    let mut health = match health::Health::connect(target).await {
        Ok(health) => health,
        Err(error) => {
            report.setup_error = Some(error);
            report.elapsed = started.elapsed();
            return report;
        }
    };
    if let Err(error) = health.check().await {
        report.setup_error = Some(format!(
            "the broker is not healthy before any case: {error}"
        ));
        report.elapsed = started.elapsed();
        return report;
    }
    let hello = health.client().hello().clone();
    let core_addrs = if target.core_addrs.is_empty() {
        hello
            .core_ports
            .iter()
            .map(|port| SocketAddr::new(target.quic_addr.ip(), *port))
            .collect()
    } else {
        target.core_addrs.clone()
    };
    let shared = Arc::new(cases::Shared {
        target: target.clone(),
        hello,
        core_addrs,
        admin: health.admin(),
    });
    let mut health_failures = 0u32;
    for round in 0..options.repeat.max(1) {
        for case in cases() {
            if !options.selects(case.name) {
                continue;
            }
            let known = options.known_failures.iter().any(|name| name == case.name);
            if health_failures >= options.max_health_failures {
                report.cases.push(CaseReport::skipped(
                    &case,
                    round,
                    "skipped: the broker stopped serving the healthy client",
                ));
                continue;
            }
            let seed = case_seed(options.seed.wrapping_add(u64::from(round)), case.name);
            let mut ctx =
                cases::Ctx::new(Arc::clone(&shared), rand::rngs::StdRng::seed_from_u64(seed));
            let case_started = Instant::now();
            let result = tokio::time::timeout(case.budget, (case.run)(&mut ctx)).await;
            let elapsed = case_started.elapsed();
            let outcome = match result {
                Err(_) => Outcome::Failed(format!(
                    "hung: not finished within its budget of {:?}",
                    case.budget
                )),
                Ok(Err(error)) => Outcome::Failed(error),
                Ok(Ok(())) => match ctx.skipped.take() {
                    Some(reason) => Outcome::Skipped(reason),
                    None => Outcome::Passed,
                },
            };
            let outcome = match outcome {
                Outcome::Failed(error) if known => Outcome::KnownFailure(error),
                Outcome::Passed if known => Outcome::FixedKnownFailure,
                other => other,
            };
            let checked = health.check().await;
            if checked.is_err() {
                health_failures += 1;
            } else {
                health_failures = 0;
            }
            report.rss.append(&mut ctx.samples);
            let rss_after = report.sample(target, case.name);
            let case_report = CaseReport {
                name: case.name,
                round,
                seed,
                basis: case.basis,
                outcome,
                elapsed,
                health: checked,
                rss_after,
                notes: std::mem::take(&mut ctx.notes),
            };
            if options.verbose {
                eprintln!("{}", case_report.line());
            }
            report.cases.push(case_report);
        }
    }
    drop(shared);
    health.close().await;
    report.sample(target, "after");
    report.elapsed = started.elapsed();
    report
}

/// A case's seed: the run's seed mixed with the case's name (FNV-1a), so one case replays
/// alone with the same run seed.
fn case_seed(seed: u64, name: &str) -> u64 {
    felix_wire::fnv1a_64(name.as_bytes()) ^ seed.rotate_left(17)
}
