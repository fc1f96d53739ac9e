//! Raw QUIC connections to the broker (an s2n-quic client, not felix-client): hand-written
//! frames and bytes on streams of our choosing, and the broker's answers read one at a time,
//! each within a deadline.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_wire::{Decoder, ErrorCode, ErrorFrame, Frame, HelloOk, Limits};
use s2n_quic::client::Connect;
use s2n_quic::connection::Connection;
use s2n_quic::stream::BidirectionalStream;

use crate::Target;

/// Time any single step (connect, open, send, read) may take before it counts as a hang.
pub(crate) const STEP: Duration = Duration::from_secs(20);

/// How a connection ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Closed {
    /// Closed with this QUIC application error code.
    Application { code: u64, by_peer: bool },
    /// Our own idle timer expired (nothing heard from the broker for the idle timeout).
    Idle,
    /// Any other way (a transport error, a stateless reset, ...), described.
    Other(String),
}

impl Closed {
    pub(crate) fn of(error: &s2n_quic::connection::Error) -> Closed {
        match error {
            s2n_quic::connection::Error::Application {
                error, initiator, ..
            } => Closed::Application {
                code: **error,
                by_peer: initiator.is_remote(),
            },
            s2n_quic::connection::Error::IdleTimerExpired { .. } => Closed::Idle,
            other => Closed::Other(other.to_string()),
        }
    }

    /// Closed by the broker with `code`.
    pub(crate) fn is_peer_code(&self, code: ErrorCode) -> bool {
        matches!(self, Closed::Application { code: c, by_peer: true } if *c == code as u64)
    }
}

/// What a stream gave next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Frame(Frame),
    /// The broker finished its side of the stream (with no partial frame left over).
    Fin,
    /// The broker reset the stream with this code.
    Reset(u64),
    /// The connection ended.
    Closed(Closed),
    /// The broker sent bytes that are not a valid frame (or a partial one before its FIN).
    Garbage(String),
    /// Nothing within the wait.
    Silent,
}

/// A permissive decoder for what the broker sends: the protocol defaults, raised to the
/// broker's announced limits where those are larger.
pub(crate) fn server_decoder(announced: Option<&Limits>) -> Decoder {
    let mut limits = Limits::DEFAULT;
    if let Some(announced) = announced {
        limits.max_frame_bytes = limits.max_frame_bytes.max(announced.max_frame_bytes);
        limits.max_batch_records = limits.max_batch_records.max(announced.max_batch_records);
        limits.max_payload_bytes = limits.max_payload_bytes.max(announced.max_payload_bytes);
        limits.max_key_bytes = limits.max_key_bytes.max(announced.max_key_bytes);
        limits.max_name_bytes = limits.max_name_bytes.max(announced.max_name_bytes);
        limits.max_shards = limits.max_shards.max(announced.max_shards);
    }
    Decoder::new(limits)
}

/// A QUIC + TLS connection with no Felix handshake yet.
pub struct RawConn {
    // Kept so the endpoint outlives the connection.
    _endpoint: s2n_quic::Client,
    pub connection: Connection,
    limits: Option<Limits>,
}

/// The s2n-quic client endpoint every raw connection uses: trusts the target's CA, ALPN
/// `felix/1`, bound to an ephemeral port of the target's address family.
pub(crate) fn client_endpoint(target: &Target) -> Result<s2n_quic::Client, String> {
    client_endpoint_offering(target, &[felix_wire::ALPN])
}

/// A client endpoint like [`client_endpoint`] whose TLS offers the ALPN `protocols` (none:
/// no ALPN extension at all).
pub(crate) fn client_endpoint_offering(
    target: &Target,
    protocols: &[&[u8]],
) -> Result<s2n_quic::Client, String> {
    let ca = std::fs::read_to_string(&target.ca_pem)
        .map_err(|error| format!("cannot read the CA {}: {error}", target.ca_pem.display()))?;
    let mut builder = s2n_quic::provider::tls::default::Client::builder()
        .with_certificate(ca.as_str())
        .map_err(|error| format!("TLS client: {error}"))?;
    if !protocols.is_empty() {
        builder = builder
            .with_application_protocols(protocols.iter().copied())
            .map_err(|error| format!("TLS client: {error}"))?;
    }
    let tls = builder
        .build()
        .map_err(|error| format!("TLS client: {error}"))?;
    let bind = if target.quic_addr.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    };
    s2n_quic::Client::builder()
        .with_tls(tls)
        .map_err(|error| format!("TLS provider: {error}"))?
        .with_io(bind)
        .map_err(|error| format!("IO provider: {error}"))?
        .start()
        .map_err(|error| format!("client endpoint: {error}"))
}

