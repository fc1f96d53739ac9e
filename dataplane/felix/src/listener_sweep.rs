//! `felix tune listeners`: sweeps FELIX_QUIC_LISTENERS against brokers started on loopback and
//! recommends a count.
//!
//! What the setting means: FELIX_QUIC_LISTENERS is the total number of QUIC endpoints on the
//! broker's shared port (FELIX_BIND's port), one UDP socket each, all in one SO_REUSEPORT
//! group. The core plan (felix-affinity) deals them round-robin over the data-plane cores
//! (listener j goes to core `j % cores`; `auto` = one per core; at most 8 per core), and each
//! core's single pinned thread drives its endpoints next to its own-port endpoint. The kernel
//! picks the socket of the group for each incoming datagram by hashing its address 4-tuple, so
//! every client connection that arrives on the shared port is served by the core owning the
//! listener it hashed to, which forwards the records of shards it does not own to their owner
//! core through the mesh. With fewer listeners than cores, some cores accept no connection on
//! the shared port; with more, a core polls several endpoints. Core-aware clients send records
//! straight to each owner core's own port and use the shared port only for their first
//! (admin) connection, so the count matters for clients that are not core-aware (`felix
//! --no-core-aware`, clients of other languages); that is the load this sweep applies.
//!
//! Method, per count (1..=data-plane cores of `felix_broker::core_plan`, or `--max` /
//! `--counts`):
//! 1. Start this executable as `felix broker` with a fresh temporary data directory, every
//!    inherited FELIX_* variable removed, the settings this command's configuration gives
//!    (those not at their default: FELIX_DATAPLANE_CORES, ingress, window and buffer
//!    settings...), then the sweep's own: FELIX_BIND=127.0.0.1:0, FELIX_METRICS_BIND=off,
//!    `FELIX_QUIC_LISTENERS=<count>`, and no FELIX_TLS_CERT/KEY (the load trusts the development certificate the broker generates).
//!    The broker is ready when it prints `felix: quic listening on <addr>`; the
//!    `felix: core <i> shared listeners <k>` lines must add up to the count.
//! 2. Create an in-memory stream with one shard per data-plane core and open the load's
//!    connections (default two per data-plane core), each a separate client endpoint (its own
//!    UDP port, so the kernel hashes each to a listener independently), not core-aware: all
//!    traffic enters through the shared port.
//! 3. Each connection keeps [`IN_FLIGHT_PER_CONNECTION`] acked batches of [`BATCH_RECORDS`]
//!    records of [`PAYLOAD_BYTES`] bytes in flight; each batch goes to one shard, the batches
//!    of a connection rotate over the shards. After [`WARMUP`], the acked records are counted
//!    for `--seconds`, and the broker's CPU time (utime + stime of its process in
//!    `/proc/<pid>/stat`, all threads) is read at both ends of that window. CPU cores used =
//!    CPU seconds / wall seconds.
//! 4. Stop issuing batches, wait for the ones in flight (bounded), SIGTERM the broker and reap
//!    it (SIGKILL after [`STOP_DEADLINE`]). A guard kills and reaps it on every error path,
//!    and the broker is started with PR_SET_PDEATHSIG, so it gets SIGTERM should this process
//!    die without unwinding.
//!
//! The recommendation is the count with the highest throughput, except that a smaller count
//! whose throughput is within [`NEAR_BEST_FRACTION`] of it wins (fewer endpoints to poll, and a
//! difference that small is within the noise of a short run). The load generator runs on the
//! same host as the broker and competes with it for CPU, so figures are indicative, and noisy
//! on a shared machine; the output says so.
//!
//! Every wait is bounded (start-up, connecting, the load, draining, stopping); a count whose
//! broker or load fails shows the error in its row, the other counts still run, and the
//! command then fails naming the counts that failed.
//!
//! Threads: the calling thread runs the sweep; a multi-thread tokio runtime runs the load's
//! clients; one thread per started broker drains its stdout until it exits.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use clap::Args;
use felix_client::{Client, ClientConfig, Record, StreamKind};
use felix_tuning::{Config, Source};

