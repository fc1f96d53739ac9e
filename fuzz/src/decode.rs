//! Fuzz target `decode`: arbitrary bytes into `felix_wire::Decoder`, with the protocol's
//! default limits and with small ones, frame after frame until it answers `None` (more bytes
//! needed) or an error.
//!
//! Input: one selector byte (the small limits and the chunk size), then the stream's bytes.
//!
//! Invariants, for each set of limits:
//! - the decoder never panics, and neither does anything done with its errors
//!   (`code`, `Display`: the broker answers every decode error with both);
//! - every frame it returns re-encodes (`felix_wire::encode`) to exactly the bytes it consumed,
//!   `encoded_len` agrees, `validate` accepts it under the same limits, and `decode_body` of
//!   its body gives the same frame;
//! - `Ok(None)` consumes nothing and is answered only to an incomplete frame; an error
//!   consumes nothing (a bad header) or exactly its frame (a bad body);
//! - feeding the same bytes in chunks (as QUIC delivers them) gives the same frames and the
//!   same final outcome as feeding them whole;
//! - a whole frame cut into chunks decodes with `decode_chunks` (what the broker does with a
//!   frame spanning QUIC chunks) to the same frame, or the same body error, as `decode`.

use bytes::{Bytes, BytesMut};
use felix_wire::{
    Decoder, FRAME_HEADER_LEN, Frame, Limits, WireError, encode, encoded_len, validate,
};

/// Runs one input (see the module documentation).
pub fn run(data: &[u8]) {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    check(Limits::DEFAULT, bytes, selector);
    check(small_limits(selector), bytes, selector);
}

/// Small limits picked by the selector byte, so that every limit check is reachable with
/// short inputs.
#[must_use]
pub fn small_limits(selector: u8) -> Limits {
    let s = usize::from(selector);
    Limits {
        max_frame_bytes: [24, 64, 512, 4096][s & 3],
        max_batch_records: [1, 2, 3, 8][(s >> 2) & 3],
        max_payload_bytes: [0, 3, 16, 1024][(s >> 4) & 3],
        max_key_bytes: [0, 2, 8, 64][(s >> 6) & 3],
        max_name_bytes: [1, 4, 8, 255][(s >> 1) & 3],
        max_shards: [1, 2, 4, 16][(s >> 3) & 3],
    }
}

/// How one decoding pass over the bytes ended.
#[derive(Debug, PartialEq)]
enum End {
    /// `Ok(None)`: these bytes wait for more.
    Incomplete(Vec<u8>),
    /// An error, and the bytes left in the buffer after it.
    Error(WireError, Vec<u8>),
}

fn check(limits: Limits, bytes: &[u8], selector: u8) {
    let decoder = Decoder::new(limits);
    let (whole, whole_end) = decode_whole(&decoder, &limits, bytes, chunk_len(selector));
    let (chunked, chunked_end) = decode_chunked(&decoder, bytes, chunk_len(selector));
    assert_eq!(
        whole, chunked,
        "the same bytes in chunks decode to the same frames"
    );
    assert_eq!(
        whole_end, chunked_end,
        "the same bytes in chunks end the same way"
    );
}

/// 1..=64 bytes per chunk.
fn chunk_len(selector: u8) -> usize {
    1 + usize::from(selector.rotate_left(3)) % 64
}

