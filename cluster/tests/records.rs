//! A replicated shard's record log (`cluster/src/records.rs`) on real files with real
//! fdatasync: applied batches are recorded at the offsets the shard gave them, once across a
//! restart; a Raft log compacted past the record log's end leaves a hole that records fetched
//! from a peer fill; offsets the peers no longer hold start a new generation that a restart
//! keeps; retention by bytes deletes the oldest segments and reads below them are refused with
//! the oldest offset held.

use std::time::Duration;

use bytes::Bytes;
use felix_cluster::node::Machine;
use felix_cluster::records::{CatchUp, RecordsConfig, ShardRecords};
use felix_cluster::shard::{Batch, ReadError, ShardRecord, ShardState};
use raft::prelude::Entry;
use raft::storage::MemStorage;

const FLUSH: Duration = Duration::from_secs(30);

fn batch(producer: u64, sequence: u64, n: usize) -> Batch {
    Batch {
        producer,
        sequence,
        client: None,
        records: (0..n)
            .map(|i| ShardRecord {
                timestamp_us: 1_000 + i as u64,
                key: Bytes::from(format!("p{producer}-s{sequence}-{i}")),
                payload: Bytes::from(vec![b'a' + (i as u8 % 26); 10 + i * 7]),
            })
            .collect(),
    }
}

/// A shard group's Raft log holding `batches` at indexes 1.., and the state applying them.
fn applied(batches: &[Batch]) -> (MemStorage, ShardState) {
    let store = MemStorage::new();
    let entries: Vec<Entry> = batches
        .iter()
        .enumerate()
        .map(|(i, b)| Entry {
            index: i as u64 + 1,
            term: 1,
            data: b.encode().into(),
            ..Entry::default()
        })
        .collect();
    store.wl().append(&entries).expect("append");
    let mut state = ShardState::default();
    for entry in &entries {
        state.apply(entry.index, &entry.data).expect("apply");
    }
    (store, state)
}

fn all(records: &ShardRecords) -> Vec<(u64, ShardRecord)> {
    records
        .read(records.oldest(), 100_000, usize::MAX)
        .expect("read")
}

#[test]
fn applied_records_are_recorded_once_at_their_offsets_across_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = RecordsConfig::default();
    // Producer 1's batch 1 twice (a retry: applied as a duplicate, no offsets).
    let mut batches = vec![
        batch(1, 1, 3),
        batch(2, 1, 2),
        batch(1, 1, 3),
        batch(1, 2, 4),
    ];
    let (store, state) = applied(&batches);
    assert_eq!(state.next_offset(), 9);
    let expected = state
        .read(&store, 0, 1_000, usize::MAX)
        .expect("the raft log's copy");

    let mut records = ShardRecords::open(dir.path(), &config).expect("open");
    assert_eq!(records.next(), 0);
    assert_eq!(
        records.catch_up(&state, &store).expect("catch up"),
        CatchUp::Recorded
    );
    records.flush(FLUSH).expect("flush");
    assert_eq!(
        (records.next(), records.synced(), records.oldest()),
        (9, 9, 0)
    );
    assert_eq!(all(&records), expected);
    drop(records);

    // A restart re-applies the same entries: nothing is appended twice.
    let mut records = ShardRecords::open(dir.path(), &config).expect("reopen");
    assert_eq!(records.next(), 9);
    assert_eq!(
        records.catch_up(&state, &store).expect("catch up"),
        CatchUp::Recorded
    );
    records.flush(FLUSH).expect("flush");
    assert_eq!(all(&records), expected);

    // Later batches follow.
    batches.push(batch(2, 2, 5));
    let (store, state) = applied(&batches);
    records.catch_up(&state, &store).expect("catch up");
    records.flush(FLUSH).expect("flush");
    let expected = state.read(&store, 0, 1_000, usize::MAX).expect("copy");
    assert_eq!(expected.len(), 14);
    assert_eq!(all(&records), expected);
    assert_eq!(
        records.read(14, 10, usize::MAX).expect("at the end"),
        vec![]
    );
}

