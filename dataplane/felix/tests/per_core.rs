//! Thread-per-core behaviour of the real `felix` binary on loopback: pinning, cross-core
//! routing (naive vs core-aware clients), and the per-core settings.

mod support;

use std::collections::BTreeMap;

use felix_client::{Client, Record, ShardSelection, StartPosition, StreamKind, record};
use futures::StreamExt as _;
use support::{BrokerProcess, within};

/// Keys chosen so that a 4-shard stream gets records on every shard (and both cores).
fn records(count: usize, tag: &str) -> Vec<Record> {
    (0..count)
        .map(|index| record(format!("key-{index}"), format!("{tag}-{index}")))
        .collect()
}

fn two_cores(extra: &[(&'static str, &'static str)]) -> BrokerProcess {
    let mut env = vec![("FELIX_DATAPLANE_CORES", "2")];
    env.extend_from_slice(extra);
    BrokerProcess::start(&env)
}

fn hops(broker: &BrokerProcess) -> f64 {
    support::sum_over_cores(&broker.metrics(), "felix_core_cross_core_hops_total")
}

#[test]
fn each_core_thread_is_pinned_to_exactly_its_cpu() {
    // Proves every data-plane thread's allowed CPU list, read back after pinning, is its CPU.
    let broker = two_cores(&[]);
    let pinned: Vec<&String> = broker
        .startup_lines
        .iter()
        .filter(|line| line.contains(" pinned to cpu "))
        .collect();
    assert_eq!(pinned.len(), 2, "{:?}", broker.startup_lines);
    for line in pinned {
        let rest = line.split(" pinned to cpu ").nth(1).expect("has a cpu");
        let (cpu, allowed) = rest.split_once(" allowed ").expect("has an allowed list");
        assert_eq!(cpu, allowed, "{line}");
    }
    assert!(
        broker
            .startup_lines
            .iter()
            .any(|line| line.starts_with("core plan")),
        "the plan is printed at start-up: {:?}",
        broker.startup_lines
    );
}

/// Publishes 3 acked batches, checks dense offsets per shard and in-order delivery of all.
async fn publish_and_check(broker: &BrokerProcess, client: &Client, stream: &str) {
    within(client.create_stream(stream, 4, StreamKind::InMemory))
        .await
        .expect("stream created");
    let mut subscription =
        within(client.subscribe(stream, ShardSelection::All, StartPosition::Latest))
            .await
            .expect("subscribed");
    let mut next_offset: BTreeMap<u32, u64> = BTreeMap::new();
    let mut sent = 0usize;
    for round in 0..3 {
        let batch = records(16, &format!("r{round}"));
        sent += batch.len();
        let acks = within(client.publish(stream, &batch)).await.expect("acked");
        let shards: Vec<u32> = acks.iter().map(|ack| ack.shard).collect();
        let mut sorted = shards.clone();
        sorted.sort_unstable();
        assert_eq!(shards, sorted, "acks come in ascending shard order");
        for ack in acks {
            let expected = next_offset.entry(ack.shard).or_insert(0);
            assert_eq!(
                ack.first_offset, *expected,
                "dense offsets on shard {}",
                ack.shard
            );
            *expected += u64::from(ack.count);
        }
    }
    assert_eq!(
        next_offset.len(),
        4,
        "every shard (both cores) took records"
    );
    let mut seen: BTreeMap<u32, u64> = BTreeMap::new();
    for _ in 0..sent {
        let delivered = within(subscription.next())
            .await
            .expect("a record")
            .expect("no error");
        let expected = seen.entry(delivered.shard).or_insert(0);
        assert_eq!(
            delivered.offset, *expected,
            "per-shard order on shard {}",
            delivered.shard
        );
        *expected += 1;
    }
    assert_eq!(seen, next_offset, "every record delivered once");
    let _ = broker;
}

