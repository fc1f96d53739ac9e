//! The broker's place in a cluster (docs/cluster.md): with FELIX_CLUSTER_NODE_ID set, the
//! broker checks the cluster settings, loads its peer certificate and starts the control
//! plane's service (`felix_cluster::service`) on its own `felix-cluster` thread, which the
//! data-plane cores never wait for. The metrics endpoint answers `GET /v1/cluster/status`
//! and `POST /v1/cluster/streams` from it (`metrics.rs`).
//!
//! Each core has a [`CoreLink`] to the service: publishes to the cluster's durable streams
//! leave the core's state machine as parts (`felix_core`'s `cluster.rs`), go to the service,
//! and their answers come back to the core on its own thread ([`core_task`]).

use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use felix_cluster::control::Member;
use felix_cluster::pki::NodeIdentity;
use felix_cluster::publish::PublishError;
use felix_cluster::service::{DurableStreams, Service, ServiceConfig, parse_members};
use felix_cluster::shard::ShardRecord;
use felix_core::{ClusterPublish, ClusterRefusal};
use felix_tuning::Config;
use felix_wire::{ErrorCode, ShardAck};

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
    })
    .map_err(|error| BrokerError::Cluster(error.to_string()))?;
    tracing::info!(
        id,
        peer_addr = %service.peer_addr(),
        "cluster member started (control plane on the felix-cluster thread)"
    );
    Ok(Some(Arc::new(service)))
}

/// How long a publish to a replicated shard may take to commit before its publisher hears
/// `unavailable` (the records may still commit).
pub(crate) const CLUSTER_COMMIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The cluster's answer to one publish part, for the core that handed it over.
pub(crate) type PartAnswer = (u64, Result<ShardAck, ClusterRefusal>);

/// One core's link to the cluster service: parts go to the service (which never blocks), the
/// answers come back on the core's own channel, drained by [`core_task`] on the core's thread.
pub(crate) struct CoreLink {
    service: Arc<Service>,
    answers: tokio::sync::mpsc::UnboundedSender<PartAnswer>,
}

impl CoreLink {
    /// A link and the receiving end of its answers.
    pub(crate) fn new(
        service: Arc<Service>,
    ) -> (CoreLink, tokio::sync::mpsc::UnboundedReceiver<PartAnswer>) {
        let (answers, received) = tokio::sync::mpsc::unbounded_channel();
        (CoreLink { service, answers }, received)
    }

    /// Hands a part to the service. Its answer arrives on the link's channel; the channel
    /// holds at most the parts in flight, which the core's ingress queue bounds.
    pub(crate) fn send(&self, part: ClusterPublish) {
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
        let answers = self.answers.clone();
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
                let _ = answers.send((token, result));
            }),
        );
    }
}

/// A cluster refusal as the publisher hears it.
pub(crate) fn refusal(error: &PublishError) -> ClusterRefusal {
    let code = match error {
        PublishError::NoSuchStream { .. } => ErrorCode::StreamNotFound,
        PublishError::Busy { .. } => ErrorCode::IngressBudgetExhausted,
        PublishError::NotReplicatedHere { .. }
        | PublishError::Timeout(_)
        | PublishError::Stopped => ErrorCode::Unavailable,
    };
    ClusterRefusal {
        code,
        message: error.to_string(),
    }
}

/// Answers published parts and keeps the core's set of cluster streams current: runs on the
/// core's thread for as long as the core serves.
pub(crate) async fn core_task(
    shell: Rc<Shell>,
    mut answers: tokio::sync::mpsc::UnboundedReceiver<PartAnswer>,
    mut streams: tokio::sync::watch::Receiver<DurableStreams>,
) {
    let mut batch = Vec::with_capacity(ANSWERS_PER_INPUT);
    let initial = (**streams.borrow_and_update()).clone();
    shell.input(|core, _| core.set_cluster_streams(initial));
    loop {
        tokio::select! {
            received = answers.recv_many(&mut batch, ANSWERS_PER_INPUT) => {
                if received == 0 {
                    return;
                }
                shell.input(|core, now| {
                    for (token, result) in batch.drain(..) {
                        core.handle_cluster_answer(now, token, result);
                    }
                });
            }
            changed = streams.changed() => {
                if changed.is_err() {
                    // The service stopped: its streams stay known, publishes to them are
                    // answered `unavailable`.
                    std::future::pending::<()>().await;
                }
                let now_known = (**streams.borrow_and_update()).clone();
                shell.input(|core, _| core.set_cluster_streams(now_known));
            }
        }
    }
}

/// Answers handed to the core per input.
const ANSWERS_PER_INPUT: usize = 256;
