//! `felix-bench cluster`: replicated publishing measured side by side in one run
//! (docs/performance.md, "Cluster"). Seven arms, each the same acked load for the same time:
//!
//! - `single`: one broker, a durable stream of its own (on_commit: acked after its fdatasync);
//! - `single-periodic`: the same with FELIX_DURABLE_FSYNC_MODE=periodic (acked after the
//!   write);
//! - `cluster-leader`: three brokers on this machine, a durable cluster stream (3 replicas,
//!   Quorum, `--fsync on_commit`), the publisher connected to the shard's leader;
//! - `cluster-leader-periodic`: the same through a stream created `--fsync periodic` (a
//!   majority including the leader has it written);
//! - `cluster-follower`: the same cluster, the publisher connected to a follower, whose
//!   publishes reach the leader as Raft proposal forwards (the forwarding path);
//! - `spread-forwarding`: a stream of three shards whose leaders are spread over the three
//!   members, a plain client connected to member 1: each batch's records of the shards led
//!   elsewhere are forwarded;
//! - `spread-cluster-client`: the same stream through the cluster client
//!   (`felix_client::ClusterClient`), each shard's records straight to its leader.
//!
//! In the single and cluster-leader/follower arms one shard, so the leader is one member and
//! the arms differ only in the path. Each arm reports
//! acked records per second, MB/s, the ack latency (p50, p99), and the servers' CPU time (all
//! three brokers of a cluster arm: replication costs CPU on every member) per GB and per
//! million records. With `--server-cpus` / `--generator-cpus` the brokers and this process are
//! pinned apart (src/pin.rs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_client::{Client, ClientConfig, ClusterClient};
use felix_wire::{FsyncMode, Record, StreamKind};

use crate::BenchError;
use crate::broker::SpawnedBroker;
use crate::sampler::process_cpu_seconds;

/// What to run.
#[derive(Debug, Clone)]
pub struct ClusterBench {
    pub felix: PathBuf,
    /// Data directories, certificates and broker logs go here (data wiped per arm and removed
    /// once measured; the logs stay).
    pub work: PathBuf,
    /// Measured seconds per arm (after a one-second warm-up).
    pub seconds: u64,
    /// Publishes in flight (one task each, one shared connection).
    pub publishers: usize,
    /// Records per publish.
    pub batch: usize,
    /// Payload bytes per record.
    pub size: usize,
    pub server_cpus: Option<Vec<usize>>,
}

/// One arm's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ArmResult {
    pub arm: String,
    pub records: u64,
    pub seconds: f64,
    pub records_per_second: f64,
    pub mb_per_second: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub refused: u64,
    /// CPU seconds of every broker of the arm over the measured window.
    pub server_cpu_seconds: f64,
    pub cpu_seconds_per_gb: f64,
    pub cpu_seconds_per_million_records: f64,
}

const STREAM: &str = "bench";
/// The periodic cluster arm's stream (one shard, `--fsync periodic`).
const PERIODIC: &str = "bench-periodic";
/// The spread arms' stream: one shard led by each member.
const SPREAD: &str = "spread";
const DEADLINE: Duration = Duration::from_secs(60);