/// Records per publish batch: the reference fast path's batch size (see tuning's
/// FELIX_MAX_BATCH_RECORDS bounds), large enough that per-request costs do not dominate.
const BATCH_RECORDS: usize = 64;
/// Payload bytes per record: a typical small event; with 64 records a batch is ~17 KB, a few
/// QUIC datagrams at the default MTU.
const PAYLOAD_BYTES: usize = 256;
/// Acked batches each connection keeps outstanding: enough to hide the loopback round trip
/// and keep the broker's cores busy, few enough (8 x ~17 KB) to stay far inside the default
/// 4 MiB publish budget and the broker's ingress queue (512 jobs per core).
const IN_FLIGHT_PER_CONNECTION: usize = 8;
/// Load connections per data-plane core by default: more than one per core so the kernel's
/// hashing of connections onto listeners has something to spread, few enough that the load
/// generator does not take the CPUs away from the broker on a small machine.
const CONNECTIONS_PER_CORE: usize = 2;
/// Load before the measured window: QUIC congestion windows on loopback open within tens of
/// milliseconds, and the first batches also pay for lazily opened publish streams.
const WARMUP: Duration = Duration::from_millis(500);
/// Time a started broker has to print its listening line. A cold start generates a TLS pair
/// (tens of milliseconds) and binds a few sockets; 30 s leaves room for a loaded machine.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Time to create the stream and open every load connection (the client's own handshake
/// timeout is 10 s per connection; they connect concurrently).
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Time the batches in flight at the end of the window have to be acked and the connections
/// to close; bounds a broker that stopped answering.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(15);
/// Time a broker has to exit after SIGTERM before it is killed. It closes its connections
/// (a grace of 2 s) and has no durable data to sync; 10 s bounds a hung broker.
const STOP_DEADLINE: Duration = Duration::from_secs(10);
/// How often a stopping broker's exit is polled: adds at most that to each count's time.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(20);
/// A smaller count within this fraction of the best throughput is recommended instead: 5% is
/// about the run-to-run spread of a few-second loopback load.
const NEAR_BEST_FRACTION: f64 = 0.05;
/// Below this fraction of its data-plane cores busy at every count, the broker was not the
/// bottleneck (a saturated core runs near 1.0); the output then says the load was the limit.
const LOAD_BOUND_FRACTION: f64 = 0.5;
/// Clock ticks per second of `/proc/<pid>/stat`'s utime and stime: Linux's USER_HZ, 100 on
/// every architecture Felix runs on (fixed by the ABI, independent of the kernel's CONFIG_HZ).
const USER_HZ: f64 = 100.0;
/// Last bytes of a broker's log quoted when it fails.
const LOG_TAIL_BYTES: usize = 2000;
/// The stream the load publishes to (each broker is fresh, so it never exists before).
const STREAM: &str = "felix-tune-listeners";
/// Prefix of the broker's shared-port line on stdout (printed last at start-up).
const QUIC_LINE_PREFIX: &str = "felix: quic listening on ";
/// Variables the sweep sets (or removes) itself; the configuration's values are not passed.
const SWEEP_OWNED: &[&str] = &[
    "FELIX_DATA_DIR",
    "FELIX_BIND",
    "FELIX_METRICS_BIND",
    "FELIX_QUIC_LISTENERS",
    "FELIX_TLS_CERT",
    "FELIX_TLS_KEY",
];

/// Options of `felix tune listeners`.
#[derive(Debug, Args)]
pub(crate) struct ListenersArgs {
    /// Seconds of measured load per listener count (after a half-second warm-up).
    #[arg(long, default_value_t = 3, value_name = "S",
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    seconds: u32,
    /// Sweep 1..=N listeners instead of 1..=the data-plane core count.
    #[arg(long, value_name = "N", conflicts_with = "counts",
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    max: Option<u32>,
    /// Sweep exactly these listener counts, e.g. `1,2,4`.
    #[arg(long, value_name = "N,...", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    counts: Option<Vec<u32>>,
    /// Load connections (default: two per data-plane core).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    connections: Option<u32>,
}

/// What the load achieved in one count's measured window.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Measurement {
    /// Records acked within the window.
    records: u64,
    /// Wall time of the window.
    wall: Duration,
    /// Broker process CPU time (all threads) within the window.
    broker_cpu: Duration,
}

impl Measurement {
    fn seconds(&self) -> f64 {
        self.wall.as_secs_f64().max(f64::EPSILON)
    }

    fn records_per_second(&self) -> f64 {
        self.records as f64 / self.seconds()
    }

    /// Payload megabytes (10^6 bytes) per second.
    fn megabytes_per_second(&self) -> f64 {
        self.records_per_second() * PAYLOAD_BYTES as f64 / 1e6
    }

    fn cpu_cores(&self) -> f64 {
        self.broker_cpu.as_secs_f64() / self.seconds()
    }

