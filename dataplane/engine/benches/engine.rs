//! Engine hot path: publish of 64 x 256 B and 1 x 256 B batches into a 48-shard in-memory
//! stream with the replay ring active (default bounds), without and with one subscriber
//! draining every record, and by handle with the shards routed outside the measured call
//! (`publish_routed`, as a shell that routes records to cores calls it); and the key -> shard
//! routing hash over 16-byte keys.
//!
//! `cargo bench -p felix-engine --bench engine -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use felix_engine::{Engine, EngineConfig};
use felix_wire::{Record, ShardSelection, StartPosition, StreamKind, shard_for_key};

const STREAM: &str = "bench";
/// The reference's shard count.
const SHARDS: u32 = 48;
/// The reference's smallest payload.
const PAYLOAD_BYTES: usize = 256;
/// Distinct keys cycled through, so every shard and its ring stay busy.
const KEYS: usize = 4096;
/// Largest poll of the draining subscriber (what the shell would put in one Delivery frame).
const POLL_RECORDS_MAX: usize = 256;
const POLL_BYTES_MAX: usize = 1 << 20;

fn keys() -> Vec<Bytes> {
    (0..KEYS)
        .map(|i| Bytes::from(format!("key-{i:012}").into_bytes()))
        .collect()
}

/// Batches of `size` records, cycling over the keys; payloads share one buffer as decoded
/// frames share their receive buffer.
fn batch_maker(size: usize) -> impl FnMut() -> Vec<Record> {
    let keys = keys();
    let payload = Bytes::from(vec![0xab; PAYLOAD_BYTES]);
    let mut next = 0usize;
    move || {
        (0..size)
            .map(|_| {
                next = (next + 1) % KEYS;
                Record {
                    key: keys[next].clone(),
                    payload: payload.clone(),
                }
            })
            .collect()
    }
}

fn bench_engine() -> Engine {
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream(STREAM, SHARDS, StreamKind::InMemory)
        .expect("bench stream");
    engine
}

fn publish(c: &mut Criterion) {
    let mut group = c.benchmark_group("publish");
    for batch in [64usize, 1] {
        group.throughput(Throughput::Elements(batch as u64));
        let name = format!("{batch}x{PAYLOAD_BYTES}B/no_subscriber");
        let mut engine = bench_engine();
        let mut make = batch_maker(batch);
        group.bench_function(&name, |b| {
            b.iter_batched(
                &mut make,
                |records| engine.publish(1, STREAM, records).expect("publish"),
                BatchSize::SmallInput,
            );
        });

        let name = format!("{batch}x{PAYLOAD_BYTES}B/no_subscriber/routed");
        let mut engine = bench_engine();
        let meta = engine.lookup(STREAM).expect("bench stream");
        let mut make = batch_maker(batch);
        group.bench_function(&name, |b| {
            b.iter_batched(
                || {
                    let records = make();
                    let shards: Vec<u32> = records
                        .iter()
                        .map(|record| shard_for_key(&record.key, meta.shard_count))
                        .collect();
                    (records, shards)
                },
                |(records, shards)| {
                    engine
                        .publish_routed(1, meta.handle, records, &shards, None)
                        .expect("publish")
                },
                BatchSize::SmallInput,
            );
        });

        let name = format!("{batch}x{PAYLOAD_BYTES}B/one_subscriber_draining");
        let mut engine = bench_engine();
        let id = engine
            .subscribe(STREAM, &ShardSelection::All, &StartPosition::Latest)
            .expect("subscribe")
            .id;
        let mut make = batch_maker(batch);
        group.bench_function(&name, |b| {
            b.iter_batched(
                &mut make,
                |records| {
                    let acks = engine.publish(1, STREAM, records).expect("publish");
                    while let Some(event) = engine.poll_event() {
                        black_box(event);
                    }
                    loop {
                        let delivered = engine.poll_delivery(id, POLL_RECORDS_MAX, POLL_BYTES_MAX);
                        if delivered.is_empty() {
                            break;
                        }
                        black_box(delivered);
                    }
                    acks
                },
                BatchSize::SmallInput,
            );
        });
    }
    group.finish();
}

fn routing(c: &mut Criterion) {
    let keys: Vec<[u8; 16]> = (0..KEYS as u64)
        .map(|i| {
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&i.to_le_bytes());
            key[8..].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
            key
        })
        .collect();
    let mut group = c.benchmark_group("routing");
    group.throughput(Throughput::Elements(1));
    let mut next = 0usize;
    group.bench_function("shard_for_key/16B/48_shards", |b| {
        b.iter(|| {
            next = (next + 1) % KEYS;
            shard_for_key(black_box(&keys[next]), black_box(SHARDS))
        });
    });
    group.finish();
}

criterion_group!(benches, publish, routing);
criterion_main!(benches);
