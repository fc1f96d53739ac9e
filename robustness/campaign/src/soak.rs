//! The soak: one broker, a mixed workload for a fixed time, then checks.
//!
//! Workload: acked publishers (durable on_commit and in-memory streams, pipelined batches)
//! and fire-and-forget publishers (in-memory and durable), all reconnecting now and then and
//! continuing their sequence numbers; live subscribers; lagging subscribers (they stop
//! reading for a few seconds, are ended with `subscriber_lagged` and resume from the
//! positions its message gives); reconnecting subscribers (they close their client every few
//! seconds and resume from their last offsets, from the oldest offset still held when the
//! broker refuses the position as `too_old`); short-lived streams (either kind) created,
//! used and deleted during the run.
//!
//! Checks at the end:
//! - the broker's resident memory (VmRSS, sampled every [`RSS_SAMPLE_EVERY`]) stayed under the
//!   bound ([`DEFAULT_RSS_BOUND`]);
//! - no acknowledged durable record is lost: every durable stream is read back from the
//!   earliest offset and every acked record is at its acked offset, byte for byte;
//! - every subscriber saw each shard in order: offsets strictly increasing, no duplicate,
//!   gaps only where the broker said so (a `subscriber_lagged` resume position, a `too_old`
//!   refusal, a subscription that started later than asked);
//! - every record delivered is intact ([`crate::record`]);
//! - no error but the expected ones ([`EXPECTED_ERRORS`]), each only where it can happen.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use felix_client::{
    Client, ClientError, ErrorCode, ShardSelection, StartPosition, StreamKind, Subscription,
};
use futures::StreamExt as _;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use crate::CampaignError;
use crate::broker::{Broker, BrokerOptions};
use crate::record::{self, RecordId};

/// The errors a soak expects, and where: `subscriber_lagged` on any subscription (the broker
/// ends a slow subscriber and says where to resume), `too_old` when resubscribing to an
/// in-memory stream whose ring moved on, `stream_not_found` on a short-lived stream once its
/// deletion started, `ingress_budget_exhausted` on an acked publish refused under overload.
pub const EXPECTED_ERRORS: [&str; 4] = [
    "subscriber_lagged",
    "too_old",
    "stream_not_found",
    "ingress_budget_exhausted",
];

/// Resident-memory bound of the broker during a soak. Measured (2-CPU machine,
/// docs/reliability.md): VmRSS 18 MiB at start, 55-58 MiB from ~30 s on, flat to the end of
/// 60 s and 300 s soaks (in-memory rings full within seconds, subscriber queues bounded).
/// 128 MiB leaves 2x the measured peak for allocator and QUIC buffer noise, and is far below
/// what a leak of records or subscriber queues reaches in a minute (the workload moves
/// ~500,000 records, ~150 MB, a minute).
pub const DEFAULT_RSS_BOUND: u64 = 128 << 20;
/// How often VmRSS is sampled.
pub const RSS_SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Live backlog per subscription: the smallest allowed, so a subscriber that stops reading
/// for a few seconds is ended with `subscriber_lagged` (the broker's default is 64 MiB; QUIC
/// flow-control windows hold more before the broker's queue grows at all).
const SUBSCRIBER_QUEUE_MAX_BYTES: &str = "64KiB";
/// Segment size of the durable logs.
const SEGMENT_BYTES: &str = "4MiB";
/// The long-lived streams: (name, shards, durable).
const STREAMS: [(&str, u32, bool); 4] = [
    ("soak-mem-0", 4, false),
    ("soak-mem-1", 3, false),
    ("soak-dur-0", 4, true),
    ("soak-dur-1", 3, true),
];
/// Shards of a short-lived stream.
const CHURN_SHARDS: u32 = 2;
/// A short-lived stream is created every 1-3 s and lives 1-3 s.
const CHURN_PAUSE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(3));
const CHURN_LIFE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(3));
/// Pipelined acked publishes in flight per publisher.
const IN_FLIGHT: usize = 4;
/// Largest batch; half the publishes are single records.
const BATCH_MAX: usize = 16;
/// Largest payload (most are up to [`SMALL_PAYLOAD_MAX`]).
const SMALL_PAYLOAD_MAX: usize = 512;
const LARGE_PAYLOAD_MAX: usize = 8 * 1024;
const LARGE_ONE_IN: u32 = 20;
/// Pause after each ack (acked) or publish (fire-and-forget), drawn below this: bounds the
/// data volume (the durable streams are read back at the end) while keeping queues busy.
const PUBLISH_PAUSE_MAX: Duration = Duration::from_millis(5);
/// A publisher reconnects after 5-15 s.
const PUBLISHER_SESSION: (Duration, Duration) = (Duration::from_secs(5), Duration::from_secs(15));
/// A reconnecting subscriber reconnects after 2-6 s.
const SUBSCRIBER_SESSION: (Duration, Duration) = (Duration::from_secs(2), Duration::from_secs(6));
/// A lagging subscriber reads 1-3 s, then stops reading for 2-5 s.
const LAG_READ: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(3));
const LAG_STALL: (Duration, Duration) = (Duration::from_secs(3), Duration::from_secs(8));
/// A reconnecting subscriber stays away 0-3 s between sessions: long enough, now and then,
/// for an in-memory ring to move past its position (then `too_old`).
const OFFLINE_MAX: Duration = Duration::from_secs(3);
/// Deadline of each client operation.
const OP_DEADLINE: Duration = Duration::from_secs(30);
/// How long a subscriber waits for a record before checking whether to stop.
const POLL: Duration = Duration::from_millis(200);
/// After the run, workers get this long to finish before they are aborted.
const DRAIN_DEADLINE: Duration = Duration::from_secs(30);
/// Publisher and subscriber of a deleted stream must end within this.
const DELETED_END_DEADLINE: Duration = Duration::from_secs(15);
/// The final read-back of the durable streams.
const READ_BACK_DEADLINE: Duration = Duration::from_secs(600);
/// Longest soak accepted (bounds the run; the acked-record model grows with it).
pub const DURATION_MAX: Duration = Duration::from_secs(24 * 3600);
/// Failure details and error samples kept.
const DETAILS_MAX: usize = 20;
/// Progress line interval.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    pub felix: PathBuf,
    pub duration: Duration,
    pub seed: u64,
    /// Fails the soak when VmRSS exceeds it.
    pub rss_bound: u64,
    pub work_parent: Option<PathBuf>,
    /// Print a line every [`PROGRESS_EVERY`].
    pub progress: bool,
}

