//! The Felix load generator: a [`CellDriver`] that runs one cell against a Felix broker.
//!
//! Per cell: start a broker (or use the one given), create the stream, connect P publishers
//! (one QUIC connection each) and, for latency cells, one subscriber; take the first counter
//! sample; release the publishers together; each keeps `in_flight` publishes outstanding
//! (`publish_pipelined`) or publishes fire-and-forget until the deadline, then stops issuing and
//! waits for its outstanding acks (graceful finish, so sent and accepted agree); wait for the
//! broker's accepted count to settle; take the last sample; stop the broker.
//!
//! Latency cells: each publisher runs [`LatencyCounts::warmup`] unrecorded then
//! [`LatencyCounts::measured`] recorded publishes (ack latency: just before the publish is
//! handed to the client -> its ack; delivery latency: the same send time, carried in the
//! payload's first 8 bytes -> the subscriber's receipt), and keeps publishing unrecorded until
//! the cell's duration has passed so the broker-side throughput is still taken over a steady
//! window.
//!
//! Threads: the generators are tasks on a multi-thread tokio runtime owned by the driver (one
//! worker per CPU of the bench machine); the sampler has its own thread; the calling thread
//! blocks in [`CellDriver::run_cell`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_client::{
    Client, ClientConfig, ClientError, Record, ShardSelection, StartPosition, StreamKind,
    Subscription,
};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;

use crate::BenchError;
use crate::broker::{BrokerEndpoint, SpawnedBroker};
use crate::cell::{CellDriver, CellRun, GeneratorReport};
use crate::plan::{self, Arm, Cell, Keys, Measure, Mode, Settings};
use crate::sampler::{Counters, SampleSource, Sampler};
use crate::stats::{Counts, Span};

/// Plain keys: `k0..k47`, the reference's plain-key set (one per shard of its 48).
pub const PLAIN_KEYS: usize = 48;

/// Candidate keys tried per shard when looking for a key that maps to it. FNV-1a spreads
/// `s<n>` keys uniformly, so the chance of missing a shard of N after 64·N tries is ~e^-64.
const KEY_SEARCH_PER_SHARD: u64 = 64;

/// Warm-up and measured publishes of a latency cell (docs/semantics.md, 7 Measuring
/// performance: 2,000 and 20,000).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatencyCounts {
    pub warmup: u64,
    pub measured: u64,
}

impl Default for LatencyCounts {
    fn default() -> Self {
        LatencyCounts {
            warmup: 2_000,
            measured: 20_000,
        }
    }
}

/// Histogram bounds: 1 µs .. 60 s in nanoseconds at 3 significant digits. A publish slower
/// than a minute is recorded as 60 s (saturating) rather than dropped.
const HIST_LOW_NS: u64 = 1_000;
const HIST_HIGH_NS: u64 = 60_000_000_000;
const HIST_SIGFIG: u8 = 3;

/// Time the broker's accepted count has to reach what the generators sent once they finish.
/// Fire-and-forget frames may still sit in the broker's queues when the last publisher closes;
/// 10 s is far more than a drain takes and bounds a broker that really dropped them.
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// Accepted bytes unchanged for this long count as settled (a broker that shed publishes
/// never reaches the sent count).
const DRAIN_STABLE: Duration = Duration::from_secs(1);

/// Pause between drain checks: 100 ms, ten scrapes a second at most.
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// Time a latency cell's subscriber has after the last publish to receive the last measured
/// record before it is stopped (and the missing deliveries reported by the count).
const DELIVERY_DEADLINE: Duration = Duration::from_secs(10);

/// Time allowed to connect every publisher and create the stream.
const SETUP_DEADLINE: Duration = Duration::from_secs(60);

/// Per-record bytes on the wire besides key and payload (length prefixes), and the publish
/// header, used only to size the client's in-flight budget.
const RECORD_OVERHEAD_BYTES: u64 = 16;
const PUBLISH_HEADER_BYTES: u64 = 256;

/// Largest client budget asked for: 4 GiB, the client setting's upper bound.
const BUDGET_BYTES_MAX: u64 = 4 * 1024 * 1024 * 1024;

/// Where the broker comes from.
#[derive(Debug, Clone)]
pub enum Target {
    /// Start `felix broker` per cell: binary, work directory (data dir and log live here).
    Spawn { felix: PathBuf, work_dir: PathBuf },
    /// A broker already running (its stream names are made unique per run).
    External(BrokerEndpoint),
}

