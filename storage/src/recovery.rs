//! Recovery at open: load each closed segment from its sidecar index (or scan it when the
//! sidecar is missing or unusable, and write one), scan the active segment, verify every
//! record scanned, cut a torn tail of the active segment silently, refuse to open on damage
//! inside committed data ([`StorageError::CorruptLog`]), and rebuild the shard state and the
//! index. The rules are in `docs/storage-format.md` (Recovery; Corruption and repair).
//!
//! Threads: the thread that opens the log (a core's thread at start-up, before it serves; or
//! an offline command's).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{CorruptLog, repair_command};
use crate::index::IndexEntry;
use crate::lock::DirLock;
use crate::log::{Log, ShardState};
use crate::quarantine::{self, Quarantine, Released};
use crate::scan::{
    self, Frame, MARK_SEARCH_WINDOW_BYTES, RESYNC_WINDOW_BYTES, SCAN_CHUNK_BYTES, Stop,
};
use crate::segment::{self, SegmentHeader};
use crate::sidecar::{self, Sidecar};
use crate::{LogConfig, ShardRange, StorageError};

/// How far past the end of the active segment's data recovery reads to count the non-zero
/// bytes a cut drops (for the report and the metrics) and to notice data beyond a zeroed
/// region. Beyond it the segment is cleared without being read (truncate + preallocate,
/// metadata only): reading a whole preallocated 1 GiB tail took ~9 s per core at start-up,
/// because ext4 reports unwritten extents as data once their zero pages sit in the page cache.
/// 8 MiB covers a typical commit round; a larger torn region is still cleared, only
/// under-counted.
pub const TAIL_COUNT_WINDOW_BYTES: u64 = 8 << 20;

/// One cut made by recovery (only ever at a torn tail of the active segment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncation {
    pub segment: u64,
    /// Where the kept data of the segment ends.
    pub position: u64,
    /// Non-zero bytes dropped after `position`, counted within [`TAIL_COUNT_WINDOW_BYTES`]
    /// (the rest of the segment is cleared unread).
    pub bytes: u64,
    pub reason: String,
}

/// A shard as recovery left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRecovery {
    pub shard: u32,
    /// Oldest stored offset.
    pub oldest: u64,
    /// The next offset to append (one past the last recovered record, and past every
    /// quarantined offset).
    pub next: u64,
}

/// What recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Records kept.
    pub records: u64,
    /// Framed bytes of the records kept.
    pub bytes: u64,
    /// Segments kept.
    pub segments: usize,
    /// Cuts of a torn tail (the active segment only).
    pub truncations: Vec<Truncation>,
    /// Sum of `truncations[..].bytes`.
    pub truncated_bytes: u64,
    /// Whole segments deleted. Recovery no longer deletes segments (damage stops it
    /// instead), so this stays empty; kept for the report's readers.
    pub deleted_segments: Vec<u64>,
    /// Leftover temporary files of interrupted writes (segment creation, sidecars, the
    /// quarantine or released file), removed.
    pub removed_temp_files: usize,
    /// Closed segments loaded from their sidecar index without a scan.
    pub sidecar_segments: usize,
    /// Sidecar indexes written by this recovery (closed segments that had none usable).
    pub sidecars_written: usize,
    /// Bytes of segment data scanned.
    pub scanned_bytes: u64,
    /// Quarantined offsets (see `quarantine.rs`) and released shards, as loaded.
    pub quarantined_records: u64,
    pub released_shards: usize,
    /// Every shard, ascending.
    pub shards: Vec<ShardRecovery>,
    pub duration: Duration,
}

/// The segments and sidecars of a directory, with temporary files removed.
struct Listing {
    segments: Vec<u64>,
    sidecars: Vec<u64>,
}

