//! The crash campaign: durable streams (FELIX_DURABLE_FSYNC_MODE=on_commit, small segments)
//! under acked load from several publishers (each its own connection, batches and single
//! records, keys over every shard) with live subscribers; the broker is SIGKILLed at a
//! moment drawn from a seeded RNG, restarted on the same data directory, and audited after
//! every restart:
//!
//! - every acknowledged record is present exactly once, at the offset its ack gave, in its
//!   publisher's order, byte for byte (payloads are self-describing, [`crate::record`]);
//! - offsets are dense per shard (from 0: no retention here);
//! - every record any subscriber received (the live ones before the kill, and every earlier
//!   audit) is still present at the same offset and identical: a subscriber only ever sees
//!   durable records;
//! - records never acked may or may not be present, but at most once, never at an acked
//!   record's offset, and never a record that was not sent.
//!
//! Kill moments, one per cycle: a random delay under load (appends and fsync rounds run all
//! the time under on_commit load), right after a random ack (the next group-commit round is
//! in flight), right after a new segment file appears (during a roll: creation,
//! preallocation, header fsync, rename, the first appends into it); and, in some cycles, an
//! extra kill during or right after start-up (recovery, binding) before the restart that is
//! audited. Each start picks the io_uring or the pwrite writer.
//!
//! Publishers keep their sequence numbers across restarts (they reconnect and continue; what
//! was in flight at the kill is not resent). The RNG decides the plan (modes, delays, batch
//! shapes); thread timing decides the rest, so a seed replays the plan, not the interleaving.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use felix_client::{
    Client, ClientError, DeliveredRecord, ErrorCode, ShardAck, ShardSelection, StartPosition,
    StreamKind,
};
use futures::StreamExt as _;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use crate::CampaignError;
use crate::broker::{Broker, BrokerOptions, KillSwitch};
use crate::record::{self, RecordId};

/// The durable streams and their shard counts: several streams, shard counts that are not
/// multiples of the core count, so every core owns shards of every stream.
const STREAMS: [(&str, u32); 3] = [("crash-a", 3), ("crash-b", 4), ("crash-c", 7)];
/// An in-memory stream made and published to in every cycle: nothing of it may survive a
/// restart (docs/semantics.md, 2 Data model).
const MEMORY_STREAM: &str = "crash-mem";
/// Publishers, each with its own client (connections) and its own sequence numbers.
const PUBLISHERS: u32 = 4;
/// Segment size: small, so segments roll about once a cycle at this campaign's data rate
/// (~300 KB a cycle; the 4 MiB the tests use would roll once in ~15 cycles).
const SEGMENT_BYTES: &str = "256KiB";
/// Most pipelined publishes a publisher keeps in flight (drawn 1..=this per cycle).
const IN_FLIGHT_MAX: usize = 4;
/// Largest batch; half the publishes are single records.
const BATCH_MAX: usize = 16;
/// Payload sizes: most records small (up to this), 1 in [`LARGE_ONE_IN`] up to
/// [`LARGE_PAYLOAD_MAX`], so rounds mix small and large writes.
const SMALL_PAYLOAD_MAX: usize = 300;
const LARGE_PAYLOAD_MAX: usize = 16 * 1024;
const LARGE_ONE_IN: u32 = 32;
/// Pause after each ack, drawn from 0..this: keeps the data per cycle (and so the audit,
/// which reads everything back after every restart, and the whole run) bounded while kills
/// still find appends in flight. Without it 4 publishers acked ~6,000 records/s here and a
/// 1,000-cycle run would audit millions of records per cycle by its end.
const PUBLISH_PAUSE_MAX: Duration = Duration::from_millis(20);
/// Delay-mode kills land uniformly in this window after the load started.
const DELAY_MIN: Duration = Duration::from_millis(5);
const DELAY_MAX: Duration = Duration::from_millis(1000);
/// Ack-mode kills fire after a random number of acks (in this cycle) up to this.
const ACK_TARGET_MAX: u64 = 150;
/// Roll-mode kills fire this long (drawn) after a new segment file appears, so they land in
/// different steps of the roll.
const ROLL_KILL_JITTER_MAX: Duration = Duration::from_micros(3000);
/// How often the segment watcher lists the log directories.
const ROLL_POLL: Duration = Duration::from_micros(250);
/// The latest a triggered kill (ack or roll mode) waits before firing anyway.
const LOAD_MAX: Duration = Duration::from_secs(5);
/// Share of cycles with an extra kill during or right after start-up, and its delay bound.
const STARTUP_KILL_ONE_IN: u32 = 6;
const STARTUP_KILL_DELAY_MAX: Duration = Duration::from_millis(60);
/// The catch-up subscriber starts at most this many records back per shard.
const CATCH_UP_BACK: u64 = 2000;
/// Deadline of each client operation (connect, subscribe, describe, an ack).
const OP_DEADLINE: Duration = Duration::from_secs(30);
/// Deadline of one audit (reading every stream back); generous for a long run's data.
const AUDIT_DEADLINE: Duration = Duration::from_secs(300);
/// Default bound of a whole run: a minute of set-up plus this per cycle (a cycle takes
/// 1-3 s here; far more means something hangs).
pub const RUN_BASE: Duration = Duration::from_secs(60);
pub const RUN_PER_CYCLE: Duration = Duration::from_secs(30);
/// Failure details kept for the report.
const FAILURE_DETAILS_MAX: usize = 20;
/// Unexpected client errors kept verbatim for the report.
const ERROR_SAMPLES_MAX: usize = 10;

