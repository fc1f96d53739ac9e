//! Writes the committed seed corpus of the fuzz targets (`make fuzz-corpus`):
//! `fuzz/corpus/{decode,core,recovery}/`, each file named after what it holds. Deterministic:
//! running it again rewrites the same bytes.
//!
//! - `decode`: valid frames of every type made with `felix_wire::encode` (alone, several in a
//!   row, with a partial one after), and a few classic errors.
//! - `core`: programs for the machine harness (`felix_fuzz::machine`): a configuration
//!   ([`Setup`]), then steps ([`Op`]); frames are sent as raw chunks of encoded frames. Each
//!   seed is run once here and must get the answers it is meant to (checked), so a change of
//!   the harness that breaks a seed shows at once.
//! - `recovery`: segment files written by the real `felix_storage::Log` (one segment, two
//!   segments after a roll, torn tails), carried as raw bytes, and harness-framed segments
//!   (valid headers and records, a gap, a bad checkpoint, a corruption).
//!
//! Usage: `cargo run --manifest-path fuzz/Cargo.toml --example gen_corpus [-- OUT_DIR]`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_fuzz::machine::{Op, Setup};
use felix_storage::{FaultBackend, FsyncMode, Log, LogConfig, SEGMENT_BYTES_MIN, segment};
use felix_wire::{
    Ack, AckMode, CreateStream, DeliveredRecord, Delivery, ErrorCode, ErrorFrame, Frame, HashKind,
    Hello, HelloOk, Limits, PROTOCOL_VERSION, Publish, Record, ShardAck, ShardInfo, ShardSelection,
    StartPosition, StreamInfo, StreamKind, StreamRoute, StreamSummary, Subscribe, Subscribed,
};

fn main() {
    let out = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    let decode = decode_seeds();
    let core = core_seeds();
    let recovery = recovery_seeds();
    let mut total = 0usize;
    for (target, seeds) in [("decode", decode), ("core", core), ("recovery", recovery)] {
        let dir = out.join(target);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("clear the old corpus");
        }
        std::fs::create_dir_all(&dir).expect("the corpus directory");
        let bytes: usize = seeds.values().map(Vec::len).sum();
        for (name, data) in &seeds {
            std::fs::write(dir.join(name), data).expect("write a seed");
        }
        println!(
            "{target}: {} seeds, {bytes} bytes -> {}",
            seeds.len(),
            dir.display()
        );
        total += bytes;
    }
    println!("total {total} bytes");
}

// ---- decode ----

fn record(key: &str, payload: &str) -> Record {
    Record {
        key: Bytes::copy_from_slice(key.as_bytes()),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
    }
}

fn hello(token: Option<&str>) -> Frame {
    Frame::Hello(Hello {
        min_version: PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        features: 0,
        client_name: "seed/1".to_owned(),
        token: token.map(|token| Bytes::copy_from_slice(token.as_bytes())),
    })
}

fn create(request_id: u64, name: &str, shards: u32, kind: StreamKind) -> Frame {
    Frame::CreateStream(CreateStream {
        request_id,
        name: name.to_owned(),
        shard_count: shards,
        kind,
    })
}

fn publish(request_id: u64, ack: AckMode, stream: &str, records: Vec<Record>) -> Frame {
    Frame::Publish(Publish {
        request_id,
        ack,
        stream: stream.to_owned(),
        records,
    })
}

fn subscribe(request_id: u64, stream: &str, shards: ShardSelection, from: StartPosition) -> Frame {
    Frame::Subscribe(Subscribe {
        request_id,
        stream: stream.to_owned(),
        shards,
        from,
    })
}

fn encoded(frames: &[Frame]) -> Vec<u8> {
    let mut buf = BytesMut::new();
    for frame in frames {
        felix_wire::encode(frame, &mut buf);
    }
    buf.to_vec()
}

