//! Reading segment files frame by frame, shared by recovery (`recovery.rs`) and the offline
//! commands (`offline.rs`): the sequential scan, the search for commit marks past a bad frame,
//! the resynchronisation on the next valid frame after damage, and the lenient reading of
//! damaged headers that attributes lost offsets to shards.
//!
//! Threads: whichever thread opens the log (start-up) or runs an offline command.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use crate::frame::{self, Decoded, HEADER_BYTES, Invalid, RecordRef};
use crate::{ShardRange, StorageError, segment};

/// Bytes read per pread while scanning. 4 MiB: large sequential reads run at the disk's
/// rate, and the buffer is allocated once per recovery.
pub const SCAN_CHUNK_BYTES: usize = 4 << 20;
/// Bytes read per pread when looking for non-zero bytes after the cut point.
const ZERO_CHECK_CHUNK_BYTES: usize = 1 << 20;
/// How far past a bad frame in the active segment recovery looks for a commit mark proving
/// that the bad bytes were synced (so they are corruption, not a torn write). The proving
/// mark, when there is one, is in the first round written after the fdatasync that covered
/// the bad bytes, and a round is at most `LogConfig::max_round_bytes` (4 MiB by default); in
/// periodic mode the bad bytes may lie up to one interval of writes before that fdatasync.
/// 256 MiB covers a full 250 ms interval at ~1 GB/s plus the round; it is read only when the
/// active segment has a bad frame (a torn tail after a power loss, or damage), and unwritten
/// (hole) ranges are skipped without reading.
pub const MARK_SEARCH_WINDOW_BYTES: u64 = 256 << 20;
/// How far past damage the resynchronisation looks for the next valid frame before giving
/// up on the rest of the segment: 64 MiB, the largest record body (`frame::BODY_BYTES_MAX`),
/// so a single damaged record of any size is stepped over.
pub const RESYNC_WINDOW_BYTES: u64 = frame::BODY_BYTES_MAX as u64;
/// Largest record body a resynchronisation accepts from a shard it has not seen yet. Known
/// shards' records of any size are accepted; capping unknown ones at 64 KiB bounds the CRC
/// work on random damaged bytes (a random length passes this filter once per 65,536
/// positions) while still finding small records of a shard first seen after the damage.
const RESYNC_UNKNOWN_SHARD_BODY_MAX: usize = 64 << 10;

/// One valid frame found by a scan.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Frame<'a> {
    Record {
        record: RecordRef<'a>,
        pos: u64,
        len: u64,
    },
    Mark {
        synced_end: u64,
    },
}

/// Why a segment scan stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stop {
    /// A zero header or the end of the file: where every segment's data ends.
    End,
    /// A frame that is invalid, partial, or refused by the visitor (an offset gap).
    Bad(String),
}

/// Scans frames from `start` up to `file_len`, calling `visit` for each valid one; `visit`
/// returns an error text to stop at that frame. A mark claiming a position past itself is a
/// bad frame. Returns where the accepted frames end and why the scan stopped.
pub(crate) fn scan(
    file: &File,
    start: u64,
    file_len: u64,
    buf: &mut Vec<u8>,
    mut visit: impl FnMut(Frame<'_>) -> Result<(), String>,
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
            let here = pos + at as u64;
            let (frame, frame_bytes) = match frame::decode(&buf[at..]) {
                Decoded::Record {
                    record,
                    frame_bytes,
                } => (
                    Frame::Record {
                        record,
                        pos: here,
                        len: frame_bytes as u64,
                    },
                    frame_bytes,
                ),
                Decoded::Mark { synced_end, .. } => {
                    if synced_end > here {
                        return Ok((here, Stop::Bad("commit mark claims bytes after it".into())));
                    }
                    (Frame::Mark { synced_end }, frame::MARK_BYTES)
                }
                Decoded::Incomplete { frame_bytes } => {
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
                Decoded::Invalid(Invalid::Zero) => return Ok((here, Stop::End)),
                Decoded::Invalid(why) => return Ok((here, Stop::Bad(why.to_string()))),
            };
            if let Err(reason) = visit(frame) {
                return Ok((here, Stop::Bad(reason)));
            }
            at += frame_bytes;
            if at == buf.len() {
                break;
            }
        }
        pos += at as u64;
    }
}

