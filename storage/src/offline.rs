//! Offline commands on one log directory, run with the broker stopped and the directory's
//! lock held ([`DirLock`]; a running broker holds it, so they refuse to run next to one):
//!
//! - [`check`]: reads every segment in full (sidecars are not trusted, they are compared),
//!   and reports per segment what recovery and `repair` would see: damage (position, reason,
//!   attributed offsets), a torn tail, the sidecar's state, and the offset ranges that
//!   `repair` would quarantine. Changes nothing.
//! - [`repair`]: quarantines the damage `check` finds so the log can open again without
//!   reusing an offset: the lost offset ranges go to the `quarantine` file (written first),
//!   then each damaged segment is rewritten without its damaged bytes (every readable record
//!   kept at its offset), a missing segment gets an empty placeholder, a damaged header is
//!   rebuilt; finally the log is opened once to verify it and rebuild the sidecars.
//! - [`compact`]: drops the records of deleted streams (shards `live` rejects): their ids go
//!   to the `released` file (written first), closed segments without a live record are
//!   deleted or cut to their header, the others are rewritten with the live records only
//!   (offsets unchanged); the log is reopened to verify it and rebuild the sidecars.
//!
//! The rules are in `docs/storage-format.md` (Corruption and repair; Deleting streams).
//! Threads: the caller's (the `felix log` CLI's main thread, or a test).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::frame::{self, HEADER_BYTES};
use crate::quarantine::{Quarantine, QuarantineRange, Released};
use crate::recovery::{RecoveryReport, TAIL_COUNT_WINDOW_BYTES};
use crate::scan::{self, Frame, MARK_SEARCH_WINDOW_BYTES, RESYNC_WINDOW_BYTES, Stop};
use crate::segment::{self, SEGMENT_FIXED_HEADER_BYTES, SEGMENT_HEADER_BYTES_MAX};
use crate::sidecar;
use crate::{
    DirLock, FsyncMode, Log, LogConfig, PwriteBackend, SEGMENT_BYTES_MIN, ShardRange, StorageError,
};

/// Bytes buffered before each write of a rewritten segment: 4 MiB, large sequential writes.
const REWRITE_BUFFER_BYTES: usize = 4 << 20;

/// A configuration that opens any log offline: the smallest segment size, so recovery never
/// grows a file the broker sized (a cut tail keeps the file's own length), and the default
/// index interval, which the broker uses too (sidecars written offline stay valid for it).
pub fn offline_config(dir: &Path) -> LogConfig {
    let mut config = LogConfig::new(dir);
    config.segment_bytes = SEGMENT_BYTES_MIN;
    config.max_round_bytes = (SEGMENT_BYTES_MIN / 2) as usize;
    config.max_pending_bytes = config.max_round_bytes;
    config.fsync = FsyncMode::OnCommit;
    config
}

/// The state of a segment's sidecar index, as `check` finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SidecarStatus {
    /// The active segment has none (it is still written).
    Active,
    Missing,
    /// It matches what the scan found.
    Matches,
    /// It is valid but describes something else (recovery would scan and rewrite it).
    Stale(String),
    /// It cannot be read.
    Bad(String),
}

/// Damaged bytes inside committed data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    pub segment: u64,
    /// First damaged byte and where the next valid frame starts (or the damaged bytes end).
    pub position: u64,
    pub end: u64,
    pub reason: String,
    /// Offsets the damaged records' own headers name (the rest is found from the gaps).
    pub attributed: Vec<ShardRange>,
}

/// One segment as `check` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentStatus {
    pub seq: u64,
    pub file: PathBuf,
    /// Missing from the sequence (a placeholder is created by `repair`).
    pub missing: bool,
    pub file_bytes: u64,
    /// Why the header is invalid, if it is.
    pub header_error: Option<String>,
    /// Valid records found (released shards' included).
    pub records: u64,
    /// Records of released shards (dropped by `compact`).
    pub released_records: u64,
    /// Valid records repeating offsets already seen (left by damage; `repair` drops them).
    pub stale_records: u64,
    /// End of the last valid frame.
    pub data_end: u64,
    pub sidecar: SidecarStatus,
    pub damage: Vec<Damage>,
    /// The active segment's torn tail (cut silently by recovery): where it starts.
    pub torn_tail: Option<u64>,
}

