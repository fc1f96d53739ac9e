//! Idempotent producers against a real broker process (docs/semantics.md, "Idempotent
//! producers"): a second `Client` with the same producer id re-sending the same batches gets
//! the original offsets and stores nothing, also after the broker was SIGKILLed and
//! restarted; reading the shards back shows every record once.

mod support;

use std::collections::BTreeMap;

use bytes::Bytes;
use felix_client::{
    Client, ClientConfig, ShardAck, ShardSelection, StartPosition, StreamKind, record,
};
use futures::StreamExt as _;
use support::{BrokerProcess, within};

const STREAM: &str = "produced";
const SHARDS: u32 = 4;
const BATCHES: usize = 3;
const PRODUCER: u64 = 0x5eed_f00d_0000_0001;

/// Batch `index`: records spread over every shard (so each batch is one part per shard).
fn batch(index: usize) -> Vec<felix_client::Record> {
    (0..8)
        .map(|i| record(format!("key-{i}"), format!("batch {index} record {i}")))
        .collect()
}

fn producer_config(broker: &BrokerProcess) -> ClientConfig {
    let mut config = broker.client_config();
    config.producer_id = Some(PRODUCER);
    config
}

/// Publishes every batch through a new client with the producer id; returns their acks.
async fn publish_all(broker: &BrokerProcess) -> Vec<Vec<ShardAck>> {
    let client = within(Client::connect(producer_config(broker)))
        .await
        .expect("client connects");
    assert_eq!(
        client.producer_id(),
        Some(PRODUCER),
        "the broker echoed PRODUCER"
    );
    let mut acks = Vec::new();
    for index in 0..BATCHES {
        acks.push(
            within(client.publish(STREAM, &batch(index)))
                .await
                .expect("acked"),
        );
    }
    client.close().await;
    acks
}

/// Every record of the stream from the earliest offset: shard -> payloads in offset order.
async fn read_back(broker: &BrokerProcess) -> BTreeMap<u32, Vec<Bytes>> {
    let client = broker.client().await;
    let info = within(client.describe_stream(STREAM))
        .await
        .expect("described");
    let total: u64 = info.shards.iter().map(|shard| shard.next_offset).sum();
    let mut subscription =
        within(client.subscribe(STREAM, ShardSelection::All, StartPosition::Earliest))
            .await
            .expect("subscribed");
    let mut content: BTreeMap<u32, Vec<Bytes>> = BTreeMap::new();
    for _ in 0..total {
        let delivered = within(subscription.next())
            .await
            .expect("a record")
            .expect("delivered");
        let list = content.entry(delivered.shard).or_default();
        assert_eq!(delivered.offset, list.len() as u64, "dense offsets");
        list.push(delivered.payload);
    }
    content
}