    /// Broker CPU seconds per million acked records; `None` when nothing was acked.
    fn cpu_seconds_per_million(&self) -> Option<f64> {
        (self.records > 0).then(|| self.broker_cpu.as_secs_f64() * 1e6 / self.records as f64)
    }
}

/// The load's shape, the same for every count.
#[derive(Debug, Clone)]
struct LoadPlan {
    connections: usize,
    shards: u32,
    seconds: Duration,
    publish_inflight_bytes: u64,
    pub_shard_streams: u32,
}

/// Runs the sweep and prints its table and recommendation.
pub(crate) fn run(config: &Config, args: &ListenersArgs) -> anyhow::Result<()> {
    // The core count does not depend on the listener count; with `auto`, a configured
    // FELIX_QUIC_LISTENERS the plan would refuse cannot stop the sweep that is to replace it.
    let mut auto = config.clone();
    auto.quic_listeners = "auto".to_owned();
    let plan = felix_broker::core_plan(&auto).context("cannot build the core plan")?;
    let cores = plan.cores().len();
    let counts: Vec<u32> = match (&args.counts, args.max) {
        (Some(counts), _) => counts.clone(),
        (None, Some(max)) => (1..=max).collect(),
        (None, None) => (1..=u32::try_from(cores).unwrap_or(u32::MAX)).collect(),
    };
    anyhow::ensure!(!counts.is_empty(), "no listener count to sweep");
    // Refuse a count the plan rejects before starting anything, with the plan's reason.
    for &count in &counts {
        let mut candidate = config.clone();
        candidate.quic_listeners = count.to_string();
        // The plan's message names the count and the limit; its source chain repeats it.
        felix_broker::core_plan(&candidate)
            .map_err(|error| anyhow::anyhow!("listener count {count} cannot be swept: {error}"))?;
    }
    let connections = args
        .connections
        .map_or(cores * CONNECTIONS_PER_CORE, |n| n as usize);
    let load = LoadPlan {
        connections,
        shards: u32::try_from(cores).unwrap_or(u32::MAX),
        seconds: Duration::from_secs(u64::from(args.seconds)),
        publish_inflight_bytes: config.publish_inflight_bytes,
        // The tuning crate bounds FELIX_PUB_SHARD_STREAMS to 0..=64.
        pub_shard_streams: u32::try_from(config.pub_shard_streams)
            .unwrap_or(felix_client::DEFAULT_PUB_SHARD_STREAMS),
    };
    let passed = passed_settings(config);
    let executable = std::env::current_exe().context("cannot find the felix executable")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("felix-tune-load")
        .build()
        .context("cannot build the tokio runtime for the load")?;

    let cpus: Vec<String> = plan
        .cores()
        .iter()
        .map(|core| core.cpu.os_index.to_string())
        .collect();
    println!(
        "felix tune listeners: {cores} data-plane cores (cpus {}); listener counts {}",
        cpus.join(","),
        join_counts(&counts)
    );
    println!(
        "load per count: {connections} connections (not core-aware, through the shared port), \
         each {IN_FLIGHT_PER_CONNECTION} acked batches of {BATCH_RECORDS} x {PAYLOAD_BYTES} B \
         in flight, to an in-memory stream of {} shards; {} ms warm-up, {} s measured",
        load.shards,
        WARMUP.as_millis(),
        args.seconds
    );
    if passed.is_empty() {
        println!("broker settings: defaults (plus the sweep's own)");
    } else {
        let shown: Vec<String> = passed
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        println!("broker settings passed on: {}", shown.join(" "));
    }
    println!(
        "note: the load generator runs on this host and shares its CPUs with the broker; on a \
         shared or loaded machine the figures are noisy (re-run before acting on a small \
         difference)."
    );
    println!();
    let table = Table::new();
    println!("{}", table.header());

    let mut results: Vec<(u32, anyhow::Result<Measurement>)> = Vec::with_capacity(counts.len());
    for &count in &counts {
        let result = run_count(&runtime, &executable, config, &passed, &load, count);
        match &result {
            Ok(measurement) => println!("{}", table.row(count, measurement)),
            Err(error) => println!("{}", table.failed_row(count, error)),
        }
        results.push((count, result));
    }
    println!();
    println!(
        "MB/S: payload megabytes (10^6 B) per second; BROKER CPU: CPU time of the broker \
              process over wall time; CPU-S PER M RECORDS: broker CPU seconds per million records."
    );

    let failed: Vec<u32> = results
        .iter()
        .filter(|(_, result)| result.is_err())
        .map(|(count, _)| *count)
        .collect();
    for (count, result) in &results {
        if let Err(error) = result {
            eprintln!("felix: listeners {count} failed: {error:#}");
        }
    }
    let measured: Vec<(u32, f64)> = results
        .iter()
        .filter_map(|(count, result)| {
            result
                .as_ref()
                .ok()
                .map(|measurement| (*count, measurement.records_per_second()))
        })
        .collect();
    let busiest = results
        .iter()
        .filter_map(|(_, result)| result.as_ref().ok().map(Measurement::cpu_cores))
        .fold(0.0f64, f64::max);
    if !measured.is_empty() && busiest < LOAD_BOUND_FRACTION * cores as f64 {
        println!(
            "note: the broker used at most {busiest:.2} of its {cores} data-plane cores: the \
             load generator, on the same CPUs, was probably the limit, which hides differences \
             between counts; try --connections, or a quieter machine."
        );
    }
    if cfg!(debug_assertions) {
        println!("note: this felix is a debug build; its figures are far below a release build's.");
    }
    match recommend(&measured) {
        Some(choice) => print_recommendation(&choice, cores),
        None => println!("no recommendation: no listener count was measured"),
    }
    anyhow::ensure!(
        failed.is_empty(),
        "listener count(s) {} failed (see their rows)",
        join_counts(&failed)
    );
    Ok(())
}

