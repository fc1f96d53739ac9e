//! Self-describing records: the payload names its writer and sequence number and its bytes
//! follow from them, so a record read back can be checked byte for byte without keeping a
//! copy of what was sent.
//!
//! Payload layout: `FXC1` (4 bytes), writer (u32 LE), sequence number (u64 LE), payload length
//! (u32 LE), then a body generated from (writer, sequence) by splitmix64. The key is
//! `w<writer>-<seq>`, so keys spread over every shard (FNV-1a of distinct strings).

use bytes::Bytes;
use felix_client::Record;

/// First bytes of every campaign payload.
pub const MAGIC: [u8; 4] = *b"FXC1";
/// Magic, writer, sequence number and length.
pub const HEADER_BYTES: usize = 4 + 4 + 8 + 4;

/// Who wrote a record and its place in that writer's sequence. Unique within a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId {
    pub writer: u32,
    pub seq: u64,
}

impl std::fmt::Display for RecordId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "w{}#{}", self.writer, self.seq)
    }
}

/// The key of record `id`.
#[must_use]
pub fn key(id: RecordId) -> Bytes {
    Bytes::from(format!("w{}-{}", id.writer, id.seq))
}

/// splitmix64: a tiny, well-mixed generator for the body bytes.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn body_state(id: RecordId) -> u64 {
    (u64::from(id.writer) << 48) ^ id.seq ^ 0xF31C_CA3F_A16E_0001
}

/// The payload of record `id`, `len` bytes long (at least [`HEADER_BYTES`]).
#[must_use]
pub fn payload(id: RecordId, len: usize) -> Bytes {
    let len = len.max(HEADER_BYTES);
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&id.writer.to_le_bytes());
    out.extend_from_slice(&id.seq.to_le_bytes());
    // Payload lengths are bounded by the broker's u32 payload limit.
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    let mut state = body_state(id);
    while out.len() < len {
        let word = splitmix64(&mut state).to_le_bytes();
        let take = (len - out.len()).min(word.len());
        out.extend_from_slice(&word[..take]);
    }
    Bytes::from(out)
}

/// Record `id` with a payload of `len` bytes.
#[must_use]
pub fn make(id: RecordId, len: usize) -> Record {
    Record {
        key: key(id),
        payload: payload(id, len),
    }
}

/// Checks a record read back: its payload must be exactly what [`make`] produced for the id
/// it names, and its key that id's key. Returns the id, or what is wrong.
pub fn check(key_bytes: &[u8], payload_bytes: &[u8]) -> Result<RecordId, String> {
    if payload_bytes.len() < HEADER_BYTES || payload_bytes[..4] != MAGIC {
        return Err(format!(
            "not a campaign payload ({} bytes, starts {:02x?})",
            payload_bytes.len(),
            &payload_bytes[..payload_bytes.len().min(8)]
        ));
    }
    let field = |from: usize, to: usize| &payload_bytes[from..to];
    // The slices have the exact lengths of the integers (checked length above).
    let writer = u32::from_le_bytes(field(4, 8).try_into().unwrap_or_default());
    let seq = u64::from_le_bytes(field(8, 16).try_into().unwrap_or_default());
    let len = u32::from_le_bytes(field(16, 20).try_into().unwrap_or_default());
    let id = RecordId { writer, seq };
    if usize::try_from(len).ok() != Some(payload_bytes.len()) {
        return Err(format!(
            "{id}: header says {len} bytes, payload has {}",
            payload_bytes.len()
        ));
    }
    let expected = payload(id, payload_bytes.len());
    if expected.as_ref() != payload_bytes {
        let at = expected
            .iter()
            .zip(payload_bytes)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        return Err(format!("{id}: payload differs from byte {at}"));
    }
    if key(id).as_ref() != key_bytes {
        return Err(format!(
            "{id}: key is {:?}",
            String::from_utf8_lossy(key_bytes)
        ));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_check_and_damage_is_found() {
        // Proves a generated record checks as its own id and any flipped byte or wrong key is caught.
        let id = RecordId { writer: 3, seq: 77 };
        let r = make(id, 100);
        assert_eq!(check(&r.key, &r.payload), Ok(id));
        for at in 0..r.payload.len() {
            let mut damaged = r.payload.to_vec();
            damaged[at] ^= 0x40;
            assert!(check(&r.key, &damaged).is_err(), "flip at {at} unnoticed");
        }
        assert!(check(b"w3-78", &r.payload).is_err());
        assert!(check(&r.key, &r.payload[..50]).is_err());
        let short = make(id, 1);
        assert_eq!(short.payload.len(), HEADER_BYTES);
        assert_eq!(check(&short.key, &short.payload), Ok(id));
    }
}
