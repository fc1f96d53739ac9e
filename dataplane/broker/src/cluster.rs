//! The broker's place in a cluster (docs/cluster.md): with FELIX_CLUSTER_NODE_ID set, the
//! broker checks the cluster settings, loads its peer certificate and prepares the control
//! plane's service (`felix_cluster::service`), whose loop core 0 runs as one of its tasks
//! ([`host`], from `runtime.rs`): the member and its peer endpoint share core 0's thread and
//! runtime, and the member never waits for a shard group's write. The metrics endpoint
//! answers `GET /v1/cluster/status` from it (`metrics.rs`).
//!
//! Each core has a [`CoreLink`] to the service: what the core's state machine asks of the
//! cluster (publish parts, admin, subscriptions: `felix_core`'s `cluster.rs`) is routed by
//! `felix_cluster::link` (IO-free, shared with the simulation) to the service's queue, and
//! the answers come back to the core on its own thread ([`core_task`]), at most
//! `felix_cluster::subscribe::CREDITS` batches in flight per subscription. On core 0 neither
//! crosses a thread.

use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use felix_cluster::control::Member;
use felix_cluster::link::{self, EventSink, LinkEvent};
use felix_cluster::pki::NodeIdentity;
use felix_cluster::service::{ClusterView, Service, ServiceConfig, ServiceTask, parse_members};
use felix_core::ClusterRequest;
use felix_tuning::Config;

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

/// Prepares the cluster service when FELIX_CLUSTER_NODE_ID is set; `client_addr` is where
/// clients reach this broker, `cores` its data-plane cores, `mtu` the largest datagram its
/// endpoints probe for (FELIX_MTU_UPPER_BOUND, clamped), the peer endpoints' too. Core 0
/// opens and runs the returned loop ([`host`]). A bad cluster setting stops start-up naming
/// the variable.
pub(crate) fn prepare(
    config: &Config,
    client_addr: std::net::SocketAddr,
    cores: u16,
    mtu: u16,
) -> Result<Option<(Arc<Service>, ServiceTask)>, BrokerError> {
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
    let (service, task) = Service::hosted(ServiceConfig {
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
        peer_max_mtu: mtu,
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
    });
    Ok(Some((Arc::new(service), task)))
}

/// Opens the cluster member on core 0's thread (recovery reads its Raft logs: the core
/// serves once it is open, as it does after its own log's recovery) and starts its loop as a
/// task of the core's runtime; the task ends when `shutdown` fires (the broker's shutdown),
/// the service is stopped, or the member fails. The core awaits the returned handle before
/// it closes its own log, so the member's logs close cleanly first.
pub(crate) async fn host(
    task: ServiceTask,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, BrokerError> {
    let opened = task
        .open()
        .await
        .map_err(|error| BrokerError::Cluster(error.to_string()))?;
    tracing::info!(
        member = opened.member_id(),
        peer_addr = ?opened.peer_addr(),
        "cluster member started (its loop on core 0)"
    );
    Ok(tokio::task::spawn_local(opened.run(async move {
        // A dropped trigger stops the broker too.
        let _ = shutdown.wait_for(|stop| *stop).await;
    })))
}

/// One core's link to the cluster service: requests go to the service (which never blocks)
/// as `felix_cluster::link` routes them, the answers come back on the core's own channel,
/// drained by [`core_task`] on the core's thread. The channel holds at most the parts in
/// flight (bounded by the core's ingress queue) and, per subscription, its credits' batches
/// and two other events.
pub(crate) struct CoreLink {
    service: Arc<Service>,
    core: u16,
    events: EventSink,
}

impl CoreLink {
    /// The link of core `core` and the receiving end of its events.
    pub(crate) fn new(
        service: Arc<Service>,
        core: u16,
    ) -> (CoreLink, tokio::sync::mpsc::UnboundedReceiver<LinkEvent>) {
        let (events, received) = tokio::sync::mpsc::unbounded_channel();
        let events: EventSink = Arc::new(move |event| {
            let _ = events.send(event);
        });
        (
            CoreLink {
                service,
                core,
                events,
            },
            received,
        )
    }

    /// Hands a request to the service.
    pub(crate) fn send(&self, request: ClusterRequest) {
        let routed = link::route(self.core, request, std::time::Instant::now(), &self.events);
        self.service.submit(routed);
    }
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
    let initial = link::core_view(&view.borrow_and_update());
    shell.input(|core, _| core.set_cluster_view(initial));
    loop {
        tokio::select! {
            received = answers.recv_many(&mut batch, ANSWERS_PER_INPUT) => {
                if received == 0 {
                    return;
                }
                shell.input(|core, now| {
                    for event in batch.drain(..) {
                        link::apply(core, now, event);
                    }
                });
            }
            changed = view.changed() => {
                if changed.is_err() {
                    // The service stopped: its streams stay known, publishes to them are
                    // answered `unavailable`.
                    std::future::pending::<()>().await;
                }
                let now = link::core_view(&view.borrow_and_update());
                shell.input(|core, _| core.set_cluster_view(now));
            }
        }
    }
}

/// Events handed to the core per input.
const ANSWERS_PER_INPUT: usize = 256;