impl SoakConfig {
    #[must_use]
    pub fn new(felix: PathBuf, duration: Duration, seed: u64) -> SoakConfig {
        SoakConfig {
            felix,
            duration,
            seed,
            rss_bound: DEFAULT_RSS_BOUND,
            work_parent: None,
            progress: false,
        }
    }
}

/// What a soak found.
#[derive(Debug, Clone, Default)]
pub struct SoakReport {
    pub seconds: u64,
    pub seed: u64,
    pub published: u64,
    pub acked: u64,
    pub fire_and_forget: u64,
    pub delivered: u64,
    pub rss_min: u64,
    pub rss_max: u64,
    pub rss_bound: u64,
    pub rss_samples: u64,
    /// Every client error, by kind.
    pub errors: BTreeMap<String, u64>,
    /// Those that were not expected where they happened.
    pub unexpected: BTreeMap<String, u64>,
    pub durable_acked: u64,
    pub durable_read_back: u64,
    pub lost: u64,
    pub order_violations: u64,
    pub corrupted: u64,
    /// Gaps the broker declared (lagged resume positions past what was delivered, too_old).
    pub declared_gaps: u64,
    pub streams_created: u64,
    pub streams_deleted: u64,
    pub publisher_reconnects: u64,
    pub subscriber_reconnects: u64,
    pub failures: Vec<String>,
    pub error_samples: Vec<String>,
}

impl SoakReport {
    /// Whether every check held.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
            && self.unexpected.is_empty()
            && self.lost == 0
            && self.order_violations == 0
            && self.corrupted == 0
            && self.rss_max <= self.rss_bound
            && self.rss_samples > 0
    }

    /// The summary, several lines.
    #[must_use]
    pub fn summary(&self) -> String {
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        let mut out = format!(
            "soak {} s, seed {}: published {} records (acked {}, fire-and-forget {}), delivered {}\n\
             broker RSS min {:.1} MiB, max {:.1} MiB (bound {:.0} MiB, {} samples)\n\
             durable: {} acked records, {} read back, lost {}; order violations {}, corrupted {}, gaps declared by the broker {}\n\
             streams created {} deleted {}; reconnects: publishers {}, subscribers {}\n\
             errors by kind: {:?}\n",
            self.seconds,
            self.seed,
            self.published,
            self.acked,
            self.fire_and_forget,
            self.delivered,
            mib(self.rss_min),
            mib(self.rss_max),
            mib(self.rss_bound),
            self.rss_samples,
            self.durable_acked,
            self.durable_read_back,
            self.lost,
            self.order_violations,
            self.corrupted,
            self.declared_gaps,
            self.streams_created,
            self.streams_deleted,
            self.publisher_reconnects,
            self.subscriber_reconnects,
            self.errors,
        );
        if !self.unexpected.is_empty() {
            out.push_str(&format!("UNEXPECTED errors: {:?}\n", self.unexpected));
        }
        for sample in &self.error_samples {
            out.push_str(&format!("  {sample}\n"));
        }
        if self.rss_max > self.rss_bound {
            out.push_str("FAILURE: resident memory exceeded the bound\n");
        }
        for failure in &self.failures {
            out.push_str(&format!("FAILURE: {failure}\n"));
        }
        out.push_str(if self.passed() {
            "soak: PASS\n"
        } else {
            "soak: FAIL\n"
        });
        out
    }
}

/// Acked durable records: per stream, per shard, by offset.
type AckedMap = HashMap<String, Vec<Vec<Option<RecordId>>>>;

#[derive(Default)]
struct State {
    errors: BTreeMap<String, u64>,
    unexpected: BTreeMap<String, u64>,
    samples: Vec<String>,
    failures: Vec<String>,
    order_violations: u64,
    corrupted: u64,
    acked: AckedMap,
}

