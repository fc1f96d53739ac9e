//! Disk full on a real small file system: the broker's data directory on a size-limited
//! tmpfs, then on a loop-mounted ext4 image, acked durable load (on_commit, 1 MiB segments)
//! until the disk is full. Publishes are then refused with `storage_full` (code 31), nothing
//! acked is lost, and once space is freed (a filler file in the same file system is deleted)
//! the broker serves again; a SIGKILL and restart afterwards still finds every acked record.
//! Needs root (mount); each kind that cannot be mounted is skipped with the reason printed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use felix_campaign::broker::{Broker, BrokerOptions};
use felix_campaign::record::{self, RecordId};
use felix_campaign::smallfs::{SmallFs, SmallFsKind};
use felix_client::{Client, ErrorCode, ShardSelection, StartPosition, StreamKind};
use futures::StreamExt as _;

/// Size of the small file system.
const FS_MIB: u32 = 24;
/// Filler written first, leaving room for the broker's first segments, the certificate and
/// the catalogue plus a few MiB of records (two cores preallocate 1 MiB each).
const FILLER_BYTES: usize = 14 << 20;
const STREAM: &str = "full";
const SHARDS: u32 = 4;
/// Records per publish and payload size: 64 KiB per publish fills MiBs in ~100 publishes.
const BATCH: u64 = 8;
const PAYLOAD_BYTES: usize = 8 * 1024;
/// Publishes attempted before the test gives up on seeing the disk fill (24 MiB / 64 KiB =
/// 384 publishes fill everything).
const PUBLISHES_MAX: u64 = 2000;
/// `storage_full` answers in a row that mean "full", not a passing hiccup.
const FULL_IN_A_ROW: u32 = 5;
/// Generous deadline of each step on a loaded 2-CPU machine.
const DEADLINE: Duration = Duration::from_secs(60);

/// Acked records: (shard, offset) -> id.
type Acked = HashMap<(u32, u64), RecordId>;

fn options(fs: &SmallFs, work: &std::path::Path) -> BrokerOptions {
    BrokerOptions {
        felix: env!("CARGO_BIN_EXE_felix").into(),
        data_dir: fs.path().join("data"),
        env: vec![
            ("FELIX_DURABLE_FSYNC_MODE".into(), "on_commit".into()),
            ("FELIX_DURABLE_SEGMENT_BYTES".into(), "1MiB".into()),
        ],
        // The log lives outside the small file system, so it never takes its space.
        log: work.join("broker.log"),
    }
}

async fn within<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, future)
        .await
        .expect("finished within the deadline")
}

/// Publishes one batch of new records; records their offsets when acked.
async fn publish(
    client: &Client,
    seq: &mut u64,
    acked: &mut Acked,
) -> Result<(), felix_client::ClientError> {
    let ids: Vec<RecordId> = (0..BATCH)
        .map(|i| RecordId {
            writer: 0,
            seq: *seq + i,
        })
        .collect();
    *seq += BATCH;
    let records: Vec<_> = ids
        .iter()
        .map(|id| record::make(*id, PAYLOAD_BYTES))
        .collect();
    let acks = within(client.publish(STREAM, &records)).await?;
    for ack in acks {
        let on_shard = ids
            .iter()
            .filter(|id| felix_wire::shard_for_key(&record::key(**id), SHARDS) == ack.shard);
        for (i, id) in on_shard.enumerate() {
            acked.insert((ack.shard, ack.first_offset + i as u64), *id);
        }
    }
    Ok(())
}

/// Reads the stream back and asserts every acked record is there, byte for byte.
async fn assert_all_acked_present(client: &Client, acked: &Acked, when: &str) {
    let info = within(client.describe_stream(STREAM))
        .await
        .expect("described");
    let want: u64 = info
        .shards
        .iter()
        .map(|s| s.next_offset - s.oldest_offset)
        .sum();
    let mut subscription =
        within(client.subscribe(STREAM, ShardSelection::All, StartPosition::Earliest))
            .await
            .expect("subscribed");
    let mut found: HashMap<(u32, u64), RecordId> = HashMap::new();
    for _ in 0..want {
        let r = within(subscription.next())
            .await
            .expect("a record")
            .expect("no error");
        let id = record::check(&r.key, &r.payload).unwrap_or_else(|why| {
            panic!("{when}: damaged record at {}:{}: {why}", r.shard, r.offset)
        });
        found.insert((r.shard, r.offset), id);
    }
    subscription.close().await;
    for (at, id) in acked {
        assert_eq!(
            found.get(at),
            Some(id),
            "{when}: acked {id} at {at:?} is missing"
        );
    }
}

