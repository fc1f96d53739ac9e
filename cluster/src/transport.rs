//! The peer connections between brokers: QUIC (s2n-quic) with mutual TLS against the cluster
//! CA, carrying length-prefixed frames (a big-endian u32 length, then the bytes).
//!
//! - One server endpoint on the member's peer address. It *requires* a client certificate
//!   that chains to the CA, and takes the peer's member id from the certificate's common name
//!   `felix-node-<id>` (`pki.rs`): a member cannot speak for another. Frames from a member
//!   not in the peer list, or with a length over [`FRAME_BYTES_MAX`], close that connection,
//!   never the endpoint.
//! - One client endpoint; per peer, a task that owns the outgoing connection: it dials the
//!   peer's address with the server name `felix-node-<id>` (every member's certificate carries
//!   its own as a DNS name, so ordinary host-name verification proves the peer's id), opens one
//!   bidirectional stream per [`Lane`] (replication; forwards and fetches), on each sends a
//!   hello (its member id, which the server checks against the certificate) and waits for the
//!   server's accept byte (in TLS 1.3 the client's handshake ends before the server checked
//!   the client's certificate: only the accept byte says it was taken), then writes each
//!   lane's queued frames on its stream, all that are queued in one send. The lanes are
//!   written and read independently: forwards never wait behind Raft's appends, nor Raft
//!   behind forwards; order holds within a lane. Any error, or the server's side of the first
//!   stream ending, drops the connection; the task redials with a capped backoff.
//! - `send` never blocks: a bounded queue per peer and lane; a full queue drops the frame
//!   (Raft retransmits what is lost; a forward's sender is told). Inbound frames go to one
//!   bounded channel.
//!
//! Threads: everything runs as tasks on the caller's tokio runtime (the service loop's: the
//! broker's core 0).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use s2n_quic::client::Connect;
use s2n_quic::provider::event::{ConnectionInfo, ConnectionMeta, Subscriber, events};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use crate::member::Lane;
use crate::pki::{NODE_NAME_PREFIX, NodeIdentity, node_id_of};

/// ALPN of the peer protocol (2: one stream per lane; a member speaking 1 is refused at the
/// handshake).
pub const ALPN: &str = "felix-peer/2";
/// Largest frame a peer may send (a Raft message with a snapshot of the control plane).
pub const FRAME_BYTES_MAX: usize = 64 << 20;
/// Frames queued per peer before `send` drops.
const PEER_QUEUE_FRAMES: usize = 4096;
/// Inbound frames queued for the caller before they are dropped.
const INBOUND_QUEUE_FRAMES: usize = 8192;
/// Lanes per peer connection ([`Lane`]).
const LANES: usize = 2;

/// Frames, and bytes, a peer's connection task takes off its queue for one send.
const COALESCE_FRAMES_MAX: usize = 256;
const COALESCE_BYTES_MAX: usize = 1 << 20;
/// A dial that gets no answer in this time is retried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection with no packet for this long is closed: a killed peer's connection goes away
/// (Raft's heartbeats every 200 ms keep a live one busy).
const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Bytes of a dialling member's hello: its member id, big-endian.
const HELLO_BYTES: usize = 8;
/// The byte a server answers a hello it accepts with.
const ACCEPTED: u8 = 1;
/// Application error codes a connection is closed with.
const CLOSE_UNKNOWN_PEER: u32 = 1;
const CLOSE_FRAME_TOO_LARGE: u32 = 2;

/// Why the transport could not start.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot start the peer endpoint on {addr}: {reason}")]
    Endpoint { addr: SocketAddr, reason: String },
}

/// What a member needs to reach its peers.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    pub node_id: u64,
    /// The peer endpoint's address (port 0: any).
    pub bind: SocketAddr,
    /// Every other member's id and peer address.
    pub peers: BTreeMap<u64, SocketAddr>,
    pub identity: NodeIdentity,
    /// The cluster CA (PEM).
    pub ca_pem: String,
    /// The largest QUIC datagram the peer endpoints probe for (path MTU discovery's upper
    /// bound; the broker's FELIX_MTU_UPPER_BOUND, as its client endpoints'). s2n-quic's own
    /// default is 1,500: an append of a few kilobytes then takes several packets, each
    /// encrypted and sent on its own.
    pub max_mtu: u16,
}

/// A frame from a peer.
#[derive(Debug)]
pub struct Inbound {
    pub from: u64,
    pub frame: Bytes,
}

