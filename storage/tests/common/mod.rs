//! Helpers shared by the integration tests: small-segment configs, a deterministic record
//! generator, and a model of what was appended.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use felix_storage::{Backend, FsyncMode, Log, LogConfig, LogEvent, Record, ShardRange};

/// Generous deadline for anything that waits on a real disk (tests never assert on speed).
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A config with tiny segments and rounds so a few hundred records cross several segments.
pub fn small_config(dir: &Path, fsync: FsyncMode) -> LogConfig {
    let mut c = LogConfig::new(dir);
    c.segment_bytes = 32 << 10;
    c.max_round_bytes = 8 << 10;
    c.max_pending_bytes = 4 << 20;
    c.index_interval_bytes = 4096;
    c.fsync = fsync;
    c
}

/// splitmix64, for reproducible record contents.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// One appended record as the test expects to read it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub shard: u32,
    pub offset: u64,
    pub timestamp_us: u64,
    pub key: Vec<u8>,
    pub payload: Vec<u8>,
}

/// What the test appended, per shard in offset order.
#[derive(Debug, Default, Clone)]
pub struct Model {
    pub shards: BTreeMap<u32, Vec<Expected>>,
}

impl Model {
    /// Every shard of the model reads back from `log` from offset 0, record for record.
    pub fn assert_read_back<B: Backend>(&self, log: &Log<B>) {
        for (shard, want) in &self.shards {
            let got = read_all(log, *shard, 0, 50);
            assert!(got.len() == want.len() && got.iter().zip(want).all(|(g, e)| same(g, e)));
        }
    }

    pub fn next_offset(&self, shard: u32) -> u64 {
        self.shards.get(&shard).map_or(0, |v| v.len() as u64)
    }

    /// Appends one generated record to `log` and to the model.
    pub fn append<B: Backend>(
        &mut self,
        log: &mut Log<B>,
        rng: &mut Rng,
        shard: u32,
        key_max: usize,
        payload_max: usize,
    ) {
        let key_len = rng.below(key_max as u64 + 1) as usize;
        let payload_len = rng.below(payload_max as u64 + 1) as usize;
        let e = Expected {
            shard,
            offset: self.next_offset(shard),
            timestamp_us: 1_000_000 + rng.below(1_000_000),
            key: rng.bytes(key_len),
            payload: rng.bytes(payload_len),
        };
        log.append(e.shard, e.offset, e.timestamp_us, &e.key, &e.payload)
            .expect("append");
        self.shards.entry(shard).or_default().push(e);
    }

    pub fn records(&self) -> u64 {
        self.shards.values().map(|v| v.len() as u64).sum()
    }
}

pub fn same(r: &Record, e: &Expected) -> bool {
    r.shard == e.shard
        && r.offset == e.offset
        && r.timestamp_us == e.timestamp_us
        && r.key == e.key
        && r.payload == e.payload
}

/// Reads every committed record of `shard` from `from`, in pages of `page` records.
pub fn read_all<B: Backend>(log: &Log<B>, shard: u32, from: u64, page: usize) -> Vec<Record> {
    let mut out: Vec<Record> = Vec::new();
    let mut next = from;
    loop {
        let got = log.read(shard, next, page, usize::MAX).expect("read");
        if got.is_empty() {
            return out;
        }
        next = got.last().map(|r| r.offset + 1).expect("non-empty");
        out.extend(got);
    }
}

/// Drains queued events.
pub fn drain<B: Backend>(log: &mut Log<B>) -> Vec<LogEvent> {
    std::iter::from_fn(|| log.poll_event()).collect()
}

/// Per-shard offsets covered by ranges, checking that each shard's ranges are contiguous and
/// ascending: returns shard -> end of the covered prefix.
pub fn covered(ranges: impl IntoIterator<Item = ShardRange>) -> BTreeMap<u32, u64> {
    let mut ends = BTreeMap::new();
    for r in ranges {
        let end = ends.entry(r.shard).or_insert(r.first);
        assert_eq!(*end, r.first, "ranges of shard {} are contiguous", r.shard);
        assert!(r.end > r.first, "ranges are non-empty");
        *end = r.end;
    }
    ends
}