impl SegmentStatus {
    /// Needs `repair` (damage, stale records, a bad header or a missing file).
    pub fn needs_repair(&self) -> bool {
        self.missing
            || self.header_error.is_some()
            || !self.damage.is_empty()
            || self.stale_records > 0
    }
}

/// What `check` found in one log directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    pub dir: PathBuf,
    pub segments: Vec<SegmentStatus>,
    /// Offset ranges lost to the damage found, which `repair` would quarantine.
    pub lost: Vec<QuarantineRange>,
    /// Offsets already quarantined by earlier repairs.
    pub quarantined_before: u64,
    pub released_shards: usize,
}

impl CheckReport {
    /// True when recovery would open the log without an error.
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty() && !self.segments.iter().any(SegmentStatus::needs_repair)
    }
}

/// What `repair` did.
#[derive(Debug, Clone)]
pub struct RepairReport {
    /// What was found (before the repair).
    pub check: CheckReport,
    /// Ranges added to the quarantine.
    pub quarantined: Vec<QuarantineRange>,
    /// Segments rewritten without their damaged bytes, and placeholders created.
    pub rewritten: Vec<u64>,
    pub placeholders: Vec<u64>,
    /// The recovery that verified the repaired log.
    pub recovery: Option<RecoveryReport>,
}

/// What `compact` did.
#[derive(Debug, Clone, Default)]
pub struct CompactReport {
    /// Shards released by this run (their records dropped).
    pub released: Vec<u32>,
    pub rewritten: Vec<u64>,
    /// Closed segments without a live record: deleted, or cut to their header.
    pub emptied: Vec<u64>,
    pub records_dropped: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// The recovery that verified the compacted log.
    pub recovery: Option<RecoveryReport>,
}

/// How a segment must be rewritten.
#[derive(Debug, Clone, Default)]
struct Plan {
    seq: u64,
    missing: bool,
    rewrite: bool,
    /// Checkpoint of a placeholder or rebuilt header (else the header's own).
    checkpoint: Option<Vec<(u32, u64)>>,
    data_start: u64,
    /// Byte ranges to leave out (damage, stale records), ascending.
    drop_spans: Vec<(u64, u64)>,
    /// Where the kept data ends (a torn tail of the active segment), if before the end.
    cut_at: Option<u64>,
}

struct Survey {
    report: CheckReport,
    plans: Vec<Plan>,
}

/// Segment sequence numbers in `dir`, ascending.
fn segment_seqs(dir: &Path) -> Result<Vec<u64>, StorageError> {
    let mut seqs = Vec::new();
    for entry in
        fs::read_dir(dir).map_err(|e| StorageError::io(format!("list {}", dir.display()), e))?
    {
        let entry = entry.map_err(|e| StorageError::io(format!("list {}", dir.display()), e))?;
        if let Some(seq) = entry
            .file_name()
            .to_str()
            .and_then(segment::parse_file_name)
        {
            seqs.push(seq);
        }
    }
    seqs.sort_unstable();
    Ok(seqs)
}

fn open_rw(path: &Path) -> Result<(File, u64), StorageError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| StorageError::io(format!("open {}", path.display()), e))?;
    let len = file
        .metadata()
        .map_err(|e| StorageError::io(format!("stat {}", path.display()), e))?
        .len();
    Ok((file, len))
}

/// Reads every segment of the locked directory; changes nothing.
pub fn check(lock: &DirLock) -> Result<CheckReport, StorageError> {
    survey(lock.dir()).map(|s| s.report)
}

