//! A cursor over the fuzzer's bytes that the harnesses draw their choices from (like the
//! `arbitrary` crate's `Unstructured`, without the dependency, so the regression tests of the
//! crates under test can include this file as it is). Reading past the end gives zeros: every
//! input is a valid program, and a shorter input is a shorter program.

/// The fuzzer's bytes, consumed front to back.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    #[must_use]
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data }
    }

    /// No byte is left.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Bytes left.
    #[must_use]
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// The next byte, or 0 past the end.
    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((first, rest)) => {
                self.data = rest;
                *first
            }
            None => 0,
        }
    }

    pub fn bool(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    /// True about `per_256` times in 256.
    pub fn chance(&mut self, per_256: u16) -> bool {
        u16::from(self.byte()) < per_256
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A value in `0..n` (`n` at most 256 is one byte; more, four); 0 when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        if n <= 256 {
            return usize::from(self.byte()) % n;
        }
        self.u32() as usize % n
    }

    /// A value in `low..=high`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        assert!(low <= high, "an empty range");
        let span = high - low;
        if span == u64::MAX {
            return self.u64();
        }
        let raw = if span < 256 {
            u64::from(self.byte())
        } else if span < 65_536 {
            u64::from(self.u16())
        } else {
            self.u64()
        };
        low + raw % (span + 1)
    }

    /// One of `items` (which must not be empty).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// A length-prefixed (one byte) slice of at most `max` bytes, shorter at the end.
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let want = self.below(max.saturating_add(1).min(256));
        self.take(want)
    }

    /// The next `len` bytes (fewer at the end).
    pub fn take(&mut self, len: usize) -> &'a [u8] {
        let len = len.min(self.data.len());
        let (head, rest) = self.data.split_at(len);
        self.data = rest;
        head
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}