/// Calls `f(start, end)` for each data (non-hole) range of `[from, limit)`: SEEK_DATA and
/// SEEK_HOLE skip unwritten ranges without reading them where the filesystem supports it;
/// elsewhere the whole range is one data range.
fn for_data_ranges(
    file: &File,
    from: u64,
    limit: u64,
    mut f: impl FnMut(u64, u64) -> Result<bool, StorageError>,
) -> Result<(), StorageError> {
    let mut pos = from;
    // Bounded by the file length: every pass moves `pos` forward.
    while pos < limit {
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
        if data_start >= limit {
            break;
        }
        let Ok(ds) = libc::off_t::try_from(data_start) else {
            break;
        };
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), ds, libc::SEEK_HOLE) };
        let data_end = if hole < 0 {
            limit
        } else {
            (hole as u64).clamp(data_start + 1, limit)
        };
        if !f(data_start, data_end)? {
            break;
        }
        pos = data_end;
    }
    Ok(())
}

/// End of the last non-zero byte in `[from, len)`, or `from` when all are zero.
pub(crate) fn nonzero_end(file: &File, from: u64, len: u64) -> Result<u64, StorageError> {
    let mut last = from;
    let mut buf = vec![0u8; ZERO_CHECK_CHUNK_BYTES];
    for_data_ranges(file, from, len, |start, end| {
        let mut p = start;
        while p < end {
            let n = ((end - p) as usize).min(buf.len());
            file.read_exact_at(&mut buf[..n], p)
                .map_err(|e| StorageError::io("recovery zero check", e))?;
            if let Some(i) = buf[..n].iter().rposition(|b| *b != 0) {
                last = p + i as u64 + 1;
            }
            p += n as u64;
        }
        Ok(true)
    })?;
    Ok(last)
}

/// The largest claim of a valid commit mark in `[from, limit)` (only marks whose claim does
/// not exceed their own position count), or 0. Holes are skipped; the byte pattern of a mark
/// header is checked before its CRC.
pub(crate) fn max_mark_claim(file: &File, from: u64, limit: u64) -> Result<u64, StorageError> {
    let mut best = 0u64;
    let mut buf = vec![0u8; SCAN_CHUNK_BYTES + HEADER_BYTES];
    for_data_ranges(file, from, limit, |start, end| {
        let mut p = start;
        while p < end {
            // Overlap by a header so a mark across two chunks is seen.
            let n = ((end - p) as usize + HEADER_BYTES).min(buf.len());
            let got = read_upto(file, &mut buf[..n], p)?;
            if got < HEADER_BYTES {
                break;
            }
            for i in 0..=got - HEADER_BYTES {
                let bytes = &buf[i..i + HEADER_BYTES];
                if frame::looks_like_mark(bytes)
                    && let Decoded::Mark { synced_end, .. } = frame::decode(bytes)
                    && synced_end <= p + i as u64
                {
                    best = best.max(synced_end);
                }
            }
            p += (got - HEADER_BYTES + 1) as u64;
        }
        Ok(true)
    })?;
    Ok(best)
}

/// Reads up to `buf.len()` bytes at `pos` (fewer at the end of the file).
fn read_upto(file: &File, buf: &mut [u8], pos: u64) -> Result<usize, StorageError> {
    let mut at = 0;
    while at < buf.len() {
        match file.read_at(&mut buf[at..], pos + at as u64) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(StorageError::io("read segment", e)),
        }
    }
    Ok(at)
}

