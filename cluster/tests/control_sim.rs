//! Seeded simulation of the control plane: three (or five) control-plane `Node`s in the
//! simulated group of `group/mod.rs` (drops, delays, reordering, partitions, crash-restarts;
//! election and state machine safety checked every step), proposing registrations and
//! stream creations at random members. At the end, after the faults heal: a leader is
//! elected, a last creation commits, every member holds the same state, and every
//! acknowledged creation (its proposer applied it as done) is in it.
//!
//! `FELIX_CLUSTER_SIM_SEEDS` (default 60) and `FELIX_CLUSTER_SIM_FIRST` choose the seeds.

mod group;
mod seeds;

use std::collections::{BTreeMap, BTreeSet};

use felix_cluster::control::{Command, ControlState, Member, Outcome, StreamKind};
use felix_cluster::node::Applied;
use group::{Group, Identity};
use rand::Rng;

impl Identity for Applied {
    fn index(&self) -> u64 {
        self.index
    }
    fn identity(&self) -> (u64, u64, u64) {
        (
            self.proposal.proposer,
            self.proposal.boot,
            self.proposal.sequence,
        )
    }
}

struct Run {
    group: Group<ControlState>,
    propose_per_mille: u32,
    /// Pending proposals: (proposer, sequence) -> stream name.
    pending: BTreeMap<(u64, u64), String>,
    /// Creations whose proposer applied them as done.
    acked: BTreeSet<String>,
    next_stream: u64,
}

impl Run {
    fn step(&mut self, faults: bool, propose_at: Option<u64>) {
        let propose_per_mille = self.propose_per_mille;
        let mut proposed = None;
        let next_stream = self.next_stream;
        let retry = self
            .pending
            .iter()
            .next()
            .map(|(key, name)| (*key, name.clone()));
        let stepped = self.group.step(faults, |group| {
            let at = propose_at.or_else(|| {
                group
                    .rng
                    .random_ratio(propose_per_mille, 1000)
                    .then(|| group.rng.random_range(1..=group.shape.members))
            });
            if let Some(id) = at
                && let Some(node) = group.member(id)
            {
                proposed = Some((id, propose(node, next_stream)));
            }
            // Sometimes a pending creation is proposed again, as the service does when one
            // does not come back in time: it must still apply once.
            if group.rng.random_ratio(propose_per_mille, 1000)
                && let Some(((proposer, sequence), name)) = retry.clone()
                && let Some(node) = group.member(proposer)
            {
                let _ = node.propose_again(sequence, creation(&name));
            }
        });
        if let Some((id, proposal)) = proposed {
            match proposal {
                Proposed::Creation(sequence) => {
                    self.pending
                        .insert((id, sequence), format!("s{next_stream}"));
                    self.next_stream += 1;
                }
                Proposed::Other => {}
            }
        }
        for crashed in stepped.crashed {
            // Its proposals in flight are lost with it (never acknowledged).
            self.pending.retain(|(proposer, _), _| *proposer != crashed);
        }
        for (id, applied) in stepped.applied {
            let key = (applied.proposal.proposer, applied.proposal.sequence);
            let mine = self
                .group
                .member(id)
                .is_some_and(|node| node.proposed(&applied.proposal));
            if mine
                && let Some(name) = self.pending.remove(&key)
                && applied.outcome == Outcome::Done
            {
                self.acked.insert(name);
            }
        }
    }

    /// Heals every fault and runs until the group converges; returns the common state.
    fn converge(&mut self) -> ControlState {
        self.group.heal();
        // Bounded: 60 simulated seconds. Every simulated second without an acknowledged
        // final creation, the current leader is asked for one (a proposal can be lost to a
        // leader change, or be a registration first).
        let mut finals: Vec<String> = Vec::new();
        for step in 0..6_000u64 {
            let final_acked = finals.iter().any(|name| self.acked.contains(name));
            let propose_at = if !final_acked && step.is_multiple_of(100) {
                let leader = self.group.leader();
                if leader.is_some() {
                    finals.push(format!("s{}", self.next_stream));
                }
                leader
            } else {
                None
            };
            self.step(false, propose_at);
            if final_acked {
                let states: Vec<&ControlState> = self.group.live().map(|n| n.state()).collect();
                let first = states[0];
                if states
                    .iter()
                    .all(|s| s.streams == first.streams && s.applied == first.applied)
                {
                    return first.clone();
                }
            }
        }
        panic!(
            "the group did not converge within 60 simulated seconds after healing: {}, finals {finals:?}",
            self.group.describe()
        );
    }
}

enum Proposed {
    Creation(u64),
    Other,
}

/// A member registers before anything else (the service does it at start); then it proposes
/// creations of `s<next>`.
fn propose(
    node: &mut felix_cluster::node::Node<felix_cluster::node::MemLog>,
    next: u64,
) -> Proposed {
    let id = node.id();
    if !node.state().members.contains_key(&id) {
        let _ = node.propose(Command::Register {
            member: Member {
                id,
                client_addr: format!("127.0.0.1:{}", 7000 + id),
                peer_addr: format!("127.0.0.1:{}", 8000 + id),
                cores: 2,
            },
        });
        return Proposed::Other;
    }
    match node.propose(creation(&format!("s{next}"))) {
        Ok(sequence) => Proposed::Creation(sequence),
        Err(_) => Proposed::Other,
    }
}

fn creation(name: &str) -> Command {
    Command::CreateStream {
        name: name.to_owned(),
        kind: StreamKind::InMemory,
        shards: 3,
        replicas: 1,
        fsync: Default::default(),
    }
}

fn run(seed: u64) {
    let group = Group::new(seed, ControlState::default());
    let mut run = Run {
        propose_per_mille: [20, 100][usize::from(seed % 2 == 1)],
        group,
        pending: BTreeMap::new(),
        acked: BTreeSet::new(),
        next_stream: 0,
    };
    for _ in 0..3_000 {
        run.step(true, None);
    }
    let state = run.converge();
    for name in &run.acked {
        assert!(
            state.streams.contains_key(name),
            "acknowledged stream {name} lost"
        );
    }
}

#[test]
fn control_plane_keeps_raft_safety_under_faults() {
    seeds::for_seeds("control-plane", "FELIX_CLUSTER_SIM", 0, 60, run);
}
