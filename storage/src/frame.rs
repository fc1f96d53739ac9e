//! Record framing: a fixed 28-byte header followed by the record body.
//!
//! ```text
//! offset size field
//!  0      4   body_len      u32 LE: bytes of body (key + payload) that follow the header
//!  4      4   shard         u32 LE: log-local shard id
//!  8      8   offset_key    u64 LE: bits 0..48 the record's offset in its shard (dense from
//!                           the shard's base), bits 48..64 the key length
//! 16      8   timestamp_us  u64 LE: microseconds since the Unix epoch, from the appender
//! 24      4   crc32c        u32 LE: CRC32C of bytes 0..24 followed by the whole body
//! 28  key_len key           \ body (body_len bytes)
//!  .      .   payload       /
//! ```
//!
//! The key length shares the offset word, so every record costs exactly `HEADER_BYTES` of
//! framing on top of its key and payload; see `docs/storage-format.md`.

/// Bytes of framing per record.
pub const HEADER_BYTES: usize = 28;
const _: () = assert!(HEADER_BYTES == 28);
/// Bits of the offset word that hold the offset; the 16 above hold the key length.
pub const OFFSET_BITS: u32 = 48;
/// Largest storable offset: 2^48 - 1 (at 10 million records a second, 890 years of one shard).
pub const OFFSET_MAX: u64 = (1 << OFFSET_BITS) - 1;
/// Longest key: 16 bits of the offset word (the wire protocol's key length is a u16 too).
pub const KEY_BYTES_MAX: usize = u16::MAX as usize;
/// Largest body (key prefix + key + payload). 64 MiB: 16 times the wire protocol's default
/// 4 MiB payload limit, so anything the broker accepts fits, while recovery and reads never
/// need to hold more than one such record in memory.
pub const BODY_BYTES_MAX: usize = 64 << 20;
const _: () = assert!(BODY_BYTES_MAX <= u32::MAX as usize);
const _: () = assert!(BODY_BYTES_MAX > KEY_BYTES_MAX);

const CRC_AT: usize = 24;

/// Key-length value of a commit mark. A record's key length never exceeds its body, so an
/// empty body with this key length (which `decode` used to reject as `KeyLength`) is free to
/// mean "commit mark" without changing any record's encoding.
const MARK_KEY_LEN: u16 = u16::MAX;
/// Bytes of a commit mark: a bare header (no body).
pub const MARK_BYTES: usize = HEADER_BYTES;

/// A decoded record borrowing its key and payload from the buffer it was decoded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRef<'a> {
    pub shard: u32,
    pub offset: u64,
    pub timestamp_us: u64,
    pub key: &'a [u8],
    pub payload: &'a [u8],
}

/// Header fields, read without checking the CRC (used on the log's own in-memory buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub body_len: u32,
    pub shard: u32,
    pub offset: u64,
    pub key_len: u16,
    pub timestamp_us: u64,
    pub crc: u32,
}

/// Why bytes are not a valid record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// All 28 header bytes are zero: the end of the written part of a preallocated segment.
    Zero,
    /// The body length is above [`BODY_BYTES_MAX`].
    BodyLength(u32),
    /// The stored CRC does not match the header and body.
    Crc { stored: u32, computed: u32 },
    /// The key length exceeds the body (possible only if the encoder is wrong).
    KeyLength(u16),
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Zero => write!(f, "zero header"),
            Invalid::BodyLength(n) => write!(f, "impossible body length {n}"),
            Invalid::Crc { stored, computed } => {
                write!(
                    f,
                    "CRC mismatch (stored {stored:#010x}, computed {computed:#010x})"
                )
            }
            Invalid::KeyLength(n) => write!(f, "key length {n} exceeds the body"),
        }
    }
}

/// Result of decoding at the start of a byte slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A valid record of `frame_bytes` bytes (header + body).
    Record {
        record: RecordRef<'a>,
        frame_bytes: usize,
    },
    /// A commit mark (a 28-byte frame with no body, see `docs/storage-format.md`, Commit
    /// marks): when it was written, a completed fdatasync covered every byte of its segment
    /// before `synced_end`. Its frame length is [`MARK_BYTES`].
    Mark { synced_end: u64, timestamp_us: u64 },
    /// The slice ends before the frame does; `frame_bytes` is how many bytes are needed
    /// (at least the header, and the whole frame once the header is readable and sane).
    Incomplete { frame_bytes: usize },
    /// Not a record.
    Invalid(Invalid),
}

/// Body bytes of a record: key + payload.
pub fn body_len(key_bytes: usize, payload_bytes: usize) -> usize {
    key_bytes + payload_bytes
}

/// Frame bytes of a record: header + body.
pub fn frame_len(key_bytes: usize, payload_bytes: usize) -> usize {
    HEADER_BYTES + body_len(key_bytes, payload_bytes)
}

