//! Recovery at open: scan every segment in order, verify every record, keep the longest
//! valid prefix of the log, cut the rest, and rebuild the shard state and the index.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::frame::{self, Decoded, Invalid, RecordRef};
use crate::log::{Log, ShardState};
use crate::segment::{self, SegmentHeader};
use crate::{LogConfig, StorageError};

/// Bytes read per pread while scanning. 4 MiB: large sequential reads run at the disk's
/// rate, and the buffer is allocated once per recovery.
pub const SCAN_CHUNK_BYTES: usize = 4 << 20;
/// Bytes read per pread when looking for non-zero bytes after the cut point.
const ZERO_CHECK_CHUNK_BYTES: usize = 1 << 20;
/// How far past a cut point recovery reads to count the bytes it drops (for the report and
/// the metrics). Beyond it the segment is cleared without being read (truncate + preallocate,
/// metadata only): reading a whole preallocated 1 GiB tail took ~9 s per core at start-up,
/// because ext4 reports unwritten extents as data once their zero pages sit in the page cache.
/// 8 MiB covers a typical commit round; a larger torn region is still cleared, only under-counted.
pub const TAIL_COUNT_WINDOW_BYTES: u64 = 8 << 20;

/// One cut made by recovery.
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
    /// The next offset to append (one past the last recovered record).
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
    /// Cuts inside segments.
    pub truncations: Vec<Truncation>,
    /// Sum of `truncations[..].bytes`.
    pub truncated_bytes: u64,
    /// Whole segments deleted because they followed a cut (or were invalid).
    pub deleted_segments: Vec<u64>,
    /// Leftover `.tmp` files of interrupted segment creations, removed.
    pub removed_temp_files: usize,
    /// Every shard, ascending.
    pub shards: Vec<ShardRecovery>,
    pub duration: Duration,
}

/// Why a segment scan stopped.
#[derive(Debug)]
enum Stop {
    /// A zero header or the end of the file: where every segment's data ends.
    End,
    /// A record that is invalid, partial or out of sequence.
    Bad(String),
}

