//! `felix log check|repair|compact` end to end with the real binary (docs/operations.md,
//! Durable streams; docs/storage-format.md, Corruption and repair): a flipped byte in a closed
//! segment is reported by `check`, quarantined by `repair` (never reusing an offset), and
//! afterwards a subscriber catching up from the earliest offset gets every other record
//! byte-identical at its offset, the quarantined ones skipped and counted; the commands refuse
//! to run next to a broker; `compact` gives back a deleted stream's space.

mod support;

use std::path::{Path, PathBuf};
use std::process::Output;

use bytes::Bytes;
use felix_client::{ShardSelection, StartPosition, StreamKind, record};
use futures::StreamExt as _;
use support::{BrokerProcess, metric_value, within};

const RECORDS: u64 = 400;

fn payload(index: u64) -> Bytes {
    Bytes::from(format!("{index:05}:{}", "d".repeat(480)))
}

/// `felix log <args...> --data-dir DIR`.
fn log_command(data_dir: &Path, args: &[&str]) -> Output {
    support::felix()
        .arg("log")
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .output()
        .expect("felix log runs")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The segment files of core `core`'s log, oldest first.
fn segments(data_dir: &Path, core: usize) -> Vec<PathBuf> {
    let dir = data_dir.join("log").join(format!("core-{core}"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the core's log directory")
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "log"))
        .collect();
    files.sort();
    files
}

// Proves a flipped byte in a closed segment is found by `felix log check`, quarantined by
// `felix log repair`, and then served around: every other record at its offset, byte for
// byte, the lost offsets skipped (counted) and never handed out again; and that the commands
// refuse to run while a broker holds the data directory.
#[tokio::test]
async fn a_damaged_segment_is_checked_repaired_and_served_around() {
    let mut broker = BrokerProcess::start(&[
        ("FELIX_DATAPLANE_CORES", "1"),
        ("FELIX_DURABLE_FSYNC_MODE", "on_commit"),
        ("FELIX_DURABLE_SEGMENT_BYTES", "64KiB"),
    ]);
    let data_dir = broker.data_dir.path().to_path_buf();
    let client = broker.client().await;
    within(client.create_stream("audit", 1, StreamKind::Durable))
        .await
        .expect("created");
    for index in 0..RECORDS {
        within(client.publish("audit", &[record("k", payload(index))]))
            .await
            .expect("acked");
    }
    client.close().await;
    let busy = log_command(&data_dir, &["check"]);
    assert!(!busy.status.success(), "check ran next to a broker");
    assert!(text(&busy).contains("in use"), "{}", text(&busy));
    assert!(broker.terminate().success());

    let clean = log_command(&data_dir, &["check"]);
    assert!(clean.status.success(), "{}", text(&clean));
    let files = segments(&data_dir, 0);
    assert!(files.len() >= 3, "the log rolled: {files:?}");
    // Flip a byte in the middle of the first (closed) segment.
    let mut bytes = std::fs::read(&files[0]).expect("segment");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&files[0], &bytes).expect("damaged");
    let damaged = log_command(&data_dir, &["check"]);
    assert!(!damaged.status.success(), "check missed the damage");
    let repaired = log_command(&data_dir, &["repair"]);
    assert!(repaired.status.success(), "{}", text(&repaired));
    assert!(text(&repaired).contains("quarantin"), "{}", text(&repaired));
    assert!(log_command(&data_dir, &["check"]).status.success());

    broker.restart();
    let quarantined = metric_value(&broker.metrics(), "felix_quarantined_records").unwrap_or(0);
    assert!(quarantined >= 1, "the lost offsets are counted");
    let client = broker.client().await;
    let mut subscription =
        within(client.subscribe("audit", ShardSelection::All, StartPosition::Earliest))
            .await
            .expect("subscribed");
    let mut offsets = Vec::new();
    while offsets.len() as u64 + quarantined < RECORDS {
        let next = within(subscription.next())
            .await
            .expect("a record")
            .expect("delivered");
        assert_eq!(next.payload, payload(next.offset), "record {}", next.offset);
        offsets.push(next.offset);
    }
    assert!(offsets.windows(2).all(|pair| pair[0] < pair[1]), "in order");
    assert_eq!(
        offsets.len() as u64 + quarantined,
        RECORDS,
        "every record but the quarantined ones"
    );
    // A new record gets an offset past every offset ever handed out.
    let acks = within(client.publish("audit", &[record("k", payload(RECORDS))]))
        .await
        .expect("acked");
    assert_eq!(acks[0].first_offset, RECORDS);
    let skipped =
        metric_value(&broker.metrics(), "felix_quarantine_skipped_records_total").unwrap_or(0);
    assert_eq!(skipped, quarantined, "the skips are counted");
    client.close().await;
}

// Proves a deleted durable stream's records leave the disk: the segments holding only them
// are given back by the broker, and `felix log compact` rewrites the rest offline, while the
// live stream keeps every record at its offset.
#[tokio::test]
async fn deleted_streams_give_their_space_back() {
    let mut broker = BrokerProcess::start(&[
        ("FELIX_DATAPLANE_CORES", "1"),
        ("FELIX_DURABLE_FSYNC_MODE", "on_commit"),
        ("FELIX_DURABLE_SEGMENT_BYTES", "64KiB"),
    ]);
    let data_dir = broker.data_dir.path().to_path_buf();
    let client = broker.client().await;
    for name in ["keep", "drop"] {
        within(client.create_stream(name, 1, StreamKind::Durable))
            .await
            .expect("created");
    }
    for index in 0..RECORDS {
        let stream = if index % 4 == 0 { "keep" } else { "drop" };
        within(client.publish(stream, &[record("k", payload(index))]))
            .await
            .expect("acked");
    }
    within(client.delete_stream("drop")).await.expect("deleted");
    client.close().await;
    assert!(broker.terminate().success());
    let size = |dir: &Path| -> u64 {
        segments(dir, 0)
            .iter()
            .map(|file| std::fs::metadata(file).map_or(0, |meta| meta.len()))
            .sum()
    };
    let before = size(&data_dir);
    let compacted = log_command(&data_dir, &["compact"]);
    assert!(compacted.status.success(), "{}", text(&compacted));
    let after = size(&data_dir);
    assert!(after < before, "compact freed nothing: {before} -> {after}");
    broker.restart();
    let client = broker.client().await;
    let mut subscription =
        within(client.subscribe("keep", ShardSelection::All, StartPosition::Earliest))
            .await
            .expect("subscribed");
    for (offset, index) in (0..RECORDS).step_by(4).enumerate() {
        let next = within(subscription.next())
            .await
            .expect("a record")
            .expect("delivered");
        assert_eq!(next.offset, offset as u64);
        assert_eq!(next.payload, payload(index));
    }
    client.close().await;
}