/// What to run.
#[derive(Debug, Clone)]
pub struct CrashConfig {
    /// The `felix` binary.
    pub felix: PathBuf,
    /// Kill/restart cycles.
    pub cycles: u64,
    /// RNG seed (printed; the same seed replays the same plan).
    pub seed: u64,
    /// Bound of the whole run; when reached the run stops and fails.
    pub time_limit: Duration,
    /// Parent of the run's fresh temporary directory (default: the system's).
    pub work_parent: Option<PathBuf>,
    /// Print one line per cycle to stderr.
    pub progress: bool,
    /// FELIX_DURABLE_FSYNC_MODE: `on_commit` (the campaign's subject) or `periodic` (a
    /// process crash must lose nothing acked there either: the page cache survives it).
    pub fsync_mode: String,
}

impl CrashConfig {
    /// `cycles` cycles with the default time bound.
    #[must_use]
    pub fn new(felix: PathBuf, cycles: u64, seed: u64) -> CrashConfig {
        let per_cycle = u32::try_from(cycles).unwrap_or(u32::MAX);
        CrashConfig {
            felix,
            cycles,
            seed,
            time_limit: RUN_BASE + RUN_PER_CYCLE.saturating_mul(per_cycle),
            work_parent: None,
            progress: false,
            fsync_mode: "on_commit".to_owned(),
        }
    }
}

/// How the kills landed.
#[derive(Debug, Clone, Default)]
pub struct KillCounts {
    /// Random delay under load.
    pub delay: u64,
    /// Right after the n-th ack.
    pub after_ack: u64,
    /// Ack mode that reached [`LOAD_MAX`] first (killed then).
    pub after_ack_fallback: u64,
    /// Right after a new segment file appeared.
    pub roll: u64,
    /// Roll mode with no roll within [`LOAD_MAX`] (killed then).
    pub roll_fallback: u64,
    /// Extra kills during or right after start-up.
    pub startup: u64,
    /// Starts with the pwrite writer (the others used io_uring).
    pub pwrite_starts: u64,
}

/// The outcome of a campaign.
#[derive(Debug, Clone)]
pub struct CrashReport {
    pub cycles: u64,
    pub acked_records: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    pub seed: u64,
    pub elapsed: Duration,
    /// Records live subscribers received (all cycles).
    pub delivered_live: u64,
    /// Records the last audit read back.
    pub audited_last: u64,
    /// Acked publishes refused with `ingress_budget_exhausted` (allowed, never acked).
    pub refused: u64,
    pub kills: KillCounts,
    /// Client errors that are not the kill's doing (name -> count), with samples.
    pub unexpected_errors: HashMap<String, u64>,
    pub error_samples: Vec<String>,
    /// The first failures, in detail.
    pub failures: Vec<String>,
    /// Why the run stopped early (broker did not restart, time limit), if it did.
    pub aborted: Option<String>,
    /// The run's directory, kept when the run failed.
    pub kept_dir: Option<PathBuf>,
}

impl CrashReport {
    /// `cycles N, acked records A, lost L, duplicated D, reordered R, corrupted C, seed S, N s`
    #[must_use]
    pub fn summary_line(&self) -> String {
        format!(
            "cycles {}, acked records {}, lost {}, duplicated {}, reordered {}, corrupted {}, seed {}, {} s",
            self.cycles,
            self.acked_records,
            self.lost,
            self.duplicated,
            self.reordered,
            self.corrupted,
            self.seed,
            self.elapsed.as_secs()
        )
    }

    /// No loss, duplicate, reorder or corruption, every cycle ran, nothing unexpected.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.reordered == 0
            && self.corrupted == 0
            && self.aborted.is_none()
            && self.unexpected_errors.is_empty()
    }

    /// Everything beyond the summary line: kills, counters, errors, failures.
    #[must_use]
    pub fn details(&self) -> String {
        let k = &self.kills;
        let mut out = format!(
            "kills: delay {}, after ack {} (+{} at the load bound), segment roll {} (+{} with no roll), extra at start-up {}; pwrite starts {}\n\
             live subscribers received {} records; last audit read {}; publishes refused (ingress) {}\n",
            k.delay,
            k.after_ack,
            k.after_ack_fallback,
            k.roll,
            k.roll_fallback,
            k.startup,
            k.pwrite_starts,
            self.delivered_live,
            self.audited_last,
            self.refused
        );
        if !self.unexpected_errors.is_empty() {
            out.push_str(&format!(
                "unexpected errors: {:?}\n",
                self.unexpected_errors
            ));
            for sample in &self.error_samples {
                out.push_str(&format!("  {sample}\n"));
            }
        }
        if let Some(reason) = &self.aborted {
            out.push_str(&format!("ABORTED: {reason}\n"));
        }
        for failure in &self.failures {
            out.push_str(&format!("FAILURE: {failure}\n"));
        }
        if let Some(dir) = &self.kept_dir {
            out.push_str(&format!("run directory kept: {}\n", dir.display()));
        }
        out
    }
}

/// A place in the streams: (stream index, shard, offset).
type Loc = (usize, u32, u64);

/// What a finding is about (each counted once per run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Subject {
    Record(RecordId),
    At(Loc),
}

#[derive(Debug, Default)]
struct Findings {
    lost: HashSet<Subject>,
    duplicated: HashSet<Subject>,
    reordered: HashSet<Subject>,
    corrupted: HashSet<Subject>,
    details: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Lost,
    Duplicated,
    Reordered,
    Corrupted,
}