/// What every worker shares.
struct Soak {
    stop: AtomicBool,
    started: Instant,
    published: AtomicU64,
    acked: AtomicU64,
    faf: AtomicU64,
    delivered: AtomicU64,
    declared_gaps: AtomicU64,
    streams_created: AtomicU64,
    streams_deleted: AtomicU64,
    publisher_reconnects: AtomicU64,
    subscriber_reconnects: AtomicU64,
    next_writer: AtomicU32,
    state: Mutex<State>,
    config: felix_client::ClientConfig,
}

/// A stable name for an error's kind: the broker's code name, else the client's failure.
fn kind(error: &ClientError) -> String {
    match error {
        ClientError::Server { code, .. } => code.name().to_owned(),
        ClientError::Connect { .. } => "connect".to_owned(),
        ClientError::Tls(_) => "tls".to_owned(),
        ClientError::Io(_) => "io".to_owned(),
        ClientError::Protocol(_) => "protocol".to_owned(),
        ClientError::Closed(_) => "closed".to_owned(),
        ClientError::InvalidArgument(_) => "invalid_argument".to_owned(),
    }
}

impl Soak {
    fn state(&self) -> MutexGuard<'_, State> {
        // Updates are single inserts and counters: a panicked holder leaves nothing half done.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Counts an error; `expected` says whether it may happen where it did.
    fn error(&self, where_: &str, error: &ClientError, expected: bool) {
        let name = kind(error);
        let t = self.started.elapsed().as_secs_f64();
        let mut state = self.state();
        *state.errors.entry(name.clone()).or_default() += 1;
        if !expected {
            *state.unexpected.entry(name).or_default() += 1;
            if state.samples.len() < DETAILS_MAX {
                state.samples.push(format!("{t:.1} s {where_}: {error}"));
            }
        }
    }

    /// A timeout where an answer was due.
    fn timeout(&self, where_: &str) {
        let t = self.started.elapsed().as_secs_f64();
        let mut state = self.state();
        *state.errors.entry("timeout".to_owned()).or_default() += 1;
        *state.unexpected.entry("timeout".to_owned()).or_default() += 1;
        if state.samples.len() < DETAILS_MAX {
            state.samples.push(format!(
                "{t:.1} s {where_}: no answer within {OP_DEADLINE:?}"
            ));
        }
    }

    fn failure(&self, text: String) {
        let mut state = self.state();
        if state.failures.len() < DETAILS_MAX {
            state.failures.push(text);
        }
    }

    fn violation(&self, text: String) {
        self.state().order_violations += 1;
        self.failure(text);
    }

    async fn connect(&self, who: &str) -> Option<Client> {
        let mut config = self.config.clone();
        config.client_name = who.to_owned();
        match tokio::time::timeout(OP_DEADLINE, Client::connect(config)).await {
            Ok(Ok(client)) => Some(client),
            Ok(Err(error)) => {
                self.error(who, &error, false);
                None
            }
            Err(_) => {
                self.timeout(who);
                None
            }
        }
    }
}

/// Sleeps `d`, or less once the soak stops.
async fn nap(soak: &Soak, d: Duration) {
    let until = Instant::now() + d;
    while !soak.stopping() && Instant::now() < until {
        tokio::time::sleep(POLL.min(until.saturating_duration_since(Instant::now()))).await;
    }
}

fn draw(rng: &mut StdRng, (low, high): (Duration, Duration)) -> Duration {
    rng.random_range(low..high)
}

/// A batch of new records of `writer`, from `*seq` on.
fn batch(rng: &mut StdRng, writer: u32, seq: &mut u64) -> Vec<(RecordId, felix_client::Record)> {
    let count = if rng.random_bool(0.5) {
        1
    } else {
        rng.random_range(2..=BATCH_MAX)
    };
    (0..count)
        .map(|_| {
            let id = RecordId { writer, seq: *seq };
            *seq += 1;
            let len = if rng.random_ratio(1, LARGE_ONE_IN) {
                rng.random_range(record::HEADER_BYTES..=LARGE_PAYLOAD_MAX)
            } else {
                rng.random_range(record::HEADER_BYTES..=SMALL_PAYLOAD_MAX)
            };
            (id, record::make(id, len))
        })
        .collect()
}

/// Whether a stream's deletion has started (short-lived streams), so `stream_not_found` is
/// expected on it.
type Deleting = Option<Arc<AtomicBool>>;

fn deleting(flag: &Deleting) -> bool {
    flag.as_ref().is_some_and(|f| f.load(Ordering::SeqCst))
}