/// Checks the size limits of a record before it is encoded.
pub fn check_sizes(key_bytes: usize, payload_bytes: usize) -> Result<(), crate::StorageError> {
    let body_bytes = key_bytes.saturating_add(payload_bytes);
    if key_bytes > KEY_BYTES_MAX || body_bytes > BODY_BYTES_MAX {
        return Err(crate::StorageError::RecordTooLarge {
            key_bytes,
            max_key_bytes: KEY_BYTES_MAX,
            body_bytes,
            max_body_bytes: BODY_BYTES_MAX,
        });
    }
    Ok(())
}

/// Appends one framed record to `buf`. The caller has checked the sizes with
/// [`check_sizes`]; violating them is a programmer error and panics.
pub fn encode(
    buf: &mut Vec<u8>,
    shard: u32,
    offset: u64,
    timestamp_us: u64,
    key: &[u8],
    payload: &[u8],
) {
    assert!(
        key.len() <= KEY_BYTES_MAX,
        "key length checked by the caller"
    );
    let body = body_len(key.len(), payload.len());
    assert!(body <= BODY_BYTES_MAX, "body length checked by the caller");
    // Offsets are dense from 0 per shard; 2^48 of them is out of reach (see OFFSET_MAX).
    assert!(
        offset <= OFFSET_MAX,
        "offset {offset} exceeds the 48-bit offset field"
    );
    let offset_key = offset | (key.len() as u64) << OFFSET_BITS;
    let start = buf.len();
    buf.reserve(HEADER_BYTES + body);
    buf.extend_from_slice(&(body as u32).to_le_bytes());
    buf.extend_from_slice(&shard.to_le_bytes());
    buf.extend_from_slice(&offset_key.to_le_bytes());
    buf.extend_from_slice(&timestamp_us.to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(key);
    buf.extend_from_slice(payload);
    let crc = crc_of(&buf[start..start + CRC_AT], &buf[start + HEADER_BYTES..]);
    buf[start + CRC_AT..start + HEADER_BYTES].copy_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(buf.len() - start, HEADER_BYTES + body);
}

fn crc_of(header_24: &[u8], body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(header_24), body)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(raw)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(raw)
}

/// Appends one commit mark claiming that every byte of its segment before `synced_end` is
/// covered by a completed fdatasync. `synced_end` is a file position (below 2^48: segments
/// are at most 64 GiB).
pub fn encode_mark(buf: &mut Vec<u8>, synced_end: u64, timestamp_us: u64) {
    assert!(
        synced_end <= OFFSET_MAX,
        "a segment position fits the 48-bit field"
    );
    let start = buf.len();
    let offset_key = synced_end | u64::from(MARK_KEY_LEN) << OFFSET_BITS;
    buf.extend_from_slice(&0u32.to_le_bytes());
    buf.extend_from_slice(&0u32.to_le_bytes());
    buf.extend_from_slice(&offset_key.to_le_bytes());
    buf.extend_from_slice(&timestamp_us.to_le_bytes());
    let crc = crc_of(&buf[start..start + CRC_AT], &[]);
    buf.extend_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(buf.len() - start, MARK_BYTES);
}

/// Whether the header bytes at the start of `bytes` have the shape of a commit mark (empty
/// body, mark key length), before any CRC check: the cheap filter of a search for marks.
pub fn looks_like_mark(bytes: &[u8]) -> bool {
    bytes.len() >= HEADER_BYTES
        && bytes[..4] == [0, 0, 0, 0]
        && bytes[14..16] == MARK_KEY_LEN.to_le_bytes()
}

/// Reads the header fields at the start of `bytes`, or `None` if fewer than 28 bytes.
pub fn decode_header(bytes: &[u8]) -> Option<Header> {
    if bytes.len() < HEADER_BYTES {
        return None;
    }
    let offset_key = u64_at(bytes, 8);
    Some(Header {
        body_len: u32_at(bytes, 0),
        shard: u32_at(bytes, 4),
        offset: offset_key & OFFSET_MAX,
        // The shift leaves exactly 16 bits.
        key_len: (offset_key >> OFFSET_BITS) as u16,
        timestamp_us: u64_at(bytes, 16),
        crc: u32_at(bytes, CRC_AT),
    })
}

