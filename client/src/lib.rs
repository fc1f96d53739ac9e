//! Felix client library: connects to a broker over QUIC + TLS 1.3 (ALPN `felix/1`), performs
//! the `Hello` handshake, and offers stream admin, acked / pipelined / fire-and-forget
//! publishing under an in-flight byte budget, and subscriptions as a `futures::Stream`.
//!
//! Threads: it runs on the caller's tokio runtime (current-thread or multi-thread). Each
//! [`Client`] spawns two tasks (`tokio::spawn`): a writer owning the send half of its request
//! stream and a reader routing answers by request id; the client's one s2n-quic endpoint (one
//! UDP socket for every connection of the client) adds its own.
//! A [`Subscription`] is polled by whoever holds it.
//!
//! Bounds: requests queue for the writer in a channel of [`WRITER_QUEUE_DEPTH`] frames and
//! publishes hold [`ClientConfig::publish_inflight_bytes`] of budget until answered (acked) or
//! written (fire-and-forget), so nothing buffers without limit.
//!
//! ```no_run
//! use felix_client::{Client, ClientConfig, ShardSelection, StartPosition, StreamKind, record};
//! use futures::StreamExt;
//!
//! # async fn run() -> Result<(), felix_client::ClientError> {
//! let mut config = ClientConfig::new("127.0.0.1:7400".parse().unwrap());
//! config.ca = Some("/home/me/.local/share/felix/tls/dev-cert.pem".into());
//! let client = Client::connect(config).await?;
//! client.create_stream("orders", 4, StreamKind::InMemory).await?;
//! let mut subscription = client
//!     .subscribe("orders", ShardSelection::All, StartPosition::Latest)
//!     .await?;
//! let acks = client.publish("orders", &[record("customer-7", "hello")]).await?;
//! println!("acked: {acks:?}");
//! if let Some(record) = subscription.next().await {
//!     let record = record?;
//!     println!("{}:{} {}", record.shard, record.offset, String::from_utf8_lossy(&record.payload));
//! }
//! client.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! The runnable version is `client/examples/quickstart.rs`.

mod cluster;
mod error;
mod subscription;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_wire::{AckMode, Decoder, Frame, Hello, HelloOk, Limits, StreamInfo, StreamSummary};
use rustc_hash::FxHashMap;
use s2n_quic::client::Connect;
use s2n_quic::stream::{ReceiveStream, SendStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

pub use cluster::{ClusterAck, ClusterClient};
pub use error::ClientError;
pub use felix_wire::{
    DeliveredRecord, ErrorCode, Record, ShardAck, ShardSelection, StartPosition, StreamKind,
    StreamRoute,
};
pub use subscription::Subscription;

use error::Failure;

/// Default publish budget: 4 MiB outstanding, enough for a batch of 64 x 64 KiB in flight.
pub const DEFAULT_PUBLISH_INFLIGHT_BYTES: u64 = 4 * 1024 * 1024;
/// Frames waiting for the writer task; beyond this, callers wait (back-pressure). Sized for
/// a few hundred small pipelined requests; big publishes are bounded by the byte budget.
pub const WRITER_QUEUE_DEPTH: usize = 256;
/// Frames the writer hands to QUIC in one vectored send: amortizes wake-ups under load.
const WRITER_BATCH_FRAMES: usize = 64;
/// Default [`ClientConfig::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time `close` waits for queued frames to be acknowledged by the broker.
const CLOSE_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Time `close` waits for the connection to finish closing.
const CLOSE_IDLE_TIMEOUT: Duration = Duration::from_secs(1);
/// Default of [`ClientConfig::max_mtu`]: the broker's default FELIX_MTU_UPPER_BOUND.
pub const DEFAULT_MAX_MTU: u16 = 4096;

/// Default [`ClientConfig::publish_retries`].
pub const DEFAULT_PUBLISH_RETRIES: u32 = 8;
/// Default [`ClientConfig::publish_retry_backoff`].
pub const DEFAULT_PUBLISH_RETRY_BACKOFF: Duration = Duration::from_millis(20);
/// The longest wait between two retries of a publish.
pub const PUBLISH_RETRY_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Default [`ClientConfig::idle_timeout`] (QUIC's usual 30 s).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// QUIC's minimum datagram size.
const MTU_UPPER_BOUND_MIN: u16 = 1200;
/// The broker's clamp of FELIX_MTU_UPPER_BOUND (s2n-quic misbehaves with GSO above 32768).
const MTU_UPPER_BOUND_CLAMP: u16 = 16384;
/// Largest semaphore acquisition tokio accepts in one call.
const BUDGET_PERMITS_MAX: u64 = u32::MAX as u64;

/// A record to publish: `key` picks the shard (`felix_wire::shard_for_key`), `payload` is
/// opaque. Both are `Bytes`, so static strings and vectors convert without fuss.
pub fn record(key: impl Into<Bytes>, payload: impl Into<Bytes>) -> Record {
    Record {
        key: key.into(),
        payload: payload.into(),
    }
}

/// A client certificate chain and its private key (PEM files) for mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// How to reach and trust a broker, and how to prove who the client is.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// Broker UDP address.
    pub addr: SocketAddr,
    /// TLS server name to verify (and send as SNI). Default `localhost`.
    pub server_name: String,
    /// PEM CA certificate(s) to trust; when `None`, the system trust store.
    pub ca: Option<PathBuf>,
    /// Skip server certificate verification. Development only: anyone can impersonate the
    /// broker. A warning is logged.
    pub insecure: bool,
    /// Publish bytes outstanding before publishers wait. Default 4 MiB.
    pub publish_inflight_bytes: u64,
    /// Free text the broker logs, e.g. `felix-cli/0.1.0`.
    pub client_name: String,
    /// Send each shard's records straight to its owner core (one connection per core, on
    /// that core's own port, opened lazily). Default true; false sends everything through
    /// `addr` and lets the broker hop between cores.
    pub core_aware: bool,
    /// Publish streams per connection (FELIX_PUB_SHARD_STREAMS), assigned to shards first come
    /// first served; 0 = a pool of [`PUBLISH_POOL_STREAMS`] used round-robin (per-shard order
    /// across pipelined publishes is then not guaranteed). Default 4.
    pub pub_shard_streams: u32,
    /// Bearer token sent in every connection's `Hello` (FELIX_TOKEN); never printed.
    pub token: Option<String>,
    /// Client certificate presented for mutual TLS (FELIX_CLIENT_CERT, FELIX_CLIENT_KEY).
    pub identity: Option<ClientIdentity>,
    /// Largest QUIC datagram the client probes for (path MTU discovery upper bound), like the
    /// broker's FELIX_MTU_UPPER_BOUND; clamped to 1200..=16384. Default 4096, the broker's
    /// default: a path that carries less (a 1500-byte Ethernet) simply stays lower.
    pub max_mtu: u16,
    /// Time allowed for the QUIC + TLS handshake, and again for the broker's `HelloOk`: a
    /// broker that does not answer (stopped, cut off) fails the connect after this. Default
    /// [`DEFAULT_CONNECT_TIMEOUT`] (10 s).
    pub connect_timeout: Duration,
    /// A connection that hears nothing from the broker for this long is closed (keep-alives
    /// go out well within it; the broker's own idle timeout, if shorter, wins). Default 30 s.
    /// A cluster client does not wait for it to give up on a dead shard leader: it sends a
    /// part again once the cluster map shows the shard's new leader (`cluster.rs`).
    pub idle_timeout: Duration,
    /// Publish as an idempotent producer (docs/semantics.md, "Idempotent producers"): acked
    /// publishes carry this client's producer id and a sequence per shard, so a retry is
    /// stored once. Used only when the broker echoes the feature in `HelloOk` (else plain
    /// publishes). Default true.
    pub idempotent: bool,
    /// The producer id; `None` (the default) picks one at random per [`Client`]. A `Client`
    /// numbers each shard's batches from 1, so a new `Client` given the id of an earlier one
    /// that sends the same batches in the same order again has them deduplicated.
    pub producer_id: Option<u64>,
    /// Times an acked publish is sent again, with the same sequence, after a retryable
    /// answer (`ingress_budget_exhausted`, `unavailable` naming the batch's sequence: its
    /// original is still being stored, `out_of_sequence` naming an earlier batch still
    /// missing); 0 turns retries off. Only idempotent publishes are retried. Default
    /// [`DEFAULT_PUBLISH_RETRIES`].
    pub publish_retries: u32,
    /// Wait before the first retry; it doubles per retry up to [`PUBLISH_RETRY_BACKOFF_MAX`].
    /// Default [`DEFAULT_PUBLISH_RETRY_BACKOFF`].
    pub publish_retry_backoff: Duration,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("addr", &self.addr)
            .field("server_name", &self.server_name)
            .field("ca", &self.ca)
            .field("insecure", &self.insecure)
            .field("publish_inflight_bytes", &self.publish_inflight_bytes)
            .field("client_name", &self.client_name)
            .field("core_aware", &self.core_aware)
            .field("pub_shard_streams", &self.pub_shard_streams)
            // Never the token itself.
            .field("token", &self.token.as_ref().map(|_| "(hidden)"))
            .field("identity", &self.identity)
            .field("max_mtu", &self.max_mtu)
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("idempotent", &self.idempotent)
            .field("producer_id", &self.producer_id)
            .field("publish_retries", &self.publish_retries)
            .field("publish_retry_backoff", &self.publish_retry_backoff)
            .finish()
    }
}

