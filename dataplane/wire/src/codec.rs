//! Encoder and streaming decoder of protocol v1. The byte layout is specified, field by field,
//! in `docs/wire-protocol.md`; every integer is little-endian.
//!
//! The decoder is the attack surface: it reads each length and count, checks it against a limit
//! and against the bytes actually present, and only then slices or allocates. Keys and payloads
//! come out as `Bytes` slices of the received frame (zero-copy). The encoder trusts its input
//! (it comes from our own code) but asserts the few hard format bounds it cannot represent.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::{
    Ack, AckMode, CLIENT_NAME_BYTES_MAX, CLUSTER_ADDRESS_BYTES_MAX, CLUSTER_MEMBERS_MAX, CORES_MAX,
    ClusterMap, ClusterMember, ClusterRoute, CreateClusterStream, CreateStream, DeliveredRecord,
    Delivery, ERROR_MESSAGE_BYTES_MAX, ErrorCode, ErrorFrame, FEATURE_TOKEN, FRAME_HEADER_LEN,
    Frame, FrameType, FsyncMode, HashKind, Hello, HelloOk, LISTED_STREAMS_MAX, Limits,
    ProducerPublish, Publish, ReadShard, Record, Records, ShardAck, ShardInfo, ShardSelection,
    StartPosition, StreamInfo, StreamKind, StreamRoute, StreamSummary, Subscribe, Subscribed,
    TOKEN_BYTES_MAX, WireError,
};

// Field sizes of the layout (bytes).
const REQUEST_ID_LEN: usize = 8;
/// u16 length before every string and key.
const SHORT_LEN_LEN: usize = 2;
/// u32 length before every payload, u32 count before every list.
const LONG_LEN_LEN: usize = 4;
/// `Limits` in `HelloOk`: u32 frame, u32 batch, u32 payload, u16 key, u16 name, u32 shards.
const LIMITS_LEN: usize = 20;

// Smallest encoding of one list item: `count * min <= remaining` is checked before any list is
// allocated, so a hostile count costs nothing.
const CORE_PORT_LEN: usize = 2;
/// name (empty) + kind + shard_count + hash + core-list count.
const ROUTE_LEN_MIN: usize = SHORT_LEN_LEN + 1 + 4 + 1 + LONG_LEN_LEN;
/// shard + core + oldest_offset + next_offset.
const SHARD_INFO_LEN: usize = 4 + 2 + 8 + 8;
/// name (empty) + kind + shard_count.
const SUMMARY_LEN_MIN: usize = SHORT_LEN_LEN + 1 + 4;
/// A `ClusterMap` member without its address bytes: id, address length.
const CLUSTER_MEMBER_LEN_MIN: usize = 2 + SHORT_LEN_LEN;
/// A `ClusterMap` route without its name and leaders: name length, leader count.
const CLUSTER_ROUTE_LEN_MIN: usize = SHORT_LEN_LEN + LONG_LEN_LEN;
/// One leader of a `ClusterMap` route.
const CLUSTER_LEADER_LEN: usize = 2;
/// Key length + payload length; the key and payload bytes follow.
pub const PUBLISH_RECORD_OVERHEAD: usize = SHORT_LEN_LEN + LONG_LEN_LEN;
/// Bytes a `ProducerPublish` adds to a `Publish` of the same records: producer (8),
/// sequence (8) and shard (4).
pub const PRODUCER_FIELDS_LEN: usize = 8 + 8 + 4;
/// shard + first_offset + count.
const SHARD_ACK_LEN: usize = 4 + 8 + 4;
const SHARD_LEN: usize = 4;
/// shard + offset.
const SHARD_OFFSET_LEN: usize = 4 + 8;
/// shard + offset + timestamp_us + key length + payload length.
const DELIVERED_RECORD_OVERHEAD: usize = 4 + 8 + 8 + SHORT_LEN_LEN + LONG_LEN_LEN;

// Tags of the two enums with data in `Subscribe`.
const SHARDS_ALL: u8 = 0;
const SHARDS_LIST: u8 = 1;
const FROM_LATEST: u8 = 0;
const FROM_EARLIEST: u8 = 1;
const FROM_OFFSETS: u8 = 2;

// ---------------------------------------------------------------------------------------------
// Encoder
// ---------------------------------------------------------------------------------------------

/// Appends the encoding of `frame` (header + body) to `buf`.
///
/// A `Hello::client_name` over [`CLIENT_NAME_BYTES_MAX`] and an `ErrorFrame::message` over
/// [`ERROR_MESSAGE_BYTES_MAX`] are truncated at a character boundary. Nothing else is checked
/// against [`Limits`]: call [`validate`] first when the frame holds untrusted sizes.
///
/// # Panics
/// If a string or key is longer than 65,535 bytes, a payload or the body longer than
/// `u32::MAX` bytes, or a list longer than `u32::MAX` items: the format cannot express them.
pub fn encode(frame: &Frame, buf: &mut BytesMut) {
    if let Frame::Publish(publish) = frame {
        // One code path for the publisher's fast path and the generic encoder, so the two
        // always produce the same bytes.
        let records_len = publish
            .records
            .iter()
            .map(|r| encoded_record_len(r.key.len(), r.payload.len()))
            .sum();
        encode_publish_header(
            publish.request_id,
            publish.ack,
            &publish.stream,
            list_len(publish.records.len()),
            records_len,
            buf,
        );
        for record in &publish.records {
            encode_record(&record.key, &record.payload, buf);
        }
        return;
    }
    if let Frame::ProducerPublish(produced) = frame {
        let publish = &produced.publish;
        let records_len = publish
            .records
            .iter()
            .map(|r| encoded_record_len(r.key.len(), r.payload.len()))
            .sum();
        encode_producer_publish_header(
            &ProducerHeader {
                request_id: publish.request_id,
                ack: publish.ack,
                producer: produced.producer,
                sequence: produced.sequence,
                shard: produced.shard,
            },
            &publish.stream,
            list_len(publish.records.len()),
            records_len,
            buf,
        );
        for record in &publish.records {
            encode_record(&record.key, &record.payload, buf);
        }
        return;
    }
    let body_len = body_len(frame);
    buf.reserve(FRAME_HEADER_LEN + body_len);
    let start = buf.len();
    put_header(buf, frame.frame_type(), body_len);
    put_body(frame, buf);
    // Paired with `body_len`: the header announced exactly what was written.
    assert_eq!(
        buf.len() - start,
        FRAME_HEADER_LEN + body_len,
        "encoded body length mismatch"
    );
}

/// Length in bytes of `frame`'s encoding, header included.
#[must_use]
pub fn encoded_len(frame: &Frame) -> usize {
    FRAME_HEADER_LEN + body_len(frame)
}

/// Length of one record in its `Publish` encoding (what [`encode_record`] writes).
#[must_use]
pub fn encoded_record_len(key_len: usize, payload_len: usize) -> usize {
    PUBLISH_RECORD_OVERHEAD + key_len + payload_len
}

/// Length of a whole `Publish` frame (header included) to `stream` of `record_count` records
/// whose keys and payloads total `key_payload_bytes`: what [`encoded_len`] gives for it, from
/// the sums a receiver has at hand. A decoded publish's keys and payloads are slices of a
/// buffer of this length ([`Decoder::decode`]).
#[must_use]
pub fn encoded_publish_len(stream: &str, record_count: usize, key_payload_bytes: usize) -> usize {
    FRAME_HEADER_LEN
        + REQUEST_ID_LEN
        + 1
        + str_len(stream)
        + LONG_LEN_LEN
        + record_count * PUBLISH_RECORD_OVERHEAD
        + key_payload_bytes
}

/// Fast path for publishers: appends a `Publish` frame header and the fixed part of its body
/// for `record_count` records whose encoded record bytes total `records_len` (as produced by
/// [`encode_record`], see [`encoded_record_len`]). The caller appends exactly those records
/// next (with [`encode_record`], or [`encode_record_head`] and the payload as a chunk of its
/// own); only the header's capacity is reserved here, so a caller sending payloads apart
/// reserves just what it copies.
///
/// # Panics
/// If `stream` is longer than 65,535 bytes or the body longer than `u32::MAX` bytes.
pub fn encode_publish_header(
    request_id: u64,
    ack: AckMode,
    stream: &str,
    record_count: u32,
    records_len: usize,
    buf: &mut BytesMut,
) {
    let fixed_len = REQUEST_ID_LEN + 1 + str_len(stream) + LONG_LEN_LEN;
    let body_len = fixed_len + records_len;
    buf.reserve(FRAME_HEADER_LEN + fixed_len);
    put_header(buf, FrameType::Publish, body_len);
    buf.put_u64_le(request_id);
    buf.put_u8(ack as u8);
    put_str(buf, stream);
    buf.put_u32_le(record_count);
}

/// The fixed fields of a `ProducerPublish` besides its stream name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerHeader {
    pub request_id: u64,
    pub ack: AckMode,
    pub producer: u64,
    pub sequence: u64,
    pub shard: u32,
}

