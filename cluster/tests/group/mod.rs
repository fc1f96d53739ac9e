//! The simulated Raft group the seeded simulations share: `Node`s of one `Machine` on
//! `MemLog`s over a simulated network that drops, delays and reorders messages, with
//! partitions (one member cut off from the others for a while) and crash-restarts (a crashed
//! member keeps what it persisted and restarts on it). Every step checks election safety (at
//! most one leader per term) and state machine safety (no two members apply different
//! entries at an index). A run is a pure function of its seed.

#![allow(dead_code)] // each simulation uses a different subset

use std::collections::{BTreeMap, HashMap};

use felix_cluster::node::{Machine, MemLog, Node, NodeConfig, Output, Role};
use raft::prelude::{Message, MessageType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Simulated milliseconds per step.
pub const STEP_MS: u64 = 10;
/// Simulated milliseconds per Raft tick (the service's tick).
const TICK_MS: u64 = 100;

/// The faults of a run, drawn from its seed.
#[derive(Debug, Clone)]
pub struct Shape {
    pub members: u64,
    pub drop_per_mille: u32,
    pub max_delay_ms: u64,
    pub crash_per_mille: u32,
    pub partition_per_mille: u32,
    pub compact_after: u64,
    pub same_timeouts: bool,
    /// Leaders tell followers new commits lazily (`NodeConfig::lazy_commit`, as the shard
    /// groups do): on the next append or heartbeat, or when told to at a random later step.
    pub lazy_commit: bool,
    /// Writes stay in flight across steps (`MemLog::delayed`) and the nodes run as the
    /// member runs them (`Node::pump`: votes and append responses held until their write is
    /// stored; a crash keeps only the stored writes); otherwise each write is stored at once
    /// (`Node::advance`).
    pub delayed: bool,
}

impl Shape {
    pub fn draw(rng: &mut StdRng) -> Shape {
        Shape {
            members: if rng.random_ratio(1, 4) { 5 } else { 3 },
            drop_per_mille: [0, 20, 100][rng.random_range(0..3)],
            max_delay_ms: [1, 20, 80][rng.random_range(0..3)],
            crash_per_mille: [0, 2, 10, 30][rng.random_range(0..4)],
            partition_per_mille: [0, 1, 3][rng.random_range(0..3)],
            compact_after: [5, 50, 10_000][rng.random_range(0..3)],
            // Equal timeouts in some runs: split votes and vote-crash races.
            same_timeouts: rng.random_ratio(1, 3),
            lazy_commit: rng.random_ratio(1, 2),
            delayed: rng.random_ratio(2, 3),
        }
    }
}

/// What one step did, for the simulation's own checks.
pub struct Stepped<A> {
    /// `(member, applied)` in the order members applied them.
    pub applied: Vec<(u64, A)>,
    /// Members that crashed this step (their proposals in flight are lost).
    pub crashed: Vec<u64>,
}

/// The entry a member applied at an index: what state machine safety compares.
pub trait Identity {
    fn index(&self) -> u64;
    fn identity(&self) -> (u64, u64, u64);
}

pub struct Group<M: Machine + Clone> {
    pub rng: StdRng,
    pub shape: Shape,
    pub now_ms: u64,
    members: BTreeMap<u64, Option<Node<MemLog, M>>>,
    crashed: BTreeMap<u64, (MemLog, u64)>,
    configs: BTreeMap<u64, NodeConfig>,
    phase: BTreeMap<u64, u64>,
    network: Vec<(u64, u64, Message)>,
    sent: u64,
    cut: HashMap<(u64, u64), u64>,
    applied_at: BTreeMap<u64, (u64, u64, u64)>,
    leaders: BTreeMap<u64, u64>,
    fresh: M,
}

impl<M: Machine + Clone> Group<M>
where
    M::Applied: Identity,
{
    pub fn new(seed: u64, fresh: M) -> Group<M> {
        let mut rng = StdRng::seed_from_u64(seed);
        let shape = Shape::draw(&mut rng);
        let voters: Vec<u64> = (1..=shape.members).collect();
        let mut configs = BTreeMap::new();
        let mut phase = BTreeMap::new();
        let mut members = BTreeMap::new();
        for id in 1..=shape.members {
            let mut config = NodeConfig::new(id, voters.clone());
            // Fixed timeouts drawn from the seed: the run replays exactly.
            config.election_tick = if shape.same_timeouts {
                10
            } else {
                rng.random_range(10..20)
            };
            config.randomized_timeouts = false;
            config.compact_after = shape.compact_after;
            config.lazy_commit = shape.lazy_commit;
            config.boot = rng.random();
            phase.insert(id, rng.random_range(0..TICK_MS / STEP_MS));
            let store = if shape.delayed {
                MemLog::delayed()
            } else {
                MemLog::default()
            };
            let node = Node::with_machine(&config, store, fresh.clone()).expect("node");
            members.insert(id, Some(node));
            configs.insert(id, config);
        }
        Group {
            rng,
            shape,
            now_ms: 0,
            members,
            crashed: BTreeMap::new(),
            configs,
            phase,
            network: Vec::new(),
            sent: 0,
            cut: HashMap::new(),
            applied_at: BTreeMap::new(),
            leaders: BTreeMap::new(),
            fresh,
        }
    }

    pub fn ids(&self) -> Vec<u64> {
        self.members.keys().copied().collect()
    }

    pub fn member(&mut self, id: u64) -> Option<&mut Node<MemLog, M>> {
        self.members.get_mut(&id).and_then(Option::as_mut)
    }

    pub fn live(&self) -> impl Iterator<Item = &Node<MemLog, M>> {
        self.members.values().flatten()
    }

    pub fn leader(&self) -> Option<u64> {
        self.live()
            .find_map(|node| node.is_leader().then(|| node.id()))
    }

    fn linked(&self, a: u64, b: u64) -> bool {
        let key = (a.min(b), a.max(b));
        self.cut.get(&key).is_none_or(|until| *until <= self.now_ms)
    }

    fn send(&mut self, messages: Vec<Message>, faults: bool) {
        for message in messages {
            if faults && self.rng.random_ratio(self.shape.drop_per_mille, 1000) {
                self.snapshot_lost(&message);
                continue;
            }
            let delay = if faults {
                self.rng.random_range(1..=self.shape.max_delay_ms)
            } else {
                1
            };
            self.sent += 1;
            self.network.push((self.now_ms + delay, self.sent, message));
        }
    }

    /// A snapshot message that will never arrive: its sender is told, as the service's
    /// transport does.
    fn snapshot_lost(&mut self, message: &Message) {
        if message.get_msg_type() == MessageType::MsgSnapshot
            && let Some(sender) = self.member(message.from)
        {
            sender.report_snapshot(message.to, false);
        }
    }

    /// One step: deliver what is due, tick, inject faults (when `faults`), then `input` (the
    /// simulation's proposals), then drive every member.
    pub fn step(&mut self, faults: bool, input: impl FnOnce(&mut Self)) -> Stepped<M::Applied> {
        self.now_ms += STEP_MS;
        self.network.sort_by_key(|(at, seq, _)| (*at, *seq));
        let due = self
            .network
            .iter()
            .take_while(|(at, _, _)| *at <= self.now_ms)
            .count();
        let arrived: Vec<(u64, u64, Message)> = self.network.drain(..due).collect();
        for (_, _, message) in arrived {
            let alive = self.member(message.to).is_some();
            if !self.linked(message.from, message.to) || !alive {
                self.snapshot_lost(&message);
                continue;
            }
            let snapshot = message.get_msg_type() == MessageType::MsgSnapshot;
            let (from, to) = (message.from, message.to);
            if let Some(node) = self.member(to) {
                let _ = node.step(message);
            }
            if snapshot && let Some(sender) = self.member(from) {
                sender.report_snapshot(to, true);
            }
        }
        for id in self.ids() {
            let phase = self.phase[&id];
            if (self.now_ms / STEP_MS + phase).is_multiple_of(TICK_MS / STEP_MS)
                && let Some(node) = self.member(id)
            {
                node.tick();
            }
        }
        let mut crashed = Vec::new();
        if faults {
            crashed = self.faults();
        }
        input(self);
        let mut applied = Vec::new();
        for id in self.ids() {
            let tell = self.rng.random_ratio(1, 2);
            let Some(node) = self.members.get_mut(&id).and_then(Option::as_mut) else {
                continue;
            };
            if tell && node.commit_untold() {
                node.tell_commit();
            }
            let output = if self.shape.delayed {
                // The disk completes some of the writes in flight, in order.
                while node.store().writes_in_flight() > 0 && self.rng.random_ratio(3, 5) {
                    node.store_mut().complete_next();
                }
                let mut output = Output::default();
                node.pump(&mut output).expect("pump");
                node.compact_if_due().expect("compact");
                output
            } else {
                node.advance().expect("advance")
            };
            self.send(output.messages, faults);
            for entry in output.applied {
                let identity = entry.identity();
                match self.applied_at.get(&entry.index()) {
                    Some(seen) => assert_eq!(
                        *seen,
                        identity,
                        "state machine safety: member {id} applied a different entry at index {}",
                        entry.index()
                    ),
                    None => {
                        self.applied_at.insert(entry.index(), identity);
                    }
                }
                applied.push((id, entry));
            }
        }
        self.check_leaders();
        Stepped { applied, crashed }
    }

    fn faults(&mut self) -> Vec<u64> {
        let n = self.shape.members;
        let mut crashed = Vec::new();
        if self.rng.random_ratio(self.shape.crash_per_mille, 1000) {
            let id = self.rng.random_range(1..=n);
            if let Some(slot) = self.members.get_mut(&id)
                && let Some(node) = slot.take()
            {
                // What the disk stored is what survives.
                let store = node.store().crash_copy();
                let down_ms = self.rng.random_range(10..3_000);
                self.crashed.insert(id, (store, self.now_ms + down_ms));
                crashed.push(id);
            }
        }
        let restart: Vec<u64> = self
            .crashed
            .iter()
            .filter(|(_, (_, at))| *at <= self.now_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in restart {
            self.restart(id);
        }
        if self.rng.random_ratio(self.shape.partition_per_mille, 1000) {
            let lone = self.rng.random_range(1..=n);
            let until = self.now_ms + self.rng.random_range(500..4_000);
            for other in 1..=n {
                if other != lone {
                    self.cut.insert((lone.min(other), lone.max(other)), until);
                }
            }
        }
        crashed
    }

    fn restart(&mut self, id: u64) {
        if let Some((store, _)) = self.crashed.remove(&id) {
            let config = self.configs.get_mut(&id).expect("a member's config");
            config.boot = self.rng.random();
            let node = Node::with_machine(config, store, self.fresh.clone()).expect("restart");
            self.members.insert(id, Some(node));
        }
    }

    /// Restarts every crashed member and lifts every partition.
    pub fn heal(&mut self) {
        let crashed: Vec<u64> = self.crashed.keys().copied().collect();
        for id in crashed {
            self.restart(id);
        }
        self.cut.clear();
    }

    fn check_leaders(&mut self) {
        for node in self.members.values().flatten() {
            let status = node.status();
            if status.role == Role::Leader {
                let seen = *self.leaders.entry(status.term).or_insert(status.id);
                assert_eq!(
                    seen, status.id,
                    "election safety: two leaders in term {}",
                    status.term
                );
            }
        }
    }

    /// Every member's status, for failure messages.
    pub fn describe(&self) -> String {
        let statuses: Vec<_> = self.live().map(Node::status).collect();
        format!("{statuses:#?}")
    }
}