impl ClientConfig {
    /// Defaults for `addr`: server name `localhost`, system trust store, 4 MiB budget.
    #[must_use]
    pub fn new(addr: SocketAddr) -> ClientConfig {
        ClientConfig {
            addr,
            server_name: "localhost".to_owned(),
            ca: None,
            insecure: false,
            publish_inflight_bytes: DEFAULT_PUBLISH_INFLIGHT_BYTES,
            client_name: concat!("felix-client/", env!("CARGO_PKG_VERSION")).to_owned(),
            core_aware: true,
            pub_shard_streams: DEFAULT_PUB_SHARD_STREAMS,
            token: None,
            identity: None,
            max_mtu: DEFAULT_MAX_MTU,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            idempotent: true,
            producer_id: None,
            publish_retries: DEFAULT_PUBLISH_RETRIES,
            publish_retry_backoff: DEFAULT_PUBLISH_RETRY_BACKOFF,
        }
    }
}

/// The answer a pending request waits for.
type Answer = Result<Frame, Failure>;

struct Pending {
    answer: oneshot::Sender<Answer>,
    /// Budget held by an acked publish until its answer arrives.
    _permit: Option<OwnedSemaphorePermit>,
}

#[derive(Default)]
struct PendingTable {
    requests: FxHashMap<u64, Pending>,
    /// Set once the request stream failed; later requests fail at once.
    failed: Option<Failure>,
}

/// State shared by the client handle and its reader/writer tasks.
struct Shared {
    pending: Mutex<PendingTable>,
}

impl Shared {
    fn table(&self) -> std::sync::MutexGuard<'_, PendingTable> {
        // A panic while holding this lock cannot leave the table inconsistent (each operation
        // is a single insert/remove), so a poisoned lock is still usable.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn register(
        &self,
        request_id: u64,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<oneshot::Receiver<Answer>, ClientError> {
        let mut table = self.table();
        if let Some(failure) = &table.failed {
            return Err(failure.to_error());
        }
        let (answer, receiver) = oneshot::channel();
        table.requests.insert(
            request_id,
            Pending {
                answer,
                _permit: permit,
            },
        );
        Ok(receiver)
    }

    fn answer(&self, request_id: u64, frame: Frame) {
        let pending = self.table().requests.remove(&request_id);
        match pending {
            // The caller may have stopped waiting; the permit is released either way.
            Some(pending) => {
                let _ = pending.answer.send(Ok(frame));
            }
            None => tracing::warn!(request_id, "answer for an unknown request id; ignored"),
        }
    }

    fn fail_all(&self, failure: &Failure) {
        let requests = {
            let mut table = self.table();
            if table.failed.is_none() {
                table.failed = Some(failure.clone());
            }
            std::mem::take(&mut table.requests)
        };
        for (_, pending) in requests {
            let _ = pending.answer.send(Err(failure.clone()));
        }
    }
}

enum WriterCommand {
    Frame {
        chunks: Vec<Bytes>,
        /// Budget of a fire-and-forget publish, released once written.
        permit: Option<OwnedSemaphorePermit>,
    },
    Close {
        done: oneshot::Sender<()>,
    },
}

/// One QUIC connection: its admin (hello) stream and its publish streams, which share one
/// pending-request table.
struct Conn {
    handle: s2n_quic::connection::Handle,
    admin: mpsc::Sender<WriterCommand>,
    /// Publish streams, opened on first use; `pub_shard_streams` of them, or
    /// [`PUBLISH_POOL_STREAMS`] when pooled.
    publish_streams: Vec<tokio::sync::OnceCell<mpsc::Sender<WriterCommand>>>,
    /// `(stream name, shard)` -> publish stream index, first come first served.
    shard_streams: Mutex<StreamAssignment>,
    /// Round-robin position when pooled.
    next_pooled: AtomicUsize,
    pooled: bool,
    shared: Arc<Shared>,
    hello: HelloOk,
    decoder: Decoder,
    // Kept so the connection does not drop peer-initiated stream state under us.
    _acceptor: s2n_quic::connection::StreamAcceptor,
}

/// Each stream's shards' publish streams on one connection.
#[derive(Debug, Default)]
struct StreamAssignment {
    /// Stream name -> publish stream index per shard ([`UNASSIGNED`] until first used).
    by_stream: FxHashMap<String, Vec<usize>>,
    /// `(stream, shard)` pairs assigned so far: the next one gets `assigned % streams`.
    assigned: usize,
}

/// A shard not yet given a publish stream.
const UNASSIGNED: usize = usize::MAX;

/// Publish streams per connection when FELIX_PUB_SHARD_STREAMS is 0 (pooled).
pub const PUBLISH_POOL_STREAMS: usize = 4;
/// Default of [`ClientConfig::pub_shard_streams`] (FELIX_PUB_SHARD_STREAMS).
pub const DEFAULT_PUB_SHARD_STREAMS: u32 = 4;

/// A connection to a broker: the connection to `ClientConfig::addr` for admin requests, plus
/// (core-aware) one connection per data-plane core it publishes to or subscribes from, opened
/// lazily on that core's own port. Dropping it closes every connection.
pub struct Client {
    config: ClientConfig,
    /// The one QUIC endpoint every connection of this client uses.
    endpoint: s2n_quic::Client,
    primary: Conn,
    /// Per data-plane core, its own-port connection (core-aware only).
    cores: Vec<tokio::sync::OnceCell<Conn>>,
    /// Stream name -> owning core of each shard, from HelloOk, StreamInfo and describe.
    routes: Mutex<FxHashMap<String, Arc<[u16]>>>,
    budget: Arc<Semaphore>,
    budget_permits: u64,
    next_request_id: Arc<AtomicU64>,
    /// Idempotent publishing: set when configured and the broker echoed the feature.
    producer: Option<Arc<ProducerState>>,
}

/// How a producer's batch is numbered: the producer's next sequence on the shard, or one the
/// caller gives (`Client::publish_sequenced`).
#[derive(Clone, Copy)]
enum Producing<'a> {
    Next(&'a ProducerState, u32),
    Given {
        producer: u64,
        sequence: u64,
        shard: u32,
    },
}

/// An idempotent producer's numbering: per stream and shard, the producer id its batches
/// carry and the last sequence given.
#[derive(Debug)]
struct ProducerState {
    id: u64,
    /// Stream name -> per shard `(producer id, last sequence)`; `(0, 0)` until first used.
    shards: Mutex<FxHashMap<String, Vec<(u64, u64)>>>,
}

impl ProducerState {
    /// The producer id and the next sequence for `stream`'s `shard`: one lookup by name, no
    /// allocation after a stream's first batch.
    fn next(&self, stream: &str, shard: u32) -> (u64, u64) {
        let mut streams = self.shards.lock().unwrap_or_else(PoisonError::into_inner);
        if !streams.contains_key(stream) {
            streams.insert(stream.to_owned(), Vec::new());
        }
        let Some(shards) = streams.get_mut(stream) else {
            return (self.id, 0);
        };
        let slot = shard as usize;
        if shards.len() <= slot {
            shards.resize(slot + 1, (0, 0));
        }
        let entry = &mut shards[slot];
        if entry.0 == 0 {
            entry.0 = self.id;
        }
        entry.1 += 1;
        *entry
    }

    /// Whether `stream`'s `shard` still goes out as `producer`.
    fn current(&self, stream: &str, shard: u32, producer: u64) -> bool {
        let streams = self.shards.lock().unwrap_or_else(PoisonError::into_inner);
        streams
            .get(stream)
            .and_then(|shards| shards.get(shard as usize))
            .is_some_and(|entry| entry.0 == producer)
    }

    /// A batch of `producer` on this shard ended in an error (refused for good, or
    /// `out_of_sequence` with detail 0: the broker forgot the producer): its sequence is a
    /// gap the broker would refuse every later batch for, so the shard's later batches go out
    /// under a fresh random id from sequence 1, unless that happened already. Batches
    /// pipelined behind it under the old id are refused (`out_of_sequence`), not retried.
    fn abandon(&self, stream: &str, shard: u32, producer: u64) {
        let mut streams = self.shards.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = streams
            .get_mut(stream)
            .and_then(|shards| shards.get_mut(shard as usize))
            && entry.0 == producer
        {
            *entry = (random_producer_id(), 0);
        }
    }
}

