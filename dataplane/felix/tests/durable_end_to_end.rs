//! Durable streams end to end: the real `felix` binary (fresh data dir, loopback), both log
//! writers (FELIX_STORAGE_IO_URING=1 and =0), clean restarts, catch-up from the log, the CLI
//! and the durable metrics.

mod support;

use std::collections::BTreeMap;

use bytes::Bytes;
use felix_client::{Record, ShardSelection, StartPosition, StreamKind, Subscription, record};
use futures::StreamExt as _;
use support::{BrokerProcess, metric_value, within};

/// Log segments small enough that a debug-build recovery scan stays quick, large enough for
/// several rounds of these tests' records.
const SEGMENT_BYTES: &str = "4MiB";

fn durable_env(io_uring: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("FELIX_DURABLE_FSYNC_MODE", "on_commit"),
        ("FELIX_STORAGE_IO_URING", io_uring),
        ("FELIX_DURABLE_SEGMENT_BYTES", SEGMENT_BYTES),
    ]
}

/// `(offset, key, payload)` of each record of a shard, in offset order.
type ShardRecords = BTreeMap<u32, Vec<(u64, Bytes, Bytes)>>;

/// Printable, varied payload of record `index` of batch `batch`.
fn payload(batch: usize, index: usize) -> Bytes {
    let len = 20 + (batch * 37 + index * 11) % 300;
    let text: String = (0..len)
        .map(|i| char::from(b'a' + ((batch + index + i) % 26) as u8))
        .collect();
    Bytes::from(format!("b{batch}i{index}-{text}"))
}

/// Publishes `batches` acked batches of `per_batch` records and returns what the acks say
/// each shard holds.
async fn publish_acked(
    client: &felix_client::Client,
    stream: &str,
    shard_count: u32,
    batches: usize,
    per_batch: usize,
    first_batch: usize,
) -> ShardRecords {
    let mut stored = ShardRecords::new();
    for batch in first_batch..first_batch + batches {
        let records: Vec<Record> = (0..per_batch)
            .map(|index| {
                record(
                    Bytes::from(format!("k{batch}-{index}")),
                    payload(batch, index),
                )
            })
            .collect();
        let acks = within(client.publish(stream, &records))
            .await
            .expect("durable publish acked");
        for ack in acks {
            let mut offset = ack.first_offset;
            for r in records
                .iter()
                .filter(|r| felix_wire::shard_for_key(&r.key, shard_count) == ack.shard)
            {
                stored.entry(ack.shard).or_default().push((
                    offset,
                    r.key.clone(),
                    r.payload.clone(),
                ));
                offset += 1;
            }
            assert_eq!(offset, ack.first_offset + u64::from(ack.count));
        }
    }
    stored
}

/// Receives exactly `count` records.
async fn receive(subscription: &mut Subscription, count: usize) -> ShardRecords {
    let mut got = ShardRecords::new();
    for received in 0..count {
        match within(subscription.next()).await {
            Some(Ok(r)) => got
                .entry(r.shard)
                .or_default()
                .push((r.offset, r.key, r.payload)),
            Some(Err(error)) => panic!("subscription failed after {received} records: {error}"),
            None => panic!("subscription ended after {received} records"),
        }
    }
    got
}

fn total(records: &ShardRecords) -> usize {
    records.values().map(Vec::len).sum()
}

/// Asserts offsets are dense from 0 on every shard.
fn assert_dense(records: &ShardRecords) {
    for (shard, list) in records {
        for (index, (offset, _, _)) in list.iter().enumerate() {
            assert_eq!(*offset, index as u64, "shard {shard}: offsets dense from 0");
        }
    }
}

