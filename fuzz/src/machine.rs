//! Fuzz target `core`: 1 to 3 `felix_core::Core` machines wired together the way the broker
//! shell wires them (`dataplane/broker/src/{shell,connection}.rs`), driven by a program the
//! fuzzer's bytes spell out.
//!
//! Input: a configuration (cores, limits within the tuning crate's bounds, ingress settings,
//! engine bounds, security: open or rules, authentication required or not, connection
//! limits, durable logs on the storage crate's fault backend or none), then up to
//! [`STEPS_MAX`] steps, each one byte choosing what happens next and the bytes after it
//! choosing how:
//! - clients open and close connections and streams, send frames (structured ones, encoded,
//!   of every type and size, often split in two chunks) or raw bytes, and finish streams;
//! - stream tasks run as the shell's do: decode what was received (the hello decoder until
//!   the handshake is answered), feed frames while the machine accepts them, answer decode
//!   errors, a finish inside a frame and bytes after a `Subscribe`, write what
//!   `poll_transmit` gives, close the connection after a refused handshake;
//! - the mesh delivers messages (FIFO per ordered pair, bounded queues: what does not fit
//!   goes back with `return_message`), in any interleaving of pairs;
//! - token checks and catalogue writes are answered, in any order, with any verdict;
//! - time passes (admission deadlines, periodic fsyncs); held log rounds complete, sometimes
//!   after an injected fsync error or a full disk; tokens are reloaded; hellos time out.
//!
//! Every input respects the machine's documented contract (frames only while
//! `accepts_frames`, a stream's finish only while it reads, token verdicts once each, inputs on
//! streams that outlive their connection as the shell can give them), so any panic is a
//! defect of the machine.
//!
//! Invariants: `assert_invariants` on every core after every step; every byte a core writes
//! decodes with the limits it announces, is a frame a server sends, and a finished stream
//! ends on a frame boundary; at the end, once every connection and stream is closed and every
//! message, round, token check and catalogue write is answered, every core is quiet: no
//! stream, message, connection, subscription, ingress job or waiter left, and no principal
//! holds a connection in the shared ledger.

use std::collections::{BTreeMap, VecDeque};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use felix_auth::{Policy, Principal, Rules, TokenRefusal, VerifiedToken};
use felix_core::driver::{self, Effects};
use felix_core::{
    CatalogWrite, ClusterRequest, ConnectionId, ConnectionLimits, Core, CoreConfig, CoreMessage,
    DurableLog, DurableSettings, Flow, IngressSettings, Now, Security, StreamId, TokenCheck,
};
use felix_engine::EngineConfig;
use felix_storage::{BackendChoice, FaultBackend, FaultHandle, FsyncMode, SEGMENT_BYTES_MIN};
use felix_wire::{
    Ack, AckMode, CreateClusterStream, CreateStream, DeliveredRecord, Delivery, ErrorCode,
    ErrorFrame, Frame, HashKind, Hello, HelloOk, Limits, PROTOCOL_VERSION, Publish, ReadShard,
    Record, ShardAck, ShardInfo, ShardSelection, StartPosition, StreamInfo, StreamKind,
    StreamRoute, StreamSummary, Subscribe, Subscribed,
};

use crate::input::Input;

/// Steps of one input at most (a longer input's tail is ignored).
pub const STEPS_MAX: usize = 400;
/// Passes of one stream task's loop per step (the shell's task loops until it sleeps).
const TASK_PASSES_MAX: usize = 16;
/// The shell's bound on frames fed per pass (`FRAMES_PER_FEED_MAX` in connection.rs).
const FRAMES_PER_FEED_MAX: usize = 64;
/// FELIX_HELLO_MAX_BYTES default: frames of a hello stream until its handshake is answered.
const HELLO_MAX_BYTES: u32 = 16 << 10;
/// Rounds of the final settling at most (each delivers, completes or answers something).
const SETTLE_ROUNDS_MAX: usize = 10_000;
/// Stream names the clients mostly use, so that requests meet existing streams.
const NAMES: [&str; 3] = ["s0", "s1", "s2"];
/// The rules of a secured configuration (those of the simulation): p0 may do everything, p1
/// publishes and subscribes to s0 and s1, p2 subscribes anywhere and publishes to s2, and
/// everyone subscribes to s0.
const RULES: &str =
    "p0 all *; p1 publish,subscribe s0,s1; p2 subscribe s*; p2 publish s2; * subscribe s0";
const PRINCIPALS: [&str; 3] = ["p0", "p1", "p2"];
/// Wall-clock time of the start (any fixed value).
const BASE_UNIX_US: u64 = 1_800_000_000_000_000;

/// Runs one input (see the module documentation).
pub fn run(data: &[u8]) {
    run_counted(data);
}

/// Runs one input and counts the frames the clients received, by type name (for the seed
/// generator, which checks that each seed does what it is meant to).
pub fn run_counted(data: &[u8]) -> BTreeMap<&'static str, u64> {
    let mut input = Input::new(data);
    let mut world = World::new(&mut input);
    let mut steps = 0;
    while !input.is_empty() && steps < STEPS_MAX && !world.halted {
        world.step(&mut input);
        world.check();
        steps += 1;
    }
    if !world.halted {
        world.teardown();
    }
    world.received
}

/// What one step does; the first byte of a step picks it (each op owns a range of byte
/// values, its width weighting how often the fuzzer's bytes pick it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A client sends a structured frame on a stream (its task runs unless slow).
    SendFrame,
    /// A client sends raw bytes (at most 48) on a stream.
    SendRaw,
    /// A stream's task runs.
    RunTask,
    /// The mesh delivers one message.
    Deliver,
    OpenConnection,
    /// The connection task accepts a stream.
    OpenStream,
    /// A client finishes its side of a stream.
    Fin,
    /// A client resets a stream: its task ends.
    ResetStream,
    /// A connection goes away (closed by the client or the network).
    ConnectionGone,
    /// The task of a connection that went away ends.
    ConnectionTaskEnds,
    AnswerToken,
    AnswerCatalog,
    AdvanceTime,
    CompleteRound,
    PumpLog,
    ReloadTokens,
    HelloTimeout,
    /// Every stream task runs.
    RunAll,
}