/// An acked publisher on `stream`; reconnects every few seconds. Ends when the soak stops or,
/// on a short-lived stream, once it is deleted.
async fn acked_publisher(
    soak: Arc<Soak>,
    stream: String,
    shards: u32,
    durable: bool,
    gone: Deleting,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let writer = soak.next_writer.fetch_add(1, Ordering::SeqCst);
    let mut seq = 0u64;
    let who = format!("acked publisher {writer} on {stream}");
    while !soak.stopping() {
        let Some(client) = soak.connect(&who).await else {
            nap(&soak, Duration::from_millis(200)).await;
            continue;
        };
        let session_end = Instant::now() + draw(&mut rng, PUBLISHER_SESSION);
        type InFlight = (felix_client::PendingAck, Vec<RecordId>);
        let mut window: VecDeque<InFlight> = VecDeque::new();
        let mut ended = false;
        while !ended && !soak.stopping() && Instant::now() < session_end {
            while window.len() < IN_FLIGHT {
                let records = batch(&mut rng, writer, &mut seq);
                let (ids, records): (Vec<_>, Vec<_>) = records.into_iter().unzip();
                match tokio::time::timeout(OP_DEADLINE, client.publish_pipelined(&stream, &records))
                    .await
                {
                    Ok(Ok(pending)) => {
                        soak.published
                            .fetch_add(ids.len() as u64, Ordering::Relaxed);
                        window.push_back((pending, ids));
                    }
                    Ok(Err(error)) => {
                        let expected =
                            deleting(&gone) && error.code() == Some(ErrorCode::StreamNotFound);
                        soak.error(&who, &error, expected);
                        ended = true;
                        break;
                    }
                    Err(_) => {
                        soak.timeout(&who);
                        ended = true;
                        break;
                    }
                }
            }
            let Some((pending, ids)) = window.pop_front() else {
                break;
            };
            if !settle(&soak, &who, &stream, shards, durable, &gone, pending, &ids).await {
                ended = true;
            }
            tokio::time::sleep(rng.random_range(Duration::ZERO..PUBLISH_PAUSE_MAX)).await;
        }
        // Whatever is still in flight is answered before the client closes.
        while let Some((pending, ids)) = window.pop_front() {
            settle(&soak, &who, &stream, shards, durable, &gone, pending, &ids).await;
        }
        let _ = tokio::time::timeout(OP_DEADLINE, client.close()).await;
        if gone.is_some() && (ended || deleting(&gone)) {
            return;
        }
        soak.publisher_reconnects.fetch_add(1, Ordering::Relaxed);
    }
}

/// Waits for one ack; returns false when the publisher should stop (its stream is gone or
/// the connection failed).
#[allow(clippy::too_many_arguments)] // one publish's whole context
async fn settle(
    soak: &Soak,
    who: &str,
    stream: &str,
    shards: u32,
    durable: bool,
    gone: &Deleting,
    pending: felix_client::PendingAck,
    ids: &[RecordId],
) -> bool {
    match tokio::time::timeout(OP_DEADLINE, pending).await {
        Ok(Ok(acks)) => {
            soak.acked.fetch_add(ids.len() as u64, Ordering::Relaxed);
            if durable && gone.is_none() {
                let mut state = soak.state();
                let shards_model = state
                    .acked
                    .entry(stream.to_owned())
                    .or_insert_with(|| (0..shards).map(|_| Vec::new()).collect());
                for ack in acks {
                    let on_shard = ids.iter().copied().filter(|id| {
                        felix_wire::shard_for_key(&record::key(*id), shards) == ack.shard
                    });
                    for (i, id) in on_shard.enumerate() {
                        let at = usize::try_from(ack.first_offset + i as u64).unwrap_or(usize::MAX);
                        let Some(list) = shards_model.get_mut(ack.shard as usize) else {
                            continue;
                        };
                        if list.len() <= at {
                            list.resize(at + 1, None);
                        }
                        list[at] = Some(id);
                    }
                }
            }
            true
        }
        Ok(Err(error)) => {
            let code = error.code();
            let expected = code == Some(ErrorCode::IngressBudgetExhausted)
                || (deleting(gone) && code == Some(ErrorCode::StreamNotFound));
            soak.error(who, &error, expected);
            code == Some(ErrorCode::IngressBudgetExhausted)
        }
        Err(_) => {
            soak.timeout(who);
            false
        }
    }
}

/// A fire-and-forget publisher on `stream`; reconnects every few seconds.
async fn faf_publisher(soak: Arc<Soak>, stream: String, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let writer = soak.next_writer.fetch_add(1, Ordering::SeqCst);
    let mut seq = 0u64;
    let who = format!("fire-and-forget publisher {writer} on {stream}");
    while !soak.stopping() {
        let Some(client) = soak.connect(&who).await else {
            nap(&soak, Duration::from_millis(200)).await;
            continue;
        };
        let session_end = Instant::now() + draw(&mut rng, PUBLISHER_SESSION);
        while !soak.stopping() && Instant::now() < session_end {
            let (_, records): (Vec<_>, Vec<_>) =
                batch(&mut rng, writer, &mut seq).into_iter().unzip();
            match tokio::time::timeout(OP_DEADLINE, client.publish_no_ack(&stream, &records)).await
            {
                Ok(Ok(())) => {
                    soak.published
                        .fetch_add(records.len() as u64, Ordering::Relaxed);
                    soak.faf.fetch_add(records.len() as u64, Ordering::Relaxed);
                }
                Ok(Err(error)) => {
                    soak.error(&who, &error, false);
                    break;
                }
                Err(_) => {
                    soak.timeout(&who);
                    break;
                }
            }
            tokio::time::sleep(rng.random_range(Duration::ZERO..PUBLISH_PAUSE_MAX)).await;
        }
        let _ = tokio::time::timeout(OP_DEADLINE, client.close()).await;
        soak.publisher_reconnects.fetch_add(1, Ordering::Relaxed);
    }
}

/// How a subscriber behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// Reads all the time.
    Live,
    /// Stops reading now and then (until the broker ends it as lagged).
    Lagging,
    /// Closes its client every few seconds and resumes from its last offsets.
    Reconnecting,
}

