//! Microbenchmarks of the durable log: frame encode + CRC32C, and group-commit throughput
//! per backend (on_commit: one write + one fdatasync per round of 64 x 4 KiB records) on a
//! temporary directory of the machine's disk.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use felix_storage::{Backend, FsyncMode, Log, LogConfig, PwriteBackend, UringBackend, frame};

/// Records per round and payload size of the group-commit run (the brief's 4 KiB x 64).
const ROUND_RECORDS: u64 = 64;
const RECORD_PAYLOAD_BYTES: usize = 4096;
/// Shards the rounds' records are spread over, like a core holding part of a 48-shard stream.
const SHARDS: u32 = 24;
/// Segment size for the run: 64 MiB keeps preallocation quick; retention caps the temp
/// directory at 4 segments.
const BENCH_SEGMENT_BYTES: u64 = 64 << 20;
/// Deadline for one round to complete (never reached on a working disk).
const ROUND_DEADLINE: Duration = Duration::from_secs(30);

fn frame_encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("frame_encode_crc");
    for size in [256usize, 4096] {
        let payload = vec![0xA5u8; size];
        let key = [7u8; 16];
        let mut buf = Vec::with_capacity(size + 64);
        g.throughput(Throughput::Bytes(frame::frame_len(key.len(), size) as u64));
        g.bench_function(format!("{size}B"), |b| {
            let mut offset = 0u64;
            b.iter(|| {
                buf.clear();
                frame::encode(
                    &mut buf,
                    3,
                    offset,
                    1_700_000_000_000_000,
                    &key,
                    black_box(&payload),
                );
                offset += 1;
                black_box(&buf);
            })
        });
    }
    g.finish();
}

fn run_rounds<B: Backend>(
    log: &mut Log<B>,
    next: &mut [u64],
    payload: &[u8],
    rounds: u64,
) -> Duration {
    let started = Instant::now();
    for _ in 0..rounds {
        for i in 0..ROUND_RECORDS {
            let shard = (i % SHARDS as u64) as u32;
            let offset = next[shard as usize];
            log.append(shard, offset, 1, b"key", payload)
                .expect("append");
            next[shard as usize] += 1;
        }
        log.flush(ROUND_DEADLINE).expect("round");
        while log.poll_event().is_some() {}
    }
    let elapsed = started.elapsed();
    log.apply_retention(u64::MAX).expect("retention");
    elapsed
}

fn group_commit_backend<B: Backend>(c: &mut Criterion, name: &str, backend: B) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = LogConfig::new(dir.path());
    cfg.fsync = FsyncMode::OnCommit;
    cfg.segment_bytes = BENCH_SEGMENT_BYTES;
    cfg.retention_bytes = Some(4 * BENCH_SEGMENT_BYTES);
    let (mut log, _) = Log::open(cfg, backend).expect("open");
    let payload = vec![0x5Au8; RECORD_PAYLOAD_BYTES];
    let mut next = vec![0u64; SHARDS as usize];
    let mut g = c.benchmark_group("group_commit_on_commit_64x4KiB");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(
        ROUND_RECORDS * RECORD_PAYLOAD_BYTES as u64,
    ));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| run_rounds(&mut log, &mut next, &payload, iters))
    });
    g.finish();
    let counters = log.counters();
    eprintln!(
        "{name}: {} rounds, {} fsyncs, {:.1} records/fsync, fsync p50 < {} us, p99 < {} us",
        counters.rounds,
        counters.fsyncs,
        counters.records_per_fsync(),
        counters.fsync_latency.quantile_upper_us(0.5).unwrap_or(0),
        counters.fsync_latency.quantile_upper_us(0.99).unwrap_or(0),
    );
}

fn group_commit(c: &mut Criterion) {
    match UringBackend::new() {
        Ok(b) => group_commit_backend(c, "io_uring", b),
        Err(e) => eprintln!(
            "!!!!! io_uring unavailable here ({e}); io_uring group-commit bench skipped !!!!!"
        ),
    }
    group_commit_backend(c, "pwrite", PwriteBackend::new().expect("pwrite backend"));
}

criterion_group!(benches, frame_encode, group_commit);
criterion_main!(benches);