/// The transport's counters.
#[derive(Debug, Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    dropped: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    refused: AtomicU64,
}

/// A snapshot of the transport's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Frames written to a peer's stream.
    pub sent: u64,
    /// Frames received from peers.
    pub received: u64,
    /// Frames dropped: a full queue (either way), or lost with a broken connection.
    pub dropped: u64,
    /// Outgoing connections established.
    pub connects: u64,
    /// Dials that failed (no answer, TLS refused).
    pub connect_failures: u64,
    /// Incoming connections closed: an unknown member, an oversized frame.
    pub refused: u64,
}

struct Peer {
    queues: [mpsc::Sender<Bytes>; LANES],
    connected: Arc<AtomicBool>,
}

/// The running transport. Dropping it stops its tasks.
pub struct PeerTransport {
    local_addr: SocketAddr,
    peers: BTreeMap<u64, Peer>,
    counters: Arc<Counters>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for PeerTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTransport")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

/// Keeps the leaf of the certificate chain TLS verified, for the connection's handler.
#[derive(Debug, Clone, Copy, Default)]
struct PeerCertificate;

#[derive(Debug, Default)]
struct VerifiedLeaf(Option<Vec<u8>>);

impl Subscriber for PeerCertificate {
    type ConnectionContext = VerifiedLeaf;

    fn create_connection_context(
        &mut self,
        _meta: &ConnectionMeta,
        _info: &ConnectionInfo,
    ) -> VerifiedLeaf {
        VerifiedLeaf::default()
    }