/// The clean-restart scenario for one writer.
fn acked_records_survive_a_clean_restart(io_uring: &'static str) {
    let mut broker = BrokerProcess::start(&durable_env(io_uring));
    let shard_count = 4;
    let output = broker
        .cli()
        .args(["stream", "create", "ledger", "--shards", "4", "--durable"])
        .output()
        .expect("felix stream create runs");
    assert!(
        output.status.success(),
        "create failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "created stream ledger: 4 shards, durable"
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let stored = runtime.block_on(async {
        // Plain publishes: the append-bytes identity below counts records only (an idempotent
        // producer's batches add a 57-byte journal record each, docs/storage-format.md).
        let mut config = broker.client_config();
        config.idempotent = false;
        let client = within(felix_client::Client::connect(config))
            .await
            .expect("client connects");
        let stored = publish_acked(&client, "ledger", shard_count, 30, 8, 0).await;
        client.close().await;
        stored
    });
    assert_eq!(total(&stored), 240);
    assert_dense(&stored);

    // Metrics: append bytes = (28 framing + 2 key length) per record + keys + payloads.
    let body = broker.metrics();
    let records = total(&stored) as u64;
    let key_bytes: u64 = stored
        .values()
        .flatten()
        .map(|(_, k, _)| k.len() as u64)
        .sum();
    let payload_bytes: u64 = stored
        .values()
        .flatten()
        .map(|(_, _, p)| p.len() as u64)
        .sum();
    let append = metric_value(&body, "felix_append_bytes_total").expect("append bytes metric");
    assert_eq!(
        metric_value(&body, "felix_payload_bytes_total"),
        Some(payload_bytes)
    );
    assert_eq!(append - payload_bytes - key_bytes, 28 * records);
    let fsyncs = metric_value(&body, "felix_fsyncs_total").expect("fsyncs metric");
    let fsync_records = metric_value(&body, "felix_fsync_records_total").expect("fan-in metric");
    assert!(fsyncs > 0);
    assert_eq!(
        fsync_records, records,
        "on_commit: every acked record was fsynced"
    );
    assert_eq!(
        metric_value(&body, "felix_durable_records_pending"),
        Some(0)
    );
    assert!(
        body.contains("felix_fsync_seconds_bucket"),
        "latency histogram exported"
    );
    // The writer's counters: the durable stream started a segment on each core that got a
    // shard; direct rounds are counted (how many depends on the file system's O_DIRECT).
    assert!(metric_value(&body, "felix_log_segments_created_total").is_some_and(|n| n >= 1));
    assert!(metric_value(&body, "felix_log_segments_made_ahead_total").is_some());
    assert!(metric_value(&body, "felix_log_direct_rounds_total").is_some());

    let status = broker.terminate();
    assert!(status.success(), "clean exit: {status}");
    broker.restart();
    assert!(
        broker.stderr_text().contains("durable log recovered"),
        "recovery is logged"
    );

    runtime.block_on(async {
        let client = broker.client().await;
        let info = within(client.describe_stream("ledger"))
            .await
            .expect("the acked create survived the restart");
        assert_eq!(info.kind, StreamKind::Durable);
        let mut subscription =
            within(client.subscribe("ledger", ShardSelection::All, StartPosition::Earliest))
                .await
                .expect("subscribed from earliest");
        let got = receive(&mut subscription, total(&stored)).await;
        assert_eq!(
            got, stored,
            "every acked record, byte-identical, dense offsets"
        );
        subscription.close().await;
        client.close().await;
    });

    // The CLI replays from disk too.
    let output = broker
        .cli()
        .args([
            "sub", "ledger", "--from", "earliest", "--count", "240", "--meta",
        ])
        .output()
        .expect("felix sub runs");
    assert!(output.status.success());
    let lines: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(lines.len(), 240);
    for (shard, list) in &stored {
        let first = &list[0];
        let want = format!(
            "{shard}:{} {} {}",
            first.0,
            String::from_utf8_lossy(&first.1),
            String::from_utf8_lossy(&first.2)
        );
        assert!(lines.contains(&want), "missing {want}");
    }
}

// Proves acked on_commit records survive a SIGTERM restart, byte-identical with dense offsets,
// and the append-bytes metric relation, with the io_uring writer.
#[test]
fn acked_records_survive_a_clean_restart_io_uring() {
    acked_records_survive_a_clean_restart("1");
}

// Proves the same with the pwrite + fdatasync writer.
#[test]
fn acked_records_survive_a_clean_restart_pwrite() {
    acked_records_survive_a_clean_restart("0");
}

/// A subscriber resuming below the replay ring catches up from the log, then goes live.
fn resume_from_disk_then_live(io_uring: &'static str) {
    let mut env = durable_env(io_uring);
    env.push(("FELIX_REPLAY_RING_MAX_RECORDS", "16"));
    let broker = BrokerProcess::start(&env);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = broker.client().await;
        within(client.create_stream("tape", 1, StreamKind::Durable))
            .await
            .expect("created");
        let mut stored = publish_acked(&client, "tape", 1, 30, 10, 0).await;
        let mut subscription = within(client.subscribe(
            "tape",
            ShardSelection::All,
            StartPosition::Offsets(vec![(0, 7)]),
        ))
        .await
        .expect("a position on disk, older than the ring, is accepted");
        assert_eq!(subscription.start(), &[(0, 7)]);
        // Publish more while the subscriber catches up.
        let more = publish_acked(&client, "tape", 1, 10, 10, 30).await;
        stored
            .entry(0)
            .or_default()
            .extend(more[&0].iter().cloned());
        let got = receive(&mut subscription, 400 - 7).await;
        let want: Vec<_> = stored[&0].iter().skip(7).cloned().collect();
        assert_eq!(got[&0], want, "no gap, no duplicate, byte-identical");
        subscription.close().await;
        client.close().await;
    });
    // The catch-up's chunks were found in memory or fetched by the log's reader thread.
    let body = broker.metrics();
    let chunks = metric_value(&body, "felix_read_cache_hits_total").unwrap_or(0)
        + metric_value(&body, "felix_read_fetches_total").unwrap_or(0);
    assert!(chunks > 0, "catch-up chunks counted");
}

