//! [`Core`]: the state machine of one data-plane core. Lives on that core's thread (or on the
//! simulation's one thread, next to the other cores' machines); never shared.
//!
//! Inputs are `handle_*(now, ...)` calls; outputs are drained with `poll_*` calls. After any
//! input the shell drains, in this order: [`Core::poll_message`] for every other core (into
//! the mesh), [`Core::poll_catalog_write`] (core 0), the durable log when
//! [`Core::has_log_work`] (the log driver), and [`Core::poll_event`] (wake stream writers).
//! A stream's writer calls [`Core::poll_transmit`] after feeding it frames and whenever a
//! `StreamReady` event names it. Every queue here is independent, so any order is correct;
//! this one sends cross-core work first, which keeps latency lowest.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use felix_auth::{Access, Operation, Permissions, Principal, TokenRefusal, VerifiedToken};
// Keys are ids this core assigns (connections, streams, tokens), never network input, so a
// fast non-keyed hash is safe; it is also deterministic, which the simulation relies on.
use felix_engine::{
    Engine, EngineError, EngineEvent, PublishToken, StreamDescription, SubscriptionId,
};
use felix_wire::{
    ErrorCode, ErrorFrame, FEATURE_PRODUCER, FEATURE_TOKEN, Frame, HashKind, HelloOk, Limits,
    PROTOCOL_VERSION, Publish, ShardAck, ShardInfo, StreamInfo, StreamRoute, StreamSummary,
    WireError,
};
use rustc_hash::FxHashMap as HashMap;

use crate::admin::{AdminOp, PendingDescribe};
use crate::admission::{Admission, AdmissionEvent, Ticket};
use crate::catalog::CatalogChange;
use crate::cluster::ClusterAdmin;
use crate::config::{
    ACCESS_CACHE_ENTRIES_MAX, ConnectionId, CoreConfig, HELLO_SHARD_MAP_FRAME_SHARE,
    IngressSettings, Now, StreamId,
};
use crate::counters::CoreCounters;
use crate::message::CoreMessage;
use crate::producer::{JournalEntry, ProducerTag, Producers};
use crate::publish::{PendingPublish, Tracked};
use crate::security::{AuthRefusal, Limit, Security, TokenCheck, operation_index};
use crate::subscribe::{RemoteSubscription, SubscriptionSlot};

/// Something the shell must act on, drained with [`Core::poll_event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The stream has bytes to write, must finish, or accepts frames again: its writer calls
    /// [`Core::poll_transmit`], and feeds frames again if [`Core::accepts_frames`]. Queued at
    /// most once per stream between two `poll_transmit` calls, and never for the stream whose
    /// frame is being handled (its writer polls right after anyway).
    StreamReady(StreamId),
}

/// What a stream's reader does after a frame ([`Core::handle_frame`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Flow {
    /// Feed the next frame.
    Continue,
    /// A request on this stream waits (for ingress room, or for other cores): feed nothing
    /// until a `StreamReady` event and [`Core::accepts_frames`] say it goes on. Leaving the
    /// bytes unread is the backpressure: QUIC flow control stops the client.
    Blocked,
    /// The stream became a subscription: it carries no more frames. Any further byte from the
    /// client is [`Core::handle_extra_data`].
    Subscribed,
    /// The stream reads nothing more (an `Error` with request id 0 is queued, or the
    /// handshake was refused): write what [`Core::poll_transmit`] gives, then finish.
    Done,
}

/// What [`Core::poll_transmit`] gives a stream's writer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Transmit {
    /// Encoded frames to write, in order, as the chunks of one vectored write (large delivered
    /// payloads are chunks of their own, never copied into a frame); empty: nothing to write.
    pub chunks: Vec<Bytes>,
    /// Finish the stream after `bytes`: nothing more will come.
    pub finish: bool,
    /// After finishing (and giving the client a moment to read the `Error`), close the whole
    /// connection with this code: the handshake was refused.
    pub close_connection: Option<ErrorCode>,
    /// A subscription gave a batch: call again for the next (a request stream's output comes
    /// whole in one call).
    pub more: bool,
}

/// A durable catalogue change core 0 needs persisted before it goes on; answer it with
/// [`Core::handle_catalog_written`] (in any order relative to other inputs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogWrite {
    pub id: u64,
    pub change: CatalogChange,
}

/// One connection: counted for the per-core limit; its first stream is the hello stream.
#[derive(Debug)]
struct Connection {
    streams_opened: u64,
    /// Client-opened streams of this connection still open (FELIX_MAX_STREAMS_PER_CONNECTION).
    streams_open: u32,
    /// Subscription streams still open (FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION).
    subscriptions_open: u32,
    /// `HelloOk` was written.
    hello_done: bool,
    /// The principal of the verified client certificate (mutual TLS), known at accept.
    peer: Option<Principal>,
    /// Who the connection acts as, from its accepted `Hello` on (counted in the ledger).
    principal: Option<Principal>,
    /// The id of the token that authenticated it, for revocation on reload.
    token_id: Option<String>,
    /// The principal's compiled rules.
    access: Access,
    /// Permissions by stream name, evaluated once per connection and stream (at most
    /// [`ACCESS_CACHE_ENTRIES_MAX`] names; beyond, evaluated each time). Empty when `access`
    /// is unrestricted. Keys come from the network: std's keyed hasher.
    access_cache: std::collections::HashMap<Box<str>, Permissions>,
}

/// What a client stream is.
#[derive(Debug)]
pub(crate) enum Role {
    /// The connection's first stream, before `Hello`.
    Hello,
    /// No frame yet: the first one decides.
    New,
    /// Requests answered on the same stream (admin, publish).
    Requests,
    /// A subscription: `Subscribed`, then `Delivery` frames.
    Subscription(Box<SubscriptionSlot>),
}

/// A request that holds up the later frames of its stream.
#[derive(Debug)]
pub(crate) enum Parked {
    /// A publish waiting for ingress room.
    Admission {
        ticket: Ticket,
        publish: Publish,
        /// The producer of a `ProducerPublish`.
        producer: Option<ProducerTag>,
        payload_bytes: u64,
    },
    /// An admin request or a describe waiting for other cores (or for the catalogue write).
    Remote,
    /// A `Hello` whose token the shell is checking; `features` are the ones it will answer
    /// with besides the token's.
    Token { features: u64 },
}

/// Delivered payloads at least this long are written as chunks of their own (a vectored write
/// of the received bytes); shorter ones are cheaper to copy into the frame than to carry, since
/// s2n-quic pays per chunk boundary when it fills packets. Measured with callgrind
/// (docs/performance.md, "Vectored writes"): with one subscriber, 4 KiB payloads cost the broker
/// 38.2 k instructions per record vectored against 36.4 k copied; even at 8 KiB; 11 % fewer
/// vectored at 16 KiB, 7 % at 64 KiB.
pub const DELIVERY_VECTORED_MIN: usize = 8 * 1024;

