//! The broker's place in a cluster (docs/cluster.md): with FELIX_CLUSTER_NODE_ID set, the
//! broker checks the cluster settings, loads its peer certificate and starts the control
//! plane's service (`felix_cluster::service`) on its own `felix-cluster` thread, which the
//! data-plane cores never wait for. The metrics endpoint answers `GET /v1/cluster/status`
//! and `POST /v1/cluster/streams` from it (`metrics.rs`).
//!
//! Each core has a [`CoreLink`] to the service: publishes to the cluster's durable streams
//! leave the core's state machine as parts (`felix_core`'s `cluster.rs`), go to the service,
//! and their answers come back to the core on its own thread ([`core_task`]). Subscriptions to
//! them go the same way: the service's batches of committed records come back on the same
//! channel, at most `felix_cluster::subscribe::CREDITS` in flight per subscription.

use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use felix_cluster::control::Member;
use felix_cluster::control::{Command, Outcome, Rejection};
use felix_cluster::pki::NodeIdentity;
use felix_cluster::publish::PublishError;
use felix_cluster::service::{ClusterView, Service, ServiceConfig, ServiceError, parse_members};
use felix_cluster::shard::ShardRecord;
use felix_cluster::subscribe::{
    Start, SubscribeError, SubscribeRequest, SubscriptionEvent, SubscriptionSink,
};
use felix_core::{
    ClusterAdmin, ClusterAdminAnswer, ClusterPublish, ClusterRefusal, ClusterRequest, ClusterStart,
    ClusterSubscribe,
};
use felix_tuning::Config;
use felix_wire::{DeliveredRecord, ErrorCode, ShardAck};

use crate::BrokerError;
use crate::shell::Shell;

fn setting(env: &'static str, value: impl Into<String>, reason: impl Into<String>) -> BrokerError {
    BrokerError::Setting {
        env,
        value: value.into(),
        reason: reason.into(),
    }
}

fn read_pem(env: &'static str, path: Option<&Path>) -> Result<String, BrokerError> {
    let Some(path) = path else {
        return Err(setting(
            env,
            "",
            "required when FELIX_CLUSTER_NODE_ID is set (`felix cluster dev-certs` writes a \
             development set)",
        ));
    };
    std::fs::read_to_string(path).map_err(|error| {
        setting(
            env,
            path.display().to_string(),
            format!("cannot read it: {error}"),
        )
    })
}

/// Starts the cluster service when FELIX_CLUSTER_NODE_ID is set; `client_addr` is where
/// clients reach this broker, `cores` its data-plane cores. A bad cluster setting stops
/// start-up naming the variable.
pub(crate) fn start(
    config: &Config,
    client_addr: std::net::SocketAddr,
    cores: u16,
) -> Result<Option<Arc<Service>>, BrokerError> {
    let id = u64::from(config.cluster_node_id);
    if id == 0 {
        return Ok(None);
    }
    let mut members = parse_members(&config.cluster_peers)
        .map_err(|reason| setting("FELIX_CLUSTER_PEERS", config.cluster_peers.clone(), reason))?;
    let Some(own) = members.remove(&id) else {
        return Err(setting(
            "FELIX_CLUSTER_PEERS",
            config.cluster_peers.clone(),
            format!("this broker's id {id} (FELIX_CLUSTER_NODE_ID) is not listed"),
        ));
    };
    if members.is_empty() {
        return Err(setting(
            "FELIX_CLUSTER_PEERS",
            config.cluster_peers.clone(),
            "a cluster needs at least one other member",
        ));
    }
    let ca_pem = read_pem("FELIX_CLUSTER_CA", config.cluster_ca.as_deref())?;
    let cert_pem = read_pem("FELIX_CLUSTER_CERT", config.cluster_cert.as_deref())?;
    let key_pem = read_pem("FELIX_CLUSTER_KEY", config.cluster_key.as_deref())?;
    let identity = NodeIdentity {
        node_id: id,
        cert_pem,
        key_pem,
    };
    let service = Service::start(ServiceConfig {
        member: Member {
            id,
            client_addr: client_addr.to_string(),
            peer_addr: own.to_string(),
            cores,
        },
        peer_bind: own,
        peers: members,
        identity,
        ca_pem,
        dir: config.data_dir.join("cluster").join("raft"),
        records: felix_cluster::records::RecordsConfig {
            fsync_interval: std::time::Duration::from_millis(config.durable_fsync_interval_ms),
            retention_bytes: (config.durable_retention_bytes > 0)
                .then_some(config.durable_retention_bytes),
            retention_age: (config.durable_retention_seconds > 0)
                .then(|| std::time::Duration::from_secs(config.durable_retention_seconds)),
            compact_after: config.cluster_raft_compact_entries,
            // Record logs are per replicated shard: 16 MiB segments, or the durable logs'
            // smaller ones.
            segment_bytes: felix_cluster::records::RECORD_LOG_SEGMENT_BYTES
                .min(config.durable_segment_bytes),
        },
    })
    .map_err(|error| BrokerError::Cluster(error.to_string()))?;
    tracing::info!(
        id,
        peer_addr = %service.peer_addr(),
        "cluster member started (control plane on the felix-cluster thread)"
    );
    Ok(Some(Arc::new(service)))
}