/// A random 64-bit producer id (docs/semantics.md, "Idempotent producers": the collision
/// odds). Never 0.
fn random_producer_id() -> u64 {
    loop {
        let id = rand::random::<u64>();
        if id != 0 {
            return id;
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("connection", &self.primary.handle.id())
            .field("core_aware", &self.config.core_aware)
            .finish_non_exhaustive()
    }
}

fn tls_client(
    config: &ClientConfig,
) -> Result<s2n_quic::provider::tls::default::Client, ClientError> {
    let tls_error = |error: &dyn std::fmt::Display| ClientError::Tls(error.to_string());
    let mut builder = s2n_quic::provider::tls::default::Client::builder()
        .with_application_protocols([felix_wire::ALPN])
        .map_err(|e| tls_error(&e))?;
    if config.insecure {
        tracing::warn!(
            addr = %config.addr,
            "TLS certificate verification is OFF (insecure): use only for development"
        );
        // SAFETY: s2n-tls marks this unsafe because it removes authentication of the peer,
        // not because of memory safety; the caller asked for it explicitly (`insecure`).
        unsafe { builder.config_mut().disable_x509_verification() }.map_err(|e| tls_error(&e))?;
    } else if let Some(ca) = &config.ca {
        let pem = std::fs::read_to_string(ca).map_err(|error| {
            ClientError::Tls(format!("cannot read CA file {}: {error}", ca.display()))
        })?;
        builder = builder
            .with_empty_trust_store()
            .and_then(|builder| builder.with_certificate(pem.as_str()))
            .map_err(|error| {
                ClientError::Tls(format!("cannot use CA file {}: {error}", ca.display()))
            })?;
    }
    if let Some(identity) = &config.identity {
        let read = |path: &std::path::Path, what: &str| {
            std::fs::read_to_string(path).map_err(|error| {
                ClientError::Tls(format!(
                    "cannot read the client {what} {}: {error}",
                    path.display()
                ))
            })
        };
        let cert = read(&identity.cert, "certificate")?;
        let key = read(&identity.key, "key")?;
        builder = builder
            .with_client_identity(cert.as_str(), key.as_str())
            .map_err(|error| {
                ClientError::Tls(format!(
                    "cannot use the client certificate {}: {error}",
                    identity.cert.display()
                ))
            })?;
    }
    builder.build().map_err(|e| tls_error(&e))
}

/// The client's one QUIC endpoint (one UDP socket, one event loop task): every connection of
/// a [`Client`] (the primary one and each core's) goes through it.
fn endpoint(config: &ClientConfig) -> Result<s2n_quic::Client, ClientError> {
    let tls = tls_client(config)?;
    let connect_error = |reason: String| ClientError::Connect {
        addr: config.addr,
        reason,
    };
    let bind: SocketAddr = if config.addr.is_ipv6() {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    } else {
        SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0))
    };
    let max_mtu = config
        .max_mtu
        .clamp(MTU_UPPER_BOUND_MIN, MTU_UPPER_BOUND_CLAMP);
    let io = s2n_quic::provider::io::Default::builder()
        .with_receive_address(bind)
        .and_then(|builder| builder.with_max_mtu(max_mtu))
        .and_then(|builder| builder.build())
        .map_err(|error| connect_error(error.to_string()))?;
    // The handshake may take all of `connect_timeout` (s2n-quic's own bound is 10 s).
    let limits = s2n_quic::provider::limits::Limits::new()
        .with_max_idle_timeout(config.idle_timeout)
        .and_then(|limits| limits.with_max_handshake_duration(config.connect_timeout))
        .map_err(|error| connect_error(error.to_string()))?;
    s2n_quic::Client::builder()
        .with_tls(tls)
        .map_err(|error| ClientError::Tls(error.to_string()))?
        .with_limits(limits)
        .map_err(|error| connect_error(error.to_string()))?
        .with_io(io)
        .map_err(|error| connect_error(error.to_string()))?
        .start()
        .map_err(|error| connect_error(error.to_string()))
}

impl Conn {
    /// Connects over `endpoint`, performs the `Hello` handshake, and starts the admin stream.
    async fn connect(
        endpoint: &s2n_quic::Client,
        config: &ClientConfig,
        addr: SocketAddr,
    ) -> Result<Conn, ClientError> {
        let connect_error = |reason: String| ClientError::Connect { addr, reason };
        let connect = Connect::new(addr).with_server_name(config.server_name.as_str());
        let timeout = config.connect_timeout;
        let attempt = tokio::time::timeout(timeout, endpoint.connect(connect)).await;
        let mut connection = match attempt {
            Ok(Ok(connection)) => connection,
            Ok(Err(error)) => return Err(connect_error(describe_connection_error(&error))),
            Err(_) => {
                return Err(connect_error(format!("no answer within {timeout:?}")));
            }
        };
        // Subscriptions may be idle for long; keep-alives stop the idle timer closing them.
        connection
            .keep_alive(true)
            .map_err(|error| connect_error(describe_connection_error(&error)))?;
        let stream = connection
            .open_bidirectional_stream()
            .await
            .map_err(|error| connect_error(describe_connection_error(&error)))?;
        let (handle, acceptor) = connection.split();
        let (mut receive, mut send) = stream.split();
        let hello = Frame::Hello(Hello {
            min_version: felix_wire::PROTOCOL_VERSION,
            max_version: felix_wire::PROTOCOL_VERSION,
            features: if config.idempotent {
                felix_wire::FEATURE_PRODUCER
            } else {
                0
            },
            client_name: config.client_name.clone(),
            token: config
                .token
                .as_ref()
                .map(|token| Bytes::from(token.clone())),
        });
        let mut out = BytesMut::new();
        felix_wire::encode(&hello, &mut out);
        send.send(out.freeze())
            .await
            .map_err(|error| connect_error(describe_stream_error(&error)))?;
        // The broker's limits are not known yet: read HelloOk with the protocol defaults
        // (the broker's frame limit may be larger; HelloOk itself is small).
        let hello_decoder = Decoder::new(Limits::DEFAULT);
        let mut buffer = BytesMut::new();
        let hello_ok = tokio::time::timeout(
            timeout,
            read_frame(&hello_decoder, &mut receive, &mut buffer),
        )
        .await
        .map_err(|_| connect_error(format!("no HelloOk within {timeout:?}")))?;
        let hello_ok = match hello_ok? {
            Frame::HelloOk(hello_ok) => hello_ok,
            Frame::Error(error) => return Err(ClientError::from_error_frame(error)),
            other => {
                return Err(ClientError::Protocol(format!(
                    "expected HelloOk, got {other:?}"
                )));
            }
        };
        if hello_ok.version != felix_wire::PROTOCOL_VERSION {
            return Err(ClientError::Protocol(format!(
                "the broker chose protocol version {}",
                hello_ok.version
            )));
        }
        let decoder = Decoder::new(hello_ok.limits);
        let shared = Arc::new(Shared {
            pending: Mutex::new(PendingTable::default()),
        });
        let admin = start_stream_tasks(send, receive, buffer, decoder.clone(), &shared);
        let pooled = config.pub_shard_streams == 0;
        let stream_count = if pooled {
            PUBLISH_POOL_STREAMS
        } else {
            usize::try_from(config.pub_shard_streams).unwrap_or(PUBLISH_POOL_STREAMS)
        };
        Ok(Conn {
            handle,
            admin,
            publish_streams: (0..stream_count)
                .map(|_| tokio::sync::OnceCell::new())
                .collect(),
            shard_streams: Mutex::new(StreamAssignment::default()),
            next_pooled: AtomicUsize::new(0),
            pooled,
            shared,
            hello: hello_ok,
            decoder,
            _acceptor: acceptor,
        })
    }

    /// Sets `dests[i]` for every record `i` bound for `core` (`cores[i] == core`): this
    /// connection and the publish stream of its shard `shards[i]`. Pooled, the current
    /// round-robin stream; else each `(stream, shard)` keeps the stream it was first given
    /// (first come first served), so per-shard order holds across pipelined publishes.
    fn assign_streams(
        &self,
        stream: &str,
        core: Option<u16>,
        shards: &[u32],
        cores: &[Option<u16>],
        dests: &mut [Dest],
    ) {
        let count = self.publish_streams.len();
        let mine = shards
            .iter()
            .zip(cores)
            .zip(dests.iter_mut())
            .filter(|((_, record_core), _)| **record_core == core);
        if self.pooled {
            let stream_index = self.next_pooled.load(Ordering::Relaxed) % count;
            for (_, dest) in mine {
                *dest = Dest { core, stream_index };
            }
            return;
        }
        let mut assignment = self
            .shard_streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let StreamAssignment {
            by_stream,
            assigned,
        } = &mut *assignment;
        // Allocates the stream's name once, on its first publish through this connection.
        if !by_stream.contains_key(stream) {
            by_stream.insert(stream.to_owned(), Vec::new());
        }
        let Some(by_shard) = by_stream.get_mut(stream) else {
            return;
        };
        for ((&shard, _), dest) in mine {
            let slot = shard as usize;
            if by_shard.len() <= slot {
                by_shard.resize(slot + 1, UNASSIGNED);
            }
            if by_shard[slot] == UNASSIGNED {
                by_shard[slot] = *assigned % count;
                *assigned += 1;
            }
            *dest = Dest {
                core,
                stream_index: by_shard[slot],
            };
        }
    }

