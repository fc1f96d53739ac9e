//! Sidecar index files: `<seq>.idx` next to each closed segment `<seq>.log`, holding what a
//! scan of that segment would rebuild (per-shard first and next offsets and record counts,
//! the segment's index entries, its data end, record count and newest timestamp), so that
//! recovery reads one small file per closed segment and scans only the active segment.
//!
//! A sidecar is written when the log moves past a segment (the segment is synced by then and
//! never written again) and by recovery for a closed segment that has none or a bad one. It
//! is only a cache: a missing, damaged or stale sidecar (another segment incarnation, another
//! index interval, disagreeing offsets) makes recovery scan the segment and write a new one.
//! Format in `docs/storage-format.md` (Sidecar index).
//!
//! Threads: written on the core's thread when a segment closes (one small write + fsync per
//! `segment_bytes` of log) and by recovery; read by recovery.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::StorageError;

const SIDECAR_MAGIC: [u8; 8] = *b"FELIXIDX";
const SIDECAR_VERSION: u32 = 1;
/// Fixed part: magic 8, version 4, shard count 4, entry count 8, seq 8, header CRC 4, has
/// max timestamp 4, index interval 8, data end 8, records 8, record bytes 8, max timestamp 8.
const FIXED_BYTES: usize = 80;
/// One shard: u32 shard, u64 first, u64 end, u64 records.
const SHARD_BYTES: usize = 28;
/// One index entry: u32 shard, u64 offset, u64 position.
const ENTRY_BYTES: usize = 20;
/// Largest sidecar read: 256 MiB holds 13 million index entries, e.g. a 64 GiB segment at
/// the smallest index interval (4 KiB) with a shard per entry; a bigger file is not trusted
/// (recovery scans the segment instead), which bounds what a damaged file can allocate.
pub const SIDECAR_BYTES_MAX: u64 = 256 << 20;

/// One shard's records in a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SidecarShard {
    pub shard: u32,
    /// Offset of the shard's first record in the segment.
    pub first: u64,
    /// One past the offset of its last record in the segment.
    pub end: u64,
    pub records: u64,
}

/// What a scan of a closed segment finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sidecar {
    pub seq: u64,
    /// The segment header's CRC (ties the sidecar to this incarnation of the segment).
    pub header_crc: u32,
    /// The index interval the entries were built with.
    pub index_interval_bytes: u64,
    /// End of the segment's last frame.
    pub data_end: u64,
    pub records: u64,
    /// Framed bytes of the records (commit marks excluded).
    pub record_bytes: u64,
    pub max_timestamp_us: Option<u64>,
    /// Ascending by shard.
    pub shards: Vec<SidecarShard>,
    /// `(shard, offset, position)`, grouped by shard (ascending) and by offset within a shard.
    pub entries: Vec<(u32, u64, u64)>,
}

/// `<seq>.idx`.
pub fn file_name(seq: u64) -> String {
    format!("{seq:020}.idx")
}

/// The sequence number of a sidecar file name, or `None`.
pub fn parse_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".idx")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Path of the sidecar of segment `seq` in `dir`.
pub fn path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(file_name(seq))
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&b[..8]);
    u64::from_le_bytes(raw)
}

