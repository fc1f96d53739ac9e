//! Connection and stream tasks (`spawn_local` on the core's thread), per the "Connection and
//! stream usage" section of `docs/wire-protocol.md`. A connection task accepts streams; a
//! stream task reads the stream's bytes, decodes frames (zero-copy: `Bytes` slices of the
//! received chunks) and feeds them to the state machine, and writes what the machine gives it.
//! What a stream is (the hello stream, a request stream, a subscription) and what it answers
//! is the machine's decision; this file only moves bytes.

use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_core::{ConnectionId, Core, Flow, Now, StreamId};
use felix_wire::{Frame, WireError};
use s2n_quic::connection::Connection;
use s2n_quic::stream::{BidirectionalStream, SendStream};

use crate::shell::{Shell, close_code};

/// Time to get an `Error` frame acknowledged before closing a connection after a refused
/// handshake, so the client can read why.
const ERROR_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// Frames one stream feeds the machine before it writes their answers and yields to the
/// core's other tasks: bounds the answers buffered and keeps one busy publisher from
/// starving the rest.
const FRAMES_PER_FEED_MAX: u32 = 64;
/// Writes (delivery batches) a stream makes before it yields to the core's other tasks.
const WRITES_PER_YIELD_MAX: u32 = 16;
/// How often a write blocked by QUIC flow control checks whether its subscription ended.
const STALL_CHECK_INTERVAL: Duration = Duration::from_millis(250);
/// How long a subscription that ended (lagged, stream deleted) waits for a client that
/// withholds flow-control credit to read on: a reading client gets the `Error` within it; a
/// stalled one gets its stream reset with the error's code instead, so that nothing is held
/// for it (docs/wire-protocol.md, 10 Connection and stream usage).
const STALLED_END_GRACE: Duration = Duration::from_secs(1);

/// What a stream's reader does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// Decode and feed frames (when the machine accepts them).
    Frames,
    /// A subscription: any further byte is refused.
    Subscription,
    /// Nothing more is read.
    Done,
}

/// Bytes of frames not yet decoded that one connection's streams hold, bounded by the
/// shell's `connection_read_budget` (FELIX_BROKER_PUB_CONN_RECV_WINDOW + FELIX_MAX_FRAME_BYTES:
/// the data QUIC lets the client have in flight, plus one whole frame). QUIC flow control
/// alone does not bound it: bytes read into a stream's frame buffer give their credit back.
/// At the bound the connection's streams stop reading (QUIC then stops the client) until a
/// frame completes or a stream closes. A client that keeps frames unfinished on many streams
/// stalls only itself (docs/security.md).
struct ReadBudget {
    held: std::cell::Cell<u64>,
    limit: u64,
    /// Woken when bytes are released below the limit.
    freed: tokio::sync::Notify,
}

impl ReadBudget {
    fn has_room(&self) -> bool {
        self.held.get() < self.limit
    }

    /// The stream's buffer went from `*accounted` to `now` bytes.
    fn track(&self, accounted: &mut u64, now: u64) {
        let held = self.held.get() - *accounted + now;
        let freed = now < *accounted;
        self.held.set(held);
        *accounted = now;
        if freed && held < self.limit {
            self.freed.notify_waiters();
        }
    }
}

/// Releases a stream's share of its connection's read budget when the stream ends.
struct BudgetShare {
    budget: Rc<ReadBudget>,
    accounted: u64,
}

impl Drop for BudgetShare {
    fn drop(&mut self) {
        let mut accounted = self.accounted;
        self.budget.track(&mut accounted, 0);
    }
}

/// Counts the connection in the machine and keeps its handle for its whole life.
struct ConnectionGuard {
    shell: Rc<Shell>,
    id: ConnectionId,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.shell.connections.borrow_mut().remove(&self.id);
        // Through `input`, so the metrics (the connections gauge) are exported at once.
        if self.shell.core.try_borrow_mut().is_ok() {
            self.shell
                .input(|core, _| core.handle_connection_closed(self.id));
        }
        self.shell.connections_changed.notify_waiters();
    }
}

