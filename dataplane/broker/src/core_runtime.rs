//! One data-plane core: a thread running a current-thread tokio runtime and a `LocalSet`, one
//! s2n-quic server endpoint and one engine. Everything in [`CoreState`] lives on that thread
//! only (`Rc`, `RefCell`); no lock is taken on the data path. This is the unit the thread-per-core
//! broker replicates per pinned core.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;
use felix_engine::{Engine, EngineConfig, EngineError, EngineEvent, SubscriptionId};
use felix_wire::{
    AckMode, Decoder, DeliveredRecord, ErrorCode, ErrorFrame, Frame, HashKind, HelloOk, Limits,
    PROTOCOL_VERSION, Publish, ShardInfo, StreamInfo, StreamRoute, StreamSummary,
};
use s2n_quic::Server;
use tokio::sync::Notify;

use crate::BrokerError;
use crate::connection;
use crate::metrics::Metrics;
use crate::tls::CertificatePair;

/// Open connections per core beyond which new ones are closed at once with `LimitExceeded`:
/// bounds per-connection state (tasks, buffers); far above what one core serves usefully.
const MAX_CONNECTIONS_PER_CORE: usize = 10_000;
/// Client-opened bidirectional streams per connection (request and subscription streams);
/// enough for a busy client, small enough that one connection cannot exhaust a core.
const MAX_STREAMS_PER_CONNECTION: u64 = 256;
/// How long shutdown waits for connection tasks to end after closing them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// After the last connection task ended: time for the endpoint to transmit the
/// CONNECTION_CLOSE packets before the runtime (and the endpoint task) is dropped.
const CLOSE_PACKET_LINGER: Duration = Duration::from_millis(100);
/// Records per `Delivery` frame: amortizes framing and syscalls while keeping one frame small
/// enough that other subscribers' frames interleave.
pub(crate) const DELIVERY_MAX_RECORDS: usize = 256;
/// Payload bytes per `Delivery` frame (about; at least one record is always taken).
pub(crate) const DELIVERY_MAX_BYTES: usize = 1024 * 1024;
/// A shard map larger than this share of the frame limit is cut short in `HelloOk` (clients
/// can still describe any stream); half leaves room for the rest of the frame.
const HELLO_SHARD_MAP_FRAME_SHARE: usize = 2;

/// What a core needs to start.
#[derive(Debug, Clone)]
pub(crate) struct CoreSettings {
    pub core_index: u16,
    pub bind: SocketAddr,
    pub limits: Limits,
    pub engine: EngineConfig,
}

/// A running core thread.
pub struct CoreRuntime {
    local_addr: SocketAddr,
    thread: std::thread::JoinHandle<Result<(), BrokerError>>,
}

impl std::fmt::Debug for CoreRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreRuntime")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl CoreRuntime {
    /// Starts the core thread and returns once its endpoint is bound (or failed to bind).
    pub(crate) fn spawn(
        settings: CoreSettings,
        pair: CertificatePair,
        metrics: Metrics,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<CoreRuntime, BrokerError> {
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name(format!("felix-core-{}", settings.core_index))
            .spawn(move || run_thread(settings, pair, metrics, shutdown, ready_tx))
            .map_err(|source| BrokerError::Thread {
                name: "felix-core",
                source,
            })?;
        match ready_rx.recv() {
            Ok(Ok(local_addr)) => Ok(CoreRuntime { local_addr, thread }),
            Ok(Err(error)) => {
                let _ = thread.join();
                Err(error)
            }
            // The thread ended without reporting: it returned an error or panicked.
            Err(_) => match thread.join() {
                Ok(Err(error)) => Err(error),
                Ok(Ok(())) => Err(BrokerError::Core(
                    "core thread ended during start-up".into(),
                )),
                Err(_) => Err(BrokerError::Core(
                    "core thread panicked during start-up".into(),
                )),
            },
        }
    }

    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits for the core thread to end.
    pub fn join(self) -> Result<(), BrokerError> {
        match self.thread.join() {
            Ok(result) => result,
            Err(_) => Err(BrokerError::Core("core thread panicked".into())),
        }
    }
}

fn run_thread(
    settings: CoreSettings,
    pair: CertificatePair,
    metrics: Metrics,
    shutdown: tokio::sync::watch::Receiver<bool>,
    ready: std::sync::mpsc::SyncSender<Result<SocketAddr, BrokerError>>,
) -> Result<(), BrokerError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| BrokerError::Core(format!("cannot build the tokio runtime: {error}")))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let server = match start_endpoint(&settings, &pair) {
            Ok(server) => server,
            Err(error) => {
                let _ = ready.send(Err(error));
                return Ok(());
            }
        };
        let local_addr = server.local_addr().map_err(|error| BrokerError::QuicBind {
            addr: settings.bind,
            reason: error.to_string(),
        });
        let local_addr = match local_addr {
            Ok(addr) => addr,
            Err(error) => {
                let _ = ready.send(Err(error));
                return Ok(());
            }
        };
        let state = Rc::new(CoreState::new(&settings, local_addr.port(), metrics));
        let _ = ready.send(Ok(local_addr));
        tracing::info!(core = settings.core_index, %local_addr, "core serving");
        serve(state, server, shutdown).await;
        Ok(())
    })
}