/// `1, 2, 4`.
fn join_counts(counts: &[u32]) -> String {
    let counts: Vec<String> = counts.iter().map(ToString::to_string).collect();
    counts.join(", ")
}

/// The configuration's settings a started broker gets: every one not at its default, except
/// those the sweep sets itself.
fn passed_settings(config: &Config) -> Vec<(&'static str, String)> {
    config
        .entries()
        .into_iter()
        .filter(|entry| entry.source != Source::Default)
        .filter(|entry| !SWEEP_OWNED.contains(&entry.env))
        .filter(|entry| !entry.value.is_empty())
        .map(|entry| (entry.env, entry.value))
        .collect()
}

/// One count: start a broker, load it, stop it. The broker is reaped on every path.
fn run_count(
    runtime: &tokio::runtime::Runtime,
    executable: &Path,
    config: &Config,
    passed: &[(&'static str, String)],
    load: &LoadPlan,
    count: u32,
) -> anyhow::Result<Measurement> {
    let mut broker = SweepBroker::start(executable, passed, count)?;
    let ca = {
        let mut child_config = config.clone();
        child_config.data_dir = broker.data_dir();
        child_config.dev_cert_path()
    };
    let measured = runtime.block_on(run_load(broker.quic_addr, &ca, broker.pid(), load));
    let stopped = broker.stop();
    match (measured, stopped) {
        (Ok(measurement), Ok(())) => Ok(measurement),
        (Err(error), _) => Err(error.context(format!("the load failed; {}", broker.log_tail()))),
        (Ok(_), Err(error)) => Err(error.context(broker.log_tail())),
    }
}

/// A `felix broker` child process with its temporary directory (data directory and log).
/// Dropping it kills and reaps the process if [`SweepBroker::stop`] did not.
struct SweepBroker {
    child: Option<Child>,
    quic_addr: SocketAddr,
    /// Holds `data/` (the broker's data directory) and `broker.log` (its stderr); removed
    /// on drop, after the process is gone.
    dir: tempfile::TempDir,
}

impl SweepBroker {
    /// Starts `executable broker` with FELIX_QUIC_LISTENERS=`count` and waits (up to
    /// [`STARTUP_TIMEOUT`]) for its listening line.
    fn start(
        executable: &Path,
        passed: &[(&'static str, String)],
        count: u32,
    ) -> anyhow::Result<SweepBroker> {
        let dir = tempfile::Builder::new()
            .prefix("felix-tune-listeners-")
            .tempdir()
            .context("cannot create a temporary directory for the broker")?;
        let data_dir = dir.path().join("data");
        let log_path = dir.path().join("broker.log");
        let log = File::create(&log_path)
            .with_context(|| format!("cannot create {}", log_path.display()))?;
        let mut command = Command::new(executable);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("FELIX_") {
                command.env_remove(name);
            }
        }
        command
            .arg("broker")
            .envs(passed.iter().map(|(name, value)| (*name, value.as_str())))
            .env("FELIX_DATA_DIR", &data_dir)
            .env("FELIX_BIND", "127.0.0.1:0")
            .env("FELIX_METRICS_BIND", "off")
            .env("FELIX_QUIC_LISTENERS", count.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        // If this process dies without running the Drop guard (SIGKILL, SIGTERM), the broker
        // gets SIGTERM instead of living on as an orphan holding its ports and CPUs.
        // SAFETY: the closure runs in the forked child before exec and calls only prctl(2),
        // which is async-signal-safe; it touches no memory of the parent.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start {} broker", executable.display()))?;
        let stdout = child.stdout.take();
        let mut broker = SweepBroker {
            child: Some(child),
            quic_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
        };
        let Some(stdout) = stdout else {
            anyhow::bail!("the broker's stdout is not piped");
        };
        let (lines_tx, lines_rx) = mpsc::channel::<String>();
        std::thread::Builder::new()
            .name("felix-tune-broker-stdout".to_owned())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    // Nobody listens after start-up; keep draining so the broker never blocks
                    // on a full pipe.
                    let _ = lines_tx.send(line);
                }
            })
            .context("cannot start the broker's stdout reader thread")?;
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let mut shared_listeners = 0u32;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match lines_rx.recv_timeout(left) {
                Ok(line) => line,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    anyhow::bail!(
                        "the broker did not start: no listening line within {STARTUP_TIMEOUT:?}; {}",
                        broker.log_tail()
                    );
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = broker.reap();
                    anyhow::bail!(
                        "the broker did not start: it exited ({status}) before listening; {}",
                        broker.log_tail()
                    );
                }
            };
            if let Some(listeners) = parse_shared_listeners(&line) {
                shared_listeners += listeners;
            }
            if let Some(rest) = line.strip_prefix(QUIC_LINE_PREFIX) {
                broker.quic_addr = rest.trim().parse().with_context(|| {
                    format!("the broker printed an unreadable address: {line:?}")
                })?;
                break;
            }
        }
        anyhow::ensure!(
            shared_listeners == count,
            "the broker started with {shared_listeners} shared-port listeners instead of {count}"
        );
        Ok(broker)
    }

    /// The broker's data directory.
    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Its process id (0 once reaped).
    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGTERM, then SIGKILL if it has not exited within [`STOP_DEADLINE`]; reaps it. An exit
    /// other than success is an error; a kill after the deadline is a warning.
    fn stop(&mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY: kill(2) has no memory-safety preconditions. The pid is our child's and
            // it is not reaped yet, so it cannot name another process.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + STOP_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => anyhow::bail!("the broker exited with {status} after SIGTERM"),
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    eprintln!(
                        "felix: warning: a broker did not exit within {STOP_DEADLINE:?} of SIGTERM; killed"
                    );
                    return Ok(());
                }
                Ok(None) => std::thread::sleep(EXIT_POLL_INTERVAL),
                Err(error) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(error).context("cannot wait for the broker to exit");
                }
            }
        }
    }

    /// Kills and reaps the process (if still there); describes how it ended.
    fn reap(&mut self) -> String {
        let Some(mut child) = self.child.take() else {
            return "already reaped".to_owned();
        };
        match child.try_wait() {
            Ok(Some(status)) => status.to_string(),
            _ => {
                let _ = child.kill();
                match child.wait() {
                    Ok(status) => status.to_string(),
                    Err(error) => format!("cannot reap it: {error}"),
                }
            }
        }
    }

    /// `its log ends with:\n...`, the last [`LOG_TAIL_BYTES`] of its stderr.
    fn log_tail(&self) -> String {
        let path = self.dir.path().join("broker.log");
        match std::fs::read(&path) {
            Ok(bytes) if bytes.is_empty() => "its log is empty".to_owned(),
            Ok(bytes) => {
                let from = bytes.len().saturating_sub(LOG_TAIL_BYTES);
                format!(
                    "its log ends with:\n{}",
                    String::from_utf8_lossy(&bytes[from..]).trim_end()
                )
            }
            Err(error) => format!("cannot read its log {}: {error}", path.display()),
        }
    }
}

