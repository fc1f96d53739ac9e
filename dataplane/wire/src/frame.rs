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
    DescribeCluster = 0x17,
    ClusterMap = 0x18,
    CreateClusterStream = 0x19,
    DeleteClusterStream = 0x1a,
    ReadShard = 0x1b,
    Records = 0x1c,
    Publish = 0x20,
    Ack = 0x21,
    ProducerPublish = 0x22,
    Subscribe = 0x30,
    Subscribed = 0x31,
    Delivery = 0x32,
    Error = 0x7f,
}

impl FrameType {
    /// Every frame type of protocol v1, in code order.
    pub const ALL: [FrameType; 22] = [
        FrameType::Hello,
        FrameType::HelloOk,
        FrameType::CreateStream,
        FrameType::DescribeStream,
        FrameType::ListStreams,
        FrameType::DeleteStream,
        FrameType::StreamInfo,
        FrameType::StreamList,
        FrameType::Done,
        FrameType::DescribeCluster,
        FrameType::ClusterMap,
        FrameType::CreateClusterStream,
        FrameType::DeleteClusterStream,
        FrameType::ReadShard,
        FrameType::Records,
        FrameType::Publish,
        FrameType::Ack,
        FrameType::ProducerPublish,
        FrameType::Subscribe,
        FrameType::Subscribed,
        FrameType::Delivery,
        FrameType::Error,
    ];

    /// The frame type with code `value`, or `None` if v1 has no such type.
    #[must_use]
    pub fn from_u8(value: u8) -> Option<FrameType> {
        Some(match value {
            0x01 => FrameType::Hello,
            0x02 => FrameType::HelloOk,
            0x10 => FrameType::CreateStream,
            0x11 => FrameType::DescribeStream,
            0x12 => FrameType::ListStreams,
            0x13 => FrameType::DeleteStream,
            0x14 => FrameType::StreamInfo,
            0x15 => FrameType::StreamList,
            0x16 => FrameType::Done,
            0x17 => FrameType::DescribeCluster,
            0x18 => FrameType::ClusterMap,
            0x19 => FrameType::CreateClusterStream,
            0x1a => FrameType::DeleteClusterStream,
            0x1b => FrameType::ReadShard,
            0x1c => FrameType::Records,
            0x20 => FrameType::Publish,
            0x21 => FrameType::Ack,
            0x22 => FrameType::ProducerPublish,
            0x30 => FrameType::Subscribe,
            0x31 => FrameType::Subscribed,
            0x32 => FrameType::Delivery,
            0x7f => FrameType::Error,
            _ => return None,
        })
    }

    /// Stable snake_case name, used in error messages, logs and metrics labels.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            FrameType::Hello => "hello",
            FrameType::HelloOk => "hello_ok",
            FrameType::CreateStream => "create_stream",
            FrameType::DescribeStream => "describe_stream",
            FrameType::ListStreams => "list_streams",
            FrameType::DeleteStream => "delete_stream",
            FrameType::StreamInfo => "stream_info",
            FrameType::StreamList => "stream_list",
            FrameType::Done => "done",
            FrameType::DescribeCluster => "describe_cluster",
            FrameType::ClusterMap => "cluster_map",
            FrameType::CreateClusterStream => "create_cluster_stream",
            FrameType::DeleteClusterStream => "delete_cluster_stream",
            FrameType::ReadShard => "read_shard",
            FrameType::Records => "records",
            FrameType::Publish => "publish",
            FrameType::Ack => "ack",
            FrameType::ProducerPublish => "producer_publish",
            FrameType::Subscribe => "subscribe",
            FrameType::Subscribed => "subscribed",
            FrameType::Delivery => "delivery",
            FrameType::Error => "error",
        }
    }
}

/// Kind of a stream: no log (replay ring only) or an append-only log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum StreamKind {
    InMemory = 0,
    Durable = 1,
}

impl StreamKind {
    /// The kind with wire code `value`, or `None` for an unknown code.
    #[must_use]
    pub fn from_u8(value: u8) -> Option<StreamKind> {
        match value {
            0 => Some(StreamKind::InMemory),
            1 => Some(StreamKind::Durable),
            _ => None,
        }
    }
}

/// Key -> shard hash function identifier carried in stream descriptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum HashKind {
    /// `shard = fnv1a_64(key) % shard_count` (see [`crate::shard_for_key`]).
    Fnv1a64Mod = 1,
}

