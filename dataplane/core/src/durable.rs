//! The durable log of one data-plane core: one `felix_storage::Log` under
//! `<data_dir>/log/core-<i>/`, and the moves between it and the core's engine (see
//! `docs/design/durable.md`). Shared by the broker shell and the simulation, so both drive the
//! log exactly the same way.
//!
//! Lives on one data-plane core: created, recovered and driven on that core's thread, never
//! shared. The shell calls [`Core::pump_log`] after an input left log work
//! ([`Core::has_log_work`]), when the log's wake-up eventfd ([`DurableLog::wake_fd`]) is
//! readable, and at [`DurableLog::next_deadline`] (the periodic fsync timer). A pump:
//! 1. moves `Engine::poll_append` into `Log::append` while the log's pending bound
//!    (`LogConfig::max_pending_bytes`) has room; the rest stays queued in the engine
//!    (`PumpReport::held`): a slow disk makes publishers wait (their ingress admission is held
//!    until durable), it never fails a publish. [`Core::has_log_work`] leaves held appends
//!    alone until the log's wake-up says a round finished, so nothing spins meanwhile;
//! 2. drives the log (`Log::drive`: reaps the finished round, starts the next), then moves
//!    held appends that fit now;
//! 3. routes the log's events: the commit level (`Synced` on on_commit, `Written` on periodic)
//!    to `Engine::handle_durable`, `Rejected` (disk full) to `Engine::handle_rejected`;
//! 4. answers `Engine::poll_log_read` with `Log::try_read` (catch-up of subscribers resuming
//!    from offsets on disk), at most [`LOG_READS_PER_PUMP_MAX`] tries. A read whose bytes are
//!    not in the page cache waits (at most [`LOG_READS_WAITING_MAX`]) while the log's reader
//!    thread fetches them; the fetch wakes the log's eventfd and a later pump answers it
//!    (`Log::poll_reads`, then the read again from where it stopped). Publishing and other
//!    reads go on meanwhile;
//! 5. ([`Core::pump_log`]) lets the core answer what completed: acks written straight to the
//!    streams they answer, parts answered to the cores that forwarded them.
//!
//! Any error a pump returns is fatal (a failed fdatasync or write, a corrupt committed
//! record): the shell must send no further ack and stop the process; recovery at the next
//! start takes over (and stops with `StorageError::CorruptLog`, naming `felix log repair`,
//! when committed data is damaged).
//!
//! Housekeeping ([`Core::apply_retention`], every few seconds from the shell's timer)
//! releases the log shards of deleted durable streams (`Log::release_shards`: closed segments
//! holding only their records give their space back at once) and applies retention. The
//! offline `felix log` commands use [`log_dirs`] and [`catalogued_shards`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use felix_engine::{
    AppendRequest, Engine, EngineError, LogRead, LogRecord, LogShardId, StreamDescription,
};
use felix_storage::{
    Backend, BackendChoice, Counters, FsyncMode, Log, LogConfig, LogEvent, ReadOutcome, ReadResume,
    RecoveryReport, ReleaseReport, RetentionReport, StorageError, SystemBackend,
};

use crate::catalog::{Catalog, CatalogEntry};
use crate::config::Now;
use crate::core::Core;
use crate::producer::{self, JournalEntry};

/// A log record's framing (docs/storage-format.md, "Record frame"): what a producer journal
/// record costs besides its payload.
const JOURNAL_FRAME_OVERHEAD: usize = 28;

/// Log reads tried per `pump` (new ones and waiting ones retried): each answers at most 1 MiB
/// (`LOG_READ_BYTES_MAX`) from memory (`Log::try_read` never blocks on the disk), so 16 bound
/// one pump's catch-up work to ~16 MiB of copies-free decoding and keep the core's other
/// connections served; the rest wait for the next pump (`PumpReport::more`).
pub const LOG_READS_PER_PUMP_MAX: usize = 16;

/// Catch-up reads kept waiting for the log's reader thread (their bytes were not in the page
/// cache). At most [`LOG_READS_PER_PUMP_MAX`], so the pump after a fetch arrived retries them
/// all while the fetched chunk is still kept (`felix_storage::FETCHED_KEPT_MAX`); further
/// reads stay queued in the engine (`PumpReport::reads_held`).
pub const LOG_READS_WAITING_MAX: usize = LOG_READS_PER_PUMP_MAX;

/// Log events routed per `pump`. A round produces at most three events (`Written`, `Synced`,
/// or `Rejected`), at most two are in flight and `drive` reaps at most a few rounds, so 64 is
/// slack that still bounds the loop.
const LOG_EVENTS_PER_PUMP_MAX: usize = 64;

/// Durable settings shared by every core (from FELIX_DURABLE_* and FELIX_STORAGE_IO_URING).
#[derive(Debug, Clone)]
pub struct DurableSettings {
    pub fsync: FsyncMode,
    pub backend: BackendChoice,
    /// Write rounds with O_DIRECT (`LogConfig::direct_io`).
    pub direct_io: bool,
    /// Write rounds in flight per log, 1 or 2 (`LogConfig::rounds_in_flight`).
    pub rounds_in_flight: usize,
    pub segment_bytes: u64,
    /// Delete the oldest segments while a core's log exceeds this; `None` keeps everything.
    pub retention_bytes: Option<u64>,
    /// Delete the oldest segments whose newest record is older than this; `None`: never.
    pub retention_age: Option<Duration>,
}

impl DurableSettings {
    /// The log configuration of core `core`.
    #[must_use]
    pub fn log_config(&self, data_dir: &Path, core: usize) -> LogConfig {
        let mut config = LogConfig::new(log_dir(data_dir, core));
        config.fsync = self.fsync;
        config.direct_io = self.direct_io;
        config.rounds_in_flight = self.rounds_in_flight;
        config.segment_bytes = self.segment_bytes;
        // A round never exceeds half a segment (LogConfig::validate); the default 4 MiB fits
        // any segment of 8 MiB or more, smaller (test) segments get half their size.
        let half_segment = usize::try_from(self.segment_bytes / 2).unwrap_or(usize::MAX);
        config.max_round_bytes = config.max_round_bytes.min(half_segment);
        config.retention_bytes = self.retention_bytes;
        config.retention_age = self.retention_age;
        config
    }
}

/// The log directory of core `core`: `<data_dir>/log/core-<core>`.
#[must_use]
pub fn log_dir(data_dir: &Path, core: usize) -> PathBuf {
    data_dir.join("log").join(format!("core-{core}"))
}

/// Every core log directory of a data directory (`<data_dir>/log/core-<i>`), by core index;
/// none when the broker never made one.
pub fn log_dirs(data_dir: &Path) -> std::io::Result<Vec<(usize, PathBuf)>> {
    let root = data_dir.join("log");
    let entries = match std::fs::read_dir(&root) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    let mut dirs = Vec::new();
    for entry in entries {
        let entry = entry?;
        let core = entry
            .file_name()
            .to_str()
            .and_then(|name| name.strip_prefix("core-"))
            .and_then(|index| index.parse::<usize>().ok());
        if let Some(core) = core
            && entry.file_type()?.is_dir()
        {
            dirs.push((core, entry.path()));
        }
    }
    dirs.sort_unstable();
    Ok(dirs)
}

/// A log shard id as an operator reads it: `stream id S shard N` (`LogShardId`).
#[must_use]
pub fn describe_log_shard(shard: u32) -> String {
    let id = LogShardId(shard);
    if producer::is_journal(shard) {
        return format!(
            "stream id {} shard {} (producer journal)",
            producer::owning_stream_id(shard),
            id.shard()
        );
    }
    format!("stream id {} shard {}", id.stream_id(), id.shard())
}

/// For `felix log compact`: whether log shard `shard` may hold records someone can still
/// read. A stream the catalogue lists is live; a stream id below the catalogue's next id that
/// it does not list was deleted (ids are never reused); an id at or past the next id is not
/// one the catalogue ever gave out (a catalogue replaced or lost), so it is kept rather than
/// guessed away.
pub fn catalogued_shards(catalog: &Catalog) -> impl Fn(u32) -> bool + use<> {
    let live: HashSet<u32> = catalog.entries().map(|entry| entry.stream_id).collect();
    let next = catalog.next_stream_id();
    move |shard| {
        // A producer journal lives as long as its stream's records.
        let stream_id = producer::owning_stream_id(shard);
        stream_id >= next || live.contains(&stream_id)
    }
}

