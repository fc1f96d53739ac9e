//! The portable backend: a writer thread doing pwrite and a syncer thread doing fdatasync
//! (FELIX_STORAGE_IO_URING=0, or where io_uring cannot be set up).

use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Backend, EventFd, ROUNDS_IN_FLIGHT_MAX, RoundCompletion, RoundFailure, RoundRequest};
use crate::StorageError;

/// A round whose write is done, on its way to the syncer.
struct Written {
    round: RoundRequest,
    result: Result<(), RoundFailure>,
    write_latency: Duration,
}

/// Two threads fed through bounded channels: the writer does a round's pwrite, then hands it
/// to the syncer for its fdatasync, so the next round's write runs during the previous
/// round's fdatasync (two rounds in flight). Completions come back in round order through a
/// third channel and the eventfd, which also fires when a write finishes
/// ([`Backend::writes_idle`]). The threads are not pinned: they sleep in the kernel for most
/// of a round, and the broker's core plan decides where housekeeping threads go.
#[derive(Debug)]
pub struct PwriteBackend {
    to_writer: Option<SyncSender<RoundRequest>>,
    from_syncer: Receiver<RoundCompletion>,
    wake: Arc<EventFd>,
    /// Rounds submitted whose write has not finished, plus finished rounds whose write
    /// failed and whose completion was not returned yet.
    writes_busy: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
}

impl PwriteBackend {
    pub fn new() -> Result<Self, StorageError> {
        let wake = Arc::new(EventFd::new()?);
        let writes_busy = Arc::new(AtomicUsize::new(0));
        let (to_writer, requests) = sync_channel::<RoundRequest>(ROUNDS_IN_FLIGHT_MAX);
        let (to_syncer, written) = sync_channel::<Written>(ROUNDS_IN_FLIGHT_MAX);
        let (done, from_syncer) = sync_channel::<RoundCompletion>(ROUNDS_IN_FLIGHT_MAX);
        let writer_wake = Arc::clone(&wake);
        let writer_busy = Arc::clone(&writes_busy);
        let writer = std::thread::Builder::new()
            .name("felix-log-writer".into())
            .spawn(move || writer_loop(requests, to_syncer, writer_wake, writer_busy))
            .map_err(|e| StorageError::io("spawn log writer thread", e))?;
        let syncer_wake = Arc::clone(&wake);
        let syncer = std::thread::Builder::new()
            .name("felix-log-syncer".into())
            .spawn(move || syncer_loop(written, done, syncer_wake))
            .map_err(|e| StorageError::io("spawn log syncer thread", e))?;
        Ok(PwriteBackend {
            to_writer: Some(to_writer),
            from_syncer,
            wake,
            writes_busy,
            threads: vec![writer, syncer],
        })
    }
}

fn writer_loop(
    requests: Receiver<RoundRequest>,
    to_syncer: SyncSender<Written>,
    wake: Arc<EventFd>,
    writes_busy: Arc<AtomicUsize>,
) {
    // Ends when the backend drops its sender; dropping `to_syncer` then ends the syncer.
    while let Ok(round) = requests.recv() {
        let started = Instant::now();
        let (target, bytes, pos) = round.target();
        let result = target
            .write_all_at(bytes, pos)
            .map_err(|e| RoundFailure::Write(e.raw_os_error().unwrap_or(libc::EIO)));
        let write_latency = started.elapsed();
        if result.is_ok() {
            // Release: the write happened before the log learns it may write the next round.
            writes_busy.fetch_sub(1, Ordering::Release);
            wake.notify();
        }
        let written = Written {
            round,
            result,
            write_latency,
        };
        if to_syncer.send(written).is_err() {
            return;
        }
    }
}

fn syncer_loop(written: Receiver<Written>, done: SyncSender<RoundCompletion>, wake: Arc<EventFd>) {
    while let Ok(Written {
        round,
        mut result,
        write_latency,
    }) = written.recv()
    {
        let mut sync_latency = None;
        if result.is_ok() && round.sync {
            let sync_started = Instant::now();
            result = round
                .file
                .sync_data()
                .map_err(|e| RoundFailure::Sync(e.raw_os_error().unwrap_or(libc::EIO)));
            sync_latency = Some(sync_started.elapsed());
        }
        let completion = RoundCompletion {
            id: round.id,
            buf: round.buf,
            direct: round.direct.map(|d| d.buf),
            result,
            write_latency,
            sync_latency,
        };
        if done.send(completion).is_err() {
            return;
        }
        wake.notify();
    }
}

impl Backend for PwriteBackend {
    fn submit(&mut self, round: RoundRequest) -> Result<(), StorageError> {
        let Some(tx) = &self.to_writer else {
            return Err(StorageError::io(
                "submit",
                std::io::Error::other("writer stopped"),
            ));
        };
        self.writes_busy.fetch_add(1, Ordering::AcqRel);
        // Never blocks: the log keeps at most ROUNDS_IN_FLIGHT_MAX rounds outstanding, which
        // is the channel's capacity.
        tx.try_send(round).map_err(|e| {
            StorageError::io(
                "submit round",
                std::io::Error::other(format!("writer thread: {e}")),
            )
        })
    }

    fn poll_completion(&mut self) -> Result<Option<RoundCompletion>, StorageError> {
        self.wake.drain();
        match self.from_syncer.try_recv() {
            Ok(c) => {
                if matches!(c.result, Err(RoundFailure::Write(_))) {
                    // Its write never counted as finished.
                    self.writes_busy.fetch_sub(1, Ordering::AcqRel);
                }
                Ok(Some(c))
            }
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(StorageError::io(
                "poll completion",
                std::io::Error::other("writer thread exited"),
            )),
        }
    }

    fn writes_idle(&self) -> bool {
        self.writes_busy.load(Ordering::Acquire) == 0
    }

    fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    fn name(&self) -> &'static str {
        "pwrite"
    }
}

impl Drop for PwriteBackend {
    fn drop(&mut self) {
        // Closing the channel ends the writer after the round in progress, which ends the
        // syncer after the rounds it holds; joining makes sure no write or fdatasync touches
        // a segment after the log is gone. Neither thread can block on a full channel: each
        // holds ROUNDS_IN_FLIGHT_MAX, the most rounds outstanding.
        self.to_writer = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
