//! Measures what starting a segment costs the log's thread: the whole creation
//! (`segment::create`: preallocate, header, fsync, rename, directory fsync), as a log did at
//! every roll before segments were made ahead, against the part left on the log's thread
//! when the file was made ahead (`segment::finish_blank` after `segment::make_blank`, see
//! `src/ahead.rs`). Alternates the two so a drifting disk affects both alike. Not a test:
//! the figures go to docs/design/durable.md.
//!
//! ```text
//! cargo run --release -p felix-storage --example segment_start -- DIR [SEGMENT_MIB] [ROUNDS]
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use felix_storage::segment;

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
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "segment {mib} MiB, {rounds} pairs: on the log's thread, created at the roll {:.0} us \
         (median), made ahead {:.0} us; the helper thread's part {:.0} us",
        us(median(whole)),
        us(median(left)),
        us(median(ahead))
    );
}
