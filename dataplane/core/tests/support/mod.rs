//! A hand-driven broker of N core machines for the tests: the test decides when messages
//! between cores are delivered (holding a core's inbox is how a test keeps its ingress queue
//! full), time is a counter the test advances, and every stream's output is decoded back into
//! frames. No thread, socket or clock.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use felix_core::{
    ConnectionId, Core, CoreConfig, CoreMessage, Flow, IngressSettings, Now, Security, StreamId,
};
use felix_engine::EngineConfig;
use felix_wire::{
    AckMode, CreateStream, Decoder, Frame, Hello, Limits, PROTOCOL_VERSION, Publish, Record,
    StreamKind,
};

pub const START_UNIX_US: u64 = 1_800_000_000_000_000;

/// Default ingress settings of the tests (a large queue unless a test narrows it).
pub fn ingress() -> IngressSettings {
    IngressSettings {
        depth: 512,
        budget_bytes: 64 << 20,
        fire_and_forget_waits: false,
        ack_on_commit: false,
        commit_wait: Duration::from_millis(2000),
    }
}

/// N cores, their mesh (one FIFO per ordered pair) and a logical clock.
pub struct Broker {
    pub cores: Vec<Core>,
    /// Indexed `from * n + to`.
    queues: Vec<VecDeque<CoreMessage>>,
    /// Messages to these cores stay queued until released.
    pub held: Vec<bool>,
    start: Instant,
    pub elapsed: Duration,
}

impl Broker {
    pub fn new(cores: u16, ingress: IngressSettings) -> Broker {
        Broker::with_security(cores, ingress, Security::open())
    }

    /// N cores sharing `security` (authentication mode, rules, connection limits).
    pub fn with_security(cores: u16, ingress: IngressSettings, security: Security) -> Broker {
        let security = std::sync::Arc::new(security);
        let ports: Vec<u16> = (0..cores).map(|i| 7400 + i).collect();
        Broker {
            cores: (0..cores)
                .map(|index| {
                    Core::new(CoreConfig {
                        index,
                        core_count: cores,
                        core_ports: ports.clone(),
                        limits: Limits::DEFAULT,
                        engine: EngineConfig::default(),
                        ingress,
                        next_stream_id: 0,
                        security: std::sync::Arc::clone(&security),
                    })
                })
                .collect(),
            queues: (0..usize::from(cores) * usize::from(cores))
                .map(|_| VecDeque::new())
                .collect(),
            held: vec![false; usize::from(cores)],
            start: Instant::now(),
            elapsed: Duration::ZERO,
        }
    }

    pub fn now(&self) -> Now {
        Now {
            at: self.start + self.elapsed,
            unix_us: START_UNIX_US + self.elapsed.as_micros() as u64,
        }
    }

    pub fn advance(&mut self, by: Duration) {
        self.elapsed += by;
        let now = self.now();
        for core in &mut self.cores {
            if core.poll_timeout().is_some_and(|at| at <= now.at) {
                core.handle_timeout(now);
            }
        }
        self.collect();
    }

    /// Moves every core's outbox into the queues, and checks every core.
    pub fn collect(&mut self) {
        let n = self.cores.len();
        for from in 0..n {
            for to in 0..n {
                if from == to {
                    continue;
                }
                while let Some(message) = self.cores[from].poll_message(to as u16) {
                    self.queues[from * n + to].push_back(message);
                }
            }
            while self.cores[from].poll_event().is_some() {}
            self.cores[from].assert_invariants();
        }
    }

    /// Delivers queued messages (not to held cores) until none is left.
    pub fn settle(&mut self) {
        self.collect();
        let n = self.cores.len();
        loop {
            let mut delivered = false;
            for queue in 0..self.queues.len() {
                let to = queue % n;
                if self.held[to] {
                    continue;
                }
                while let Some(message) = self.queues[queue].pop_front() {
                    let now = self.now();
                    self.cores[to].handle_message(now, message);
                    delivered = true;
                }
            }
            self.collect();
            if !delivered {
                return;
            }
        }
    }

    /// Delivers the oldest message waiting for core `to` (held or not); false if none.
    pub fn deliver_one(&mut self, to: usize) -> bool {
        self.collect();
        let n = self.cores.len();
        for from in 0..n {
            if let Some(message) = self.queues[from * n + to].pop_front() {
                let now = self.now();
                self.cores[to].handle_message(now, message);
                self.collect();
                return true;
            }
        }
        false
    }