fn survey(dir: &Path) -> Result<Survey, StorageError> {
    let quarantine = Quarantine::load(dir)?;
    let released = Released::load(dir)?;
    let seqs = segment_seqs(dir)?;
    // Shards any header's checkpoint or any sidecar names: the resynchronisation after damage
    // trusts their records of any size.
    let mut known: HashSet<u32> = HashSet::new();
    for &seq in &seqs {
        let path = dir.join(segment::file_name(seq));
        let (file, len) = open_rw(&path)?;
        if let Ok(h) = segment::read_header(&file, len) {
            known.extend(h.checkpoint.iter().map(|(s, _)| *s));
        }
        if let Ok(Some(sc)) = sidecar::read(dir, seq) {
            known.extend(sc.shards.iter().map(|s| s.shard));
        }
    }
    let mut st = SurveyState {
        dir: dir.to_owned(),
        quarantine,
        released,
        known,
        expected: HashMap::new(),
        last_seen: HashMap::new(),
        lost: Vec::new(),
        tail_damage: Vec::new(),
        first_seen: HashMap::new(),
        claims: Vec::new(),
        damage_spans: Vec::new(),
    };
    let mut report = CheckReport {
        dir: dir.to_owned(),
        segments: Vec::new(),
        lost: Vec::new(),
        quarantined_before: st.quarantine.total_offsets(),
        released_shards: st.released.len(),
    };
    let mut plans = Vec::new();
    let mut buf = Vec::with_capacity(scan::SCAN_CHUNK_BYTES);
    let mut previous: Option<u64> = None;
    for (i, &seq) in seqs.iter().enumerate() {
        if let Some(prev) = previous {
            for missing in prev + 1..seq {
                let checkpoint = st.checkpoint_now();
                report.segments.push(SegmentStatus {
                    seq: missing,
                    file: dir.join(segment::file_name(missing)),
                    missing: true,
                    file_bytes: 0,
                    header_error: None,
                    records: 0,
                    released_records: 0,
                    stale_records: 0,
                    data_end: 0,
                    sidecar: SidecarStatus::Missing,
                    damage: Vec::new(),
                    torn_tail: None,
                });
                plans.push(Plan {
                    seq: missing,
                    missing: true,
                    checkpoint: Some(checkpoint),
                    ..Plan::default()
                });
            }
        }
        previous = Some(seq);
        let (status, plan) = st.segment(seq, i + 1 == seqs.len(), &mut buf)?;
        report.segments.push(status);
        plans.push(plan);
    }
    st.settle_claims();
    st.settle_tail_damage();
    report.lost = st.lost;
    Ok(Survey { report, plans })
}

/// Damage in the active segment: where, and what its headers name.
struct TailDamage {
    seq: u64,
    position: u64,
    end: u64,
    /// Attributed `(shard, offset)` pairs, and whether the lenient walk covered the span.
    pairs: Vec<(u32, u64)>,
    covered: bool,
}

struct SurveyState {
    dir: PathBuf,
    quarantine: Quarantine,
    released: Released,
    known: HashSet<u32>,
    /// Next offset of each shard (quarantined ranges skipped).
    expected: HashMap<u32, u64>,
    /// Where each shard's last valid record is: (segment, position).
    last_seen: HashMap<u32, (u64, u64)>,
    lost: Vec<QuarantineRange>,
    /// Damage in the active segment.
    tail_damage: Vec<TailDamage>,
    /// Where each shard no offset was expected for was first seen: (offset, segment, position).
    first_seen: HashMap<u32, (u64, u64, u64)>,
    /// Damaged headers naming a shard no offset was expected for (a shard whose first
    /// records were damaged): (shard, offset, segment, position, span bytes, in the active
    /// segment).
    claims: Vec<(u32, u64, u64, u64, u64, bool)>,
    /// Every damaged span: (segment, position, most offsets it could hold).
    damage_spans: Vec<(u64, u64, u64)>,
}

impl SurveyState {
    fn checkpoint_now(&self) -> Vec<(u32, u64)> {
        let mut cp: Vec<(u32, u64)> = self.expected.iter().map(|(s, n)| (*s, *n)).collect();
        cp.sort_unstable();
        cp
    }

    fn expected_of(&self, shard: u32) -> Option<u64> {
        self.expected
            .get(&shard)
            .map(|e| self.quarantine.skip(shard, *e))
    }

    fn lose(&mut self, shard: u32, first: u64, end: u64, segment: u64, position: u64) {
        if first < end {
            self.lost.push(QuarantineRange {
                shard,
                first,
                end,
                segment,
                position,
            });
        }
    }

