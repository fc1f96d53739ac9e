//! Fuzz target `recovery`: one or two segment files made of fuzzer bytes in a fresh log
//! directory, then `felix_storage::Log::open` (the fault backend, completing rounds at once;
//! 16 KiB segments, 4 KiB index interval).
//!
//! Each file has a valid segment header most of the time (written by the harness with a
//! checkpoint of fuzzer values, so the fuzzer gets past its CRC), or is raw bytes; its records
//! are raw bytes, or records framed with valid CRCs from fuzzer values (dense offsets,
//! sometimes a gap, a foreign shard or an offset out of line) with an optional corruption (a
//! flipped byte, a cut, trailing garbage); the file may be padded with zeros to the segment
//! size (preallocated) or not, the sequence may have a gap, a `.tmp` leftover may lie beside.
//!
//! Invariants:
//! - `Log::open` never panics; an error is a legitimate outcome (corrupt committed data may
//!   be refused rather than cut);
//! - on success, every shard's offsets are consistent (oldest <= written = synced = next),
//!   every record reads back (each read checks its CRC) with its shard and dense offsets from
//!   oldest to the end, the report's record count and shards agree, and the directory holds
//!   exactly the log's segment files;
//! - recovery is idempotent: a second open changes nothing (no cut, no deleted segment, the
//!   same records);
//! - the recovered log takes appends: one record per shard (and one for a new shard) written
//!   and flushed is there, after everything recovered, at the next open.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use felix_storage::frame::{self, OFFSET_MAX};
use felix_storage::segment;
use felix_storage::{FaultBackend, FsyncMode, Log, LogConfig, SEGMENT_BYTES_MIN};

use crate::input::Input;

/// Segment size of the fuzzed logs: the smallest the log accepts.
const SEGMENT_BYTES: u64 = SEGMENT_BYTES_MIN;
/// Records read per `Log::read` call while reading a shard back.
const READ_BATCH: usize = 64;
/// Shard id of the record appended to a shard recovery did not know.
const NEW_SHARD: u32 = 1_000;
/// Longest a flush may take: the fault backend completes rounds at once, so a healthy flush
/// takes microseconds; one that is not done by then never will be.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(3);

/// One shard as read back: its offsets and its records (offset, timestamp, key, payload).
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShardImage {
    oldest: u64,
    next: u64,
    records: Vec<(u64, u64, Vec<u8>, Vec<u8>)>,
}

type Image = BTreeMap<u32, ShardImage>;

/// Runs one input (see the module documentation).
pub fn run(data: &[u8]) {
    run_counted(data);
}

/// Runs one input; the records the first open recovered, or `None` if it refused the log (for
/// the seed generator, which checks that each seed recovers what it is meant to).
pub fn run_counted(data: &[u8]) -> Option<u64> {
    let dir = scratch_dir();
    let log_dir = dir.path().join("log");
    std::fs::create_dir_all(&log_dir).expect("the log directory");
    let mut input = Input::new(data);
    let fsync = if input.bool() {
        FsyncMode::OnCommit
    } else {
        FsyncMode::Periodic {
            interval: Duration::from_millis(5),
        }
    };
    write_segments(&log_dir, &mut input);
    let config = config(&log_dir, fsync);

    // First open: recovery proper.
    let (log, report) = match Log::open(config.clone(), backend()) {
        Ok(opened) => opened,
        Err(error) => {
            // Refusing a corrupt log is allowed; saying why must not panic.
            let _ = felix_storage::ErrorChain(&error).to_string();
            return None;
        }
    };
    let first = image(&log);
    let read: u64 = first.values().map(|shard| shard.records.len() as u64).sum();
    assert_eq!(report.records, read, "the report counts the records kept");
    let reported: Vec<(u32, u64, u64)> = report
        .shards
        .iter()
        .map(|shard| (shard.shard, shard.oldest, shard.next))
        .collect();
    let held: Vec<(u32, u64, u64)> = first
        .iter()
        .map(|(id, shard)| (*id, shard.oldest, shard.next))
        .collect();
    assert_eq!(
        reported, held,
        "the report lists every shard as the log has it"
    );
    assert_eq!(report.segments, log.segment_seqs().len());
    assert_eq!(
        files(&log_dir),
        log.segment_seqs(),
        "the directory holds exactly the log's segment files"
    );
    drop(log);

    // Second open: nothing left to repair.
    let (mut log, report) = Log::open(config.clone(), backend())
        .unwrap_or_else(|error| panic!("a recovered log opens again: {error}"));
    assert!(
        report.truncations.is_empty()
            && report.deleted_segments.is_empty()
            && report.removed_temp_files == 0,
        "recovery is idempotent: {report:?}"
    );
    assert_eq!(image(&log), first, "a second open recovers the same log");

    // Appends after recovery survive the next open, after everything recovered.
    let mut expected = first;
    let mut shards: Vec<u32> = expected.keys().copied().take(3).collect();
    shards.push(NEW_SHARD);
    for (index, shard) in shards.into_iter().enumerate() {
        let next = expected.get(&shard).map_or(0, |image| image.next);
        if next > OFFSET_MAX {
            // Beyond what a record can carry: nothing more is appended to this shard.
            continue;
        }
        let payload = vec![index as u8; 1 + index * 7];
        log.append(shard, next, 7, b"k", &payload)
            .unwrap_or_else(|error| panic!("append to shard {shard} at {next}: {error}"));
        let entry = expected.entry(shard).or_insert(ShardImage {
            oldest: next,
            next,
            records: Vec::new(),
        });
        entry.records.push((next, 7, b"k".to_vec(), payload));
        entry.next = next + 1;
    }
    log.sync_now();
    log.flush(FLUSH_TIMEOUT).unwrap_or_else(|error| {
        panic!(
            "appends after recovery flush: {}",
            felix_storage::ErrorChain(&error)
        )
    });
    drop(log);
    let (log, report) = Log::open(config, backend())
        .unwrap_or_else(|error| panic!("the log opens after appends: {error}"));
    assert!(
        report.truncations.is_empty() && report.deleted_segments.is_empty(),
        "appends after recovery leave nothing to repair: {report:?}"
    );
    assert_eq!(
        image(&log),
        expected,
        "records appended after recovery are kept"
    );
    Some(read)
}

