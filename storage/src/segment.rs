//! Segment files: naming, the segment header (with its shard checkpoint) and creation.
//!
//! ```text
//! offset size field
//!  0      8   magic            b"FELIXSEG"
//!  8      4   version          u32 LE, 2 (1: written before commit marks existed; read alike)
//! 12      4   header_bytes     u32 LE: where the first record starts (multiple of 4096)
//! 16      8   seq              u64 LE: the segment's sequence number (also its file name)
//! 24      8   created_unix_us  u64 LE
//! 32      4   checkpoint_count u32 LE
//! 36      4   crc32c           u32 LE: CRC32C of the whole header region with this field zeroed
//! 40   12*n   checkpoint       n x (u32 shard, u64 next_offset), ascending shard
//!  .      .   zero padding up to header_bytes
//! ```

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::StorageError;

/// File magic of a segment.
pub const SEGMENT_MAGIC: [u8; 8] = *b"FELIXSEG";
/// Segment format version written by this crate: 2, whose records may be interleaved with
/// commit marks (`frame::encode_mark`). Version 1 segments (no marks) are read the same way.
pub const SEGMENT_VERSION: u32 = 2;
/// The first version, still readable.
pub const SEGMENT_VERSION_V1: u32 = 1;
/// Fixed part of the segment header.
pub const SEGMENT_FIXED_HEADER_BYTES: usize = 40;
/// One checkpoint entry: u32 shard + u64 next offset.
pub const CHECKPOINT_ENTRY_BYTES: usize = 12;
/// Records start on a page boundary: keeps the data region aligned for a later O_DIRECT writer
/// (docs/design/machine.md, Disk: O_DIRECT group commit is faster on this disk class).
pub const SEGMENT_ALIGN_BYTES: u64 = 4096;
/// Largest header recovery will read: 16 MiB holds a checkpoint of ~1.4 million shards, far
/// above any per-core shard count, and bounds the allocation a corrupt header can cause.
pub const SEGMENT_HEADER_BYTES_MAX: usize = 16 << 20;

const CRC_AT: usize = 36;

/// Decoded segment header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentHeader {
    pub seq: u64,
    pub created_unix_us: u64,
    /// Bytes before the first record.
    pub header_bytes: u64,
    /// Every shard the log knew when the segment was created, with its next offset then.
    pub checkpoint: Vec<(u32, u64)>,
    /// The header's stored CRC32C: identifies this incarnation of the segment (a sidecar
    /// index names it, so a sidecar never describes another file of the same sequence).
    pub crc: u32,
}

/// Rounds `n` up to the next multiple of [`SEGMENT_ALIGN_BYTES`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(SEGMENT_ALIGN_BYTES) * SEGMENT_ALIGN_BYTES
}

/// Header bytes for a checkpoint of `shards` entries.
pub fn header_bytes_for(shards: usize) -> u64 {
    align_up((SEGMENT_FIXED_HEADER_BYTES + CHECKPOINT_ENTRY_BYTES * shards) as u64)
}

/// `<seq>.log`, zero-padded to 20 digits so names sort like numbers.
pub fn file_name(seq: u64) -> String {
    format!("{seq:020}.log")
}

