//! The simulated broker: N cores of the real state machine, each with its real durable log on
//! the storage crate's fault backend (real files in a temporary directory; rounds held until
//! the simulation completes them, fsync errors, disk-full writes, power cuts), core 0's real
//! catalogue file, a mesh of bounded FIFO queues per ordered pair of cores delivered in a
//! random interleaving, and a logical clock. Everything random comes from the seed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

use felix_auth::{Access, Operation, Policy, Principal, Rules};
use felix_core::driver::{self, Effects};
use felix_core::{
    Catalog, CatalogWrite, ClusterRequest, ConnectionLimits, Core, CoreConfig, CoreMessage,
    DurableLog, DurableSettings, IngressSettings, Now, REMOTE_DELIVERY_CREDITS, Security, StreamId,
    TokenCheck,
};
use felix_engine::{EngineConfig, LogShardId};
use felix_storage::{BackendChoice, FaultBackend, FaultHandle, FsyncMode, PowerCut};
use felix_wire::Limits;

use crate::client::Client;
use crate::oracle::Oracle;
use crate::rng::Rng;
use crate::trace::Trace;

/// Wall-clock time of the simulation's start, stamped on records (any fixed value works).
const BASE_UNIX_US: u64 = 1_800_000_000_000_000;
/// Segment size of the simulated logs: small, so segments roll over within a run.
const SEGMENT_BYTES: u64 = 256 << 10;
/// The segment size of the runs that roll often (the smallest a log accepts): a run writes a
/// few hundred KiB at most, so with 256 KiB segments it would rarely leave its first one.
const SMALL_SEGMENT_BYTES: u64 = 16 << 10;

/// The shape of one run, drawn from its seed.
#[derive(Debug, Clone)]
pub struct Shape {
    pub cores: u16,
    pub clients: usize,
    pub steps: u64,
    pub fsync: FsyncMode,
    pub ingress: IngressSettings,
    pub ring_max_records: usize,
    pub subscriber_queue_max_bytes: u64,
    pub mesh_capacity: usize,
    /// Per mille of steps that inject a storage fault or crash.
    pub fault_rate: u64,
    pub crashes_max: u32,
    /// Clients connect as principals `p<client % 3>` under [`SIM_RULES`] (else the open
    /// development mode).
    pub secured: bool,
    /// `(max_round_bytes, max_pending_bytes)` of the logs when small (so a held disk fills
    /// the pending bound and appends wait in the engine); `None`: the defaults.
    pub log_bounds: Option<(usize, usize)>,
    /// Half the runs stage rounds for O_DIRECT (whole blocks, the tail block rewritten);
    /// the fault backend writes the staged bytes, so its power cuts see them.
    pub direct_io: bool,
    /// Half the runs use the smallest segments, so logs roll many times (the pre-roll round,
    /// the next segment's file made ahead, sidecars, recovery across segments).
    pub small_segments: bool,
    /// Per mille of the logs' looks at the page cache that miss (0, 300 or 1000): a missed
    /// catch-up read waits for its fetch, which the fault backend holds until a step
    /// completes it (`World::complete_fetch`), and is answered at a later pump.
    pub read_misses: u64,
    /// Write rounds in flight per log (1 or 2, `LogConfig::rounds_in_flight`); with 2 the
    /// steps also perform a held round's write alone (the log may then submit a second
    /// round) and complete the newer of two rounds first.
    pub rounds_in_flight: usize,
}

/// The rules of a secured run: p0 may do everything; p1 publishes and subscribes on s0 and s1
/// only (it may not even see s2); p2 subscribes anywhere and publishes to s2; everyone
/// subscribes to s0. So every request kind is both allowed and denied for some principal and
/// name, and the lists differ.
pub const SIM_RULES: &str =
    "p0 all *; p1 publish,subscribe s0,s1; p2 subscribe s*; p2 publish s2; * subscribe s0";

