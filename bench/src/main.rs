//! `felix-bench`: the benchmark tool's command line.
//!
//! - `felix-bench disk --dir DIR [--mib N] [--small-mib M]`: the fsync write baseline.
//! - `felix-bench plan check FILE`: validates a plan, prints the expanded cells and trial order.
//! - `felix-bench report --cells DIR [--out DIR] [--font TTF]`: re-renders `cells.csv`,
//!   `summary.md` and charts from recorded cell JSON lines.
//! - `felix-bench run --plan FILE --out DIR [--felix BIN]`: runs a campaign (records the
//!   session in `run.json`, every run in `cells.jsonl`, then renders the report).
//! - `felix-bench cell [shape flags] [--out DIR]`: runs one cell quickly.
//! - `felix-bench instructions [--valgrind BIN] [--scale F] [--shape LABEL]`: instructions per
//!   published record under callgrind, broker and client apart, with the broker's top functions
//!   (runs `felix-bench instructions-workload` with N and 2N publishes per shape).
//!
//! Arms with `system = "nats"` start `--nats BIN` (default target/nats/.../nats-server) per cell;
//! arms with `system = "iggy"` start `--iggy BIN` (an iggy-server build the user supplies; the
//! Iggy driver needs felix-bench built with the `iggy` feature).
//!
//! Both `run` and `cell` start `felix broker` per cell unless `--broker-addr`,
//! `--metrics-addr` and `--ca` name a broker already running.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use serde::Serialize;

use felix_bench::broker::effective_config;
use felix_bench::cell::Facts;
use felix_bench::disk::{self, DiskBaseline};
use felix_bench::generator::{FelixDriver, LatencyCounts, Target, external_endpoint};
use felix_bench::iggy::DEFAULT_IGGY_SERVER;
use felix_bench::instructions;
use felix_bench::nats::{DEFAULT_NATS_SERVER, SystemDriver};
use felix_bench::pin;
use felix_bench::plan::{BROKER_SPAWN, Plan, System, trial_order};
use felix_bench::progress::Progress;
use felix_bench::report::{self, DEFAULT_FONT_PATH, ReportOptions};
use felix_bench::runner::run_plan;

/// Session metadata file inside a campaign's output directory.
const RUN_FILE: &str = "run.json";