/// Fast path for idempotent producers: [`encode_publish_header`] for a `ProducerPublish`
/// frame. The records follow exactly as in a `Publish` ([`encode_record`]).
///
/// # Panics
/// If `stream` is longer than 65,535 bytes or the body longer than `u32::MAX` bytes.
pub fn encode_producer_publish_header(
    header: &ProducerHeader,
    stream: &str,
    record_count: u32,
    records_len: usize,
    buf: &mut BytesMut,
) {
    let fixed_len = REQUEST_ID_LEN + 1 + str_len(stream) + PRODUCER_FIELDS_LEN + LONG_LEN_LEN;
    let body_len = fixed_len + records_len;
    buf.reserve(FRAME_HEADER_LEN + fixed_len);
    put_header(buf, FrameType::ProducerPublish, body_len);
    buf.put_u64_le(header.request_id);
    buf.put_u8(header.ack as u8);
    put_str(buf, stream);
    buf.put_u64_le(header.producer);
    buf.put_u64_le(header.sequence);
    buf.put_u32_le(header.shard);
    buf.put_u32_le(record_count);
}

/// Appends one record (key, payload) in its `Publish` encoding; returns the bytes written.
///
/// # Panics
/// If `key` is longer than 65,535 bytes or `payload` longer than `u32::MAX` bytes.
pub fn encode_record(key: &[u8], payload: &[u8], buf: &mut BytesMut) -> usize {
    let len = encoded_record_len(key.len(), payload.len());
    buf.reserve(len);
    put_key(buf, key);
    put_payload(buf, payload);
    len
}

/// Encodes a `Delivery` frame of `records` for a vectored write: bytes go into `buf`, except
/// that each payload of at least `vectored_min` bytes is not copied: whatever `buf` holds so
/// far is moved out as a chunk onto `chunks`, then the payload itself (a reference). The
/// frame is `chunks` (those appended) followed by what is left in `buf`; earlier bytes in
/// `buf` stay in front of it. Writes exactly what [`encode`] writes for the same frame.
pub fn encode_delivery_vectored(
    records: &[DeliveredRecord],
    vectored_min: usize,
    buf: &mut BytesMut,
    chunks: &mut Vec<Bytes>,
) {
    let mut body_len = LONG_LEN_LEN;
    let mut copied_len = FRAME_HEADER_LEN + LONG_LEN_LEN;
    for record in records {
        let len = DELIVERED_RECORD_OVERHEAD + record.key.len() + record.payload.len();
        body_len += len;
        copied_len += if record.payload.len() >= vectored_min {
            len - record.payload.len()
        } else {
            len
        };
    }
    buf.reserve(copied_len);
    put_header(buf, FrameType::Delivery, body_len);
    put_count(buf, records.len());
    for record in records {
        put_delivered_head(buf, record);
        if record.payload.len() >= vectored_min {
            put_payload_len(buf, record.payload.len());
            chunks.push(buf.split().freeze());
            chunks.push(record.payload.clone());
        } else {
            put_payload(buf, &record.payload);
        }
    }
}

/// Appends one record's `Publish` encoding up to its payload (key length, key, payload
/// length): the caller sends the payload itself next, e.g. as its own chunk of a vectored
/// write, so a large payload is never copied into the frame. Returns the bytes written.
///
/// # Panics
/// If `key` is longer than 65,535 bytes or `payload_len` is above `u32::MAX`.
pub fn encode_record_head(key: &[u8], payload_len: usize, buf: &mut BytesMut) -> usize {
    let len = PUBLISH_RECORD_OVERHEAD + key.len();
    buf.reserve(len);
    put_key(buf, key);
    put_payload_len(buf, payload_len);
    len
}

fn put_header(buf: &mut BytesMut, frame_type: FrameType, body_len: usize) {
    let body_len = u32::try_from(body_len);
    assert!(body_len.is_ok(), "a frame body is at most u32::MAX bytes");
    buf.put_u32_le(body_len.unwrap_or(u32::MAX));
    buf.put_u8(frame_type as u8);
    // Flags: none defined in v1.
    buf.put_u8(0);
}

fn put_body(frame: &Frame, buf: &mut BytesMut) {
    match frame {
        Frame::Hello(hello) => {
            buf.put_u16_le(hello.min_version);
            buf.put_u16_le(hello.max_version);
            buf.put_u64_le(hello_features(hello));
            put_str(
                buf,
                truncate_utf8(&hello.client_name, CLIENT_NAME_BYTES_MAX),
            );
            if let Some(token) = &hello.token {
                put_key(buf, token);
            }
        }
        Frame::HelloOk(ok) => {
            buf.put_u16_le(ok.version);
            buf.put_u64_le(ok.features);
            put_limits(buf, &ok.limits);
            put_count(buf, ok.core_ports.len());
            for port in &ok.core_ports {
                buf.put_u16_le(*port);
            }
            put_count(buf, ok.shard_map.len());
            for route in &ok.shard_map {
                put_str(buf, &route.name);
                buf.put_u8(route.kind as u8);
                buf.put_u32_le(route.shard_count);
                buf.put_u8(route.hash as u8);
                put_count(buf, route.shard_cores.len());
                for core in &route.shard_cores {
                    buf.put_u16_le(*core);
                }
            }
        }
        Frame::CreateStream(create) => {
            buf.put_u64_le(create.request_id);
            put_str(buf, &create.name);
            buf.put_u32_le(create.shard_count);
            buf.put_u8(create.kind as u8);
        }
        Frame::DescribeStream { request_id, name } | Frame::DeleteStream { request_id, name } => {
            buf.put_u64_le(*request_id);
            put_str(buf, name);
        }
        Frame::ListStreams { request_id }
        | Frame::Done { request_id }
        | Frame::DescribeCluster { request_id } => {
            buf.put_u64_le(*request_id);
        }
        Frame::ClusterMap(map) => {
            buf.put_u64_le(map.request_id);
            buf.put_u16_le(map.member);
            put_count(buf, map.members.len());
            for member in &map.members {
                buf.put_u16_le(member.id);
                put_str(buf, &member.addr);
            }
            put_count(buf, map.streams.len());
            for route in &map.streams {
                put_str(buf, &route.name);
                put_count(buf, route.leaders.len());
                for leader in &route.leaders {
                    buf.put_u16_le(*leader);
                }
            }
        }
        Frame::CreateClusterStream(create) => {
            buf.put_u64_le(create.request_id);
            put_str(buf, &create.name);
            buf.put_u32_le(create.shard_count);
            buf.put_u8(create.kind as u8);
            buf.put_u8(create.replicas);
            buf.put_u8(create.fsync as u8);
        }
        Frame::DeleteClusterStream { request_id, name } => {
            buf.put_u64_le(*request_id);
            put_str(buf, name);
        }
        Frame::ReadShard(read) => {
            buf.put_u64_le(read.request_id);
            put_str(buf, &read.stream);
            buf.put_u32_le(read.shard);
            buf.put_u64_le(read.from);
            buf.put_u32_le(read.max_records);
        }
        Frame::Records(records) => {
            buf.put_u64_le(records.request_id);
            put_count(buf, records.records.len());
            for record in &records.records {
                put_delivered_head(buf, record);
                put_payload(buf, &record.payload);
            }
        }
        Frame::StreamInfo(info) => {
            buf.put_u64_le(info.request_id);
            put_str(buf, &info.name);
            buf.put_u8(info.kind as u8);
            buf.put_u8(info.hash as u8);
            put_count(buf, info.shards.len());
            for shard in &info.shards {
                buf.put_u32_le(shard.shard);
                buf.put_u16_le(shard.core);
                buf.put_u64_le(shard.oldest_offset);
                buf.put_u64_le(shard.next_offset);
            }
        }
        Frame::StreamList {
            request_id,
            streams,
        } => {
            buf.put_u64_le(*request_id);
            put_count(buf, streams.len());
            for stream in streams {
                put_str(buf, &stream.name);
                buf.put_u8(stream.kind as u8);
                buf.put_u32_le(stream.shard_count);
            }
        }
        Frame::Publish(publish) => {
            buf.put_u64_le(publish.request_id);
            buf.put_u8(publish.ack as u8);
            put_str(buf, &publish.stream);
            put_count(buf, publish.records.len());
            for record in &publish.records {
                encode_record(&record.key, &record.payload, buf);
            }
        }
        Frame::ProducerPublish(produced) => {
            let publish = &produced.publish;
            buf.put_u64_le(publish.request_id);
            buf.put_u8(publish.ack as u8);
            put_str(buf, &publish.stream);
            buf.put_u64_le(produced.producer);
            buf.put_u64_le(produced.sequence);
            buf.put_u32_le(produced.shard);
            put_count(buf, publish.records.len());
            for record in &publish.records {
                encode_record(&record.key, &record.payload, buf);
            }
        }
        Frame::Ack(ack) => {
            buf.put_u64_le(ack.request_id);
            put_count(buf, ack.shards.len());
            for shard in &ack.shards {
                buf.put_u32_le(shard.shard);
                buf.put_u64_le(shard.first_offset);
                buf.put_u32_le(shard.count);
            }
        }
        Frame::Subscribe(subscribe) => {
            buf.put_u64_le(subscribe.request_id);
            put_str(buf, &subscribe.stream);
            match &subscribe.shards {
                ShardSelection::All => buf.put_u8(SHARDS_ALL),
                ShardSelection::List(shards) => {
                    buf.put_u8(SHARDS_LIST);
                    put_count(buf, shards.len());
                    for shard in shards {
                        buf.put_u32_le(*shard);
                    }
                }
            }
            match &subscribe.from {
                StartPosition::Latest => buf.put_u8(FROM_LATEST),
                StartPosition::Earliest => buf.put_u8(FROM_EARLIEST),
                StartPosition::Offsets(offsets) => {
                    buf.put_u8(FROM_OFFSETS);
                    put_shard_offsets(buf, offsets);
                }
            }
        }
        Frame::Subscribed(subscribed) => {
            buf.put_u64_le(subscribed.request_id);
            put_shard_offsets(buf, &subscribed.shards);
        }
        Frame::Delivery(delivery) => {
            put_count(buf, delivery.records.len());
            for record in &delivery.records {
                put_delivered_head(buf, record);
                put_payload(buf, &record.payload);
            }
        }
        Frame::Error(error) => {
            buf.put_u64_le(error.request_id);
            buf.put_u16_le(error.code as u16);
            buf.put_u64_le(error.detail);
            put_str(buf, truncate_utf8(&error.message, ERROR_MESSAGE_BYTES_MAX));
        }
    }
}