    /// Messages waiting for core `to`.
    pub fn queued_for(&self, to: usize) -> usize {
        let n = self.cores.len();
        (0..n).map(|from| self.queues[from * n + to].len()).sum()
    }

    /// A connection on core `core` with its handshake done.
    pub fn connect(&mut self, core: usize) -> Conn {
        let id = self.cores[core]
            .handle_connection_opened(None)
            .expect("below the connection limit");
        let hello = self.cores[core].handle_stream_opened(id);
        let flow = self.feed(
            core,
            hello,
            Frame::Hello(Hello {
                min_version: PROTOCOL_VERSION,
                max_version: PROTOCOL_VERSION,
                features: 0,
                client_name: "test".to_owned(),
                token: None,
            }),
        );
        assert_eq!(flow, Flow::Continue);
        let frames = self.read(core, hello);
        assert!(
            matches!(frames.as_slice(), [Frame::HelloOk(_)]),
            "{frames:?}"
        );
        Conn {
            core,
            id,
            requests: hello,
        }
    }

    pub fn open(&mut self, conn: &Conn) -> StreamId {
        self.cores[conn.core].handle_stream_opened(conn.id)
    }

    pub fn feed(&mut self, core: usize, stream: StreamId, frame: Frame) -> Flow {
        let now = self.now();
        let flow = self.cores[core].handle_frame(now, stream, frame);
        self.collect();
        flow
    }

    /// Everything the stream's writer would write now, decoded.
    pub fn read(&mut self, core: usize, stream: StreamId) -> Vec<Frame> {
        self.read_all(core, stream).0
    }

    /// The frames and whether the stream was finished.
    pub fn read_all(&mut self, core: usize, stream: StreamId) -> (Vec<Frame>, bool) {
        let mut buffer = BytesMut::new();
        let mut finished = false;
        loop {
            let now = self.now();
            let transmit = self.cores[core].poll_transmit(now, stream);
            self.collect();
            let wrote = !transmit.chunks.is_empty();
            for chunk in &transmit.chunks {
                buffer.extend_from_slice(chunk);
            }
            if transmit.finish {
                finished = true;
                break;
            }
            if !wrote {
                break;
            }
        }
        let decoder = Decoder::new(Limits::DEFAULT);
        let mut frames = Vec::new();
        while let Some(frame) = decoder
            .decode(&mut buffer)
            .expect("the core writes valid frames")
        {
            frames.push(frame);
        }
        (frames, finished)
    }

    /// Creates a stream through `conn` (core 0 serializes it) and returns its answer.
    pub fn create(&mut self, conn: &Conn, name: &str, shards: u32, kind: StreamKind) -> Frame {
        let flow = self.feed(
            conn.core,
            conn.requests,
            Frame::CreateStream(CreateStream {
                request_id: 1,
                name: name.to_owned(),
                shard_count: shards,
                kind,
            }),
        );
        assert!(matches!(flow, Flow::Continue | Flow::Blocked));
        self.settle();
        let mut frames = self.read(conn.core, conn.requests);
        assert_eq!(frames.len(), 1, "{frames:?}");
        frames.remove(0)
    }
}

/// A connection of the test client.
pub struct Conn {
    pub core: usize,
    pub id: ConnectionId,
    /// Its first stream, a request stream after the handshake.
    pub requests: StreamId,
}

pub fn record(key: &str, payload: &str) -> Record {
    Record {
        key: Bytes::copy_from_slice(key.as_bytes()),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
    }
}

pub fn publish(request_id: u64, ack: AckMode, stream: &str, records: Vec<Record>) -> Frame {
    Frame::Publish(Publish {
        request_id,
        ack,
        stream: stream.to_owned(),
        records,
    })
}

/// A key whose shard (of `shards`) is owned by core `core` of `cores`.
pub fn key_on_core(shards: u32, cores: u16, core: u16) -> String {
    (0..)
        .map(|index| format!("k{index}"))
        .find(|key| {
            felix_affinity::shard_core(felix_wire::shard_for_key(key.as_bytes(), shards), cores)
                == core
        })
        .expect("some key lands there")
}