impl Drop for SweepBroker {
    fn drop(&mut self) {
        self.reap();
    }
}

/// `k` from the broker's `felix: core <i> shared listeners <k>` line.
fn parse_shared_listeners(line: &str) -> Option<u32> {
    let rest = line.strip_prefix("felix: core ")?;
    let (_, listeners) = rest.split_once(" shared listeners ")?;
    listeners.trim().parse().ok()
}

/// utime + stime of process `pid`, from `/proc/<pid>/stat`.
fn process_cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    let ticks = parse_stat_cpu_ticks(&stat).with_context(|| format!("cannot parse {path}"))?;
    Ok(Duration::from_secs_f64(ticks as f64 / USER_HZ))
}

/// utime + stime (clock ticks) from the text of `/proc/<pid>/stat`. The command name (field 2)
/// is in parentheses and may itself hold spaces and parentheses, so fields are counted after
/// the last `)`: field 3 (state) comes first there, utime and stime are fields 14 and 15.
fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The client configuration of the load: the broker's development certificate, not
/// core-aware (every connection enters through the shared port).
fn load_client_config(addr: SocketAddr, ca: &Path, load: &LoadPlan) -> ClientConfig {
    let mut client = ClientConfig::new(addr);
    // The development certificate is valid for localhost and the loopback addresses.
    client.server_name = "localhost".to_owned();
    client.ca = Some(ca.to_path_buf());
    client.publish_inflight_bytes = load.publish_inflight_bytes;
    client.pub_shard_streams = load.pub_shard_streams;
    client.core_aware = false;
    client.client_name = concat!("felix-tune-listeners/", env!("CARGO_PKG_VERSION")).to_owned();
    client
}