/// Each op and the last byte value of its range; the ranges follow each other from 0.
const OPS: [(Op, u8); 18] = [
    (Op::SendFrame, 59),
    (Op::SendRaw, 74),
    (Op::RunTask, 94),
    (Op::Deliver, 114),
    (Op::OpenConnection, 124),
    (Op::OpenStream, 139),
    (Op::Fin, 146),
    (Op::ResetStream, 151),
    (Op::ConnectionGone, 156),
    (Op::ConnectionTaskEnds, 161),
    (Op::AnswerToken, 171),
    (Op::AnswerCatalog, 179),
    (Op::AdvanceTime, 189),
    (Op::CompleteRound, 203),
    (Op::PumpLog, 207),
    (Op::ReloadTokens, 210),
    (Op::HelloTimeout, 212),
    (Op::RunAll, 255),
];

impl Op {
    /// The op a step's first byte picks.
    #[must_use]
    pub fn of(byte: u8) -> Op {
        OPS.iter()
            .find(|(_, last)| byte <= *last)
            .map(|(op, _)| *op)
            .expect("the last range ends at 255")
    }

    /// The first byte value that picks this op.
    #[must_use]
    pub fn byte(self) -> u8 {
        let at = OPS
            .iter()
            .position(|(op, _)| *op == self)
            .expect("every op has a range");
        if at == 0 { 0 } else { OPS[at - 1].1 + 1 }
    }
}

/// The configuration a seed starts with: the bytes `World::new` reads, for a few shapes (the
/// fuzzer's mutations reach the others).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Setup {
    /// 1 to 3.
    pub cores: u8,
    /// 64 KiB frames, payloads up to the frame, batches of 3, 16-byte keys, 4 shards at most
    /// (else the protocol's defaults).
    pub small_limits: bool,
    /// An ingress queue of depth 1 and 64 bytes, small replay rings and subscriber queues,
    /// two streams, two connections per core and per principal, two streams and one
    /// subscription per connection (else roomy settings).
    pub tight: bool,
    /// Fire-and-forget publishes wait for room, acked ones ack after commit.
    pub waiting: bool,
    /// The simulation's rules (else the open policy).
    pub secured: bool,
    /// FELIX_AUTH=required.
    pub auth_required: bool,
    /// Periodic fsync every 10 ms (else on commit).
    pub periodic: bool,
    /// Mesh queues of one message (else unbounded).
    pub narrow_mesh: bool,
}

impl Setup {
    /// The configuration bytes, in the order `World::new` reads them.
    #[must_use]
    pub fn bytes(&self) -> Vec<u8> {
        let (tight, small) = (u8::from(self.tight), u8::from(self.small_limits));
        let yes = |flag: bool| if flag { 0 } else { 255 };
        let mut bytes = vec![
            self.cores.clamp(1, 3) - 1,
            // max_frame_bytes, max_batch_records, max_payload_bytes, max_key_bytes, max_shards
            1 - small,
            2 - small,
            if self.small_limits { 2 } else { 3 },
            2 - small,
            3 - 2 * small,
            // ingress: depth - 1, budget, fire-and-forget waits, ack on commit, commit wait
            if self.tight { 0 } else { 7 },
            3 - 2 * tight,
            u8::from(self.waiting),
            u8::from(self.waiting),
            99,
            0,
            // engine: ring records, ring bytes, subscriber queue, streams
            3 - tight,
            2 - tight,
            1 - tight,
            3 - 2 * tight,
            // secured, authentication required
            yes(self.secured),
            yes(self.auth_required),
            // connection limits: per core, per principal, streams and subscriptions per connection
            2 - tight,
            3 - tight,
            3 - 2 * tight,
            2 - 2 * tight,
            // fsync: on commit, or periodic (interval - 1 in ms)
            u8::from(!self.periodic),
        ];
        if self.periodic {
            bytes.push(9);
        }
        bytes.push(if self.narrow_mesh { 0 } else { 3 });
        bytes
    }
}

/// One core: its machine, its log and the log's fault handle.
struct SimCore {
    core: Core,
    log: (DurableLog<FaultBackend>, FaultHandle),
}

/// What a stream's task reads next (`Reading` in connection.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    Frames,
    Subscription,
    Done,
}

/// Something the client sent on a stream that its task has not read yet.
#[derive(Debug)]
enum Chunk {
    Data(Bytes),
    Fin,
}

/// A client connection.
#[derive(Debug)]
struct Conn {
    core: usize,
    id: ConnectionId,
    /// The hello stream was accepted.
    hello_opened: bool,
    /// The handshake was answered: the connection task accepts more streams.
    accepting: bool,
    /// The connection is closed or closing (the client left, a refused handshake, a hello
    /// timeout, a revoked token): no more streams, no more bytes; its tasks end.
    closing: bool,
    /// `handle_connection_closed` was given (the connection task ended).
    gone: bool,
}

/// A client stream and its task in the shell.
#[derive(Debug)]
struct Stream {
    core: usize,
    conn: usize,
    id: StreamId,
    /// The connection's first stream, until the handshake is answered (its task uses the
    /// hello decoder meanwhile).
    hello: bool,
    /// Sent by the client, not yet read by the task.
    pending: VecDeque<Chunk>,
    /// The client sent its finish (no more chunks after it).
    fin_sent: bool,
    /// Read by the task, not yet decoded and fed.
    buffer: BytesMut,
    reading: Reading,
    receive_open: bool,
    /// Bytes the machine wrote, not yet decoded by the client.
    received: BytesMut,
}

/// The broker: cores, their mesh, the clients' connections and streams, what waits for an
/// answer, and a logical clock.
struct World {
    cores: Vec<SimCore>,
    limits: Limits,
    decoder: felix_wire::Decoder,
    hello_decoder: felix_wire::Decoder,
    security: Arc<Security>,
    /// Indexed `from * cores + to`.
    mesh: Vec<VecDeque<CoreMessage>>,
    mesh_capacity: usize,
    conns: Vec<Conn>,
    streams: Vec<Stream>,
    token_checks: Vec<(usize, TokenCheck)>,
    catalog_writes: Vec<CatalogWrite>,
    base: Instant,
    clock: Duration,
    /// A fatal storage error: the broker process would exit here.
    halted: bool,
    /// Holds the durable logs' files (on tmpfs when there is one).
    _dir: tempfile::TempDir,
    /// `FELIX_FUZZ_TRACE` is set: every step is printed (to diagnose a crash).
    trace: bool,
    /// Frames the clients received, by type name.
    received: BTreeMap<&'static str, u64>,
}

