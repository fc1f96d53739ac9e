//! The crash campaign (felix_campaign::crash) in short: a few SIGKILL/restart cycles of the
//! real broker under acked on_commit load, audited after every restart. The long runs are
//! `make crash-campaign CYCLES=N` (docs/reliability.md).

use std::time::Duration;

use felix_campaign::crash::{self, CrashConfig};

/// Cycles of the short run (each ~1-3 s here).
const CYCLES: u64 = 3;
/// Fixed seed, so a failure names a plan that can be replayed with the campaign binary.
const SEED: u64 = 20_261_203;
/// Bound of the whole run: far above its usual ~10 s on a loaded 2-CPU machine.
const TIME_LIMIT: Duration = Duration::from_secs(300);

#[test]
fn short_crash_campaign_loses_nothing_acked() {
    // Proves 3 SIGKILL/restart cycles lose, duplicate, reorder or damage no acked or delivered record.
    let mut config = CrashConfig::new(env!("CARGO_BIN_EXE_felix").into(), CYCLES, SEED);
    config.time_limit = TIME_LIMIT;
    let report = crash::run(&config).expect("the campaign runs");
    eprintln!("{}{}", report.details(), report.summary_line());
    assert!(
        report.passed(),
        "{}\n{}",
        report.summary_line(),
        report.details()
    );
    assert_eq!(report.cycles, CYCLES, "every cycle ran");
    assert!(report.acked_records > 0, "publishers got acks");
}
