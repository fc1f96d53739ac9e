//! Two small files next to the segments that change how recovery and reads treat offsets:
//!
//! - `quarantine`: offset ranges `[first, end)` of shards whose records were lost to damage and
//!   quarantined by `felix log repair` (`offline.rs`). Recovery accepts a shard's offsets
//!   jumping over a quarantined range, the shard's next offset is past every quarantined
//!   offset (so none is handed out again), and reads skip the range (counted in
//!   `Counters::quarantine_skipped_records`).
//! - `released`: log shard ids of deleted streams whose records may be dropped from the log
//!   (online, whole segments; offline, by `felix log compact`). Recovery ignores their records
//!   and checkpoint entries; stream ids are never reused, so a released id never comes back.
//!
//! Format (both little-endian, `docs/storage-format.md`): an 8-byte magic, a u32 version, a
//! u32 count, the entries, and a CRC32C of everything before it. Each file is replaced
//! atomically (temporary file, fsync, rename, directory fsync), so it is always the old or the
//! new content; a damaged one stops the log from opening.
//!
//! Threads: read by recovery and the offline commands; `released` is rewritten on the core's
//! thread when a deleted stream's segments are released (`Log::release_shards`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::Path;

use crate::StorageError;
use crate::segment;

/// File name of the quarantine in a log directory.
pub const QUARANTINE_FILE: &str = "quarantine";
/// File name of the released shard ids in a log directory.
pub const RELEASED_FILE: &str = "released";
const QUARANTINE_MAGIC: [u8; 8] = *b"FELIXQRN";
const RELEASED_MAGIC: [u8; 8] = *b"FELIXREL";
const FILE_VERSION: u32 = 1;
/// Bytes of one quarantine entry: u32 shard, u64 first, u64 end, u64 segment, u64 position.
const QUARANTINE_ENTRY_BYTES: usize = 36;
/// Largest quarantine or released file read: 64 MiB is 1.8 million ranges or 16 million
/// shard ids, far beyond any real damage or deletion count; bigger means the file is not ours.
const STATE_FILE_BYTES_MAX: u64 = 64 << 20;
/// magic + version + count.
const PREFIX_BYTES: usize = 16;

/// One quarantined range: offsets `first..end` of `shard`, lost at `position` of segment
/// `segment` (where the damage was found; for the operator's records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct QuarantineRange {
    pub shard: u32,
    pub first: u64,
    pub end: u64,
    pub segment: u64,
    pub position: u64,
}

/// The quarantined ranges of a log, per shard sorted and merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Quarantine {
    /// As listed in the file (kept for rewriting it and for reports).
    entries: Vec<QuarantineRange>,
    /// Per shard: disjoint, ascending, non-adjacent `(first, end)` ranges.
    merged: BTreeMap<u32, Vec<(u64, u64)>>,
}

impl Quarantine {
    /// Builds the merged view from entries.
    pub fn from_entries(mut entries: Vec<QuarantineRange>) -> Quarantine {
        entries.retain(|e| e.first < e.end);
        entries.sort_unstable();
        entries.dedup();
        let mut merged: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
        for e in &entries {
            let ranges = merged.entry(e.shard).or_default();
            ranges.push((e.first, e.end));
        }
        for ranges in merged.values_mut() {
            ranges.sort_unstable();
            let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
            for &(first, end) in ranges.iter() {
                match out.last_mut() {
                    Some(last) if first <= last.1 => last.1 = last.1.max(end),
                    _ => out.push((first, end)),
                }
            }
            *ranges = out;
        }
        Quarantine { entries, merged }
    }

    /// Every entry, as in the file.
    pub fn entries(&self) -> &[QuarantineRange] {
        &self.entries
    }

    /// True when nothing is quarantined.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The first offset at or after `offset` of `shard` that is not quarantined.
    pub fn skip(&self, shard: u32, offset: u64) -> u64 {
        let Some(ranges) = self.merged.get(&shard) else {
            return offset;
        };
        // Ranges are merged, so one lookup suffices: the range holding `offset`, if any.
        let at = ranges.partition_point(|r| r.1 <= offset);
        match ranges.get(at) {
            Some(&(first, end)) if first <= offset => end,
            _ => offset,
        }
    }

    /// The start of the quarantined range that ends exactly at `offset` (so a shard whose
    /// oldest record follows a quarantined range reads from the range's start, skipping it),
    /// or `offset` itself.
    pub fn extend_down(&self, shard: u32, offset: u64) -> u64 {
        self.merged
            .get(&shard)
            .and_then(|ranges| ranges.iter().find(|r| r.1 == offset))
            .map_or(offset, |r| r.0)
    }