impl World {
    fn new(input: &mut Input<'_>) -> World {
        let cores = 1 + input.below(3);
        let max_frame_bytes = input.pick(&[64 << 10, 16 << 20]);
        let limits = Limits {
            max_frame_bytes,
            max_batch_records: input.pick(&[1, 3, 4096]),
            // The tuning crate keeps a payload within a frame.
            max_payload_bytes: input
                .pick(&[1 << 10, 64 << 10, max_frame_bytes, 4 << 20])
                .min(max_frame_bytes),
            max_key_bytes: input.pick(&[0, 16, 1024]),
            max_shards: input.pick(&[1, 4, 1024, 4096]),
            ..Limits::DEFAULT
        };
        let ingress = IngressSettings {
            depth: input.range(1, 8),
            budget_bytes: input.pick(&[0, 64, 4096, 64 << 20]),
            fire_and_forget_waits: input.bool(),
            ack_on_commit: input.bool(),
            commit_wait: Duration::from_millis(input.range(1, 400)),
        };
        let engine = EngineConfig {
            ring_max_records: input.pick(&[0, 1, 4, 1024]),
            ring_max_bytes: input.pick(&[0, 64, 64 << 20]),
            subscriber_queue_max_bytes: input.pick(&[256, 64 << 10]),
            max_shards: limits.max_shards,
            max_name_bytes: limits.max_name_bytes,
            max_streams: input.pick(&[1, 2, 3, 1024]),
        };
        let secured = input.chance(64);
        let auth_required = input.chance(64);
        let policy = if secured {
            Policy::from_rules(Rules::parse(RULES).expect("the rules parse"))
        } else {
            Policy::open()
        };
        let connection_limits = ConnectionLimits {
            connections_per_core: input.pick(&[1, 2, 10_000]),
            connections_per_principal: input.pick(&[0, 1, 2, 1024]),
            streams_per_connection: input.pick(&[1, 2, 3, 256]),
            subscriptions_per_connection: input.pick(&[1, 2, 64]),
        };
        let security = Arc::new(Security::new(auth_required, policy, connection_limits));
        let fsync = if input.bool() {
            FsyncMode::OnCommit
        } else {
            FsyncMode::Periodic {
                interval: Duration::from_millis(input.range(1, 50)),
            }
        };
        let mesh_capacity = input.pick(&[1, 2, 16, usize::MAX]);
        // The broker always has a log per core (a core without durable shards never writes it).
        let dir = scratch_dir();
        let core_count = u16::try_from(cores).expect("at most 3 cores");
        let ports: Vec<u16> = (0..core_count).map(|i| 7400 + i).collect();
        let cores = (0..core_count)
            .map(|index| {
                let mut core = Core::new(CoreConfig {
                    index,
                    core_count,
                    core_ports: ports.clone(),
                    limits,
                    engine,
                    ingress,
                    next_stream_id: 0,
                    security: Arc::clone(&security),
                });
                let log = {
                    let settings = DurableSettings {
                        fsync,
                        backend: BackendChoice::Pwrite,
                        direct_io: true,
                        rounds_in_flight: 2,
                        segment_bytes: SEGMENT_BYTES_MIN,
                        retention_bytes: None,
                        retention_age: None,
                    };
                    let (backend, fault) = FaultBackend::new(false).expect("the fault backend");
                    let config = settings.log_config(dir.path(), usize::from(index));
                    let log = DurableLog::open(usize::from(index), config, backend)
                        .expect("an empty log opens");
                    core.restore_durable(&log, &[]).expect("nothing to restore");
                    (log, fault)
                };
                SimCore { core, log }
            })
            .collect();
        let n = usize::from(core_count);
        World {
            cores,
            limits,
            decoder: felix_wire::Decoder::new(limits),
            hello_decoder: felix_wire::Decoder::new(Limits {
                max_frame_bytes: HELLO_MAX_BYTES,
                ..limits
            }),
            security,
            mesh: (0..n * n).map(|_| VecDeque::new()).collect(),
            mesh_capacity,
            conns: Vec::new(),
            streams: Vec::new(),
            token_checks: Vec::new(),
            catalog_writes: Vec::new(),
            base: Instant::now(),
            clock: Duration::ZERO,
            halted: false,
            _dir: dir,
            trace: std::env::var_os("FELIX_FUZZ_TRACE").is_some(),
            received: BTreeMap::new(),
        }
    }

    fn now(&self) -> Now {
        Now {
            at: self.base + self.clock,
            unix_us: BASE_UNIX_US + u64::try_from(self.clock.as_micros()).expect("a short run"),
        }
    }

    // ---- steps ----

    fn step(&mut self, input: &mut Input<'_>) {
        let op = input.byte();
        if self.trace {
            eprintln!(
                "step {op}: {} streams, {} connections, mesh {:?}, {} token checks, {} catalogue writes",
                self.streams.len(),
                self.conns.len(),
                self.mesh.iter().map(VecDeque::len).collect::<Vec<_>>(),
                self.token_checks.len(),
                self.catalog_writes.len()
            );
        }
        match Op::of(op) {
            Op::SendFrame => {
                if let Some(stream) = self.pick_sending(input) {
                    let frame = self.frame(input);
                    let mut bytes = BytesMut::new();
                    felix_wire::encode(&frame, &mut bytes);
                    let split = input.byte();
                    self.send(stream, bytes.freeze(), split);
                }
            }
            Op::SendRaw => {
                let stream = self.pick_sending(input);
                let bytes = Bytes::copy_from_slice(input.bytes(48));
                let split = input.byte();
                if let Some(stream) = stream {
                    self.send(stream, bytes, split);
                }
            }
            Op::RunTask => {
                if let Some(stream) = self.pick(input) {
                    self.run_task(stream);
                }
            }
            Op::Deliver => self.deliver(input),
            Op::OpenConnection => self.open_connection(input),
            Op::OpenStream => self.open_stream(input),
            Op::Fin => {
                let (stream, run) = (self.pick_sending(input), input.bool());
                if let Some(stream) = stream {
                    self.streams[stream].pending.push_back(Chunk::Fin);
                    self.streams[stream].fin_sent = true;
                    if run {
                        self.run_task(stream);
                    }
                }
            }
            Op::ResetStream => {
                // The client resets the stream (or its task ends any other way).
                if let Some(stream) = self.pick(input) {
                    self.end_task(stream);
                }
            }
            Op::ConnectionGone => {
                if let Some(conn) = self.pick_conn(input, |c| !c.closing) {
                    self.conns[conn].closing = true;
                }
            }
            Op::ConnectionTaskEnds => {
                if let Some(conn) = self.pick_conn(input, |c| c.closing && !c.gone) {
                    self.connection_task_ends(conn);
                }
            }
            Op::AnswerToken => self.answer_token(input),
            Op::AnswerCatalog => self.answer_catalog(input),
            Op::AdvanceTime => {
                let by = Duration::from_millis(input.pick(&[1, 5, 50, 500, 5_000]));
                self.advance(by);
            }
            Op::CompleteRound => self.complete_round(input),
            Op::PumpLog => {
                let core = input.below(self.cores.len());
                self.pump(core);
                self.drain(core);
            }
            Op::ReloadTokens => self.reload_tokens(input),
            Op::HelloTimeout => {
                if let Some(conn) = self.pick_conn(input, |c| !c.accepting && !c.closing) {
                    let core = self.conns[conn].core;
                    let id = self.conns[conn].id;
                    let code = self.cores[core].core.handle_hello_timeout(id);
                    assert_eq!(code, ErrorCode::ProtocolViolation);
                    self.drain(core);
                    self.conns[conn].closing = true;
                }
            }
            Op::RunAll => self.run_all(),
        }
    }

