//! Property tests of the codec through its public API: round trips of every frame variant,
//! every truncation, random corruption and garbage, the publisher fast path, and `validate`
//! agreeing with the decoder.

use bytes::{Bytes, BytesMut};
use felix_wire::{
    Ack, AckMode, CreateStream, Decoder, DeliveredRecord, Delivery, ErrorCode, ErrorFrame,
    FRAME_HEADER_LEN, Frame, FrameType, FsyncMode, HashKind, Hello, HelloOk, Limits,
    PRODUCER_FIELDS_LEN, ProducerHeader, ProducerPublish, Publish, Record, ShardAck, ShardInfo,
    ShardSelection, StartPosition, StreamInfo, StreamKind, StreamRoute, StreamSummary, Subscribe,
    Subscribed, encode, encode_delivery_vectored, encode_producer_publish_header,
    encode_publish_header, encode_record, encode_record_head, encoded_len, encoded_publish_len,
    encoded_record_len, validate,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{FileFailurePersistence, TestCaseError};

/// Small limits, so generated frames reach every limit exactly while staying small enough for
/// the quadratic truncation test.
const LIMITS: Limits = Limits {
    max_frame_bytes: 1024,
    max_batch_records: 8,
    max_payload_bytes: 64,
    max_key_bytes: 16,
    max_name_bytes: 24,
    max_shards: 8,
};

/// Upper bounds of generated sizes.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// Characters per name; a char is up to 4 UTF-8 bytes.
    name_chars: usize,
    key_bytes: usize,
    payload_bytes: usize,
    records: usize,
    shards: usize,
    streams: usize,
}

/// Frames within `LIMITS` (6 chars x 4 bytes = 24 = max_name_bytes; the largest Delivery is
/// 4 + 8 x (26 + 16 + 64) = 852 bytes <= max_frame_bytes).
const VALID: Sizes = Sizes {
    name_chars: 6,
    key_bytes: 16,
    payload_bytes: 64,
    records: 8,
    shards: 8,
    streams: 4,
};

/// Frames that are sometimes over `LIMITS`, to compare `validate` with the decoder.
const LOOSE: Sizes = Sizes {
    name_chars: 8,
    key_bytes: 20,
    payload_bytes: 80,
    records: 10,
    shards: 10,
    streams: 4,
};

/// Default case count (256); failing seeds are kept next to this file
/// (`properties.regressions`), since an integration test has no lib.rs for proptest to find.
fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    }
}

fn text(max_chars: usize) -> impl Strategy<Value = String> {
    vec(any::<char>(), 0..=max_chars).prop_map(|chars| chars.into_iter().collect())
}

fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..=max).prop_map(Bytes::from)
}

fn stream_kind() -> impl Strategy<Value = StreamKind> {
    select(vec![StreamKind::InMemory, StreamKind::Durable])
}

fn shard_offsets(max: usize) -> impl Strategy<Value = Vec<(u32, u64)>> {
    vec((any::<u32>(), any::<u64>()), 0..=max)
}

fn route(sz: Sizes) -> impl Strategy<Value = StreamRoute> {
    (
        text(sz.name_chars),
        stream_kind(),
        vec(any::<u16>(), 0..=sz.shards),
    )
        .prop_map(|(name, kind, shard_cores)| StreamRoute {
            name,
            kind,
            shard_count: u32::try_from(shard_cores.len()).expect("at most sz.shards"),
            hash: HashKind::Fnv1a64Mod,
            shard_cores,
        })
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u16>(),
        any::<u16>(),
        any::<u32>(),
    )
        .prop_map(|(frame, batch, payload, key, name, shards)| Limits {
            max_frame_bytes: frame,
            max_batch_records: batch,
            max_payload_bytes: payload,
            max_key_bytes: key,
            max_name_bytes: name,
            max_shards: shards,
        })
}