/// What one `pump` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PumpReport {
    /// Records moved from the engine into the log.
    pub appended: u64,
    /// Records refused by `Log::append` and rolled back (a defect or an invalid record; a
    /// full pending bound holds appends back instead, see `held`).
    pub refused: u64,
    /// Appends were left queued in the engine because the log's pending bound
    /// (`LogConfig::max_pending_bytes`) is full: the disk is behind. They move at a later
    /// pump, after the log's wake-up eventfd says a round finished; pumping before that
    /// moves nothing.
    pub held: bool,
    /// Log reads were left for the next pump: call `pump` again soon.
    pub more: bool,
    /// Log reads are left queued in the engine because [`LOG_READS_WAITING_MAX`] reads wait
    /// for the disk: they move at a later pump, after the log's wake-up says a fetch arrived.
    pub reads_held: bool,
}

/// What recovery found, kept for the metrics (gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RecoverySummary {
    pub seconds: f64,
    pub records: u64,
    pub truncated_bytes: u64,
}

/// One core's durable log and its glue to the core's engine.
#[derive(Debug)]
pub struct DurableLog<B: Backend = SystemBackend> {
    core: usize,
    log: Log<B>,
    recovery: RecoverySummary,
    /// Durable stream ids seen live in the engine since start: once gone from the engine
    /// they were deleted, so their log shards may be released.
    seen_live: HashSet<u32>,
    /// Catch-up reads waiting for their bytes (`ReadOutcome::Pending`), oldest first, at
    /// most [`LOG_READS_WAITING_MAX`].
    waiting_reads: VecDeque<(LogRead, ReadResume)>,
    /// How many of `waiting_reads` (from the front) to retry: set to all of them when fetched
    /// chunks arrive.
    retries_due: usize,
    /// Data log shards rolled back (a refused write) whose producer journal must record the
    /// rollback before the shard's next record: data log shard -> the offset it went back to.
    rollbacks: HashMap<u32, u64>,
}

impl DurableLog<SystemBackend> {
    /// Opens and recovers core `core`'s log with the configured backend (io_uring falls back
    /// to pwrite with a warning where the ring cannot be set up). Blocks while recovery scans;
    /// call it before the core serves.
    pub fn open_system(
        data_dir: &Path,
        core: usize,
        settings: &DurableSettings,
    ) -> Result<DurableLog<SystemBackend>, StorageError> {
        let backend = SystemBackend::open(settings.backend)?;
        DurableLog::open(core, settings.log_config(data_dir, core), backend)
    }
}

impl<B: Backend> DurableLog<B> {
    /// Opens and recovers a log on `backend`; logs what recovery did (truncations are logged
    /// by the storage crate too, segment by segment).
    pub fn open(core: usize, config: LogConfig, backend: B) -> Result<DurableLog<B>, StorageError> {
        let dir = config.dir.clone();
        let (log, report) = Log::open(config, backend)?;
        let recovery = summarize(&report);
        tracing::info!(
            core,
            dir = %dir.display(),
            backend = log.backend_name(),
            records = report.records,
            segments = report.segments,
            truncated_bytes = report.truncated_bytes,
            seconds = recovery.seconds,
            "durable log recovered"
        );
        if report.truncated_bytes > 0 {
            tracing::warn!(
                core,
                truncated_bytes = report.truncated_bytes,
                truncations = report.truncations.len(),
                "recovery truncated an incomplete or corrupt tail (records never acknowledged)"
            );
        }
        Ok(DurableLog {
            core,
            log,
            recovery,
            seen_live: HashSet::new(),
            waiting_reads: VecDeque::new(),
            retries_due: 0,
            rollbacks: HashMap::new(),
        })
    }

    /// The `(oldest, next)` offsets of each shard of durable stream `stream_id`, for
    /// `Engine::restore_durable_stream`. A shard the log never stored starts at `(0, 0)`.
    #[must_use]
    pub fn stream_offsets(&self, stream_id: u32, shards: u32) -> Vec<(u64, u64)> {
        (0..shards)
            .map(|shard| {
                LogShardId::new(stream_id, shard)
                    .and_then(|id| self.log.shard_offsets(id.0))
                    .map_or((0, 0), |offsets| (offsets.oldest, offsets.next))
            })
            .collect()
    }

    /// Recreates a catalogued stream in `engine` from the log's offsets (start-up).
    pub fn restore(
        &self,
        engine: &mut Engine,
        entry: &CatalogEntry,
    ) -> Result<StreamDescription, EngineError> {
        let offsets = self.stream_offsets(entry.stream_id, entry.shards);
        engine.restore_durable_stream(&entry.name, entry.shards, entry.stream_id, &offsets)
    }

    /// Moves `engine`'s queued appends into the log, in publish order, while the log's
    /// pending bound (`LogConfig::max_pending_bytes`) has room; returns whether appends were
    /// left queued for lack of room. Those wait in the engine (bounded by ingress admission:
    /// a durable publish holds its admission until durable) until a round is submitted: a
    /// slow disk makes publishers wait, it never fails their publishes.
    fn move_appends(
        &mut self,
        engine: &mut Engine,
        journal: &mut VecDeque<JournalEntry>,
        report: &mut PumpReport,
    ) -> Result<bool, StorageError> {
        // Bounded by the engine's queue, which only publishes (not this loop) grow.
        while let Some(request) = engine.peek_append() {
            let AppendRequest {
                log_shard,
                offset,
                timestamp_us,
                ref key,
                ref payload,
            } = *request;
            // Producer journal records go right before the record they concern (module
            // `producer`, docs/storage-format.md "Producer journals"): none on the usual path.
            let rollback = if self.rollbacks.is_empty() {
                None
            } else {
                self.rollbacks.get(&log_shard.0).copied()
            };
            let entry = journal
                .front()
                .filter(|entry| entry.log_shard == log_shard && entry.first_offset == offset)
                .copied();
            let extra = (usize::from(rollback.is_some()) + usize::from(entry.is_some()))
                * (producer::JOURNAL_RECORD_BYTES + JOURNAL_FRAME_OVERHEAD);
            if !self.log.can_append(key.len(), payload.len() + extra) {
                // No room: leave it, and every later append, queued for a later pump.
                return Ok(true);
            }
            let journal_shard = producer::journal_of(log_shard);
            if let Some(from) = rollback {
                if let Some(journal_shard) = journal_shard {
                    let record = producer::rollback_record(from);
                    match self.append_journal(journal_shard, timestamp_us, &record) {
                        Ok(()) => {}
                        Err(StorageError::PendingFull { .. }) => return Ok(true),
                        Err(error) if error.is_fatal() => return Err(error),
                        Err(error) => {
                            self.refuse(engine, journal, report, log_shard, offset, &error);
                            continue;
                        }
                    }
                }
                self.rollbacks.remove(&log_shard.0);
            }
            if let Some(entry) = entry {
                if let Some(journal_shard) = journal_shard {
                    let record = producer::batch_record(&entry);
                    match self.append_journal(journal_shard, timestamp_us, &record) {
                        Ok(()) => {}
                        Err(StorageError::PendingFull { .. }) => return Ok(true),
                        Err(error) if error.is_fatal() => return Err(error),
                        Err(error) => {
                            self.refuse(engine, journal, report, log_shard, offset, &error);
                            continue;
                        }
                    }
                }
                journal.pop_front();
            }
            match self
                .log
                .append(log_shard.0, offset, timestamp_us, key, payload)
            {
                Ok(()) => {
                    report.appended += 1;
                    let _ = engine.poll_append();
                }
                // Unreachable after `can_append`; were it met, it would still mean "wait",
                // never a refused publish.
                Err(StorageError::PendingFull { .. }) => return Ok(true),
                Err(error) if error.is_fatal() => return Err(error),
                Err(error) => {
                    // Not stored: roll the shard back here (this also drops its later queued
                    // appends); its publishes fail and nothing of it is acknowledged.
                    self.refuse(engine, journal, report, log_shard, offset, &error);
                }
            }
        }
        // Nothing queued: a journal entry left has no record to precede any more (its
        // appends were dropped with a deleted stream).
        journal.clear();
        Ok(false)
    }

