//! A data-plane core's link to its member, IO-free: what a core's state machine asks of the
//! cluster (`felix_core::ClusterRequest`: publish parts, admin, subscriptions) becomes a
//! [`Member`](crate::member::Member) request ([`route`]), and what the member answers comes
//! back as [`LinkEvent`]s that [`apply`] hands to the core. The member's view of the cluster
//! becomes the core's ([`core_view`]). The broker (`dataplane/broker/src/cluster.rs`) carries
//! the requests to the service's loop (on core 0) and the events back to each core's thread; a
//! simulation calls the same functions with no threads at all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use felix_core::{
    ClusterAdmin, ClusterAdminAnswer, ClusterPublish, ClusterRefusal, ClusterRequest, ClusterStart,
    ClusterSubscribe, Core, Now,
};
use felix_wire::{DeliveredRecord, ErrorCode, ShardAck};

use crate::control::{Command, Fsync, Outcome, Rejection, StreamKind};
use crate::member::{Request, SubscriptionControl};
use crate::publish::{PublishAnswer, PublishError};
use crate::service::{Answer, ClusterView, ServiceError};
use crate::shard::ShardRecord;
use crate::subscribe::{
    Start, SubscribeError, SubscribeRequest, SubscriptionEvent, SubscriptionSink,
};

/// How long a cluster create or delete may wait to be applied before its client hears
/// `unavailable` (it may still be applied: `felix cluster status` tells).
pub const CLUSTER_ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a publish to a replicated shard may take to commit before its publisher hears
/// `unavailable` (the records may still commit).
pub const CLUSTER_COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

// A cluster subscription's batches wait in the subscription slot like another core's do:
// the slot's bound counts on the same number of credits.
const _: () = assert!(crate::subscribe::CREDITS == felix_core::REMOTE_DELIVERY_CREDITS);

/// What the member sends back to the core that asked: answers to admin requests and publish
/// parts, and the events of its subscriptions, each named by the core's token.
#[derive(Debug)]
pub enum LinkEvent {
    Admin(u64, Result<ClusterAdminAnswer, ClusterRefusal>),
    Part(u64, Result<ShardAck, ClusterRefusal>),
    Subscribed(u64, Result<Vec<(u32, u64)>, ClusterRefusal>),
    Delivery(u64, Vec<DeliveredRecord>),
    Ended(u64, ClusterRefusal),
}

/// Where a core's events go (called on the member's thread; must not block).
pub type EventSink = Arc<dyn Fn(LinkEvent) + Send + Sync>;

/// A core's request as the member takes it.
pub enum Routed {
    Request(Request),
    Subscription(SubscriptionControl),
}

/// The member's id of core `core`'s subscription `token`: unique among every core's.
#[must_use]
pub fn subscription_id(core: u16, token: u64) -> u64 {
    (u64::from(core) << 48) | (token & ((1 << 48) - 1))
}

/// Core `core`'s `request` as a member request whose answers go to `events`; a publish must
/// commit by `now` + [`CLUSTER_COMMIT_TIMEOUT`].
#[must_use]
pub fn route(core: u16, request: ClusterRequest, now: Instant, events: &EventSink) -> Routed {
    match request {
        ClusterRequest::Admin { token, admin } => {
            Routed::Request(admin_request(token, admin, events))
        }
        ClusterRequest::Publish(part) => Routed::Request(publish_request(part, now, events)),
        ClusterRequest::Subscribe(subscribe) => {
            Routed::Subscription(subscribe_request(core, subscribe, events))
        }
        ClusterRequest::Credit { token } => {
            Routed::Subscription(SubscriptionControl::Credit(subscription_id(core, token)))
        }
        ClusterRequest::Unsubscribe { token } => Routed::Subscription(
            SubscriptionControl::Unsubscribe(subscription_id(core, token)),
        ),
    }
}