impl Shape {
    pub fn draw(rng: &mut Rng, steps: u64) -> Shape {
        let fsync = if rng.chance(750) {
            FsyncMode::OnCommit
        } else {
            FsyncMode::Periodic {
                interval: Duration::from_millis(rng.range(5, 200)),
            }
        };
        Shape {
            cores: u16::try_from(rng.range(1, 4)).expect("small"),
            clients: usize::try_from(rng.range(1, 4)).expect("small"),
            steps,
            fsync,
            ingress: IngressSettings {
                depth: rng.range(1, 8),
                budget_bytes: [64, 512, 4096, 1 << 20][rng.index(4)],
                fire_and_forget_waits: rng.chance(300),
                ack_on_commit: rng.chance(300),
                commit_wait: Duration::from_millis(rng.range(5, 400)),
            },
            ring_max_records: usize::try_from(rng.range(2, 64)).expect("small"),
            subscriber_queue_max_bytes: [256, 2048, 1 << 16][rng.index(3)],
            mesh_capacity: usize::try_from(rng.range(1, 16)).expect("small"),
            fault_rate: [0, 2, 10][rng.index(3)],
            crashes_max: u32::try_from(rng.range(0, 3)).expect("small"),
            secured: rng.chance(300),
            log_bounds: rng
                .chance(500)
                .then(|| [(4096, 4096), (4096, 8192), (4096, 16384)][rng.index(3)]),
            direct_io: rng.chance(500),
            small_segments: rng.chance(500),
            read_misses: [0, 300, 1000][rng.index(3)],
            rounds_in_flight: if rng.chance(500) { 2 } else { 1 },
        }
    }

    fn durable(&self) -> DurableSettings {
        DurableSettings {
            fsync: self.fsync,
            backend: BackendChoice::Pwrite,
            direct_io: self.direct_io,
            rounds_in_flight: self.rounds_in_flight,
            segment_bytes: if self.small_segments {
                SMALL_SEGMENT_BYTES
            } else {
                SEGMENT_BYTES
            },
            retention_bytes: None,
            retention_age: None,
        }
    }
}

/// One simulated core: its machine, its log and the log's fault handle.
pub struct SimCore {
    pub core: Core,
    pub log: DurableLog<FaultBackend>,
    pub fault: FaultHandle,
}

/// Counts of what a run exercised (printed in the summary, to show coverage).
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub frames: u64,
    pub acks: u64,
    pub refused: u64,
    pub shed: u64,
    pub waits: u64,
    pub deliveries: u64,
    pub lagged: u64,
    pub resumed: u64,
    pub crashes: u64,
    pub power_cuts: u64,
    /// Power cuts that tore the unsynced bytes sector by sector.
    pub torn_cuts: u64,
    pub fsync_failures: u64,
    pub disk_full: u64,
    /// Log pumps that left appends waiting in the engine: the pending bound was full.
    pub appends_held: u64,
    pub catalog_failures: u64,
    pub messages: u64,
    pub rounds: u64,
    /// Round writes performed alone (their fdatasync left outstanding), and rounds completed
    /// ahead of an older one (two in flight).
    pub writes_alone: u64,
    pub newest_first: u64,
    /// Log pumps that left two rounds in flight.
    pub two_in_flight: u64,
    pub durable_checked: u64,
    /// Requests and subscriptions refused by the rules (secured runs).
    pub denied: u64,
    /// Catch-up read fetches completed (reads that missed the page cache).
    pub fetches: u64,
}

impl Stats {
    pub fn add(&mut self, other: &Stats) {
        self.frames += other.frames;
        self.acks += other.acks;
        self.refused += other.refused;
        self.shed += other.shed;
        self.waits += other.waits;
        self.deliveries += other.deliveries;
        self.lagged += other.lagged;
        self.resumed += other.resumed;
        self.crashes += other.crashes;
        self.power_cuts += other.power_cuts;
        self.torn_cuts += other.torn_cuts;
        self.fsync_failures += other.fsync_failures;
        self.disk_full += other.disk_full;
        self.appends_held += other.appends_held;
        self.catalog_failures += other.catalog_failures;
        self.messages += other.messages;
        self.rounds += other.rounds;
        self.writes_alone += other.writes_alone;
        self.newest_first += other.newest_first;
        self.two_in_flight += other.two_in_flight;
        self.durable_checked += other.durable_checked;
        self.denied += other.denied;
        self.fetches += other.fetches;
    }
}