/// A stream's encoded output not yet handed to the shell: finished chunks, then the bytes
/// after them.
#[derive(Debug, Default)]
pub(crate) struct Output {
    chunks: Vec<Bytes>,
    tail: BytesMut,
}

impl Output {
    pub(crate) fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.tail.is_empty()
    }

    /// Everything queued, in order, leaving the output empty.
    fn take(&mut self) -> Vec<Bytes> {
        let mut chunks = std::mem::take(&mut self.chunks);
        if !self.tail.is_empty() {
            chunks.push(self.tail.split().freeze());
        }
        chunks
    }
}

/// One client stream of this core.
#[derive(Debug)]
pub(crate) struct StreamState {
    pub(crate) connection: ConnectionId,
    pub(crate) role: Role,
    /// Encoded frames not yet handed to the writer.
    pub(crate) out: Output,
    /// Answers still owed on this stream: publishes with parts on other cores or waiting for
    /// their commit. Each is at most one per publish frame read, and frames are read only as
    /// fast as the ingress queue admits them, so this is bounded by the ingress depth.
    pub(crate) owed: u32,
    pub(crate) parked: Option<Parked>,
    /// The client finished its side: finish ours once nothing is owed.
    pub(crate) fin: bool,
    /// Finish once `out` is written, whatever is owed.
    pub(crate) finishing: bool,
    pub(crate) close_connection: Option<ErrorCode>,
    /// A `StreamReady` event is queued and not yet followed by `poll_transmit`.
    ready_queued: bool,
    /// Counted in its connection's open subscriptions.
    pub(crate) subscription_counted: bool,
}

/// A request sent to another core, waiting for its answer (by token).
#[derive(Debug)]
pub(crate) enum Request {
    /// A part of publish `publish` (answered by `PublishDone`).
    PublishPart { publish: u64 },
    /// A catalogue change forwarded to core 0 for stream `stream` (answered by `AdminDone`).
    Admin {
        stream: StreamId,
        request_id: u64,
        delete: bool,
    },
    /// A describe part (answered by `DescribeDone`).
    Describe { describe: u64 },
    /// The part of subscription `stream` on core `core` (answered by `SubscribeDone`).
    Subscribe { stream: StreamId, core: u16 },
    /// A part of publish `publish` handed to the cluster (`cluster.rs`; answered by
    /// `Core::handle_cluster_answer`).
    ClusterPart { publish: u64 },
    /// A cluster admin request of stream `stream` (`cluster.rs`; answered by
    /// `Core::handle_cluster_admin`).
    ClusterAdmin { stream: StreamId, request_id: u64 },
}

/// The state machine of one data-plane core: publish routing and splitting, ingress
/// admission, the cross-core protocol (tokens, credits, the outbox per destination),
/// subscription slots, durable waiters, and, on core 0, the serialized catalogue changes.
/// It owns no thread, socket, file, clock or channel.
pub struct Core {
    pub(crate) index: u16,
    /// Authentication mode, authorization policy and connection limits (shared, read-only).
    security: Arc<Security>,
    pub(crate) core_count: u16,
    core_ports: Vec<u16>,
    pub(crate) limits: Limits,
    pub(crate) ingress: IngressSettings,
    pub(crate) engine: Engine,
    pub(crate) admission: Admission,
    pub(crate) counters: CoreCounters,
    next_token: u64,
    next_connection: u64,
    next_stream: u64,
    connections: HashMap<ConnectionId, Connection>,
    pub(crate) streams: HashMap<StreamId, StreamState>,
    /// The stream of each admission waiter.
    pub(crate) waiters: HashMap<Ticket, StreamId>,
    /// Requests sent to other cores, by token. Bounded by the ingress queue (publish parts)
    /// and by the streams (at most one admin, describe or subscribe each).
    pub(crate) requests: HashMap<u64, Request>,
    /// Admitted publishes with parts not yet answered, by publish token.
    pub(crate) publishes: HashMap<u64, PendingPublish>,
    /// Durable publishes (or parts) this core's engine tracks, by engine token.
    pub(crate) tracked: HashMap<u64, Tracked>,
    /// Describes gathering shard states from the owner cores.
    pub(crate) describes: HashMap<u64, PendingDescribe>,
    /// Engine subscriptions feeding a subscription stream of this core.
    pub(crate) local_subscriptions: HashMap<SubscriptionId, StreamId>,
    /// Engine subscriptions feeding a subscription stream on another core.
    pub(crate) remote_subscriptions: HashMap<SubscriptionId, RemoteSubscription>,
    /// Messages per destination core, oldest first. FIFO per pair; the shell moves them into
    /// the mesh while it has room. Bounded by what caused them: publish parts by the ingress
    /// queue, answers by the requests received, deliveries by the credits.
    outbox: Vec<VecDeque<CoreMessage>>,
    outbox_len: usize,
    events: VecDeque<Event>,
    /// Core 0: the catalogue id the next durable stream gets.
    pub(crate) next_stream_id: u32,
    /// Core 0: catalogue changes, one at a time, oldest first.
    pub(crate) admin_ops: VecDeque<AdminOp>,
    pub(crate) catalog_writes: VecDeque<CatalogWrite>,
    /// The stream whose frame is being handled: its writer polls next, so no event for it.
    in_call: Option<StreamId>,
    /// Scratch of `run_publish` (each record's shard), kept to avoid an allocation per publish.
    pub(crate) scratch_shards: Vec<u32>,
    /// Idempotent producers of the shards this core owns.
    pub(crate) producers: Producers,
    /// Durable producer batches queued in the engine whose journal records the log pump
    /// writes before their records, in publish order.
    pub(crate) journal: std::collections::VecDeque<JournalEntry>,
    /// A durable shard landed on this core since the last log pump: the pump makes sure the
    /// log has its first segment (a core without durable shards takes no disk).
    pub(crate) log_wanted: bool,
    /// The last log pump left appends queued in the engine: the log's pending bound is full
    /// (`PumpReport::held`). Until the next pump (the log's wake-up when a round finished,
    /// or its timer) queued appends are not log work, so the shell does not spin on them.
    pub(crate) appends_held: bool,
    /// The last log pump left catch-up reads queued in the engine: the reads that wait for
    /// the log's reader thread are at their bound (`PumpReport::reads_held`). Until the next
    /// pump (the log's wake-up when a fetch arrived) they are not log work either.
    pub(crate) reads_held: bool,
    /// Tokens of hellos waiting for the shell's verdict, oldest first. At most one per
    /// connection (its hello stream is parked meanwhile).
    token_checks: VecDeque<TokenCheck>,
    /// The cluster as its service last described it (`cluster.rs`).
    pub(crate) cluster: Arc<crate::cluster::ClusterView>,
    /// Requests for the cluster service, oldest first. Bounded by the ingress queue (publish
    /// parts) and by the subscriptions (one subscribe, at most their credits and one
    /// unsubscribe each).
    pub(crate) cluster_out: VecDeque<crate::cluster::ClusterRequest>,
    /// Subscription streams fed by the cluster service, by the token of their request, from
    /// the request until the stream is gone or the service refused or ended it.
    pub(crate) cluster_subscriptions: HashMap<u64, StreamId>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("index", &self.index)
            .field("streams", &self.streams.len())
            .field("outbox", &self.outbox_len)
            .finish_non_exhaustive()
    }
}