/// A client's create, delete or read, authorized by the core: proposed to the control plane
/// (answered once applied on this member) or read from this member's copy.
fn admin_request(token: u64, admin: ClusterAdmin, events: &EventSink) -> Request {
    let events = Arc::clone(events);
    let answer = move |result: Result<ClusterAdminAnswer, ClusterRefusal>| {
        events(LinkEvent::Admin(token, result));
    };
    let command = match admin {
        ClusterAdmin::Read {
            stream,
            shard,
            from,
            max_records,
        } => {
            return Request::Read {
                stream,
                shard,
                from,
                max_records: max_records as usize,
                answer: Answer::new(
                    move |result: Result<Vec<(u64, ShardRecord)>, ServiceError>| {
                        answer(
                            result
                                .map(|records| {
                                    ClusterAdminAnswer::Records(
                                        records
                                            .into_iter()
                                            .map(|(offset, record)| DeliveredRecord {
                                                shard,
                                                offset,
                                                timestamp_us: record.timestamp_us,
                                                key: record.key,
                                                payload: record.payload,
                                            })
                                            .collect(),
                                    )
                                })
                                .map_err(|error| service_refusal(&error)),
                        );
                    },
                ),
            };
        }
        ClusterAdmin::Create {
            name,
            kind,
            shard_count,
            replicas,
            fsync,
        } => Command::CreateStream {
            name,
            kind: match kind {
                felix_wire::StreamKind::Durable => StreamKind::Durable,
                felix_wire::StreamKind::InMemory => StreamKind::InMemory,
            },
            shards: shard_count,
            replicas,
            fsync: match fsync {
                felix_wire::FsyncMode::OnCommit => Fsync::OnCommit,
                felix_wire::FsyncMode::Periodic => Fsync::Periodic,
            },
        },
        ClusterAdmin::Delete { name } => Command::DeleteStream { name },
    };
    Request::Propose {
        command,
        timeout: CLUSTER_ADMIN_TIMEOUT,
        answer: Answer::new(move |result| {
            answer(match result {
                Ok(Outcome::Done) => Ok(ClusterAdminAnswer::Done),
                Ok(Outcome::Rejected { reason, kind }) => Err(ClusterRefusal {
                    code: match kind {
                        Rejection::Exists => ErrorCode::StreamExists,
                        Rejection::NotFound => ErrorCode::StreamNotFound,
                        Rejection::Invalid => ErrorCode::InvalidArgument,
                    },
                    detail: 0,
                    message: reason,
                }),
                Err(error) => Err(service_refusal(&error)),
            });
        }),
    }
}

fn publish_request(part: ClusterPublish, now: Instant, events: &EventSink) -> Request {
    let ClusterPublish {
        token,
        stream,
        shard,
        records,
        unix_us,
        producer,
    } = part;
    let records = records
        .into_iter()
        .map(|record| ShardRecord {
            timestamp_us: unix_us,
            key: record.key,
            payload: record.payload,
        })
        .collect();
    let events = Arc::clone(events);
    Request::Publish {
        stream,
        shard,
        records,
        deadline: now + CLUSTER_COMMIT_TIMEOUT,
        timeout: CLUSTER_COMMIT_TIMEOUT,
        producer,
        answer: PublishAnswer::new(move |result| {
            let result = result
                .map(|ack| ShardAck {
                    shard,
                    first_offset: ack.first_offset,
                    count: ack.count,
                })
                .map_err(|error| {
                    let mut refusal = publish_refusal(&error);
                    // An idempotent producer's batch: a retry is applied once, so the client
                    // may send it again (`unavailable` naming its sequence, as on a single
                    // broker, docs/wire-protocol.md).
                    if let (Some((_, sequence)), ErrorCode::Unavailable) = (producer, refusal.code)
                    {
                        refusal.detail = sequence;
                    }
                    refusal
                });
            events(LinkEvent::Part(token, result));
        }),
    }
}

fn subscribe_request(
    core: u16,
    subscribe: ClusterSubscribe,
    events: &EventSink,
) -> SubscriptionControl {
    let ClusterSubscribe {
        token,
        stream,
        shards,
        max_records,
        max_bytes,
    } = subscribe;
    let shards = shards
        .into_iter()
        .map(|(shard, start)| {
            let start = match start {
                ClusterStart::Earliest => Start::Earliest,
                ClusterStart::Latest => Start::Latest,
                ClusterStart::Offset(offset) => Start::Offset(offset),
            };
            (shard, start)
        })
        .collect();
    let events = Arc::clone(events);
    SubscriptionControl::Subscribe {
        request: SubscribeRequest {
            id: subscription_id(core, token),
            stream,
            shards,
            max_records,
            max_bytes,
        },
        sink: SubscriptionSink::new(move |event| {
            events(match event {
                SubscriptionEvent::Started(start) => LinkEvent::Subscribed(token, Ok(start)),
                SubscriptionEvent::Refused(error) => {
                    LinkEvent::Subscribed(token, Err(subscribe_refusal(&error)))
                }
                SubscriptionEvent::Records(batch) => LinkEvent::Delivery(
                    token,
                    batch
                        .into_iter()
                        .map(|delivered| DeliveredRecord {
                            shard: delivered.shard,
                            offset: delivered.offset,
                            timestamp_us: delivered.record.timestamp_us,
                            key: delivered.record.key,
                            payload: delivered.record.payload,
                        })
                        .collect(),
                ),
                SubscriptionEvent::Ended(error) => {
                    LinkEvent::Ended(token, subscribe_refusal(&error))
                }
            });
        }),
    }
}

