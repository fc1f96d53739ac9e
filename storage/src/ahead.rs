//! File work of a roll done off the log's thread: the next segment's file, made ahead of
//! time, and the closing segment's sidecar index.
//!
//! Starting a segment blocks for a few ms, most of it preallocating the file
//! (`segment::make_blank`: ~1.3-1.8 ms for 1 GiB here), then the closing segment's sidecar
//! (a file of up to a few hundred KiB, fsynced and renamed: ~0.5-1 ms), then the header,
//! an fsync, the rename and the directory's fsync (~0.4-0.6 ms; docs/design/durable.md
//! "Segments made ahead"). A log that did all of it when it rolled would stall every publisher
//! of its core once per segment. So once the active segment is half full, the log asks for the
//! next segment's blank file (`<seq>.log.tmp`, preallocated and fsynced) and a helper thread
//! makes it; at the roll the helper also writes the closing segment's sidecar, and the log's
//! thread only finishes the blank (`segment::finish_blank`).
//!
//! What is on disk stays what recovery already handles: a blank is a `.tmp` file, deleted by
//! the next recovery if the log never used it; a segment appears under its real name only
//! complete; a sidecar is optional (recovery scans a closed segment without one, and checks
//! one it has against the segment), and one written for a segment deleted meanwhile is an
//! orphan recovery removes.
//!
//! Ordering: the helper runs jobs one at a time in the order given. Before the log writes or
//! removes a sidecar itself (releasing deleted streams' segments, a corrupt read), it waits
//! for the jobs given so far ([`Ahead::settle`]), so an older sidecar never lands after it.
//!
//! Threads: [`Ahead`] lives on the log's thread; with [`AheadMode::Thread`] it owns one
//! helper thread (`felix-log-ahead`, started with the first job, joined on drop after the jobs
//! given so far). [`AheadMode::Inline`] does each job on the calling thread when given, for the
//! deterministic simulation (the fault backend).

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use crate::StorageError;
use crate::segment::{self, Blank};
use crate::sidecar::{self, Sidecar};

/// Jobs queued for the helper at most: the blank asked for, the sidecar of the roll, and room
/// for a blank asked again after a roll that did not use the previous one. A job that does not
/// fit is done on the log's thread.
const JOBS_QUEUED_MAX: usize = 4;

/// How a log does its file work ([`crate::Backend::ahead_mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AheadMode {
    /// On a helper thread (the system backends).
    Thread,
    /// On the calling thread, when given (the fault backend: the simulation stays
    /// deterministic and still takes the roll path that uses a blank).
    Inline,
}

enum Job {
    Blank { seq: u64, size: u64 },
    Sidecar(Box<Sidecar>),
}

enum Done {
    Blank(u64, Result<Blank, StorageError>),
    Sidecar(u64, Result<(), StorageError>),
}

