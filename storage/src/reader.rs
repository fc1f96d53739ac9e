//! Where [`crate::Log::try_read`] takes its bytes without blocking the core's thread on the
//! disk. A chunk of a segment (`log::READ_CHUNK_BYTES`) comes, in this order, from:
//! 1. the log's few chunks fetched for reads that had to wait ([`FETCHED_KEPT_MAX`]);
//! 2. the page cache, read without blocking: `preadv2(RWF_NOWAIT)`, which fails with EAGAIN
//!    or returns short when the pages are not all cached (a short read that holds whole
//!    frames is used as is, the rest comes from the next chunk);
//! 3. otherwise a [`Fetch`]: the log's reader thread (`felix-log-reader`, spawned at the
//!    first fetch) does the blocking pread and wakes the core through the log's `wake_fd`
//!    (a duplicate of the backend's eventfd, so the broker still watches one fd). The read
//!    answers [`crate::ReadOutcome::Pending`] and is tried again once the chunk arrived
//!    ([`crate::Log::poll_reads`]). At most [`FETCHES_IN_FLIGHT_MAX`] fetches are
//!    outstanding.
//!
//! With the fault backend (tests, the simulation) nothing here runs on a thread or depends on
//! the page cache: [`HeldReads`] decides hits and misses from a seed, and fetches wait until
//! the test completes them (`FaultHandle::complete_next_fetch`), like the backend's rounds.
//!
//! Threads: [`Reads`] lives on the log's core thread; the reader thread only preads into
//! buffers it sends back.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::thread::JoinHandle;

use bytes::Bytes;

use crate::StorageError;
use crate::backend::EventFd;

/// Fetches outstanding at once (the reader thread's queue): enough to keep one disk busy
/// with 256 KiB reads while a few subscribers catch up, few enough that the chunks waiting
/// for their retry stay small (4 x 256 KiB per core).
pub const FETCHES_IN_FLIGHT_MAX: usize = 4;
/// Fetched chunks kept for the reads waiting on them. Fetches complete only into this list,
/// at most [`FETCHES_IN_FLIGHT_MAX`] per `Log::poll_reads`, and the core's pump retries its
/// waiting reads right after (`dataplane/core/src/durable.rs`), so twice that keeps every
/// chunk until its retry, and lets reads of the same region (several subscribers resuming
/// together) share it.
pub const FETCHED_KEPT_MAX: usize = 2 * FETCHES_IN_FLIGHT_MAX;

/// A chunk of a segment to read with a blocking pread.
#[derive(Debug)]
pub struct Fetch {
    pub(crate) segment: u64,
    pub(crate) file: Arc<File>,
    pub(crate) pos: u64,
    pub(crate) len: usize,
}

/// A performed [`Fetch`].
#[derive(Debug)]
pub(crate) struct Fetched {
    pub(crate) segment: u64,
    pub(crate) pos: u64,
    pub(crate) len: usize,
    pub(crate) result: Result<Bytes, Arc<io::Error>>,
}

impl Fetch {
    fn perform(self) -> Fetched {
        let mut buf = vec![0u8; self.len];
        let result = self
            .file
            .read_exact_at(&mut buf, self.pos)
            .map(|()| Bytes::from(buf))
            .map_err(Arc::new);
        Fetched {
            segment: self.segment,
            pos: self.pos,
            len: self.len,
            result,
        }
    }
}

/// What a non-blocking look at the page cache found.
#[derive(Debug)]
pub(crate) enum Probe {
    /// The first bytes of the range (at least what was needed).
    Hit(Bytes),
    Miss,
}

/// Reads `len` bytes at `pos` if the page cache holds them, without blocking: the bytes
/// read when at least `need` came back, `Miss` on EAGAIN or a shorter read,
/// `Err(EOPNOTSUPP or EINVAL)` when the kernel or file system cannot read without waiting.
fn probe_page_cache(file: &File, pos: u64, len: usize, need: usize) -> io::Result<Probe> {
    let mut buf = vec![0u8; len];
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: len,
    };
    let offset =
        libc::off_t::try_from(pos).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // Bounded: EINTR is retried, anything else returns.
    loop {
        // SAFETY: one iovec over `buf`, which lives and is `len` bytes long during the call;
        // the fd is open (we hold the file).
        let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset, libc::RWF_NOWAIT) };
        if n >= 0 {
            let n = usize::try_from(n).unwrap_or(0);
            if n < need.max(1) {
                return Ok(Probe::Miss);
            }
            buf.truncate(n);
            return Ok(Probe::Hit(Bytes::from(buf)));
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN) => return Ok(Probe::Miss),
            _ => return Err(error),
        }
    }
}

/// The reader thread and its channels.
#[derive(Debug)]
struct ReaderThread {
    to_reader: Option<SyncSender<Fetch>>,
    from_reader: Receiver<Fetched>,
    thread: Option<JoinHandle<()>>,
}