/// Default broker binary, relative to the working directory (the workspace root).
const DEFAULT_FELIX: &str = "target/release/felix";

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
    /// Run a campaign: every cell x trial x arm of a plan, then the report.
    Run {
        /// The plan (TOML).
        #[arg(long)]
        plan: PathBuf,
        /// Output directory (run.json, cells.jsonl, cells.csv, summary.md, charts, work/).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        broker: BrokerArgs,
        #[command(flatten)]
        session: SessionArgs,
    },
    /// Run one cell against a broker this command starts (or the one given).
    Cell {
        #[command(flatten)]
        shape: CellArgs,
        /// Directory for the record (cells.jsonl) and the broker's work files (default: a
        /// temporary directory, record printed only).
        #[arg(long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Replicated publishing side by side: a single broker's durable stream (on_commit, then
    /// periodic), then three brokers' replicated stream through the shard's leader (an
    /// on_commit stream, then a periodic one) and through a follower (the forwarding path), then a stream of three shards led by the three members through one
    /// member (forwarding) and through the cluster client (straight to each leader); prints a
    /// table and writes cluster.json and cluster.md into --out.
    Cluster {
        /// The `felix` binary.
        #[arg(long, default_value = DEFAULT_FELIX)]
        felix: PathBuf,
        /// Output directory (the brokers' data, certificates and logs go under work/; each arm's data
        /// is removed once measured, the logs stay).
        #[arg(long)]
        out: PathBuf,
        /// Measured seconds per arm (after one second of warm-up).
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Publishes in flight.
        #[arg(long, default_value_t = 8)]
        publishers: usize,
        /// Records per publish.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Payload bytes per record.
        #[arg(long, default_value_t = 256)]
        size: usize,
        /// CPUs for the brokers (all of them), e.g. 0.
        #[arg(long, requires = "generator_cpus")]
        server_cpus: Option<String>,
        /// CPUs for this load generator, e.g. 1.
        #[arg(long, requires = "server_cpus")]
        generator_cpus: Option<String>,
    },
    /// Campaign plans.
    Plan {
        #[command(subcommand)]
        command: PlanCommand,
    },
    /// Instructions per published record under callgrind, the broker's threads apart from the
    /// client's, with the broker's top functions: five shapes, each run with N and 2N
    /// publishes; prints one line per shape and writes summary.md into --out.
    Instructions {
        /// valgrind binary.
        #[arg(long, default_value = "valgrind")]
        valgrind: PathBuf,
        /// Multiplies every shape's default N (publishes); 0.1 for a quick look.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Only the shapes whose label contains this (repeatable), e.g. "256 B batch 1".
        #[arg(long)]
        shape: Vec<String>,
        /// Where callgrind's output files and summary.md go.
        #[arg(long, default_value = "target/bench-instructions")]
        out: PathBuf,
    },
    /// The fixed workload `instructions` runs under callgrind (in-process broker and client).
    #[command(hide = true)]
    InstructionsWorkload {
        #[arg(long)]
        payload: u32,
        #[arg(long)]
        batch: u32,
        /// acked | fire-and-forget
        #[arg(long, default_value = "acked")]
        mode: String,
        /// in-memory | durable
        #[arg(long, default_value = "in-memory")]
        kind: String,
        /// One live subscriber receives every record.
        #[arg(long)]
        subscribed: bool,
        #[arg(long)]
        publishes: u64,
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

/// Where the broker under test comes from.
#[derive(Debug, Args)]
struct BrokerArgs {
    /// The `felix` binary started per cell.
    #[arg(long, default_value = DEFAULT_FELIX)]
    felix: PathBuf,
    /// QUIC address of a broker already running (then no broker is started).
    #[arg(long, requires_all = ["metrics_addr", "ca"])]
    broker_addr: Option<SocketAddr>,
    /// Metrics address of that broker.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// CA certificate (PEM) to trust for that broker.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Process id of that broker, for its CPU time (when it exports no CPU metric).
    #[arg(long)]
    broker_pid: Option<u32>,
    /// The `nats-server` binary started per cell for `system = "nats"` arms
    /// (bench/scripts/get-nats.sh fetches it).
    #[arg(long, default_value = DEFAULT_NATS_SERVER)]
    nats: PathBuf,
    /// The `iggy-server` binary started per cell for `system = "iggy"` arms: a build of Apache
    /// Iggy's server (the figures used 0.8.0) that you supply.
    #[arg(long, default_value = DEFAULT_IGGY_SERVER)]
    iggy: PathBuf,
    /// Warm-up publishes of a latency cell.
    #[arg(long, default_value_t = LatencyCounts::default().warmup)]
    latency_warmup: u64,
    /// Measured publishes of a latency cell.
    #[arg(long, default_value_t = LatencyCounts::default().measured)]
    latency_measured: u64,
    /// The pinned method: CPUs for every broker started (a kernel CPU list, e.g. 0), over the
    /// plan's `server_cpus`. Needs --generator-cpus.
    #[arg(long, value_name = "CPU_LIST")]
    server_cpus: Option<String>,
    /// The pinned method: CPUs for this process, the load generator (e.g. 1), over the plan's
    /// `generator_cpus`.
    #[arg(long, value_name = "CPU_LIST")]
    generator_cpus: Option<String>,
}

impl BrokerArgs {
    fn target(&self, work_dir: &Path) -> Result<Target> {
        Ok(match (self.broker_addr, self.metrics_addr, &self.ca) {
            (Some(q), Some(m), Some(ca)) => {
                Target::External(external_endpoint(q, m, ca.clone(), self.broker_pid))
            }
            (None, _, _) => {
                if !self.felix.is_file() {
                    bail!(
                        "broker binary {} not found: build it (cargo build --release -p felix) \
                         or pass --felix, or --broker-addr/--metrics-addr/--ca for a running broker",
                        self.felix.display()
                    );
                }
                std::fs::create_dir_all(work_dir)
                    .with_context(|| format!("create {}", work_dir.display()))?;
                Target::Spawn {
                    felix: self.felix.clone(),
                    work_dir: work_dir.to_path_buf(),
                }
            }
            _ => bail!("--broker-addr needs --metrics-addr and --ca"),
        })
    }

    /// Applies the pinning flags over the plan's settings, then moves this process (the load
    /// generator) onto its CPUs. Call before any driver starts its runtime.
    fn pin(&self, plan: &mut Plan) -> Result<()> {
        plan.settings
            .set_pinning(self.server_cpus.as_deref(), self.generator_cpus.as_deref())?;
        if let (Some(server), Some(generator)) =
            (&plan.settings.server_cpus, &plan.settings.generator_cpus)
        {
            pin::pin_this_process(generator)?;
            eprintln!(
                "pinned: servers on CPUs {}, this load generator on CPUs {}",
                felix_affinity::format_cpu_list(server),
                felix_affinity::format_cpu_list(generator)
            );
        }
        Ok(())
    }

    fn latency(&self) -> Result<LatencyCounts> {
        if self.latency_measured == 0 {
            bail!("--latency-measured must be at least 1");
        }
        Ok(LatencyCounts {
            warmup: self.latency_warmup,
            measured: self.latency_measured,
        })
    }
}

/// Session facts recorded with a campaign.
#[derive(Debug, Args)]
struct SessionArgs {
    /// TTF font for chart text.
    #[arg(long, default_value = DEFAULT_FONT_PATH)]
    font: PathBuf,
    /// MiB the disk baseline writes in 256 KiB writes (on the broker data dir's filesystem).
    #[arg(long, default_value_t = disk::DEFAULT_LARGE_MIB)]
    disk_mib: u64,
    /// MiB the disk baseline writes in 4 KiB writes.
    #[arg(long, default_value_t = disk::DEFAULT_SMALL_MIB)]
    disk_small_mib: u64,
    /// Skip the disk baseline (run.json then says so).
    #[arg(long)]
    no_disk: bool,
}

/// One cell's shape as flags (validated like a plan).
#[derive(Debug, Args)]
struct CellArgs {
    /// in-memory | durable
    #[arg(long, default_value = "in-memory")]
    kind: String,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 256)]
    payload: u32,
    /// Records per publish.
    #[arg(long, default_value_t = 1)]
    batch: u32,
    /// acked | fire-and-forget
    #[arg(long, default_value = "acked")]
    mode: String,
    #[arg(long, default_value_t = 1)]
    publishers: u32,
    /// Publishes in flight per publisher (acked).
    #[arg(long, default_value_t = 1)]
    in_flight: u32,
    /// spread | plain
    #[arg(long, default_value = "spread")]
    keys: String,
    /// Measured seconds.
    #[arg(long, default_value_t = 5)]
    duration: u32,
    /// Seconds of load before the measured duration.
    #[arg(long, default_value_t = 0)]
    warmup: u32,
    /// Shards of the stream.
    #[arg(long, default_value_t = felix_bench::plan::DEFAULT_SHARDS)]
    shards: u32,
    /// Service latency: counted publishes with one subscriber.
    #[arg(long)]
    latency: bool,
    /// Broker environment, NAME=VALUE (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
}