    /// A live stream, if any.
    ///
    /// Every picker reads its byte whether or not there is anything to pick, so that a step
    /// always takes the same bytes, whatever the state (mutations stay local, seeds are easy to
    /// write).
    fn pick(&self, input: &mut Input<'_>) -> Option<usize> {
        let choice = usize::from(input.byte());
        (!self.streams.is_empty()).then(|| choice % self.streams.len())
    }

    /// A live stream its client may still send on.
    fn pick_sending(&self, input: &mut Input<'_>) -> Option<usize> {
        let open: Vec<usize> = (0..self.streams.len())
            .filter(|&s| !self.streams[s].fin_sent && !self.conns[self.streams[s].conn].closing)
            .collect();
        let choice = usize::from(input.byte());
        (!open.is_empty()).then(|| open[choice % open.len()])
    }

    fn pick_conn(&self, input: &mut Input<'_>, filter: impl Fn(&Conn) -> bool) -> Option<usize> {
        let fit: Vec<usize> = (0..self.conns.len())
            .filter(|&c| filter(&self.conns[c]))
            .collect();
        let choice = usize::from(input.byte());
        (!fit.is_empty()).then(|| fit[choice % fit.len()])
    }

    /// The client sends `bytes`: in two chunks when `split` < 64; its task runs unless
    /// `split` >= 224 (it is slow to).
    fn send(&mut self, stream: usize, bytes: Bytes, split: u8) {
        let s = &mut self.streams[stream];
        if split < 64 && bytes.len() > 1 {
            let at = 1 + usize::from(split) % (bytes.len() - 1);
            s.pending.push_back(Chunk::Data(bytes.slice(..at)));
            s.pending.push_back(Chunk::Data(bytes.slice(at..)));
        } else {
            s.pending.push_back(Chunk::Data(bytes));
        }
        if split < 224 {
            self.run_task(stream);
        }
    }

    fn open_connection(&mut self, input: &mut Input<'_>) {
        let core = input.below(self.cores.len());
        let peer = match input.byte() {
            0..=191 => None,
            b => Some(principal(usize::from(b) % PRINCIPALS.len())),
        };
        let opened = self.cores[core].core.handle_connection_opened(peer);
        self.drain(core);
        if let Ok(id) = opened {
            self.conns.push(Conn {
                core,
                id,
                hello_opened: false,
                accepting: false,
                closing: false,
                gone: false,
            });
        }
    }

    /// The connection task accepts a stream: the first one (the hello stream), or another
    /// once the handshake is answered.
    fn open_stream(&mut self, input: &mut Input<'_>) {
        let conn = self.pick_conn(input, |c| !c.closing && (!c.hello_opened || c.accepting));
        let run = input.bool();
        let Some(conn) = conn else {
            return;
        };
        let c = &mut self.conns[conn];
        let hello = !c.hello_opened;
        c.hello_opened = true;
        let (core, connection) = (c.core, c.id);
        let id = self.cores[core].core.handle_stream_opened(connection);
        self.drain(core);
        self.streams.push(Stream {
            core,
            conn,
            id,
            hello,
            pending: VecDeque::new(),
            fin_sent: false,
            buffer: BytesMut::new(),
            reading: Reading::Frames,
            receive_open: true,
            received: BytesMut::new(),
        });
        if run {
            let stream = self.streams.len() - 1;
            self.run_task(stream);
        }
    }

    /// The connection task ends: the machine forgets the connection (its streams' tasks end
    /// on their own, maybe later).
    fn connection_task_ends(&mut self, conn: usize) {
        let c = &mut self.conns[conn];
        c.gone = true;
        let (core, id) = (c.core, c.id);
        self.cores[core].core.handle_connection_closed(id);
        self.drain(core);
    }

    /// A stream's task ends: the machine forgets the stream.
    fn end_task(&mut self, stream: usize) {
        let s = self.streams.swap_remove(stream);
        let now = self.now();
        self.cores[s.core].core.handle_stream_closed(now, s.id);
        self.drain(s.core);
    }

    /// Every task with something to do runs (what the shell's wake-ups lead to).
    fn run_all(&mut self) {
        let mut stream = 0;
        while stream < self.streams.len() {
            let before = self.streams.len();
            self.run_task(stream);
            if self.streams.len() == before {
                stream += 1;
            }
        }
    }

