//! The control plane's replicated state machine: the members, the streams and where their
//! shards are placed. Every broker applies the same committed commands in the same order
//! (`node.rs`), so every broker holds the same `ControlState`.
//!
//! Commands are JSON in Raft entries: the control plane carries a few commands per stream
//! created or member registered, never a record, so a readable encoding costs nothing that
//! matters. Applying is deterministic and total: a command that is not valid in the current
//! state (a stream that exists, more replicas than members) is *rejected* as the outcome of
//! its entry, identically on every broker, and changes nothing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::placement::{Seat, ShardPlacement, place};

/// Largest replication factor a stream may ask for.
pub const REPLICAS_MAX: u8 = 7;
/// Largest shard count of a stream in the cluster's placement.
pub const SHARDS_MAX: u32 = 4096;

/// Whether a stream's records are kept in memory or in the durable log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    InMemory,
    Durable,
}

/// When a replicated stream's members count an entry as theirs, and so when a publish is
/// acknowledged (docs/cluster.md, "Acknowledgement modes"; `raft_log.rs`, "Durability").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fsync {
    /// Once fdatasynced: an acknowledged record is on a majority's disks.
    #[default]
    OnCommit,
    /// Once written (page cache), fdatasynced every FELIX_DURABLE_FSYNC_INTERVAL_MS of each
    /// member: an acknowledged record survives killed processes, not a majority's power loss
    /// within that interval.
    Periodic,
}

impl Fsync {
    /// The name the settings and the CLI use: `on_commit` or `periodic`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Fsync::OnCommit => "on_commit",
            Fsync::Periodic => "periodic",
        }
    }
}

/// A broker of the cluster, as it registered itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: u64,
    /// Where clients reach the broker (its QUIC listener).
    pub client_addr: String,
    /// Where peers reach it.
    pub peer_addr: String,
    /// Its data-plane cores.
    pub cores: u16,
}

/// A stream and where its shards are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamPlacement {
    pub name: String,
    pub kind: StreamKind,
    pub replicas: u8,
    /// Raft index of the entry that created it: tells a recreated stream of the same name from
    /// the old one.
    pub incarnation: u64,
    pub shards: Vec<ShardPlacement>,
    /// When its shard groups acknowledge (durable streams; in-memory ones are on_commit).
    #[serde(default)]
    pub fsync: Fsync,
}

/// A control-plane command, proposed by any broker and applied by all once committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// A broker announces how clients and peers reach it (at every start; the newest wins).
    Register { member: Member },
    /// Creates a stream and places its shards over the registered members.
    CreateStream {
        name: String,
        kind: StreamKind,
        shards: u32,
        replicas: u8,
        /// Absent in commands of brokers before acknowledgement modes: on_commit.
        #[serde(default)]
        fsync: Fsync,
    },
    /// Deletes a stream.
    DeleteStream { name: String },
}

/// A command with the proposal it answers: `(proposer, boot, sequence)` is unique per
/// proposal, so the broker that proposed it can answer its caller once the entry is applied
/// there. `boot` tells the proposer's runs apart: its sequence restarts at each start, and an
/// entry it proposed before a restart may still commit after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    pub proposer: u64,
    pub boot: u64,
    pub sequence: u64,
    pub command: Command,
}

/// What applying a command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Done,
    Rejected {
        reason: String,
        /// What kind of refusal (absent in answers of brokers before it: `invalid`).
        #[serde(default)]
        kind: Rejection,
    },
}

/// Why a command was rejected, for the error code a client hears.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    /// A create of a name that is taken.
    Exists,
    /// A delete of a name that is not there.
    NotFound,
    /// A bad argument (name, shard or replica count, kind and fsync mode together).
    #[default]
    Invalid,
}

/// The replicated state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlState {
    pub members: BTreeMap<u64, Member>,
    pub streams: BTreeMap<String, StreamPlacement>,
    /// Streams created so far: where the next stream's leader rotation starts.
    pub streams_created: u64,
    /// Raft index of the last entry applied.
    pub applied: u64,
    /// Per proposer: its run (`Proposal::boot`) and the outcomes of its last
    /// [`RECENT_PROPOSALS`] proposals by sequence, so a proposal proposed again (the service
    /// retries one that did not come back: a forward lost on the way to the leader, a leader
    /// change) is applied once and answered with its first outcome.
    #[serde(default)]
    pub recent: BTreeMap<u64, (u64, BTreeMap<u64, Outcome>)>,
}

