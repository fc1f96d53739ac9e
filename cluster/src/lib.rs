//! felix-cluster: three or more brokers that keep a replicated control plane (membership,
//! streams, shard placement and leaders) through Raft, over QUIC+TLS peer connections with
//! mutual TLS.
//!
//! - `raft_log`: Raft's log and hard state kept in a Felix log (`felix-storage`): entries are
//!   records, a rewritten index supersedes what followed it, recovery replays the records.
//! - `transport`: the peer connections (s2n-quic, mutual TLS against the cluster CA), one per
//!   peer, carrying length-prefixed frames; best effort (Raft retries what is lost).
//! - `pki`: the cluster CA and node certificates for development and tests.
//! - `control`: the control plane's replicated state machine and its commands.
//! - `placement`: where each stream's shards and leaders go.
//! - `node`: the sans-IO Raft node (raft-rs `RawNode`): ticks, messages and proposals in,
//!   messages, persistence and applied commands out; driven by the service's loop (on the
//!   broker's core 0) and
//!   by the seeded simulation alike.
//! - `groups`, `shard`, `publish`, `subscribe`: the replicated shards a member holds, what
//!   their Raft groups apply, publishing into them and subscribing to them.
//! - `member`: the whole member as a sans-IO state machine (control plane, shard groups,
//!   in-memory shards, subscriptions): inputs with the time, frames and answers polled, logs
//!   through the storage backend its owner picks; `service`: the thread that runs it.
//! - `link`: a data-plane core's requests as the member's, its answers back to the core
//!   (IO-free: the broker and a simulation share it).
//! - `memory`: in-memory cluster streams (one copy per shard, on its owner), their forwards
//!   and fetches between members.
//!
//! The design and its trade-offs are in `docs/cluster.md`.

pub mod admin;
pub mod control;
pub mod groups;
pub mod link;
pub mod member;
pub mod memory;
pub mod node;
pub mod pki;
pub mod placement;
pub mod publish;
pub mod raft_log;
pub mod records;
pub mod service;
pub mod shard;
pub mod subscribe;
pub mod transport;