/// Serves one connection: a task per accepted stream; the first carries the handshake.
pub(crate) async fn serve_connection(shell: Rc<Shell>, mut connection: Connection) {
    let remote = connection.remote_addr().ok();
    let peer = match crate::auth::peer_principal(&connection) {
        Ok(peer) => peer,
        Err(reason) => {
            // TLS verified the chain, but its names make no principal (docs/security.md).
            tracing::warn!(?remote, %reason, "client certificate refused");
            connection.close(close_code(felix_wire::ErrorCode::Unauthenticated));
            return;
        }
    };
    let id = match shell.input(|core, _| core.handle_connection_opened(peer)) {
        Ok(id) => id,
        Err(code) => {
            tracing::warn!(?code, "connection refused: too many connections");
            connection.close(close_code(code));
            return;
        }
    };
    shell
        .connections
        .borrow_mut()
        .insert(id, connection.handle());
    let _guard = ConnectionGuard {
        shell: Rc::clone(&shell),
        id,
    };
    tracing::debug!(?remote, "connection accepted");
    let hello_timeout = shell.hello_timeout;
    let deadline = tokio::time::Instant::now() + hello_timeout;
    let hello = tokio::time::timeout_at(deadline, connection.accept_bidirectional_stream());
    let first = match hello.await {
        Ok(Ok(Some(stream))) => stream,
        Ok(_) => return,
        Err(_) => {
            tracing::debug!(?remote, "no Hello in time");
            let code = shell.input(|core, _| core.handle_hello_timeout(id));
            connection.close(close_code(code));
            return;
        }
    };
    let stream = shell.input(|core, _| core.handle_stream_opened(id));
    let budget = Rc::new(ReadBudget {
        held: std::cell::Cell::new(0),
        limit: shell.connection_read_budget,
        freed: tokio::sync::Notify::new(),
    });
    let (handshake_done, handshake) = tokio::sync::oneshot::channel();
    tokio::task::spawn_local(serve_stream(
        Rc::clone(&shell),
        id,
        stream,
        first,
        Some(handshake_done),
        Rc::clone(&budget),
    ));
    // Other streams wait until the handshake is answered (the client opens none before).
    match tokio::time::timeout_at(deadline, handshake).await {
        Ok(Ok(true)) => {}
        Ok(_) => return,
        Err(_) => {
            tracing::debug!(?remote, "no Hello in time");
            let code = shell.input(|core, _| core.handle_hello_timeout(id));
            connection.close(close_code(code));
            return;
        }
    }
    loop {
        match connection.accept_bidirectional_stream().await {
            Ok(Some(quic)) => {
                let stream = shell.input(|core, _| core.handle_stream_opened(id));
                tokio::task::spawn_local(serve_stream(
                    Rc::clone(&shell),
                    id,
                    stream,
                    quic,
                    None,
                    Rc::clone(&budget),
                ));
            }
            Ok(None) => break,
            Err(error) => {
                tracing::debug!(?remote, %error, "connection ended");
                break;
            }
        }
    }
}

/// Forgets the stream in the machine when its task ends, however it ends.
struct StreamGuard {
    shell: Rc<Shell>,
    stream: StreamId,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.shell.remove_writer(self.stream);
        if self.shell.core.try_borrow_mut().is_ok() {
            self.shell
                .input(|core, now| core.handle_stream_closed(now, self.stream));
        }
    }
}

/// A received chunk under this many bytes is copied onto a small last chunk
/// ([`FrameBuffer::push`]).
const SMALL_CHUNK_BYTES: usize = 512;
/// ... as long as that chunk stays within this many bytes.
const MERGED_CHUNK_BYTES_MAX: usize = 4096;

/// A stream's received bytes, as the chunks QUIC gave them, uncopied.
///
/// A frame inside one chunk is decoded from it; a frame spanning chunks is decoded from the
/// chunks themselves ([`felix_wire::Decoder::decode_chunks`]): only a key or payload that
/// straddles two chunks is copied. Copying every chunk into one growing buffer copied each
/// byte twice (the append and the growth), and putting a spanning frame together once still
/// copied every byte of it: at 4 KiB x 64 that one copy was ~4 k of the broker's ~20 k
/// instructions per record (docs/performance.md). What it holds is counted as before (`len`):
/// bytes received and not yet decoded.
#[derive(Default)]
struct FrameBuffer {
    chunks: VecDeque<Bytes>,
    len: usize,
    /// The chunks of the frame being decoded (kept to reuse its allocation).
    parts: Vec<Bytes>,
}

