//! Felix-versus-NATS pairs: which recorded runs compare, their ratio, and what still differs.
//!
//! A pair is one plan cell (same shape, same trials, interleaved by the runner) that ran a
//! Felix arm and a NATS arm; every (Felix arm, NATS arm) combination of a cell is a pair. Each
//! side's figure is the median over its finished trials, like the rest of `summary.md`. The
//! pair's kind comes from the NATS arm (what the publisher is promised when it gets its
//! answer), following the reference's "How each pair is matched" table, adapted to this bench
//! (both sides driven by felix-bench's own Rust generator). Pure functions on records: no IO.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::cell::CellRecord;
use crate::plan::{
    IggyArm, IggySync, Measure, NatsArm, NatsMode, NatsStorage, NatsSync, Shape, StreamKind, System,
};
use crate::stats::{BYTES_PER_MB, median};

/// Longest error text quoted in the pairs table; the full text is in "Failed runs".
const ERROR_QUOTE_CHARS: usize = 100;

/// What the publisher is promised when it gets its answer, on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PairKind {
    /// Felix durable on_commit vs NATS file store with `sync_interval: always`.
    FsyncBeforeAck,
    /// Felix durable periodic fsync vs NATS file store with the default sync interval.
    PeriodicFsync,
    /// Felix in-memory acked vs NATS memory storage.
    InMemory,
    /// Felix unacked publish vs core NATS publish.
    FireAndForget,
}

impl PairKind {
    /// The kind a peer's settings put a pair in. An Iggy arm without fsync answers from its
    /// in-memory journal: it pairs with Felix in memory in an in-memory cell and with Felix's
    /// periodic fsync in a durable one.
    pub fn of_peer(peer: &Peer, shape: &Shape) -> PairKind {
        match peer {
            Peer::Nats(n) => PairKind::of(n),
            Peer::Iggy(i) => match (i.sync, shape.kind) {
                (IggySync::Always, _) => PairKind::FsyncBeforeAck,
                (IggySync::Off, StreamKind::Durable) => PairKind::PeriodicFsync,
                (IggySync::Off, StreamKind::InMemory) => PairKind::InMemory,
            },
        }
    }

    /// The kind a NATS arm's settings put a pair in.
    pub fn of(nats: &NatsArm) -> PairKind {
        match (nats.mode, nats.storage, nats.sync) {
            (NatsMode::Core, _, _) => PairKind::FireAndForget,
            (NatsMode::Jetstream, NatsStorage::Memory, _) => PairKind::InMemory,
            (NatsMode::Jetstream, NatsStorage::File, NatsSync::Always) => PairKind::FsyncBeforeAck,
            (NatsMode::Jetstream, NatsStorage::File, NatsSync::Default) => PairKind::PeriodicFsync,
        }
    }
}

/// One side of a pair: an arm's figures over its trials (medians of the finished trials).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PairSide {
    pub arm: String,
    pub trials_run: usize,
    pub trials_finished: usize,
    pub payload_bytes_per_s: Option<f64>,
    pub cpu_cores: Option<f64>,
    /// Payload bytes per second per server core in use (the median of each trial's ratio).
    pub payload_bytes_per_core_s: Option<f64>,
    /// `server`, `generator` or `mixed` (src/pin.rs), with the server's CPU count and whether
    /// they were its own.
    pub limit: Option<(&'static str, usize, bool)>,
    pub ctx_switches_per_s: Option<f64>,
    pub ctx_switches_per_record: Option<f64>,
    /// Ack p50, p99, p999 in microseconds.
    pub ack_us: Option<[f64; 3]>,
    /// Delivery p50, p99, p999 in microseconds.
    pub delivery_us: Option<[f64; 3]>,
    /// The first error of a trial that did not finish.
    pub first_error: Option<String>,
}

/// The other side of a pair: a NATS or an Iggy arm's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Nats(NatsArm),
    Iggy(IggyArm),
}

impl Peer {
    pub fn system(&self) -> System {
        match self {
            Peer::Nats(_) => System::Nats,
            Peer::Iggy(_) => System::Iggy,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Peer::Nats(n) => n.describe(),
            Peer::Iggy(i) => i.describe(),
        }
    }
}