impl Core {
    #[must_use]
    pub fn new(config: CoreConfig) -> Core {
        assert!(config.core_count >= 1, "at least one data-plane core");
        assert!(
            config.index < config.core_count,
            "the core is one of the plan's"
        );
        assert_eq!(
            config.core_ports.len(),
            usize::from(config.core_count),
            "one own port per core"
        );
        let mut engine = Engine::new(config.engine);
        engine.enable_durable();
        Core {
            index: config.index,
            security: config.security,
            core_count: config.core_count,
            core_ports: config.core_ports,
            limits: config.limits,
            ingress: config.ingress,
            engine,
            admission: Admission::new(config.ingress.depth, config.ingress.budget_bytes),
            counters: CoreCounters::default(),
            next_token: 1,
            next_connection: 1,
            next_stream: 1,
            connections: HashMap::default(),
            streams: HashMap::default(),
            waiters: HashMap::default(),
            requests: HashMap::default(),
            publishes: HashMap::default(),
            tracked: HashMap::default(),
            describes: HashMap::default(),
            local_subscriptions: HashMap::default(),
            remote_subscriptions: HashMap::default(),
            outbox: (0..config.core_count).map(|_| VecDeque::new()).collect(),
            outbox_len: 0,
            events: VecDeque::new(),
            next_stream_id: config.next_stream_id,
            admin_ops: VecDeque::new(),
            catalog_writes: VecDeque::new(),
            in_call: None,
            scratch_shards: Vec::new(),
            producers: Producers::default(),
            journal: std::collections::VecDeque::new(),
            log_wanted: false,
            appends_held: false,
            reads_held: false,
            token_checks: VecDeque::new(),
            cluster: Arc::default(),
            cluster_out: VecDeque::new(),
            cluster_subscriptions: HashMap::default(),
        }
    }

    // ---- getters ----

    #[must_use]
    pub fn index(&self) -> u16 {
        self.index
    }

    /// The engine, read-only (descriptions, counters, invariants).
    #[must_use]
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// This core's counters, gauges brought up to date.
    pub fn counters(&mut self) -> &CoreCounters {
        self.counters.ingress_depth = self.admission.depth();
        self.counters.ingress_bytes = self.admission.held_bytes();
        self.counters.ingress_waiting = self.admission.waiting() as u64;
        self.counters.producer_evictions = self.producers.evictions;
        &self.counters
    }

    /// Whether the stream takes frames now (not parked, not done, not a subscription).
    #[must_use]
    pub fn accepts_frames(&self, stream: StreamId) -> bool {
        self.streams.get(&stream).is_some_and(|state| {
            state.parked.is_none()
                && !state.finishing
                && matches!(state.role, Role::Hello | Role::New | Role::Requests)
        })
    }

    /// Whether the connection's handshake was answered with `HelloOk`.
    #[must_use]
    pub fn handshake_done(&self, connection: ConnectionId) -> bool {
        self.connections
            .get(&connection)
            .is_some_and(|state| state.hello_done)
    }