fn start_endpoint(settings: &CoreSettings, pair: &CertificatePair) -> Result<Server, BrokerError> {
    let bind_error = |reason: String| BrokerError::QuicBind {
        addr: settings.bind,
        reason,
    };
    let tls = s2n_quic::provider::tls::default::Server::builder()
        .with_certificate(pair.cert_pem.as_str(), pair.key_pem.as_str())
        .and_then(|builder| builder.with_application_protocols([felix_wire::ALPN]))
        .and_then(|builder| builder.build())
        .map_err(|error| BrokerError::Tls(error.to_string()))?;
    let io = s2n_quic::provider::io::tokio::Builder::default()
        .with_receive_address(settings.bind)
        .and_then(|builder| builder.build())
        .map_err(|error| bind_error(error.to_string()))?;
    let limits = s2n_quic::provider::limits::Limits::new()
        .with_max_open_remote_bidirectional_streams(MAX_STREAMS_PER_CONNECTION)
        .map_err(|error| bind_error(error.to_string()))?;
    Server::builder()
        .with_tls(tls)
        .map_err(|error| BrokerError::Tls(error.to_string()))?
        .with_io(io)
        .map_err(|error| bind_error(error.to_string()))?
        .with_limits(limits)
        .map_err(|error| bind_error(error.to_string()))?
        .start()
        .map_err(|error| bind_error(error.to_string()))
}

async fn serve(
    state: Rc<CoreState>,
    mut server: Server,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            accepted = server.accept() => {
                let Some(connection) = accepted else { break };
                if state.connections.borrow().len() >= MAX_CONNECTIONS_PER_CORE {
                    tracing::warn!(max = MAX_CONNECTIONS_PER_CORE, "connection refused: too many connections");
                    state.metrics.error(ErrorCode::LimitExceeded);
                    connection.close(u32::from(ErrorCode::LimitExceeded as u16).into());
                    continue;
                }
                tokio::task::spawn_local(connection::serve_connection(Rc::clone(&state), connection));
            }
            changed = shutdown.changed() => {
                // An error means every trigger is gone: nobody can ask us to stop any more,
                // so stop now rather than run unowned.
                if changed.is_err() || *shutdown.borrow() {
                    break;
                }
            }
        }
    }
    tracing::info!("shutting down: closing connections");
    let handles: Vec<s2n_quic::connection::Handle> =
        state.connections.borrow().values().cloned().collect();
    for handle in &handles {
        handle.close(u32::from(ErrorCode::ShuttingDown as u16).into());
    }
    drop(server);
    let all_closed = async {
        while !state.connections.borrow().is_empty() {
            state.connections_changed.notified().await;
        }
    };
    if tokio::time::timeout(SHUTDOWN_GRACE, all_closed)
        .await
        .is_err()
    {
        tracing::warn!("some connections did not close within the shutdown grace period");
    }
    tokio::time::sleep(CLOSE_PACKET_LINGER).await;
}

/// Microseconds since the Unix epoch (0 if the clock is before 1970).
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A subscription's link between the engine's events and its stream task.
struct SubscriptionSlot {
    notify: Rc<Notify>,
    /// Set when the engine ended the subscription (lagged, stream deleted).
    ended: Option<EngineError>,
}

/// A subscription registered for a stream task.
pub(crate) struct Registered {
    pub id: SubscriptionId,
    /// `(shard, first offset delivered)` per subscribed shard.
    pub start: Vec<(u32, u64)>,
    /// Woken when records are queued or the engine ended the subscription.
    pub notify: Rc<Notify>,
}

/// Whether a request stream goes on after a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    Continue,
    /// The stream is unusable (an `Error` with request id 0 was written): finish it.
    Finish,
}

/// Per-core state shared by this core's tasks. Never leaves the core thread. No `RefCell`
/// borrow is ever held across an `.await`: every method here is synchronous.
pub(crate) struct CoreState {
    pub engine: Rc<RefCell<Engine>>,
    subscriptions: RefCell<HashMap<SubscriptionId, SubscriptionSlot>>,
    /// Open connections by id, so shutdown can close them.
    pub connections: RefCell<HashMap<u64, s2n_quic::connection::Handle>>,
    /// Notified whenever a connection leaves `connections`.
    pub connections_changed: Notify,
    pub metrics: Metrics,
    pub limits: Limits,
    pub decoder: Decoder,
    core_index: u16,
    core_ports: Vec<u16>,
}