/// One frame of every type (all valid under the default limits).
fn every_frame() -> Vec<(&'static str, Frame)> {
    vec![
        ("hello", hello(None)),
        ("hello-token", hello(Some("felix_0123456789abcdef_secret"))),
        (
            "hello-ok",
            Frame::HelloOk(HelloOk {
                version: PROTOCOL_VERSION,
                features: 0,
                limits: Limits::DEFAULT,
                core_ports: vec![7400, 7401],
                shard_map: vec![StreamRoute {
                    name: "s0".to_owned(),
                    kind: StreamKind::InMemory,
                    shard_count: 2,
                    hash: HashKind::Fnv1a64Mod,
                    shard_cores: vec![0, 1],
                }],
            }),
        ),
        ("create", create(1, "s0", 2, StreamKind::InMemory)),
        ("create-durable", create(2, "s1", 3, StreamKind::Durable)),
        (
            "describe",
            Frame::DescribeStream {
                request_id: 3,
                name: "s0".to_owned(),
            },
        ),
        ("list", Frame::ListStreams { request_id: 4 }),
        (
            "delete",
            Frame::DeleteStream {
                request_id: 5,
                name: "s0".to_owned(),
            },
        ),
        (
            "stream-info",
            Frame::StreamInfo(StreamInfo {
                request_id: 3,
                name: "s0".to_owned(),
                kind: StreamKind::InMemory,
                hash: HashKind::Fnv1a64Mod,
                shards: vec![ShardInfo {
                    shard: 0,
                    core: 0,
                    oldest_offset: 0,
                    next_offset: 7,
                }],
            }),
        ),
        (
            "stream-list",
            Frame::StreamList {
                request_id: 4,
                streams: vec![StreamSummary {
                    name: "s0".to_owned(),
                    kind: StreamKind::InMemory,
                    shard_count: 2,
                }],
            },
        ),
        ("done", Frame::Done { request_id: 5 }),
        (
            "publish",
            publish(
                6,
                AckMode::Acked,
                "s0",
                vec![record("k1", "one"), record("", "two")],
            ),
        ),
        (
            "publish-fire-and-forget",
            publish(0, AckMode::FireAndForget, "s0", vec![record("k", "p")]),
        ),
        (
            "ack",
            Frame::Ack(Ack {
                request_id: 6,
                shards: vec![ShardAck {
                    shard: 1,
                    first_offset: 0,
                    count: 2,
                }],
            }),
        ),
        (
            "subscribe-all-earliest",
            subscribe(7, "s0", ShardSelection::All, StartPosition::Earliest),
        ),
        (
            "subscribe-list-offsets",
            subscribe(
                8,
                "s0",
                ShardSelection::List(vec![0, 1]),
                StartPosition::Offsets(vec![(0, 3), (1, 0)]),
            ),
        ),
        (
            "subscribed",
            Frame::Subscribed(Subscribed {
                request_id: 7,
                shards: vec![(0, 0), (1, 5)],
            }),
        ),
        (
            "delivery",
            Frame::Delivery(Delivery {
                records: vec![DeliveredRecord {
                    shard: 1,
                    offset: 5,
                    timestamp_us: 1_800_000_000_000_000,
                    key: Bytes::from_static(b"k"),
                    payload: Bytes::from_static(b"payload"),
                }],
            }),
        ),
        (
            "error",
            Frame::Error(ErrorFrame {
                request_id: 6,
                code: ErrorCode::StreamNotFound,
                detail: 0,
                message: "no stream s9".to_owned(),
            }),
        ),
    ]
}