    /// One stream task runs until it would sleep: feeds what it buffered while the machine
    /// accepts frames, writes what the machine gives, reads the next chunk the client sent
    /// (`serve_stream` in connection.rs). May end the task (and remove the stream).
    fn run_task(&mut self, stream: usize) {
        for _ in 0..TASK_PASSES_MAX {
            if self.halted {
                return;
            }
            let core = self.streams[stream].core;
            let id = self.streams[stream].id;
            let mut frames_left = false;
            if self.streams[stream].reading == Reading::Frames {
                let (reading, left) = self.feed(stream);
                self.streams[stream].reading = reading;
                frames_left = left;
            }
            // Write everything the machine has (a subscription: batch by batch).
            loop {
                let now = self.now();
                let transmit = self.cores[core].core.poll_transmit(now, id);
                self.drain(core);
                for chunk in &transmit.chunks {
                    self.receive(stream, chunk);
                }
                if transmit.finish {
                    let s = &self.streams[stream];
                    assert!(
                        s.received.is_empty(),
                        "a finished stream ends on a frame boundary ({} bytes left)",
                        s.received.len()
                    );
                    if transmit.close_connection.is_some() {
                        let conn = s.conn;
                        self.conns[conn].closing = true;
                    }
                    self.end_task(stream);
                    return;
                }
                if !transmit.more {
                    break;
                }
            }
            let conn = self.streams[stream].conn;
            if self.streams[stream].hello
                && self.cores[core].core.handshake_done(self.conns[conn].id)
            {
                self.streams[stream].hello = false;
                self.conns[conn].accepting = true;
            }
            if frames_left {
                continue;
            }
            if self.conns[conn].closing {
                // The connection is gone: reading fails, the task ends.
                self.end_task(stream);
                return;
            }
            let s = &self.streams[stream];
            let read = s.receive_open
                && match s.reading {
                    Reading::Frames => self.cores[core].core.accepts_frames(id),
                    Reading::Subscription => true,
                    Reading::Done => false,
                };
            if !read {
                return;
            }
            let Some(chunk) = self.streams[stream].pending.pop_front() else {
                return;
            };
            let now = self.now();
            let s = &mut self.streams[stream];
            match chunk {
                Chunk::Data(bytes) => match s.reading {
                    Reading::Frames => s.buffer.extend_from_slice(&bytes),
                    Reading::Subscription if bytes.is_empty() => {}
                    Reading::Subscription => {
                        s.reading = Reading::Done;
                        self.cores[core].core.handle_extra_data(now, id);
                        self.drain(core);
                    }
                    Reading::Done => {}
                },
                Chunk::Fin => {
                    s.receive_open = false;
                    if s.reading == Reading::Frames {
                        let partial = !s.buffer.is_empty();
                        self.cores[core].core.handle_fin(now, id, partial);
                        self.drain(core);
                    }
                }
            }
        }
    }

    /// Decodes and feeds buffered frames while the machine accepts them (`feed` in
    /// connection.rs). Returns what to read next and whether whole frames may be left.
    fn feed(&mut self, stream: usize) -> (Reading, bool) {
        let s = &mut self.streams[stream];
        let (core, id) = (s.core, s.id);
        if !self.cores[core].core.accepts_frames(id) {
            return (Reading::Frames, false);
        }
        for _ in 0..FRAMES_PER_FEED_MAX {
            let now = self.now();
            let s = &mut self.streams[stream];
            let decoder = if s.hello {
                &self.hello_decoder
            } else {
                &self.decoder
            };
            let frame = match decoder.decode(&mut s.buffer) {
                Ok(Some(frame)) => frame,
                Ok(None) => return (Reading::Frames, false),
                Err(error) => {
                    self.cores[core].core.handle_decode_error(now, id, &error);
                    self.drain(core);
                    return (Reading::Done, false);
                }
            };
            if self.trace {
                eprintln!("  core{core} stream{} <- {frame:?}", id.0);
            }
            let flow = self.cores[core].core.handle_frame(now, id, frame);
            if self.trace {
                eprintln!("  core{core} stream{} flow {flow:?}", id.0);
            }
            self.drain(core);
            let s = &mut self.streams[stream];
            match flow {
                Flow::Continue => {}
                Flow::Blocked => return (Reading::Frames, false),
                Flow::Subscribed if s.buffer.is_empty() => return (Reading::Subscription, false),
                Flow::Subscribed => {
                    let now = self.now();
                    self.cores[core].core.handle_extra_data(now, id);
                    self.drain(core);
                    return (Reading::Done, false);
                }
                Flow::Done => return (Reading::Done, false),
            }
        }
        (Reading::Frames, !self.streams[stream].buffer.is_empty())
    }

    /// The client receives bytes the machine wrote: they must decode, with the limits the
    /// broker announces, into frames a server sends.
    fn receive(&mut self, stream: usize, bytes: &Bytes) {
        let s = &mut self.streams[stream];
        s.received.extend_from_slice(bytes);
        loop {
            match self.decoder.decode(&mut s.received) {
                Ok(Some(frame)) => {
                    if self.trace {
                        eprintln!("  core{} stream{} -> {frame:?}", s.core, s.id.0);
                    }
                    check_server_frame(&frame);
                    *self.received.entry(frame.frame_type().name()).or_default() += 1;
                }
                Ok(None) => return,
                Err(error) => panic!("core {} wrote an undecodable frame: {error}", s.core),
            }
        }
    }

    // ---- the shell's drain ----

    /// What the shell does after every input on `core`: felix-core's driver
    /// (`dataplane/core/src/driver.rs`, the shell's own drain: its rounds, its order, the log
    /// pumped at most once per input) with the fuzz machine's effects ([`FuzzEffects`]):
    /// messages into the mesh, catalogue writes and token checks held for a later answer,
    /// cluster requests refused (not a member), events dropped (every task may run at any
    /// time anyway).
    fn drain(&mut self, core: usize) {
        if self.halted {
            return;
        }
        let now = self.now();
        let _ = driver::drain(&mut FuzzEffects { world: self, core }, now);
    }

    /// The oldest message of one non-empty queue is delivered.
    fn deliver(&mut self, input: &mut Input<'_>) {
        let choice = usize::from(input.byte());
        let busy: Vec<usize> = (0..self.mesh.len())
            .filter(|&queue| !self.mesh[queue].is_empty())
            .collect();
        if busy.is_empty() {
            return;
        }
        self.deliver_from(busy[choice % busy.len()]);
    }

    fn deliver_from(&mut self, queue: usize) {
        let n = self.cores.len();
        let (from, to) = (queue / n, queue % n);
        let message = self.mesh[queue].pop_front().expect("a busy queue");
        if self.trace {
            eprintln!("  mesh {from}->{to}: {message:?}");
        }
        let now = self.now();
        self.cores[to].core.handle_message(now, message);
        self.drain(to);
        // Room freed: the sender's pump moves its outbox on.
        self.drain(from);
    }