impl RawConn {
    /// Connects to `addr` (QUIC + TLS only). `Err(Ok(closed))`: the broker closed the
    /// connection during or right after the handshake; `Err(Err(text))`: anything else.
    pub async fn connect(
        target: &Target,
        addr: SocketAddr,
        keep_alive: bool,
    ) -> Result<RawConn, Result<Closed, String>> {
        let endpoint = client_endpoint(target).map_err(Err)?;
        let connect = Connect::new(addr).with_server_name(target.server_name.as_str());
        let mut connection = match tokio::time::timeout(STEP, endpoint.connect(connect)).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(error)) => return Err(Ok(Closed::of(&error))),
            Err(_) => return Err(Err(format!("QUIC handshake with {addr} hung for {STEP:?}"))),
        };
        if keep_alive {
            // A closed connection refuses; the first read will tell.
            let _ = connection.keep_alive(true);
        }
        Ok(RawConn {
            _endpoint: endpoint,
            connection,
            limits: None,
        })
    }

    /// Connects, failing on any refusal (for cases that need a working connection).
    pub async fn open(target: &Target, addr: SocketAddr) -> Result<RawConn, String> {
        RawConn::connect(target, addr, true)
            .await
            .map_err(|error| match error {
                Ok(closed) => format!("connection to {addr} refused: {closed:?}"),
                Err(text) => text,
            })
    }

    /// Opens a bidirectional stream (the broker sees it once a byte or a FIN is sent).
    pub async fn stream(&mut self) -> Result<RawStream, String> {
        match tokio::time::timeout(STEP, self.connection.open_bidirectional_stream()).await {
            Ok(Ok(stream)) => Ok(RawStream::new(stream, self.limits.as_ref())),
            Ok(Err(error)) => Err(format!("cannot open a stream: {error}")),
            Err(_) => Err(format!("opening a stream hung for {STEP:?}")),
        }
    }

    /// Opens a stream within `wait`, or `None` if QUIC flow control holds it back.
    pub async fn try_stream(&mut self, wait: Duration) -> Result<Option<RawStream>, String> {
        match tokio::time::timeout(wait, self.connection.open_bidirectional_stream()).await {
            Ok(Ok(stream)) => Ok(Some(RawStream::new(stream, self.limits.as_ref()))),
            Ok(Err(error)) => Err(format!("cannot open a stream: {error}")),
            Err(_) => Ok(None),
        }
    }

    /// The standard `Hello` on a new stream; the broker's `HelloOk` (its limits are then used
    /// to decode its frames).
    pub async fn hello(&mut self) -> Result<(RawStream, HelloOk), String> {
        let mut stream = self.stream().await?;
        stream
            .send_frame(&crate::frames::hello("felix-hostile"))
            .await?;
        match stream.next(STEP).await {
            Next::Frame(Frame::HelloOk(hello_ok)) => {
                self.limits = Some(hello_ok.limits);
                stream.decoder = server_decoder(self.limits.as_ref());
                Ok((stream, hello_ok))
            }
            other => Err(format!("expected HelloOk, got {}", describe(&other))),
        }
    }

    /// How the connection ended, waiting up to `wait` for it to end.
    pub async fn closed(&mut self, wait: Duration) -> Option<Closed> {
        match tokio::time::timeout(wait, self.connection.accept_bidirectional_stream()).await {
            Ok(Err(error)) => Some(Closed::of(&error)),
            Ok(Ok(None)) => Some(Closed::Other("the acceptor ended".to_owned())),
            // The broker never opens streams; treat one as "still open".
            Ok(Ok(Some(_))) | Err(_) => None,
        }
    }

    /// Expects the broker to close the connection with `code` within `wait`.
    pub async fn expect_closed(&mut self, code: ErrorCode, wait: Duration) -> Result<(), String> {
        match self.closed(wait).await {
            Some(closed) if closed.is_peer_code(code) => Ok(()),
            Some(closed) => Err(format!(
                "expected the broker to close the connection with {} ({}), got {closed:?}",
                code.name(),
                code as u16
            )),
            None => Err(format!(
                "expected the broker to close the connection with {} ({}), still open after \
                 {wait:?}",
                code.name(),
                code as u16
            )),
        }
    }
}

/// One bidirectional stream with its receive buffer.
pub struct RawStream {
    pub stream: BidirectionalStream,
    buffer: BytesMut,
    decoder: Decoder,
    ended: bool,
}

impl RawStream {
    fn new(stream: BidirectionalStream, limits: Option<&Limits>) -> RawStream {
        RawStream {
            stream,
            buffer: BytesMut::new(),
            decoder: server_decoder(limits),
            ended: false,
        }
    }

    pub async fn send(&mut self, bytes: Bytes) -> Result<(), String> {
        match tokio::time::timeout(STEP, self.stream.send(bytes)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(format!("send failed: {error}")),
            Err(_) => Err(format!("send hung for {STEP:?}")),
        }
    }

    pub async fn send_frame(&mut self, frame: &Frame) -> Result<(), String> {
        let mut out = BytesMut::new();
        felix_wire::encode(frame, &mut out);
        self.send(out.freeze()).await
    }