#[test]
fn a_raft_log_compacted_past_the_record_log_leaves_a_hole_that_fetched_records_fill() {
    let dir = tempfile::tempdir().expect("temp dir");
    let batches: Vec<Batch> = (1..=6).map(|s| batch(7, s, 3)).collect();
    let (store, mut state) = applied(&batches);
    let peers_copy = state.read(&store, 0, 1_000, usize::MAX).expect("copy");
    // This member installed a snapshot at index 3: entries 1..=3 (offsets 0..9) are gone.
    store.wl().compact(4).expect("compact");
    state.compacted(3);

    let mut records = ShardRecords::open(dir.path(), &RecordsConfig::default()).expect("open");
    assert_eq!(
        records.catch_up(&state, &store).expect("catch up"),
        CatchUp::Hole { from: 0 }
    );
    // Records that do not follow the log's end are ignored (a late or repeated answer).
    assert_eq!(records.fill(&peers_copy[4..9]).expect("fill"), 0);
    assert_eq!(records.fill(&peers_copy[..4]).expect("fill"), 4);
    assert_eq!(
        records.catch_up(&state, &store).expect("catch up"),
        CatchUp::Hole { from: 4 }
    );
    assert_eq!(records.fill(&peers_copy[2..9]).expect("fill"), 5);
    assert_eq!(
        records.catch_up(&state, &store).expect("catch up"),
        CatchUp::Recorded
    );
    records.flush(FLUSH).expect("flush");
    assert_eq!(all(&records), peers_copy);
}

#[test]
fn offsets_the_peers_no_longer_hold_start_a_new_generation() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = RecordsConfig::default();
    let batches: Vec<Batch> = (1..=2).map(|s| batch(3, s, 3)).collect();
    let (store, state) = applied(&batches);
    let copy = state.read(&store, 0, 100, usize::MAX).expect("copy");
    let mut records = ShardRecords::open(dir.path(), &config).expect("open");
    records.catch_up(&state, &store).expect("catch up");
    records.flush(FLUSH).expect("flush");
    assert_eq!(records.next(), 6);

    // The peers hold offsets from 10 on only: recording starts there.
    records.skip_to(10).expect("skip");
    assert_eq!((records.next(), records.oldest()), (10, 10));
    assert_eq!(
        records.read(2, 10, usize::MAX),
        Err(ReadError::Compacted { oldest: 10 })
    );
    let later: Vec<(u64, ShardRecord)> = (10..14).zip(copy.iter().map(|r| r.1.clone())).collect();
    assert_eq!(records.fill(&later).expect("fill"), 4);
    records.flush(FLUSH).expect("flush");
    records
        .apply_retention()
        .expect("release the old generation");
    assert_eq!(all(&records), later);
    drop(records);

    let records = ShardRecords::open(dir.path(), &config).expect("reopen");
    assert_eq!((records.oldest(), records.next()), (10, 14));
    assert_eq!(all(&records), later);
}

#[test]
fn retention_deletes_the_oldest_segments_and_reads_below_them_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = RecordsConfig {
        segment_bytes: 64 << 10,
        retention_bytes: Some(192 << 10),
        ..RecordsConfig::default()
    };
    // ~1 MiB of records: 16 segments of 64 KiB.
    let batches: Vec<Batch> = (1..=40)
        .map(|s| Batch {
            producer: 9,
            sequence: s,
            client: None,
            records: (0..8)
                .map(|i| ShardRecord {
                    timestamp_us: s * 100 + i,
                    key: Bytes::from(format!("k{s}-{i}")),
                    payload: Bytes::from(vec![7u8; 3_000]),
                })
                .collect(),
        })
        .collect();
    let (store, state) = applied(&batches);
    let mut records = ShardRecords::open(dir.path(), &config).expect("open");
    while records.next() < state.next_offset() {
        records.catch_up(&state, &store).expect("catch up");
        records.flush(FLUSH).expect("flush");
    }
    assert_eq!(records.oldest(), 0);
    let before = records.disk_bytes();
    records.apply_retention().expect("retention");
    let oldest = records.oldest();
    assert!(oldest > 0, "the oldest segments are deleted");
    assert!(records.disk_bytes() < before);
    assert!(records.disk_bytes() <= (192 << 10) + (64 << 10));
    assert_eq!(
        records.read(0, 10, usize::MAX),
        Err(ReadError::Compacted { oldest })
    );
    let kept = all(&records);
    let expected = state
        .read(&store, oldest, 1_000, usize::MAX)
        .expect("the raft log's copy");
    assert_eq!(
        kept, expected,
        "the records from the oldest held on are intact"
    );
}
