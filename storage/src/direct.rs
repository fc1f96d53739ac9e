//! Direct writes (O_DIRECT): a round goes from a page-aligned buffer straight to the device,
//! with no copy into the page cache and no writeback work at fdatasync.
//!
//! Why: with buffered writes the kernel's copy of each round into freshly allocated page-cache
//! pages (`copy_folio_from_iter_atomic`, run by io_uring's worker on the core's CPU) was ~47 %
//! of a pinned broker core at 4 KiB x 64 on_commit, more than the whole QUIC receive path
//! (docs/performance.md, durable writer). O_DIRECT needs the file position, the length and the
//! buffer address aligned to the device's block; [`DIRECT_ALIGN`] (4 KiB) covers every
//! logical block size Felix targets, and segments already start their data on a 4 KiB
//! boundary (`segment::SEGMENT_ALIGN_BYTES`).
//!
//! A round rarely starts or ends on a block boundary, so the log stages it
//! ([`crate::Log`], `stage_direct`): the staged buffer starts at the block holding the
//! segment's tail, with the bytes already in that block before the tail (kept from the
//! previous round's staged bytes, or read back), then the round's bytes, then zeros up to the next block
//! boundary. The zeros land past the tail, where a preallocated segment reads as zeros anyway
//! (recovery stops at the first all-zero header), and the next round rewrites that block with
//! the same prefix. Rewriting the tail block is what buffered writeback does too (it writes
//! whole pages), so the power-loss exposure of synced records in that block is unchanged.
//!
//! With two rounds in flight the tail (and the kept block) is the previous round's end as
//! staged, not as completed; the next round is submitted only after the previous round's
//! write finished, so two writes to the tail block never race (see docs/storage-format.md,
//! Two rounds in flight).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

/// Alignment of a direct write's file position, length and buffer address.
/// The segments' data alignment: records start on such a boundary.
pub const DIRECT_ALIGN: usize = crate::segment::SEGMENT_ALIGN_BYTES as usize;

/// A heap buffer whose address is [`DIRECT_ALIGN`]-aligned. Its bytes are always initialized
/// (allocated zeroed, then only overwritten).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Vec<u8>); no interior sharing.
unsafe impl Send for AlignedBuf {}
// SAFETY: &AlignedBuf only gives out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// An empty buffer with no allocation.
    #[must_use]
    pub fn new() -> Self {
        AlignedBuf {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// Sets the length to `len` (a multiple of [`DIRECT_ALIGN`]), reallocating when the
    /// capacity is short. The contents are unspecified (old bytes or zeros): the caller
    /// overwrites all of them.
    pub fn set_len(&mut self, len: usize) {
        debug_assert!(len.is_multiple_of(DIRECT_ALIGN));
        if len > self.cap {
            self.free();
            // Grow by at least a quarter, so a slowly growing round size reallocates rarely.
            let cap = len
                .max(self.cap + self.cap / 4)
                .next_multiple_of(DIRECT_ALIGN);
            let layout = Self::layout(cap);
            // SAFETY: the layout has a non-zero size (cap >= len > 0) and a valid alignment.
            let ptr = unsafe { alloc_zeroed(layout) };
            let Some(ptr) = NonNull::new(ptr) else {
                std::alloc::handle_alloc_error(layout);
            };
            self.ptr = ptr;
            self.cap = cap;
        }
        self.len = len;
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap >= len` initialized bytes (or dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn layout(cap: usize) -> Layout {
        match Layout::from_size_align(cap, DIRECT_ALIGN) {
            Ok(l) => l,
            Err(_) => unreachable!("a round's size is far below isize::MAX"),
        }
    }

    fn free(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated by `set_len` with exactly this layout, not freed since.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) };
            self.ptr = NonNull::dangling();
            self.cap = 0;
            self.len = 0;
        }
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

/// A round staged for a direct write: `buf` goes at `pos` through `file` (the segment opened
/// with O_DIRECT). `pos` and `buf.len()` are multiples of [`DIRECT_ALIGN`].
#[derive(Debug)]
pub struct DirectWrite {
    pub file: Arc<File>,
    pub pos: u64,
    pub buf: AlignedBuf,
}

/// Opens `path` for direct writes. Fails (EINVAL) on file systems without O_DIRECT.
pub fn open(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// `n` rounded down to a multiple of [`DIRECT_ALIGN`].
#[must_use]
pub fn align_down(n: u64) -> u64 {
    n - n % DIRECT_ALIGN as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_aligned_and_keep_their_bytes_until_grown() {
        let mut b = AlignedBuf::new();
        assert!(b.is_empty());
        b.set_len(DIRECT_ALIGN);
        assert_eq!(b.as_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0), "allocated zeroed");
        b.as_mut_slice().fill(7);
        b.set_len(DIRECT_ALIGN);
        assert!(b.as_slice().iter().all(|&x| x == 7), "no reallocation");
        b.set_len(5 * DIRECT_ALIGN);
        assert_eq!(b.len(), 5 * DIRECT_ALIGN);
        assert_eq!(b.as_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
        b.set_len(2 * DIRECT_ALIGN);
        assert_eq!(b.as_slice().len(), 2 * DIRECT_ALIGN);
    }

    #[test]
    fn align_down_rounds_to_blocks() {
        assert_eq!(align_down(0), 0);
        assert_eq!(align_down(4095), 0);
        assert_eq!(align_down(4096), 4096);
        assert_eq!(align_down(10_000), 8192);
    }
}