    fn segment(
        &mut self,
        seq: u64,
        newest: bool,
        buf: &mut Vec<u8>,
    ) -> Result<(SegmentStatus, Plan), StorageError> {
        let path = self.dir.join(segment::file_name(seq));
        let (file, len) = open_rw(&path)?;
        let mut status = SegmentStatus {
            seq,
            file: path.clone(),
            missing: false,
            file_bytes: len,
            header_error: None,
            records: 0,
            released_records: 0,
            stale_records: 0,
            data_end: 0,
            sidecar: SidecarStatus::Missing,
            damage: Vec::new(),
            torn_tail: None,
        };
        let mut plan = Plan {
            seq,
            ..Plan::default()
        };
        let header = segment::read_header(&file, len);
        let header_crc = header.as_ref().ok().map(|h| h.crc);
        match header {
            Ok(h) if h.seq == seq => {
                for (shard, next) in &h.checkpoint {
                    if self.released.contains(*shard) {
                        continue;
                    }
                    match self.expected_of(*shard) {
                        Some(e) if *next > e => {
                            self.lose(*shard, e, *next, seq, 0);
                            self.expected.insert(*shard, *next);
                        }
                        Some(_) => {}
                        None => {
                            self.expected.insert(*shard, *next);
                        }
                    }
                }
                plan.data_start = h.header_bytes;
            }
            other => {
                let why = match other {
                    Ok(h) => format!("the header names segment {}", h.seq),
                    Err(why) => why,
                };
                status.header_error = Some(why.clone());
                plan.rewrite = true;
                plan.checkpoint = Some(self.checkpoint_now());
                let from = SEGMENT_FIXED_HEADER_BYTES as u64;
                let limit = len.min(SEGMENT_HEADER_BYTES_MAX as u64 + RESYNC_WINDOW_BYTES);
                let known = |s: u32| self.known.contains(&s);
                let first = scan::resync(&file, from, limit, len, &known)?.unwrap_or(len);
                plan.data_start = first;
                status.damage.push(Damage {
                    segment: seq,
                    position: 0,
                    end: first,
                    reason: format!("invalid segment header: {why}"),
                    attributed: Vec::new(),
                });
            }
        }
        let mut pos = plan.data_start;
        let mut mark_claim = 0u64;
        // Bounded: every pass scans forward from `pos` and either ends the segment or moves
        // `pos` past damage to a later valid frame.
        loop {
            let (end, stop) = self.scan_from(
                &file,
                seq,
                pos,
                len,
                buf,
                &mut status,
                &mut plan,
                &mut mark_claim,
            )?;
            status.data_end = status.data_end.max(end);
            let bad = match stop {
                Stop::Bad(reason) => Some(reason),
                Stop::End if !newest => {
                    // A closed segment ends at its first zero header, unless valid frames
                    // follow (a zeroed region inside committed data).
                    let known = |s: u32| self.known.contains(&s);
                    let limit = len.min(end.saturating_add(RESYNC_WINDOW_BYTES));
                    scan::resync(&file, end, limit, len, &known)?
                        .map(|_| "zeros inside committed data".to_string())
                }
                Stop::End => {
                    let window = len.min(end.saturating_add(TAIL_COUNT_WINDOW_BYTES));
                    (scan::nonzero_end(&file, end, window)? > end)
                        .then(|| "data after a zero gap".to_string())
                }
            };
            let Some(reason) = bad else { break };
            if newest {
                let search_end = len.min(end.saturating_add(MARK_SEARCH_WINDOW_BYTES));
                let claim = mark_claim.max(scan::max_mark_claim(&file, end, search_end)?);
                if claim <= end {
                    status.torn_tail = Some(end);
                    plan.cut_at = Some(end);
                    break;
                }
            }
            let known = |s: u32| self.known.contains(&s);
            let limit = len.min(end.saturating_add(RESYNC_WINDOW_BYTES));
            let next = scan::resync(&file, end + 1, limit, len, &known)?;
            let span_end = match next {
                Some(q) => q,
                None => scan::nonzero_end(&file, end, limit)?.max(end + 1),
            };
            let expected: HashMap<u32, u64> = self
                .expected
                .keys()
                .filter_map(|s| Some((*s, self.expected_of(*s)?)))
                .collect();
            let (pairs, covered) = scan::attribute_span(&file, end, span_end, &expected)?;
            if let Some(h) = read_header_at(&file, end)
                && !expected.contains_key(&h.shard)
                && !self.released.contains(h.shard)
            {
                self.claims
                    .push((h.shard, h.offset, seq, end, span_end - end, newest));
            }
            status.damage.push(Damage {
                segment: seq,
                position: end,
                end: span_end,
                reason,
                attributed: scan::attributed_ranges(&pairs, &expected),
            });
            plan.rewrite = true;
            plan.drop_spans.push((end, span_end));
            self.damage_spans
                .push((seq, end, (span_end - end).div_ceil(HEADER_BYTES as u64)));
            if newest {
                self.tail_damage.push(TailDamage {
                    seq,
                    position: end,
                    end: span_end,
                    pairs,
                    covered,
                });
            }
            match next {
                Some(q) => pos = q,
                None => break,
            }
        }
        status.sidecar = if newest {
            SidecarStatus::Active
        } else {
            match sidecar::read(&self.dir, seq) {
                Ok(None) => SidecarStatus::Missing,
                Err(why) => SidecarStatus::Bad(why),
                Ok(Some(sc)) if Some(sc.header_crc) != header_crc || sc.seq != seq => {
                    SidecarStatus::Stale("written for another incarnation of the segment".into())
                }
                Ok(Some(sc)) if sc.data_end != status.data_end => SidecarStatus::Stale(format!(
                    "data end {} where the scan found {}",
                    sc.data_end, status.data_end
                )),
                Ok(Some(sc))
                    if sc.shards.iter().map(|s| s.records).sum::<u64>()
                        != status.records - status.stale_records =>
                {
                    SidecarStatus::Stale("record counts differ".into())
                }
                Ok(Some(_)) => SidecarStatus::Matches,
            }
        };
        Ok((status, plan))
    }

