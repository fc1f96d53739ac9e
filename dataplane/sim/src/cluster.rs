//! The cluster run: three brokers, each with N cores of the real `felix_core::Core` (drained
//! by felix-core's driver, as the broker's shell does) and the real cluster member
//! (`felix_cluster::member::Member`), linked by the same IO-free link the broker uses
//! (`felix_cluster::link`), every log on the storage crate's fault backend, over a simulated
//! peer network (loss, delays so reordering, partitions), on simulated time. Clients speak
//! the wire protocol to random cores of random brokers: one creates a replicated stream
//! (`CreateClusterStream`), all publish acked batches of uniquely named records with random
//! keys. Brokers are killed (every log's unsynced bytes lost or torn, as at a power cut) and
//! restarted from their directories; leaders change under load; Raft logs compact behind
//! the record logs, so a member that was down fetches the records it missed.
//!
//! Checked after every step: every core's invariants. At the end, healed and quiet, every
//! member's copy of every shard is read back: the same records at the same offsets, dense
//! from 0; every acknowledged record exactly once, at the offsets its ack named; no record
//! twice.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use felix_cluster::link::{self, EventSink, LinkEvent, Routed};
use felix_cluster::member::{Member, MemberConfig, Request};
use felix_cluster::records::RecordsConfig;
use felix_cluster::service::{Answer, ClusterStatus, ServiceError};
use felix_cluster::shard::ShardRecord;
use felix_core::driver::{self, Effects};
use felix_core::{
    Catalog, CatalogWrite, ClusterRequest, ConnectionId, ConnectionLimits, Core, CoreConfig,
    CoreMessage, DurableLog, DurableSettings, IngressSettings, Now, Security, StreamId, TokenCheck,
};
use felix_engine::EngineConfig;
use felix_storage::{BackendChoice, FaultBackend, FaultHandle, FsyncMode, PowerCut};
use felix_wire::{
    AckMode, CreateClusterStream, Decoder, ErrorCode, FEATURE_PRODUCER, Frame, Hello, Limits,
    PROTOCOL_VERSION, ProducerPublish, Publish, Record, StreamKind,
};

use crate::rng::Rng;
use crate::trace::Trace;

const BROKERS: u64 = 3;
const STREAM: &str = "cs";
const SHARDS: u32 = 3;
/// Simulated time per step.
const STEP: Duration = Duration::from_millis(5);
const BASE_UNIX_US: u64 = 1_800_000_000_000_000;
const MESH_CAPACITY: usize = 64;
/// Requests a client keeps in flight at most.
const IN_FLIGHT_MAX: usize = 8;

/// The shape of one cluster run, drawn from its seed.
#[derive(Debug, Clone)]
pub struct ClusterShape {
    pub cores: u16,
    pub clients: usize,
    pub steps: u64,
    /// Per mille of peer frames lost.
    pub loss: u32,
    /// Per 10,000 steps (of 5 ms) that start or end a fault (a partition, a kill).
    pub fault_rate: u64,
    /// Raft entries a shard group keeps before it compacts (small: members behind fetch).
    pub compact_after: u64,
    /// Per mille of the record logs' looks at the page cache that miss: a miss holds the
    /// read (a member's copy read, a peer's fetch, a subscriber's) until `disks` completes
    /// its fetch. From the seed itself (0, 300 or 1,000), not drawn, so the other draws of a
    /// seed stay as they were.
    pub read_misses: u64,
}

impl ClusterShape {
    fn draw(rng: &mut Rng, steps: u64) -> ClusterShape {
        ClusterShape {
            cores: u16::try_from(rng.range(1, 3)).expect("small"),
            clients: usize::try_from(rng.range(1, 4)).expect("small"),
            steps,
            loss: [0, 10, 50][rng.index(3)],
            fault_rate: [0, 4, 10][rng.index(3)],
            compact_after: [16, 64, 10_000][rng.index(3)],
            read_misses: 0,
        }
    }
}

/// What a passing cluster run did.
#[derive(Debug, Clone, Default)]
pub struct ClusterStats {
    pub publishes: u64,
    /// Idempotent batches sent again (after `unavailable`, or their broker's kill).
    pub retries: u64,
    pub acked: u64,
    pub refused: u64,
    pub kills: u64,
    pub partitions: u64,
    pub records: u64,
    /// Record-log reads that missed the page cache and waited for their fetch.
    pub fetches: u64,
}

impl ClusterStats {
    pub fn add(&mut self, other: &ClusterStats) {
        self.publishes += other.publishes;
        self.retries += other.retries;
        self.acked += other.acked;
        self.refused += other.refused;
        self.kills += other.kills;
        self.partitions += other.partitions;
        self.records += other.records;
        self.fetches += other.fetches;
    }
}

/// One core of a running broker.
struct NodeCore {
    core: Core,
    log: DurableLog<FaultBackend>,
    fault: FaultHandle,
}

/// One broker: its member and cores while it runs, its directory always.
struct Node {
    dir: PathBuf,
    /// Its election timeout in ticks, drawn from the seed (so the run replays).
    election_tick: usize,
    runs: u64,
    member: Option<Member<FaultBackend>>,
    /// The fault handles of the member's logs (opened through its backend opener).
    member_faults: Rc<RefCell<Vec<FaultHandle>>>,
    cores: Vec<NodeCore>,
    /// Indexed `from * cores + to`.
    mesh: Vec<VecDeque<CoreMessage>>,
    catalog: Option<Catalog>,
    /// The member's answers to each core, in order (the broker's per-core channels).
    events: Arc<Mutex<VecDeque<(u16, LinkEvent)>>>,
    sinks: Vec<EventSink>,
}