/// Scans records from `start` up to `file_len`, calling `accept` for each valid record;
/// `accept` returns an error text to stop at that record (an offset gap). Returns where the
/// accepted data ends and why the scan stopped.
fn scan(
    file: &File,
    start: u64,
    file_len: u64,
    buf: &mut Vec<u8>,
    mut accept: impl FnMut(&RecordRef<'_>, u64, u64) -> Result<(), String>,
) -> Result<(u64, Stop), StorageError> {
    let mut pos = start;
    // Bounded: every iteration consumes a frame, reads more, or returns.
    loop {
        let remaining = file_len.saturating_sub(pos);
        if remaining == 0 {
            return Ok((pos, Stop::End));
        }
        let want = (buf.capacity().max(SCAN_CHUNK_BYTES) as u64).min(remaining) as usize;
        buf.clear();
        buf.resize(want, 0);
        file.read_exact_at(buf, pos)
            .map_err(|e| StorageError::io("recovery read", e))?;
        let mut at = 0usize;
        loop {
            match frame::decode(&buf[at..]) {
                Decoded::Record {
                    record,
                    frame_bytes,
                } => {
                    let here = pos + at as u64;
                    if let Err(reason) = accept(&record, here, frame_bytes as u64) {
                        return Ok((here, Stop::Bad(reason)));
                    }
                    at += frame_bytes;
                    if at == buf.len() {
                        break;
                    }
                }
                Decoded::Incomplete { frame_bytes } => {
                    let here = pos + at as u64;
                    if here + frame_bytes as u64 > file_len {
                        let why = if buf[at..].iter().all(|b| *b == 0) {
                            Stop::End
                        } else {
                            Stop::Bad("partial record at the end of the file".into())
                        };
                        return Ok((here, why));
                    }
                    if at == 0 {
                        // One frame bigger than the buffer: grow to it (bounded by BODY_BYTES_MAX,
                        // which decode enforces before reporting a frame length).
                        buf.reserve(frame_bytes);
                    }
                    break;
                }
                Decoded::Invalid(Invalid::Zero) => return Ok((pos + at as u64, Stop::End)),
                Decoded::Invalid(why) => return Ok((pos + at as u64, Stop::Bad(why.to_string()))),
            }
        }
        pos += at as u64;
    }
}

/// End of the last non-zero byte in `[from, len)`, or `from` when all are zero. Skips holes
/// (and unwritten preallocated extents) with SEEK_DATA where the filesystem supports it.
fn nonzero_end(file: &File, from: u64, len: u64) -> Result<u64, StorageError> {
    let mut last = from;
    let mut pos = from;
    let mut buf = vec![0u8; ZERO_CHECK_CHUNK_BYTES];
    // Bounded by the file length: every pass moves `pos` forward.
    while pos < len {
        let Ok(at) = libc::off_t::try_from(pos) else {
            break;
        };
        // SAFETY: lseek on a valid fd borrowed from `file`; no memory is passed. The file
        // position it changes is unused (all IO here is positional).
        let data = unsafe { libc::lseek(file.as_raw_fd(), at, libc::SEEK_DATA) };
        let data_start = if data < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ENXIO) => break,
                _ => pos, // SEEK_DATA unsupported: read everything
            }
        } else {
            (data as u64).max(pos)
        };
        if data_start >= len {
            break;
        }
        let Ok(ds) = libc::off_t::try_from(data_start) else {
            break;
        };
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), ds, libc::SEEK_HOLE) };
        let data_end = if hole < 0 {
            len
        } else {
            (hole as u64).clamp(data_start + 1, len)
        };
        let mut p = data_start;
        while p < data_end {
            let n = ((data_end - p) as usize).min(buf.len());
            file.read_exact_at(&mut buf[..n], p)
                .map_err(|e| StorageError::io("recovery zero check", e))?;
            if let Some(i) = buf[..n].iter().rposition(|b| *b != 0) {
                last = p + i as u64 + 1;
            }
            p += n as u64;
        }
        pos = data_end;
    }
    Ok(last)
}

/// Zeroes a segment from `end` on, keeping its size: truncate, then preallocate again.
fn cut_tail(file: &File, end: u64, size: u64) -> Result<(), StorageError> {
    file.set_len(end)
        .map_err(|e| StorageError::io("recovery truncate", e))?;
    segment::preallocate(file, size)?;
    file.sync_all()
        .map_err(|e| StorageError::io("recovery fsync", e))
}

fn delete_segment(
    dir: &Path,
    seq: u64,
    report: &mut RecoveryReport,
    why: &str,
) -> Result<(), StorageError> {
    let path = dir.join(segment::file_name(seq));
    tracing::warn!(segment = seq, reason = why, "recovery deletes log segment");
    fs::remove_file(&path)
        .map_err(|e| StorageError::io(format!("delete {}", path.display()), e))?;
    report.deleted_segments.push(seq);
    Ok(())
}