impl FrameBuffer {
    /// Bytes held, whole and partial frames.
    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Takes a received chunk. A small one is appended to a small last chunk (copied), so a
    /// peer sending its bytes a few at a time cannot make the queue hold an entry per byte:
    /// entries stay at most ~2 per [`SMALL_CHUNK_BYTES`] held.
    fn push(&mut self, chunk: Bytes) {
        if chunk.is_empty() {
            return;
        }
        self.len += chunk.len();
        if chunk.len() < SMALL_CHUNK_BYTES
            && let Some(back) = self.chunks.back_mut()
            && back.len() + chunk.len() <= MERGED_CHUNK_BYTES_MAX
        {
            let mut merged = BytesMut::with_capacity(back.len() + chunk.len());
            merged.extend_from_slice(back);
            merged.extend_from_slice(&chunk);
            *back = merged.freeze();
            return;
        }
        self.chunks.push_back(chunk);
    }

    /// Decodes the frame at the front once it is whole (`Ok(None)` until then, nothing taken).
    /// Its header is judged as soon as its 6 bytes are here; a header error takes nothing, a
    /// body error takes the frame.
    fn next(&mut self, decoder: &felix_wire::Decoder) -> Result<Option<Frame>, WireError> {
        const HEADER: usize = felix_wire::FRAME_HEADER_LEN;
        if self.len < HEADER {
            return Ok(None);
        }
        let mut header = [0u8; HEADER];
        let mut filled = 0;
        for chunk in &self.chunks {
            let n = chunk.len().min(HEADER - filled);
            header[filled..filled + n].copy_from_slice(&chunk[..n]);
            filled += n;
            if filled == HEADER {
                break;
            }
        }
        let frame_len = decoder.frame_len(&header)?;
        if self.len < frame_len {
            return Ok(None);
        }
        self.len -= frame_len;
        let mut parts = std::mem::take(&mut self.parts);
        let mut need = frame_len;
        while need > 0 {
            let mut chunk = self
                .chunks
                .pop_front()
                .expect("len counts the chunks' bytes");
            if chunk.len() > need {
                self.chunks.push_front(chunk.split_off(need));
            }
            need -= chunk.len();
            parts.push(chunk);
        }
        let frame = decoder.decode_chunks(&parts).map(|(frame, _copied)| frame);
        parts.clear();
        self.parts = parts;
        frame.map(Some)
    }
}

/// Decodes and feeds buffered frames while the machine accepts them, at most
/// [`FRAMES_PER_FEED_MAX`]. Returns what to read next and whether whole frames may be left.
/// `decoder`: the hello decoder (frames bounded by FELIX_HELLO_MAX_BYTES) on a hello stream
/// until its handshake is answered, else the connection's.
fn feed(
    core: &mut Core,
    now: Now,
    stream: StreamId,
    frames: &mut FrameBuffer,
    decoder: &felix_wire::Decoder,
) -> (Reading, bool) {
    if !core.accepts_frames(stream) {
        return (Reading::Frames, false);
    }
    for _ in 0..FRAMES_PER_FEED_MAX {
        let frame = match frames.next(decoder) {
            Ok(Some(frame)) => frame,
            Ok(None) => return (Reading::Frames, false),
            Err(error) => {
                core.handle_decode_error(now, stream, &error);
                return (Reading::Done, false);
            }
        };
        match core.handle_frame(now, stream, frame) {
            Flow::Continue => {}
            // Parked: the rest stays buffered until the machine says the stream goes on.
            Flow::Blocked => return (Reading::Frames, false),
            Flow::Subscribed if frames.is_empty() => return (Reading::Subscription, false),
            Flow::Subscribed => {
                core.handle_extra_data(now, stream);
                return (Reading::Done, false);
            }
            Flow::Done => return (Reading::Done, false),
        }
    }
    (Reading::Frames, !frames.is_empty())
}