struct Helper {
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

/// See the module docs.
pub(crate) struct Ahead {
    dir: PathBuf,
    mode: AheadMode,
    helper: Option<Helper>,
    /// Jobs given to the helper whose result has not been collected.
    outstanding: usize,
    /// The segment whose blank was asked for and not yet taken (made or being made).
    requested: Option<u64>,
    /// The last segment asked for, kept after a failed request so it is not asked again.
    asked: Option<u64>,
    /// A blank made and not yet taken.
    ready: Option<Blank>,
    /// Sidecars written since the log last collected the count ([`Self::sidecars_written`]).
    sidecars_written: u64,
}

impl std::fmt::Debug for Ahead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ahead")
            .field("mode", &self.mode)
            .field("outstanding", &self.outstanding)
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
            outstanding: 0,
            requested: None,
            asked: None,
            ready: None,
            sidecars_written: 0,
        }
    }

    /// The segment whose blank was asked for and not taken yet (made or being made).
    pub(crate) fn requested(&self) -> Option<u64> {
        self.requested
    }

    /// Sidecars written since the last call (the log adds them to its counters).
    pub(crate) fn sidecars_written(&mut self) -> u64 {
        std::mem::take(&mut self.sidecars_written)
    }

    /// Asks for the blank of segment `seq` (`size` bytes), once per segment. A blank asked
    /// for before and not taken (the log moved on without it) is removed when it comes. Never
    /// blocks in `Thread` mode; a blank that cannot be made is logged and the roll makes the
    /// segment itself.
    pub(crate) fn request(&mut self, seq: u64, size: u64) {
        if self.asked == Some(seq) {
            return;
        }
        self.asked = Some(seq);
        self.requested = Some(seq);
        if let Some(old) = self.ready.take() {
            remove(old);
        }
        match self.mode {
            AheadMode::Inline => {
                let made = segment::make_blank(&self.dir, seq, size);
                self.collect(Done::Blank(seq, made));
            }
            AheadMode::Thread => {
                if let Err(Job::Blank { .. }) = self.give(Job::Blank { seq, size }) {
                    // No helper, or its queue full: the roll makes the segment itself.
                    self.requested = None;
                }
            }
        }
    }

    /// Writes the sidecar of a closed segment: on the helper thread (in order after the jobs
    /// given before), else here. Not fatal either way (see the module docs).
    pub(crate) fn write_sidecar(&mut self, sidecar: Sidecar) {
        let sidecar = match self.mode {
            AheadMode::Inline => Err(Job::Sidecar(Box::new(sidecar))),
            AheadMode::Thread => self.give(Job::Sidecar(Box::new(sidecar))),
        };
        if let Err(Job::Sidecar(sidecar)) = sidecar {
            let seq = sidecar.seq;
            let written =
                sidecar::write(&self.dir, &sidecar).and_then(|()| segment::sync_dir(&self.dir));
            self.collect(Done::Sidecar(seq, written));
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
        while self.requested == Some(seq)
            && self.ready.is_none()
            && self.outstanding > 0
            && self.receive_one(true)
        {}
        self.requested = None;
        let blank = self.ready.take()?;
        if blank.tmp == self.dir.join(format!("{}.tmp", segment::file_name(seq))) {
            Some(blank)
        } else {
            remove(blank);
            None
        }
    }

    /// Collects what the helper finished, without waiting.
    pub(crate) fn poll(&mut self) {
        while self.outstanding > 0 && self.receive_one(false) {}
    }

    /// Waits until every job given so far is done (before the log touches a sidecar itself).
    pub(crate) fn settle(&mut self) {
        while self.outstanding > 0 && self.receive_one(true) {}
    }

    /// Gives `job` to the helper (started on first use); the job back when it cannot.
    fn give(&mut self, job: Job) -> Result<(), Job> {
        if self.helper.is_none() {
            self.helper = self.spawn();
        }
        let Some(jobs) = self.helper.as_ref().and_then(|h| h.jobs.as_ref()) else {
            return Err(job);
        };
        match jobs.try_send(job) {
            Ok(()) => {
                self.outstanding += 1;
                Ok(())
            }
            Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => Err(job),
        }
    }

    /// Collects one result of the helper; false when there is none (now, or ever: the helper
    /// is gone).
    fn receive_one(&mut self, wait: bool) -> bool {
        let Some(helper) = &self.helper else {
            self.outstanding = 0;
            return false;
        };
        let done = if wait {
            helper.done.recv().ok()
        } else {
            helper.done.try_recv().ok()
        };
        match done {
            Some(done) => {
                self.outstanding = self.outstanding.saturating_sub(1);
                self.collect(done);
                true
            }
            None => {
                if wait {
                    // The helper ended (a panic): nothing more will come.
                    self.outstanding = 0;
                }
                false
            }
        }
    }

    fn collect(&mut self, done: Done) {
        match done {
            Done::Blank(seq, Ok(blank)) if self.requested == Some(seq) => {
                if let Some(old) = self.ready.replace(blank) {
                    remove(old);
                }
            }
            Done::Blank(_, Ok(blank)) => remove(blank),
            Done::Blank(seq, Err(error)) => {
                if self.requested == Some(seq) {
                    self.requested = None;
                }
                tracing::warn!(seq, error = %crate::ErrorChain(&error), "cannot make the next segment ahead; it is made when needed");
            }
            Done::Sidecar(_, Ok(())) => self.sidecars_written += 1,
            Done::Sidecar(seq, Err(error)) => {
                tracing::warn!(seq, error = %crate::ErrorChain(&error), "cannot write a sidecar index; recovery will scan the segment");
            }
        }
    }

    fn spawn(&self) -> Option<Helper> {
        let (jobs, incoming) = sync_channel::<Job>(JOBS_QUEUED_MAX);
        // Room for every job's result: the helper never blocks on a log that is busy.
        let (finished, done) = sync_channel::<Done>(JOBS_QUEUED_MAX + 1);
        let dir = self.dir.clone();
        let spawned = std::thread::Builder::new()
            .name("felix-log-ahead".into())
            .spawn(move || {
                // Ends when the log drops the sender (after the jobs queued before).
                while let Ok(job) = incoming.recv() {
                    let done = match job {
                        Job::Blank { seq, size } => {
                            Done::Blank(seq, segment::make_blank(&dir, seq, size))
                        }
                        // The directory's fsync makes the sidecar's rename durable.
                        Job::Sidecar(sidecar) => Done::Sidecar(
                            sidecar.seq,
                            sidecar::write(&dir, &sidecar).and_then(|()| segment::sync_dir(&dir)),
                        ),
                    };
                    if finished.send(done).is_err() {
                        return;
                    }
                }
            });
        match spawned {
            Ok(thread) => Some(Helper {
                jobs: Some(jobs),
                done,
                thread: Some(thread),
            }),
            Err(error) => {
                tracing::warn!(%error, "cannot start the thread for the log's file work; the log does it on its own thread");
                None
            }
        }
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        self.requested = None;
        self.settle();
        if let Some(blank) = self.ready.take() {
            remove(blank);
        }
        if let Some(mut helper) = self.helper.take() {
            helper.jobs = None;
            if let Some(thread) = helper.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// Removes an unused blank (best effort: the next recovery removes stray `.tmp` files).
fn remove(blank: Blank) {
    let _ = std::fs::remove_file(&blank.tmp);
}