impl HashKind {
    /// The hash with wire code `value`, or `None` for an unknown code.
    #[must_use]
    pub fn from_u8(value: u8) -> Option<HashKind> {
        match value {
            1 => Some(HashKind::Fnv1a64Mod),
            _ => None,
        }
    }
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

impl AckMode {
    /// The mode with wire code `value`, or `None` for an unknown code.
    #[must_use]
    pub fn from_u8(value: u8) -> Option<AckMode> {
        match value {
            0 => Some(AckMode::Acked),
            1 => Some(AckMode::FireAndForget),
            _ => None,
        }
    }
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

/// `Hello::features` bit: a bearer token follows the client name (`Hello::token`).
pub const FEATURE_TOKEN: u64 = 1 << 0;
/// `Hello::features` bit: the client sends `ProducerPublish` frames (idempotent producers,
/// docs/wire-protocol.md section 4.16). A broker that takes them echoes the bit in
/// `HelloOk::features`; a client must not send `ProducerPublish` to a broker that did not
/// (an older broker ends the stream with `UnknownFrameType`), it sends plain `Publish` instead.
pub const FEATURE_PRODUCER: u64 = 1 << 1;
/// Every feature bit this version defines; a server ignores the others and answers with the
/// bits it used (`HelloOk::features`).
pub const FEATURES_KNOWN: u64 = FEATURE_TOKEN | FEATURE_PRODUCER;

/// First frame of a connection, client to server, on the first bidirectional stream.
#[derive(Clone, PartialEq, Eq)]
pub struct Hello {
    pub min_version: u16,
    pub max_version: u16,
    /// Feature bits the client understands or uses. [`FEATURE_TOKEN`] is set by the encoder
    /// exactly when `token` is present; unknown bits are carried as they are.
    pub features: u64,
    /// Free text for logs, e.g. "felix-cli/0.1.0". At most 255 bytes.
    pub client_name: String,
    /// A bearer token (`felix_<id>_<secret>`), at most [`crate::TOKEN_BYTES_MAX`] bytes; on
    /// the wire only when [`FEATURE_TOKEN`] is set. Never printed (`Debug` hides it).
    pub token: Option<Bytes>,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hello")
            .field("min_version", &self.min_version)
            .field("max_version", &self.max_version)
            .field("features", &self.features)
            .field("client_name", &self.client_name)
            .field(
                "token",
                &self
                    .token
                    .as_ref()
                    .map(|token| format!("<{} bytes>", token.len())),
            )
            .finish()
    }
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

/// When a replicated stream's publishes are acknowledged (`CreateClusterStream`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FsyncMode {
    /// Once a majority including the leader fdatasynced the records.
    OnCommit = 0,
    /// Once a majority including the leader wrote them; each member fdatasyncs periodically.
    Periodic = 1,
}

impl FsyncMode {
    /// The mode with wire code `value`, or `None` for an unknown code.
    #[must_use]
    pub fn from_u8(value: u8) -> Option<FsyncMode> {
        match value {
            0 => Some(FsyncMode::OnCommit),
            1 => Some(FsyncMode::Periodic),
            _ => None,
        }
    }
}

/// Creates a stream through the cluster's control plane: its shards are placed over the
/// members, `replicas` copies each (docs/cluster.md). Answered by `Done` once applied on the
/// answering member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateClusterStream {
    pub request_id: u64,
    pub name: String,
    pub shard_count: u32,
    pub kind: StreamKind,
    /// Copies of each shard (an in-memory stream keeps one).
    pub replicas: u8,
    pub fsync: FsyncMode,
}

/// Reads committed records of one replicated shard from the answering member's own copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadShard {
    pub request_id: u64,
    pub stream: String,
    pub shard: u32,
    /// The first offset to read.
    pub from: u64,
    /// At most this many records (the server may answer fewer).
    pub max_records: u32,
}

/// The answer to `ReadShard`: records in offset order, none at the end of the copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Records {
    pub request_id: u64,
    pub records: Vec<DeliveredRecord>,
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

/// A cluster member as a `ClusterMap` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterMember {
    /// Member id, 1..=65535.
    pub id: u16,
    /// Where clients reach it: `IP:PORT`, at most [`crate::CLUSTER_ADDRESS_BYTES_MAX`] bytes.
    pub addr: String,
}

/// A replicated stream of the cluster as a `ClusterMap` routes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterRoute {
    pub name: String,
    /// The member leading each shard (shard 0 first) as the answering member knows it; 0 when
    /// it knows of none. The shard count is the list's length.
    pub leaders: Vec<u16>,
}

/// The answer to `DescribeCluster`: the members and who leads each replicated shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterMap {
    pub request_id: u64,
    /// The answering member's id; 0 when the broker is not a cluster member (then nothing is
    /// listed).
    pub member: u16,
    pub members: Vec<ClusterMember>,
    pub streams: Vec<ClusterRoute>,
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

