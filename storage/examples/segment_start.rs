//! Measures what starting a segment costs the log's thread: the whole creation
//! (`segment::create`: preallocate, header, fsync, rename, directory fsync), as a log did at
//! every roll before segments were made ahead, against the part left on the log's thread
//! when the file was made ahead (`segment::finish_blank` after `segment::make_blank`, see
//! `src/ahead.rs`). Alternates the two so a drifting disk affects both alike. Also times the
//! closing segment's sidecar (48 shards, an index entry per shard every 4 MiB of a full
//! segment: the default index interval), which the helper thread now writes too. Not a test:
//! the figures go to docs/design/durable.md.
//!
//! ```text
//! cargo run --release -p felix-storage --example segment_start -- DIR [SEGMENT_MIB] [ROUNDS]
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use felix_storage::segment;
use felix_storage::sidecar::{self, Sidecar, SidecarShard};

/// Segment size when none is given: the broker's default (FELIX_DURABLE_SEGMENT_BYTES).
const DEFAULT_SEGMENT_MIB: u64 = 1024;
/// Pairs measured when none is given.
const DEFAULT_ROUNDS: usize = 12;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: segment_start DIR [SEGMENT_MIB] [ROUNDS]");
        std::process::exit(2);
    };
    let mib: u64 = args.next().map_or(DEFAULT_SEGMENT_MIB, |a| {
        a.parse().expect("SEGMENT_MIB is a number")
    });
    let rounds: usize = args
        .next()
        .map_or(DEFAULT_ROUNDS, |a| a.parse().expect("ROUNDS is a number"));
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).expect("create DIR");
    let size = mib << 20;
    let checkpoint: Vec<(u32, u64)> = (0..48).map(|s| (s, 1_000_000)).collect();
    let (mut whole, mut left, mut ahead) = (Vec::new(), Vec::new(), Vec::new());
    let mut sidecars = Vec::new();
    let per_shard = (size / (4 << 20)).max(1);
    let sidecar = Sidecar {
        seq: 0,
        header_crc: 0,
        index_interval_bytes: 4 << 20,
        data_end: size,
        records: 48 * per_shard * 64,
        record_bytes: size,
        max_timestamp_us: Some(1),
        shards: (0..48)
            .map(|shard| SidecarShard {
                shard,
                first: 0,
                end: per_shard * 64,
                records: per_shard * 64,
            })
            .collect(),
        entries: (0..48u32)
            .flat_map(|shard| {
                (0..per_shard).map(move |i| (shard, i * 64, i * (4 << 20) + u64::from(shard)))
            })
            .collect(),
    };
    for i in 0..rounds as u64 {
        let seq = 2 * i;
        let t = Instant::now();
        let (_, _, path) = segment::create(dir, seq, size, 0, &checkpoint).expect("create");
        whole.push(t.elapsed());
        std::fs::remove_file(path).expect("remove");
        let t = Instant::now();
        let blank = segment::make_blank(dir, seq + 1, size).expect("make_blank");
        ahead.push(t.elapsed());
        let t = Instant::now();
        let (_, _, path) =
            segment::finish_blank(dir, blank, seq + 1, size, 0, &checkpoint).expect("finish");
        left.push(t.elapsed());
        std::fs::remove_file(path).expect("remove");
        let t = Instant::now();
        sidecar::write(dir, &sidecar).expect("sidecar");
        segment::sync_dir(dir).expect("sync dir");
        sidecars.push(t.elapsed());
        sidecar::remove(dir, sidecar.seq);
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "segment {mib} MiB, {rounds} pairs: on the log's thread, created at the roll {:.0} us \
         (median), made ahead {:.0} us; the helper thread's part {:.0} us; the sidecar ({} \
         entries) {:.0} us",
        us(median(whole)),
        us(median(left)),
        us(median(ahead)),
        sidecar.entries.len(),
        us(median(sidecars))
    );
}
