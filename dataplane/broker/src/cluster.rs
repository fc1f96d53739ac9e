//! The broker's place in a cluster (docs/cluster.md): with FELIX_CLUSTER_NODE_ID set, the
//! broker checks the cluster settings, loads its peer certificate and starts the control
//! plane's service (`felix_cluster::service`) on its own `felix-cluster` thread, which the
//! data-plane cores never wait for. The metrics endpoint answers `GET /v1/cluster/status`
//! and `POST /v1/cluster/streams` from it (`metrics.rs`).

use std::path::Path;
use std::sync::Arc;

use felix_cluster::control::Member;
use felix_cluster::pki::NodeIdentity;
use felix_cluster::service::{Service, ServiceConfig, parse_members};
use felix_tuning::Config;

use crate::BrokerError;

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
