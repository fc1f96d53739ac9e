//! Three `felix broker` processes on loopback forming a cluster (docs/cluster.md): the control
//! plane elects a leader over mutual-TLS QUIC peer connections, every broker registers,
//! streams created through any member are placed with each stream's leaders spread, the
//! control plane survives SIGKILL of its leader and the killed broker catches up when it
//! rejoins, a paused (SIGSTOP) majority leaves the remaining broker unable to change anything
//! or to acknowledge a publish, acknowledged publishes are on every replica exactly once after
//! a leader's SIGKILL while subscribers on every member receive them once and in order, and
//! bad cluster settings stop start-up naming the variable.
//!
//! The members reach each other through UDP relays of the test's own ([`Network`]): a
//! network partition drops their datagrams, as a real network would, with no hook in the
//! broker.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use felix_cluster::control::Fsync;
use felix_cluster::node::Role;
use felix_cluster::service::ClusterStatus;
use support::{BrokerProcess, DEADLINE, felix};

/// Admin requests on a loaded machine (a creation waits for the control plane).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(15);

/// The peer network of a test cluster: member `a` reaches member `b` through a relay socket
/// of its own (a's peer list names it as b's address), which forwards a's datagrams to b's
/// peer endpoint and b's answers back. A partition drops the datagrams of the links it cuts,
/// both ways; the QUIC connections then time out and are dialled again once healed, as on a
/// real network.
struct Network {
    /// Links cut, as (smaller id, larger id).
    cut: Arc<Mutex<BTreeSet<(u64, u64)>>>,
    stop: Arc<AtomicBool>,
    relays: Vec<std::thread::JoinHandle<()>>,
    /// Each member's peer list: its own real address, the others' relays.
    peer_lists: BTreeMap<u64, String>,
}