    fn on_tls_exporter_ready(
        &mut self,
        context: &mut VerifiedLeaf,
        _meta: &ConnectionMeta,
        event: &events::TlsExporterReady,
    ) {
        if let Ok(chain) = event.session.peer_cert_chain_der() {
            context.0 = chain.into_iter().next();
        }
    }
}

/// Client certificates are verified against the CA; the member id is read from the
/// certificate afterwards, so any name is acceptable here.
struct AnyName;

impl s2n_quic::provider::tls::default::callbacks::VerifyHostNameCallback for AnyName {
    fn verify_host_name(&self, _host_name: &str) -> bool {
        true
    }
}

fn tls_error(error: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(error.to_string())
}

fn limits() -> Result<s2n_quic::provider::limits::Limits, TransportError> {
    s2n_quic::provider::limits::Limits::new()
        .with_max_idle_timeout(IDLE_TIMEOUT)
        .map_err(tls_error)
}

fn server(config: &TransportConfig) -> Result<s2n_quic::Server, TransportError> {
    use s2n_quic::provider::tls::default::enums::ClientAuthType;
    let mut tls = s2n_quic::provider::tls::default::Server::builder()
        .with_certificate(
            config.identity.cert_pem.as_str(),
            config.identity.key_pem.as_str(),
        )
        .and_then(|builder| builder.with_application_protocols([ALPN]))
        .and_then(|builder| builder.with_empty_trust_store())
        .and_then(|builder| builder.with_trusted_certificate(config.ca_pem.as_str()))
        .and_then(|builder| builder.with_verify_host_name_callback(AnyName))
        .map_err(tls_error)?;
    tls.config_mut()
        .set_client_auth_type(ClientAuthType::Required)
        .map_err(tls_error)?;
    let tls = tls.build().map_err(tls_error)?;
    let endpoint_error = |reason: String| TransportError::Endpoint {
        addr: config.bind,
        reason,
    };
    s2n_quic::Server::builder()
        .with_tls(tls)
        .map_err(tls_error)?
        .with_io(io(config.bind, config.max_mtu).map_err(&endpoint_error)?)
        .map_err(|error| endpoint_error(error.to_string()))?
        .with_limits(limits()?)
        .map_err(|error| endpoint_error(error.to_string()))?
        .with_event(PeerCertificate)
        .map_err(|error| endpoint_error(error.to_string()))?
        .start()
        .map_err(|error| endpoint_error(error.to_string()))
}

/// A peer endpoint's UDP IO on `bind`, probing datagrams up to `max_mtu`; a failure as the
/// reason the endpoint cannot start.
fn io(bind: SocketAddr, max_mtu: u16) -> Result<s2n_quic::provider::io::tokio::Provider, String> {
    s2n_quic::provider::io::tokio::Builder::default()
        .with_receive_address(bind)
        .and_then(|builder| builder.with_max_mtu(max_mtu))
        .and_then(|builder| builder.build())
        .map_err(|error| error.to_string())
}

fn client(config: &TransportConfig) -> Result<s2n_quic::Client, TransportError> {
    let tls = s2n_quic::provider::tls::default::Client::builder()
        .with_application_protocols([ALPN])
        .and_then(|builder| builder.with_empty_trust_store())
        .and_then(|builder| builder.with_certificate(config.ca_pem.as_str()))
        .and_then(|builder| {
            builder.with_client_identity(
                config.identity.cert_pem.as_str(),
                config.identity.key_pem.as_str(),
            )
        })
        .and_then(|builder| builder.build())
        .map_err(tls_error)?;
    let bind = SocketAddr::new(config.bind.ip(), 0);
    let endpoint_error = |reason: String| TransportError::Endpoint { addr: bind, reason };
    s2n_quic::Client::builder()
        .with_tls(tls)
        .map_err(tls_error)?
        .with_io(io(bind, config.max_mtu).map_err(&endpoint_error)?)
        .map_err(|error| endpoint_error(error.to_string()))?
        .with_limits(limits()?)
        .map_err(|error| endpoint_error(error.to_string()))?
        .start()
        .map_err(|error| endpoint_error(error.to_string()))
}

impl PeerTransport {
    /// Binds the peer endpoint and starts dialling every peer. Call inside a tokio runtime.
    pub fn start(
        config: TransportConfig,
    ) -> Result<(PeerTransport, mpsc::Receiver<Inbound>), TransportError> {
        let server = server(&config)?;
        let local_addr = server
            .local_addr()
            .map_err(|error| TransportError::Endpoint {
                addr: config.bind,
                reason: error.to_string(),
            })?;
        let client = client(&config)?;
        let counters = Arc::new(Counters::default());
        let (inbound, frames) = mpsc::channel(INBOUND_QUEUE_FRAMES);
        let known: Arc<Vec<u64>> = Arc::new(config.peers.keys().copied().collect());
        let mut tasks = vec![tokio::spawn(accept(
            server,
            Arc::clone(&known),
            inbound,
            Arc::clone(&counters),
        ))];
        let mut peers = BTreeMap::new();
        for (id, addr) in &config.peers {
            let (replication, replication_queued) = mpsc::channel(PEER_QUEUE_FRAMES);
            let (forward, forward_queued) = mpsc::channel(PEER_QUEUE_FRAMES);
            let connected = Arc::new(AtomicBool::new(false));
            tasks.push(tokio::spawn(dial(
                client.clone(),
                config.node_id,
                *id,
                *addr,
                [replication_queued, forward_queued],
                Arc::clone(&connected),
                Arc::clone(&counters),
            )));
            peers.insert(
                *id,
                Peer {
                    queues: [replication, forward],
                    connected,
                },
            );
        }
        Ok((
            PeerTransport {
                local_addr,
                peers,
                counters,
                tasks,
            },
            frames,
        ))
    }