/// How long a cluster create or delete may wait to be applied before its client hears
/// `unavailable` (it may still be applied: `felix cluster status` tells).
pub(crate) const CLUSTER_ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a publish to a replicated shard may take to commit before its publisher hears
/// `unavailable` (the records may still commit).
pub(crate) const CLUSTER_COMMIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What the service sends back to the core that asked: answers to publish parts and the
/// events of its subscriptions, each named by the core's token.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    Admin(u64, Result<ClusterAdminAnswer, ClusterRefusal>),
    Part(u64, Result<ShardAck, ClusterRefusal>),
    Subscribed(u64, Result<Vec<(u32, u64)>, ClusterRefusal>),
    Delivery(u64, Vec<DeliveredRecord>),
    Ended(u64, ClusterRefusal),
}

// A cluster subscription's batches wait in the subscription slot like another core's do:
// the slot's bound counts on the same number of credits.
const _: () = assert!(felix_cluster::subscribe::CREDITS == felix_core::REMOTE_DELIVERY_CREDITS);

/// One core's link to the cluster service: requests go to the service (which never blocks),
/// the answers come back on the core's own channel, drained by [`core_task`] on the core's
/// thread. The channel holds at most the parts in flight (bounded by the core's ingress
/// queue) and, per subscription, its credits' batches and two other events.
pub(crate) struct CoreLink {
    service: Arc<Service>,
    core: u16,
    events: tokio::sync::mpsc::UnboundedSender<LinkEvent>,
}

impl CoreLink {
    /// The link of core `core` and the receiving end of its events.
    pub(crate) fn new(
        service: Arc<Service>,
        core: u16,
    ) -> (CoreLink, tokio::sync::mpsc::UnboundedReceiver<LinkEvent>) {
        let (events, received) = tokio::sync::mpsc::unbounded_channel();
        (
            CoreLink {
                service,
                core,
                events,
            },
            received,
        )
    }

    /// The service's id of this core's subscription `token`: unique among every core's.
    fn subscription_id(&self, token: u64) -> u64 {
        (u64::from(self.core) << 48) | (token & ((1 << 48) - 1))
    }

    /// Hands a request to the service.
    pub(crate) fn send(&self, request: ClusterRequest) {
        match request {
            ClusterRequest::Admin { token, admin } => self.admin(token, admin),
            ClusterRequest::Publish(part) => self.publish(part),
            ClusterRequest::Subscribe(subscribe) => self.subscribe(subscribe),
            ClusterRequest::Credit { token } => {
                self.service.credit(self.subscription_id(token));
            }
            ClusterRequest::Unsubscribe { token } => {
                self.service.unsubscribe(self.subscription_id(token));
            }
        }
    }

