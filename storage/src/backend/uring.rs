//! The io_uring backend: one ring per log; a round is a write linked (IO_LINK) with an
//! fdatasync; completions are reaped without blocking and announced through an eventfd
//! registered with the ring. Up to two rounds are in flight: the log submits the second once
//! the first one's write CQE is in ([`Backend::writes_idle`]; the eventfd fires for every
//! CQE, the write's included), so the second write runs during the first fdatasync.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, squeue, types};

use super::{Backend, EventFd, RoundCompletion, RoundFailure, RoundRequest};
use crate::StorageError;
use crate::direct::DIRECT_ALIGN;

/// Ring size: a round needs 2 entries (write + fdatasync) and at most
/// `ROUNDS_IN_FLIGHT_MAX` (2) rounds are in flight; 8 leaves room without wasting memory.
const RING_ENTRIES: u32 = 8;
/// Short writes continued before the round is failed with EIO. A buffered write to a
/// preallocated regular file is short only under memory pressure or signals; 64 continuations
/// without finishing means something is wrong.
const SHORT_WRITE_CONTINUATIONS_MAX: u32 = 64;
/// CQEs handled per `poll_completion` call (a round produces at most 2 per submission).
const REAPS_MAX: usize = 16;

/// A CQE's user data: the round's id shifted left by 2, or'ed with one of these tags.
const TAG_WRITE: u64 = 1;
const TAG_SYNC: u64 = 2;
const TAG_MASK: u64 = 3;

#[derive(Debug)]
struct InFlight {
    round: RoundRequest,
    /// Bytes of `round.buf` known written.
    written: usize,
    /// CQEs still expected for the current submission.
    outstanding: u32,
    /// Whether the current submission carries the fdatasync.
    sync_submitted: bool,
    continuations: u32,
    failure: Option<RoundFailure>,
    /// The write was short; resubmit the rest once the cancelled fsync CQE is in.
    resubmit: bool,
    started: Instant,
    write_latency: Option<Duration>,
}

impl InFlight {
    /// The whole write is in (a round without bytes has nothing to write).
    fn write_done(&self) -> bool {
        self.failure.is_none() && self.written == self.round.target().1.len()
    }

    /// Every CQE is in and nothing is left to resubmit.
    fn finished(&self) -> bool {
        self.outstanding == 0 && (!self.resubmit || self.failure.is_some())
    }
}

/// See the module docs.
pub struct UringBackend {
    ring: IoUring,
    wake: EventFd,
    /// Oldest first; at most `ROUNDS_IN_FLIGHT_MAX`.
    in_flight: VecDeque<InFlight>,
}