#[test]
fn disk_full_refuses_with_storage_full_keeps_acked_and_recovers() {
    // Proves a full disk (tmpfs, then ext4) refuses publishes with storage_full, loses nothing acked, and serves again once space is freed.
    let mut ran = 0;
    for kind in [SmallFsKind::Tmpfs, SmallFsKind::LoopExt4] {
        match SmallFs::mount_as(kind, FS_MIB) {
            Ok(fs) => {
                fill_and_free(fs);
                ran += 1;
            }
            Err(why) => eprintln!("enospc: {kind:?} SKIPPED: {why}"),
        }
    }
    if ran == 0 {
        eprintln!("enospc: SKIPPED: no small file system could be mounted here");
    }
}

/// The scenario on one mounted file system.
fn fill_and_free(fs: SmallFs) {
    eprintln!(
        "enospc: {:?} of {FS_MIB} MiB at {}",
        fs.kind(),
        fs.path().display()
    );
    let work = tempfile::tempdir().expect("temp dir");
    let filler = fs.path().join("filler");
    std::fs::write(&filler, vec![0xA5u8; FILLER_BYTES]).expect("filler written");
    let options = options(&fs, work.path());
    std::fs::create_dir_all(&options.data_dir).expect("data dir");
    let mut broker = Broker::start(&options).expect("broker starts on the small file system");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut acked = Acked::new();
    let mut seq = 0u64;
    runtime.block_on(async {
        let client = within(Client::connect(broker.client_config("enospc")))
            .await
            .expect("connects");
        within(client.create_stream(STREAM, SHARDS, StreamKind::Durable))
            .await
            .expect("created");
        // Fill the disk under acked load.
        let started = Instant::now();
        let mut full_in_a_row = 0;
        let mut refused = 0u64;
        for _ in 0..PUBLISHES_MAX {
            match publish(&client, &mut seq, &mut acked).await {
                Ok(()) => full_in_a_row = 0,
                Err(error) => {
                    assert_eq!(
                        error.code(),
                        Some(ErrorCode::StorageFull),
                        "a full disk refuses with storage_full, not: {error}"
                    );
                    assert_eq!(ErrorCode::StorageFull as u16, 31);
                    refused += 1;
                    full_in_a_row += 1;
                    if full_in_a_row >= FULL_IN_A_ROW {
                        break;
                    }
                }
            }
        }
        assert!(
            full_in_a_row >= FULL_IN_A_ROW,
            "the disk never filled: {} acked records, free {:?}",
            acked.len(),
            fs.free_bytes()
        );
        eprintln!(
            "enospc: full after {} acked records, {refused} publishes refused, {:.1} s; free {:?} bytes",
            acked.len(),
            started.elapsed().as_secs_f64(),
            fs.free_bytes()
        );
        assert!(!acked.is_empty(), "some publishes were acked before the disk filled");
        // Nothing acked is lost.
        assert_all_acked_present(&client, &acked, "disk full").await;
        // Free space: the broker serves again (the next append retries the segment roll).
        std::fs::remove_file(&filler).expect("filler removed");
        let deadline = Instant::now() + DEADLINE;
        loop {
            match publish(&client, &mut seq, &mut acked).await {
                Ok(()) => break,
                Err(error) if error.code() == Some(ErrorCode::StorageFull) => {
                    assert!(Instant::now() < deadline, "still storage_full after space was freed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => panic!("after space was freed: {error}"),
            }
        }
        for _ in 0..10 {
            publish(&client, &mut seq, &mut acked)
                .await
                .expect("acked once space is free");
        }
        assert_all_acked_present(&client, &acked, "space freed").await;
        client.close().await;
    });
    // A crash after all this: recovery on the once-full disk keeps every acked record.
    broker.kill().expect("killed");
    let broker = Broker::start(&options).expect("restarts on the same data directory");
    runtime.block_on(async {
        let client = within(Client::connect(broker.client_config("enospc")))
            .await
            .expect("connects after the restart");
        assert_all_acked_present(&client, &acked, "after SIGKILL and restart").await;
        client.close().await;
    });
    // The broker is dropped (killed) before the file system is unmounted.
    drop(broker);
    drop(fs);
}
