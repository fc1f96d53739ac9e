//! The harness the in-process cluster tests share: three (or more) cluster services in one
//! process, each on its own thread, with real QUIC peer connections (mutual TLS) on loopback
//! and real Felix logs under one temporary directory.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use felix_cluster::control::Member;
use felix_cluster::pki::ClusterCa;
use felix_cluster::service::{Service, ServiceConfig};

/// Generous deadline for anything the tests wait for (loaded 2-core machine, parallel tests).
pub const DEADLINE: Duration = Duration::from_secs(60);

pub type Slot = Arc<Mutex<Option<Service>>>;

pub struct Cluster {
    ca: ClusterCa,
    addrs: BTreeMap<u64, SocketAddr>,
    root: tempfile::TempDir,
}

impl Cluster {
    pub fn new(ids: &[u64]) -> Cluster {
        let addrs = ids
            .iter()
            .map(|id| {
                let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
                (*id, socket.local_addr().expect("addr"))
            })
            .collect();
        Cluster {
            ca: ClusterCa::generate("cluster test CA").expect("ca"),
            addrs,
            root: tempfile::tempdir().expect("tempdir"),
        }
    }

    pub fn start(&self, id: u64) -> Service {
        let peers: BTreeMap<u64, SocketAddr> = self
            .addrs
            .iter()
            .filter(|(peer, _)| **peer != id)
            .map(|(peer, addr)| (*peer, *addr))
            .collect();
        let dir = member_dir(self.root.path(), id);
        let deadline = Instant::now() + DEADLINE;
        loop {
            // The port was free a moment ago (or this member's earlier run just let it go).
            match Service::start(ServiceConfig {
                member: Member {
                    id,
                    client_addr: format!("127.0.0.1:{}", 7000 + id),
                    peer_addr: self.addrs[&id].to_string(),
                    cores: 2,
                },
                peer_bind: self.addrs[&id],
                peers: peers.clone(),
                identity: self.ca.issue_node(id, &[]).expect("cert"),
                ca_pem: self.ca.cert_pem.clone(),
                // The broker's default FELIX_MTU_UPPER_BOUND.
                peer_max_mtu: 4096,
                dir: dir.clone(),
                records: felix_cluster::records::RecordsConfig::default(),
            }) {
                Ok(service) => return service,
                Err(error) if Instant::now() < deadline => {
                    eprintln!("member {id} did not start yet: {error}");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(error) => panic!("member {id} does not start: {error}"),
            }
        }
    }
}

impl Cluster {
    /// Starts members `ids`, each in a slot a test can empty (stop it) and fill again.
    pub fn start_slots(&self, ids: &[u64]) -> BTreeMap<u64, Slot> {
        ids.iter()
            .map(|id| (*id, Arc::new(Mutex::new(Some(self.start(*id))))))
            .collect()
    }
}

pub fn member_dir(root: &Path, id: u64) -> std::path::PathBuf {
    root.join(format!("member-{id}"))
        .join("cluster")
        .join("raft")
}

pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Creates durable stream `name` (RF 3) through `service` once the control plane has a
/// leader, and waits until every member of `services` knows a leader of each of its shards.
pub fn create_stream(services: &[&Service], name: &str, shards: u32) {
    use felix_cluster::control::{Command, Outcome, StreamKind};
    wait_until("the stream is created", || {
        matches!(
            services[0].propose(
                Command::CreateStream {
                    name: name.into(),
                    kind: StreamKind::Durable,
                    shards,
                    replicas: 3,
                    fsync: Default::default(),
                },
                Duration::from_secs(5),
            ),
            Ok(Outcome::Done)
        )
    });
    wait_until("every member leads or follows every shard", || {
        services.iter().all(|service| {
            let status = service.status();
            status.shards.iter().filter(|s| s.stream == name).count() == shards as usize
                && status.shards.iter().all(|shard| shard.leader.is_some())
        })
    });
}

/// Each shard's next offset on `service`, in shard order, when nothing is pending there (a
/// batch still pending may commit later and move the end); `None` while something is.
pub fn settled_ends(service: &Service) -> Option<Vec<u64>> {
    let status = service.status();
    if status.shards.iter().any(|shard| shard.pending > 0) {
        return None;
    }
    let mut ends: Vec<(u32, u64)> = status
        .shards
        .iter()
        .map(|shard| (shard.shard, shard.next_offset))
        .collect();
    ends.sort_unstable();
    Some(ends.into_iter().map(|(_, end)| end).collect())
}

/// Every committed record of shard `shard` of `stream` in `service`'s copy: `(offset,
/// record)`, read 1,000 at a time.
pub fn read_shard(
    service: &Service,
    stream: &str,
    shard: u32,
) -> Vec<(u64, felix_cluster::shard::ShardRecord)> {
    let mut records = Vec::new();
    loop {
        let read = service
            .read(stream, shard, records.len() as u64, 1_000, DEADLINE)
            .expect("read");
        if read.is_empty() {
            return records;
        }
        records.extend(read);
    }
}
