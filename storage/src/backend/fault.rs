//! A fault-injecting backend for tests: it writes to the real segment files, remembers which
//! written bytes a *completed* fdatasync covered, and on a simulated power cut puts back the
//! previous contents of every byte that no completed fdatasync covered. It can also fail the
//! next fdatasync (e.g. EIO) or the next write (e.g. ENOSPC, after writing part of it), and
//! hold rounds until the test completes them, so group commit can be stepped by hand.
//!
//! Two rounds in flight: a held round's write can be performed alone
//! ([`FaultHandle::write_next`]), after which the log may submit the next round, whose write
//! then happens while the first round's fdatasync is outstanding. An fdatasync covers only
//! the writes performed before it started, and it starts right after its own round's write
//! (the write and the fdatasync are linked, as in `uring.rs`): so round N's fdatasync never
//! makes round N+1's bytes durable, while N+1's fdatasync covers N's. Writes are always
//! performed in submission order; completions may be made visible out of order
//! ([`FaultHandle::complete_newest`]).
//!
//! Single-threaded by design (`Rc`): the log and the test's [`FaultHandle`] live on one thread,
//! like a per-core log.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use super::{AheadMode, Backend, EventFd, RoundCompletion, RoundFailure, RoundRequest};
use crate::StorageError;
use crate::reader::HeldReads;

/// Simulated write time reported in completions (no real clock in the model).
const SIM_WRITE_LATENCY: Duration = Duration::from_micros(20);
/// Simulated fdatasync time (docs/design/machine.md, Disk: ~110-125 us on this disk class).
const SIM_SYNC_LATENCY: Duration = Duration::from_micros(120);
/// Granularity at which a torn power cut keeps or loses unsynced bytes: a disk sector.
const SECTOR_BYTES: u64 = 512;

/// What a power cut does to bytes no completed fdatasync covered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerCut {
    /// Every such byte reverts to its last synced content.
    DropUnsynced,
    /// Each 512-byte sector of such bytes independently keeps the new content or reverts
    /// (seeded), like a disk that wrote back some dirty pages before the cut.
    TearUnsynced { seed: u64 },
}

#[derive(Debug)]
struct FileModel {
    file: Arc<File>,
    /// (write number, position, previous bytes) of every write no completed sync covers,
    /// oldest first.
    undo: Vec<(u64, u64, Vec<u8>)>,
}

/// A round the test has not completed yet.
#[derive(Debug)]
struct Held {
    round: RoundRequest,
    /// Set once its write was performed (successfully): the number of the last write its
    /// fdatasync covers (writes are numbered from 1 in the order performed).
    sync_covers: Option<u64>,
}

#[derive(Debug, Default)]
struct FaultState {
    auto_complete: bool,
    /// Held rounds complete when the log blocks waiting for one ([`FaultHandle::hold_rounds`]).
    complete_on_wait: bool,
    /// Report every write finished as soon as it is submitted (see
    /// [`FaultHandle::report_writes_early`]).
    writes_early: bool,
    submitted: VecDeque<Held>,
    completed: VecDeque<RoundCompletion>,
    /// Writes performed so far.
    writes: u64,
    files: HashMap<u64, FileModel>,
    next_write_error: Option<(i32, usize)>,
    next_sync_error: Option<i32>,
    powered_off: bool,
    syncs_completed: u64,
}

/// The backend half, owned by the log.
#[derive(Debug)]
pub struct FaultBackend {
    state: Rc<RefCell<FaultState>>,
    wake: Rc<EventFd>,
    reads: HeldReads,
}

/// The test's half: inject faults, complete rounds, cut the power.
#[derive(Debug, Clone)]
pub struct FaultHandle {
    state: Rc<RefCell<FaultState>>,
    wake: Rc<EventFd>,
    reads: HeldReads,
}

impl FaultBackend {
    /// `auto_complete`: perform each round as soon as it is submitted (it still completes
    /// through `poll_completion`); otherwise rounds wait for [`FaultHandle::complete_next`].
    pub fn new(auto_complete: bool) -> Result<(FaultBackend, FaultHandle), StorageError> {
        let state = Rc::new(RefCell::new(FaultState {
            auto_complete,
            ..FaultState::default()
        }));
        let wake = Rc::new(EventFd::new()?);
        let reads = HeldReads::default();
        Ok((
            FaultBackend {
                state: Rc::clone(&state),
                wake: Rc::clone(&wake),
                reads: reads.clone(),
            },
            FaultHandle { state, wake, reads },
        ))
    }
}