/// One client stream: feed its frames, write its answers (or deliveries), until the machine
/// finishes it or the client goes away. `handshake`: the connection's first stream, told
/// whether the handshake was answered.
async fn serve_stream(
    shell: Rc<Shell>,
    connection: ConnectionId,
    stream: StreamId,
    quic: BidirectionalStream,
    mut handshake: Option<tokio::sync::oneshot::Sender<bool>>,
    budget: Rc<ReadBudget>,
) {
    let (mut receive, mut send) = quic.split();
    let writer = shell.add_writer(stream);
    let _guard = StreamGuard {
        shell: Rc::clone(&shell),
        stream,
    };
    let mut share = BudgetShare {
        budget,
        accounted: 0,
    };
    let mut frames = FrameBuffer::default();
    let mut reading = Reading::Frames;
    let mut receive_open = true;
    loop {
        // Feed what is buffered and take the answers in one input.
        let mut frames_left = false;
        let mut transmit = shell.input(|core, now| {
            if reading == Reading::Frames {
                let decoder = if handshake.is_some() {
                    &shell.hello_decoder
                } else {
                    &shell.decoder
                };
                (reading, frames_left) = feed(core, now, stream, &mut frames, decoder);
            }
            core.poll_transmit(now, stream)
        });
        share
            .budget
            .track(&mut share.accounted, frames.len() as u64);
        // Write everything the machine has for this stream (a subscription: batch by batch).
        let mut writes = 0u32;
        loop {
            if !transmit.chunks.is_empty()
                && !write(&shell, stream, &mut send, &mut transmit.chunks).await
            {
                return;
            }
            if transmit.finish {
                finish(&shell, connection, &mut send, transmit.close_connection).await;
                if let Some(done) = handshake.take() {
                    let _ = done.send(false);
                }
                return;
            }
            if !transmit.more {
                break;
            }
            writes += 1;
            if writes >= WRITES_PER_YIELD_MAX {
                writes = 0;
                tokio::task::yield_now().await;
            }
            transmit = shell.input(|core, now| core.poll_transmit(now, stream));
        }
        if handshake.is_some()
            && shell.core.borrow().handshake_done(connection)
            && let Some(done) = handshake.take()
        {
            let _ = done.send(true);
        }
        if frames_left {
            tokio::task::yield_now().await;
            continue;
        }
        // Registered before the check, so a release between the two is not missed.
        let freed = share.budget.freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        let over_budget = reading == Reading::Frames && !share.budget.has_room();
        let read = receive_open
            && !over_budget
            && match reading {
                Reading::Frames => shell.core.borrow().accepts_frames(stream),
                Reading::Subscription => true,
                Reading::Done => false,
            };
        tokio::select! {
            biased;
            () = writer.notified() => {}
            () = &mut freed, if over_budget => {}
            received = receive.receive(), if read => match received {
                Ok(Some(chunk)) => match reading {
                    Reading::Frames => {
                        frames.push(chunk);
                        share
                            .budget
                            .track(&mut share.accounted, frames.len() as u64);
                    }
                    Reading::Subscription if chunk.is_empty() => {}
                    Reading::Subscription => {
                        shell.input(|core, now| core.handle_extra_data(now, stream));
                        reading = Reading::Done;
                    }
                    Reading::Done => {}
                },
                Ok(None) => {
                    receive_open = false;
                    if reading == Reading::Frames {
                        let partial = !frames.is_empty();
                        shell.input(|core, now| core.handle_fin(now, stream, partial));
                    }
                }
                // Reset by the client, or the connection is gone.
                Err(_) => return,
            },
        }
    }
}

/// Writes `chunks` on the stream (one vectored write); false when the stream is gone. A write blocked by a client
/// that stopped reading (no QUIC flow-control credit) gives up once its subscription has ended
/// and [`STALLED_END_GRACE`] passed: the stream is reset with the ending error's code.
async fn write(
    shell: &Shell,
    stream: StreamId,
    send: &mut SendStream,
    chunks: &mut [Bytes],
) -> bool {
    use futures::FutureExt as _;
    let stalled_code = {
        let mut sending = std::pin::pin!(send.send_vectored(chunks));
        // The common case costs no timer: the data fits the flow-control window.
        if let Some(result) = (&mut sending).now_or_never() {
            return result.is_ok();
        }
        let mut ending_since = None;
        loop {
            tokio::select! {
                result = &mut sending => return result.is_ok(),
                () = tokio::time::sleep(STALL_CHECK_INTERVAL) => {}
            }
            let Some(code) = shell.core.borrow().subscription_ending(stream) else {
                continue;
            };
            let since = *ending_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= STALLED_END_GRACE {
                break code;
            }
        }
    };
    tracing::debug!(
        ?stream,
        code = ?stalled_code,
        "a stalled subscriber's stream is reset: its subscription ended"
    );
    let _ = send.reset(close_code(stalled_code));
    false
}

