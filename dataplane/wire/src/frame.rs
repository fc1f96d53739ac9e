//! Frame types of wire protocol v1. The byte layout of each frame is specified in
//! `docs/wire-protocol.md`; this file is the Rust face of that document.

use bytes::Bytes;

use crate::ErrorCode;

/// Frame type codes (byte 4 of the frame header). Stable: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    Hello = 0x01,
    HelloOk = 0x02,
    CreateStream = 0x10,
    DescribeStream = 0x11,
    ListStreams = 0x12,
    DeleteStream = 0x13,
    StreamInfo = 0x14,
    StreamList = 0x15,
    Done = 0x16,
    Publish = 0x20,
    Ack = 0x21,
    Subscribe = 0x30,
    Subscribed = 0x31,
    Delivery = 0x32,
    Error = 0x7f,
}

/// Kind of a stream: no log (replay ring only) or an append-only log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum StreamKind {
    InMemory = 0,
    Durable = 1,
}

/// Key -> shard hash function identifier carried in stream descriptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum HashKind {
    /// `shard = fnv1a_64(key) % shard_count` (see [`crate::shard_for_key`]).
    Fnv1a64Mod = 1,
}

/// Whether the publisher wants an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AckMode {
    /// The broker answers with an `Ack` or an `Error` carrying the request id.
    Acked = 0,
    /// No answer, ever (errors included); the request id should be 0.
    FireAndForget = 1,
}

/// Server limits announced in `HelloOk`; the decoder enforces the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Largest frame body (bytes after the 6-byte header) either side may send.
    pub max_frame_bytes: u32,
    /// Largest number of records in one `Publish` or `Delivery`.
    pub max_batch_records: u32,
    /// Largest payload of one record.
    pub max_payload_bytes: u32,
    /// Largest key of one record.
    pub max_key_bytes: u16,
    /// Largest stream name (UTF-8 bytes).
    pub max_name_bytes: u16,
    /// Largest shard count of a stream.
    pub max_shards: u32,
}

impl Limits {
    /// Protocol defaults: 16 MiB frames hold a batch of 64 records of 64 KiB with room to spare.
    pub const DEFAULT: Limits = Limits {
        max_frame_bytes: 16 * 1024 * 1024,
        max_batch_records: 4096,
        max_payload_bytes: 4 * 1024 * 1024,
        max_key_bytes: 1024,
        max_name_bytes: 255,
        max_shards: 4096,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// First frame of a connection, client to server, on the first bidirectional stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub min_version: u16,
    pub max_version: u16,
    /// Feature bits the client understands (none defined in v1: send 0).
    pub features: u64,
    /// Free text for logs, e.g. "felix-cli/0.1.0". At most 255 bytes.
    pub client_name: String,
}

/// Server's answer to `Hello`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloOk {
    pub version: u16,
    pub features: u64,
    pub limits: Limits,
    /// UDP port of each data-plane core's own endpoint, indexed by core.
    pub core_ports: Vec<u16>,
    /// Routing of every stream that existed when the connection was accepted.
    pub shard_map: Vec<StreamRoute>,
}

/// Routing of one stream: enough for a client to send each shard's records to its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRoute {
    pub name: String,
    pub kind: StreamKind,
    pub shard_count: u32,
    pub hash: HashKind,
    /// Owning core's index into `HelloOk::core_ports`, one entry per shard.
    pub shard_cores: Vec<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateStream {
    pub request_id: u64,
    pub name: String,
    pub shard_count: u32,
    pub kind: StreamKind,
}

/// Per-shard state in a `StreamInfo` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardInfo {
    pub shard: u32,
    /// Index of the owning core (into `HelloOk::core_ports`).
    pub core: u16,
    /// Oldest offset still readable (ring or log). Equals `next_offset` when empty.
    pub oldest_offset: u64,
    /// Offset the next record appended to this shard will get.
    pub next_offset: u64,
}

/// Answer to `CreateStream` and `DescribeStream`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    pub request_id: u64,
    pub name: String,
    pub kind: StreamKind,
    pub hash: HashKind,
    pub shards: Vec<ShardInfo>,
}

/// One entry of a `StreamList` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSummary {
    pub name: String,
    pub kind: StreamKind,
    pub shard_count: u32,
}

/// A record as published: the key picks the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub key: Bytes,
    pub payload: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub request_id: u64,
    pub ack: AckMode,
    pub stream: String,
    /// 1..=`Limits::max_batch_records` records.
    pub records: Vec<Record>,
}

/// Offsets given to the records of one shard in one publish: they are
/// `first_offset .. first_offset + count`, in the order the records appeared in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardAck {
    pub shard: u32,
    pub first_offset: u64,
    pub count: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    pub request_id: u64,
    /// One entry per shard the publish touched, in ascending shard order.
    pub shards: Vec<ShardAck>,
}

/// Which shards a subscription covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardSelection {
    All,
    List(Vec<u32>),
}

/// Where a subscription starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartPosition {
    /// Only records appended after the subscription is registered.
    Latest,
    /// The oldest record still held by each shard.
    Earliest,
    /// Per shard `(shard, offset)`: the first offset to deliver. Selected shards not listed
    /// start at latest; listing a shard outside the selection is an error.
    Offsets(Vec<(u32, u64)>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribe {
    pub request_id: u64,
    pub stream: String,
    pub shards: ShardSelection,
    pub from: StartPosition,
}

/// Answer to `Subscribe`: the first offset that will be delivered per subscribed shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribed {
    pub request_id: u64,
    pub shards: Vec<(u32, u64)>,
}

/// A record as delivered to a subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveredRecord {
    pub shard: u32,
    pub offset: u64,
    /// Broker time at append, microseconds since the Unix epoch.
    pub timestamp_us: u64,
    pub key: Bytes,
    pub payload: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// 1..=`Limits::max_batch_records` records, per-shard offsets ascending.
    pub records: Vec<DeliveredRecord>,
}

/// An error answer. `request_id` 0 means the error concerns the stream or connection
/// itself (e.g. a malformed frame), which the sender closes right after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    pub request_id: u64,
    pub code: ErrorCode,
    /// Code-specific number (e.g. the oldest offset still held for `TooOld`), else 0.
    pub detail: u64,
    /// Human-readable text, at most 1024 bytes.
    pub message: String,
}

/// Every frame of protocol v1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    HelloOk(HelloOk),
    CreateStream(CreateStream),
    DescribeStream { request_id: u64, name: String },
    ListStreams { request_id: u64 },
    DeleteStream { request_id: u64, name: String },
    StreamInfo(StreamInfo),
    StreamList { request_id: u64, streams: Vec<StreamSummary> },
    /// Success answer without a body (e.g. to `DeleteStream`).
    Done { request_id: u64 },
    Publish(Publish),
    Ack(Ack),
    Subscribe(Subscribe),
    Subscribed(Subscribed),
    Delivery(Delivery),
    Error(ErrorFrame),
}