impl std::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBackend")
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl UringBackend {
    /// Sets up the ring and registers the eventfd. Fails where io_uring is not permitted.
    pub fn new() -> Result<Self, StorageError> {
        let ring = IoUring::new(RING_ENTRIES).map_err(|e| StorageError::io("io_uring setup", e))?;
        let wake = EventFd::new()?;
        ring.submitter()
            .register_eventfd(wake.as_fd().as_raw_fd())
            .map_err(|e| StorageError::io("io_uring register eventfd", e))?;
        Ok(UringBackend {
            ring,
            wake,
            in_flight: VecDeque::with_capacity(super::ROUNDS_IN_FLIGHT_MAX),
        })
    }

    /// Queues the rest of in-flight round `at`'s write (linked with the fsync when asked) or,
    /// when everything is written, the fsync alone.
    fn push_current(&mut self, at: usize) -> Result<(), StorageError> {
        let Some(f) = self.in_flight.get_mut(at) else {
            return Ok(());
        };
        let id_bits = f.round.id << 2;
        let fd = types::Fd(f.round.file.as_raw_fd());
        let (target, bytes, pos) = f.round.target();
        let target = types::Fd(target.as_raw_fd());
        let rest = &bytes[f.written..];
        let mut entries = Vec::with_capacity(2);
        // A lone direct round: the write is made durable by the device itself (RWF_DSYNC: a
        // FUA write, or the block layer's flush after it), no fdatasync behind it. That saves
        // the hop through an io-wq worker that every fdatasync takes (docs/design/durable.md,
        // "Lone rounds written with RWF_DSYNC").
        let dsync =
            f.round.sync && f.round.sync_by_write && f.round.direct.is_some() && !rest.is_empty();
        if !rest.is_empty() {
            // A u32 length: rounds are bounded far below 4 GiB (LogConfig::max_round_bytes).
            let len = u32::try_from(rest.len())
                .map_err(|_| StorageError::Config("round above 4 GiB".into()))?;
            let mut write = opcode::Write::new(target, rest.as_ptr(), len)
                .offset(pos + f.written as u64)
                .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                .build()
                .user_data(id_bits | TAG_WRITE);
            if f.round.sync && !dsync {
                write = write.flags(squeue::Flags::IO_LINK);
            }
            entries.push(write);
        }
        if f.round.sync && !dsync {
            entries.push(
                opcode::Fsync::new(fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build()
                    .user_data(id_bits | TAG_SYNC),
            );
        }
        f.outstanding = entries.len() as u32;
        f.sync_submitted = f.round.sync;
        if rest.is_empty() {
            f.write_latency.get_or_insert(f.started.elapsed());
        }
        // SAFETY: the entries point into `f.round.buf` (or the staged direct buffer) and use
        // `f.round.file`'s fd (and the direct file's). All are owned by `self.in_flight` (the
        // buffers' heap memory does not move with it) and none is resized or dropped until every CQE
        // of this submission has been reaped (`outstanding` reaches 0); Drop waits for that.
        unsafe {
            self.ring
                .submission()
                .push_multiple(&entries)
                .map_err(|_| {
                    StorageError::io(
                        "io_uring push",
                        std::io::Error::other("submission queue full"),
                    )
                })?;
        }
        self.ring
            .submit()
            .map_err(|e| StorageError::io("io_uring submit", e))?;
        Ok(())
    }

    fn handle_cqe(&mut self, user_data: u64, res: i32) {
        let id = user_data >> 2;
        let Some(f) = self.in_flight.iter_mut().find(|f| f.round.id == id) else {
            return;
        };
        f.outstanding = f.outstanding.saturating_sub(1);
        match user_data & TAG_MASK {
            TAG_WRITE => {
                let total = f.round.target().1.len();
                let want = total - f.written;
                if res < 0 {
                    f.failure = Some(RoundFailure::Write(-res));
                } else if res == 0 {
                    // No progress and no error: give up rather than spin.
                    f.failure = Some(RoundFailure::Write(libc::EIO));
                } else {
                    f.written += (res as usize).min(want);
                    if f.written < total {
                        f.continuations += 1;
                        let direct = f.round.direct.is_some();
                        if f.continuations > SHORT_WRITE_CONTINUATIONS_MAX
                            || (direct && !f.written.is_multiple_of(DIRECT_ALIGN))
                        {
                            // A direct write can only continue from a block boundary.
                            f.failure = Some(RoundFailure::Write(libc::EIO));
                        } else {
                            f.resubmit = true;
                        }
                    } else {
                        f.write_latency = Some(f.started.elapsed());
                    }
                }
            }
            // -ECANCELED means the linked write was short or failed; handled via the write's CQE.
            TAG_SYNC if res < 0 && res != -libc::ECANCELED && f.failure.is_none() => {
                f.failure = Some(RoundFailure::Sync(-res));
            }
            _ => {}
        }
    }
}

impl Backend for UringBackend {
    fn submit(&mut self, round: RoundRequest) -> Result<(), StorageError> {
        assert!(
            self.in_flight.len() < super::ROUNDS_IN_FLIGHT_MAX,
            "at most ROUNDS_IN_FLIGHT_MAX rounds in flight"
        );
        assert!(
            self.writes_idle(),
            "a round is submitted only after the previous writes finished"
        );
        self.in_flight.push_back(InFlight {
            round,
            written: 0,
            outstanding: 0,
            sync_submitted: false,
            continuations: 0,
            failure: None,
            resubmit: false,
            started: Instant::now(),
            write_latency: None,
        });
        let at = self.in_flight.len() - 1;
        let empty = self
            .in_flight
            .back()
            .is_some_and(|f| f.round.target().1.is_empty() && !f.round.sync);
        if empty {
            // Nothing to do: complete at the next poll.
            self.wake.notify();
            return Ok(());
        }
        self.push_current(at)
    }

    fn poll_completion(&mut self) -> Result<Option<RoundCompletion>, StorageError> {
        self.wake.drain();
        let mut cqes = [(0u64, 0i32); REAPS_MAX];
        let mut n = 0;
        for cqe in self.ring.completion() {
            cqes[n] = (cqe.user_data(), cqe.result());
            n += 1;
            if n == REAPS_MAX {
                // More remain: make sure the caller is woken again for them.
                self.wake.notify();
                break;
            }
        }
        for &(tag, res) in &cqes[..n] {
            self.handle_cqe(tag, res);
        }
        // Short writes continue once their round's CQEs are all in. Bounded by the rounds
        // in flight.
        for at in 0..self.in_flight.len() {
            let f = &mut self.in_flight[at];
            if f.outstanding == 0 && f.resubmit && f.failure.is_none() {
                f.resubmit = false;
                self.push_current(at)?;
            }
        }
        let Some(at) = self.in_flight.iter().position(InFlight::finished) else {
            return Ok(None);
        };
        let Some(f) = self.in_flight.remove(at) else {
            return Ok(None);
        };
        if self.in_flight.iter().any(InFlight::finished) {
            // One completion per call: make sure the caller comes back for the other.
            self.wake.notify();
        }
        let result = match f.failure {
            Some(failure) => Err(failure),
            None => Ok(()),
        };
        let write_latency = f.write_latency.unwrap_or_else(|| f.started.elapsed());
        Ok(Some(RoundCompletion {
            id: f.round.id,
            buf: f.round.buf,
            direct: f.round.direct.map(|d| d.buf),
            result,
            write_latency,
            // The write and the fdatasync are linked in the kernel and their CQEs are usually
            // reaped together, so the fsync sample is the whole round (submission to reaped
            // completion); the buffered write part is a page-cache copy and small next to it.
            sync_latency: (f.sync_submitted && f.failure.is_none()).then(|| f.started.elapsed()),
        }))
    }

    fn writes_idle(&self) -> bool {
        self.in_flight.iter().all(InFlight::write_done)
    }

    fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    fn name(&self) -> &'static str {
        "io_uring"
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        // The kernel may still read the in-flight buffers: wait for their CQEs before the
        // buffers and the files are freed. Bounded by the ops outstanding (at most 2 per
        // round in flight).
        while self.in_flight.iter().any(|f| f.outstanding > 0) {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                // Cannot tell when the kernel is done with the buffer: leak it rather than
                // free memory the kernel may still read.
                std::mem::forget(std::mem::take(&mut self.in_flight));
                break;
            }
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (tag, res) in done {
                self.handle_cqe(tag, res);
            }
        }
    }
}
