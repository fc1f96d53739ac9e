//! `felix log check|repair|compact`: offline maintenance of the durable logs of one data
//! directory (`<data_dir>/log/core-<i>/`, FELIX_DATA_DIR or `--data-dir`), with the broker
//! stopped. Every command first takes the lock of every core's log directory, the lock a
//! running broker holds for as long as it runs (felix-storage `lock.rs`, taken by
//! `Log::open`): so a command refuses to run next to a broker, and a broker refuses to start
//! while a command runs. The rules are in `docs/storage-format.md` (Corruption and repair;
//! Deleting streams).
//!
//! - `check` reads every segment in full and prints each one's state (damage, torn tail,
//!   sidecar index), and what `repair` would quarantine; it changes nothing and fails when a
//!   repair is needed.
//! - `repair` quarantines damaged ranges (the broker then starts again without reusing an
//!   offset; reads skip the quarantined offsets) and prints what it quarantined.
//! - `compact` drops the records of deleted streams (those `catalog.json` no longer lists),
//!   keeping every live record at its offset, and prints the space freed.
//!
//! Threads: the main thread.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use felix_core::Catalog;
use felix_core::durable::{catalogued_shards, describe_log_shard, log_dirs};
use felix_storage::offline::{self, CheckReport, SegmentStatus, SidecarStatus};
use felix_storage::{DirLock, QuarantineRange, StorageError};

/// The `felix log` subcommands.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum LogCommand {
    /// Verify every segment of every core's log (reads all of it) and print each one's state
    /// and what `repair` would quarantine. Changes nothing; fails when a repair is needed.
    Check {
        /// Print every segment, not only those with something to report.
        #[arg(long)]
        all: bool,
    },
    /// Quarantine the damaged ranges the broker's recovery refused, so the broker can start
    /// again: readable records stay at their offsets, lost offsets are never handed out again
    /// and readers skip them. Prints what it quarantined.
    Repair,
    /// Drop the records of deleted durable streams (not in catalog.json) from the logs,
    /// keeping every live record at its offset. Prints the space freed.
    Compact,
}

/// Runs a `felix log` command on `config.data_dir`.
pub(crate) fn run(config: &felix_tuning::Config, command: LogCommand) -> anyhow::Result<()> {
    let data_dir = &config.data_dir;
    let dirs = log_dirs(data_dir)
        .with_context(|| format!("cannot list {}", data_dir.join("log").display()))?;
    if dirs.is_empty() {
        println!("no durable logs under {}", data_dir.join("log").display());
        return Ok(());
    }
    let locks = lock_all(data_dir, &dirs)?;
    match command {
        LogCommand::Check { all } => check(&locks, all),
        LogCommand::Repair => repair(locks),
        LogCommand::Compact => compact(data_dir, locks),
    }
}

/// Takes the lock of every core's log directory, all or nothing.
fn lock_all(data_dir: &Path, dirs: &[(usize, PathBuf)]) -> anyhow::Result<Vec<(usize, DirLock)>> {
    let mut locks = Vec::with_capacity(dirs.len());
    for (core, dir) in dirs {
        match DirLock::acquire(dir) {
            Ok(lock) => locks.push((*core, lock)),
            Err(error @ StorageError::Locked { .. }) => {
                return Err(anyhow::Error::from(error)).with_context(|| {
                    format!(
                        "the durable logs of {} are in use: stop the broker (or the other `felix log` command) first",
                        data_dir.display()
                    )
                });
            }
            Err(error) => {
                return Err(anyhow::Error::from(error))
                    .with_context(|| format!("cannot lock {}", dir.display()));
            }
        }
    }
    Ok(locks)
}

fn check(locks: &[(usize, DirLock)], all: bool) -> anyhow::Result<()> {
    let mut damaged_cores = Vec::new();
    for (core, lock) in locks {
        let report = offline::check(lock)
            .with_context(|| format!("cannot check {}", lock.dir().display()))?;
        print_check(*core, &report, all);
        if !report.is_clean() {
            damaged_cores.push(*core);
        }
    }
    anyhow::ensure!(
        damaged_cores.is_empty(),
        "damage found in the logs of core(s) {damaged_cores:?}: stop the broker and run `felix log repair`"
    );
    println!("all logs are clean");
    Ok(())
}

fn print_check(core: usize, report: &CheckReport, all: bool) {
    let damaged = report.segments.iter().filter(|s| s.needs_repair()).count();
    let records: u64 = report.segments.iter().map(|s| s.records).sum();
    println!(
        "core {core}: {}: {} segments, {records} records, {damaged} to repair, {} offsets quarantined before, {} released shards",
        report.dir.display(),
        report.segments.len(),
        report.quarantined_before,
        report.released_shards
    );
    for segment in &report.segments {
        let noteworthy = segment.needs_repair()
            || segment.torn_tail.is_some()
            || segment.released_records > 0
            || !matches!(
                segment.sidecar,
                SidecarStatus::Matches | SidecarStatus::Active
            );
        if all || noteworthy {
            println!("  {}", segment_line(segment));
        }
    }
    for range in &report.lost {
        println!("  would quarantine: {}", range_line(range));
    }
}