impl Findings {
    fn add(&mut self, kind: Kind, subject: Subject, detail: impl FnOnce() -> String) {
        let set = match kind {
            Kind::Lost => &mut self.lost,
            Kind::Duplicated => &mut self.duplicated,
            Kind::Reordered => &mut self.reordered,
            Kind::Corrupted => &mut self.corrupted,
        };
        if set.insert(subject) && self.details.len() < FAILURE_DETAILS_MAX {
            self.details.push(format!("{kind:?}: {}", detail()));
        }
    }
}

/// Everything the campaign knows about the streams.
#[derive(Debug)]
struct Model {
    names: Vec<String>,
    shard_counts: Vec<u32>,
    /// Every acked record and where its ack put it.
    acked: HashMap<RecordId, Loc>,
    /// Per stream, per shard, by offset: the record a subscriber (live or audit) received.
    seen: Vec<Vec<Vec<Option<RecordId>>>>,
    /// Per publisher: the next sequence number (all below were built, sent or not).
    next_seq: Vec<u64>,
    findings: Findings,
    delivered_live: u64,
    refused: u64,
    unexpected: HashMap<String, u64>,
    error_samples: Vec<String>,
    /// Cycle number, for messages.
    cycle: u64,
}

impl Model {
    fn new() -> Model {
        Model {
            names: STREAMS.iter().map(|(n, _)| (*n).to_owned()).collect(),
            shard_counts: STREAMS.iter().map(|(_, s)| *s).collect(),
            acked: HashMap::new(),
            seen: STREAMS
                .iter()
                .map(|(_, shards)| (0..*shards).map(|_| Vec::new()).collect())
                .collect(),
            next_seq: vec![0; PUBLISHERS as usize],
            findings: Findings::default(),
            delivered_live: 0,
            refused: 0,
            unexpected: HashMap::new(),
            error_samples: Vec::new(),
            cycle: 0,
        }
    }

    fn unexpected_error(&mut self, what: &str, error: &ClientError) {
        let name = match error.code() {
            Some(code) => code.name().to_owned(),
            None => format!("{what}: client error"),
        };
        *self.unexpected.entry(name).or_default() += 1;
        if self.error_samples.len() < ERROR_SAMPLES_MAX {
            self.error_samples
                .push(format!("cycle {}: {what}: {error}", self.cycle));
        }
    }

    /// Records the acks of one publish: the records of each shard, in batch order, got
    /// `first_offset..first_offset + count`.
    fn acked(&mut self, stream: usize, ids: &[RecordId], acks: &[ShardAck]) {
        let shards = self.shard_counts[stream];
        let cycle = self.cycle;
        for ack in acks {
            let on_shard: Vec<RecordId> = ids
                .iter()
                .copied()
                .filter(|id| felix_wire::shard_for_key(&record::key(*id), shards) == ack.shard)
                .collect();
            if on_shard.len() != ack.count as usize {
                let first = (stream, ack.shard, ack.first_offset);
                self.findings.add(Kind::Reordered, Subject::At(first), || {
                    format!(
                        "cycle {cycle}: an ack gives shard {} of {} {} offsets for {} records",
                        ack.shard,
                        self.names[stream],
                        ack.count,
                        on_shard.len()
                    )
                });
            }
            for (i, id) in on_shard.into_iter().enumerate() {
                let loc = (stream, ack.shard, ack.first_offset + i as u64);
                if let Some(before) = self.acked.insert(id, loc) {
                    let name = &self.names[stream];
                    self.findings
                        .add(Kind::Duplicated, Subject::Record(id), || {
                            format!(
                                "cycle {cycle}: {id} acked twice ({before:?}, then {name} {loc:?})"
                            )
                        });
                }
            }
        }
    }

    /// A record a live subscriber received, `expected` its subscription's next offset on the
    /// record's shard.
    fn delivered(&mut self, stream: usize, r: &DeliveredRecord, expected: &mut HashMap<u32, u64>) {
        self.delivered_live += 1;
        let loc = (stream, r.shard, r.offset);
        let cycle = self.cycle;
        let name = self.names[stream].clone();
        let Some(next) = expected.get(&r.shard).copied() else {
            self.findings.add(Kind::Corrupted, Subject::At(loc), || {
                format!(
                    "cycle {cycle}: a subscriber of {name} got shard {} offset {}, a shard it did not subscribe to",
                    r.shard, r.offset
                )
            });
            return;
        };
        if r.offset != next {
            self.findings.add(Kind::Reordered, Subject::At(loc), || {
                format!(
                    "cycle {cycle}: a live subscriber of {name} shard {} got offset {} where {next} was next",
                    r.shard, r.offset
                )
            });
        }
        expected.insert(r.shard, r.offset + 1);
        match record::check(&r.key, &r.payload) {
            Ok(id) => self.see(loc, id, "a live subscriber"),
            Err(why) => self.findings.add(Kind::Corrupted, Subject::At(loc), || {
                format!(
                    "cycle {cycle}: a live subscriber got a damaged record at {name} shard {} offset {}: {why}",
                    r.shard, r.offset
                )
            }),
        }
    }

    /// Remembers that a subscriber received `id` at `loc`; a different record seen there
    /// before is a finding.
    fn see(&mut self, loc: Loc, id: RecordId, who: &str) {
        let (stream, shard, offset) = loc;
        let Ok(at) = usize::try_from(offset) else {
            return;
        };
        let Some(slots) = self
            .seen
            .get_mut(stream)
            .and_then(|shards| shards.get_mut(shard as usize))
        else {
            // A shard the stream does not have: the delivery check already reports it.
            return;
        };
        if slots.len() <= at {
            slots.resize(at + 1, None);
        }
        match slots[at] {
            None => slots[at] = Some(id),
            Some(before) if before == id => {}
            Some(before) => {
                let cycle = self.cycle;
                let name = &self.names[stream];
                self.findings.add(Kind::Lost, Subject::Record(before), || {
                    format!(
                        "cycle {cycle}: {who} got {id} at {name} shard {shard} offset {offset}, where {before} was received before"
                    )
                });
            }
        }
    }
}