/// The first position in `[from, limit)` where a valid frame (ending by `file_len`) starts: a
/// commit mark, or a record of a shard in `known` (any size) or of another shard (small bodies
/// only, see [`RESYNC_UNKNOWN_SHARD_BODY_MAX`]). `None` when there is none.
pub(crate) fn resync(
    file: &File,
    from: u64,
    limit: u64,
    file_len: u64,
    known: &dyn Fn(u32) -> bool,
) -> Result<Option<u64>, StorageError> {
    let mut found = None;
    let mut buf = vec![0u8; SCAN_CHUNK_BYTES + HEADER_BYTES];
    let mut big = Vec::new();
    for_data_ranges(file, from, limit, |start, end| {
        let mut p = start;
        while p < end {
            let n = ((end - p) as usize + HEADER_BYTES).min(buf.len());
            let got = read_upto(file, &mut buf[..n], p)?;
            if got < HEADER_BYTES {
                return Ok(true);
            }
            for i in 0..=got - HEADER_BYTES {
                let here = p + i as u64;
                if here >= limit {
                    return Ok(false);
                }
                let Some(h) = frame::decode_header(&buf[i..]) else {
                    continue;
                };
                let body = h.body_len as usize;
                let fits = here + (HEADER_BYTES + body) as u64 <= file_len;
                let candidate = frame::looks_like_mark(&buf[i..])
                    || (fits
                        && body <= frame::BODY_BYTES_MAX
                        && usize::from(h.key_len) <= body
                        && (known(h.shard) || body <= RESYNC_UNKNOWN_SHARD_BODY_MAX));
                if !candidate {
                    continue;
                }
                let frame_end = i + HEADER_BYTES + body;
                let decoded_ok = if frame_end <= got {
                    valid_frame(&buf[i..frame_end], here)
                } else {
                    big.clear();
                    big.resize(HEADER_BYTES + body, 0);
                    read_upto(file, &mut big, here)? == big.len() && valid_frame(&big, here)
                };
                if decoded_ok {
                    found = Some(here);
                    return Ok(false);
                }
            }
            p += (got - HEADER_BYTES + 1) as u64;
        }
        Ok(true)
    })?;
    Ok(found)
}

fn valid_frame(bytes: &[u8], here: u64) -> bool {
    match frame::decode(bytes) {
        Decoded::Record { .. } => true,
        Decoded::Mark { synced_end, .. } => synced_end <= here,
        _ => false,
    }
}

/// Reads the damaged span `[from, to)` leniently: walks the headers whose lengths tile the
/// span and whose shard is in `expected` with an offset that could be the shard's next ones
/// (at least its expected offset, at most one offset per 28 bytes of the span beyond it).
/// Returns the attributed `(shard, offset)` pairs and whether the walk covered the span.
pub(crate) fn attribute_span(
    file: &File,
    from: u64,
    to: u64,
    expected: &HashMap<u32, u64>,
) -> Result<(Vec<(u32, u64)>, bool), StorageError> {
    let span = to.saturating_sub(from);
    // Reading is bounded by the resync window that produced the span.
    let len = usize::try_from(span.min(RESYNC_WINDOW_BYTES)).unwrap_or(0);
    let mut buf = vec![0u8; len];
    let got = read_upto(file, &mut buf, from)?;
    buf.truncate(got);
    let most = span / HEADER_BYTES as u64 + 1;
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < buf.len() {
        let Some(h) = frame::decode_header(&buf[at..]) else {
            break;
        };
        let frame_bytes = HEADER_BYTES.saturating_add(h.body_len as usize);
        let plausible = expected
            .get(&h.shard)
            .is_some_and(|e| h.offset >= *e && h.offset - *e < most);
        if !plausible {
            break;
        }
        if at + frame_bytes > buf.len() {
            // The first damaged header may have lost only its length: its shard and offset
            // still name the record (they matched the shard's expected offset).
            if at == 0 {
                out.push((h.shard, h.offset));
            }
            break;
        }
        out.push((h.shard, h.offset));
        at += frame_bytes;
    }
    Ok((out, at == buf.len()))
}