/// The sequence number of a segment file name, or `None` for other files.
pub fn parse_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".log")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Encodes a header into exactly `header_bytes_for(checkpoint.len())` bytes.
pub fn encode_header(seq: u64, created_unix_us: u64, checkpoint: &[(u32, u64)]) -> Vec<u8> {
    let header_bytes = header_bytes_for(checkpoint.len());
    assert!(
        header_bytes as usize <= SEGMENT_HEADER_BYTES_MAX,
        "checkpoint of {} shards",
        checkpoint.len()
    );
    let mut buf = Vec::with_capacity(header_bytes as usize);
    buf.extend_from_slice(&SEGMENT_MAGIC);
    buf.extend_from_slice(&SEGMENT_VERSION.to_le_bytes());
    buf.extend_from_slice(&(header_bytes as u32).to_le_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&created_unix_us.to_le_bytes());
    buf.extend_from_slice(&(checkpoint.len() as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    for (shard, next) in checkpoint {
        buf.extend_from_slice(&shard.to_le_bytes());
        buf.extend_from_slice(&next.to_le_bytes());
    }
    buf.resize(header_bytes as usize, 0);
    let crc = crc32c::crc32c(&buf);
    buf[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    buf
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&b[..8]);
    u64::from_le_bytes(raw)
}

/// Reads and verifies a segment header from `file`. `Err` carries why it is not valid.
pub fn read_header(file: &File, file_len: u64) -> Result<SegmentHeader, String> {
    if file_len < SEGMENT_FIXED_HEADER_BYTES as u64 {
        return Err(format!(
            "file of {file_len} bytes is shorter than a segment header"
        ));
    }
    let mut fixed = [0u8; SEGMENT_FIXED_HEADER_BYTES];
    file.read_exact_at(&mut fixed, 0)
        .map_err(|e| format!("reading header: {e}"))?;
    if fixed[..8] != SEGMENT_MAGIC {
        return Err("bad magic".into());
    }
    let version = le_u32(&fixed[8..]);
    if version != SEGMENT_VERSION && version != SEGMENT_VERSION_V1 {
        return Err(format!("unsupported version {version}"));
    }
    let header_bytes = le_u32(&fixed[12..]) as usize;
    let count = le_u32(&fixed[32..]) as usize;
    let needed =
        SEGMENT_FIXED_HEADER_BYTES.saturating_add(count.saturating_mul(CHECKPOINT_ENTRY_BYTES));
    if header_bytes > SEGMENT_HEADER_BYTES_MAX
        || needed > header_bytes
        || !(header_bytes as u64).is_multiple_of(SEGMENT_ALIGN_BYTES)
        || header_bytes as u64 > file_len
    {
        return Err(format!(
            "impossible header size {header_bytes} for {count} checkpoint entries"
        ));
    }
    let mut buf = vec![0u8; header_bytes];
    file.read_exact_at(&mut buf, 0)
        .map_err(|e| format!("reading header: {e}"))?;
    let stored = le_u32(&buf[CRC_AT..]);
    buf[CRC_AT..CRC_AT + 4].fill(0);
    let computed = crc32c::crc32c(&buf);
    if stored != computed {
        return Err(format!(
            "header CRC mismatch (stored {stored:#010x}, computed {computed:#010x})"
        ));
    }
    let checkpoint = buf[SEGMENT_FIXED_HEADER_BYTES..needed]
        .chunks_exact(CHECKPOINT_ENTRY_BYTES)
        .map(|e| (le_u32(e), le_u64(&e[4..])))
        .collect();
    Ok(SegmentHeader {
        seq: le_u64(&fixed[16..]),
        created_unix_us: le_u64(&fixed[24..]),
        header_bytes: header_bytes as u64,
        checkpoint,
        crc: stored,
    })
}

/// Allocates `len` bytes of `file` from `offset` so later writes need no block allocation
/// (docs/design/machine.md, Disk: fdatasync of a growing file costs ~2x a preallocated one).
/// Filesystems without fallocate get a sparse `set_len` instead, with a warning.
pub fn preallocate(file: &File, len: u64) -> Result<(), StorageError> {
    let Ok(len_off) = libc::off_t::try_from(len) else {
        return Err(StorageError::Config(format!(
            "segment size {len} does not fit off_t"
        )));
    };
    // SAFETY: fallocate takes a valid open fd (borrowed from `file` for the call) and plain
    // integers; it does not touch memory we own.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_off) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EOPNOTSUPP) {
        tracing::warn!("fallocate not supported here; segment files will be sparse");
        if file
            .metadata()
            .map_err(|e| StorageError::io("stat segment", e))?
            .len()
            < len
        {
            file.set_len(len)
                .map_err(|e| StorageError::io("extend segment", e))?;
        }
        return Ok(());
    }
    Err(StorageError::io("fallocate segment", err))
}

/// fsyncs a directory so created, renamed or deleted entries survive power loss.
pub fn sync_dir(dir: &Path) -> Result<(), StorageError> {
    let d =
        File::open(dir).map_err(|e| StorageError::io(format!("open dir {}", dir.display()), e))?;
    d.sync_all()
        .map_err(|e| StorageError::io(format!("fsync dir {}", dir.display()), e))
}

/// Creates segment `seq` of `size` bytes: written as `<name>.tmp`, preallocated, header
/// written and fsynced, renamed into place, directory fsynced. A crash leaves either no
/// `<seq>.log` or a complete, valid one (recovery deletes stray `.tmp` files).
/// Blocks the calling thread (a few ms, once per segment: the preallocation is most of it,
/// which is why the log makes the next segment's file ahead, off its thread: `ahead.rs`).
pub fn create(
    dir: &Path,
    seq: u64,
    size: u64,
    created_unix_us: u64,
    checkpoint: &[(u32, u64)],
) -> Result<(File, u64, PathBuf), StorageError> {
    let blank = make_blank(dir, seq, size)?;
    finish_blank(dir, blank, seq, size, created_unix_us, checkpoint)
}

/// A preallocated segment file not yet in place: `<seq>.log.tmp`, no header yet. Recovery
/// deletes it like any stray `.tmp` file; only [`finish_blank`] makes it a segment.
#[derive(Debug)]
pub struct Blank {
    pub file: File,
    pub tmp: PathBuf,
    pub size: u64,
}

/// The first, slow half of [`create`]: `<seq>.log.tmp` created, preallocated to `size` bytes
/// and fsynced (so the extents it allocated are on disk before the header's sync). Safe to
/// run on any thread; nothing reads the file until [`finish_blank`].
pub fn make_blank(dir: &Path, seq: u64, size: u64) -> Result<Blank, StorageError> {
    let tmp = dir.join(format!("{}.tmp", file_name(seq)));
    let ctx = |what: &str| format!("{what} {}", tmp.display());
    let result = (|| {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| StorageError::io(ctx("create segment"), e))?;
        preallocate(&file, size)?;
        file.sync_all()
            .map_err(|e| StorageError::io(ctx("fsync segment"), e))?;
        Ok(file)
    })();
    match result {
        Ok(file) => Ok(Blank { file, tmp, size }),
        Err(e) => {
            // Best effort: a leftover .tmp is also removed by the next recovery.
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The second half of [`create`], on the log's thread when the segment starts: header
/// written and fsynced, `<seq>.log.tmp` renamed to `<seq>.log`, directory fsynced. A blank
/// smaller than `size` (a record bigger than a segment) is preallocated further first.
pub fn finish_blank(
    dir: &Path,
    blank: Blank,
    seq: u64,
    size: u64,
    created_unix_us: u64,
    checkpoint: &[(u32, u64)],
) -> Result<(File, u64, PathBuf), StorageError> {
    let header = encode_header(seq, created_unix_us, checkpoint);
    assert!(
        size >= header.len() as u64,
        "segment size covers the header"
    );
    assert_eq!(
        blank.tmp,
        dir.join(format!("{}.tmp", file_name(seq))),
        "the blank was made for this segment"
    );
    let path = dir.join(file_name(seq));
    let tmp = blank.tmp;
    let ctx = |what: &str| format!("{what} {}", tmp.display());
    let result = (|| {
        let file = blank.file;
        if blank.size < size {
            preallocate(&file, size)?;
        }
        file.write_all_at(&header, 0)
            .map_err(|e| StorageError::io(ctx("write segment header"), e))?;
        file.sync_all()
            .map_err(|e| StorageError::io(ctx("fsync segment"), e))?;
        fs::rename(&tmp, &path).map_err(|e| StorageError::io(ctx("rename segment"), e))?;
        Ok(file)
    })();
    let file = match result {
        Ok(file) => file,
        Err(e) => {
            // Best effort: a leftover .tmp is also removed by the next recovery.
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };
    sync_dir(dir)?;
    Ok((file, header.len() as u64, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_sort_and_parse() {
        // File names round-trip and sort in sequence order; foreign names are ignored.
        assert_eq!(parse_file_name(&file_name(0)), Some(0));
        assert_eq!(parse_file_name(&file_name(u64::MAX)), Some(u64::MAX));
        assert!(file_name(9) < file_name(10));
        assert_eq!(parse_file_name("00000000000000000001.log.tmp"), None);
        assert_eq!(parse_file_name("1.log"), None);
    }

    #[test]
    fn header_round_trip_and_crc() {
        // A written header reads back equal, and any flipped byte in the region is rejected.
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = vec![(1, 10), (5, 0), (9, 123_456)];
        let (file, hb, _) = create(dir.path(), 3, 64 << 10, 77, &cp).expect("create");
        assert_eq!(hb, 4096);
        let h = read_header(&file, 64 << 10).expect("valid header");
        assert_eq!(
            h,
            SegmentHeader {
                seq: 3,
                created_unix_us: 77,
                header_bytes: 4096,
                checkpoint: cp,
                crc: h.crc,
            }
        );
        assert_ne!(h.crc, 0);
        for at in [0u64, 9, 13, 20, 30, 33, 38, 45, 4000] {
            let mut b = [0u8; 1];
            file.read_exact_at(&mut b, at).expect("read");
            file.write_all_at(&[b[0] ^ 0x20], at).expect("write");
            assert!(read_header(&file, 64 << 10).is_err(), "flip at {at}");
            file.write_all_at(&b, at).expect("restore");
        }
    }
}