// Proves catch-up from the log below the ring, then live delivery, with io_uring.
#[test]
fn resume_below_the_ring_reads_the_log_io_uring() {
    resume_from_disk_then_live("1");
}

// Proves catch-up from the log below the ring, then live delivery, with pwrite.
#[test]
fn resume_below_the_ring_reads_the_log_pwrite() {
    resume_from_disk_then_live("0");
}

// Proves a deleted durable stream stays deleted after a restart and its name can be reused
// with fresh offsets (stream ids are never reused).
#[test]
fn deleted_durable_stream_stays_deleted() {
    let mut broker = BrokerProcess::start(&durable_env("1"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = broker.client().await;
        within(client.create_stream("gone", 2, StreamKind::Durable))
            .await
            .expect("created");
        publish_acked(&client, "gone", 2, 3, 4, 0).await;
        within(client.delete_stream("gone")).await.expect("deleted");
        client.close().await;
    });
    broker.terminate();
    broker.restart();
    runtime.block_on(async {
        let client = broker.client().await;
        let streams = within(client.list_streams()).await.expect("listed");
        assert!(streams.iter().all(|s| s.name != "gone"), "{streams:?}");
        within(client.create_stream("gone", 2, StreamKind::Durable))
            .await
            .expect("name reusable");
        let stored = publish_acked(&client, "gone", 2, 2, 4, 100).await;
        assert_dense(&stored);
        client.close().await;
    });
    let catalog = std::fs::read_to_string(broker.data_dir.path().join("catalog.json"))
        .expect("catalogue written");
    assert!(catalog.contains("\"next_stream_id\": 2"), "{catalog}");
}

/// The `.log` segment files under `<data_dir>/log/core-<core>/` (none when the folder is
/// missing).
fn segments_of(data_dir: &std::path::Path, core: usize) -> usize {
    std::fs::read_dir(data_dir.join("log").join(format!("core-{core}")))
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".log"))
                .count()
        })
        .unwrap_or(0)
}

