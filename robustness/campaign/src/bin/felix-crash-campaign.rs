//! `felix-crash-campaign`: the SIGKILL crash campaign against the real broker
//! (felix_campaign::crash). Prints one summary line and exits non-zero if anything acked or
//! delivered was lost, duplicated, reordered or corrupted, or if the run could not finish.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use felix_campaign::crash::{self, CrashConfig};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "SIGKILL crash campaign of Felix durable streams (on_commit)"
)]
struct Args {
    /// The felix binary to test (a release build).
    #[arg(long)]
    felix: PathBuf,
    /// Kill/restart cycles.
    #[arg(long, default_value_t = 50)]
    cycles: u64,
    /// RNG seed (default: from the clock; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Bound of the whole run in seconds (default: 60 + 30 per cycle).
    #[arg(long)]
    time_limit: Option<u64>,
    /// Parent directory of the run's temporary directory (default: the system's).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// FELIX_DURABLE_FSYNC_MODE of the broker: on_commit, or periodic (a process crash loses
    /// nothing acked there either).
    #[arg(long, default_value = "on_commit", value_parser = ["on_commit", "periodic"])]
    fsync_mode: String,
    /// Print only the summary (no line per cycle).
    #[arg(long)]
    quiet: bool,
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let mut config = CrashConfig::new(args.felix, args.cycles, seed);
    if let Some(secs) = args.time_limit {
        config.time_limit = Duration::from_secs(secs);
    }
    config.work_parent = args.work_dir;
    config.progress = !args.quiet;
    config.fsync_mode = args.fsync_mode;
    eprintln!(
        "felix-crash-campaign: {} cycles, fsync {}, seed {seed} (replay the plan with --seed {seed}), time limit {} s",
        config.cycles,
        config.fsync_mode,
        config.time_limit.as_secs()
    );
    let report = crash::run(&config)?;
    eprint!("{}", report.details());
    println!("{}", report.summary_line());
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