/// Finishes the stream; after a refused handshake, waits (bounded) for the client to read the
/// error, then closes the connection.
async fn finish(
    shell: &Shell,
    connection: ConnectionId,
    send: &mut SendStream,
    close: Option<felix_wire::ErrorCode>,
) {
    match close {
        None => {
            let _ = send.finish();
        }
        Some(code) => {
            // `close` finishes the stream and waits until the peer acknowledged it.
            let _ = tokio::time::timeout(ERROR_FLUSH_TIMEOUT, send.close()).await;
            tracing::debug!(?code, "handshake refused");
            shell.close_connection(connection, code);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FrameBuffer;
    use bytes::{Bytes, BytesMut};
    use felix_wire::{AckMode, Decoder, Frame, Limits, Publish, Record};

    fn publish(request_id: u64, records: usize, payload: usize) -> Frame {
        Frame::Publish(Publish {
            request_id,
            ack: AckMode::Acked,
            stream: "s".to_string(),
            records: (0..records)
                .map(|i| Record {
                    key: Bytes::from(format!("k{i}")),
                    payload: Bytes::from(vec![(i % 251) as u8; payload]),
                })
                .collect(),
        })
    }

    /// Decodes every whole frame `frames` holds, as the stream's feed does.
    fn drain(frames: &mut FrameBuffer, decoder: &Decoder, out: &mut Vec<Frame>) {
        while let Some(frame) = frames.next(decoder).unwrap() {
            out.push(frame);
        }
    }

    #[test]
    fn frames_split_anywhere_decode_as_sent_and_held_bytes_are_counted() {
        // Proves chunks cut at every kind of place (inside a header, inside a body, several
        // frames in one chunk, a frame over many chunks) give back exactly the frames sent, and
        // that what the buffer says it holds is what was received and not yet decoded.
        let limits = Limits::DEFAULT;
        let decoder = Decoder::new(limits);
        let sent = vec![
            publish(1, 64, 4096),
            publish(2, 1, 3),
            publish(3, 3, 700),
            publish(4, 64, 4096),
            publish(5, 1, 0),
        ];
        let mut wire = BytesMut::new();
        for frame in &sent {
            felix_wire::encode(frame, &mut wire);
        }
        let wire = wire.freeze();
        for chunk_len in [1usize, 5, 6, 7, 1200, 1350, 4096, 70_000, wire.len()] {
            let mut frames = FrameBuffer::default();
            let mut got = Vec::new();
            let mut received = 0;
            let mut decoded = 0;
            for piece in wire.chunks(chunk_len) {
                frames.push(wire.slice_ref(piece));
                received += piece.len();
                drain(&mut frames, &decoder, &mut got);
                decoded = got.iter().map(felix_wire::encoded_len).sum::<usize>();
                assert_eq!(frames.len(), received - decoded, "chunks of {chunk_len}");
            }
            assert_eq!(decoded, wire.len());
            assert!(frames.is_empty());
            assert_eq!(got, sent, "chunks of {chunk_len}");
        }
    }

    #[test]
    fn bytes_sent_a_few_at_a_time_are_held_in_few_chunks() {
        // Proves a peer trickling a frame byte by byte does not make the buffer keep an entry
        // per byte (small chunks are merged), and the frame still decodes as sent.
        let decoder = Decoder::new(Limits::DEFAULT);
        let sent = publish(7, 16, 600);
        let mut wire = BytesMut::new();
        felix_wire::encode(&sent, &mut wire);
        let mut frames = FrameBuffer::default();
        for i in 0..wire.len() - 1 {
            frames.push(wire.clone().freeze().slice(i..=i));
        }
        assert_eq!(frames.len(), wire.len() - 1);
        assert!(
            frames.chunks.len() <= wire.len() / 4096 + 1,
            "{} chunks for {} bytes",
            frames.chunks.len(),
            wire.len()
        );
        assert_eq!(frames.next(&decoder), Ok(None));
        frames.push(wire.clone().freeze().slice(wire.len() - 1..));
        assert_eq!(frames.next(&decoder), Ok(Some(sent)));
        assert!(frames.is_empty());
    }

    #[test]
    fn a_header_over_the_limit_is_refused_at_once() {
        // Proves a header claiming more than the frame limit is refused as soon as its 6
        // bytes are here (split over two chunks), without waiting for the body.
        let limits = Limits::DEFAULT;
        let decoder = Decoder::new(limits);
        let mut frames = FrameBuffer::default();
        let mut header = (limits.max_frame_bytes + 1).to_le_bytes().to_vec();
        header.extend_from_slice(&[0x20, 0]);
        frames.push(Bytes::copy_from_slice(&header[..3]));
        assert_eq!(frames.next(&decoder), Ok(None));
        frames.push(Bytes::copy_from_slice(&header[3..]));
        assert!(matches!(
            frames.next(&decoder),
            Err(felix_wire::WireError::FrameTooLarge { .. })
        ));
    }
}
