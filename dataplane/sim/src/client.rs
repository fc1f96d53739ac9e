//! The simulated clients: connections and streams on the cores, frames queued and fed as the
//! machine accepts them (a parked stream is fed nothing, as QUIC flow control would do), and
//! every answer read back, decoded and checked: acks against the records sent, deliveries for
//! per-shard order with no gap or duplicate, errors for plausibility, counts for exactness.

use std::collections::{BTreeMap, VecDeque};

use bytes::{Bytes, BytesMut};
use felix_auth::Operation;
use felix_core::{ConnectionId, Flow, INGRESS_EXHAUSTED_MESSAGE, StreamId};
use felix_wire::{
    AckMode, CreateStream, Decoder, ErrorCode, Frame, Hello, Limits, PROTOCOL_VERSION, Publish,
    Record, ShardSelection, StartPosition, StreamKind, Subscribe,
};

use crate::oracle::{Change, Sighting, Snapshot};

use crate::world::World;

/// Stream names the clients use: few, so creates, deletes and publishes collide.
pub const NAMES: [&str; 3] = ["s0", "s1", "s2"];
/// Keys the clients use: enough to touch every shard of a small stream.
const KEYS: usize = 24;

/// A request a stream waits for an answer to.
#[derive(Debug)]
pub enum Pending {
    Publish {
        name: String,
        snapshot: Option<Snapshot>,
        ack: AckMode,
        records: Vec<Record>,
    },
    Create {
        name: String,
        shards: u32,
        kind: StreamKind,
        change: u64,
    },
    Delete {
        name: String,
        change: u64,
    },
    Describe {
        name: String,
        snapshot: Option<Snapshot>,
        /// Per shard, the last offset acked before the describe was sent: applied before it
        /// was read, so the answer's next offset is past it.
        acked: Vec<Option<u64>>,
        /// The name's epoch at sending, if no change on it was in flight.
        quiet: Option<u64>,
    },
    List {
        /// The global epoch at sending, if every name was settled then.
        epoch: Option<u64>,
    },
    /// A request the client's principal may not make (a secured run): only
    /// `PermissionDenied` may answer it.
    Denied {
        operation: Operation,
        name: String,
    },
}

/// A subscription as its client follows it.
#[derive(Debug)]
pub struct Sub {
    pub request_id: u64,
    pub name: String,
    pub selection: Vec<u32>,
    pub requested: StartPosition,
    /// The selection was an explicit list (not "all").
    pub explicit: bool,
    pub snapshot: Option<Snapshot>,
    /// The incarnation it certainly reads (set at `Subscribed`).
    pub incarnation: Option<u64>,
    /// Next offset expected per shard (set at `Subscribed`).
    pub next: BTreeMap<u32, u64>,
    pub ended: Option<ErrorCode>,
    /// The client's principal may not subscribe to the stream: refused, never subscribed.
    pub denied: bool,
}

#[derive(Debug)]
pub enum Role {
    Requests,
    Subscription(Box<Sub>),
}

/// One client stream.
#[derive(Debug)]
pub struct SimStream {
    pub id: StreamId,
    pub role: Role,
    /// Frames the client wrote that the machine has not taken yet.
    pub to_send: VecDeque<Frame>,
    /// The last frame fed was a publish of this mode and it parked the stream.
    pub parked: Option<AckMode>,
    pub inbuf: BytesMut,
    pub pending: BTreeMap<u64, Pending>,
    /// The machine reads no more frames (subscribed, or done).
    pub feeding_done: bool,
    pub fin_sent: bool,
    /// A subscriber that stopped reading for a while.
    pub lagging: bool,
}

/// One connection, to one core.
#[derive(Debug)]
pub struct Conn {
    pub core: u16,
    pub id: ConnectionId,
    pub ready: bool,
    pub streams: Vec<SimStream>,
}

/// One simulated client.
#[derive(Debug)]
pub struct Client {
    next_request: u64,
    next_publish: u64,
    pub conns: Vec<Conn>,
}

impl Client {
    pub fn new() -> Client {
        Client {
            next_request: 1,
            next_publish: 1,
            conns: Vec::new(),
        }
    }

    /// The broker restarted: every connection is gone.
    pub fn reset(&mut self) {
        self.conns.clear();
    }

    fn request_id(&mut self) -> u64 {
        let id = self.next_request;
        self.next_request += 1;
        id
    }
}

/// Where a stream is: client, connection, stream indices.
#[derive(Debug, Clone, Copy)]
pub struct At {
    pub client: usize,
    pub conn: usize,
    pub stream: usize,
}

impl World {
    fn stream(&mut self, at: At) -> &mut SimStream {
        &mut self.clients[at.client].conns[at.conn].streams[at.stream]
    }

    fn core_of(&self, at: At) -> u16 {
        self.clients[at.client].conns[at.conn].core
    }

    /// Every stream of every client, for picking.
    pub fn all_streams(&self) -> Vec<At> {
        let mut all = Vec::new();
        for (client, c) in self.clients.iter().enumerate() {
            for (conn, k) in c.conns.iter().enumerate() {
                for stream in 0..k.streams.len() {
                    all.push(At {
                        client,
                        conn,
                        stream,
                    });
                }
            }
        }
        all
    }

