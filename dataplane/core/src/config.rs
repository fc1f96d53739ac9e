//! What one core state machine is built with, the time it is given, and the identifiers it
//! hands out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use felix_engine::EngineConfig;
use felix_wire::Limits;

use crate::security::Security;

/// Stream names whose permissions one connection remembers: a client touches a handful of
/// streams; a hostile one naming random streams costs an evaluation each, not memory.
pub const ACCESS_CACHE_ENTRIES_MAX: usize = 1024;
/// Records per `Delivery` frame: amortizes framing and syscalls while keeping one frame small
/// enough that other subscribers' frames interleave.
pub const DELIVERY_RECORDS_MAX: usize = 256;
/// Payload bytes per `Delivery` frame (about; at least one record is always taken).
pub const DELIVERY_BYTES_MAX: usize = 1024 * 1024;
/// Delivery batches an owner core may have in flight to a subscriber core per subscription:
/// 4 x 1 MiB keeps the subscriber's writer busy while bounding cross-core memory; the rest
/// waits in the owner's engine queue, where the lag bound applies as for local subscribers.
pub const REMOTE_DELIVERY_CREDITS: u32 = 4;
/// A shard map larger than this share of the frame limit is cut short in `HelloOk` (clients
/// can still describe any stream); half leaves room for the rest of the frame.
pub const HELLO_SHARD_MAP_FRAME_SHARE: usize = 2;
/// The exact refusal text of an exhausted ingress queue (docs/semantics.md, 3 Publishing).
pub const INGRESS_EXHAUSTED_MESSAGE: &str = "publish ingress byte budget exhausted";

/// Ingress queue settings of one core (docs/semantics.md, 3 Publishing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngressSettings {
    /// Jobs the queue holds (FELIX_INGRESS_QUEUE_DEPTH, at least 1).
    pub depth: u64,
    /// Payload bytes the queue holds (FELIX_INGRESS_BYTE_BUDGET).
    pub budget_bytes: u64,
    /// Fire-and-forget waits for room instead of being shed (FELIX_PUB_INGRESS_WAIT).
    pub fire_and_forget_waits: bool,
    /// Every acked publish acks after commit, and so waits for room (FELIX_ACK_ON_COMMIT).
    pub ack_on_commit: bool,
    /// How long a publish that acks after commit waits for room (FELIX_PUBLISH_QUEUE_WAIT_MS).
    pub commit_wait: Duration,
}

/// What a core state machine is built with.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// This core's index in the core plan, `0..core_count`.
    pub index: u16,
    pub core_count: u16,
    /// Every core's own UDP port, for `HelloOk` (core-aware clients connect to the owner).
    pub core_ports: Vec<u16>,
    pub limits: Limits,
    pub engine: EngineConfig,
    pub ingress: IngressSettings,
    /// Core 0 only: the catalogue id the next durable stream gets (the durable catalogue's
    /// `next_stream_id`); ignored on other cores.
    pub next_stream_id: u32,
    /// Authentication mode, authorization policy and connection limits: one value shared by
    /// every core ([`Security::open`] for the development default).
    pub security: Arc<Security>,
}

/// The time an input happens at: monotonic for deadlines, wall clock for record timestamps.
/// Both are passed in, never read: the state machine has no clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    pub at: Instant,
    /// Microseconds since the Unix epoch, stamped on published records.
    pub unix_us: u64,
}

/// One QUIC connection as the core knows it. Never reused by a core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub u64);

/// One client-opened bidirectional QUIC stream as the core knows it. Never reused by a core;
/// also names the stream's subscription slot in cross-core messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);