impl<B: Backend> Log<B> {
    /// Opens (creating if needed) the log in `config.dir` and recovers it:
    /// - segments are read in sequence order; a gap in the sequence, an invalid header, or a
    ///   checkpoint that disagrees with the offsets recovered so far ends the log there;
    /// - every record's CRC is verified and each shard's offsets must be dense; the scan of a
    ///   segment stops at its first zero header (its end) or at the first bad or partial
    ///   record or offset gap;
    /// - at a bad record the segment is cut there (zeroed from there on) and every later
    ///   segment is deleted; in the last segment, non-zero bytes after the end (a torn
    ///   unsynced write) are zeroed too; each cut is logged with segment, position, bytes;
    /// - the index and per-shard offsets are rebuilt, and every kept segment is fsynced so
    ///   what recovery kept is durable before anything is appended after it.
    ///
    /// Blocks the calling thread (start-up only).
    pub fn open(config: LogConfig, backend: B) -> Result<(Self, RecoveryReport), StorageError> {
        config.validate()?;
        let started = Instant::now();
        let dir = config.dir.clone();
        fs::create_dir_all(&dir)
            .map_err(|e| StorageError::io(format!("create {}", dir.display()), e))?;
        let mut report = RecoveryReport::default();
        let mut seqs = Vec::new();
        for entry in fs::read_dir(&dir)
            .map_err(|e| StorageError::io(format!("list {}", dir.display()), e))?
        {
            let entry =
                entry.map_err(|e| StorageError::io(format!("list {}", dir.display()), e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(stem) = name.strip_suffix(".tmp")
                && segment::parse_file_name(stem).is_some()
            {
                fs::remove_file(entry.path())
                    .map_err(|e| StorageError::io(format!("remove {name}"), e))?;
                report.removed_temp_files += 1;
                continue;
            }
            if let Some(seq) = segment::parse_file_name(name) {
                seqs.push(seq);
            }
        }
        seqs.sort_unstable();

        let mut log = Log::empty(config, backend);
        let mut cut = false;
        let mut buf = Vec::with_capacity(SCAN_CHUNK_BYTES);
        for &seq in &seqs {
            if cut {
                delete_segment(&dir, seq, &mut report, "follows a cut")?;
                continue;
            }
            if let Some(prev) = log.segments.back()
                && prev.seq + 1 != seq
            {
                cut = true;
                delete_segment(&dir, seq, &mut report, "gap in the segment sequence")?;
                continue;
            }
            let path = dir.join(segment::file_name(seq));
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
                    cut = true;
                    delete_segment(
                        &dir,
                        seq,
                        &mut report,
                        &format!("header names segment {}", h.seq),
                    )?;
                    continue;
                }
                Err(why) => {
                    cut = true;
                    delete_segment(&dir, seq, &mut report, &format!("invalid header: {why}"))?;
                    continue;
                }
            };
            if let Err(why) = apply_checkpoint(&mut log.shards, &header) {
                cut = true;
                delete_segment(&dir, seq, &mut report, &why)?;
                continue;
            }
            let interval = log.config.index_interval_bytes;
            let mut max_ts: Option<u64> = None;
            let mut records = 0u64;
            let (end, stop) = {
                let shards = &mut log.shards;
                let index = &mut log.index;
                scan(
                    &file,
                    header.header_bytes,
                    file_len,
                    &mut buf,
                    |r, pos, frame_bytes| {
                        let state = shards
                            .entry(r.shard)
                            .or_insert_with(|| ShardState::anchored_at(r.offset));
                        if r.offset != state.written {
                            return Err(format!(
                                "shard {}: offset {} where {} was expected",
                                r.shard, r.offset, state.written
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
                        max_ts = max_ts.max(Some(r.timestamp_us));
                        records += 1;
                        report.bytes += frame_bytes;
                        Ok(())
                    },
                )?
            };
            report.records += records;
            let mut size = file_len;
            if let Stop::Bad(reason) = stop {
                cut = true;
                let window_end = file_len.min(end.saturating_add(TAIL_COUNT_WINDOW_BYTES));
                let bytes = nonzero_end(&file, end, window_end)? - end;
                // A file shortened below the configured size gets its preallocation back.
                size = file_len.max(log.config.segment_bytes);
                tracing::warn!(segment = seq, position = end, bytes, reason = %reason, "recovery truncates the log");
                cut_tail(&file, end, size)?;
                report.truncated_bytes += bytes;
                report.truncations.push(Truncation {
                    segment: seq,
                    position: end,
                    bytes,
                    reason,
                });
            }
            log.push_segment(seq, file, path, size, end, header.created_unix_us);
            if let Some(seg) = log.segments.back_mut() {
                seg.max_timestamp_us = max_ts;
            }
        }

        // Appends continue in the last segment: bytes after its end (a torn unsynced write,
        // or leftovers of a failed one) must go, or new records could line up with stale
        // ones and a later recovery would take those for real records.
        if let Some(seg) = log.segments.back_mut() {
            let window_end = seg
                .size
                .min(seg.tail.saturating_add(TAIL_COUNT_WINDOW_BYTES));
            let garbage_end = nonzero_end(&seg.file, seg.tail, window_end)?;
            if garbage_end > seg.tail {
                let bytes = garbage_end - seg.tail;
                let reason =
                    "bytes after the end of the data (torn or failed unsynced write)".to_string();
                tracing::warn!(segment = seg.seq, position = seg.tail, bytes, reason = %reason, "recovery truncates the log");
                cut_tail(&seg.file, seg.tail, seg.size)?;
                report.truncated_bytes += bytes;
                report.truncations.push(Truncation {
                    segment: seg.seq,
                    position: seg.tail,
                    bytes,
                    reason,
                });
            } else if seg.tail < seg.size {
                // Nothing within the counted window; clear the rest unread (it may still hold a
                // torn write further out in periodic mode).
                cut_tail(&seg.file, seg.tail, seg.size)?;
            }
        }

        if log.segments.is_empty() {
            // Fresh directory, or everything was cut: the first segment (after any deleted
            // one) is made when records first arrive, so an idle log takes no disk.
            log.first_seq = seqs.last().map_or(0, |s| s + 1);
            if !report.deleted_segments.is_empty() {
                segment::sync_dir(&dir)?;
            }
        } else {
            for seg in &log.segments {
                seg.file
                    .sync_all()
                    .map_err(|e| StorageError::io("recovery fsync", e))?;
            }
            if !report.deleted_segments.is_empty() {
                segment::sync_dir(&dir)?;
            }
        }

        for (shard, state) in log.shards.iter_mut() {
            state.oldest = log
                .index
                .get(shard)
                .and_then(|ix| ix.first())
                .map_or(state.written, |e| e.offset);
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
        tracing::info!(
            dir = %dir.display(),
            records = report.records,
            bytes = report.bytes,
            segments = report.segments,
            truncated_bytes = report.truncated_bytes,
            deleted_segments = report.deleted_segments.len(),
            duration_us = c.recovery_us,
            backend = log.backend.name(),
            "durable log recovered"
        );
        Ok((log, report))
    }
}

/// Checks a segment's checkpoint against the offsets recovered from earlier segments, then
/// adds the shards it introduces. A disagreement means records are missing before this
/// segment: the log must end before it.
fn apply_checkpoint(
    shards: &mut HashMap<u32, ShardState>,
    header: &SegmentHeader,
) -> Result<(), String> {
    for (shard, next) in &header.checkpoint {
        if let Some(s) = shards.get(shard)
            && s.written != *next
        {
            return Err(format!(
                "checkpoint says shard {shard} continues at {next}, recovered up to {}",
                s.written
            ));
        }
    }
    for (shard, next) in &header.checkpoint {
        shards
            .entry(*shard)
            .or_insert_with(|| ShardState::anchored_at(*next));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::HEADER_BYTES;

    #[test]
    fn scan_stops_at_zero_and_at_garbage() {
        // A scan ends cleanly at a zero header and reports a bad record at garbage.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("open");
        let mut data = Vec::new();
        frame::encode(&mut data, 1, 0, 5, b"k", b"v1");
        frame::encode(&mut data, 1, 1, 6, b"k", b"v2");
        let first_len = data.len() as u64;
        file.write_all_at(&data, 0).expect("write");
        file.set_len(4096).expect("len");
        let mut buf = Vec::new();
        let mut seen = Vec::new();
        let (end, stop) = scan(&file, 0, 4096, &mut buf, |r, _, _| {
            seen.push(r.offset);
            Ok(())
        })
        .expect("scan");
        assert_eq!((end, seen.len()), (first_len, 2));
        assert!(matches!(stop, Stop::End));
        file.write_all_at(&[7u8; HEADER_BYTES], first_len)
            .expect("garbage");
        let (end, stop) = scan(&file, 0, 4096, &mut buf, |_, _, _| Ok(())).expect("scan");
        assert_eq!(end, first_len);
        assert!(matches!(stop, Stop::Bad(_)));
        assert_eq!(
            nonzero_end(&file, end, 4096).expect("zero check"),
            first_len + HEADER_BYTES as u64
        );
    }
}
