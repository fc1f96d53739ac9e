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
//! The core knows the cluster through a [`ClusterView`] ([`Core::set_cluster_view`], from
//! the shell whenever the service's view changes): the members' client addresses and, per
//! replicated stream, each shard's leader and this member's offsets. It routes by it, and
//! answers `DescribeStream`, `ListStreams` and `DescribeCluster` (the cluster map a cluster
//! client publishes by) from it. A stream of this broker's own catalogue wins over a cluster
//! stream of the same name.

use std::collections::HashMap;
use std::sync::Arc;

use felix_auth::Operation;
use felix_engine::EngineError;
use felix_wire::{
    ClusterMap, ClusterMember, ClusterRoute, DeliveredRecord, ErrorCode, ErrorFrame, Frame,
    FsyncMode, HashKind, Publish, Record, Records, ShardAck, ShardInfo, StreamInfo, StreamKind,
    StreamSummary,
};

use crate::config::{Now, StreamId};
use crate::core::{Core, Flow, Parked, Request};
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
    /// The client's idempotent producer id and sequence (`ProducerPublish`, one shard): the
    /// replicated shard applies the batch once however often it is retried, through any
    /// member.
    pub producer: Option<(u64, u64)>,
}

/// The cluster as this member's service last described it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// This member's id (0: not a cluster member).
    pub member: u16,
    /// Every registered member's client address.
    pub members: Vec<ClusterMember>,
    /// Each cluster stream: replicated (durable) or in memory (one copy per shard).
    pub streams: HashMap<String, ClusterStream>,
}

/// One stream in a [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterStream {
    pub kind: StreamKind,
    /// Its shards, shard 0 first.
    pub shards: Vec<ClusterShard>,
}

/// One shard in a [`ClusterView`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterShard {
    /// The member leading it (an in-memory shard: its owner), as this member knows it (0:
    /// none known).
    pub leader: u16,
    /// This member's copy: the oldest offset held and the next one.
    pub oldest_offset: u64,
    pub next_offset: u64,
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

/// A cluster admin request of a client, already authorized by the core: a change through the
/// control plane, or a read of this member's copy of a replicated shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterAdmin {
    Create {
        name: String,
        kind: StreamKind,
        shard_count: u32,
        replicas: u8,
        fsync: FsyncMode,
    },
    Delete {
        name: String,
    },
    Read {
        stream: String,
        shard: u32,
        from: u64,
        /// At most this many records (already capped by the core).
        max_records: u32,
    },
}

/// The cluster's answer to a [`ClusterAdmin`] request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterAdminAnswer {
    /// A create or delete was applied on this member.
    Done,
    /// A read's committed records, in offset order (none at the end of the copy).
    Records(Vec<DeliveredRecord>),
}