    /// Where the peer endpoint listens.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Queues `frame` for peer `to` on `lane`; false (and counted) when the lane's queue is
    /// full or `to` is not a peer, or the frame is over [`FRAME_BYTES_MAX`]. Never blocks.
    pub fn send(&self, to: u64, lane: Lane, frame: Bytes) -> bool {
        let queued = frame.len() <= FRAME_BYTES_MAX
            && self
                .peers
                .get(&to)
                .is_some_and(|peer| peer.queues[lane as usize].try_send(frame).is_ok());
        if !queued {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    /// The peers whose outgoing connection is up now.
    #[must_use]
    pub fn connected_peers(&self) -> Vec<u64> {
        self.peers
            .iter()
            .filter(|(_, peer)| peer.connected.load(Ordering::Relaxed))
            .map(|(id, _)| *id)
            .collect()
    }

    /// The counters so far.
    #[must_use]
    pub fn stats(&self) -> TransportStats {
        let c = &self.counters;
        TransportStats {
            sent: c.sent.load(Ordering::Relaxed),
            received: c.received.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            connects: c.connects.load(Ordering::Relaxed),
            connect_failures: c.connect_failures.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
        }
    }
}

impl Drop for PeerTransport {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn accept(
    mut server: s2n_quic::Server,
    known: Arc<Vec<u64>>,
    inbound: mpsc::Sender<Inbound>,
    counters: Arc<Counters>,
) {
    while let Some(connection) = server.accept().await {
        tokio::spawn(receive(
            connection,
            Arc::clone(&known),
            inbound.clone(),
            Arc::clone(&counters),
        ));
    }
}

fn close(connection: &s2n_quic::connection::Handle, code: u32, counters: &Counters) {
    counters.refused.fetch_add(1, Ordering::Relaxed);
    connection.close(s2n_quic::application::Error::from(code));
}

/// Serves one incoming connection: identifies the member, then reads frames from every
/// stream it opens until the connection ends.
async fn receive(
    connection: s2n_quic::Connection,
    known: Arc<Vec<u64>>,
    inbound: mpsc::Sender<Inbound>,
    counters: Arc<Counters>,
) {
    let leaf = connection
        .query_event_context(|context: &VerifiedLeaf| context.0.clone())
        .ok()
        .flatten();
    let Some(from) = leaf.as_deref().and_then(node_id_of) else {
        tracing::warn!(remote = ?connection.remote_addr(), "a peer certificate names no member; connection closed");
        close(&connection.handle(), CLOSE_UNKNOWN_PEER, &counters);
        return;
    };
    if !known.contains(&from) {
        tracing::warn!(
            from,
            "a member not in FELIX_CLUSTER_PEERS connected; connection closed"
        );
        close(&connection.handle(), CLOSE_UNKNOWN_PEER, &counters);
        return;
    }
    // Each of the peer's streams (one per lane): its hello (its member id), this side's accept
    // byte, then frames. The accept byte tells the peer its certificate was taken: in TLS 1.3 a client's
    // handshake completes before the server has checked the client's certificate, so without
    // it a refused member would count itself connected and lose frames.
    // Each lane's stream is read on its own: one held up never holds back the other.
    let (connection, mut streams) = connection.split();
    let mut readers = tokio::task::JoinSet::new();
    while let Ok(Some(stream)) = streams.accept_bidirectional_stream().await {
        readers.spawn(read_lane(
            stream,
            connection.clone(),
            from,
            inbound.clone(),
            Arc::clone(&counters),
        ));
    }
    readers.abort_all();
}

/// Reads one stream of member `from`'s connection: its hello (which must name `from`), this
/// side's accept byte, then frames until the stream ends.
async fn read_lane(
    stream: s2n_quic::stream::BidirectionalStream,
    connection: s2n_quic::connection::Handle,
    from: u64,
    inbound: mpsc::Sender<Inbound>,
    counters: Arc<Counters>,
) {
    let (mut stream, mut answer) = stream.split();
    let mut buffer = BytesMut::new();
    let hello = tokio::time::timeout(CONNECT_TIMEOUT, async {
        while buffer.len() < HELLO_BYTES {
            match stream.receive().await {
                Ok(Some(chunk)) => buffer.extend_from_slice(&chunk),
                Ok(None) | Err(_) => return false,
            }
        }
        true
    })
    .await;
    let claimed = (hello == Ok(true)).then(|| buffer.get_u64());
    if claimed != Some(from) {
        tracing::warn!(
            from,
            ?claimed,
            "a peer's hello does not match its certificate; connection closed"
        );
        close(&connection, CLOSE_UNKNOWN_PEER, &counters);
        return;
    }
    if answer.send(Bytes::from_static(&[ACCEPTED])).await.is_err() {
        return;
    }
    loop {
        loop {
            if buffer.len() < 4 {
                break;
            }
            let len = u32::from_be_bytes([buffer[0], buffer[1], buffer[2], buffer[3]]) as usize;
            if len > FRAME_BYTES_MAX {
                tracing::warn!(from, len, "a peer frame over the limit; connection closed");
                close(&connection, CLOSE_FRAME_TOO_LARGE, &counters);
                return;
            }
            if buffer.len() < 4 + len {
                buffer.reserve(4 + len - buffer.len());
                break;
            }
            buffer.advance(4);
            let frame = buffer.split_to(len).freeze();
            counters.received.fetch_add(1, Ordering::Relaxed);
            if inbound.try_send(Inbound { from, frame }).is_err() {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        match stream.receive().await {
            Ok(Some(chunk)) => buffer.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
}

/// Owns the outgoing connection to one peer: dials, opens one stream per [`Lane`], writes
/// each lane's queued frames on its own stream, redials.
async fn dial(
    client: s2n_quic::Client,
    own_id: u64,
    id: u64,
    addr: SocketAddr,
    mut queued: [mpsc::Receiver<Bytes>; LANES],
    connected: Arc<AtomicBool>,
    counters: Arc<Counters>,
) {
    let server_name = format!("{NODE_NAME_PREFIX}{id}");
    let mut backoff = BACKOFF_FIRST;
    loop {
        let connect = Connect::new(addr).with_server_name(server_name.as_str());
        let attempt = tokio::time::timeout(CONNECT_TIMEOUT, async {
            let mut connection = client.connect(connect).await.ok()?;
            let replication = open_lane(&mut connection, own_id).await?;
            let forward = open_lane(&mut connection, own_id).await?;
            Some((connection, replication, forward))
        })
        .await;
        let Some((_connection, (mut answers, mut replication), (_, mut forward))) =
            attempt.ok().flatten()
        else {
            counters.connect_failures.fetch_add(1, Ordering::Relaxed);
            // Frames queued meanwhile are stale by the time a connection comes up: Raft sends
            // fresh ones.
            for queue in &mut queued {
                while queue.try_recv().is_ok() {
                    counters.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
            continue;
        };
        counters.connects.fetch_add(1, Ordering::Relaxed);
        connected.store(true, Ordering::Relaxed);
        backoff = BACKOFF_FIRST;
        tracing::debug!(peer = id, %addr, "peer connection up");
        let [replication_queue, forward_queue] = &mut queued;
        // The lanes are written independently: a forward lane held up by flow control never
        // holds back a Raft message, nor the other way round.
        tokio::select! {
            () = write_lane(&mut replication, replication_queue, &counters) => {}
            () = write_lane(&mut forward, forward_queue, &counters) => {}
            // The server sends nothing after its accept byte: anything here is the end of the
            // connection, noticed at once rather than at the next send.
            _ = answers.receive() => {}
        }
        connected.store(false, Ordering::Relaxed);
        if queued.iter().all(mpsc::Receiver::is_closed) {
            return;
        }
        tracing::debug!(peer = id, %addr, "peer connection lost; redialling");
    }
}

/// Opens one lane's stream on `connection`: sends this member's hello and waits for the
/// server's accept byte (connected only once the server took this member's certificate and
/// hello). Returns the stream's receive half (the accept byte's) and its send half.
async fn open_lane(
    connection: &mut s2n_quic::Connection,
    own_id: u64,
) -> Option<(
    s2n_quic::stream::ReceiveStream,
    s2n_quic::stream::SendStream,
)> {
    let (mut answers, mut stream) = connection.open_bidirectional_stream().await.ok()?.split();
    stream
        .send(Bytes::copy_from_slice(&own_id.to_be_bytes()))
        .await
        .ok()?;
    match answers.receive().await {
        Ok(Some(byte)) if byte.first() == Some(&ACCEPTED) => Some((answers, stream)),
        _ => None,
    }
}

/// Writes one lane's queued frames on its stream until the queue closes or a send fails.
/// What else is queued goes in the same send: one enqueue (so the frames share packets, and
/// one wake-up of the connection) per pass of the member, however many groups' messages it
/// made for this peer.
async fn write_lane(
    stream: &mut s2n_quic::stream::SendStream,
    queued: &mut mpsc::Receiver<Bytes>,
    counters: &Counters,
) {
    let mut parts: Vec<Bytes> = Vec::new();
    while let Some(frame) = queued.recv().await {
        parts.clear();
        let mut bytes = push_frame(&mut parts, frame);
        while parts.len() < 2 * COALESCE_FRAMES_MAX && bytes < COALESCE_BYTES_MAX {
            let Ok(frame) = queued.try_recv() else { break };
            bytes += push_frame(&mut parts, frame);
        }
        let frames = (parts.len() / 2) as u64;
        if stream.send_vectored(&mut parts).await.is_err() {
            counters.dropped.fetch_add(frames, Ordering::Relaxed);
            return;
        }
        counters.sent.fetch_add(frames, Ordering::Relaxed);
    }
}

/// Adds `frame` with its length prefix to `parts`; returns the bytes added.
fn push_frame(parts: &mut Vec<Bytes>, frame: Bytes) -> usize {
    let len = frame.len();
    parts.push(Bytes::copy_from_slice(
        &u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes(),
    ));
    parts.push(frame);
    4 + len
}