fn read_old(file: &File, pos: u64, len: usize) -> Vec<u8> {
    let mut old = vec![0u8; len];
    // Bytes past the end of the file read as zeros, which is what they were.
    let mut at = 0;
    while at < len {
        match file.read_at(&mut old[at..], pos + at as u64) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    old
}

impl FaultState {
    /// Performs a round's write. `Ok` carries the number of the last write performed (what
    /// an fdatasync starting now covers).
    fn perform_write(&mut self, round: &RoundRequest) -> Result<u64, RoundFailure> {
        let model = self
            .files
            .entry(round.segment)
            .or_insert_with(|| FileModel {
                file: Arc::clone(&round.file),
                undo: Vec::new(),
            });
        // A direct round is modelled by its staged bytes (whole blocks, the tail block's
        // prefix rewritten), written through the ordinary file: the model's undo then covers
        // exactly what a direct write would have changed.
        let (_, bytes, pos) = round.target();
        // An injected write error waits for a round that actually writes.
        let injected = if bytes.is_empty() {
            None
        } else {
            self.next_write_error.take()
        };
        let (write_len, write_error) = match injected {
            Some((errno, written)) => (written.min(bytes.len()), Some(errno)),
            None => (bytes.len(), None),
        };
        let mut result = Ok(());
        if write_len > 0 {
            let old = read_old(&model.file, pos, write_len);
            self.writes += 1;
            model.undo.push((self.writes, pos, old));
            if let Err(e) = model.file.write_all_at(&bytes[..write_len], pos) {
                result = Err(RoundFailure::Write(e.raw_os_error().unwrap_or(libc::EIO)));
            }
        }
        if let Some(errno) = write_error {
            result = Err(RoundFailure::Write(errno));
        }
        result.map(|()| self.writes)
    }

    /// Runs a written round's fdatasync (when it has one), covering the writes up to
    /// `covers`, and builds its completion.
    fn perform_sync(&mut self, round: RoundRequest, covers: u64) -> RoundCompletion {
        let mut result = Ok(());
        let mut sync_latency = None;
        if round.sync {
            sync_latency = Some(SIM_SYNC_LATENCY);
            match self.next_sync_error.take() {
                // A failed fdatasync leaves the data not durable.
                Some(errno) => result = Err(RoundFailure::Sync(errno)),
                None => {
                    if let Some(model) = self.files.get_mut(&round.segment) {
                        model.undo.retain(|(n, _, _)| *n > covers);
                    }
                    self.syncs_completed += 1;
                }
            }
        }
        Self::completion(round, result, sync_latency)
    }

    fn completion(
        round: RoundRequest,
        result: Result<(), RoundFailure>,
        sync_latency: Option<Duration>,
    ) -> RoundCompletion {
        RoundCompletion {
            id: round.id,
            buf: round.buf,
            direct: round.direct.map(|d| d.buf),
            result,
            write_latency: SIM_WRITE_LATENCY,
            sync_latency,
        }
    }

    /// Performs the write of the oldest held round not written yet; a failed write
    /// completes its round at once (its fdatasync never runs). False when every held round
    /// is written.
    fn write_next(&mut self) -> bool {
        let Some(at) = self.submitted.iter().position(|h| h.sync_covers.is_none()) else {
            return false;
        };
        let Some(mut held) = self.submitted.remove(at) else {
            unreachable!("found above");
        };
        match self.perform_write(&held.round) {
            Ok(covers) => {
                held.sync_covers = Some(covers);
                self.submitted.insert(at, held);
            }
            Err(failure) => {
                let c = Self::completion(held.round, Err(failure), None);
                self.completed.push_back(c);
            }
        }
        true
    }

    /// Completes held round `at`: performs the writes up to it (in order), then its
    /// fdatasync. False when there is no such round.
    fn complete_at(&mut self, at: usize) -> bool {
        if at >= self.submitted.len() {
            return false;
        }
        let id = self.submitted[at].round.id;
        // Writes go in submission order: every held round up to this one is written first.
        // Bounded by the held rounds; each pass writes one or completes a failed one.
        loop {
            let target = self.submitted.iter().position(|h| h.round.id == id);
            let unwritten = self.submitted.iter().position(|h| h.sync_covers.is_none());
            match (target, unwritten) {
                (Some(t), Some(u)) if u <= t => {
                    self.write_next();
                }
                _ => break,
            }
        }
        // The round itself may have failed its write (completed above).
        let Some(at) = self.submitted.iter().position(|h| h.round.id == id) else {
            return true;
        };
        let Some(held) = self.submitted.remove(at) else {
            unreachable!("found above");
        };
        let Some(covers) = held.sync_covers else {
            unreachable!("written above");
        };
        let c = self.perform_sync(held.round, covers);
        self.completed.push_back(c);
        true
    }
}

impl Backend for FaultBackend {
    fn submit(&mut self, round: RoundRequest) -> Result<(), StorageError> {
        let mut s = self.state.borrow_mut();
        if s.powered_off {
            // The machine is off: the round never happens.
            return Ok(());
        }
        s.submitted.push_back(Held {
            round,
            sync_covers: None,
        });
        if s.auto_complete {
            let at = s.submitted.len() - 1;
            s.complete_at(at);
            self.wake.notify();
        }
        Ok(())
    }

    fn poll_completion(&mut self) -> Result<Option<RoundCompletion>, StorageError> {
        self.wake.drain();
        Ok(self.state.borrow_mut().completed.pop_front())
    }

    fn writes_idle(&self) -> bool {
        let s = self.state.borrow();
        s.writes_early
            || (s.submitted.iter().all(|h| h.sync_covers.is_some())
                && !s
                    .completed
                    .iter()
                    .any(|c| matches!(c.result, Err(RoundFailure::Write(_)))))
    }

    fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    fn name(&self) -> &'static str {
        "fault"
    }

    fn before_wait(&mut self) {
        let mut s = self.state.borrow_mut();
        if !s.complete_on_wait || s.powered_off {
            return;
        }
        let mut completed = false;
        while s.complete_at(0) {
            completed = true;
        }
        drop(s);
        if completed {
            self.wake.notify();
        }
    }

    fn ahead_mode(&self) -> AheadMode {
        // The model is single-threaded and deterministic: blanks are made when asked.
        AheadMode::Inline
    }

    fn held_reads(&self) -> Option<HeldReads> {
        Some(self.reads.clone())
    }
}