    // ---- connections and streams ----

    /// A client connects to a random core and says Hello (rarely with a version the broker
    /// does not speak).
    pub fn connect(&mut self, client: usize) {
        let core = u16::try_from(self.rng.below(u64::from(self.shape.cores))).expect("a core");
        let principal = self.principal_of(client);
        let id = self.cores[usize::from(core)]
            .core
            .handle_connection_opened(principal)
            .expect("far below the connection limit");
        let stream = self.cores[usize::from(core)].core.handle_stream_opened(id);
        let version = if self.rng.chance(20) {
            PROTOCOL_VERSION + 1
        } else {
            PROTOCOL_VERSION
        };
        self.trace.line(format!(
            "c{client} connects to core{core} (hello v{version})"
        ));
        let mut to_send = VecDeque::new();
        to_send.push_back(Frame::Hello(Hello {
            min_version: version,
            max_version: version,
            features: 0,
            client_name: format!("sim-{client}"),
            token: None,
        }));
        self.clients[client].conns.push(Conn {
            core,
            id,
            ready: false,
            streams: vec![SimStream::new(stream, to_send)],
        });
    }

    /// A ready connection of the client, if any (picked at random).
    fn ready_conn(&mut self, client: usize) -> Option<usize> {
        let ready: Vec<usize> = (0..self.clients[client].conns.len())
            .filter(|&conn| self.clients[client].conns[conn].ready)
            .collect();
        (!ready.is_empty()).then(|| ready[self.rng.index(ready.len())])
    }