    fn pump(&mut self, core: usize) {
        let now = self.now();
        let sim = &mut self.cores[core];
        if let Err(error) = sim.core.pump_log(&mut sim.log.0, now) {
            assert!(error.is_fatal(), "pump errors are fatal: {error}");
            self.halted = true;
        }
    }

    fn complete_round(&mut self, input: &mut Input<'_>) {
        let (choice, fault_kind, written) = (
            usize::from(input.byte()),
            input.byte(),
            usize::from(input.byte()),
        );
        let held: Vec<usize> = (0..self.cores.len())
            .filter(|&core| self.cores[core].log.1.held_rounds() > 0)
            .collect();
        if held.is_empty() {
            return;
        }
        let core = held[choice % held.len()];
        let fault = &self.cores[core].log.1;
        match fault_kind {
            0..=5 => fault.fail_next_sync(libc_eio()),
            6..=15 => fault.fail_next_write(libc_enospc(), written),
            _ => {}
        }
        assert!(fault.complete_next(), "a held round completes");
        self.pump(core);
        self.drain(core);
    }

    fn advance(&mut self, by: Duration) {
        self.clock += by;
        let now = self.now();
        for core in 0..self.cores.len() {
            if self.halted {
                return;
            }
            let sim = &mut self.cores[core];
            if sim.core.poll_timeout().is_some_and(|at| at <= now.at) {
                sim.core.handle_timeout(now);
            }
            if sim.log.0.next_deadline().is_some_and(|at| at <= now.at) {
                self.pump(core);
            }
            self.drain(core);
        }
    }

    // ---- answers ----

    fn answer_token(&mut self, input: &mut Input<'_>) {
        let (choice, kind, which) = (
            usize::from(input.byte()),
            input.byte(),
            usize::from(input.byte()) % PRINCIPALS.len(),
        );
        if self.token_checks.is_empty() {
            return;
        }
        let (core, check) = self.token_checks.remove(choice % self.token_checks.len());
        let verdict = match kind {
            0..=159 => Ok(VerifiedToken {
                id: format!("t{which}"),
                principal: principal(which),
            }),
            160..=199 => Err(TokenRefusal::Wrong),
            200..=229 => Err(TokenRefusal::Unknown),
            _ => Err(TokenRefusal::Malformed),
        };
        let now = self.now();
        self.cores[core]
            .core
            .handle_token_checked(now, check.stream, verdict);
        self.drain(core);
    }

    fn answer_catalog(&mut self, input: &mut Input<'_>) {
        let (choice, fail) = (usize::from(input.byte()), input.chance(32));
        if self.catalog_writes.is_empty() {
            return;
        }
        let write = self
            .catalog_writes
            .remove(choice % self.catalog_writes.len());
        let result = if fail {
            Err("injected: no space left on the catalogue's disk".to_owned())
        } else {
            Ok(())
        };
        let now = self.now();
        self.cores[0]
            .core
            .handle_catalog_written(now, write.id, result);
        self.drain(0);
    }

    /// The tokens file is re-read: the tokens of the principals the input picks are revoked,
    /// and the connections they authenticated are closed.
    fn reload_tokens(&mut self, input: &mut Input<'_>) {
        let revoked = input.byte();
        for core in 0..self.cores.len() {
            let closed = self.cores[core]
                .core
                .handle_tokens_reloaded(|_, principal| {
                    let index = PRINCIPALS
                        .iter()
                        .position(|name| *name == principal.to_string())
                        .unwrap_or(0);
                    revoked & (1 << index) == 0
                });
            self.drain(core);
            for id in closed {
                if let Some(conn) = self
                    .conns
                    .iter_mut()
                    .find(|c| c.core == core && c.id == id && !c.gone)
                {
                    conn.closing = true;
                }
            }
        }
    }

    // ---- checks ----

    fn check(&self) {
        for sim in &self.cores {
            sim.core.assert_invariants();
        }
    }

    /// Everything is closed and answered; then nothing may be left anywhere.
    fn teardown(&mut self) {
        for conn in &mut self.conns {
            conn.closing = true;
        }
        self.settle();
        while let Some(stream) = self.streams.len().checked_sub(1) {
            self.run_task(stream);
            if self.halted {
                return;
            }
            if self.streams.len() > stream {
                // Still busy with buffered frames: the connection's end stops it all the same.
                self.end_task(stream);
            }
        }
        for conn in 0..self.conns.len() {
            if !self.conns[conn].gone {
                self.connection_task_ends(conn);
            }
        }
        self.settle();
        if self.halted {
            return;
        }
        self.check();
        for (index, sim) in self.cores.iter_mut().enumerate() {
            assert_eq!(
                sim.core.stream_count(),
                0,
                "core {index} forgot every stream"
            );
            assert_eq!(sim.core.outbox_len(), 0, "core {index} sent every message");
            let counters = sim.core.counters().clone();
            assert_eq!(
                counters.connections, 0,
                "core {index} counts no connection once all are closed"
            );
            assert_eq!(
                counters.subscribers, 0,
                "core {index} counts no subscriber once all streams are closed"
            );
            assert_eq!(
                (
                    counters.ingress_depth,
                    counters.ingress_bytes,
                    counters.ingress_waiting
                ),
                (0, 0, 0),
                "core {index} holds no ingress job once everything is answered"
            );
        }
        for name in PRINCIPALS {
            assert_eq!(
                self.security.connections_of(&principal_named(name)),
                0,
                "no connection of {name} is left in the ledger"
            );
        }
        assert_eq!(
            self.security.connections_of(&Principal::anonymous()),
            0,
            "no anonymous connection is left in the ledger"
        );
    }