// An idle broker takes no disk for its logs: a core's first segment is made when a durable
// shard lands on it, and only on the cores that own one.
#[test]
fn logs_take_disk_only_on_the_cores_of_durable_shards() {
    let broker = BrokerProcess::start(&[]);
    let cores = broker.core_addrs.len();
    let data_dir = broker.data_dir.path().to_owned();
    for core in 0..cores {
        assert_eq!(
            segments_of(&data_dir, core),
            0,
            "core {core} before any stream"
        );
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let owners: Vec<usize> = runtime.block_on(async {
        let client = broker.client().await;
        // In-memory streams take no disk either.
        within(client.create_stream("scratch", 4, StreamKind::InMemory))
            .await
            .expect("in-memory create");
        let info = within(client.create_stream("ledger", 1, StreamKind::Durable))
            .await
            .expect("durable create");
        client.close().await;
        info.shards.iter().map(|s| usize::from(s.core)).collect()
    });
    assert_eq!(owners.len(), 1);
    let owner = owners[0];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while segments_of(&data_dir, owner) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "core {owner} owns the durable shard but made no segment: {}",
            broker.stderr_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(segments_of(&data_dir, owner), 1);
    for core in (0..cores).filter(|&c| c != owner) {
        assert_eq!(
            segments_of(&data_dir, core),
            0,
            "core {core} owns no durable shard"
        );
    }
    let stderr = broker.stderr_text();
    assert!(stderr.contains("durable log segments"), "{stderr}");
    assert!(stderr.contains("first segment created"), "{stderr}");
}

// A data directory the broker cannot use stops it with one message that names the path and
// says its cause once (it used to repeat "Not a directory (os error 20)" three times).
#[test]
fn an_unusable_data_directory_says_its_cause_once() {
    let data = tempfile::tempdir().expect("tempdir");
    std::fs::write(data.path().join("log"), b"not a directory").expect("write");
    let output = support::felix()
        .args(["broker", "--bind", "127.0.0.1:0", "--metrics-bind", "off"])
        .env("FELIX_DATA_DIR", data.path())
        .output()
        .expect("felix runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("felix: cannot start the broker"))
        .unwrap_or_else(|| panic!("no start-up error line: {stderr}"));
    let cause = std::io::Error::from_raw_os_error(20).to_string();
    // Whichever core reports first: "... create DIR/log/core-<i>: Not a directory (os error 20)".
    let prefix = format!(
        "felix: cannot start the broker: durable log: create {}/log/core-",
        data.path().display()
    );
    let rest = line
        .strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("{line}"));
    let (core, tail) = rest.split_once(": ").unwrap_or_else(|| panic!("{line}"));
    assert!(core.parse::<u16>().is_ok(), "{line}");
    assert_eq!(tail, cause, "{line}");
    assert_eq!(line.matches(&cause).count(), 1, "{line}");
}

/// How one publisher of the shutdown test ended.
struct PublisherOutcome {
    /// `(shard, offset) -> (key, payload)` of every record whose publish was acked.
    acked: BTreeMap<(u32, u64), (Bytes, Bytes)>,
    /// The error that ended it (every publisher ends with one: the broker went away).
    error: String,
}

/// Publishes acked batches of 4 on its own connection until a publish fails; every publish is
/// answered within the deadline or the test fails (a publish left unanswered by shutdown).
async fn publish_until_refused(
    client: felix_client::Client,
    publisher: usize,
    acked_total: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> PublisherOutcome {
    let mut acked = BTreeMap::new();
    for batch in 0.. {
        let records: Vec<Record> = (0..4)
            .map(|index| {
                record(
                    Bytes::from(format!("p{publisher}-{batch}-{index}")),
                    payload(batch, index),
                )
            })
            .collect();
        match within(client.publish("orders", &records)).await {
            Ok(acks) => {
                for ack in acks {
                    let of_shard = records
                        .iter()
                        .filter(|r| felix_wire::shard_for_key(&r.key, 2) == ack.shard);
                    for (offset, r) in (ack.first_offset..).zip(of_shard) {
                        acked.insert((ack.shard, offset), (r.key.clone(), r.payload.clone()));
                    }
                }
                acked_total.fetch_add(4, std::sync::atomic::Ordering::Relaxed);
            }
            Err(error) => {
                return PublisherOutcome {
                    acked,
                    error: error.to_string(),
                };
            }
        }
    }
    unreachable!("the loop ends by returning")
}

// SIGTERM under acked durable load: the broker exits 0, every publisher's publish in flight is
// answered (an ack, or an error naming the shutdown), and after a restart every acked record
// is there at the offset its ack gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_acked_durable_load_loses_no_acked_record() {
    stop_under_acked_durable_load("TERM").await;
}

// SIGINT (Ctrl-C of `make run`) is the same shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_under_acked_durable_load_loses_no_acked_record() {
    stop_under_acked_durable_load("INT").await;
}

async fn stop_under_acked_durable_load(signal: &str) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let mut broker = BrokerProcess::start(&durable_env("1"));
    let admin = broker.client().await;
    within(admin.create_stream("orders", 2, StreamKind::Durable))
        .await
        .expect("durable stream created");
    let acked_total = Arc::new(AtomicU64::new(0));
    let mut publishers = Vec::new();
    for publisher in 0..4 {
        let client = broker.client().await;
        publishers.push(tokio::spawn(publish_until_refused(
            client,
            publisher,
            Arc::clone(&acked_total),
        )));
    }
    // Shut down in the middle of the load: once some records are acked.
    within(async {
        while acked_total.load(Ordering::Relaxed) < 200 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;
    let status = tokio::task::block_in_place(|| broker.stop_with(signal));
    assert!(
        status.success(),
        "SIG{signal}: exit status {status:?}; stderr:\n{}",
        broker.stderr_text()
    );
    let mut acked = BTreeMap::new();
    for publisher in publishers {
        let outcome = within(publisher).await.expect("publisher task");
        let error = outcome.error.to_lowercase();
        assert!(
            error.contains("shutting down") || error.contains("closed"),
            "a publish in flight at shutdown ends with the shutdown: {}",
            outcome.error
        );
        acked.extend(outcome.acked);
    }
    assert!(acked.len() >= 200);

    broker.restart();
    let client = broker.client().await;
    let mut subscription =
        within(client.subscribe("orders", ShardSelection::All, StartPosition::Earliest))
            .await
            .expect("subscribed from earliest");
    let mut found = 0usize;
    within(async {
        while found < acked.len() {
            let record = subscription
                .next()
                .await
                .expect("the subscription stays open")
                .expect("a record");
            if let Some((key, payload)) = acked.get(&(record.shard, record.offset)) {
                assert_eq!(
                    (&record.key, &record.payload),
                    (key, payload),
                    "shard {} offset {}",
                    record.shard,
                    record.offset
                );
                found += 1;
            }
        }
    })
    .await;
    subscription.close().await;
    client.close().await;
}
