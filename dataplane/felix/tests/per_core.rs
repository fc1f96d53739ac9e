//! Thread-per-core behaviour of the real `felix` binary on loopback: pinning, cross-core
//! routing (naive vs core-aware clients), ingress overload answers, and the per-core settings.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use felix_client::{
    Client, ClientError, ErrorCode, Record, ShardSelection, StartPosition, StreamKind, record,
};
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

/// A broker whose core 1 can be paused (test-only knob TEST_FELIX_PAUSE_CORE_EXECUTOR: while
/// the file exists core 1 leaves its inbound queue alone), with a one-job ingress queue.
struct Paused {
    broker: BrokerProcess,
    pause: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn paused_broker(extra: &[(&'static str, &'static str)]) -> Paused {
    let dir = tempfile::tempdir().expect("temp dir");
    let pause = dir.path().join("pause");
    let pause_text: &'static str = Box::leak(pause.display().to_string().into_boxed_str());
    let mut env = vec![
        ("FELIX_DATAPLANE_CORES", "2"),
        ("FELIX_INGRESS_QUEUE_DEPTH", "1"),
        ("TEST_FELIX_PAUSE_CORE_EXECUTOR", pause_text),
    ];
    env.extend_from_slice(extra);
    Paused {
        broker: BrokerProcess::start(&env),
        pause,
        _dir: dir,
    }
}

/// A naive client on core 0's own port, and a key owned by core 1 (shard 1 of 2).
async fn core_zero_client(paused: &Paused) -> (Client, Record) {
    let mut config = paused.broker.naive_client_config();
    config.addr = paused.broker.core_addrs[0];
    let client = within(Client::connect(config)).await.expect("connects");
    within(client.create_stream("held", 2, StreamKind::InMemory))
        .await
        .expect("created");
    let key = (0..)
        .map(|index| format!("k{index}"))
        .find(|key| felix_wire::shard_for_key(key.as_bytes(), 2) == 1)
        .expect("some key lands on shard 1");
    // Pause core 1 only now: catalogue changes need it too.
    std::fs::write(&paused.pause, b"").expect("pause file");
    (client, record(key, "x".repeat(100)))
}

fn metric(broker: &BrokerProcess, name: &str) -> u64 {
    support::metric_value(&broker.metrics(), name).unwrap_or(0)
}

#[tokio::test]
async fn full_ingress_sheds_fire_and_forget_and_refuses_acked() {
    // Proves shed = sent - accepted for fire-and-forget and the exact refusal text for acked.
    let paused = paused_broker(&[]);
    let (client, held) = core_zero_client(&paused).await;
    // Holds the only slot: its record waits in core 1's (paused) queue.
    let first = within(client.publish_pipelined("held", std::slice::from_ref(&held)))
        .await
        .expect("queued");
    let sent = 5u64;
    for _ in 0..sent {
        within(client.publish_no_ack("held", std::slice::from_ref(&held)))
            .await
            .expect("queued");
    }
    let refused = within(client.publish("held", std::slice::from_ref(&held))).await;
    match refused {
        Err(ClientError::Server { code, message, .. }) => {
            assert_eq!(code, ErrorCode::IngressBudgetExhausted);
            assert_eq!(message, "publish ingress byte budget exhausted");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    std::fs::remove_file(&paused.pause).expect("unpause");
    within(first).await.expect("the held publish completes");
    let shed = metric(&paused.broker, "felix_publishes_shed_total");
    let accepted = support::labelled_value(
        &paused.broker.metrics(),
        "felix_publishes_total{ack=\"fire_and_forget\"}",
    )
    .unwrap_or(0.0) as u64;
    assert_eq!(sent, accepted + shed, "{}", paused.broker.metrics());
    assert_eq!(shed, sent, "the queue was full for every one");
    assert_eq!(metric(&paused.broker, "felix_publishes_refused_total"), 1);
    client.close().await;
}

#[tokio::test]
async fn ingress_wait_sheds_nothing_and_other_streams_keep_serving() {
    // Proves FELIX_PUB_INGRESS_WAIT=1 makes fire-and-forget wait (sent = accepted), and a
    // connection with a waiting publish still answers on its other streams.
    let paused = paused_broker(&[("FELIX_PUB_INGRESS_WAIT", "1")]);
    let (client, held) = core_zero_client(&paused).await;
    let sent = 4u64;
    for _ in 0..sent {
        within(client.publish_no_ack("held", std::slice::from_ref(&held)))
            .await
            .expect("queued");
    }
    // The publish stream is parked behind the full queue; the admin stream still answers.
    let deadline = Instant::now() + support::DEADLINE;
    while support::sum_over_cores(&paused.broker.metrics(), "felix_core_ingress_waits_total") == 0.0
    {
        assert!(Instant::now() < deadline, "a publish never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let streams = within(client.list_streams())
        .await
        .expect("other stream served");
    assert_eq!(streams.len(), 1);
    std::fs::remove_file(&paused.pause).expect("unpause");
    let deadline = Instant::now() + support::DEADLINE;
    loop {
        let body = paused.broker.metrics();
        let accepted =
            support::labelled_value(&body, "felix_publishes_total{ack=\"fire_and_forget\"}")
                .unwrap_or(0.0) as u64;
        if accepted == sent {
            assert_eq!(
                support::metric_value(&body, "felix_publishes_shed_total"),
                Some(0)
            );
            break;
        }
        assert!(Instant::now() < deadline, "not all accepted: {body}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    client.close().await;
}

#[tokio::test]
async fn ack_on_commit_waits_then_is_refused() {
    // Proves an ack-on-commit publish waits FELIX_PUBLISH_QUEUE_WAIT_MS for room before the
    // refusal (a lower bound on the wait, not a speed assertion).
    let paused = paused_broker(&[
        ("FELIX_ACK_ON_COMMIT", "1"),
        ("FELIX_PUBLISH_QUEUE_WAIT_MS", "300"),
    ]);
    let (client, held) = core_zero_client(&paused).await;
    let first = within(client.publish_pipelined("held", std::slice::from_ref(&held)))
        .await
        .expect("queued");
    let started = Instant::now();
    let refused = within(client.publish("held", std::slice::from_ref(&held))).await;
    let waited = started.elapsed();
    match refused {
        Err(ClientError::Server { code, message, .. }) => {
            assert_eq!(code, ErrorCode::IngressBudgetExhausted);
            assert_eq!(message, "publish ingress byte budget exhausted");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(300),
        "refused after {waited:?}"
    );
    std::fs::remove_file(&paused.pause).expect("unpause");
    within(first).await.expect("the held publish completes");
    client.close().await;
}

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
