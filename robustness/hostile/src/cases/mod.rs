//! The cases, as data: each a name, what documents its expected outcome (or, where the
//! documentation is silent, what the broker does today), a time budget, and an async fn that
//! returns `Ok(())` when the broker behaved as expected and `Err(description)` otherwise.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use felix_client::Client;
use felix_wire::{HelloOk, Limits};
use rand::rngs::StdRng;

use crate::Target;
use crate::raw::{RawConn, RawStream};
use crate::report::RssSample;

mod framing;
mod handshake;
mod misplaced;
mod requests;
mod resources;
mod udp;

/// Prefix of a note that records a behaviour the documentation does not state.
pub(crate) const UNDOCUMENTED: &str = "undocumented: ";

/// The future of one case.
pub type CaseFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + 'a>>;

/// Where a case's expected outcome comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// The documentation states it (where).
    Documented(&'static str),
    /// The documentation is silent or unclear; the case asserts what the broker does today
    /// (described).
    Undocumented(&'static str),
}

/// One hostile client.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub name: &'static str,
    pub basis: Basis,
    /// Longer than this is a hang (a failure).
    pub budget: Duration,
    pub(crate) run: fn(&mut Ctx) -> CaseFuture<'_>,
}

const BUDGET: Duration = Duration::from_secs(120);
const LONG_BUDGET: Duration = Duration::from_secs(300);

macro_rules! case {
    ($module:ident :: $name:ident, $basis:expr) => {
        case!($module::$name, $basis, BUDGET)
    };
    ($module:ident :: $name:ident, $basis:expr, $budget:expr) => {
        Case {
            name: stringify!($name),
            basis: $basis,
            budget: $budget,
            run: |ctx| Box::pin($module::$name(ctx)),
        }
    };
}

use Basis::{Documented, Undocumented};

