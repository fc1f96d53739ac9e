//! A small bounded load generator (the full bench tool lives in `bench/`): N publishers for T
//! seconds, acked, core-aware or naive, then the broker-side rates from its `/metrics`.
//!
//! ```text
//! cargo run --release -p felix-client --example load -- \
//!     ADDR CA METRICS_ADDR [publishers=8] [seconds=10] [payload=4096] [batch=64] \
//!     [inflight=8] [naive=0] [shards=8]
//! ```
//!
//! Prints one line: payload MB/s, records/s, cross-core hops, broker CPU seconds per GB and
//! per million records, all from the broker's counters (before/after difference).

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use felix_client::{Client, ClientConfig, StreamKind, record};

/// Generous bound on one metrics scrape.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).expect("metrics endpoint");
    stream
        .set_read_timeout(Some(SCRAPE_TIMEOUT))
        .expect("timeout");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: felix\r\n\r\n")
        .expect("request");
    let mut body = String::new();
    stream.read_to_string(&mut body).expect("response");
    body
}

/// Sum of every sample of `name` (labelled or not).
fn total(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn arg<T: std::str::FromStr>(args: &[String], index: usize, default: T) -> T {
    args.get(index)
        .and_then(|text| text.parse().ok())
        .unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    assert!(
        args.len() >= 3,
        "usage: load ADDR CA METRICS_ADDR [publishers] [seconds] [payload] [batch] [inflight] [naive] [shards]"
    );
    let addr: SocketAddr = args[0].parse().expect("ADDR");
    let ca = std::path::PathBuf::from(&args[1]);
    let metrics: SocketAddr = args[2].parse().expect("METRICS_ADDR");
    let publishers: usize = arg(&args, 3, 8);
    let seconds: u64 = arg(&args, 4, 10);
    let payload: usize = arg(&args, 5, 4096);
    let batch: usize = arg(&args, 6, 64);
    let inflight: usize = arg(&args, 7, 8);
    let naive: u8 = arg(&args, 8, 0);
    let shards: u32 = arg(&args, 9, 8);
    let mut config = ClientConfig::new(addr);
    config.ca = Some(ca);
    config.core_aware = naive == 0;
    config.publish_inflight_bytes = (payload * batch * inflight * 2).max(4 << 20) as u64;
    let stream = format!("load-{}", std::process::id());
    let admin = Client::connect(config.clone()).await.expect("connect");
    admin
        .create_stream(&stream, shards, StreamKind::InMemory)
        .await
        .expect("create");
    let before = scrape(metrics);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for publisher in 0..publishers {
        let config = config.clone();
        let stream = stream.clone();
        tasks.push(tokio::spawn(async move {
            let client = Client::connect(config).await.expect("connect");
            let body = bytes::Bytes::from(vec![b'x'; payload]);
            let records: Vec<_> = (0..batch)
                .map(|index| record(format!("p{publisher}-{index}"), body.clone()))
                .collect();
            let mut pending = std::collections::VecDeque::new();
            while Instant::now() < deadline {
                pending.push_back(
                    client
                        .publish_pipelined(&stream, &records)
                        .await
                        .expect("queued"),
                );
                if pending.len() >= inflight
                    && let Some(ack) = pending.pop_front()
                {
                    ack.await.expect("acked");
                }
            }
            for ack in pending {
                ack.await.expect("acked");
            }
            client.close().await;
        }));
    }
    for task in tasks {
        task.await.expect("publisher");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = scrape(metrics);
    let delta = |name: &str| total(&after, name) - total(&before, name);
    let bytes = delta("felix_payload_bytes_total");
    let records = delta("felix_records_total");
    let hops = delta("felix_core_cross_core_hops_total");
    let cpu = delta("felix_core_cpu_seconds");
    println!(
        "mode={} publishers={publishers} payload={payload} batch={batch} inflight={inflight} seconds={elapsed:.1} \
         MB/s={:.1} records/s={:.0} hops={hops:.0} cpu_s={cpu:.2} cpu_s_per_GB={:.2} cpu_s_per_Mrec={:.2}",
        if naive == 0 { "core-aware" } else { "naive" },
        bytes / elapsed / 1e6,
        records / elapsed,
        cpu / (bytes / 1e9).max(1e-9),
        cpu / (records / 1e6).max(1e-9),
    );
    admin.delete_stream(&stream).await.expect("delete");
    admin.close().await;
}