    /// A request stream of the connection to queue a frame on: an open one, or a new one.
    fn request_stream(&mut self, client: usize, conn: usize) -> usize {
        let open: Vec<usize> = self.clients[client].conns[conn]
            .streams
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s.role, Role::Requests) && !s.feeding_done && !s.fin_sent)
            .map(|(index, _)| index)
            .collect();
        if !open.is_empty() && !self.rng.chance(150) {
            return open[self.rng.index(open.len())];
        }
        self.open_stream(client, conn, Role::Requests)
    }

    fn open_stream(&mut self, client: usize, conn: usize, role: Role) -> usize {
        let connection = &self.clients[client].conns[conn];
        let (core, id) = (connection.core, connection.id);
        let stream = self.cores[usize::from(core)].core.handle_stream_opened(id);
        let streams = &mut self.clients[client].conns[conn].streams;
        let mut sim = SimStream::new(stream, VecDeque::new());
        sim.role = role;
        streams.push(sim);
        streams.len() - 1
    }

    /// The client queues a random request (or opens a subscription).
    pub fn client_request(&mut self, client: usize) {
        let Some(conn) = self.ready_conn(client) else {
            self.connect(client);
            return;
        };
        let name = NAMES[self.rng.index(NAMES.len())].to_owned();
        let kind = self.rng.weighted(&[3, 2, 40, 10, 2, 2]);
        let operation = [
            Operation::Create,
            Operation::Delete,
            Operation::Publish,
            Operation::Subscribe,
            Operation::Describe,
        ]
        .get(kind)
        .copied();
        if let Some(operation) = operation
            && operation != Operation::Subscribe
            && !self.allowed(client, operation, &name)
        {
            self.queue_denied(client, conn, operation, name);
            return;
        }
        match kind {
            0 => {
                let shards = u32::try_from(self.rng.range(1, 6)).expect("small");
                let kind = if self.rng.chance(500) {
                    StreamKind::Durable
                } else {
                    StreamKind::InMemory
                };
                let stream = self.request_stream(client, conn);
                let request_id = self.clients[client].request_id();
                let change = self.oracle.begin(&name, Change::Create);
                self.trace.line(format!(
                    "c{client} create {name} x{shards} {kind:?} (#{request_id})"
                ));
                let at = At {
                    client,
                    conn,
                    stream,
                };
                let s = self.stream(at);
                s.pending.insert(
                    request_id,
                    Pending::Create {
                        name: name.clone(),
                        shards,
                        kind,
                        change,
                    },
                );
                s.to_send.push_back(Frame::CreateStream(CreateStream {
                    request_id,
                    name,
                    shard_count: shards,
                    kind,
                }));
            }
            1 => {
                let stream = self.request_stream(client, conn);
                let request_id = self.clients[client].request_id();
                let change = self.oracle.begin(&name, Change::Delete);
                self.trace
                    .line(format!("c{client} delete {name} (#{request_id})"));
                let s = self.stream(At {
                    client,
                    conn,
                    stream,
                });
                s.pending.insert(
                    request_id,
                    Pending::Delete {
                        name: name.clone(),
                        change,
                    },
                );
                s.to_send
                    .push_back(Frame::DeleteStream { request_id, name });
            }
            2 => self.queue_publish(client, conn, name),
            3 => self.subscribe(client, conn, name, None),
            4 => {
                let stream = self.request_stream(client, conn);
                let request_id = self.clients[client].request_id();
                let snapshot = self.oracle.snapshot(&name);
                let acked = snapshot.map_or_else(Vec::new, |snapshot| {
                    let shards = self.oracle.incarnations[&snapshot.incarnation].shards;
                    (0..shards)
                        .map(|shard| self.oracle.last_acked(snapshot.incarnation, shard))
                        .collect()
                });
                let quiet = self.oracle.quiet_epoch(&name);
                self.trace
                    .line(format!("c{client} describe {name} (#{request_id})"));
                let s = self.stream(At {
                    client,
                    conn,
                    stream,
                });
                s.pending.insert(
                    request_id,
                    Pending::Describe {
                        name: name.clone(),
                        snapshot,
                        acked,
                        quiet,
                    },
                );
                s.to_send
                    .push_back(Frame::DescribeStream { request_id, name });
            }
            _ => {
                let stream = self.request_stream(client, conn);
                let request_id = self.clients[client].request_id();
                let epoch = self
                    .oracle
                    .all_settled()
                    .then_some(self.oracle.global_epoch);
                let s = self.stream(At {
                    client,
                    conn,
                    stream,
                });
                s.pending.insert(request_id, Pending::List { epoch });
                s.to_send.push_back(Frame::ListStreams { request_id });
            }
        }
    }

    fn queue_publish(&mut self, client: usize, conn: usize, name: String) {
        let count = if self.rng.chance(300) {
            self.rng.range(8, 40)
        } else {
            self.rng.range(1, 6)
        };
        let publish = self.clients[client].next_publish;
        self.clients[client].next_publish += 1;
        let records: Vec<Record> = (0..count)
            .map(|index| {
                let key = format!("k{}", self.rng.index(KEYS));
                let padding = "x".repeat(usize::try_from(self.rng.below(300)).expect("small"));
                Record {
                    key: Bytes::from(key),
                    payload: Bytes::from(format!("c{client}p{publish}r{index}{padding}")),
                }
            })
            .collect();
        let ack = if self.rng.chance(250) {
            AckMode::FireAndForget
        } else {
            AckMode::Acked
        };
        let stream = self.request_stream(client, conn);
        let request_id = self.clients[client].request_id();
        let snapshot = self.oracle.snapshot(&name);
        self.trace.line(format!(
            "c{client} publish {name} x{count} {ack:?} (#{request_id}) on core{}",
            self.clients[client].conns[conn].core
        ));
        let s = self.stream(At {
            client,
            conn,
            stream,
        });
        if ack == AckMode::Acked {
            s.pending.insert(
                request_id,
                Pending::Publish {
                    name: name.clone(),
                    snapshot,
                    ack,
                    records: records.clone(),
                },
            );
        }
        s.to_send.push_back(Frame::Publish(Publish {
            request_id,
            ack,
            stream: name,
            records,
        }));
    }

    /// A request the client's principal may not make: the same frame as an allowed one, with
    /// nothing begun in the oracle, answered by `PermissionDenied` only (a fire-and-forget
    /// publish by nothing, counted as failed).
    fn queue_denied(&mut self, client: usize, conn: usize, operation: Operation, name: String) {
        let stream = self.request_stream(client, conn);
        let request_id = self.clients[client].request_id();
        let ack = if operation == Operation::Publish && self.rng.chance(250) {
            AckMode::FireAndForget
        } else {
            AckMode::Acked
        };
        self.trace.line(format!(
            "c{client} {} {name} (#{request_id}), which its principal may not",
            operation.name()
        ));
        let frame = match operation {
            Operation::Create => Frame::CreateStream(CreateStream {
                request_id,
                name: name.clone(),
                shard_count: 1,
                kind: StreamKind::InMemory,
            }),
            Operation::Delete => Frame::DeleteStream {
                request_id,
                name: name.clone(),
            },
            Operation::Describe => Frame::DescribeStream {
                request_id,
                name: name.clone(),
            },
            Operation::Publish => Frame::Publish(Publish {
                request_id,
                ack,
                stream: name.clone(),
                records: vec![Record {
                    key: Bytes::from_static(b"k0"),
                    payload: Bytes::from(format!("c{client}-denied")),
                }],
            }),
            Operation::Subscribe | Operation::List => {
                unreachable!("subscriptions are denied on their own stream; lists never")
            }
        };
        let s = self.stream(At {
            client,
            conn,
            stream,
        });
        if ack == AckMode::Acked {
            s.pending
                .insert(request_id, Pending::Denied { operation, name });
        }
        s.to_send.push_back(frame);
    }

    /// Opens a subscription stream (from `resume` positions, or a random start).
    pub fn subscribe(
        &mut self,
        client: usize,
        conn: usize,
        name: String,
        resume: Option<BTreeMap<u32, u64>>,
    ) {
        let snapshot = self.oracle.snapshot(&name);
        let shards = snapshot.map(|s| self.oracle.incarnations[&s.incarnation].shards);
        let (selection, from, list) = match (resume, shards) {
            (Some(next), _) => {
                let selection: Vec<u32> = next.keys().copied().collect();
                let from = StartPosition::Offsets(next.into_iter().collect());
                (ShardSelection::List(selection.clone()), from, selection)
            }
            (None, Some(count)) if self.rng.chance(400) => {
                let selection: Vec<u32> = (0..count).filter(|_| self.rng.chance(600)).collect();
                let selection = if selection.is_empty() {
                    vec![0]
                } else {
                    selection
                };
                let from = if self.rng.chance(500) {
                    StartPosition::Earliest
                } else {
                    StartPosition::Latest
                };
                (ShardSelection::List(selection.clone()), from, selection)
            }
            (None, count) => {
                let from = if self.rng.chance(500) {
                    StartPosition::Earliest
                } else {
                    StartPosition::Latest
                };
                let all = count.map(|count| (0..count).collect()).unwrap_or_default();
                (ShardSelection::All, from, all)
            }
        };
        let request_id = self.clients[client].request_id();
        self.trace.line(format!(
            "c{client} subscribe {name} {selection:?} from {from:?} (#{request_id})"
        ));
        let denied = !self.allowed(client, Operation::Subscribe, &name);
        let sub = Sub {
            denied,
            request_id,
            name: name.clone(),
            explicit: matches!(selection, ShardSelection::List(_)),
            selection: list,
            requested: from.clone(),
            snapshot,
            incarnation: None,
            next: BTreeMap::new(),
            ended: None,
        };
        let stream = self.open_stream(client, conn, Role::Subscription(Box::new(sub)));
        let s = self.stream(At {
            client,
            conn,
            stream,
        });
        s.to_send.push_back(Frame::Subscribe(Subscribe {
            request_id,
            stream: name,
            shards: selection,
            from,
        }));
    }

    // ---- feeding ----

    /// Streams with frames to feed that the machine accepts now.
    pub fn feedable(&self) -> Vec<At> {
        self.all_streams()
            .into_iter()
            .filter(|at| {
                let conn = &self.clients[at.client].conns[at.conn];
                let s = &conn.streams[at.stream];
                !s.to_send.is_empty()
                    && !s.feeding_done
                    && self.cores[usize::from(conn.core)].core.accepts_frames(s.id)
            })
            .collect()
    }

    /// Feeds the oldest queued frame of a stream to its core.
    pub fn feed(&mut self, at: At) {
        let core = self.core_of(at);
        let now = self.now();
        let s = self.stream(at);
        let id = s.id;
        let frame = s.to_send.pop_front().expect("a queued frame");
        self.trace.line(format!(
            "  c{} feeds core{core} stream{} {} #{}",
            at.client,
            id.0,
            frame.frame_type().name(),
            frame.request_id().unwrap_or(0)
        ));
        let publish = match &frame {
            Frame::Publish(publish) => Some((publish.ack, publish_bytes(publish))),
            _ => None,
        };
        self.stats.frames += 1;
        let before = self.cores[usize::from(core)].core.counters().clone();
        let flow = self.cores[usize::from(core)]
            .core
            .handle_frame(now, id, frame);
        let after = self.cores[usize::from(core)].core.counters().clone();
        if let Some((ack, bytes)) = publish {
            let fed = &mut self.fed[usize::from(core)];
            match ack {
                AckMode::Acked => fed.acked += 1,
                AckMode::FireAndForget => fed.fire_and_forget += 1,
            }
            self.check_admission(core, &before, &after, bytes, flow);
        }
        let s = self.stream(at);
        s.parked = match (flow, publish) {
            (Flow::Blocked, Some((ack, _))) => Some(ack),
            _ => None,
        };
        match flow {
            Flow::Continue | Flow::Blocked => {}
            Flow::Subscribed | Flow::Done => s.feeding_done = true,
        }
        self.drain(core);
    }

    /// A publish the queue shed, refused or parked found it full; one it admitted fit.
    fn check_admission(
        &mut self,
        core: u16,
        before: &felix_core::CoreCounters,
        after: &felix_core::CoreCounters,
        bytes: u64,
        flow: Flow,
    ) {
        let depth_max = self.shape.ingress.depth;
        let budget = self.shape.ingress.budget_bytes;
        let fits = before.ingress_waiting == 0
            && before.ingress_depth < depth_max
            && (before.ingress_bytes + bytes <= budget || before.ingress_depth == 0);
        let shed = after.shed - before.shed;
        let refused = after.refused - before.refused;
        let waited = after.waits - before.waits;
        if shed + refused + waited > 0 {
            assert!(
                !fits,
                "core {core} turned away a publish of {bytes} bytes that fit (depth {}/{depth_max}, \
                 {} of {budget} bytes, {} waiting)",
                before.ingress_depth, before.ingress_bytes, before.ingress_waiting
            );
            assert_eq!(shed + refused + waited, 1, "one answer per publish");
        }
        self.stats.shed += shed;
        self.stats.waits += waited;
        if waited > 0 {
            assert_eq!(flow, Flow::Blocked, "a waiting publish parks its stream");
        }
    }

    // ---- reading ----

    /// Reads everything the machine has for a stream, and closes it when the machine
    /// finished it.
    pub fn read(&mut self, at: At) {
        let core = self.core_of(at);
        let id = self.stream(at).id;
        loop {
            if self.halted {
                return;
            }
            let now = self.now();
            let transmit = self.cores[usize::from(core)].core.poll_transmit(now, id);
            self.drain(core);
            if !transmit.chunks.is_empty() {
                for chunk in &transmit.chunks {
                    self.stream(at).inbuf.extend_from_slice(chunk);
                }
                self.decode(at);
            }
            if transmit.finish {
                self.trace.line(format!(
                    "c{} core{core} stream{} finished{}",
                    at.client,
                    id.0,
                    transmit
                        .close_connection
                        .map(|code| format!(", connection closed {code:?}"))
                        .unwrap_or_default()
                ));
                if transmit.close_connection.is_some() {
                    self.close_conn(at.client, at.conn);
                } else {
                    self.close_stream(at, false);
                }
                return;
            }
            if transmit.chunks.is_empty() {
                return;
            }
        }
    }

    fn decode(&mut self, at: At) {
        let decoder = Decoder::new(Limits::DEFAULT);
        loop {
            let frame = decoder
                .decode(&mut self.stream(at).inbuf)
                .expect("the broker writes valid frames");
            let Some(frame) = frame else { return };
            self.answer(at, frame);
        }
    }

    /// One frame from the broker.
    fn answer(&mut self, at: At, frame: Frame) {
        let core = self.core_of(at);
        let client = at.client;
        match frame {
            Frame::HelloOk(hello) => {
                assert_eq!(hello.version, PROTOCOL_VERSION);
                assert_eq!(hello.core_ports.len(), usize::from(self.shape.cores));
                self.clients[client].conns[at.conn].ready = true;
            }
            Frame::Ack(ack) => {
                let Some(Pending::Publish {
                    name,
                    snapshot,
                    ack: AckMode::Acked,
                    records,
                }) = self.stream(at).pending.remove(&ack.request_id)
                else {
                    panic!("an Ack for #{} answers an acked publish", ack.request_id);
                };
                self.stats.acks += 1;
                let shards: Vec<String> = ack
                    .shards
                    .iter()
                    .map(|a| format!("{}:{}+{}", a.shard, a.first_offset, a.count))
                    .collect();
                self.trace.line(format!(
                    "c{client} #{} acked {name} {}",
                    ack.request_id,
                    shards.join(" ")
                ));
                self.check_ack(&name, snapshot, &records, &ack.shards);
            }
            Frame::Error(error) if error.request_id == 0 => {
                self.trace
                    .line(format!("c{client} stream error {:?}", error.code));
            }
            Frame::Error(error) => self.answer_error(at, core, error),
            Frame::StreamInfo(info) => match self.stream(at).pending.remove(&info.request_id) {
                Some(Pending::Create {
                    name,
                    shards,
                    kind,
                    change,
                }) => {
                    assert_eq!((info.name.as_str(), info.kind), (name.as_str(), kind));
                    assert_eq!(info.shards.len(), shards as usize);
                    for shard in &info.shards {
                        assert_eq!(
                            shard.core,
                            felix_affinity::shard_core(shard.shard, self.shape.cores)
                        );
                    }
                    if self.oracle.end(&name, change) {
                        assert!(
                            self.oracle.names[&name].current.is_none()
                                || self.oracle.names[&name].unknown,
                            "{name} was created though it existed: {:?}",
                            self.oracle.names[&name]
                        );
                        let id = self
                            .oracle
                            .created(&name, shards, kind == StreamKind::Durable);
                        self.trace
                            .line(format!("c{client} created {name} as #{id}"));
                    }
                }
                Some(Pending::Describe {
                    name,
                    snapshot,
                    acked,
                    quiet,
                }) => {
                    let shards: Vec<String> = info
                        .shards
                        .iter()
                        .map(|s| format!("{}:{}..{}", s.shard, s.oldest_offset, s.next_offset))
                        .collect();
                    self.trace.line(format!(
                        "c{client} #{} described {name} {}",
                        info.request_id,
                        shards.join(" ")
                    ));
                    let found = (info.shards.len() as u32, info.kind == StreamKind::Durable);
                    self.oracle.described(&name, quiet, Some(found));
                    if let Some(id) = self.oracle.still(&name, snapshot) {
                        let inc = &self.oracle.incarnations[&id];
                        assert_eq!(info.shards.len(), inc.shards as usize, "describe {name}");
                        for shard in &info.shards {
                            if let Some(&Some(last)) = acked.get(shard.shard as usize) {
                                assert!(
                                    shard.next_offset > last,
                                    "describe {name}: shard {} next {} but {last} was acked",
                                    shard.shard,
                                    shard.next_offset
                                );
                            }
                        }
                    }
                }
                other => panic!("StreamInfo answers {other:?}"),
            },
            Frame::Done { request_id } => match self.stream(at).pending.remove(&request_id) {
                Some(Pending::Delete { name, change }) => {
                    if self.oracle.end(&name, change) {
                        self.oracle.found(&name, true);
                        self.oracle.deleted(&name);
                        self.trace.line(format!("c{client} deleted {name}"));
                    }
                }
                other => panic!("Done answers {other:?}"),
            },
            Frame::StreamList {
                request_id,
                streams,
            } => {
                let Some(Pending::List { epoch }) = self.stream(at).pending.remove(&request_id)
                else {
                    panic!("StreamList answers a list");
                };
                if epoch == Some(self.oracle.global_epoch) && self.oracle.all_settled() {
                    let listed: Vec<&str> = streams.iter().map(|s| s.name.as_str()).collect();
                    let access = &self.accesses[client];
                    let known: Vec<&str> = self
                        .oracle
                        .names
                        .iter()
                        .filter(|(name, state)| state.current.is_some() && access.may_see(name))
                        .map(|(name, _)| name.as_str())
                        .collect();
                    assert_eq!(
                        listed, known,
                        "the list shows the acknowledged streams the principal may see"
                    );
                }
            }
            Frame::Subscribed(subscribed) => self.subscribed(at, &subscribed.shards),
            Frame::Delivery(delivery) => {
                for record in delivery.records {
                    self.delivered(at, &record);
                }
            }
            other => panic!("the broker sent a client {:?}", other.frame_type()),
        }
    }

    fn check_ack(
        &mut self,
        name: &str,
        snapshot: Option<Snapshot>,
        records: &[Record],
        shards: &[felix_wire::ShardAck],
    ) {
        assert!(
            shards.windows(2).all(|pair| pair[0].shard < pair[1].shard),
            "acks ascend by shard"
        );
        let total: u64 = shards.iter().map(|ack| u64::from(ack.count)).sum();
        assert_eq!(total, records.len() as u64, "every record is acked once");
        let Some(id) = self.oracle.still(name, snapshot) else {
            return;
        };
        let count = self.oracle.incarnations[&id].shards;
        for ack in shards {
            let mine: Vec<&Record> = records
                .iter()
                .filter(|record| felix_wire::shard_for_key(&record.key, count) == ack.shard)
                .collect();
            assert_eq!(
                mine.len(),
                ack.count as usize,
                "shard {} of {name} acked {} records of the {} sent there",
                ack.shard,
                ack.count,
                mine.len()
            );
            for (offset, record) in (ack.first_offset..).zip(mine) {
                self.oracle.saw(
                    id,
                    ack.shard,
                    offset,
                    (&record.key, &record.payload),
                    Sighting::Acked,
                );
            }
        }
    }

    fn answer_error(&mut self, at: At, core: u16, error: felix_wire::ErrorFrame) {
        let client = at.client;
        if let Role::Subscription(sub) = &mut self.stream(at).role
            && sub.request_id == error.request_id
        {
            assert_eq!(
                sub.denied,
                error.code == ErrorCode::PermissionDenied,
                "a subscription is refused by the rules exactly when its principal may not \
                 subscribe: {:?} {}",
                error.code,
                error.message
            );
            sub.ended = Some(error.code);
            let (name, next, lagged, denied) = (
                sub.name.clone(),
                sub.next.clone(),
                error.code == ErrorCode::SubscriberLagged,
                sub.denied,
            );
            if denied {
                self.stats.denied += 1;
            }
            if lagged && !error.message.ends_with(" ...") {
                // The resume positions name every selected shard, where this stream's
                // deliveries stopped, whichever core lagged.
                let listed: BTreeMap<u32, u64> = error
                    .message
                    .rsplit("shard:next_offset")
                    .next()
                    .unwrap_or_default()
                    .split_whitespace()
                    .map(|entry| {
                        let (shard, offset) = entry.split_once(':').expect("shard:offset");
                        (
                            shard.parse().expect("a shard"),
                            offset.parse().expect("an offset"),
                        )
                    })
                    .collect();
                assert_eq!(
                    listed, next,
                    "the lagged subscription's resume positions are where its deliveries stopped"
                );
            }
            self.trace.line(format!(
                "c{client} subscription {name} ended {:?}: {}",
                error.code, error.message
            ));
            if lagged {
                self.stats.lagged += 1;
                if !next.is_empty() && self.rng.chance(700) {
                    self.stats.resumed += 1;
                    self.subscribe(client, at.conn, name, Some(next));
                }
            }
            return;
        }
        let pending = self
            .stream(at)
            .pending
            .remove(&error.request_id)
            .unwrap_or_else(|| panic!("an Error answers request #{}", error.request_id));
        self.trace.line(format!(
            "c{client} #{} refused {:?}: {}",
            error.request_id, error.code, error.message
        ));
        match pending {
            Pending::Publish { name, snapshot, .. } => {
                if error.code == ErrorCode::IngressBudgetExhausted {
                    assert_eq!(error.message, INGRESS_EXHAUSTED_MESSAGE);
                    self.fed[usize::from(core)].refused += 1;
                    self.stats.refused += 1;
                } else if error.code == ErrorCode::StreamNotFound {
                    assert!(
                        self.oracle.still(&name, snapshot).is_none(),
                        "a publish to {name} found no stream though it existed throughout"
                    );
                } else {
                    assert!(
                        matches!(error.code, ErrorCode::StorageFull),
                        "a publish failed with {:?}: {}",
                        error.code,
                        error.message
                    );
                    // A held (slow) disk makes publishes wait; only a write failing with
                    // ENOSPC may fail one with storage_full.
                    assert!(
                        self.stats.disk_full > 0,
                        "storage_full though no write ever failed with ENOSPC: {}",
                        error.message
                    );
                }
            }
            Pending::Create { name, change, .. } => {
                assert!(
                    matches!(
                        error.code,
                        ErrorCode::StreamExists | ErrorCode::StorageFailed
                    ),
                    "create {name} failed with {:?}",
                    error.code
                );
                if self.oracle.end(&name, change) && error.code == ErrorCode::StreamExists {
                    self.oracle.found(&name, true);
                }
            }
            Pending::Delete { name, change } => {
                assert!(
                    matches!(
                        error.code,
                        ErrorCode::StreamNotFound | ErrorCode::StorageFailed
                    ),
                    "delete {name} failed with {:?}",
                    error.code
                );
                if self.oracle.end(&name, change) && error.code == ErrorCode::StreamNotFound {
                    self.oracle.found(&name, false);
                }
            }
            Pending::Describe {
                name,
                snapshot,
                quiet,
                ..
            } => {
                assert_eq!(error.code, ErrorCode::StreamNotFound);
                assert!(
                    self.oracle.still(&name, snapshot).is_none(),
                    "describe of {name} found no stream though it existed throughout"
                );
                self.oracle.described(&name, quiet, None);
            }
            Pending::List { .. } => panic!("a list cannot fail"),
            Pending::Denied { operation, name } => {
                self.stats.denied += 1;
                assert_eq!(
                    error.code,
                    ErrorCode::PermissionDenied,
                    "{} {name} by a principal that may not: {}",
                    operation.name(),
                    error.message
                );
                assert!(
                    error
                        .message
                        .ends_with(&format!("may not {} stream {name:?}", operation.name())),
                    "{}",
                    error.message
                );
            }
        }
    }

    fn subscribed(&mut self, at: At, start: &[(u32, u64)]) {
        let (name, snapshot) = match &self.stream(at).role {
            Role::Subscription(sub) => (sub.name.clone(), sub.snapshot),
            Role::Requests => panic!("Subscribed on a request stream"),
        };
        let incarnation = self.oracle.still(&name, snapshot);
        let Role::Subscription(sub) = &mut self.stream(at).role else {
            unreachable!("checked above");
        };
        assert!(
            !sub.denied,
            "a subscription its principal may not make was accepted"
        );
        let shards: Vec<u32> = start.iter().map(|(shard, _)| *shard).collect();
        // An explicit list is subscribed as asked; "all" means the shard count of the stream
        // the subscription reached, known only when nothing changed since it was sent.
        if sub.explicit || (incarnation.is_some() && !sub.selection.is_empty()) {
            assert_eq!(
                shards, sub.selection,
                "Subscribed lists the selected shards"
            );
        }
        if let StartPosition::Offsets(requested) = &sub.requested {
            let mut requested = requested.clone();
            requested.sort_unstable();
            assert_eq!(
                start,
                requested.as_slice(),
                "a resume starts where it asked"
            );
        }
        sub.next = start.iter().copied().collect();
        sub.incarnation = incarnation;
    }

    fn delivered(&mut self, at: At, record: &felix_wire::DeliveredRecord) {
        self.stats.deliveries += 1;
        let Role::Subscription(sub) = &mut self.stream(at).role else {
            panic!("a Delivery on a request stream");
        };
        let next = sub
            .next
            .get_mut(&record.shard)
            .unwrap_or_else(|| panic!("a record of shard {} not subscribed", record.shard));
        assert_eq!(
            record.offset, *next,
            "shard {} of {} delivered offset {} where {} was next (gap or duplicate)",
            record.shard, sub.name, record.offset, *next
        );
        *next += 1;
        if let Some(id) = sub.incarnation {
            self.oracle.saw(
                id,
                record.shard,
                record.offset,
                (&record.key, &record.payload),
                Sighting::Delivered,
            );
        }
    }

    // ---- closing ----

    /// The client goes away from a stream: it reads what is there first (so refusals are
    /// counted), then resets it. Streams with a catalogue change in flight are kept (their
    /// outcome must stay known).
    pub fn close_stream(&mut self, at: At, reset: bool) {
        let core = self.core_of(at);
        if reset {
            let s = self.stream(at);
            if s.pending
                .values()
                .any(|p| matches!(p, Pending::Create { .. } | Pending::Delete { .. }))
            {
                return;
            }
            self.read_quietly(at);
            if self.halted {
                return;
            }
        }
        let (id, parked) = {
            let s = self.stream(at);
            (s.id, s.parked)
        };
        let withdrawn_before = self.cores[usize::from(core)].core.counters().withdrawn;
        let now = self.now();
        self.cores[usize::from(core)]
            .core
            .handle_stream_closed(now, id);
        // A publish that still waited for room is withdrawn: never admitted, never answered.
        let withdrawn = self.cores[usize::from(core)].core.counters().withdrawn - withdrawn_before;
        let cancelled = match withdrawn {
            0 => None,
            1 => Some(parked.expect("a withdrawn waiter is the publish that parked the stream")),
            more => panic!("closing one stream withdrew {more} waiters"),
        };
        match cancelled {
            Some(AckMode::Acked) => self.fed[usize::from(core)].cancelled_acked += 1,
            Some(AckMode::FireAndForget) => {
                self.fed[usize::from(core)].cancelled_fire_and_forget += 1;
            }
            None => {}
        }
        self.trace.line(format!(
            "  c{} closes core{core} stream{}{}",
            at.client,
            id.0,
            cancelled
                .map(|ack| format!(" (waiting {ack:?} publish withdrawn)"))
                .unwrap_or_default()
        ));
        self.drain(core);
        self.clients[at.client].conns[at.conn]
            .streams
            .remove(at.stream);
    }

    /// Reads a stream's waiting output without acting on a finish (the caller closes it).
    fn read_quietly(&mut self, at: At) {
        let core = self.core_of(at);
        let id = self.stream(at).id;
        loop {
            let now = self.now();
            let transmit = self.cores[usize::from(core)].core.poll_transmit(now, id);
            self.drain(core);
            if self.halted {
                return;
            }
            if transmit.chunks.is_empty() {
                return;
            }
            for chunk in &transmit.chunks {
                self.stream(at).inbuf.extend_from_slice(chunk);
            }
            self.decode(at);
        }
    }

    /// Whether a connection has a catalogue change in flight (its outcome must stay known,
    /// so the client does not walk away from it).
    pub fn changing(&self, client: usize, conn: usize) -> bool {
        self.clients[client].conns[conn].streams.iter().any(|s| {
            s.pending
                .values()
                .any(|p| matches!(p, Pending::Create { .. } | Pending::Delete { .. }))
        })
    }

    /// The client closes a whole connection, after reading what its streams hold.
    pub fn close_conn(&mut self, client: usize, conn: usize) {
        // Reading may open streams (a lagged subscriber resumes): close until none is left.
        while let Some(stream) = self.clients[client].conns[conn]
            .streams
            .len()
            .checked_sub(1)
        {
            let at = At {
                client,
                conn,
                stream,
            };
            self.read_quietly(at);
            if self.halted {
                return;
            }
            self.close_stream(at, false);
            if self.halted {
                return;
            }
        }
        let (core, id) = {
            let c = &self.clients[client].conns[conn];
            (c.core, c.id)
        };
        self.cores[usize::from(core)]
            .core
            .handle_connection_closed(id);
        self.clients[client].conns.remove(conn);
    }

    /// The client writes bytes that are no frame (or ends a stream inside a frame): the
    /// stream answers `Error` with request id 0 and finishes; the connection goes on.
    pub fn garbage(&mut self, at: At) {
        let core = self.core_of(at);
        let s = self.stream(at);
        if s.feeding_done
            || s.fin_sent
            || !matches!(s.role, Role::Requests)
            || s.pending
                .values()
                .any(|p| matches!(p, Pending::Create { .. } | Pending::Delete { .. }))
        {
            return;
        }
        let id = s.id;
        if !self.cores[usize::from(core)].core.accepts_frames(id) {
            return;
        }
        let s = self.stream(at);
        s.feeding_done = true;
        s.to_send.clear();
        let now = self.now();
        self.trace.line(format!(
            "  c{} garbage on core{core} stream{}",
            at.client, id.0
        ));
        if self.rng.chance(500) {
            self.cores[usize::from(core)].core.handle_fin(now, id, true);
        } else {
            let error = felix_wire::WireError::Malformed {
                frame: "frame",
                reason: "simulated garbage".to_owned(),
            };
            self.cores[usize::from(core)]
                .core
                .handle_decode_error(now, id, &error);
        }
        self.drain(core);
    }

    /// The client finishes its side of a request stream.
    pub fn fin(&mut self, at: At) {
        let core = self.core_of(at);
        let s = self.stream(at);
        if s.fin_sent || !s.to_send.is_empty() || s.feeding_done {
            return;
        }
        s.fin_sent = true;
        let id = s.id;
        let now = self.now();
        self.cores[usize::from(core)]
            .core
            .handle_fin(now, id, false);
        self.drain(core);
    }
}

impl SimStream {
    fn new(id: StreamId, to_send: VecDeque<Frame>) -> SimStream {
        SimStream {
            id,
            role: Role::Requests,
            to_send,
            parked: None,
            inbuf: BytesMut::new(),
            pending: BTreeMap::new(),
            feeding_done: false,
            fin_sent: false,
            lagging: false,
        }
    }
}

fn publish_bytes(publish: &Publish) -> u64 {
    publish
        .records
        .iter()
        .map(|record| record.payload.len() as u64)
        .sum()
}