impl ReaderThread {
    fn spawn(wake: EventFd) -> Result<ReaderThread, StorageError> {
        let (to_reader, requests) = sync_channel::<Fetch>(FETCHES_IN_FLIGHT_MAX);
        let (done, from_reader) = sync_channel::<Fetched>(FETCHES_IN_FLIGHT_MAX);
        let thread = std::thread::Builder::new()
            .name("felix-log-reader".into())
            .spawn(move || {
                // Ends when the log drops its sender. Never blocks on `done`: the log keeps
                // at most FETCHES_IN_FLIGHT_MAX fetches outstanding, the channel's capacity.
                while let Ok(fetch) = requests.recv() {
                    if done.send(fetch.perform()).is_err() {
                        return;
                    }
                    // After the send: a core that drained the eventfd before this write sees
                    // the chunk on its next wake-up; one that drains after it sees it now.
                    wake.notify();
                }
            })
            .map_err(|e| StorageError::io("spawn log reader thread", e))?;
        Ok(ReaderThread {
            to_reader: Some(to_reader),
            from_reader,
            thread: Some(thread),
        })
    }
}

impl Drop for ReaderThread {
    fn drop(&mut self) {
        // Closing the channel ends the thread after its current pread.
        drop(self.to_reader.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The fault backend's reads (tests, the simulation): hits and misses drawn from a seed,
/// fetches held until [`HeldReads::complete_next`]. Single-threaded, like the fault backend.
#[derive(Debug, Clone, Default)]
pub struct HeldReads(Rc<RefCell<HeldState>>);

#[derive(Debug, Default)]
struct HeldState {
    /// Per mille of page-cache looks that miss.
    miss_per_mille: u64,
    rng: u64,
    queued: VecDeque<Fetch>,
    done: VecDeque<Fetched>,
}

impl HeldReads {
    /// From now on `per_mille` of the looks at the page cache miss (drawn from `seed`).
    pub(crate) fn set_misses(&self, per_mille: u64, seed: u64) {
        let mut s = self.0.borrow_mut();
        s.miss_per_mille = per_mille.min(1000);
        s.rng = seed;
    }

    fn misses(&self) -> bool {
        let mut s = self.0.borrow_mut();
        if s.miss_per_mille == 0 {
            return false;
        }
        let draw = crate::backend::fault::next_random(&mut s.rng) % 1000;
        draw < s.miss_per_mille
    }

    /// Performs the oldest held fetch (a pread on this thread); false if none is held.
    pub(crate) fn complete_next(&self) -> bool {
        let mut s = self.0.borrow_mut();
        let Some(fetch) = s.queued.pop_front() else {
            return false;
        };
        let done = fetch.perform();
        s.done.push_back(done);
        true
    }

    /// Fetches held, not completed yet.
    pub(crate) fn held(&self) -> usize {
        self.0.borrow().queued.len()
    }
}

/// A chunk kept for the reads that wait for it: its bytes, or the error its fetch met.
#[derive(Debug)]
struct Kept {
    segment: u64,
    pos: u64,
    result: Result<Bytes, Arc<io::Error>>,
}

/// The read side of a log (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Reads {
    kept: VecDeque<Kept>,
    /// (segment, position, length) of the outstanding fetches.
    in_flight: Vec<(u64, u64, usize)>,
    thread: Option<ReaderThread>,
    /// Test hook: every look at the page cache misses.
    force_misses: bool,
    /// The kernel or file system refused RWF_NOWAIT: every chunk is fetched.
    nowait_unsupported: bool,
}

/// Where a chunk came from.
#[derive(Debug)]
pub(crate) enum Chunk {
    /// In memory (the page cache, or a kept fetched chunk): its first bytes.
    Ready(Bytes),
    /// Being fetched (or waiting for room to be): try again after [`Reads::poll`].
    Pending,
}

impl Reads {
    pub(crate) fn set_force_misses(&mut self, on: bool) {
        self.force_misses = on;
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.in_flight.len()
    }

    /// The bytes of `segment` (`file`) from `pos`: up to `len`, at least `need` (a whole
    /// frame). `Ok(Some)` when in memory, `Ok(None)` when a fetch was started or is already
    /// on its way (or the fetch queue is full: a fetch arriving frees a place). `hits` counts
    /// chunks found in memory. `wake` makes the eventfd the reader thread notifies. `held`:
    /// the fault backend's reads (`Backend::held_reads`), which replace the page cache and
    /// the thread. Not kept here, so a log on a system backend stays `Send`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn chunk(
        &mut self,
        held: Option<&HeldReads>,
        segment: u64,
        file: &Arc<File>,
        pos: u64,
        len: usize,
        need: usize,
        wake: impl FnOnce() -> Result<EventFd, StorageError>,
    ) -> Result<Chunk, StorageError> {
        let need = need.max(1);
        if let Some(at) = self.kept.iter().position(|k| {
            k.segment == segment
                && k.pos <= pos
                && match &k.result {
                    Ok(bytes) => pos + need as u64 <= k.pos + bytes.len() as u64,
                    Err(_) => k.pos == pos,
                }
        }) {
            let kept = &self.kept[at];
            match &kept.result {
                Ok(bytes) => {
                    let from = usize::try_from(pos - kept.pos).unwrap_or(usize::MAX);
                    let end = bytes.len().min(from.saturating_add(len));
                    return Ok(Chunk::Ready(bytes.slice(from..end)));
                }
                Err(error) => {
                    // An error answers one read; a later read fetches again.
                    let error = StorageError::Io {
                        context: format!("read segment {segment} (reader thread)"),
                        source: Arc::clone(error),
                    };
                    self.kept.remove(at);
                    return Err(error);
                }
            }
        }
        let missed = match held {
            Some(held) => {
                if self.force_misses || held.misses() {
                    true
                } else {
                    // A hit, by the seed's decision: the model reads at once.
                    let mut buf = vec![0u8; len];
                    file.read_exact_at(&mut buf, pos)
                        .map_err(|e| StorageError::io(format!("read segment {segment}"), e))?;
                    return Ok(Chunk::Ready(Bytes::from(buf)));
                }
            }
            None if self.force_misses || self.nowait_unsupported => true,
            None => match probe_page_cache(file, pos, len, need) {
                Ok(Probe::Hit(bytes)) => return Ok(Chunk::Ready(bytes)),
                Ok(Probe::Miss) => true,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                    tracing::warn!(
                        error = %e,
                        "reads cannot check the page cache without blocking (RWF_NOWAIT); every catch-up chunk goes through the log reader thread"
                    );
                    self.nowait_unsupported = true;
                    true
                }
                Err(e) => return Err(StorageError::io(format!("read segment {segment}"), e)),
            },
        };
        debug_assert!(missed);
        let covered = self
            .in_flight
            .iter()
            .any(|&(s, p, l)| s == segment && p <= pos && pos + need as u64 <= p + l as u64);
        if covered || self.in_flight.len() >= FETCHES_IN_FLIGHT_MAX {
            return Ok(Chunk::Pending);
        }
        let fetch = Fetch {
            segment,
            file: Arc::clone(file),
            pos,
            len,
        };
        match held {
            Some(held) => held.0.borrow_mut().queued.push_back(fetch),
            None => {
                if self.thread.is_none() {
                    self.thread = Some(ReaderThread::spawn(wake()?)?);
                }
                let Some(sender) = self.thread.as_ref().and_then(|t| t.to_reader.as_ref()) else {
                    unreachable!("spawned above, sender dropped only on drop");
                };
                // Never full: the channel holds FETCHES_IN_FLIGHT_MAX, checked above.
                if sender.try_send(fetch).is_err() {
                    return Err(StorageError::io(
                        "log reader thread",
                        io::Error::other("the log reader thread is gone"),
                    ));
                }
            }
        }
        self.in_flight.push((segment, pos, len));
        Ok(Chunk::Pending)
    }