impl Network {
    /// Relays for every ordered pair of `size` members whose peer endpoints bind free ports.
    fn start(size: u64) -> Network {
        let endpoints: BTreeMap<u64, SocketAddr> = (1..=size)
            .map(|id| {
                (
                    id,
                    SocketAddr::from(([127, 0, 0, 1], support::free_peer_port())),
                )
            })
            .collect();
        let cut = Arc::new(Mutex::new(BTreeSet::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut relays = Vec::new();
        let mut peer_lists = BTreeMap::new();
        for from in 1..=size {
            let mut list = vec![format!("{from}={}", endpoints[&from])];
            for to in (1..=size).filter(|to| *to != from) {
                let socket = UdpSocket::bind("127.0.0.1:0").expect("relay binds");
                list.push(format!("{to}={}", socket.local_addr().expect("relay addr")));
                let (cut, stop) = (Arc::clone(&cut), Arc::clone(&stop));
                let target = endpoints[&to];
                relays.push(std::thread::spawn(move || {
                    relay(&socket, target, (from.min(to), from.max(to)), &cut, &stop);
                }));
            }
            peer_lists.insert(from, list.join(","));
        }
        Network {
            cut,
            stop,
            relays,
            peer_lists,
        }
    }

    /// Cuts every link of member `alone`: it runs on, unable to reach the others.
    fn partition(&self, alone: u64) {
        let mut cut = self.cut.lock().expect("lock");
        for other in self.peer_lists.keys().filter(|id| **id != alone) {
            cut.insert((alone.min(*other), alone.max(*other)));
        }
    }

    fn heal(&self) {
        self.cut.lock().expect("lock").clear();
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for relay in self.relays.drain(..) {
            let _ = relay.join();
        }
    }
}

/// Forwards datagrams between the member that sends to `socket` and the peer endpoint at
/// `target`, dropping them while `link` is cut, until `stop`.
fn relay(
    socket: &UdpSocket,
    target: SocketAddr,
    link: (u64, u64),
    cut: &Mutex<BTreeSet<(u64, u64)>>,
    stop: &AtomicBool,
) {
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .expect("read timeout");
    let mut buffer = vec![0u8; 65_536];
    // Where the dialling member's datagrams come from (its endpoint's socket).
    let mut dialler: Option<SocketAddr> = None;
    while !stop.load(Ordering::Relaxed) {
        let Ok((len, from)) = socket.recv_from(&mut buffer) else {
            continue;
        };
        if cut.lock().expect("lock").contains(&link) {
            continue;
        }
        let to = if from == target {
            match dialler {
                Some(dialler) => dialler,
                None => continue,
            }
        } else {
            dialler = Some(from);
            target
        };
        // Best effort, as the network: a full socket buffer drops the datagram.
        let _ = socket.send_to(&buffer[..len], to);
    }
}

struct Cluster {
    // Declared first: the brokers stop before the certificates and the network go.
    brokers: BTreeMap<u64, BrokerProcess>,
    network: Network,
    _certs: tempfile::TempDir,
}

impl Cluster {
    fn start(size: u64) -> Cluster {
        Cluster::start_with(size, &[])
    }

    /// A cluster whose members all get `extra` in their environment too.
    fn start_with(size: u64, extra: &[(&str, &str)]) -> Cluster {
        let certs = tempfile::tempdir().expect("temp dir");
        felix_ok(
            felix()
                .args(["cluster", "dev-certs", "--out"])
                .arg(certs.path())
                .args((1..=size).flat_map(|id| ["--node".to_owned(), id.to_string()])),
        );
        let network = Network::start(size);
        let mut brokers = BTreeMap::new();
        for id in 1..=size {
            let mut env = member_env(certs.path(), id, &network.peer_lists[&id]);
            env.extend(
                extra
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
            );
            let env: Vec<(&str, &str)> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            brokers.insert(id, BrokerProcess::start(&env));
        }
        Cluster {
            brokers,
            network,
            _certs: certs,
        }
    }

    fn status(&self, id: u64) -> Option<ClusterStatus> {
        felix_cluster::admin::status(self.brokers[&id].metrics_addr, ADMIN_TIMEOUT).ok()
    }

    /// Waits until every member in `ids` knows the same leader among `ids` and has applied
    /// every registration; returns the leader.
    fn settled(&self, ids: &[u64]) -> u64 {
        let deadline = Instant::now() + DEADLINE * 2;
        loop {
            let statuses: Vec<ClusterStatus> =
                ids.iter().filter_map(|id| self.status(*id)).collect();
            if statuses.len() == ids.len() {
                let leader = statuses[0].node.leader;
                let agreed = statuses.iter().all(|s| s.node.leader == leader);
                let registered = statuses
                    .iter()
                    .all(|s| s.state.members.len() == self.brokers.len());
                if let Some(leader) = leader
                    && agreed
                    && registered
                    && ids.contains(&leader)
                {
                    return leader;
                }
            }
            assert!(
                Instant::now() < deadline,
                "members {ids:?} did not settle: {statuses:#?}\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stderr(&self) -> String {
        self.brokers
            .iter()
            .map(|(id, b)| format!("--- broker {id} stderr:\n{}", b.stderr_text()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Cuts member `alone` off from the others, both ways (a network partition: every process
    /// runs, only the peer traffic between the two sides is dropped).
    fn partition(&self, alone: u64) {
        self.network.partition(alone);
    }

    /// Every peer link whole again.
    fn heal(&self) {
        self.network.heal();
    }

    /// Creates a durable stream of three replicas acknowledged on_commit.
    fn create(&self, via: u64, name: &str, shards: u32) -> Result<(), String> {
        self.create_fsync(via, name, shards, Fsync::OnCommit)
    }

    fn create_fsync(&self, via: u64, name: &str, shards: u32, fsync: Fsync) -> Result<(), String> {
        let fsync = match fsync {
            Fsync::OnCommit => felix_wire::FsyncMode::OnCommit,
            Fsync::Periodic => felix_wire::FsyncMode::Periodic,
        };
        with_client(self.brokers[&via].client_config(), async |client| {
            client
                .create_cluster_stream(name, shards, felix_wire::StreamKind::Durable, 3, fsync)
                .await
        })
    }
}

/// Runs one admin `request` with a client of `config`, on a runtime of its own (the cluster
/// tests' helpers are synchronous), within [`ADMIN_TIMEOUT`] and a little.
fn with_client<T>(
    config: felix_client::ClientConfig,
    request: impl AsyncFnOnce(&felix_client::Client) -> Result<T, felix_client::ClientError>,
) -> Result<T, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let answered = tokio::time::timeout(ADMIN_TIMEOUT * 2, async {
            let client = felix_client::Client::connect(config).await?;
            request(&client).await
        })
        .await;
        match answered {
            Ok(result) => result.map_err(|error| error.to_string()),
            Err(_) => Err(format!("no answer within {:?}", ADMIN_TIMEOUT * 2)),
        }
    })
}

/// Runs a `felix` command that must succeed; returns its standard output.
fn felix_ok(command: &mut std::process::Command) -> String {
    let output = command.output().expect("felix runs");
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn member_env(certs: &Path, id: u64, peers: &str) -> Vec<(String, String)> {
    let path = |name: String| certs.join(name).display().to_string();
    vec![
        ("FELIX_CLUSTER_NODE_ID".to_owned(), id.to_string()),
        (
            "FELIX_LOG".to_owned(),
            "info,felix_cluster=debug".to_owned(),
        ),
        ("FELIX_CLUSTER_PEERS".to_owned(), peers.to_owned()),
        ("FELIX_CLUSTER_CA".to_owned(), path("ca.pem".to_owned())),
        (
            "FELIX_CLUSTER_CERT".to_owned(),
            path(format!("node-{id}.pem")),
        ),
        (
            "FELIX_CLUSTER_KEY".to_owned(),
            path(format!("node-{id}.key")),
        ),
    ]
}

/// One plain HTTP/1.0 request to `addr`: the status code and the body.
fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, ADMIN_TIMEOUT).expect("connects");
    stream
        .set_read_timeout(Some(ADMIN_TIMEOUT))
        .expect("timeout set");
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: felix\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("request written");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("answer read");
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `addr`'s port on 127.0.0.1: the tests reach brokers bound to every address over loopback.
fn on_loopback(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], addr.port()))
}

// Proves the cluster's admin plane is closed: with FELIX_AUTH=required and rules, on members
// bound to every address (QUIC and metrics on 0.0.0.0, not only loopback), creating, deleting
// and reading a cluster stream is refused without a credential (`unauthenticated`: the QUIC
// handshake) and without the rule (`permission_denied`), through the library and the CLI on
// every member, while the metrics endpoint serves metrics and the read-only status only
// (POST/DELETE /v1/cluster/streams and POST /v1/cluster/read change and reveal nothing).
#[test]
fn cluster_admin_needs_a_credential_and_a_rule_on_every_path() {
    let tokens = tempfile::tempdir().expect("temp dir");
    let tokens_file = tokens.path().join("tokens");
    let token = |principal: &str| -> String {
        felix_ok(
            felix()
                .env("FELIX_TOKENS_FILE", &tokens_file)
                .args(["token", "add", principal]),
        )
        .trim()
        .to_owned()
    };
    let ops = token("ops");
    let reader = token("reader");
    let tokens_path = tokens_file.display().to_string();
    let mut cluster = Cluster::start_with(
        3,
        &[
            ("FELIX_AUTH", "required"),
            ("FELIX_TOKENS_FILE", &tokens_path),
            ("FELIX_RULES", "ops all *; reader subscribe *"),
            ("FELIX_BIND", "0.0.0.0:0"),
            ("FELIX_METRICS_BIND", "0.0.0.0:0"),
        ],
    );
    for broker in cluster.brokers.values_mut() {
        assert!(
            broker.quic_addr.ip().is_unspecified(),
            "bound to every address"
        );
        assert!(broker.metrics_addr.ip().is_unspecified());
        broker.quic_addr = on_loopback(broker.quic_addr);
        broker.metrics_addr = on_loopback(broker.metrics_addr);
    }
    cluster.settled(&[1, 2, 3]);
    let config = |id: u64, token: Option<&str>| {
        let mut config = cluster.brokers[&id].client_config();
        config.token = token.map(str::to_owned);
        config
    };
    let create = |config: felix_client::ClientConfig, name: &str| {
        with_client(config, async |client| {
            client
                .create_cluster_stream(
                    name,
                    2,
                    felix_wire::StreamKind::Durable,
                    3,
                    felix_wire::FsyncMode::OnCommit,
                )
                .await
        })
    };
    let delete = |config: felix_client::ClientConfig, name: &str| {
        with_client(config, async |client| {
            client.delete_cluster_stream(name).await
        })
    };
    let read = |config: felix_client::ClientConfig, name: &str| {
        with_client(config, async |client| {
            client.read_shard(name, 0, 0, 10).await
        })
    };
    let streams = |cluster: &Cluster| -> Vec<String> {
        cluster
            .status(1)
            .expect("status")
            .state
            .streams
            .keys()
            .cloned()
            .collect()
    };
    // No credential: the handshake itself is refused, on every member.
    for id in 1..=3 {
        for (what, refused) in [
            ("create", create(config(id, None), "orders")),
            ("delete", delete(config(id, None), "orders")),
            ("read", read(config(id, None), "orders").map(|_| ())),
        ] {
            let error = refused.expect_err("no credential, no request");
            assert!(
                error.contains("unauthenticated"),
                "member {id} {what}: {error}"
            );
        }
    }
    // A principal without `admin`: create and delete refused whoever leads.
    for id in 1..=3 {
        let error = create(config(id, Some(&reader)), "orders").expect_err("reader creates");
        assert!(error.contains("permission_denied"), "member {id}: {error}");
    }
    assert!(streams(&cluster).is_empty(), "nothing was created");
    // The one allowed: ops creates; the reader may read (subscribe), not delete.
    create(config(2, Some(&ops)), "orders").expect("ops creates");
    wait_for(&cluster, &[1, 2, 3], "the stream placed", |statuses| {
        placed_and_in_sync(statuses, 2)
    });
    let records = read(config(3, Some(&reader)), "orders").expect("reader reads");
    assert!(records.is_empty(), "nothing published yet: {records:?}");
    for id in 1..=3 {
        let error = delete(config(id, Some(&reader)), "orders").expect_err("reader deletes");
        assert!(error.contains("permission_denied"), "member {id}: {error}");
    }
    // The CLI takes the same paths: refused without the token, served with it.
    let cli = |id: u64, token: Option<&str>, args: &[&str]| {
        let mut command = cluster.brokers[&id].cli();
        command.arg("cluster").args(args);
        if let Some(token) = token {
            command.env("FELIX_TOKEN", token);
        }
        command.output().expect("felix cluster runs")
    };
    for args in [
        &["create-stream", "other", "--shards", "1"][..],
        &["delete-stream", "orders"][..],
        &["read", "orders"][..],
    ] {
        let output = cli(1, None, args);
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && said.contains("unauthenticated"),
            "{args:?}: {said}"
        );
    }
    let output = cli(1, Some(&reader), &["delete-stream", "orders"]);
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && said.contains("permission_denied"),
        "{said}"
    );
    // The metrics endpoint of every member: metrics and the status, nothing that changes or
    // reads a stream.
    for (id, broker) in &cluster.brokers {
        let addr = broker.metrics_addr;
        for (method, path, body) in [
            (
                "POST",
                "/v1/cluster/streams",
                r#"{"name":"sneaky","kind":"durable","shards":1,"replicas":3}"#,
            ),
            ("DELETE", "/v1/cluster/streams", r#"{"name":"orders"}"#),
            (
                "POST",
                "/v1/cluster/read",
                r#"{"stream":"orders","shard":0,"from":0,"max":10}"#,
            ),
        ] {
            let (status, answer) = http(addr, method, path, body);
            assert_eq!(status, 404, "member {id}: {method} {path}: {answer}");
            assert!(answer.contains("read-only status only"), "{answer}");
        }
        // Nor a way to cut a member's links (the fault hook of earlier versions is gone).
        let (status, answer) = http(addr, "POST", "/v1/cluster/faults", r#"{"cut":[1,2,3]}"#);
        assert_eq!(
            status, 404,
            "member {id}: POST /v1/cluster/faults: {answer}"
        );
        assert_eq!(http(addr, "GET", "/v1/cluster/status", "").0, 200);
        assert_eq!(http(addr, "GET", "/metrics", "").0, 200);
    }
    assert_eq!(
        streams(&cluster),
        ["orders"],
        "nothing created or deleted over HTTP"
    );
    // And ops deletes it, through the CLI.
    let output = cli(3, Some(&ops), &["delete-stream", "orders"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    wait_for(&cluster, &[1, 2, 3], "the stream gone", |statuses| {
        statuses.iter().all(|s| s.state.streams.is_empty())
    });
}

#[test]
fn three_brokers_elect_register_and_spread_each_streams_leaders() {
    let cluster = Cluster::start(3);
    let leader = cluster.settled(&[1, 2, 3]);
    // Created through a follower: the proposal is forwarded to the leader.
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    cluster.create(follower, "orders", 12).expect("created");
    assert!(
        cluster
            .create(leader, "orders", 12)
            .expect_err("a second creation is refused")
            .contains("exists")
    );
    for id in 1..=3 {
        let deadline = Instant::now() + DEADLINE;
        let status = loop {
            let status = cluster.status(id).expect("status");
            if status.state.streams.contains_key("orders") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "broker {id} never applied the creation"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let orders = &status.state.streams["orders"];
        assert_eq!(orders.shards.len(), 12);
        for member in 1..=3 {
            let led = orders.shards.iter().filter(|s| s.leader == member).count();
            assert_eq!(led, 4, "member {member} leads a third of the shards");
        }
        for shard in &orders.shards {
            assert_eq!(shard.replicas.len(), 3);
        }
        // Every member registered where clients reach it.
        for (member, broker) in &cluster.brokers {
            assert_eq!(
                status.state.members[member].client_addr,
                broker.quic_addr.to_string()
            );
        }
    }
    // Every member keeps the twelve groups' Raft logs in its one shared on_commit log.
    wait_for(
        &cluster,
        &[1, 2, 3],
        "the groups in each member's shared raft log",
        |statuses| {
            statuses.iter().all(|s| {
                s.raft_logs
                    .iter()
                    .any(|log| log.fsync == Fsync::OnCommit && log.groups == 12 && log.bytes > 0)
            })
        },
    );
    // `felix cluster status` shows the members and the stream's leaders.
    let text = felix_ok(
        felix()
            .args(["cluster", "status", "--admin"])
            .arg(cluster.brokers[&follower].metrics_addr.to_string()),
    );
    assert!(
        text.contains(&format!("control-plane leader {leader}")),
        "{text}"
    );
    assert!(
        text.contains("stream orders (durable, fsync on_commit, 12 shards, 3 replicas)"),
        "{text}"
    );
    assert!(
        text.contains("shard groups' raft log (on_commit): "),
        "{text}"
    );
    let leader_status = cluster.status(leader).expect("status");
    assert_eq!(leader_status.node.role, Role::Leader);
    assert_eq!(
        leader_status.node.peers.len(),
        3,
        "the leader reports each member's progress"
    );
    // The cluster's gauges are in the broker's metrics.
    let metrics = cluster.brokers[&leader].metrics();
    assert!(metrics.contains("\nfelix_cluster_leader 1\n"), "{metrics}");
    assert!(
        metrics.contains("felix_cluster_peer_lag_entries{peer="),
        "{metrics}"
    );
    assert!(
        metrics.contains("felix_cluster_shard_leader{stream=\"orders\",shard=\"11\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("felix_cluster_raft_log_groups{fsync=\"on_commit\"} 12\n"),
        "{metrics}"
    );
    assert!(metrics.trim_end().ends_with("# EOF"));
    let follower_metrics = cluster.brokers[&follower].metrics();
    assert!(follower_metrics.contains("\nfelix_cluster_leader 0\n"));
    assert!(follower_metrics.contains(&format!(
        "felix_cluster_peer_connected{{peer=\"{leader}\"}} 1"
    )));

    // An in-memory cluster stream: one copy of each shard on its owner; published through
    // member 2 (forwarded to the owners), read by a subscriber on member 3 (fetched from them).
    felix_ok(
        cluster.brokers[&1]
            .cli()
            .args(["cluster", "create-stream", "ticks", "--kind", "in-memory"])
            .args(["--shards", "3", "--replicas", "1"]),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        use futures::StreamExt as _;
        let publisher = support::within(felix_client::Client::connect(
            cluster.brokers[&2].naive_client_config(),
        ))
        .await
        .expect("connects");
        let reader = support::within(felix_client::Client::connect(
            cluster.brokers[&3].naive_client_config(),
        ))
        .await
        .expect("connects");
        // The members learn of the stream within a tick.
        let deadline = Instant::now() + DEADLINE;
        let mut subscription = loop {
            match reader
                .subscribe(
                    "ticks",
                    felix_wire::ShardSelection::All,
                    felix_wire::StartPosition::Earliest,
                )
                .await
            {
                Ok(subscription) => break subscription,
                Err(error) => {
                    assert!(Instant::now() < deadline, "cannot subscribe: {error}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let mut acked = BTreeMap::new();
        for n in 0..12 {
            let key = format!("t{n}");
            let acks = support::within(
                publisher.publish("ticks", &[felix_client::record(key, format!("tick {n}"))]),
            )
            .await
            .expect("an in-memory publish through a member that may not own the shard");
            acked.insert((acks[0].shard, acks[0].first_offset), format!("tick {n}"));
        }
        let mut received = BTreeMap::new();
        while received.len() < acked.len() {
            let record = support::within(subscription.next())
                .await
                .expect("open")
                .expect("a record");
            let payload = String::from_utf8(record.payload.to_vec()).expect("utf8");
            received.insert((record.shard, record.offset), payload);
        }
        assert_eq!(received, acked, "every record where its ack said, once");
    });
    drop(runtime);

    // The member runs on data-plane core 0 (its loop is one of the core's tasks): a member's
    // process has no thread of its own for the cluster.
    for broker in cluster.brokers.values() {
        let threads = broker.thread_names();
        assert!(threads.iter().any(|t| t == "felix-core-0"), "{threads:?}");
        assert!(
            !threads.iter().any(|t| t.contains("cluster")),
            "{threads:?}"
        );
    }
    // A clean stop (SIGTERM) stops the member with core 0: its logs closed, the broker exits 0,
    // and it comes back with its copy.
    let mut cluster = cluster;
    let stopped = cluster.brokers.get_mut(&follower).expect("follower");
    assert!(stopped.terminate().success());
    let said = stopped.stderr_text();
    assert!(!said.contains("did not stop"), "{said}");
    assert!(!said.contains("no longer takes part"), "{said}");
    stopped.restart();
    cluster.settled(&[1, 2, 3]);
    wait_for(
        &cluster,
        &[follower],
        "the restarted member's twelve groups",
        |statuses| statuses.iter().all(|s| s.shards.len() == 12),
    );
}

#[test]
fn the_control_plane_survives_its_leaders_kill_and_the_member_catches_up() {
    let mut cluster = Cluster::start(3);
    let first_leader = cluster.settled(&[1, 2, 3]);
    cluster.create(first_leader, "before", 3).expect("created");
    cluster
        .brokers
        .get_mut(&first_leader)
        .expect("leader")
        .kill();
    let rest: Vec<u64> = (1..=3).filter(|id| *id != first_leader).collect();
    let second_leader = cluster.settled(&rest);
    assert_ne!(second_leader, first_leader);
    // The two survivors still form a majority: changes commit.
    let deadline = Instant::now() + DEADLINE;
    while let Err(error) = cluster.create(rest[0], "after", 3) {
        assert!(
            Instant::now() < deadline,
            "no creation after the kill: {error}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The killed member rejoins on the same data directory and catches up.
    cluster
        .brokers
        .get_mut(&first_leader)
        .expect("killed member")
        .restart();
    let leader = cluster.settled(&[1, 2, 3]);
    let deadline = Instant::now() + DEADLINE;
    loop {
        let status = cluster.status(first_leader).expect("status");
        let streams: Vec<&String> = status.state.streams.keys().collect();
        let client_addr = &status.state.members[&first_leader].client_addr;
        if streams == ["after", "before"]
            && *client_addr == cluster.brokers[&first_leader].quic_addr.to_string()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the rejoined member did not catch up (leader {leader}): {status:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_member_cut_off_from_the_majority_cannot_change_the_control_plane_or_ack_a_publish() {
    let cluster = Cluster::start(3);
    let leader = cluster.settled(&[1, 2, 3]);
    cluster.create(leader, "ledger", 1).expect("created");
    wait_for(
        &cluster,
        &[1, 2, 3],
        "the shard led as placed",
        |statuses| placed_and_in_sync(statuses, 1),
    );
    let config = cluster.brokers[&leader].naive_client_config();
    // The lone member is the leader: the hardest case (it must step down, not commit alone).
    let others: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();
    for id in &others {
        cluster.brokers[id].signal("STOP");
    }
    // A publish through the lone member, while it also tries to create a stream.
    let publish = publish_one_in_a_thread(config, "ledger", "alone");
    let outcome = cluster.create(leader, "lonely", 3);
    let published = publish.join().expect("publisher");
    for id in &others {
        cluster.brokers[id].signal("CONT");
    }
    let error = outcome.expect_err("a minority cannot commit a creation");
    assert!(
        error.contains("503") || error.contains("no answer") || error.contains("leader"),
        "{error}"
    );
    match published {
        Ok(Err(felix_client::ClientError::Server { code, .. })) => {
            assert_eq!(code, felix_wire::ErrorCode::Unavailable);
        }
        other => panic!("a minority acknowledged a publish, or never answered: {other:?}"),
    }
    // Healed: the pending batch commits once (its outcome was unknown, never a lie), on
    // every member.
    wait_for(
        &cluster,
        &[1, 2, 3],
        "the pending record committed",
        |statuses| {
            statuses
                .iter()
                .all(|s| s.shards.first().is_some_and(|shard| shard.next_offset == 1))
        },
    );
    for id in 1..=3 {
        let copy = read_copy(&cluster, id, "ledger", 1);
        assert_eq!(
            copy[0],
            vec![("k".to_owned(), b"alone".to_vec())],
            "member {id}"
        );
    }
    // Healed: the cluster works again, and a creation commits.
    cluster.settled(&[1, 2, 3]);
    let deadline = Instant::now() + DEADLINE;
    while let Err(error) = cluster.create(others[0], "healed", 1) {
        assert!(
            Instant::now() < deadline,
            "no creation after healing: {error}\n{}",
            cluster.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Jepsen case a pause cannot make: the shard's leader keeps running, cut off from both
/// followers by a network partition. It must not acknowledge (it cannot reach a majority);
/// the majority side elects a leader and acknowledges; after healing, every copy agrees and
/// holds every acknowledged record exactly once.
#[test]
fn a_partitioned_leader_cannot_ack_while_the_majority_elects_and_acks() {
    let cluster = Cluster::start(3);
    cluster.settled(&[1, 2, 3]);
    cluster.create(1, "split", 1).expect("created");
    wait_for(
        &cluster,
        &[1, 2, 3],
        "the shard led as placed",
        |statuses| placed_and_in_sync(statuses, 1),
    );
    let old_leader = cluster.status(1).expect("status").shards[0]
        .leader
        .expect("a leader");
    let majority: Vec<u64> = (1..=3).filter(|id| *id != old_leader).collect();
    cluster.partition(old_leader);
    // A publish through the cut-off leader: never acknowledged.
    let lonely = cluster.brokers[&old_leader].naive_client_config();
    let minority_publish = publish_one_in_a_thread(lonely, "split", "minority");
    // The majority elects a new leader of the shard and acknowledges publishes through it.
    wait_for(
        &cluster,
        &majority,
        "the majority elects a new shard leader",
        |statuses| {
            statuses.iter().all(|s| {
                s.shards
                    .first()
                    .and_then(|shard| shard.leader)
                    .is_some_and(|leader| leader != old_leader)
            })
        },
    );
    let config = cluster.brokers[&majority[0]].naive_client_config();
    let acked: Vec<String> = {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let client = felix_client::Client::connect(config)
                .await
                .expect("connect");
            let mut acked = Vec::new();
            for i in 0..20 {
                let payload = format!("majority {i}");
                let record = felix_client::record("k", payload.clone());
                // Bounded: the new leader was elected; a retry covers a leader still settling.
                let deadline = Instant::now() + DEADLINE;
                loop {
                    match client.publish("split", std::slice::from_ref(&record)).await {
                        Ok(_) => break,
                        Err(error) => {
                            assert!(Instant::now() < deadline, "majority publish: {error}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
                acked.push(payload);
            }
            client.close().await;
            acked
        })
    };
    match minority_publish.join().expect("publisher") {
        Ok(Err(felix_client::ClientError::Server { code, .. })) => {
            assert_eq!(code, felix_wire::ErrorCode::Unavailable);
        }
        other => panic!("a cut-off leader acknowledged a publish, or never answered: {other:?}"),
    }
    cluster.heal();
    // Healed: the old leader catches up, every copy agrees. The minority's batch stays
    // pending on its member after its caller heard `unavailable`, and is proposed again once
    // healed: the copies are compared once nothing is pending anywhere, or that late commit
    // could land between the reads of two copies.
    wait_for_complete_copies(&cluster, 1);
    let copies: Vec<_> = (1..=3)
        .map(|id| read_copy(&cluster, id, "split", 1))
        .collect();
    assert!(
        copies.windows(2).all(|pair| pair[0] == pair[1]),
        "the copies differ: {copies:?}\n{}",
        cluster.stderr()
    );
    assert!(copies[0][0].len() >= 20, "every acked record is there");
    let payloads: Vec<String> = copies[0][0]
        .iter()
        .map(|(_, payload)| String::from_utf8_lossy(payload).into_owned())
        .collect();
    for payload in &acked {
        assert_eq!(
            payloads.iter().filter(|p| *p == payload).count(),
            1,
            "acked {payload:?} once in {payloads:?}"
        );
    }
    // The minority's record was never acknowledged: it may commit once after healing (its
    // member proposes it again), never twice.
    assert!(payloads.iter().filter(|p| *p == "minority").count() <= 1);
    assert_eq!(
        payloads.len(),
        acked.len() + payloads.iter().filter(|p| *p == "minority").count()
    );
}

/// Publishes one record (key `k`) to `stream` through a client of `config` on a thread of its
/// own, once: the client library's retries are off, so the broker's own answer comes back
/// (an idempotent batch answered `unavailable` would be sent again for ~90 s otherwise). The
/// thread returns the outcome, or a timeout after [`DEADLINE`].
fn publish_one_in_a_thread(
    config: felix_client::ClientConfig,
    stream: &'static str,
    payload: &'static str,
) -> std::thread::JoinHandle<
    Result<
        Result<Vec<felix_wire::ShardAck>, felix_client::ClientError>,
        tokio::time::error::Elapsed,
    >,
> {
    let mut config = config;
    config.publish_retries = 0;
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let client = felix_client::Client::connect(config)
                .await
                .expect("the member takes client connections");
            let record = felix_client::record("k", payload);
            let outcome = tokio::time::timeout(DEADLINE, client.publish(stream, &[record])).await;
            client.close().await;
            outcome
        })
    })
}

#[test]
fn bad_cluster_settings_stop_start_up_naming_the_variable() {
    let certs = tempfile::tempdir().expect("temp dir");
    let written = felix()
        .args(["cluster", "dev-certs", "--out"])
        .arg(certs.path())
        .output()
        .expect("dev-certs runs");
    assert!(written.status.success());
    let data = tempfile::tempdir().expect("temp dir");
    let peers = "1=127.0.0.1:1,2=127.0.0.1:2,3=127.0.0.1:3";
    let cases: Vec<(Vec<(String, String)>, &str)> = vec![
        (member_env(certs.path(), 4, peers), "FELIX_CLUSTER_PEERS"),
        (
            member_env(certs.path(), 1, "1=127.0.0.1:1,2=nowhere"),
            "FELIX_CLUSTER_PEERS",
        ),
        (
            {
                let mut env = member_env(certs.path(), 1, peers);
                env.retain(|(name, _)| name != "FELIX_CLUSTER_CA");
                env
            },
            "FELIX_CLUSTER_CA",
        ),
        (
            {
                let mut env = member_env(certs.path(), 1, peers);
                for (name, value) in &mut env {
                    if name == "FELIX_CLUSTER_KEY" {
                        *value = "/nonexistent/key.pem".to_owned();
                    }
                }
                env
            },
            "FELIX_CLUSTER_KEY",
        ),
    ];
    for (env, names) in cases {
        let output = felix()
            .arg("broker")
            .env("FELIX_DATA_DIR", data.path())
            .env("FELIX_BIND", "127.0.0.1:0")
            .env("FELIX_METRICS_BIND", "127.0.0.1:0")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("felix broker runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "start-up must fail: {env:?}");
        assert!(stderr.contains(names), "{names} not named: {stderr}");
    }
}

/// Waits until `check` holds for the statuses of `ids` (all answering), or fails with them.
fn wait_for(cluster: &Cluster, ids: &[u64], what: &str, check: impl Fn(&[ClusterStatus]) -> bool) {
    let deadline = Instant::now() + DEADLINE * 2;
    loop {
        let statuses: Vec<ClusterStatus> =
            ids.iter().filter_map(|id| cluster.status(*id)).collect();
        if statuses.len() == ids.len() && check(&statuses) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not within the deadline: {what}: {:#?}\n{}",
            statuses
                .iter()
                .map(|s| (s.node.id, &s.shards))
                .collect::<Vec<_>>(),
            cluster.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every member holds every shard and every shard is led by its placed leader, in sync.
fn placed_and_in_sync(statuses: &[ClusterStatus], shards: usize) -> bool {
    statuses.iter().all(|s| {
        s.shards.len() == shards
            && s.shards.iter().all(|shard| {
                shard.leader == Some(shard.placed_leader)
                    && !(shard.role == Role::Leader && shard.under_replicated)
            })
    })
}

#[test]
fn replicated_shards_elect_their_placed_leaders_and_fail_over() {
    let mut cluster = Cluster::start(3);
    cluster.settled(&[1, 2, 3]);
    cluster.create(2, "orders", 6).expect("created");
    // Each shard's Raft group runs on its three replicas and is led by its placed leader.
    wait_for(&cluster, &[1, 2, 3], "shards led as placed", |statuses| {
        placed_and_in_sync(statuses, 6)
    });
    // SIGKILL member 1: the shards it led elect a survivor, which reports them
    // under-replicated; the others keep their leaders.
    cluster.brokers.get_mut(&1).expect("member 1").kill();
    wait_for(
        &cluster,
        &[2, 3],
        "failover of member 1's shards",
        |statuses| {
            statuses.iter().all(|s| {
                s.shards.iter().all(|shard| {
                    let led_by_survivor = matches!(shard.leader, Some(2 | 3));
                    let flagged = shard.role != Role::Leader || shard.under_replicated;
                    led_by_survivor && flagged
                })
            })
        },
    );
    let shown = felix()
        .args(["cluster", "status", "--admin"])
        .arg(cluster.brokers[&2].metrics_addr.to_string())
        .output()
        .expect("felix cluster status runs");
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(text.contains("under-replicated"), "{text}");
    let metrics = cluster.brokers[&2].metrics();
    assert!(
        metrics.contains("felix_cluster_shard_under_replicated{stream=\"orders\""),
        "{metrics}"
    );
    // Member 1 rejoins on its data: it catches up, and takes back the shards placed on it.
    cluster.brokers.get_mut(&1).expect("member 1").restart();
    wait_for(
        &cluster,
        &[1, 2, 3],
        "shards led as placed after the rejoin",
        |statuses| placed_and_in_sync(statuses, 6),
    );

    // `felix pub --cluster` through member 1: each record straight to its shard's leader.
    let bundle = tempfile::tempdir().expect("temp dir");
    let keys: Vec<String> = (0..12).map(|i| format!("--key=c{i}")).collect();
    for key in &keys {
        let published = felix()
            .args(["pub", "orders", "--cluster", key, "--addr"])
            .arg(cluster.brokers[&1].quic_addr.to_string())
            .arg("--ca")
            .arg(write_bundle(&cluster, bundle.path()))
            .arg("straight")
            .output()
            .expect("felix pub runs");
        let said = String::from_utf8_lossy(&published.stdout);
        assert!(
            published.status.success() && said.starts_with("acked 1 record: shard "),
            "{said}{}",
            String::from_utf8_lossy(&published.stderr)
        );
    }
    // The same batch as the same producer, from two processes through two members: stored
    // once, the second answered with the first's offsets.
    let once: Vec<String> = [1, 3]
        .iter()
        .map(|via| {
            felix_ok(
                felix()
                    .args([
                        "pub",
                        "orders",
                        "--cluster",
                        "--key=once",
                        "--producer-id=f1ee",
                    ])
                    .arg("--addr")
                    .arg(cluster.brokers[via].quic_addr.to_string())
                    .arg("--ca")
                    .arg(write_bundle(&cluster, bundle.path()))
                    .arg("exactly once"),
            )
        })
        .collect();
    assert!(once[0].starts_with("acked 1 record: shard "), "{once:?}");
    assert_eq!(once[0], once[1], "the second is the first's ack");

    // Deleting the stream (`felix cluster delete-stream`, through member 3) ends its
    // subscribers, refuses its publishes and removes every member's shard logs.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (client, mut subscription) = runtime.block_on(async {
        let client = support::within(felix_client::Client::connect(
            cluster.brokers[&2].naive_client_config(),
        ))
        .await
        .expect("connects");
        let acks = support::within(client.publish(
            "orders",
            &[felix_client::record("k", "before the deletion")],
        ))
        .await
        .expect("published");
        assert_eq!(acks.len(), 1);
        let subscription = support::within(client.subscribe(
            "orders",
            felix_wire::ShardSelection::All,
            felix_wire::StartPosition::Earliest,
        ))
        .await
        .expect("subscribed");
        (client, subscription)
    });
    felix_ok(
        cluster.brokers[&3]
            .cli()
            .args(["cluster", "delete-stream", "orders"]),
    );
    wait_for(
        &cluster,
        &[1, 2, 3],
        "the stream gone everywhere",
        |statuses| {
            statuses
                .iter()
                .all(|s| s.shards.is_empty() && !s.state.streams.contains_key("orders"))
        },
    );
    for (id, broker) in &cluster.brokers {
        for logs in ["shards", "records"] {
            let dir = broker.data_dir.path().join("cluster").join(logs);
            // The groups' Raft logs were released inside the member's shared Raft logs
            // (`shards/on_commit`, `shards/periodic`): no group has a directory of its own.
            let left = entry_names(&dir);
            let shared = |name: &std::ffi::OsString| {
                logs == "shards" && (name == "on_commit" || name == "periodic")
            };
            assert!(
                left.iter().all(shared),
                "member {id} kept {logs} logs {left:?}"
            );
        }
    }
    runtime.block_on(async {
        use futures::StreamExt as _;
        // The records published before (twelve through `felix pub --cluster`, one twice as
        // one producer, one more), then the end.
        let mut received = 0;
        let end = loop {
            match support::within(subscription.next()).await {
                Some(Ok(_)) => received += 1,
                end => break end,
            }
        };
        assert_eq!(
            received, 14,
            "every record published before the deletion, once"
        );
        assert!(
            matches!(
                &end,
                Some(Err(felix_client::ClientError::Server { code, .. }))
                    if *code == felix_wire::ErrorCode::StreamNotFound
            ),
            "{end:?}"
        );
        // Every member dropped the stream's groups: a publish is refused, never acked.
        let refused = support::within(
            client.publish("orders", &[felix_client::record("k", "after the deletion")]),
        )
        .await;
        assert!(
            matches!(
                &refused,
                Err(felix_client::ClientError::Server { code, .. })
                    if *code == felix_wire::ErrorCode::StreamNotFound
            ),
            "{refused:?}"
        );
    });
    let again = cluster.brokers[&1]
        .cli()
        .args(["cluster", "delete-stream", "orders"])
        .output()
        .expect("felix cluster delete-stream runs");
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && said.contains("no stream named"),
        "{said}"
    );
}

/// One creation a client made during the randomized fault run.
#[derive(Debug)]
struct Operation {
    name: String,
    invoked: Instant,
    completed: Instant,
    outcome: Result<(), String>,
}

/// One publish a client made during the randomized fault run.
#[derive(Debug)]
struct PublishOp {
    payload: Vec<u8>,
    invoked: Instant,
    completed: Instant,
    /// The shard and offset its ack gave.
    acked: Option<(u32, u64)>,
}

/// Publishes one-record batches with unique payloads to the replicated stream `events`
/// through random running members (5 s deadline each) until `stop`; returns the history.
fn publish_under_faults(
    configs: &std::sync::Mutex<BTreeMap<u64, Option<felix_client::ClientConfig>>>,
    stop: &std::sync::atomic::AtomicBool,
    seed: u64,
) -> Vec<PublishOp> {
    use rand::{Rng, SeedableRng};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut clients: BTreeMap<u64, felix_client::Client> = BTreeMap::new();
        let mut history = Vec::new();
        let mut next = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let up: Vec<(u64, felix_client::ClientConfig)> = configs
                .lock()
                .expect("lock")
                .iter()
                .filter_map(|(id, config)| config.clone().map(|config| (*id, config)))
                .collect();
            let Some((id, config)) = up.get(rng.random_range(0..up.len().max(1))).cloned() else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            if let std::collections::btree_map::Entry::Vacant(slot) = clients.entry(id) {
                let connect = felix_client::Client::connect(config);
                match tokio::time::timeout(Duration::from_secs(5), connect).await {
                    Ok(Ok(client)) => {
                        slot.insert(client);
                    }
                    _ => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                }
            }
            let client = &clients[&id];
            let payload = format!("e{next}").into_bytes();
            let record = felix_client::record(format!("k{next}"), payload.clone());
            next += 1;
            let invoked = Instant::now();
            let outcome =
                tokio::time::timeout(Duration::from_secs(5), client.publish("events", &[record]))
                    .await;
            let completed = Instant::now();
            let acked = match outcome {
                Ok(Ok(acks)) => Some((acks[0].shard, acks[0].first_offset)),
                // Refused by a running broker: the connection stays.
                Ok(Err(felix_client::ClientError::Server { .. })) => None,
                // The member is gone or paused: connect again next time.
                Ok(Err(_)) | Err(_) => {
                    clients.remove(&id);
                    None
                }
            };
            history.push(PublishOp {
                payload,
                invoked,
                completed,
                acked,
            });
        }
        for (_, client) in clients {
            let _ = tokio::time::timeout(Duration::from_secs(5), client.close()).await;
        }
        history
    })
}

/// What the subscriber of the fault run received: each shard's payloads from offset 0 on, and
/// how many times it moved to another member.
struct Resumed {
    shards: Vec<Vec<Vec<u8>>>,
    moves: usize,
}

/// Subscribes to both shards of `events` through a random running member and, whenever that
/// member is silent for a second (killed, paused, or just nothing new) or every 50 records,
/// moves to another member, resuming from the next offset of each shard. Every record must be
/// the next offset of its shard (no gap, no duplicate, across moves). Stops once `stop` is set
/// and it holds every record below `ends` (set after healing).
fn subscribe_under_faults(
    configs: &std::sync::Mutex<BTreeMap<u64, Option<felix_client::ClientConfig>>>,
    ends: &Ends,
    seed: u64,
) -> Resumed {
    use futures::StreamExt as _;
    use rand::{Rng, SeedableRng};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut shards: Vec<Vec<Vec<u8>>> = vec![Vec::new(), Vec::new()];
        let mut moves = 0;
        let deadline = Instant::now() + DEADLINE * 4;
        loop {
            let done = |shards: &[Vec<Vec<u8>>]| {
                ends.lock().unwrap().as_ref().is_some_and(|ends| {
                    ends.iter()
                        .zip(shards)
                        .all(|(end, got)| got.len() as u64 >= *end)
                })
            };
            if done(&shards) {
                return Resumed { shards, moves };
            }
            assert!(Instant::now() < deadline, "the resuming subscriber stalled");
            let up: Vec<felix_client::ClientConfig> = configs
                .lock()
                .expect("lock")
                .values()
                .flatten()
                .cloned()
                .collect();
            let Some(config) = up.get(rng.random_range(0..up.len().max(1))).cloned() else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let from = felix_wire::StartPosition::Offsets(
                shards
                    .iter()
                    .enumerate()
                    .map(|(shard, got)| (shard as u32, got.len() as u64))
                    .collect(),
            );
            let attempt = async {
                let client = felix_client::Client::connect(config).await.ok()?;
                let subscription = client
                    .subscribe("events", felix_wire::ShardSelection::All, from)
                    .await
                    .ok()?;
                Some((client, subscription))
            };
            // A paused member never answers; a member behind this subscriber refuses offsets
            // beyond its end (`invalid_argument`): try another.
            let Ok(Some((client, mut subscription))) =
                tokio::time::timeout(Duration::from_secs(3), attempt).await
            else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            moves += 1;
            let mut here = 0;
            while here < 50 && !done(&shards) {
                match tokio::time::timeout(Duration::from_secs(1), subscription.next()).await {
                    Ok(Some(Ok(record))) => {
                        let got = &mut shards[record.shard as usize];
                        assert_eq!(
                            record.offset,
                            got.len() as u64,
                            "shard {}: a gap or a duplicate after {moves} moves",
                            record.shard
                        );
                        got.push(record.payload.to_vec());
                        here += 1;
                    }
                    // Ended (its member stopped), silent, or gone: move.
                    _ => break,
                }
            }
            drop(subscription);
            let _ = tokio::time::timeout(Duration::from_secs(1), client.close()).await;
        }
    })
}

/// A Jepsen-style run: a client creates streams (unique names) through random members, and
/// another publishes unique records to a replicated stream through random members, while a
/// nemesis kills members with SIGKILL and restarts them, cuts one off from the others (a
/// network partition: `Cluster::partition`), and pauses them with SIGSTOP
/// (sometimes two at once, leaving a minority), for FELIX_CLUSTER_NEMESIS_SECONDS (default 20;
/// `make cluster-test` runs 60). After healing, the audit of the control plane: every member
/// holds the same streams; every acknowledged creation is there; nothing is there that no
/// client asked for; no creation was applied twice (it would answer `exists`); and
/// acknowledgements are linearizable: a creation acknowledged before another began holds the
/// earlier place in the log. And of the published records: every member's copy is the same;
/// every acknowledged record is there once, where its ack said; none is there twice or from
/// nowhere; and a record acknowledged before another (of its shard) was published has the lower
/// offset. A subscriber moving between members (`subscribe_under_faults`) received every
/// record of the copies once, in order. FELIX_CLUSTER_NEMESIS_SEED replays a nemesis schedule.
#[test]
fn randomized_faults_keep_acked_creations_once_and_in_real_time_order() {
    use rand::{Rng, SeedableRng};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let seconds: u64 = std::env::var("FELIX_CLUSTER_NEMESIS_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("FELIX_CLUSTER_NEMESIS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
    eprintln!("nemesis seed {seed} (FELIX_CLUSTER_NEMESIS_SEED={seed} replays its schedule)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Half the runs compact the shards' Raft logs every 16 batches: the audit then reads
    // every record from the members' record logs, and a member that was down or cut off
    // while the others compacted catches up from a snapshot and fetches what it missed.
    let compact = if rng.random_bool(0.5) { "16" } else { "10000" };
    eprintln!("nemesis raft logs compacted every {compact} batches");
    let mut cluster = Cluster::start_with(3, &[("FELIX_CLUSTER_RAFT_COMPACT_ENTRIES", compact)]);
    cluster.settled(&[1, 2, 3]);
    // Both acknowledgement modes keep every acked record through kills, pauses and
    // partitions (none of them cuts power): the seed picks one.
    let fsync = if rng.random_bool(0.5) {
        Fsync::Periodic
    } else {
        Fsync::OnCommit
    };
    eprintln!("nemesis stream acknowledged {}", fsync.name());
    cluster
        .create_fsync(1, "events", 2, fsync)
        .expect("the replicated stream");
    wait_for(
        &cluster,
        &[1, 2, 3],
        "the shards led as placed",
        |statuses| placed_and_in_sync(statuses, 2),
    );
    let configs: Arc<Mutex<BTreeMap<u64, Option<felix_client::ClientConfig>>>> =
        Arc::new(Mutex::new(
            cluster
                .brokers
                .iter()
                .map(|(id, b)| (*id, Some(b.naive_client_config())))
                .collect(),
        ));
    let stop = Arc::new(AtomicBool::new(false));
    let client = {
        let admin = Arc::clone(&configs);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut history = Vec::new();
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
            let mut next = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let up: Vec<felix_client::ClientConfig> = admin
                    .lock()
                    .expect("lock")
                    .values()
                    .flatten()
                    .cloned()
                    .collect();
                let Some(config) = up.get(rng.random_range(0..up.len().max(1))).cloned() else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let name = format!("n{next}");
                next += 1;
                let invoked = Instant::now();
                let outcome = with_client(config, async |client| {
                    client
                        .create_cluster_stream(
                            &name,
                            1,
                            felix_wire::StreamKind::InMemory,
                            1,
                            felix_wire::FsyncMode::OnCommit,
                        )
                        .await
                });
                history.push(Operation {
                    name,
                    invoked,
                    completed: Instant::now(),
                    outcome,
                });
            }
            history
        })
    };
    let publisher = {
        let configs = Arc::clone(&configs);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || publish_under_faults(&configs, &stop, seed ^ 0xfeed))
    };
    let ends: Ends = Arc::default();
    let subscriber = {
        let configs = Arc::clone(&configs);
        let ends = Arc::clone(&ends);
        std::thread::spawn(move || subscribe_under_faults(&configs, &ends, seed ^ 0x50b))
    };
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut faults = Vec::new();
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1_500)));
        let victim = rng.random_range(1..=3u64);
        match rng.random_range(0..4) {
            0 => {
                faults.push(format!("kill {victim}"));
                configs.lock().expect("lock").insert(victim, None);
                let broker = cluster.brokers.get_mut(&victim).expect("member");
                broker.kill();
                std::thread::sleep(Duration::from_millis(rng.random_range(200..2_000)));
                broker.restart();
                let config = broker.naive_client_config();
                configs.lock().expect("lock").insert(victim, Some(config));
            }
            1 => {
                faults.push(format!("pause {victim}"));
                cluster.brokers[&victim].signal("STOP");
                std::thread::sleep(Duration::from_millis(rng.random_range(200..3_000)));
                cluster.brokers[&victim].signal("CONT");
            }
            2 => {
                // A network partition: the victim runs on, cut off from both others.
                faults.push(format!("partition {victim}"));
                cluster.partition(victim);
                std::thread::sleep(Duration::from_millis(rng.random_range(200..3_000)));
                cluster.heal();
            }
            _ => {
                // Two paused at once: the remaining member is a minority.
                let other = victim % 3 + 1;
                faults.push(format!("pause {victim} and {other}"));
                cluster.brokers[&victim].signal("STOP");
                cluster.brokers[&other].signal("STOP");
                std::thread::sleep(Duration::from_millis(rng.random_range(200..2_000)));
                cluster.brokers[&victim].signal("CONT");
                cluster.brokers[&other].signal("CONT");
            }
        }
    }
    // Healed (every member runs): wait for a settled cluster, then a last creation.
    cluster.settled(&[1, 2, 3]);
    stop.store(true, Ordering::Relaxed);
    let history = client.join().expect("client");
    let published = publisher.join().expect("publisher");
    let last = Instant::now() + DEADLINE;
    while let Err(error) = cluster.create(1, "last", 1) {
        assert!(Instant::now() < last, "no creation after healing: {error}");
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_for(
        &cluster,
        &[1, 2, 3],
        "every member applied the last creation",
        |statuses| {
            statuses
                .iter()
                .all(|s| s.state.streams.contains_key("last"))
                && statuses
                    .windows(2)
                    .all(|pair| pair[0].state.streams == pair[1].state.streams)
        },
    );
    let state = cluster.status(1).expect("status").state;
    let acked: Vec<&Operation> = history.iter().filter(|op| op.outcome.is_ok()).collect();
    eprintln!(
        "nemesis: {} faults ({faults:?}), {} creations, {} acknowledged",
        faults.len(),
        history.len(),
        acked.len()
    );
    for op in &history {
        if let Err(error) = &op.outcome {
            assert!(
                !error.contains("exists"),
                "{} was applied twice: {error}",
                op.name
            );
        }
    }
    for op in &acked {
        assert!(
            state.streams.contains_key(&op.name),
            "acknowledged {} lost",
            op.name
        );
    }
    for name in state.streams.keys() {
        assert!(
            name == "last" || name == "events" || history.iter().any(|op| op.name == *name),
            "{name} appeared without a request"
        );
    }
    for a in &acked {
        for b in &acked {
            if a.completed < b.invoked {
                let (ia, ib) = (
                    state.streams[&a.name].incarnation,
                    state.streams[&b.name].incarnation,
                );
                assert!(
                    ia < ib,
                    "{} was acknowledged before {} began, yet applied after it ({ia} > {ib})",
                    a.name,
                    b.name
                );
            }
        }
    }
    assert!(!acked.is_empty(), "the run acknowledged creations");
    let reference = audit_published(&cluster, &published);
    *ends.lock().unwrap() = Some(reference.iter().map(|r| r.len() as u64).collect());
    let resumed = subscriber.join().expect("subscriber");
    for (shard, got) in resumed.shards.iter().enumerate() {
        let stored: Vec<&Vec<u8>> = reference[shard].iter().map(|(_, p)| p).collect();
        assert!(
            got.iter().collect::<Vec<_>>() == stored,
            "the resuming subscriber's shard {shard} differs from the copies"
        );
    }
    eprintln!(
        "nemesis: the subscriber received {} records over {} subscriptions on random members",
        resumed.shards.iter().map(Vec::len).sum::<usize>(),
        resumed.moves
    );
    let holes: usize = cluster
        .brokers
        .values()
        .map(|b| b.stderr_text().matches("fetching them from a peer").count())
        .sum();
    eprintln!("nemesis: {holes} copies caught up from a snapshot and fetched what they missed");
}

/// The audit of the records published during the fault run (see the run's comment); returns
/// the copies' records.
fn audit_published(cluster: &Cluster, published: &[PublishOp]) -> Vec<Vec<(String, Vec<u8>)>> {
    // Batches still pending on a member commit (or stay lost with a killed member's memory);
    // wait until nothing is pending and every copy has the same end.
    wait_for(
        cluster,
        &[1, 2, 3],
        "every copy of events complete",
        |statuses| {
            let ends = |s: &ClusterStatus| {
                let mut ends: Vec<(u32, u64, usize)> = s
                    .shards
                    .iter()
                    .filter(|shard| shard.stream == "events")
                    .map(|shard| (shard.shard, shard.next_offset, shard.pending))
                    .collect();
                ends.sort_unstable();
                ends
            };
            let first = ends(&statuses[0]);
            first.len() == 2
                && first.iter().all(|(_, _, pending)| *pending == 0)
                && statuses.iter().all(|s| ends(s) == first)
        },
    );
    let reference = read_copy(cluster, 1, "events", 2);
    for id in [2, 3] {
        assert!(
            read_copy(cluster, id, "events", 2) == reference,
            "member {id}'s copy of events differs from member 1's"
        );
    }
    let asked: std::collections::HashSet<&[u8]> =
        published.iter().map(|op| op.payload.as_slice()).collect();
    let mut seen = std::collections::HashSet::new();
    for records in &reference {
        for (_, payload) in records {
            assert!(seen.insert(payload.clone()), "{payload:?} is there twice");
            assert!(
                asked.contains(payload.as_slice()),
                "{payload:?} from nowhere"
            );
        }
    }
    let acked: Vec<(&PublishOp, u32, u64)> = published
        .iter()
        .filter_map(|op| op.acked.map(|(shard, offset)| (op, shard, offset)))
        .collect();
    for (op, shard, offset) in &acked {
        let stored = reference[*shard as usize].get(usize::try_from(*offset).expect("small"));
        assert_eq!(
            stored.map(|(_, payload)| payload),
            Some(&op.payload),
            "an acknowledged record is not where its ack said"
        );
    }
    for (a, shard_a, offset_a) in &acked {
        for (b, shard_b, offset_b) in &acked {
            if shard_a == shard_b && a.completed < b.invoked {
                assert!(
                    offset_a < offset_b,
                    "{:?} was acknowledged before {:?} was published, yet has a later offset",
                    String::from_utf8_lossy(&a.payload),
                    String::from_utf8_lossy(&b.payload)
                );
            }
        }
    }
    eprintln!(
        "nemesis: {} publishes, {} acknowledged, {} records stored",
        published.len(),
        acked.len(),
        seen.len()
    );
    assert!(!acked.is_empty(), "the run acknowledged publishes");
    reference
}

/// Publishers' batches for the replicated publish test (bounded: the test stops by itself).
const PUBLISH_BATCHES: u64 = 150;

/// One acknowledged batch: the payloads and where the ack put them.
struct AckedBatch {
    payloads: Vec<Vec<u8>>,
    acks: Vec<felix_wire::ShardAck>,
    keys: Vec<String>,
}

/// Every record of every shard of `stream` in member `id`'s copy, by shard.
fn read_copy(cluster: &Cluster, id: u64, stream: &str, shards: u32) -> Vec<Vec<(String, Vec<u8>)>> {
    let config = cluster.brokers[&id].client_config();
    (0..shards)
        .map(|shard| {
            let mut records = Vec::new();
            loop {
                let from = records.len() as u64;
                let read = with_client(config.clone(), async |client| {
                    client.read_shard(stream, shard, from, 1_000).await
                })
                .unwrap_or_else(|error| panic!("member {id} reads shard {shard}: {error}"));
                if read.is_empty() {
                    break;
                }
                for record in read {
                    assert_eq!(record.offset, records.len() as u64, "dense offsets");
                    records.push((
                        String::from_utf8(record.key.to_vec()).expect("utf8"),
                        record.payload.to_vec(),
                    ));
                }
            }
            records
        })
        .collect()
}

#[test]
fn acked_publishes_are_on_every_replica_once_after_a_leaders_kill() {
    let mut cluster = Cluster::start(3);
    cluster.settled(&[1, 2, 3]);
    let shards = 3;
    // Periodic acknowledgements: a member counts an entry once written, so an ack may come
    // before any fdatasync; a SIGKILL must still lose none (the page cache keeps it). The
    // on_commit mode goes through the kills of the fail-over and nemesis tests.
    cluster
        .create_fsync(1, "payments", shards, Fsync::Periodic)
        .expect("created");
    wait_for(&cluster, &[1, 2, 3], "shards led as placed", |statuses| {
        placed_and_in_sync(statuses, shards as usize)
    });
    // One publisher per member, through the plain client (no cluster map yet: a publish
    // entering a member that does not lead its shard goes to the leader through Raft), and a
    // subscriber on every member from the start.
    let ends: Ends = Arc::default();
    let configs: BTreeMap<u64, Arc<Mutex<Option<felix_client::ClientConfig>>>> = cluster
        .brokers
        .iter()
        .map(|(id, broker)| {
            (
                *id,
                Arc::new(Mutex::new(Some(broker.naive_client_config()))),
            )
        })
        .collect();
    let publishers: Vec<_> = configs
        .iter()
        .map(|(&id, slot)| {
            let slot = Arc::clone(slot);
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                runtime.block_on(publish_batches(id, slot))
            })
        })
        .collect();
    // And a cluster client, seeded with member 1, straight to each shard's leader, as one
    // idempotent producer: a part caught by the kill is sent again (same producer id and
    // sequence) through the shard's new leader, and stored once. Its retries cover a
    // failover with room to spare (~15 s of backoff; the failover below waits up to 60 s).
    let bundle = tempfile::tempdir().expect("temp dir");
    let mut cluster_config = cluster_client_config(&cluster, 1, bundle.path());
    cluster_config.publish_retries = 20;
    let cluster_publisher = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(cluster_publish_batches(cluster_config))
    });
    let mut subscribers: Vec<(u64, std::thread::JoinHandle<Received>)> = configs
        .iter()
        .map(|(&id, slot)| (id, subscriber(id, Arc::clone(slot), Arc::clone(&ends))))
        .collect();
    // SIGKILL the leader of shard 0 once some batches are in, then start it again.
    wait_for(&cluster, &[1], "some batches committed", |statuses| {
        statuses[0]
            .shards
            .iter()
            .any(|shard| shard.next_offset >= 30)
    });
    let victim = cluster.status(1).expect("status").shards[0]
        .leader
        .expect("a leader");
    *configs[&victim].lock().unwrap() = None;
    cluster.brokers.get_mut(&victim).expect("victim").kill();
    let survivor = if victim == 1 { 2 } else { 1 };
    wait_for(&cluster, &[survivor], "shard 0 fails over", |statuses| {
        statuses[0].shards[0]
            .leader
            .is_some_and(|leader| leader != victim)
    });
    cluster.brokers.get_mut(&victim).expect("victim").restart();
    *configs[&victim].lock().unwrap() = Some(cluster.brokers[&victim].naive_client_config());
    // A subscriber on the restarted member, from the start of its recovered copy.
    subscribers.push((
        victim,
        subscriber(victim, Arc::clone(&configs[&victim]), Arc::clone(&ends)),
    ));

    let mut acked = Vec::new();
    let mut refused = 0usize;
    for publisher in publishers {
        let (batches, refusals) = publisher.join().expect("publisher");
        acked.extend(batches);
        refused += refusals;
    }
    let (batches, refusals, straight) = cluster_publisher.join().expect("cluster publisher");
    eprintln!(
        "cluster client: {} batches acknowledged, {refusals} refused, {straight} parts straight \
         to a leader that is not its seed",
        batches.len()
    );
    assert_eq!(
        refusals, 0,
        "the cluster client rode the leader's kill: every publish acknowledged"
    );
    assert!(
        straight > 0,
        "the cluster client sent parts straight to leaders other than its seed"
    );
    acked.extend(batches);
    refused += refusals;
    eprintln!("{} batches acknowledged, {refused} refused", acked.len());
    assert!(
        acked.len() as u64 > PUBLISH_BATCHES,
        "most batches acknowledged"
    );
    // The killed member catches up: every member reaches the same end of every shard, with
    // nothing pending anywhere (a refused batch may still commit; the ends are taken after).
    wait_for_complete_copies(&cluster, shards);
    let reference = read_copy(&cluster, 1, "payments", shards);
    for id in [2, 3] {
        assert!(
            read_copy(&cluster, id, "payments", shards) == reference,
            "member {id}'s copy differs from member 1's"
        );
    }
    // Every subscriber received the committed records of each shard once, in offset order,
    // from offset 0: to the end, or (the first one on the killed member) until the kill.
    *ends.lock().unwrap() = Some(reference.iter().map(|r| r.len() as u64).collect());
    for (index, (id, subscriber)) in subscribers.into_iter().enumerate() {
        let received = subscriber.join().expect("subscriber");
        let killed = index < 3 && id == victim;
        let mut total = 0;
        for (shard, records) in received.iter().enumerate() {
            for (position, (offset, payload)) in records.iter().enumerate() {
                assert_eq!(
                    *offset, position as u64,
                    "subscriber {index} on member {id}: shard {shard} in order, once, from 0"
                );
                assert_eq!(
                    &reference[shard][position].1, payload,
                    "subscriber {index} on member {id}: shard {shard} offset {offset} is the \
                     committed record"
                );
            }
            if !killed {
                assert_eq!(
                    records.len(),
                    reference[shard].len(),
                    "subscriber {index} on member {id}: shard {shard} to the end"
                );
            }
            total += records.len();
        }
        eprintln!("subscriber {index} on member {id}: {total} records");
    }
    let mut seen = std::collections::HashSet::new();
    for records in &reference {
        for (_, payload) in records {
            assert!(
                seen.insert(payload.clone()),
                "a record is there twice: {payload:?}"
            );
        }
    }
    for batch in &acked {
        // Records of one shard take consecutive offsets in batch order.
        for ack in &batch.acks {
            let in_shard: Vec<&Vec<u8>> = batch
                .keys
                .iter()
                .zip(&batch.payloads)
                .filter(|(key, _)| felix_wire::shard_for_key(key.as_bytes(), shards) == ack.shard)
                .map(|(_, payload)| payload)
                .collect();
            assert_eq!(
                in_shard.len(),
                ack.count as usize,
                "the ack counts the shard's part"
            );
            for (at, payload) in (ack.first_offset..).zip(in_shard) {
                let stored = &reference[ack.shard as usize][usize::try_from(at).expect("small")];
                assert_eq!(&stored.1, payload, "an acked record is where its ack said");
            }
        }
    }
}

/// A cluster client configuration through member `via` that trusts every member's development
/// certificate (a bundle written under `dir`), noticing a dead member within 3 s.
/// A stopped shard leader and the cluster client:
/// 1. The client opens each member's connection on its own: a publish bound to the stopped
///    leader (its handshake cannot end while the member is stopped) holds up no part bound to
///    a live member. (Before, one lock over every member's connection was held across the
///    handshake, so every shard waited out the stopped member's connect timeout.) Resumed,
///    the stopped member answers and the held publish is acknowledged too.
/// 2. A part sent to a leader that then stops is sent again once the cluster map shows the
///    shard's new leader, and acknowledged while the old one is still stopped. (Before, it
///    waited for its connection's idle timeout, here 10 minutes on both sides.)
#[test]
fn a_stopped_leader_holds_up_no_other_shard_of_the_cluster_client() {
    let cluster = Cluster::start_with(3, &[("FELIX_IDLE_TIMEOUT_MS", "600000")]);
    cluster.settled(&[1, 2, 3]);
    cluster.create(1, "spread", 3).expect("created");
    wait_for(&cluster, &[1, 2, 3], "shards led as placed", |statuses| {
        placed_and_in_sync(statuses, 3)
    });
    let status = cluster.status(1).expect("member 1's status");
    let shard_led_by = |member: u64| {
        status
            .shards
            .iter()
            .find(|shard| shard.placed_leader == member)
            .map(|shard| shard.shard)
            .expect("each member leads a shard")
    };
    let key_for = |shard: u32| {
        (0..)
            .map(|i| format!("key-{i}"))
            .find(|key| felix_wire::shard_for_key(key.as_bytes(), 3) == shard)
            .expect("a key for every shard")
    };
    // The client's seed is member 1; member 2 is stopped, member 3 is reached fresh.
    let (stopped, live) = (2u64, 3u64);
    let (held_shard, live_shard) = (shard_led_by(stopped), shard_led_by(live));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = cluster_client_config(&cluster, 1, dir.path());
    // The handshake with the stopped member does not time out within the test.
    config.connect_timeout = Duration::from_secs(600);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let client = runtime.block_on(async {
        let client = Arc::new(
            support::within(felix_client::ClusterClient::connect(config))
                .await
                .expect("the cluster client connects"),
        );
        cluster.brokers[&stopped].signal("STOP");
        let held = tokio::spawn({
            let client = Arc::clone(&client);
            let record = felix_client::record(key_for(held_shard), b"held".to_vec());
            async move { client.publish("spread", &[record]).await }
        });
        // Its handshake has reached the stopped member: the Initial waits in its socket.
        let port = cluster.brokers[&stopped].quic_addr.port();
        let deadline = Instant::now() + DEADLINE;
        while udp_queued(port) == 0 {
            assert!(
                Instant::now() < deadline,
                "the held publish never reached member {stopped}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let record = felix_client::record(key_for(live_shard), b"live".to_vec());
        let acks = tokio::time::timeout(DEADLINE, client.publish("spread", &[record]))
            .await
            .expect("a publish to a live leader's shard waited for the stopped member's handshake")
            .expect("acknowledged");
        assert_eq!(acks.len(), 1);
        assert_eq!(acks[0].shard, live_shard);
        assert!(
            !held.is_finished(),
            "the held publish ended while its leader was stopped"
        );
        cluster.brokers[&stopped].signal("CONT");
        let acks = tokio::time::timeout(DEADLINE * 2, held)
            .await
            .expect("the held publish ended once its member resumed")
            .expect("the held publish's task")
            .expect("the held publish acknowledged");
        assert_eq!(acks[0].shard, held_shard);
        client
    });
    // 2. The client now has a connection to every member. Once the shard is led by the
    // stopped member again, stop it and publish to its shard.
    wait_for(
        &cluster,
        &[1, 2, 3],
        "shards led as placed again",
        |statuses| placed_and_in_sync(statuses, 3),
    );
    cluster.brokers[&stopped].signal("STOP");
    // Many parts wait at once: they share the cluster map's refreshes (one per part and
    // second would be `WAITING` per second).
    const WAITING: usize = 64;
    runtime.block_on(async {
        let asked_before = client.map_requests();
        let mut pending = Vec::new();
        for i in 0..WAITING {
            let record = felix_client::record(key_for(held_shard), format!("moved-{i}"));
            pending.push(
                client
                    .publish_pipelined("spread", &[record])
                    .await
                    .expect("queued"),
            );
        }
        let settling: Vec<_> = pending
            .into_iter()
            .map(|pending| {
                let client = Arc::clone(&client);
                tokio::spawn(async move { client.settle(pending).await })
            })
            .collect();
        let mut offsets = std::collections::BTreeSet::new();
        for settled in settling {
            let acks = tokio::time::timeout(DEADLINE * 2, settled)
                .await
                .expect("a part sent to a stopped leader waited for its connection's idle timeout")
                .expect("a settling task")
                .expect("acknowledged by the shard's new leader");
            assert_eq!(acks.len(), 1);
            assert_eq!(acks[0].shard, held_shard);
            offsets.insert(acks[0].first_offset);
        }
        assert_eq!(offsets.len(), WAITING, "two parts acked at one offset");
        let asked = client.map_requests() - asked_before;
        assert!(
            asked < WAITING as u64,
            "{WAITING} waiting parts asked for the cluster map {asked} times: they did not share"
        );
    });
    let moved = cluster.status(1).expect("member 1's status").shards[held_shard as usize]
        .leader
        .expect("a leader");
    assert_ne!(
        moved, stopped,
        "acknowledged while its placed leader was stopped"
    );
    cluster.brokers[&stopped].signal("CONT");
}

/// The names of the entries of directory `dir` (none when it does not exist).
fn entry_names(dir: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .map(|dir| dir.flatten().map(|entry| entry.file_name()).collect())
        .unwrap_or_default()
}

/// Bytes queued unread in the IPv4 UDP sockets bound to `port` (`/proc/net/udp`).
fn udp_queued(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/udp").expect("/proc/net/udp");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (_, local_port) = fields.get(1)?.split_once(':')?;
            if u16::from_str_radix(local_port, 16).ok()? != port {
                return None;
            }
            let (_, queued) = fields.get(4)?.split_once(':')?;
            u64::from_str_radix(queued, 16).ok()
        })
        .sum()
}

fn cluster_client_config(cluster: &Cluster, via: u64, dir: &Path) -> felix_client::ClientConfig {
    let mut config = cluster.brokers[&via].client_config();
    config.ca = Some(write_bundle(cluster, dir));
    // Longer than any test: a part caught by a leader's kill must be sent again because the
    // cluster map shows the shard's new leader, not because its connection timed out.
    config.idle_timeout = Duration::from_secs(600);
    config
}

/// Batch `batch` of publisher `publisher`: 1-4 records with unique keys and payloads.
fn batch_of(publisher: &str, batch: u64) -> (Vec<String>, Vec<Vec<u8>>, Vec<felix_wire::Record>) {
    let count = 1 + batch % 4;
    let keys: Vec<String> = (0..count)
        .map(|r| format!("k{publisher}-{batch}-{r}"))
        .collect();
    let payloads: Vec<Vec<u8>> = (0..count)
        .map(|r| format!("{publisher}-b{batch}-r{r}").into_bytes())
        .collect();
    let records = keys
        .iter()
        .zip(&payloads)
        .map(|(key, payload)| felix_client::record(key.clone(), payload.clone()))
        .collect();
    (keys, payloads, records)
}

/// Every member's development certificate in one PEM file under `dir`.
fn write_bundle(cluster: &Cluster, dir: &Path) -> std::path::PathBuf {
    let bundle: String = cluster
        .brokers
        .values()
        .map(|broker| std::fs::read_to_string(broker.ca_path()).expect("a member's certificate"))
        .collect();
    let path = dir.join("members.pem");
    std::fs::write(&path, bundle).expect("write the bundle");
    path
}

/// Publishes PUBLISH_BATCHES batches of 1-4 keyed records through a cluster client, eight in
/// flight (so the leader's kill catches several parts, some of them committed but not yet
/// acknowledged), across the leader's kill: the client sends a part caught by it again
/// itself, as the same producer and sequence, and it must be stored once. A publish that
/// still fails is counted and not published again (its records may still commit). Returns
/// the acknowledged batches, the refused count, and how many parts went to a leader other
/// than the seed (member 1).
async fn cluster_publish_batches(
    config: felix_client::ClientConfig,
) -> (Vec<AckedBatch>, usize, usize) {
    const IN_FLIGHT: usize = 8;
    let client = support::within(felix_client::ClusterClient::connect(config))
        .await
        .expect("the cluster client connects");
    let mut acked = Vec::new();
    let mut refused = 0;
    let mut straight = 0;
    let deadline = Instant::now() + DEADLINE * 4;
    let mut in_flight = std::collections::VecDeque::new();
    let mut batches = 0..PUBLISH_BATCHES;
    loop {
        while in_flight.len() < IN_FLIGHT
            && let Some(batch) = batches.next()
        {
            let (keys, payloads, records) = batch_of("c", batch);
            let leaders: std::collections::BTreeSet<u16> = keys
                .iter()
                .filter_map(|key| {
                    client.leader("payments", felix_wire::shard_for_key(key.as_bytes(), 3))
                })
                .collect();
            straight += leaders.iter().filter(|leader| **leader != 1).count();
            let sent = support::within(client.publish_pipelined("payments", &records))
                .await
                .expect("a cluster publish is queued");
            in_flight.push_back((batch, keys, payloads, sent));
        }
        let Some((batch, keys, payloads, sent)) = in_flight.pop_front() else {
            break;
        };
        assert!(Instant::now() < deadline, "the cluster publisher stalled");
        // Bounded: the client's retries (module docs of `felix_client::cluster`) end well
        // within this.
        match tokio::time::timeout(DEADLINE * 3, client.settle(sent)).await {
            Ok(Ok(acks)) => acked.push(AckedBatch {
                payloads,
                acks,
                keys,
            }),
            Ok(Err(error)) => {
                eprintln!("cluster publisher: batch {batch}: {error}");
                refused += 1;
            }
            Err(_) => panic!(
                "a cluster publish was not answered within {:?}",
                DEADLINE * 3
            ),
        }
    }
    (acked, refused, straight)
}

/// The end of each shard, once the publishers are done and every copy is complete.
type Ends = Arc<Mutex<Option<Vec<u64>>>>;

/// What a subscriber received: per shard, `(offset, payload)` in arrival order.
type Received = Vec<Vec<(u64, Vec<u8>)>>;

/// A subscriber to every shard of "payments" from the start, through the member whose client
/// configuration `slot` holds, on its own thread: it stops once it holds every record below
/// `ends` (set when the publishers are done), or when its member is killed (its slot empties).
fn subscriber(
    member: u64,
    slot: Arc<Mutex<Option<felix_client::ClientConfig>>>,
    ends: Ends,
) -> std::thread::JoinHandle<Received> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            use futures::StreamExt as _;
            let config = slot.lock().unwrap().clone().expect("the member runs");
            let client = support::within(felix_client::Client::connect(config))
                .await
                .expect("connects");
            let mut subscription = support::within(client.subscribe(
                "payments",
                felix_wire::ShardSelection::All,
                felix_wire::StartPosition::Earliest,
            ))
            .await
            .expect("subscribed");
            let mut received: Received = Vec::new();
            let deadline = Instant::now() + DEADLINE * 4;
            loop {
                let done = ends.lock().unwrap().as_ref().is_some_and(|ends| {
                    ends.iter()
                        .enumerate()
                        .all(|(shard, end)| received.get(shard).map_or(0, Vec::len) as u64 >= *end)
                });
                if done || slot.lock().unwrap().is_none() {
                    return received;
                }
                assert!(
                    Instant::now() < deadline,
                    "subscriber on member {member} stalled"
                );
                match tokio::time::timeout(Duration::from_millis(100), subscription.next()).await {
                    Ok(Some(Ok(record))) => {
                        let shard = record.shard as usize;
                        if received.len() <= shard {
                            received.resize_with(shard + 1, Vec::new);
                        }
                        received[shard].push((record.offset, record.payload.to_vec()));
                    }
                    Ok(Some(Err(error))) => panic!("subscriber on member {member}: {error}"),
                    Ok(None) => panic!("subscriber on member {member}: the subscription ended"),
                    Err(_) => {}
                }
            }
        })
    })
}