    /// Appends a producer journal record to `journal_shard` at its next offset.
    fn append_journal(
        &mut self,
        journal_shard: LogShardId,
        timestamp_us: u64,
        record: &[u8],
    ) -> Result<(), StorageError> {
        let next = self
            .log
            .shard_offsets(journal_shard.0)
            .map_or(0, |offsets| offsets.next);
        self.log
            .append(journal_shard.0, next, timestamp_us, &[], record)
    }

    /// A record of `log_shard` at `offset` could not be stored: the shard rolls back there
    /// (its publishes fail, nothing of them is acknowledged), its queued journal entries from
    /// there are dropped, and its journal will record the rollback.
    fn refuse(
        &mut self,
        engine: &mut Engine,
        journal: &mut VecDeque<JournalEntry>,
        report: &mut PumpReport,
        log_shard: LogShardId,
        offset: u64,
        error: &StorageError,
    ) {
        tracing::warn!(
            core = self.core,
            shard = log_shard.shard(),
            offset,
            error = %felix_storage::ErrorChain(error),
            "durable append refused"
        );
        report.refused += 1;
        self.rolled_back(engine, journal, log_shard, offset);
    }

    /// Data log shard `log_shard` rolled back to `offset` (in the log already, or refused
    /// here): the engine rolls back too, and the producer journal forgets what was past it.
    fn rolled_back(
        &mut self,
        engine: &mut Engine,
        journal: &mut VecDeque<JournalEntry>,
        log_shard: LogShardId,
        offset: u64,
    ) {
        engine.handle_rejected(log_shard, offset);
        if producer::is_journal(log_shard.0) {
            return;
        }
        journal.retain(|entry| !(entry.log_shard == log_shard && entry.first_offset >= offset));
        if producer::journal_of(log_shard).is_some() {
            let from = self.rollbacks.entry(log_shard.0).or_insert(offset);
            *from = (*from).min(offset);
        }
    }

    /// Steps 1-4 of a pump on `engine` (the engine's finished publishes stay queued in
    /// `Engine::poll_completed_publish`). Never blocks on the disk (log reads take what is in
    /// memory; the rest is read by the log's reader thread and answered at a later pump). An error is fatal: the caller must not send
    /// any ack it has not sent yet.
    pub fn pump(&mut self, engine: &mut Engine, now: Instant) -> Result<PumpReport, StorageError> {
        self.pump_journaled(engine, &mut VecDeque::new(), now)
    }

    /// [`DurableLog::pump`], with `journal`: the engine's queued producer batches of durable
    /// shards, in publish order, whose journal records go to the log right before their first
    /// records (module `producer`).
    pub fn pump_journaled(
        &mut self,
        engine: &mut Engine,
        journal: &mut VecDeque<JournalEntry>,
        now: Instant,
    ) -> Result<PumpReport, StorageError> {
        let mut report = PumpReport::default();
        // 1. Appends, in publish order, while the log's pending bound has room.
        report.held = self.move_appends(engine, journal, &mut report)?;
        // 2. Reap the finished round and start the next.
        self.log.drive(now)?;
        // 3. Route the events.
        let commit_is_sync = self.log.commit_is_sync();
        let mut events_left = true;
        for _ in 0..LOG_EVENTS_PER_PUMP_MAX {
            let Some(event) = self.log.poll_event() else {
                events_left = false;
                break;
            };
            match event {
                LogEvent::Written(ranges) if !commit_is_sync => {
                    for range in ranges {
                        engine.handle_durable(LogShardId(range.shard), range.end);
                    }
                }
                LogEvent::Synced(ranges) if commit_is_sync => {
                    for range in ranges {
                        engine.handle_durable(LogShardId(range.shard), range.end);
                    }
                }
                LogEvent::Written(_) | LogEvent::Synced(_) => {}
                LogEvent::Rejected { ranges, error } => {
                    tracing::warn!(core = self.core, error = %felix_storage::ErrorChain(&error), "durable appends rejected");
                    for range in ranges {
                        self.rolled_back(engine, journal, LogShardId(range.shard), range.first);
                    }
                }
            }
        }
        // 3b. The reaped round freed room, so held appends may fit now (they join the round
        //     after the one in flight). Only after the events: a rejected round rolls its
        //     shards back in the log (a shard that never reached the disk is forgotten, and
        //     would take any offset), and the engine must roll back too, dropping the queued
        //     appends past it, before anything more of those shards goes to the log (events
        //     left for the next pump: the held appends wait for it too).
        if report.held && !events_left {
            report.held = self.move_appends(engine, journal, &mut report)?;
        }
        // 4. Log reads for catching-up subscriptions; every read is answered, now or (when
        //    its bytes are not in memory) once the log's reader thread fetched them: first
        //    the waiting reads, when fetched chunks arrived, then new ones while there is
        //    room to wait.
        if self.log.poll_reads() > 0 {
            self.retries_due = self.waiting_reads.len();
        }
        let mut attempts = 0;
        while attempts < LOG_READS_PER_PUMP_MAX && self.retries_due > 0 {
            self.retries_due -= 1;
            let Some((read, resume)) = self.waiting_reads.pop_front() else {
                break;
            };
            attempts += 1;
            self.answer_read(engine, read, Some(resume))?;
        }
        while attempts < LOG_READS_PER_PUMP_MAX && self.waiting_reads.len() < LOG_READS_WAITING_MAX
        {
            let Some(read) = engine.poll_log_read() else {
                break;
            };
            attempts += 1;
            self.answer_read(engine, read, None)?;
        }
        // At the bound there may be more (a read's answer often asks for the next).
        report.more = attempts == LOG_READS_PER_PUMP_MAX;
        // No room to wait: the engine's next reads stay queued until a fetch arrives (the
        // log's wake-up), so the shell does not spin on them meanwhile.
        report.reads_held =
            self.waiting_reads.len() >= LOG_READS_WAITING_MAX && engine.has_log_reads();
        Ok(report)
    }

    /// Tries `read` (again, from `resume`) and answers it, or keeps it waiting for its chunk.
    fn answer_read(
        &mut self,
        engine: &mut Engine,
        read: LogRead,
        resume: Option<ReadResume>,
    ) -> Result<(), StorageError> {
        match self.log.try_read(
            read.log_shard.0,
            read.from_offset,
            read.max_records,
            read.max_bytes,
            resume,
        ) {
            Ok(ReadOutcome::Pending(resume)) => {
                // Answered once its chunk arrived (the subscription may be gone by then: the
                // engine ignores answers to reads no longer outstanding).
                self.waiting_reads.push_back((read, resume));
            }
            Ok(ReadOutcome::Records(records)) => {
                // The log skips quarantined offsets (records lost to damage, see
                // `felix log repair`). A read that starts past its offset crossed such a
                // range: the subscription skips exactly those offsets (a gap its client
                // sees, counted). The answer then stops at the next jump; the next read
                // goes on from there.
                let mut expect = read.from_offset;
                if let Some(first) = records.first()
                    && first.offset > expect
                {
                    tracing::warn!(
                        core = self.core,
                        shard = read.log_shard.shard(),
                        stream_id = read.log_shard.stream_id(),
                        from = expect,
                        to = first.offset,
                        "a catch-up read skips quarantined offsets"
                    );
                    engine.handle_log_skip(read.subscription, read.log_shard, first.offset);
                    expect = first.offset;
                }
                let mut dense = Vec::with_capacity(records.len());
                for record in records {
                    if record.offset != expect {
                        break;
                    }
                    expect += 1;
                    dense.push(LogRecord {
                        offset: record.offset,
                        timestamp_us: record.timestamp_us,
                        key: record.key,
                        payload: record.payload,
                    });
                }
                engine.handle_log_records(read.subscription, read.log_shard, dense);
            }
            Err(StorageError::OffsetTooOld { oldest, .. }) => {
                engine.handle_log_read_too_old(read.subscription, read.log_shard, oldest);
            }
            Err(error) if error.is_fatal() => return Err(error),
            Err(error) => {
                // An empty answer: the engine continues from the ring if it covers the
                // position, else ends the subscription with StorageFailed.
                tracing::warn!(core = self.core, error = %felix_storage::ErrorChain(&error), "log read failed");
                engine.handle_log_records(read.subscription, read.log_shard, Vec::new());
            }
        }
        Ok(())
    }

