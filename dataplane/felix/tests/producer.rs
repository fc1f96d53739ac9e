//! Idempotent producers against a real broker process (docs/semantics.md, "Idempotent
//! producers"): a second `Client` with the same producer id re-sending the same batches gets
//! the original offsets and stores nothing; reading the shard back shows every record once.

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
// stored once, on an in-memory and a durable stream of a 2-core broker.
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
        });
    }
}

// The same across a SIGKILL and restart of the broker, on a durable stream. Not built yet:
// the per-shard producer tables are not recovered from the durable log (docs/semantics.md,
// "Idempotent producers"), so after the restart the re-sent batch 1 of each shard is stored
// again and the later ones are refused with out_of_sequence.
#[test]
#[ignore = "producer state is not yet recovered from the durable log at restart"]
fn resending_after_sigkill_and_restart_stores_them_once() {
    let mut broker = BrokerProcess::start(&[("FELIX_DURABLE_FSYNC_MODE", "on_commit")]);
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