/// splitmix64: a tiny seeded generator, enough to pick torn sectors reproducibly.
pub(crate) fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl FaultHandle {
    /// From now on, completes every round as soon as it is submitted (`true`, as
    /// `FaultBackend::new(true)`) or holds it for the test (`false`). Rounds already held
    /// stay held.
    pub fn set_auto_complete(&self, on: bool) {
        self.state.borrow_mut().auto_complete = on;
    }

    /// From now on, holds every round for the test ([`FaultHandle::complete_next`] and the
    /// like), except when the log blocks its thread waiting for one (opening a group, a
    /// generation switch, a clean close): then every held round completes first, as the disk
    /// would while its caller waits. A simulation so keeps writes in flight across its steps
    /// without deadlocking the log's blocking paths. `false`: completes each round at once.
    pub fn hold_rounds(&self, on: bool) {
        let mut s = self.state.borrow_mut();
        s.auto_complete = !on;
        s.complete_on_wait = on;
    }

    /// Performs the oldest held round (its write, if not performed yet, then its
    /// fdatasync) and makes its completion visible. False if none held.
    pub fn complete_next(&self) -> bool {
        let done = self.state.borrow_mut().complete_at(0);
        if done {
            self.wake.notify();
        }
        done
    }

    /// Performs the newest held round (the writes of the rounds before it first, in order)
    /// and makes its completion visible, ahead of the older rounds' completions. False if
    /// none held.
    pub fn complete_newest(&self) -> bool {
        let mut s = self.state.borrow_mut();
        let Some(at) = s.submitted.len().checked_sub(1) else {
            return false;
        };
        s.complete_at(at);
        drop(s);
        self.wake.notify();
        true
    }

    /// From now on `per_mille` of the log's looks at the page cache miss (drawn from `seed`):
    /// those reads answer `ReadOutcome::Pending` and fetch their chunk, held until
    /// [`FaultHandle::complete_next_fetch`]. 0 (the default): every look hits.
    pub fn set_read_misses(&self, per_mille: u64, seed: u64) {
        self.reads.set_misses(per_mille, seed);
    }

    /// Performs the oldest held read fetch and wakes the log (`Log::poll_reads` then takes
    /// it). False if none is held.
    pub fn complete_next_fetch(&self) -> bool {
        let done = self.reads.complete_next();
        if done {
            self.wake.notify();
        }
        done
    }

    /// Performs the write of the oldest held round not written yet, leaving its fdatasync
    /// outstanding (a failed write completes the round at once). The log may then submit
    /// another round. False if every held round is written.
    pub fn write_next(&self) -> bool {
        let done = self.state.borrow_mut().write_next();
        if done {
            self.wake.notify();
        }
        done
    }

    /// Read fetches held, not completed yet.
    pub fn held_fetches(&self) -> usize {
        self.reads.held()
    }

    /// Rounds submitted and held (manual mode).
    pub fn held_rounds(&self) -> usize {
        self.state.borrow().submitted.len()
    }

    /// Held rounds whose write was not performed yet (manual mode).
    pub fn unwritten_rounds(&self) -> usize {
        self.state
            .borrow()
            .submitted
            .iter()
            .filter(|h| h.sync_covers.is_none())
            .count()
    }

    /// When set, the backend tells the log every write is finished as soon as it is
    /// submitted, before performing it (the writes still happen in order when the test
    /// performs them). No real backend does this; it lets a test fail the write of the first
    /// of two rounds in flight, which the log must handle without relying on the
    /// backend's ordering (the second round is rejected too).
    pub fn report_writes_early(&self, early: bool) {
        self.state.borrow_mut().writes_early = early;
    }

    /// The next fdatasync fails with `errno`.
    pub fn fail_next_sync(&self, errno: i32) {
        self.state.borrow_mut().next_sync_error = Some(errno);
    }

    /// The next write fails with `errno` after writing its first `bytes_written` bytes.
    pub fn fail_next_write(&self, errno: i32, bytes_written: usize) {
        self.state.borrow_mut().next_write_error = Some((errno, bytes_written));
    }

    /// fdatasyncs completed so far.
    pub fn syncs_completed(&self) -> u64 {
        self.state.borrow().syncs_completed
    }

    /// Cuts the power: held rounds are dropped, and bytes not covered by a completed
    /// fdatasync revert (all of them, or torn per sector). The backend accepts nothing after.
    pub fn power_cut(&self, how: PowerCut) -> Result<(), StorageError> {
        let mut s = self.state.borrow_mut();
        s.powered_off = true;
        s.submitted.clear();
        s.completed.clear();
        let mut rng = match how {
            PowerCut::DropUnsynced => 0,
            PowerCut::TearUnsynced { seed } => seed,
        };
        for model in s.files.values_mut() {
            // Newest first, so overlapping writes restore the oldest unsynced content last.
            for (_, pos, old) in model.undo.drain(..).rev() {
                let end = pos + old.len() as u64;
                let mut at = pos;
                while at < end {
                    let sector_end = ((at / SECTOR_BYTES) + 1) * SECTOR_BYTES;
                    let piece_end = sector_end.min(end);
                    let revert = match how {
                        PowerCut::DropUnsynced => true,
                        PowerCut::TearUnsynced { .. } => next_random(&mut rng).is_multiple_of(2),
                    };
                    if revert {
                        let from = (at - pos) as usize;
                        let to = (piece_end - pos) as usize;
                        model.file.write_all_at(&old[from..to], at).map_err(|e| {
                            StorageError::io("power cut: restore unsynced bytes", e)
                        })?;
                    }
                    at = piece_end;
                }
            }
        }
        Ok(())
    }
}
