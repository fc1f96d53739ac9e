//! Felix shard engine: streams, shards, per-shard dense offsets, in-memory replay rings and
//! subscribers with live delivery in per-shard order.
//!
//! Owns: the stream table of one data-plane core, each shard's offset counter and replay ring,
//! and each subscription's delivery queue. It does not own sockets, framing, admission
//! (ingress queues) or metrics export: those belong to the broker's IO shell.
//!
//! Sans-IO (quinn-proto style): no sockets, files, threads, clocks or randomness. Input comes
//! in through calls with the time passed in (`now_us`, microseconds since the Unix epoch);
//! output is drained with `poll_*` calls. An `Engine` lives on one data-plane core and is used
//! from that core's thread only (the shell holds it in an `Rc<RefCell<_>>`).
//!
//! Output order: [`Engine::poll_event`] yields events in the order they arose (FIFO). A
//! `DeliveryReady(id)` is emitted once per transition of the subscription's queue from empty
//! to non-empty, so the shell drains [`Engine::poll_delivery`] until it returns nothing before
//! it waits for the next one. Events may still name a subscription that ended or was
//! unsubscribed since; `poll_delivery` then returns nothing.
//!
//! Durable streams (after [`Engine::enable_durable`]): a publish gives offsets as for
//! in-memory streams but holds the records pending and queues [`AppendRequest`]s
//! ([`Engine::poll_append`]) for the shell to append to the per-core log. The shell reports
//! the log's progress with [`Engine::handle_durable`] (records durable: released to the ring
//! and to live subscribers, in order) and [`Engine::handle_rejected`] (disk full: offsets
//! rolled back). Publishes made with [`Engine::publish_tracked`] are answered through
//! [`Engine::poll_completed_publish`]. A subscription starting below the ring catches up from
//! the log: the engine asks for reads ([`Engine::poll_log_read`]), the shell answers with
//! [`Engine::handle_log_records`], and the shard switches to the ring and then to live
//! delivery with no gap and no duplicate. The engine never depends on the storage crate.
//!
//! Drain order after each input call: `poll_append` (before the next `drive` of the log),
//! `poll_completed_publish`, `poll_log_read`, `poll_event`; each queue is independent, so any
//! order is correct, this one keeps latency lowest. [`Engine::has_log_work`] says in O(1)
//! whether the first or the third has anything, so the shell pumps its log only then.
//!
//! Hot path: [`Engine::lookup`] resolves a stream's name once to a [`StreamMeta`] (a
//! [`StreamHandle`], the kind, the shard count); [`Engine::publish_routed`] then takes the
//! handle and each record's shard as the caller routed it, so neither the name nor a key is
//! hashed again. [`select_shards`] and [`Engine::check_create`] give a subscription's shard
//! checks and a create's checks without doing either, with the same errors, for a shell that
//! validates before it splits a subscription over cores or persists a catalogue entry.

mod durable;
mod engine;
mod error;
mod ring;
mod shard;
mod stream;
mod subscription;

use felix_wire::{HashKind, StreamKind};

pub use durable::{
    AppendRequest, CATCH_UP_REFILL_RECORDS, DURABLE_SHARDS_MAX, DURABLE_STREAM_ID_MAX,
    DurableCounters, LOG_READ_BYTES_MAX, LOG_READ_RECORDS_MAX, LOG_SHARD_BITS, LogRead, LogRecord,
    LogShardId, PublishCompletion, PublishToken,
};
pub use engine::Engine;
pub use error::{ERROR_MESSAGE_BYTES_MAX, EngineError};
pub use subscription::{SUBSCRIBER_QUEUE_LIVE_RECORDS_MAX, select_shards};

/// What the keys and payloads of one publish's records keep alive: a `Bytes` slice keeps its
/// whole buffer, so a record decoded from a frame (`felix_wire::Decoder` slices keys and
/// payloads out of the frame) keeps the whole frame. The replay ring counts these buffers
/// against its byte bound, each once per ring that holds any of its records
/// ([`Engine::publish_routed_from`], docs/semantics.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordBuffers {
    /// Each record's key and payload are buffers of their own (or slices of buffers no larger
    /// than they are): a record costs its payload length (its key, at most
    /// `Limits::max_key_bytes`, is not counted).
    Own,
    /// Every record's key and payload are slices of one buffer of `len` bytes (the frame
    /// the records were decoded from, header included; `felix_wire::encoded_publish_len`).
    Shared { len: u64 },
}