    /// Scans valid frames from `pos`, applying the offset rules; returns where they end and
    /// why the scan stopped.
    #[allow(clippy::too_many_arguments)] // the survey's per-segment state, one caller
    fn scan_from(
        &mut self,
        file: &File,
        seq: u64,
        pos: u64,
        len: u64,
        buf: &mut Vec<u8>,
        status: &mut SegmentStatus,
        plan: &mut Plan,
        mark_claim: &mut u64,
    ) -> Result<(u64, Stop), StorageError> {
        let mut found: Vec<(u32, u64, u64, u64)> = Vec::new();
        let (end, stop) = scan::scan(file, pos, len, buf, |frame| {
            match frame {
                Frame::Record { record, pos, len } => {
                    found.push((record.shard, record.offset, pos, len));
                }
                Frame::Mark { synced_end } => *mark_claim = (*mark_claim).max(synced_end),
            }
            Ok(())
        })?;
        for (shard, offset, at, frame_len) in found {
            status.records += 1;
            if self.released.contains(shard) {
                status.released_records += 1;
                continue;
            }
            self.known.insert(shard);
            if !self.expected.contains_key(&shard) {
                self.first_seen.entry(shard).or_insert((offset, seq, at));
            }
            match self.expected_of(shard) {
                Some(e) if offset < e => {
                    status.stale_records += 1;
                    plan.rewrite = true;
                    plan.drop_spans.push((at, at + frame_len));
                    continue;
                }
                Some(e) if offset > e => self.lose(shard, e, offset, seq, at),
                _ => {}
            }
            self.expected.insert(shard, offset + 1);
            self.last_seen.insert(shard, (seq, at));
        }
        Ok((end, stop))
    }

