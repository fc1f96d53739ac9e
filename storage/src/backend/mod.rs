//! The IO side of group commit: a [`Backend`] performs rounds (a write at the segment's
//! tail, optionally linked with an fdatasync) off the calling thread and reports completion.
//!
//! Contract, relied on by [`crate::Log`]:
//! - at most [`ROUNDS_IN_FLIGHT_MAX`] rounds are submitted and not yet returned by
//!   [`Backend::poll_completion`], and a round is submitted while another is outstanding only
//!   when [`Backend::writes_idle`] said every outstanding round's write had finished (so two
//!   writes never race, e.g. on the tail block a direct round rewrites);
//! - completions may come back in any order (the log applies them in round order);
//! - the write covers `buf` entirely at `file_pos` (short writes are continued by the backend)
//!   and the fdatasync, when `sync` is set, starts only after the write succeeded;
//! - [`Backend::poll_completion`] never blocks;
//! - [`Backend::wake_fd`] is a non-blocking eventfd that becomes readable when a completion
//!   may be ready. A caller clears its readiness (e.g. tokio `AsyncFd` guard `clear_ready`)
//!   *before* calling `poll_completion`, which drains the eventfd first and then reaps, so no
//!   wake-up is lost.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

pub use crate::ahead::AheadMode;
use crate::direct::{AlignedBuf, DirectWrite};
use crate::{BackendChoice, StorageError};

pub mod fault;
pub mod pwrite;
pub mod uring;

pub use fault::{FaultBackend, FaultHandle, PowerCut};
pub use pwrite::PwriteBackend;
pub use uring::UringBackend;

/// Rounds in flight at once (`LogConfig::rounds_in_flight`). Two: the write of round N+1
/// runs during the fdatasync of round N. A round's write still finishes before the next
/// round's write at the following position starts ([`Backend::writes_idle`]), which keeps
/// the tail contiguous and recovery simple; appends made meanwhile coalesce into the next
/// round (group commit).
pub const ROUNDS_IN_FLIGHT_MAX: usize = 2;

/// One round for the backend.
#[derive(Debug)]
pub struct RoundRequest {
    /// Identifies the round in its completion.
    pub id: u64,
    /// The segment's sequence number (for errors and the fault model).
    pub segment: u64,
    /// The segment file; the backend holds this clone until the round completes, so the fd
    /// stays open while the kernel uses it.
    pub file: Arc<File>,
    /// Where `buf` goes in the file.
    pub file_pos: u64,
    /// The bytes to write (may be empty for a sync-only round).
    pub buf: Vec<u8>,
    /// Run an fdatasync of `file` after the write.
    pub sync: bool,
    /// The same bytes staged for a direct write (`crate::direct`): when set, the backend
    /// writes `direct.buf` at `direct.pos` through `direct.file` instead of `buf` at
    /// `file_pos` (it covers `buf`'s range, widened to whole blocks); the fdatasync still
    /// goes to `file`.
    pub direct: Option<DirectWrite>,
    /// With `sync` and `direct`: the backend may make the write itself durable (RWF_DSYNC)
    /// instead of following it with an fdatasync. The log sets it only for a round nothing
    /// else waits behind, on_commit (see `Log::submit`); a backend may ignore it and run the
    /// fdatasync.
    pub sync_by_write: bool,
}

impl RoundRequest {
    /// What the backend writes: (the file, the bytes, where).
    #[must_use]
    pub fn target(&self) -> (&File, &[u8], u64) {
        match &self.direct {
            Some(d) => (&d.file, d.buf.as_slice(), d.pos),
            None => (&self.file, &self.buf, self.file_pos),
        }
    }
}

/// Why a round failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundFailure {
    /// The write failed with this errno (the sync, if any, did not run).
    Write(i32),
    /// The write succeeded but the fdatasync failed with this errno.
    Sync(i32),
}

/// A finished round.
#[derive(Debug)]
pub struct RoundCompletion {
    pub id: u64,
    /// The round's buffer, handed back for reuse.
    pub buf: Vec<u8>,
    /// The staged direct buffer, if the round had one, handed back for reuse.
    pub direct: Option<AlignedBuf>,
    pub result: Result<(), RoundFailure>,
    /// Time of the write part, as measured by the backend.
    pub write_latency: Duration,
    /// Time of the fdatasync, when one ran.
    pub sync_latency: Option<Duration>,
}