fn list_dir(dir: &Path, report: &mut RecoveryReport) -> Result<Listing, StorageError> {
    let mut listing = Listing {
        segments: Vec::new(),
        sidecars: Vec::new(),
    };
    for entry in
        fs::read_dir(dir).map_err(|e| StorageError::io(format!("list {}", dir.display()), e))?
    {
        let entry = entry.map_err(|e| StorageError::io(format!("list {}", dir.display()), e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let temp = name.strip_suffix(".tmp").is_some_and(|stem| {
            segment::parse_file_name(stem).is_some() || sidecar::parse_file_name(stem).is_some()
        }) || quarantine::is_state_temp_file(name);
        if temp {
            fs::remove_file(entry.path())
                .map_err(|e| StorageError::io(format!("remove {name}"), e))?;
            report.removed_temp_files += 1;
        } else if let Some(seq) = segment::parse_file_name(name) {
            listing.segments.push(seq);
        } else if let Some(seq) = sidecar::parse_file_name(name) {
            listing.sidecars.push(seq);
        }
    }
    listing.segments.sort_unstable();
    Ok(listing)
}

impl<B: Backend> Log<B> {
    /// Opens (creating if needed) the log in `config.dir`, taking the directory's lock
    /// (`lock.rs`: a second opener, in this process or another, gets
    /// [`StorageError::Locked`]), and recovers it:
    /// - segments are taken in sequence order; a missing segment, an invalid header or a
    ///   checkpoint that disagrees with the offsets recovered so far is damage;
    /// - a closed segment with a valid sidecar index is loaded from it without a scan; one
    ///   without is scanned, every record's CRC verified, and its sidecar written;
    /// - the active segment is scanned; each shard's offsets must be dense (quarantined
    ///   ranges excepted) and released shards' records are ignored;
    /// - a bad frame in a closed segment, or in the active segment before the end a commit
    ///   mark proves synced, stops recovery with [`StorageError::CorruptLog`] (nothing is cut);
    /// - a bad frame (or data after a zero gap) in the active segment past every mark's
    ///   claim is a torn write: the segment is cut there (zeroed from there on), logged and
    ///   reported; bytes after the end of the active segment's data are cleared too;
    /// - the index and per-shard offsets are rebuilt (each shard's next offset past every
    ///   quarantined offset), and the active segment is fsynced so what recovery kept is
    ///   durable before anything is appended after it.
    ///
    /// Blocks the calling thread (start-up only).
    pub fn open(config: LogConfig, backend: B) -> Result<(Self, RecoveryReport), StorageError> {
        config.validate()?;
        let lock = DirLock::acquire(&config.dir)?;
        Self::open_with_lock(config, backend, lock)
    }

    /// [`Log::open`] with the directory's lock already held (an offline command that
    /// reopens a log without letting another process in between).
    pub fn open_with_lock(
        config: LogConfig,
        backend: B,
        lock: DirLock,
    ) -> Result<(Self, RecoveryReport), StorageError> {
        config.validate()?;
        if lock.dir() != config.dir {
            return Err(StorageError::Config(format!(
                "the lock held is of {}, not of the log's directory {}",
                lock.dir().display(),
                config.dir.display()
            )));
        }
        let started = Instant::now();
        let dir = config.dir.clone();
        let mut report = RecoveryReport::default();
        let listing = list_dir(&dir, &mut report)?;
        let quarantine = Quarantine::load(&dir)?;
        let released = Released::load(&dir)?;
        for orphan in listing
            .sidecars
            .iter()
            .filter(|s| listing.segments.binary_search(s).is_err())
        {
            sidecar::remove(&dir, *orphan);
        }
        let mut log = Log::empty(config, backend, lock);
        report.quarantined_records = quarantine.total_offsets();
        report.released_shards = released.len();
        log.quarantine = quarantine;
        log.released = released;
        let mut buf = Vec::with_capacity(SCAN_CHUNK_BYTES);
        let count = listing.segments.len();
        for (i, &seq) in listing.segments.iter().enumerate() {
            recover_segment(&mut log, seq, i + 1 == count, &mut buf, &mut report)?;
        }
        if let Some(active) = log.segments.back() {
            active
                .file
                .sync_all()
                .map_err(|e| StorageError::io("recovery fsync", e))?;
        }
        if report.sidecars_written > 0 || report.removed_temp_files > 0 {
            segment::sync_dir(&dir)?;
        }
        finish_shards(&mut log);
        let mark_delay = log.mark_delay();
        if let Some(active) = log.segments.back_mut() {
            active.synced_end = active.tail;
            active.synced_records_end = active.records_end;
            active.mark_claim_durable = active.mark_claim_written;
            if active.synced_records_end > active.mark_claim_durable {
                log.mark_due_at = Some(Instant::now() + mark_delay);
            }
        }
        let mut shards: Vec<ShardRecovery> = log
            .shards
            .iter()
            .map(|(id, s)| ShardRecovery {
                shard: *id,
                oldest: s.oldest,
                next: s.next,
            })
            .collect();
        shards.sort_unstable_by_key(|s| s.shard);
        report.shards = shards;
        report.segments = log.segments.len();
        report.duration = started.elapsed();
        let c = &mut log.counters;
        c.recovery_records = report.records;
        c.recovery_bytes = report.bytes;
        c.recovery_truncated_bytes = report.truncated_bytes;
        c.recovery_us = u64::try_from(report.duration.as_micros()).unwrap_or(u64::MAX);
        c.recovery_sidecar_segments = report.sidecar_segments as u64;
        c.recovery_scanned_bytes = report.scanned_bytes;
        c.sidecars_written = report.sidecars_written as u64;
        c.quarantined_records = report.quarantined_records;
        tracing::info!(
            dir = %dir.display(),
            records = report.records,
            bytes = report.bytes,
            segments = report.segments,
            sidecar_segments = report.sidecar_segments,
            scanned_bytes = report.scanned_bytes,
            truncated_bytes = report.truncated_bytes,
            quarantined_records = report.quarantined_records,
            duration_us = c.recovery_us,
            backend = log.backend.name(),
            "durable log recovered"
        );
        Ok((log, report))
    }
}

/// Each shard's next offset goes past every quarantined offset, shards known only from the
/// quarantine are anchored past it, and each shard's oldest offset is its first record (or
/// the start of a quarantined range right before it).
fn finish_shards<B: Backend>(log: &mut Log<B>) {
    let quarantined: Vec<u32> = log
        .quarantine
        .shards()
        .filter(|s| !log.released.contains(*s))
        .collect();
    for shard in quarantined {
        let Some(end) = log.quarantine.end_of(shard) else {
            continue;
        };
        let state = log
            .shards
            .entry(shard)
            .or_insert_with(|| ShardState::anchored_at(end));
        let next = log.quarantine.skip(shard, state.written).max(end);
        state.written = next;
        state.synced = next;
        state.next = next;
    }
    for (shard, state) in log.shards.iter_mut() {
        let first = log
            .index
            .get(shard)
            .and_then(|ix| ix.first())
            .map_or(state.written, |e| e.offset);
        state.oldest = log.quarantine.extend_down(*shard, first);
    }
}

/// Recovers one segment into `log`: from its sidecar when it is closed and has a usable
/// one, else by scanning it.
fn recover_segment<B: Backend>(
    log: &mut Log<B>,
    seq: u64,
    newest: bool,
    buf: &mut Vec<u8>,
    report: &mut RecoveryReport,
) -> Result<(), StorageError> {
    let dir = log.config.dir.clone();
    let path = dir.join(segment::file_name(seq));
    if let Some(prev) = log.segments.back()
        && prev.seq + 1 != seq
    {
        let missing = prev.seq + 1;
        return Err(corrupt(
            log,
            missing,
            dir.join(segment::file_name(missing)),
            0,
            format!(
                "segment file missing (the sequence jumps from {} to {seq})",
                prev.seq
            ),
            Vec::new(),
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| StorageError::io(format!("open {}", path.display()), e))?;
    let file_len = file
        .metadata()
        .map_err(|e| StorageError::io(format!("stat {}", path.display()), e))?
        .len();
    let header = match segment::read_header(&file, file_len) {
        Ok(h) if h.seq == seq => h,
        Ok(h) => {
            let why = format!("the header names segment {}", h.seq);
            return Err(corrupt(log, seq, path, 0, why, Vec::new()));
        }
        Err(why) => {
            let why = format!("invalid segment header: {why}");
            return Err(corrupt(log, seq, path, 0, why, Vec::new()));
        }
    };
    if let Err((why, ranges)) = apply_checkpoint(log, &header) {
        return Err(corrupt(log, seq, path, 0, why, ranges));
    }
    if !newest {
        match sidecar::read(&dir, seq) {
            Ok(Some(sc)) => match sidecar_fits(log, &sc, &header, file_len) {
                Ok(()) => {
                    load_sidecar(log, file, path, file_len, &header, &sc, report);
                    return Ok(());
                }
                Err(why) => {
                    tracing::info!(segment = seq, reason = %why, "sidecar index not used; scanning the segment")
                }
            },
            Ok(None) => {}
            Err(why) => {
                tracing::warn!(segment = seq, reason = %why, "bad sidecar index; scanning the segment")
            }
        }
    }
    log.push_segment(
        seq,
        file,
        path.clone(),
        file_len,
        header.header_bytes,
        header.crc,
        header.created_unix_us,
    );
    let (end, stop) = scan_segment(log, seq, file_len, buf, report)?;
    let Some(seg) = log.segments.back() else {
        unreachable!("pushed above");
    };
    let file = std::sync::Arc::clone(&seg.file);
    if !newest {
        if let Stop::Bad(reason) = stop {
            return Err(corrupt_at(log, seq, path, &file, file_len, end, reason));
        }
        let sc = log.sidecar_of(seg);
        match sidecar::write(&dir, &sc) {
            Ok(()) => report.sidecars_written += 1,
            Err(error) => {
                tracing::warn!(segment = seq, error = %crate::ErrorChain(&error), "cannot write a sidecar index")
            }
        }
        return Ok(());
    }
    // The active segment: what follows the end of its data is either nothing (zeros), a
    // torn write (cut silently) or damage inside synced data (a commit mark proves it).
    let size = file_len.max(log.config.segment_bytes);
    let window_end = file_len.min(end.saturating_add(TAIL_COUNT_WINDOW_BYTES));
    let garbage_end = scan::nonzero_end(&file, end, window_end)?;
    let bad = match stop {
        Stop::Bad(reason) => Some(reason),
        Stop::End if garbage_end > end => {
            Some("data after a zero gap (torn or failed unsynced write)".to_string())
        }
        Stop::End => None,
    };
    if let Some(reason) = bad {
        let proven_before = seg.mark_claim_written;
        let search_end = file_len.min(end.saturating_add(MARK_SEARCH_WINDOW_BYTES));
        let claim = proven_before.max(scan::max_mark_claim(&file, end, search_end)?);
        if claim > end {
            let reason =
                format!("{reason}; a commit mark proves the segment was synced up to byte {claim}");
            return Err(corrupt_at(log, seq, path, &file, file_len, end, reason));
        }
        let bytes = garbage_end - end;
        let reason = format!("{reason} after the last commit mark's claim: a torn write");
        tracing::warn!(segment = seq, position = end, bytes, reason = %reason, "recovery truncates the log");
        scan::cut_tail(&file, end, size)?;
        report.truncated_bytes += bytes;
        report.truncations.push(Truncation {
            segment: seq,
            position: end,
            bytes,
            reason,
        });
    } else if end < file_len || size > file_len {
        // Nothing within the counted window; clear the rest unread (it may still hold a torn
        // write further out in periodic mode).
        scan::cut_tail(&file, end, size)?;
    }
    if size > file_len {
        // A file shortened below the configured size got its preallocation back.
        log.total_bytes += size - file_len;
        if let Some(seg) = log.segments.back_mut() {
            seg.size = size;
        }
    }
    Ok(())
}

/// Scans the frames of the segment just pushed, filling the shard state, the index and the
/// segment's stats and marks.
fn scan_segment<B: Backend>(
    log: &mut Log<B>,
    seq: u64,
    file_len: u64,
    buf: &mut Vec<u8>,
    report: &mut RecoveryReport,
) -> Result<(u64, Stop), StorageError> {
    let interval = log.config.index_interval_bytes;
    let shards = &mut log.shards;
    let index = &mut log.index;
    let quarantine = &log.quarantine;
    let released = &log.released;
    let Some(seg) = log.segments.back_mut() else {
        unreachable!("the caller pushed the segment");
    };
    let file = std::sync::Arc::clone(&seg.file);
    let start = seg.data_start;
    let mut records = 0u64;
    let mut bytes = 0u64;
    let (end, stop) = scan::scan(&file, start, file_len, buf, |frame| {
        match frame {
            Frame::Record {
                record: r,
                pos,
                len,
            } => {
                if released.contains(r.shard) {
                    seg.released_records += 1;
                    return Ok(());
                }
                let state = shards
                    .entry(r.shard)
                    .or_insert_with(|| ShardState::anchored_at(r.offset));
                let want = quarantine.skip(r.shard, state.written);
                if r.offset != want {
                    return Err(format!(
                        "shard {}: offset {} where {want} was expected",
                        r.shard, r.offset
                    ));
                }
                if r.offset == u64::MAX {
                    return Err(format!("shard {}: offset u64::MAX", r.shard));
                }
                state.written = r.offset + 1;
                state.synced = state.written;
                state.next = state.written;
                index
                    .entry(r.shard)
                    .or_default()
                    .add(r.offset, seq, pos, interval);
                seg.note_records(r.shard, r.offset, r.offset + 1, 1);
                seg.record_bytes += len;
                seg.records_end = pos + len;
                seg.max_timestamp_us = seg.max_timestamp_us.max(Some(r.timestamp_us));
                records += 1;
                bytes += len;
            }
            Frame::Mark { synced_end } => {
                seg.mark_claim_written = seg.mark_claim_written.max(synced_end);
            }
        }
        Ok(())
    })?;
    seg.tail = end;
    report.records += records;
    report.bytes += bytes;
    report.scanned_bytes += end - start;
    Ok((end, stop))
}

/// Whether a sidecar describes this segment and continues the offsets recovered so far.
fn sidecar_fits<B: Backend>(
    log: &Log<B>,
    sc: &Sidecar,
    header: &SegmentHeader,
    file_len: u64,
) -> Result<(), String> {
    if sc.seq != header.seq || sc.header_crc != header.crc {
        return Err("written for another incarnation of the segment".into());
    }
    if sc.index_interval_bytes != log.config.index_interval_bytes {
        return Err(format!(
            "built with index interval {}, the log uses {}",
            sc.index_interval_bytes, log.config.index_interval_bytes
        ));
    }
    if sc.data_end < header.header_bytes || sc.data_end > file_len {
        return Err(format!(
            "data end {} outside the file ({file_len} bytes)",
            sc.data_end
        ));
    }
    let mut firsts: HashMap<u32, (u64, u64)> = HashMap::new();
    for (shard, offset, position) in &sc.entries {
        if *position < header.header_bytes {
            return Err("an index entry points into the header".into());
        }
        firsts.entry(*shard).or_insert((*offset, *position));
    }
    for s in &sc.shards {
        if log.released.contains(s.shard) {
            continue;
        }
        if firsts.get(&s.shard).map(|f| f.0) != Some(s.first) {
            return Err(format!(
                "shard {} has no entry for its first record",
                s.shard
            ));
        }
        if let Some(state) = log.shards.get(&s.shard) {
            let want = log.quarantine.skip(s.shard, state.written);
            if s.first != want {
                return Err(format!(
                    "shard {} starts at {} where {want} was expected",
                    s.shard, s.first
                ));
            }
        }
    }
    Ok(())
}

fn load_sidecar<B: Backend>(
    log: &mut Log<B>,
    file: File,
    path: PathBuf,
    file_len: u64,
    header: &SegmentHeader,
    sc: &Sidecar,
    report: &mut RecoveryReport,
) {
    let seq = header.seq;
    log.push_segment(
        seq,
        file,
        path,
        file_len,
        header.header_bytes,
        header.crc,
        header.created_unix_us,
    );
    let mut records = 0;
    for s in sc.shards.iter().filter(|s| !log.released.contains(s.shard)) {
        let state = log
            .shards
            .entry(s.shard)
            .or_insert_with(|| ShardState::anchored_at(s.first));
        state.written = s.end;
        state.synced = s.end;
        state.next = s.end;
        records += s.records;
    }
    for (shard, offset, position) in &sc.entries {
        if log.released.contains(*shard) {
            continue;
        }
        log.index.entry(*shard).or_default().push(IndexEntry {
            offset: *offset,
            segment: seq,
            position: *position,
        });
    }
    let Some(seg) = log.segments.back_mut() else {
        unreachable!("pushed above");
    };
    for s in &sc.shards {
        if log.released.contains(s.shard) {
            seg.released_records += s.records;
        } else {
            seg.note_records(s.shard, s.first, s.end, s.records);
        }
    }
    seg.tail = sc.data_end;
    seg.records_end = sc.data_end;
    seg.synced_end = sc.data_end;
    seg.synced_records_end = sc.data_end;
    seg.record_bytes = sc.record_bytes;
    seg.max_timestamp_us = sc.max_timestamp_us;
    report.records += records;
    report.bytes += sc.record_bytes;
    report.sidecar_segments += 1;
}

/// Checks a segment's checkpoint against the offsets recovered from earlier segments
/// (a quarantined range may lie between: the checkpoint may name any offset from the shard's
/// end to the range's end; released shards are ignored), then adds the shards
/// it introduces. A disagreement means records are missing before this segment.
fn apply_checkpoint<B: Backend>(
    log: &mut Log<B>,
    header: &SegmentHeader,
) -> Result<(), (String, Vec<ShardRange>)> {
    for (shard, next) in &header.checkpoint {
        if log.released.contains(*shard) {
            continue;
        }
        if let Some(s) = log.shards.get(shard) {
            // The checkpoint may point anywhere in a quarantined range that starts at the
            // shard's end (quarantined offsets after it belong to this segment or later).
            let want = log.quarantine.skip(*shard, s.written);
            if *next < s.written || *next > want {
                return Err((
                    format!(
                        "the checkpoint says shard {shard} continues at offset {next}, earlier segments hold it up to {want}"
                    ),
                    vec![ShardRange {
                        shard: *shard,
                        first: want.min(*next),
                        end: want.max(*next),
                    }],
                ));
            }
        }
    }
    for (shard, next) in &header.checkpoint {
        if !log.released.contains(*shard) {
            log.shards
                .entry(*shard)
                .or_insert_with(|| ShardState::anchored_at(*next));
        }
    }
    Ok(())
}

fn corrupt<B: Backend>(
    log: &Log<B>,
    segment: u64,
    file: PathBuf,
    position: u64,
    reason: String,
    attributed: Vec<ShardRange>,
) -> StorageError {
    let detail = CorruptLog {
        dir: log.config.dir.clone(),
        segment,
        file,
        position,
        reason,
        attributed,
        repair_command: repair_command(&log.config.dir),
    };
    tracing::error!(error = %detail, "durable log recovery stopped");
    StorageError::CorruptLog(Box::new(detail))
}

/// The error for damage at `position` of a segment, attributing what it can: the damaged
/// records' own headers, and offsets missing before the next valid records.
fn corrupt_at<B: Backend>(
    log: &Log<B>,
    seq: u64,
    path: PathBuf,
    file: &File,
    file_len: u64,
    position: u64,
    reason: String,
) -> StorageError {
    let expected: HashMap<u32, u64> = log
        .shards
        .iter()
        .map(|(id, s)| (*id, log.quarantine.skip(*id, s.written)))
        .collect();
    // A later segment's checkpoint tells where every shard continued.
    let next_path = log.config.dir.join(segment::file_name(seq + 1));
    let next_checkpoint = File::open(&next_path)
        .ok()
        .and_then(|f| {
            let len = f.metadata().ok()?.len();
            segment::read_header(&f, len).ok()
        })
        .map(|h| h.checkpoint)
        .unwrap_or_default();
    let attributed =
        attribute(file, file_len, position, &expected, &next_checkpoint).unwrap_or_default();
    corrupt(log, seq, path, position, reason, attributed)
}

/// Best effort (IO errors give up): see [`corrupt_at`].
fn attribute(
    file: &File,
    file_len: u64,
    position: u64,
    expected: &HashMap<u32, u64>,
    next_checkpoint: &[(u32, u64)],
) -> Result<Vec<ShardRange>, StorageError> {
    let limit = file_len.min(position.saturating_add(RESYNC_WINDOW_BYTES));
    let known = |s: u32| expected.contains_key(&s);
    let next = scan::resync(file, position + 1, limit, file_len, &known)?;
    let span_end = match next {
        Some(q) => q,
        None => scan::nonzero_end(file, position, limit)?,
    };
    let (pairs, _) = scan::attribute_span(file, position, span_end, expected)?;
    let mut ranges: HashMap<u32, ShardRange> = scan::attributed_ranges(&pairs, expected)
        .into_iter()
        .map(|r| (r.shard, r))
        .collect();
    let mut seen: HashMap<u32, u64> = HashMap::new();
    if let Some(q) = next {
        // The first record of each shard after the damage shows the offsets it held.
        let mut buf = Vec::with_capacity(SCAN_CHUNK_BYTES);
        let scan_end = file_len.min(q + SCAN_CHUNK_BYTES as u64);
        scan::scan(file, q, scan_end, &mut buf, |frame| {
            if let Frame::Record { record, .. } = frame {
                seen.entry(record.shard).or_insert(record.offset);
            }
            Ok(())
        })?;
    }
    let later = next_checkpoint
        .iter()
        .filter(|(shard, _)| !seen.contains_key(shard));
    for (shard, first_after) in seen.iter().map(|(s, o)| (*s, *o)).chain(later.copied()) {
        if let Some(e) = expected.get(&shard)
            && first_after > *e
        {
            let r = ranges.entry(shard).or_insert(ShardRange {
                shard,
                first: *e,
                end: first_after,
            });
            r.end = r.end.max(first_after);
        }
    }
    let mut out: Vec<ShardRange> = ranges.into_values().collect();
    out.sort_unstable_by_key(|r| r.shard);
    Ok(out)
}
