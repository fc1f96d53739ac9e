//! Encoder and streaming decoder. TO BE IMPLEMENTED (see docs/wire-protocol.md).

use bytes::{Bytes, BytesMut};

use crate::{AckMode, Frame, Limits, WireError};

/// Appends the encoding of `frame` (header + body) to `buf`.
pub fn encode(frame: &Frame, buf: &mut BytesMut) {
    let _ = (frame, buf);
    unreachable!("codec not implemented yet")
}

/// Fast path for publishers: appends a `Publish` frame header and the fixed part of its body
/// for `record_count` records whose encoded record bytes total `records_len` (as produced by
/// [`encode_record`]). The caller appends exactly those records next.
pub fn encode_publish_header(
    request_id: u64,
    ack: AckMode,
    stream: &str,
    record_count: u32,
    records_len: usize,
    buf: &mut BytesMut,
) {
    let _ = (request_id, ack, stream, record_count, records_len, buf);
    unreachable!("codec not implemented yet")
}

/// Appends one record (key, payload) in its `Publish` encoding; returns the bytes written.
pub fn encode_record(key: &[u8], payload: &[u8], buf: &mut BytesMut) -> usize {
    let _ = (key, payload, buf);
    unreachable!("codec not implemented yet")
}

/// Streaming decoder: feed it bytes as they arrive, take whole frames out.
#[derive(Debug, Clone)]
pub struct Decoder {
    limits: Limits,
}

impl Decoder {
    #[must_use]
    pub fn new(limits: Limits) -> Decoder {
        Decoder { limits }
    }

    #[must_use]
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Takes one whole frame from the front of `buf`, if one is there. `Ok(None)` means more
    /// bytes are needed (nothing consumed). Payloads and keys are zero-copy slices of `buf`.
    /// An error means the stream is unusable: the caller answers with an `Error` frame and
    /// closes it.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        let _ = buf;
        unreachable!("codec not implemented yet")
    }

    /// Decodes exactly one frame body of type `frame_type` (header already removed).
    pub fn decode_body(&self, frame_type: u8, body: Bytes) -> Result<Frame, WireError> {
        let _ = (frame_type, body);
        unreachable!("codec not implemented yet")
    }
}