    /// Shards whose first records may have been damaged. A shard first seen (no checkpoint
    /// names it) at an offset above 0 after damaged spans that could hold that many records
    /// lost its offsets from 0 (the broker starts every shard at 0). A damaged header in the
    /// active segment naming an unknown shard of which nothing valid follows loses the offset
    /// it names, so that offset is never handed out again (in a closed segment, a real shard
    /// would appear in a later checkpoint, so such a header is itself damaged).
    fn settle_claims(&mut self) {
        let mut settled: HashSet<u32> = HashSet::new();
        for (&shard, &(first, fseq, fpos)) in &self.first_seen {
            if first == 0 {
                continue;
            }
            let could_hold: u64 = self
                .damage_spans
                .iter()
                .filter(|(seq, pos, _)| (*seq, *pos) < (fseq, fpos))
                .map(|(_, _, most)| most)
                .sum();
            if could_hold >= first {
                self.lost.push(QuarantineRange {
                    shard,
                    first: 0,
                    end: first,
                    segment: fseq,
                    position: fpos,
                });
                settled.insert(shard);
            }
        }
        for (shard, offset, seq, position, span, active) in std::mem::take(&mut self.claims) {
            if settled.contains(&shard) {
                continue;
            }
            let most = span.div_ceil(HEADER_BYTES as u64);
            match self.first_seen.get(&shard) {
                Some(&(first, fseq, fpos)) if (fseq, fpos) > (seq, position) => {
                    if first > offset && first - offset <= most {
                        self.lose(shard, offset, first, seq, position);
                    }
                }
                Some(_) => {}
                None => {
                    if active && !self.expected.contains_key(&shard) {
                        self.lose(shard, offset, offset.saturating_add(1), seq, position);
                        self.expected.insert(shard, offset.saturating_add(1));
                    }
                }
            }
        }
    }

    /// Damage in the active segment after a shard's last valid record may have held that
    /// shard's next offsets, which nothing later shows: quarantine what the damaged headers
    /// name, and where the span could not be read through, up to one offset per 28 bytes of
    /// it for every shard (never reuse an offset that may have been handed out).
    fn settle_tail_damage(&mut self) {
        for damage in std::mem::take(&mut self.tail_damage) {
            let TailDamage {
                seq,
                position,
                end,
                pairs,
                covered,
            } = damage;
            let after = |seen: Option<&(u64, u64)>| seen.is_none_or(|at| *at < (seq, position));
            let mut attributed: BTreeMap<u32, u64> = BTreeMap::new();
            for (shard, offset) in pairs {
                let e = attributed.entry(shard).or_insert(0);
                *e = (*e).max(offset + 1);
            }
            let shards: Vec<u32> = self.expected.keys().copied().collect();
            for shard in shards {
                if !after(self.last_seen.get(&shard)) {
                    continue;
                }
                let Some(e) = self.expected_of(shard) else {
                    continue;
                };
                let mut until = attributed.get(&shard).copied().unwrap_or(e).max(e);
                if !covered {
                    let most = (end - position).div_ceil(HEADER_BYTES as u64);
                    until = until.max(e + most);
                }
                if until > e {
                    self.lose(shard, e, until, seq, position);
                    self.expected.insert(shard, until);
                }
            }
        }
    }
}

/// The header at `pos`, read without any check.
fn read_header_at(file: &File, pos: u64) -> Option<frame::Header> {
    let mut raw = [0u8; HEADER_BYTES];
    file.read_exact_at(&mut raw, pos).ok()?;
    frame::decode_header(&raw)
}

/// Quarantines the damage `check` finds and rewrites the damaged segments without it (see
/// the module docs), then verifies by opening the log. A clean log is left untouched.
pub fn repair(lock: DirLock) -> Result<(RepairReport, DirLock), StorageError> {
    let dir = lock.dir().to_owned();
    let survey = survey(&dir)?;
    let mut report = RepairReport {
        check: survey.report.clone(),
        quarantined: Vec::new(),
        rewritten: Vec::new(),
        placeholders: Vec::new(),
        recovery: None,
    };
    if !survey.report.is_clean() {
        let released = Released::load(&dir)?;
        let mut quarantine = Quarantine::load(&dir)?;
        if !survey.report.lost.is_empty() {
            let mut entries = quarantine.entries().to_vec();
            entries.extend(survey.report.lost.iter().copied());
            quarantine = Quarantine::from_entries(entries);
            // Written first: a crash before the rewrites leaves the damage quarantined but
            // still in place, and a second repair finds nothing new to quarantine.
            quarantine.store(&dir)?;
            report.quarantined = survey.report.lost.clone();
        }
        for plan in survey.plans.iter().filter(|p| p.rewrite || p.missing) {
            let keep = |s: u32| !released.contains(s);
            rewrite_segment(&dir, plan, &keep)?;
            if plan.missing {
                report.placeholders.push(plan.seq);
            } else {
                report.rewritten.push(plan.seq);
            }
        }
        segment::sync_dir(&dir)?;
    }
    let (log, recovery) = Log::open_with_lock(offline_config(&dir), PwriteBackend::new()?, lock)?;
    report.recovery = Some(recovery);
    Ok((report, log.into_lock()))
}

