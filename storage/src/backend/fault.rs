//! A fault-injecting backend for tests: it writes to the real segment files, remembers which
//! written bytes a *completed* fdatasync covered, and on a simulated power cut puts back the
//! previous contents of every byte that no completed fdatasync covered. It can also fail the
//! next fdatasync (e.g. EIO) or the next write (e.g. ENOSPC, after writing part of it), and
//! hold rounds until the test completes them, so group commit can be stepped by hand.
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
    /// (position, previous bytes) of every write since the file's last completed sync.
    undo: Vec<(u64, Vec<u8>)>,
}

#[derive(Debug, Default)]
struct FaultState {
    auto_complete: bool,
    submitted: VecDeque<RoundRequest>,
    completed: VecDeque<RoundCompletion>,
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
    fn perform(&mut self, round: RoundRequest) -> RoundCompletion {
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
            model.undo.push((pos, old));
            if let Err(e) = model.file.write_all_at(&bytes[..write_len], pos) {
                result = Err(RoundFailure::Write(e.raw_os_error().unwrap_or(libc::EIO)));
            }
        }
        if let Some(errno) = write_error {
            result = Err(RoundFailure::Write(errno));
        }
        let mut sync_latency = None;
        if result.is_ok() && round.sync {
            sync_latency = Some(SIM_SYNC_LATENCY);
            match self.next_sync_error.take() {
                // A failed fdatasync leaves the data not durable.
                Some(errno) => result = Err(RoundFailure::Sync(errno)),
                None => {
                    model.undo.clear();
                    self.syncs_completed += 1;
                }
            }
        }
        RoundCompletion {
            id: round.id,
            buf: round.buf,
            direct: round.direct.map(|d| d.buf),
            result,
            write_latency: SIM_WRITE_LATENCY,
            sync_latency,
        }
    }
}

impl Backend for FaultBackend {
    fn submit(&mut self, round: RoundRequest) -> Result<(), StorageError> {
        let mut s = self.state.borrow_mut();
        if s.powered_off {
            // The machine is off: the round never happens.
            return Ok(());
        }
        if s.auto_complete {
            let c = s.perform(round);
            s.completed.push_back(c);
            self.wake.notify();
        } else {
            s.submitted.push_back(round);
        }
        Ok(())
    }

    fn poll_completion(&mut self) -> Result<Option<RoundCompletion>, StorageError> {
        self.wake.drain();
        Ok(self.state.borrow_mut().completed.pop_front())
    }

    fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    fn name(&self) -> &'static str {
        "fault"
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
    /// Performs the oldest held round and makes its completion visible. False if none held.
    pub fn complete_next(&self) -> bool {
        let mut s = self.state.borrow_mut();
        let Some(round) = s.submitted.pop_front() else {
            return false;
        };
        let c = s.perform(round);
        s.completed.push_back(c);
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

    /// Read fetches held, not completed yet.
    pub fn held_fetches(&self) -> usize {
        self.reads.held()
    }

    /// Rounds submitted and held (manual mode).
    pub fn held_rounds(&self) -> usize {
        self.state.borrow().submitted.len()
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
            for (pos, old) in model.undo.drain(..).rev() {
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