    /// The end of the last quarantined range of `shard`, if any: the shard's next offset is
    /// at least this.
    pub fn end_of(&self, shard: u32) -> Option<u64> {
        self.merged.get(&shard).and_then(|r| r.last()).map(|r| r.1)
    }

    /// Shards with quarantined ranges.
    pub fn shards(&self) -> impl Iterator<Item = u32> + '_ {
        self.merged.keys().copied()
    }

    /// Quarantined offsets in total (merged, so none is counted twice).
    pub fn total_offsets(&self) -> u64 {
        self.merged
            .values()
            .flatten()
            .map(|(first, end)| end - first)
            .sum()
    }

    /// Quarantined offsets of `shard` in `first..end`.
    pub fn offsets_within(&self, shard: u32, first: u64, end: u64) -> u64 {
        self.merged.get(&shard).map_or(0, |ranges| {
            ranges
                .iter()
                .map(|r| r.1.min(end).saturating_sub(r.0.max(first)))
                .sum()
        })
    }

    /// Reads `<dir>/quarantine`; an absent file is an empty quarantine.
    pub fn load(dir: &Path) -> Result<Quarantine, StorageError> {
        let Some(body) = read_state_file(dir, QUARANTINE_FILE, QUARANTINE_MAGIC)? else {
            return Ok(Quarantine::default());
        };
        let (count, entries_bytes) = body;
        if entries_bytes.len() != count * QUARANTINE_ENTRY_BYTES {
            return Err(bad_state_file(dir, QUARANTINE_FILE, "entry count"));
        }
        let entries = entries_bytes
            .chunks_exact(QUARANTINE_ENTRY_BYTES)
            .map(|e| QuarantineRange {
                shard: le_u32(&e[0..]),
                first: le_u64(&e[4..]),
                end: le_u64(&e[12..]),
                segment: le_u64(&e[20..]),
                position: le_u64(&e[28..]),
            })
            .collect();
        Ok(Quarantine::from_entries(entries))
    }

    /// Replaces `<dir>/quarantine` atomically with these entries.
    pub fn store(&self, dir: &Path) -> Result<(), StorageError> {
        let mut body = Vec::with_capacity(self.entries.len() * QUARANTINE_ENTRY_BYTES);
        for e in &self.entries {
            body.extend_from_slice(&e.shard.to_le_bytes());
            body.extend_from_slice(&e.first.to_le_bytes());
            body.extend_from_slice(&e.end.to_le_bytes());
            body.extend_from_slice(&e.segment.to_le_bytes());
            body.extend_from_slice(&e.position.to_le_bytes());
        }
        write_state_file(
            dir,
            QUARANTINE_FILE,
            QUARANTINE_MAGIC,
            self.entries.len(),
            &body,
        )
    }
}

/// Log shard ids of deleted streams whose records may be dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Released {
    shards: BTreeSet<u32>,
}

impl Released {
    /// Whether `shard` was released.
    pub fn contains(&self, shard: u32) -> bool {
        self.shards.contains(&shard)
    }

    /// Released shards, ascending.
    pub fn shards(&self) -> impl Iterator<Item = u32> + '_ {
        self.shards.iter().copied()
    }

    pub fn len(&self) -> usize {
        self.shards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// Adds shards; returns how many were new.
    pub fn extend(&mut self, shards: impl IntoIterator<Item = u32>) -> usize {
        let before = self.shards.len();
        self.shards.extend(shards);
        self.shards.len() - before
    }

    /// Reads `<dir>/released`; an absent file releases nothing.
    pub fn load(dir: &Path) -> Result<Released, StorageError> {
        let Some((count, body)) = read_state_file(dir, RELEASED_FILE, RELEASED_MAGIC)? else {
            return Ok(Released::default());
        };
        if body.len() != count * 4 {
            return Err(bad_state_file(dir, RELEASED_FILE, "entry count"));
        }
        Ok(Released {
            shards: body.chunks_exact(4).map(le_u32).collect(),
        })
    }

    /// Replaces `<dir>/released` atomically.
    pub fn store(&self, dir: &Path) -> Result<(), StorageError> {
        let body: Vec<u8> = self.shards.iter().flat_map(|s| s.to_le_bytes()).collect();
        write_state_file(dir, RELEASED_FILE, RELEASED_MAGIC, self.shards.len(), &body)
    }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&b[..8]);
    u64::from_le_bytes(raw)
}

fn bad_state_file(dir: &Path, name: &str, why: &str) -> StorageError {
    let path = dir.join(name);
    StorageError::io(
        format!(
            "{} is damaged ({why}); it is fsynced and replaced atomically, so this is disk corruption: restore it or run `{}`",
            path.display(),
            crate::error::repair_command(dir)
        ),
        std::io::Error::from(std::io::ErrorKind::InvalidData),
    )
}