impl Node {
    fn alive(&self) -> bool {
        self.member.is_some()
    }
}

/// What a core's drain does in the cluster run: the mesh queues, the catalogue, the member
/// (through the link), the log.
struct NodeEffects<'a> {
    cores: &'a mut [NodeCore],
    index: usize,
    mesh: &'a mut [VecDeque<CoreMessage>],
    catalog: &'a mut Catalog,
    member: &'a mut Member<FaultBackend>,
    sinks: &'a [EventSink],
}

impl Effects for NodeEffects<'_> {
    fn core(&mut self) -> &mut Core {
        &mut self.cores[self.index].core
    }

    fn send(&mut self, to: u16, message: CoreMessage) -> Result<(), CoreMessage> {
        let queue = &mut self.mesh[self.index * self.cores.len() + usize::from(to)];
        if queue.len() >= MESH_CAPACITY {
            return Err(message);
        }
        queue.push_back(message);
        Ok(())
    }

    fn write_catalog(&mut self, now: Now, write: CatalogWrite) {
        let result = self
            .catalog
            .apply(&write.change)
            .map_err(|error| felix_storage::ErrorChain(&error).to_string());
        self.cores[self.index]
            .core
            .handle_catalog_written(now, write.id, result);
    }

    fn route_cluster(&mut self, now: Now, request: ClusterRequest) -> Result<(), ClusterRequest> {
        let core = u16::try_from(self.index).expect("a core index");
        match link::route(core, request, now.at, &self.sinks[self.index]) {
            Routed::Request(request) => self.member.handle_request(now.at, request),
            Routed::Subscription(control) => self.member.handle_subscription(control),
        }
        Ok(())
    }

    fn check_token(&mut self, _now: Now, _check: TokenCheck) {
        unreachable!("the cluster run's clients send no tokens");
    }

    fn pump_log(&mut self, now: Now) -> ControlFlow<()> {
        let sim = &mut self.cores[self.index];
        match sim.core.pump_log(&mut sim.log, now) {
            Ok(_) => ControlFlow::Continue(()),
            Err(error) => panic!("the cluster run's core logs do not fail: {error}"),
        }
    }

    fn stream_ready(&mut self, _stream: StreamId) {}

    fn drained(&mut self, _now: Now) {
        self.cores[self.index].core.assert_invariants();
    }
}

/// A batch a client published: its records' names, the frame (sent again as it is when
/// retried), the answer.
#[derive(Debug, Clone)]
struct Batch {
    client: usize,
    names: Vec<String>,
    frame: Frame,
    outcome: Option<Result<Vec<felix_wire::ShardAck>, ErrorCode>>,
    /// Times it was sent again.
    retries: u32,
}

/// A client's connection to one core of one broker.
struct Conn {
    node: u64,
    run: u64,
    core: u16,
    id: ConnectionId,
    stream: StreamId,
    ready: bool,
    to_send: VecDeque<Frame>,
    inbuf: BytesMut,
    /// Request ids waiting for an answer on this connection.
    waiting: BTreeSet<u64>,
}

#[derive(Default)]
struct SimClient {
    conn: Option<Conn>,
    next_request: u64,
    /// The next sequence of this client's idempotent producer on each shard.
    sequences: BTreeMap<u32, u64>,
    /// Publishes to send again (their answer was a retryable refusal, or their connection
    /// went with its broker): the same producer id and sequence, so applied once.
    retry: VecDeque<u64>,
}

/// The whole cluster run.
pub struct ClusterWorld {
    pub rng: Rng,
    pub shape: ClusterShape,
    _root: tempfile::TempDir,
    base: Instant,
    clock: Duration,
    nodes: BTreeMap<u64, Node>,
    network: Vec<(Duration, u64, u64, Bytes)>,
    cut: BTreeSet<(u64, u64)>,
    clients: Vec<SimClient>,
    /// Every publish by request id (ids are unique across clients).
    batches: HashMap<u64, Batch>,
    next_batch: u64,
    /// Request ids of the creations asked (refused early: too few members registered yet).
    creates: BTreeSet<u64>,
    created: bool,
    pub trace: Trace,
    pub stats: ClusterStats,
    /// Draws the completions of the record logs' held fetches (apart from `rng`, so a seed
    /// without read misses runs as it did before they existed).
    fetch_rng: Rng,
}