/// The Felix load generator.
pub struct FelixDriver {
    target: Target,
    runtime: tokio::runtime::Runtime,
    latency: LatencyCounts,
    runs: u64,
    /// How each started broker ended, one line per run (kept for the run metadata).
    pub broker_exits: Vec<String>,
}

impl std::fmt::Debug for FelixDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FelixDriver")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl FelixDriver {
    /// A driver with its own multi-thread runtime.
    pub fn new(target: Target, latency: LatencyCounts) -> Result<FelixDriver, BenchError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("felix-bench-gen")
            .build()
            .map_err(|e| BenchError::Driver {
                cell: "-".to_string(),
                detail: format!("cannot start the tokio runtime: {e}"),
            })?;
        Ok(FelixDriver {
            target,
            runtime,
            latency,
            runs: 0,
            broker_exits: Vec::new(),
        })
    }
}

impl CellDriver for FelixDriver {
    fn run_cell(
        &mut self,
        settings: &Settings,
        cell: &Cell,
        arm: &Arm,
        trial: u32,
    ) -> Result<CellRun, BenchError> {
        self.runs += 1;
        let label = cell.label();
        let driver_err = |detail: String| BenchError::Driver {
            cell: label.clone(),
            detail,
        };
        let (spawned, endpoint) = match &self.target {
            Target::Spawn { felix, work_dir } => {
                let data_dir = work_dir.join("data");
                let log = work_dir.join("broker.log");
                let b = SpawnedBroker::start(
                    felix,
                    &arm.env,
                    &data_dir,
                    &log,
                    settings.server_cpus.as_deref(),
                )?;
                let e = b.endpoint().clone();
                (Some(b), e)
            }
            Target::External(e) => (None, e.clone()),
        };
        let stream = format!("bench-c{}-t{}-r{}", cell.number, trial, self.runs);
        let job = Job {
            endpoint: endpoint.clone(),
            stream,
            shards: settings.shards,
            warmup: Duration::from_secs(u64::from(settings.warmup_s)),
            cell: *cell,
            latency: self.latency,
        };
        let result = self.runtime.block_on(job.run()).map_err(driver_err);
        if let Some(b) = spawned {
            match b.stop() {
                Ok(how) => self
                    .broker_exits
                    .push(format!("{label} arm {}: {how}", arm.name)),
                Err(e) => self
                    .broker_exits
                    .push(format!("{label} arm {}: stop failed: {e}", arm.name)),
            }
        }
        result
    }
}

/// One cell's work, independent of where the broker came from.
struct Job {
    endpoint: BrokerEndpoint,
    stream: String,
    shards: u32,
    warmup: Duration,
    cell: Cell,
    latency: LatencyCounts,
}

/// What one publisher did (Felix or NATS driver).
pub(crate) struct PublisherResult {
    pub(crate) span: Span,
    pub(crate) sent: Counts,
    pub(crate) refused: u64,
    pub(crate) first_refusal: Option<String>,
    pub(crate) ack: Option<Histogram<u64>>,
}

/// Merges the publishers' results into a cell run: one generator report each (ids
/// `<id_prefix><i>`), the ack histograms added together, refusals reported on stderr.
pub(crate) fn assemble_run(
    label: &str,
    id_prefix: &str,
    results: Vec<PublisherResult>,
    samples: Vec<crate::stats::Sample>,
    delivery: Option<Histogram<u64>>,
) -> CellRun {
    let mut ack: Option<Histogram<u64>> = None;
    let mut generators = Vec::with_capacity(results.len());
    let mut refused = 0u64;
    let mut first_refusal = None;
    for (i, r) in results.into_iter().enumerate() {
        refused += r.refused;
        if first_refusal.is_none() {
            first_refusal = r.first_refusal;
        }
        if let Some(h) = r.ack {
            match &mut ack {
                Some(total) => {
                    let _ = total.add(&h);
                }
                None => ack = Some(h),
            }
        }
        generators.push(GeneratorReport {
            id: format!("{id_prefix}{i}"),
            span: r.span,
            sent: r.sent,
            refused_publishes: r.refused,
        });
    }
    if refused > 0 {
        eprintln!(
            "{label}: {refused} publishes refused (first: {})",
            first_refusal.unwrap_or_default()
        );
    }
    CellRun {
        generators,
        samples,
        ack_latency_ns: ack,
        delivery_latency_ns: delivery,
    }
}