    /// Answers and delivers everything that waits, until nothing does.
    fn settle(&mut self) {
        for round in 0..SETTLE_ROUNDS_MAX {
            if self.halted {
                return;
            }
            if self.trace && round < 20 {
                eprintln!(
                    "  settle: mesh {:?}, log work {:?}, held rounds {:?}, timeouts {:?}, log deadlines {:?}",
                    self.mesh.iter().map(VecDeque::len).collect::<Vec<_>>(),
                    self.cores
                        .iter()
                        .map(|sim| sim.core.has_log_work())
                        .collect::<Vec<_>>(),
                    self.cores
                        .iter()
                        .map(|sim| sim.log.1.held_rounds())
                        .collect::<Vec<_>>(),
                    self.cores
                        .iter()
                        .map(|sim| sim.core.poll_timeout().is_some())
                        .collect::<Vec<_>>(),
                    self.cores
                        .iter()
                        .map(|sim| sim.log.0.next_deadline().is_some())
                        .collect::<Vec<_>>(),
                );
            }
            if let Some(queue) = (0..self.mesh.len()).find(|&q| !self.mesh[q].is_empty()) {
                self.deliver_from(queue);
                continue;
            }
            if let Some((core, check)) = self.token_checks.pop() {
                let now = self.now();
                self.cores[core].core.handle_token_checked(
                    now,
                    check.stream,
                    Err(TokenRefusal::Unknown),
                );
                self.drain(core);
                continue;
            }
            if let Some(write) = self.catalog_writes.pop() {
                let now = self.now();
                self.cores[0]
                    .core
                    .handle_catalog_written(now, write.id, Ok(()));
                self.drain(0);
                continue;
            }
            if let Some(core) =
                (0..self.cores.len()).find(|&core| self.cores[core].log.1.held_rounds() > 0)
            {
                self.cores[core].log.1.complete_next();
                self.pump(core);
                self.drain(core);
                continue;
            }
            if let Some(core) =
                (0..self.cores.len()).find(|&core| self.cores[core].core.has_log_work())
            {
                self.pump(core);
                self.drain(core);
                continue;
            }
            if let Some(core) =
                (0..self.cores.len()).find(|&core| self.cores[core].core.outbox_len() > 0)
            {
                self.drain(core);
                if self.mesh.iter().all(VecDeque::is_empty) {
                    panic!("core {core} keeps messages it cannot send into an empty mesh");
                }
                continue;
            }
            // Periodic fsyncs and admission deadlines.
            let due = self.cores.iter().any(|sim| {
                sim.core.poll_timeout().is_some() || sim.log.0.next_deadline().is_some()
            });
            if due && self.clock < Duration::from_secs(3_600) {
                self.advance(Duration::from_secs(1));
                continue;
            }
            return;
        }
        panic!("the broker does not settle in {SETTLE_ROUNDS_MAX} rounds");
    }

    // ---- frames ----

    /// A frame a client sends: every type, mostly the requests, with names, counts and sizes
    /// around the limits.
    fn frame(&self, input: &mut Input<'_>) -> Frame {
        let request_id = u64::from(input.byte() & 3);
        match input.byte() % 16 {
            0 | 1 => Frame::Hello(Hello {
                min_version: input.pick(&[PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2]),
                max_version: input.pick(&[PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2]),
                features: if input.chance(16) { input.u64() } else { 0 },
                client_name: text(input, 12),
                token: input
                    .chance(96)
                    .then(|| Bytes::copy_from_slice(input.bytes(32))),
            }),
            2 => Frame::CreateStream(CreateStream {
                request_id,
                name: self.name(input),
                shard_count: self.shard_count(input),
                kind: if input.chance(96) {
                    StreamKind::Durable
                } else {
                    StreamKind::InMemory
                },
            }),
            3 => Frame::DeleteStream {
                request_id,
                name: self.name(input),
            },
            4 => Frame::DescribeStream {
                request_id,
                name: self.name(input),
            },
            5 => Frame::ListStreams { request_id },
            6..=10 => Frame::Publish(Publish {
                request_id,
                ack: if input.chance(64) {
                    AckMode::FireAndForget
                } else {
                    AckMode::Acked
                },
                stream: self.name(input),
                records: self.records(input),
            }),
            11..=13 => Frame::Subscribe(Subscribe {
                request_id,
                stream: self.name(input),
                shards: if input.bool() {
                    ShardSelection::All
                } else {
                    ShardSelection::List((0..input.below(4)).map(|_| shard_number(input)).collect())
                },
                from: match input.byte() % 4 {
                    0 | 1 => StartPosition::Latest,
                    2 => StartPosition::Earliest,
                    _ => StartPosition::Offsets(
                        (0..input.below(4))
                            .map(|_| (shard_number(input), offset(input)))
                            .collect(),
                    ),
                },
            }),
            // Without another input byte, so the inputs found before keep their meaning (but
            // for the cluster admin requests, which take odd ids DescribeCluster had).
            14 if request_id % 2 == 0 => Frame::Done { request_id },
            14 if request_id % 8 == 3 => Frame::CreateClusterStream(CreateClusterStream {
                request_id,
                name: NAMES[(request_id / 8) as usize % NAMES.len()].to_owned(),
                shard_count: 1 + (request_id / 64) as u32 % 8,
                kind: StreamKind::Durable,
                replicas: 3,
                fsync: felix_wire::FsyncMode::OnCommit,
            }),
            14 if request_id % 8 == 5 => Frame::DeleteClusterStream {
                request_id,
                name: NAMES[(request_id / 8) as usize % NAMES.len()].to_owned(),
            },
            14 if request_id % 8 == 7 => Frame::ReadShard(ReadShard {
                request_id,
                stream: NAMES[(request_id / 8) as usize % NAMES.len()].to_owned(),
                shard: (request_id / 64) as u32 % 8,
                from: request_id / 512,
                max_records: (request_id / 16) as u32 % 3,
            }),
            14 => Frame::DescribeCluster { request_id },
            _ => server_frame(input, request_id),
        }
    }

    fn name(&self, input: &mut Input<'_>) -> String {
        match input.byte() {
            0..=223 => NAMES[input.below(NAMES.len())].to_owned(),
            224..=239 => text(input, 8),
            240..=247 => "x".repeat(usize::from(self.limits.max_name_bytes)),
            _ => "x".repeat(usize::from(self.limits.max_name_bytes) + 1),
        }
    }

    fn shard_count(&self, input: &mut Input<'_>) -> u32 {
        match input.byte() {
            0..=219 => 1 + u32::from(input.byte() % 5),
            220..=235 => 0,
            236..=249 => self.limits.max_shards,
            _ => self.limits.max_shards + 1,
        }
    }