impl ClusterWorld {
    pub fn new(seed: u64, steps: u64, trace: Trace) -> ClusterWorld {
        let mut rng = Rng::new(seed);
        let mut shape = ClusterShape::draw(&mut rng, steps);
        shape.read_misses = [0, 300, 1_000][usize::try_from(seed % 3).expect("small")];
        let root = tempfile::tempdir().expect("a temporary directory");
        let mut world = ClusterWorld {
            rng,
            clients: (0..shape.clients).map(|_| SimClient::default()).collect(),
            shape,
            base: Instant::now(),
            clock: Duration::ZERO,
            nodes: BTreeMap::new(),
            network: Vec::new(),
            cut: BTreeSet::new(),
            batches: HashMap::new(),
            next_batch: 1,
            creates: BTreeSet::new(),
            created: false,
            trace,
            stats: ClusterStats::default(),
            fetch_rng: Rng::new(seed ^ 0x5EED_F37C),
            _root: root,
        };
        world.trace.line(format!("cluster shape {:?}", world.shape));
        for id in 1..=BROKERS {
            let dir = world._root.path().join(format!("broker-{id}"));
            world.nodes.insert(
                id,
                Node {
                    dir,
                    election_tick: usize::try_from(world.rng.range(10, 19)).expect("small"),
                    runs: 0,
                    member: None,
                    member_faults: Rc::new(RefCell::new(Vec::new())),
                    cores: Vec::new(),
                    mesh: Vec::new(),
                    catalog: None,
                    events: Arc::new(Mutex::new(VecDeque::new())),
                    sinks: Vec::new(),
                },
            );
            world.start(id);
        }
        world
    }

    fn now(&self) -> Now {
        Now {
            at: self.base + self.clock,
            unix_us: BASE_UNIX_US + u64::try_from(self.clock.as_micros()).expect("a short run"),
        }
    }

    /// Starts (or restarts) broker `id` from its directory: its member, then its cores.
    fn start(&mut self, id: u64) {
        let now = self.now();
        let cores = self.shape.cores;
        let compact_after = self.shape.compact_after;
        let node = self.nodes.get_mut(&id).expect("a broker");
        node.runs += 1;
        node.member_faults.borrow_mut().clear();
        let faults = Rc::clone(&node.member_faults);
        let control_dir = node.dir.join("cluster").join("raft");
        let held_dir = control_dir.clone();
        let read_misses = self.shape.read_misses;
        let runs = node.runs;
        let open = Box::new(move |dir: &Path| {
            let (backend, fault) = FaultBackend::new(true)?;
            if felix_cluster::groups::is_shared_raft_log(dir) || dir == held_dir {
                // The Raft logs' writes (the shard groups' and the control plane's) stay in
                // flight across steps (`Sim::disks`).
                fault.hold_rounds(true);
            } else {
                // A record log: its reads miss the page cache as the seed says, and wait.
                let opened = faults.borrow().len() as u64;
                fault.set_read_misses(read_misses, (id << 40) ^ (runs << 20) ^ opened);
            }
            faults.borrow_mut().push(fault);
            Ok(backend)
        });
        let config = MemberConfig {
            member: felix_cluster::control::Member {
                id,
                client_addr: format!("127.0.0.1:{}", 7400 + id * 10),
                peer_addr: format!("127.0.0.1:{}", 7500 + id),
                cores,
            },
            peers: (1..=BROKERS).filter(|peer| *peer != id).collect(),
            dir: control_dir,
            records: RecordsConfig {
                compact_after,
                ..RecordsConfig::default()
            },
            boot: id * 1_000 + node.runs,
            fixed_election_tick: Some(node.election_tick),
        };
        node.member = Some(Member::open(config, now.at, open).expect("the member opens"));
        let mut catalog = Catalog::load(&node.dir).expect("the catalogue");
        catalog.bind_cores(cores).expect("bound");
        let entries: Vec<_> = catalog.entries().cloned().collect();
        let security = Arc::new(Security::new(
            false,
            felix_auth::Policy::open(),
            ConnectionLimits::DEFAULT,
        ));
        let durable = DurableSettings {
            fsync: FsyncMode::OnCommit,
            backend: BackendChoice::Pwrite,
            direct_io: false,
            rounds_in_flight: 1,
            segment_bytes: 256 << 10,
            retention_bytes: None,
            retention_age: None,
        };
        node.cores = (0..cores)
            .map(|index| {
                let (backend, fault) = FaultBackend::new(true).expect("fault backend");
                let log = DurableLog::open(
                    usize::from(index),
                    durable.log_config(&node.dir, usize::from(index)),
                    backend,
                )
                .expect("recovered");
                let mut core = Core::new(CoreConfig {
                    index,
                    core_count: cores,
                    core_ports: (0..cores).map(|i| 7401 + i).collect(),
                    limits: Limits::DEFAULT,
                    engine: EngineConfig::default(),
                    ingress: IngressSettings {
                        depth: 64,
                        budget_bytes: 1 << 20,
                        fire_and_forget_waits: false,
                        ack_on_commit: false,
                        commit_wait: Duration::from_millis(100),
                    },
                    next_stream_id: catalog.next_stream_id(),
                    security: Arc::clone(&security),
                });
                core.restore_durable(&log, &entries).expect("restored");
                NodeCore { core, log, fault }
            })
            .collect();
        node.catalog = Some(catalog);
        let pairs = usize::from(cores) * usize::from(cores);
        node.mesh = (0..pairs).map(|_| VecDeque::new()).collect();
        node.events.lock().expect("lock").clear();
        node.sinks = (0..cores)
            .map(|index| {
                let events = Arc::clone(&node.events);
                let sink: EventSink = Arc::new(move |event| {
                    events.lock().expect("lock").push_back((index, event));
                });
                sink
            })
            .collect();
        self.trace
            .line(format!("broker {id} starts (run {})", self.nodes[&id].runs));
    }

