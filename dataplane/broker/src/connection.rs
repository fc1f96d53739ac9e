//! Connection and stream handlers (tasks spawned with `spawn_local` on the core thread), per
//! the "Connection and stream usage" section of `docs/wire-protocol.md`:
//! the first bidirectional stream carries `Hello`/`HelloOk` and then requests; every other
//! client stream is a request stream, or a subscription stream when its first frame is
//! `Subscribe`. A frame that cannot be decoded ends only its own stream (`Error` with request
//! id 0, then FIN); the connection and the broker carry on.

use std::rc::Rc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_wire::{Delivery, ErrorCode, ErrorFrame, Frame, Subscribed, WireError};
use s2n_quic::connection::Connection;
use s2n_quic::stream::{BidirectionalStream, ReceiveStream, SendStream};

use tokio::sync::mpsc;

use crate::core_runtime::{Batch, CoreState, Next, PublishOutcome, Registered, frame_name};

/// Time a new connection has to open its first stream and send `Hello`: generous for a slow
/// client, short enough that idle handshakes do not pile up.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to get an `Error` frame acknowledged before closing a connection after a failed
/// handshake, so the client can read why.
const ERROR_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// Answers buffered before they are written out while decoding one received chunk: bounds
/// the memory of a stream that pipelines many small requests.
const ANSWER_FLUSH_BYTES: usize = 64 * 1024;
/// Received chunks a request stream handles before it yields to the core's other tasks, so
/// one busy publisher cannot starve the rest.
const REQUEST_CHUNKS_PER_YIELD: u32 = 32;
/// Delivery frames a subscription writes before it yields to the core's other tasks.
const DELIVERIES_PER_YIELD: u32 = 16;

/// Why a stream stopped producing frames.
enum ReadError {
    /// The bytes are not a valid frame: answer with an `Error` and finish the stream.
    Wire(WireError),
    /// The stream or connection failed (reset, closed): nothing can be written back.
    Transport,
}

/// Counts the connection in the metrics and in the core's table for its whole life.
struct ConnectionGuard {
    state: Rc<CoreState>,
    id: u64,
}

impl ConnectionGuard {
    fn new(state: &Rc<CoreState>, connection: &Connection) -> ConnectionGuard {
        let id = connection.id();
        state
            .connections
            .borrow_mut()
            .insert(id, connection.handle());
        state.metrics.connections.inc();
        ConnectionGuard {
            state: Rc::clone(state),
            id,
        }
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        if let Ok(mut connections) = self.state.connections.try_borrow_mut() {
            connections.remove(&self.id);
        }
        self.state.metrics.connections.dec();
        self.state.connections_changed.notify_waiters();
    }
}

fn close_code(code: ErrorCode) -> s2n_quic::application::Error {
    u32::from(code as u16).into()
}

/// Serves one connection: the handshake, then a task per accepted stream.
pub(crate) async fn serve_connection(state: Rc<CoreState>, mut connection: Connection) {
    let _guard = ConnectionGuard::new(&state, &connection);
    let remote = connection.remote_addr().ok();
    tracing::debug!(?remote, "connection accepted");
    let handshake = tokio::time::timeout(HELLO_TIMEOUT, handshake(&state, &mut connection)).await;
    match handshake {
        Ok(Ok((receive, send, buffer))) => {
            tokio::task::spawn_local(serve_requests(
                Rc::clone(&state),
                receive,
                send,
                buffer,
                None,
            ));
        }
        Ok(Err(Some(code))) => {
            tracing::debug!(?remote, ?code, "handshake refused");
            connection.close(close_code(code));
            return;
        }
        Ok(Err(None)) => return,
        Err(_) => {
            tracing::debug!(?remote, "no Hello in time");
            state.metrics.error(ErrorCode::ProtocolViolation);
            connection.close(close_code(ErrorCode::ProtocolViolation));
            return;
        }
    }
    loop {
        match connection.accept_bidirectional_stream().await {
            Ok(Some(stream)) => {
                tokio::task::spawn_local(serve_stream(Rc::clone(&state), stream));
            }
            Ok(None) => break,
            Err(error) => {
                tracing::debug!(?remote, %error, "connection ended");
                break;
            }
        }
    }
}