    /// The writer of publish stream `index`, opening the stream on first use.
    async fn publish_writer(
        &self,
        index: usize,
    ) -> Result<&mpsc::Sender<WriterCommand>, ClientError> {
        self.publish_streams[index]
            .get_or_try_init(|| async {
                let mut handle = self.handle.clone();
                let stream = handle
                    .open_bidirectional_stream()
                    .await
                    .map_err(|error| ClientError::Closed(describe_connection_error(&error)))?;
                let (receive, send) = stream.split();
                Ok(start_stream_tasks(
                    send,
                    receive,
                    BytesMut::new(),
                    self.decoder.clone(),
                    &self.shared,
                ))
            })
            .await
    }

    fn closed_error(&self) -> ClientError {
        match &self.shared.table().failed {
            Some(failure) => failure.to_error(),
            None => ClientError::Closed("the client's request stream is closed".to_owned()),
        }
    }

    async fn queue(
        &self,
        writer: &mpsc::Sender<WriterCommand>,
        chunks: Vec<Bytes>,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<(), ClientError> {
        writer
            .send(WriterCommand::Frame { chunks, permit })
            .await
            .map_err(|_| self.closed_error())
    }

    /// Finishes every stream (bounded wait), then closes the connection with code 0.
    async fn close(&self) {
        let writers = std::iter::once(&self.admin)
            .chain(self.publish_streams.iter().filter_map(|cell| cell.get()));
        for writer in writers {
            let (done, finished) = oneshot::channel();
            if writer.send(WriterCommand::Close { done }).await.is_ok() {
                let _ = finished.await;
            }
        }
        self.handle.close(0u32.into());
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.handle.close(0u32.into());
    }
}

/// Starts the writer and reader tasks of one request stream; returns the writer's queue.
fn start_stream_tasks(
    send: SendStream,
    receive: ReceiveStream,
    buffer: BytesMut,
    decoder: Decoder,
    shared: &Arc<Shared>,
) -> mpsc::Sender<WriterCommand> {
    let (writer, commands) = mpsc::channel(WRITER_QUEUE_DEPTH);
    tokio::spawn(write_loop(send, commands, Arc::clone(shared)));
    tokio::spawn(read_loop(receive, buffer, decoder, Arc::clone(shared)));
    writer
}

/// Where records go: a connection (an owner core's, or the primary one) and one of its
/// publish streams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Dest {
    core: Option<u16>,
    stream_index: usize,
}

/// One publish's records by destination: all of them to one (the common case: borrowed as
/// they are, nothing copied or cloned), or split by owner core and publish stream (batch
/// order kept within each part).
enum Parts<'r> {
    One(Dest, &'r [Record]),
    Split(Vec<(Dest, Vec<Record>)>),
}

impl Parts<'_> {
    fn iter(&self) -> impl Iterator<Item = (Dest, &[Record])> {
        let (one, split) = match self {
            Parts::One(dest, records) => (Some((*dest, *records)), &[][..]),
            Parts::Split(parts) => (None, parts.as_slice()),
        };
        one.into_iter().chain(
            split
                .iter()
                .map(|(dest, records)| (*dest, records.as_slice())),
        )
    }

    fn len(&self) -> usize {
        match self {
            Parts::One(..) => 1,
            Parts::Split(parts) => parts.len(),
        }
    }
}

/// An idempotent publish's records by shard: all of one shard (borrowed as they are), or
/// split by shard (batch order kept within each), each part with its destination.
enum ShardParts<'r> {
    One(Dest, u32, &'r [Record]),
    Split(Vec<(Dest, u32, Vec<Record>)>),
}

impl ShardParts<'_> {
    fn iter(&self) -> impl Iterator<Item = (Dest, u32, &[Record])> {
        let (one, split) = match self {
            ShardParts::One(dest, shard, records) => (Some((*dest, *shard, *records)), &[][..]),
            ShardParts::Split(parts) => (None, parts.as_slice()),
        };
        one.into_iter().chain(
            split
                .iter()
                .map(|(dest, shard, records)| (*dest, *shard, records.as_slice())),
        )
    }

    fn len(&self) -> usize {
        match self {
            ShardParts::One(..) => 1,
            ShardParts::Split(parts) => parts.len(),
        }
    }
}

/// Payloads at least this long go to QUIC as chunks of their own (a vectored write), not
/// copied into the frame; shorter ones are cheaper to copy than to carry as a chunk: s2n-quic
/// pays per chunk boundary when it fills packets. Measured with callgrind (docs/performance.md,
/// "Vectored writes"): at 4 KiB payloads the copy is cheaper (client 15.9 k against 18.0 k
/// instructions per record), at 8 KiB the two are even, at 16 KiB and 64 KiB the vectored write
/// saves 8-9 %.
const VECTORED_PAYLOAD_MIN: usize = 8 * 1024;