/// Drops the records of shards `live` rejects (deleted streams), keeping every live record
/// at its offset (see the module docs). The log must open cleanly (else run `repair`).
pub fn compact(
    lock: DirLock,
    live: &dyn Fn(u32) -> bool,
) -> Result<(CompactReport, DirLock), StorageError> {
    let dir = lock.dir().to_owned();
    let config = offline_config(&dir);
    let (log, _) = Log::open_with_lock(config.clone(), PwriteBackend::new()?, lock)?;
    let mut report = CompactReport {
        bytes_before: log.total_bytes(),
        ..CompactReport::default()
    };
    let mut dead: Vec<u32> = log
        .shards
        .keys()
        .copied()
        .chain(log.segments.iter().flat_map(|s| s.stats.keys().copied()))
        .filter(|s| !live(*s))
        .collect();
    dead.sort_unstable();
    dead.dedup();
    let mut released = log.released.clone();
    released.extend(dead.iter().copied());
    if !dead.is_empty() {
        released.store(&dir)?;
    }
    report.released = dead.clone();
    let keep = |s: u32| live(s) && !released.contains(s);
    // What each segment holds, decided from the open log; the files are changed after it
    // is closed (the lock stays held).
    struct Work {
        seq: u64,
        data_start: u64,
        live_records: u64,
        dropped: u64,
        newest: bool,
    }
    let count = log.segments.len();
    let work: Vec<Work> = log
        .segments
        .iter()
        .enumerate()
        .map(|(i, seg)| {
            let dead_records: u64 = seg
                .stats
                .iter()
                .filter(|(s, _)| !keep(**s))
                .map(|(_, s)| s.records)
                .sum();
            Work {
                seq: seg.seq,
                data_start: seg.data_start,
                live_records: seg.records - dead_records,
                dropped: dead_records + seg.released_records,
                newest: i + 1 == count,
            }
        })
        .collect();
    let lock = log.into_lock();
    let mut front = true;
    for w in &work {
        if w.dropped == 0 {
            front = false;
            continue;
        }
        report.records_dropped += w.dropped;
        let path = dir.join(segment::file_name(w.seq));
        if w.live_records == 0 && !w.newest {
            if front {
                fs::remove_file(&path)
                    .map_err(|e| StorageError::io(format!("delete {}", path.display()), e))?;
            } else {
                let (file, _) = open_rw(&path)?;
                file.set_len(w.data_start)
                    .map_err(|e| StorageError::io(format!("cut {}", path.display()), e))?;
                file.sync_all()
                    .map_err(|e| StorageError::io(format!("fsync {}", path.display()), e))?;
            }
            sidecar::remove(&dir, w.seq);
            report.emptied.push(w.seq);
            continue;
        }
        front = false;
        let plan = Plan {
            seq: w.seq,
            rewrite: true,
            data_start: w.data_start,
            ..Plan::default()
        };
        rewrite_segment(&dir, &plan, &keep)?;
        report.rewritten.push(w.seq);
    }
    segment::sync_dir(&dir)?;
    let (log, recovery) = Log::open_with_lock(config, PwriteBackend::new()?, lock)?;
    report.bytes_after = log.total_bytes();
    report.recovery = Some(recovery);
    Ok((report, log.into_lock()))
}