/// Reads `Hello` on the first stream and answers it. On refusal returns the close code (after
/// trying to deliver the `Error` frame); `Err(None)` when the connection went away.
async fn handshake(
    state: &CoreState,
    connection: &mut Connection,
) -> Result<(ReceiveStream, SendStream, BytesMut), Option<ErrorCode>> {
    let stream = match connection.accept_bidirectional_stream().await {
        Ok(Some(stream)) => stream,
        Ok(None) | Err(_) => return Err(None),
    };
    let (mut receive, mut send) = stream.split();
    let mut buffer = BytesMut::new();
    let refusal = match read_frame(state, &mut receive, &mut buffer).await {
        Ok(Some(Frame::Hello(hello))) => {
            if hello.min_version <= felix_wire::PROTOCOL_VERSION
                && felix_wire::PROTOCOL_VERSION <= hello.max_version
            {
                tracing::debug!(client = hello.client_name, "hello");
                let mut out = BytesMut::new();
                felix_wire::encode(&Frame::HelloOk(state.hello_ok()), &mut out);
                if send.send(out.freeze()).await.is_err() {
                    return Err(None);
                }
                return Ok((receive, send, buffer));
            }
            ErrorFrame {
                request_id: 0,
                code: ErrorCode::UnsupportedVersion,
                detail: 0,
                message: format!(
                    "this broker speaks protocol version {}; the client offered {}..={}",
                    felix_wire::PROTOCOL_VERSION,
                    hello.min_version,
                    hello.max_version
                ),
            }
        }
        Ok(Some(other)) => ErrorFrame {
            request_id: 0,
            code: ErrorCode::ProtocolViolation,
            detail: 0,
            message: format!(
                "the first frame of a connection must be Hello, not {}",
                frame_name(&other)
            ),
        },
        Ok(None) => ErrorFrame {
            request_id: 0,
            code: ErrorCode::ProtocolViolation,
            detail: 0,
            message: "the first stream ended before Hello".to_owned(),
        },
        Err(ReadError::Wire(error)) => ErrorFrame {
            request_id: 0,
            code: error.code(),
            detail: 0,
            message: error.to_string(),
        },
        Err(ReadError::Transport) => return Err(None),
    };
    let code = refusal.code;
    let mut out = BytesMut::new();
    state.write_error(refusal, &mut out);
    if send.send(out.freeze()).await.is_ok() {
        // `close` finishes the stream and waits until the peer acknowledged it.
        let _ = tokio::time::timeout(ERROR_FLUSH_TIMEOUT, send.close()).await;
    }
    Err(Some(code))
}

/// Appends a received chunk, without copying when the buffer is empty and the chunk unique.
fn append(buffer: &mut BytesMut, chunk: Bytes) {
    if buffer.is_empty() {
        *buffer = BytesMut::from(chunk);
    } else {
        buffer.extend_from_slice(&chunk);
    }
}

/// Reads until one whole frame is decoded. `Ok(None)`: the peer finished the stream cleanly
/// between frames.
async fn read_frame(
    state: &CoreState,
    receive: &mut ReceiveStream,
    buffer: &mut BytesMut,
) -> Result<Option<Frame>, ReadError> {
    loop {
        if let Some(frame) = state.decoder.decode(buffer).map_err(ReadError::Wire)? {
            return Ok(Some(frame));
        }
        match receive.receive().await {
            Ok(Some(chunk)) => append(buffer, chunk),
            Ok(None) if buffer.is_empty() => return Ok(None),
            Ok(None) => return Err(ReadError::Wire(truncated())),
            Err(_) => return Err(ReadError::Transport),
        }
    }
}

fn truncated() -> WireError {
    WireError::Malformed {
        frame: "frame",
        reason: "the stream ended inside a frame".to_owned(),
    }
}

/// Writes `Error(request id 0)` for an undecodable frame and finishes the stream.
async fn refuse_stream(state: &CoreState, send: &mut SendStream, error: &WireError) {
    tracing::debug!(%error, "undecodable frame; finishing the stream");
    let mut out = BytesMut::new();
    state.write_error(
        ErrorFrame {
            request_id: 0,
            code: error.code(),
            detail: 0,
            message: error.to_string(),
        },
        &mut out,
    );
    if send.send(out.freeze()).await.is_ok() {
        let _ = send.finish();
    }
}