fn decode_seeds() -> BTreeMap<String, Vec<u8>> {
    let mut seeds = BTreeMap::new();
    // Selector 0xff: the largest small limits; 0x00 the smallest; 0x5a in between.
    for (name, frame) in every_frame() {
        let mut data = vec![0xff];
        data.extend(encoded(std::slice::from_ref(&frame)));
        seeds.insert(format!("frame-{name}"), data);
    }
    let conversation = [
        hello(None),
        create(1, "s0", 2, StreamKind::InMemory),
        publish(
            2,
            AckMode::Acked,
            "s0",
            vec![record("a", "1"), record("b", "2")],
        ),
        subscribe(3, "s0", ShardSelection::All, StartPosition::Latest),
    ];
    let mut data = vec![0x5a];
    data.extend(encoded(&conversation));
    seeds.insert("conversation".to_owned(), data.clone());
    // The same with half of a frame after it (waits for more).
    let mut partial = encoded(&[Frame::Done { request_id: 9 }]);
    partial.truncate(9);
    data.extend(partial);
    seeds.insert("conversation-then-partial".to_owned(), data);
    // Classic errors: a header over the frame limit, an unknown type, flags, trailing bytes.
    seeds.insert(
        "error-too-large".to_owned(),
        vec![0x00, 0xff, 0xff, 0xff, 0x00, 0x20, 0x00],
    );
    seeds.insert(
        "error-unknown-type".to_owned(),
        vec![0xff, 0x08, 0, 0, 0, 0x7e, 0, 1, 2, 3, 4, 5, 6, 7, 8],
    );
    seeds.insert(
        "error-flags".to_owned(),
        vec![0xff, 0x08, 0, 0, 0, 0x16, 0x01, 1, 0, 0, 0, 0, 0, 0, 0],
    );
    let mut trailing = encoded(&[Frame::Done { request_id: 1 }]);
    trailing[0] += 1;
    trailing.push(0xaa);
    let mut data = vec![0xff];
    data.extend(trailing);
    seeds.insert("error-trailing".to_owned(), data);
    for (name, data) in &seeds {
        felix_fuzz::decode::run(data);
        assert!(!data.is_empty(), "{name}");
    }
    seeds
}

// ---- core ----

/// A machine-harness program: the configuration bytes, then steps.
struct Program {
    bytes: Vec<u8>,
}

impl Program {
    fn new(setup: Setup) -> Program {
        Program {
            bytes: setup.bytes(),
        }
    }

    fn op(&mut self, op: Op, args: &[u8]) -> &mut Program {
        self.bytes.push(op.byte());
        self.bytes.extend_from_slice(args);
        self
    }

    /// A connection to `core` (a client certificate of `principal`, if any).
    fn connect(&mut self, core: u8, principal: Option<u8>) -> &mut Program {
        let peer = principal.map_or(0, |p| 192 + p);
        self.op(Op::OpenConnection, &[core, peer])
    }

    /// The `conn`-th connection (of those that accept a stream) opens a stream; its task
    /// runs.
    fn open_stream(&mut self, conn: u8) -> &mut Program {
        self.op(Op::OpenStream, &[conn, 1])
    }

    /// The client of the `stream`-th stream sends `frames`, in raw chunks of at most 48
    /// bytes; the task runs after the last one.
    fn send(&mut self, stream: u8, frames: &[Frame]) -> &mut Program {
        let bytes = encoded(frames);
        let chunks: Vec<&[u8]> = bytes.chunks(48).collect();
        for (index, chunk) in chunks.iter().enumerate() {
            let last = index + 1 == chunks.len();
            let len = u8::try_from(chunk.len()).expect("48 at most");
            self.bytes.push(Op::SendRaw.byte());
            self.bytes.push(stream);
            self.bytes.push(len);
            self.bytes.extend_from_slice(chunk);
            // 100: one chunk, the task runs; 255: one chunk, the task waits.
            self.bytes.push(if last { 100 } else { 255 });
        }
        self
    }

    fn run_all(&mut self) -> &mut Program {
        self.op(Op::RunAll, &[])
    }

    /// Delivers `n` messages (of the first busy queue each) and lets every task run.
    fn deliver(&mut self, n: usize) -> &mut Program {
        for _ in 0..n {
            self.op(Op::Deliver, &[0]);
        }
        self.run_all()
    }

    fn answer_catalog(&mut self, ok: bool) -> &mut Program {
        self.op(Op::AnswerCatalog, &[0, if ok { 255 } else { 0 }])
    }

    /// Answers the oldest token check: verified as `principal`, or refused.
    fn answer_token(&mut self, principal: Option<u8>) -> &mut Program {
        match principal {
            Some(p) => self.op(Op::AnswerToken, &[0, 0, p]),
            None => self.op(Op::AnswerToken, &[0, 180, 0]),
        }
    }