fn lock(model: &Mutex<Model>) -> MutexGuard<'_, Model> {
    // A panicking task cannot leave the model half-updated in a way the audit relies on
    // (each update is a few inserts); keep going with it.
    model.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One stream as read back by an audit: per shard, by offset, the record (or what is wrong
/// with it; `None` for a hole).
type Content = Vec<Vec<Option<Result<RecordId, String>>>>;

/// Reads every stream back from the earliest offset and checks it against the model.
/// Returns the number of records read.
async fn audit(broker: &Broker, model: &Mutex<Model>) -> Result<u64, CampaignError> {
    let client = connect(broker, "felix-crash-audit").await?;
    let mut total = 0u64;
    let names = lock(model).names.clone();
    for (stream, name) in names.iter().enumerate() {
        let info = match within("describe", client.describe_stream(name)).await? {
            Ok(info) => Some(info),
            Err(error) if error.code() == Some(ErrorCode::StreamNotFound) => None,
            Err(error) => return Err(CampaignError::client(format!("describe {name}"), error)),
        };
        let shards = lock(model).shard_counts[stream];
        let mut content: Content = (0..shards).map(|_| Vec::new()).collect();
        let cycle = lock(model).cycle;
        let Some(info) = info else {
            let mut m = lock(model);
            let gone: Vec<RecordId> = m
                .acked
                .iter()
                .filter(|(_, loc)| loc.0 == stream)
                .map(|(id, _)| *id)
                .collect();
            for id in gone {
                m.findings.add(Kind::Lost, Subject::Record(id), || {
                    format!("cycle {cycle}: stream {name} is gone after the restart")
                });
            }
            continue;
        };
        let mut want: u64 = 0;
        let mut holes = Vec::new();
        for shard in &info.shards {
            if shard.oldest_offset > 0 {
                holes.push((shard.shard, 0, shard.oldest_offset));
            }
            want += shard.next_offset;
        }
        let mut next: Vec<u64> = vec![0; shards as usize];
        let ends: Vec<u64> = info.shards.iter().map(|s| s.next_offset).collect();
        if want > 0 {
            let mut subscription = within(
                "subscribe",
                client.subscribe(name, ShardSelection::All, StartPosition::Earliest),
            )
            .await?
            .map_err(|e| CampaignError::client(format!("audit subscribe {name}"), e))?;
            let deadline = Instant::now() + AUDIT_DEADLINE;
            let mut received = 0u64;
            // Offsets below `oldest` never come: count them as read (they are holes).
            let mut accounted: u64 = info.shards.iter().map(|s| s.oldest_offset).sum();
            for s in &info.shards {
                next[s.shard as usize] = s.oldest_offset;
            }
            while accounted < want {
                let left = deadline.saturating_duration_since(Instant::now());
                let item = tokio::time::timeout(left.min(OP_DEADLINE), subscription.next()).await;
                let r = match item {
                    Ok(Some(Ok(r))) => r,
                    Ok(Some(Err(error))) => {
                        return Err(CampaignError::client(
                            format!("audit read of {name} after {received} records"),
                            error,
                        ));
                    }
                    Ok(None) | Err(_) => break,
                };
                received += 1;
                let Some(slot) = next.get_mut(r.shard as usize) else {
                    continue;
                };
                let expected = *slot;
                let end = ends.get(r.shard as usize).copied().unwrap_or(0);
                if r.offset < expected || r.offset >= end {
                    let loc = (stream, r.shard, r.offset);
                    lock(model)
                        .findings
                        .add(Kind::Reordered, Subject::At(loc), || {
                            format!(
                                "cycle {cycle}: the audit of {name} shard {} got offset {} where {expected} was next (end {})",
                                r.shard, r.offset, end
                            )
                        });
                    continue;
                }
                if r.offset > expected {
                    holes.push((r.shard, expected, r.offset));
                }
                accounted += r.offset + 1 - expected;
                *slot = r.offset + 1;
                let list = &mut content[r.shard as usize];
                let at = usize::try_from(r.offset).unwrap_or(usize::MAX);
                if list.len() < at {
                    list.resize(at, None);
                }
                list.push(Some(record::check(&r.key, &r.payload)));
            }
            subscription.close().await;
            total += received;
        }
        for (shard, end) in ends.iter().enumerate() {
            if next[shard] < *end {
                holes.push((shard as u32, next[shard], *end));
            }
        }
        check_stream(&mut lock(model), stream, &content, &holes);
    }
    // In-memory streams do not survive a restart.
    match within("describe", client.describe_stream(MEMORY_STREAM)).await? {
        Err(error) if error.code() == Some(ErrorCode::StreamNotFound) => {}
        other => {
            let mut m = lock(model);
            let cycle = m.cycle;
            *m.unexpected
                .entry("in_memory_survived".to_owned())
                .or_default() += 1;
            if m.error_samples.len() < ERROR_SAMPLES_MAX {
                m.error_samples.push(format!(
                    "cycle {cycle}: in-memory stream {MEMORY_STREAM} after a restart: {other:?}"
                ));
            }
        }
    }
    client.close().await;
    Ok(total)
}

/// The audit's checks of one stream read back (`holes`: offsets `[from, to)` of a shard the
/// broker did not deliver).
fn check_stream(m: &mut Model, stream: usize, content: &Content, holes: &[(u32, u64, u64)]) {
    let cycle = m.cycle;
    let name = m.names[stream].clone();
    let shards = m.shard_counts[stream];
    for &(shard, from, to) in holes {
        for offset in from..to {
            let loc = (stream, shard, offset);
            m.findings.add(Kind::Lost, Subject::At(loc), || {
                format!("cycle {cycle}: {name} shard {shard} offset {offset} not delivered (a hole in {from}..{to})")
            });
        }
    }
    let mut places: HashMap<RecordId, Vec<Loc>> = HashMap::new();
    let mut last_seq: HashMap<(u32, u32), u64> = HashMap::new();
    for (shard, list) in content.iter().enumerate() {
        let shard = shard as u32;
        for (offset, entry) in list.iter().enumerate() {
            let offset = offset as u64;
            let loc = (stream, shard, offset);
            let Some(entry) = entry else { continue };
            let id = match entry {
                Ok(id) => *id,
                Err(why) => {
                    m.findings.add(Kind::Corrupted, Subject::At(loc), || {
                        format!("cycle {cycle}: {name} shard {shard} offset {offset}: {why}")
                    });
                    continue;
                }
            };
            let sent = m
                .next_seq
                .get(id.writer as usize)
                .is_some_and(|next| id.seq < *next);
            if !sent {
                m.findings.add(Kind::Corrupted, Subject::At(loc), || {
                    format!("cycle {cycle}: {name} shard {shard} offset {offset} holds {id}, which was never sent")
                });
                continue;
            }
            if felix_wire::shard_for_key(&record::key(id), shards) != shard {
                m.findings.add(Kind::Corrupted, Subject::At(loc), || {
                    format!("cycle {cycle}: {id} is on shard {shard} of {name}, not its key's")
                });
            }
            places.entry(id).or_default().push(loc);
            if let Some(last) = last_seq.insert((id.writer, shard), id.seq)
                && last >= id.seq
            {
                m.findings.add(Kind::Reordered, Subject::Record(id), || {
                    format!(
                        "cycle {cycle}: {name} shard {shard} offset {offset} holds {id} after w{}#{last}",
                        id.writer
                    )
                });
            }
        }
    }
    for (id, locs) in &places {
        if locs.len() > 1 {
            m.findings.add(Kind::Duplicated, Subject::Record(*id), || {
                format!("cycle {cycle}: {id} stored {} times: {locs:?}", locs.len())
            });
        }
    }
    let acked: Vec<(RecordId, Loc)> = m
        .acked
        .iter()
        .filter(|(_, loc)| loc.0 == stream)
        .map(|(id, loc)| (*id, *loc))
        .collect();
    for (id, loc) in acked {
        match places.get(&id) {
            None => m.findings.add(Kind::Lost, Subject::Record(id), || {
                format!(
                    "cycle {cycle}: acked {id} ({name} shard {} offset {}) is missing",
                    loc.1, loc.2
                )
            }),
            Some(locs) if !locs.contains(&loc) => {
                m.findings.add(Kind::Reordered, Subject::Record(id), || {
                    format!("cycle {cycle}: acked {id} is at {locs:?}, its ack said {loc:?}")
                });
            }
            Some(_) => {}
        }
    }
    let mut seen = std::mem::take(&mut m.seen[stream]);
    for (shard, slots) in seen.iter().enumerate() {
        for (offset, seen) in slots.iter().enumerate() {
            let Some(id) = seen else { continue };
            let now = content
                .get(shard)
                .and_then(|list| list.get(offset))
                .and_then(|entry| entry.as_ref())
                .and_then(|entry| entry.as_ref().ok());
            if now == Some(id) {
                continue;
            }
            let (kind, what) = if places.contains_key(id) {
                (Kind::Reordered, "moved")
            } else {
                (Kind::Lost, "vanished")
            };
            m.findings.add(kind, Subject::Record(*id), || {
                format!(
                    "cycle {cycle}: {id}, received by a subscriber at {name} shard {shard} offset {offset}, {what} (now {now:?})"
                )
            });
        }
    }
    // What this audit read is now what a subscriber received (earlier sightings stay where
    // the audit found nothing, so a loss keeps being reported once).
    for (shard, list) in content.iter().enumerate() {
        let slots = &mut seen[shard];
        for (offset, entry) in list.iter().enumerate() {
            if let Some(Ok(id)) = entry {
                if slots.len() <= offset {
                    slots.resize(offset + 1, None);
                }
                slots[offset] = Some(*id);
            }
        }
    }
    m.seen[stream] = seen;
}

async fn within<T>(
    what: &str,
    future: impl std::future::Future<Output = T>,
) -> Result<T, CampaignError> {
    tokio::time::timeout(OP_DEADLINE, future)
        .await
        .map_err(|_| CampaignError::Timeout(format!("{what} within {OP_DEADLINE:?}")))
}

async fn connect(broker: &Broker, name: &str) -> Result<Client, CampaignError> {
    within("connect", Client::connect(broker.client_config(name)))
        .await?
        .map_err(|e| CampaignError::client(format!("{name} connect"), e))
}

/// How the cycle's kill is triggered.
#[derive(Debug, Clone, Copy)]
enum KillMode {
    Delay(Duration),
    AfterAcks(u64),
    Roll(Duration),
}

/// Number of entries (segments and their `.tmp` files) in the data directory's logs.
fn segment_entries(data_dir: &Path) -> usize {
    let Ok(cores) = std::fs::read_dir(data_dir.join("log")) else {
        return 0;
    };
    cores
        .filter_map(Result::ok)
        .filter_map(|core| std::fs::read_dir(core.path()).ok())
        .map(Iterator::count)
        .sum()
}

/// What the publishers share in one cycle.
struct Shared {
    model: Arc<Mutex<Model>>,
    switch: Arc<KillSwitch>,
    acks: AtomicU64,
    ack_target: Option<u64>,
    /// Set once the kill fired: errors after it are the kill's doing.
    killed: AtomicBool,
}

async fn publisher(client: Client, writer: u32, depth: usize, seed: u64, shared: Arc<Shared>) {
    let mut rng = StdRng::seed_from_u64(seed);
    type InFlight = (felix_client::PendingAck, usize, Vec<RecordId>);
    let mut window: VecDeque<InFlight> = VecDeque::new();
    loop {
        while window.len() < depth {
            let stream = rng.random_range(0..STREAMS.len());
            let count = if rng.random_bool(0.5) {
                1
            } else {
                rng.random_range(2..=BATCH_MAX)
            };
            let first = {
                let mut m = lock(&shared.model);
                let first = m.next_seq[writer as usize];
                m.next_seq[writer as usize] += count as u64;
                first
            };
            let ids: Vec<RecordId> = (0..count as u64)
                .map(|i| RecordId {
                    writer,
                    seq: first + i,
                })
                .collect();
            let records: Vec<_> = ids
                .iter()
                .map(|id| {
                    let len = if rng.random_ratio(1, LARGE_ONE_IN) {
                        rng.random_range(record::HEADER_BYTES..=LARGE_PAYLOAD_MAX)
                    } else {
                        rng.random_range(record::HEADER_BYTES..=SMALL_PAYLOAD_MAX)
                    };
                    record::make(*id, len)
                })
                .collect();
            let sent = tokio::time::timeout(
                OP_DEADLINE,
                client.publish_pipelined(STREAMS[stream].0, &records),
            )
            .await;
            match sent {
                Ok(Ok(pending)) => window.push_back((pending, stream, ids)),
                Ok(Err(error)) => return note_error(&shared, "publish", &error),
                Err(_) => return,
            }
        }
        let Some((pending, stream, ids)) = window.pop_front() else {
            return;
        };
        match tokio::time::timeout(OP_DEADLINE, pending).await {
            Ok(Ok(acks)) => {
                lock(&shared.model).acked(stream, &ids, &acks);
                let total = shared.acks.fetch_add(1, Ordering::SeqCst) + 1;
                if shared.ack_target.is_some_and(|target| total >= target) {
                    shared.switch.fire();
                }
            }
            Ok(Err(error)) if error.code() == Some(ErrorCode::IngressBudgetExhausted) => {
                lock(&shared.model).refused += 1;
            }
            Ok(Err(error)) => return note_error(&shared, "ack", &error),
            Err(_) => return,
        }
        let pause = rng.random_range(Duration::ZERO..PUBLISH_PAUSE_MAX);
        tokio::time::sleep(pause).await;
    }
}

/// An error that ends a publisher or subscriber: expected once the kill fired (the
/// connection is gone), unexpected before.
fn note_error(shared: &Shared, what: &str, error: &ClientError) {
    if !shared.killed.load(Ordering::SeqCst) && !shared.switch.fired() {
        lock(&shared.model).unexpected_error(what, error);
    }
}

async fn subscriber(
    mut subscription: felix_client::Subscription,
    stream: usize,
    shared: Arc<Shared>,
    _client: Arc<Client>,
) {
    let mut expected: HashMap<u32, u64> = subscription.start().iter().copied().collect();
    while let Some(item) = subscription.next().await {
        match item {
            Ok(r) => lock(&shared.model).delivered(stream, &r, &mut expected),
            Err(error) => return note_error(&shared, "subscription", &error),
        }
    }
}

/// Per-cycle results for the progress line.
struct LoadOutcome {
    mode: &'static str,
    after: Duration,
    acks: u64,
}

/// Runs the cycle's load and fires the kill; returns once every task has stopped and the
/// broker is dead and reaped.
async fn load_and_kill(
    broker: &mut Broker,
    model: &Arc<Mutex<Model>>,
    mode: KillMode,
    rng: &mut StdRng,
    data_dir: &Path,
    kills: &mut KillCounts,
) -> Result<LoadOutcome, CampaignError> {
    let switch = Arc::new(broker.kill_switch());
    let shared = Arc::new(Shared {
        model: Arc::clone(model),
        switch: Arc::clone(&switch),
        acks: AtomicU64::new(0),
        ack_target: match mode {
            KillMode::AfterAcks(n) => Some(n),
            _ => None,
        },
        killed: AtomicBool::new(false),
    });
    let mut tasks = Vec::new();
    // Live subscribers first, so `Latest` covers everything published this cycle.
    let live = Arc::new(connect(broker, "felix-crash-live").await?);
    for (stream, (name, _)) in STREAMS.iter().enumerate() {
        let subscription = within(
            "subscribe",
            live.subscribe(name, ShardSelection::All, StartPosition::Latest),
        )
        .await?
        .map_err(|e| CampaignError::client(format!("live subscribe {name}"), e))?;
        tasks.push(tokio::spawn(subscriber(
            subscription,
            stream,
            Arc::clone(&shared),
            Arc::clone(&live),
        )));
    }
    // A catch-up subscriber: one stream from a recent position per shard (log, ring, live).
    let catch_up = Arc::new(connect(broker, "felix-crash-catch-up").await?);
    let stream = rng.random_range(0..STREAMS.len());
    let info = within("describe", catch_up.describe_stream(STREAMS[stream].0))
        .await?
        .map_err(|e| CampaignError::client("describe", e))?;
    let from: Vec<(u32, u64)> = info
        .shards
        .iter()
        .map(|s| {
            let low = s
                .next_offset
                .saturating_sub(CATCH_UP_BACK)
                .max(s.oldest_offset);
            (s.shard, rng.random_range(low..=s.next_offset))
        })
        .collect();
    let subscription = within(
        "subscribe",
        catch_up.subscribe(
            STREAMS[stream].0,
            ShardSelection::All,
            StartPosition::Offsets(from),
        ),
    )
    .await?
    .map_err(|e| CampaignError::client("catch-up subscribe", e))?;
    tasks.push(tokio::spawn(subscriber(
        subscription,
        stream,
        Arc::clone(&shared),
        Arc::clone(&catch_up),
    )));
    // An in-memory stream with a few acked records, gone after the restart (audit).
    within(
        "create",
        catch_up.create_stream(MEMORY_STREAM, 2, StreamKind::InMemory),
    )
    .await?
    .map_err(|e| CampaignError::client(format!("create {MEMORY_STREAM}"), e))?;
    let records: Vec<_> = (0..4)
        .map(|i| felix_client::record(format!("m{i}"), "in memory only"))
        .collect();
    within("publish", catch_up.publish(MEMORY_STREAM, &records))
        .await?
        .map_err(|e| CampaignError::client(format!("publish to {MEMORY_STREAM}"), e))?;
    // Every publisher connects before any publishes: an ack-triggered kill must not land
    // while the others are still connecting.
    let mut clients = Vec::new();
    for writer in 0..PUBLISHERS {
        clients.push(connect(broker, &format!("felix-crash-pub-{writer}")).await?);
    }
    for (writer, client) in (0..PUBLISHERS).zip(clients) {
        let depth = rng.random_range(1..=IN_FLIGHT_MAX);
        tasks.push(tokio::spawn(publisher(
            client,
            writer,
            depth,
            rng.random(),
            Arc::clone(&shared),
        )));
    }
    let started = Instant::now();
    let watcher = match mode {
        KillMode::Roll(jitter) => {
            let switch = Arc::clone(&switch);
            let dir = data_dir.to_path_buf();
            Some(std::thread::spawn(move || {
                let before = segment_entries(&dir);
                while !switch.fired() && started.elapsed() < LOAD_MAX {
                    if segment_entries(&dir) > before {
                        std::thread::sleep(jitter);
                        switch.fire();
                        return;
                    }
                    std::thread::sleep(ROLL_POLL);
                }
            }))
        }
        _ => None,
    };
    let bound = match mode {
        KillMode::Delay(delay) => delay,
        KillMode::AfterAcks(_) | KillMode::Roll(_) => LOAD_MAX,
    };
    let mut died = false;
    while !switch.fired() && started.elapsed() < bound {
        if broker.has_died() {
            // `fire` marks the switch before it signals, so a death the switch caused is
            // seen with the switch marked.
            died = !switch.fired();
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let fell_back = switch.fire();
    let after = started.elapsed();
    shared.killed.store(true, Ordering::SeqCst);
    if let Some(watcher) = watcher {
        let _ = watcher.join();
    }
    // A killed broker sends no CONNECTION_CLOSE: stop the tasks rather than wait for QUIC's
    // idle timeout. A publish cut off here was never acked.
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
    let status = broker.kill()?;
    if died || status.signal() != Some(nix::sys::signal::Signal::SIGKILL as i32) {
        return Err(CampaignError::Broker(format!(
            "the broker died on its own under load ({status}); log:\n{}",
            crate::broker::log_tail(broker.log())
        )));
    }
    let label = match (mode, fell_back) {
        (KillMode::Delay(_), _) => {
            kills.delay += 1;
            "delay"
        }
        (KillMode::AfterAcks(_), false) => {
            kills.after_ack += 1;
            "after ack"
        }
        (KillMode::AfterAcks(_), true) => {
            kills.after_ack_fallback += 1;
            "after ack (load bound)"
        }
        (KillMode::Roll(_), false) => {
            kills.roll += 1;
            "segment roll"
        }
        (KillMode::Roll(_), true) => {
            kills.roll_fallback += 1;
            "segment roll (none)"
        }
    };
    Ok(LoadOutcome {
        mode: label,
        after,
        acks: shared.acks.load(Ordering::SeqCst),
    })
}

/// Runs the campaign. `Err` only for what stops it from starting (no binary, no temp dir);
/// everything found, and an early stop, is in the report.
pub fn run(config: &CrashConfig) -> Result<CrashReport, CampaignError> {
    if config.cycles == 0 {
        return Err(CampaignError::Invalid(
            "cycles must be at least 1".to_owned(),
        ));
    }
    let started = Instant::now();
    let mut builder = tempfile::Builder::new();
    builder.prefix("felix-crash-");
    let work = match &config.work_parent {
        Some(parent) => builder.tempdir_in(parent),
        None => builder.tempdir(),
    }
    .map_err(|e| CampaignError::io("cannot make a temporary directory", "felix-crash-", e))?;
    let data_dir = work.path().join("data");
    std::fs::create_dir_all(&data_dir)
        .map_err(|e| CampaignError::io("cannot create", &data_dir, e))?;
    let options = |pwrite: bool| BrokerOptions {
        felix: config.felix.clone(),
        data_dir: data_dir.clone(),
        env: vec![
            (
                "FELIX_DURABLE_FSYNC_MODE".to_owned(),
                config.fsync_mode.clone(),
            ),
            (
                "FELIX_DURABLE_SEGMENT_BYTES".to_owned(),
                SEGMENT_BYTES.to_owned(),
            ),
            (
                "FELIX_STORAGE_IO_URING".to_owned(),
                if pwrite { "0" } else { "1" }.to_owned(),
            ),
        ],
        log: work.path().join("broker.log"),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CampaignError::io("cannot start a runtime", "tokio", e))?;
    let mut rng = StdRng::seed_from_u64(config.seed);
    let model = Arc::new(Mutex::new(Model::new()));
    let mut kills = KillCounts::default();
    let mut aborted = None;
    let mut cycles_done = 0;
    let mut audited_last = 0;
    let mut broker = Broker::start(&options(false))?;
    runtime.block_on(async {
        let client = connect(&broker, "felix-crash-admin").await?;
        for (name, shards) in STREAMS {
            within(
                "create",
                client.create_stream(name, shards, StreamKind::Durable),
            )
            .await?
            .map_err(|e| CampaignError::client(format!("create {name}"), e))?;
        }
        client.close().await;
        Ok::<(), CampaignError>(())
    })?;
    for cycle in 1..=config.cycles {
        if started.elapsed() >= config.time_limit {
            aborted = Some(format!(
                "time limit {:?} reached after {} cycles",
                config.time_limit, cycles_done
            ));
            break;
        }
        let cycle_started = Instant::now();
        lock(&model).cycle = cycle;
        let mode = match rng.random_range(0..3) {
            0 => KillMode::Delay(rng.random_range(DELAY_MIN..DELAY_MAX)),
            1 => KillMode::AfterAcks(rng.random_range(1..=ACK_TARGET_MAX)),
            _ => KillMode::Roll(rng.random_range(Duration::ZERO..ROLL_KILL_JITTER_MAX)),
        };
        let outcome = runtime.block_on(load_and_kill(
            &mut broker,
            &model,
            mode,
            &mut rng,
            &data_dir,
            &mut kills,
        ));
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                aborted = Some(format!("cycle {cycle}: {error}"));
                break;
            }
        };
        if rng.random_ratio(1, STARTUP_KILL_ONE_IN) {
            let delay = rng.random_range(Duration::ZERO..STARTUP_KILL_DELAY_MAX);
            let pwrite = rng.random_bool(0.5);
            kills.pwrite_starts += u64::from(pwrite);
            match Broker::start_and_kill_after(&options(pwrite), delay) {
                Ok(_) => kills.startup += 1,
                Err(error) => {
                    aborted = Some(format!("cycle {cycle}: start-up kill: {error}"));
                    break;
                }
            }
        }
        let pwrite = rng.random_bool(0.5);
        kills.pwrite_starts += u64::from(pwrite);
        broker = match Broker::start(&options(pwrite)) {
            Ok(broker) => broker,
            Err(error) => {
                aborted = Some(format!("cycle {cycle}: restart: {error}"));
                // No broker: the final report comes without a last audit.
                cycles_done = cycle;
                return Ok(finish(
                    config,
                    &model,
                    kills,
                    cycles_done,
                    0,
                    aborted,
                    started,
                    work,
                ));
            }
        };
        match runtime.block_on(audit(&broker, &model)) {
            Ok(read) => audited_last = read,
            Err(error) => {
                aborted = Some(format!("cycle {cycle}: audit: {error}"));
                cycles_done = cycle;
                break;
            }
        }
        cycles_done = cycle;
        if config.progress {
            let m = lock(&model);
            let f = &m.findings;
            eprintln!(
                "cycle {cycle}/{}: kill {} after {} ms ({} acks), acked {}, audited {}, findings {}/{}/{}/{}, {:.1} s",
                config.cycles,
                outcome.mode,
                outcome.after.as_millis(),
                outcome.acks,
                m.acked.len(),
                audited_last,
                f.lost.len(),
                f.duplicated.len(),
                f.reordered.len(),
                f.corrupted.len(),
                cycle_started.elapsed().as_secs_f64()
            );
        }
    }
    drop(broker);
    Ok(finish(
        config,
        &model,
        kills,
        cycles_done,
        audited_last,
        aborted,
        started,
        work,
    ))
}

#[allow(clippy::too_many_arguments)] // the run's loose ends, gathered once
fn finish(
    config: &CrashConfig,
    model: &Mutex<Model>,
    kills: KillCounts,
    cycles: u64,
    audited_last: u64,
    aborted: Option<String>,
    started: Instant,
    work: tempfile::TempDir,
) -> CrashReport {
    let m = lock(model);
    let f = &m.findings;
    let mut report = CrashReport {
        cycles,
        acked_records: m.acked.len() as u64,
        lost: f.lost.len() as u64,
        duplicated: f.duplicated.len() as u64,
        reordered: f.reordered.len() as u64,
        corrupted: f.corrupted.len() as u64,
        seed: config.seed,
        elapsed: started.elapsed(),
        delivered_live: m.delivered_live,
        audited_last,
        refused: m.refused,
        kills,
        unexpected_errors: m.unexpected.clone(),
        error_samples: m.error_samples.clone(),
        failures: f.details.clone(),
        aborted,
        kept_dir: None,
    };
    if !report.passed() {
        report.kept_dir = Some(work.keep());
    }
    report
}