/// The resume positions of a `subscriber_lagged` message (`... shard:next_offset s:o ...`).
fn lag_positions(message: &str) -> Vec<(u32, u64)> {
    let tail = message
        .split_once("shard:next_offset")
        .map_or("", |(_, tail)| tail);
    tail.split_whitespace()
        .filter_map(|token| {
            let (shard, offset) = token.split_once(':')?;
            Some((shard.parse().ok()?, offset.parse().ok()?))
        })
        .collect()
}

/// One logical subscriber of one stream: its positions survive resubscriptions and
/// reconnects, and every delivery is checked against them.
struct Positions {
    /// Next offset expected per shard.
    next: HashMap<u32, u64>,
    /// The current subscription started from `Earliest` after a `too_old` refusal: records
    /// below `next` were asked for again and are skipped, not counted as duplicates.
    skip_below: bool,
}

impl Positions {
    /// Takes the first offsets of a new subscription: later than asked is a gap the broker
    /// declared; earlier would deliver records twice.
    fn started(&mut self, soak: &Soak, who: &str, start: &[(u32, u64)]) {
        for &(shard, first) in start {
            if let Some(&want) = self.next.get(&shard) {
                if first > want {
                    soak.declared_gaps.fetch_add(1, Ordering::Relaxed);
                } else if first < want {
                    if !self.skip_below {
                        soak.violation(format!(
                            "{who}: shard {shard} resubscribed at {want} but starts at {first}"
                        ));
                    }
                    continue;
                }
            }
            self.next.insert(shard, first);
        }
    }

    fn delivered(&mut self, soak: &Soak, who: &str, r: &felix_client::DeliveredRecord) {
        if self.skip_below && self.next.get(&r.shard).is_some_and(|next| r.offset < *next) {
            return;
        }
        soak.delivered.fetch_add(1, Ordering::Relaxed);
        if let Err(why) = record::check(&r.key, &r.payload) {
            soak.state().corrupted += 1;
            soak.failure(format!(
                "{who}: damaged record at shard {} offset {}: {why}",
                r.shard, r.offset
            ));
        }
        match self.next.get(&r.shard).copied() {
            Some(want) if r.offset != want => soak.violation(format!(
                "{who}: shard {} delivered offset {} where {want} was next",
                r.shard, r.offset
            )),
            _ => {}
        }
        self.next.insert(r.shard, r.offset + 1);
    }

    /// The broker ended the subscription as lagged: resume where it says.
    fn lagged(&mut self, soak: &Soak, who: &str, message: &str) {
        for (shard, offset) in lag_positions(message) {
            let want = self.next.get(&shard).copied().unwrap_or(offset);
            if offset > want {
                soak.declared_gaps.fetch_add(1, Ordering::Relaxed);
                self.next.insert(shard, offset);
            } else if offset < want {
                soak.violation(format!(
                    "{who}: lagged at shard {shard} resume {offset}, but {want} was next"
                ));
            }
        }
    }

    fn from(&self) -> StartPosition {
        if self.skip_below {
            StartPosition::Earliest
        } else if self.next.is_empty() {
            StartPosition::Latest
        } else {
            let mut positions: Vec<(u32, u64)> = self.next.iter().map(|(s, o)| (*s, *o)).collect();
            positions.sort_unstable();
            StartPosition::Offsets(positions)
        }
    }
}

/// A subscriber of `stream` in `style`. Ends when the soak stops or, on a short-lived stream,
/// once the stream is deleted.
async fn subscriber(soak: Arc<Soak>, stream: String, style: Style, gone: Deleting, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let who = format!("{style:?} subscriber of {stream}");
    let mut positions = Positions {
        next: HashMap::new(),
        skip_below: false,
    };
    // Short-lived streams are read from the start.
    let mut first_from = gone.as_ref().map(|_| StartPosition::Earliest);
    while !soak.stopping() {
        let Some(client) = soak.connect(&who).await else {
            nap(&soak, Duration::from_millis(200)).await;
            continue;
        };
        let session_end = Instant::now() + draw(&mut rng, SUBSCRIBER_SESSION);
        let mut ended = false;
        while !soak.stopping() && !ended {
            if style == Style::Reconnecting && Instant::now() >= session_end {
                break;
            }
            let from = first_from.take().unwrap_or_else(|| positions.from());
            let opened = tokio::time::timeout(
                OP_DEADLINE,
                client.subscribe(&stream, ShardSelection::All, from),
            )
            .await;
            let mut subscription = match opened {
                Ok(Ok(subscription)) => subscription,
                Ok(Err(error)) if error.code() == Some(ErrorCode::TooOld) => {
                    // The ring moved past a position: read from the oldest record still held
                    // (a gap the broker declared), skipping what was delivered already.
                    soak.error(&who, &error, true);
                    positions.skip_below = true;
                    continue;
                }
                Ok(Err(error)) => {
                    let expected =
                        deleting(&gone) && error.code() == Some(ErrorCode::StreamNotFound);
                    soak.error(&who, &error, expected);
                    ended = gone.is_some();
                    if !ended {
                        nap(&soak, Duration::from_millis(200)).await;
                    }
                    break;
                }
                Err(_) => {
                    soak.timeout(&who);
                    break;
                }
            };
            positions.started(&soak, &who, subscription.start());
            ended = read(
                &soak,
                &mut subscription,
                &mut positions,
                &who,
                style,
                &gone,
                session_end,
                &mut rng,
            )
            .await;
            positions.skip_below = false;
            subscription.close().await;
        }
        let _ = tokio::time::timeout(OP_DEADLINE, client.close()).await;
        if ended && gone.is_some() {
            return;
        }
        if style == Style::Reconnecting {
            nap(&soak, rng.random_range(Duration::ZERO..OFFLINE_MAX)).await;
        }
        soak.subscriber_reconnects.fetch_add(1, Ordering::Relaxed);
    }
}