/// Writes segment `plan.seq` anew through `<seq>.log.tmp` (fsynced, renamed over the old
/// file): the same header (or the plan's checkpoint for a placeholder or a damaged header),
/// then every valid record of a shard `keep` accepts, outside the plan's drop spans and
/// before its cut, re-encoded byte for byte at new positions, offsets unchanged. Commit marks
/// are not copied (their claims name old positions); the active segment gets one new mark
/// covering everything. The active segment keeps its file size (preallocated for appends), a
/// closed one shrinks to its data. The sidecar is removed (recovery writes a new one).
fn rewrite_segment(
    dir: &Path,
    plan: &Plan,
    keep: &dyn Fn(u32) -> bool,
) -> Result<(), StorageError> {
    let path = dir.join(segment::file_name(plan.seq));
    let tmp = dir.join(format!("{}.tmp", segment::file_name(plan.seq)));
    let source = if plan.missing {
        None
    } else {
        Some(open_rw(&path)?)
    };
    let (created, checkpoint) = match (&plan.checkpoint, &source) {
        (Some(cp), _) => (crate::log::now_unix_us(), cp.clone()),
        (None, Some((file, len))) => {
            let h = segment::read_header(file, *len).map_err(|why| {
                StorageError::io(
                    format!("read the header of {}", path.display()),
                    std::io::Error::other(why),
                )
            })?;
            (h.created_unix_us, h.checkpoint)
        }
        (None, None) => unreachable!("a placeholder plan carries its checkpoint"),
    };
    let header = segment::encode_header(plan.seq, created, &checkpoint);
    let out_file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| StorageError::io(format!("create {}", tmp.display()), e))?;
    let mut out = Vec::with_capacity(REWRITE_BUFFER_BYTES);
    out.extend_from_slice(&header);
    let mut written = 0u64;
    let flush = |out: &mut Vec<u8>, written: &mut u64, force: bool| -> Result<(), StorageError> {
        if force || out.len() >= REWRITE_BUFFER_BYTES {
            out_file
                .write_all_at(out, *written)
                .map_err(|e| StorageError::io(format!("write {}", tmp.display()), e))?;
            *written += out.len() as u64;
            out.clear();
        }
        Ok(())
    };
    let mut newest = false;
    let mut size = 0u64;
    if let Some((file, len)) = &source {
        newest = segment_seqs(dir)?.last() == Some(&plan.seq);
        size = *len;
        let limit = plan.cut_at.unwrap_or(*len);
        let mut pos = plan.data_start;
        let mut spans = plan.drop_spans.iter().peekable();
        let mut buf = Vec::with_capacity(scan::SCAN_CHUNK_BYTES);
        // Bounded: each pass moves `pos` forward past a span or to the end of a scan.
        while pos < limit {
            while let Some(&&(start, end)) = spans.peek() {
                if start <= pos {
                    pos = pos.max(end);
                    spans.next();
                } else {
                    break;
                }
            }
            if pos >= limit {
                break;
            }
            let stop_at = spans.peek().map_or(limit, |s| s.0.min(limit));
            let mut write_error = None;
            let (end, _) = scan::scan(file, pos, stop_at, &mut buf, |frame| {
                if let Frame::Record { record, .. } = frame
                    && keep(record.shard)
                {
                    frame::encode(
                        &mut out,
                        record.shard,
                        record.offset,
                        record.timestamp_us,
                        record.key,
                        record.payload,
                    );
                    if let Err(error) = flush(&mut out, &mut written, false) {
                        write_error = Some(error);
                        return Err("write failed".into());
                    }
                }
                Ok(())
            })?;
            if let Some(error) = write_error {
                return Err(error);
            }
            if end < stop_at {
                // The data ends before the next span: nothing valid is left to copy.
                if spans.peek().is_none() {
                    break;
                }
            }
            pos = stop_at;
        }
    }
    let data_end = written + out.len() as u64;
    if newest {
        frame::encode_mark(&mut out, data_end, crate::log::now_unix_us());
    }
    flush(&mut out, &mut written, true)?;
    let data_end = written;
    let size = if newest {
        size.max(segment::align_up(data_end))
    } else {
        segment::align_up(data_end)
    };
    if newest {
        segment::preallocate(&out_file, size)?;
    } else {
        out_file
            .set_len(size)
            .map_err(|e| StorageError::io(format!("size {}", tmp.display()), e))?;
    }
    out_file
        .sync_all()
        .map_err(|e| StorageError::io(format!("fsync {}", tmp.display()), e))?;
    drop(out_file);
    fs::rename(&tmp, &path)
        .map_err(|e| StorageError::io(format!("rename {}", path.display()), e))?;
    sidecar::remove(dir, plan.seq);
    Ok(())
}