/// Body length of `frame`'s encoding; must agree with `put_body` byte for byte.
fn body_len(frame: &Frame) -> usize {
    match frame {
        Frame::Hello(hello) => {
            2 + 2
                + 8
                + str_len(truncate_utf8(&hello.client_name, CLIENT_NAME_BYTES_MAX))
                + hello
                    .token
                    .as_ref()
                    .map_or(0, |token| SHORT_LEN_LEN + token.len())
        }
        Frame::HelloOk(ok) => {
            let routes: usize = ok
                .shard_map
                .iter()
                .map(|r| ROUTE_LEN_MIN + r.name.len() + CORE_PORT_LEN * r.shard_cores.len())
                .sum();
            2 + 8
                + LIMITS_LEN
                + LONG_LEN_LEN
                + CORE_PORT_LEN * ok.core_ports.len()
                + LONG_LEN_LEN
                + routes
        }
        Frame::CreateStream(create) => REQUEST_ID_LEN + str_len(&create.name) + 4 + 1,
        Frame::DescribeStream { name, .. } | Frame::DeleteStream { name, .. } => {
            REQUEST_ID_LEN + str_len(name)
        }
        Frame::ListStreams { .. } | Frame::Done { .. } | Frame::DescribeCluster { .. } => {
            REQUEST_ID_LEN
        }
        Frame::ClusterMap(map) => {
            let members: usize = map
                .members
                .iter()
                .map(|m| CLUSTER_MEMBER_LEN_MIN + m.addr.len())
                .sum();
            let routes: usize = map
                .streams
                .iter()
                .map(|r| {
                    CLUSTER_ROUTE_LEN_MIN + r.name.len() + CLUSTER_LEADER_LEN * r.leaders.len()
                })
                .sum();
            REQUEST_ID_LEN + 2 + LONG_LEN_LEN + members + LONG_LEN_LEN + routes
        }
        Frame::CreateClusterStream(create) => {
            REQUEST_ID_LEN + str_len(&create.name) + 4 + 1 + 1 + 1
        }
        Frame::DeleteClusterStream { name, .. } => REQUEST_ID_LEN + str_len(name),
        Frame::ReadShard(read) => REQUEST_ID_LEN + str_len(&read.stream) + 4 + 8 + 4,
        Frame::Records(records) => {
            REQUEST_ID_LEN + LONG_LEN_LEN + delivered_records_len(&records.records)
        }
        Frame::StreamInfo(info) => {
            REQUEST_ID_LEN
                + str_len(&info.name)
                + 1
                + 1
                + LONG_LEN_LEN
                + SHARD_INFO_LEN * info.shards.len()
        }
        Frame::StreamList { streams, .. } => {
            let items: usize = streams.iter().map(|s| SUMMARY_LEN_MIN + s.name.len()).sum();
            REQUEST_ID_LEN + LONG_LEN_LEN + items
        }
        Frame::Publish(publish) => {
            let records: usize = publish
                .records
                .iter()
                .map(|r| encoded_record_len(r.key.len(), r.payload.len()))
                .sum();
            REQUEST_ID_LEN + 1 + str_len(&publish.stream) + LONG_LEN_LEN + records
        }
        Frame::ProducerPublish(produced) => {
            let publish = &produced.publish;
            let records: usize = publish
                .records
                .iter()
                .map(|r| encoded_record_len(r.key.len(), r.payload.len()))
                .sum();
            REQUEST_ID_LEN
                + 1
                + str_len(&publish.stream)
                + PRODUCER_FIELDS_LEN
                + LONG_LEN_LEN
                + records
        }
        Frame::Ack(ack) => REQUEST_ID_LEN + LONG_LEN_LEN + SHARD_ACK_LEN * ack.shards.len(),
        Frame::Subscribe(subscribe) => {
            let shards = match &subscribe.shards {
                ShardSelection::All => 0,
                ShardSelection::List(shards) => LONG_LEN_LEN + SHARD_LEN * shards.len(),
            };
            let from = match &subscribe.from {
                StartPosition::Latest | StartPosition::Earliest => 0,
                StartPosition::Offsets(offsets) => LONG_LEN_LEN + SHARD_OFFSET_LEN * offsets.len(),
            };
            REQUEST_ID_LEN + str_len(&subscribe.stream) + 1 + shards + 1 + from
        }
        Frame::Subscribed(subscribed) => {
            REQUEST_ID_LEN + LONG_LEN_LEN + SHARD_OFFSET_LEN * subscribed.shards.len()
        }
        Frame::Delivery(delivery) => LONG_LEN_LEN + delivered_records_len(&delivery.records),
        Frame::Error(error) => {
            REQUEST_ID_LEN + 2 + 8 + str_len(truncate_utf8(&error.message, ERROR_MESSAGE_BYTES_MAX))
        }
    }
}

/// The encoded length of delivered records (`Delivery`, `Records`).
fn delivered_records_len(records: &[DeliveredRecord]) -> usize {
    records
        .iter()
        .map(|r| DELIVERED_RECORD_OVERHEAD + r.key.len() + r.payload.len())
        .sum()
}

