//! Real crash test of durable streams: acked publishers under load, the broker SIGKILLed and
//! restarted over and over (FELIX_DURABLE_FSYNC_MODE=on_commit). After every restart the
//! stream is read from the earliest offset and checked against what the publishers got acks
//! for and what a live subscriber received before the kill.

mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_client::{Record, ShardSelection, StartPosition, StreamKind, record};
use futures::StreamExt as _;
use support::{BrokerProcess, DEADLINE, within};

/// Kill/restart cycles (the brief asks for at least 20).
const CYCLES: usize = 20;
/// Publisher tasks, each with one acked publish in flight at a time.
const PUBLISHERS: usize = 3;
/// Records per publish (small batches).
const BATCH: usize = 4;
const SHARDS: u32 = 4;
const STREAM: &str = "crash";
/// Bound on the whole test; generous for a loaded 2-core machine (no speed assert: the test
/// only fails if it hangs far past its normal ~60 s).
const TOTAL_DEADLINE: Duration = Duration::from_secs(600);

/// One record as stored: `(key, payload)`; offsets are the index in the shard's list.
type Content = BTreeMap<u32, Vec<(Bytes, Bytes)>>;

/// Payload of record `seq` of publisher `publisher`: self-describing, so integrity can be
/// checked from the bytes alone.
fn payload(publisher: usize, seq: u64) -> Bytes {
    let body: String = (0..(seq % 97) as usize + 16)
        .map(|i| char::from(b'A' + ((seq as usize + i + publisher) % 26) as u8))
        .collect();
    Bytes::from(format!("p{publisher}:s{seq}:{body}"))
}

fn parse(payload: &[u8]) -> (usize, u64) {
    let text = std::str::from_utf8(payload).expect("payload is text");
    let mut parts = text.splitn(3, ':');
    let publisher = parts.next().and_then(|p| p.strip_prefix('p')).expect("p");
    let seq = parts.next().and_then(|s| s.strip_prefix('s')).expect("s");
    (
        publisher.parse().expect("publisher number"),
        seq.parse().expect("sequence number"),
    )
}

/// Reads the whole stream from the earliest offset (up to each shard's next offset).
async fn read_all(broker: &BrokerProcess) -> Content {
    let client = broker.client().await;
    let info = within(client.describe_stream(STREAM))
        .await
        .expect("the acked create survived");
    let want: usize = info
        .shards
        .iter()
        .map(|s| usize::try_from(s.next_offset - s.oldest_offset).expect("fits"))
        .sum();
    let mut content = Content::new();
    for shard in &info.shards {
        content.insert(shard.shard, Vec::new());
    }
    if want > 0 {
        let mut subscription =
            within(client.subscribe(STREAM, ShardSelection::All, StartPosition::Earliest))
                .await
                .expect("subscribed");
        for got in 0..want {
            let r = match within(subscription.next()).await {
                Some(Ok(r)) => r,
                other => panic!("read failed after {got} of {want} records: {other:?}"),
            };
            let list = content.entry(r.shard).or_default();
            assert_eq!(
                r.offset,
                list.len() as u64,
                "dense offsets on shard {}",
                r.shard
            );
            list.push((r.key, r.payload));
        }
        subscription.close().await;
    }
    client.close().await;
    content
}

/// Checks the stream after a restart; returns the records it holds.
fn check(
    cycle: usize,
    content: &Content,
    previous: &Content,
    acked: &HashSet<(usize, u64)>,
    observed: &[(u32, u64, Bytes)],
) {
    let mut present = HashSet::new();
    for (shard, list) in content {
        // Whatever was there after the previous restart is still there, unchanged.
        let before = previous.get(shard).map_or(&[][..], Vec::as_slice);
        assert!(
            list.len() >= before.len() && list[..before.len()] == *before,
            "cycle {cycle}: shard {shard} lost or changed records it held before"
        );
        let mut last_seq: BTreeMap<usize, u64> = BTreeMap::new();
        for (offset, (key, body)) in list.iter().enumerate() {
            let (publisher, seq) = parse(body);
            assert_eq!(
                *body,
                payload(publisher, seq),
                "cycle {cycle}: intact bytes"
            );
            assert_eq!(*key, Bytes::from(format!("p{publisher}-{seq}")));
            assert_eq!(
                felix_wire::shard_for_key(key, SHARDS),
                *shard,
                "record on its shard"
            );
            assert!(
                present.insert((publisher, seq)),
                "cycle {cycle}: p{publisher} s{seq} stored twice (shard {shard} offset {offset})"
            );
            if let Some(last) = last_seq.insert(publisher, seq) {
                assert!(
                    last < seq,
                    "cycle {cycle}: p{publisher} out of order on shard {shard}"
                );
            }
        }
    }
    for record in acked {
        assert!(
            present.contains(record),
            "cycle {cycle}: acked record p{} s{} is missing",
            record.0,
            record.1
        );
    }
    for (shard, offset, body) in observed {
        let stored = content
            .get(shard)
            .and_then(|list| list.get(usize::try_from(*offset).expect("fits")));
        assert_eq!(
            stored.map(|(_, p)| p),
            Some(body),
            "cycle {cycle}: a delivered record (shard {shard} offset {offset}) vanished"
        );
    }
}