fn segment_line(s: &SegmentStatus) -> String {
    let name = s
        .file
        .file_name()
        .map_or_else(|| s.seq.to_string(), |n| n.to_string_lossy().into_owned());
    if s.missing {
        return format!("{name}: MISSING (repair writes an empty placeholder)");
    }
    let sidecar = match &s.sidecar {
        SidecarStatus::Active => "active".to_owned(),
        SidecarStatus::Missing => "sidecar missing (recovery scans it)".to_owned(),
        SidecarStatus::Matches => "sidecar ok".to_owned(),
        SidecarStatus::Stale(why) => format!("sidecar stale: {why}"),
        SidecarStatus::Bad(why) => format!("sidecar bad: {why}"),
    };
    let mut line = format!(
        "{name}: {} bytes, {} records, data end {}, {sidecar}",
        s.file_bytes, s.records, s.data_end
    );
    if let Some(why) = &s.header_error {
        line.push_str(&format!("; HEADER DAMAGED: {why}"));
    }
    for d in &s.damage {
        line.push_str(&format!(
            "; DAMAGE at byte {}..{}: {}",
            d.position, d.end, d.reason
        ));
        for r in &d.attributed {
            line.push_str(&format!(
                " ({} offsets {}..{})",
                describe_log_shard(r.shard),
                r.first,
                r.end
            ));
        }
    }
    if s.stale_records > 0 {
        line.push_str(&format!("; {} stale records", s.stale_records));
    }
    if let Some(at) = s.torn_tail {
        line.push_str(&format!(
            "; torn tail from byte {at} (recovery cuts it; never acknowledged)"
        ));
    }
    if s.released_records > 0 {
        line.push_str(&format!(
            "; {} records of deleted streams (compact drops them)",
            s.released_records
        ));
    }
    line
}

fn range_line(r: &QuarantineRange) -> String {
    format!(
        "{} offsets {}..{} ({} record(s); damage in segment {} at byte {})",
        describe_log_shard(r.shard),
        r.first,
        r.end,
        r.end - r.first,
        r.segment,
        r.position
    )
}

fn repair(locks: Vec<(usize, DirLock)>) -> anyhow::Result<()> {
    let mut held = Vec::with_capacity(locks.len());
    for (core, lock) in locks {
        let dir = lock.dir().to_owned();
        let (report, lock) =
            offline::repair(lock).with_context(|| format!("cannot repair {}", dir.display()))?;
        held.push(lock);
        if report.check.is_clean() {
            println!("core {core}: {}: clean, nothing to repair", dir.display());
            continue;
        }
        println!("core {core}: {}: repaired", dir.display());
        for range in &report.quarantined {
            println!("  quarantined {}", range_line(range));
        }
        for seq in &report.rewritten {
            println!("  rewrote segment {seq} without its damaged bytes");
        }
        for seq in &report.placeholders {
            println!("  wrote an empty placeholder for missing segment {seq}");
        }
        if let Some(recovery) = &report.recovery {
            println!(
                "  verified: {} records in {} segments open cleanly; {} offsets quarantined in all",
                recovery.records, recovery.segments, recovery.quarantined_records
            );
        }
    }
    println!(
        "readers skip quarantined offsets (counted in the broker's felix_quarantine_skipped_records_total); new records get offsets past them"
    );
    Ok(())
}

fn compact(data_dir: &Path, locks: Vec<(usize, DirLock)>) -> anyhow::Result<()> {
    let catalog = Catalog::load(data_dir).with_context(|| {
        format!(
            "cannot read the durable catalogue of {}: compaction needs it to know the deleted streams",
            data_dir.display()
        )
    })?;
    let live = catalogued_shards(&catalog);
    let mut freed = 0u64;
    let mut held = Vec::with_capacity(locks.len());
    for (core, lock) in locks {
        let dir = lock.dir().to_owned();
        let (report, lock) = offline::compact(lock, &live)
            .with_context(|| format!("cannot compact {}", dir.display()))?;
        held.push(lock);
        let saved = report.bytes_before.saturating_sub(report.bytes_after);
        freed += saved;
        println!(
            "core {core}: {}: {} shards released, {} records dropped, {} segments rewritten, {} emptied, {} -> {} bytes",
            dir.display(),
            report.released.len(),
            report.records_dropped,
            report.rewritten.len(),
            report.emptied.len(),
            report.bytes_before,
            report.bytes_after
        );
        for shard in &report.released {
            println!("  released {}", describe_log_shard(*shard));
        }
    }
    println!("freed {freed} bytes");
    Ok(())
}