impl CellArgs {
    /// The one-cell, one-arm, one-trial plan these flags describe, validated as a plan.
    fn plan(&self) -> Result<Plan> {
        let q = |s: &str| toml::Value::String(s.to_string()).to_string();
        let mut env = Vec::new();
        for pair in &self.env {
            let Some((k, v)) = pair.split_once('=') else {
                bail!("--env {pair:?}: expected NAME=VALUE");
            };
            env.push(format!("{} = {}", q(k), q(v)));
        }
        let text = format!(
            "[settings]\nduration_s = {}\ntrials = 1\nwarmup_s = {}\nshards = {}\n\
             [[arms]]\nname = \"cli\"\nenv = {{ {} }}\n\
             [[cells]]\nkind = {}\npayload = {}\nbatch = {}\nmode = {}\npublishers = {}\n\
             in_flight = {}\nkeys = {}\nmeasure = {}\n",
            self.duration,
            self.warmup,
            self.shards,
            env.join(", "),
            q(&self.kind),
            self.payload,
            self.batch,
            q(&self.mode),
            self.publishers,
            self.in_flight,
            q(&self.keys),
            q(if self.latency {
                "latency"
            } else {
                "throughput"
            }),
        );
        Ok(Plan::parse(&text)?)
    }
}

/// What `run.json` records about a campaign session.
#[derive(Debug, Serialize)]
struct RunMeta {
    bench_version: &'static str,
    facts: Facts,
    /// `git rev-parse HEAD` of the working directory, `-dirty` when it has changes.
    commit: Option<String>,
    /// `spawn <felix binary>` or `external <addr>`.
    broker: String,
    /// `felix config` output per arm, with the environment the broker gets.
    broker_config: BTreeMap<String, String>,
    disk: Option<DiskBaseline>,
    disk_error: Option<String>,
    latency_warmup: u64,
    latency_measured: u64,
    plan: Plan,
}