/// `NATS`, `Iggy` (`Felix` for completeness).
pub fn system_name(system: System) -> &'static str {
    match system {
        System::Felix => "Felix",
        System::Nats => "NATS",
        System::Iggy => "Iggy",
    }
}

/// A Felix run and a peer's (NATS or Iggy) run of the same cell.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub cell_number: usize,
    pub shape: Shape,
    pub kind: PairKind,
    pub peer: Peer,
    pub felix: PairSide,
    /// The peer's side.
    pub other: PairSide,
}

/// Which system was faster and by how much (>= 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    pub faster: System,
    pub ratio: f64,
}

impl Verdict {
    /// `Felix, 1.53×`.
    pub fn label(&self) -> String {
        format!("{}, {:.2}×", system_name(self.faster), self.ratio)
    }
}

/// The faster of two payload rates and the ratio of faster to slower; `None` when either is
/// missing or not positive (no meaningful ratio). Equal rates name Felix with ratio 1.
pub fn compare(felix: Option<f64>, other: Option<(System, f64)>) -> Option<Verdict> {
    let (f, (system, n)) = (felix?, other?);
    if !(f > 0.0 && n > 0.0 && f.is_finite() && n.is_finite()) {
        return None;
    }
    Some(if f >= n {
        Verdict {
            faster: System::Felix,
            ratio: f / n,
        }
    } else {
        Verdict {
            faster: system,
            ratio: n / f,
        }
    })
}

impl Pair {
    /// The pair's row title, e.g. "Durable, one at a time" or "Latency: fsync before the ack".
    pub fn title(&self) -> String {
        let b = self.shape.batch;
        let per_request = |base: &str| {
            if b == 1 {
                format!("{base}, one at a time")
            } else {
                format!("{base}, {b} per request")
            }
        };
        if self.shape.measure == Measure::Latency {
            return match self.kind {
                PairKind::FsyncBeforeAck => "Latency: fsync before the ack",
                PairKind::PeriodicFsync => "Latency: periodic fsync",
                PairKind::InMemory => "Latency: in memory",
                PairKind::FireAndForget => "Latency: fire and forget",
            }
            .to_string();
        }
        match self.kind {
            PairKind::FsyncBeforeAck => per_request("Durable"),
            PairKind::PeriodicFsync => per_request("Periodic fsync"),
            PairKind::InMemory => "In memory".to_string(),
            PairKind::FireAndForget => "Fire and forget".to_string(),
        }
    }

    /// Which side is faster on payload MB/s.
    pub fn verdict(&self) -> Option<Verdict> {
        compare(
            self.felix.payload_bytes_per_s,
            self.other
                .payload_bytes_per_s
                .map(|v| (self.peer.system(), v)),
        )
    }

    /// The same comparison per server core in use: payload bytes per CPU-second.
    pub fn per_core_verdict(&self) -> Option<Verdict> {
        compare(
            self.felix.payload_bytes_per_core_s,
            self.other
                .payload_bytes_per_core_s
                .map(|v| (self.peer.system(), v)),
        )
    }

