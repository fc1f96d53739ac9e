//! Replicated streams on one core (docs/cluster.md, "The publish path"): a publish to a
//! durable stream of the cluster is admitted like any durable publish, split by shard, and each
//! shard's part is handed to the shell ([`Core::poll_cluster`]), which passes it to the
//! cluster service; the service answers once the part is committed by the shard's Raft group
//! and applied on this broker ([`Core::handle_cluster_answer`]). The publish is acked when
//! every part is answered, with the offsets the group gave: Quorum consistency, whichever
//! member the publish entered.
//!
//! A subscription to a replicated stream ("Subscribing" there; the slot side is in
//! `subscribe.rs`) is one request to the service for all its shards; the service reads this
//! member's copy (committed records only) and sends batches back under the same credits as
//! another core's deliveries: a credit goes back for each batch the subscription's stream
//! takes.
//!
//! The core knows the cluster's durable streams by name and shard count
//! ([`Core::set_cluster_streams`], from the shell whenever the control plane changes). A
//! stream of this broker's own catalogue wins over a cluster stream of the same name.

use std::collections::HashMap;

use felix_engine::EngineError;
use felix_wire::{ErrorCode, Publish, Record, ShardAck};

use crate::config::{Now, StreamId};
use crate::core::{Core, Request};
use crate::publish::PendingPublish;

/// A shard's part of a publish to a replicated stream, for the cluster service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterPublish {
    /// Answers this part ([`Core::handle_cluster_answer`]).
    pub token: u64,
    pub stream: String,
    pub shard: u32,
    /// The shard's records, in the order the publish carried them.
    pub records: Vec<Record>,
    /// Broker time at admission, microseconds since the Unix epoch (the records' timestamp).
    pub unix_us: u64,
}

/// Why the cluster did not take a part, or refused or ended a subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterRefusal {
    pub code: ErrorCode,
    /// The error's detail (`TooOld`: the oldest offset held), else 0.
    pub detail: u64,
    pub message: String,
}

/// Where a replicated shard's delivery starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterStart {
    Earliest,
    Latest,
    Offset(u64),
}

/// A subscription to shards of a replicated stream, for the cluster service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSubscribe {
    /// Names the subscription in every later request and answer.
    pub token: u64,
    pub stream: String,
    /// `(shard, start)` per selected shard, ascending.
    pub shards: Vec<(u32, ClusterStart)>,
    /// Bounds of one delivered batch.
    pub max_records: usize,
    pub max_bytes: usize,
}

/// What a core asks of the cluster service, in the order it asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterRequest {
    Publish(ClusterPublish),
    Subscribe(ClusterSubscribe),
    /// The subscription's stream took one of its batches: send one more.
    Credit {
        token: u64,
    },
    /// The subscription's stream is gone.
    Unsubscribe {
        token: u64,
    },
}

/// Where a publish's stream is.
pub(crate) enum Target {
    Local(felix_engine::StreamMeta),
    /// A durable stream of the cluster with this many shards.
    Cluster(u32),
}

impl Core {
    /// The cluster's durable streams (name, shard count); replaces the previous set. Parts
    /// already handed to the cluster are answered as usual.
    pub fn set_cluster_streams(&mut self, streams: HashMap<String, u32>) {
        self.cluster_streams = streams;
    }

    /// Whether `name` is a stream of the cluster this core routes publishes for.
    #[must_use]
    pub fn is_cluster_stream(&self, name: &str) -> bool {
        self.cluster_streams.contains_key(name)
    }

    /// The next request for the cluster service, oldest first.
    pub fn poll_cluster(&mut self) -> Option<ClusterRequest> {
        self.cluster_out.pop_front()
    }

    /// The cluster's answer to part `token`: the offsets the shard gave its records, or why
    /// not. Unknown tokens are ignored (never handed out, or answered already).
    pub fn handle_cluster_answer(
        &mut self,
        now: Now,
        token: u64,
        result: Result<ShardAck, ClusterRefusal>,
    ) {
        let Some(Request::ClusterPart { publish }) = self.requests.remove(&token) else {
            return;
        };
        let result = result
            .map(|ack| vec![ack])
            .map_err(ClusterRefusal::into_error);
        self.resolve_part(now, publish, result);
        // The freed ingress job admits the next waiter.
        self.settle(now);
    }

    /// Where `name` is published: this broker's own stream, or the cluster's.
    pub(crate) fn target(&self, name: &str) -> Option<Target> {
        if let Some(meta) = self.engine.lookup(name) {
            return Some(Target::Local(meta));
        }
        self.cluster_streams
            .get(name)
            .map(|shards| Target::Cluster(*shards))
    }

    /// Splits an admitted publish by shard and hands each part to the cluster.
    pub(crate) fn run_cluster_publish(
        &mut self,
        now: Now,
        stream: StreamId,
        publish: Publish,
        shard_count: u32,
        payload_bytes: u64,
    ) {
        let Publish {
            request_id,
            ack,
            stream: name,
            records,
        } = publish;
        let record_count = records.len() as u64;
        let mut parts: Vec<(u32, Vec<Record>)> = Vec::new();
        for record in records {
            let shard = felix_wire::shard_for_key(&record.key, shard_count);
            match parts.iter_mut().find(|(s, _)| *s == shard) {
                Some((_, part)) => part.push(record),
                None => parts.push((shard, vec![record])),
            }
        }
        let publish_token = self.token();
        let pending = PendingPublish::new(
            stream,
            request_id,
            ack,
            payload_bytes,
            record_count,
            u16::try_from(parts.len()).expect("at most max_batch_records parts"),
        );
        for (shard, records) in parts {
            let token = self.token();
            self.requests.insert(
                token,
                Request::ClusterPart {
                    publish: publish_token,
                },
            );
            self.cluster_out
                .push_back(ClusterRequest::Publish(ClusterPublish {
                    token,
                    stream: name.clone(),
                    shard,
                    records,
                    unix_us: now.unix_us,
                }));
        }
        self.hold(publish_token, pending);
    }
}

impl ClusterRefusal {
    pub(crate) fn into_error(self) -> EngineError {
        EngineError::new(self.code, self.detail, self.message)
    }
}