// Proves that across 20 SIGKILL/restart cycles under acked on_commit load every acked record
// survives exactly once, in order and intact, and no subscriber ever saw a record that later
// vanished.
#[test]
fn acked_records_survive_repeated_sigkill() {
    let started = Instant::now();
    let mut broker = BrokerProcess::start(&[
        ("FELIX_DURABLE_FSYNC_MODE", "on_commit"),
        ("FELIX_DURABLE_SEGMENT_BYTES", "1MiB"),
    ]);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = broker.client().await;
        within(client.create_stream(STREAM, SHARDS, StreamKind::Durable))
            .await
            .expect("created");
        client.close().await;
    });
    let acked: Arc<Mutex<HashSet<(usize, u64)>>> = Arc::default();
    let mut next_seq = [0u64; PUBLISHERS];
    let mut previous = Content::new();
    let mut observed_total = 0;
    for cycle in 0..CYCLES {
        assert!(started.elapsed() < TOTAL_DEADLINE, "crash test overran");
        // Load: publishers with acks, and a live subscriber recording what it received.
        let observed: Arc<Mutex<Vec<(u32, u64, Bytes)>>> = Arc::default();
        let load_for = Duration::from_millis(300 + (cycle as u64 * 137) % 700);
        runtime.block_on(async {
            let subscriber_client = broker.client().await;
            let mut subscription = within(subscriber_client.subscribe(
                STREAM,
                ShardSelection::All,
                StartPosition::Latest,
            ))
            .await
            .expect("live subscriber");
            let sink = Arc::clone(&observed);
            let subscriber = tokio::spawn(async move {
                let _client = subscriber_client;
                while let Some(Ok(r)) = subscription.next().await {
                    sink.lock()
                        .expect("lock")
                        .push((r.shard, r.offset, r.payload));
                }
            });
            let mut tasks = Vec::new();
            for (publisher, seq) in next_seq.iter_mut().enumerate() {
                let client = broker.client().await;
                let acked = Arc::clone(&acked);
                let first = *seq;
                // Room for any number of publishes this cycle; unused numbers are skipped.
                *seq += 1_000_000;
                tasks.push(tokio::spawn(async move {
                    let mut seq = first;
                    loop {
                        let records: Vec<Record> = (0..BATCH as u64)
                            .map(|i| {
                                record(
                                    Bytes::from(format!("p{publisher}-{}", seq + i)),
                                    payload(publisher, seq + i),
                                )
                            })
                            .collect();
                        // Errors (the broker died) end the publisher; unacked records may or
                        // may not be stored.
                        match tokio::time::timeout(DEADLINE, client.publish(STREAM, &records)).await
                        {
                            Ok(Ok(_)) => {
                                let mut acked = acked.lock().expect("lock");
                                for i in 0..BATCH as u64 {
                                    acked.insert((publisher, seq + i));
                                }
                            }
                            _ => break,
                        }
                        seq += BATCH as u64;
                    }
                }));
            }
            tokio::time::sleep(load_for).await;
            broker.kill();
            // A killed broker sends no CONNECTION_CLOSE: stop the tasks instead of waiting
            // for QUIC's idle timeout. A publish cut off here was never acked.
            for task in tasks.iter().chain(std::iter::once(&subscriber)) {
                task.abort();
            }
            for task in tasks {
                let _ = task.await;
            }
            let _ = subscriber.await;
        });
        broker.restart();
        let content = runtime.block_on(read_all(&broker));
        let observed = observed.lock().expect("lock").clone();
        observed_total += observed.len();
        check(
            cycle,
            &content,
            &previous,
            &acked.lock().expect("lock"),
            &observed,
        );
        previous = content;
    }
    let acked = acked.lock().expect("lock").len();
    assert!(acked > 0, "publishers got acks");
    assert!(observed_total > 0, "the live subscriber received records");
    eprintln!(
        "crash test: {CYCLES} cycles, {acked} acked records, {observed_total} observed live, {:?}",
        started.elapsed()
    );
}