/// Publish outcomes per core as the clients see them, for the exact-count checks.
#[derive(Debug, Default, Clone, Copy)]
pub struct Fed {
    pub acked: u64,
    pub fire_and_forget: u64,
    /// Refusals the clients read (`IngressBudgetExhausted`).
    pub refused: u64,
    /// Parked publishes whose stream the client closed (never admitted, never answered).
    pub cancelled_acked: u64,
    pub cancelled_fire_and_forget: u64,
}

/// The whole simulated broker and its clients.
pub struct World {
    pub rng: Rng,
    pub shape: Shape,
    dir: tempfile::TempDir,
    base: Instant,
    pub clock: Duration,
    pub cores: Vec<SimCore>,
    catalog: Catalog,
    /// Indexed `from * cores + to`.
    mesh: Vec<VecDeque<CoreMessage>>,
    pub clients: Vec<Client>,
    pub oracle: Oracle,
    pub trace: Trace,
    pub stats: Stats,
    /// Per core since the last restart.
    pub fed: Vec<Fed>,
    /// A core hit a fatal storage error: the process would exit now; nothing more happens
    /// until the crash is carried out.
    pub halted: bool,
    /// What every core enforces ([`SIM_RULES`] when secured), and each client's rules.
    pub policy: Policy,
    pub accesses: Vec<Access>,
}

impl World {
    pub fn new(seed: u64, steps: u64, trace: Trace) -> World {
        let mut rng = Rng::new(seed);
        let shape = Shape::draw(&mut rng, steps);
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut catalog = Catalog::load(dir.path()).expect("an empty catalogue");
        catalog.bind_cores(shape.cores).expect("bound");
        let clients = (0..shape.clients).map(|_| Client::new()).collect();
        let policy = if shape.secured {
            Policy::from_rules(Rules::parse(SIM_RULES).expect("the simulation's rules parse"))
        } else {
            Policy::open()
        };
        let accesses = (0..shape.clients)
            .map(|client| policy.access(&principal(client)))
            .collect();
        let mut world = World {
            policy,
            accesses,
            rng,
            shape,
            dir,
            base: Instant::now(),
            clock: Duration::ZERO,
            cores: Vec::new(),
            catalog,
            mesh: Vec::new(),
            clients,
            oracle: Oracle::default(),
            trace,
            stats: Stats::default(),
            fed: Vec::new(),
            halted: false,
        };
        world.trace.line(format!("shape {:?}", world.shape));
        world.open_cores();
        world
    }

    pub fn now(&self) -> Now {
        Now {
            at: self.base + self.clock,
            unix_us: BASE_UNIX_US + u64::try_from(self.clock.as_micros()).expect("a short run"),
        }
    }

    /// The principal client `client` connects as in a secured run.
    pub fn principal_of(&self, client: usize) -> Option<Principal> {
        self.shape.secured.then(|| principal(client))
    }

    /// Whether client `client` may do `operation` on stream `name`.
    pub fn allowed(&self, client: usize, operation: Operation, name: &str) -> bool {
        self.accesses[client].allows(operation, name)
    }

    fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Opens (recovers) every core's log and builds the machines from the catalogue.
    fn open_cores(&mut self) {
        let cores = self.shape.cores;
        let entries: Vec<_> = self.catalog.entries().cloned().collect();
        let core_ports: Vec<u16> = (0..cores).map(|i| 7401 + i).collect();
        // One per broker start: its per-principal ledger is shared by every core.
        let security = std::sync::Arc::new(Security::new(
            false,
            self.policy.clone(),
            ConnectionLimits::DEFAULT,
        ));
        let read_seeds: Vec<u64> = (0..cores).map(|_| self.rng.next_u64()).collect();
        self.cores = (0..cores)
            .map(|index| {
                let (backend, fault) = FaultBackend::new(false).expect("fault backend");
                fault.set_read_misses(self.shape.read_misses, read_seeds[usize::from(index)]);
                let mut config = self
                    .shape
                    .durable()
                    .log_config(self.dir.path(), usize::from(index));
                if let Some((round, pending)) = self.shape.log_bounds {
                    config.max_round_bytes = round;
                    config.max_pending_bytes = pending;
                }
                let log = DurableLog::open(usize::from(index), config, backend).expect("recovered");
                let mut core = Core::new(CoreConfig {
                    index,
                    core_count: cores,
                    core_ports: core_ports.clone(),
                    limits: Limits::DEFAULT,
                    engine: EngineConfig {
                        ring_max_records: self.shape.ring_max_records,
                        ring_max_bytes: 1 << 20,
                        subscriber_queue_max_bytes: self.shape.subscriber_queue_max_bytes,
                        ..EngineConfig::default()
                    },
                    ingress: self.shape.ingress,
                    next_stream_id: self.catalog.next_stream_id(),
                    security: std::sync::Arc::clone(&security),
                });
                core.restore_durable(&log, &entries).expect("restored");
                SimCore { core, log, fault }
            })
            .collect();
        let pairs = usize::from(cores) * usize::from(cores);
        self.mesh = (0..pairs).map(|_| VecDeque::new()).collect();
        self.fed = vec![Fed::default(); usize::from(cores)];
    }

