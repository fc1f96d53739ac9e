//! `felix-soak`: a mixed workload against one real broker for a fixed time, then the soak's
//! checks (felix_campaign::soak). Prints a summary; exits non-zero when a check failed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use felix_campaign::soak::{self, SoakConfig};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Soak of a Felix broker: mixed load, then memory, durability, order and error checks"
)]
struct Args {
    /// The felix binary to test (a release build).
    #[arg(long)]
    felix: PathBuf,
    /// How long the workload runs.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// RNG seed (default: from the clock; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Resident-memory bound of the broker in MiB (default: the soak's documented bound).
    #[arg(long)]
    rss_bound_mib: Option<u64>,
    /// Parent directory of the run's temporary directory (default: the system's).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// No progress lines.
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
    let mut config = SoakConfig::new(args.felix, Duration::from_secs(args.seconds), seed);
    if let Some(mib) = args.rss_bound_mib {
        config.rss_bound = mib << 20;
    }
    config.work_parent = args.work_dir;
    config.progress = !args.quiet;
    eprintln!("felix-soak: {} s, seed {seed}", args.seconds);
    let report = soak::run(&config)?;
    print!("{}", report.summary());
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