/// What a core asks of the cluster service, in the order it asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterRequest {
    /// Answered by [`Core::handle_cluster_admin`].
    Admin {
        token: u64,
        admin: ClusterAdmin,
    },
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
    /// The cluster as the service now sees it; replaces the previous view. Parts and
    /// subscriptions already handed to the cluster go on as usual.
    pub fn set_cluster_view(&mut self, view: Arc<ClusterView>) {
        self.cluster = view;
    }

    /// Whether `name` is a stream of the cluster this core routes publishes for.
    #[must_use]
    pub fn is_cluster_stream(&self, name: &str) -> bool {
        self.cluster.streams.contains_key(name)
    }

    /// The shard count of cluster stream `name`.
    pub(crate) fn cluster_shard_count(&self, name: &str) -> Option<u32> {
        self.cluster
            .streams
            .get(name)
            .map(|known| u32::try_from(known.shards.len()).unwrap_or(u32::MAX))
    }

    /// `DescribeStream` of a cluster stream: its shards with this member's offsets (as of the
    /// service's last view, at most a tick old) and the core a core-aware client should
    /// send each shard's records to (any core takes them; these spread the load).
    pub(crate) fn describe_cluster_stream(
        &mut self,
        stream: StreamId,
        request_id: u64,
        name: &str,
    ) {
        let known = &self.cluster.streams[name];
        let kind = known.kind;
        let shards = known
            .shards
            .iter()
            .enumerate()
            .map(|(shard, view)| {
                let shard = u32::try_from(shard).unwrap_or(u32::MAX);
                ShardInfo {
                    shard,
                    core: self.owner(shard),
                    oldest_offset: view.oldest_offset,
                    next_offset: view.next_offset,
                }
            })
            .collect();
        let info = StreamInfo {
            request_id,
            name: name.to_owned(),
            kind,
            hash: HashKind::Fnv1a64Mod,
            shards,
        };
        self.write(stream, &Frame::StreamInfo(info));
    }

    /// The cluster streams the connection of `stream` may see, without those an own stream of
    /// the same name shadows.
    fn visible_cluster_streams(
        &self,
        stream: StreamId,
    ) -> impl Iterator<Item = (&String, &ClusterStream)> {
        self.cluster.streams.iter().filter(move |(name, _)| {
            self.engine.lookup(name).is_none() && self.may_see(stream, name)
        })
    }

    /// The cluster streams `ListStreams` adds to this broker's own (those not shadowed by an
    /// own stream of the same name).
    pub(crate) fn cluster_summaries(&self, stream: StreamId) -> Vec<StreamSummary> {
        let mut summaries: Vec<StreamSummary> = self
            .visible_cluster_streams(stream)
            .map(|(name, known)| StreamSummary {
                name: name.clone(),
                kind: known.kind,
                shard_count: u32::try_from(known.shards.len()).unwrap_or(u32::MAX),
            })
            .collect();
        summaries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        summaries
    }

    /// `DescribeCluster`: the members and each visible cluster stream's leaders (owners).
    pub(crate) fn describe_cluster(&mut self, stream: StreamId, request_id: u64) {
        let mut streams: Vec<ClusterRoute> = self
            .visible_cluster_streams(stream)
            .map(|(name, known)| ClusterRoute {
                name: name.clone(),
                leaders: known.shards.iter().map(|shard| shard.leader).collect(),
            })
            .collect();
        streams.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        let map = ClusterMap {
            request_id,
            member: self.cluster.member,
            members: self.cluster.members.clone(),
            streams,
        };
        self.write(stream, &Frame::ClusterMap(map));
    }

    /// A cluster admin request (`CreateClusterStream`, `DeleteClusterStream`, `ReadShard`):
    /// authorized here by the same rules as this broker's own admin (`admin` on the name to
    /// create or delete, `subscribe` to read), then handed to the cluster service; the stream
    /// waits for the answer ([`Core::handle_cluster_admin`]).
    pub(crate) fn request_cluster_admin(
        &mut self,
        stream: StreamId,
        request_id: u64,
        admin: ClusterAdmin,
    ) -> Flow {
        let (operation, name) = match &admin {
            ClusterAdmin::Create { name, .. } => (Operation::Create, name),
            ClusterAdmin::Delete { name } => (Operation::Delete, name),
            ClusterAdmin::Read { stream, .. } => (Operation::Subscribe, stream),
        };
        if let Err(denied) = self.authorize(stream, operation, name) {
            self.write_error(stream, denied.to_frame(request_id));
            return Flow::Continue;
        }
        if self.cluster.member == 0 {
            self.write_error(
                stream,
                ErrorFrame {
                    request_id,
                    code: ErrorCode::InvalidArgument,
                    detail: 0,
                    message: "this broker is not a cluster member (FELIX_CLUSTER_NODE_ID is 0)"
                        .to_owned(),
                },
            );
            return Flow::Continue;
        }
        let token = self.token();
        self.requests
            .insert(token, Request::ClusterAdmin { stream, request_id });
        self.cluster_out
            .push_back(ClusterRequest::Admin { token, admin });
        self.stream_mut(stream).parked = Some(Parked::Remote);
        Flow::Blocked
    }

    /// The cluster's answer to admin request `token`: `Done`, the records read (as many as
    /// fit one frame of this broker's limits), or the refusal. Unknown tokens are ignored.
    pub fn handle_cluster_admin(
        &mut self,
        token: u64,
        result: Result<ClusterAdminAnswer, ClusterRefusal>,
    ) {
        let Some(Request::ClusterAdmin { stream, request_id }) = self.requests.remove(&token)
        else {
            return;
        };
        let frame = match result {
            Ok(ClusterAdminAnswer::Done) => Frame::Done { request_id },
            Ok(ClusterAdminAnswer::Records(mut records)) => {
                self.fit_records(&mut records);
                Frame::Records(Records {
                    request_id,
                    records,
                })
            }
            Err(refusal) => Frame::Error(refusal.into_error().to_frame(request_id)),
        };
        self.write(stream, &frame);
        self.unpark(stream);
    }

    /// Drops the records past what one `Records` frame may carry under this broker's limits
    /// (its record count and frame size): the reader asks again from the next offset.
    fn fit_records(&self, records: &mut Vec<DeliveredRecord>) {
        /// `Records`' fixed part: request id and record count.
        const RECORDS_FIXED_BYTES: usize = 8 + 4;
        /// One delivered record's fixed part: shard, offset, timestamp, key and payload lengths.
        const RECORD_FIXED_BYTES: usize = 4 + 8 + 8 + 2 + 4;
        let mut body = RECORDS_FIXED_BYTES;
        let fit = records
            .iter()
            .take(self.limits.max_batch_records as usize)
            .take_while(|record| {
                body += RECORD_FIXED_BYTES + record.key.len() + record.payload.len();
                body <= self.limits.max_frame_bytes as usize
            })
            .count();
        records.truncate(fit);
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
        self.cluster_shard_count(name).map(Target::Cluster)
    }

    /// Splits an admitted publish by shard and hands each part to the cluster.
    pub(crate) fn run_cluster_publish(
        &mut self,
        now: Now,
        stream: StreamId,
        publish: Publish,
        producer: Option<crate::producer::ProducerTag>,
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
                    producer: producer.map(|tag| (tag.producer, tag.sequence)),
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