fn git_commit() -> Option<String> {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let head = run(&["rev-parse", "HEAD"]).filter(|h| !h.is_empty())?;
    let dirty =
        run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    Some(if dirty { format!("{head}-dirty") } else { head })
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))
}

fn run_campaign(
    plan_path: &Path,
    out: &Path,
    broker: &BrokerArgs,
    session: &SessionArgs,
) -> Result<()> {
    let mut plan =
        Plan::load(plan_path).with_context(|| format!("plan {}", plan_path.display()))?;
    broker.pin(&mut plan)?;
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    if plan.settings.broker != BROKER_SPAWN && broker.broker_addr.is_none() {
        bail!(
            "the plan names broker {}; pass --broker-addr, --metrics-addr and --ca for it, \
             or set broker = \"{BROKER_SPAWN}\" (the default) to start one per cell",
            plan.settings.broker
        );
    }
    let work_dir = out.join("work");
    let target = broker.target(&work_dir)?;
    let commit = git_commit();
    let mut facts = Facts::gather();
    if facts.commit.is_none() {
        facts.commit.clone_from(&commit);
    }
    let (broker_desc, broker_config) = match &target {
        Target::Spawn { felix, work_dir } => {
            let mut configs = BTreeMap::new();
            for arm in &plan.arms {
                if let Some(n) = &arm.nats {
                    configs.insert(
                        arm.name.clone(),
                        format!("nats-server {} ({})", broker.nats.display(), n.describe()),
                    );
                    continue;
                }
                if let Some(i) = &arm.iggy {
                    configs.insert(
                        arm.name.clone(),
                        format!("iggy-server {} ({})", broker.iggy.display(), i.describe()),
                    );
                    continue;
                }
                let text = effective_config(
                    felix,
                    &arm.env,
                    &work_dir.join("data"),
                    plan.settings.server_cpus.as_deref(),
                )
                .unwrap_or_else(|e| format!("(felix config failed: {e})"));
                configs.insert(arm.name.clone(), text);
            }
            (format!("spawn {}", felix.display()), configs)
        }
        Target::External(e) => (format!("external {}", e.quic_addr), BTreeMap::new()),
    };
    let (disk, disk_error) = if session.no_disk {
        (None, Some("skipped (--no-disk)".to_string()))
    } else {
        let dir = match &target {
            Target::Spawn { work_dir, .. } => work_dir.clone(),
            Target::External(_) => out.to_path_buf(),
        };
        eprintln!("disk baseline in {} ...", dir.display());
        match disk::baseline(&dir, session.disk_mib, session.disk_small_mib) {
            Ok(b) => {
                eprintln!("{}", b.line());
                (Some(b), None)
            }
            Err(e) => (None, Some(e.to_string())),
        }
    };
    let latency = broker.latency()?;
    let meta = RunMeta {
        bench_version: env!("CARGO_PKG_VERSION"),
        facts: facts.clone(),
        commit,
        broker: broker_desc,
        broker_config,
        disk,
        disk_error,
        latency_warmup: latency.warmup,
        latency_measured: latency.measured,
        plan: plan.clone(),
    };
    write_json(&out.join(RUN_FILE), &meta)?;
    if plan.arms.iter().any(|a| a.system == System::Nats) && !broker.nats.is_file() {
        bail!(
            "the plan has NATS arms but {} is not there: run bench/scripts/get-nats.sh or pass --nats",
            broker.nats.display()
        );
    }
    if plan.arms.iter().any(|a| a.system == System::Iggy) {
        if !cfg!(feature = "iggy") {
            bail!(
                "the plan has Iggy arms but felix-bench was built without the `iggy` feature: \
                 make bench-iggy, or cargo build --release -p felix-bench --features iggy"
            );
        }
        if !broker.iggy.is_file() {
            bail!(
                "the plan has Iggy arms but {} is not there: pass --iggy with an iggy-server \
                 {} build from the Apache Iggy project",
                broker.iggy.display(),
                felix_bench::iggy::IGGY_SERVER_VERSION
            );
        }
    }
    let felix = FelixDriver::new(target, latency)?;
    let mut driver = SystemDriver::new(felix, broker.nats.clone(), work_dir.clone(), latency);
    driver.iggy_bin.clone_from(&broker.iggy);
    let runs = plan.schedule().len() as u64;
    let progress = Progress::new(runs);
    let summary = run_plan(&plan, &mut driver, out, &progress, &facts)?;
    println!(
        "{} runs, {} failed -> {}",
        summary.runs,
        summary.failed,
        summary.records_path.display()
    );
    render(out, &session.font)
}