    /// Completes `n` held log rounds (of the first core holding one each), then every task
    /// runs.
    fn complete_rounds(&mut self, n: usize) -> &mut Program {
        for _ in 0..n {
            self.op(Op::CompleteRound, &[0, 255, 0]);
        }
        self.run_all()
    }

    fn fin(&mut self, stream: u8) -> &mut Program {
        self.op(Op::Fin, &[stream, 1])
    }

    fn advance(&mut self, index: u8) -> &mut Program {
        self.op(Op::AdvanceTime, &[index])
    }

    /// A connection on `core` with its handshake done: it is the `conn`-th connection, and
    /// its hello stream becomes the `stream`-th stream.
    fn handshake(&mut self, core: u8, conn: u8, stream: u8) -> &mut Program {
        self.connect(core, None)
            .open_stream(conn)
            .send(stream, &[hello(None)])
    }

    fn done(&self) -> Vec<u8> {
        self.bytes.clone()
    }
}

fn default_setup(cores: u8) -> Setup {
    Setup {
        cores,
        ..Setup::default()
    }
}

fn three_records() -> Vec<Record> {
    vec![record("a", "one"), record("b", "two"), record("c", "three")]
}

/// A core seed: its name, its bytes, and the frames its clients must receive at least (type
/// name, count).
type CoreSeed = (&'static str, Vec<u8>, Vec<(&'static str, u64)>);