/// Proposals per proposer whose outcomes are kept to answer a retry.
pub const RECENT_PROPOSALS: usize = 256;

impl ControlState {
    /// Applies a proposal at `index` once: a retry of a proposal applied before (same
    /// proposer, run and sequence) changes nothing and gets the first outcome back.
    pub fn apply_proposal(&mut self, index: u64, proposal: &Proposal) -> Outcome {
        let (boot, outcomes) = self
            .recent
            .entry(proposal.proposer)
            .or_insert_with(|| (proposal.boot, BTreeMap::new()));
        if *boot == proposal.boot
            && let Some(outcome) = outcomes.get(&proposal.sequence)
        {
            let outcome = outcome.clone();
            assert!(index > self.applied, "entries apply in order, once");
            self.applied = index;
            return outcome;
        }
        let outcome = self.apply(index, &proposal.command);
        let (boot, outcomes) = self
            .recent
            .entry(proposal.proposer)
            .or_insert_with(|| (proposal.boot, BTreeMap::new()));
        if *boot != proposal.boot {
            // A new run of the proposer: its earlier run's proposals will not be retried.
            *boot = proposal.boot;
            outcomes.clear();
        }
        outcomes.insert(proposal.sequence, outcome.clone());
        while outcomes.len() > RECENT_PROPOSALS {
            outcomes.pop_first();
        }
        outcome
    }

    /// Applies the command of the entry at `index`. Deterministic: the same state and command
    /// give the same outcome on every broker.
    pub fn apply(&mut self, index: u64, command: &Command) -> Outcome {
        assert!(index > self.applied, "entries apply in order, once");
        self.applied = index;
        match command {
            Command::Register { member } => {
                self.members.insert(member.id, member.clone());
                Outcome::Done
            }
            Command::CreateStream {
                name,
                kind,
                shards,
                replicas,
                fsync,
            } => self.create_stream(index, name, *kind, *shards, *replicas, *fsync),
            Command::DeleteStream { name } => {
                if self.streams.remove(name).is_some() {
                    Outcome::Done
                } else {
                    rejected_as(Rejection::NotFound, format!("no stream named {name:?}"))
                }
            }
        }
    }

    fn create_stream(
        &mut self,
        index: u64,
        name: &str,
        kind: StreamKind,
        shards: u32,
        replicas: u8,
        fsync: Fsync,
    ) -> Outcome {
        if self.streams.contains_key(name) {
            return rejected_as(Rejection::Exists, format!("stream {name:?} exists"));
        }
        if name.is_empty() || name.len() > 255 {
            return rejected("a stream name has 1 to 255 bytes".to_owned());
        }
        if shards == 0 || shards > SHARDS_MAX {
            return rejected(format!("shards must be 1 to {SHARDS_MAX}, not {shards}"));
        }
        if replicas == 0 || replicas > REPLICAS_MAX {
            return rejected(format!(
                "replicas must be 1 to {REPLICAS_MAX}, not {replicas}"
            ));
        }
        if kind == StreamKind::InMemory && replicas != 1 {
            return rejected("an in-memory stream keeps one copy: use --replicas 1".to_owned());
        }
        if kind == StreamKind::InMemory && fsync != Fsync::OnCommit {
            return rejected("an in-memory stream is never written to disk: no --fsync".to_owned());
        }
        if usize::from(replicas) > self.members.len() {
            return rejected(format!(
                "{replicas} replicas need {replicas} registered members; {} are",
                self.members.len()
            ));
        }
        let seats: Vec<Seat> = self
            .members
            .values()
            .map(|m| Seat {
                id: m.id,
                cores: m.cores,
            })
            .collect();
        let placed = place(&seats, shards, usize::from(replicas), self.streams_created);
        self.streams_created += 1;
        self.streams.insert(
            name.to_owned(),
            StreamPlacement {
                name: name.to_owned(),
                kind,
                replicas,
                incarnation: index,
                shards: placed,
                fsync,
            },
        );
        Outcome::Done
    }
}

fn rejected(reason: String) -> Outcome {
    rejected_as(Rejection::Invalid, reason)
}

fn rejected_as(kind: Rejection, reason: String) -> Outcome {
    Outcome::Rejected { reason, kind }
}

