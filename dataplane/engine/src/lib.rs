//! Felix shard engine: streams, shards, per-shard dense offsets, in-memory replay rings and
//! subscribers with live delivery in per-shard order.
//!
//! Sans-IO (quinn-proto style): no sockets, files, threads or clocks. Input comes in through
//! `handle_*`-style calls with the time passed in (`now_us`, microseconds since the Unix
//! epoch); output is drained with `poll_*` calls. An `Engine` lives on one data-plane core and
//! is deliberately used from that core only.
//!
//! API CONTRACT (implementation in progress): the broker's IO shell is written against the
//! signatures below; keep them.

use felix_wire::{
    DeliveredRecord, ErrorCode, ErrorFrame, HashKind, Record, ShardAck, ShardSelection,
    StartPosition, StreamKind,
};

/// Tunables of one engine (the broker fills them from its configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Replay ring bound per shard, in records (default 1,024).
    pub ring_max_records: usize,
    /// Replay ring bound per shard, in payload bytes (default 64 MiB).
    pub ring_max_bytes: u64,
    /// Live records queued for one subscription beyond which it is ended with
    /// `SubscriberLagged` (payload bytes; default 64 MiB). Catch-up from the ring does not count.
    pub subscriber_queue_max_bytes: u64,
    /// Largest shard count of a stream.
    pub max_shards: u32,
    /// Largest stream name in bytes.
    pub max_name_bytes: u16,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ring_max_records: 1024,
            ring_max_bytes: 64 * 1024 * 1024,
            subscriber_queue_max_bytes: 64 * 1024 * 1024,
            max_shards: felix_wire::Limits::DEFAULT.max_shards,
            max_name_bytes: felix_wire::Limits::DEFAULT.max_name_bytes,
        }
    }
}

/// Why a request failed; becomes an `Error` frame on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct EngineError {
    pub code: ErrorCode,
    /// Code-specific detail (oldest offset held for `TooOld`), else 0.
    pub detail: u64,
    pub message: String,
}

impl EngineError {
    /// The wire form, answering request `request_id`.
    #[must_use]
    pub fn to_frame(&self, request_id: u64) -> ErrorFrame {
        ErrorFrame {
            request_id,
            code: self.code,
            detail: self.detail,
            message: self.message.clone(),
        }
    }
}

/// Identifies one subscription within an engine. Never reused by an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubscriptionId(pub u64);

/// Description of one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardState {
    pub shard: u32,
    /// Oldest offset still in the ring; equals `next_offset` when the ring is empty.
    pub oldest_offset: u64,
    pub next_offset: u64,
    pub ring_records: usize,
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

/// All streams and shards of one core, with their subscribers.
pub struct Engine {
    _config: EngineConfig,
}

impl Engine {
    #[must_use]
    pub fn new(config: EngineConfig) -> Engine {
        Engine { _config: config }
    }

    /// Creates a stream. Names: 1..=max_name_bytes of `[A-Za-z0-9._-]`; shard count
    /// 1..=max_shards. Durable streams are refused (`InvalidArgument`) until storage lands.
    pub fn create_stream(
        &mut self,
        name: &str,
        shard_count: u32,
        kind: StreamKind,
    ) -> Result<StreamDescription, EngineError> {
        let _ = (name, shard_count, kind);
        unreachable!("engine not implemented yet")
    }

    pub fn describe_stream(&self, name: &str) -> Result<StreamDescription, EngineError> {
        let _ = name;
        unreachable!("engine not implemented yet")
    }

    /// `(name, kind, shard_count)` of every stream, sorted by name.
    #[must_use]
    pub fn list_streams(&self) -> Vec<(String, StreamKind, u32)> {
        unreachable!("engine not implemented yet")
    }

    /// Deletes a stream; its subscriptions end with `StreamNotFound` events.
    pub fn delete_stream(&mut self, name: &str) -> Result<(), EngineError> {
        let _ = name;
        unreachable!("engine not implemented yet")
    }

    /// Appends a batch: routes each record by `felix_wire::shard_for_key`, gives dense
    /// per-shard offsets in batch order, stamps `now_us`, pushes into rings (evicting oldest
    /// first by count and by bytes) and queues live delivery. All-or-nothing: a bad batch
    /// (unknown stream, empty) changes nothing. Returns one `ShardAck` per shard touched,
    /// ascending shard order.
    pub fn publish(
        &mut self,
        now_us: u64,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<Vec<ShardAck>, EngineError> {
        let _ = (now_us, stream, records);
        unreachable!("engine not implemented yet")
    }

    /// Registers a subscription; catch-up records from the ring are queued immediately.
    /// A position older than the ring fails with `TooOld` (detail = oldest offset held,
    /// message names the shard); a position beyond `next_offset` is `InvalidArgument`.
    pub fn subscribe(
        &mut self,
        stream: &str,
        shards: &ShardSelection,
        from: &StartPosition,
    ) -> Result<Subscription, EngineError> {
        let _ = (stream, shards, from);
        unreachable!("engine not implemented yet")
    }

    /// Forgets a subscription (client went away). Unknown ids are ignored.
    pub fn unsubscribe(&mut self, id: SubscriptionId) {
        let _ = id;
        unreachable!("engine not implemented yet")
    }

    /// Takes up to `max_records` queued records (and about `max_bytes` of payload; at least
    /// one record if any is queued) of a subscription, per-shard order kept.
    #[must_use]
    pub fn poll_delivery(
        &mut self,
        id: SubscriptionId,
        max_records: usize,
        max_bytes: usize,
    ) -> Vec<DeliveredRecord> {
        let _ = (id, max_records, max_bytes);
        unreachable!("engine not implemented yet")
    }

    /// Next event for the shell, if any.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        unreachable!("engine not implemented yet")
    }

    #[must_use]
    pub fn counters(&self) -> EngineCounters {
        unreachable!("engine not implemented yet")
    }
}