    /// Catch-up reads waiting for the log's reader thread.
    #[must_use]
    pub fn reads_waiting(&self) -> usize {
        self.waiting_reads.len()
    }

    /// Makes the log's first segment if it has none (a durable shard landed on this core).
    /// A failure is logged and left to the first append, which tries again and is rejected
    /// with `StorageFull` if there is still no room.
    pub fn ensure_segment(&mut self) {
        if self.log.has_segments() {
            return;
        }
        match self.log.ensure_segment() {
            Ok(()) => tracing::info!(
                core = self.core,
                dir = %self.log.config().dir.display(),
                segment_bytes = self.log.config().segment_bytes,
                "durable log: first segment created"
            ),
            Err(error) => tracing::warn!(
                core = self.core,
                error = %felix_storage::ErrorChain(&error),
                "durable log: cannot create the first segment yet"
            ),
        }
    }

    /// Deletes segments past the retention bounds and moves each shard's oldest offset in the
    /// engine forward. Call it every few seconds from the core's loop.
    pub fn apply_retention(
        &mut self,
        engine: &mut Engine,
        now_unix_us: u64,
    ) -> Result<RetentionReport, StorageError> {
        let report = self.log.apply_retention(now_unix_us)?;
        if !report.segments_deleted.is_empty() {
            for shard in self.log.shard_ids() {
                if let Some(offsets) = self.log.shard_offsets(shard) {
                    engine.handle_retention(LogShardId(shard), offsets.oldest);
                }
            }
            tracing::info!(
                core = self.core,
                segments = report.segments_deleted.len(),
                bytes = report.bytes_deleted,
                "retention deleted segments"
            );
        }
        Ok(report)
    }

    /// Whether the shell's timer must call `Core::apply_retention` every few seconds:
    /// always, since besides retention (when FELIX_DURABLE_RETENTION_* bounds are set, see
    /// [`DurableLog::retention_bounds_set`]) it releases the segments of deleted streams.
    #[must_use]
    pub fn retention_configured(&self) -> bool {
        true
    }

    /// Whether retention bounds are configured (else retention never deletes).
    #[must_use]
    pub fn retention_bounds_set(&self) -> bool {
        let config = self.log.config();
        config.retention_bytes.is_some() || config.retention_age.is_some()
    }

    /// Releases the log shards of durable streams `engine` no longer has (deleted), so the
    /// closed segments holding only their records give their space back at once
    /// (`Log::release_shards`). A stream counts as deleted only when its id is below
    /// `catalogued_below` (ids the catalogue had given out at start-up) or it was seen live
    /// earlier in this process: a log shard of an unknown stream is never released on a guess
    /// (e.g. a lost catalogue). Nothing is released while durable streams are disabled.
    pub fn release_deleted(
        &mut self,
        engine: &Engine,
        catalogued_below: u32,
    ) -> Result<ReleaseReport, StorageError> {
        if !engine.durable_enabled() {
            return Ok(ReleaseReport::default());
        }
        let live: HashSet<u32> = engine
            .list_streams()
            .into_iter()
            .filter_map(|(name, _, _)| engine.log_shard(&name, 0))
            .map(LogShardId::stream_id)
            .collect();
        self.seen_live.extend(live.iter().copied());
        let seen = &self.seen_live;
        let report = self.log.release_shards(|shard| {
            let stream_id = producer::owning_stream_id(shard);
            live.contains(&stream_id)
                || !(stream_id < catalogued_below || seen.contains(&stream_id))
        })?;
        if !report.shards.is_empty() {
            tracing::info!(
                core = self.core,
                shards = report.shards.len(),
                segments = report.segments.len(),
                bytes = report.bytes_freed,
                "released the log shards of deleted durable streams"
            );
        }
        Ok(report)
    }

    /// The eventfd that becomes readable when the log has a completion to reap: wrap it in
    /// `AsyncFd`, clear its readiness, then `pump`.
    #[must_use]
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.log.wake_fd()
    }

    /// When `pump` must run even without a wake-up (periodic fsync), if ever.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Instant> {
        self.log.next_deadline()
    }

    /// The log's counters (append bytes, fsyncs, fan-in, latencies).
    #[must_use]
    pub fn counters(&self) -> &Counters {
        self.log.counters()
    }

    /// What recovery found at open.
    #[must_use]
    pub fn recovery(&self) -> RecoverySummary {
        self.recovery
    }

    /// `io_uring`, `pwrite` or `fault`.
    #[must_use]
    pub fn backend_name(&self) -> &'static str {
        self.log.backend_name()
    }

    /// Nothing appended is waiting for the disk.
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.log.is_idle()
    }

    /// The underlying log (reads and offsets in tests and diagnostics).
    #[must_use]
    pub fn log(&self) -> &Log<B> {
        &self.log
    }

    /// Clean shutdown: moves the engine's last appends in, then blocks until everything is
    /// written and synced (whatever the mode) or `timeout` passes. Completions are not
    /// answered: the connections are gone by then.
    pub fn shutdown(&mut self, engine: &mut Engine, timeout: Duration) -> Result<(), StorageError> {
        self.shutdown_journaled(engine, &mut VecDeque::new(), timeout)
    }

    /// [`DurableLog::shutdown`] with the core's queued producer journal entries (see
    /// [`DurableLog::pump_journaled`]).
    pub fn shutdown_journaled(
        &mut self,
        engine: &mut Engine,
        journal: &mut VecDeque<JournalEntry>,
        timeout: Duration,
    ) -> Result<(), StorageError> {
        let deadline = Instant::now() + timeout;
        // Appends held back by the pending bound move in as the flushes make room.
        while self.pump_journaled(engine, journal, Instant::now())?.held {
            self.log
                .flush(deadline.saturating_duration_since(Instant::now()))?;
        }
        self.log.sync_now();
        self.log
            .flush(deadline.saturating_duration_since(Instant::now()))
    }
}

fn summarize(report: &RecoveryReport) -> RecoverySummary {
    RecoverySummary {
        seconds: report.duration.as_secs_f64(),
        records: report.records,
        truncated_bytes: report.truncated_bytes,
    }
}

impl Core {
    /// Recreates every catalogued durable stream from `log`'s offsets (start-up, before the
    /// core serves).
    pub fn restore_durable<B: Backend>(
        &mut self,
        log: &DurableLog<B>,
        entries: &[CatalogEntry],
    ) -> Result<(), (String, EngineError)> {
        for entry in entries {
            log.restore(&mut self.engine, entry)
                .map_err(|error| (entry.name.clone(), error))?;
            self.durable_shards_landed(entry.shards);
            self.restore_producers(log, entry);
        }
        Ok(())
    }

    /// Rebuilds the producers of `entry`'s shards in this core's log from their journals'
    /// newest [`producer::JOURNAL_TAIL_RECORDS`] records (start-up). A journal that cannot
    /// be read is skipped with a warning: its producers are then unknown (a retry of theirs
    /// is refused with `OutOfSequence`, except a first batch).
    fn restore_producers<B: Backend>(&mut self, log: &DurableLog<B>, entry: &CatalogEntry) {
        let Some(meta) = self.engine.lookup(&entry.name) else {
            return;
        };
        for shard in 0..entry.shards {
            let Some(data) = LogShardId::new(entry.stream_id, shard) else {
                continue;
            };
            let Some(journal) = producer::journal_of(data) else {
                continue;
            };
            let Some(offsets) = log.log.shard_offsets(journal.0) else {
                continue;
            };
            let data_next = log.log.shard_offsets(data.0).map_or(0, |o| o.next);
            let from = offsets
                .oldest
                .max(offsets.next.saturating_sub(producer::JOURNAL_TAIL_RECORDS));
            let mut payloads = Vec::new();
            let mut at = from;
            let read = loop {
                if at >= offsets.next {
                    break Ok(());
                }
                match log.log.read(journal.0, at, 4096, 1 << 20) {
                    Ok(records) if records.is_empty() => break Ok(()),
                    Ok(records) => {
                        at = records.last().map_or(at, |record| record.offset + 1);
                        payloads.extend(records.into_iter().map(|record| record.payload));
                    }
                    Err(error) => break Err(error),
                }
            };
            if let Err(error) = read {
                tracing::warn!(
                    core = log.core,
                    stream = entry.name,
                    shard,
                    error = %felix_storage::ErrorChain(&error),
                    "producer journal unreadable: its producers are forgotten"
                );
                continue;
            }
            let (batches, skipped) =
                producer::replay_journal(payloads.iter().map(|payload| &payload[..]), data_next);
            if skipped > 0 {
                tracing::warn!(
                    core = log.core,
                    stream = entry.name,
                    shard,
                    skipped,
                    "producer journal records not understood were skipped"
                );
            }
            self.producers.restore((meta.handle, shard), &batches);
        }
    }