/// Encodes a proposal as an entry's data.
#[must_use]
pub fn encode(proposal: &Proposal) -> Vec<u8> {
    serde_json::to_vec(proposal).expect("a proposal always serializes")
}

/// Decodes an entry's data. An entry this broker cannot read is a fatal error for the caller
/// (the brokers run different versions), never skipped.
pub fn decode(data: &[u8]) -> Result<Proposal, serde_json::Error> {
    serde_json::from_slice(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64) -> Command {
        Command::Register {
            member: Member {
                id,
                client_addr: format!("127.0.0.1:{}", 7000 + id),
                peer_addr: format!("127.0.0.1:{}", 8000 + id),
                cores: 2,
            },
        }
    }

    fn create(name: &str, replicas: u8) -> Command {
        Command::CreateStream {
            name: name.to_owned(),
            kind: StreamKind::Durable,
            shards: 6,
            replicas,
            fsync: Fsync::OnCommit,
        }
    }

    #[test]
    fn invalid_commands_are_rejected_and_change_nothing_but_applied() {
        let mut state = ControlState::default();
        assert_eq!(state.apply(1, &member(1)), Outcome::Done);
        let before = state.clone();
        assert!(matches!(
            state.apply(2, &create("orders", 3)),
            Outcome::Rejected { .. }
        ));
        assert_eq!(state.streams, before.streams);
        assert_eq!(state.apply(3, &member(2)), Outcome::Done);
        assert_eq!(state.apply(4, &member(3)), Outcome::Done);
        assert_eq!(state.apply(5, &create("orders", 3)), Outcome::Done);
        assert!(matches!(
            state.apply(6, &create("orders", 3)),
            Outcome::Rejected { .. }
        ));
        let orders = &state.streams["orders"];
        assert_eq!(orders.incarnation, 5);
        assert_eq!(orders.shards.len(), 6);
        assert_eq!(
            state.apply(
                7,
                &Command::DeleteStream {
                    name: "orders".to_owned()
                }
            ),
            Outcome::Done
        );
        assert!(state.streams.is_empty());
        assert!(matches!(
            state.apply(
                8,
                &Command::CreateStream {
                    name: "cache".to_owned(),
                    kind: StreamKind::InMemory,
                    shards: 3,
                    replicas: 3,
                    fsync: Fsync::OnCommit,
                }
            ),
            Outcome::Rejected { .. }
        ));
    }

    #[test]
    fn a_proposal_applied_again_changes_nothing_and_keeps_its_outcome() {
        let mut state = ControlState::default();
        for id in 1..=3 {
            state.apply(id, &member(id));
        }
        let proposal = |boot, sequence, name: &str| Proposal {
            proposer: 2,
            boot,
            sequence,
            command: create(name, 3),
        };
        assert_eq!(state.apply_proposal(4, &proposal(7, 1, "a")), Outcome::Done);
        let incarnation = state.streams["a"].incarnation;
        // The same proposal committed again (a retry): no new stream, the first outcome.
        assert_eq!(state.apply_proposal(5, &proposal(7, 1, "a")), Outcome::Done);
        assert_eq!(state.streams["a"].incarnation, incarnation);
        assert_eq!(state.applied, 5);
        // Another proposal of the same name is a real second creation: refused.
        assert!(matches!(
            state.apply_proposal(6, &proposal(7, 2, "a")),
            Outcome::Rejected { .. }
        ));
        // A new run of the proposer starts its sequences again.
        assert_eq!(state.apply_proposal(7, &proposal(8, 1, "b")), Outcome::Done);
        assert!(state.streams.contains_key("b"));
    }

    #[test]
    fn leader_rotation_moves_with_each_stream() {
        let mut state = ControlState::default();
        for id in 1..=3 {
            state.apply(id, &member(id));
        }
        state.apply(4, &create("a", 3));
        state.apply(5, &create("b", 3));
        assert_eq!(state.streams["a"].shards[0].leader, 1);
        assert_eq!(state.streams["b"].shards[0].leader, 2);
    }

    #[test]
    fn proposals_round_trip() {
        let proposal = Proposal {
            proposer: 2,
            boot: 5,
            sequence: 9,
            command: create("orders", 3),
        };
        assert_eq!(decode(&encode(&proposal)).unwrap(), proposal);
        assert!(decode(b"{\"nope\":1}").is_err());
    }
}
