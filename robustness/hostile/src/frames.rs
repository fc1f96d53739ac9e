//! Frames built by hand: valid ones through `felix_wire::encode`, invalid ones byte by byte
//! (any length or count, any type code, any flags), as docs/wire-protocol.md lays them out.

use bytes::{BufMut, Bytes, BytesMut};
use felix_wire::{
    AckMode, CreateStream, FRAME_HEADER_LEN, Frame, FrameType, Hello, Publish, Record,
    ShardSelection, StartPosition, StreamKind, Subscribe,
};

/// A frame body written field by field (little-endian), then wrapped in a header.
#[derive(Debug, Default, Clone)]
pub struct Body(BytesMut);

impl Body {
    #[must_use]
    pub fn new() -> Body {
        Body(BytesMut::new())
    }

    #[must_use]
    pub fn u8(mut self, value: u8) -> Body {
        self.0.put_u8(value);
        self
    }

    #[must_use]
    pub fn u16(mut self, value: u16) -> Body {
        self.0.put_u16_le(value);
        self
    }

    #[must_use]
    pub fn u32(mut self, value: u32) -> Body {
        self.0.put_u32_le(value);
        self
    }

    #[must_use]
    pub fn u64(mut self, value: u64) -> Body {
        self.0.put_u64_le(value);
        self
    }

    #[must_use]
    pub fn bytes(mut self, bytes: &[u8]) -> Body {
        self.0.put_slice(bytes);
        self
    }

    /// A `str`/`key` field: u16 length (as given, true or not) and the bytes.
    #[must_use]
    pub fn str16(self, len: u16, bytes: &[u8]) -> Body {
        self.u16(len).bytes(bytes)
    }

    /// A well-formed string field.
    #[must_use]
    pub fn string(self, text: &str) -> Body {
        let len = u16::try_from(text.len()).unwrap_or(u16::MAX);
        self.str16(len, text.as_bytes())
    }

    /// Header (`body_len` = the body's true length, flags 0) + body.
    #[must_use]
    pub fn frame(self, frame_type: u8) -> Bytes {
        let len = u32::try_from(self.0.len()).unwrap_or(u32::MAX);
        self.frame_as(frame_type, len, 0)
    }

    /// Header announcing `body_len` with `flags`, then the body bytes (whatever their length).
    #[must_use]
    pub fn frame_as(self, frame_type: u8, body_len: u32, flags: u8) -> Bytes {
        let mut out = BytesMut::with_capacity(FRAME_HEADER_LEN + self.0.len());
        out.put_u32_le(body_len);
        out.put_u8(frame_type);
        out.put_u8(flags);
        out.put_slice(&self.0);
        out.freeze()
    }
}

/// Just a header: `body_len`, type, flags.
#[must_use]
pub fn header(body_len: u32, frame_type: u8, flags: u8) -> Bytes {
    Body::new().frame_as(frame_type, body_len, flags)
}

/// The encoding of `frame`.
#[must_use]
pub fn encode(frame: &Frame) -> Bytes {
    let mut out = BytesMut::new();
    felix_wire::encode(frame, &mut out);
    out.freeze()
}

/// A protocol-v1 `Hello` with no token.
#[must_use]
pub fn hello(client_name: &str) -> Frame {
    Frame::Hello(Hello {
        min_version: 1,
        max_version: 1,
        features: 0,
        client_name: client_name.to_owned(),
        token: None,
    })
}

#[must_use]
pub fn create(request_id: u64, name: &str, shard_count: u32) -> Frame {
    Frame::CreateStream(CreateStream {
        request_id,
        name: name.to_owned(),
        shard_count,
        kind: StreamKind::InMemory,
    })
}

#[must_use]
pub fn publish(request_id: u64, stream: &str, records: &[(&str, &str)], ack: AckMode) -> Frame {
    Frame::Publish(Publish {
        request_id,
        ack,
        stream: stream.to_owned(),
        records: records
            .iter()
            .map(|(key, payload)| Record {
                key: Bytes::from(key.as_bytes().to_vec()),
                payload: Bytes::from(payload.as_bytes().to_vec()),
            })
            .collect(),
    })
}

#[must_use]
pub fn subscribe(
    request_id: u64,
    stream: &str,
    shards: ShardSelection,
    from: StartPosition,
) -> Frame {
    Frame::Subscribe(Subscribe {
        request_id,
        stream: stream.to_owned(),
        shards,
        from,
    })
}

/// One valid frame of each client -> server type (the hello aside), for truncation and
/// trailing-byte cases; `stream` names an existing stream of at least 2 shards.
#[must_use]
pub fn client_requests(stream: &str) -> Vec<(FrameType, Frame)> {
    vec![
        (
            FrameType::CreateStream,
            create(11, "hostile-never-created", 1),
        ),
        (
            FrameType::DescribeStream,
            Frame::DescribeStream {
                request_id: 12,
                name: stream.to_owned(),
            },
        ),
        (
            FrameType::ListStreams,
            Frame::ListStreams { request_id: 13 },
        ),
        (
            FrameType::DeleteStream,
            Frame::DeleteStream {
                request_id: 14,
                name: "hostile-never-created".to_owned(),
            },
        ),
        (
            FrameType::Publish,
            publish(
                15,
                stream,
                &[("k1", "hello"), ("k2", "world")],
                AckMode::Acked,
            ),
        ),
        (
            FrameType::Subscribe,
            subscribe(
                16,
                stream,
                ShardSelection::List(vec![0, 1]),
                StartPosition::Offsets(vec![(1, 0)]),
            ),
        ),
    ]
}

/// One valid frame of each server -> client type.
#[must_use]
pub fn server_frames() -> Vec<Frame> {
    use felix_wire::{
        Ack, DeliveredRecord, Delivery, ErrorCode, ErrorFrame, HashKind, HelloOk, Limits, ShardAck,
        ShardInfo, StreamInfo, StreamSummary, Subscribed,
    };
    vec![
        Frame::HelloOk(HelloOk {
            version: 1,
            features: 0,
            limits: Limits::DEFAULT,
            core_ports: vec![7401],
            shard_map: Vec::new(),
        }),
        Frame::StreamInfo(StreamInfo {
            request_id: 21,
            name: "s".to_owned(),
            kind: StreamKind::InMemory,
            hash: HashKind::Fnv1a64Mod,
            shards: vec![ShardInfo {
                shard: 0,
                core: 0,
                oldest_offset: 0,
                next_offset: 0,
            }],
        }),
        Frame::StreamList {
            request_id: 22,
            streams: vec![StreamSummary {
                name: "s".to_owned(),
                kind: StreamKind::InMemory,
                shard_count: 1,
            }],
        },
        Frame::Done { request_id: 23 },
        Frame::Ack(Ack {
            request_id: 24,
            shards: vec![ShardAck {
                shard: 0,
                first_offset: 0,
                count: 1,
            }],
        }),
        Frame::Subscribed(Subscribed {
            request_id: 25,
            shards: vec![(0, 0)],
        }),
        Frame::Delivery(Delivery {
            records: vec![DeliveredRecord {
                shard: 0,
                offset: 0,
                timestamp_us: 1,
                key: Bytes::from_static(b"k"),
                payload: Bytes::from_static(b"v"),
            }],
        }),
        Frame::Error(ErrorFrame {
            request_id: 26,
            code: ErrorCode::Internal,
            detail: 0,
            message: "from a client".to_owned(),
        }),
    ]
}