/// A publish by an idempotent producer (frame `ProducerPublish`): every record of `publish`
/// belongs to shard `shard` (its key hashes there), and the batch is the producer's
/// `sequence`-th on that shard. A batch whose sequence the shard already stored is answered
/// with the original ack and stores nothing (docs/semantics.md, "Idempotent producers").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerPublish {
    /// Request id, ack mode, stream and records, as in a plain `Publish`.
    pub publish: Publish,
    /// The producer's id, chosen at random by the client (64 bits).
    pub producer: u64,
    /// The producer's batch number on this shard: 1 for its first batch, one more per batch;
    /// 0 asks for no deduplication.
    pub sequence: u64,
    /// The one shard every record belongs to.
    pub shard: u32,
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
    DescribeStream {
        request_id: u64,
        name: String,
    },
    ListStreams {
        request_id: u64,
    },
    DeleteStream {
        request_id: u64,
        name: String,
    },
    StreamInfo(StreamInfo),
    StreamList {
        request_id: u64,
        streams: Vec<StreamSummary>,
    },
    /// Success answer without a body (e.g. to `DeleteStream`).
    Done {
        request_id: u64,
    },
    DescribeCluster {
        request_id: u64,
    },
    ClusterMap(ClusterMap),
    CreateClusterStream(CreateClusterStream),
    DeleteClusterStream {
        request_id: u64,
        name: String,
    },
    ReadShard(ReadShard),
    Records(Records),
    Publish(Publish),
    Ack(Ack),
    ProducerPublish(ProducerPublish),
    Subscribe(Subscribe),
    Subscribed(Subscribed),
    Delivery(Delivery),
    Error(ErrorFrame),
}

impl Frame {
    /// The type code this frame is encoded with.
    #[must_use]
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Hello(_) => FrameType::Hello,
            Frame::HelloOk(_) => FrameType::HelloOk,
            Frame::CreateStream(_) => FrameType::CreateStream,
            Frame::DescribeStream { .. } => FrameType::DescribeStream,
            Frame::ListStreams { .. } => FrameType::ListStreams,
            Frame::DeleteStream { .. } => FrameType::DeleteStream,
            Frame::StreamInfo(_) => FrameType::StreamInfo,
            Frame::StreamList { .. } => FrameType::StreamList,
            Frame::Done { .. } => FrameType::Done,
            Frame::DescribeCluster { .. } => FrameType::DescribeCluster,
            Frame::ClusterMap(_) => FrameType::ClusterMap,
            Frame::CreateClusterStream(_) => FrameType::CreateClusterStream,
            Frame::DeleteClusterStream { .. } => FrameType::DeleteClusterStream,
            Frame::ReadShard(_) => FrameType::ReadShard,
            Frame::Records(_) => FrameType::Records,
            Frame::Publish(_) => FrameType::Publish,
            Frame::Ack(_) => FrameType::Ack,
            Frame::ProducerPublish(_) => FrameType::ProducerPublish,
            Frame::Subscribe(_) => FrameType::Subscribe,
            Frame::Subscribed(_) => FrameType::Subscribed,
            Frame::Delivery(_) => FrameType::Delivery,
            Frame::Error(_) => FrameType::Error,
        }
    }

    /// The request id a frame carries, or `None` for `Hello`, `HelloOk` and `Delivery`,
    /// which have none.
    #[must_use]
    pub fn request_id(&self) -> Option<u64> {
        match self {
            Frame::Hello(_) | Frame::HelloOk(_) | Frame::Delivery(_) => None,
            Frame::CreateStream(f) => Some(f.request_id),
            Frame::DescribeStream { request_id, .. }
            | Frame::ListStreams { request_id }
            | Frame::DeleteStream { request_id, .. }
            | Frame::StreamList { request_id, .. }
            | Frame::Done { request_id }
            | Frame::DescribeCluster { request_id }
            | Frame::DeleteClusterStream { request_id, .. } => Some(*request_id),
            Frame::ClusterMap(f) => Some(f.request_id),
            Frame::CreateClusterStream(f) => Some(f.request_id),
            Frame::ReadShard(f) => Some(f.request_id),
            Frame::Records(f) => Some(f.request_id),
            Frame::StreamInfo(f) => Some(f.request_id),
            Frame::Publish(f) => Some(f.request_id),
            Frame::Ack(f) => Some(f.request_id),
            Frame::ProducerPublish(f) => Some(f.publish.request_id),
            Frame::Subscribe(f) => Some(f.request_id),
            Frame::Subscribed(f) => Some(f.request_id),
            Frame::Error(f) => Some(f.request_id),
        }
    }
}