fn core_seeds() -> BTreeMap<String, Vec<u8>> {
    // Each seed, and the frames its clients must have received at least (type, count).
    let mut seeds: Vec<CoreSeed> = Vec::new();

    for cores in [1u8, 3] {
        let name = if cores == 1 {
            "in-memory-1-core"
        } else {
            "in-memory-3-cores"
        };
        let mut p = Program::new(default_setup(cores));
        p.handshake(0, 0, 0)
            .send(0, &[create(1, "s0", 4, StreamKind::InMemory)])
            .deliver(8)
            .open_stream(0)
            .send(
                1,
                &[subscribe(
                    2,
                    "s0",
                    ShardSelection::All,
                    StartPosition::Earliest,
                )],
            )
            .deliver(8)
            .send(0, &[publish(3, AckMode::Acked, "s0", three_records())])
            .deliver(12)
            .send(
                0,
                &[
                    publish(4, AckMode::FireAndForget, "s0", vec![record("d", "4")]),
                    Frame::ListStreams { request_id: 5 },
                    Frame::DescribeStream {
                        request_id: 6,
                        name: "s0".to_owned(),
                    },
                ],
            )
            .deliver(12)
            .send(
                0,
                &[Frame::DeleteStream {
                    request_id: 7,
                    name: "s0".to_owned(),
                }],
            )
            .deliver(12)
            .fin(0)
            .run_all();
        seeds.push((
            name,
            p.done(),
            vec![
                ("hello_ok", 1),
                ("ack", 1),
                ("subscribed", 1),
                ("delivery", 1),
                ("stream_list", 1),
                ("stream_info", 2),
                ("done", 1),
            ],
        ));
    }

    for (name, cores, periodic) in [
        ("durable-1-core", 1u8, false),
        ("durable-2-cores-periodic", 2, true),
    ] {
        let mut p = Program::new(Setup {
            cores,
            periodic,
            ..Setup::default()
        });
        p.handshake(0, 0, 0)
            .send(0, &[create(1, "s1", 2, StreamKind::Durable)])
            .answer_catalog(true)
            .deliver(8)
            .complete_rounds(2)
            .send(0, &[publish(2, AckMode::Acked, "s1", three_records())])
            .deliver(8)
            .complete_rounds(4)
            .advance(2)
            .complete_rounds(4)
            .deliver(8)
            .open_stream(0)
            .send(
                1,
                &[subscribe(
                    3,
                    "s1",
                    ShardSelection::All,
                    StartPosition::Earliest,
                )],
            )
            .deliver(8)
            .complete_rounds(2)
            .deliver(8);
        seeds.push((
            name,
            p.done(),
            vec![
                ("hello_ok", 1),
                ("stream_info", 1),
                ("ack", 1),
                ("subscribed", 1),
                ("delivery", 1),
            ],
        ));
    }

    // A durable create whose catalogue write fails.
    let mut p = Program::new(default_setup(2));
    p.handshake(1, 0, 0)
        .send(0, &[create(1, "s1", 2, StreamKind::Durable)])
        .deliver(4)
        .answer_catalog(false)
        .deliver(4);
    seeds.push(("durable-catalogue-fails", p.done(), vec![("error", 1)]));

    // Authentication required: a token verified as p0, another refused.
    let mut p = Program::new(Setup {
        cores: 1,
        auth_required: true,
        secured: true,
        ..Setup::default()
    });
    p.connect(0, None)
        .open_stream(0)
        .send(0, &[hello(Some("felix_0123456789abcdef_secret"))])
        .answer_token(Some(0))
        .run_all()
        .send(0, &[create(1, "s0", 2, StreamKind::InMemory)])
        .send(0, &[publish(2, AckMode::Acked, "s0", three_records())])
        .connect(0, None)
        .open_stream(1)
        .send(1, &[hello(Some("felix_0123456789abcdef_wrong"))])
        .answer_token(None)
        .run_all();
    seeds.push((
        "tokens",
        p.done(),
        vec![
            ("hello_ok", 1),
            ("stream_info", 1),
            ("ack", 1),
            ("error", 1),
        ],
    ));

    // Rules: p1 (client certificate) may not create, but publishes to s0 once p0 made it.
    let mut p = Program::new(Setup {
        cores: 2,
        secured: true,
        ..Setup::default()
    });
    p.connect(0, Some(0))
        .open_stream(0)
        .send(0, &[hello(None)])
        .send(0, &[create(1, "s0", 2, StreamKind::InMemory)])
        .deliver(6)
        .connect(1, Some(1))
        .open_stream(1)
        .send(1, &[hello(None)])
        .send(
            1,
            &[
                create(2, "s2", 1, StreamKind::InMemory),
                publish(3, AckMode::Acked, "s0", three_records()),
                Frame::ListStreams { request_id: 4 },
            ],
        )
        .deliver(8);
    seeds.push((
        "rules",
        p.done(),
        vec![
            ("hello_ok", 2),
            ("stream_info", 1),
            ("error", 1),
            ("ack", 1),
            ("stream_list", 1),
        ],
    ));

    // A tight ingress queue: publishes wait, are refused or shed; time passes.
    let mut p = Program::new(Setup {
        cores: 2,
        tight: true,
        waiting: true,
        narrow_mesh: true,
        ..Setup::default()
    });
    p.handshake(0, 0, 0)
        .send(0, &[create(1, "s0", 2, StreamKind::InMemory)])
        .deliver(6)
        .send(
            0,
            &[
                publish(2, AckMode::Acked, "s0", three_records()),
                publish(3, AckMode::Acked, "s0", three_records()),
                publish(0, AckMode::FireAndForget, "s0", three_records()),
            ],
        )
        .advance(3)
        .deliver(10)
        .advance(3)
        .run_all();
    seeds.push(("tight-ingress", p.done(), vec![("hello_ok", 1), ("ack", 1)]));

    // Subscriptions: a shard list from offsets, one past the end, one too many; a subscriber
    // that sends more bytes; a stream deleted under its subscriber.
    let mut p = Program::new(default_setup(2));
    p.handshake(0, 0, 0)
        .send(0, &[create(1, "s0", 2, StreamKind::InMemory)])
        .deliver(6)
        .send(0, &[publish(2, AckMode::Acked, "s0", three_records())])
        .deliver(6)
        .open_stream(0)
        .send(
            1,
            &[subscribe(
                3,
                "s0",
                ShardSelection::List(vec![0, 1]),
                StartPosition::Offsets(vec![(0, 1), (1, 0)]),
            )],
        )
        .deliver(6)
        .open_stream(0)
        .send(
            2,
            &[subscribe(
                4,
                "s0",
                ShardSelection::List(vec![5]),
                StartPosition::Latest,
            )],
        )
        .deliver(6)
        .send(
            0,
            &[Frame::DeleteStream {
                request_id: 5,
                name: "s0".to_owned(),
            }],
        )
        .deliver(10);
    seeds.push((
        "subscriptions",
        p.done(),
        vec![
            ("subscribed", 1),
            ("delivery", 1),
            ("done", 1),
            ("error", 2),
        ],
    ));

    // Hostile clients: a request before hello, a wrong version, garbage, a frame over the
    // limit, a stream that ends inside a frame, too many streams.
    let mut p = Program::new(Setup {
        cores: 1,
        small_limits: true,
        tight: true,
        ..Setup::default()
    });
    p.connect(0, None)
        .open_stream(0)
        .send(0, &[Frame::ListStreams { request_id: 1 }])
        .connect(0, None)
        .open_stream(0)
        .send(
            0,
            &[Frame::Hello(Hello {
                min_version: 2,
                max_version: 3,
                features: 0,
                client_name: "future".to_owned(),
                token: None,
            })],
        )
        .run_all();
    let mut hostile = p.done();
    let mut p = Program::new(default_setup(1));
    p.handshake(0, 0, 0).open_stream(0);
    // Garbage on a second stream, then a header announcing more than the frame limit on a
    // third, then half a frame and a finish on a fourth. Each of the first two is finished
    // (and forgotten) at once, so each new one is the second stream again.
    p.bytes.extend([
        Op::SendRaw.byte(),
        1,
        6,
        0xde,
        0xad,
        0xbe,
        0xef,
        0x00,
        0x01,
        100,
    ]);
    p.open_stream(0).bytes.extend([
        Op::SendRaw.byte(),
        1,
        6,
        0xff,
        0xff,
        0xff,
        0x7f,
        0x20,
        0x00,
        100,
    ]);
    p.open_stream(0)
        .bytes
        .extend([Op::SendRaw.byte(), 1, 4, 0x08, 0, 0, 0, 100]);
    p.fin(1).run_all();
    seeds.push((
        "hostile-before-hello",
        std::mem::take(&mut hostile),
        vec![("error", 2)],
    ));
    seeds.push((
        "hostile-bytes",
        p.done(),
        vec![("hello_ok", 1), ("error", 3)],
    ));

    // Connections that go away: mid-publish, and a hello that times out.
    let mut p = Program::new(default_setup(3));
    p.handshake(0, 0, 0)
        .send(0, &[create(1, "s0", 3, StreamKind::InMemory)])
        .deliver(6)
        .send(0, &[publish(2, AckMode::Acked, "s0", three_records())])
        .op(Op::ConnectionGone, &[0])
        .run_all()
        .op(Op::ConnectionTaskEnds, &[0])
        .deliver(10)
        .connect(1, None)
        .open_stream(0)
        .op(Op::HelloTimeout, &[0])
        .run_all()
        .op(Op::ConnectionTaskEnds, &[0]);
    seeds.push((
        "connections-go-away",
        p.done(),
        vec![("hello_ok", 1), ("stream_info", 1)],
    ));

    // Tokens reloaded: p0's token is revoked.
    let mut p = Program::new(Setup {
        cores: 1,
        auth_required: true,
        ..Setup::default()
    });
    p.connect(0, None)
        .open_stream(0)
        .send(0, &[hello(Some("felix_0123456789abcdef_secret"))])
        .answer_token(Some(0))
        .run_all()
        .op(Op::ReloadTokens, &[1])
        .run_all();
    seeds.push(("tokens-revoked", p.done(), vec![("hello_ok", 1)]));

    let mut out = BTreeMap::new();
    for (name, data, expected) in seeds {
        let received = felix_fuzz::machine::run_counted(&data);
        for (frame, at_least) in expected {
            let got = received.get(frame).copied().unwrap_or(0);
            assert!(
                got >= at_least,
                "core seed {name}: expected at least {at_least} {frame} frames, got {received:?}"
            );
        }
        out.insert(name.to_owned(), data);
    }
    out
}