/// A stream other than the hello stream: its first frame decides what it is.
async fn serve_stream(state: Rc<CoreState>, stream: BidirectionalStream) {
    let (mut receive, mut send) = stream.split();
    let mut buffer = BytesMut::new();
    match read_frame(&state, &mut receive, &mut buffer).await {
        Ok(Some(Frame::Subscribe(subscribe))) => {
            serve_subscription(state, receive, send, buffer, subscribe).await;
        }
        Ok(Some(first)) => serve_requests(state, receive, send, buffer, Some(first)).await,
        Ok(None) => {
            let _ = send.finish();
        }
        Err(ReadError::Wire(error)) => refuse_stream(&state, &mut send, &error).await,
        Err(ReadError::Transport) => {}
    }
}

/// Publishes a request stream handles before it yields to the core's other tasks, so one
/// busy publisher cannot starve the rest.
const PUBLISHES_PER_YIELD: u32 = 64;

/// A request stream: decode pipelined frames and answer each on the same stream. Publishes
/// whose records go to other cores are answered later, through `completions`; the stream is
/// finished only once every such answer is written. A publish waiting for ingress room holds
/// up the later frames of this stream only (other streams have their own tasks).
async fn serve_requests(
    state: Rc<CoreState>,
    mut receive: ReceiveStream,
    mut send: SendStream,
    mut buffer: BytesMut,
    first: Option<Frame>,
) {
    let mut out = BytesMut::new();
    let mut pending = first;
    let mut chunks_since_yield = 0u32;
    let mut publishes_since_yield = 0u32;
    let (completions_tx, mut completions) = mpsc::unbounded_channel::<Frame>();
    let mut completions_tx = Some(completions_tx);
    loop {
        let mut next = Next::Continue;
        while next == Next::Continue {
            let frame = match pending.take() {
                Some(frame) => frame,
                None => match state.decoder.decode(&mut buffer) {
                    Ok(Some(frame)) => frame,
                    Ok(None) => break,
                    Err(error) => {
                        tracing::debug!(%error, "undecodable frame; finishing the stream");
                        state.write_error(
                            ErrorFrame {
                                request_id: 0,
                                code: error.code(),
                                detail: 0,
                                message: error.to_string(),
                            },
                            &mut out,
                        );
                        next = Next::Finish;
                        break;
                    }
                },
            };
            next = match frame {
                Frame::Publish(publish) => {
                    if let Some(sender) = &completions_tx {
                        handle_publish(&state, publish, &mut out, sender).await;
                    }
                    publishes_since_yield += 1;
                    if publishes_since_yield >= PUBLISHES_PER_YIELD {
                        publishes_since_yield = 0;
                        tokio::task::yield_now().await;
                    }
                    Next::Continue
                }
                other => state.handle_request(other, &mut out).await,
            };
            while let Ok(frame) = completions.try_recv() {
                felix_wire::encode(&frame, &mut out);
            }
            if out.len() >= ANSWER_FLUSH_BYTES && send.send(out.split().freeze()).await.is_err() {
                return;
            }
        }
        while let Ok(frame) = completions.try_recv() {
            felix_wire::encode(&frame, &mut out);
        }
        if !out.is_empty() && send.send(out.split().freeze()).await.is_err() {
            return;
        }
        if next == Next::Finish {
            let _ = send.finish();
            return;
        }
        if completions_tx.is_none() {
            // The client finished sending: wait for the answers still owed, then finish.
            match completions.recv().await {
                Some(frame) => {
                    felix_wire::encode(&frame, &mut out);
                    continue;
                }
                None => {
                    let _ = send.finish();
                    return;
                }
            }
        }
        tokio::select! {
            biased;
            Some(frame) = completions.recv() => felix_wire::encode(&frame, &mut out),
            received = receive.receive() => match received {
                Ok(Some(chunk)) => {
                    append(&mut buffer, chunk);
                    chunks_since_yield += 1;
                    if chunks_since_yield >= REQUEST_CHUNKS_PER_YIELD {
                        chunks_since_yield = 0;
                        tokio::task::yield_now().await;
                    }
                }
                Ok(None) => {
                    if !buffer.is_empty() {
                        refuse_stream(&state, &mut send, &truncated()).await;
                        return;
                    }
                    // Dropping our sender lets `recv` end once the owed answers are in.
                    completions_tx = None;
                }
                Err(_) => return,
            },
        }
    }
}

