//! Criterion microbenchmarks of the codec: encode and decode of Publish batches (64 x 4 KiB,
//! 64 x 256 B, 1 x 256 B) and of a Delivery of 64 x 256 B, reported as bytes of frame per
//! second. Decode measures `Decoder::decode` of frames back to back in a filled `BytesMut` (the
//! copy that fills it is set-up, not measured).

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use felix_wire::{
    AckMode, Decoder, DeliveredRecord, Delivery, Frame, Limits, Publish, Record, encode,
    encode_publish_header, encode_record, encoded_len, encoded_record_len,
};

/// Bytes of back-to-back frames prepared per measured decode run: about an L2 cache, so the
/// frames are warm, as just-received (just-decrypted) bytes are in the broker.
const DECODE_FILL_BYTES: usize = 1024 * 1024;

/// 16-byte keys, like the bench tool's.
const KEY_BYTES: usize = 16;

fn key(i: usize) -> Bytes {
    Bytes::from(format!("key-{i:012}").into_bytes())
}

fn publish(records: usize, payload_bytes: usize) -> Frame {
    let payload = Bytes::from(vec![0xa5; payload_bytes]);
    Frame::Publish(Publish {
        request_id: 42,
        ack: AckMode::Acked,
        stream: "bench".into(),
        records: (0..records)
            .map(|i| Record {
                key: key(i),
                payload: payload.clone(),
            })
            .collect(),
    })
}

fn delivery(records: usize, payload_bytes: usize) -> Frame {
    let payload = Bytes::from(vec![0x5a; payload_bytes]);
    Frame::Delivery(Delivery {
        records: (0..records)
            .map(|i| DeliveredRecord {
                shard: (i % 48) as u32,
                offset: i as u64,
                timestamp_us: 1_700_000_000_000_000 + i as u64,
                key: key(i),
                payload: payload.clone(),
            })
            .collect(),
    })
}

fn bench_codec(c: &mut Criterion) {
    assert_eq!(key(0).len(), KEY_BYTES);
    let cases = [
        ("publish_64x4KiB", publish(64, 4096)),
        ("publish_64x256B", publish(64, 256)),
        ("publish_1x256B", publish(1, 256)),
        ("delivery_64x256B", delivery(64, 256)),
    ];
    let decoder = Decoder::new(Limits::DEFAULT);

    let mut group = c.benchmark_group("encode");
    for (name, frame) in &cases {
        group.throughput(Throughput::Bytes(encoded_len(frame) as u64));
        let mut buf = BytesMut::with_capacity(encoded_len(frame));
        group.bench_function(*name, |b| {
            b.iter(|| {
                buf.clear();
                encode(black_box(frame), &mut buf);
                black_box(buf.len())
            })
        });
    }
    // The publisher's fast path: header then records straight from the caller's slices.
    for (name, frame) in &cases[..3] {
        let Frame::Publish(publish) = frame else {
            unreachable!("the first three cases are publishes")
        };
        group.throughput(Throughput::Bytes(encoded_len(frame) as u64));
        let mut buf = BytesMut::with_capacity(encoded_len(frame));
        group.bench_function(format!("{name}_fast_path"), |b| {
            b.iter(|| {
                buf.clear();
                let records = black_box(&publish.records);
                let len = records
                    .iter()
                    .map(|r| encoded_record_len(r.key.len(), r.payload.len()))
                    .sum();
                let count = records.len() as u32;
                encode_publish_header(42, AckMode::Acked, "bench", count, len, &mut buf);
                for r in records {
                    encode_record(&r.key, &r.payload, &mut buf);
                }
                black_box(buf.len())
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("decode");
    for (name, frame) in &cases {
        let mut encoded = BytesMut::new();
        encode(frame, &mut encoded);
        let encoded = encoded.freeze();
        group.throughput(Throughput::Bytes(encoded.len() as u64));
        let frames_per_fill = (DECODE_FILL_BYTES / encoded.len()).max(1);
        group.bench_function(*name, |b| {
            b.iter_custom(|iters| {
                // Decode frames back to back from a buffer holding up to DECODE_FILL_BYTES of
                // them, as a receive buffer would; refilling it is not measured. Dropping
                // the decoded frames is measured: the broker pays it too.
                let mut measured = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let frames = left.min(frames_per_fill as u64);
                    let mut buf = BytesMut::with_capacity(encoded.len() * frames as usize);
                    for _ in 0..frames {
                        buf.extend_from_slice(&encoded);
                    }
                    let start = Instant::now();
                    for _ in 0..frames {
                        black_box(decoder.decode(black_box(&mut buf)).ok());
                    }
                    measured += start.elapsed();
                    left -= frames;
                }
                measured
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_codec);
criterion_main!(benches);