    /// Takes the completed fetches into the kept chunks; returns how many arrived.
    pub(crate) fn poll(&mut self, held: Option<&HeldReads>) -> usize {
        let mut arrived = Vec::new();
        match held {
            Some(held) => arrived.extend(held.0.borrow_mut().done.drain(..)),
            None => {
                let mut gone = false;
                if let Some(thread) = &self.thread {
                    // Bounded by the fetches in flight.
                    loop {
                        match thread.from_reader.try_recv() {
                            Ok(fetched) => arrived.push(fetched),
                            Err(TryRecvError::Empty) => break,
                            Err(TryRecvError::Disconnected) => {
                                gone = true;
                                break;
                            }
                        }
                    }
                }
                if gone {
                    // The thread died (a panic): what it had is answered with an error, and
                    // the next fetch starts a new thread.
                    self.thread = None;
                    for &(segment, pos, len) in &self.in_flight {
                        arrived.push(Fetched {
                            segment,
                            pos,
                            len,
                            result: Err(Arc::new(io::Error::other("the log reader thread died"))),
                        });
                    }
                }
            }
        }
        let count = arrived.len();
        for fetched in arrived {
            if let Some(at) = self
                .in_flight
                .iter()
                .position(|&(s, p, l)| (s, p, l) == (fetched.segment, fetched.pos, fetched.len))
            {
                self.in_flight.swap_remove(at);
            }
            self.kept.push_back(Kept {
                segment: fetched.segment,
                pos: fetched.pos,
                result: fetched.result,
            });
            while self.kept.len() > FETCHED_KEPT_MAX {
                self.kept.pop_front();
            }
        }
        count
    }
}