// ---- recovery ----

/// Wall-clock time written in the seeds' segment headers (instead of the real time), so the
/// generator writes the same bytes every time.
const CREATED_UNIX_US: u64 = 1_800_000_000_000_000;

/// Records appended to a real log: (shard, key, payload length).
fn log_files(records: &[(u32, &str, usize)], fsync: FsyncMode) -> Vec<Vec<u8>> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut config = LogConfig::new(dir.path());
    config.segment_bytes = SEGMENT_BYTES_MIN;
    config.max_round_bytes = 4096;
    config.index_interval_bytes = 4096;
    config.fsync = fsync;
    let backend = FaultBackend::new(true).expect("the fault backend").0;
    let (mut log, _) = Log::open(config, backend).expect("a fresh log");
    let mut next: BTreeMap<u32, u64> = BTreeMap::new();
    for (index, (shard, key, len)) in records.iter().enumerate() {
        let offset = next.entry(*shard).or_insert(0);
        let payload = vec![b'a' + (index % 26) as u8; *len];
        log.append(
            *shard,
            *offset,
            1_000 + index as u64,
            key.as_bytes(),
            &payload,
        )
        .expect("append");
        *offset += 1;
        // Small rounds, as a broker under light load writes them.
        log.sync_now();
        log.flush(Duration::from_secs(10)).expect("flush");
    }
    drop(log);
    let mut seqs: Vec<u64> = std::fs::read_dir(dir.path())
        .expect("list")
        .filter_map(|entry| {
            segment::parse_file_name(&entry.expect("entry").file_name().to_string_lossy())
        })
        .collect();
    seqs.sort_unstable();
    seqs.into_iter()
        .map(|seq| {
            let path = dir.path().join(segment::file_name(seq));
            let file = std::fs::File::open(&path).expect("open a segment");
            let len = file.metadata().expect("stat").len();
            let header = segment::read_header(&file, len).expect("a valid header");
            let mut bytes = std::fs::read(&path).expect("read a segment");
            let fixed = segment::encode_header(seq, CREATED_UNIX_US, &header.checkpoint);
            bytes[..fixed.len()].copy_from_slice(&fixed);
            // Preallocated zeros are put back by the harness (size mode).
            while bytes.last() == Some(&0) {
                bytes.pop();
            }
            bytes
        })
        .collect()
}