/// Admits a publish through the core's ingress queue, then runs it.
async fn handle_publish(
    state: &Rc<CoreState>,
    publish: felix_wire::Publish,
    out: &mut BytesMut,
    completions: &mpsc::UnboundedSender<Frame>,
) {
    let payload_bytes: u64 = publish
        .records
        .iter()
        .map(|record| record.payload.len() as u64)
        .sum();
    if state.admit(&publish, payload_bytes, out).await.is_err() {
        return;
    }
    if let PublishOutcome::Done(Some(frame)) =
        state.publish(publish, payload_bytes, completions).await
    {
        felix_wire::encode(&frame, out);
    }
}

/// Unregisters a subscription when its task ends, however it ends.
struct SubscriptionGuard {
    state: Rc<CoreState>,
    slot: u64,
}

impl Drop for SubscriptionGuard {
    fn drop(&mut self) {
        self.state.subscription_closed(self.slot);
    }
}

/// A subscription stream: `Subscribed`, then `Delivery` frames until the client goes away or
/// an owner ends the subscription (then `Error` and FIN).
async fn serve_subscription(
    state: Rc<CoreState>,
    mut receive: ReceiveStream,
    mut send: SendStream,
    buffer: BytesMut,
    subscribe: felix_wire::Subscribe,
) {
    let request_id = subscribe.request_id;
    let mut out = BytesMut::new();
    let Registered {
        slot,
        start,
        notify,
    } = match state.subscribe(&subscribe).await {
        Ok(registered) => registered,
        Err(error) => {
            tracing::debug!(%error, stream = subscribe.stream, "subscribe refused");
            state.write_error(error.to_frame(request_id), &mut out);
            if send.send(out.freeze()).await.is_ok() {
                let _ = send.finish();
            }
            return;
        }
    };
    let _guard = SubscriptionGuard {
        state: Rc::clone(&state),
        slot,
    };
    if !buffer.is_empty() {
        refuse_after_subscribe(&state, &mut send).await;
        return;
    }
    felix_wire::encode(
        &Frame::Subscribed(Subscribed {
            request_id,
            shards: start,
        }),
        &mut out,
    );
    if send.send(out.split().freeze()).await.is_err() {
        return;
    }
    let mut receive_open = true;
    let mut deliveries_since_yield = 0u32;
    loop {
        let Batch { records, credit } = state.poll_delivery(slot);
        if !records.is_empty() {
            let count = records.len() as u64;
            felix_wire::encode(&Frame::Delivery(Delivery { records }), &mut out);
            if send.send(out.split().freeze()).await.is_err() {
                return;
            }
            if let Some((owner, id)) = credit {
                state.return_credit(owner, id);
            }
            state.metrics.delivered_records.inc_by(count);
            deliveries_since_yield += 1;
            if deliveries_since_yield >= DELIVERIES_PER_YIELD {
                deliveries_since_yield = 0;
                tokio::task::yield_now().await;
            }
            continue;
        }
        // Records already queued go out before the error that ended the subscription.
        if let Some(error) = state.take_ended(slot) {
            tracing::debug!(%error, "subscription ended by an owner core");
            state.write_error(error.to_frame(request_id), &mut out);
            if send.send(out.split().freeze()).await.is_ok() {
                let _ = send.finish();
            }
            return;
        }
        tokio::select! {
            () = notify.notified() => {}
            received = receive.receive(), if receive_open => match received {
                // The client half-closed after Subscribe: deliveries go on.
                Ok(None) => receive_open = false,
                Ok(Some(chunk)) if chunk.is_empty() => {}
                Ok(Some(_)) => {
                    refuse_after_subscribe(&state, &mut send).await;
                    return;
                }
                // Reset by the client, or the connection is gone: the subscription is over.
                Err(_) => return,
            },
        }
    }
}

async fn refuse_after_subscribe(state: &CoreState, send: &mut SendStream) {
    let mut out = BytesMut::new();
    state.write_error(
        ErrorFrame {
            request_id: 0,
            code: ErrorCode::ProtocolViolation,
            detail: 0,
            message: "a subscription stream carries exactly one Subscribe frame".to_owned(),
        },
        &mut out,
    );
    if send.send(out.freeze()).await.is_ok() {
        let _ = send.finish();
    }
}