/// Every case, in the order the suite runs them.
#[must_use]
pub fn cases() -> Vec<Case> {
    vec![
        // Bytes that are not frames.
        case!(
            framing::random_bytes_on_request_streams,
            Documented(
                "wire-protocol.md 2, 7, 10 (Errors on a stream): Error with the decoder's code, \
             request id 0, the stream finished; a cut-short frame as in \
             truncated_frames_then_fin"
            )
        ),
        case!(
            framing::random_bytes_on_the_hello_stream,
            Documented(
                "wire-protocol.md 10: an undecodable Hello closes the connection with the error code \
             (and an Error with request id 0 on the hello stream first)"
            )
        ),
        case!(
            framing::truncated_frames_then_fin,
            Undocumented(
                "a request frame cut short at any byte, then FIN: Error malformed (request id 0, \
             message \"malformed frame frame: the stream ended inside a frame\"), the stream \
             finished; an empty stream then FIN: finished with no frame"
            )
        ),
        case!(
            framing::truncated_hello_then_fin,
            Undocumented(
                "a Hello cut short then FIN: Error malformed (request id 0) and close 1; an empty \
             hello stream then FIN: Error protocol_violation and close 5"
            )
        ),
        case!(
            framing::unknown_frame_types,
            Documented(
                "wire-protocol.md 2, 3: every code outside the table is unknown_frame_type, judged \
             from the header"
            )
        ),
        case!(
            framing::nonzero_flags,
            Documented("wire-protocol.md 2: non-zero flags are malformed, judged from the header")
        ),
        case!(
            framing::trailing_and_missing_bytes,
            Documented(
                "wire-protocol.md 1, 7: trailing bytes and fields running past the body are \
             malformed"
            )
        ),
        case!(
            framing::fields_over_their_limits,
            Documented(
                "wire-protocol.md 6, 7: body_len over max_frame_bytes is frame_too_large; a length \
             or count over its limit is limit_exceeded (before its bytes are looked for); a \
             count within its limit that the body cannot hold is malformed; the stream ends"
            )
        ),
        case!(
            framing::create_shard_count_over_limit,
            Documented(
                "wire-protocol.md 6: CreateStream.shard_count over max_shards is limit_exceeded with \
             the request's id (0 is invalid_argument); the stream goes on"
            )
        ),
        case!(
            framing::hello_fields_over_their_limits,
            Documented(
                "wire-protocol.md 4.1, 6, 10: a Hello over FELIX_HELLO_MAX_BYTES is frame_too_large, \
             a client name over 255 or a token over 1024 bytes limit_exceeded, a TOKEN bit \
             without a token malformed; each closes the connection with its code"
            )
        ),
        // The handshake.
        case!(
            handshake::wrong_alpn,
            Undocumented(
                "a QUIC handshake not offering ALPN felix/1 (another, several others, none) is \
             refused at once by a TLS alert (a QUIC transport close with a crypto error code, \
             0x100-0x1ff)"
            )
        ),
        case!(
            handshake::frames_before_hello,
            Documented(
                "wire-protocol.md 10: any frame but Hello first closes the connection with \
             protocol_violation (5); the Error sent before the close is undocumented"
            )
        ),
        case!(
            handshake::hello_versions_without_1,
            Documented(
                "wire-protocol.md 10: a Hello range excluding 1 gets Error unsupported_version, then \
             close 2"
            )
        ),
        case!(
            handshake::hello_edge_cases,
            Documented(
                "wire-protocol.md 4.1: unknown feature bits are ignored (HelloOk.features holds \
             only the bits used); a 255-byte name is accepted, 256 is limit_exceeded"
            )
        ),
        case!(
            handshake::hello_with_a_bogus_token,
            Documented(
                "wire-protocol.md 10, configuration.md FELIX_AUTH: a token presented is verified \
             even in open mode; a malformed or unknown one gets unauthenticated, close 60"
            )
        ),
        case!(
            handshake::second_hello,
            Undocumented(
                "a Hello after HelloOk (on the hello stream or a new one): Error protocol_violation \
             (request id 0), that stream finished, the connection goes on"
            )
        ),
        case!(
            handshake::request_pipelined_after_hello,
            Undocumented(
                "a request sent on the hello stream right behind Hello, before HelloOk arrives, is \
             answered after HelloOk"
            )
        ),
        case!(
            handshake::no_hello_in_time,
            Documented(
                "wire-protocol.md 10, security.md: no Hello answered within FELIX_HELLO_TIMEOUT_MS \
             closes the connection with protocol_violation (5): nothing sent, a Hello dribbled \
             a byte at a time, a Hello on the second stream"
            ),
            LONG_BUDGET
        ),
        // Valid frames in the wrong place after the handshake.
        case!(
            misplaced::server_frames_from_the_client,
            Undocumented(
                "a server-only frame (HelloOk, StreamInfo, StreamList, Done, Ack, Subscribed, \
             Delivery, Error) from the client after HelloOk: Error protocol_violation \
             (request id 0), that stream finished, the connection goes on"
            )
        ),
        case!(
            misplaced::bytes_after_subscribe,
            Undocumented(
                "bytes after a Subscribe on its stream (with it, or after Subscribed): Error \
             protocol_violation (request id 0), the subscription ended, the stream finished"
            )
        ),
        case!(
            misplaced::subscribe_on_a_request_stream,
            Undocumented(
                "a Subscribe that is not the first frame of its stream: Error protocol_violation \
             with the Subscribe's request id; the request stream goes on"
            )
        ),
        case!(
            misplaced::subscriber_half_close,
            Undocumented(
                "a subscriber that finishes its side after Subscribe keeps getting deliveries"
            )
        ),
        // Requests naming what does not exist.
        case!(
            requests::unknown_streams,
            Documented(
                "wire-protocol.md 4.4, 5, 10: requests naming no stream get stream_not_found with \
             their id; a fire-and-forget publish gets nothing; the stream goes on"
            )
        ),
        case!(
            requests::invalid_requests,
            Documented(
                "wire-protocol.md 4.8, 5: an empty acked publish, a bad name, a taken name are \
             invalid_argument / stream_exists with the request's id"
            )
        ),
        case!(
            requests::subscribe_shard_errors,
            Documented(
                "wire-protocol.md 4.10, 5: a shard out of range or an offset for an unselected shard \
             is invalid_argument with the Subscribe's id, the stream finished; empty and \
             duplicated lists and offsets past next_offset are undocumented"
            )
        ),
        case!(
            requests::publish_to_a_deleted_stream,
            Documented(
                "wire-protocol.md 5, 10: a publish to a deleted stream is acked stream_not_found; \
             its subscriptions end with stream_not_found (their request id is undocumented)"
            )
        ),
        case!(
            requests::publishes_racing_a_delete,
            Documented(
                "wire-protocol.md 10: every acked publish gets exactly one answer, an Ack or \
             stream_not_found; once refused, later publishes stay refused"
            )
        ),
        // Resource floods and clients that do not read or do not write.
        case!(
            resources::connections_per_core,
            Documented(
                "security.md: beyond FELIX_MAX_CONNECTIONS_PER_CORE the connection is closed at \
             once with code 6 (wire-protocol.md 10 also promises an Error on the hello stream)"
            )
        ),
        case!(
            resources::connections_per_principal,
            Documented(
                "wire-protocol.md 10, security.md: beyond FELIX_MAX_CONNECTIONS_PER_PRINCIPAL, Error \
             limit_exceeded naming the setting on the hello stream, then close 6"
            )
        ),
        case!(
            resources::streams_per_connection,
            Documented(
                "wire-protocol.md 10, security.md: a stream beyond FELIX_MAX_STREAMS_PER_CONNECTION \
             gets Error limit_exceeded (request id 0) and is finished; QUIC stops the client 8 \
             streams further"
            )
        ),
        case!(
            resources::subscriptions_per_connection,
            Documented(
                "wire-protocol.md 10, security.md: a Subscribe beyond \
             FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION gets limit_exceeded with its request id and \
             its stream is finished"
            )
        ),
        case!(
            resources::stalled_subscriber,
            Documented(
                "security.md: a subscriber that never reads holds at most its backlog bound; its \
             subscription ends with subscriber_lagged and resume positions; others are served"
            ),
            LONG_BUDGET
        ),
        case!(
            resources::silent_and_partial_streams,
            Undocumented(
                "streams that carry nothing, or a partial frame, are held open in silence (no \
             per-stream timeout; only the QUIC idle timeout ends a silent connection); the \
             partial frame is answered once completed, and malformed once cut by FIN"
            ),
            LONG_BUDGET
        ),
        // Not even QUIC.
        case!(
            udp::garbage_datagrams,
            Documented(
                "security.md (bytes that are not Felix): never the broker; no answer is owed to \
             datagrams that are not QUIC"
            )
        ),
        case!(
            udp::mutilated_initials,
            Documented(
                "security.md: never the broker; RFC 9000 8.1: before address validation a server \
             sends at most 3 times the bytes it received"
            )
        ),
        // Nothing leaked.
        case!(
            resources::connection_gauge_is_current,
            Documented("operations.md (metrics): felix_connections is the open QUIC connections")
        ),
        case!(
            resources::nothing_leaked,
            Documented(
                "operations.md (metrics): once every hostile client has gone, felix_connections and \
             felix_subscribers are the healthy client's own (1 connection, 0 subscriptions)"
            )
        ),
    ]
}