/// Turns attributed `(shard, offset)` pairs plus the expected offsets into per-shard ranges
/// `[expected, last attributed + 1)`, ascending by shard.
pub(crate) fn attributed_ranges(
    pairs: &[(u32, u64)],
    expected: &HashMap<u32, u64>,
) -> Vec<ShardRange> {
    let mut by_shard: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
    for &(shard, offset) in pairs {
        let end = by_shard.entry(shard).or_insert(0);
        *end = (*end).max(offset + 1);
    }
    by_shard
        .into_iter()
        .filter_map(|(shard, end)| {
            let first = *expected.get(&shard)?;
            (end > first).then_some(ShardRange { shard, first, end })
        })
        .collect()
}

/// Zeroes a segment from `end` on, keeping its size: truncate, then preallocate again.
pub(crate) fn cut_tail(file: &File, end: u64, size: u64) -> Result<(), StorageError> {
    file.set_len(end)
        .map_err(|e| StorageError::io("recovery truncate", e))?;
    segment::preallocate(file, size)?;
    file.sync_all()
        .map_err(|e| StorageError::io("recovery fsync", e))
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;

    use super::*;

    fn temp_file(dir: &std::path::Path) -> File {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("f"))
            .expect("open")
    }

    #[test]
    fn scan_stops_at_zero_and_at_garbage() {
        // A scan ends cleanly at a zero header and reports a bad record at garbage.
        let dir = tempfile::tempdir().expect("tempdir");
        let file = temp_file(dir.path());
        let mut data = Vec::new();
        frame::encode(&mut data, 1, 0, 5, b"k", b"v1");
        frame::encode(&mut data, 1, 1, 6, b"k", b"v2");
        let first_len = data.len() as u64;
        file.write_all_at(&data, 0).expect("write");
        file.set_len(4096).expect("len");
        let mut buf = Vec::new();
        let mut seen = Vec::new();
        let (end, stop) = scan(&file, 0, 4096, &mut buf, |f| {
            if let Frame::Record { record, .. } = f {
                seen.push(record.offset);
            }
            Ok(())
        })
        .expect("scan");
        assert_eq!((end, seen.len()), (first_len, 2));
        assert_eq!(stop, Stop::End);
        file.write_all_at(&[7u8; HEADER_BYTES], first_len)
            .expect("garbage");
        let (end, stop) = scan(&file, 0, 4096, &mut buf, |_| Ok(())).expect("scan");
        assert_eq!(end, first_len);
        assert!(matches!(stop, Stop::Bad(_)));
        assert_eq!(
            nonzero_end(&file, end, 4096).expect("zero check"),
            first_len + HEADER_BYTES as u64
        );
    }

    #[test]
    fn marks_resync_and_attribution() {
        // Past a damaged record, the resync finds the next frame, the mark search finds the
        // mark's claim, and the damaged header attributes its shard and offset.
        let dir = tempfile::tempdir().expect("tempdir");
        let file = temp_file(dir.path());
        let mut data = Vec::new();
        frame::encode(&mut data, 3, 0, 1, b"k", &[1u8; 100]);
        let second = data.len();
        frame::encode(&mut data, 3, 1, 1, b"k", &[2u8; 100]);
        let third = data.len();
        frame::encode(&mut data, 5, 9, 1, b"k", &[3u8; 10]);
        let mark_at = data.len();
        frame::encode_mark(&mut data, third as u64, 1);
        data[second + 40] ^= 0xFF; // inside the second record's body
        file.write_all_at(&data, 0).expect("write");
        file.set_len(8192).expect("len");
        let known = |s: u32| s == 3;
        let next = resync(&file, second as u64 + 1, 8192, 8192, &known).expect("resync");
        assert_eq!(next, Some(third as u64));
        assert_eq!(
            max_mark_claim(&file, second as u64, 8192).expect("marks"),
            third as u64
        );
        assert!(mark_at > third);
        let expected = HashMap::from([(3u32, 1u64), (5, 9)]);
        let (pairs, tiled) =
            attribute_span(&file, second as u64, third as u64, &expected).expect("attribute");
        assert_eq!((pairs.clone(), tiled), (vec![(3, 1)], true));
        assert_eq!(
            attributed_ranges(&pairs, &expected),
            vec![ShardRange {
                shard: 3,
                first: 1,
                end: 2
            }]
        );
    }
}