    /// What still differs between the two sides of this pair (adapted from the reference).
    pub fn still_differs(&self) -> String {
        let nats_arm = match self.peer {
            Peer::Nats(n) => n,
            Peer::Iggy(i) => return self.iggy_still_differs(i),
        };
        let b = self.shape.batch;
        let mut text = match self.kind {
            PairKind::FsyncBeforeAck if b > 1 && nats_arm.atomic_batch => format!(
                "Both fsync before the ack. NATS gets each batch of {b} as one atomic batch \
                 (ADR-50 headers, one ack for the commit), all-or-nothing. A Felix batch is acked \
                 or refused as one unit but is not atomic on disk: a crash partway through \
                 writing it can leave its first records in the log, unacknowledged. Both keep the \
                 plan's in-flight batches per publisher (nats bench keeps one atomic batch per \
                 client). Felix group-commits waiting writes into one fsync."
            ),
            PairKind::FsyncBeforeAck if b > 1 => format!(
                "Both fsync before the ack. NATS gets {b} separate publishes whose acks are \
                 awaited as one unit (not an atomic batch); Felix sends them in one request. \
                 Felix group-commits waiting writes into one fsync."
            ),
            PairKind::FsyncBeforeAck => "Both fsync before the ack (Felix on_commit, NATS \
                 sync_interval: always). Felix group-commits the writes that are waiting together \
                 into one fsync."
                .to_string(),
            PairKind::PeriodicFsync => {
                let mut t = "Both ack before the fsync and can lose the last interval's writes on \
                     a power loss. Felix fsyncs every 250 ms (its default periodic interval), NATS \
                     every 2 minutes (defaultSyncInterval in nats-server's filestore.go), 480 times \
                     longer."
                    .to_string();
                if b > 1 {
                    let _ = write!(
                        t,
                        " NATS gets each batch of {b} as {}.",
                        if nats_arm.atomic_batch {
                            "one atomic batch"
                        } else {
                            "separate publishes whose acks are awaited as one unit"
                        }
                    );
                }
                t
            }
            PairKind::InMemory => "Neither touches disk. A NATS memory stream keeps every message \
                 up to its limits (here 1 GiB per stream, oldest discarded). A Felix in-memory \
                 stream keeps only a replay ring per shard (by default the last 1,024 records, \
                 at most 64 MiB)."
                .to_string(),
            PairKind::FireAndForget => "Both are at-most-once with nothing on disk, and neither \
                 side has a subscriber. Felix still routes each record to its shard and puts it in \
                 the replay ring; core NATS finds no interest and discards it. NATS is counted as \
                 publishes received (/varz in_msgs), Felix as records accepted."
                .to_string(),
        };
        if self.shape.measure == Measure::Latency {
            text.push_str(
                " Latency: one publisher, one publish in flight. The Felix subscriber is a stream \
                 subscription over every shard; the NATS one is an ordered push consumer per \
                 stream, so delivery is timed after the message is stored on both sides.",
            );
        }
        if !nats_arm.tls {
            text.push_str(
                " NATS ran without TLS (plain TCP) while Felix always runs TLS: a difference \
                 favouring NATS.",
            );
        }
        text
    }

    /// What still differs between Felix and Iggy in this pair.
    fn iggy_still_differs(&self, iggy: IggyArm) -> String {
        let b = self.shape.batch;
        let mut text = match (self.kind, iggy.sync) {
            (PairKind::FsyncBeforeAck, _) => format!(
                "Both fsync before the ack. Iggy (enforce_fsync = true, \
                 messages_required_to_save = 1) writes and fsyncs each SendMessages of {b} \
                 message(s) on its own (messages file, then index file) before it answers; \
                 Felix group-commits the writes that are waiting together into one fsync."
            ),
            (PairKind::PeriodicFsync, _) => "Both ack before the data is on disk. Felix \
                 writes each batch and fsyncs every 250 ms; Iggy (its defaults) answers once the \
                 batch is in the partition's in-memory journal, writes it to the segment file \
                 when 1,024 messages or 1 MiB are buffered or every 30 s (message saver), and \
                 never fsyncs it (the kernel's writeback does): fsync off."
                .to_string(),
            _ => "Felix keeps the records in memory only (a replay ring per shard); Iggy is \
                 always disk-backed, and with its defaults answers from its in-memory journal \
                 and writes to the segment file in the background of later sends (1,024 \
                 messages or 1 MiB per partition), without fsync."
                .to_string(),
        };
        text.push_str(
            " Iggy's QUIC client (the iggy crate) keeps one request in flight per connection, so \
             each Iggy publisher opens min(in_flight, 8) connections with one request each.",
        );
        if self.shape.measure == Measure::Latency {
            text.push_str(
                " Latency: one publisher, one publish in flight; ack latency only on the Iggy \
                 side (no consumer was timed).",
            );
        }
        text
    }
}

/// Median of the values `f` gives for the finished trials, if any.
fn side_median(records: &[&CellRecord], f: impl Fn(&CellRecord) -> Option<f64>) -> Option<f64> {
    let values: Vec<f64> = records.iter().filter_map(|r| f(r)).collect();
    median(&values)
}