fn str_len(s: &str) -> usize {
    SHORT_LEN_LEN + s.len()
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    // Index 0 is always a boundary, so this stops; UTF-8 characters are at most 4 bytes.
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The features a `Hello` is encoded with: [`FEATURE_TOKEN`] exactly when it carries a token,
/// so the bit and the field always agree (and decoding then encoding gives the same bytes).
fn hello_features(hello: &Hello) -> u64 {
    let token = if hello.token.is_some() {
        FEATURE_TOKEN
    } else {
        0
    };
    (hello.features & !FEATURE_TOKEN) | token
}

fn put_str(buf: &mut BytesMut, s: &str) {
    put_key(buf, s.as_bytes());
}

fn put_key(buf: &mut BytesMut, key: &[u8]) {
    let len = u16::try_from(key.len());
    assert!(
        len.is_ok(),
        "strings and keys are at most 65,535 bytes on the wire"
    );
    buf.put_u16_le(len.unwrap_or(u16::MAX));
    buf.put_slice(key);
}

fn put_payload(buf: &mut BytesMut, payload: &[u8]) {
    put_payload_len(buf, payload.len());
    buf.put_slice(payload);
}

/// A payload's u32 length prefix (the payload follows, in the buffer or as a chunk of its own).
fn put_payload_len(buf: &mut BytesMut, len: usize) {
    let len = u32::try_from(len);
    assert!(
        len.is_ok(),
        "payloads are at most u32::MAX bytes on the wire"
    );
    buf.put_u32_le(len.unwrap_or(u32::MAX));
}

/// A delivered record up to its payload: shard, offset, timestamp, key.
fn put_delivered_head(buf: &mut BytesMut, record: &DeliveredRecord) {
    buf.put_u32_le(record.shard);
    buf.put_u64_le(record.offset);
    buf.put_u64_le(record.timestamp_us);
    put_key(buf, &record.key);
}

fn list_len(len: usize) -> u32 {
    let len = u32::try_from(len);
    assert!(len.is_ok(), "lists hold at most u32::MAX items on the wire");
    len.unwrap_or(u32::MAX)
}

fn put_count(buf: &mut BytesMut, len: usize) {
    buf.put_u32_le(list_len(len));
}

fn put_limits(buf: &mut BytesMut, limits: &Limits) {
    buf.put_u32_le(limits.max_frame_bytes);
    buf.put_u32_le(limits.max_batch_records);
    buf.put_u32_le(limits.max_payload_bytes);
    buf.put_u16_le(limits.max_key_bytes);
    buf.put_u16_le(limits.max_name_bytes);
    buf.put_u32_le(limits.max_shards);
}

fn put_shard_offsets(buf: &mut BytesMut, shards: &[(u32, u64)]) {
    put_count(buf, shards.len());
    for (shard, offset) in shards {
        buf.put_u32_le(*shard);
        buf.put_u64_le(*offset);
    }
}

// ---------------------------------------------------------------------------------------------
// Validation (the decoder's limits, applied to a frame before it is sent)
// ---------------------------------------------------------------------------------------------

/// Checks `frame` against what a peer's [`Decoder`] with `limits` accepts: the body size, every
/// name, key and payload length and every list count. `Ok` means the peer decodes
/// `encode(frame)` back into an equal frame (after the encoder's truncation of a long client
/// name or error message); `Err` is the error that decoder would report first.
///
/// Use it on frames whose sizes come from users (a client's publish), so a bad frame is refused
/// locally instead of costing the whole QUIC stream.
pub fn validate(frame: &Frame, limits: &Limits) -> Result<(), WireError> {
    let body_len = body_len(frame);
    if body_len > limits.max_frame_bytes as usize {
        return Err(WireError::FrameTooLarge {
            len: body_len as u64,
            max: limits.max_frame_bytes,
        });
    }
    let name_max = usize::from(limits.max_name_bytes);
    match frame {
        Frame::Hello(hello) => match &hello.token {
            Some(token) => check_len("token length", token.len(), TOKEN_BYTES_MAX),
            None => Ok(()),
        },
        Frame::ListStreams { .. }
        | Frame::Done { .. }
        | Frame::DescribeCluster { .. }
        | Frame::Error(_) => Ok(()),
        Frame::ClusterMap(map) => {
            check_count("member count", map.members.len(), CLUSTER_MEMBERS_MAX)?;
            for member in &map.members {
                check_len(
                    "member address length",
                    member.addr.len(),
                    CLUSTER_ADDRESS_BYTES_MAX,
                )?;
            }
            check_count("stream count", map.streams.len(), LISTED_STREAMS_MAX)?;
            for route in &map.streams {
                check_len("stream name length", route.name.len(), name_max)?;
                check_count("shard count", route.leaders.len(), limits.max_shards)?;
            }
            Ok(())
        }
        Frame::HelloOk(ok) => {
            check_count("core port count", ok.core_ports.len(), CORES_MAX)?;
            check_count("stream count", ok.shard_map.len(), LISTED_STREAMS_MAX)?;
            for route in &ok.shard_map {
                check_len("stream name length", route.name.len(), name_max)?;
                check_count("shard count", route.shard_cores.len(), limits.max_shards)?;
                check_route_cores(route.shard_count, route.shard_cores.len())?;
            }
            Ok(())
        }
        Frame::CreateStream(CreateStream { name, .. })
        | Frame::DescribeStream { name, .. }
        | Frame::DeleteStream { name, .. }
        | Frame::CreateClusterStream(CreateClusterStream { name, .. })
        | Frame::DeleteClusterStream { name, .. }
        | Frame::ReadShard(ReadShard { stream: name, .. }) => {
            check_len("stream name length", name.len(), name_max)
        }
        Frame::Records(Records { records, .. }) => check_delivered(limits, records),
        Frame::StreamInfo(info) => {
            check_len("stream name length", info.name.len(), name_max)?;
            check_count("shard count", info.shards.len(), limits.max_shards)
        }
        Frame::StreamList { streams, .. } => {
            check_count("stream count", streams.len(), LISTED_STREAMS_MAX)?;
            for stream in streams {
                check_len("stream name length", stream.name.len(), name_max)?;
            }
            Ok(())
        }
        Frame::Publish(publish) | Frame::ProducerPublish(ProducerPublish { publish, .. }) => {
            check_len("stream name length", publish.stream.len(), name_max)?;
            check_count(
                "record count",
                publish.records.len(),
                limits.max_batch_records,
            )?;
            for record in &publish.records {
                check_record(limits, record.key.len(), record.payload.len())?;
            }
            Ok(())
        }
        Frame::Ack(ack) => check_count("shard count", ack.shards.len(), limits.max_shards),
        Frame::Subscribe(subscribe) => {
            check_len("stream name length", subscribe.stream.len(), name_max)?;
            if let ShardSelection::List(shards) = &subscribe.shards {
                check_count("shard count", shards.len(), limits.max_shards)?;
            }
            if let StartPosition::Offsets(offsets) = &subscribe.from {
                check_count("shard count", offsets.len(), limits.max_shards)?;
            }
            Ok(())
        }
        Frame::Subscribed(subscribed) => {
            check_count("shard count", subscribed.shards.len(), limits.max_shards)
        }
        Frame::Delivery(delivery) => check_delivered(limits, &delivery.records),
    }
}

/// The checks of a list of delivered records (`Delivery`, `Records`).
fn check_delivered(limits: &Limits, records: &[DeliveredRecord]) -> Result<(), WireError> {
    check_count("record count", records.len(), limits.max_batch_records)?;
    for record in records {
        check_record(limits, record.key.len(), record.payload.len())?;
    }
    Ok(())
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), WireError> {
    if len > max {
        return Err(WireError::LimitExceeded {
            what,
            value: len as u64,
            max: max as u64,
        });
    }
    Ok(())
}

fn check_count(what: &'static str, count: usize, max: u32) -> Result<(), WireError> {
    check_len(what, count, max as usize)
}

fn check_record(limits: &Limits, key_len: usize, payload_len: usize) -> Result<(), WireError> {
    check_len("key length", key_len, usize::from(limits.max_key_bytes))?;
    check_len(
        "payload length",
        payload_len,
        limits.max_payload_bytes as usize,
    )
}

fn check_route_cores(shard_count: u32, cores: usize) -> Result<(), WireError> {
    if cores != shard_count as usize {
        return Err(malformed(
            FrameType::HelloOk,
            format!("route lists {cores} shard cores for {shard_count} shards"),
        ));
    }
    Ok(())
}

fn malformed(frame: FrameType, reason: String) -> WireError {
    WireError::Malformed {
        frame: frame.name(),
        reason,
    }
}

// ---------------------------------------------------------------------------------------------
// Decoder
// ---------------------------------------------------------------------------------------------

/// The body length a frame header announces (its first four bytes, little-endian), before any
/// check: [`Decoder::decode`] judges it against the limits.
#[must_use]
pub fn header_body_len(header: &[u8; FRAME_HEADER_LEN]) -> u32 {
    u32::from_le_bytes([header[0], header[1], header[2], header[3]])
}

/// Streaming decoder: feed it bytes as they arrive, take whole frames out.
#[derive(Debug, Clone)]
pub struct Decoder {
    limits: Limits,
}

impl Decoder {
    #[must_use]
    pub fn new(limits: Limits) -> Decoder {
        Decoder { limits }
    }

    #[must_use]
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Takes one whole frame from the front of `buf`, if one is there. `Ok(None)` means more
    /// bytes are needed (nothing consumed). Payloads and keys are zero-copy slices of `buf`.
    /// An error means the stream is unusable: the caller answers with an `Error` frame and
    /// closes it.
    ///
    /// The header is judged as soon as its 6 bytes are present, before the body arrives, in
    /// this order: body length over `max_frame_bytes` (`FrameTooLarge`), unknown frame type
    /// (`UnknownFrameType`), non-zero flags (`Malformed`). A header error consumes nothing; a
    /// body error consumes the frame.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        let Some(header) = buf.first_chunk::<FRAME_HEADER_LEN>() else {
            return Ok(None);
        };
        let (frame_type, frame_len) = self.check_header(header)?;
        if buf.len() < frame_len {
            return Ok(None);
        }
        let mut frame = buf.split_to(frame_len);
        frame.advance(FRAME_HEADER_LEN);
        let body = frame.freeze();
        self.decode_frame(frame_type, &body).map(Some)
    }

    /// Decodes one whole frame (header included) that arrived in several `chunks`, without
    /// putting it together first: keys and payloads inside one chunk are zero-copy slices of it;
    /// one that straddles two or more chunks is copied into a buffer of its own. Judged like
    /// [`Decoder::decode`] (the same errors, the same limits). Returns the frame and the bytes
    /// copied (for memory accounting: the records keep their chunks and these copies alive).
    ///
    /// # Errors
    /// As [`Decoder::decode`], and `Malformed` when the chunks do not hold exactly the length
    /// the header announces.
    pub fn decode_chunks(&self, chunks: &[Bytes]) -> Result<(Frame, usize), WireError> {
        if let [whole] = chunks
            && let Some(header) = whole.first_chunk::<FRAME_HEADER_LEN>()
        {
            let (frame_type, frame_len) = self.check_header(header)?;
            if frame_len == whole.len() {
                let body = whole.slice(FRAME_HEADER_LEN..);
                return Ok((self.decode_frame(frame_type, &body)?, 0));
            }
        }
        let total: usize = chunks.iter().map(Bytes::len).sum();
        let mut body = Split {
            chunks,
            index: 0,
            pos: 0,
            remaining: total,
            copied: 0,
        };
        if total < FRAME_HEADER_LEN {
            return Err(WireError::Malformed {
                frame: "frame",
                reason: format!("a frame of {total} bytes is shorter than its header"),
            });
        }
        let mut header = [0u8; FRAME_HEADER_LEN];
        body.read(&mut header);
        let (frame_type, frame_len) = self.check_header(&header)?;
        if frame_len != total {
            return Err(malformed(
                frame_type,
                format!("the header announces {frame_len} bytes, {total} were given"),
            ));
        }
        let mut reader = Reader {
            body,
            frame: frame_type,
            limits: &self.limits,
        };
        let frame = reader.frame()?;
        Ok((frame, reader.body.copied))
    }

    /// Judges a frame header as [`Decoder::decode`] does (its first three errors): the whole
    /// frame's length, header included, when the header is acceptable.
    ///
    /// # Errors
    /// `FrameTooLarge`, `UnknownFrameType`, `Malformed` (flags).
    pub fn frame_len(&self, header: &[u8; FRAME_HEADER_LEN]) -> Result<usize, WireError> {
        self.check_header(header).map(|(_, len)| len)
    }

    /// Judges a frame header as soon as its 6 bytes are present: the frame's type and its whole
    /// length (header included).
    fn check_header(
        &self,
        header: &[u8; FRAME_HEADER_LEN],
    ) -> Result<(FrameType, usize), WireError> {
        let body_len = header_body_len(header);
        let type_code = header[4];
        let flags = header[5];
        if body_len > self.limits.max_frame_bytes {
            return Err(WireError::FrameTooLarge {
                len: u64::from(body_len),
                max: self.limits.max_frame_bytes,
            });
        }
        let frame_type =
            FrameType::from_u8(type_code).ok_or(WireError::UnknownFrameType(type_code))?;
        if flags != 0 {
            return Err(malformed(
                frame_type,
                format!("flags 0x{flags:02x} (v1 defines none)"),
            ));
        }
        // body_len <= max_frame_bytes <= u32::MAX, which fits usize on every target we build.
        Ok((frame_type, FRAME_HEADER_LEN + body_len as usize))
    }

    /// Decodes exactly one frame body of type `frame_type` (header already removed).
    pub fn decode_body(&self, frame_type: u8, body: Bytes) -> Result<Frame, WireError> {
        let frame_type =
            FrameType::from_u8(frame_type).ok_or(WireError::UnknownFrameType(frame_type))?;
        if body.len() > self.limits.max_frame_bytes as usize {
            return Err(WireError::FrameTooLarge {
                len: body.len() as u64,
                max: self.limits.max_frame_bytes,
            });
        }
        self.decode_frame(frame_type, &body)
    }

    fn decode_frame(&self, frame_type: FrameType, body: &Bytes) -> Result<Frame, WireError> {
        Reader {
            body: Whole { body, pos: 0 },
            frame: frame_type,
            limits: &self.limits,
        }
        .frame()
    }
}