/// Reads one subscription until the session ends, the broker ends it, or the soak stops.
/// Returns true when the subscriber is done for good (its short-lived stream is gone).
#[allow(clippy::too_many_arguments)] // one subscription's whole context
async fn read(
    soak: &Soak,
    subscription: &mut Subscription,
    positions: &mut Positions,
    who: &str,
    style: Style,
    gone: &Deleting,
    session_end: Instant,
    rng: &mut StdRng,
) -> bool {
    let mut stall_at = Instant::now() + draw(rng, LAG_READ);
    loop {
        if soak.stopping() {
            return false;
        }
        if style == Style::Reconnecting && Instant::now() >= session_end {
            return false;
        }
        if style == Style::Lagging && Instant::now() >= stall_at {
            // Stop reading: the broker's queue for this subscription fills up.
            nap(soak, draw(rng, LAG_STALL)).await;
            stall_at = Instant::now() + draw(rng, LAG_READ);
        }
        match tokio::time::timeout(POLL, subscription.next()).await {
            Err(_) => {}
            Ok(Some(Ok(r))) => positions.delivered(soak, who, &r),
            Ok(Some(Err(error))) => {
                let code = error.code();
                if code == Some(ErrorCode::SubscriberLagged) {
                    soak.error(who, &error, true);
                    if let ClientError::Server { message, .. } = &error {
                        positions.lagged(soak, who, message);
                    }
                    return false;
                }
                let expected = deleting(gone) && code == Some(ErrorCode::StreamNotFound);
                soak.error(who, &error, expected);
                return gone.is_some();
            }
            Ok(None) => {
                if !deleting(gone) {
                    soak.failure(format!("{who}: the subscription ended without an error"));
                }
                return gone.is_some();
            }
        }
    }
}

/// Creates, uses and deletes short-lived streams until the soak stops.
async fn churner(soak: Arc<Soak>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(admin) = soak.connect("churn admin").await else {
        return;
    };
    let mut n = 0u64;
    while !soak.stopping() {
        nap(&soak, draw(&mut rng, CHURN_PAUSE)).await;
        if soak.stopping() {
            break;
        }
        let name = format!("soak-churn-{n}");
        n += 1;
        let kind = if rng.random_bool(0.5) {
            StreamKind::Durable
        } else {
            StreamKind::InMemory
        };
        match tokio::time::timeout(OP_DEADLINE, admin.create_stream(&name, CHURN_SHARDS, kind))
            .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                soak.error("churn create", &error, false);
                continue;
            }
            Err(_) => {
                soak.timeout("churn create");
                continue;
            }
        }
        soak.streams_created.fetch_add(1, Ordering::Relaxed);
        let flag = Arc::new(AtomicBool::new(false));
        let tasks = [
            tokio::spawn(acked_publisher(
                Arc::clone(&soak),
                name.clone(),
                CHURN_SHARDS,
                kind == StreamKind::Durable,
                Some(Arc::clone(&flag)),
                rng.random(),
            )),
            tokio::spawn(subscriber(
                Arc::clone(&soak),
                name.clone(),
                Style::Live,
                Some(Arc::clone(&flag)),
                rng.random(),
            )),
        ];
        nap(&soak, draw(&mut rng, CHURN_LIFE)).await;
        flag.store(true, Ordering::SeqCst);
        match tokio::time::timeout(OP_DEADLINE, admin.delete_stream(&name)).await {
            Ok(Ok(())) => {
                soak.streams_deleted.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(error)) => soak.error("churn delete", &error, false),
            Err(_) => soak.timeout("churn delete"),
        }
        for task in tasks {
            let abort = task.abort_handle();
            if tokio::time::timeout(DELETED_END_DEADLINE, task)
                .await
                .is_err()
            {
                abort.abort();
                if !soak.stopping() {
                    soak.failure(format!(
                        "a worker on deleted stream {name} did not end within {DELETED_END_DEADLINE:?}"
                    ));
                }
            }
        }
    }
    let _ = tokio::time::timeout(OP_DEADLINE, admin.close()).await;
}