fn render(dir: &Path, font: &Path) -> Result<()> {
    let records = report::read_records(dir)?;
    if records.is_empty() {
        bail!("no cell records (*.jsonl) in {}", dir.display());
    }
    let files = report::write_report(
        &records,
        dir,
        &ReportOptions {
            font_path: font.to_path_buf(),
        },
    )?;
    println!(
        "report: {} {} ({} charts)",
        files.csv.display(),
        files.summary.display(),
        files.charts.len()
    );
    Ok(())
}

fn run_one_cell(shape: &CellArgs, out: Option<&Path>, broker: &BrokerArgs) -> Result<()> {
    let mut plan = shape.plan()?;
    broker.pin(&mut plan)?;
    let temp;
    let dir = match out {
        Some(d) => d.to_path_buf(),
        None => {
            temp = tempfile::tempdir().context("temporary directory")?;
            temp.path().to_path_buf()
        }
    };
    let target = broker.target(&dir.join("work"))?;
    let mut facts = Facts::gather();
    if facts.commit.is_none() {
        facts.commit = git_commit();
    }
    let mut driver = FelixDriver::new(target, broker.latency()?)?;
    let progress = Progress::hidden(1);
    let summary = run_plan(&plan, &mut driver, &dir, &progress, &facts)?;
    let records = report::read_records(&dir)?;
    if let Some(last) = records.last() {
        println!("{}", last.to_json_line()?);
    }
    if out.is_some() {
        println!("record appended to {}", summary.records_path.display());
    }
    if summary.failed > 0 {
        bail!("the cell failed");
    }
    Ok(())
}