/// One batch per shard: [`BATCH_RECORDS`] records whose key hashes to that shard.
fn batches_per_shard(shards: u32) -> Vec<Arc<[Record]>> {
    let payload = Bytes::from(vec![b'x'; PAYLOAD_BYTES]);
    (0..shards)
        .map(|shard| {
            // Some key among the first few hundred hashes to each shard of any small count.
            let key = (0u64..)
                .map(|n| format!("k{n}"))
                .find(|key| felix_wire::shard_for_key(key.as_bytes(), shards) == shard)
                .map(|key| Bytes::from(key.into_bytes()))
                .unwrap_or_default();
            let records: Vec<Record> = (0..BATCH_RECORDS)
                .map(|_| Record {
                    key: key.clone(),
                    payload: payload.clone(),
                })
                .collect();
            Arc::from(records)
        })
        .collect()
}

/// Connects the load, runs it for the warm-up and the measured window, and stops it.
async fn run_load(
    addr: SocketAddr,
    ca: &Path,
    pid: u32,
    load: &LoadPlan,
) -> anyhow::Result<Measurement> {
    let client_config = load_client_config(addr, ca, load);
    let clients = tokio::time::timeout(SETUP_TIMEOUT, async {
        let admin = Client::connect(client_config.clone())
            .await
            .context("cannot connect to the broker")?;
        admin
            .create_stream(STREAM, load.shards, StreamKind::InMemory)
            .await
            .context("cannot create the load's stream")?;
        admin.close().await;
        let connecting = (0..load.connections).map(|_| Client::connect(client_config.clone()));
        futures::future::try_join_all(connecting)
            .await
            .context("cannot open the load's connections")
    })
    .await
    .map_err(|_| anyhow::anyhow!("the load's set-up took longer than {SETUP_TIMEOUT:?}"))??;

    let batches = batches_per_shard(load.shards);
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for (index, client) in clients.into_iter().enumerate() {
        tasks.spawn(publish_loop(
            client,
            batches.clone(),
            index,
            Arc::clone(&acked),
            Arc::clone(&stop),
        ));
    }
    let window = async {
        tokio::time::sleep(WARMUP).await;
        let start = (
            acked.load(Ordering::Relaxed),
            process_cpu_time(pid)?,
            Instant::now(),
        );
        tokio::time::sleep(load.seconds).await;
        let end = (
            acked.load(Ordering::Relaxed),
            process_cpu_time(pid)?,
            Instant::now(),
        );
        anyhow::Ok(Measurement {
            records: end.0 - start.0,
            wall: end.2 - start.2,
            broker_cpu: end.1.saturating_sub(start.1),
        })
    };
    // A connection failing ends the window early with its error.
    let measured = tokio::select! {
        measured = window => measured,
        Some(finished) = tasks.join_next() => Err(task_error(finished)),
    };
    stop.store(true, Ordering::Relaxed);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        let mut first_error = None;
        while let Some(finished) = tasks.join_next().await {
            if let Err(error) = finished.map_err(anyhow::Error::from).and_then(|done| done) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    })
    .await;
    let drained = match drained {
        Ok(drained) => drained,
        Err(_) => {
            tasks.abort_all();
            Err(anyhow::anyhow!(
                "the load's batches in flight were not acked within {DRAIN_TIMEOUT:?} of the end"
            ))
        }
    };
    let measurement = measured?;
    drained.context("the load failed while finishing")?;
    Ok(measurement)
}