    /// A client's create, delete or read, authorized by the core: proposed to the control
    /// plane (answered once applied here) or read from this member's copy.
    fn admin(&self, token: u64, admin: ClusterAdmin) {
        let events = self.events.clone();
        let answer = move |result: Result<ClusterAdminAnswer, ClusterRefusal>| {
            let _ = events.send(LinkEvent::Admin(token, result));
        };
        let command = match admin {
            ClusterAdmin::Read {
                stream,
                shard,
                from,
                max_records,
            } => {
                self.service.read_then(
                    &stream,
                    shard,
                    from,
                    max_records as usize,
                    felix_cluster::service::Answer::new(
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
                );
                return;
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
                    felix_wire::StreamKind::Durable => felix_cluster::control::StreamKind::Durable,
                    felix_wire::StreamKind::InMemory => {
                        felix_cluster::control::StreamKind::InMemory
                    }
                },
                shards: shard_count,
                replicas,
                fsync: match fsync {
                    felix_wire::FsyncMode::OnCommit => felix_cluster::control::Fsync::OnCommit,
                    felix_wire::FsyncMode::Periodic => felix_cluster::control::Fsync::Periodic,
                },
            },
            ClusterAdmin::Delete { name } => Command::DeleteStream { name },
        };
        self.service.propose_then(
            command,
            CLUSTER_ADMIN_TIMEOUT,
            felix_cluster::service::Answer::new(move |result| {
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
        );
    }

    fn publish(&self, part: ClusterPublish) {
        let ClusterPublish {
            token,
            stream,
            shard,
            records,
            unix_us,
        } = part;
        let records = records
            .into_iter()
            .map(|record| ShardRecord {
                timestamp_us: unix_us,
                key: record.key,
                payload: record.payload,
            })
            .collect();
        let events = self.events.clone();
        self.service.publish(
            &stream,
            shard,
            records,
            CLUSTER_COMMIT_TIMEOUT,
            felix_cluster::publish::PublishAnswer::new(move |result| {
                let result = result
                    .map(|ack| ShardAck {
                        shard,
                        first_offset: ack.first_offset,
                        count: ack.count,
                    })
                    .map_err(|error| refusal(&error));
                let _ = events.send(LinkEvent::Part(token, result));
            }),
        );
    }

    fn subscribe(&self, subscribe: ClusterSubscribe) {
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
        let events = self.events.clone();
        self.service.subscribe(
            SubscribeRequest {
                id: self.subscription_id(token),
                stream,
                shards,
                max_records,
                max_bytes,
            },
            SubscriptionSink::new(move |event| {
                let event = match event {
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
                };
                let _ = events.send(event);
            }),
        );
    }
}

/// A cluster subscription's refusal or end as the subscriber hears it.
pub(crate) fn subscribe_refusal(error: &SubscribeError) -> ClusterRefusal {
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
/// held) is `stream_not_found` / `too_old` territory the service words itself; everything
/// else (no leader, no answer in time, stopped) is `unavailable`: ask again.
fn service_refusal(error: &ServiceError) -> ClusterRefusal {
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

/// A cluster refusal as the publisher hears it.
pub(crate) fn refusal(error: &PublishError) -> ClusterRefusal {
    let code = match error {
        PublishError::NoSuchStream { .. } => ErrorCode::StreamNotFound,
        PublishError::Busy { .. } => ErrorCode::IngressBudgetExhausted,
        PublishError::NotReplicatedHere { .. }
        | PublishError::Timeout(_)
        | PublishError::Stopped
        | PublishError::OwnerUnreachable { .. }
        | PublishError::NotOwner { .. } => ErrorCode::Unavailable,
    };
    ClusterRefusal {
        code,
        detail: 0,
        message: error.to_string(),
    }
}

/// The service's view of the cluster as the core takes it. Member ids are 1..=65535
/// (`parse_members`).
fn core_view(view: &ClusterView) -> Arc<felix_core::ClusterView> {
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
                    felix_cluster::control::StreamKind::Durable => felix_wire::StreamKind::Durable,
                    felix_cluster::control::StreamKind::InMemory => {
                        felix_wire::StreamKind::InMemory
                    }
                };
                (name.clone(), felix_core::ClusterStream { kind, shards })
            })
            .collect(),
    })
}

/// Hands the service's events to the core (answers to published parts, subscriptions'
/// batches) and keeps the core's view of the cluster current: runs on the core's thread for
/// as long as the core serves.
pub(crate) async fn core_task(
    shell: Rc<Shell>,
    mut answers: tokio::sync::mpsc::UnboundedReceiver<LinkEvent>,
    mut view: tokio::sync::watch::Receiver<Arc<ClusterView>>,
) {
    let mut batch = Vec::with_capacity(ANSWERS_PER_INPUT);
    let initial = core_view(&view.borrow_and_update());
    shell.input(|core, _| core.set_cluster_view(initial));
    loop {
        tokio::select! {
            received = answers.recv_many(&mut batch, ANSWERS_PER_INPUT) => {
                if received == 0 {
                    return;
                }
                shell.input(|core, now| {
                    for event in batch.drain(..) {
                        match event {
                            LinkEvent::Admin(token, result) => {
                                core.handle_cluster_admin(token, result);
                            }
                            LinkEvent::Part(token, result) => {
                                core.handle_cluster_answer(now, token, result);
                            }
                            LinkEvent::Subscribed(token, result) => {
                                core.handle_cluster_subscribed(token, result);
                            }
                            LinkEvent::Delivery(token, records) => {
                                core.handle_cluster_delivery(token, records);
                            }
                            LinkEvent::Ended(token, refusal) => {
                                core.handle_cluster_ended(token, refusal);
                            }
                        }
                    }
                });
            }
            changed = view.changed() => {
                if changed.is_err() {
                    // The service stopped: its streams stay known, publishes to them are
                    // answered `unavailable`.
                    std::future::pending::<()>().await;
                }
                let now = core_view(&view.borrow_and_update());
                shell.input(|core, _| core.set_cluster_view(now));
            }
        }
    }
}

/// Events handed to the core per input.
const ANSWERS_PER_INPUT: usize = 256;