/// Reads every durable stream back and checks the acked records. Returns (acked, read, lost).
async fn read_back(soak: &Soak) -> Result<(u64, u64, u64), CampaignError> {
    let client = Client::connect(soak.config.clone())
        .await
        .map_err(|e| CampaignError::client("read-back connect", e))?;
    let acked = std::mem::take(&mut soak.state().acked);
    let (mut acked_total, mut read_total, mut lost) = (0u64, 0u64, 0u64);
    let deadline = Instant::now() + READ_BACK_DEADLINE;
    for (name, _, durable) in STREAMS {
        if !durable {
            continue;
        }
        let info = tokio::time::timeout(OP_DEADLINE, client.describe_stream(name))
            .await
            .map_err(|_| CampaignError::Timeout(format!("describe {name}")))?
            .map_err(|e| CampaignError::client(format!("describe {name}"), e))?;
        let want: u64 = info
            .shards
            .iter()
            .map(|s| s.next_offset - s.oldest_offset)
            .sum();
        let mut content: HashMap<(u32, u64), RecordId> = HashMap::new();
        if want > 0 {
            let mut subscription = tokio::time::timeout(
                OP_DEADLINE,
                client.subscribe(name, ShardSelection::All, StartPosition::Earliest),
            )
            .await
            .map_err(|_| CampaignError::Timeout(format!("subscribe {name}")))?
            .map_err(|e| CampaignError::client(format!("read-back subscribe {name}"), e))?;
            let mut got = 0u64;
            while got < want {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .min(OP_DEADLINE);
                match tokio::time::timeout(left, subscription.next()).await {
                    Ok(Some(Ok(r))) => {
                        got += 1;
                        match record::check(&r.key, &r.payload) {
                            Ok(id) => {
                                content.insert((r.shard, r.offset), id);
                            }
                            Err(why) => {
                                soak.state().corrupted += 1;
                                soak.failure(format!(
                                    "read-back of {name}: shard {} offset {}: {why}",
                                    r.shard, r.offset
                                ));
                            }
                        }
                    }
                    Ok(Some(Err(error))) => {
                        return Err(CampaignError::client(format!("read-back of {name}"), error));
                    }
                    Ok(None) | Err(_) => {
                        soak.failure(format!(
                            "read-back of {name} stopped after {got} of {want} records"
                        ));
                        break;
                    }
                }
            }
            subscription.close().await;
            read_total += got;
        }
        let Some(shards) = acked.get(name) else {
            continue;
        };
        for (shard, list) in shards.iter().enumerate() {
            for (offset, id) in list.iter().enumerate() {
                let Some(id) = id else { continue };
                acked_total += 1;
                let at = (shard as u32, offset as u64);
                if content.get(&at) != Some(id) {
                    lost += 1;
                    soak.failure(format!(
                        "acked {id} of {name} shard {shard} offset {offset} is missing (found {:?})",
                        content.get(&at)
                    ));
                }
            }
        }
    }
    client.close().await;
    Ok((acked_total, read_total, lost))
}