/// Hands one of the member's events to the core that asked.
pub fn apply(core: &mut Core, now: Now, event: LinkEvent) {
    match event {
        LinkEvent::Admin(token, result) => core.handle_cluster_admin(token, result),
        LinkEvent::Part(token, result) => core.handle_cluster_answer(now, token, result),
        LinkEvent::Subscribed(token, result) => core.handle_cluster_subscribed(token, result),
        LinkEvent::Delivery(token, records) => core.handle_cluster_delivery(token, records),
        LinkEvent::Ended(token, refusal) => core.handle_cluster_ended(token, refusal),
    }
}

/// A cluster subscription's refusal or end as the subscriber hears it.
#[must_use]
pub fn subscribe_refusal(error: &SubscribeError) -> ClusterRefusal {
    let (code, detail) = match error {
        SubscribeError::NoSuchStream { .. } | SubscribeError::Deleted { .. } => {
            (ErrorCode::StreamNotFound, 0)
        }
        SubscribeError::NoSuchShard { .. } | SubscribeError::BeyondEnd { .. } => {
            (ErrorCode::InvalidArgument, 0)
        }
        SubscribeError::TooOld { oldest, .. } => (ErrorCode::TooOld, *oldest),
        SubscribeError::NotReplicatedHere { .. }
        | SubscribeError::Stopped
        | SubscribeError::OwnerUnreachable { .. }
        | SubscribeError::OwnerRestarted { .. } => (ErrorCode::Unavailable, 0),
        SubscribeError::Lagged { .. } => (ErrorCode::SubscriberLagged, 0),
        SubscribeError::Read { .. } => (ErrorCode::StorageFailed, 0),
        SubscribeError::IdInUse(_) => (ErrorCode::Internal, 0),
    };
    ClusterRefusal {
        code,
        detail,
        message: error.to_string(),
    }
}

/// A service error as an admin client hears it: a read of a shard not here (or no longer
/// held) is `invalid_argument`; everything else (no leader, no answer in time, stopped) is
/// `unavailable`: ask again.
#[must_use]
pub fn service_refusal(error: &ServiceError) -> ClusterRefusal {
    let code = match error {
        ServiceError::Read(_) => ErrorCode::InvalidArgument,
        _ => ErrorCode::Unavailable,
    };
    ClusterRefusal {
        code,
        detail: 0,
        message: error.to_string(),
    }
}

/// A cluster publish refusal as the publisher hears it.
#[must_use]
pub fn publish_refusal(error: &PublishError) -> ClusterRefusal {
    let code = match error {
        PublishError::NoSuchStream { .. } => ErrorCode::StreamNotFound,
        PublishError::Busy { .. } => ErrorCode::IngressBudgetExhausted,
        PublishError::NotReplicatedHere { .. }
        | PublishError::Timeout(_)
        | PublishError::Stopped
        | PublishError::OwnerUnreachable { .. }
        | PublishError::NotOwner { .. }
        | PublishError::OffsetsUnknown => ErrorCode::Unavailable,
    };
    ClusterRefusal {
        code,
        detail: 0,
        message: error.to_string(),
    }
}

/// The member's view of the cluster as a core takes it. Member ids are 1..=65535
/// (`service::parse_members`).
#[must_use]
pub fn core_view(view: &ClusterView) -> Arc<felix_core::ClusterView> {
    let id = |member: u64| u16::try_from(member).unwrap_or(0);
    Arc::new(felix_core::ClusterView {
        member: id(view.member),
        members: view
            .members
            .iter()
            .map(|(member, addr)| felix_wire::ClusterMember {
                id: id(*member),
                addr: addr.clone(),
            })
            .collect(),
        streams: view
            .streams
            .iter()
            .map(|(name, stream)| {
                let shards = stream
                    .shards
                    .iter()
                    .map(|shard| felix_core::ClusterShard {
                        leader: shard.leader.map_or(0, id),
                        oldest_offset: shard.oldest_offset,
                        next_offset: shard.next_offset,
                    })
                    .collect();
                let kind = match stream.kind {
                    StreamKind::Durable => felix_wire::StreamKind::Durable,
                    StreamKind::InMemory => felix_wire::StreamKind::InMemory,
                };
                (name.clone(), felix_core::ClusterStream { kind, shards })
            })
            .collect(),
    })
}