/// One side's figures from the records of one cell and arm.
pub fn side(arm: &str, records: &[&CellRecord]) -> PairSide {
    let lat = |get: &dyn Fn(&CellRecord) -> Option<[f64; 3]>| -> Option<[f64; 3]> {
        let p = |i: usize| side_median(records, |r| get(r).map(|v| v[i]));
        Some([p(0)?, p(1)?, p(2)?])
    };
    PairSide {
        arm: arm.to_string(),
        trials_run: records.len(),
        trials_finished: records.iter().filter(|r| r.outputs.is_some()).count(),
        payload_bytes_per_s: side_median(records, |r| {
            r.outputs.as_ref().map(|o| o.throughput.payload_bytes_per_s)
        }),
        cpu_cores: side_median(records, |r| {
            r.outputs.as_ref().map(|o| o.throughput.cpu_cores)
        }),
        payload_bytes_per_core_s: side_median(records, |r| {
            r.outputs
                .as_ref()
                .filter(|o| o.throughput.cpu_cores > 0.0)
                .map(|o| o.throughput.payload_bytes_per_s / o.throughput.cpu_cores)
        }),
        limit: {
            let uses: Vec<_> = records
                .iter()
                .filter_map(|r| r.outputs.as_ref().and_then(|o| o.server))
                .collect();
            let bound = uses.iter().filter(|u| u.server_bound).count();
            uses.first()
                .zip(crate::pin::limit_label(bound, uses.len()))
                .map(|(first, limit)| (limit, first.cpus, first.pinned))
        },
        ctx_switches_per_s: side_median(records, |r| {
            r.outputs.as_ref().map(|o| o.throughput.ctx_switches_per_s)
        }),
        ctx_switches_per_record: side_median(records, |r| {
            r.outputs
                .as_ref()
                .map(|o| o.throughput.ctx_switches_per_record())
        }),
        ack_us: lat(&|r| {
            r.outputs
                .as_ref()
                .and_then(|o| o.ack_latency)
                .map(|l| [l.p50_us, l.p99_us, l.p999_us])
        }),
        delivery_us: lat(&|r| {
            r.outputs
                .as_ref()
                .and_then(|o| o.delivery_latency)
                .map(|l| [l.p50_us, l.p99_us, l.p999_us])
        }),
        first_error: records.iter().find_map(|r| r.error.clone()),
    }
}

/// Every Felix x NATS pair in `records`, in cell order then arm order.
pub fn match_pairs(records: &[CellRecord]) -> Vec<Pair> {
    // cell number -> arm name -> records, keeping first-seen arm order per cell.
    let mut cells: BTreeMap<usize, Vec<(String, Vec<&CellRecord>)>> = BTreeMap::new();
    for r in records {
        let arms = cells.entry(r.cell.number).or_default();
        match arms.iter_mut().find(|(name, _)| *name == r.arm.name) {
            Some((_, recs)) => recs.push(r),
            None => arms.push((r.arm.name.clone(), vec![r])),
        }
    }
    let mut pairs = Vec::new();
    for (number, arms) in &cells {
        let of = |system: System| {
            arms.iter()
                .filter(move |(_, recs)| recs[0].arm.system == system)
                .collect::<Vec<_>>()
        };
        for (felix_arm, felix_recs) in of(System::Felix) {
            for system in [System::Nats, System::Iggy] {
                for (peer_arm, peer_recs) in of(system) {
                    let arm = &peer_recs[0].arm;
                    let peer = match (arm.nats, arm.iggy) {
                        (Some(n), _) => Peer::Nats(n),
                        (None, Some(i)) => Peer::Iggy(i),
                        (None, None) => continue,
                    };
                    let shape = felix_recs[0].cell.shape;
                    pairs.push(Pair {
                        cell_number: *number,
                        shape,
                        kind: PairKind::of_peer(&peer, &shape),
                        peer,
                        felix: side(felix_arm, felix_recs),
                        other: side(peer_arm, peer_recs),
                    });
                }
            }
        }
    }
    pairs
}

