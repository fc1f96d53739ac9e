//! The portable backend: a dedicated writer thread doing pwrite + fdatasync
//! (FELIX_STORAGE_IO_URING=0, or where io_uring cannot be set up).

use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use super::{Backend, EventFd, ROUNDS_IN_FLIGHT_MAX, RoundCompletion, RoundFailure, RoundRequest};
use crate::StorageError;

/// Writer thread fed through a bounded channel; completions come back through another
/// channel and the eventfd. The thread is not pinned: it sleeps in the kernel for most of a
/// round, and the broker's core plan decides where housekeeping threads go.
#[derive(Debug)]
pub struct PwriteBackend {
    to_writer: Option<SyncSender<RoundRequest>>,
    from_writer: Receiver<RoundCompletion>,
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl PwriteBackend {
    pub fn new() -> Result<Self, StorageError> {
        let wake = Arc::new(EventFd::new()?);
        let (to_writer, requests) = sync_channel::<RoundRequest>(ROUNDS_IN_FLIGHT_MAX);
        let (done, from_writer) = sync_channel::<RoundCompletion>(ROUNDS_IN_FLIGHT_MAX);
        let thread_wake = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name("felix-log-writer".into())
            .spawn(move || writer_loop(requests, done, thread_wake))
            .map_err(|e| StorageError::io("spawn log writer thread", e))?;
        Ok(PwriteBackend {
            to_writer: Some(to_writer),
            from_writer,
            wake,
            thread: Some(thread),
        })
    }
}

fn writer_loop(
    requests: Receiver<RoundRequest>,
    done: SyncSender<RoundCompletion>,
    wake: Arc<EventFd>,
) {
    // Ends when the backend drops its sender.
    while let Ok(round) = requests.recv() {
        let started = Instant::now();
        let (target, bytes, pos) = round.target();
        let mut result = target
            .write_all_at(bytes, pos)
            .map_err(|e| RoundFailure::Write(e.raw_os_error().unwrap_or(libc::EIO)));
        let write_latency = started.elapsed();
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
        match self.from_writer.try_recv() {
            Ok(c) => Ok(Some(c)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(StorageError::io(
                "poll completion",
                std::io::Error::other("writer thread exited"),
            )),
        }
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
        // Closing the channel ends the loop after the round in progress; joining makes sure
        // no write touches a segment after the log is gone. The writer cannot be blocked on
        // the completion channel: its capacity equals ROUNDS_IN_FLIGHT_MAX.
        self.to_writer = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