/// A fresh directory for one run, on tmpfs when there is one (fsync is free there).
fn scratch_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix("felix-fuzz-recovery-")
        .tempdir_in(base)
        .or_else(|_| tempfile::tempdir())
        .expect("a temporary directory")
}

fn backend() -> FaultBackend {
    FaultBackend::new(true).expect("the fault backend").0
}

fn config(dir: &Path, fsync: FsyncMode) -> LogConfig {
    let mut config = LogConfig::new(dir);
    config.segment_bytes = SEGMENT_BYTES;
    config.fsync = fsync;
    config.max_round_bytes = 4096;
    config.max_pending_bytes = 64 << 10;
    config.index_interval_bytes = 4096;
    config
}

/// Segment sequence numbers of the segment files in `dir`; a `.tmp` leftover of a segment is
/// an error (recovery removes them). Other files (the log's own bookkeeping) are not looked at.
fn files(dir: &Path) -> Vec<u64> {
    let mut seqs = Vec::new();
    for entry in std::fs::read_dir(dir).expect("list the log directory") {
        let name = entry.expect("a directory entry").file_name();
        let name = name.to_string_lossy();
        if let Some(stem) = name.strip_suffix(".tmp") {
            assert!(
                segment::parse_file_name(stem).is_none(),
                "recovery removes segment leftovers, found {name}"
            );
        }
        seqs.extend(segment::parse_file_name(&name));
    }
    seqs.sort_unstable();
    seqs
}

/// Every shard of `log` read back from its oldest offset, checking what each read gives.
fn image(log: &Log<FaultBackend>) -> Image {
    let mut image = Image::new();
    for shard in log.shard_ids() {
        let offsets = log.shard_offsets(shard).expect("a listed shard");
        assert!(
            offsets.oldest <= offsets.written
                && offsets.written == offsets.synced
                && offsets.synced == offsets.next,
            "shard {shard} after recovery: {offsets:?}"
        );
        assert_eq!(log.committed_offset(shard), Some(offsets.next));
        let mut records = Vec::new();
        let mut from = offsets.oldest;
        // Bounded: each pass reads at least one record or stops.
        while from < offsets.next {
            let batch = log
                .read(shard, from, READ_BATCH, usize::MAX)
                .unwrap_or_else(|error| {
                    panic!("shard {shard} reads back from {from} after recovery: {error}")
                });
            assert!(
                !batch.is_empty(),
                "shard {shard} holds {from}..{} but reads nothing at {from}",
                offsets.next
            );
            for record in batch {
                assert_eq!(record.shard, shard, "a read gives its own shard's records");
                assert_eq!(record.offset, from, "offsets read back are dense");
                records.push((
                    record.offset,
                    record.timestamp_us,
                    record.key.to_vec(),
                    record.payload.to_vec(),
                ));
                from += 1;
            }
        }
        assert_eq!(from, offsets.next, "nothing reads past the end");
        image.insert(
            shard,
            ShardImage {
                oldest: offsets.oldest,
                next: offsets.next,
                records,
            },
        );
    }
    image
}