/// Frames of type `t` with sizes up to `sz`.
fn frame_of(t: FrameType, sz: Sizes) -> BoxedStrategy<Frame> {
    let name = move || text(sz.name_chars);
    match t {
        FrameType::Hello => (
            any::<u16>(),
            any::<u16>(),
            any::<u64>(),
            text(60),
            proptest::option::of(vec(any::<u8>(), 0..=100)),
        )
            .prop_map(|(min_version, max_version, features, client_name, token)| {
                // The token bit says whether the token is on the wire: it matches `token`.
                let features = if token.is_some() {
                    features | felix_wire::FEATURE_TOKEN
                } else {
                    features & !felix_wire::FEATURE_TOKEN
                };
                Frame::Hello(Hello {
                    min_version,
                    max_version,
                    features,
                    client_name,
                    token: token.map(Bytes::from),
                })
            })
            .boxed(),
        FrameType::HelloOk => (
            any::<u16>(),
            any::<u64>(),
            limits(),
            vec(any::<u16>(), 0..=8),
            vec(route(sz), 0..=sz.streams),
        )
            .prop_map(|(version, features, limits, core_ports, shard_map)| {
                Frame::HelloOk(HelloOk {
                    version,
                    features,
                    limits,
                    core_ports,
                    shard_map,
                })
            })
            .boxed(),
        FrameType::CreateStream => (any::<u64>(), name(), any::<u32>(), stream_kind())
            .prop_map(|(request_id, name, shard_count, kind)| {
                Frame::CreateStream(CreateStream {
                    request_id,
                    name,
                    shard_count,
                    kind,
                })
            })
            .boxed(),
        FrameType::DescribeStream => (any::<u64>(), name())
            .prop_map(|(request_id, name)| Frame::DescribeStream { request_id, name })
            .boxed(),
        FrameType::ListStreams => any::<u64>()
            .prop_map(|request_id| Frame::ListStreams { request_id })
            .boxed(),
        FrameType::DeleteStream => (any::<u64>(), name())
            .prop_map(|(request_id, name)| Frame::DeleteStream { request_id, name })
            .boxed(),
        FrameType::StreamInfo => {
            let shard = (any::<u32>(), any::<u16>(), any::<u64>(), any::<u64>()).prop_map(
                |(shard, core, oldest_offset, next_offset)| ShardInfo {
                    shard,
                    core,
                    oldest_offset,
                    next_offset,
                },
            );
            (
                any::<u64>(),
                name(),
                stream_kind(),
                vec(shard, 0..=sz.shards),
            )
                .prop_map(|(request_id, name, kind, shards)| {
                    Frame::StreamInfo(StreamInfo {
                        request_id,
                        name,
                        kind,
                        hash: HashKind::Fnv1a64Mod,
                        shards,
                    })
                })
                .boxed()
        }
        FrameType::StreamList => {
            let summary =
                (name(), stream_kind(), any::<u32>()).prop_map(|(name, kind, shard_count)| {
                    StreamSummary {
                        name,
                        kind,
                        shard_count,
                    }
                });
            (any::<u64>(), vec(summary, 0..=sz.streams))
                .prop_map(|(request_id, streams)| Frame::StreamList {
                    request_id,
                    streams,
                })
                .boxed()
        }
        FrameType::Done => any::<u64>()
            .prop_map(|request_id| Frame::Done { request_id })
            .boxed(),
        FrameType::DescribeCluster => any::<u64>()
            .prop_map(|request_id| Frame::DescribeCluster { request_id })
            .boxed(),
        FrameType::ClusterMap => {
            let member = (any::<u16>(), text(16))
                .prop_map(|(id, addr)| felix_wire::ClusterMember { id, addr });
            let route = (name(), vec(any::<u16>(), 0..=sz.shards))
                .prop_map(|(name, leaders)| felix_wire::ClusterRoute { name, leaders });
            (
                any::<u64>(),
                any::<u16>(),
                vec(member, 0..=4),
                vec(route, 0..=sz.streams),
            )
                .prop_map(|(request_id, member, members, streams)| {
                    Frame::ClusterMap(felix_wire::ClusterMap {
                        request_id,
                        member,
                        members,
                        streams,
                    })
                })
                .boxed()
        }
        FrameType::CreateClusterStream => (
            any::<u64>(),
            name(),
            any::<u32>(),
            stream_kind(),
            any::<u8>(),
            select(vec![FsyncMode::OnCommit, FsyncMode::Periodic]),
        )
            .prop_map(|(request_id, name, shard_count, kind, replicas, fsync)| {
                Frame::CreateClusterStream(felix_wire::CreateClusterStream {
                    request_id,
                    name,
                    shard_count,
                    kind,
                    replicas,
                    fsync,
                })
            })
            .boxed(),
        FrameType::DeleteClusterStream => (any::<u64>(), name())
            .prop_map(|(request_id, name)| Frame::DeleteClusterStream { request_id, name })
            .boxed(),
        FrameType::ReadShard => (
            any::<u64>(),
            name(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
        )
            .prop_map(|(request_id, stream, shard, from, max_records)| {
                Frame::ReadShard(felix_wire::ReadShard {
                    request_id,
                    stream,
                    shard,
                    from,
                    max_records,
                })
            })
            .boxed(),
        FrameType::Records => (any::<u64>(), vec(delivered_record(sz), 0..=sz.records))
            .prop_map(|(request_id, records)| {
                Frame::Records(felix_wire::Records {
                    request_id,
                    records,
                })
            })
            .boxed(),
        FrameType::Publish => publish(sz).prop_map(Frame::Publish).boxed(),
        FrameType::ProducerPublish => producer_publish(sz)
            .prop_map(Frame::ProducerPublish)
            .boxed(),
        FrameType::Ack => {
            let shard = (any::<u32>(), any::<u64>(), any::<u32>()).prop_map(
                |(shard, first_offset, count)| ShardAck {
                    shard,
                    first_offset,
                    count,
                },
            );
            (any::<u64>(), vec(shard, 0..=sz.shards))
                .prop_map(|(request_id, shards)| Frame::Ack(Ack { request_id, shards }))
                .boxed()
        }
        FrameType::Subscribe => {
            let selection = prop_oneof![
                Just(ShardSelection::All),
                vec(any::<u32>(), 0..=sz.shards).prop_map(ShardSelection::List),
            ];
            let from = prop_oneof![
                Just(StartPosition::Latest),
                Just(StartPosition::Earliest),
                shard_offsets(sz.shards).prop_map(StartPosition::Offsets),
            ];
            (any::<u64>(), name(), selection, from)
                .prop_map(|(request_id, stream, shards, from)| {
                    Frame::Subscribe(Subscribe {
                        request_id,
                        stream,
                        shards,
                        from,
                    })
                })
                .boxed()
        }
        FrameType::Subscribed => (any::<u64>(), shard_offsets(sz.shards))
            .prop_map(|(request_id, shards)| Frame::Subscribed(Subscribed { request_id, shards }))
            .boxed(),
        FrameType::Delivery => vec(delivered_record(sz), 0..=sz.records)
            .prop_map(|records| Frame::Delivery(Delivery { records }))
            .boxed(),
        FrameType::Error => (
            any::<u64>(),
            select(ErrorCode::ALL.to_vec()),
            any::<u64>(),
            text(40),
        )
            .prop_map(|(request_id, code, detail, message)| {
                Frame::Error(ErrorFrame {
                    request_id,
                    code,
                    detail,
                    message,
                })
            })
            .boxed(),
    }
}

fn delivered_record(sz: Sizes) -> impl Strategy<Value = DeliveredRecord> {
    (
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        bytes(sz.key_bytes),
        bytes(sz.payload_bytes),
    )
        .prop_map(
            |(shard, offset, timestamp_us, key, payload)| DeliveredRecord {
                shard,
                offset,
                timestamp_us,
                key,
                payload,
            },
        )
}

fn publish(sz: Sizes) -> impl Strategy<Value = Publish> {
    let record = (bytes(sz.key_bytes), bytes(sz.payload_bytes))
        .prop_map(|(key, payload)| Record { key, payload });
    (
        any::<u64>(),
        select(vec![AckMode::Acked, AckMode::FireAndForget]),
        text(sz.name_chars),
        vec(record, 0..=sz.records),
    )
        .prop_map(|(request_id, ack, stream, records)| Publish {
            request_id,
            ack,
            stream,
            records,
        })
}

fn producer_publish(sz: Sizes) -> impl Strategy<Value = ProducerPublish> {
    (publish(sz), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(
        |(publish, producer, sequence, shard)| ProducerPublish {
            publish,
            producer,
            sequence,
            shard,
        },
    )
}

/// Any frame type, with sizes up to `sz`.
fn any_frame(sz: Sizes) -> impl Strategy<Value = Frame> {
    select(FrameType::ALL.to_vec()).prop_flat_map(move |t| frame_of(t, sz))
}

/// A publish's frame header and fixed body from the publisher fast path, and the encoded
/// length of its records (what must follow).
fn publish_header(publish: &Publish) -> (BytesMut, usize) {
    let records_len: usize = publish
        .records
        .iter()
        .map(|r| encoded_record_len(r.key.len(), r.payload.len()))
        .sum();
    let count = u32::try_from(publish.records.len()).expect("at most VALID.records");
    let mut head = BytesMut::new();
    encode_publish_header(
        publish.request_id,
        publish.ack,
        &publish.stream,
        count,
        records_len,
        &mut head,
    );
    (head, records_len)
}

fn encoded(frame: &Frame) -> BytesMut {
    let mut buf = BytesMut::new();
    encode(frame, &mut buf);
    buf
}

fn check_roundtrip(frame: &Frame) -> Result<(), TestCaseError> {
    prop_assert_eq!(validate(frame, &LIMITS), Ok(()));
    let mut buf = encoded(frame);
    prop_assert_eq!(buf.len(), encoded_len(frame));
    prop_assert_eq!(buf[4], frame.frame_type() as u8);
    let body = Bytes::copy_from_slice(&buf[FRAME_HEADER_LEN..]);
    let decoder = Decoder::new(LIMITS);
    prop_assert_eq!(decoder.decode(&mut buf), Ok(Some(frame.clone())));
    prop_assert!(buf.is_empty(), "decode consumed the whole frame");
    prop_assert_eq!(
        decoder.decode_body(frame.frame_type() as u8, body),
        Ok(frame.clone())
    );
    Ok(())
}

/// Decodes frames from `buf` until it is empty, needs more bytes or fails. Every frame the
/// decoder accepts must re-encode to exactly the bytes it consumed (the encoding is canonical).
fn decode_all(decoder: &Decoder, buf: &mut BytesMut) -> Result<(), TestCaseError> {
    loop {
        let before = buf.clone();
        match decoder.decode(buf) {
            Ok(Some(frame)) => {
                let consumed = before.len() - buf.len();
                prop_assert_eq!(&encoded(&frame)[..], &before[..consumed]);
            }
            Ok(None) => {
                prop_assert_eq!(&before, buf, "Ok(None) consumed nothing");
                return Ok(());
            }
            Err(_) => return Ok(()),
        }
    }
}

// One property per frame variant: a generated valid frame passes `validate`, encodes to
// `encoded_len` bytes, and both `decode` and `decode_body` give back an equal frame.
macro_rules! roundtrip_tests {
    ($($test:ident => $frame_type:expr,)*) => {
        proptest! {
            #![proptest_config(config())]
            $(
                #[test]
                fn $test(frame in frame_of($frame_type, VALID)) {
                    // Proves: this variant round-trips through encode, decode and decode_body.
                    check_roundtrip(&frame)?;
                }
            )*
        }
    };
}

roundtrip_tests! {
    roundtrip_hello => FrameType::Hello,
    roundtrip_hello_ok => FrameType::HelloOk,
    roundtrip_create_stream => FrameType::CreateStream,
    roundtrip_describe_stream => FrameType::DescribeStream,
    roundtrip_list_streams => FrameType::ListStreams,
    roundtrip_delete_stream => FrameType::DeleteStream,
    roundtrip_stream_info => FrameType::StreamInfo,
    roundtrip_stream_list => FrameType::StreamList,
    roundtrip_done => FrameType::Done,
    roundtrip_publish => FrameType::Publish,
    roundtrip_ack => FrameType::Ack,
    roundtrip_producer_publish => FrameType::ProducerPublish,
    roundtrip_subscribe => FrameType::Subscribe,
    roundtrip_subscribed => FrameType::Subscribed,
    roundtrip_delivery => FrameType::Delivery,
    roundtrip_error => FrameType::Error,
}

proptest! {
    #![proptest_config(config())]

    // Every strict prefix of a valid frame is Ok(None) with nothing consumed, and every strict
    // prefix of its body is an error from decode_body: never a panic, never a short frame.
    #[test]
    fn every_truncation_waits_or_fails(frame in any_frame(VALID)) {
        let full = encoded(&frame);
        let decoder = Decoder::new(LIMITS);
        for len in 0..full.len() {
            let mut prefix = BytesMut::from(&full[..len]);
            prop_assert_eq!(decoder.decode(&mut prefix), Ok(None), "prefix of {} bytes", len);
            prop_assert_eq!(prefix.len(), len);
        }
        let body = Bytes::copy_from_slice(&full[FRAME_HEADER_LEN..]);
        for len in 0..body.len() {
            let result = decoder.decode_body(frame.frame_type() as u8, body.slice(..len));
            prop_assert!(result.is_err(), "body prefix of {} bytes decoded: {:?}", len, result);
        }
    }

    // A frame received in chunks, cut anywhere (body bytes possibly overwritten), decodes with
    // decode_chunks exactly as the whole frame decodes with decode: the same frame or the same
    // error. Only bytes that straddle a cut are copied, so one chunk copies nothing.
    #[test]
    fn split_frames_decode_like_whole_ones(
        frame in any_frame(VALID),
        cuts in vec(any::<prop::sample::Index>(), 0..=8),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 0..=2),
    ) {
        let mut full = encoded(&frame);
        let body_len = full.len() - FRAME_HEADER_LEN;
        for (index, byte) in edits {
            if body_len > 0 {
                full[FRAME_HEADER_LEN + index.index(body_len)] = byte;
            }
        }
        let decoder = Decoder::new(LIMITS);
        let whole = decoder.decode(&mut full.clone()).map(|frame| frame.expect("whole"));
        let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(full.len() + 1)).collect();
        cuts.sort_unstable();
        let full = full.freeze();
        let mut chunks = Vec::new();
        let mut start = 0;
        for cut in cuts.into_iter().chain([full.len()]) {
            chunks.push(full.slice(start..cut));
            start = cut;
        }
        let split = decoder.decode_chunks(&chunks);
        match (&whole, &split) {
            (Ok(frame), Ok((got, copied))) => {
                prop_assert_eq!(frame, got);
                prop_assert!(*copied <= full.len());
                if chunks.iter().filter(|c| !c.is_empty()).count() == 1 {
                    prop_assert_eq!(*copied, 0);
                }
            }
            (Err(error), Err(got)) => prop_assert_eq!(error, got),
            _ => prop_assert!(false, "decode {:?}, decode_chunks {:?}", whole, split),
        }
    }

    // Chunks that do not hold exactly the frame the header announces are refused.
    #[test]
    fn split_frames_of_the_wrong_length_are_refused(frame in any_frame(VALID), extra in 1..4usize) {
        let full = encoded(&frame).freeze();
        let decoder = Decoder::new(LIMITS);
        let short = [full.slice(..full.len() - 1)];
        prop_assert!(decoder.decode_chunks(&short).is_err());
        let long = [full.clone(), Bytes::from(vec![0u8; extra])];
        prop_assert!(decoder.decode_chunks(&long).is_err());
    }

    // Overwriting or flipping random bytes of valid frames gives an error or a valid frame
    // (which re-encodes to the same bytes), never a panic.
    #[test]
    fn corrupted_frames_never_panic(
        frames in vec(any_frame(VALID), 1..=3),
        edits in vec((any::<prop::sample::Index>(), any::<u8>(), any::<bool>()), 1..=6),
    ) {
        let mut buf = BytesMut::new();
        for frame in &frames {
            encode(frame, &mut buf);
        }
        for (index, byte, flip) in edits {
            let i = index.index(buf.len());
            if flip { buf[i] ^= byte | 1 } else { buf[i] = byte }
        }
        decode_all(&Decoder::new(LIMITS), &mut buf)?;
        decode_all(&Decoder::new(Limits::DEFAULT), &mut BytesMut::from(&buf[..]))?;
    }

    // Random garbage never panics the decoder; whatever it accepts is canonical.
    #[test]
    fn garbage_never_panics(garbage in vec(any::<u8>(), 0..512)) {
        decode_all(&Decoder::new(LIMITS), &mut BytesMut::from(&garbage[..]))?;
    }

    // Random bodies behind a valid header of every type reach the body parsers; they never
    // panic, and an accepted body re-encodes to exactly itself.
    #[test]
    fn garbage_bodies_never_panic(
        frame_type in select(FrameType::ALL.to_vec()),
        body in vec(any::<u8>(), 0..256),
    ) {
        let decoder = Decoder::new(Limits::DEFAULT);
        if let Ok(frame) = decoder.decode_body(frame_type as u8, Bytes::from(body.clone())) {
            prop_assert_eq!(&encoded(&frame)[FRAME_HEADER_LEN..], &body[..]);
        }
    }

    // The publisher fast path (header + N records) writes exactly what encode(Publish) writes.
    #[test]
    fn publish_fast_path_matches_encode(publish in publish(VALID)) {
        let (mut fast, records_len) = publish_header(&publish);
        let mut written = 0;
        for record in &publish.records {
            written += encode_record(&record.key, &record.payload, &mut fast);
        }
        prop_assert_eq!(written, records_len);
        let key_payload_bytes: usize =
            publish.records.iter().map(|r| r.key.len() + r.payload.len()).sum();
        let whole = encoded_publish_len(&publish.stream, publish.records.len(), key_payload_bytes);
        let frame = Frame::Publish(publish);
        prop_assert_eq!(&fast[..], &encoded(&frame)[..]);
        // The length a receiver computes for the buffer a decoded publish's records keep alive.
        prop_assert_eq!(whole, encoded_len(&frame));
    }

    // The producer fast path writes what encode(ProducerPublish) writes, and that is the plain
    // Publish of the same records with producer, sequence and shard between the stream name
    // and the record count (docs/wire-protocol.md, 4.16): a ProducerPublish is a Publish plus
    // PRODUCER_FIELDS_LEN bytes.
    #[test]
    fn producer_publish_fast_path_and_layout(produced in producer_publish(VALID)) {
        let publish = &produced.publish;
        let records_len: usize = publish
            .records
            .iter()
            .map(|r| encoded_record_len(r.key.len(), r.payload.len()))
            .sum();
        let count = u32::try_from(publish.records.len()).expect("at most VALID.records");
        let mut fast = BytesMut::new();
        encode_producer_publish_header(
            &ProducerHeader {
                request_id: publish.request_id,
                ack: publish.ack,
                producer: produced.producer,
                sequence: produced.sequence,
                shard: produced.shard,
            },
            &publish.stream,
            count,
            records_len,
            &mut fast,
        );
        for record in &publish.records {
            encode_record(&record.key, &record.payload, &mut fast);
        }
        let frame = Frame::ProducerPublish(produced.clone());
        prop_assert_eq!(&fast[..], &encoded(&frame)[..]);
        let plain = encoded(&Frame::Publish(publish.clone()));
        prop_assert_eq!(fast.len(), plain.len() + PRODUCER_FIELDS_LEN);
        prop_assert_eq!(fast[4], 0x22);
        let fields = FRAME_HEADER_LEN + 8 + 1 + 2 + publish.stream.len();
        prop_assert_eq!(&fast[FRAME_HEADER_LEN..fields], &plain[FRAME_HEADER_LEN..fields]);
        prop_assert_eq!(&fast[fields..fields + 8], &produced.producer.to_le_bytes()[..]);
        prop_assert_eq!(&fast[fields + 8..fields + 16], &produced.sequence.to_le_bytes()[..]);
        prop_assert_eq!(&fast[fields + 16..fields + 20], &produced.shard.to_le_bytes()[..]);
        prop_assert_eq!(&fast[fields + 20..], &plain[fields..]);
    }

    // The vectored fast path (record heads in the frame, payloads as chunks of their own)
    // puts the same bytes on the wire as encode(Publish).
    #[test]
    fn vectored_publish_matches_encode(publish in publish(VALID)) {
        let (head, records_len) = publish_header(&publish);
        let mut wire = head.to_vec();
        let mut written = 0;
        for record in &publish.records {
            let mut part = BytesMut::new();
            written += encode_record_head(&record.key, record.payload.len(), &mut part);
            wire.extend_from_slice(&part);
            wire.extend_from_slice(&record.payload);
            written += record.payload.len();
        }
        prop_assert_eq!(written, records_len);
        let frame = Frame::Publish(publish);
        prop_assert_eq!(&wire[..], &encoded(&frame)[..]);
    }

    // A vectored Delivery (large payloads as chunks of their own, at any threshold) puts the
    // same bytes on the wire as encode(Delivery), after whatever the buffer already held.
    #[test]
    fn vectored_delivery_matches_encode(
        frame in frame_of(FrameType::Delivery, VALID),
        threshold in 0usize..256,
        prefix in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        if let Frame::Delivery(delivery) = &frame {
            let mut buf = BytesMut::from(&prefix[..]);
            let mut chunks = Vec::new();
            encode_delivery_vectored(&delivery.records, threshold, &mut buf, &mut chunks);
            let mut wire: Vec<u8> = chunks.iter().flat_map(|chunk| chunk.to_vec()).collect();
            wire.extend_from_slice(&buf);
            let mut expected = prefix.clone();
            expected.extend_from_slice(&encoded(&frame));
            prop_assert_eq!(wire, expected);
        }
    }

    // `validate` accepts exactly what the decoder accepts, and reports the decoder's error.
    #[test]
    fn validate_agrees_with_the_decoder(frame in any_frame(LOOSE)) {
        let mut buf = encoded(&frame);
        let decoded = Decoder::new(LIMITS).decode(&mut buf);
        match validate(&frame, &LIMITS) {
            Ok(()) => prop_assert!(matches!(decoded, Ok(Some(_))), "{:?}", decoded),
            Err(err) => prop_assert_eq!(decoded, Err(err)),
        }
    }
}