    // ---- the shell's part ----

    /// What the broker shell does after every input on core `index`: felix-core's driver
    /// (`dataplane/core/src/driver.rs`, the shell's own drain: its rounds, its order, the log
    /// pumped at most once per input) with the simulation's effects ([`SimEffects`]): outbox
    /// into the mesh (what does not fit waits), catalogue writes (core 0; some fail), cluster
    /// requests refused (not a member), the log pumped on the fault backend. Then every core's
    /// invariants are checked.
    pub fn drain(&mut self, index: u16) {
        if self.halted {
            return;
        }
        let now = self.now();
        let _ = driver::drain(&mut SimEffects { world: self, index }, now);
    }

    /// Moves core `from`'s outbox into the mesh while the queues have room (the driver's
    /// `send_messages`, as the broker's pump does when room is freed).
    fn send_messages(&mut self, from: u16) {
        driver::send_messages(&mut SimEffects {
            world: self,
            index: from,
        });
    }

    /// Pumps a core's log; a fatal error halts the broker (the process would exit).
    pub fn pump(&mut self, index: u16) {
        let now = self.now();
        let sim = &mut self.cores[usize::from(index)];
        let max_pending = sim.log.log().config().max_pending_bytes;
        match sim.core.pump_log(&mut sim.log, now) {
            Ok(report) => {
                if sim.fault.held_rounds() > 1 {
                    self.stats.two_in_flight += 1;
                }
                assert!(
                    sim.log.log().pending_bytes() <= max_pending,
                    "core {index}: {} bytes pending over the bound {max_pending}",
                    sim.log.log().pending_bytes()
                );
                if report.held {
                    self.stats.appends_held += 1;
                    assert!(
                        sim.fault.held_rounds() > 0,
                        "core {index}: appends wait with no round in flight to wake the log"
                    );
                }
                if sim.log.reads_waiting() > 0 {
                    assert!(
                        sim.fault.held_fetches() > 0,
                        "core {index}: catch-up reads wait with no fetch in flight to wake the log"
                    );
                }
            }
            Err(error) => {
                assert!(error.is_fatal(), "pump errors are fatal: {error}");
                self.trace.line(format!(
                    "  core{index} fatal storage error: {}",
                    felix_storage::ErrorChain(&error)
                ));
                self.halted = true;
            }
        }
    }

    /// Delivers the oldest message of one random non-empty queue.
    pub fn deliver_message(&mut self) -> bool {
        let busy: Vec<usize> = (0..self.mesh.len())
            .filter(|&queue| !self.mesh[queue].is_empty())
            .collect();
        if busy.is_empty() {
            return false;
        }
        let queue = busy[self.rng.index(busy.len())];
        let message = self.mesh[queue].pop_front().expect("non-empty");
        let cores = usize::from(self.shape.cores);
        let to = u16::try_from(queue % cores).expect("a core index");
        let from = queue / cores;
        self.trace.line(format!(
            "  mesh {from}->{to} {}",
            describe_message(&message)
        ));
        self.stats.messages += 1;
        let now = self.now();
        self.cores[usize::from(to)]
            .core
            .handle_message(now, message);
        self.drain(to);
        // Room freed in the queue: the sender's outbox may move on.
        let from = u16::try_from(from).expect("a core index");
        self.send_messages(from);
        true
    }