/// What every case of a run shares.
pub(crate) struct Shared {
    pub(crate) target: Target,
    /// The broker's answer to the healthy client's Hello (its announced limits).
    pub(crate) hello: HelloOk,
    pub(crate) core_addrs: Vec<SocketAddr>,
    /// The healthy client, for admin requests (create, delete, publish).
    pub(crate) admin: Arc<Client>,
}

/// What a case works with.
pub struct Ctx {
    shared: Arc<Shared>,
    pub(crate) rng: StdRng,
    pub(crate) notes: Vec<String>,
    pub(crate) samples: Vec<RssSample>,
    pub(crate) skipped: Option<String>,
    names: u32,
}

/// A connection that completed its Felix handshake.
pub(crate) struct Session {
    pub(crate) conn: RawConn,
    pub(crate) hello_stream: RawStream,
}

impl Session {
    pub(crate) async fn stream(&mut self) -> Result<RawStream, String> {
        self.conn.stream().await
    }
}

impl Ctx {
    pub(crate) fn new(shared: Arc<Shared>, rng: StdRng) -> Ctx {
        Ctx {
            shared,
            rng,
            notes: Vec::new(),
            samples: Vec::new(),
            skipped: None,
            names: 0,
        }
    }

    pub(crate) fn target(&self) -> &Target {
        &self.shared.target
    }