    /// Pumps `log` (see the module docs) and answers what completed. An error is fatal.
    pub fn pump_log<B: Backend>(
        &mut self,
        log: &mut DurableLog<B>,
        now: Now,
    ) -> Result<PumpReport, StorageError> {
        if std::mem::take(&mut self.log_wanted) {
            log.ensure_segment();
        }
        let report = log.pump_journaled(&mut self.engine, &mut self.journal, now.at)?;
        self.appends_held = report.held;
        self.reads_held = report.reads_held;
        self.settle(now);
        Ok(report)
    }

    /// Housekeeping of `log`, every few seconds from the shell's timer: releases the log
    /// shards of deleted durable streams (their segments' space comes back at once), then
    /// deletes segments past the retention bounds, if set.
    pub fn apply_retention<B: Backend>(
        &mut self,
        log: &mut DurableLog<B>,
        now: Now,
    ) -> Result<RetentionReport, StorageError> {
        log.release_deleted(&self.engine, self.next_stream_id)?;
        if !log.retention_bounds_set() {
            return Ok(RetentionReport::default());
        }
        log.apply_retention(&mut self.engine, now.unix_us)
    }

    /// Clean shutdown of `log` (see [`DurableLog::shutdown`]).
    pub fn shutdown_log<B: Backend>(
        &mut self,
        log: &mut DurableLog<B>,
        timeout: Duration,
    ) -> Result<(), StorageError> {
        log.shutdown_journaled(&mut self.engine, &mut self.journal, timeout)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use bytes::Bytes;
    use felix_engine::{EngineConfig, PublishCompletion, PublishToken, SubscriptionId};
    use felix_storage::{FaultBackend, FaultHandle, wait_readable};
    use felix_wire::{ErrorCode, Record, ShardSelection, StartPosition};

    use super::*;

    /// Generous bound for a real disk round (loaded 2-core machine); never a speed assert.
    const DEADLINE: Duration = Duration::from_secs(30);
    const STREAM: &str = "orders";
    const STREAM_ID: u32 = 7;

    fn engine(ring_max_records: usize) -> Engine {
        let mut engine = Engine::new(EngineConfig {
            ring_max_records,
            ..EngineConfig::default()
        });
        engine.enable_durable();
        engine
    }

    fn fault_log(dir: &Path, fsync: FsyncMode) -> (DurableLog<FaultBackend>, FaultHandle) {
        let (backend, handle) = FaultBackend::new(false).expect("fault backend");
        let mut config = LogConfig::new(dir);
        config.fsync = fsync;
        config.segment_bytes = 1 << 20;
        config.max_round_bytes = 256 << 10;
        let log = DurableLog::open(0, config, backend).expect("log opens");
        (log, handle)
    }

    fn batch(tag: u64, count: usize, payload_bytes: usize) -> Vec<Record> {
        (0..count)
            .map(|i| {
                let payload: Vec<u8> = (0..payload_bytes)
                    .map(|b| (tag as usize * 31 + i * 7 + b) as u8)
                    .collect();
                Record {
                    key: Bytes::from(format!("key-{tag}-{i}")),
                    payload: Bytes::from(payload),
                }
            })
            .collect()
    }

    fn pump(log: &mut DurableLog<impl Backend>, engine: &mut Engine) -> Vec<PublishCompletion> {
        log.pump(engine, Instant::now()).expect("no fatal error");
        engine.assert_invariants();
        std::iter::from_fn(|| engine.poll_completed_publish()).collect()
    }

    /// Pumps a real-backend log until `want` publishes completed, waiting on its eventfd.
    fn pump_until(
        log: &mut DurableLog<SystemBackend>,
        engine: &mut Engine,
        want: usize,
    ) -> Vec<PublishCompletion> {
        let deadline = Instant::now() + DEADLINE;
        let mut done = Vec::new();
        while done.len() < want {
            assert!(Instant::now() < deadline, "publishes not durable in time");
            done.extend(pump(log, engine));
            if done.len() < want && !log.is_idle() {
                wait_readable(log.wake_fd(), Duration::from_millis(100)).expect("wait");
            }
        }
        done
    }

    fn drain(engine: &mut Engine, id: SubscriptionId) -> Vec<felix_wire::DeliveredRecord> {
        engine.poll_delivery(id, usize::MAX, usize::MAX)
    }

    #[test]
    fn on_commit_acks_and_delivers_only_after_the_sync() {
        // A tracked publish completes, and its records reach a subscriber, only once the
        // round holding them (write + fdatasync) completed.
        let dir = tempfile::tempdir().expect("temp dir");
        let (mut log, handle) = fault_log(dir.path(), FsyncMode::OnCommit);
        let mut engine = engine(1024);
        engine
            .create_durable_stream(STREAM, 2, STREAM_ID)
            .expect("created");
        let sub = engine
            .subscribe(STREAM, &ShardSelection::All, &StartPosition::Latest)
            .expect("subscribed");
        engine
            .publish_tracked(1, STREAM, batch(1, 10, 64), PublishToken(1))
            .expect("published");
        let report = log.pump(&mut engine, Instant::now()).expect("pumped");
        assert!(
            engine.poll_completed_publish().is_none(),
            "no ack before the round completes"
        );
        assert_eq!(report.appended, 10);
        assert!(drain(&mut engine, sub.id).is_empty());
        assert_eq!(handle.held_rounds(), 1);
        assert!(handle.complete_next());
        let completions = pump(&mut log, &mut engine);
        assert_eq!(completions.len(), 1);
        assert_eq!(completions[0].token, PublishToken(1));
        assert!(completions[0].result.is_ok());
        assert_eq!(handle.syncs_completed(), 1);
        assert_eq!(drain(&mut engine, sub.id).len(), 10);
        assert_eq!(log.counters().records, 10);
    }

    #[test]
    fn periodic_acks_after_the_write_before_the_sync() {
        // In periodic mode the commit level is the write: acks do not wait for fdatasync.
        let dir = tempfile::tempdir().expect("temp dir");
        let interval = Duration::from_secs(3600);
        let (mut log, handle) = fault_log(dir.path(), FsyncMode::Periodic { interval });
        let mut engine = engine(1024);
        engine
            .create_durable_stream(STREAM, 1, STREAM_ID)
            .expect("created");
        engine
            .publish_tracked(1, STREAM, batch(1, 3, 16), PublishToken(9))
            .expect("published");
        assert!(pump(&mut log, &mut engine).is_empty());
        assert!(handle.complete_next());
        let completions = pump(&mut log, &mut engine);
        assert_eq!(completions.len(), 1);
        assert!(completions[0].result.is_ok());
        assert_eq!(handle.syncs_completed(), 0, "acked before any fdatasync");
        assert!(
            log.next_deadline().is_some(),
            "the periodic sync is scheduled"
        );
    }

    #[test]
    fn disk_full_refuses_the_publish_and_reuses_the_offsets() {
        // ENOSPC fails the publish with StorageFull, stores and delivers nothing of it, and
        // the next publish gets the same offsets and succeeds.
        let dir = tempfile::tempdir().expect("temp dir");
        let (mut log, handle) = fault_log(dir.path(), FsyncMode::OnCommit);
        let mut engine = engine(1024);
        engine
            .create_durable_stream(STREAM, 1, STREAM_ID)
            .expect("created");
        let sub = engine
            .subscribe(STREAM, &ShardSelection::All, &StartPosition::Earliest)
            .expect("subscribed");
        handle.fail_next_write(libc::ENOSPC, 100);
        let acks = engine
            .publish_tracked(1, STREAM, batch(1, 5, 64), PublishToken(1))
            .expect("published");
        assert_eq!(acks[0].first_offset, 0);
        assert!(pump(&mut log, &mut engine).is_empty());
        assert!(handle.complete_next());
        let completions = pump(&mut log, &mut engine);
        assert_eq!(completions.len(), 1);
        let error = completions[0].result.clone().expect_err("refused");
        assert_eq!(error.code, ErrorCode::StorageFull);
        assert_eq!(engine.durable_through(STREAM, 0), Some(0));
        assert!(drain(&mut engine, sub.id).is_empty());

        let acks = engine
            .publish_tracked(2, STREAM, batch(2, 5, 64), PublishToken(2))
            .expect("published");
        assert_eq!(
            acks[0].first_offset, 0,
            "the rolled-back offsets are reused"
        );
        assert!(pump(&mut log, &mut engine).is_empty());
        assert!(handle.complete_next());
        let completions = pump(&mut log, &mut engine);
        assert_eq!(completions.len(), 1);
        assert!(completions[0].result.is_ok());
        let delivered = drain(&mut engine, sub.id);
        assert_eq!(delivered.len(), 5);
        assert_eq!(delivered[0].key, Bytes::from("key-2-0"));
    }

    #[test]
    fn a_record_over_the_pending_bound_waits_for_an_empty_log_then_is_stored() {
        // The pending bound holds appends back (never refuses them), and a single record
        // larger than the whole bound is still taken once nothing is pending.
        let dir = tempfile::tempdir().expect("temp dir");
        let (backend, handle) = FaultBackend::new(false).expect("fault backend");
        let mut config = LogConfig::new(dir.path());
        config.fsync = FsyncMode::OnCommit;
        config.segment_bytes = 1 << 20;
        config.max_round_bytes = 4096;
        config.max_pending_bytes = 8192;
        let mut log = DurableLog::open(0, config, backend).expect("log opens");
        let mut engine = engine(1024);
        engine
            .create_durable_stream(STREAM, 1, STREAM_ID)
            .expect("created");
        // Round 1 in flight, then pending bytes, then the big record behind them.
        for tag in 1..=3 {
            engine
                .publish_tracked(tag, STREAM, batch(tag, 4, 900), PublishToken(tag))
                .expect("published");
            assert!(pump(&mut log, &mut engine).is_empty());
        }
        engine
            .publish_tracked(4, STREAM, batch(4, 1, 20_000), PublishToken(4))
            .expect("published");
        let report = log.pump(&mut engine, Instant::now()).expect("pumped");
        assert!(report.held, "the big record waits behind pending bytes");
        assert_eq!(report.refused, 0);
        assert!(engine.peek_append().is_some());
        assert!(engine.poll_completed_publish().is_none());
        let mut done = Vec::new();
        let mut rounds = 0;
        while handle.held_rounds() > 0 {
            rounds += 1;
            assert!(rounds < 100, "the rounds never end");
            assert!(handle.complete_next());
            let report = log.pump(&mut engine, Instant::now()).expect("pumped");
            assert_eq!(report.refused, 0);
            done.extend(std::iter::from_fn(|| engine.poll_completed_publish()));
        }
        let tokens: Vec<u64> = done.iter().map(|c| c.token.0).collect();
        assert_eq!(tokens, vec![1, 2, 3, 4]);
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
        assert!(engine.peek_append().is_none());
        let shard = LogShardId::new(STREAM_ID, 0).expect("id").0;
        assert_eq!(log.log().shard_offsets(shard).map(|o| o.next), Some(13));
    }

    #[test]
    fn failed_fsync_is_fatal_and_acks_nothing() {
        // An fdatasync error comes out of pump as a fatal error with no completion and no
        // delivery of the round's records.
        let dir = tempfile::tempdir().expect("temp dir");
        let (mut log, handle) = fault_log(dir.path(), FsyncMode::OnCommit);
        let mut engine = engine(1024);
        engine
            .create_durable_stream(STREAM, 1, STREAM_ID)
            .expect("created");
        let sub = engine
            .subscribe(STREAM, &ShardSelection::All, &StartPosition::Latest)
            .expect("subscribed");
        engine
            .publish_tracked(1, STREAM, batch(1, 4, 64), PublishToken(1))
            .expect("published");
        assert!(pump(&mut log, &mut engine).is_empty());
        handle.fail_next_sync(libc::EIO);
        assert!(handle.complete_next());
        let error = log.pump(&mut engine, Instant::now()).expect_err("fatal");
        assert!(error.is_fatal(), "{error}");
        assert!(matches!(error, StorageError::SyncFailed { .. }), "{error}");
        assert!(engine.poll_completed_publish().is_none());
        assert!(drain(&mut engine, sub.id).is_empty());
        // The log stays failed: later pumps fail too.
        let again = log.pump(&mut engine, Instant::now());
        assert!(again.is_err());
    }

    /// Publishes `batches` tracked batches of `per_batch` records to `STREAM` (`shards`
    /// shards) on a real backend, and returns what each shard holds, in order.
    fn publish_real(
        log: &mut DurableLog<SystemBackend>,
        engine: &mut Engine,
        shards: u32,
        batches: u64,
        per_batch: usize,
    ) -> BTreeMap<u32, Vec<(Bytes, Bytes)>> {
        let mut expected: BTreeMap<u32, Vec<(Bytes, Bytes)>> = BTreeMap::new();
        let mut done = 0;
        for tag in 0..batches {
            let records = batch(tag, per_batch, 100 + tag as usize * 37 % 900);
            for record in &records {
                let shard = felix_wire::shard_for_key(&record.key, shards);
                expected
                    .entry(shard)
                    .or_default()
                    .push((record.key.clone(), record.payload.clone()));
            }
            engine
                .publish_tracked(tag, STREAM, records, PublishToken(tag))
                .expect("published");
            let completions = pump(log, engine);
            assert!(completions.iter().all(|c| c.result.is_ok()));
            done += completions.len();
        }
        let rest = pump_until(log, engine, batches as usize - done);
        assert!(rest.iter().all(|c| c.result.is_ok()));
        expected
    }

    #[test]
    fn real_backends_store_and_recover_every_acked_record() {
        // With io_uring and with pwrite: acked records survive a reopen and are read back
        // from disk, byte-identical, dense from offset 0, through a catch-up subscription.
        for choice in [BackendChoice::IoUring, BackendChoice::Pwrite] {
            let dir = tempfile::tempdir().expect("temp dir");
            let settings = DurableSettings {
                fsync: FsyncMode::OnCommit,
                backend: choice,
                direct_io: true,
                rounds_in_flight: 2,
                segment_bytes: 256 << 10,
                retention_bytes: None,
                retention_age: None,
            };
            let entry = CatalogEntry {
                name: STREAM.to_owned(),
                shards: 4,
                stream_id: STREAM_ID,
            };
            let expected = {
                let mut log = DurableLog::open_system(dir.path(), 1, &settings).expect("opens");
                let mut engine = engine(1024);
                engine
                    .create_durable_stream(STREAM, entry.shards, STREAM_ID)
                    .expect("created");
                let expected = publish_real(&mut log, &mut engine, entry.shards, 60, 16);
                assert!(log.counters().fsyncs > 0);
                log.shutdown(&mut engine, DEADLINE).expect("clean shutdown");
                expected
            };
            assert!(log_dir(dir.path(), 1).is_dir());

            let mut log = DurableLog::open_system(dir.path(), 1, &settings).expect("reopens");
            assert_eq!(log.recovery().records, 60 * 16);
            let mut engine = engine(1024);
            let description = log.restore(&mut engine, &entry).expect("restored");
            for shard in &description.shards {
                let want = expected.get(&shard.shard).map_or(0, Vec::len) as u64;
                assert_eq!(shard.next_offset, want);
            }
            let sub = engine
                .subscribe(STREAM, &ShardSelection::All, &StartPosition::Earliest)
                .expect("subscribed");
            let mut got: BTreeMap<u32, Vec<(u64, Bytes, Bytes)>> = BTreeMap::new();
            let deadline = Instant::now() + DEADLINE;
            let total: usize = expected.values().map(Vec::len).sum();
            let mut received = 0;
            while received < total {
                assert!(Instant::now() < deadline, "catch-up did not finish");
                pump(&mut log, &mut engine);
                for record in drain(&mut engine, sub.id) {
                    got.entry(record.shard).or_default().push((
                        record.offset,
                        record.key,
                        record.payload,
                    ));
                    received += 1;
                }
            }
            for (shard, records) in &expected {
                let stored = &got[shard];
                assert_eq!(stored.len(), records.len(), "{choice:?} shard {shard}");
                for (index, ((offset, key, payload), (want_key, want_payload))) in
                    stored.iter().zip(records).enumerate()
                {
                    assert_eq!(*offset, index as u64, "dense offsets");
                    assert_eq!(key, want_key);
                    assert_eq!(payload, want_payload, "byte-identical");
                }
            }
        }
    }

    /// A subscriber starting at an offset older than the ring reads the log, then takes live
    /// records, with no gap and no duplicate, while publishing continues (pwrite backend, a
    /// real reader thread). With `force_read_misses` every look at the page cache misses, so
    /// the catch-up reads wait for the log's reader thread and are answered at later pumps
    /// (woken through the log's eventfd). Returns how many pumps left a read waiting, and the
    /// chunks the reader thread fetched.
    fn catch_up_below_the_ring_while_publishing(force_read_misses: bool) -> (u32, u64) {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut log =
            DurableLog::open_system(dir.path(), 0, &pwrite_settings(1 << 20)).expect("opens");
        let mut engine = engine(8);
        engine
            .create_durable_stream(STREAM, 1, STREAM_ID)
            .expect("created");
        publish_real(&mut log, &mut engine, 1, 40, 10);
        log.log().force_read_misses(force_read_misses);
        let sub = engine
            .subscribe(
                STREAM,
                &ShardSelection::All,
                &StartPosition::Offsets(vec![(0, 5)]),
            )
            .expect("subscribed");
        let mut offsets = Vec::new();
        let deadline = Instant::now() + DEADLINE;
        let mut tag = 1000;
        let mut waited = 0;
        while offsets.len() < 395 + 200 {
            assert!(Instant::now() < deadline, "subscriber did not catch up");
            if tag < 1020 {
                engine
                    .publish_tracked(tag, STREAM, batch(tag, 10, 32), PublishToken(tag))
                    .expect("published");
                tag += 1;
            }
            pump(&mut log, &mut engine);
            offsets.extend(drain(&mut engine, sub.id).iter().map(|r| r.offset));
            if log.reads_waiting() > 0 {
                waited += 1;
            }
            if !log.is_idle() || log.reads_waiting() > 0 {
                wait_readable(log.wake_fd(), Duration::from_millis(50)).expect("wait");
            }
        }
        let want: Vec<u64> = (5..600).collect();
        assert_eq!(offsets, want);
        assert!(engine.durable_counters().log_records_read > 0);
        if force_read_misses {
            assert_eq!(log.reads_waiting(), 0);
        }
        (waited, log.counters().read_fetches.get())
    }

    #[test]
    fn resume_below_the_ring_catches_up_from_the_log_then_live() {
        // See the helper: reads served without waiting or through the reader thread alike.
        catch_up_below_the_ring_while_publishing(false);
    }

    #[test]
    fn catch_up_through_the_reader_thread_while_publishing_continues() {
        // See the helper: every read misses the page cache, and still every offset arrives
        // once, in order, while publishes keep going.
        let (waited, fetches) = catch_up_below_the_ring_while_publishing(true);
        assert!(waited > 0, "reads waited for the reader thread");
        assert!(fetches > 0);
    }

    #[test]
    fn a_waiting_catch_up_read_holds_up_no_publish_and_tolerates_its_subscription_ending() {
        // The fault backend holds the read's fetch: meanwhile publishes are acked and
        // delivered to a live subscriber; once the fetch completes the catch-up resumes with
        // no gap and no duplicate. A second read waiting when its subscription ends is
        // answered later and ignored.
        let dir = tempfile::tempdir().expect("temp dir");
        let (mut log, fault) = fault_log(dir.path(), FsyncMode::OnCommit);
        let mut engine = engine(8);
        engine
            .create_durable_stream(STREAM, 1, STREAM_ID)
            .expect("created");
        let publish = |log: &mut DurableLog<FaultBackend>, engine: &mut Engine, tag: u64| {
            engine
                .publish_tracked(tag, STREAM, batch(tag, 10, 48), PublishToken(tag))
                .expect("published");
            let mut done = pump(log, engine);
            let mut rounds = 0;
            while done.is_empty() {
                assert!(fault.complete_next(), "a round is held");
                rounds += 1;
                assert!(rounds < 100, "the publish was never acked");
                done.extend(pump(log, engine));
            }
            assert!(done.iter().all(|c| c.result.is_ok()));
        };
        for tag in 0..30 {
            publish(&mut log, &mut engine, tag);
        }
        fault.set_read_misses(1000, 5);
        let live = engine
            .subscribe(STREAM, &ShardSelection::All, &StartPosition::Latest)
            .expect("subscribed");
        let sub = engine
            .subscribe(
                STREAM,
                &ShardSelection::All,
                &StartPosition::Offsets(vec![(0, 3)]),
            )
            .expect("subscribed");
        let gone = engine
            .subscribe(
                STREAM,
                &ShardSelection::All,
                &StartPosition::Offsets(vec![(0, 100)]),
            )
            .expect("subscribed");
        pump(&mut log, &mut engine);
        assert_eq!(log.reads_waiting(), 2, "both reads wait for the disk");
        assert!(fault.held_fetches() >= 1);
        assert!(drain(&mut engine, sub.id).is_empty());
        // Publishing goes on while the reads wait.
        for tag in 30..35 {
            publish(&mut log, &mut engine, tag);
        }
        assert_eq!(drain(&mut engine, live.id).len(), 50);
        assert_eq!(log.reads_waiting(), 2, "nothing answered them yet");
        engine.unsubscribe(gone.id);
        let mut offsets = Vec::new();
        let mut steps = 0;
        while offsets.len() < 350 - 3 {
            steps += 1;
            assert!(
                steps < 10_000,
                "catch-up stalled at {} records",
                offsets.len()
            );
            if !fault.complete_next_fetch() {
                assert!(
                    log.reads_waiting() == 0,
                    "a waiting read has its fetch held"
                );
            }
            pump(&mut log, &mut engine);
            offsets.extend(drain(&mut engine, sub.id).iter().map(|r| r.offset));
        }
        assert_eq!(offsets, (3..350).collect::<Vec<u64>>());
        assert!(log.counters().read_fetches.get() > 0);
        assert_eq!(log.reads_waiting(), 0);
        engine.assert_invariants();
    }

    fn pwrite_settings(segment_bytes: u64) -> DurableSettings {
        DurableSettings {
            fsync: FsyncMode::OnCommit,
            backend: BackendChoice::Pwrite,
            direct_io: true,
            rounds_in_flight: 2,
            segment_bytes,
            retention_bytes: None,
            retention_age: None,
        }
    }

    /// Publishes `batches` tracked batches of `per_batch` records of `payload` bytes to
    /// `stream` and waits until all are durable.
    fn publish_to(
        log: &mut DurableLog<SystemBackend>,
        engine: &mut Engine,
        stream: &str,
        batches: u64,
        per_batch: usize,
        payload: usize,
    ) {
        for tag in 0..batches {
            engine
                .publish_tracked(
                    tag,
                    stream,
                    batch(tag, per_batch, payload),
                    PublishToken(tag),
                )
                .expect("published");
        }
        let done = pump_until(log, engine, batches as usize);
        assert!(done.iter().all(|c| c.result.is_ok()));
    }

    #[test]
    fn deleting_a_durable_stream_releases_its_segments() {
        // Once a durable stream is deleted, housekeeping gives back at once the closed
        // segments that held only its records; the live stream is untouched and keeps its
        // offsets across a restart, and a stream of an id the catalogue never gave out is not
        // released.
        let dir = tempfile::tempdir().expect("temp dir");
        let settings = pwrite_settings(64 << 10);
        let mut log = DurableLog::open_system(dir.path(), 0, &settings).expect("opens");
        let mut engine = engine(1024);
        engine.create_durable_stream("kept", 1, 1).expect("created");
        engine.create_durable_stream("gone", 1, 2).expect("created");
        publish_to(&mut log, &mut engine, "kept", 4, 8, 100);
        publish_to(&mut log, &mut engine, "gone", 60, 8, 900);
        let nothing = log.release_deleted(&engine, 3).expect("release");
        assert!(nothing.shards.is_empty(), "every stream is live");
        // A stream created (and deleted) between two housekeeping passes, with an id past
        // what the catalogue had given out at start-up: never seen live, so never released.
        engine
            .create_durable_stream("unknown", 1, 9)
            .expect("created");
        publish_to(&mut log, &mut engine, "unknown", 2, 8, 100);
        publish_to(&mut log, &mut engine, "kept", 4, 8, 100);
        let segments = log.log().segment_seqs().len();
        assert!(segments >= 5, "{segments} segments");
        engine.delete_stream("gone").expect("deleted");
        engine.delete_stream("unknown").expect("deleted");
        let before = log.log().total_bytes();
        let report = log.release_deleted(&engine, 3).expect("release");
        let gone = LogShardId::new(2, 0).expect("id").0;
        assert_eq!(
            report.shards,
            vec![gone],
            "id 9 was never seen live nor catalogued"
        );
        assert!(report.segments.len() >= 3, "{report:?}");
        assert_eq!(log.log().total_bytes(), before - report.bytes_freed);
        assert!(log.counters().released_bytes >= report.bytes_freed);
        let kept = LogShardId::new(1, 0).expect("id").0;
        assert_eq!(log.log().shard_offsets(kept).map(|o| o.next), Some(64));
        assert_eq!(
            log.log()
                .read(kept, 0, 100, usize::MAX)
                .expect("read")
                .len(),
            64
        );
        log.shutdown(&mut engine, DEADLINE).expect("shutdown");
        drop(log);
        let log = DurableLog::open_system(dir.path(), 0, &settings).expect("reopens");
        assert_eq!(log.log().shard_offsets(gone), None);
        assert_eq!(
            log.log()
                .read(kept, 0, 100, usize::MAX)
                .expect("read")
                .len(),
            64
        );
        assert!(
            log.log()
                .shard_offsets(LogShardId::new(9, 0).expect("id").0)
                .is_some()
        );
    }

    #[test]
    fn catalogue_decides_which_shards_compaction_keeps() {
        // Listed streams are kept, deleted ones (ids below the next id) are not, and ids the
        // catalogue never gave out are kept rather than guessed away.
        let dir = tempfile::tempdir().expect("temp dir");
        let mut catalog = Catalog::load(dir.path()).expect("loads");
        catalog.add("a", 2).expect("added");
        catalog.add("b", 2).expect("added");
        catalog.remove("a").expect("removed");
        let live = catalogued_shards(&catalog);
        let id = |stream: u32, shard: u32| LogShardId::new(stream, shard).expect("id").0;
        assert!(!live(id(0, 1)), "deleted stream a");
        assert!(live(id(1, 0)) && live(id(1, 1)), "listed stream b");
        assert!(live(id(7, 0)), "never given out");
        assert!(log_dirs(dir.path()).expect("list").is_empty());
        std::fs::create_dir_all(log_dir(dir.path(), 1)).expect("dir");
        std::fs::create_dir_all(dir.path().join("log").join("other")).expect("dir");
        assert_eq!(
            log_dirs(dir.path()).expect("list"),
            vec![(1, log_dir(dir.path(), 1))]
        );
    }

    #[test]
    fn corruption_stops_start_up_and_a_repaired_gap_is_skipped_and_counted() {
        // A flipped byte in committed records stops the core's log from opening with the
        // repair command; after `repair`, a catch-up subscription gets every record but the
        // quarantined one, in order (the skip counted); new publishes get offsets past every
        // offset handed out.
        let dir = tempfile::tempdir().expect("temp dir");
        let settings = pwrite_settings(1 << 20);
        let entry = CatalogEntry {
            name: STREAM.to_owned(),
            shards: 1,
            stream_id: STREAM_ID,
        };
        {
            let mut log = DurableLog::open_system(dir.path(), 0, &settings).expect("opens");
            let mut engine = engine(1024);
            engine
                .create_durable_stream(STREAM, 1, STREAM_ID)
                .expect("created");
            publish_to(&mut log, &mut engine, STREAM, 4, 10, 64);
            log.shutdown(&mut engine, DEADLINE).expect("shutdown");
        }
        let core_dir = log_dir(dir.path(), 0);
        let segment_path = core_dir.join(felix_storage::segment::file_name(0));
        let bytes = std::fs::read(&segment_path).expect("read");
        let header = felix_storage::segment::read_header(
            &std::fs::File::open(&segment_path).expect("open"),
            bytes.len() as u64,
        )
        .expect("header");
        let mut at = header.header_bytes as usize;
        let damaged_at = loop {
            match felix_storage::frame::decode(&bytes[at..]) {
                felix_storage::frame::Decoded::Record {
                    record,
                    frame_bytes,
                } => {
                    if record.offset == 25 {
                        break at;
                    }
                    at += frame_bytes;
                }
                felix_storage::frame::Decoded::Mark { .. } => {
                    at += felix_storage::frame::MARK_BYTES
                }
                other => panic!("unexpected {other:?}"),
            }
        };
        let mut damaged = bytes;
        damaged[damaged_at + 40] ^= 0x20;
        std::fs::write(&segment_path, &damaged).expect("write");
        let error = DurableLog::open_system(dir.path(), 0, &settings).expect_err("refused");
        let message = error.to_string();
        assert!(matches!(error, StorageError::CorruptLog(_)), "{message}");
        assert!(
            message.contains(&format!(
                "felix log repair --data-dir {}",
                dir.path().display()
            )),
            "{message}"
        );
        assert!(message.contains(&format!("byte {damaged_at}")), "{message}");
        let lock = felix_storage::DirLock::acquire(&core_dir).expect("lock");
        let (report, lock) = felix_storage::offline::repair(lock).expect("repaired");
        drop(lock);
        assert_eq!(report.quarantined.len(), 1);
        assert_eq!(
            (report.quarantined[0].first, report.quarantined[0].end),
            (25, 26)
        );

        let mut log = DurableLog::open_system(dir.path(), 0, &settings).expect("reopens");
        assert_eq!(log.counters().quarantined_records, 1);
        let mut engine = engine(1024);
        let description = log.restore(&mut engine, &entry).expect("restored");
        assert_eq!(description.shards[0].next_offset, 40);
        let sub = engine
            .subscribe(STREAM, &ShardSelection::All, &StartPosition::Earliest)
            .expect("subscribed");
        let mut offsets = Vec::new();
        let deadline = Instant::now() + DEADLINE;
        while offsets.len() < 39 {
            assert!(
                Instant::now() < deadline,
                "the catch-up did not deliver the records around the gap: {offsets:?}"
            );
            pump(&mut log, &mut engine);
            offsets.extend(drain(&mut engine, sub.id).iter().map(|r| r.offset));
            while let Some(event) = engine.poll_event() {
                if let felix_engine::EngineEvent::SubscriptionEnded(id, error) = event {
                    assert_ne!(id, sub.id, "the subscription ended: {error}");
                }
            }
        }
        // Every record but the quarantined one, in order: exactly offset 25 is skipped, and
        // counted.
        let expected: Vec<u64> = (0..40).filter(|&offset| offset != 25).collect();
        assert_eq!(offsets, expected);
        assert_eq!(engine.durable_counters().quarantine_skipped, 1);
        engine
            .publish_tracked(9, STREAM, batch(9, 1, 8), PublishToken(9))
            .expect("published");
        let acks = engine.poll_completed_publish();
        assert!(acks.is_none());
        let mut log_engine_done = Vec::new();
        let deadline = Instant::now() + DEADLINE;
        while log_engine_done.is_empty() {
            assert!(Instant::now() < deadline, "publish not durable");
            log_engine_done.extend(pump(&mut log, &mut engine));
            if log_engine_done.is_empty() && !log.is_idle() {
                wait_readable(log.wake_fd(), Duration::from_millis(100)).expect("wait");
            }
        }
        let kept = LogShardId::new(STREAM_ID, 0).expect("id").0;
        assert_eq!(log.log().shard_offsets(kept).map(|o| o.next), Some(41));
    }
}