    fn records(&self, input: &mut Input<'_>) -> Vec<Record> {
        match input.byte() {
            // A few records of fuzzer bytes.
            0..=199 => (0..input.below(5))
                .map(|_| Record {
                    key: Bytes::copy_from_slice(input.bytes(8)),
                    payload: Bytes::copy_from_slice(input.bytes(24)),
                })
                .collect(),
            // A batch at the limits: many records, or payloads and keys of the largest size.
            200..=229 => {
                let count = input.pick(&[2, 16, 64, self.limits.max_batch_records as usize]);
                (0..count.min(256))
                    .map(|index| Record {
                        key: Bytes::from(format!("k{index}")),
                        payload: Bytes::from(vec![b'p'; input.below(64)]),
                    })
                    .collect()
            }
            _ => {
                let key_len = usize::from(self.limits.max_key_bytes) + input.below(2);
                let payload_max = (self.limits.max_payload_bytes as usize).min(64 << 10);
                let payload_len = (payload_max + 1).saturating_sub(input.below(64));
                vec![Record {
                    key: Bytes::from(vec![b'k'; key_len]),
                    payload: Bytes::from(vec![b'p'; payload_len]),
                }]
            }
        }
    }
}

/// A frame only a server sends (a client may send it anyway).
/// What the fuzz machine does for each output of the driver (`dataplane/core/src/driver.rs`)
/// of core `core`.
struct FuzzEffects<'a> {
    world: &'a mut World,
    core: usize,
}

impl Effects for FuzzEffects<'_> {
    fn core(&mut self) -> &mut Core {
        &mut self.world.cores[self.core].core
    }

    fn send(&mut self, to: u16, message: CoreMessage) -> Result<(), CoreMessage> {
        let n = self.world.cores.len();
        let queue = &mut self.world.mesh[self.core * n + usize::from(to)];
        if queue.len() >= self.world.mesh_capacity {
            return Err(message);
        }
        queue.push_back(message);
        Ok(())
    }

    fn write_catalog(&mut self, _now: Now, write: CatalogWrite) {
        assert_eq!(self.core, 0, "catalogue writes come from core 0");
        self.world.catalog_writes.push(write);
    }

    fn route_cluster(&mut self, _now: Now, request: ClusterRequest) -> Result<(), ClusterRequest> {
        // The fuzzed broker is not a cluster member: the driver refuses it.
        Err(request)
    }

    fn check_token(&mut self, _now: Now, check: TokenCheck) {
        self.world.token_checks.push((self.core, check));
    }

    fn pump_log(&mut self, _now: Now) -> ControlFlow<()> {
        self.world.pump(self.core);
        if self.world.halted {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }

    fn stream_ready(&mut self, _stream: StreamId) {}

    fn drained(&mut self, _now: Now) {}
}

fn server_frame(input: &mut Input<'_>, request_id: u64) -> Frame {
    match input.byte() % 8 {
        0 => Frame::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            features: 0,
            limits: Limits::DEFAULT,
            core_ports: vec![7400],
            shard_map: vec![StreamRoute {
                name: "s0".to_owned(),
                kind: StreamKind::InMemory,
                shard_count: 1,
                hash: HashKind::Fnv1a64Mod,
                shard_cores: vec![0],
            }],
        }),
        1 => Frame::StreamInfo(StreamInfo {
            request_id,
            name: "s0".to_owned(),
            kind: StreamKind::InMemory,
            hash: HashKind::Fnv1a64Mod,
            shards: vec![ShardInfo {
                shard: 0,
                core: 0,
                oldest_offset: 0,
                next_offset: 0,
            }],
        }),
        2 => Frame::StreamList {
            request_id,
            streams: vec![StreamSummary {
                name: "s0".to_owned(),
                kind: StreamKind::InMemory,
                shard_count: 1,
            }],
        },
        3 => Frame::Ack(Ack {
            request_id,
            shards: vec![ShardAck {
                shard: 0,
                first_offset: 0,
                count: 1,
            }],
        }),
        4 => Frame::Subscribed(Subscribed {
            request_id,
            shards: vec![(0, 0)],
        }),
        5 => Frame::Delivery(Delivery {
            records: vec![DeliveredRecord {
                shard: 0,
                offset: 0,
                timestamp_us: 0,
                key: Bytes::new(),
                payload: Bytes::from_static(b"p"),
            }],
        }),
        _ => Frame::Error(ErrorFrame {
            request_id,
            code: ErrorCode::Internal,
            detail: 0,
            message: text(input, 16),
        }),
    }
}

/// What a client may receive: frames a server sends, never a request.
fn check_server_frame(frame: &Frame) {
    assert!(
        matches!(
            frame,
            Frame::HelloOk(_)
                | Frame::StreamInfo(_)
                | Frame::StreamList { .. }
                | Frame::Done { .. }
                | Frame::ClusterMap(_)
                | Frame::Records(_)
                | Frame::Ack(_)
                | Frame::Subscribed(_)
                | Frame::Delivery(_)
                | Frame::Error(_)
        ),
        "a server never sends a {}",
        frame.frame_type().name()
    );
}

/// A shard number: mostly one of the first few, sometimes anything.
fn shard_number(input: &mut Input<'_>) -> u32 {
    match input.byte() {
        0..=239 => u32::from(input.byte() % 6),
        _ => input.u32(),
    }
}

/// An offset: mostly small, sometimes anything.
fn offset(input: &mut Input<'_>) -> u64 {
    match input.byte() {
        0..=223 => u64::from(input.byte() % 8),
        _ => input.u64(),
    }
}

/// A short string from the fuzzer's bytes (any UTF-8, lossily).
fn text(input: &mut Input<'_>, max: usize) -> String {
    String::from_utf8_lossy(input.bytes(max)).into_owned()
}

fn principal(index: usize) -> Principal {
    principal_named(PRINCIPALS[index])
}

fn principal_named(name: &str) -> Principal {
    Principal::new(name).expect("a valid principal")
}

/// A fresh directory for the durable logs, on tmpfs when there is one (fsync is free there).
fn scratch_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix("felix-fuzz-core-")
        .tempdir_in(base)
        .or_else(|_| tempfile::tempdir())
        .expect("a temporary directory")
}

/// EIO and ENOSPC (Linux values; the `libc` crate is not a dependency of every includer).
fn libc_eio() -> i32 {
    5
}

fn libc_enospc() -> i32 {
    28
}