    /// The limits the broker announced in `HelloOk`.
    pub(crate) fn limits(&self) -> Limits {
        self.shared.hello.limits
    }

    pub(crate) fn core_addrs(&self) -> &[SocketAddr] {
        &self.shared.core_addrs
    }

    pub(crate) fn admin(&self) -> Arc<Client> {
        Arc::clone(&self.shared.admin)
    }

    pub(crate) fn note(&mut self, text: impl Into<String>) {
        self.notes.push(text.into());
    }

    /// Records a behaviour the documentation does not state (listed in the report).
    pub(crate) fn undocumented(&mut self, text: impl Into<String>) {
        self.notes.push(format!("{UNDOCUMENTED}{}", text.into()));
    }

    /// Ends the case as skipped (return `Ok(())` right after).
    pub(crate) fn skip(&mut self, reason: impl Into<String>) {
        self.skipped = Some(reason.into());
    }

    /// Reads the broker's memory now (if its pid is known); returns `VmRSS`.
    pub(crate) fn sample(&mut self, label: &str) -> Option<u64> {
        let (rss, hwm) = crate::rss_of(self.shared.target.pid?)?;
        self.samples.push(RssSample {
            label: label.to_owned(),
            rss,
            hwm,
        });
        Some(rss)
    }

    /// A stream name no other case (or round) uses.
    pub(crate) fn unique_name(&mut self, what: &str) -> String {
        self.names += 1;
        let salt: u32 = rand::Rng::random(&mut self.rng);
        format!("hostile-{what}-{}-{salt:08x}", self.names)
    }

    /// A QUIC connection to the shared port (no Hello yet), keep-alives on.
    pub(crate) async fn connect(&self) -> Result<RawConn, String> {
        RawConn::open(self.target(), self.target().quic_addr).await
    }

    /// A connection to the shared port that completed its handshake.
    pub(crate) async fn session(&self) -> Result<Session, String> {
        self.session_at(self.target().quic_addr).await
    }

    pub(crate) async fn session_at(&self, addr: SocketAddr) -> Result<Session, String> {
        let mut conn = RawConn::open(self.target(), addr).await?;
        let (hello_stream, _) = conn.hello().await?;
        Ok(Session { conn, hello_stream })
    }

    /// Creates an in-memory stream of `shards` shards through the healthy client.
    pub(crate) async fn create_stream(&self, name: &str, shards: u32) -> Result<(), String> {
        self.admin()
            .create_stream(name, shards, felix_wire::StreamKind::InMemory)
            .await
            .map(|_| ())
            .map_err(|error| format!("cannot create stream {name}: {error}"))
    }

    /// Deletes a stream through the healthy client (cleanup: errors are ignored).
    pub(crate) async fn delete_stream(&self, name: &str) {
        let _ = self.admin().delete_stream(name).await;
    }
}

/// `Err` with `what` unless `condition`.
pub(crate) fn ensure(condition: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if condition { Ok(()) } else { Err(what()) }
}
