//! The hostile-client suite (felix-hostile, docs/hostile-clients.md) against the real `felix`
//! binary over loopback: dozens of malformed, oversized, misplaced and abusive clients run one
//! after another against one broker, each checked against its documented error or close, with
//! a healthy client served between every two cases and the broker's resident memory read from
//! /proc before, after each case, and after the run.
//!
//! `FELIX_HOSTILE_SEED` (a number) replays another seed; `FELIX_HOSTILE_REPEAT` runs the list
//! that many times; `FELIX_HOSTILE_CASE` runs only the cases whose name contains it.

mod support;

use std::time::Duration;

use felix_hostile::{BrokerLimits, Options, Target, run_suite};
use support::BrokerProcess;

/// Modest limits, so that the floods are cheap (tens of connections and streams), the
/// handshake timeout short, and a stalled subscriber's backlog small next to what is pushed
/// past it. The same values are given to the suite (`BrokerLimits`), which floods exactly
/// them.
const CONNECTIONS_PER_CORE: u32 = 10;
const CONNECTIONS_PER_PRINCIPAL: u32 = 16;
const STREAMS_PER_CONNECTION: u32 = 12;
const SUBSCRIPTIONS_PER_CONNECTION: u32 = 4;
const HELLO_TIMEOUT_MS: u64 = 2000;
const HELLO_MAX_BYTES: u32 = 2048;
const SUBSCRIBER_QUEUE_MAX_BYTES: u64 = 1 << 20;

/// Broker defects the suite finds today (case names): run and reported, not counted. Remove a
/// name once its defect is fixed (the report then says `FIXED?` and the test fails). None now:
/// `connection_gauge_is_current` (the gauge kept counting a closed connection) was fixed by
/// closing connections through the shell's input path.
const KNOWN_FAILURES: &[&str] = &[];

/// Bound on how far the broker's peak resident memory (VmHWM, which also covers the moments
/// between samples) may rise above its resident memory before the first case.
///
/// Measured (debug build, 2 cores, 2 shared CPUs): about 24 MiB before the first case, a peak
/// of 45-51 MiB, so 18-28 MiB of growth: about 14 MiB while the stalled-subscriber case pushes
/// 64 MiB past a subscriber that never reads (its 1 MiB backlog bound, 64-record replay rings
/// of 16 KiB records, QUIC buffers, allocator caches), about 12 MiB while one connection holds
/// six 1 MiB partial frames (twice the bytes: buffers double as they grow), a few MiB for the
/// few dozen connections of the floods. 64 MiB is over twice the worst growth seen; a
/// subscriber backlog without its bound would exceed it by itself (the 64 MiB pushed would
/// stay held).
const RSS_GROWTH_BOUND: u64 = 64 << 20;

/// The broker's process id: the one `felix` process whose environment names this broker's
/// (unique, temporary) data directory. `BrokerProcess` keeps its child private.
fn broker_pid(broker: &BrokerProcess) -> u32 {
    let wanted = format!("FELIX_DATA_DIR={}", broker.data_dir.path().display());
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc")
        .expect("/proc is readable")
        .flatten()
    {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        // Processes of other users (or gone meanwhile) are not readable: not ours.
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ
            .split(|byte| *byte == 0)
            .any(|variable| variable == wanted.as_bytes())
        {
            found.push(pid);
        }
    }
    assert_eq!(found.len(), 1, "one process with {wanted}: {found:?}");
    found[0]
}

fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.parse().ok()
}