/// A harness input carrying real segment files as raw bytes: header region, then data,
/// padded back to the segment size.
fn raw_segments(on_commit: bool, files: &[Vec<u8>], torn_tail: Option<&[u8]>) -> Vec<u8> {
    assert!(!files.is_empty() && files.len() <= 2);
    let mut data = vec![u8::from(on_commit), u8::from(files.len() == 2)];
    for (index, file) in files.iter().enumerate() {
        let mut file = file.clone();
        if index + 1 == files.len()
            && let Some(tail) = torn_tail
        {
            file.extend_from_slice(tail);
        }
        let header_len = 4096.min(file.len());
        // Raw header, raw body, preallocated to the segment size.
        data.push(0b0001_1000);
        data.extend(u16::try_from(header_len).expect("small").to_le_bytes());
        data.extend(&file[..header_len]);
        let body = &file[header_len..];
        data.extend(u16::try_from(body.len()).expect("small").to_le_bytes());
        data.extend(body);
    }
    data
}

/// A harness-framed record: `shard` (0..=3), at the expected offset, with a key and a
/// payload of `len` bytes of `fill`.
fn framed(shard: u8, key: &[u8], fill: u8, len: u16) -> Vec<u8> {
    let mut bytes = vec![0, shard, 0];
    bytes.extend(7u64.to_le_bytes());
    bytes.push(u8::try_from(key.len()).expect("short"));
    bytes.extend(key);
    bytes.push(fill);
    bytes.extend(len.to_le_bytes());
    bytes
}