/// Waits for every publisher task, then for the latency subscriber (stopped after
/// `DELIVERY_DEADLINE` if it has not finished by itself); failures are collected, not fatal.
pub(crate) async fn join_load(
    tasks: Vec<tokio::task::JoinHandle<Result<PublisherResult, String>>>,
    subscriber: Option<tokio::task::JoinHandle<Result<Histogram<u64>, String>>>,
    stop_sub: &tokio::sync::watch::Sender<bool>,
    subscriber_name: &str,
) -> (Vec<PublisherResult>, Vec<String>, Option<Histogram<u64>>) {
    let mut results = Vec::with_capacity(tasks.len());
    let mut failures = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(Ok(r)) => results.push(r),
            Ok(Err(e)) => failures.push(format!("publisher {i}: {e}")),
            Err(e) => failures.push(format!("publisher {i} task: {e}")),
        }
    }
    let delivery = match subscriber {
        Some(mut task) => {
            // The subscriber stops by itself once it has every measured record.
            let joined = match tokio::time::timeout(DELIVERY_DEADLINE, &mut task).await {
                Ok(joined) => joined,
                Err(_) => {
                    let _ = stop_sub.send(true);
                    task.await
                }
            };
            match joined {
                Ok(Ok(h)) => Some(h),
                Ok(Err(e)) => {
                    failures.push(format!("{subscriber_name}: {e}"));
                    None
                }
                Err(e) => {
                    failures.push(format!("{subscriber_name} task: {e}"));
                    None
                }
            }
        }
        None => None,
    };
    (results, failures, delivery)
}