    /// SIGKILL and a power cut at once: every log of the broker loses what no fdatasync
    /// covered (torn per sector); its clients' connections are gone.
    fn kill(&mut self, id: u64) {
        let seed = self.rng.next_u64();
        let node = self.nodes.get_mut(&id).expect("a broker");
        if !node.alive() {
            return;
        }
        for fault in node.member_faults.borrow().iter() {
            fault
                .power_cut(PowerCut::TearUnsynced { seed })
                .expect("power cut");
        }
        for core in &node.cores {
            core.fault
                .power_cut(PowerCut::TearUnsynced { seed })
                .expect("power cut");
        }
        node.member = None;
        node.cores.clear();
        node.mesh.clear();
        node.catalog = None;
        node.events.lock().expect("lock").clear();
        for client in 0..self.clients.len() {
            if self.clients[client]
                .conn
                .as_ref()
                .is_some_and(|conn| conn.node == id)
            {
                self.lose_conn(client);
            }
        }
        self.stats.kills += 1;
        self.trace.line(format!("broker {id} killed (power cut)"));
    }

    fn linked(&self, from: u64, to: u64) -> bool {
        self.nodes[&from].alive() && self.nodes[&to].alive() && !self.cut.contains(&(from, to))
    }

    /// Drains core `index` of broker `id` (felix-core's driver with the cluster run's
    /// effects).
    fn drain(&mut self, id: u64, index: usize) {
        let now = self.now();
        let node = self.nodes.get_mut(&id).expect("a broker");
        let (Some(member), Some(catalog)) = (node.member.as_mut(), node.catalog.as_mut()) else {
            return;
        };
        let mut effects = NodeEffects {
            cores: &mut node.cores,
            index,
            mesh: &mut node.mesh,
            catalog,
            member,
            sinks: &node.sinks,
        };
        let _ = driver::drain(&mut effects, now);
    }

    fn drain_all(&mut self, id: u64) {
        for index in 0..self.nodes[&id].cores.len() {
            self.drain(id, index);
        }
    }

    // ---- one step ----

    fn step(&mut self, faults: bool) {
        self.clock += STEP;
        if faults {
            self.maybe_fault();
        }
        self.disks();
        let ids: Vec<u64> = self.nodes.keys().copied().collect();
        for &id in &ids {
            self.tick(id);
        }
        self.deliver_frames();
        for &id in &ids {
            self.deliver_mesh(id);
            self.advance(id);
            self.deliver_events(id);
        }
        // Clients publish while the run makes faults; quiet, they only send their retries.
        if self.rng.chance(300) {
            let client = self.rng.index(self.clients.len());
            self.client_act(client, faults);
        }
        for client in 0..self.clients.len() {
            self.client_io(client);
        }
    }

    /// The members' shared shard-group logs finish some of their held rounds: each with a
    /// chance, now and then the newest first (its completion seen before the older one's).
    /// The members learn of it at their next advance, as from an eventfd.
    fn disks(&mut self) {
        for node in self.nodes.values() {
            if node.member.is_none() {
                continue;
            }
            for fault in node.member_faults.borrow().iter() {
                while fault.held_rounds() > 0 && self.rng.below(100) < 60 {
                    if self.rng.below(100) < 15 {
                        fault.complete_newest();
                    } else {
                        fault.complete_next();
                    }
                }
                while fault.held_fetches() > 0 && self.fetch_rng.below(100) < 60 {
                    fault.complete_next_fetch();
                    self.stats.fetches += 1;
                }
            }
        }
    }

    fn maybe_fault(&mut self) {
        if self.rng.below(10_000) >= self.shape.fault_rate {
            return;
        }
        match self.rng.below(4) {
            0 if self.cut.is_empty() => {
                let alone = self.rng.range(1, BROKERS);
                for other in (1..=BROKERS).filter(|o| *o != alone) {
                    self.cut.insert((alone, other));
                    self.cut.insert((other, alone));
                }
                self.stats.partitions += 1;
                self.trace
                    .line(format!("partition: broker {alone} cut off"));
            }
            0 | 1 => {
                if !self.cut.is_empty() {
                    self.trace.line("partition healed".to_owned());
                }
                self.cut.clear();
            }
            _ => {
                // At most one broker down at a time: a majority always remains.
                let down = (1..=BROKERS).find(|id| !self.nodes[id].alive());
                match down {
                    Some(id) => self.start(id),
                    None => {
                        let victim = self.rng.range(1, BROKERS);
                        self.kill(victim);
                    }
                }
            }
        }
    }

    /// The member's tick when due, and every core's timers.
    fn tick(&mut self, id: u64) {
        let now = self.now();
        let connected: Vec<u64> = (1..=BROKERS)
            .filter(|peer| *peer != id && self.linked(id, *peer))
            .collect();
        let node = self.nodes.get_mut(&id).expect("a broker");
        let Some(member) = node.member.as_mut() else {
            return;
        };
        if member.poll_timeout() <= now.at {
            member.handle_tick(now.at, &connected).expect("tick");
        }
        let due: Vec<usize> = node
            .cores
            .iter()
            .enumerate()
            .filter(|(_, c)| c.core.poll_timeout().is_some_and(|at| at <= now.at))
            .map(|(index, _)| index)
            .collect();
        for index in due {
            self.nodes.get_mut(&id).expect("a broker").cores[index]
                .core
                .handle_timeout(now);
            self.drain(id, index);
        }
    }