/// `felix-bench instructions`: every selected shape under callgrind, one line each, and
/// `summary.md` (lines plus the broker's top functions) in `out`.
fn run_instructions(valgrind: &Path, scale: f64, only: &[String], out: &Path) -> Result<()> {
    if !(scale > 0.0 && scale.is_finite()) {
        bail!("--scale must be a positive number, got {scale}");
    }
    let me = std::env::current_exe().context("path of this felix-bench binary")?;
    let shapes: Vec<_> = instructions::DEFAULT_SHAPES
        .iter()
        .filter(|(shape, _)| only.is_empty() || only.iter().any(|o| shape.label().contains(o)))
        .collect();
    if shapes.is_empty() {
        bail!("no shape matches --shape {only:?}");
    }
    let mut summary = format!(
        "# Instructions per record (callgrind)\n\nCommit: {}. `felix-bench instructions \
         --scale {scale}`; broker = every thread but the client's (thread 1).\n\n",
        git_commit().unwrap_or_else(|| "unknown".to_string())
    );
    let mut lines = Vec::new();
    let mut tables = Vec::new();
    for (shape, default_n) in shapes {
        let publishes = ((*default_n as f64) * scale).round().max(1.0) as u64;
        eprintln!(
            "callgrind: {} with {publishes} and {} publishes ...",
            shape.label(),
            publishes * 2
        );
        let m = instructions::measure(valgrind, &me, out, *shape, publishes)?;
        println!("{}", m.line());
        lines.push(format!("- {}", m.line()));
        tables.push(m.top_markdown());
    }
    summary.push_str(&lines.join("\n"));
    summary.push_str("\n\n");
    summary.push_str(&tables.join("\n"));
    let path = out.join("summary.md");
    std::fs::write(&path, summary).with_context(|| format!("write {}", path.display()))?;
    println!("top functions per shape: {}", path.display());
    Ok(())
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
        Command::Run {
            plan,
            out,
            broker,
            session,
        } => run_campaign(&plan, &out, &broker, &session)?,
        Command::Cell { shape, out, broker } => run_one_cell(&shape, out.as_deref(), &broker)?,
        Command::Cluster {
            felix,
            out,
            seconds,
            publishers,
            batch,
            size,
            server_cpus,
            generator_cpus,
        } => {
            let server_cpus = server_cpus
                .map(|text| pin::parse_cpus("--server-cpus", &text))
                .transpose()?;
            if let Some(text) = generator_cpus {
                let generator = pin::parse_cpus("--generator-cpus", &text)?;
                pin::pin_this_process(&generator)?;
            }
            let bench = felix_bench::cluster::ClusterBench {
                felix,
                work: out.join("work"),
                seconds,
                publishers,
                batch,
                size,
                server_cpus,
            };
            let results = felix_bench::cluster::run(&bench)?;
            let table = format!(
                "{}\n{}",
                felix_bench::cluster::table(&results),
                felix_bench::cluster::comparisons(&results)
            );
            print!("{table}");
            std::fs::write(out.join("cluster.md"), &table)?;
            std::fs::write(
                out.join("cluster.json"),
                serde_json::to_string_pretty(&results)?,
            )?;
        }
        Command::Plan {
            command: PlanCommand::Check { file },
        } => {
            let plan = Plan::load(&file).with_context(|| format!("plan {}", file.display()))?;
            print_plan(&plan);
        }
        Command::Instructions {
            valgrind,
            scale,
            shape,
            out,
        } => run_instructions(&valgrind, scale, &shape, &out)?,
        Command::InstructionsWorkload {
            payload,
            batch,
            mode,
            kind,
            subscribed,
            publishes,
        } => {
            let shape = instructions::Shape {
                payload_bytes: payload,
                batch,
                acked: match mode.as_str() {
                    "acked" => true,
                    "fire-and-forget" => false,
                    other => bail!("--mode {other:?}: expected acked or fire-and-forget"),
                },
                durable: match kind.as_str() {
                    "in-memory" => false,
                    "durable" => true,
                    other => bail!("--kind {other:?}: expected in-memory or durable"),
                },
                subscribed,
            };
            let records = instructions::run_workload(shape, publishes)?;
            eprintln!("{}: {records} records published", shape.label());
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
        "broker {}  duration {} s  warm-up {} s  trials {}  shards {}",
        s.broker, s.duration_s, s.warmup_s, s.trials, s.shards
    );
    if let (Some(server), Some(generator)) = (&s.server_cpus, &s.generator_cpus) {
        println!(
            "pinned: server on CPUs {}, generator on CPUs {}",
            felix_affinity::format_cpu_list(server),
            felix_affinity::format_cpu_list(generator)
        );
    }
    println!("arms:");
    for (i, arm) in plan.arms.iter().enumerate() {
        let mut line = format!("  {} {}", letter(i), arm.name);
        if let Some(n) = &arm.nats {
            line.push_str(&format!(" [nats {}]", n.describe()));
        }
        if let Some(i) = &arm.iggy {
            line.push_str(&format!(" [iggy {}]", i.describe()));
        }
        for (k, v) in &arm.env {
            line.push_str(&format!(" {k}={v}"));
        }
        println!("{line}");
    }
    println!("cells ({}):", plan.cells.len());
    for (i, cell) in plan.cells.iter().enumerate() {
        let arms: Vec<String> = plan
            .cell_arms
            .get(i)
            .map(|a| a.iter().map(|&a| letter(a).to_string()).collect())
            .unwrap_or_default();
        println!("  {} arms {}", cell.label(), arms.join(""));
    }
    // Each cell rotates its own arms; cell 1's order shows the pattern.
    let first: Vec<usize> = plan
        .cell_arms
        .first()
        .cloned()
        .unwrap_or_else(|| (0..plan.arms.len()).collect());
    println!("trial order (cell 1; every cell rotates its own arms the same way):");
    for trial in 1..=s.trials {
        let order: Vec<String> = trial_order(first.len(), trial)
            .into_iter()
            .map(|i| format!("{}={}", letter(first[i]), plan.arms[first[i]].name))
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
    // ARMS_MAX (16) < 26, so the index stays within A..Z.
    char::from(b'A' + (i % 26) as u8)
}