fn mb(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_string(), |v| format!("{:.1}", v / BYTES_PER_MB))
}

fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "–".to_string(), |v| format!("{v:.decimals$}"))
}

fn triple(v: Option<[f64; 3]>) -> String {
    v.map_or_else(
        || "–".to_string(),
        |[a, b, c]| format!("{a:.0} / {b:.0} / {c:.0} µs"),
    )
}

fn short_error(side: &PairSide) -> Option<String> {
    side.first_error.as_ref().map(|e| {
        let e = e.replace('|', "\\|").replace('\n', " ");
        if e.chars().count() > ERROR_QUOTE_CHARS {
            format!("{}…", e.chars().take(ERROR_QUOTE_CHARS).collect::<String>())
        } else {
            e
        }
    })
}

fn payload_label(shape: &Shape) -> String {
    let n = shape.payload_bytes;
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{} KiB", n / 1024)
    } else {
        format!("{n} B")
    }
}

/// The "Pairs" sections of summary.md, one per peer system (NATS, then Iggy); empty when
/// there is no pair.
pub fn pairs_markdown(pairs: &[Pair]) -> String {
    let mut s = String::new();
    for system in [System::Nats, System::Iggy] {
        let of: Vec<&Pair> = pairs.iter().filter(|p| p.peer.system() == system).collect();
        if !of.is_empty() {
            s.push_str(&peer_markdown(&of, system));
        }
    }
    s
}

