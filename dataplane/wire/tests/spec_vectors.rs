//! The worked examples printed in docs/wire-protocol.md: if one of these fails, the document
//! and the code disagree, and one of them must be fixed.

use bytes::{Bytes, BytesMut};
use felix_wire::{
    Ack, AckMode, Decoder, Frame, Hello, Limits, ProducerPublish, Publish, Record, ShardAck,
    encode, fnv1a_64, shard_for_key,
};

/// Parses the document's hex dump notation ("11 00 00 00 01 ...").
fn hex(dump: &str) -> Vec<u8> {
    dump.split_whitespace()
        .map(|byte| u8::from_str_radix(byte, 16).expect("the dumps are valid hex"))
        .collect()
}

/// Encodes `frame`, checks the bytes against `dump`, and checks they decode back to `frame`.
fn check(frame: &Frame, dump: &str) {
    let mut buf = BytesMut::new();
    encode(frame, &mut buf);
    assert_eq!(&buf[..], &hex(dump)[..], "encoding of {frame:?}");
    let decoded = Decoder::new(Limits::DEFAULT).decode(&mut buf);
    assert_eq!(decoded, Ok(Some(frame.clone())));
}

// The document's key -> shard worked examples are what the code computes.
#[test]
fn shard_hash_examples() {
    assert_eq!(fnv1a_64(b"user-42"), 0x32c6_d7a5_4d35_dacb);
    assert_eq!(fnv1a_64(b"user-42"), 3_658_848_852_250_057_419);
    assert_eq!(shard_for_key(b"user-42", 48), 27);
    assert_eq!(fnv1a_64(b"sensor/7"), 0xa08c_2c06_666c_0f11);
    assert_eq!(fnv1a_64(b"sensor/7"), 11_568_669_948_807_745_297);
    assert_eq!(shard_for_key(b"sensor/7", 16), 1);
    assert_eq!(fnv1a_64(b""), 14_695_981_039_346_656_037);
    assert_eq!(shard_for_key(b"", 48), 5);
}

// The document's Hello hex dump is exactly what the encoder writes.
#[test]
fn hello_dump() {
    let hello = Frame::Hello(Hello {
        min_version: 1,
        max_version: 1,
        features: 0,
        client_name: "cli".into(),
        token: None,
    });
    check(
        &hello,
        "11 00 00 00 01 00
         01 00 01 00 00 00 00 00 00 00 00 00 03 00 63 6c 69",
    );
}

// The document's Hello-with-token hex dump is exactly what the encoder writes: the token bit
// is set and the token follows the client name.
#[test]
fn hello_with_token_dump() {
    let hello = Frame::Hello(Hello {
        min_version: 1,
        max_version: 1,
        features: felix_wire::FEATURE_TOKEN,
        client_name: "cli".into(),
        token: Some(Bytes::from_static(b"tok")),
    });
    check(
        &hello,
        "16 00 00 00 01 00
         01 00 01 00 01 00 00 00 00 00 00 00 03 00 63 6c 69 03 00 74 6f 6b",
    );
}

// The document's one-record Publish hex dump is exactly what the encoder writes.
#[test]
fn publish_dump() {
    let publish = Frame::Publish(Publish {
        request_id: 7,
        ack: AckMode::Acked,
        stream: "orders".into(),
        records: vec![Record {
            key: Bytes::from_static(b"k1"),
            payload: Bytes::from_static(b"hello"),
        }],
    });
    check(
        &publish,
        "22 00 00 00 20 00
         07 00 00 00 00 00 00 00 00 06 00 6f 72 64 65 72 73
         01 00 00 00 02 00 6b 31 05 00 00 00 68 65 6c 6c 6f",
    );
}

// The document's ProducerPublish hex dump (the same record as producer 0x1122334455667788's
// third batch on shard 17) is exactly what the encoder writes.
#[test]
fn producer_publish_dump() {
    let publish = Frame::ProducerPublish(ProducerPublish {
        publish: Publish {
            request_id: 7,
            ack: AckMode::Acked,
            stream: "orders".into(),
            records: vec![Record {
                key: Bytes::from_static(b"k1"),
                payload: Bytes::from_static(b"hello"),
            }],
        },
        producer: 0x1122_3344_5566_7788,
        sequence: 3,
        shard: 17,
    });
    assert_eq!(shard_for_key(b"k1", 48), 17);
    check(
        &publish,
        "36 00 00 00 22 00
         07 00 00 00 00 00 00 00 00 06 00 6f 72 64 65 72 73
         88 77 66 55 44 33 22 11 03 00 00 00 00 00 00 00 11 00 00 00
         01 00 00 00 02 00 6b 31 05 00 00 00 68 65 6c 6c 6f",
    );
}

// The document's Ack hex dump (the answer to that Publish on a 48-shard stream, where key "k1"
// lives on shard 17) is exactly what the encoder writes.
#[test]
fn ack_dump() {
    assert_eq!(shard_for_key(b"k1", 48), 17);
    let ack = Frame::Ack(Ack {
        request_id: 7,
        shards: vec![ShardAck {
            shard: 17,
            first_offset: 41,
            count: 1,
        }],
    });
    check(
        &ack,
        "1c 00 00 00 21 00
         07 00 00 00 00 00 00 00 01 00 00 00
         11 00 00 00 29 00 00 00 00 00 00 00 01 00 00 00",
    );
}