impl CoreState {
    fn new(settings: &CoreSettings, port: u16, metrics: Metrics) -> CoreState {
        CoreState {
            engine: Rc::new(RefCell::new(Engine::new(settings.engine))),
            subscriptions: RefCell::new(HashMap::new()),
            connections: RefCell::new(HashMap::new()),
            connections_changed: Notify::new(),
            metrics,
            limits: settings.limits,
            decoder: Decoder::new(settings.limits),
            core_index: settings.core_index,
            core_ports: vec![port],
        }
    }

    /// The handshake answer: version, limits, ports, and every stream's route (all shards on
    /// this core).
    pub fn hello_ok(&self) -> HelloOk {
        let streams = self.engine.borrow().list_streams();
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
                shard_cores: vec![self.core_index; usize::try_from(shard_count).unwrap_or(0)],
            });
        }
        HelloOk {
            version: PROTOCOL_VERSION,
            features: 0,
            limits: self.limits,
            core_ports: self.core_ports.clone(),
            shard_map,
        }
    }

    /// Encodes an error answer and counts it.
    pub fn write_error(&self, frame: ErrorFrame, out: &mut BytesMut) {
        self.metrics.error(frame.code);
        felix_wire::encode(&Frame::Error(frame), out);
    }

    /// Handles one frame of a request stream, appending its answer (if any) to `out`.
    pub fn handle_request(&self, frame: Frame, out: &mut BytesMut) -> Next {
        match frame {
            Frame::Publish(publish) => {
                self.publish(publish, out);
                Next::Continue
            }
            Frame::CreateStream(create) => {
                let result = self.engine.borrow_mut().create_stream(
                    &create.name,
                    create.shard_count,
                    create.kind,
                );
                match result {
                    Ok(description) => self.write_stream_info(create.request_id, description, out),
                    Err(error) => self.write_error(error.to_frame(create.request_id), out),
                }
                Next::Continue
            }
            Frame::DescribeStream { request_id, name } => {
                let result = self.engine.borrow().describe_stream(&name);
                match result {
                    Ok(description) => self.write_stream_info(request_id, description, out),
                    Err(error) => self.write_error(error.to_frame(request_id), out),
                }
                Next::Continue
            }
            Frame::ListStreams { request_id } => {
                let streams = self
                    .engine
                    .borrow()
                    .list_streams()
                    .into_iter()
                    .map(|(name, kind, shard_count)| StreamSummary {
                        name,
                        kind,
                        shard_count,
                    })
                    .collect();
                felix_wire::encode(
                    &Frame::StreamList {
                        request_id,
                        streams,
                    },
                    out,
                );
                Next::Continue
            }
            Frame::DeleteStream { request_id, name } => {
                let result = self.engine.borrow_mut().delete_stream(&name);
                match result {
                    Ok(()) => felix_wire::encode(&Frame::Done { request_id }, out),
                    Err(error) => self.write_error(error.to_frame(request_id), out),
                }
                self.dispatch_events();
                Next::Continue
            }
            Frame::Subscribe(subscribe) => {
                self.write_error(
                    ErrorFrame {
                        request_id: subscribe.request_id,
                        code: ErrorCode::ProtocolViolation,
                        detail: 0,
                        message: "Subscribe must be the first and only frame of its own stream"
                            .to_owned(),
                    },
                    out,
                );
                Next::Continue
            }
            other => {
                self.write_error(
                    ErrorFrame {
                        request_id: 0,
                        code: ErrorCode::ProtocolViolation,
                        detail: 0,
                        message: format!(
                            "{} is not a request a client may send on a request stream",
                            frame_name(&other)
                        ),
                    },
                    out,
                );
                Next::Finish
            }
        }
    }

    fn write_stream_info(
        &self,
        request_id: u64,
        description: felix_engine::StreamDescription,
        out: &mut BytesMut,
    ) {
        let shards = description
            .shards
            .iter()
            .map(|shard| ShardInfo {
                shard: shard.shard,
                core: self.core_index,
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
        felix_wire::encode(&Frame::StreamInfo(info), out);
    }

    fn publish(&self, publish: Publish, out: &mut BytesMut) {
        let Publish {
            request_id,
            ack,
            stream,
            records,
        } = publish;
        let payload_bytes: u64 = records
            .iter()
            .map(|record| record.payload.len() as u64)
            .sum();
        let record_count = records.len() as u64;
        let result = self.engine.borrow_mut().publish(now_us(), &stream, records);
        match result {
            Ok(shards) => {
                self.metrics.payload_bytes.inc_by(payload_bytes);
                self.metrics.records.inc_by(record_count);
                match ack {
                    AckMode::Acked => {
                        self.metrics.publishes_acked.inc();
                        self.metrics.acks.inc();
                        felix_wire::encode(
                            &Frame::Ack(felix_wire::Ack { request_id, shards }),
                            out,
                        );
                    }
                    AckMode::FireAndForget => {
                        self.metrics.publishes_fire_and_forget.inc();
                    }
                }
            }
            Err(error) => match ack {
                AckMode::Acked => self.write_error(error.to_frame(request_id), out),
                AckMode::FireAndForget => {
                    // No answer, ever: count it and say it in the debug log.
                    self.metrics.error(error.code);
                    tracing::debug!(%error, stream, "fire-and-forget publish refused");
                }
            },
        }
        self.dispatch_events();
    }

    /// Registers a subscription for a stream task; catch-up may already be queued.
    pub fn subscribe(&self, subscribe: &felix_wire::Subscribe) -> Result<Registered, EngineError> {
        let subscription = self.engine.borrow_mut().subscribe(
            &subscribe.stream,
            &subscribe.shards,
            &subscribe.from,
        )?;
        let notify = Rc::new(Notify::new());
        self.subscriptions.borrow_mut().insert(
            subscription.id,
            SubscriptionSlot {
                notify: Rc::clone(&notify),
                ended: None,
            },
        );
        self.metrics.subscribers.inc();
        self.dispatch_events();
        Ok(Registered {
            id: subscription.id,
            start: subscription.start,
            notify,
        })
    }

    /// Forgets a subscription (its stream is gone). Safe to call for ended subscriptions.
    pub fn unsubscribe(&self, id: SubscriptionId) {
        if self.subscriptions.borrow_mut().remove(&id).is_some() {
            self.metrics.subscribers.dec();
        }
        match self.engine.try_borrow_mut() {
            Ok(mut engine) => engine.unsubscribe(id),
            // Only reachable if a task were dropped while the engine is borrowed, which the
            // synchronous borrow discipline rules out; the engine ends it on its own later.
            Err(_) => tracing::error!(?id, "engine busy while unsubscribing"),
        }
    }

    /// The error that ended the subscription, if the engine ended it.
    pub fn take_ended(&self, id: SubscriptionId) -> Option<EngineError> {
        self.subscriptions
            .borrow_mut()
            .get_mut(&id)
            .and_then(|slot| slot.ended.take())
    }

    /// Next batch of records for a subscription (empty when nothing is queued).
    pub fn poll_delivery(&self, id: SubscriptionId) -> Vec<DeliveredRecord> {
        let max_records = DELIVERY_MAX_RECORDS
            .min(usize::try_from(self.limits.max_batch_records).unwrap_or(usize::MAX));
        let max_bytes = DELIVERY_MAX_BYTES
            .min(usize::try_from(self.limits.max_frame_bytes / 2).unwrap_or(usize::MAX));
        self.engine
            .borrow_mut()
            .poll_delivery(id, max_records, max_bytes)
    }

    /// Drains the engine's events and wakes the subscription tasks they concern.
    pub fn dispatch_events(&self) {
        loop {
            // The borrow ends with this statement, before any slot is touched.
            let event = self.engine.borrow_mut().poll_event();
            let Some(event) = event else { break };
            match event {
                EngineEvent::DeliveryReady(id) => {
                    if let Some(slot) = self.subscriptions.borrow().get(&id) {
                        slot.notify.notify_one();
                    }
                }
                EngineEvent::SubscriptionEnded(id, error) => {
                    if let Some(slot) = self.subscriptions.borrow_mut().get_mut(&id) {
                        slot.ended = Some(error);
                        slot.notify.notify_one();
                    }
                }
            }
        }
    }
}

/// Frame name for messages.
pub(crate) fn frame_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Hello(_) => "Hello",
        Frame::HelloOk(_) => "HelloOk",
        Frame::CreateStream(_) => "CreateStream",
        Frame::DescribeStream { .. } => "DescribeStream",
        Frame::ListStreams { .. } => "ListStreams",
        Frame::DeleteStream { .. } => "DeleteStream",
        Frame::StreamInfo(_) => "StreamInfo",
        Frame::StreamList { .. } => "StreamList",
        Frame::Done { .. } => "Done",
        Frame::Publish(_) => "Publish",
        Frame::Ack(_) => "Ack",
        Frame::Subscribe(_) => "Subscribe",
        Frame::Subscribed(_) => "Subscribed",
        Frame::Delivery(_) => "Delivery",
        Frame::Error(_) => "Error",
    }
}