/// The error of a publish loop that ended before it was told to stop.
fn task_error(finished: Result<anyhow::Result<()>, tokio::task::JoinError>) -> anyhow::Error {
    match finished {
        Ok(Ok(())) => anyhow::anyhow!("a load connection ended early"),
        Ok(Err(error)) => error,
        Err(error) => anyhow::Error::from(error).context("a load task failed"),
    }
}

/// One connection's load: keeps [`IN_FLIGHT_PER_CONNECTION`] acked batches outstanding until
/// `stop`, counting acked records, then waits for the rest and closes.
async fn publish_loop(
    client: Client,
    batches: Vec<Arc<[Record]>>,
    first_shard: usize,
    acked: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut in_flight = VecDeque::with_capacity(IN_FLIGHT_PER_CONNECTION);
    let mut next = first_shard;
    while !stop.load(Ordering::Relaxed) {
        if in_flight.len() >= IN_FLIGHT_PER_CONNECTION
            && let Some(pending) = in_flight.pop_front()
        {
            count_acks(pending, &acked).await?;
        }
        let batch = &batches[next % batches.len()];
        next = next.wrapping_add(1);
        let pending = client
            .publish_pipelined(STREAM, batch)
            .await
            .context("cannot publish")?;
        in_flight.push_back(pending);
    }
    while let Some(pending) = in_flight.pop_front() {
        count_acks(pending, &acked).await?;
    }
    client.close().await;
    Ok(())
}

/// Waits for one batch's acks and adds its records to `acked`.
async fn count_acks(pending: felix_client::PendingAck, acked: &AtomicU64) -> anyhow::Result<()> {
    let acks = pending.await.context("a publish was refused")?;
    let records: u64 = acks.iter().map(|ack| u64::from(ack.count)).sum();
    acked.fetch_add(records, Ordering::Relaxed);
    Ok(())
}

/// The result table: fixed column widths, so rows print as each count finishes.
struct Table {
    widths: [usize; 5],
}

/// Column headers, left to right.
const HEADERS: [&str; 5] = [
    "LISTENERS",
    "RECORDS/S",
    "MB/S",
    "BROKER CPU (cores)",
    "CPU-S PER M RECORDS",
];
/// Narrowest numeric column: room for e.g. `12345678` records per second.
const COLUMN_WIDTH_MIN: usize = 10;

impl Table {
    fn new() -> Table {
        let mut widths = HEADERS.map(|header| header.len().max(COLUMN_WIDTH_MIN));
        // The count column holds small numbers: its header is wide enough.
        widths[0] = HEADERS[0].len();
        Table { widths }
    }

    fn line(&self, cells: &[String]) -> String {
        let cells: Vec<String> = cells
            .iter()
            .zip(self.widths)
            .map(|(cell, width)| format!("{cell:>width$}"))
            .collect();
        cells.join("  ").trim_end().to_owned()
    }

    fn header(&self) -> String {
        self.line(&HEADERS.map(str::to_owned))
    }

    fn row(&self, count: u32, measurement: &Measurement) -> String {
        self.line(&[
            count.to_string(),
            format!("{:.0}", measurement.records_per_second()),
            format!("{:.1}", measurement.megabytes_per_second()),
            format!("{:.2}", measurement.cpu_cores()),
            measurement
                .cpu_seconds_per_million()
                .map_or_else(|| "-".to_owned(), |seconds| format!("{seconds:.2}")),
        ])
    }

    fn failed_row(&self, count: u32, error: &anyhow::Error) -> String {
        // The first line of the outermost error; the full chain goes to stderr at the end.
        let text = error.to_string();
        let first = text.lines().next().unwrap_or("");
        format!(
            "{}  failed: {first}",
            self.line(std::slice::from_ref(&count.to_string()))
        )
    }
}

/// The recommended count and why.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Choice {
    count: u32,
    /// The count with the highest throughput and that throughput (records per second).
    best: (u32, f64),
}

/// The count with the highest throughput, or the smallest count within
/// [`NEAR_BEST_FRACTION`] of it. `None` when nothing was measured.
fn recommend(measured: &[(u32, f64)]) -> Option<Choice> {
    let best = measured
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))?;
    let floor = best.1 * (1.0 - NEAR_BEST_FRACTION);
    let count = measured
        .iter()
        .filter(|(_, rate)| *rate >= floor)
        .map(|(count, _)| *count)
        .min()
        .unwrap_or(best.0);
    Some(Choice { count, best })
}