/// Runs the seven arms and returns their figures, in order.
pub fn run(bench: &ClusterBench) -> Result<Vec<ArmResult>, BenchError> {
    std::fs::create_dir_all(&bench.work).map_err(|e| BenchError::io(&bench.work, e))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| BenchError::io(&bench.work, e))?;
    let mut results = Vec::new();

    // Single broker, a durable stream of its own, acked after its fdatasync as the replicated
    // shards of an on_commit stream are; then acked after the write, as a periodic one's.
    for (arm, mode) in [("single", "on_commit"), ("single-periodic", "periodic")] {
        let env = BTreeMap::from([("FELIX_DURABLE_FSYNC_MODE".to_owned(), mode.to_owned())]);
        let single = SpawnedBroker::start(
            &bench.felix,
            &env,
            &bench.work.join(arm),
            &bench.work.join(format!("{arm}.log")),
            bench.server_cpus.as_deref(),
        )?;
        let config = client_config(single.endpoint().quic_addr, &single.endpoint().ca);
        let pid = single.endpoint().pid;
        results.push(runtime.block_on(async {
            let client = connect(config.clone()).await?;
            client
                .create_stream(STREAM, 1, StreamKind::Durable)
                .await
                .map_err(|e| BenchError::Broker(format!("create the stream: {e}")))?;
            client.close().await;
            let client = Publisher::Plain(Box::new(connect(config).await?));
            measure(bench, arm, STREAM, client, &[pid]).await
        })?);
        let _ = single.stop();
        // Its data (gigabytes after a long arm) is not needed once measured: the log stays.
        let _ = std::fs::remove_dir_all(bench.work.join(arm));
    }

    // Three brokers, a replicated stream.
    let certs = bench.work.join("certs");
    felix_cluster::pki::write_dev_cluster(&certs, &[1, 2, 3], &["127.0.0.1".to_owned()])
        .map_err(|e| BenchError::Broker(format!("cluster certificates: {e}")))?;
    let peers: Vec<String> = (1..=3)
        .map(|id| -> Result<String, BenchError> {
            let socket = std::net::UdpSocket::bind("127.0.0.1:0")
                .map_err(|e| BenchError::io(Path::new("127.0.0.1:0"), e))?;
            let port = socket
                .local_addr()
                .map_err(|e| BenchError::io(Path::new("127.0.0.1:0"), e))?
                .port();
            Ok(format!("{id}=127.0.0.1:{port}"))
        })
        .collect::<Result<_, _>>()?;
    let peers = peers.join(",");
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let path = |name: String| certs.join(name).display().to_string();
        let env = BTreeMap::from([
            // The replicated shards always fdatasync before they commit; the same for the
            // members' own logs.
            (
                "FELIX_DURABLE_FSYNC_MODE".to_owned(),
                "on_commit".to_owned(),
            ),
            ("FELIX_CLUSTER_NODE_ID".to_owned(), id.to_string()),
            ("FELIX_CLUSTER_PEERS".to_owned(), peers.clone()),
            ("FELIX_CLUSTER_CA".to_owned(), path("ca.pem".to_owned())),
            (
                "FELIX_CLUSTER_CERT".to_owned(),
                path(format!("node-{id}.pem")),
            ),
            (
                "FELIX_CLUSTER_KEY".to_owned(),
                path(format!("node-{id}.key")),
            ),
        ]);
        let broker = SpawnedBroker::start(
            &bench.felix,
            &env,
            &bench.work.join(format!("member-{id}")),
            &bench.work.join(format!("member-{id}.log")),
            bench.server_cpus.as_deref(),
        )?;
        members.insert(id, broker);
    }
    let admin = client_config(members[&1].endpoint().quic_addr, &members[&1].endpoint().ca);
    let deadline = Instant::now() + DEADLINE;
    for (name, shards, fsync) in [
        (STREAM, 1, FsyncMode::OnCommit),
        (PERIODIC, 1, FsyncMode::Periodic),
        (SPREAD, 3, FsyncMode::OnCommit),
    ] {
        // Asked again until the control plane has a leader and every member registered.
        while let Err(error) = runtime.block_on(async {
            connect(admin.clone())
                .await?
                .create_cluster_stream(name, shards, StreamKind::Durable, 3, fsync)
                .await
                .map_err(|e| BenchError::Broker(e.to_string()))
        }) {
            if Instant::now() > deadline {
                return Err(BenchError::Broker(format!(
                    "create the cluster stream {name}: {error}"
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    // Every member holds the shards and agrees on their placed leaders.
    let leader_of = |statuses: &[felix_cluster::service::ClusterStatus], stream: &str| {
        let leaders: Vec<Option<u64>> = statuses
            .iter()
            .map(|s| {
                s.shards
                    .iter()
                    .find(|shard| shard.stream == stream)
                    .and_then(|shard| shard.leader)
            })
            .collect();
        match leaders.first() {
            Some(Some(leader)) if leaders.iter().all(|l| *l == Some(*leader)) => Some(*leader),
            _ => None,
        }
    };
    let (leader, periodic_leader) = loop {
        let statuses: Vec<_> = members
            .values()
            .filter_map(|m| felix_cluster::admin::status(m.endpoint().metrics_addr, DEADLINE).ok())
            .collect();
        // Every shard of the three streams led by its placed leader, as every member sees it.
        let placed = statuses.iter().all(|s| {
            s.shards.len() == 5
                && s.shards
                    .iter()
                    .all(|shard| shard.leader == Some(shard.placed_leader))
        });
        if statuses.len() == 3
            && placed
            && let (Some(leader), Some(periodic)) =
                (leader_of(&statuses, STREAM), leader_of(&statuses, PERIODIC))
        {
            break (leader, periodic);
        }
        if Instant::now() > deadline {
            return Err(BenchError::Broker(
                "the cluster streams' shards have no agreed placed leaders".to_owned(),
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let follower = (1..=3).find(|id| *id != leader).expect("three members");
    let pids: Vec<Option<u32>> = members.values().map(|m| m.endpoint().pid).collect();
    for (arm, id, stream) in [
        ("cluster-leader", leader, STREAM),
        ("cluster-leader-periodic", periodic_leader, PERIODIC),
        ("cluster-follower", follower, STREAM),
    ] {
        let endpoint = members[&id].endpoint();
        let config = client_config(endpoint.quic_addr, &endpoint.ca);
        results.push(runtime.block_on(async {
            let client = Publisher::Plain(Box::new(connect(config).await?));
            measure(bench, arm, stream, client, &pids).await
        })?);
    }
    // The spread stream: through member 1 (forwarding), then through the cluster client.
    let endpoint = members[&1].endpoint();
    let config = client_config(endpoint.quic_addr, &endpoint.ca);
    results.push(runtime.block_on(async {
        let client = Publisher::Plain(Box::new(connect(config).await?));
        measure(bench, "spread-forwarding", SPREAD, client, &pids).await
    })?);
    // The cluster client trusts every member's development certificate.
    let bundle = bench.work.join("members.pem");
    let mut pems = String::new();
    for member in members.values() {
        let ca = &member.endpoint().ca;
        pems.push_str(&std::fs::read_to_string(ca).map_err(|e| BenchError::io(ca, e))?);
    }
    std::fs::write(&bundle, pems).map_err(|e| BenchError::io(&bundle, e))?;
    let mut config = client_config(endpoint.quic_addr, &bundle);
    config.core_aware = true;
    results.push(runtime.block_on(async {
        let client = tokio::time::timeout(DEADLINE, ClusterClient::connect(config))
            .await
            .map_err(|_| BenchError::Broker("connect: timed out".to_owned()))?
            .map_err(|e| BenchError::Broker(format!("connect the cluster client: {e}")))?;
        measure(
            bench,
            "spread-cluster-client",
            SPREAD,
            Publisher::Cluster(Box::new(client)),
            &pids,
        )
        .await
    })?);
    for (id, member) in members {
        let _ = member.stop();
        let _ = std::fs::remove_dir_all(bench.work.join(format!("member-{id}")));
    }
    Ok(results)
}

fn client_config(addr: std::net::SocketAddr, ca: &Path) -> ClientConfig {
    let mut config = ClientConfig::new(addr);
    config.ca = Some(ca.to_path_buf());
    config.client_name = "felix-bench-cluster".to_owned();
    // One connection to the member the arm names, whatever the shard map says.
    config.core_aware = false;
    // Plain publishes, as the recorded figures (docs/performance.md).
    config.idempotent = false;
    config
}

async fn connect(config: ClientConfig) -> Result<Client, BenchError> {
    tokio::time::timeout(DEADLINE, Client::connect(config))
        .await
        .map_err(|_| BenchError::Broker("connect: timed out".to_owned()))?
        .map_err(|e| BenchError::Broker(format!("connect: {e}")))
}

fn cpu_seconds(pids: &[Option<u32>]) -> f64 {
    pids.iter()
        .flatten()
        .filter_map(|pid| process_cpu_seconds(*pid))
        .sum()
}

/// What an arm publishes through.
enum Publisher {
    Plain(Box<Client>),
    Cluster(Box<ClusterClient>),
}

impl Publisher {
    async fn publish(&self, stream: &str, records: &[Record]) -> Result<(), String> {
        match self {
            Publisher::Plain(client) => client.publish(stream, records).await.map(drop),
            Publisher::Cluster(client) => client.publish(stream, records).await.map(drop),
        }
        .map_err(|error| error.to_string())
    }

    async fn close(self) {
        match self {
            Publisher::Plain(client) => client.close().await,
            Publisher::Cluster(_) => {}
        }
    }
}

/// Acked publishes to `stream` from `bench.publishers` tasks for one second of warm-up and
/// `bench.seconds` measured.
async fn measure(
    bench: &ClusterBench,
    arm: &str,
    stream: &'static str,
    client: Publisher,
    pids: &[Option<u32>],
) -> Result<ArmResult, BenchError> {
    let client = Arc::new(client);
    let records: Vec<Record> = (0..bench.batch)
        .map(|i| felix_client::record(format!("k{i}"), Bytes::from(vec![b'x'; bench.size])))
        .collect();
    let records = Arc::new(records);
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..bench.publishers {
        let (client, records) = (Arc::clone(&client), Arc::clone(&records));
        let (measuring, stop) = (Arc::clone(&measuring), Arc::clone(&stop));
        let (acked, refused) = (Arc::clone(&acked), Arc::clone(&refused));
        tasks.push(tokio::spawn(async move {
            let mut latencies =
                hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let outcome =
                    tokio::time::timeout(DEADLINE, client.publish(stream, &records)).await;
                if !measuring.load(Ordering::Relaxed) {
                    continue;
                }
                match outcome {
                    Ok(Ok(_)) => {
                        let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                        let _ = latencies.record(us.max(1));
                        acked.fetch_add(records.len() as u64, Ordering::Relaxed);
                    }
                    _ => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            latencies
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu_before = cpu_seconds(pids);
    let started = Instant::now();
    measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(bench.seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    let records_acked = acked.load(Ordering::Relaxed);
    let server_cpu_seconds = cpu_seconds(pids) - cpu_before;
    stop.store(true, Ordering::Relaxed);
    let mut latencies =
        hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
    for task in tasks {
        let task_latencies = task
            .await
            .map_err(|e| BenchError::Broker(format!("a publisher task failed: {e}")))?;
        latencies
            .add(task_latencies)
            .map_err(|e| BenchError::Broker(format!("latencies: {e}")))?;
    }
    if let Ok(client) = Arc::try_unwrap(client) {
        client.close().await;
    }
    let bytes = records_acked as f64 * bench.size as f64;
    let gb = bytes / 1e9;
    let million = records_acked as f64 / 1e6;
    Ok(ArmResult {
        arm: arm.to_owned(),
        records: records_acked,
        seconds,
        records_per_second: records_acked as f64 / seconds,
        mb_per_second: bytes / 1e6 / seconds,
        p50_us: latencies.value_at_quantile(0.50),
        p99_us: latencies.value_at_quantile(0.99),
        refused: refused.load(Ordering::Relaxed),
        server_cpu_seconds,
        cpu_seconds_per_gb: if gb > 0.0 {
            server_cpu_seconds / gb
        } else {
            0.0
        },
        cpu_seconds_per_million_records: if million > 0.0 {
            server_cpu_seconds / million
        } else {
            0.0
        },
    })
}

/// The figures as a Markdown table, each arm's rate also as a ratio to the first arm's.
#[must_use]
pub fn table(results: &[ArmResult]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "| arm | records/s | MB/s | vs single | ack p50 | ack p99 | refused | server CPU-s | CPU-s per GB | CPU-s per M records |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let base = results.first().map_or(1.0, |r| r.records_per_second);
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.2} | {:.2}x | {} us | {} us | {} | {:.2} | {:.1} | {:.2} |",
            r.arm,
            r.records_per_second,
            r.mb_per_second,
            if base > 0.0 {
                r.records_per_second / base
            } else {
                0.0
            },
            r.p50_us,
            r.p99_us,
            r.refused,
            r.server_cpu_seconds,
            r.cpu_seconds_per_gb,
            r.cpu_seconds_per_million_records
        );
    }
    out
}

/// The comparisons the cluster is judged by (docs/cluster.md, "What it costs"), from one
/// run's arms: the leader's CPU per record against the single broker's, a three-shard stream's
/// (through the cluster client) against a one-shard stream's (through its leader), and the
/// leader's ack p50 over the single broker's (the lone ack, with `--publishers 1 --batch 1`).
/// An arm missing from `results` leaves its line out.
#[must_use]
pub fn comparisons(results: &[ArmResult]) -> String {
    use std::fmt::Write as _;
    let find = |name: &str| results.iter().find(|r| r.arm == name);
    let cpu = |r: &ArmResult| r.cpu_seconds_per_million_records;
    let mut out = String::new();
    if let (Some(leader), Some(single)) = (find("cluster-leader"), find("single")) {
        if cpu(single) > 0.0 {
            let _ = writeln!(
                out,
                "- CPU per record, cluster-leader / single: {:.2}x",
                cpu(leader) / cpu(single)
            );
        }
        let _ = writeln!(
            out,
            "- ack p50, cluster-leader - single: {:+} us",
            i128::from(leader.p50_us) - i128::from(single.p50_us)
        );
    }
    if let (Some(spread), Some(leader)) = (find("spread-cluster-client"), find("cluster-leader"))
        && cpu(leader) > 0.0
    {
        let _ = writeln!(
            out,
            "- CPU per record, three shards (spread-cluster-client) / one (cluster-leader): {:.2}x",
            cpu(spread) / cpu(leader)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(name: &str, rate: f64) -> ArmResult {
        ArmResult {
            arm: name.to_owned(),
            records: 0,
            seconds: 1.0,
            records_per_second: rate,
            mb_per_second: 0.0,
            p50_us: 1,
            p99_us: 2,
            refused: 0,
            server_cpu_seconds: 0.5,
            cpu_seconds_per_gb: 1.0,
            cpu_seconds_per_million_records: 2.0,
        }
    }

    #[test]
    fn the_comparisons_divide_the_right_arms() {
        let with = |name: &str, cpu: f64, p50: u64| ArmResult {
            cpu_seconds_per_million_records: cpu,
            p50_us: p50,
            ..arm(name, 1.0)
        };
        let text = comparisons(&[
            with("single", 1.0, 60),
            with("cluster-leader", 7.0, 150),
            with("spread-cluster-client", 14.0, 160),
        ]);
        assert_eq!(
            text,
            "- CPU per record, cluster-leader / single: 7.00x\n\
             - ack p50, cluster-leader - single: +90 us\n\
             - CPU per record, three shards (spread-cluster-client) / one (cluster-leader): 2.00x\n"
        );
        assert_eq!(comparisons(&[with("single", 1.0, 60)]), "");
    }

    #[test]
    fn the_table_gives_each_arm_as_a_ratio_to_the_single_broker() {
        let text = table(&[arm("single", 1000.0), arm("cluster-leader", 250.0)]);
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows.len(), 4);
        assert!(rows[2].starts_with("| single | 1000 |") && rows[2].contains("| 1.00x |"));
        assert!(rows[3].contains("| 0.25x |"), "{}", rows[3]);
    }
}