impl Sidecar {
    /// The file's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            FIXED_BYTES + self.shards.len() * SHARD_BYTES + self.entries.len() * ENTRY_BYTES + 4,
        );
        b.extend_from_slice(&SIDECAR_MAGIC);
        b.extend_from_slice(&SIDECAR_VERSION.to_le_bytes());
        // Shard ids are u32, so a segment never holds more than u32::MAX shards.
        b.extend_from_slice(&(self.shards.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.header_crc.to_le_bytes());
        b.extend_from_slice(&u32::from(self.max_timestamp_us.is_some()).to_le_bytes());
        b.extend_from_slice(&self.index_interval_bytes.to_le_bytes());
        b.extend_from_slice(&self.data_end.to_le_bytes());
        b.extend_from_slice(&self.records.to_le_bytes());
        b.extend_from_slice(&self.record_bytes.to_le_bytes());
        b.extend_from_slice(&self.max_timestamp_us.unwrap_or(0).to_le_bytes());
        debug_assert_eq!(b.len(), FIXED_BYTES);
        for s in &self.shards {
            b.extend_from_slice(&s.shard.to_le_bytes());
            b.extend_from_slice(&s.first.to_le_bytes());
            b.extend_from_slice(&s.end.to_le_bytes());
            b.extend_from_slice(&s.records.to_le_bytes());
        }
        for (shard, offset, position) in &self.entries {
            b.extend_from_slice(&shard.to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            b.extend_from_slice(&position.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a sidecar: magic, version, CRC, and that its shards and entries
    /// are ordered and consistent (so loading it can never trip the index's invariants).
    pub fn decode(bytes: &[u8]) -> Result<Sidecar, String> {
        if bytes.len() < FIXED_BYTES + 4 {
            return Err(format!("{} bytes is shorter than a sidecar", bytes.len()));
        }
        let (content, crc) = bytes.split_at(bytes.len() - 4);
        if crc32c::crc32c(content) != le_u32(crc) {
            return Err("CRC mismatch".into());
        }
        if content[..8] != SIDECAR_MAGIC {
            return Err("bad magic".into());
        }
        let version = le_u32(&content[8..]);
        if version != SIDECAR_VERSION {
            return Err(format!("unsupported version {version}"));
        }
        let shard_count = le_u32(&content[12..]) as usize;
        let entry_count = usize::try_from(le_u64(&content[16..])).map_err(|e| e.to_string())?;
        let need = shard_count
            .checked_mul(SHARD_BYTES)
            .and_then(|s| entry_count.checked_mul(ENTRY_BYTES)?.checked_add(s))
            .and_then(|n| n.checked_add(FIXED_BYTES));
        if need != Some(content.len()) {
            return Err("counts disagree with the size".into());
        }
        let data_end = le_u64(&content[48..]);
        let mut sidecar = Sidecar {
            seq: le_u64(&content[24..]),
            header_crc: le_u32(&content[32..]),
            index_interval_bytes: le_u64(&content[40..]),
            data_end,
            records: le_u64(&content[56..]),
            record_bytes: le_u64(&content[64..]),
            max_timestamp_us: (le_u32(&content[36..]) != 0).then(|| le_u64(&content[72..])),
            shards: Vec::with_capacity(shard_count),
            entries: Vec::with_capacity(entry_count),
        };
        let shards_end = FIXED_BYTES + shard_count * SHARD_BYTES;
        for s in content[FIXED_BYTES..shards_end].chunks_exact(SHARD_BYTES) {
            let shard = SidecarShard {
                shard: le_u32(s),
                first: le_u64(&s[4..]),
                end: le_u64(&s[12..]),
                records: le_u64(&s[20..]),
            };
            if shard.first >= shard.end
                || shard.records == 0
                || shard.records > shard.end - shard.first
            {
                return Err(format!("shard {} has impossible offsets", shard.shard));
            }
            if sidecar
                .shards
                .last()
                .is_some_and(|l| l.shard >= shard.shard)
            {
                return Err("shards out of order".into());
            }
            sidecar.shards.push(shard);
        }
        let mut previous: Option<(u32, u64, u64)> = None;
        for e in content[shards_end..].chunks_exact(ENTRY_BYTES) {
            let entry = (le_u32(e), le_u64(&e[4..]), le_u64(&e[12..]));
            let Ok(at) = sidecar.shards.binary_search_by_key(&entry.0, |s| s.shard) else {
                return Err(format!("entry of unknown shard {}", entry.0));
            };
            let owner = sidecar.shards[at];
            if entry.1 < owner.first || entry.1 >= owner.end || entry.2 >= data_end {
                return Err(format!("entry of shard {} out of range", entry.0));
            }
            if let Some(p) = previous
                && (p.0 > entry.0 || (p.0 == entry.0 && (p.1 >= entry.1 || p.2 >= entry.2)))
            {
                return Err("entries out of order".into());
            }
            previous = Some(entry);
            sidecar.entries.push(entry);
        }
        Ok(sidecar)
    }
}

/// Writes `<dir>/<seq>.idx` through a temporary file (fsynced, then renamed). The caller
/// fsyncs the directory (segment creation does, right after).
pub fn write(dir: &Path, sidecar: &Sidecar) -> Result<(), StorageError> {
    let path = path(dir, sidecar.seq);
    let tmp = dir.join(format!("{}.tmp", file_name(sidecar.seq)));
    let ctx = |what: &str| format!("{what} {}", tmp.display());
    let mut out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| StorageError::io(ctx("create sidecar"), e))?;
    out.write_all(&sidecar.encode())
        .map_err(|e| StorageError::io(ctx("write sidecar"), e))?;
    out.sync_all()
        .map_err(|e| StorageError::io(ctx("fsync sidecar"), e))?;
    drop(out);
    fs::rename(&tmp, &path).map_err(|e| StorageError::io(ctx("rename sidecar"), e))
}

/// Reads `<dir>/<seq>.idx`: `Ok(None)` when absent, `Err(why)` when unreadable or invalid.
pub fn read(dir: &Path, seq: u64) -> Result<Option<Sidecar>, String> {
    let path = path(dir, seq);
    let len = match fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("stat: {e}")),
    };
    if len > SIDECAR_BYTES_MAX {
        return Err(format!("{len} bytes, over {SIDECAR_BYTES_MAX}"));
    }
    let bytes = fs::read(&path).map_err(|e| format!("read: {e}"))?;
    Sidecar::decode(&bytes).map(Some)
}

/// Removes the sidecar of `seq` if there is one (best effort: a stale sidecar is detected by
/// its header CRC or offsets anyway).
pub fn remove(dir: &Path, seq: u64) {
    match fs::remove_file(path(dir, seq)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(seq, error = %e, "cannot remove a sidecar index"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() {
        // A sidecar decodes to what was encoded; a flipped byte or disordered entries are refused.
        let s = Sidecar {
            seq: 9,
            header_crc: 0xABCD,
            index_interval_bytes: 4096,
            data_end: 90_000,
            records: 12,
            record_bytes: 3000,
            max_timestamp_us: Some(55),
            shards: vec![
                SidecarShard {
                    shard: 1,
                    first: 10,
                    end: 20,
                    records: 10,
                },
                SidecarShard {
                    shard: 4,
                    first: 0,
                    end: 2,
                    records: 2,
                },
            ],
            entries: vec![(1, 10, 4096), (1, 15, 9000), (4, 0, 5000)],
        };
        let bytes = s.encode();
        assert_eq!(Sidecar::decode(&bytes).expect("valid"), s);
        for at in [0, 13, 30, 70, 85, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            assert!(Sidecar::decode(&bad).is_err(), "flip at {at}");
        }
        let mut disordered = s.clone();
        disordered.entries.swap(0, 1);
        assert!(Sidecar::decode(&disordered.encode()).is_err());
        assert_eq!(parse_file_name(&file_name(9)), Some(9));
        assert_eq!(parse_file_name("00000000000000000009.log"), None);
    }
}