// Proves that every hostile client of the suite gets its documented error or close (or, where
// the documentation is silent, the broker's present behaviour, listed in the report), that a
// healthy client is served after every case, and that the broker's resident memory stays
// within RSS_GROWTH_BOUND of where it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_get_their_documented_answers() {
    let broker = BrokerProcess::start(&[
        ("FELIX_DATAPLANE_CORES", "2"),
        (
            "FELIX_MAX_CONNECTIONS_PER_CORE",
            &CONNECTIONS_PER_CORE.to_string(),
        ),
        (
            "FELIX_MAX_CONNECTIONS_PER_PRINCIPAL",
            &CONNECTIONS_PER_PRINCIPAL.to_string(),
        ),
        (
            "FELIX_MAX_STREAMS_PER_CONNECTION",
            &STREAMS_PER_CONNECTION.to_string(),
        ),
        (
            "FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION",
            &SUBSCRIPTIONS_PER_CONNECTION.to_string(),
        ),
        ("FELIX_HELLO_TIMEOUT_MS", &HELLO_TIMEOUT_MS.to_string()),
        ("FELIX_HELLO_MAX_BYTES", &HELLO_MAX_BYTES.to_string()),
        (
            "FELIX_SUBSCRIBER_QUEUE_MAX_BYTES",
            &SUBSCRIBER_QUEUE_MAX_BYTES.to_string(),
        ),
        // Small frames and lists: the over-limit cases and the partial frame held stay small.
        ("FELIX_MAX_FRAME_BYTES", "1MiB"),
        ("FELIX_MAX_PAYLOAD_BYTES", "256KiB"),
        ("FELIX_MAX_SHARDS_PER_STREAM", "16"),
        // Small rings: what the broker holds is the subscribers' share, not the replay.
        ("FELIX_REPLAY_RING_MAX_RECORDS", "64"),
    ]);
    let pid = broker_pid(&broker);
    let mut target = Target::new(broker.quic_addr, broker.ca_path());
    target.core_addrs = broker.core_addrs.clone();
    target.pid = Some(pid);
    target.metrics_addr = Some(broker.metrics_addr);
    target.limits = BrokerLimits {
        connections_per_core: Some(CONNECTIONS_PER_CORE),
        connections_per_principal: Some(CONNECTIONS_PER_PRINCIPAL),
        streams_per_connection: Some(STREAMS_PER_CONNECTION),
        subscriptions_per_connection: Some(SUBSCRIPTIONS_PER_CONNECTION),
        hello_timeout: Some(Duration::from_millis(HELLO_TIMEOUT_MS)),
        hello_max_bytes: Some(HELLO_MAX_BYTES),
        subscriber_queue_max_bytes: Some(SUBSCRIBER_QUEUE_MAX_BYTES),
    };
    let mut options = Options {
        known_failures: KNOWN_FAILURES
            .iter()
            .map(|name| (*name).to_owned())
            .collect(),
        verbose: true,
        ..Options::default()
    };
    if let Some(seed) = env_number("FELIX_HOSTILE_SEED") {
        options.seed = seed;
    }
    if let Some(repeat) = env_number("FELIX_HOSTILE_REPEAT") {
        options.repeat = repeat;
    }
    if let Ok(case) = std::env::var("FELIX_HOSTILE_CASE") {
        options.only.push(case);
    }
    let before = broker.rss_bytes();
    let report = run_suite(&target, &options).await;
    let after = broker.rss_bytes();
    println!("{report}");
    let peak = report.high_water_mark().unwrap_or(after).max(after);
    let grown = peak.saturating_sub(before);
    println!(
        "broker RSS: {before} bytes before, {after} after, peak (VmHWM) {peak}: {grown} bytes \
         above the start (bound {RSS_GROWTH_BOUND})"
    );
    assert!(
        report.passed(),
        "the hostile-client suite failed:\n{report}\nbroker stderr (tail):\n{}",
        tail(&broker.stderr_text(), 40)
    );
    assert!(
        report.cases.len() >= 30 || !options.only.is_empty(),
        "only {} cases ran",
        report.cases.len()
    );
    assert!(
        grown < RSS_GROWTH_BOUND,
        "the broker's peak resident memory rose {grown} bytes above its start ({before}), over \
         the bound of {RSS_GROWTH_BOUND}:\n{report}"
    );
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