impl<B: Body> Reader<'_, B> {
    /// The whole body of a frame of type `self.frame`, nothing left over.
    fn frame(&mut self) -> Result<Frame, WireError> {
        let r = self;
        let frame = match r.frame {
            FrameType::Hello => {
                let min_version = r.u16("min_version")?;
                let max_version = r.u16("max_version")?;
                let features = r.u64("features")?;
                let client_name = r.string("client name length", CLIENT_NAME_BYTES_MAX)?;
                let token = if features & FEATURE_TOKEN == 0 {
                    None
                } else {
                    Some(r.bytes16("token length", "token", TOKEN_BYTES_MAX)?)
                };
                Frame::Hello(Hello {
                    min_version,
                    max_version,
                    features,
                    client_name,
                    token,
                })
            }
            FrameType::HelloOk => Frame::HelloOk(r.hello_ok()?),
            FrameType::CreateStream => Frame::CreateStream(CreateStream {
                request_id: r.u64("request_id")?,
                name: r.name()?,
                shard_count: r.u32("shard_count")?,
                kind: r.stream_kind()?,
            }),
            FrameType::DescribeStream => Frame::DescribeStream {
                request_id: r.u64("request_id")?,
                name: r.name()?,
            },
            FrameType::ListStreams => Frame::ListStreams {
                request_id: r.u64("request_id")?,
            },
            FrameType::DeleteStream => Frame::DeleteStream {
                request_id: r.u64("request_id")?,
                name: r.name()?,
            },
            FrameType::StreamInfo => Frame::StreamInfo(r.stream_info()?),
            FrameType::StreamList => r.stream_list()?,
            FrameType::Done => Frame::Done {
                request_id: r.u64("request_id")?,
            },
            FrameType::DescribeCluster => Frame::DescribeCluster {
                request_id: r.u64("request_id")?,
            },
            FrameType::ClusterMap => Frame::ClusterMap(r.cluster_map()?),
            FrameType::CreateClusterStream => Frame::CreateClusterStream(CreateClusterStream {
                request_id: r.u64("request_id")?,
                name: r.name()?,
                shard_count: r.u32("shard_count")?,
                kind: r.stream_kind()?,
                replicas: r.u8("replicas")?,
                fsync: r.fsync_mode()?,
            }),
            FrameType::DeleteClusterStream => Frame::DeleteClusterStream {
                request_id: r.u64("request_id")?,
                name: r.name()?,
            },
            FrameType::ReadShard => Frame::ReadShard(ReadShard {
                request_id: r.u64("request_id")?,
                stream: r.name()?,
                shard: r.u32("shard")?,
                from: r.u64("from")?,
                max_records: r.u32("max_records")?,
            }),
            FrameType::Records => Frame::Records(Records {
                request_id: r.u64("request_id")?,
                records: r.delivered_records()?,
            }),
            FrameType::Publish => Frame::Publish(r.publish(false)?.0),
            FrameType::ProducerPublish => {
                let (publish, fields) = r.publish(true)?;
                let (producer, sequence, shard) = fields.unwrap_or_default();
                Frame::ProducerPublish(ProducerPublish {
                    publish,
                    producer,
                    sequence,
                    shard,
                })
            }
            FrameType::Ack => Frame::Ack(r.ack()?),
            FrameType::Subscribe => Frame::Subscribe(r.subscribe()?),
            FrameType::Subscribed => Frame::Subscribed(Subscribed {
                request_id: r.u64("request_id")?,
                shards: r.shard_offsets()?,
            }),
            FrameType::Delivery => Frame::Delivery(r.delivery()?),
            FrameType::Error => Frame::Error(r.error()?),
        };
        r.finish()?;
        Ok(frame)
    }
}

/// The bytes of one frame body, read front to back. The caller checks `len <= remaining()`
/// before every read.
trait Body {
    fn remaining(&self) -> usize;
    /// Copies the next `out.len()` bytes into `out`.
    fn read(&mut self, out: &mut [u8]);
    /// The next `len` bytes, as a slice of the received bytes where they are contiguous.
    fn take(&mut self, len: usize) -> Bytes;
    /// The next `len` bytes as UTF-8.
    fn string(&mut self, len: usize) -> Result<String, std::str::Utf8Error>;
}

/// A body received in one buffer: every key and payload is a zero-copy slice of it.
struct Whole<'a> {
    body: &'a Bytes,
    pos: usize,
}

impl Body for Whole<'_> {
    #[inline]
    fn remaining(&self) -> usize {
        self.body.len() - self.pos
    }

    #[inline]
    fn read(&mut self, out: &mut [u8]) {
        out.copy_from_slice(&self.body[self.pos..self.pos + out.len()]);
        self.pos += out.len();
    }

    #[inline]
    fn take(&mut self, len: usize) -> Bytes {
        let bytes = self.body.slice(self.pos..self.pos + len);
        self.pos += len;
        bytes
    }

    fn string(&mut self, len: usize) -> Result<String, std::str::Utf8Error> {
        let range = self.pos..self.pos + len;
        self.pos += len;
        std::str::from_utf8(&self.body[range]).map(str::to_owned)
    }
}

/// A body received in several chunks ([`Decoder::decode_chunks`]): what lies inside one chunk
/// is sliced out of it, what straddles chunks is copied (and counted in `copied`).
struct Split<'a> {
    chunks: &'a [Bytes],
    /// The chunk read next, and the position in it.
    index: usize,
    pos: usize,
    remaining: usize,
    copied: usize,
}

impl<'a> Split<'a> {
    /// The chunk holding the next byte, after the used-up ones. Only called with bytes
    /// remaining, so a non-empty chunk is ahead.
    #[inline]
    fn current(&mut self) -> &'a Bytes {
        let chunks = self.chunks;
        while self.pos == chunks[self.index].len() {
            self.index += 1;
            self.pos = 0;
        }
        &chunks[self.index]
    }
}

impl Split<'_> {
    /// The next `len` bytes copied into a buffer of their own (appended, never zeroed first).
    fn copy(&mut self, len: usize) -> BytesMut {
        let mut copy = BytesMut::with_capacity(len);
        while copy.len() < len {
            let chunk = self.current();
            let n = (chunk.len() - self.pos).min(len - copy.len());
            copy.extend_from_slice(&chunk[self.pos..self.pos + n]);
            self.pos += n;
        }
        self.remaining -= len;
        copy
    }
}

impl Body for Split<'_> {
    #[inline]
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn read(&mut self, out: &mut [u8]) {
        let mut filled = 0;
        while filled < out.len() {
            let chunk = self.current();
            let n = (chunk.len() - self.pos).min(out.len() - filled);
            out[filled..filled + n].copy_from_slice(&chunk[self.pos..self.pos + n]);
            self.pos += n;
            filled += n;
        }
        self.remaining -= out.len();
    }

    fn take(&mut self, len: usize) -> Bytes {
        if len == 0 {
            return Bytes::new();
        }
        let chunk = self.current();
        if chunk.len() - self.pos >= len {
            let bytes = chunk.slice(self.pos..self.pos + len);
            self.pos += len;
            self.remaining -= len;
            return bytes;
        }
        self.copied += len;
        self.copy(len).freeze()
    }

    fn string(&mut self, len: usize) -> Result<String, std::str::Utf8Error> {
        String::from_utf8(self.copy(len).into()).map_err(|e| e.utf8_error())
    }
}

/// A cursor over one frame body. Every read checks the bytes remaining first.
struct Reader<'a, B> {
    body: B,
    frame: FrameType,
    limits: &'a Limits,
}