/// A ring that would keep a buffer alive for records whose keys and payloads are less than
/// 1/`RING_COPY_RATIO` of it gets a copy of those records instead (one allocation each, only
/// their key and payload bytes): [`Engine::publish_routed_from`].
pub const RING_COPY_RATIO: u64 = 64;

/// Tunables of one engine (the broker fills them from its configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Replay ring bound per shard, in records (default 1,024).
    pub ring_max_records: usize,
    /// Replay ring bound per shard, in bytes of the buffers its records keep alive, each
    /// counted once ([`RecordBuffers`]; default 64 MiB).
    pub ring_max_bytes: u64,
    /// Live records queued for one subscription beyond which it is ended with
    /// `SubscriberLagged` (payload bytes; default 64 MiB). Catch-up from the ring does not count.
    /// A live record that finds no other live record queued is always taken, so a subscriber
    /// that keeps up is never ended; [`SUBSCRIBER_QUEUE_LIVE_RECORDS_MAX`] bounds the count.
    pub subscriber_queue_max_bytes: u64,
    /// Largest shard count of a stream.
    pub max_shards: u32,
    /// Largest stream name in bytes.
    pub max_name_bytes: u16,
    /// Most streams the engine holds (FELIX_MAX_STREAMS); a create beyond it is
    /// `LimitExceeded`.
    pub max_streams: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ring_max_records: 1024,
            ring_max_bytes: 64 * 1024 * 1024,
            subscriber_queue_max_bytes: 64 * 1024 * 1024,
            max_shards: felix_wire::Limits::DEFAULT.max_shards,
            max_name_bytes: felix_wire::Limits::DEFAULT.max_name_bytes,
            max_streams: felix_wire::LISTED_STREAMS_MAX,
        }
    }
}

/// Identifies one subscription within an engine. Never reused by an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubscriptionId(pub u64);

/// A resolved stream of one engine; stays valid until that stream is deleted. Got from
/// [`Engine::lookup`], used by [`Engine::publish_routed`]. A handle whose stream was deleted
/// (even if a stream of the same name was created since) is stale: calls with it answer
/// `StreamNotFound`. Meaningful only to the engine that gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamHandle {
    /// Index in the engine's stream table.
    slot: u32,
    /// The slot's generation when the stream was created (bumped by each delete).
    generation: u32,
}

/// What a publisher needs to know of a stream, from one [`Engine::lookup`]: its handle, its
/// kind and its shard count (to route keys with `felix_wire::shard_for_key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamMeta {
    pub handle: StreamHandle,
    pub kind: StreamKind,
    pub shard_count: u32,
}

/// Description of one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardState {
    pub shard: u32,
    /// Oldest offset still in the ring; equals `next_offset` when the ring is empty. For a
    /// durable shard: the oldest a subscription may start from (the log's oldest retained
    /// offset, or the ring's if older).
    pub oldest_offset: u64,
    /// Offset the next record appended gets. For a durable shard it counts records not yet
    /// durable too; [`Engine::durable_through`] gives the released offset.
    pub next_offset: u64,
    pub ring_records: usize,
    /// Bytes the ring's records keep alive: the length of each buffer their keys and payloads
    /// are slices of, once per buffer (see [`RecordBuffers`]); at most
    /// [`EngineConfig::ring_max_bytes`].
    pub ring_bytes: u64,
}

/// Description of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamDescription {
    pub name: String,
    pub kind: StreamKind,
    pub hash: HashKind,
    pub shards: Vec<ShardState>,
}

/// Result of a successful subscribe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub id: SubscriptionId,
    /// `(shard, first offset to be delivered)` per subscribed shard, ascending shard order.
    pub start: Vec<(u32, u64)>,
}

/// Something the IO shell must act on, drained with [`Engine::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// The subscription has records waiting in [`Engine::poll_delivery`]. Emitted once per
    /// transition from empty to non-empty.
    DeliveryReady(SubscriptionId),
    /// The subscription is over (lagged, stream deleted); the shell sends the error and
    /// closes the subscription's stream. The engine has already forgotten it.
    SubscriptionEnded(SubscriptionId, EngineError),
}

/// Totals since start, for metrics (the shell reads them; no metric lives in the engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineCounters {
    pub records_appended: u64,
    pub payload_bytes_appended: u64,
    pub records_delivered: u64,
    pub subscriptions_active: u64,
}