    /// Open streams of this core.
    #[must_use]
    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }

    /// Messages waiting in the outbox, all destinations.
    #[must_use]
    pub fn outbox_len(&self) -> usize {
        self.outbox_len
    }

    /// The messages waiting in the outbox with their destination core, for checks.
    pub fn outbox_messages(&self) -> impl Iterator<Item = (u16, &CoreMessage)> + '_ {
        self.outbox.iter().enumerate().flat_map(|(to, queue)| {
            let to = u16::try_from(to).expect("a core index");
            queue.iter().map(move |message| (to, message))
        })
    }

    /// The engine has appends or log reads for the durable log (the shell pumps it). Appends
    /// the last pump held back for lack of room in the log (a slow disk) do not count: they
    /// move at the pump the log's wake-up eventfd triggers when a round finishes, so a core
    /// whose disk is behind does not pump (spin) in the meantime.
    #[must_use]
    pub fn has_log_work(&self) -> bool {
        self.log_wanted
            || (self.engine.has_log_reads() && !self.reads_held)
            || (self.engine.has_appends() && !self.appends_held)
    }

    /// Appends wait in the engine because the log's pending bound is full (the disk is
    /// behind); the log's wake-up moves them on.
    #[must_use]
    pub fn appends_held(&self) -> bool {
        self.appends_held && self.engine.has_appends()
    }

    /// Notes that durable stream shards `0..shard_count` exist; if this core owns one, the
    /// next log pump creates the log's first segment.
    pub(crate) fn durable_shards_landed(&mut self, shard_count: u32) {
        let owned = (0..shard_count).any(|shard| self.owner(shard) == self.index);
        self.log_wanted |= owned;
    }

    pub(crate) fn token(&mut self) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        token
    }

    /// The core owning `shard`: the core plan's rule, `shard % cores`.
    pub(crate) fn owner(&self, shard: u32) -> u16 {
        felix_affinity::shard_core(shard, self.core_count)
    }

    // ---- connections and streams ----

    /// A connection was accepted; `peer` is the principal of its verified client certificate
    /// (mutual TLS), if it presented one. Refused (`LimitExceeded`, counted) beyond
    /// FELIX_MAX_CONNECTIONS_PER_CORE: the shell closes it with that code.
    pub fn handle_connection_opened(
        &mut self,
        peer: Option<Principal>,
    ) -> Result<ConnectionId, ErrorCode> {
        if self.connections.len() >= self.security.limits.connections_per_core as usize {
            self.counters.limit(Limit::ConnectionsPerCore);
            self.counters.error(ErrorCode::LimitExceeded);
            return Err(ErrorCode::LimitExceeded);
        }
        let id = ConnectionId(self.next_connection);
        self.next_connection += 1;
        self.connections.insert(
            id,
            Connection {
                streams_opened: 0,
                streams_open: 0,
                subscriptions_open: 0,
                hello_done: false,
                peer,
                principal: None,
                token_id: None,
                access: Access::unrestricted(),
                access_cache: std::collections::HashMap::new(),
            },
        );
        self.counters.connections += 1;
        Ok(id)
    }

    /// No `Hello` answered in time (FELIX_HELLO_TIMEOUT_MS): counts the violation; the shell
    /// closes with the code.
    pub fn handle_hello_timeout(&mut self, connection: ConnectionId) -> ErrorCode {
        assert!(
            self.connections.contains_key(&connection),
            "a live connection"
        );
        self.counters.limit(Limit::HelloTime);
        self.counters.error(ErrorCode::ProtocolViolation);
        ErrorCode::ProtocolViolation
    }

    /// The connection is gone (its streams are closed one by one by their writers).
    pub fn handle_connection_closed(&mut self, connection: ConnectionId) {
        if let Some(state) = self.connections.remove(&connection) {
            self.counters.connections -= 1;
            if let Some(principal) = &state.principal {
                self.security.release(principal);
            }
        }
    }

    /// The tokens file was re-read (SIGHUP): every connection authenticated by a token that
    /// `still_valid(id, principal)` no longer accepts is refused (counted as revoked). Returns
    /// them: the shell closes each with `Unauthenticated`.
    pub fn handle_tokens_reloaded(
        &mut self,
        still_valid: impl Fn(&str, &Principal) -> bool,
    ) -> Vec<ConnectionId> {
        let mut revoked: Vec<ConnectionId> = self
            .connections
            .iter()
            .filter_map(|(id, state)| {
                let token = state.token_id.as_deref()?;
                let principal = state.principal.as_ref()?;
                (!still_valid(token, principal)).then_some(*id)
            })
            .collect();
        revoked.sort_unstable();
        for _ in &revoked {
            self.counters.auth_refusal(AuthRefusal::Revoked);
            self.counters.error(ErrorCode::Unauthenticated);
        }
        revoked
    }

    /// The principal a connection acts as (once its `Hello` was accepted).
    #[must_use]
    pub fn principal_of(&self, connection: ConnectionId) -> Option<&Principal> {
        self.connections.get(&connection)?.principal.as_ref()
    }

    /// Next token to check, oldest first: answer with [`Core::handle_token_checked`].
    #[must_use]
    pub fn poll_token_check(&mut self) -> Option<TokenCheck> {
        self.token_checks.pop_front()
    }

    /// The shell's verdict on a token [`Core::poll_token_check`] gave: the handshake goes on
    /// as the token's principal, or is refused with `Unauthenticated`. A stream that closed
    /// meanwhile is forgotten.
    pub fn handle_token_checked(
        &mut self,
        now: Now,
        stream: StreamId,
        verdict: Result<VerifiedToken, TokenRefusal>,
    ) {
        let Some(state) = self.streams.get_mut(&stream) else {
            return;
        };
        assert!(
            matches!(state.role, Role::Hello) && matches!(state.parked, Some(Parked::Token { .. })),
            "a token verdict answers a parked hello"
        );
        let features = match state.parked.take() {
            Some(Parked::Token { features }) => features,
            _ => 0,
        };
        match verdict {
            Ok(verified) => {
                self.accept_hello(
                    stream,
                    verified.principal,
                    Some(verified.id),
                    FEATURE_TOKEN | features,
                );
            }
            Err(refusal) => {
                self.counters.auth_refusal(AuthRefusal::of_token(&refusal));
                self.refuse_handshake(
                    stream,
                    error_frame(
                        ErrorCode::Unauthenticated,
                        format!("the token was refused: {refusal}"),
                    ),
                );
            }
        }
        self.mark_ready(stream);
        self.settle(now);
    }

    /// The client opened a bidirectional stream on `connection`; the connection's first
    /// stream carries the handshake.
    pub fn handle_stream_opened(&mut self, connection: ConnectionId) -> StreamId {
        let opened = self
            .connections
            .get_mut(&connection)
            .expect("streams are opened on live connections");
        let role = if opened.streams_opened == 0 {
            Role::Hello
        } else {
            Role::New
        };
        opened.streams_opened += 1;
        let over = opened.streams_open >= self.security.limits.streams_per_connection;
        opened.streams_open += 1;
        let id = StreamId(self.next_stream);
        self.next_stream += 1;
        self.streams.insert(
            id,
            StreamState {
                connection,
                role,
                out: Output::default(),
                owed: 0,
                parked: None,
                fin: false,
                finishing: false,
                close_connection: None,
                ready_queued: false,
                subscription_counted: false,
            },
        );
        if over {
            // Refused with its error; it stays counted until its writer closes it.
            let limit = self.security.limits.streams_per_connection;
            self.counters.limit(Limit::StreamsPerConnection);
            let mut refusal = error_frame(
                ErrorCode::LimitExceeded,
                format!(
                    "the connection holds its limit of {limit} open streams \
                     (FELIX_MAX_STREAMS_PER_CONNECTION)"
                ),
            );
            refusal.detail = u64::from(limit);
            self.write_error(id, refusal);
            self.stream_mut(id).finishing = true;
        }
        id
    }

    /// One decoded frame from the client on `stream`. Only while [`Core::accepts_frames`].
    pub fn handle_frame(&mut self, now: Now, stream: StreamId, frame: Frame) -> Flow {
        self.in_call = Some(stream);
        let flow = self.dispatch_frame(now, stream, frame);
        self.settle(now);
        self.in_call = None;
        // A request that parked its stream may have been answered within this call (a
        // catalogue change on a one-core broker, say): then nothing waits.
        if flow == Flow::Blocked && self.accepts_frames(stream) {
            return Flow::Continue;
        }
        flow
    }

    fn dispatch_frame(&mut self, now: Now, stream: StreamId, frame: Frame) -> Flow {
        let state = self
            .streams
            .get_mut(&stream)
            .expect("frames come from open streams");
        assert!(
            state.parked.is_none() && !state.finishing,
            "frames are fed only while the stream accepts them"
        );
        match state.role {
            Role::Hello => self.handle_hello(stream, frame),
            Role::New => match frame {
                Frame::Subscribe(subscribe) => self.start_subscription(stream, subscribe),
                other => {
                    state.role = Role::Requests;
                    self.handle_request(now, stream, other)
                }
            },
            Role::Requests => self.handle_request(now, stream, frame),
            Role::Subscription(_) => {
                self.refuse_extra_data(stream);
                Flow::Done
            }
        }
    }

    fn handle_hello(&mut self, stream: StreamId, frame: Frame) -> Flow {
        let refusal = match frame {
            Frame::Hello(hello)
                if hello.min_version <= PROTOCOL_VERSION
                    && PROTOCOL_VERSION <= hello.max_version =>
            {
                tracing::debug!(client = hello.client_name, "hello");
                // The features this broker uses besides the token: idempotent producers.
                let features = hello.features & FEATURE_PRODUCER;
                if let Some(token) = hello.token {
                    // The shell checks it (off the event loop when it must hash).
                    self.stream_mut(stream).parked = Some(Parked::Token { features });
                    self.token_checks.push_back(TokenCheck { stream, token });
                    return Flow::Blocked;
                }
                let connection = self.stream_mut(stream).connection;
                let peer = self
                    .connections
                    .get(&connection)
                    .and_then(|state| state.peer.clone());
                let principal = match peer {
                    Some(principal) => principal,
                    None if self.security.auth_required => {
                        self.counters.auth_refusal(AuthRefusal::Missing);
                        self.refuse_handshake(
                            stream,
                            error_frame(
                                ErrorCode::Unauthenticated,
                                "this broker requires authentication (FELIX_AUTH=required): \
                                 present a client certificate or a token"
                                    .to_owned(),
                            ),
                        );
                        return Flow::Done;
                    }
                    None => Principal::anonymous(),
                };
                self.accept_hello(stream, principal, None, features);
                return if self.stream_mut(stream).finishing {
                    Flow::Done
                } else {
                    Flow::Continue
                };
            }
            Frame::Hello(hello) => error_frame(
                ErrorCode::UnsupportedVersion,
                format!(
                    "this broker speaks protocol version {PROTOCOL_VERSION}; the client offered \
                     {}..={}",
                    hello.min_version, hello.max_version
                ),
            ),
            other => error_frame(
                ErrorCode::ProtocolViolation,
                format!(
                    "the first frame of a connection must be hello, not {}",
                    other.frame_type().name()
                ),
            ),
        };
        self.refuse_handshake(stream, refusal);
        Flow::Done
    }

    /// The handshake is authenticated as `principal`: counted against its connection limit,
    /// its rules compiled, `HelloOk` written (with the streams it may see), or refused when the
    /// principal holds FELIX_MAX_CONNECTIONS_PER_PRINCIPAL connections already.
    fn accept_hello(
        &mut self,
        stream: StreamId,
        principal: Principal,
        token_id: Option<String>,
        features: u64,
    ) {
        let connection = self.stream_mut(stream).connection;
        if !self.connections.contains_key(&connection) {
            // The connection closed while its token was checked: nothing to admit (its
            // streams are closing too).
            self.stream_mut(stream).finishing = true;
            return;
        }
        if let Err(max) = self.security.acquire(&principal) {
            self.counters.limit(Limit::ConnectionsPerPrincipal);
            let mut refusal = error_frame(
                ErrorCode::LimitExceeded,
                format!(
                    "principal {principal} holds its limit of {max} connections \
                     (FELIX_MAX_CONNECTIONS_PER_PRINCIPAL)"
                ),
            );
            refusal.detail = u64::from(max);
            self.refuse_handshake(stream, refusal);
            return;
        }
        tracing::debug!(%principal, token = token_id.as_deref(), "hello accepted");
        let access = self.security.policy.access(&principal);
        let hello_ok = Frame::HelloOk(self.hello_ok(&access, features));
        self.write(stream, &hello_ok);
        self.counters.authenticated += 1;
        let state = self.stream_mut(stream);
        state.role = Role::Requests;
        let connection = state.connection;
        let state = self
            .connections
            .get_mut(&connection)
            .expect("a hello stream's connection is open");
        state.principal = Some(principal);
        state.token_id = token_id;
        state.access = access;
        state.hello_done = true;
    }

    /// Whether the principal of `stream`'s connection may do `operation` on stream `name`:
    /// `Err` is the `PermissionDenied` answer (counted). Evaluated once per connection and
    /// name; free when no rules are configured.
    pub(crate) fn authorize(
        &mut self,
        stream: StreamId,
        operation: Operation,
        name: &str,
    ) -> Result<(), EngineError> {
        if self.security.policy.is_open() {
            return Ok(());
        }
        let connection = self.streams.get(&stream).map(|state| state.connection);
        let (allowed, principal) = match connection.and_then(|id| self.connections.get_mut(&id)) {
            Some(state) => {
                let permissions = match state.access_cache.get(name) {
                    Some(permissions) => *permissions,
                    None => {
                        let permissions = state.access.permissions(name);
                        if state.access_cache.len() < ACCESS_CACHE_ENTRIES_MAX {
                            state.access_cache.insert(name.into(), permissions);
                        }
                        permissions
                    }
                };
                let required = operation.required();
                let allowed = if required.is_empty() {
                    !permissions.is_empty()
                } else {
                    permissions.contains(required)
                };
                let principal = state
                    .principal
                    .as_ref()
                    .map_or_else(|| "?".to_owned(), ToString::to_string);
                (allowed, principal)
            }
            // The connection is closing: nothing more is allowed on it.
            None => (false, "?".to_owned()),
        };
        if allowed {
            return Ok(());
        }
        self.counters.denied[operation_index(operation)] += 1;
        Err(core_error(
            ErrorCode::PermissionDenied,
            format!("{principal} may not {} stream {name:?}", operation.name()),
        ))
    }

    /// The security settings every core shares.
    pub(crate) fn security(&self) -> &Security {
        &self.security
    }

    /// The open-subscription count of `connection`, if it is open.
    pub(crate) fn subscriptions_open_mut(&mut self, connection: ConnectionId) -> Option<&mut u32> {
        self.connections
            .get_mut(&connection)
            .map(|state| &mut state.subscriptions_open)
    }

    /// Whether the principal of `stream`'s connection may see stream `name` (list, shard map).
    pub(crate) fn may_see(&self, stream: StreamId, name: &str) -> bool {
        if self.security.policy.is_open() {
            return true;
        }
        self.streams
            .get(&stream)
            .and_then(|state| self.connections.get(&state.connection))
            .is_some_and(|state| state.access.may_see(name))
    }

    /// Writes the refusal, finishes the stream and closes the connection after it.
    fn refuse_handshake(&mut self, stream: StreamId, refusal: ErrorFrame) {
        let code = refusal.code;
        self.write_error(stream, refusal);
        let state = self.stream_mut(stream);
        state.finishing = true;
        state.close_connection = Some(code);
    }

    /// The bytes on `stream` are not a valid frame: the stream answers `Error` (request id 0)
    /// and finishes; on the hello stream the connection closes too.
    pub fn handle_decode_error(&mut self, now: Now, stream: StreamId, error: &WireError) {
        tracing::debug!(%error, "undecodable frame; finishing the stream");
        let refusal = error_frame(error.code(), error.to_string());
        let hello = matches!(self.stream_mut(stream).role, Role::Hello);
        if let Some(limit) = Limit::of_wire_error(error, hello) {
            self.counters.limit(limit);
        }
        if hello {
            self.refuse_handshake(stream, refusal);
        } else {
            self.write_error(stream, refusal);
            self.stream_mut(stream).finishing = true;
        }
        self.settle(now);
    }

    /// The client finished its side of `stream`; `partial_frame`: bytes of an incomplete
    /// frame were left (a truncated frame, answered like an undecodable one).
    pub fn handle_fin(&mut self, now: Now, stream: StreamId, partial_frame: bool) {
        if partial_frame {
            let truncated = WireError::Malformed {
                frame: "truncated",
                reason: "the stream ended inside a frame".to_owned(),
            };
            self.handle_decode_error(now, stream, &truncated);
            return;
        }
        let state = self.stream_mut(stream);
        match state.role {
            Role::Hello => self.refuse_handshake(
                stream,
                error_frame(
                    ErrorCode::ProtocolViolation,
                    "the first stream ended before Hello".to_owned(),
                ),
            ),
            // A subscriber may half-close after Subscribe: deliveries go on.
            Role::Subscription(_) => {}
            Role::New | Role::Requests => state.fin = true,
        }
    }

    /// Bytes arrived on a subscription stream after its `Subscribe`.
    pub fn handle_extra_data(&mut self, now: Now, stream: StreamId) {
        self.refuse_extra_data(stream);
        self.settle(now);
    }

    /// The stream's writer is gone (finished, reset, or its connection closed): forget
    /// everything of it. Answers still owed are dropped when they arrive; the ingress jobs they
    /// hold are freed as they complete.
    pub fn handle_stream_closed(&mut self, now: Now, stream: StreamId) {
        let Some(state) = self.streams.remove(&stream) else {
            return;
        };
        if let Some(connection) = self.connections.get_mut(&state.connection) {
            connection.streams_open -= 1;
            if state.subscription_counted {
                connection.subscriptions_open -= 1;
            }
        }
        match state.parked {
            Some(Parked::Admission { ticket, .. }) => {
                let removed = self.waiters.remove(&ticket);
                assert_eq!(removed, Some(stream), "a parked publish is a waiter");
                let waiting = self.admission.handle_cancel(ticket);
                assert!(waiting, "admitted waiters are unparked in the same input");
                self.counters.withdrawn += 1;
            }
            Some(Parked::Remote | Parked::Token { .. }) | None => {}
        }
        if let Role::Subscription(slot) = state.role {
            self.drop_subscription(*slot);
        }
        self.settle(now);
    }

    // ---- output ----

    /// The next bytes to write on `stream`, and whether to finish it. For a subscription this
    /// takes one delivery batch (at most [`crate::DELIVERY_RECORDS_MAX`] records): call it
    /// until it gives nothing, then wait for a `StreamReady` event.
    pub fn poll_transmit(&mut self, now: Now, stream: StreamId) -> Transmit {
        let Some(state) = self.streams.get_mut(&stream) else {
            return Transmit {
                chunks: Vec::new(),
                finish: true,
                close_connection: None,
                more: false,
            };
        };
        state.ready_queued = false;
        let subscription = matches!(state.role, Role::Subscription(_));
        if subscription && state.out.is_empty() && !state.finishing {
            self.in_call = Some(stream);
            self.fill_delivery(stream);
            self.settle(now);
            self.in_call = None;
        }
        let state = self.stream_mut(stream);
        let chunks = state.out.take();
        let requests_done = state.fin
            && state.owed == 0
            && state.parked.is_none()
            && matches!(state.role, Role::New | Role::Requests);
        let finish = state.finishing || requests_done;
        Transmit {
            more: subscription && !finish && !chunks.is_empty(),
            chunks,
            finish,
            close_connection: if finish { state.close_connection } else { None },
        }
    }

    /// Next event for the shell, oldest first.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Next message for core `to`, oldest first.
    #[must_use]
    pub fn poll_message(&mut self, to: u16) -> Option<CoreMessage> {
        let message = self.outbox[usize::from(to)].pop_front()?;
        self.outbox_len -= 1;
        Some(message)
    }

    /// Gives back a message [`Core::poll_message`] returned whose queue was full; it goes out
    /// first next time (FIFO per pair is kept).
    pub fn return_message(&mut self, to: u16, message: CoreMessage) {
        self.outbox[usize::from(to)].push_front(message);
        self.outbox_len += 1;
    }

    /// Next durable catalogue change to persist (core 0).
    #[must_use]
    pub fn poll_catalog_write(&mut self) -> Option<CatalogWrite> {
        self.catalog_writes.pop_front()
    }

    /// The earliest deadline of an admission waiter: call [`Core::handle_timeout`] then.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<std::time::Instant> {
        self.admission.poll_timeout()
    }

    /// Expires admission waiters whose deadline passed (they are refused).
    pub fn handle_timeout(&mut self, now: Now) {
        self.admission.handle_timeout(now.at);
        self.settle(now);
    }

    // ---- messages from other cores ----

    /// One message from another core.
    pub fn handle_message(&mut self, now: Now, message: CoreMessage) {
        match message {
            CoreMessage::Publish {
                from,
                token,
                stream,
                shard_count,
                records,
                shards,
                buffers,
                now_us,
                producer,
            } => self.publish_for(
                from,
                token,
                &stream,
                shard_count,
                records,
                &shards,
                buffers,
                now_us,
                producer.map(|tag| *tag),
            ),
            CoreMessage::PublishDone { token, result } => match self.requests.remove(&token) {
                Some(Request::PublishPart { publish }) => self.resolve_part(now, publish, result),
                other => panic!("PublishDone {token} answers {other:?}"),
            },
            CoreMessage::Admin {
                from,
                token,
                request,
            } => self.queue_admin(crate::admin::AdminOrigin::Remote { from, token }, request),
            CoreMessage::Apply { token, request } => self.apply_from_core_zero(token, &request),
            CoreMessage::Applied { token } => self.handle_applied(token),
            CoreMessage::AdminDone { token, result } => self.handle_admin_done(token, result),
            CoreMessage::Describe {
                from,
                token,
                stream,
            } => self.describe_for(from, token, &stream),
            CoreMessage::DescribeDone { token, result } => self.handle_describe_done(token, result),
            CoreMessage::Subscribe {
                from,
                token,
                slot,
                stream,
                shards,
                start,
            } => self.subscribe_for(from, token, slot, &stream, shards, &start),
            CoreMessage::SubscribeDone { token, result } => {
                self.handle_subscribe_done(token, result);
            }
            CoreMessage::Deliver {
                slot,
                owner,
                id,
                records,
            } => self.handle_deliver(slot, owner, id, records),
            CoreMessage::Ended { slot, error } => self.handle_ended(slot, error),
            CoreMessage::Credit { id } => self.handle_credit(id),
            CoreMessage::Unsubscribe { id } => {
                if self.remote_subscriptions.remove(&id).is_some() {
                    self.engine.unsubscribe(id);
                }
            }
        }
        self.settle(now);
    }

    // ---- internals shared by the modules ----

    pub(crate) fn send(&mut self, to: u16, message: CoreMessage) {
        assert_ne!(to, self.index, "a core never messages itself");
        self.outbox[usize::from(to)].push_back(message);
        self.outbox_len += 1;
    }

    pub(crate) fn stream_mut(&mut self, stream: StreamId) -> &mut StreamState {
        self.streams
            .get_mut(&stream)
            .expect("the stream is open (checked by the caller)")
    }

    /// Queues a `StreamReady` for `stream`, unless its writer is the caller or one is queued.
    pub(crate) fn mark_ready(&mut self, stream: StreamId) {
        if self.in_call == Some(stream) {
            return;
        }
        if let Some(state) = self.streams.get_mut(&stream)
            && !state.ready_queued
        {
            state.ready_queued = true;
            self.events.push_back(Event::StreamReady(stream));
        }
    }

    /// Encodes `frame` on `stream` (if it is still open) and wakes its writer.
    pub(crate) fn write(&mut self, stream: StreamId, frame: &Frame) {
        if let Some(state) = self.streams.get_mut(&stream) {
            felix_wire::encode(frame, &mut state.out.tail);
            self.mark_ready(stream);
        }
    }

    /// Writes a `Delivery` of `records` on `stream`: payloads of at least
    /// [`DELIVERY_VECTORED_MIN`] bytes go out as references to the received bytes, not copies.
    pub(crate) fn write_delivery(
        &mut self,
        stream: StreamId,
        records: &[felix_wire::DeliveredRecord],
    ) {
        if let Some(state) = self.streams.get_mut(&stream) {
            let Output { chunks, tail } = &mut state.out;
            felix_wire::encode_delivery_vectored(records, DELIVERY_VECTORED_MIN, tail, chunks);
            self.mark_ready(stream);
        }
    }

    /// Counts an error and writes it on `stream` (if it is still open).
    pub(crate) fn write_error(&mut self, stream: StreamId, error: ErrorFrame) {
        self.counters.error(error.code);
        self.write(stream, &Frame::Error(error));
    }

    /// Unparks `stream`: its reader may feed frames again.
    pub(crate) fn unpark(&mut self, stream: StreamId) {
        if let Some(state) = self.streams.get_mut(&stream) {
            state.parked = None;
            self.mark_ready(stream);
        }
    }

    /// One answer fewer owed on `stream`.
    pub(crate) fn answered(&mut self, stream: StreamId) {
        if let Some(state) = self.streams.get_mut(&stream) {
            assert!(state.owed > 0, "an owed answer was counted");
            state.owed -= 1;
            if state.owed == 0 && state.fin {
                self.mark_ready(stream);
            }
        }
    }

    /// Drains what one input set off, until nothing is left: admission events (admitted or
    /// expired waiters), finished durable publishes, engine events. Each step can feed the
    /// others (an admitted publish completes a job and admits the next waiter), so it loops;
    /// every pass consumes queued work, and new work is bounded by the waiters and
    /// subscriptions that exist, so it ends.
    pub(crate) fn settle(&mut self, now: Now) {
        loop {
            let mut progressed = false;
            while let Some(event) = self.admission.poll_event() {
                progressed = true;
                match event {
                    AdmissionEvent::Admitted(ticket) => self.admit_waiter(now, ticket),
                    AdmissionEvent::Expired(ticket) => self.expire_waiter(ticket),
                }
            }
            while let Some(completion) = self.engine.poll_completed_publish() {
                progressed = true;
                self.complete_tracked(now, completion.token, completion.result);
            }
            while let Some(event) = self.engine.poll_event() {
                progressed = true;
                match event {
                    EngineEvent::DeliveryReady(id) => self.delivery_ready(id),
                    EngineEvent::SubscriptionEnded(id, error) => self.subscription_ended(id, error),
                }
            }
            if !progressed {
                return;
            }
        }
    }

    fn complete_tracked(&mut self, now: Now, token: PublishToken, result: Result<(), EngineError>) {
        let tracked = self
            .tracked
            .remove(&token.0)
            .expect("every tracked publish is registered when the engine takes it");
        if let Some(produced) = tracked.produced() {
            self.producers.settled(
                produced.key,
                produced.producer,
                produced.sequence,
                token.0,
                result.is_ok(),
            );
        }
        match tracked {
            Tracked::Local { publish, .. } => {
                self.resolve_part(now, publish, result.map(|()| Vec::new()));
            }
            Tracked::Remote {
                from, token, acks, ..
            } => self.send(
                from,
                CoreMessage::PublishDone {
                    token,
                    result: result.map(|()| acks),
                },
            ),
        }
    }

    // ---- requests ----

    fn handle_request(&mut self, now: Now, stream: StreamId, frame: Frame) -> Flow {
        match frame {
            Frame::Publish(publish) => self.handle_publish(now, stream, publish, None),
            Frame::ProducerPublish(produced) => {
                let tag = ProducerTag {
                    producer: produced.producer,
                    sequence: produced.sequence,
                    shard: produced.shard,
                };
                self.handle_publish(now, stream, produced.publish, Some(tag))
            }
            Frame::CreateStream(create) => self.request_admin(
                stream,
                create.request_id,
                crate::message::AdminRequest::Create {
                    name: create.name,
                    shard_count: create.shard_count,
                    kind: create.kind,
                    stream_id: None,
                },
            ),
            Frame::DeleteStream { request_id, name } => self.request_admin(
                stream,
                request_id,
                crate::message::AdminRequest::Delete { name },
            ),
            Frame::DescribeStream { request_id, name } => {
                self.start_describe(stream, request_id, &name)
            }
            Frame::DescribeCluster { request_id } => {
                self.describe_cluster(stream, request_id);
                Flow::Continue
            }
            Frame::CreateClusterStream(create) => self.request_cluster_admin(
                stream,
                create.request_id,
                ClusterAdmin::Create {
                    name: create.name,
                    kind: create.kind,
                    shard_count: create.shard_count,
                    replicas: create.replicas,
                    fsync: create.fsync,
                },
            ),
            Frame::DeleteClusterStream { request_id, name } => {
                self.request_cluster_admin(stream, request_id, ClusterAdmin::Delete { name })
            }
            Frame::ReadShard(read) => {
                if read.max_records == 0 {
                    self.write_error(
                        stream,
                        ErrorFrame {
                            request_id: read.request_id,
                            code: ErrorCode::InvalidArgument,
                            detail: 0,
                            message: "read_shard asks for 0 records".to_owned(),
                        },
                    );
                    return Flow::Continue;
                }
                let max_records = read.max_records.min(self.limits.max_batch_records);
                self.request_cluster_admin(
                    stream,
                    read.request_id,
                    ClusterAdmin::Read {
                        stream: read.stream,
                        shard: read.shard,
                        from: read.from,
                        max_records,
                    },
                )
            }
            Frame::ListStreams { request_id } => {
                let streams = self
                    .engine
                    .list_streams()
                    .into_iter()
                    .filter(|(name, _, _)| self.may_see(stream, name))
                    .map(|(name, kind, shard_count)| StreamSummary {
                        name,
                        kind,
                        shard_count,
                    })
                    .chain(self.cluster_summaries(stream))
                    .collect();
                self.write(
                    stream,
                    &Frame::StreamList {
                        request_id,
                        streams,
                    },
                );
                Flow::Continue
            }
            Frame::Subscribe(subscribe) => {
                self.write_error(
                    stream,
                    ErrorFrame {
                        request_id: subscribe.request_id,
                        code: ErrorCode::ProtocolViolation,
                        detail: 0,
                        message: "Subscribe must be the first and only frame of its own stream"
                            .to_owned(),
                    },
                );
                Flow::Continue
            }
            other => {
                self.write_error(
                    stream,
                    error_frame(
                        ErrorCode::ProtocolViolation,
                        format!(
                            "{} is not a request a client may send on a request stream",
                            other.frame_type().name()
                        ),
                    ),
                );
                self.stream_mut(stream).finishing = true;
                Flow::Done
            }
        }
    }

    /// The handshake answer: version, the client's `features` the broker used, limits, every
    /// core's own port, and the route of every stream `access` may see.
    #[must_use]
    pub fn hello_ok(&self, access: &Access, features: u64) -> HelloOk {
        let mut streams = self.engine.list_streams();
        if !access.is_unrestricted() {
            streams.retain(|(name, _, _)| access.may_see(name));
        }
        let budget = usize::try_from(self.limits.max_frame_bytes).unwrap_or(usize::MAX)
            / HELLO_SHARD_MAP_FRAME_SHARE;
        let mut used = 0usize;
        let mut shard_map = Vec::with_capacity(streams.len());
        for (name, kind, shard_count) in streams {
            // Generous upper bound of one route's encoding: name, fixed fields, u16 per shard.
            let cost = name.len() + 32 + 2 * usize::try_from(shard_count).unwrap_or(usize::MAX);
            used = used.saturating_add(cost);
            if used > budget {
                tracing::warn!(
                    "shard map too large for HelloOk; clients must describe the remaining streams"
                );
                break;
            }
            shard_map.push(StreamRoute {
                name,
                kind,
                shard_count,
                hash: HashKind::Fnv1a64Mod,
                shard_cores: (0..shard_count).map(|shard| self.owner(shard)).collect(),
            });
        }
        HelloOk {
            version: PROTOCOL_VERSION,
            features,
            limits: self.limits,
            core_ports: self.core_ports.clone(),
            shard_map,
        }
    }

    /// Writes a `StreamInfo` answer, each shard with its owner core.
    pub(crate) fn write_stream_info(
        &mut self,
        stream: StreamId,
        request_id: u64,
        description: StreamDescription,
    ) {
        let shards = description
            .shards
            .iter()
            .map(|shard| ShardInfo {
                shard: shard.shard,
                core: self.owner(shard.shard),
                oldest_offset: shard.oldest_offset,
                next_offset: shard.next_offset,
            })
            .collect();
        let info = StreamInfo {
            request_id,
            name: description.name,
            kind: description.kind,
            hash: description.hash,
            shards,
        };
        self.write(stream, &Frame::StreamInfo(info));
    }

    // ---- checks ----

    /// Checks every invariant of this core and of its engine. O(everything held): for tests
    /// and the simulation, not the hot path.
    pub fn assert_invariants(&self) {
        self.engine.assert_invariants();
        assert!(
            self.admission.depth() <= self.ingress.depth,
            "the ingress depth stays within its bound"
        );
        assert!(
            self.admission.held_bytes() <= self.ingress.budget_bytes || self.admission.depth() == 1,
            "the ingress byte budget is exceeded only by one job alone"
        );
        assert_eq!(
            self.waiters.len(),
            self.admission.waiting(),
            "every admission waiter is a parked publish"
        );
        for (ticket, stream) in &self.waiters {
            let state = self.streams.get(stream).expect("a waiter's stream is open");
            assert!(
                matches!(state.parked, Some(Parked::Admission { ticket: parked, .. }) if parked == *ticket),
                "a waiter's stream is parked on it"
            );
        }
        assert_eq!(
            self.tracked.len(),
            self.engine.unreported_publishes(),
            "every engine-tracked publish is registered once"
        );
        // Each admitted publish holds one job until it is finished.
        assert!(
            self.publishes.len() as u64 <= self.admission.depth(),
            "a pending publish holds an ingress job"
        );
        let owed: u64 = self
            .streams
            .values()
            .map(|state| u64::from(state.owed))
            .sum();
        let pending_live = self
            .publishes
            .values()
            .filter(|publish| self.streams.contains_key(&publish.stream))
            .count() as u64;
        assert_eq!(
            owed, pending_live,
            "each owed answer is one pending publish"
        );
        assert_eq!(
            self.outbox_len,
            self.outbox.iter().map(VecDeque::len).sum::<usize>(),
            "the outbox length is kept"
        );
        // A stream may outlive its connection briefly: the shell's connection task can end
        // (and close the connection) before the stream tasks have closed their streams.
        for (stream, state) in &self.streams {
            if let Role::Subscription(slot) = &state.role {
                slot.assert_invariants();
                if let Some(id) = slot.local {
                    assert_eq!(self.local_subscriptions.get(&id), Some(stream));
                }
                if let Some(token) = slot.cluster {
                    assert_eq!(self.cluster_subscriptions.get(&token), Some(stream));
                }
            }
        }
        for (token, stream) in &self.cluster_subscriptions {
            assert!(
                matches!(
                    self.streams.get(stream).map(|state| &state.role),
                    Some(Role::Subscription(slot)) if slot.cluster == Some(*token)
                ),
                "a cluster subscription feeds the open subscription stream that holds its token"
            );
        }
        for stream in self.local_subscriptions.values() {
            assert!(
                matches!(
                    self.streams.get(stream).map(|state| &state.role),
                    Some(Role::Subscription(_))
                ),
                "a local engine subscription feeds an open subscription stream"
            );
        }
        for remote in self.remote_subscriptions.values() {
            assert!(
                remote.credits <= crate::config::REMOTE_DELIVERY_CREDITS,
                "credits stay within their bound"
            );
        }
        assert!(
            self.index == 0 || (self.admin_ops.is_empty() && self.catalog_writes.is_empty()),
            "catalogue changes run on core 0 only"
        );
        assert!(
            self.catalog_writes.len() <= 1,
            "one catalogue change at a time"
        );
    }
}

/// An `Error` frame answering no particular request (request id 0).
pub(crate) fn error_frame(code: ErrorCode, message: String) -> ErrorFrame {
    ErrorFrame {
        request_id: 0,
        code,
        detail: 0,
        message,
    }
}

/// An error of the core itself (the engine's constructor bounds the message length).
pub(crate) fn core_error(code: ErrorCode, message: String) -> EngineError {
    EngineError::new(code, 0, message)
}

/// `ShardAck`s of the parts of one publish, merged in ascending shard order.
pub(crate) fn sort_acks(acks: &mut [ShardAck]) {
    acks.sort_unstable_by_key(|ack| ack.shard);
}