/// Publishes PUBLISH_BATCHES batches of 1-4 keyed records through the member whose client
/// configuration `slot` holds (none while it is down: the publisher waits for it). Returns
/// the acknowledged batches and the number refused (never published again: a refused
/// publish may still commit, so a retry could store it twice).
async fn publish_batches(
    member: u64,
    slot: Arc<Mutex<Option<felix_client::ClientConfig>>>,
) -> (Vec<AckedBatch>, usize) {
    let mut acked = Vec::new();
    let mut refused = 0;
    let mut client: Option<felix_client::Client> = None;
    let deadline = Instant::now() + DEADLINE * 4;
    let mut batch = 0;
    while batch < PUBLISH_BATCHES {
        assert!(Instant::now() < deadline, "publisher {member} stalled");
        let Some(connected) = client.as_ref() else {
            let config = slot.lock().unwrap().clone();
            match config {
                Some(config) => match felix_client::Client::connect(config).await {
                    Ok(connected) => client = Some(connected),
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                },
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
            continue;
        };
        let (keys, payloads, records) = batch_of(&format!("m{member}"), batch);
        batch += 1;
        // The member is about to be killed when its slot empties: a publish in flight then
        // ends here (no answer comes from a SIGKILLed broker; QUIC's idle timeout would
        // take 30 s to tell).
        let member_gone = async {
            while slot.lock().unwrap().is_some() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let published = tokio::select! {
            published = tokio::time::timeout(DEADLINE, connected.publish("payments", &records)) => published,
            () = member_gone => Ok(Err(felix_client::ClientError::Closed("member killed".into()))),
        };
        match published {
            Ok(Ok(acks)) => acked.push(AckedBatch {
                payloads,
                acks,
                keys,
            }),
            Ok(Err(felix_client::ClientError::Server { code, message, .. })) => {
                eprintln!("publisher {member}: refused: {message} ({})", code.name());
                refused += 1;
            }
            // The connection is gone (its member was killed): connect again.
            Ok(Err(_)) | Err(_) => {
                refused += 1;
                client = None;
            }
        }
    }
    (acked, refused)
}

/// Publishes `batches` batches of `per` records to `stream` through member `via`, each
/// acknowledged before the next (a refused one is published again: the copies may then hold
/// it twice, which the callers allow); returns every payload published.
fn publish_acked(
    cluster: &Cluster,
    via: u64,
    stream: &str,
    tag: &str,
    batches: usize,
    per: usize,
) -> Vec<Vec<u8>> {
    let config = cluster.brokers[&via].naive_client_config();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = felix_client::Client::connect(config)
            .await
            .expect("the member takes client connections");
        let mut payloads = Vec::new();
        for batch in 0..batches {
            let records: Vec<felix_wire::Record> = (0..per)
                .map(|i| {
                    felix_client::record(
                        format!("{tag}-{batch}-{i}"),
                        format!("{tag} batch {batch} record {i}"),
                    )
                })
                .collect();
            let deadline = Instant::now() + DEADLINE;
            loop {
                match tokio::time::timeout(DEADLINE, client.publish(stream, &records)).await {
                    Ok(Ok(_)) => break,
                    other => {
                        assert!(Instant::now() < deadline, "{tag} batch {batch}: {other:?}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            payloads.extend(records.iter().map(|r| r.payload.to_vec()));
        }
        client.close().await;
        payloads
    })
}

#[test]
fn records_outlive_raft_compaction_and_a_member_behind_it_fetches_what_it_missed() {
    // Each shard group compacts its Raft log after 16 entries: its records must stay in the
    // members' record logs, and a member that was down while the others compacted must catch
    // up from a snapshot and fetch the records it missed from a peer.
    let mut cluster = Cluster::start_with(
        3,
        &[
            ("FELIX_CLUSTER_RAFT_COMPACT_ENTRIES", "16"),
            ("FELIX_DURABLE_FSYNC_INTERVAL_MS", "20"),
        ],
    );
    cluster.settled(&[1, 2, 3]);
    let shards = 2;
    cluster.create(1, "ledger", shards).expect("created");
    wait_for(&cluster, &[1, 2, 3], "shards led as placed", |statuses| {
        placed_and_in_sync(statuses, shards as usize)
    });
    let mut published = publish_acked(&cluster, 1, "ledger", "first", 60, 3);
    let compacted = |statuses: &[ClusterStatus], past: u64| {
        statuses.iter().all(|s| {
            s.shards.len() == shards as usize
                && s.shards
                    .iter()
                    .all(|sh| sh.snapshot_index > past && sh.pending == 0)
        })
    };
    wait_for(&cluster, &[1, 2, 3], "every copy compacted", |statuses| {
        compacted(statuses, 16)
    });
    let reference = read_copy(&cluster, 1, "ledger", shards);
    for id in [2, 3] {
        assert!(
            read_copy(&cluster, id, "ledger", shards) == reference,
            "member {id}'s copy differs from member 1's"
        );
    }
    // Member 3 goes down; the others go on and compact past everything it has.
    cluster.brokers.get_mut(&3).expect("member 3").kill();
    wait_for(
        &cluster,
        &[1],
        "no shard led by the killed member",
        |statuses| {
            statuses[0]
                .shards
                .iter()
                .all(|sh| sh.leader.is_some_and(|leader| leader != 3))
        },
    );
    let before = cluster.status(1).expect("status").shards;
    published.extend(publish_acked(&cluster, 1, "ledger", "second", 60, 3));
    wait_for(
        &cluster,
        &[1, 2],
        "compacted past member 3's copy",
        |statuses| {
            statuses.iter().all(|s| {
                s.shards.iter().all(|sh| {
                    let then = before.iter().find(|b| b.shard == sh.shard).expect("shard");
                    sh.snapshot_index > then.commit + 1
                })
            })
        },
    );
    cluster.brokers.get_mut(&3).expect("member 3").restart();
    wait_for(&cluster, &[1, 2, 3], "member 3 caught up", |statuses| {
        let ends = |s: &ClusterStatus| {
            let mut ends: Vec<(u32, u64, u64, Option<u64>)> = s
                .shards
                .iter()
                .map(|sh| {
                    (
                        sh.shard,
                        sh.next_offset,
                        sh.recorded_offset,
                        sh.fetching_from,
                    )
                })
                .collect();
            ends.sort_unstable();
            ends
        };
        let first = ends(&statuses[0]);
        first.len() == shards as usize
            && first
                .iter()
                .all(|(_, next, recorded, fetching)| next == recorded && fetching.is_none())
            && statuses.iter().all(|s| ends(s) == first)
    });
    assert!(
        cluster.brokers[&3]
            .stderr_text()
            .contains("fetching them from a peer"),
        "member 3 installed a snapshot and fetched the records it missed:\n{}",
        cluster.stderr()
    );
    let reference = read_copy(&cluster, 1, "ledger", shards);
    for id in [2, 3] {
        assert!(
            read_copy(&cluster, id, "ledger", shards) == reference,
            "member {id}'s copy differs from member 1's"
        );
    }
    // Every record published is there, from offset 0 on (read_copy checks the offsets).
    let held: std::collections::HashSet<&Vec<u8>> = reference
        .iter()
        .flatten()
        .map(|(_, payload)| payload)
        .collect();
    for payload in &published {
        assert!(
            held.contains(payload),
            "a published record is missing: {payload:?}"
        );
    }
    for status in (1..=3).filter_map(|id| cluster.status(id)) {
        for shard in status.shards {
            assert_eq!(shard.oldest_offset, 0, "nothing deleted: {shard:?}");
        }
    }
}

#[test]
fn a_member_down_while_its_stream_is_deleted_releases_its_copy_when_it_returns() {
    // Member 3 holds a copy of every shard of `doomed` (records in its record logs, entries in
    // its shared Raft log), is SIGKILLed, and the stream is deleted while it is down. When it
    // returns, it must give every byte of that copy back, and go on serving other streams.
    // (It replays the creation from its own control-plane log, restarts the groups, and
    // releases them when it learns of the deletion, from the log or a snapshot. The orphan
    // sweep is for a member that also lost the creation's commit index, written lazily:
    // `groups.rs`'s tests.)
    let mut cluster = Cluster::start(3);
    cluster.settled(&[1, 2, 3]);
    let shards = 3;
    cluster.create(1, "doomed", shards).expect("created");
    wait_for(&cluster, &[1, 2, 3], "shards led as placed", |statuses| {
        placed_and_in_sync(statuses, shards as usize)
    });
    publish_acked(&cluster, 1, "doomed", "doomed", 12, 4);
    wait_for_complete_copies(&cluster, shards);
    let records_dir = cluster.brokers[&3]
        .data_dir
        .path()
        .join("cluster")
        .join("records");
    assert_eq!(
        entry_names(&records_dir).len(),
        shards as usize,
        "member 3 keeps a record log per shard"
    );
    let held =
        |status: &ClusterStatus| -> usize { status.raft_logs.iter().map(|log| log.groups).sum() };
    let before = cluster.status(3).expect("member 3's status");
    assert_eq!(
        held(&before),
        shards as usize,
        "member 3's shared Raft log holds every group"
    );
    assert!(
        before
            .shards
            .iter()
            .all(|shard| shard.raft_log_entry_bytes > 0),
        "every group keeps its entries (no compaction yet): {:?}",
        before.shards
    );

    cluster.brokers.get_mut(&3).expect("member 3").kill();
    felix_ok(
        cluster.brokers[&1]
            .cli()
            .args(["cluster", "delete-stream", "doomed"]),
    );
    wait_for(
        &cluster,
        &[1, 2],
        "the stream gone on the members up",
        |statuses| {
            statuses
                .iter()
                .all(|s| s.shards.is_empty() && !s.state.streams.contains_key("doomed"))
        },
    );
    // Still on member 3's disk while it is down.
    assert_eq!(entry_names(&records_dir).len(), shards as usize);

    cluster.brokers.get_mut(&3).expect("member 3").restart();
    wait_for(&cluster, &[3], "member 3 gave its copy back", |statuses| {
        let status = &statuses[0];
        !status.state.streams.contains_key("doomed")
            && status.state.members.len() == 3
            && status.shards.is_empty()
            && held(status) == 0
            && entry_names(&records_dir).is_empty()
    });
    // And it takes part as before: a new stream is placed on it and written everywhere.
    cluster.create(2, "after", shards).expect("created");
    wait_for(
        &cluster,
        &[1, 2, 3],
        "the new stream led as placed",
        |statuses| placed_and_in_sync(statuses, shards as usize),
    );
    publish_acked(&cluster, 3, "after", "after", 6, 2);
    wait_for_complete_copies(&cluster, shards);
    let reference = read_copy(&cluster, 1, "after", shards);
    assert_eq!(reference.iter().map(Vec::len).sum::<usize>(), 12);
    assert!(
        read_copy(&cluster, 3, "after", shards) == reference,
        "member 3's copy of the new stream differs from member 1's"
    );
}

/// Waits until every member reaches the same end of each of the `shards` shards, with nothing
/// pending anywhere (a refused batch may still commit: the ends are taken after).
fn wait_for_complete_copies(cluster: &Cluster, shards: u32) {
    wait_for(cluster, &[1, 2, 3], "every copy complete", |statuses| {
        let ends = |s: &ClusterStatus| {
            let mut ends: Vec<(u32, u64, usize)> = s
                .shards
                .iter()
                .map(|sh| (sh.shard, sh.next_offset, sh.pending))
                .collect();
            ends.sort_unstable();
            ends
        };
        let first = ends(&statuses[0]);
        first.len() == shards as usize
            && first.iter().all(|(_, _, pending)| *pending == 0)
            && statuses.iter().all(|s| ends(s) == first)
    });
}

/// What one idempotent publisher of the failover run got acknowledged: `(shard, offset,
/// payload)` per batch of one record.
type FailoverAcks = Vec<(u32, u64, String)>;

/// One idempotent publisher of the failover run: producer `producer` publishes one-record
/// batches to the shards in turn, numbering each shard's batches itself, through whichever
/// member it can reach. A batch whose outcome is unknown (its member killed, `unavailable`,
/// a timeout) is sent again with the same producer and sequence, through the next member,
/// until acknowledged: so every batch ends up acknowledged, and must be stored exactly once.
/// Stops taking new batches once `stop` is set.
async fn failover_publisher(
    producer: u64,
    shards: u32,
    configs: Vec<Arc<Mutex<Option<felix_client::ClientConfig>>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> FailoverAcks {
    let key_of = |shard: u32| {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|key| felix_wire::shard_for_key(key.as_bytes(), shards) == shard)
            .expect("a key of the shard")
    };
    let mut acked = Vec::new();
    let mut client: Option<felix_client::Client> = None;
    let mut through = producer as usize;
    let mut sequences = vec![0u64; shards as usize];
    let mut batch = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let shard = u32::try_from(batch % u64::from(shards)).expect("small");
        batch += 1;
        sequences[shard as usize] += 1;
        let sequence = sequences[shard as usize];
        let payload = format!("p{producer}-s{shard}-{sequence}");
        let records = [felix_client::record(key_of(shard), payload.clone())];
        let deadline = Instant::now() + DEADLINE * 4;
        loop {
            assert!(
                Instant::now() < deadline,
                "producer {producer}: batch {sequence} of shard {shard} never acknowledged"
            );
            if client.is_none() {
                through += 1;
                let config = configs[through % configs.len()].lock().unwrap().clone();
                if let Some(config) = config {
                    client =
                        tokio::time::timeout(ADMIN_TIMEOUT, felix_client::Client::connect(config))
                            .await
                            .ok()
                            .and_then(Result::ok);
                }
                if client.is_none() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
            let sent = client.as_ref().expect("connected").publish_sequenced(
                "ledger",
                shard,
                (producer, sequence),
                &records,
            );
            match tokio::time::timeout(ADMIN_TIMEOUT, sent).await {
                Ok(Ok(acks)) => {
                    assert_eq!(acks.len(), 1);
                    assert_eq!((acks[0].shard, acks[0].count), (shard, 1));
                    acked.push((shard, acks[0].first_offset, payload));
                    break;
                }
                // Unknown outcome: the same batch again, through the next member.
                Ok(Err(_)) | Err(_) => {
                    client = None;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    acked
}

/// The failover run with idempotent producers: three members, a durable stream of three
/// shards (on_commit), three publishers numbering their own batches and sending each again
/// through another member until acknowledged, while the leader of one shard after another is
/// SIGKILLed and restarted (FELIX_FAILOVER_KILLS times: 2 in `make test`, 10 in `make
/// cluster-test`). Then every copy is the same, dense, and holds every batch exactly once,
/// where its ack said: 0 acknowledged records lost, 0 divergent, 0 duplicates.
#[test]
fn failover_with_idempotent_producers_stores_every_batch_once() {
    let kills: usize = std::env::var("FELIX_FAILOVER_KILLS")
        .ok()
        .and_then(|kills| kills.parse().ok())
        .unwrap_or(2);
    let shards = 3;
    let mut cluster = Cluster::start(3);
    cluster.settled(&[1, 2, 3]);
    cluster.create(1, "ledger", shards).expect("created");
    wait_for(&cluster, &[1, 2, 3], "shards led as placed", |statuses| {
        placed_and_in_sync(statuses, shards as usize)
    });
    let configs: BTreeMap<u64, Arc<Mutex<Option<felix_client::ClientConfig>>>> = cluster
        .brokers
        .iter()
        .map(|(id, broker)| {
            (
                *id,
                Arc::new(Mutex::new(Some(broker.naive_client_config()))),
            )
        })
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publishers: Vec<_> = (1..=3u64)
        .map(|producer| {
            let configs: Vec<_> = configs.values().cloned().collect();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(failover_publisher(producer, shards, configs, stop))
            })
        })
        .collect();
    for kill in 0..kills {
        let shard = kill % shards as usize;
        let before = cluster
            .status(1)
            .map_or(0, |s| s.shards.iter().map(|sh| sh.next_offset).sum::<u64>());
        wait_for(&cluster, &[1, 2, 3], "batches under way", |statuses| {
            statuses[0]
                .shards
                .iter()
                .map(|sh| sh.next_offset)
                .sum::<u64>()
                >= before + 20
                && placed_and_in_sync(statuses, shards as usize)
        });
        let victim = cluster.status(1).expect("status").shards[shard]
            .leader
            .expect("a leader");
        *configs[&victim].lock().unwrap() = None;
        cluster.brokers.get_mut(&victim).expect("victim").kill();
        let survivors: Vec<u64> = (1..=3).filter(|id| *id != victim).collect();
        wait_for(&cluster, &survivors, "the shard fails over", |statuses| {
            statuses.iter().all(|s| {
                s.shards
                    .iter()
                    .find(|sh| sh.shard as usize == shard)
                    .and_then(|sh| sh.leader)
                    .is_some_and(|leader| leader != victim)
            })
        });
        cluster.brokers.get_mut(&victim).expect("victim").restart();
        *configs[&victim].lock().unwrap() = Some(cluster.brokers[&victim].naive_client_config());
        eprintln!(
            "kill {}: member {victim}, leader of shard {shard}",
            kill + 1
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked: FailoverAcks = publishers
        .into_iter()
        .flat_map(|publisher| publisher.join().expect("publisher"))
        .collect();
    wait_for_complete_copies(&cluster, shards);
    let copies: Vec<_> = (1..=3)
        .map(|id| read_copy(&cluster, id, "ledger", shards))
        .collect();
    for (i, copy) in copies.iter().enumerate() {
        assert!(
            copy == &copies[0],
            "member {} holds other records than member 1",
            i + 1
        );
    }
    let mut seen = std::collections::HashSet::new();
    let mut stored = 0;
    for records in &copies[0] {
        for (_, payload) in records {
            stored += 1;
            assert!(
                seen.insert(payload.clone()),
                "{} stored twice",
                String::from_utf8_lossy(payload)
            );
        }
    }
    for (shard, offset, payload) in &acked {
        assert_eq!(
            copies[0][*shard as usize]
                .get(*offset as usize)
                .map(|r| &r.1),
            Some(&payload.as_bytes().to_vec()),
            "acknowledged {payload} not at {shard}:{offset}"
        );
    }
    assert_eq!(
        stored,
        acked.len(),
        "every stored batch was acknowledged, once"
    );
    eprintln!(
        "failover: {kills} kills, {} batches acknowledged and stored once on every member",
        acked.len()
    );
}