/// Drives `log` until `done` holds, waiting on its wake fd; panics after DEADLINE.
pub fn drive_until<B: Backend>(
    log: &mut Log<B>,
    now: impl Fn() -> Instant,
    mut done: impl FnMut(&mut Log<B>) -> bool,
) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        log.drive(now()).expect("drive");
        if done(log) {
            return;
        }
        let left = deadline
            .checked_duration_since(Instant::now())
            .expect("condition not reached before the deadline");
        felix_storage::wait_readable(log.wake_fd(), left.min(Duration::from_millis(100)))
            .expect("wait");
    }
}

/// One frame as found in the files by the test's own parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub seq: u64,
    pub start: u64,
    pub end: u64,
    /// `None` for a commit mark.
    pub record: Option<(u32, u64)>,
}

/// Segment seq -> (header bytes, end of data), and every frame (records and commit marks)
/// in log order.
pub fn parse_files(dir: &Path) -> (BTreeMap<u64, (u64, u64)>, Vec<Placed>) {
    use felix_storage::frame::{self, Decoded};
    use felix_storage::segment;
    let mut segs = BTreeMap::new();
    let mut placed = Vec::new();
    for seq in segment_seqs(dir) {
        let path = dir.join(segment::file_name(seq));
        let bytes = std::fs::read(&path).expect("read segment");
        let file = std::fs::File::open(&path).expect("open");
        let header = segment::read_header(&file, bytes.len() as u64).expect("valid header");
        let mut at = header.header_bytes as usize;
        loop {
            let (record, len) = match frame::decode(&bytes[at..]) {
                Decoded::Record {
                    record,
                    frame_bytes,
                } => (Some((record.shard, record.offset)), frame_bytes),
                Decoded::Mark { .. } => (None, frame::MARK_BYTES),
                _ => break,
            };
            placed.push(Placed {
                seq,
                start: at as u64,
                end: (at + len) as u64,
                record,
            });
            at += len;
        }
        segs.insert(seq, (header.header_bytes, at as u64));
    }
    (segs, placed)
}

/// Segment sequence numbers in `dir`, ascending.
pub fn segment_seqs(dir: &Path) -> Vec<u64> {
    let mut seqs: Vec<u64> = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| felix_storage::segment::parse_file_name(e.ok()?.file_name().to_str()?))
        .collect();
    seqs.sort_unstable();
    seqs
}

/// XORs the byte at `pos` of a file with `x` (non-zero), in place.
pub fn flip(path: &Path, pos: u64, x: u8) {
    use std::os::unix::fs::FileExt;
    assert_ne!(x, 0, "a flip changes the byte");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, pos).expect("read");
    f.write_all_at(&[b[0] ^ x], pos).expect("write");
    f.sync_all().expect("fsync");
}

/// Removes every sidecar index of `dir` (recovery then scans every segment).
pub fn remove_sidecars(dir: &Path) {
    for entry in std::fs::read_dir(dir).expect("list") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "idx") {
            std::fs::remove_file(path).expect("remove sidecar");
        }
    }
}

/// Copies the regular files of `from` into the empty directory `to` (the lock file too).
pub fn copy_dir(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).expect("list") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

/// A log of `records` records over `shards` shards in small segments, flushed (so a final
/// commit mark covers everything), returned closed with its model.
pub fn build_log(dir: &Path, records: usize, shards: u32, seed: u64) -> Model {
    let cfg = small_config(dir, FsyncMode::OnCommit);
    let (backend, _) = felix_storage::FaultBackend::new(true).expect("backend");
    let (mut log, _) = Log::open(cfg, backend).expect("open");
    let mut model = Model::default();
    let mut rng = Rng(seed);
    for i in 0..records {
        let shard = rng.below(u64::from(shards)) as u32;
        model.append(&mut log, &mut rng, shard, 8, 500);
        if i % 7 == 6 {
            log.flush(DEADLINE).expect("flush");
        }
    }
    // A clean stop: the final commit mark proves every record synced.
    log.sync_now();
    log.flush(DEADLINE).expect("flush");
    model
}

/// Opens `dir` with the fault backend (auto-complete) and the small test config.
pub fn open_fault(
    dir: &Path,
) -> Result<
    (
        Log<felix_storage::FaultBackend>,
        felix_storage::RecoveryReport,
    ),
    felix_storage::StorageError,
> {
    let (backend, _) = felix_storage::FaultBackend::new(true).expect("backend");
    Log::open(small_config(dir, FsyncMode::OnCommit), backend)
}