fn recovery_seeds() -> BTreeMap<String, Vec<u8>> {
    let mut seeds = BTreeMap::new();
    let small: Vec<(u32, &str, usize)> = (0..6)
        .map(|i| {
            (
                i % 2,
                if i % 3 == 0 { "" } else { "key" },
                10 + 5 * i as usize,
            )
        })
        .collect();
    let one = log_files(&small, FsyncMode::OnCommit);
    assert_eq!(one.len(), 1);
    seeds.insert("log-one-segment".to_owned(), raw_segments(true, &one, None));
    seeds.insert(
        "log-torn-tail".to_owned(),
        raw_segments(true, &one, Some(&[0x1c, 0, 0, 0, 1, 0, 0, 0, 9, 9, 9])),
    );
    // Enough records of three shards to roll into a second segment.
    let many: Vec<(u32, &str, usize)> = (0..40).map(|i| (i % 3, "k", 300)).collect();
    let two = log_files(
        &many,
        FsyncMode::Periodic {
            interval: Duration::from_millis(5),
        },
    );
    assert_eq!(two.len(), 2, "the records fill more than one segment");
    seeds.insert(
        "log-two-segments".to_owned(),
        raw_segments(false, &two, None),
    );
    let mut cut = two[1].clone();
    cut.truncate(cut.len() - 100);
    seeds.insert(
        "log-two-segments-cut".to_owned(),
        raw_segments(false, &[two[0].clone(), cut], None),
    );

    // Harness-framed segments: valid header with the carried checkpoint, framed records.
    // fsync on commit; flags: two segments; first: header + checkpoint, records, padded.
    let mut data = vec![1, 0b0000_0001, 0b0001_0101];
    data.extend(0u64.to_le_bytes()); // created_unix_us
    data.push(4); // records
    for (shard, len) in [(0u8, 3u16), (1, 0), (0, 40), (2, 1000)] {
        data.extend(framed(shard, b"k", b'x', len));
    }
    data.push(0); // no corruption
    data.push(0b0001_0101); // second segment: the same layout
    data.extend(0u64.to_le_bytes());
    data.push(3);
    for (shard, len) in [(1u8, 5u16), (2, 5), (0, 5)] {
        data.extend(framed(shard, b"", b'y', len));
    }
    data.push(0);
    seeds.insert("framed-two-segments".to_owned(), data.clone());
    // The same with a flipped byte in the second segment's records.
    let mut flipped = data.clone();
    *flipped.last_mut().expect("the corruption byte") = 170;
    flipped.extend([7, 0x40]);
    seeds.insert("framed-flipped-byte".to_owned(), flipped);
    // A gap in the sequence (0, 2) and a .tmp leftover.
    let mut gap = data.clone();
    gap[1] = 0b0000_0111;
    gap.extend([4, b't', b'm', b'p', b'!']);
    seeds.insert("framed-gap-and-tmp".to_owned(), gap);
    // A checkpoint of fuzzer values that disagrees with the first segment.
    let mut checkpoint = vec![1, 0b0000_0001, 0b0001_0101];
    checkpoint.extend(0u64.to_le_bytes());
    checkpoint.push(2);
    checkpoint.extend(framed(0, b"k", b'a', 8));
    checkpoint.extend(framed(0, b"k", b'b', 8));
    checkpoint.push(0);
    // Second segment: header from fuzzer values (mode bit 2 clear): two entries.
    checkpoint.push(0b0001_0001);
    checkpoint.push(2); // count
    checkpoint.extend([0, 0, 0, 5]); // shard 0 continues at 5 (recovered up to 2)
    checkpoint.extend([0, 1, 0, 0]); // shard 1 at 0
    checkpoint.extend(0u64.to_le_bytes());
    checkpoint.push(1);
    checkpoint.extend(framed(0, b"", b'c', 1));
    checkpoint.push(0);
    seeds.insert("framed-bad-checkpoint".to_owned(), checkpoint);

    let expected: BTreeMap<&str, Option<u64>> = [
        ("log-one-segment", Some(6)),
        ("log-two-segments", Some(40)),
        ("framed-two-segments", Some(7)),
    ]
    .into_iter()
    .collect();
    for (name, data) in &seeds {
        let recovered = felix_fuzz::recovery::run_counted(data);
        if let Some(want) = expected.get(name.as_str()) {
            assert_eq!(
                recovered, *want,
                "recovery seed {name} recovers its records"
            );
        }
    }
    seeds
}