/// Runs a soak. `Err` for what stops it from running at all (no broker, no temp dir).
pub fn run(config: &SoakConfig) -> Result<SoakReport, CampaignError> {
    if config.duration.is_zero() || config.duration > DURATION_MAX {
        return Err(CampaignError::Invalid(format!(
            "duration must be between 1 s and {DURATION_MAX:?}"
        )));
    }
    let mut builder = tempfile::Builder::new();
    builder.prefix("felix-soak-");
    let work = match &config.work_parent {
        Some(parent) => builder.tempdir_in(parent),
        None => builder.tempdir(),
    }
    .map_err(|e| CampaignError::io("cannot make a temporary directory", "felix-soak-", e))?;
    let data_dir = work.path().join("data");
    std::fs::create_dir_all(&data_dir)
        .map_err(|e| CampaignError::io("cannot create", &data_dir, e))?;
    let options = BrokerOptions {
        felix: config.felix.clone(),
        data_dir,
        env: [
            ("FELIX_DURABLE_FSYNC_MODE", "on_commit"),
            ("FELIX_DURABLE_SEGMENT_BYTES", SEGMENT_BYTES),
            (
                "FELIX_SUBSCRIBER_QUEUE_MAX_BYTES",
                SUBSCRIBER_QUEUE_MAX_BYTES,
            ),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect(),
        log: work.path().join("broker.log"),
    };
    let mut broker = Broker::start(&options)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CampaignError::io("cannot start a runtime", "tokio", e))?;
    let soak = Arc::new(Soak {
        stop: AtomicBool::new(false),
        started: Instant::now(),
        published: AtomicU64::new(0),
        acked: AtomicU64::new(0),
        faf: AtomicU64::new(0),
        delivered: AtomicU64::new(0),
        declared_gaps: AtomicU64::new(0),
        streams_created: AtomicU64::new(0),
        streams_deleted: AtomicU64::new(0),
        publisher_reconnects: AtomicU64::new(0),
        subscriber_reconnects: AtomicU64::new(0),
        next_writer: AtomicU32::new(0),
        state: Mutex::new(State::default()),
        config: broker.client_config("felix-soak"),
    });
    // Resident memory, sampled on a thread of its own until the workload stops.
    let pid = broker.pid();
    let sampler = {
        let soak = Arc::clone(&soak);
        std::thread::spawn(move || {
            let (mut min, mut max, mut samples) = (u64::MAX, 0u64, 0u64);
            while !soak.stopping() {
                if let Some(rss) = crate::broker::rss_bytes(pid) {
                    min = min.min(rss);
                    max = max.max(rss);
                    samples += 1;
                }
                std::thread::sleep(RSS_SAMPLE_EVERY);
            }
            (min, max, samples)
        })
    };
    let mut rng = StdRng::seed_from_u64(config.seed);
    let outcome = runtime.block_on(async {
        let admin = Client::connect(soak.config.clone())
            .await
            .map_err(|e| CampaignError::client("admin connect", e))?;
        for (name, shards, durable) in STREAMS {
            let kind = if durable {
                StreamKind::Durable
            } else {
                StreamKind::InMemory
            };
            admin
                .create_stream(name, shards, kind)
                .await
                .map_err(|e| CampaignError::client(format!("create {name}"), e))?;
        }
        admin.close().await;
        let mut tasks = Vec::new();
        for (name, shards, durable) in STREAMS {
            let name = name.to_owned();
            let s = || Arc::clone(&soak);
            // Subscribers first, so `Latest` starts before the publishers.
            tasks.push(tokio::spawn(subscriber(s(), name.clone(), Style::Live, None, rng.random())));
            let other = if name.ends_with('0') {
                Style::Lagging
            } else {
                Style::Reconnecting
            };
            tasks.push(tokio::spawn(subscriber(s(), name.clone(), other, None, rng.random())));
            tasks.push(tokio::spawn(acked_publisher(
                s(),
                name.clone(),
                shards,
                durable,
                None,
                rng.random(),
            )));
            // Fire-and-forget on one stream of each kind.
            if name.ends_with('1') || (durable && name.ends_with('0')) {
                tasks.push(tokio::spawn(faf_publisher(s(), name.clone(), rng.random())));
            }
        }
        tasks.push(tokio::spawn(churner(Arc::clone(&soak), rng.random())));
        let end = Instant::now() + config.duration;
        let mut next_progress = Instant::now() + PROGRESS_EVERY;
        while Instant::now() < end {
            tokio::time::sleep(POLL).await;
            if broker.has_died() {
                soak.failure("the broker died during the soak".to_owned());
                break;
            }
            if config.progress && Instant::now() >= next_progress {
                next_progress += PROGRESS_EVERY;
                eprintln!(
                    "soak {:.0} s: published {}, acked {}, delivered {}, RSS {:.1} MiB, errors {:?}",
                    soak.started.elapsed().as_secs_f64(),
                    soak.published.load(Ordering::Relaxed),
                    soak.acked.load(Ordering::Relaxed),
                    soak.delivered.load(Ordering::Relaxed),
                    crate::broker::rss_bytes(pid).unwrap_or(0) as f64 / f64::from(1u32 << 20),
                    soak.state().errors
                );
            }
        }
        soak.stop.store(true, Ordering::SeqCst);
        let drain_end = Instant::now() + DRAIN_DEADLINE;
        for task in tasks {
            let abort = task.abort_handle();
            let left = drain_end.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, task).await.is_err() {
                abort.abort();
            }
        }
        if broker.has_died() {
            return Ok((0, 0, 0));
        }
        read_back(&soak).await
    });
    let (rss_min, rss_max, rss_samples) = sampler.join().unwrap_or((0, 0, 0));
    if let Some(status) = broker.exited() {
        soak.failure(format!(
            "the broker exited ({status}); log:\n{}",
            crate::broker::log_tail(broker.log())
        ));
    }
    let (durable_acked, durable_read_back, lost) = match outcome {
        Ok(counts) => counts,
        Err(error) => {
            soak.failure(format!("read-back: {error}"));
            (0, 0, 0)
        }
    };
    drop(broker);
    let state = soak.state();
    let report = SoakReport {
        seconds: config.duration.as_secs(),
        seed: config.seed,
        published: soak.published.load(Ordering::Relaxed),
        acked: soak.acked.load(Ordering::Relaxed),
        fire_and_forget: soak.faf.load(Ordering::Relaxed),
        delivered: soak.delivered.load(Ordering::Relaxed),
        rss_min: if rss_samples == 0 { 0 } else { rss_min },
        rss_max,
        rss_bound: config.rss_bound,
        rss_samples,
        errors: state.errors.clone(),
        unexpected: state.unexpected.clone(),
        durable_acked,
        durable_read_back,
        lost,
        order_violations: state.order_violations,
        corrupted: state.corrupted,
        declared_gaps: soak.declared_gaps.load(Ordering::Relaxed),
        streams_created: soak.streams_created.load(Ordering::Relaxed),
        streams_deleted: soak.streams_deleted.load(Ordering::Relaxed),
        publisher_reconnects: soak.publisher_reconnects.load(Ordering::Relaxed),
        subscriber_reconnects: soak.subscriber_reconnects.load(Ordering::Relaxed),
        failures: state.failures.clone(),
        error_samples: state.samples.clone(),
    };
    drop(state);
    if !report.passed() {
        let kept = work.keep();
        eprintln!("soak: run directory kept: {}", kept.display());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::lag_positions;

    #[test]
    fn lag_message_positions_parse() {
        // Proves the resume positions are read from the broker's subscriber_lagged message, truncated or not.
        let message = "subscriber fell behind live delivery (over 262144 payload bytes or 65536 records queued); resume from shard:next_offset 0:17 2:40 ...";
        assert_eq!(lag_positions(message), vec![(0, 17), (2, 40)]);
        assert_eq!(lag_positions("no positions"), Vec::new());
    }
}