/// Reads a state file: `None` when absent, else (count, entry bytes) after checking the
/// magic, version and CRC.
fn read_state_file(
    dir: &Path,
    name: &str,
    magic: [u8; 8],
) -> Result<Option<(usize, Vec<u8>)>, StorageError> {
    let path = dir.join(name);
    let len = match fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StorageError::io(format!("stat {}", path.display()), e)),
    };
    if len > STATE_FILE_BYTES_MAX || len < (PREFIX_BYTES + 4) as u64 {
        return Err(bad_state_file(dir, name, "impossible size"));
    }
    let bytes =
        fs::read(&path).map_err(|e| StorageError::io(format!("read {}", path.display()), e))?;
    let (content, crc) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(content) != le_u32(crc) {
        return Err(bad_state_file(dir, name, "CRC mismatch"));
    }
    if content[..8] != magic || le_u32(&content[8..]) != FILE_VERSION {
        return Err(bad_state_file(dir, name, "magic or version"));
    }
    let count = le_u32(&content[12..]) as usize;
    Ok(Some((count, content[PREFIX_BYTES..].to_vec())))
}

/// Replaces `<dir>/<name>` atomically: `<name>.tmp`, fsync, rename, directory fsync.
fn write_state_file(
    dir: &Path,
    name: &str,
    magic: [u8; 8],
    count: usize,
    body: &[u8],
) -> Result<(), StorageError> {
    let count = u32::try_from(count)
        .map_err(|_| StorageError::Config(format!("{name}: too many entries")))?;
    let mut bytes = Vec::with_capacity(PREFIX_BYTES + body.len() + 4);
    bytes.extend_from_slice(&magic);
    bytes.extend_from_slice(&FILE_VERSION.to_le_bytes());
    bytes.extend_from_slice(&count.to_le_bytes());
    bytes.extend_from_slice(body);
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let ctx = |what: &str, p: &Path| format!("{what} {}", p.display());
    let mut out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| StorageError::io(ctx("create", &tmp), e))?;
    out.write_all(&bytes)
        .map_err(|e| StorageError::io(ctx("write", &tmp), e))?;
    out.sync_all()
        .map_err(|e| StorageError::io(ctx("fsync", &tmp), e))?;
    drop(out);
    fs::rename(&tmp, &path).map_err(|e| StorageError::io(ctx("rename", &path), e))?;
    segment::sync_dir(dir)
}

/// Temporary files of interrupted state-file writes (removed by recovery).
pub(crate) fn is_state_temp_file(name: &str) -> bool {
    name == format!("{QUARANTINE_FILE}.tmp") || name == format!("{RELEASED_FILE}.tmp")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(shard: u32, first: u64, end: u64) -> QuarantineRange {
        QuarantineRange {
            shard,
            first,
            end,
            segment: 0,
            position: 0,
        }
    }

    #[test]
    fn skip_merges_and_round_trips() {
        // Overlapping and adjacent ranges merge; skip jumps over them; the file round-trips and a flipped byte is refused.
        let dir = tempfile::tempdir().expect("tempdir");
        let q = Quarantine::from_entries(vec![
            range(1, 10, 20),
            range(1, 20, 25),
            range(1, 40, 41),
            range(2, 0, 3),
        ]);
        assert_eq!((q.skip(1, 9), q.skip(1, 10), q.skip(1, 24)), (9, 25, 25));
        assert_eq!((q.skip(1, 25), q.skip(1, 40), q.skip(3, 7)), (25, 41, 7));
        assert_eq!((q.extend_down(1, 25), q.extend_down(1, 26)), (10, 26));
        assert_eq!((q.end_of(1), q.end_of(3)), (Some(41), None));
        assert_eq!(q.total_offsets(), 15 + 1 + 3);
        assert_eq!(q.offsets_within(1, 15, 41), 10 + 1);
        q.store(dir.path()).expect("store");
        assert_eq!(Quarantine::load(dir.path()).expect("load"), q);
        let path = dir.path().join(QUARANTINE_FILE);
        let mut bytes = fs::read(&path).expect("read");
        bytes[20] ^= 1;
        fs::write(&path, &bytes).expect("write");
        let error = Quarantine::load(dir.path()).expect_err("damaged");
        assert!(error.to_string().contains("damaged"), "{error}");
        let released_dir = tempfile::tempdir().expect("tempdir");
        let mut released = Released::default();
        assert_eq!(released.extend([7, 3, 7]), 2);
        released.store(released_dir.path()).expect("store");
        let loaded = Released::load(released_dir.path()).expect("load");
        assert_eq!(loaded.shards().collect::<Vec<_>>(), vec![3, 7]);
        assert!(loaded.contains(7) && !loaded.contains(4));
    }
}