/// Decodes `bytes` fed at once, checking every frame and the way it ends.
fn decode_whole(
    decoder: &Decoder,
    limits: &Limits,
    bytes: &[u8],
    chunk: usize,
) -> (Vec<Frame>, End) {
    let mut buf = BytesMut::from(bytes);
    let mut frames = Vec::new();
    loop {
        let before = buf.clone();
        match decoder.decode(&mut buf) {
            Ok(Some(frame)) => {
                let consumed = before.len() - buf.len();
                let wire = &before[..consumed];
                check_frame(decoder, limits, &frame, wire);
                let (split, copied) = decoder
                    .decode_chunks(&cut(wire, chunk))
                    .expect("a frame decode accepts decodes in chunks");
                assert_eq!(split, frame, "decode_chunks agrees with decode");
                assert!(copied <= wire.len(), "copies only the frame's bytes");
                frames.push(frame);
            }
            Ok(None) => {
                assert_eq!(buf, before, "Ok(None) consumes nothing");
                if let Some(frame_len) = announced_len(&before) {
                    assert!(
                        frame_len > before.len(),
                        "Ok(None) only for an incomplete frame ({frame_len} of {} bytes)",
                        before.len()
                    );
                }
                return (frames, End::Incomplete(buf.to_vec()));
            }
            Err(error) => {
                check_error(&error);
                let consumed = before.len() - buf.len();
                if consumed != 0 {
                    assert_eq!(
                        Some(consumed),
                        announced_len(&before),
                        "a body error consumes exactly its frame"
                    );
                    assert_eq!(
                        decoder.decode_chunks(&cut(&before[..consumed], chunk)),
                        Err(error.clone()),
                        "decode_chunks refuses a frame in chunks as decode does"
                    );
                }
                return (frames, End::Error(error, buf.to_vec()));
            }
        }
    }
}

/// Decodes `bytes` arriving `chunk` bytes at a time, as a stream's reader does.
fn decode_chunked(decoder: &Decoder, bytes: &[u8], chunk: usize) -> (Vec<Frame>, End) {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut chunks = bytes.chunks(chunk);
    loop {
        match decoder.decode(&mut buf) {
            Ok(Some(frame)) => frames.push(frame),
            Ok(None) => match chunks.next() {
                Some(more) => buf.extend_from_slice(more),
                None => return (frames, End::Incomplete(buf.to_vec())),
            },
            Err(error) => {
                // The whole pass saw every byte; so must this one, for the same leftovers.
                for more in chunks {
                    buf.extend_from_slice(more);
                }
                return (frames, End::Error(error, buf.to_vec()));
            }
        }
    }
}

/// `bytes` cut into pieces of `chunk` bytes, as QUIC might hand them out.
fn cut(bytes: &[u8], chunk: usize) -> Vec<Bytes> {
    let whole = Bytes::copy_from_slice(bytes);
    (0..bytes.len())
        .step_by(chunk)
        .map(|start| whole.slice(start..(start + chunk).min(bytes.len())))
        .collect()
}

/// The frame length a header announces (header included), if 6 bytes are there.
fn announced_len(bytes: &[u8]) -> Option<usize> {
    let header = bytes.first_chunk::<FRAME_HEADER_LEN>()?;
    let body = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    Some(FRAME_HEADER_LEN + body as usize)
}

fn check_frame(decoder: &Decoder, limits: &Limits, frame: &Frame, wire: &[u8]) {
    let mut again = BytesMut::new();
    encode(frame, &mut again);
    assert_eq!(
        &again[..],
        wire,
        "a decoded {} re-encodes to the bytes it came from",
        frame.frame_type().name()
    );
    assert_eq!(encoded_len(frame), wire.len(), "encoded_len agrees");
    assert_eq!(
        validate(frame, limits),
        Ok(()),
        "validate accepts a decoded {} under the decoder's limits",
        frame.frame_type().name()
    );
    let body = bytes::Bytes::copy_from_slice(&wire[FRAME_HEADER_LEN..]);
    assert_eq!(
        decoder.decode_body(wire[4], body).as_ref(),
        Ok(frame),
        "decode_body agrees with decode"
    );
    // What the broker does with a frame's request id must not panic either.
    let _ = frame.request_id();
}

fn check_error(error: &WireError) {
    // The broker answers every decode error with `Error { code, message }`.
    let _ = error.code();
    let message = error.to_string();
    assert!(!message.is_empty(), "an error says what is wrong");
}
