//! Hostile list counts and lengths: a count of u32::MAX (or a length prefix far beyond the
//! body) in a tiny body is an error, and the decoder never allocates for it.
//!
//! This test binary installs a global allocator that forwards to the system allocator and
//! records the largest single allocation, so "never allocates big" is measured, not assumed.
//! It holds a single test so no other test allocates while it measures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use felix_wire::{Decoder, ErrorCode, FrameType, Limits, WireError};

/// Forwards to [`System`], recording the largest allocation size requested.
struct LargestAllocation;

static LARGEST_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so this
// allocator upholds exactly the guarantees `System` does; it only records sizes.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST_BYTES.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: our caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST_BYTES.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST_BYTES.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`; the caller
        // upholds the rest of `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// Largest allocation a rejected hostile frame may cause: error messages and the like. Any
/// allocation sized by a hostile count would be gigabytes.
const ALLOCATION_BYTES_MAX: usize = 64 * 1024;

/// Limits as loose as the format allows: only the "count x smallest item <= bytes remaining"
/// check stands between a hostile count and an allocation.
const NO_LIMITS: Limits = Limits {
    max_frame_bytes: u32::MAX,
    max_batch_records: u32::MAX,
    max_payload_bytes: u32::MAX,
    max_key_bytes: u16::MAX,
    max_name_bytes: u16::MAX,
    max_shards: u32::MAX,
};

fn body(build: impl FnOnce(&mut BytesMut)) -> Bytes {
    let mut buf = BytesMut::new();
    build(&mut buf);
    buf.freeze()
}

fn hello_ok_prefix(buf: &mut BytesMut) {
    buf.put_u16_le(1); // version
    buf.put_u64_le(0); // features
    buf.put_bytes(0, 20); // limits
}

/// Bodies whose one list count (or length prefix) is `n`, followed by a few bytes.
fn hostile_bodies(n: u32) -> Vec<(&'static str, FrameType, Bytes)> {
    let tail = [0u8; 7];
    vec![
        (
            "hello_ok core ports",
            FrameType::HelloOk,
            body(|b| {
                hello_ok_prefix(b);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "hello_ok routes",
            FrameType::HelloOk,
            body(|b| {
                hello_ok_prefix(b);
                b.put_u32_le(0);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "hello_ok route cores",
            FrameType::HelloOk,
            body(|b| {
                hello_ok_prefix(b);
                b.put_u32_le(0);
                b.put_u32_le(1);
                b.put_u16_le(1);
                b.put_slice(b"s");
                b.put_u8(0); // kind
                b.put_u32_le(n); // shard_count, consistent with the hostile list
                b.put_u8(1); // hash
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "stream_info shards",
            FrameType::StreamInfo,
            body(|b| {
                b.put_u64_le(1);
                b.put_u16_le(0);
                b.put_u8(0);
                b.put_u8(1);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "stream_list streams",
            FrameType::StreamList,
            body(|b| {
                b.put_u64_le(1);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "publish records",
            FrameType::Publish,
            body(|b| {
                b.put_u64_le(1);
                b.put_u8(0);
                b.put_u16_le(0);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "publish payload length",
            FrameType::Publish,
            body(|b| {
                b.put_u64_le(1);
                b.put_u8(0);
                b.put_u16_le(0);
                b.put_u32_le(1);
                b.put_u16_le(0);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "producer_publish records",
            FrameType::ProducerPublish,
            body(|b| {
                b.put_u64_le(1);
                b.put_u8(0);
                b.put_u16_le(0);
                b.put_u64_le(9);
                b.put_u64_le(1);
                b.put_u32_le(0);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "ack shards",
            FrameType::Ack,
            body(|b| {
                b.put_u64_le(1);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "subscribe shard list",
            FrameType::Subscribe,
            body(|b| {
                b.put_u64_le(1);
                b.put_u16_le(0);
                b.put_u8(1);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "subscribe offsets",
            FrameType::Subscribe,
            body(|b| {
                b.put_u64_le(1);
                b.put_u16_le(0);
                b.put_u8(0);
                b.put_u8(2);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "subscribed shards",
            FrameType::Subscribed,
            body(|b| {
                b.put_u64_le(1);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "delivery records",
            FrameType::Delivery,
            body(|b| {
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
        (
            "delivery payload length",
            FrameType::Delivery,
            body(|b| {
                b.put_u32_le(1);
                b.put_bytes(0, 20); // shard, offset, timestamp
                b.put_u16_le(0);
                b.put_u32_le(n);
                b.put_slice(&tail);
            }),
        ),
    ]
}

/// Decodes `body` and returns the error and the largest allocation made while decoding.
fn decode_measured(decoder: &Decoder, frame_type: FrameType, body: Bytes) -> (WireError, usize) {
    LARGEST_BYTES.store(0, Ordering::Relaxed);
    let result = decoder.decode_body(frame_type as u8, body);
    let largest = LARGEST_BYTES.load(Ordering::Relaxed);
    match result {
        Ok(frame) => panic!("hostile body decoded: {frame:?}"),
        Err(err) => (err, largest),
    }
}

// A count or length of u32::MAX (or 1000) in a tiny body fails (LimitExceeded under the default
// limits, Malformed when only the bytes present bound it) and never causes an allocation over
// 64 KiB, through `decode_body` and through `decode` with a header in front.
#[test]
fn hostile_counts_fail_without_allocating() {
    for (case, frame_type, body) in hostile_bodies(u32::MAX) {
        // Lists bounded by a protocol constant (core ports, streams) hit it first.
        let (err, largest) = decode_measured(&Decoder::new(NO_LIMITS), frame_type, body.clone());
        assert!(
            matches!(err.code(), ErrorCode::Malformed | ErrorCode::LimitExceeded),
            "{case}: {err}"
        );
        assert!(
            largest <= ALLOCATION_BYTES_MAX,
            "{case}: allocated {largest} bytes"
        );

        let (err, largest) =
            decode_measured(&Decoder::new(Limits::DEFAULT), frame_type, body.clone());
        assert_eq!(err.code(), ErrorCode::LimitExceeded, "{case}: {err}");
        assert!(
            largest <= ALLOCATION_BYTES_MAX,
            "{case}: allocated {largest} bytes"
        );

        let mut framed = BytesMut::with_capacity(6 + body.len());
        framed.put_u32_le(u32::try_from(body.len()).expect("tiny body"));
        framed.put_u8(frame_type as u8);
        framed.put_u8(0);
        framed.put_slice(&body);
        LARGEST_BYTES.store(0, Ordering::Relaxed);
        let result = Decoder::new(NO_LIMITS).decode(&mut framed);
        let largest = LARGEST_BYTES.load(Ordering::Relaxed);
        assert!(result.is_err(), "{case}: {result:?}");
        assert!(
            largest <= ALLOCATION_BYTES_MAX,
            "{case}: allocated {largest} bytes"
        );
    }
    // A count within every limit but beyond what the bytes present could hold is Malformed.
    for (case, frame_type, body) in hostile_bodies(1000) {
        let (err, largest) = decode_measured(&Decoder::new(NO_LIMITS), frame_type, body);
        assert_eq!(err.code(), ErrorCode::Malformed, "{case}: {err}");
        assert!(
            largest <= ALLOCATION_BYTES_MAX,
            "{case}: allocated {largest} bytes"
        );
    }
}