/// Checks each record of every batch is in the stream exactly once.
fn assert_each_once(content: &BTreeMap<u32, Vec<Bytes>>) {
    let stored: usize = content.values().map(Vec::len).sum();
    assert_eq!(stored, BATCHES * 8, "{content:?}");
    for index in 0..BATCHES {
        for record in batch(index) {
            let copies = content
                .values()
                .flatten()
                .filter(|payload| **payload == record.payload)
                .count();
            assert_eq!(copies, 1, "{:?}", record.payload);
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

// Proves a producer's batches sent again by a new client with the same producer id (what an
// application does after losing its connection) are answered with the original offsets and
// stored once, on an in-memory and a durable stream of a 2-core broker, and counted in
// /metrics (`felix_core_producer_duplicates_total`).
#[test]
fn resending_a_producers_batches_stores_them_once() {
    for kind in [StreamKind::InMemory, StreamKind::Durable] {
        let broker = BrokerProcess::start(&[
            ("FELIX_DATAPLANE_CORES", "2"),
            ("FELIX_DURABLE_FSYNC_MODE", "on_commit"),
        ]);
        runtime().block_on(async {
            let client = broker.client().await;
            within(client.create_stream(STREAM, SHARDS, kind))
                .await
                .expect("created");
            client.close().await;
            let first = publish_all(&broker).await;
            let again = publish_all(&broker).await;
            assert_eq!(again, first, "{kind:?}: the original offsets");
            assert_each_once(&read_back(&broker).await);
            // Every re-sent batch counted as a duplicate in /metrics (one or more per batch:
            // one per shard it touched).
            support::eventually("duplicates in the metrics", || {
                support::sum_over_cores(&broker.metrics(), "felix_core_producer_duplicates_total")
                    >= BATCHES as f64
            })
            .await;
        });
    }
}

// Proves the same across a SIGKILL and restart of the broker, on a durable stream of a 2-core
// broker: the producer tables are rebuilt from the producer journals in the durable log
// (docs/storage-format.md, "Producer journals"), so the re-sent batches get their original
// offsets and reading the shards back shows each record once.
#[test]
fn resending_after_sigkill_and_restart_stores_them_once() {
    let mut broker = BrokerProcess::start(&[
        ("FELIX_DATAPLANE_CORES", "2"),
        ("FELIX_DURABLE_FSYNC_MODE", "on_commit"),
    ]);
    let runtime = runtime();
    let first = runtime.block_on(async {
        let client = broker.client().await;
        within(client.create_stream(STREAM, SHARDS, StreamKind::Durable))
            .await
            .expect("created");
        client.close().await;
        publish_all(&broker).await
    });
    broker.kill();
    broker.restart();
    runtime.block_on(async {
        let again = publish_all(&broker).await;
        assert_eq!(again, first, "the original offsets after the restart");
        assert_each_once(&read_back(&broker).await);
    });
}

// Proves the client's retries: with an ingress queue of one job on a 2-core broker and a
// naive client (every publish enters the core its connection landed on; a shard of the other
// core holds the job until that core answers), pipelined acked publishes to both shards are
// refused (ingress_budget_exhausted) and the ones behind them on a shard refused as
// out_of_sequence; the client sends each again with the same sequence until stored, so every
// publish is acked and each shard holds each of its records once, in order.
#[test]
fn refused_publishes_are_retried_and_stored_once_in_order() {
    const PUBLISHES: usize = 200;
    let broker = BrokerProcess::start(&[
        ("FELIX_DATAPLANE_CORES", "2"),
        ("FELIX_INGRESS_QUEUE_DEPTH", "1"),
    ]);
    runtime().block_on(async {
        let mut config = broker.naive_client_config();
        config.publish_retries = 10_000;
        config.publish_retry_backoff = std::time::Duration::from_millis(1);
        let client = within(Client::connect(config)).await.expect("connects");
        within(client.create_stream(STREAM, 2, StreamKind::InMemory))
            .await
            .expect("created");
        // A key of each shard (one per core).
        let key_of = |shard: u32| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|key| felix_wire::shard_for_key(key.as_bytes(), 2) == shard)
                .expect("a key of the shard")
        };
        let keys = [key_of(0), key_of(1)];
        let mut pending = Vec::new();
        for i in 0..PUBLISHES {
            let records = [record(keys[i % 2].clone(), format!("record {i}"))];
            pending.push(
                within(client.publish_pipelined(STREAM, &records))
                    .await
                    .expect("sent"),
            );
        }
        let mut offsets = Vec::new();
        for ack in pending {
            let acks = within(ack).await.expect("acked after retries");
            offsets.push((acks[0].shard, acks[0].first_offset));
        }
        let expected: Vec<(u32, u64)> = (0..PUBLISHES)
            .map(|i| ((i % 2) as u32, (i / 2) as u64))
            .collect();
        assert_eq!(offsets, expected, "each publish stored once, in order");
        client.close().await;
        let content = read_back(&broker).await;
        for shard in 0..2 {
            let payloads: Vec<Bytes> = (0..PUBLISHES)
                .filter(|i| i % 2 == shard)
                .map(|i| Bytes::from(format!("record {i}")))
                .collect();
            assert_eq!(content.get(&(shard as u32)), Some(&payloads));
        }
        support::eventually("refusals in the metrics", || {
            support::metric_value(&broker.metrics(), "felix_publishes_refused_total")
                .is_some_and(|refused| refused > 0)
        })
        .await;
    });
}

// Proves `felix pub` publishes as an idempotent producer: run twice with the same
// `--producer-id`, the second run is answered with the first run's offsets and stores
// nothing; with `--no-idempotence` the same records are stored again.
#[test]
fn felix_pub_with_a_producer_id_stores_a_rerun_once() {
    let broker = BrokerProcess::start(&[]);
    let created = broker
        .cli()
        .args(["stream", "create", "cli-produced", "--shards", "2"])
        .output()
        .expect("felix stream create runs");
    assert!(created.status.success(), "{created:?}");
    let publish = |extra: &[&str]| {
        let output = broker
            .cli()
            .args(["pub", "cli-produced", "--key", "k", "--batch", "2"])
            .args(extra)
            .args(["one", "two", "three"])
            .output()
            .expect("felix pub runs");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let first = publish(&["--producer-id", "0xfe11c5"]);
    let shard = felix_wire::shard_for_key(b"k", 2);
    assert_eq!(
        first,
        format!(
            "acked 2 records: shard {shard} offsets 0..1\nacked 1 record: shard {shard} offset 2\n"
        )
    );
    assert_eq!(
        publish(&["--producer-id", "fe11c5"]),
        first,
        "a rerun: the same offsets"
    );
    let plain = publish(&["--no-idempotence"]);
    assert_eq!(
        plain,
        format!(
            "acked 2 records: shard {shard} offsets 3..4\nacked 1 record: shard {shard} offset 5\n"
        )
    );
}
