//! Recovery properties on real files: for random logs, truncating the log or corrupting a
//! byte at ANY position keeps exactly the valid prefix before it, and the index rebuilt by
//! recovery equals the writer's index restricted to that prefix.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::Rng;
use common::*;
use felix_storage::frame::{self, Decoded};
use felix_storage::{FaultBackend, FsyncMode, IndexEntry, Log, segment};
use proptest::prelude::*;

/// One record as found in the files by the test's own parser.
#[derive(Debug, Clone)]
struct Placed {
    seq: u64,
    start: u64,
    end: u64,
    shard: u32,
    offset: u64,
}

/// Segment seq -> (header bytes, end of data), and every record in log order.
fn parse_files(dir: &Path) -> (BTreeMap<u64, (u64, u64)>, Vec<Placed>) {
    let mut segs = BTreeMap::new();
    let mut placed = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| segment::parse_file_name(e.ok()?.file_name().to_str()?))
        .collect();
    names.sort_unstable();
    for seq in names {
        let bytes = std::fs::read(dir.join(segment::file_name(seq))).expect("read segment");
        let file = std::fs::File::open(dir.join(segment::file_name(seq))).expect("open");
        let header = segment::read_header(&file, bytes.len() as u64).expect("valid header");
        let mut at = header.header_bytes as usize;
        while let Decoded::Record {
            record,
            frame_bytes,
        } = frame::decode(&bytes[at..])
        {
            placed.push(Placed {
                seq,
                start: at as u64,
                end: (at + frame_bytes) as u64,
                shard: record.shard,
                offset: record.offset,
            });
            at += frame_bytes;
        }
        segs.insert(seq, (header.header_bytes, at as u64));
    }
    (segs, placed)
}

#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Cut the log at the position: the segment is shortened, later segments removed.
    Truncate,
    /// XOR one byte at the position with a non-zero value; nothing else changes.
    Corrupt(u8),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        Just(Damage::Truncate),
        (1u8..=255).prop_map(Damage::Corrupt)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn damage_at_any_byte_keeps_exactly_the_valid_prefix(
        batches in prop::collection::vec(prop::collection::vec((0u32..3, 0usize..8, 0usize..700), 1..12), 1..30),
        segment_pick in any::<prop::sample::Index>(),
        position_pick in any::<prop::sample::Index>(),
        damage in damage(),
    ) {
        // Any truncation or single-byte corruption leaves exactly the records wholly before it, with the same index.
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = small_config(dir.path(), FsyncMode::OnCommit);
        let (backend, _) = FaultBackend::new(true).expect("backend");
        let (mut log, _) = Log::open(cfg.clone(), backend).expect("open");
        let mut model = Model::default();
        let mut rng = Rng(batches.len() as u64);
        for batch in &batches {
            for &(shard, key, payload) in batch {
                model.append(&mut log, &mut rng, shard, key, payload);
            }
            log.flush(DEADLINE).expect("flush");
        }
        let shards = log.shard_ids();
        let index_before: BTreeMap<u32, Vec<IndexEntry>> = shards.iter().map(|s| (*s, log.index_entries(*s))).collect();
        drop(log);

        let (segs, placed) = parse_files(dir.path());
        prop_assert_eq!(placed.len() as u64, model.records());
        let seqs: Vec<u64> = segs.keys().copied().collect();
        let seq = seqs[segment_pick.index(seqs.len())];
        let (_, data_end) = segs[&seq];
        let path = dir.path().join(segment::file_name(seq));
        // Truncation may cut at data_end itself (nothing lost in this segment); a corruption
        // hits a byte of the header or of a record.
        let pos = match damage {
            Damage::Truncate => position_pick.index(data_end as usize + 1) as u64,
            Damage::Corrupt(_) => position_pick.index(data_end as usize) as u64,
        };
        match damage {
            Damage::Truncate => {
                OpenOptions::new().write(true).open(&path).expect("open").set_len(pos).expect("truncate");
                for later in seqs.iter().filter(|s| **s > seq) {
                    std::fs::remove_file(dir.path().join(segment::file_name(*later))).expect("remove");
                }
            }
            Damage::Corrupt(x) => {
                let f = OpenOptions::new().read(true).write(true).open(&path).expect("open");
                let mut b = [0u8; 1];
                f.read_exact_at(&mut b, pos).expect("read");
                f.write_all_at(&[b[0] ^ x], pos).expect("write");
            }
        }
        // Records wholly before the damage survive; the header's damage takes the segment.
        let kept: Vec<&Placed> = placed.iter().filter(|p| p.seq < seq || (p.seq == seq && p.end <= pos)).collect();
        let kept_starts: BTreeSet<(u64, u64)> = kept.iter().map(|p| (p.seq, p.start)).collect();

        let (backend, _) = FaultBackend::new(true).expect("backend");
        let (log, report) = Log::open(cfg, backend).expect("recover");
        prop_assert_eq!(report.records, kept.len() as u64);
        let mut kept_per_shard: BTreeMap<u32, u64> = BTreeMap::new();
        for p in &kept {
            let n = kept_per_shard.entry(p.shard).or_insert(0);
            prop_assert_eq!(p.offset, *n);
            *n += 1;
        }
        for shard in &shards {
            let want = &model.shards[shard][..*kept_per_shard.get(shard).unwrap_or(&0) as usize];
            let got = read_all(&log, *shard, 0, 100);
            prop_assert_eq!(got.len(), want.len());
            prop_assert!(got.iter().zip(want).all(|(g, e)| same(g, e)));
            let expected_index: Vec<IndexEntry> =
                index_before[shard].iter().copied().filter(|e| kept_starts.contains(&(e.segment, e.position))).collect();
            prop_assert_eq!(log.index_entries(*shard), expected_index);
            prop_assert_eq!(log.shard_offsets(*shard).map_or(0, |o| o.next), want.len() as u64);
        }
        // No segment after the damaged one survives (a fresh one follows a total loss).
        let after: Vec<u64> = log.segment_seqs().into_iter().filter(|s| *s > seq).collect();
        prop_assert!(after.is_empty() || (after.len() == 1 && report.segments == 1), "{:?}", after);
        // The files now hold exactly the prefix: recovering again changes nothing.
        drop(log);
        let (backend, _) = FaultBackend::new(true).expect("backend");
        let (_, again) = Log::open(small_config(dir.path(), FsyncMode::OnCommit), backend).expect("recover again");
        prop_assert_eq!(again.records, kept.len() as u64);
        prop_assert_eq!(again.truncated_bytes, 0);
        prop_assert!(again.deleted_segments.is_empty());
    }
}