/// A group-commit IO provider, chosen at compile time (a generic parameter, no dynamic
/// dispatch on the hot path).
pub trait Backend {
    /// Starts a round. Must not block on the disk.
    fn submit(&mut self, round: RoundRequest) -> Result<(), StorageError>;
    /// Returns a finished round, if any, without blocking. With two rounds outstanding the
    /// later one may come back first.
    fn poll_completion(&mut self) -> Result<Option<RoundCompletion>, StorageError>;
    /// True when every outstanding round's write has finished successfully (only fdatasyncs
    /// may still run): the log may then submit the next round at the following position.
    /// It tells what the backend knew at the last [`Backend::poll_completion`] (which reaps);
    /// the wake fd fires when a write finishes, so a caller waiting on it learns of it. A
    /// backend that does one round at a time says true only when nothing is outstanding.
    fn writes_idle(&self) -> bool;
    /// An eventfd that becomes readable when a completion may be ready.
    fn wake_fd(&self) -> BorrowedFd<'_>;
    /// Short name for logs and benchmarks.
    fn name(&self) -> &'static str;
    /// How the log makes its next segment's file ahead of time (`ahead.rs`): on a helper
    /// thread, unless the backend is the deterministic model.
    fn ahead_mode(&self) -> AheadMode {
        AheadMode::Thread
    }

    /// Reads stepped by this backend instead of the page cache and the log's reader thread
    /// (`reader.rs`): the fault backend's, so tests and the simulation decide when a read
    /// misses and when its fetch completes. `None` (the default): real reads.
    fn held_reads(&self) -> Option<crate::reader::HeldReads> {
        None
    }

    /// The log is about to block its thread until a round completes ([`crate::Log::flush`]).
    /// A real disk goes on by itself; the fault backend's held rounds complete here when the
    /// test asked for it (`FaultHandle::hold_rounds`), as a disk would while its caller
    /// waits. Default: nothing.
    fn before_wait(&mut self) {}
}

/// A non-blocking eventfd.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> Result<Self, StorageError> {
        // SAFETY: eventfd has no memory arguments; a non-negative return is a new fd we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(StorageError::io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds one to the counter, waking a waiter.
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd. It can only fail with
        // EAGAIN when the counter is at its maximum, which still leaves the fd readable.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter (non-blocking; EAGAIN when already zero is fine).
    pub fn drain(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking eventfd.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.as_fd()
    }

    /// A second handle on the eventfd behind `fd` (a `dup`): notifying it wakes whoever
    /// waits on `fd`. The log's reader thread wakes the core through the backend's eventfd
    /// this way (`reader.rs`).
    pub fn duplicate(fd: BorrowedFd<'_>) -> Result<Self, StorageError> {
        fd.try_clone_to_owned()
            .map(EventFd)
            .map_err(|e| StorageError::io("dup the log's eventfd", e))
    }
}

/// Blocks until `fd` is readable or `timeout` passes. For shutdown and tests only.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> Result<(), StorageError> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd on the stack, count 1.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(StorageError::io("poll wake fd", e));
        }
    }
    Ok(())
}

/// The production backend chosen at start-up: io_uring where it works, else pwrite.
/// An enum rather than `dyn Backend` so the hot path stays statically dispatched.
#[derive(Debug)]
pub enum SystemBackend {
    /// Boxed: the ring handle is several hundred bytes, the pwrite handle a few words.
    Uring(Box<UringBackend>),
    Pwrite(PwriteBackend),
}

impl SystemBackend {
    /// Opens the chosen backend; `IoUring` falls back to pwrite with a `warn` log line when
    /// the ring cannot be set up (old kernel, seccomp, io_uring_disabled).
    pub fn open(choice: BackendChoice) -> Result<Self, StorageError> {
        match choice {
            BackendChoice::IoUring => match UringBackend::new() {
                Ok(b) => Ok(SystemBackend::Uring(Box::new(b))),
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring unavailable, falling back to the pwrite writer thread");
                    Ok(SystemBackend::Pwrite(PwriteBackend::new()?))
                }
            },
            BackendChoice::Pwrite => Ok(SystemBackend::Pwrite(PwriteBackend::new()?)),
        }
    }
}

impl Backend for SystemBackend {
    fn submit(&mut self, round: RoundRequest) -> Result<(), StorageError> {
        match self {
            SystemBackend::Uring(b) => b.submit(round),
            SystemBackend::Pwrite(b) => b.submit(round),
        }
    }
    fn poll_completion(&mut self) -> Result<Option<RoundCompletion>, StorageError> {
        match self {
            SystemBackend::Uring(b) => b.poll_completion(),
            SystemBackend::Pwrite(b) => b.poll_completion(),
        }
    }
    fn writes_idle(&self) -> bool {
        match self {
            SystemBackend::Uring(b) => b.writes_idle(),
            SystemBackend::Pwrite(b) => b.writes_idle(),
        }
    }
    fn wake_fd(&self) -> BorrowedFd<'_> {
        match self {
            SystemBackend::Uring(b) => b.wake_fd(),
            SystemBackend::Pwrite(b) => b.wake_fd(),
        }
    }
    fn name(&self) -> &'static str {
        match self {
            SystemBackend::Uring(b) => b.name(),
            SystemBackend::Pwrite(b) => b.name(),
        }
    }
}