    fn deliver_frames(&mut self) {
        let clock = self.clock;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.network)
            .into_iter()
            .partition(|(at, ..)| *at <= clock);
        self.network = later;
        let now = self.now();
        for (_, from, to, frame) in due {
            if !self.linked(from, to) {
                continue;
            }
            if let Some(member) = self.nodes.get_mut(&to).and_then(|n| n.member.as_mut()) {
                member.handle_peer_frame(now.at, from, &frame);
            }
        }
    }

    /// Messages between the broker's cores, in a random order per step (FIFO per pair).
    fn deliver_mesh(&mut self, id: u64) {
        let now = self.now();
        loop {
            let node = &self.nodes[&id];
            let busy: Vec<usize> = (0..node.mesh.len())
                .filter(|q| !node.mesh[*q].is_empty())
                .collect();
            if busy.is_empty() {
                return;
            }
            let queue = busy[self.rng.index(busy.len())];
            let n = self.nodes[&id].cores.len();
            let (from, to) = (queue / n, queue % n);
            let node = self.nodes.get_mut(&id).expect("a broker");
            let message = node.mesh[queue].pop_front().expect("busy");
            node.cores[to].core.handle_message(now, message);
            self.drain(id, to);
            self.drain(id, from);
        }
    }

    /// The member advances; its frames go on the network, its answers to the cores' queues,
    /// its view to every core.
    fn advance(&mut self, id: u64) {
        let now = self.now();
        let mut sends = Vec::new();
        let mut view = None;
        {
            let node = self.nodes.get_mut(&id).expect("a broker");
            let Some(member) = node.member.as_mut() else {
                return;
            };
            member.advance(now.at).expect("advance");
            while let Some(out) = member.poll_transmit() {
                sends.push(out);
            }
            if member.status_due() {
                let mut shown = member.status();
                view = Some(member.update_status(&mut shown));
            }
        }
        let mut reports = Vec::new();
        for out in sends {
            let sent = self.linked(id, out.to);
            if sent && self.rng.below(1_000) >= u64::from(self.shape.loss) {
                let delay = Duration::from_millis(self.rng.range(1, 21));
                self.network
                    .push((self.clock + delay, id, out.to, out.frame));
            }
            reports.push((out.to, out.about, sent));
        }
        let node = self.nodes.get_mut(&id).expect("a broker");
        let member = node.member.as_mut().expect("alive");
        for (to, about, sent) in reports {
            member.handle_transmitted(to, about, sent);
        }
        while let Some(answered) = member.poll_answer() {
            answered.deliver();
        }
        if let Some(view) = view {
            let view = link::core_view(&view);
            for index in 0..node.cores.len() {
                node.cores[index].core.set_cluster_view(Arc::clone(&view));
            }
            self.drain_all(id);
        }
    }

    /// The member's answers reach their cores.
    fn deliver_events(&mut self, id: u64) {
        let now = self.now();
        loop {
            let next = self.nodes[&id].events.lock().expect("lock").pop_front();
            let Some((core, event)) = next else {
                return;
            };
            let node = self.nodes.get_mut(&id).expect("a broker");
            let Some(sim) = node.cores.get_mut(usize::from(core)) else {
                return;
            };
            link::apply(&mut sim.core, now, event);
            self.drain(id, usize::from(core));
        }
    }

    // ---- clients ----

    /// A client acts: connects, creates the stream (the first time), sends a batch again, or
    /// (`publishing`) publishes a new one.
    fn client_act(&mut self, client: usize, publishing: bool) {
        let ready = self.clients[client]
            .conn
            .as_ref()
            .is_some_and(|conn| conn.ready);
        if !ready {
            if self.clients[client].conn.is_none() {
                self.connect(client);
            }
            return;
        }
        // At most IN_FLIGHT_MAX requests in flight per client, as a pipelining client keeps.
        if self.clients[client]
            .conn
            .as_ref()
            .is_some_and(|conn| conn.waiting.len() >= IN_FLIGHT_MAX)
        {
            return;
        }
        if let Some(request_id) = self.clients[client].retry.pop_front() {
            let batch = self.batches.get_mut(&request_id).expect("a publish");
            batch.retries += 1;
            let frame = batch.frame.clone();
            self.stats.retries += 1;
            self.trace
                .line(format!("c{client} sends #{request_id} again"));
            let conn = self.clients[client].conn.as_mut().expect("ready");
            conn.waiting.insert(request_id);
            conn.to_send.push_back(frame);
            return;
        }
        if !publishing {
            return;
        }
        self.clients[client].next_request += 1;
        let request_id = (client as u64) << 40 | self.clients[client].next_request;
        let frame = if self.created {
            let count = self.rng.range(1, 5);
            let batch = self.next_batch;
            self.next_batch += 1;
            let names: Vec<String> = (0..count).map(|i| format!("b{batch}-r{i}")).collect();
            // Half the batches go as an idempotent producer's, to one shard (retried until
            // acked), half as plain publishes spread by key (never retried).
            let shard = self
                .rng
                .chance(500)
                .then(|| u32::try_from(self.rng.below(u64::from(SHARDS))).expect("a shard"));
            let records = names
                .iter()
                .map(|name| Record {
                    key: Bytes::from(match shard {
                        Some(shard) => key_of(shard),
                        None => format!("k{}", self.rng.below(8)),
                    }),
                    payload: Bytes::from(name.clone()),
                })
                .collect();
            let publish = Publish {
                request_id,
                ack: AckMode::Acked,
                stream: STREAM.to_owned(),
                records,
            };
            let frame = match shard {
                Some(shard) => {
                    let next = self.clients[client].sequences.entry(shard).or_insert(1);
                    let sequence = *next;
                    *next += 1;
                    Frame::ProducerPublish(ProducerPublish {
                        publish,
                        producer: client as u64 + 1,
                        sequence,
                        shard,
                    })
                }
                None => Frame::Publish(publish),
            };
            self.batches.insert(
                request_id,
                Batch {
                    client,
                    names,
                    frame: frame.clone(),
                    outcome: None,
                    retries: 0,
                },
            );
            self.stats.publishes += 1;
            frame
        } else {
            self.creates.insert(request_id);
            Frame::CreateClusterStream(CreateClusterStream {
                request_id,
                name: STREAM.to_owned(),
                shard_count: SHARDS,
                kind: StreamKind::Durable,
                replicas: 3,
                fsync: felix_wire::FsyncMode::OnCommit,
            })
        };
        self.trace.line(format!(
            "c{client} sends {} #{request_id}",
            frame.frame_type().name()
        ));
        let conn = self.clients[client].conn.as_mut().expect("ready");
        conn.waiting.insert(request_id);
        conn.to_send.push_back(frame);
    }

    /// The client's connection is gone (its broker was killed): its idempotent publishes
    /// still unanswered are sent again on the next connection.
    fn lose_conn(&mut self, client: usize) {
        let Some(conn) = self.clients[client].conn.take() else {
            return;
        };
        for request_id in conn.waiting {
            if self
                .batches
                .get(&request_id)
                .is_some_and(|batch| matches!(batch.frame, Frame::ProducerPublish(_)))
            {
                self.clients[client].retry.push_back(request_id);
            }
        }
    }

    fn connect(&mut self, client: usize) {
        let live: Vec<u64> = (1..=BROKERS).filter(|id| self.nodes[id].alive()).collect();
        let node = live[self.rng.index(live.len())];
        let core = u16::try_from(self.rng.below(u64::from(self.shape.cores))).expect("a core");
        let run = self.nodes[&node].runs;
        let sim = &mut self.nodes.get_mut(&node).expect("a broker").cores[usize::from(core)];
        let id = sim
            .core
            .handle_connection_opened(None)
            .expect("below the limit");
        let stream = sim.core.handle_stream_opened(id);
        let mut to_send = VecDeque::new();
        to_send.push_back(Frame::Hello(Hello {
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            features: FEATURE_PRODUCER,
            client_name: format!("sim-{client}"),
            token: None,
        }));
        self.clients[client].conn = Some(Conn {
            node,
            run,
            core,
            id,
            stream,
            ready: false,
            to_send,
            inbuf: BytesMut::new(),
            waiting: BTreeSet::new(),
        });
        self.trace
            .line(format!("c{client} connects to broker {node} core {core}"));
    }

    /// Feeds what the client queued and reads what its core wrote.
    fn client_io(&mut self, client: usize) {
        let now = self.now();
        let Some(conn) = self.clients[client].conn.as_mut() else {
            return;
        };
        let (node, core, stream) = (conn.node, conn.core, conn.stream);
        if self.nodes[&node].runs != conn.run || !self.nodes[&node].alive() {
            self.lose_conn(client);
            return;
        }
        loop {
            let conn = self.clients[client].conn.as_mut().expect("open");
            let sim = &mut self.nodes.get_mut(&node).expect("a broker").cores[usize::from(core)];
            if conn.to_send.is_empty() || !sim.core.accepts_frames(stream) {
                break;
            }
            let frame = conn.to_send.pop_front().expect("queued");
            // A parked publish stops the feeding (`accepts_frames`); a finished stream is
            // closed when its transmit says so.
            let _flow = sim.core.handle_frame(now, stream, frame);
            self.drain(node, usize::from(core));
        }
        let sim = &mut self.nodes.get_mut(&node).expect("a broker").cores[usize::from(core)];
        let transmit = sim.core.poll_transmit(now, stream);
        self.drain(node, usize::from(core));
        let conn = self.clients[client].conn.as_mut().expect("open");
        for chunk in &transmit.chunks {
            conn.inbuf.extend_from_slice(chunk);
        }
        let decoder = Decoder::new(Limits::DEFAULT);
        let mut frames = Vec::new();
        while let Some(frame) = decoder
            .decode(&mut conn.inbuf)
            .expect("the broker writes valid frames")
        {
            frames.push(frame);
        }
        for frame in frames {
            self.answer(client, frame);
        }
        if transmit.finish {
            let id = self.clients[client].conn.as_ref().expect("open").id;
            self.lose_conn(client);
            let sim = &mut self.nodes.get_mut(&node).expect("a broker").cores[usize::from(core)];
            sim.core.handle_connection_closed(id);
            self.drain(node, usize::from(core));
        }
    }

    fn answer(&mut self, client: usize, frame: Frame) {
        self.trace.line(format!(
            "c{client} reads {} #{}",
            frame.frame_type().name(),
            frame.request_id().unwrap_or(0)
        ));
        let conn = self.clients[client].conn.as_mut().expect("open");
        match frame {
            Frame::HelloOk(_) => conn.ready = true,
            Frame::Done { request_id } => {
                conn.waiting.remove(&request_id);
                self.created = true;
                self.trace.line(format!("c{client}: stream created"));
            }
            Frame::Ack(ack) => {
                self.trace.line(format!("c{client}: {:?}", ack.shards));
                let conn = self.clients[client].conn.as_mut().expect("open");
                conn.waiting.remove(&ack.request_id);
                let batch = self.batches.get_mut(&ack.request_id).expect("a publish");
                assert!(batch.outcome.is_none(), "one answer per publish");
                let count: u32 = ack.shards.iter().map(|shard| shard.count).sum();
                assert_eq!(
                    count as usize,
                    batch.names.len(),
                    "the ack counts every record"
                );
                batch.outcome = Some(Ok(ack.shards));
                self.stats.acked += 1;
            }
            Frame::Error(error) => {
                self.trace
                    .line(format!("c{client}: {:?} {}", error.code, error.message));
                let conn = self.clients[client].conn.as_mut().expect("open");
                conn.waiting.remove(&error.request_id);
                if let Some(batch) = self.batches.get_mut(&error.request_id) {
                    assert!(batch.outcome.is_none(), "one answer per publish");
                    self.stats.refused += 1;
                    // An idempotent batch is sent again until acked: whatever the refusal, a
                    // retry is applied once (`unavailable` names its sequence).
                    if let Frame::ProducerPublish(produced) = &batch.frame {
                        if error.code == ErrorCode::Unavailable {
                            assert_eq!(
                                error.detail, produced.sequence,
                                "an idempotent batch's unavailable names its sequence"
                            );
                        }
                        self.clients[batch.client].retry.push_back(error.request_id);
                    } else {
                        batch.outcome = Some(Err(error.code));
                    }
                } else if self.creates.contains(&error.request_id) {
                    // Too early (members not registered yet, no leader): asked again later.
                    if error.code == ErrorCode::StreamExists {
                        self.created = true;
                    }
                    return;
                }
                assert!(
                    matches!(
                        error.code,
                        ErrorCode::Unavailable
                            | ErrorCode::StreamNotFound
                            | ErrorCode::StreamExists
                            | ErrorCode::IngressBudgetExhausted
                    ),
                    "c{client}: an unexpected refusal {error:?}"
                );
            }
            other => panic!("c{client}: an unexpected frame {other:?}"),
        }
    }

    // ---- the end ----

    /// Heals every fault, restarts every broker, and runs until every publish on a live
    /// connection is answered and every member's copy of every shard has caught up.
    fn quiesce(&mut self) {
        self.cut.clear();
        self.shape.loss = 0;
        for id in 1..=BROKERS {
            if !self.nodes[&id].alive() {
                self.start(id);
            }
        }
        let limit = 60_000 / STEP.as_millis() as u64;
        for step in 0.. {
            if step >= limit {
                let waiting: Vec<(usize, u64, Vec<u64>)> = self
                    .clients
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| {
                        c.conn
                            .as_ref()
                            .map(|conn| (i, conn.node, conn.waiting.iter().copied().collect()))
                    })
                    .collect();
                let ends: Vec<Vec<(u32, u64, Option<u64>)>> = self
                    .statuses()
                    .iter()
                    .map(|s| {
                        s.shards
                            .iter()
                            .map(|x| (x.shard, x.next_offset, x.leader))
                            .collect()
                    })
                    .collect();
                panic!(
                    "not quiet within 60 s of simulated time: clients waiting {waiting:?}, \
                     shard ends per member {ends:?}"
                );
            }
            let answered = self.clients.iter().all(|c| {
                c.retry.is_empty() && c.conn.as_ref().is_none_or(|conn| conn.waiting.is_empty())
            });
            if answered && self.caught_up() {
                return;
            }
            self.step(false);
        }
    }

    fn statuses(&self) -> Vec<ClusterStatus> {
        self.nodes
            .values()
            .filter_map(|node| node.member.as_ref().map(Member::status))
            .collect()
    }

    fn caught_up(&self) -> bool {
        if !self.created {
            return true;
        }
        let statuses = self.statuses();
        (0..SHARDS).all(|shard| {
            let ends: BTreeSet<u64> = statuses
                .iter()
                .filter_map(|s| {
                    s.shards
                        .iter()
                        .find(|x| x.stream == STREAM && x.shard == shard)
                        .map(|x| x.next_offset)
                })
                .collect();
            // Every member holds the shard, and has recorded every committed record (no
            // fetch of missed records still running).
            ends.len() == 1
                && statuses.iter().all(|s| {
                    s.shards.iter().any(|x| {
                        x.stream == STREAM
                            && x.shard == shard
                            && x.recorded_offset == x.next_offset
                            && x.fetching_from.is_none()
                    })
                })
        })
    }

    /// Reads member `id`'s copy of `shard` from offset 0.
    fn read_copy(&mut self, id: u64, shard: u32) -> Vec<(u64, ShardRecord)> {
        let mut all: Vec<(u64, ShardRecord)> = Vec::new();
        loop {
            let answer = Arc::new(Mutex::new(None));
            let sink = Arc::clone(&answer);
            let now = self.now();
            let member = self
                .nodes
                .get_mut(&id)
                .and_then(|n| n.member.as_mut())
                .expect("alive");
            member.handle_request(
                now.at,
                Request::Read {
                    stream: STREAM.to_owned(),
                    shard,
                    from: all.last().map_or(0, |(offset, _)| offset + 1),
                    max_records: 1_000,
                    answer: Answer::new(move |result: Result<_, ServiceError>| {
                        *sink.lock().expect("lock") = Some(result);
                    }),
                },
            );
            while let Some(answered) = member.poll_answer() {
                answered.deliver();
            }
            // A read whose record-log bytes missed the page cache is answered once they were
            // fetched: the fetches complete, the member goes on with them.
            let faults = Rc::clone(&self.nodes[&id].member_faults);
            for _ in 0..1_000 {
                if answer.lock().expect("lock").is_some() {
                    break;
                }
                for fault in faults.borrow().iter() {
                    while fault.complete_next_fetch() {
                        self.stats.fetches += 1;
                    }
                }
                let member = self
                    .nodes
                    .get_mut(&id)
                    .and_then(|n| n.member.as_mut())
                    .expect("alive");
                member.advance(now.at).expect("advance");
                while let Some(answered) = member.poll_answer() {
                    answered.deliver();
                }
            }
            let read = answer
                .lock()
                .expect("lock")
                .take()
                .expect("a read is answered once its fetches completed")
                .expect("the read");
            if read.is_empty() {
                return all;
            }
            all.extend(read);
        }
    }

    fn audit(&mut self) {
        if !self.created {
            return;
        }
        let mut stored: HashMap<String, (u32, u64)> = HashMap::new();
        for shard in 0..SHARDS {
            let copies: Vec<Vec<(u64, ShardRecord)>> =
                (1..=BROKERS).map(|id| self.read_copy(id, shard)).collect();
            for (i, copy) in copies.iter().enumerate() {
                if copy != &copies[0] {
                    let differ = copy
                        .iter()
                        .zip(&copies[0])
                        .position(|(a, b)| a != b)
                        .unwrap_or(copy.len().min(copies[0].len()));
                    panic!(
                        "shard {shard}: broker {} holds other records than broker 1: {} and {} \
                         records, first difference at {differ}: {:?} and {:?}; statuses {:?}",
                        i + 1,
                        copy.len(),
                        copies[0].len(),
                        copy.get(differ),
                        copies[0].get(differ),
                        self.statuses()
                            .iter()
                            .map(|s| s.shards.iter().find(|x| x.shard == shard).map(|x| (
                                x.next_offset,
                                x.oldest_offset,
                                x.recorded_offset,
                                x.snapshot_index,
                                x.fetching_from
                            )))
                            .collect::<Vec<_>>()
                    );
                }
            }
            for (i, (offset, record)) in copies[0].iter().enumerate() {
                assert_eq!(*offset, i as u64, "shard {shard}: offsets not dense");
                let name = String::from_utf8_lossy(&record.payload).into_owned();
                let earlier = stored.insert(name.clone(), (shard, *offset));
                assert!(
                    earlier.is_none(),
                    "{name} stored twice: {earlier:?} and {shard}:{offset}"
                );
            }
        }
        self.stats.records = stored.len() as u64;
        for (request, batch) in &self.batches {
            let Some(Ok(shards)) = &batch.outcome else {
                continue;
            };
            for ack in shards {
                let at: BTreeSet<u64> =
                    (ack.first_offset..ack.first_offset + u64::from(ack.count)).collect();
                let here: BTreeSet<u64> = batch
                    .names
                    .iter()
                    .filter_map(|name| stored.get(name))
                    .filter(|(shard, _)| *shard == ack.shard)
                    .map(|(_, offset)| *offset)
                    .collect();
                assert_eq!(
                    here, at,
                    "publish {request}: its records in shard {} are not where its ack said",
                    ack.shard
                );
            }
            for name in &batch.names {
                assert!(stored.contains_key(name), "acked record {name} lost");
            }
        }
        // An idempotent producer's batches were sent until acked: every one is there, once
        // (the check above), however often it was retried.
        for (request, batch) in &self.batches {
            if matches!(batch.frame, Frame::ProducerPublish(_)) {
                assert!(
                    matches!(batch.outcome, Some(Ok(_))),
                    "idempotent publish {request} was never acked ({} retries)",
                    batch.retries
                );
            }
        }
    }
}

/// A key of shard `shard` of the run's stream.
fn key_of(shard: u32) -> String {
    (0..)
        .map(|n| format!("p{n}"))
        .find(|key| felix_wire::shard_for_key(key.as_bytes(), SHARDS) == shard)
        .expect("a key of every shard")
}

/// Runs one cluster seed: the steps, then quiet, then the audit.
pub fn run(world: &mut ClusterWorld) {
    for step in 0..world.shape.steps {
        world
            .trace
            .line(format!("#{step} t={}ms", world.clock.as_millis()));
        if step % 200 == 0 {
            let leaders: Vec<String> = world
                .statuses()
                .iter()
                .map(|s| {
                    format!(
                        "{:?}/{}/{}",
                        s.node.leader,
                        s.node.term,
                        s.state.members.len()
                    )
                })
                .collect();
            world.trace.line(format!("control plane: {leaders:?}"));
        }
        world.step(true);
    }
    world.quiesce();
    world.audit();
}