    /// Completes one held log round of a random core (maybe failing it first), then pumps.
    pub fn complete_round(&mut self, inject: bool) -> bool {
        let held: Vec<u16> = (0..self.shape.cores)
            .filter(|&index| self.cores[usize::from(index)].fault.held_rounds() > 0)
            .collect();
        if held.is_empty() {
            return false;
        }
        let index = held[self.rng.index(held.len())];
        if inject {
            if self.rng.chance(300) {
                self.stats.fsync_failures += 1;
                self.trace
                    .line(format!("  core{index} next fdatasync fails (EIO)"));
                self.cores[usize::from(index)]
                    .fault
                    .fail_next_sync(libc::EIO);
            } else {
                self.stats.disk_full += 1;
                let written = usize::try_from(self.rng.below(200)).expect("small");
                self.trace.line(format!(
                    "  core{index} next write fails (ENOSPC after {written} bytes)"
                ));
                self.cores[usize::from(index)]
                    .fault
                    .fail_next_write(libc::ENOSPC, written);
            }
        }
        let fault = &self.cores[usize::from(index)].fault;
        if self.shape.rounds_in_flight > 1 && fault.unwritten_rounds() > 0 && self.rng.chance(400) {
            // The write alone: the round's fdatasync stays outstanding and the log may submit
            // a second round, whose write then runs during this fdatasync.
            self.stats.writes_alone += 1;
            self.trace
                .line(format!("  core{index} round write completes"));
            assert!(fault.write_next());
        } else if fault.held_rounds() > 1 && self.rng.chance(300) {
            self.stats.rounds += 1;
            self.stats.newest_first += 1;
            self.trace
                .line(format!("  core{index} newest round completes first"));
            assert!(fault.complete_newest());
        } else {
            self.stats.rounds += 1;
            self.trace.line(format!("  core{index} round completes"));
            assert!(fault.complete_next());
        }
        self.pump(index);
        if !self.halted {
            self.drain(index);
        }
        true
    }

    /// Completes the oldest held read fetch of a random core, then pumps (what the log's
    /// eventfd does in the broker).
    pub fn complete_fetch(&mut self) -> bool {
        let held: Vec<u16> = (0..self.shape.cores)
            .filter(|&index| self.cores[usize::from(index)].fault.held_fetches() > 0)
            .collect();
        if held.is_empty() {
            return false;
        }
        let index = held[self.rng.index(held.len())];
        self.stats.fetches += 1;
        self.trace
            .line(format!("  core{index} read fetch completes"));
        assert!(self.cores[usize::from(index)].fault.complete_next_fetch());
        self.pump(index);
        if !self.halted {
            self.drain(index);
        }
        true
    }

    /// Advances the logical clock, then fires what is due: admission deadlines, periodic
    /// fsyncs.
    pub fn advance(&mut self, by: Duration) {
        self.clock += by;
        let now = self.now();
        for index in 0..self.shape.cores {
            if self.halted {
                return;
            }
            let sim = &mut self.cores[usize::from(index)];
            if sim.core.poll_timeout().is_some_and(|at| at <= now.at) {
                sim.core.handle_timeout(now);
            }
            if sim.log.next_deadline().is_some_and(|at| at <= now.at) {
                self.pump(index);
            }
            self.drain(index);
        }
    }

    // ---- crashes ----

    /// The broker dies (a power cut, or the process is killed), restarts from its disk, and
    /// every acknowledged or delivered durable record must be there.
    pub fn crash(&mut self, power_cut: Option<PowerCut>) {
        self.stats.crashes += 1;
        self.trace.line(format!("crash: power cut {power_cut:?}"));
        if let Some(how) = power_cut {
            self.stats.power_cuts += 1;
            if matches!(how, PowerCut::TearUnsynced { .. }) {
                self.stats.torn_cuts += 1;
            }
            for sim in &self.cores {
                sim.fault.power_cut(how).expect("power cut");
            }
        }
        self.cores.clear();
        self.halted = false;
        for client in &mut self.clients {
            client.reset();
        }
        self.oracle.crash();
        self.catalog = Catalog::load(self.dir()).expect("the catalogue recovers");
        self.open_cores();
        let catalogued: BTreeMap<String, u32> = self
            .catalog
            .entries()
            .map(|entry| (entry.name.clone(), entry.shards))
            .collect();
        let contradictions = self.oracle.resolve(&catalogued);
        assert!(
            contradictions.is_empty(),
            "after the crash the catalogue contradicts acknowledged changes of {contradictions:?}"
        );
        self.check_durable();
    }