impl Client {
    /// Connects to `config.addr`, performs the TLS and `Hello` handshakes, and starts the
    /// admin stream. Core-aware clients open their per-core connections later, when needed.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        let endpoint = endpoint(&config)?;
        let primary = Conn::connect(&endpoint, &config, config.addr).await?;
        let cores = if config.core_aware {
            (0..primary.hello.core_ports.len())
                .map(|_| tokio::sync::OnceCell::new())
                .collect()
        } else {
            Vec::new()
        };
        let routes = primary
            .hello
            .shard_map
            .iter()
            .map(|route| (route.name.clone(), Arc::from(route.shard_cores.as_slice())))
            .collect();
        let budget_permits = config.publish_inflight_bytes.clamp(1, BUDGET_PERMITS_MAX);
        let budget = Arc::new(Semaphore::new(
            usize::try_from(budget_permits).unwrap_or(usize::MAX),
        ));
        let producer = (config.idempotent
            && primary.hello.features & felix_wire::FEATURE_PRODUCER != 0)
            .then(|| {
                Arc::new(ProducerState {
                    id: config.producer_id.unwrap_or_else(random_producer_id),
                    shards: Mutex::new(FxHashMap::default()),
                })
            });
        Ok(Client {
            config,
            endpoint,
            primary,
            cores,
            routes: Mutex::new(routes),
            budget,
            budget_permits,
            next_request_id: Arc::new(AtomicU64::new(1)),
            producer,
        })
    }

    /// The broker's handshake answer (limits, ports, shard map at connect time).
    #[must_use]
    pub fn hello(&self) -> &HelloOk {
        &self.primary.hello
    }

    /// The broker's limits.
    #[must_use]
    pub fn limits(&self) -> &Limits {
        &self.primary.hello.limits
    }

    /// Per-core connections opened so far (core-aware clients), for diagnostics and tests.
    #[must_use]
    pub fn core_connections(&self) -> usize {
        self.cores
            .iter()
            .filter(|cell| cell.get().is_some())
            .count()
    }

    fn next_request_id(&self) -> u64 {
        self.next_request_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The connection for `core`: the primary one when not core-aware (or `None`), else that
    /// core's own-port connection, opened on first use.
    async fn conn(&self, core: Option<u16>) -> Result<&Conn, ClientError> {
        let Some(core) = core else {
            return Ok(&self.primary);
        };
        let Some(cell) = self.cores.get(usize::from(core)) else {
            return Ok(&self.primary);
        };
        let port = self.primary.hello.core_ports[usize::from(core)];
        let addr = SocketAddr::new(self.config.addr.ip(), port);
        cell.get_or_try_init(|| Conn::connect(&self.endpoint, &self.config, addr))
            .await
    }

    fn remember_route(&self, info: &StreamInfo) {
        let cores: Arc<[u16]> = info.shards.iter().map(|shard| shard.core).collect();
        self.routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(info.name.clone(), cores);
    }

    /// Owning core per shard of `stream`, describing it once if unknown. `None` if the broker
    /// cannot describe it (the publish then goes to the primary connection, which answers).
    async fn route(&self, stream: &str) -> Option<Arc<[u16]>> {
        let known = self
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(stream)
            .cloned();
        if known.is_some() {
            return known;
        }
        let info = self.describe_stream(stream).await.ok()?;
        let cores: Arc<[u16]> = info.shards.iter().map(|shard| shard.core).collect();
        Some(cores)
    }

    /// Splits a batch by owner core (core-aware) and publish stream, keeping batch order
    /// within each part. One route lookup and one lock per connection touched, whatever the
    /// batch size; a batch bound for one destination is borrowed, not cloned.
    async fn parts<'r>(
        &self,
        stream: &str,
        records: &'r [Record],
    ) -> Result<Parts<'r>, ClientError> {
        self.check_batch(stream, records)?;
        let route = self.route(stream).await;
        let Some(route) = route.filter(|route| !route.is_empty()) else {
            return Ok(Parts::One(Dest::default(), records));
        };
        let shard_count = u32::try_from(route.len()).unwrap_or(u32::MAX);
        let core_of = |shard: u32| {
            if self.cores.is_empty() {
                None
            } else {
                Some(route[shard as usize])
            }
        };
        if let [record] = records {
            let shard = felix_wire::shard_for_key(&record.key, shard_count);
            let core = core_of(shard);
            let mut dest = [Dest::default()];
            self.conn(core)
                .await?
                .assign_streams(stream, core, &[shard], &[core], &mut dest);
            return Ok(Parts::One(dest[0], records));
        }
        let shards: Vec<u32> = records
            .iter()
            .map(|record| felix_wire::shard_for_key(&record.key, shard_count))
            .collect();
        let cores: Vec<Option<u16>> = shards.iter().map(|&shard| core_of(shard)).collect();
        let mut dests = vec![Dest::default(); records.len()];
        let mut done: Vec<Option<u16>> = Vec::new();
        for &core in &cores {
            if !done.contains(&core) {
                done.push(core);
                self.conn(core)
                    .await?
                    .assign_streams(stream, core, &shards, &cores, &mut dests);
            }
        }
        let first = dests[0];
        if dests.iter().all(|dest| *dest == first) {
            return Ok(Parts::One(first, records));
        }
        let mut parts: Vec<(Dest, Vec<Record>)> = Vec::new();
        for (record, dest) in records.iter().zip(&dests) {
            match parts.iter_mut().find(|(part, _)| part == dest) {
                Some((_, part)) => part.push(record.clone()),
                None => parts.push((*dest, vec![record.clone()])),
            }
        }
        Ok(Parts::Split(parts))
    }

    /// Sends one admin request and waits for its answer (an `Error` answer is an error).
    async fn request(&self, build: impl FnOnce(u64) -> Frame) -> Result<Frame, ClientError> {
        let conn = &self.primary;
        let request_id = self.next_request_id();
        let answer = conn.shared.register(request_id, None)?;
        let mut out = BytesMut::new();
        felix_wire::encode(&build(request_id), &mut out);
        conn.queue(&conn.admin, vec![out.freeze()], None).await?;
        match answer.await {
            Ok(Ok(Frame::Error(error))) => Err(ClientError::from_error_frame(error)),
            Ok(Ok(frame)) => Ok(frame),
            Ok(Err(failure)) => Err(failure.to_error()),
            Err(_) => Err(conn.closed_error()),
        }
    }

    /// Creates a stream of `shard_count` shards.
    pub async fn create_stream(
        &self,
        name: &str,
        shard_count: u32,
        kind: StreamKind,
    ) -> Result<StreamInfo, ClientError> {
        let name = name.to_owned();
        let frame = self
            .request(|request_id| {
                Frame::CreateStream(felix_wire::CreateStream {
                    request_id,
                    name,
                    shard_count,
                    kind,
                })
            })
            .await?;
        let info = expect_stream_info(frame)?;
        self.remember_route(&info);
        Ok(info)
    }

    /// Describes a stream: kind, hash and per-shard offsets and owner cores.
    pub async fn describe_stream(&self, name: &str) -> Result<StreamInfo, ClientError> {
        let name = name.to_owned();
        let frame = self
            .request(|request_id| Frame::DescribeStream { request_id, name })
            .await?;
        let info = expect_stream_info(frame)?;
        self.remember_route(&info);
        Ok(info)
    }

    /// Every stream, sorted by name.
    pub async fn list_streams(&self) -> Result<Vec<StreamSummary>, ClientError> {
        match self
            .request(|request_id| Frame::ListStreams { request_id })
            .await?
        {
            Frame::StreamList { streams, .. } => Ok(streams),
            other => Err(unexpected("StreamList", &other)),
        }
    }

    /// Deletes a stream; its subscribers get `StreamNotFound`.
    pub async fn delete_stream(&self, name: &str) -> Result<(), ClientError> {
        let forget = name.to_owned();
        let name = name.to_owned();
        match self
            .request(|request_id| Frame::DeleteStream { request_id, name })
            .await?
        {
            Frame::Done { .. } => {
                self.routes
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&forget);
                Ok(())
            }
            other => Err(unexpected("Done", &other)),
        }
    }

    /// Checks a batch against the broker's limits before anything is sent.
    fn check_batch(&self, stream: &str, records: &[Record]) -> Result<(), ClientError> {
        let limits = &self.primary.hello.limits;
        if records.is_empty() {
            return Err(ClientError::InvalidArgument(
                "a publish needs at least one record".to_owned(),
            ));
        }
        if records.len() > limits.max_batch_records as usize {
            return Err(ClientError::InvalidArgument(format!(
                "a batch of {} records exceeds the broker's limit of {}",
                records.len(),
                limits.max_batch_records
            )));
        }
        if stream.len() > usize::from(limits.max_name_bytes) {
            return Err(ClientError::InvalidArgument(format!(
                "stream name of {} bytes exceeds the limit of {}",
                stream.len(),
                limits.max_name_bytes
            )));
        }
        Ok(())
    }

    /// Encodes a publish as the chunks of one vectored write, checking the broker's limits
    /// first: the frame's header and the records, except that payloads of at least
    /// [`VECTORED_PAYLOAD_MIN`] bytes are chunks of their own (a reference, not a copy).
    fn encode_publish(
        &self,
        request_id: u64,
        ack: AckMode,
        stream: &str,
        records: &[Record],
        producer: Option<Producing<'_>>,
    ) -> Result<(Vec<Bytes>, (u64, u64)), ClientError> {
        let limits = &self.primary.hello.limits;
        let mut records_len = 0usize;
        let mut copied_len = 0usize;
        let mut chunk_count = 1usize;
        for record in records {
            if record.key.len() > usize::from(limits.max_key_bytes) {
                return Err(ClientError::InvalidArgument(format!(
                    "key of {} bytes exceeds the limit of {}",
                    record.key.len(),
                    limits.max_key_bytes
                )));
            }
            if record.payload.len() > limits.max_payload_bytes as usize {
                return Err(ClientError::InvalidArgument(format!(
                    "payload of {} bytes exceeds the limit of {}",
                    record.payload.len(),
                    limits.max_payload_bytes
                )));
            }
            let len = felix_wire::encoded_record_len(record.key.len(), record.payload.len());
            records_len += len;
            if record.payload.len() >= VECTORED_PAYLOAD_MIN {
                copied_len += len - record.payload.len();
                chunk_count += 2;
            } else {
                copied_len += len;
            }
        }
        let producer_len = if producer.is_some() {
            felix_wire::PRODUCER_FIELDS_LEN
        } else {
            0
        };
        let body_len = felix_wire::encoded_publish_len(stream, 0, 0) - felix_wire::FRAME_HEADER_LEN
            + producer_len
            + records_len;
        if body_len > limits.max_frame_bytes as usize {
            return Err(ClientError::InvalidArgument(format!(
                "a publish of {body_len} bytes exceeds the broker's frame limit of {}; send smaller batches",
                limits.max_frame_bytes
            )));
        }
        let mut buf = BytesMut::new();
        // The count was checked against max_batch_records (a u32) in check_batch.
        let record_count = u32::try_from(records.len()).unwrap_or(u32::MAX);
        // Every check is done: the sequence is taken only for a frame that goes out (a
        // sequence taken and not sent would be a gap the broker refuses later batches for).
        let mut numbered = (0, 0);
        match producer {
            Some(producing) => {
                let shard = match producing {
                    Producing::Next(producer, shard) => {
                        numbered = producer.next(stream, shard);
                        shard
                    }
                    Producing::Given {
                        producer,
                        sequence,
                        shard,
                    } => {
                        numbered = (producer, sequence);
                        shard
                    }
                };
                felix_wire::encode_producer_publish_header(
                    &felix_wire::ProducerHeader {
                        request_id,
                        ack,
                        producer: numbered.0,
                        sequence: numbered.1,
                        shard,
                    },
                    stream,
                    record_count,
                    records_len,
                    &mut buf,
                );
            }
            None => felix_wire::encode_publish_header(
                request_id,
                ack,
                stream,
                record_count,
                records_len,
                &mut buf,
            ),
        }
        buf.reserve(copied_len);
        let mut chunks = Vec::with_capacity(chunk_count);
        for record in records {
            if record.payload.len() >= VECTORED_PAYLOAD_MIN {
                felix_wire::encode_record_head(&record.key, record.payload.len(), &mut buf);
                chunks.push(buf.split().freeze());
                chunks.push(record.payload.clone());
            } else {
                felix_wire::encode_record(&record.key, &record.payload, &mut buf);
            }
        }
        if !buf.is_empty() {
            chunks.push(buf.freeze());
        }
        Ok((chunks, numbered))
    }

    /// Takes budget for `bytes` (the whole budget for a batch larger than it).
    async fn acquire_budget(&self, bytes: usize) -> Result<OwnedSemaphorePermit, ClientError> {
        let wanted = u64::try_from(bytes)
            .unwrap_or(u64::MAX)
            .clamp(1, self.budget_permits);
        // `budget_permits` <= u32::MAX by construction.
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        Arc::clone(&self.budget)
            .acquire_many_owned(wanted)
            .await
            .map_err(|_| ClientError::Closed("the publish budget is closed".to_owned()))
    }

    /// Queues an acked publish and returns once it is handed to the writers; the returned
    /// future resolves to the acks. Core-aware, each owner core's records go straight to that
    /// core; the acks are merged (one per shard, ascending). Keep several in flight for
    /// throughput; the in-flight byte budget makes this wait when too much is outstanding.
    pub async fn publish_pipelined(
        &self,
        stream: &str,
        records: &[Record],
    ) -> Result<PendingAck, ClientError> {
        if let Some(producer) = &self.producer
            && let Some(parts) = self.shard_parts(stream, records).await?
        {
            return self.publish_produced(producer, stream, parts).await;
        }
        let parts = self.parts(stream, records).await?;
        let mut answers = Vec::with_capacity(parts.len());
        for (dest, records) in parts.iter() {
            let conn = self.conn(dest.core).await?;
            let request_id = self.next_request_id();
            let (chunks, _) =
                self.encode_publish(request_id, AckMode::Acked, stream, records, None)?;
            let bytes = chunks.iter().map(Bytes::len).sum();
            let permit = self.acquire_budget(bytes).await?;
            let answer = conn.shared.register(request_id, Some(permit))?;
            let writer = conn.publish_writer(dest.stream_index).await?;
            conn.queue(writer, chunks, None).await?;
            answers.push(answer);
        }
        if self.primary.pooled {
            self.primary.next_pooled.fetch_add(1, Ordering::Relaxed);
            for cell in &self.cores {
                if let Some(conn) = cell.get() {
                    conn.next_pooled.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(PendingAck {
            answers: answers.into_iter().map(Some).collect(),
            ready: Vec::new(),
            retrying: None,
        })
    }

    /// Publishes `records`, every one of shard `shard` of `stream`, as batch `sequence` of
    /// idempotent producer `producer`, and waits for the ack; sent once, never retried here.
    /// For applications that number their own batches: a batch whose outcome is unknown (its
    /// connection went with a broker, a cluster answered `unavailable`) is sent again with the
    /// same producer and sequence, through any connection or cluster member, and is stored
    /// once (docs/semantics.md, "Idempotent producers"). Keep one producer's sequences per
    /// shard dense from 1 on a single broker (a gap is refused `out_of_sequence`).
    ///
    /// # Errors
    /// `InvalidArgument` when the broker did not take the producer feature, a record belongs
    /// to another shard or the stream's routing is unknown; the broker's refusal otherwise.
    pub async fn publish_sequenced(
        &self,
        stream: &str,
        shard: u32,
        producer: (u64, u64),
        records: &[Record],
    ) -> Result<Vec<ShardAck>, ClientError> {
        let answer = self
            .send_sequenced(stream, shard, producer, records)
            .await?;
        sequenced_acks(answer).await
    }

    /// [`Client::publish_sequenced`]'s sending half: returns once the batch is queued on its
    /// publish stream, with the receiver of its answer ([`sequenced_acks`] reads it).
    pub(crate) async fn send_sequenced(
        &self,
        stream: &str,
        shard: u32,
        (producer, sequence): (u64, u64),
        records: &[Record],
    ) -> Result<oneshot::Receiver<Answer>, ClientError> {
        if self.primary.hello.features & felix_wire::FEATURE_PRODUCER == 0 {
            return Err(ClientError::InvalidArgument(
                "the broker does not take idempotent producers (no producer feature)".to_owned(),
            ));
        }
        self.check_batch(stream, records)?;
        let Some(route) = self.route(stream).await.filter(|route| !route.is_empty()) else {
            return Err(ClientError::InvalidArgument(format!(
                "the routing of stream {stream:?} is unknown"
            )));
        };
        let shard_count = u32::try_from(route.len()).unwrap_or(u32::MAX);
        if records
            .iter()
            .any(|record| felix_wire::shard_for_key(&record.key, shard_count) != shard)
        {
            return Err(ClientError::InvalidArgument(format!(
                "a record of the batch belongs to another shard than {shard}"
            )));
        }
        let dest = self.shard_dest(stream, &route, shard).await?;
        let conn = self.conn(dest.core).await?;
        let request_id = self.next_request_id();
        let (chunks, _) = self.encode_publish(
            request_id,
            AckMode::Acked,
            stream,
            records,
            Some(Producing::Given {
                producer,
                sequence,
                shard,
            }),
        )?;
        let bytes = chunks.iter().map(Bytes::len).sum();
        let permit = self.acquire_budget(bytes).await?;
        let answer = conn.shared.register(request_id, Some(permit))?;
        let writer = conn.publish_writer(dest.stream_index).await?;
        conn.queue(writer, chunks, None).await?;
        Ok(answer)
    }

    /// This client's producer id, when it publishes as an idempotent producer (configured,
    /// and the broker echoed the feature).
    #[must_use]
    pub fn producer_id(&self) -> Option<u64> {
        self.producer.as_ref().map(|producer| producer.id)
    }

    /// A batch split by shard (batch order kept within each), each with its destination, for
    /// idempotent publishing; `None` when the stream's routing is unknown (the publish then
    /// goes out plain, and the broker answers it).
    async fn shard_parts<'r>(
        &self,
        stream: &str,
        records: &'r [Record],
    ) -> Result<Option<ShardParts<'r>>, ClientError> {
        self.check_batch(stream, records)?;
        let Some(route) = self.route(stream).await.filter(|route| !route.is_empty()) else {
            return Ok(None);
        };
        let shard_count = u32::try_from(route.len()).unwrap_or(u32::MAX);
        let shard_of = |record: &Record| felix_wire::shard_for_key(&record.key, shard_count);
        let first = records.first().map_or(0, shard_of);
        let mut parts = if records.iter().all(|record| shard_of(record) == first) {
            // The common case: one shard, the records borrowed as they are.
            ShardParts::One(Dest::default(), first, records)
        } else {
            let mut split: Vec<(Dest, u32, Vec<Record>)> = Vec::new();
            for record in records {
                let shard = shard_of(record);
                match split.iter_mut().find(|(_, part, _)| *part == shard) {
                    Some((_, _, part)) => part.push(record.clone()),
                    None => split.push((Dest::default(), shard, vec![record.clone()])),
                }
            }
            ShardParts::Split(split)
        };
        match &mut parts {
            ShardParts::One(dest, shard, _) => {
                *dest = self.shard_dest(stream, &route, *shard).await?
            }
            ShardParts::Split(split) => {
                for (dest, shard, _) in split {
                    *dest = self.shard_dest(stream, &route, *shard).await?;
                }
            }
        }
        Ok(Some(parts))
    }

    /// Where `stream`'s `shard` is published: its owner core's connection (core-aware) and
    /// the shard's publish stream there.
    async fn shard_dest(
        &self,
        stream: &str,
        route: &[u16],
        shard: u32,
    ) -> Result<Dest, ClientError> {
        let core = if self.cores.is_empty() {
            None
        } else {
            route.get(shard as usize).copied()
        };
        let mut one = [Dest::default()];
        self.conn(core)
            .await?
            .assign_streams(stream, core, &[shard], &[core], &mut one);
        Ok(one[0])
    }

    /// Sends one `ProducerPublish` per shard part, each with the shard's next sequence; the
    /// returned ack retries retryable answers with the same bytes (see
    /// [`ClientConfig::publish_retries`]).
    async fn publish_produced(
        &self,
        producer: &Arc<ProducerState>,
        stream: &str,
        parts: ShardParts<'_>,
    ) -> Result<PendingAck, ClientError> {
        let mut sent = Vec::with_capacity(parts.len());
        let name: Arc<str> = Arc::from(stream);
        for (dest, shard, records) in parts.iter() {
            let conn = self.conn(dest.core).await?;
            let request_id = self.next_request_id();
            let (chunks, (producer_id, sequence)) = self.encode_publish(
                request_id,
                AckMode::Acked,
                stream,
                records,
                Some(Producing::Next(producer, shard)),
            )?;
            let bytes = chunks.iter().map(Bytes::len).sum();
            let permit = self.acquire_budget(bytes).await?;
            let answer = conn.shared.register(request_id, Some(permit))?;
            let writer = conn.publish_writer(dest.stream_index).await?;
            conn.queue(writer, chunks.clone(), None).await?;
            sent.push((
                answer,
                SentPart {
                    writer: writer.clone(),
                    shared: Arc::clone(&conn.shared),
                    chunks,
                    stream: Arc::clone(&name),
                    shard,
                    producer: producer_id,
                    sequence,
                },
            ));
        }
        if self.primary.pooled {
            self.primary.next_pooled.fetch_add(1, Ordering::Relaxed);
            for cell in &self.cores {
                if let Some(conn) = cell.get() {
                    conn.next_pooled.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let retry = RetryPolicy {
            retries: self.config.publish_retries,
            backoff: self.config.publish_retry_backoff,
            next_request_id: Arc::clone(&self.next_request_id),
            producer: Arc::clone(producer),
        };
        let retrying = async move {
            let mut acks = Vec::new();
            let mut failed = None;
            for (answer, part) in sent {
                match retry.settle(answer, part).await {
                    Ok(shards) => acks.extend(shards),
                    Err(error) => {
                        failed.get_or_insert(error);
                    }
                }
            }
            if let Some(error) = failed {
                return Err(error);
            }
            acks.sort_unstable_by_key(|ack: &ShardAck| ack.shard);
            Ok(acks)
        };
        Ok(PendingAck {
            answers: Vec::new(),
            ready: Vec::new(),
            retrying: Some(Box::pin(retrying)),
        })
    }

    /// Publishes `records` to `stream` and waits for the acks: one per shard touched, in
    /// ascending shard order, with the offsets given.
    pub async fn publish(
        &self,
        stream: &str,
        records: &[Record],
    ) -> Result<Vec<ShardAck>, ClientError> {
        self.publish_pipelined(stream, records).await?.await
    }

    /// Publishes without an ack: returns once queued; the broker never answers, not even with
    /// an error (it counts them). Budget is released once the frame is written to QUIC.
    pub async fn publish_no_ack(
        &self,
        stream: &str,
        records: &[Record],
    ) -> Result<(), ClientError> {
        let parts = self.parts(stream, records).await?;
        for (dest, records) in parts.iter() {
            let conn = self.conn(dest.core).await?;
            let (chunks, _) =
                self.encode_publish(0, AckMode::FireAndForget, stream, records, None)?;
            let bytes = chunks.iter().map(Bytes::len).sum();
            let permit = self.acquire_budget(bytes).await?;
            let writer = conn.publish_writer(dest.stream_index).await?;
            conn.queue(writer, chunks, Some(permit)).await?;
        }
        if self.primary.pooled {
            self.primary.next_pooled.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Opens a subscription. `Latest` delivers only records appended after this returns;
    /// offsets resume from the replay ring (`TooOld` if already evicted). Core-aware, it
    /// subscribes on each owner core's connection and merges (per-shard order holds, since
    /// each shard comes from one core).
    pub async fn subscribe(
        &self,
        stream: &str,
        shards: ShardSelection,
        from: StartPosition,
    ) -> Result<Subscription, ClientError> {
        let route = if self.cores.is_empty() {
            None
        } else {
            self.route(stream).await
        };
        let Some(route) = route else {
            let part = self
                .subscribe_on(&self.primary, stream, shards, from)
                .await?;
            return Ok(Subscription::merged(vec![part]));
        };
        let shard_count = u32::try_from(route.len()).unwrap_or(u32::MAX);
        let selected: Vec<u32> = match &shards {
            ShardSelection::All => (0..shard_count).collect(),
            ShardSelection::List(list) => list.clone(),
        };
        let mut by_core: Vec<(u16, Vec<u32>)> = Vec::new();
        for shard in selected {
            // An out-of-range shard goes to core 0, whose broker answer names the problem.
            let core = route.get(shard as usize).copied().unwrap_or(0);
            match by_core.iter_mut().find(|(c, _)| *c == core) {
                Some((_, list)) => list.push(shard),
                None => by_core.push((core, vec![shard])),
            }
        }
        if by_core.is_empty() {
            // An empty selection: let the broker refuse it.
            let part = self
                .subscribe_on(&self.primary, stream, shards, from)
                .await?;
            return Ok(Subscription::merged(vec![part]));
        }
        let mut parts = Vec::with_capacity(by_core.len());
        for (core, list) in by_core {
            let position = match &from {
                StartPosition::Offsets(positions) => StartPosition::Offsets(
                    positions
                        .iter()
                        .copied()
                        .filter(|(shard, _)| list.contains(shard))
                        .collect(),
                ),
                other => other.clone(),
            };
            let conn = self.conn(Some(core)).await?;
            parts.push(
                self.subscribe_on(conn, stream, ShardSelection::List(list), position)
                    .await?,
            );
        }
        Ok(Subscription::merged(parts))
    }

    async fn subscribe_on(
        &self,
        conn: &Conn,
        stream: &str,
        shards: ShardSelection,
        from: StartPosition,
    ) -> Result<subscription::SubscriptionPart, ClientError> {
        let mut handle = conn.handle.clone();
        let bidirectional = handle
            .open_bidirectional_stream()
            .await
            .map_err(|error| ClientError::Closed(describe_connection_error(&error)))?;
        let (receive, send) = bidirectional.split();
        let request_id = self.next_request_id();
        let frame = Frame::Subscribe(felix_wire::Subscribe {
            request_id,
            stream: stream.to_owned(),
            shards,
            from,
        });
        subscription::SubscriptionPart::open(receive, send, conn.decoder.clone(), &frame).await
    }

    /// Finishes every stream (waiting until the broker has every queued frame, bounded), then
    /// closes the connections with code 0.
    pub async fn close(self) {
        for cell in &self.cores {
            if let Some(conn) = cell.get() {
                conn.close().await;
            }
        }
        self.primary.close().await;
        let mut endpoint = self.endpoint.clone();
        drop(self);
        let _ = tokio::time::timeout(CLOSE_IDLE_TIMEOUT, endpoint.wait_idle()).await;
    }
}

/// One sent `ProducerPublish`: what a retry needs to send the same bytes again.
struct SentPart {
    writer: mpsc::Sender<WriterCommand>,
    shared: Arc<Shared>,
    chunks: Vec<Bytes>,
    stream: Arc<str>,
    shard: u32,
    producer: u64,
    sequence: u64,
}

/// How an idempotent publish is retried (docs/semantics.md, "Idempotent producers").
struct RetryPolicy {
    retries: u32,
    backoff: Duration,
    next_request_id: Arc<AtomicU64>,
    producer: Arc<ProducerState>,
}

impl RetryPolicy {
    /// Waits for one part's answer, sending the part again (same producer, sequence and
    /// records, a new request id) after a retryable one, at most `retries` times.
    async fn settle(
        &self,
        answer: oneshot::Receiver<Answer>,
        part: SentPart,
    ) -> Result<Vec<ShardAck>, ClientError> {
        let result = self.attempts(answer, &part).await;
        if result.is_err() {
            self.producer
                .abandon(&part.stream, part.shard, part.producer);
        }
        result
    }

    async fn attempts(
        &self,
        mut answer: oneshot::Receiver<Answer>,
        part: &SentPart,
    ) -> Result<Vec<ShardAck>, ClientError> {
        let mut attempts = 0;
        let mut wait = self.backoff;
        loop {
            let error = match answer.await {
                Ok(Ok(Frame::Ack(ack))) => return Ok(ack.shards),
                Ok(Ok(Frame::Error(error))) => ClientError::from_error_frame(error),
                Ok(Ok(other)) => unexpected("Ack", &other),
                Ok(Err(failure)) => failure.to_error(),
                Err(_) => ClientError::Closed("the connection ended before the ack".to_owned()),
            };
            // Another batch of the shard failed for good: the shard went on under a new id.
            let abandoned = !self
                .producer
                .current(&part.stream, part.shard, part.producer);
            if attempts >= self.retries || abandoned || !retryable(&error, part.sequence) {
                return Err(error);
            }
            attempts += 1;
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(PUBLISH_RETRY_BACKOFF_MAX);
            let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
            let chunks = with_request_id(&part.chunks, request_id);
            answer = part.shared.register(request_id, None)?;
            part.writer
                .send(WriterCommand::Frame {
                    chunks,
                    permit: None,
                })
                .await
                .map_err(|_| ClientError::Closed("the publish stream is closed".to_owned()))?;
        }
    }
}

/// The acks (or the error) a batch sent with [`Client::send_sequenced`] was answered with.
pub(crate) async fn sequenced_acks(
    answer: oneshot::Receiver<Answer>,
) -> Result<Vec<ShardAck>, ClientError> {
    match answer.await {
        Ok(Ok(Frame::Ack(ack))) => Ok(ack.shards),
        Ok(Ok(Frame::Error(error))) => Err(ClientError::from_error_frame(error)),
        Ok(Ok(other)) => Err(unexpected("Ack", &other)),
        Ok(Err(failure)) => Err(failure.to_error()),
        Err(_) => Err(ClientError::Closed(
            "the connection ended before the ack".to_owned(),
        )),
    }
}

/// Whether an idempotent publish answered `error` is worth sending again as it is: the broker
/// took nothing of it (`ingress_budget_exhausted`), its original is still being stored
/// or a replicated stream's batch not committed in time (`unavailable` naming its sequence in
/// `detail`: a retry is applied once either way), or an earlier batch of the producer on that shard is still missing
/// (`out_of_sequence` naming a sequence below this one: the earlier batch's own retry fills
/// the gap).
fn retryable(error: &ClientError, sequence: u64) -> bool {
    match error {
        ClientError::Server { code, detail, .. } => match code {
            ErrorCode::IngressBudgetExhausted => true,
            ErrorCode::Unavailable => *detail != 0,
            ErrorCode::OutOfSequence => *detail != 0 && *detail < sequence,
            _ => false,
        },
        _ => false,
    }
}

/// `chunks` (an encoded publish) with its request id replaced: the first chunk always holds
/// the frame header and the request id right after it.
fn with_request_id(chunks: &[Bytes], request_id: u64) -> Vec<Bytes> {
    let mut out = chunks.to_vec();
    if let Some(first) = out.first_mut() {
        let at = felix_wire::FRAME_HEADER_LEN;
        let mut head = BytesMut::from(&first[..]);
        head[at..at + 8].copy_from_slice(&request_id.to_le_bytes());
        *first = head.freeze();
    }
    out
}

/// An idempotent publish's answers, retried as needed ([`RetryPolicy`]).
type Retrying = Pin<Box<dyn Future<Output = Result<Vec<ShardAck>, ClientError>> + Send>>;

/// The ack of a pipelined publish (see [`Client::publish_pipelined`]).
#[must_use = "the publish is sent; await this to learn its offsets or its error"]
pub struct PendingAck {
    /// One answer per part (owner core / publish stream) of the publish; `None` once taken.
    answers: Vec<Option<oneshot::Receiver<Answer>>>,
    /// Answers taken so far.
    ready: Vec<Result<Answer, oneshot::error::RecvError>>,
    /// An idempotent publish: its parts' answers, retried as needed.
    retrying: Option<Retrying>,
}

impl std::fmt::Debug for PendingAck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingAck").finish_non_exhaustive()
    }
}

impl Future for PendingAck {
    type Output = Result<Vec<ShardAck>, ClientError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(retrying) = &mut this.retrying {
            return retrying.as_mut().poll(cx);
        }
        let mut waiting = false;
        for slot in &mut this.answers {
            let Some(answer) = slot else { continue };
            match Pin::new(answer).poll(cx) {
                Poll::Pending => waiting = true,
                Poll::Ready(answer) => {
                    this.ready.push(answer);
                    *slot = None;
                }
            }
        }
        if waiting {
            return Poll::Pending;
        }
        let mut acks = Vec::new();
        for answer in this.ready.drain(..) {
            match answer {
                Ok(Ok(Frame::Ack(ack))) => acks.extend(ack.shards),
                Ok(Ok(Frame::Error(error))) => {
                    return Poll::Ready(Err(ClientError::from_error_frame(error)));
                }
                Ok(Ok(other)) => return Poll::Ready(Err(unexpected("Ack", &other))),
                Ok(Err(failure)) => return Poll::Ready(Err(failure.to_error())),
                Err(_) => {
                    return Poll::Ready(Err(ClientError::Closed(
                        "the connection ended before the ack".to_owned(),
                    )));
                }
            }
        }
        acks.sort_unstable_by_key(|ack| ack.shard);
        Poll::Ready(Ok(acks))
    }
}

fn expect_stream_info(frame: Frame) -> Result<StreamInfo, ClientError> {
    match frame {
        Frame::StreamInfo(info) => Ok(info),
        other => Err(unexpected("StreamInfo", &other)),
    }
}

fn unexpected(expected: &str, got: &Frame) -> ClientError {
    ClientError::Protocol(format!("expected {expected}, got {got:?}"))
}

/// Human text for a connection error, naming the broker's close code when it sent one.
pub(crate) fn describe_connection_error(error: &s2n_quic::connection::Error) -> String {
    match error {
        s2n_quic::connection::Error::Application { error, .. } => describe_close_code(**error),
        other => other.to_string(),
    }
}

pub(crate) fn describe_stream_error(error: &s2n_quic::stream::Error) -> String {
    match error {
        s2n_quic::stream::Error::ConnectionError { error, .. } => describe_connection_error(error),
        s2n_quic::stream::Error::StreamReset { error, .. } => {
            format!("the broker reset the stream with code {}", **error)
        }
        other => other.to_string(),
    }
}

fn describe_close_code(code: u64) -> String {
    if code == 0 {
        return "the connection was closed".to_owned();
    }
    match u16::try_from(code).ok().and_then(ErrorCode::from_u16) {
        Some(ErrorCode::ShuttingDown) => "the broker is shutting down".to_owned(),
        Some(known) => format!(
            "the broker closed the connection: {} (code {code})",
            known.name()
        ),
        None => format!("the connection was closed with code {code}"),
    }
}

/// Reads until one whole frame is decoded (used for handshake answers).
pub(crate) async fn read_frame(
    decoder: &Decoder,
    receive: &mut ReceiveStream,
    buffer: &mut BytesMut,
) -> Result<Frame, ClientError> {
    loop {
        if let Some(frame) = decoder.decode(buffer).map_err(|error| {
            ClientError::Protocol(format!("undecodable frame from the broker: {error}"))
        })? {
            return Ok(frame);
        }
        match receive.receive().await {
            Ok(Some(chunk)) => buffer.extend_from_slice(&chunk),
            Ok(None) => {
                return Err(ClientError::Closed(
                    "the broker finished the stream".to_owned(),
                ));
            }
            Err(error) => return Err(ClientError::Closed(describe_stream_error(&error))),
        }
    }
}

/// Owns the request stream's send half: writes queued frames in order.
async fn write_loop(
    mut send: SendStream,
    mut commands: mpsc::Receiver<WriterCommand>,
    shared: Arc<Shared>,
) {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut permits: Vec<OwnedSemaphorePermit> = Vec::new();
    while let Some(command) = commands.recv().await {
        let mut close = None;
        let mut next = Some(command);
        // Gather what is already queued, up to a bound, into one vectored send.
        let mut frames = 0usize;
        while let Some(command) = next.take() {
            match command {
                WriterCommand::Frame {
                    chunks: frame,
                    permit,
                } => {
                    chunks.extend(frame);
                    permits.extend(permit);
                    frames += 1;
                }
                WriterCommand::Close { done } => {
                    close = Some(done);
                    break;
                }
            }
            if frames < WRITER_BATCH_FRAMES {
                next = commands.try_recv().ok();
            }
        }
        if !chunks.is_empty() {
            if let Err(error) = send.send_vectored(&mut chunks).await {
                shared.fail_all(&Failure::Closed(describe_stream_error(&error)));
                return;
            }
            chunks.clear();
            // Written to the QUIC stream: fire-and-forget budget goes back.
            permits.clear();
        }
        if let Some(done) = close {
            // `close` finishes the stream and waits until the broker acknowledged every byte.
            let _ = tokio::time::timeout(CLOSE_FLUSH_TIMEOUT, send.close()).await;
            let _ = done.send(());
            return;
        }
    }
    // Every client handle is gone: finish the stream so the broker sees a clean end.
    let _ = send.finish();
}

/// Owns the request stream's receive half: routes answers to their requests by id.
async fn read_loop(
    mut receive: ReceiveStream,
    mut buffer: BytesMut,
    decoder: Decoder,
    shared: Arc<Shared>,
) {
    let failure = loop {
        match decoder.decode(&mut buffer) {
            Ok(Some(frame)) => {
                if let Err(failure) = route(&shared, frame) {
                    break failure;
                }
                continue;
            }
            Ok(None) => {}
            Err(error) => {
                break Failure::Protocol(format!("undecodable answer from the broker: {error}"));
            }
        }
        match receive.receive().await {
            Ok(Some(chunk)) => buffer.extend_from_slice(&chunk),
            Ok(None) => break Failure::Closed("the broker finished the request stream".to_owned()),
            Err(error) => break Failure::Closed(describe_stream_error(&error)),
        }
    };
    tracing::debug!(?failure, "request stream ended");
    shared.fail_all(&failure);
}

fn route(shared: &Shared, frame: Frame) -> Result<(), Failure> {
    let request_id = match &frame {
        Frame::StreamInfo(info) => info.request_id,
        Frame::StreamList { request_id, .. } | Frame::Done { request_id } => *request_id,
        Frame::ClusterMap(map) => map.request_id,
        Frame::Records(records) => records.request_id,
        Frame::Ack(ack) => ack.request_id,
        Frame::Error(error) if error.request_id == 0 => {
            return Err(Failure::Server {
                code: error.code,
                detail: error.detail,
                message: error.message.clone(),
            });
        }
        Frame::Error(error) => error.request_id,
        other => {
            return Err(Failure::Protocol(format!(
                "unexpected frame on the request stream: {other:?}"
            )));
        }
    };
    shared.answer(request_id, frame);
    Ok(())
}
