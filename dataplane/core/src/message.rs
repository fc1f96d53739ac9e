//! Everything cores say to each other: owned values, one per message, carried by the shell's
//! bounded lock-free queues (FIFO per ordered pair of cores). A request carries its source
//! core and a `token`; the answer goes back to that core with the same token.

use felix_engine::{EngineError, RecordBuffers, ShardState, StreamDescription, SubscriptionId};
use felix_wire::{DeliveredRecord, Record, ShardAck, StartPosition, StreamKind};

use crate::config::StreamId;
use crate::producer::ProducerTag;

/// A catalogue change, serialized through core 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminRequest {
    Create {
        name: String,
        shard_count: u32,
        kind: StreamKind,
        /// A durable stream's catalogue id: `None` until core 0 assigns it.
        stream_id: Option<u32>,
    },
    Delete {
        name: String,
    },
}

/// One message between two cores.
#[derive(Debug)]
pub enum CoreMessage {
    /// Append records (every one owned by the receiver) and answer with `PublishDone`.
    /// `shards[i]` is the shard of `records[i]`, computed by the sender against
    /// `shard_count`; the receiver refuses the part if its stream now has another count.
    Publish {
        from: u16,
        token: u64,
        stream: String,
        shard_count: u32,
        records: Vec<Record>,
        shards: Vec<u32>,
        /// What the records keep alive (the frame they were decoded from on the sender).
        buffers: RecordBuffers,
        now_us: u64,
        /// The producer of a `ProducerPublish` batch (one shard): the owner deduplicates it.
        /// Boxed: it keeps the message as small as before for plain publishes.
        producer: Option<Box<ProducerTag>>,
    },
    PublishDone {
        token: u64,
        result: Result<Vec<ShardAck>, EngineError>,
    },
    /// To core 0: validate and apply a catalogue change everywhere, answer with `AdminDone`.
    Admin {
        from: u16,
        token: u64,
        request: AdminRequest,
    },
    /// From core 0: apply a change core 0 already validated and applied; answer `Applied`.
    Apply {
        token: u64,
        request: AdminRequest,
    },
    Applied {
        token: u64,
    },
    AdminDone {
        token: u64,
        result: Result<StreamDescription, EngineError>,
    },
    /// The receiver's view of its own shards of a stream; answer with `DescribeDone`.
    Describe {
        from: u16,
        token: u64,
        stream: String,
    },
    DescribeDone {
        token: u64,
        result: Result<Vec<ShardState>, EngineError>,
    },
    /// Register a subscription for `shards` (every one owned by the receiver) whose records
    /// go to core `from`, subscription stream `slot`; answer with `SubscribeDone` (before
    /// any `Deliver`: the queues are FIFO per pair).
    Subscribe {
        from: u16,
        token: u64,
        slot: StreamId,
        stream: String,
        shards: Vec<u32>,
        start: StartPosition,
    },
    SubscribeDone {
        token: u64,
        result: Result<(SubscriptionId, Vec<(u32, u64)>), EngineError>,
    },
    /// Records for subscription stream `slot` on the receiver, from the owner's engine
    /// subscription `id`; the receiver gives a `Credit` back once it wrote them.
    Deliver {
        slot: StreamId,
        owner: u16,
        id: SubscriptionId,
        records: Vec<DeliveredRecord>,
    },
    /// The owner ended its part of subscription stream `slot` (lagged, stream deleted).
    Ended {
        slot: StreamId,
        error: EngineError,
    },
    /// The subscriber core wrote one delivery batch of subscription `id`: one more may come.
    Credit {
        id: SubscriptionId,
    },
    /// The subscriber went away: forget subscription `id`.
    Unsubscribe {
        id: SubscriptionId,
    },
}