/// Decodes and verifies the record at the start of `bytes`. Never panics, whatever the bytes.
pub fn decode(bytes: &[u8]) -> Decoded<'_> {
    let Some(header) = decode_header(bytes) else {
        return Decoded::Incomplete {
            frame_bytes: HEADER_BYTES,
        };
    };
    if bytes[..HEADER_BYTES].iter().all(|b| *b == 0) {
        return Decoded::Invalid(Invalid::Zero);
    }
    let body = header.body_len as usize;
    if body > BODY_BYTES_MAX {
        return Decoded::Invalid(Invalid::BodyLength(header.body_len));
    }
    let frame_bytes = HEADER_BYTES + body;
    if bytes.len() < frame_bytes {
        return Decoded::Incomplete { frame_bytes };
    }
    let body_bytes = &bytes[HEADER_BYTES..frame_bytes];
    let computed = crc_of(&bytes[..CRC_AT], body_bytes);
    if computed != header.crc {
        return Decoded::Invalid(Invalid::Crc {
            stored: header.crc,
            computed,
        });
    }
    let key_end = usize::from(header.key_len);
    if key_end > body {
        if body == 0 && header.key_len == MARK_KEY_LEN {
            return Decoded::Mark {
                synced_end: header.offset,
                timestamp_us: header.timestamp_us,
            };
        }
        return Decoded::Invalid(Invalid::KeyLength(header.key_len));
    }
    Decoded::Record {
        record: RecordRef {
            shard: header.shard,
            offset: header.offset,
            timestamp_us: header.timestamp_us,
            key: &body_bytes[..key_end],
            payload: &body_bytes[key_end..],
        },
        frame_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trip() {
        // A record decodes to exactly what was encoded and occupies 28 + key + payload bytes.
        let mut buf = Vec::new();
        encode(&mut buf, 7, 42, 1_700_000_000_000_000, b"key", b"payload");
        assert_eq!(buf.len(), HEADER_BYTES + 3 + 7);
        match decode(&buf) {
            Decoded::Record {
                record,
                frame_bytes,
            } => {
                assert_eq!(frame_bytes, buf.len());
                assert_eq!(record.shard, 7);
                assert_eq!(record.offset, 42);
                assert_eq!(record.timestamp_us, 1_700_000_000_000_000);
                assert_eq!(record.key, b"key");
                assert_eq!(record.payload, b"payload");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn every_single_byte_flip_is_detected() {
        // Flipping any bit of any byte of a frame makes it invalid or incomplete, never a different record.
        let mut buf = Vec::new();
        encode(&mut buf, 1, 2, 3, b"k", &[9u8; 40]);
        for at in 0..buf.len() {
            for bit in 0..8 {
                let mut bad = buf.clone();
                bad[at] ^= 1 << bit;
                assert!(
                    !matches!(decode(&bad), Decoded::Record { .. }),
                    "flip at {at} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn empty_record_never_reads_as_the_zero_end_marker() {
        // A record with no key and no payload at shard 0, offset 0, time 0 still has a non-zero
        // CRC, so it cannot be mistaken for preallocated zeros.
        let mut buf = Vec::new();
        encode(&mut buf, 0, 0, 0, b"", b"");
        assert_eq!(buf.len(), HEADER_BYTES);
        assert!(buf.iter().any(|b| *b != 0));
        assert!(matches!(decode(&buf), Decoded::Record { .. }));
    }

    #[test]
    fn marks_round_trip_and_flips_are_detected() {
        // A commit mark decodes as a mark with its claim, is 28 bytes, matches the cheap
        // filter, and any flipped bit makes it invalid (never a record or another mark).
        let mut buf = Vec::new();
        encode_mark(&mut buf, 123_456, 77);
        assert_eq!(buf.len(), MARK_BYTES);
        assert!(looks_like_mark(&buf));
        assert_eq!(
            decode(&buf),
            Decoded::Mark {
                synced_end: 123_456,
                timestamp_us: 77
            }
        );
        for at in 0..buf.len() {
            for bit in 0..8 {
                let mut bad = buf.clone();
                bad[at] ^= 1 << bit;
                assert!(
                    !matches!(decode(&bad), Decoded::Record { .. } | Decoded::Mark { .. }),
                    "flip at {at} bit {bit}"
                );
            }
        }
        let mut record = Vec::new();
        encode(&mut record, 0, 0, 0, b"", b"");
        assert!(!looks_like_mark(&record), "an empty record is not a mark");
    }

    #[test]
    fn offset_and_key_length_share_a_word() {
        // The largest offset and the longest key both survive the shared 64-bit field.
        let mut buf = Vec::new();
        let key = vec![7u8; KEY_BYTES_MAX];
        encode(&mut buf, 3, OFFSET_MAX, 9, &key, b"p");
        match decode(&buf) {
            Decoded::Record { record, .. } => {
                assert_eq!(record.offset, OFFSET_MAX);
                assert_eq!(record.key.len(), KEY_BYTES_MAX);
                assert_eq!(record.payload, b"p");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn zero_header_and_short_input() {
        // Preallocated zeros read as the end of data; short input asks for more bytes.
        assert_eq!(decode(&[0u8; 64]), Decoded::Invalid(Invalid::Zero));
        assert_eq!(
            decode(&[1u8; 10]),
            Decoded::Incomplete {
                frame_bytes: HEADER_BYTES
            }
        );
        let mut buf = Vec::new();
        encode(&mut buf, 1, 2, 3, b"", b"abc");
        assert_eq!(
            decode(&buf[..buf.len() - 1]),
            Decoded::Incomplete {
                frame_bytes: buf.len()
            }
        );
    }
}