    /// Every acknowledged or delivered record of every current durable incarnation is in its
    /// core's log, byte for byte, at its offset.
    fn check_durable(&mut self) {
        let entries: Vec<_> = self.catalog.entries().cloned().collect();
        let cores = self.shape.cores;
        for entry in entries {
            let Some(state) = self.oracle.names.get(&entry.name) else {
                continue;
            };
            let Some(id) = state.current else { continue };
            let inc = &self.oracle.incarnations[&id];
            for (shard, records) in inc.records.iter().enumerate() {
                let shard = u32::try_from(shard).expect("few shards");
                let must: Vec<(u64, &crate::oracle::Seen)> = records
                    .iter()
                    .filter(|(_, seen)| seen.acked || seen.delivered)
                    .map(|(offset, seen)| (*offset, seen))
                    .collect();
                if must.is_empty() {
                    continue;
                }
                let log_shard = LogShardId::new(entry.stream_id, shard).expect("in range");
                let core = usize::from(felix_affinity::shard_core(shard, cores));
                let log = self.cores[core].log.log();
                for (offset, seen) in must {
                    let found = log.read(log_shard.0, offset, 1, usize::MAX).unwrap_or_else(
                        |error| {
                            panic!(
                                "acknowledged record {offset} of shard {shard} of {:?} is not in \
                                 the log after the crash: {}",
                                entry.name,
                                felix_storage::ErrorChain(&error)
                            )
                        },
                    );
                    let record = found.first().unwrap_or_else(|| {
                        panic!(
                            "acknowledged record {offset} of shard {shard} of {:?} is lost \
                             after the crash (log holds up to {:?})",
                            entry.name,
                            log.shard_offsets(log_shard.0)
                        )
                    });
                    assert_eq!(record.offset, offset, "the log reads from the offset asked");
                    assert!(
                        record.key == seen.key && record.payload == seen.payload,
                        "record {offset} of shard {shard} of {:?} changed across the crash",
                        entry.name
                    );
                    self.stats.durable_checked += 1;
                }
            }
        }
    }

    // ---- checks ----

    /// Every core's invariants, and the memory bounds of what waits between cores.
    ///
    /// Requests and answers are bounded by every core's ingress queue and the open streams
    /// (one admin/describe/subscribe in flight per stream, plus its answers). What belongs to
    /// one subscription is bounded per subscription, not by the open streams: a connection
    /// that goes away closes all its subscription streams at once, and their `Unsubscribe`s,
    /// last `Credit`s and the owners' `Ended`s wait until the mesh has room.
    pub fn check_invariants(&self) {
        let streams: usize = self.cores.iter().map(|sim| sim.core.stream_count()).sum();
        let cores = self.shape.cores as usize;
        let credits = REMOTE_DELIVERY_CREDITS as usize;
        for sim in &self.cores {
            sim.core.assert_invariants();
            let index = sim.core.index();
            let mut requests = 0usize;
            let mut per_subscription: HashMap<(u16, &'static str, u64), usize> = HashMap::new();
            for (to, message) in sim.core.outbox_messages() {
                let (kind, key, most) = match message {
                    CoreMessage::Deliver { id, .. } => ("Deliver", id.0, credits),
                    CoreMessage::Credit { id } => ("Credit", id.0, credits),
                    CoreMessage::Unsubscribe { id } => ("Unsubscribe", id.0, 1),
                    CoreMessage::Ended { slot, .. } => ("Ended", slot.0, 1),
                    _ => {
                        requests += 1;
                        continue;
                    }
                };
                let count = per_subscription.entry((to, kind, key)).or_default();
                *count += 1;
                assert!(
                    *count <= most,
                    "core {index} holds {count} {kind} messages for {key} to core {to}, \
                     over the bound {most}"
                );
            }
            let bound = cores * (2 * self.shape.ingress.depth as usize) + streams * 3 + 16;
            assert!(
                requests <= bound,
                "core {index} holds {requests} outgoing requests and answers, over the bound \
                 {bound}"
            );
        }
    }

    /// Nothing waits anywhere: no message, no round, no parked request.
    pub fn quiet(&self) -> bool {
        self.mesh.iter().all(VecDeque::is_empty)
            && self.cores.iter().all(|sim| {
                sim.core.outbox_len() == 0
                    && sim.fault.held_rounds() == 0
                    && sim.fault.held_fetches() == 0
                    && !sim.core.has_log_work()
            })
    }
}

/// What the simulation does for each output of the driver (`dataplane/core/src/driver.rs`)
/// of core `index`.
struct SimEffects<'a> {
    world: &'a mut World,
    index: u16,
}