fn print_recommendation(choice: &Choice, cores: usize) {
    println!(
        "recommended: FELIX_QUIC_LISTENERS={count}   (config file: quic_listeners = \"{count}\")",
        count = choice.count
    );
    let (best_count, best_rate) = choice.best;
    if choice.count == best_count {
        println!("  the highest throughput of the counts swept ({best_rate:.0} records/s)");
    } else {
        println!(
            "  within {:.0}% of the highest throughput ({best_count} listeners, {best_rate:.0} \
             records/s); the smaller count is preferred",
            NEAR_BEST_FRACTION * 100.0
        );
    }
    if usize::try_from(choice.count).is_ok_and(|count| count == cores) {
        println!("  (this is also the default, auto: one listener per data-plane core)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves utime + stime are found after the command name even when it holds spaces and
    // parentheses.
    #[test]
    fn stat_fields_after_the_command_name() {
        let stat = "4242 (felix (a) b) S 1 4242 4242 0 -1 4194560 1200 0 3 0 250 75 0 0 20 0 9 0 \
                    123456 1000000 500 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0";
        assert_eq!(parse_stat_cpu_ticks(stat), Some(325));
        assert_eq!(parse_stat_cpu_ticks("4242 (felix) S 1 2"), None);
        assert_eq!(parse_stat_cpu_ticks("no parenthesis"), None);
    }

    // Proves our own process's CPU time can be read.
    #[test]
    fn own_cpu_time_reads() {
        assert!(process_cpu_time(std::process::id()).is_ok());
    }

    // Proves the highest throughput wins unless a smaller count is within 5% of it.
    #[test]
    fn recommendation_prefers_a_smaller_count_near_the_best() {
        assert_eq!(recommend(&[]), None);
        let clear = recommend(&[(1, 100.0), (2, 200.0)]).map(|choice| choice.count);
        assert_eq!(clear, Some(2));
        let near = recommend(&[(1, 96.0), (2, 100.0), (3, 99.0)]);
        assert_eq!(
            near,
            Some(Choice {
                count: 1,
                best: (2, 100.0)
            })
        );
        let tie = recommend(&[(2, 100.0), (1, 100.0)]);
        assert_eq!(
            tie,
            Some(Choice {
                count: 1,
                best: (1, 100.0)
            })
        );
        assert_eq!(
            recommend(&[(1, 94.0), (2, 100.0)]).map(|choice| choice.count),
            Some(2)
        );
    }

    // Proves the shared-listener lines are summed from the broker's own format.
    #[test]
    fn shared_listener_lines_parse() {
        assert_eq!(
            parse_shared_listeners("felix: core 1 shared listeners 2"),
            Some(2)
        );
        assert_eq!(
            parse_shared_listeners("felix: core 1 listening on 127.0.0.1:5"),
            None
        );
    }

    // Proves every batch's records hash to the batch's shard.
    #[test]
    fn batches_hit_their_shard() {
        for shards in [1u32, 2, 3, 7] {
            let batches = batches_per_shard(shards);
            assert_eq!(batches.len(), shards as usize);
            for (shard, batch) in batches.iter().enumerate() {
                assert_eq!(batch.len(), BATCH_RECORDS);
                for record in batch.iter() {
                    assert_eq!(felix_wire::shard_for_key(&record.key, shards), shard as u32);
                    assert_eq!(record.payload.len(), PAYLOAD_BYTES);
                }
            }
        }
    }

    // Proves rows line up under the header and a failed row names its count.
    #[test]
    fn table_columns_align() {
        let table = Table::new();
        let header = table.header();
        let row = table.row(
            2,
            &Measurement {
                records: 300_000,
                wall: Duration::from_secs(3),
                broker_cpu: Duration::from_millis(4500),
            },
        );
        assert_eq!(header.len(), row.len(), "{header}\n{row}");
        assert!(row.contains("100000"), "{row}");
        assert!(row.contains("25.6"), "{row}");
        assert!(row.contains("1.50"), "{row}");
        assert!(row.contains("15.00"), "{row}");
        let failed = table.failed_row(3, &anyhow::anyhow!("boom\nmore"));
        assert!(
            failed.trim_start().starts_with("3  failed: boom"),
            "{failed}"
        );
        assert!(!failed.contains("more"));
    }
}