    /// Finishes our side (FIN after what was sent).
    pub fn finish(&mut self) -> Result<(), String> {
        self.stream
            .finish()
            .map_err(|error| format!("finish failed: {error}"))
    }

    /// Sends `bytes` then FIN.
    pub async fn send_fin(&mut self, bytes: Bytes) -> Result<(), String> {
        if !bytes.is_empty() {
            self.send(bytes).await?;
        }
        self.finish()
    }

    /// The next thing the broker gives on this stream, waiting up to `wait`.
    pub async fn next(&mut self, wait: Duration) -> Next {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match self.decoder.decode(&mut self.buffer) {
                Ok(Some(frame)) => return Next::Frame(frame),
                Ok(None) => {}
                Err(error) => return Next::Garbage(format!("undecodable server bytes: {error}")),
            }
            if self.ended {
                return if self.buffer.is_empty() {
                    Next::Fin
                } else {
                    Next::Garbage(format!(
                        "the stream ended inside a frame ({} bytes left)",
                        self.buffer.len()
                    ))
                };
            }
            match tokio::time::timeout_at(deadline, self.stream.receive()).await {
                Err(_) => return Next::Silent,
                Ok(Ok(Some(chunk))) => self.buffer.extend_from_slice(&chunk),
                Ok(Ok(None)) => self.ended = true,
                Ok(Err(error)) => return stream_error(&error),
            }
        }
    }

    /// Expects `Error` with `request_id` and `code`; returns it.
    pub async fn expect_error(
        &mut self,
        request_id: u64,
        code: ErrorCode,
    ) -> Result<ErrorFrame, String> {
        match self.next(STEP).await {
            Next::Frame(Frame::Error(error))
                if error.request_id == request_id && error.code == code =>
            {
                Ok(error)
            }
            other => Err(format!(
                "expected Error {{ request_id: {request_id}, code: {} }}, got {}",
                code.name(),
                describe(&other)
            )),
        }
    }

    /// Expects the broker to finish the stream next (nothing more on it).
    pub async fn expect_fin(&mut self) -> Result<(), String> {
        match self.next(STEP).await {
            Next::Fin => Ok(()),
            other => Err(format!(
                "expected the broker to finish the stream, got {}",
                describe(&other)
            )),
        }
    }

    /// Expects `Error` (request id 0, `code`) and then the end of the stream: the documented
    /// answer to a frame that cannot be decoded.
    pub async fn expect_stream_error(&mut self, code: ErrorCode) -> Result<ErrorFrame, String> {
        let error = self.expect_error(0, code).await?;
        self.expect_fin().await?;
        Ok(error)
    }

    /// Expects the next frame to satisfy `check` (which describes what it wanted).
    pub async fn expect_frame<T>(
        &mut self,
        what: &str,
        check: impl FnOnce(Frame) -> Option<T>,
    ) -> Result<T, String> {
        match self.next(STEP).await {
            Next::Frame(frame) => {
                let shown = format!("{frame:?}");
                check(frame).ok_or_else(|| format!("expected {what}, got {}", short(&shown)))
            }
            other => Err(format!("expected {what}, got {}", describe(&other))),
        }
    }

    /// Expects nothing at all for `wait` (the broker holds the stream open and silent).
    pub async fn expect_silence(&mut self, wait: Duration) -> Result<(), String> {
        match self.next(wait).await {
            Next::Silent => Ok(()),
            other => Err(format!(
                "expected silence for {wait:?}, got {}",
                describe(&other)
            )),
        }
    }
}

fn stream_error(error: &s2n_quic::stream::Error) -> Next {
    match error {
        s2n_quic::stream::Error::StreamReset { error, .. } => Next::Reset(**error),
        s2n_quic::stream::Error::ConnectionError { error, .. } => Next::Closed(Closed::of(error)),
        other => Next::Closed(Closed::Other(other.to_string())),
    }
}

/// A short description of what a stream gave, for failure messages.
pub(crate) fn describe(next: &Next) -> String {
    match next {
        Next::Frame(Frame::Error(error)) => format!(
            "Error {{ request_id: {}, code: {} ({}), detail: {}, message: {:?} }}",
            error.request_id,
            error.code.name(),
            error.code as u16,
            error.detail,
            error.message
        ),
        Next::Frame(frame) => short(&format!("{frame:?}")),
        Next::Fin => "the end of the stream".to_owned(),
        Next::Reset(code) => format!("a stream reset with code {code}"),
        Next::Closed(closed) => format!("the connection closed: {closed:?}"),
        Next::Garbage(text) => text.clone(),
        Next::Silent => "nothing (silence)".to_owned(),
    }
}

/// At most 300 characters of `text`.
pub(crate) fn short(text: &str) -> String {
    const MAX: usize = 300;
    if text.len() <= MAX {
        return text.to_owned();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}
