//! The next segment's file, made ahead of time off the log's thread.
//!
//! Creating a segment blocks for a few ms, most of it preallocating the file
//! (`segment::make_blank`: ~2.5-3.6 ms for 1 GiB here against ~0.5-0.9 ms for the rest,
//! docs/design/durable.md "Segments made ahead"). A log that made its segments when it
//! rolled would stall every publisher of its core for that long once per segment. So once
//! the active segment is half full, the log asks for the next segment's blank file
//! (`<seq>.log.tmp`, preallocated and fsynced) and a helper thread makes it; at the roll the
//! log's thread only writes the header, fsyncs, renames and fsyncs the directory
//! (`segment::finish_blank`).
//!
//! What is on disk stays what recovery already handles: a blank is a `.tmp` file, deleted by
//! the next recovery if the log never used it, and a segment appears under its real name
//! only complete, as before.
//!
//! Threads: [`Ahead`] lives on the log's thread; with [`AheadMode::Thread`] it owns one
//! helper thread (`felix-log-ahead`, started with the first request, ended and joined on
//! drop) that runs one job at a time. [`AheadMode::Inline`] makes the blank on the calling
//! thread when asked, for the deterministic simulation (the fault backend).

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use crate::StorageError;
use crate::segment::{self, Blank};

/// How a log makes its next segment's file ahead of time ([`crate::Backend::ahead_mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AheadMode {
    /// On a helper thread (the system backends).
    Thread,
    /// On the calling thread, at the request (the fault backend: the simulation stays
    /// deterministic and still takes the roll path that uses a blank).
    Inline,
}

struct Job {
    seq: u64,
    size: u64,
}

type Made = (u64, Result<Blank, StorageError>);

struct Helper {
    jobs: Option<SyncSender<Job>>,
    made: Receiver<Made>,
    thread: Option<JoinHandle<()>>,
}

/// See the module docs.
pub(crate) struct Ahead {
    dir: PathBuf,
    mode: AheadMode,
    helper: Option<Helper>,
    /// The segment whose blank was asked for and not yet taken (made or being made).
    requested: Option<u64>,
    /// The last segment asked for, kept after a failed request so it is not asked again.
    asked: Option<u64>,
    /// A blank made and not yet taken.
    ready: Option<Blank>,
}

impl std::fmt::Debug for Ahead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ahead")
            .field("mode", &self.mode)
            .field("requested", &self.requested)
            .field("ready", &self.ready.as_ref().map(|b| &b.tmp))
            .finish()
    }
}

impl Ahead {
    pub(crate) fn new(dir: PathBuf, mode: AheadMode) -> Self {
        Ahead {
            dir,
            mode,
            helper: None,
            requested: None,
            asked: None,
            ready: None,
        }
    }

    /// The segment whose blank was asked for and not taken yet (made or being made).
    pub(crate) fn requested(&self) -> Option<u64> {
        self.requested
    }

    /// Asks for the blank of segment `seq` (`size` bytes), once per segment. A request for
    /// another segment first drops the blank asked for before (the log moved on without
    /// it). Never blocks in `Thread` mode beyond collecting that earlier blank; a blank
    /// that cannot be made is logged and the roll makes the segment itself.
    pub(crate) fn request(&mut self, seq: u64, size: u64) {
        if self.asked == Some(seq) {
            return;
        }
        self.discard();
        self.asked = Some(seq);
        self.requested = Some(seq);
        match self.mode {
            AheadMode::Inline => match segment::make_blank(&self.dir, seq, size) {
                Ok(blank) => self.ready = Some(blank),
                Err(error) => {
                    tracing::warn!(seq, error = %crate::ErrorChain(&error), "cannot make the next segment ahead; it is made when needed");
                }
            },
            AheadMode::Thread => {
                if self.helper.is_none() {
                    self.helper = self.spawn();
                }
                let sent = self
                    .helper
                    .as_ref()
                    .and_then(|h| h.jobs.as_ref())
                    .is_some_and(|jobs| jobs.try_send(Job { seq, size }).is_ok());
                if !sent {
                    // No helper (spawn failed) or its queue full: the roll makes the segment.
                    self.requested = None;
                }
            }
        }
    }

    /// The blank of segment `seq` if one was asked for: waits for it if the helper is still
    /// making it (it started earlier, so this never takes longer than making it here).
    /// `None` when none was asked for `seq` or making it failed: the caller makes the
    /// segment itself.
    pub(crate) fn take(&mut self, seq: u64) -> Option<Blank> {
        if self.requested != Some(seq) {
            return None;
        }
        self.requested = None;
        if self.mode == AheadMode::Thread {
            self.receive(Some(seq));
        }
        let blank = self.ready.take()?;
        if blank.tmp == self.dir.join(format!("{}.tmp", segment::file_name(seq))) {
            Some(blank)
        } else {
            remove(blank);
            None
        }
    }

    /// Collects what the helper made: every finished job, and (with `wait_for`) blocks until
    /// the job for that segment is done. Blanks for other segments are removed.
    fn receive(&mut self, wait_for: Option<u64>) {
        let Some(helper) = &self.helper else {
            return;
        };
        loop {
            let made = match wait_for {
                Some(_) => helper.made.recv().ok(),
                None => helper.made.try_recv().ok(),
            };
            let Some((seq, result)) = made else {
                return;
            };
            match result {
                Ok(blank) if Some(seq) == wait_for || Some(seq) == self.requested => {
                    if let Some(old) = self.ready.replace(blank) {
                        remove(old);
                    }
                }
                Ok(blank) => remove(blank),
                Err(error) => {
                    tracing::warn!(seq, error = %crate::ErrorChain(&error), "cannot make the next segment ahead; it is made when needed");
                }
            }
            if wait_for == Some(seq) {
                return;
            }
        }
    }

    /// Drops the blank asked for before, if any (its file is removed).
    fn discard(&mut self) {
        if let Some(seq) = self.requested.take()
            && self.mode == AheadMode::Thread
        {
            self.receive(Some(seq));
        }
        if let Some(blank) = self.ready.take() {
            remove(blank);
        }
    }

    fn spawn(&self) -> Option<Helper> {
        let (jobs, incoming) = sync_channel::<Job>(1);
        let (done, made) = sync_channel::<Made>(2);
        let dir = self.dir.clone();
        let spawned = std::thread::Builder::new()
            .name("felix-log-ahead".into())
            .spawn(move || {
                // Ends when the log drops the sender.
                while let Ok(job) = incoming.recv() {
                    let result = segment::make_blank(&dir, job.seq, job.size);
                    if done.send((job.seq, result)).is_err() {
                        return;
                    }
                }
            });
        match spawned {
            Ok(thread) => Some(Helper {
                jobs: Some(jobs),
                made,
                thread: Some(thread),
            }),
            Err(error) => {
                tracing::warn!(%error, "cannot start the thread that makes segments ahead; segments are made when needed");
                None
            }
        }
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        self.discard();
        if let Some(mut helper) = self.helper.take() {
            // The thread ends once its job queue is closed; whatever it made and nobody took
            // (none: the discard waited for the one asked for) is removed.
            helper.jobs = None;
            if let Some(thread) = helper.thread.take() {
                let _ = thread.join();
            }
            while let Ok((_, made)) = helper.made.try_recv() {
                if let Ok(blank) = made {
                    remove(blank);
                }
            }
        }
    }
}

/// Removes an unused blank (best effort: the next recovery removes stray `.tmp` files).
fn remove(blank: Blank) {
    let _ = std::fs::remove_file(&blank.tmp);
}