impl Effects for SimEffects<'_> {
    fn core(&mut self) -> &mut Core {
        &mut self.world.cores[usize::from(self.index)].core
    }

    fn send(&mut self, to: u16, message: CoreMessage) -> Result<(), CoreMessage> {
        let cores = usize::from(self.world.shape.cores);
        let queue = &mut self.world.mesh[usize::from(self.index) * cores + usize::from(to)];
        if queue.len() >= self.world.shape.mesh_capacity {
            return Err(message);
        }
        queue.push_back(message);
        Ok(())
    }

    fn write_catalog(&mut self, now: Now, write: CatalogWrite) {
        let world = &mut *self.world;
        let index = self.index;
        let result = if world.rng.chance(world.shape.fault_rate * 10) {
            world.stats.catalog_failures += 1;
            Err("injected: no space left on the catalogue's disk".to_owned())
        } else {
            world
                .catalog
                .apply(&write.change)
                .map_err(|error| felix_storage::ErrorChain(&error).to_string())
        };
        world.trace.line(format!(
            "  core{index} catalogue {:?}: {}",
            write.change,
            if result.is_ok() { "written" } else { "failed" }
        ));
        world.cores[usize::from(index)]
            .core
            .handle_catalog_written(now, write.id, result);
    }

    fn route_cluster(&mut self, _now: Now, request: ClusterRequest) -> Result<(), ClusterRequest> {
        // The simulated broker is not a cluster member: the driver refuses it.
        Err(request)
    }

    fn check_token(&mut self, _now: Now, _check: TokenCheck) {
        panic!(
            "core {}: a token check, but the simulation's clients send no token",
            self.index
        );
    }

    fn pump_log(&mut self, _now: Now) -> ControlFlow<()> {
        self.world.pump(self.index);
        if self.world.halted {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }

    fn stream_ready(&mut self, _stream: StreamId) {
        // Every stream may be read at any step anyway.
    }

    fn drained(&mut self, _now: Now) {
        self.world.check_invariants();
    }
}

/// A short name of a message for the step log.
fn describe_message(message: &CoreMessage) -> String {
    match message {
        CoreMessage::Publish { token, records, .. } => {
            format!("Publish#{token} x{}", records.len())
        }
        CoreMessage::PublishDone { token, result } => {
            format!(
                "PublishDone#{token} {}",
                if result.is_ok() { "ok" } else { "err" }
            )
        }
        CoreMessage::Admin { token, request, .. } => format!("Admin#{token} {request:?}"),
        CoreMessage::Apply { token, request } => format!("Apply#{token} {request:?}"),
        CoreMessage::Applied { token } => format!("Applied#{token}"),
        CoreMessage::AdminDone { token, .. } => format!("AdminDone#{token}"),
        CoreMessage::Describe { token, .. } => format!("Describe#{token}"),
        CoreMessage::DescribeDone { token, .. } => format!("DescribeDone#{token}"),
        CoreMessage::Subscribe { token, .. } => format!("Subscribe#{token}"),
        CoreMessage::SubscribeDone { token, .. } => format!("SubscribeDone#{token}"),
        CoreMessage::Deliver { slot, records, .. } => {
            format!("Deliver slot{} x{}", slot.0, records.len())
        }
        CoreMessage::Ended { slot, error } => format!("Ended slot{} {:?}", slot.0, error.code),
        CoreMessage::Credit { id } => format!("Credit {}", id.0),
        CoreMessage::Unsubscribe { id } => format!("Unsubscribe {}", id.0),
    }
}

/// The principal of client `client` in a secured run.
fn principal(client: usize) -> Principal {
    Principal::new(&format!("p{}", client % 3)).expect("a valid principal")
}
