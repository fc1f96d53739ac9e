//! Felix wire protocol v1: frame types, a zero-copy decoder that never panics and never
//! trusts a length, the encoder, stable error codes and the key -> shard hash shared by the
//! broker and every client.
//!
//! Sans-IO: this crate touches no socket, file, thread or clock. It runs on whichever core
//! calls it (the broker's per-core loops, client tasks); it holds no state across calls except
//! the [`Decoder`]'s limits. The byte layout is specified in `docs/wire-protocol.md`.
//!
//! No `unsafe`: every length read from the network is checked against the bytes present and
//! a limit before it is used, and every list count before anything is allocated for it.

#![forbid(unsafe_code)]

mod codec;
mod error;
mod frame;

pub use codec::{
    Decoder, PRODUCER_FIELDS_LEN, PUBLISH_RECORD_OVERHEAD, ProducerHeader, encode,
    encode_delivery_vectored, encode_producer_publish_header, encode_publish_header, encode_record,
    encode_record_head, encoded_len, encoded_publish_len, encoded_record_len, header_body_len,
    validate,
};
pub use error::{ErrorCode, WireError};
pub use frame::*;

/// The only protocol version this crate speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// TLS ALPN identifier of protocol v1.
pub const ALPN: &[u8] = b"felix/1";
/// Frame header: u32 body length (little-endian), u8 frame type, u8 flags.
pub const FRAME_HEADER_LEN: usize = 6;

/// Longest `Hello::client_name` in UTF-8 bytes: room for "name/version (platform)"; the
/// encoder truncates longer names at a character boundary, the decoder refuses them.
pub const CLIENT_NAME_BYTES_MAX: usize = 255;
/// Longest `ErrorFrame::message` in UTF-8 bytes: room for a sentence and a list of resume
/// positions; the encoder truncates longer messages at a character boundary, the decoder
/// refuses them.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 1024;
/// Longest `Hello::token` in bytes: a Felix token is 87 bytes; the rest is room for other
/// token formats without letting an unauthenticated peer make the broker buffer much.
pub const TOKEN_BYTES_MAX: usize = 1024;
/// Most entries in `HelloOk::core_ports`: an order of magnitude above the largest VM we target
/// (80 vCPUs), small enough that the list stays a few KiB.
pub const CORES_MAX: u32 = 1024;
/// Most streams in a `StreamList` or a `HelloOk` shard map. A v1 broker with more streams than
/// this cannot list them all in one frame (paging is not part of v1).
pub const LISTED_STREAMS_MAX: u32 = 65_536;

/// Most members in a `ClusterMap`.
pub const CLUSTER_MEMBERS_MAX: u32 = 1024;
/// Longest member address in a `ClusterMap` (`[IPv6%scope]:port` fits).
pub const CLUSTER_ADDRESS_BYTES_MAX: usize = 64;

/// FNV-1a 64-bit hash of `key` (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
#[must_use]
pub fn fnv1a_64(key: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The documented key -> shard routing ([`HashKind::Fnv1a64Mod`]):
/// `fnv1a_64(key) % shard_count`. `shard_count` must be at least 1.
#[must_use]
pub fn shard_for_key(key: &[u8], shard_count: u32) -> u32 {
    assert!(shard_count > 0, "a stream has at least one shard");
    // The remainder is < shard_count <= u32::MAX, so the cast is lossless.
    (fnv1a_64(key) % u64::from(shard_count)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FNV-1a reference vectors (from the FNV specification's test suite).
    #[test]
    fn fnv1a_matches_reference_vectors() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