/// Writes one or two segment files (and maybe a `.tmp` leftover) into `dir`.
fn write_segments(dir: &Path, input: &mut Input<'_>) {
    let flags = input.byte();
    let first_seq = u64::from(flags >> 4 & 3);
    let two = flags & 1 == 1;
    let gap = flags & 2 == 2;
    // Next offset per shard, carried from the first file into the second, so that a second
    // file usually continues the first.
    let mut next: BTreeMap<u32, u64> = BTreeMap::new();
    write_segment(dir, first_seq, input, &mut next);
    if two {
        let seq = first_seq + if gap { 2 } else { 1 };
        write_segment(dir, seq, input, &mut next);
    }
    if flags & 4 == 4 {
        let name = format!("{}.tmp", segment::file_name(first_seq + 5));
        std::fs::write(dir.join(name), input.bytes(64)).expect("a .tmp leftover");
    }
}

fn write_segment(dir: &Path, seq: u64, input: &mut Input<'_>, next: &mut BTreeMap<u32, u64>) {
    let mode = input.byte();
    let mut file = Vec::new();
    if mode & 3 != 0 {
        // A valid header (most inputs): its checkpoint from fuzzer values, or the offsets
        // the earlier file reached (as the log itself writes it).
        let header_seq = if mode & 0x80 == 0x80 {
            u64::from(input.byte() & 7)
        } else {
            seq
        };
        let checkpoint: Vec<(u32, u64)> = if mode & 4 == 4 {
            next.iter().map(|(shard, next)| (*shard, *next)).collect()
        } else {
            let count = input.below(4);
            let mut entries: Vec<(u32, u64)> = (0..count)
                .map(|_| (shard_id(input), offset_value(input)))
                .collect();
            entries.sort_unstable();
            entries
        };
        for (shard, at) in &checkpoint {
            next.entry(*shard).or_insert(*at);
        }
        file.extend(segment::encode_header(header_seq, input.u64(), &checkpoint));
    } else {
        // Raw bytes where the header goes (rarely valid, but the CRC lets a mutation of a
        // seed through).
        let len = usize::from(input.u16()) % 4200;
        file.extend_from_slice(input.take(len));
    }
    if mode & 8 == 8 {
        let len = usize::from(input.u16()) % 16_384;
        file.extend_from_slice(input.take(len));
    } else {
        write_records(&mut file, input, next);
    }
    match mode >> 4 & 3 {
        // As written.
        0 => {}
        // Preallocated: zeros up to the segment size.
        1 | 2 => {
            let size = SEGMENT_BYTES.max(file.len() as u64);
            file.resize(usize::try_from(size).expect("small"), 0);
        }
        // Preallocated to another size than configured.
        _ => {
            let size = file.len() + 4096 * input.below(4);
            file.resize(size, 0);
        }
    }
    std::fs::write(dir.join(segment::file_name(seq)), &file).expect("write a segment");
}

/// Records framed with valid CRCs, then maybe one corruption.
fn write_records(file: &mut Vec<u8>, input: &mut Input<'_>, next: &mut BTreeMap<u32, u64>) {
    let start = file.len();
    let count = input.below(17);
    for _ in 0..count {
        let shard = shard_id(input);
        let expected = next.get(&shard).copied().unwrap_or(0);
        let offset = match input.byte() {
            0..=199 => expected,
            200..=219 => expected.saturating_add(1 + u64::from(input.byte() & 3)),
            220..=239 => expected.saturating_sub(1 + u64::from(input.byte() & 3)),
            _ => offset_value(input),
        }
        .min(OFFSET_MAX);
        let timestamp = input.u64();
        let key = input.bytes(8).to_vec();
        let fill = input.byte();
        let payload = vec![fill; usize::from(input.u16()) % 1200];
        frame::encode(file, shard, offset, timestamp, &key, &payload);
        next.insert(shard, offset.saturating_add(1));
    }
    let written = file.len() - start;
    match input.byte() {
        // Most files are left as framed.
        0..=159 => {}
        160..=199 if written > 0 => {
            let at = start + input.below(written);
            file[at] ^= input.byte() | 1;
        }
        200..=229 if written > 0 => {
            let at = start + input.below(written);
            file.truncate(at);
        }
        _ => {
            let garbage = input.bytes(64);
            file.extend_from_slice(garbage);
        }
    }
}

/// A shard id: mostly one of a few, sometimes anything.
fn shard_id(input: &mut Input<'_>) -> u32 {
    match input.byte() {
        0..=239 => u32::from(input.byte() & 3),
        _ => input.u32(),
    }
}

/// An offset: mostly small, sometimes near the largest a record can carry, rarely anything.
fn offset_value(input: &mut Input<'_>) -> u64 {
    match input.byte() {
        0..=199 => u64::from(input.byte() & 15),
        200..=249 => OFFSET_MAX - u64::from(input.byte() & 3),
        _ => input.u64(),
    }
}