#[tokio::test]
async fn naive_client_works_through_cross_core_hops() {
    // Proves a client ignoring the shard map gets correct acks and deliveries on 2 cores, at
    // the cost of cross-core hops.
    let broker = two_cores(&[]);
    let client = within(Client::connect(broker.naive_client_config()))
        .await
        .expect("connects");
    publish_and_check(&broker, &client, "naive").await;
    assert!(hops(&broker) > 0.0, "{}", broker.metrics());
    client.close().await;
}

#[tokio::test]
async fn core_aware_client_causes_zero_cross_core_hops() {
    // Proves a core-aware client sends each shard's records to its owner: same results, and
    // not one message carrying publish work crosses cores.
    let broker = two_cores(&[]);
    let client = broker.client().await;
    publish_and_check(&broker, &client, "aware").await;
    assert_eq!(hops(&broker), 0.0, "{}", broker.metrics());
    assert_eq!(
        client.core_connections(),
        2,
        "one connection per owner core"
    );
    client.close().await;
}

// Ingress overload (shed, refuse, wait, ack-on-commit deadline) is tested on the state
// machine itself, on logical time: dataplane/core/tests/overload.rs and the simulation
// (`make sim`).

#[test]
fn socket_settings_are_applied_and_reported() {
    // Proves FELIX_QUIC_LISTENERS, the UDP buffer sizes and the MTU bound reach the sockets
    // (effective values read back and printed), with the MTU clamped to 16384.
    let broker = BrokerProcess::start(&[
        ("FELIX_DATAPLANE_CORES", "2"),
        ("FELIX_QUIC_LISTENERS", "1"),
        ("FELIX_UDP_RECV_BUFFER", "1MiB"),
        ("FELIX_UDP_SEND_BUFFER", "512KiB"),
        ("FELIX_MTU_UPPER_BOUND", "60000"),
    ]);
    let lines = &broker.startup_lines;
    let find = |needle: &str| lines.iter().filter(|line| line.contains(needle)).count();
    assert_eq!(find("felix: quic max mtu 16384"), 1, "{lines:?}");
    assert_eq!(
        find("shared listeners 1"),
        1,
        "one core has the listener: {lines:?}"
    );
    assert_eq!(find("shared listeners 0"), 1, "{lines:?}");
    // Linux reports twice the size it was asked for (SO_RCVBUFFORCE applies as root).
    for line in lines.iter().filter(|line| line.contains("udp buffers")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let recv: usize = words[6].parse().expect("recv size");
        let send: usize = words[8].parse().expect("send size");
        assert!(recv >= 1 << 20, "{line}");
        assert!(send >= 512 << 10, "{line}");
    }
    assert!(
        broker.stderr_text().contains("clamped to 16384"),
        "{}",
        broker.stderr_text()
    );
}

#[test]
fn bad_per_core_settings_stop_start_up_naming_the_variable() {
    // Proves each new broker setting refuses a bad value at start-up, naming the variable.
    for (env, value) in [
        ("FELIX_DATAPLANE_CORES", "0"),
        ("FELIX_DATAPLANE_CORES", "99"),
        ("FELIX_QUIC_LISTENERS", "0"),
        ("FELIX_QUIC_LISTENERS", "many"),
        ("FELIX_MTU_UPPER_BOUND", "1000"),
        ("FELIX_UDP_RECV_BUFFER", "1KiB"),
        ("FELIX_INGRESS_QUEUE_DEPTH", "0"),
        ("FELIX_PUB_INGRESS_WAIT", "maybe"),
        ("FELIX_BROKER_PUB_CONN_RECV_WINDOW", "12XiB"),
    ] {
        let output = support::felix()
            .arg("broker")
            .env("FELIX_BIND", "127.0.0.1:0")
            .env("FELIX_METRICS_BIND", "off")
            .env("FELIX_DATA_DIR", tempfile::tempdir().expect("dir").path())
            .env(env, value)
            .output()
            .expect("felix runs");
        assert!(!output.status.success(), "{env}={value} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(env), "{env}={value}: {stderr}");
    }
}