/// The pairs section for one peer system.
fn peer_markdown(pairs: &[&Pair], system: System) -> String {
    let mut s = String::new();
    let name = system_name(system);
    let throughput: Vec<&Pair> = pairs
        .iter()
        .copied()
        .filter(|p| p.shape.measure == Measure::Throughput)
        .collect();
    let latency: Vec<&Pair> = pairs
        .iter()
        .copied()
        .filter(|p| p.shape.measure == Measure::Latency)
        .collect();
    // Writing to a String cannot fail; the fmt::Result is ignored on purpose below.
    let _ = writeln!(s, "\n## Pairs: Felix and {name} side by side\n");
    if system == System::Iggy {
        let _ = writeln!(
            s,
            "Each pair is one cell run on a Felix arm and an Iggy arm in the same trials (Felix \
             first on odd trials, Iggy first on even), matched on what the publisher is promised \
             when it gets its answer. Payload MB/s is counted at each server (Felix: accepted \
             records x payload; Iggy: its /metrics `messages` gauge x payload), the median of the \
             finished trials. Cores are the server's CPU (/proc/<pid>/stat), ctx/rec its context \
             switches per record. MB/s/core is payload per server CPU-second and \"Per core\" \
             compares those. Limit: \"server\" when the server used at least 95% of its CPUs, \
             else \"generator\". Read every ratio with its row's \"what still differs\".\n"
        );
    } else {
        let _ = writeln!(
            s,
            "Each pair is one cell run on a Felix arm and a NATS arm in the same trials (Felix first on \
         odd trials, NATS first on even), matched on what the publisher is promised when it gets \
         its answer. Payload MB/s is counted at each server (Felix: accepted records x payload; \
         NATS JetStream: stored messages x payload from /jsz; core NATS: /varz in_msgs x payload), \
         the median of the finished trials. Cores are the server's CPU (/proc/<pid>/stat), \
         ctx/rec its context switches per record (all threads, /proc/<pid>/task/*/status). \
         MB/s/core is payload per server CPU-second (each trial's MB/s over its cores, the \
         median), and \"Per core\" compares those: on a machine where the load generator shares \
         or limits the server it is the fairer figure. Limit: \"server\" when the server used \
         at least 95% of its CPUs (\"pinned\": its own; \"shared\": with the generator), else \
         \"generator\". Read every ratio with its row's \"what still differs\".\n"
        );
    }
    if !throughput.is_empty() {
        let _ = writeln!(
            s,
            "| Pair | Cell | Payload | Felix arm | Felix MB/s | Felix cores | Felix MB/s/core | Felix limit | Felix ctx/rec | {name} arm | {name} MB/s | {name} cores | {name} MB/s/core | {name} limit | {name} ctx/rec | Faster | Per core |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|---|---:|---|---|"
        );
        for p in &throughput {
            let faster = match p.verdict() {
                Some(v) => v.label(),
                None => {
                    let mut why = Vec::new();
                    if let Some(e) = short_error(&p.felix) {
                        why.push(format!("Felix failed: {e}"));
                    }
                    if let Some(e) = short_error(&p.other) {
                        why.push(format!("{name} failed: {e}"));
                    }
                    if why.is_empty() {
                        "–".to_string()
                    } else {
                        why.join("; ")
                    }
                }
            };
            let per_core = p
                .per_core_verdict()
                .map_or_else(|| "–".to_string(), |v| v.label());
            let limit = |side: &PairSide| match side.limit {
                Some((limit, cpus, pinned)) => {
                    format!(
                        "{limit} ({cpus} {})",
                        if pinned { "pinned" } else { "shared" }
                    )
                }
                None => "–".to_string(),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                p.title(),
                p.cell_number,
                payload_label(&p.shape),
                p.felix.arm,
                mb(p.felix.payload_bytes_per_s),
                num(p.felix.cpu_cores, 2),
                mb(p.felix.payload_bytes_per_core_s),
                limit(&p.felix),
                num(p.felix.ctx_switches_per_record, 3),
                p.other.arm,
                mb(p.other.payload_bytes_per_s),
                num(p.other.cpu_cores, 2),
                mb(p.other.payload_bytes_per_core_s),
                limit(&p.other),
                num(p.other.ctx_switches_per_record, 3),
                faster,
                per_core,
            );
        }
    }
    if !latency.is_empty() {
        let _ = writeln!(
            s,
            "\nLatency pairs (one publisher, one publish in flight, batch 1, {}):\n",
            if system == System::Iggy {
                "one Felix subscriber; no Iggy consumer, so Iggy has ack latency only"
            } else {
                "one subscriber"
            }
        );
        let _ = writeln!(
            s,
            "| Pair | Cell | Payload | Felix ack p50 / p99 / p999 | {name} ack p50 / p99 / p999 | Felix delivery p50 / p99 / p999 | {name} delivery p50 / p99 / p999 |"
        );
        let _ = writeln!(s, "|---|---:|---|---|---|---|---|");
        for p in &latency {
            let or_error = |v: Option<[f64; 3]>, side: &PairSide| match (v, short_error(side)) {
                (None, Some(e)) => format!("failed: {e}"),
                _ => triple(v),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                p.title(),
                p.cell_number,
                payload_label(&p.shape),
                or_error(p.felix.ack_us, &p.felix),
                or_error(p.other.ack_us, &p.other),
                triple(p.felix.delivery_us),
                triple(p.other.delivery_us),
            );
        }
    }
    let _ = writeln!(s, "\n### What still differs\n");
    let mut seen: Vec<String> = Vec::new();
    for p in pairs {
        let title = p.title();
        let text = p.still_differs();
        let line = format!("- **{title}** ({name} arm {}): {text}", p.peer.describe());
        if !seen.contains(&line) {
            let _ = writeln!(s, "{line}");
            seen.push(line);
        }
    }
    if system == System::Iggy {
        let _ = writeln!(
            s,
            "- **Every pair**: both use QUIC with TLS (Iggy: quinn in the iggy 0.10 crate, the \
             server's self-signed certificate, not validated); both are driven by felix-bench's \
             own generator with the same publishers and payload. Iggy gets one stream with one \
             topic of one partition per Felix shard, and sends rotate over the partitions (by \
             partition id) as Felix's keys rotate over shards. Iggy is always disk-backed."
        );
    } else {
        let _ = writeln!(
            s,
            "- **Every pair**: Felix uses QUIC with TLS and its Rust client; NATS uses TCP (with TLS \
             unless the arm says otherwise) and async-nats 0.51. Both are driven by felix-bench's own \
             generator with the same publishers, in-flight window and payload (the reference drove \
             NATS with nats bench). NATS gets one stream per Felix shard (subject `bench.<i>`) and \
             publishes rotate over them as Felix's keys rotate over shards."
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::tests::{arm, fixed_run};
    use crate::cell::{CellRecord, Facts};
    use crate::plan::Plan;

    const PLAN: &str = "[settings]\nduration_s = 20\ntrials = 2\n\
        [[arms]]\nname = \"felix-on-commit\"\nenv = { FELIX_DURABLE_FSYNC_MODE = \"on_commit\" }\n\
        [[arms]]\nname = \"nats-always\"\nsystem = \"nats\"\nsync = \"always\"\n\
        [[cells]]\nkind = \"durable\"\npayload = 4096\nbatch = 1\nmode = \"acked\"\n\
        publishers = 1\nin_flight = 4\n";

    /// Records of the plan's one cell: Felix at `felix_rate` B/s (trial 2 failing when asked),
    /// NATS at `nats_rate` B/s.
    fn records(felix_rate: u64, nats_rate: u64, felix_fails: bool) -> Vec<CellRecord> {
        let plan = Plan::parse(PLAN).unwrap();
        let cell = &plan.cells[0];
        let mut out = Vec::new();
        for trial in 1..=2u32 {
            for a in &plan.arms {
                let rate = if a.system == System::Felix {
                    felix_rate
                } else {
                    nats_rate
                };
                let record = if felix_fails && trial == 2 && a.system == System::Felix {
                    CellRecord::failed(
                        &plan.settings,
                        cell,
                        a,
                        trial,
                        Facts::default(),
                        &crate::BenchError::Broker("durable streams not wired".to_string()),
                    )
                } else {
                    CellRecord::from_run(
                        &plan.settings,
                        cell,
                        a,
                        trial,
                        Facts::default(),
                        fixed_run(rate, 0),
                    )
                };
                out.push(record);
            }
        }
        out
    }

    #[test]
    fn ratio_names_the_faster_side() {
        // Proves the ratio is faster over slower and names the faster system, and missing or zero rates give none.
        let v = compare(Some(300.0), Some((System::Nats, 100.0))).unwrap();
        assert_eq!((v.faster, v.ratio), (System::Felix, 3.0));
        let v = compare(Some(100.0), Some((System::Nats, 134.0))).unwrap();
        assert_eq!(v.faster, System::Nats);
        assert!((v.ratio - 1.34).abs() < 1e-12);
        let v = compare(Some(100.0), Some((System::Iggy, 200.0))).unwrap();
        assert_eq!(v.label(), "Iggy, 2.00×");
        assert_eq!(compare(None, Some((System::Nats, 1.0))), None);
        assert_eq!(compare(Some(0.0), Some((System::Nats, 1.0))), None);
    }

    #[test]
    fn a_cell_with_both_systems_is_one_pair() {
        // Proves a cell run on a Felix and a NATS arm becomes one pair with each side's medians and kind.
        let pairs = match_pairs(&records(8_192_000, 4_096_000, false));
        assert_eq!(pairs.len(), 1);
        let p = &pairs[0];
        assert_eq!(p.kind, PairKind::FsyncBeforeAck);
        assert_eq!(p.title(), "Durable, one at a time");
        assert_eq!(
            (p.felix.arm.as_str(), p.other.arm.as_str()),
            ("felix-on-commit", "nats-always")
        );
        assert_eq!((p.felix.trials_finished, p.other.trials_finished), (2, 2));
        assert_eq!(p.felix.payload_bytes_per_s, Some(8_192_000.0));
        let v = p.verdict().unwrap();
        assert_eq!((v.faster, v.ratio), (System::Felix, 2.0));
        let md = pairs_markdown(&pairs);
        assert!(md.contains("| Durable, one at a time | 1 | 4 KiB | felix-on-commit | 8.2 |"));
        assert!(md.contains("Felix, 2.00×"));
        assert!(md.contains("group-commits"));
    }

    #[test]
    fn failed_trials_are_shown_not_hidden() {
        // Proves a side whose trials failed reports its error in the pair instead of a ratio.
        let mut recs = records(8_192_000, 4_096_000, true);
        recs.retain(|r| !(r.arm.system == System::Felix && r.trial == 1));
        let pairs = match_pairs(&recs);
        assert_eq!(pairs[0].felix.trials_finished, 0);
        assert_eq!(pairs[0].verdict(), None);
        let md = pairs_markdown(&pairs);
        assert!(md.contains("Felix failed: broker: durable streams not wired"));
    }

    #[test]
    fn felix_only_records_make_no_pairs() {
        // Proves records without a NATS arm give no pairs and no section.
        let plan = Plan::parse(PLAN).unwrap();
        let r = CellRecord::from_run(
            &plan.settings,
            &plan.cells[0],
            &arm("felix"),
            1,
            Facts::default(),
            fixed_run(4_096_000, 0),
        );
        assert!(match_pairs(&[r]).is_empty());
        assert_eq!(pairs_markdown(&[]), "");
    }

    #[test]
    fn nats_settings_choose_the_pair_kind() {
        // Proves each NATS arm setting maps to the reference's pair kind.
        let base = NatsArm {
            storage: NatsStorage::File,
            sync: NatsSync::Default,
            mode: NatsMode::Jetstream,
            atomic_batch: false,
            tls: true,
        };
        assert_eq!(PairKind::of(&base), PairKind::PeriodicFsync);
        let always = NatsArm {
            sync: NatsSync::Always,
            ..base
        };
        assert_eq!(PairKind::of(&always), PairKind::FsyncBeforeAck);
        let memory = NatsArm {
            storage: NatsStorage::Memory,
            ..base
        };
        assert_eq!(PairKind::of(&memory), PairKind::InMemory);
        let core = NatsArm {
            mode: NatsMode::Core,
            ..base
        };
        assert_eq!(PairKind::of(&core), PairKind::FireAndForget);
    }
    #[test]
    fn iggy_arms_pair_by_their_fsync_and_the_cell_kind() {
        // Proves an Iggy arm makes a pair with its own section: fsync always is fsync-before-ack, fsync off is periodic in a durable cell and in-memory in an in-memory one.
        let plan = Plan::parse(
            "[settings]\nduration_s = 20\ntrials = 1\n\
             [[arms]]\nname = \"felix\"\n\
             [[arms]]\nname = \"iggy-fsync\"\nsystem = \"iggy\"\nsync = \"always\"\n\
             [[arms]]\nname = \"iggy-off\"\nsystem = \"iggy\"\n\
             [[cells]]\nkind = \"durable\"\npayload = 256\nbatch = 64\nmode = \"acked\"\n\
             publishers = 1\nin_flight = 4\narms = [\"felix\", \"iggy-fsync\", \"iggy-off\"]\n\
             [[cells]]\nkind = \"in-memory\"\npayload = 256\nbatch = 1\nmode = \"acked\"\n\
             publishers = 1\nin_flight = 4\narms = [\"felix\", \"iggy-off\"]\n",
        )
        .unwrap();
        let mut recs = Vec::new();
        for (c, cell) in plan.cells.iter().enumerate() {
            for &a in &plan.cell_arms[c] {
                let arm = &plan.arms[a];
                let rate = if arm.system == System::Felix {
                    2_000_000
                } else {
                    1_000_000
                };
                recs.push(CellRecord::from_run(
                    &plan.settings,
                    cell,
                    arm,
                    1,
                    Facts::default(),
                    fixed_run(rate, 0),
                ));
            }
        }
        let pairs = match_pairs(&recs);
        let kinds: Vec<(usize, PairKind)> = pairs.iter().map(|p| (p.cell_number, p.kind)).collect();
        assert_eq!(
            kinds,
            vec![
                (1, PairKind::FsyncBeforeAck),
                (1, PairKind::PeriodicFsync),
                (2, PairKind::InMemory)
            ]
        );
        let md = pairs_markdown(&pairs);
        assert!(md.contains("## Pairs: Felix and Iggy side by side"));
        assert!(!md.contains("Felix and NATS"));
        assert!(md.contains("| Iggy arm | Iggy MB/s |"));
        assert!(md.contains("Felix, 2.00×"));
        assert!(md.contains("fsync off"));
    }
}
