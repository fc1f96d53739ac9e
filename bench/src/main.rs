//! `felix-bench`: the benchmark tool's command line.
//!
//! - `felix-bench disk --dir DIR [--mib N] [--small-mib M]`: the fsync write baseline.
//! - `felix-bench plan check FILE`: validates a plan, prints the expanded cells and trial order.
//! - `felix-bench report --cells DIR [--out DIR] [--font TTF]`: re-renders `cells.csv`,
//!   `summary.md` and charts from recorded cell JSON lines.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

use felix_bench::disk;
use felix_bench::plan::{Plan, trial_order};
use felix_bench::report::{self, DEFAULT_FONT_PATH, ReportOptions};

#[derive(Debug, Parser)]
#[command(name = "felix-bench", version, about = "Felix benchmark tool")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// fsync write baseline: 256 KiB writes + fdatasync each (like fio, one job), then 4 KiB.
    Disk {
        /// Directory on the disk to measure (a file is written there and removed).
        #[arg(long)]
        dir: PathBuf,
        /// MiB to write in 256 KiB writes.
        #[arg(long, default_value_t = disk::DEFAULT_LARGE_MIB)]
        mib: u64,
        /// MiB to write in 4 KiB writes.
        #[arg(long, default_value_t = disk::DEFAULT_SMALL_MIB)]
        small_mib: u64,
    },
    /// Campaign plans.
    Plan {
        #[command(subcommand)]
        command: PlanCommand,
    },
    /// Re-render cells.csv, summary.md and charts from recorded cell JSON lines.
    Report {
        /// Directory holding *.jsonl cell records.
        #[arg(long)]
        cells: PathBuf,
        /// Where to write the report (default: the cells directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// TTF font for chart text.
        #[arg(long, default_value = DEFAULT_FONT_PATH)]
        font: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum PlanCommand {
    /// Validate a plan and print its expanded cell list and trial order.
    Check {
        /// The plan (TOML).
        file: PathBuf,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Disk {
            dir,
            mib,
            small_mib,
        } => {
            let b = disk::baseline(&dir, mib, small_mib)?;
            println!("{}", b.line());
            println!("{}", serde_json::to_string(&b)?);
        }
        Command::Plan {
            command: PlanCommand::Check { file },
        } => {
            let plan = Plan::load(&file).with_context(|| format!("plan {}", file.display()))?;
            print_plan(&plan);
        }
        Command::Report { cells, out, font } => {
            let records = report::read_records(&cells)?;
            if records.is_empty() {
                bail!("no cell records (*.jsonl) in {}", cells.display());
            }
            let out = out.unwrap_or(cells);
            let files = report::write_report(&records, &out, &ReportOptions { font_path: font })?;
            println!(
                "{} records -> {} {} {}",
                records.len(),
                files.csv.display(),
                files.summary.display(),
                files
                    .charts
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
    }
    Ok(())
}

fn print_plan(plan: &Plan) {
    let s = &plan.settings;
    println!(
        "broker {}  duration {} s  warm-up {} s  trials {}",
        s.broker, s.duration_s, s.warmup_s, s.trials
    );
    println!("arms:");
    for (i, arm) in plan.arms.iter().enumerate() {
        let mut line = format!("  {} {}", letter(i), arm.name);
        for (k, v) in &arm.env {
            line.push_str(&format!(" {k}={v}"));
        }
        println!("{line}");
    }
    println!("cells ({}):", plan.cells.len());
    for cell in &plan.cells {
        println!("  {}", cell.label());
    }
    println!("trial order (per cell):");
    for trial in 1..=s.trials {
        let order: Vec<String> = trial_order(plan.arms.len(), trial)
            .into_iter()
            .map(|a| format!("{}={}", letter(a), plan.arms[a].name))
            .collect();
        println!("  trial {trial}: {}", order.join(" "));
    }
    let secs = plan.load_seconds();
    println!(
        "{} runs, {} s of load ({:.1} h) before set-up time",
        plan.schedule().len(),
        secs,
        secs as f64 / 3600.0
    );
}

/// Arm index as a letter (A, B, ...), as the reference writes interleavings.
fn letter(i: usize) -> char {
    // MAX_ARMS (16) < 26, so the index stays within A..Z.
    char::from(b'A' + (i % 26) as u8)
}