impl<B: Body> Reader<'_, B> {
    #[inline]
    fn remaining(&self) -> usize {
        self.body.remaining()
    }

    #[cold]
    #[inline(never)]
    fn malformed(&self, reason: String) -> WireError {
        malformed(self.frame, reason)
    }

    /// Checks that `len` more bytes are there, or Malformed if fewer remain.
    #[inline]
    fn need(&self, len: usize, what: &str) -> Result<(), WireError> {
        if len > self.remaining() {
            return Err(self.malformed(format!(
                "{what}: needs {len} bytes, {} remain",
                self.remaining()
            )));
        }
        Ok(())
    }

    /// The next `len` bytes (a slice of the received bytes where possible).
    #[inline]
    fn take(&mut self, len: usize, what: &str) -> Result<Bytes, WireError> {
        self.need(len, what)?;
        Ok(self.body.take(len))
    }

    #[inline]
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], WireError> {
        self.need(N, what)?;
        let mut bytes = [0u8; N];
        self.body.read(&mut bytes);
        Ok(bytes)
    }

    #[inline]
    fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.array::<1>(what)?[0])
    }

    #[inline]
    fn u16(&mut self, what: &str) -> Result<u16, WireError> {
        self.array(what).map(u16::from_le_bytes)
    }

    #[inline]
    fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        self.array(what).map(u32::from_le_bytes)
    }

    #[inline]
    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A u16-length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, what: &'static str, max: usize) -> Result<String, WireError> {
        let len = usize::from(self.u16(what)?);
        check_len(what, len, max)?;
        self.need(len, what)?;
        self.body
            .string(len)
            .map_err(|e| self.malformed(format!("{what}: invalid UTF-8 ({e})")))
    }

    fn name(&mut self) -> Result<String, WireError> {
        self.string(
            "stream name length",
            usize::from(self.limits.max_name_bytes),
        )
    }

    /// A u16-length-prefixed key (a zero-copy slice where it lies in one received chunk).
    #[inline]
    fn key(&mut self) -> Result<Bytes, WireError> {
        self.bytes16("key length", "key", usize::from(self.limits.max_key_bytes))
    }

    /// u16-length-prefixed bytes of at most `max` (a zero-copy slice where contiguous).
    #[inline]
    fn bytes16(
        &mut self,
        what_len: &'static str,
        what: &'static str,
        max: usize,
    ) -> Result<Bytes, WireError> {
        let len = usize::from(self.u16(what_len)?);
        check_len(what_len, len, max)?;
        self.take(len, what)
    }

    /// A u32-length-prefixed payload (a zero-copy slice where contiguous).
    #[inline]
    fn payload(&mut self) -> Result<Bytes, WireError> {
        let len = self.u32("payload length")? as usize;
        check_len(
            "payload length",
            len,
            self.limits.max_payload_bytes as usize,
        )?;
        self.take(len, "payload")
    }

    /// A u32 list count, checked against `max` and against the bytes remaining (each item
    /// takes at least `min_item_len` bytes) before the caller allocates for it.
    fn count(
        &mut self,
        what: &'static str,
        max: u32,
        min_item_len: usize,
    ) -> Result<usize, WireError> {
        let count = self.u32(what)?;
        check_count(what, count as usize, max)?;
        let needed = u64::from(count) * min_item_len as u64;
        if needed > self.remaining() as u64 {
            return Err(self.malformed(format!(
                "{what} {count} needs at least {needed} bytes, {} remain",
                self.remaining()
            )));
        }
        Ok(count as usize)
    }

    fn stream_kind(&mut self) -> Result<StreamKind, WireError> {
        let code = self.u8("stream kind")?;
        StreamKind::from_u8(code)
            .ok_or_else(|| self.malformed(format!("unknown stream kind {code}")))
    }

    fn fsync_mode(&mut self) -> Result<FsyncMode, WireError> {
        let code = self.u8("fsync mode")?;
        FsyncMode::from_u8(code).ok_or_else(|| self.malformed(format!("unknown fsync mode {code}")))
    }

    fn hash_kind(&mut self) -> Result<HashKind, WireError> {
        let code = self.u8("hash kind")?;
        HashKind::from_u8(code).ok_or_else(|| self.malformed(format!("unknown hash kind {code}")))
    }

    fn finish(&self) -> Result<(), WireError> {
        if self.remaining() != 0 {
            return Err(self.malformed(format!("{} trailing bytes", self.remaining())));
        }
        Ok(())
    }

    fn hello_ok(&mut self) -> Result<HelloOk, WireError> {
        let version = self.u16("version")?;
        let features = self.u64("features")?;
        let limits = Limits {
            max_frame_bytes: self.u32("max_frame_bytes")?,
            max_batch_records: self.u32("max_batch_records")?,
            max_payload_bytes: self.u32("max_payload_bytes")?,
            max_key_bytes: self.u16("max_key_bytes")?,
            max_name_bytes: self.u16("max_name_bytes")?,
            max_shards: self.u32("max_shards")?,
        };
        let count = self.count("core port count", CORES_MAX, CORE_PORT_LEN)?;
        let mut core_ports = Vec::with_capacity(count);
        for _ in 0..count {
            core_ports.push(self.u16("core port")?);
        }
        let count = self.count("stream count", LISTED_STREAMS_MAX, ROUTE_LEN_MIN)?;
        let mut shard_map = Vec::with_capacity(count);
        for _ in 0..count {
            let name = self.name()?;
            let kind = self.stream_kind()?;
            let shard_count = self.u32("shard_count")?;
            let hash = self.hash_kind()?;
            let cores = self.count("shard count", self.limits.max_shards, CORE_PORT_LEN)?;
            check_route_cores(shard_count, cores)?;
            let mut shard_cores = Vec::with_capacity(cores);
            for _ in 0..cores {
                shard_cores.push(self.u16("shard core")?);
            }
            shard_map.push(StreamRoute {
                name,
                kind,
                shard_count,
                hash,
                shard_cores,
            });
        }
        Ok(HelloOk {
            version,
            features,
            limits,
            core_ports,
            shard_map,
        })
    }

    fn stream_info(&mut self) -> Result<StreamInfo, WireError> {
        let request_id = self.u64("request_id")?;
        let name = self.name()?;
        let kind = self.stream_kind()?;
        let hash = self.hash_kind()?;
        let count = self.count("shard count", self.limits.max_shards, SHARD_INFO_LEN)?;
        let mut shards = Vec::with_capacity(count);
        for _ in 0..count {
            shards.push(ShardInfo {
                shard: self.u32("shard")?,
                core: self.u16("core")?,
                oldest_offset: self.u64("oldest_offset")?,
                next_offset: self.u64("next_offset")?,
            });
        }
        Ok(StreamInfo {
            request_id,
            name,
            kind,
            hash,
            shards,
        })
    }

    fn cluster_map(&mut self) -> Result<ClusterMap, WireError> {
        let request_id = self.u64("request_id")?;
        let member = self.u16("member")?;
        let count = self.count("member count", CLUSTER_MEMBERS_MAX, CLUSTER_MEMBER_LEN_MIN)?;
        let mut members = Vec::with_capacity(count);
        for _ in 0..count {
            members.push(ClusterMember {
                id: self.u16("member id")?,
                addr: self.string("member address length", CLUSTER_ADDRESS_BYTES_MAX)?,
            });
        }
        let count = self.count("stream count", LISTED_STREAMS_MAX, CLUSTER_ROUTE_LEN_MIN)?;
        let mut streams = Vec::with_capacity(count);
        for _ in 0..count {
            let name = self.name()?;
            let shards = self.count("shard count", self.limits.max_shards, CLUSTER_LEADER_LEN)?;
            let mut leaders = Vec::with_capacity(shards);
            for _ in 0..shards {
                leaders.push(self.u16("leader")?);
            }
            streams.push(ClusterRoute { name, leaders });
        }
        Ok(ClusterMap {
            request_id,
            member,
            members,
            streams,
        })
    }

    fn stream_list(&mut self) -> Result<Frame, WireError> {
        let request_id = self.u64("request_id")?;
        let count = self.count("stream count", LISTED_STREAMS_MAX, SUMMARY_LEN_MIN)?;
        let mut streams = Vec::with_capacity(count);
        for _ in 0..count {
            streams.push(StreamSummary {
                name: self.name()?,
                kind: self.stream_kind()?,
                shard_count: self.u32("shard_count")?,
            });
        }
        Ok(Frame::StreamList {
            request_id,
            streams,
        })
    }

    /// A `Publish` body, or with `producer` a `ProducerPublish` body (the producer, sequence
    /// and shard between the stream name and the records, returned apart).
    #[allow(clippy::type_complexity)]
    fn publish(&mut self, producer: bool) -> Result<(Publish, Option<(u64, u64, u32)>), WireError> {
        let request_id = self.u64("request_id")?;
        let code = self.u8("ack mode")?;
        let ack = AckMode::from_u8(code)
            .ok_or_else(|| self.malformed(format!("unknown ack mode {code}")))?;
        let stream = self.name()?;
        let fields = if producer {
            Some((
                self.u64("producer")?,
                self.u64("sequence")?,
                self.u32("shard")?,
            ))
        } else {
            None
        };
        let count = self.count(
            "record count",
            self.limits.max_batch_records,
            PUBLISH_RECORD_OVERHEAD,
        )?;
        let mut records = Vec::with_capacity(count);
        for _ in 0..count {
            records.push(Record {
                key: self.key()?,
                payload: self.payload()?,
            });
        }
        Ok((
            Publish {
                request_id,
                ack,
                stream,
                records,
            },
            fields,
        ))
    }

    fn ack(&mut self) -> Result<Ack, WireError> {
        let request_id = self.u64("request_id")?;
        let count = self.count("shard count", self.limits.max_shards, SHARD_ACK_LEN)?;
        let mut shards = Vec::with_capacity(count);
        for _ in 0..count {
            shards.push(ShardAck {
                shard: self.u32("shard")?,
                first_offset: self.u64("first_offset")?,
                count: self.u32("count")?,
            });
        }
        Ok(Ack { request_id, shards })
    }

    fn shard_offsets(&mut self) -> Result<Vec<(u32, u64)>, WireError> {
        let count = self.count("shard count", self.limits.max_shards, SHARD_OFFSET_LEN)?;
        let mut shards = Vec::with_capacity(count);
        for _ in 0..count {
            shards.push((self.u32("shard")?, self.u64("offset")?));
        }
        Ok(shards)
    }

    fn subscribe(&mut self) -> Result<Subscribe, WireError> {
        let request_id = self.u64("request_id")?;
        let stream = self.name()?;
        let shards = match self.u8("shard selection")? {
            SHARDS_ALL => ShardSelection::All,
            SHARDS_LIST => {
                let count = self.count("shard count", self.limits.max_shards, SHARD_LEN)?;
                let mut shards = Vec::with_capacity(count);
                for _ in 0..count {
                    shards.push(self.u32("shard")?);
                }
                ShardSelection::List(shards)
            }
            tag => return Err(self.malformed(format!("unknown shard selection {tag}"))),
        };
        let from = match self.u8("start position")? {
            FROM_LATEST => StartPosition::Latest,
            FROM_EARLIEST => StartPosition::Earliest,
            FROM_OFFSETS => StartPosition::Offsets(self.shard_offsets()?),
            tag => return Err(self.malformed(format!("unknown start position {tag}"))),
        };
        Ok(Subscribe {
            request_id,
            stream,
            shards,
            from,
        })
    }

    fn delivery(&mut self) -> Result<Delivery, WireError> {
        Ok(Delivery {
            records: self.delivered_records()?,
        })
    }

    fn delivered_records(&mut self) -> Result<Vec<DeliveredRecord>, WireError> {
        let count = self.count(
            "record count",
            self.limits.max_batch_records,
            DELIVERED_RECORD_OVERHEAD,
        )?;
        let mut records = Vec::with_capacity(count);
        for _ in 0..count {
            records.push(DeliveredRecord {
                shard: self.u32("shard")?,
                offset: self.u64("offset")?,
                timestamp_us: self.u64("timestamp_us")?,
                key: self.key()?,
                payload: self.payload()?,
            });
        }
        Ok(records)
    }

    fn error(&mut self) -> Result<ErrorFrame, WireError> {
        let request_id = self.u64("request_id")?;
        let code = self.u16("error code")?;
        let code = ErrorCode::from_u16(code)
            .ok_or_else(|| self.malformed(format!("unknown error code {code}")))?;
        Ok(ErrorFrame {
            request_id,
            code,
            detail: self.u64("detail")?,
            message: self.string("error message length", ERROR_MESSAGE_BYTES_MAX)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FEATURE_PRODUCER;

    fn decoder() -> Decoder {
        Decoder::new(Limits::DEFAULT)
    }

    fn header(body_len: u32, frame_type: u8, flags: u8) -> BytesMut {
        let mut buf = BytesMut::new();
        buf.put_u32_le(body_len);
        buf.put_u8(frame_type);
        buf.put_u8(flags);
        buf
    }

    // A header announcing a body over max_frame_bytes fails at once, with no body present.
    #[test]
    fn oversized_length_fails_before_the_body_arrives() {
        let max = Limits::DEFAULT.max_frame_bytes;
        let mut buf = header(max + 1, FrameType::Publish as u8, 0);
        let err = decoder().decode(&mut buf).unwrap_err();
        assert_eq!(
            err,
            WireError::FrameTooLarge {
                len: u64::from(max) + 1,
                max
            }
        );
        assert_eq!(err.code(), ErrorCode::FrameTooLarge);
        let mut buf = header(u32::MAX, FrameType::Delivery as u8, 0);
        assert_eq!(
            decoder().decode(&mut buf).unwrap_err().code(),
            ErrorCode::FrameTooLarge
        );
    }

    // A body of exactly max_frame_bytes is acceptable: the header alone waits for more bytes.
    #[test]
    fn length_at_the_limit_waits_for_the_body() {
        let mut buf = header(Limits::DEFAULT.max_frame_bytes, FrameType::Publish as u8, 0);
        assert_eq!(decoder().decode(&mut buf), Ok(None));
        assert_eq!(buf.len(), FRAME_HEADER_LEN);
    }

    // Unknown frame types and non-zero flags are refused from the header alone.
    #[test]
    fn bad_type_and_flags_fail_from_the_header() {
        let mut buf = header(8, 0x7e, 0);
        assert_eq!(
            decoder().decode(&mut buf),
            Err(WireError::UnknownFrameType(0x7e))
        );
        let mut buf = header(8, FrameType::Done as u8, 1);
        assert_eq!(
            decoder().decode(&mut buf).unwrap_err().code(),
            ErrorCode::Malformed
        );
        assert_eq!(
            decoder().decode_body(0, Bytes::new()),
            Err(WireError::UnknownFrameType(0))
        );
    }

    // Two frames back to back come out one at a time, and a partial third waits.
    #[test]
    fn frames_come_out_one_at_a_time() {
        let mut buf = BytesMut::new();
        encode(&Frame::Done { request_id: 1 }, &mut buf);
        encode(&Frame::ListStreams { request_id: 2 }, &mut buf);
        encode(&Frame::Done { request_id: 3 }, &mut buf);
        buf.truncate(buf.len() - 1);
        let d = decoder();
        assert_eq!(d.decode(&mut buf), Ok(Some(Frame::Done { request_id: 1 })));
        assert_eq!(
            d.decode(&mut buf),
            Ok(Some(Frame::ListStreams { request_id: 2 }))
        );
        assert_eq!(d.decode(&mut buf), Ok(None));
        assert_eq!(buf.len(), FRAME_HEADER_LEN + REQUEST_ID_LEN - 1);
    }

    // Keys and payloads of a decoded publish point into the received buffer (no copy).
    #[test]
    fn decoded_payloads_are_slices_of_the_frame() {
        let mut buf = BytesMut::new();
        let frame = Frame::Publish(Publish {
            request_id: 9,
            ack: AckMode::Acked,
            stream: "s".into(),
            records: vec![Record {
                key: Bytes::from_static(b"key"),
                payload: Bytes::from(vec![7u8; 100]),
            }],
        });
        encode(&frame, &mut buf);
        let range = buf.as_ptr_range();
        let Ok(Some(Frame::Publish(publish))) = decoder().decode(&mut buf) else {
            panic!("expected a publish");
        };
        let payload = publish.records[0].payload.as_ptr_range();
        assert!(range.start <= payload.start && payload.end <= range.end);
    }

    // Long client names and error messages are truncated on a character boundary.
    #[test]
    fn encoder_truncates_client_name_and_message_on_char_boundaries() {
        let message = "é".repeat(ERROR_MESSAGE_BYTES_MAX); // 2 bytes per character
        let frame = Frame::Error(ErrorFrame {
            request_id: 1,
            code: ErrorCode::Internal,
            detail: 0,
            message: format!("x{message}"),
        });
        let mut buf = BytesMut::new();
        encode(&frame, &mut buf);
        assert_eq!(buf.len(), encoded_len(&frame));
        let Ok(Some(Frame::Error(error))) = decoder().decode(&mut buf) else {
            panic!("expected an error frame");
        };
        // "x" + 511 "é" = 1023 bytes: the 512th "é" would cross the 1024-byte limit.
        assert_eq!(error.message.len(), ERROR_MESSAGE_BYTES_MAX - 1);
        let hello = Frame::Hello(Hello {
            min_version: 1,
            max_version: 1,
            features: 0,
            client_name: "€".repeat(100), // 3 bytes per character
            token: None,
        });
        let mut buf = BytesMut::new();
        encode(&hello, &mut buf);
        let Ok(Some(Frame::Hello(hello))) = decoder().decode(&mut buf) else {
            panic!("expected a hello");
        };
        assert_eq!(hello.client_name, "€".repeat(85));
    }

    // The token bit decides whether a token follows the client name: a token of exactly
    // TOKEN_BYTES_MAX decodes, one byte more is LimitExceeded (decoder and `validate`), a set
    // bit without the token bytes is Malformed, and unknown feature bits are carried as sent.
    #[test]
    fn hello_token_follows_the_feature_bit() {
        let hello = |token: Option<usize>, features: u64| {
            Frame::Hello(Hello {
                min_version: 1,
                max_version: 1,
                features,
                client_name: "c".into(),
                token: token.map(|len| Bytes::from(vec![b't'; len])),
            })
        };
        let unknown_bit = 1 << 40;
        let mut buf = BytesMut::new();
        encode(&hello(Some(TOKEN_BYTES_MAX), unknown_bit), &mut buf);
        let Ok(Some(Frame::Hello(decoded))) = decoder().decode(&mut buf) else {
            panic!("a token at its limit decodes");
        };
        assert_eq!(decoded.features, unknown_bit | FEATURE_TOKEN);
        assert_eq!(
            decoded.token.map(|token| token.len()),
            Some(TOKEN_BYTES_MAX)
        );
        let over = hello(Some(TOKEN_BYTES_MAX + 1), 0);
        assert!(matches!(
            validate(&over, &Limits::DEFAULT),
            Err(WireError::LimitExceeded { .. })
        ));
        let mut buf = BytesMut::new();
        encode(&over, &mut buf);
        assert!(matches!(
            decoder().decode(&mut buf),
            Err(WireError::LimitExceeded { .. })
        ));
        // The bit set by hand on a Hello encoded without a token: nothing follows the name.
        let mut buf = BytesMut::new();
        encode(&hello(None, 0), &mut buf);
        buf[FRAME_HEADER_LEN + 4] |= FEATURE_TOKEN as u8;
        assert!(matches!(
            decoder().decode(&mut buf),
            Err(WireError::Malformed { .. })
        ));
        // A hello built with the bit but no token is encoded without both.
        let mut buf = BytesMut::new();
        encode(&hello(None, FEATURE_TOKEN), &mut buf);
        let Ok(Some(Frame::Hello(decoded))) = decoder().decode(&mut buf) else {
            panic!("a hello without a token decodes");
        };
        assert_eq!((decoded.features, decoded.token), (0, None));
        // Debug never shows the token's bytes.
        let shown = format!("{:?}", hello(Some(5), 0));
        assert!(
            shown.contains("<5 bytes>") && !shown.contains("ttttt"),
            "{shown}"
        );
    }

    // Limit boundaries: exactly at a limit decodes, one over is LimitExceeded, both in the
    // decoder and in `validate`.
    #[test]
    fn limits_are_inclusive() {
        let limits = Limits {
            max_key_bytes: 4,
            max_payload_bytes: 8,
            max_name_bytes: 3,
            max_batch_records: 2,
            ..Limits::DEFAULT
        };
        let d = Decoder::new(limits);
        let publish = |stream: &str, key: usize, payload: usize, n: usize| {
            Frame::Publish(Publish {
                request_id: 1,
                ack: AckMode::Acked,
                stream: stream.into(),
                records: vec![
                    Record {
                        key: Bytes::from(vec![b'k'; key]),
                        payload: Bytes::from(vec![b'p'; payload]),
                    };
                    n
                ],
            })
        };
        let roundtrip = |frame: &Frame| {
            let mut buf = BytesMut::new();
            encode(frame, &mut buf);
            d.decode(&mut buf).map(|f| f.expect("whole frame"))
        };
        let ok = publish("abc", 4, 8, 2);
        assert_eq!(validate(&ok, &limits), Ok(()));
        assert_eq!(roundtrip(&ok), Ok(ok));
        for bad in [
            publish("abcd", 4, 8, 2),
            publish("abc", 5, 8, 2),
            publish("abc", 4, 9, 2),
            publish("abc", 4, 8, 3),
        ] {
            let err = roundtrip(&bad).unwrap_err();
            assert_eq!(err.code(), ErrorCode::LimitExceeded, "{err}");
            assert_eq!(validate(&bad, &limits), Err(err));
        }
    }

    // Every enum byte outside its defined values is Malformed.
    #[test]
    fn unknown_enum_values_are_malformed() {
        let d = decoder();
        let mut create = BytesMut::new();
        create.put_u64_le(1);
        create.put_u16_le(1);
        create.put_slice(b"s");
        create.put_u32_le(1);
        create.put_u8(2); // stream kind 2 does not exist
        let err = d
            .decode_body(FrameType::CreateStream as u8, create.freeze())
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::Malformed);

        let mut error = BytesMut::new();
        error.put_u64_le(1);
        error.put_u16_le(7); // error code 7 does not exist
        error.put_u64_le(0);
        error.put_u16_le(0);
        let err = d
            .decode_body(FrameType::Error as u8, error.freeze())
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::Malformed);

        for (selection, position) in [(2u8, 0u8), (0, 3)] {
            let mut subscribe = BytesMut::new();
            subscribe.put_u64_le(1);
            subscribe.put_u16_le(1);
            subscribe.put_slice(b"s");
            subscribe.put_u8(selection);
            subscribe.put_u8(position);
            let err = d
                .decode_body(FrameType::Subscribe as u8, subscribe.freeze())
                .unwrap_err();
            assert_eq!(err.code(), ErrorCode::Malformed);
        }

        let mut publish = BytesMut::new();
        encode_publish_header(1, AckMode::Acked, "s", 0, 0, &mut publish);
        publish[FRAME_HEADER_LEN + REQUEST_ID_LEN] = 2; // ack mode 2 does not exist
        let err = d.decode(&mut publish).unwrap_err();
        assert_eq!(err.code(), ErrorCode::Malformed);
    }

    // Trailing bytes after a complete body are Malformed.
    #[test]
    fn trailing_bytes_are_malformed() {
        let mut body = BytesMut::new();
        body.put_u64_le(5);
        body.put_u8(0);
        let err = decoder()
            .decode_body(FrameType::Done as u8, body.freeze())
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::Malformed);
        assert!(err.to_string().contains("1 trailing bytes"), "{err}");
    }

    // Invalid UTF-8 in a stream name is Malformed.
    #[test]
    fn invalid_utf8_is_malformed() {
        let mut body = BytesMut::new();
        body.put_u64_le(5);
        body.put_u16_le(2);
        body.put_slice(&[0xc3, 0x28]);
        let err = decoder()
            .decode_body(FrameType::DescribeStream as u8, body.freeze())
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::Malformed);
    }

    // A route whose core list disagrees with its shard count is Malformed, in both directions.
    #[test]
    fn route_core_list_must_match_shard_count() {
        let frame = Frame::HelloOk(HelloOk {
            version: 1,
            features: 0,
            limits: Limits::DEFAULT,
            core_ports: vec![7400],
            shard_map: vec![StreamRoute {
                name: "s".into(),
                kind: StreamKind::InMemory,
                shard_count: 2,
                hash: HashKind::Fnv1a64Mod,
                shard_cores: vec![0],
            }],
        });
        let err = validate(&frame, &Limits::DEFAULT).unwrap_err();
        assert_eq!(err.code(), ErrorCode::Malformed);
        let mut buf = BytesMut::new();
        encode(&frame, &mut buf);
        assert_eq!(decoder().decode(&mut buf), Err(err));
    }

    // Frame type codes round-trip through from_u8, and nothing else decodes to a type.
    #[test]
    fn frame_type_codes_are_exhaustive() {
        for code in 0..=u8::MAX {
            match FrameType::from_u8(code) {
                Some(t) => assert_eq!(t as u8, code),
                None => assert!(!FrameType::ALL.iter().any(|t| *t as u8 == code)),
            }
        }
        assert!(
            FrameType::ALL
                .iter()
                .all(|t| FrameType::from_u8(*t as u8) == Some(*t))
        );
    }

    // A ProducerPublish cut inside its producer, sequence or shard field is Malformed, and a
    // record count over the limit is LimitExceeded, as in a Publish.
    #[test]
    fn producer_publish_refusals() {
        let frame = Frame::ProducerPublish(ProducerPublish {
            publish: Publish {
                request_id: 1,
                ack: AckMode::Acked,
                stream: "s".into(),
                records: vec![Record {
                    key: Bytes::from_static(b"k"),
                    payload: Bytes::from_static(b"v"),
                }],
            },
            producer: 5,
            sequence: 2,
            shard: 0,
        });
        let mut whole = BytesMut::new();
        encode(&frame, &mut whole);
        let body = whole.split_off(FRAME_HEADER_LEN).freeze();
        let fields = REQUEST_ID_LEN + 1 + 2 + 1;
        for cut in fields..fields + PRODUCER_FIELDS_LEN {
            let err = decoder()
                .decode_body(FrameType::ProducerPublish as u8, body.slice(..cut))
                .unwrap_err();
            assert_eq!(err.code(), ErrorCode::Malformed, "cut at {cut}");
        }
        let mut limits = Limits::DEFAULT;
        limits.max_batch_records = 0;
        let err = validate(&frame, &limits).unwrap_err();
        assert_eq!(err.code(), ErrorCode::LimitExceeded);
        assert_eq!(
            Decoder::new(limits).decode_body(FrameType::ProducerPublish as u8, body),
            Err(err)
        );
    }

    // The producer feature bit is carried by Hello like any other, next to a token or not.
    #[test]
    fn hello_carries_the_producer_feature() {
        for token in [None, Some(Bytes::from_static(b"felix_a_b"))] {
            let frame = Frame::Hello(Hello {
                min_version: 1,
                max_version: 1,
                features: FEATURE_PRODUCER | (u64::from(token.is_some()) * FEATURE_TOKEN),
                client_name: "c".into(),
                token,
            });
            let mut buf = BytesMut::new();
            encode(&frame, &mut buf);
            assert_eq!(decoder().decode(&mut buf), Ok(Some(frame)));
        }
    }
}