/// Lets the server's accepted count catch up (fire-and-forget frames still queued): done when
/// accepted (since the first sample) reaches `sent_bytes`, stops moving (shed), or after
/// `DRAIN_DEADLINE`.
pub(crate) async fn drain(sampler: &Sampler, sent_bytes: u64) {
    let drain_start = Instant::now();
    let mut last_seen = (u64::MAX, Instant::now());
    while drain_start.elapsed() < DRAIN_DEADLINE {
        let Ok(now_bytes) = tokio::task::block_in_place(|| sampler.payload_bytes_now()) else {
            break;
        };
        if now_bytes.saturating_sub(sampler.first_payload_bytes()) >= sent_bytes {
            break;
        }
        if now_bytes != last_seen.0 {
            last_seen = (now_bytes, Instant::now());
        } else if last_seen.1.elapsed() >= DRAIN_STABLE {
            break;
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
}

pub(crate) fn new_histogram() -> Histogram<u64> {
    // Invariant: constant, valid bounds (low >= 1, high >= 2 * low, sigfig <= 5), which
    // hdrhistogram always accepts; the test `histogram_bounds_are_valid` checks them.
    Histogram::new_with_bounds(HIST_LOW_NS, HIST_HIGH_NS, HIST_SIGFIG)
        .expect("constant histogram bounds are valid")
}

pub(crate) fn record_ns(h: &mut Histogram<u64>, ns: u64) {
    h.saturating_record(ns.clamp(HIST_LOW_NS, HIST_HIGH_NS));
}

/// Keys for a stream of `shards` shards: one per shard in shard order (spread), or k0..k47.
pub fn keys_for(keys: Keys, shards: u32) -> Result<Vec<Bytes>, String> {
    match keys {
        Keys::Plain => Ok((0..PLAIN_KEYS)
            .map(|i| Bytes::from(format!("k{i}")))
            .collect()),
        Keys::Spread => {
            let mut found: Vec<Option<Bytes>> = vec![None; shards as usize];
            let mut missing = shards as usize;
            let tries = KEY_SEARCH_PER_SHARD * u64::from(shards);
            for n in 0..tries {
                let key = format!("s{n}");
                let shard = felix_wire::shard_for_key(key.as_bytes(), shards) as usize;
                if found[shard].is_none() {
                    found[shard] = Some(Bytes::from(key));
                    missing -= 1;
                    if missing == 0 {
                        break;
                    }
                }
            }
            found
                .into_iter()
                .enumerate()
                .map(|(s, k)| k.ok_or_else(|| format!("no key maps to shard {s} of {shards}")))
                .collect()
        }
    }
}

/// Client budget large enough for `in_flight` publishes of the cell's batches (never below
/// the client default), so the plan's in-flight count, not the budget, bounds what is
/// outstanding and Little's law uses the real figure.
fn budget_bytes(cell: &Cell, key_len: usize) -> u64 {
    let s = &cell.shape;
    let per_record = u64::from(s.payload_bytes) + key_len as u64 + RECORD_OVERHEAD_BYTES;
    let per_publish = u64::from(s.batch) * per_record + PUBLISH_HEADER_BYTES;
    // DEFAULT (4 MiB) < MAX (4 GiB), so clamp's bounds are ordered.
    (u64::from(s.in_flight) * per_publish).clamp(
        felix_client::DEFAULT_PUBLISH_INFLIGHT_BYTES,
        BUDGET_BYTES_MAX,
    )
}

fn client_config(endpoint: &BrokerEndpoint, name: &str, budget: u64) -> ClientConfig {
    let mut c = ClientConfig::new(endpoint.quic_addr);
    c.ca = Some(endpoint.ca.clone());
    c.publish_inflight_bytes = budget;
    c.client_name = format!("felix-bench/{} {name}", env!("CARGO_PKG_VERSION"));
    // Plain publishes, as every figure in docs/performance.md was measured (an idempotent
    // producer sends one frame per shard and logs 57 bytes more per batch).
    c.idempotent = false;
    c
}

pub(crate) fn nanos_since(base: Instant) -> u64 {
    u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Shared between a latency cell's publisher and subscriber: which send times are measured.
/// Used by the Felix and the NATS drivers alike.
pub(crate) struct Window {
    /// Send times (ns since the cell's base instant) at or after this are measured.
    pub(crate) from_ns: AtomicU64,
    /// Send times at or after this are not (set when the measured count is done).
    pub(crate) until_ns: AtomicU64,
    /// Records the subscriber must receive before it is done (set with `until_ns`).
    pub(crate) expected: AtomicU64,
}

impl Window {
    /// Records the delivery latency of a received payload (its first 8 bytes are the send
    /// time) when its send time is inside the measured window; true when it was counted.
    pub(crate) fn record_delivery(
        &self,
        hist: &mut Histogram<u64>,
        payload: &[u8],
        now_ns: u64,
    ) -> bool {
        let Some(head) = payload.get(..8) else {
            return false;
        };
        let mut ts = [0u8; 8];
        ts.copy_from_slice(head);
        let send_ns = u64::from_le_bytes(ts);
        let from = self.from_ns.load(Ordering::Relaxed);
        let until = self.until_ns.load(Ordering::Relaxed);
        if send_ns >= from && send_ns < until {
            record_ns(hist, now_ns.saturating_sub(send_ns));
            true
        } else {
            false
        }
    }

    /// True once the subscriber has every measured record.
    pub(crate) fn complete(&self, received: u64) -> bool {
        received >= self.expected.load(Ordering::Relaxed)
    }
}

impl Job {
    async fn run(self) -> Result<CellRun, String> {
        let s = self.cell.shape;
        let kind = match s.kind {
            plan::StreamKind::InMemory => StreamKind::InMemory,
            plan::StreamKind::Durable => StreamKind::Durable,
        };
        let admin_budget = felix_client::DEFAULT_PUBLISH_INFLIGHT_BYTES;
        let setup = async {
            let admin = Client::connect(client_config(&self.endpoint, "admin", admin_budget))
                .await
                .map_err(|e| format!("admin connection: {e}"))?;
            admin
                .create_stream(&self.stream, self.shards, kind)
                .await
                .map_err(|e| {
                    format!(
                        "create stream {} ({} shards): {e}",
                        self.stream, self.shards
                    )
                })?;
            let info = admin
                .describe_stream(&self.stream)
                .await
                .map_err(|e| format!("describe stream {}: {e}", self.stream))?;
            let shard_count = u32::try_from(info.shards.len()).unwrap_or(u32::MAX).max(1);
            let keys = keys_for(s.keys, shard_count)?;
            let key_len = keys.iter().map(Bytes::len).max().unwrap_or(0);
            let budget = budget_bytes(&self.cell, key_len);
            let mut publishers = Vec::with_capacity(s.publishers as usize);
            for i in 0..s.publishers {
                let c = Client::connect(client_config(&self.endpoint, &format!("p{i}"), budget))
                    .await
                    .map_err(|e| format!("publisher {i} connection: {e}"))?;
                publishers.push(c);
            }
            let subscription = match s.measure {
                Measure::Latency => {
                    let sub = Client::connect(client_config(&self.endpoint, "sub", admin_budget))
                        .await
                        .map_err(|e| format!("subscriber connection: {e}"))?;
                    let subscription = sub
                        .subscribe(&self.stream, ShardSelection::All, StartPosition::Latest)
                        .await
                        .map_err(|e| format!("subscribe: {e}"))?;
                    Some((sub, subscription))
                }
                Measure::Throughput => None,
            };
            Ok::<_, String>((admin, keys, publishers, subscription))
        };
        let (admin, keys, publishers, subscription) = tokio::time::timeout(SETUP_DEADLINE, setup)
            .await
            .map_err(|_| format!("set-up did not finish within {SETUP_DEADLINE:?}"))??;

        // Cell clock: t = 0 just before the first sample.
        let start = Instant::now();
        let source = SampleSource {
            metrics_addr: self.endpoint.metrics_addr,
            pid: self.endpoint.pid,
            counters: Counters::Felix,
        };
        let sampler = tokio::task::block_in_place(|| Sampler::start(source, start))
            .map_err(|e| e.to_string())?;

        let window = Arc::new(Window {
            from_ns: AtomicU64::new(u64::MAX),
            until_ns: AtomicU64::new(u64::MAX),
            expected: AtomicU64::new(u64::MAX),
        });
        let (stop_sub, stop_sub_rx) = tokio::sync::watch::channel(false);
        let subscriber = subscription.map(|(client, subscription)| {
            let window = Arc::clone(&window);
            tokio::spawn(subscribe_loop(
                client,
                subscription,
                start,
                window,
                stop_sub_rx,
            ))
        });

        let keys = Arc::new(keys);
        let payload = Bytes::from(vec![0xA5u8; s.payload_bytes as usize]);
        let begin = Instant::now();
        let warmup_end = begin + self.warmup;
        let deadline = warmup_end + Duration::from_secs(u64::from(s.duration_s));
        let mut tasks = Vec::with_capacity(publishers.len());
        for (i, client) in publishers.into_iter().enumerate() {
            let p = Publisher {
                index: i,
                client,
                stream: self.stream.clone(),
                keys: Arc::clone(&keys),
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
            join_load(tasks, subscriber, &stop_sub, "subscriber").await;
        let sent_bytes: u64 = results.iter().map(|r| r.sent.bytes).sum();
        drain(&sampler, sent_bytes).await;
        let (samples, _missed) =
            tokio::task::block_in_place(|| sampler.finish()).map_err(|e| e.to_string())?;
        admin.close().await;

        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(assemble_run(
            &self.cell.label(),
            "p",
            results,
            samples,
            delivery,
        ))
    }
}

/// One publisher: its connection and what it publishes.
struct Publisher {
    index: usize,
    client: Client,
    stream: String,
    keys: Arc<Vec<Bytes>>,
    payload: Bytes,
    cell: Cell,
    start: Instant,
    warmup_end: Instant,
    deadline: Instant,
    latency: LatencyCounts,
    window: Arc<Window>,
}

impl Publisher {
    /// The records of publish number `n`: keys rotate over the key set, each publisher offset
    /// so publishers do not move in lockstep over the shards.
    fn batch(&self, n: u64, send_ns: Option<u64>) -> Vec<Record> {
        let b = u64::from(self.cell.shape.batch);
        let payload = match send_ns {
            Some(ns) => {
                let mut p = self.payload.to_vec();
                p[..8].copy_from_slice(&ns.to_le_bytes());
                Bytes::from(p)
            }
            None => self.payload.clone(),
        };
        let keys = self.keys.len() as u64;
        (0..b)
            .map(|j| {
                let k = (self.index as u64 + n * b + j) % keys;
                Record {
                    key: self.keys[k as usize].clone(),
                    payload: payload.clone(),
                }
            })
            .collect()
    }

    async fn run(self) -> Result<PublisherResult, String> {
        let s = self.cell.shape;
        let records_per_publish = u64::from(s.batch);
        let bytes_per_publish = records_per_publish * u64::from(s.payload_bytes);
        let span_start = self.warmup_end.max(Instant::now());
        let mut sent = Counts::default();
        let mut refused = 0u64;
        let mut first_refusal = None;
        let mut n = 0u64;
        let result = match (s.mode, s.measure) {
            (Mode::FireAndForget, _) => {
                while Instant::now() < self.deadline {
                    let records = self.batch(n, None);
                    n += 1;
                    self.client
                        .publish_no_ack(&self.stream, &records)
                        .await
                        .map_err(|e| e.to_string())?;
                    sent.bytes += bytes_per_publish;
                    sent.records += records_per_publish;
                }
                None
            }
            (Mode::Acked, measure) => {
                let latency = measure == Measure::Latency;
                // Latency cells have one publisher (plan-checked); it owns the window.
                debug_assert!(!latency || self.index == 0);
                let mut hist = new_histogram();
                let mut outstanding = FuturesUnordered::new();
                let measured_from = self.latency.warmup;
                let measured_until = self.latency.warmup + self.latency.measured;
                if latency && self.index == 0 && measured_from == 0 {
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
                        if latency && self.index == 0 && n == measured_from {
                            self.window.from_ns.store(send_ns, Ordering::Relaxed);
                        }
                        if latency && self.index == 0 && n == measured_until {
                            self.window.until_ns.store(send_ns, Ordering::Relaxed);
                            self.window.expected.store(
                                self.latency.measured * records_per_publish,
                                Ordering::Relaxed,
                            );
                        }
                        let measured = !latency || (n >= measured_from && n < measured_until);
                        let records = self.batch(n, latency.then_some(send_ns));
                        n += 1;
                        let pending = self
                            .client
                            .publish_pipelined(&self.stream, &records)
                            .await
                            .map_err(|e| e.to_string())?;
                        sent.bytes += bytes_per_publish;
                        sent.records += records_per_publish;
                        outstanding.push(async move { (send_ns, measured, pending.await) });
                        continue;
                    }
                    let Some((send_ns, measured, answer)) = outstanding.next().await else {
                        break;
                    };
                    match answer {
                        Ok(_) => {
                            if measured {
                                record_ns(
                                    &mut hist,
                                    nanos_since(self.start).saturating_sub(send_ns),
                                );
                            }
                        }
                        Err(e @ ClientError::Server { .. }) => {
                            refused += 1;
                            if first_refusal.is_none() {
                                first_refusal = Some(e.to_string());
                            }
                        }
                        Err(e) => return Err(e.to_string()),
                    }
                }
                if latency && self.index == 0 && n <= measured_until {
                    // Stopped before the window closed (cannot happen: issuing continues
                    // until measured_until); close it anyway so the subscriber finishes.
                    self.window
                        .until_ns
                        .store(nanos_since(self.start), Ordering::Relaxed);
                    self.window.expected.store(
                        n.saturating_sub(measured_from) * records_per_publish,
                        Ordering::Relaxed,
                    );
                }
                Some(hist)
            }
        };
        let end = Instant::now();
        // Fire-and-forget: close waits until the broker has every queued frame (bounded).
        self.client.close().await;
        let t = |i: Instant| i.saturating_duration_since(self.start).as_secs_f64();
        Ok(PublisherResult {
            span: Span {
                start_s: t(span_start),
                end_s: t(end),
            },
            sent,
            refused,
            first_refusal,
            ack: result,
        })
    }
}

/// A latency cell's subscriber: records send -> receipt for measured records until it has
/// the expected count or is told to stop.
async fn subscribe_loop(
    client: Client,
    mut subscription: Subscription,
    start: Instant,
    window: Arc<Window>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Histogram<u64>, String> {
    let mut hist = new_histogram();
    let mut received = 0u64;
    loop {
        if window.complete(received) {
            break;
        }
        tokio::select! {
            next = subscription.next() => match next {
                Some(Ok(record)) => {
                    if window.record_delivery(&mut hist, &record.payload, nanos_since(start)) {
                        received += 1;
                    }
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => return Err("the subscription ended".to_string()),
            },
            _ = stop.changed() => break,
        }
    }
    subscription.close().await;
    client.close().await;
    Ok(hist)
}

/// The broker endpoint given on the command line for an already running broker.
pub fn external_endpoint(
    quic_addr: SocketAddr,
    metrics_addr: SocketAddr,
    ca: PathBuf,
    pid: Option<u32>,
) -> BrokerEndpoint {
    BrokerEndpoint {
        quic_addr,
        metrics_addr,
        ca,
        pid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_bounds_are_valid() {
        // Proves the constant histogram bounds are accepted and out-of-range values saturate.
        let mut h = new_histogram();
        record_ns(&mut h, 0);
        record_ns(&mut h, u64::MAX);
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn spread_keys_hit_every_shard_once() {
        // Proves spread keys name one key per shard, in shard order, for several shard counts.
        for shards in [1u32, 8, 48, 200] {
            let keys = keys_for(Keys::Spread, shards).unwrap();
            assert_eq!(keys.len(), shards as usize);
            for (s, k) in keys.iter().enumerate() {
                assert_eq!(felix_wire::shard_for_key(k, shards), s as u32);
            }
        }
        let plain = keys_for(Keys::Plain, 8).unwrap();
        assert_eq!(plain.len(), PLAIN_KEYS);
        assert_eq!(&plain[47][..], b"k47");
    }
}
