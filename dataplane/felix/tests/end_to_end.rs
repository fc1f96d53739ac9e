//! End-to-end tests: the real `felix` binary as a broker (fresh data dir, ephemeral ports),
//! driven through felix-client, a raw s2n-quic connection, and `felix` subprocesses.

mod support;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::Stdio;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use felix_client::{
    ClientError, ErrorCode, Record, ShardSelection, StartPosition, StreamKind, Subscription, record,
};
use felix_wire::{Decoder, Frame, Limits};
use futures::StreamExt as _;
use support::{BrokerProcess, DEADLINE, within};

fn keyed(key: &str, payload: String) -> Record {
    record(Bytes::from(key.to_owned()), Bytes::from(payload))
}

/// Receives `count` records from a subscription within the deadline.
async fn receive(
    subscription: &mut Subscription,
    count: usize,
) -> Vec<felix_client::DeliveredRecord> {
    let mut records = Vec::with_capacity(count);
    while records.len() < count {
        let next = within(subscription.next()).await;
        match next {
            Some(Ok(record)) => records.push(record),
            Some(Err(error)) => panic!(
                "subscription failed after {} records: {error}",
                records.len()
            ),
            None => panic!("subscription ended after {} records", records.len()),
        }
    }
    records
}

// Proves acked publishes get dense per-shard offsets starting at 0, matching describe.
#[tokio::test]
async fn acked_publishes_get_dense_offsets_per_shard() {
    let broker = BrokerProcess::start(&[]);
    let client = broker.client().await;
    let shard_count = 4;
    within(client.create_stream("dense", shard_count, StreamKind::InMemory))
        .await
        .expect("stream created");
    let mut next: BTreeMap<u32, u64> = BTreeMap::new();
    for batch in 0..10 {
        let records: Vec<Record> = (0..8)
            .map(|index| {
                keyed(
                    &format!("key-{index}"),
                    format!("batch {batch} record {index}"),
                )
            })
            .collect();
        let mut expected: BTreeMap<u32, u32> = BTreeMap::new();
        for record in &records {
            *expected
                .entry(felix_wire::shard_for_key(&record.key, shard_count))
                .or_default() += 1;
        }
        let acks = within(client.publish("dense", &records))
            .await
            .expect("publish acked");
        let shards: Vec<u32> = acks.iter().map(|ack| ack.shard).collect();
        assert_eq!(shards, expected.keys().copied().collect::<Vec<_>>());
        for ack in acks {
            let next_offset = next.entry(ack.shard).or_default();
            assert_eq!(
                ack.first_offset, *next_offset,
                "dense offsets on shard {}",
                ack.shard
            );
            assert_eq!(ack.count, expected[&ack.shard]);
            *next_offset += u64::from(ack.count);
        }
    }
    let info = within(client.describe_stream("dense"))
        .await
        .expect("describe works");
    for shard in info.shards {
        assert_eq!(
            shard.next_offset,
            next.get(&shard.shard).copied().unwrap_or(0)
        );
        assert_eq!(shard.oldest_offset, 0);
    }
    client.close().await;
}

// Proves a subscriber registered before publishing gets every record, in per-shard order.
#[tokio::test]
async fn subscriber_before_publish_receives_everything_in_order() {
    let broker = BrokerProcess::start(&[]);
    let client = broker.client().await;
    within(client.create_stream("ordered", 3, StreamKind::InMemory))
        .await
        .expect("stream created");
    let mut subscription =
        within(client.subscribe("ordered", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("subscribed");
    assert_eq!(subscription.start(), &[(0, 0), (1, 0), (2, 0)]);
    let mut published: BTreeMap<u32, Vec<Bytes>> = BTreeMap::new();
    let mut pending = Vec::new();
    for batch in 0..20 {
        let records: Vec<Record> = (0..16)
            .map(|index| {
                keyed(
                    &format!("k{}", (batch * 7 + index) % 11),
                    format!("{batch}/{index}"),
                )
            })
            .collect();
        for record in &records {
            published
                .entry(felix_wire::shard_for_key(&record.key, 3))
                .or_default()
                .push(record.payload.clone());
        }
        pending.push(
            within(client.publish_pipelined("ordered", &records))
                .await
                .expect("publish queued"),
        );
    }
    for ack in pending {
        within(ack).await.expect("publish acked");
    }
    let received = receive(&mut subscription, 320).await;
    let mut by_shard: BTreeMap<u32, Vec<(u64, Bytes)>> = BTreeMap::new();
    for record in received {
        by_shard
            .entry(record.shard)
            .or_default()
            .push((record.offset, record.payload));
    }
    for (shard, records) in &by_shard {
        let offsets: Vec<u64> = records.iter().map(|(offset, _)| *offset).collect();
        let expected: Vec<u64> = (0..offsets.len() as u64).collect();
        assert_eq!(offsets, expected, "shard {shard} offsets dense and ordered");
        let payloads: Vec<Bytes> = records.iter().map(|(_, payload)| payload.clone()).collect();
        assert_eq!(
            &payloads, &published[shard],
            "shard {shard} payloads in publish order"
        );
    }
    assert_eq!(by_shard.len(), published.len());
    client.close().await;
}

// Proves payloads of every size around the client's vectored-write threshold (large payloads
// travel as chunks of their own, small ones are copied into the frame), mixed in one batch,
// acked and fire-and-forget, arrive byte for byte and in order.
#[tokio::test]
async fn mixed_payload_sizes_arrive_byte_for_byte() {
    let broker = BrokerProcess::start(&[]);
    let client = broker.client().await;
    within(client.create_stream("sizes", 2, StreamKind::InMemory))
        .await
        .expect("stream created");
    let mut subscription =
        within(client.subscribe("sizes", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("subscribed");
    let sizes = [0usize, 1, 100, 1024, 4096, 8191, 8192, 8193, 20_000, 70_000];
    let batch: Vec<Record> = sizes
        .iter()
        .enumerate()
        .map(|(index, &size)| {
            let payload: Vec<u8> = (0..size).map(|byte| (byte * 31 + index) as u8).collect();
            record(Bytes::from(format!("key-{index}")), Bytes::from(payload))
        })
        .collect();
    within(client.publish("sizes", &batch))
        .await
        .expect("publish acked");
    within(client.publish_no_ack("sizes", &batch))
        .await
        .expect("publish queued");
    let received = receive(&mut subscription, 2 * batch.len()).await;
    let mut expected: BTreeMap<u32, Vec<Bytes>> = BTreeMap::new();
    for record in batch.iter().chain(&batch) {
        expected
            .entry(felix_wire::shard_for_key(&record.key, 2))
            .or_default()
            .push(record.payload.clone());
    }
    let mut got: BTreeMap<u32, Vec<Bytes>> = BTreeMap::new();
    for record in received {
        got.entry(record.shard).or_default().push(record.payload);
    }
    assert_eq!(got, expected, "every payload, in per-shard publish order");
    client.close().await;
}

// Proves resuming from an offset still in the ring catches up, then receives live records.
#[tokio::test]
async fn resume_from_ring_catches_up_then_goes_live() {
    let broker = BrokerProcess::start(&[]);
    let client = broker.client().await;
    within(client.create_stream("resume", 1, StreamKind::InMemory))
        .await
        .expect("stream created");
    let first: Vec<Record> = (0..10)
        .map(|index| keyed("", format!("r{index}")))
        .collect();
    within(client.publish("resume", &first))
        .await
        .expect("acked");
    let mut subscription = within(client.subscribe(
        "resume",
        ShardSelection::All,
        StartPosition::Offsets(vec![(0, 4)]),
    ))
    .await
    .expect("subscribed");
    assert_eq!(subscription.start(), &[(0, 4)]);
    let caught_up = receive(&mut subscription, 6).await;
    let offsets: Vec<u64> = caught_up.iter().map(|record| record.offset).collect();
    assert_eq!(offsets, (4..10).collect::<Vec<u64>>());
    assert_eq!(caught_up[0].payload, Bytes::from("r4"));
    let live: Vec<Record> = (10..13)
        .map(|index| keyed("", format!("r{index}")))
        .collect();
    within(client.publish("resume", &live))
        .await
        .expect("acked");
    let live_received = receive(&mut subscription, 3).await;
    let offsets: Vec<u64> = live_received.iter().map(|record| record.offset).collect();
    assert_eq!(offsets, vec![10, 11, 12]);
    assert_eq!(live_received[2].payload, Bytes::from("r12"));
    client.close().await;
}

// Proves an offset older than the ring is refused with TooOld carrying the oldest offset held.
#[tokio::test]
async fn offset_older_than_ring_is_refused_too_old() {
    let broker = BrokerProcess::start(&[("FELIX_REPLAY_RING_MAX_RECORDS", "4")]);
    let client = broker.client().await;
    within(client.create_stream("small-ring", 1, StreamKind::InMemory))
        .await
        .expect("stream created");
    let records: Vec<Record> = (0..10)
        .map(|index| keyed("", format!("r{index}")))
        .collect();
    within(client.publish("small-ring", &records))
        .await
        .expect("acked");
    let refused = within(client.subscribe(
        "small-ring",
        ShardSelection::All,
        StartPosition::Offsets(vec![(0, 2)]),
    ))
    .await;
    match refused {
        Err(ClientError::Server { code, detail, .. }) => {
            assert_eq!(code, ErrorCode::TooOld);
            assert_eq!(detail, 6, "the ring holds offsets 6..=9");
        }
        other => panic!("expected TooOld, got {other:?}"),
    }
    // The oldest offset still held resumes fine.
    let mut subscription = within(client.subscribe(
        "small-ring",
        ShardSelection::All,
        StartPosition::Offsets(vec![(0, 6)]),
    ))
    .await
    .expect("subscribed at the oldest offset");
    let records = receive(&mut subscription, 4).await;
    assert_eq!(records[0].offset, 6);
    client.close().await;
}

// Proves fire-and-forget publishes are appended and delivered to a subscriber.
#[tokio::test]
async fn fire_and_forget_records_arrive() {
    let broker = BrokerProcess::start(&[]);
    let client = broker.client().await;
    within(client.create_stream("faf", 2, StreamKind::InMemory))
        .await
        .expect("stream created");
    let mut subscription =
        within(client.subscribe("faf", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("subscribed");
    for batch in 0..5 {
        let records: Vec<Record> = (0..4)
            .map(|index| keyed(&format!("k{index}"), format!("{batch}-{index}")))
            .collect();
        within(client.publish_no_ack("faf", &records))
            .await
            .expect("queued");
    }
    let received = receive(&mut subscription, 20).await;
    let mut payloads: Vec<String> = received
        .iter()
        .map(|record| String::from_utf8_lossy(&record.payload).into_owned())
        .collect();
    payloads.sort();
    let mut expected: Vec<String> = (0..5)
        .flat_map(|batch| (0..4).map(move |index| format!("{batch}-{index}")))
        .collect();
    expected.sort();
    assert_eq!(payloads, expected);
    client.close().await;
}

/// A raw QUIC connection (s2n-quic client, no felix-client) that completed the handshake.
struct RawConnection {
    _endpoint: s2n_quic::Client,
    connection: s2n_quic::connection::Connection,
    hello_stream: s2n_quic::stream::BidirectionalStream,
    decoder: Decoder,
}

async fn raw_connect(broker: &BrokerProcess) -> RawConnection {
    let ca = std::fs::read_to_string(broker.ca_path()).expect("dev cert readable");
    let tls = s2n_quic::provider::tls::default::Client::builder()
        .with_certificate(ca.as_str())
        .and_then(|builder| builder.with_application_protocols([felix_wire::ALPN]))
        .and_then(|builder| builder.build())
        .expect("tls client");
    let endpoint = s2n_quic::Client::builder()
        .with_tls(tls)
        .expect("tls provider")
        .with_io("127.0.0.1:0")
        .expect("io provider")
        .start()
        .expect("client endpoint");
    let connect = s2n_quic::client::Connect::new(broker.quic_addr).with_server_name("localhost");
    let mut connection = within(endpoint.connect(connect)).await.expect("connected");
    let mut hello_stream = within(connection.open_bidirectional_stream())
        .await
        .expect("stream opened");
    let decoder = Decoder::new(Limits::DEFAULT);
    write_frame(
        &mut hello_stream,
        &Frame::Hello(felix_wire::Hello {
            min_version: 1,
            max_version: 1,
            features: 0,
            client_name: "raw-test".to_owned(),
            token: None,
        }),
    )
    .await;
    let mut buffer = BytesMut::new();
    match read_frame(&decoder, &mut hello_stream, &mut buffer).await {
        Some(Frame::HelloOk(hello_ok)) => {
            assert_eq!(hello_ok.version, 1);
            let own_ports: Vec<u16> = broker.core_addrs.iter().map(|addr| addr.port()).collect();
            assert_eq!(hello_ok.core_ports, own_ports);
        }
        other => panic!("expected HelloOk, got {other:?}"),
    }
    RawConnection {
        _endpoint: endpoint,
        connection,
        hello_stream,
        decoder,
    }
}

async fn write_frame(stream: &mut s2n_quic::stream::BidirectionalStream, frame: &Frame) {
    let mut out = BytesMut::new();
    felix_wire::encode(frame, &mut out);
    within(stream.send(out.freeze())).await.expect("sent");
}

/// The next frame, or None when the stream is finished.
async fn read_frame(
    decoder: &Decoder,
    stream: &mut s2n_quic::stream::BidirectionalStream,
    buffer: &mut BytesMut,
) -> Option<Frame> {
    loop {
        if let Some(frame) = decoder.decode(buffer).expect("broker frames decode") {
            return Some(frame);
        }
        match within(stream.receive()).await.expect("stream readable") {
            Some(chunk) => buffer.extend_from_slice(&chunk),
            None => {
                assert!(buffer.is_empty(), "stream ended inside a frame");
                return None;
            }
        }
    }
}

/// Sends `bytes` on a new stream; returns the code of the broker's Error and checks the
/// broker then finished the stream.
async fn send_bad_bytes(raw: &mut RawConnection, bytes: &'static [u8]) -> ErrorCode {
    let mut stream = within(raw.connection.open_bidirectional_stream())
        .await
        .expect("stream opened");
    within(stream.send(Bytes::from_static(bytes)))
        .await
        .expect("sent");
    let mut buffer = BytesMut::new();
    let code = match read_frame(&raw.decoder, &mut stream, &mut buffer).await {
        Some(Frame::Error(error)) => {
            assert_eq!(error.request_id, 0);
            error.code
        }
        other => panic!("expected an Error frame, got {other:?}"),
    };
    assert_eq!(
        read_frame(&raw.decoder, &mut stream, &mut buffer).await,
        None,
        "the broker finishes the stream after the error"
    );
    code
}

// Proves undecodable frames get an Error with the right code on their stream only, and the
// broker keeps serving that connection and others.
#[tokio::test]
async fn undecodable_frames_get_error_and_broker_keeps_serving() {
    let broker = BrokerProcess::start(&[]);
    let mut raw = raw_connect(&broker).await;
    // A Publish header announcing a 3-byte body of garbage.
    let garbage: &'static [u8] = &[3, 0, 0, 0, 0x20, 0, 0xde, 0xad, 0xbe];
    assert_eq!(
        send_bad_bytes(&mut raw, garbage).await,
        ErrorCode::Malformed
    );
    // A header announcing a body of u32::MAX bytes (far over the 16 MiB limit), no body sent.
    let oversized: &'static [u8] = &[0xff, 0xff, 0xff, 0xff, 0x20, 0];
    assert_eq!(
        send_bad_bytes(&mut raw, oversized).await,
        ErrorCode::FrameTooLarge
    );
    // A frame type protocol v1 does not define.
    let unknown: &'static [u8] = &[1, 0, 0, 0, 0xee, 0, 0];
    assert_eq!(
        send_bad_bytes(&mut raw, unknown).await,
        ErrorCode::UnknownFrameType
    );

    // The same connection still serves requests on its hello stream.
    write_frame(&mut raw.hello_stream, &Frame::ListStreams { request_id: 9 }).await;
    let mut buffer = BytesMut::new();
    match read_frame(&raw.decoder, &mut raw.hello_stream, &mut buffer).await {
        Some(Frame::StreamList { request_id, .. }) => assert_eq!(request_id, 9),
        other => panic!("expected StreamList, got {other:?}"),
    }

    // Another connection publishes and gets its ack.
    let client = broker.client().await;
    within(client.create_stream("after-garbage", 1, StreamKind::InMemory))
        .await
        .expect("stream created");
    let acks = within(client.publish("after-garbage", &[keyed("k", "v".to_owned())]))
        .await
        .expect("publish acked");
    assert_eq!(acks.len(), 1);
    assert_eq!(acks[0].first_offset, 0);
    let metrics = broker.metrics();
    assert!(
        metrics.contains("felix_errors_total{code=\"malformed\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("felix_errors_total{code=\"frame_too_large\"} 1"),
        "{metrics}"
    );
    client.close().await;
}

// Proves the metrics endpoint counts accepted payload bytes, records and acks.
#[tokio::test]
async fn metrics_count_payload_and_records() {
    let broker = BrokerProcess::start(&[]);
    // Plain publishes: one request (one ack) per publish call; an idempotent producer sends
    // one request per shard a batch touches.
    let mut config = broker.naive_client_config();
    config.idempotent = false;
    let client = within(felix_client::Client::connect(config))
        .await
        .expect("client connects");
    within(client.create_stream("metered", 2, StreamKind::InMemory))
        .await
        .expect("stream created");
    let records: Vec<Record> = (0..5)
        .map(|index| keyed(&format!("k{index}"), "x".repeat(100)))
        .collect();
    within(client.publish("metered", &records))
        .await
        .expect("acked");
    within(client.publish("metered", &records[..2]))
        .await
        .expect("acked");
    let body = broker.metrics();
    assert_eq!(
        support::metric_value(&body, "felix_payload_bytes_total"),
        Some(700),
        "{body}"
    );
    assert_eq!(
        support::metric_value(&body, "felix_records_total"),
        Some(7),
        "{body}"
    );
    assert_eq!(
        support::metric_value(&body, "felix_acks_total"),
        Some(2),
        "{body}"
    );
    assert!(
        body.contains("felix_publishes_total{ack=\"acked\"} 2"),
        "{body}"
    );
    assert_eq!(
        support::metric_value(&body, "felix_connections"),
        Some(1),
        "{body}"
    );
    // Wire bytes are the UDP bytes received: every payload byte plus QUIC, TLS and framing.
    let wire = support::metric_value(&body, "felix_wire_bytes_total").expect("wire bytes");
    assert!(
        wire > 700,
        "wire bytes {wire} must exceed the payload: {body}"
    );
    assert!(
        body.contains("felix_udp_rcvbuf_errors "),
        "UDP drops exported: {body}"
    );
    client.close().await;
}

// Proves `felix config` reports an environment override with its value and source.
#[test]
fn felix_config_reports_environment_override() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = support::felix()
        .arg("config")
        .env("FELIX_DATA_DIR", dir.path())
        .env("FELIX_REPLAY_RING_MAX_RECORDS", "77")
        .output()
        .expect("felix config runs");
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .find(|line| line.starts_with("FELIX_REPLAY_RING_MAX_RECORDS "))
        .unwrap_or_else(|| panic!("no ring line in\n{text}"));
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        fields,
        ["FELIX_REPLAY_RING_MAX_RECORDS", "77", "environment"]
    );
}

// Proves a bad FELIX_* value stops `felix broker` with a non-zero exit naming the variable.
#[test]
fn bad_setting_stops_broker_naming_the_variable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = support::felix()
        .arg("broker")
        .env("FELIX_DATA_DIR", dir.path())
        .env("FELIX_BIND", "127.0.0.1:0")
        .env("FELIX_METRICS_BIND", "127.0.0.1:0")
        .env("FELIX_REPLAY_RING_MAX_BYTES", "lots")
        .output()
        .expect("felix broker runs");
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("FELIX_REPLAY_RING_MAX_BYTES"), "{stderr}");
    assert!(output.stdout.is_empty(), "nothing announced: {output:?}");
}

// Proves the CLI path end to end: `stream create`, `sub --count`, `pub` as subprocesses.
#[test]
fn cli_create_subscribe_publish() {
    let broker = BrokerProcess::start(&[]);
    let created = broker
        .cli()
        .args(["stream", "create", "orders", "--shards", "4"])
        .output()
        .expect("stream create runs");
    assert!(created.status.success(), "{created:?}");
    assert!(String::from_utf8_lossy(&created.stdout).contains("created stream orders: 4 shards"));

    let mut sub = broker
        .cli()
        .args(["sub", "orders", "--count", "3", "--meta"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sub starts");
    let sub_stdout = support::lines(sub.stdout.take().expect("piped"));
    let sub_stderr = support::lines(sub.stderr.take().expect("piped"));
    let mut sub = support::ChildGuard(sub);
    // Wait until the subscription is registered (it starts at latest).
    let deadline = Instant::now() + DEADLINE;
    loop {
        let line = support::next_line(&sub_stderr, deadline)
            .unwrap_or_else(|| panic!("sub never subscribed; broker:\n{}", broker.stderr_text()));
        if line.starts_with("felix: subscribed to orders") {
            break;
        }
    }

    let mut publisher = broker
        .cli()
        .args(["pub", "orders", "--key", "customer-1", "--batch", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("pub starts");
    {
        let mut stdin = publisher.stdin.take().expect("piped");
        stdin
            .write_all(b"first\nsecond\nthird\n")
            .expect("stdin written");
    }
    let published = publisher.wait_with_output().expect("pub finishes");
    assert!(published.status.success(), "{published:?}");
    let shard = felix_wire::shard_for_key(b"customer-1", 4);
    let acked = String::from_utf8_lossy(&published.stdout);
    let acked_records: u64 = acked
        .lines()
        .map(|line| {
            assert!(line.contains(&format!("shard {shard} offset")), "{line}");
            let count = line
                .strip_prefix("acked ")
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|count| count.parse::<u64>().ok());
            count.unwrap_or_else(|| panic!("unexpected pub line {line:?}"))
        })
        .sum();
    assert_eq!(acked_records, 3, "{acked}");

    let mut printed = Vec::new();
    for _ in 0..3 {
        printed.push(support::next_line(&sub_stdout, deadline).expect("sub prints a record"));
    }
    assert_eq!(
        printed,
        [
            format!("{shard}:0 customer-1 first"),
            format!("{shard}:1 customer-1 second"),
            format!("{shard}:2 customer-1 third"),
        ]
    );
    // Its stdout closes when it exits; only then is waiting for it bounded.
    assert_eq!(support::next_line(&sub_stdout, deadline), None);
    assert!(Instant::now() < deadline, "sub did not exit after --count");
    let status = sub.0.wait().expect("sub exits after --count");
    assert!(status.success());
}

// Proves a Hello without a common version gets Error UnsupportedVersion and the connection is
// closed with that code as the QUIC application close code.
#[tokio::test]
async fn unsupported_version_is_refused_and_closes_the_connection() {
    let broker = BrokerProcess::start(&[]);
    let ca = std::fs::read_to_string(broker.ca_path()).expect("dev cert readable");
    let tls = s2n_quic::provider::tls::default::Client::builder()
        .with_certificate(ca.as_str())
        .and_then(|builder| builder.with_application_protocols([felix_wire::ALPN]))
        .and_then(|builder| builder.build())
        .expect("tls client");
    let endpoint = s2n_quic::Client::builder()
        .with_tls(tls)
        .expect("tls provider")
        .with_io("127.0.0.1:0")
        .expect("io provider")
        .start()
        .expect("client endpoint");
    let connect = s2n_quic::client::Connect::new(broker.quic_addr).with_server_name("localhost");
    let mut connection = within(endpoint.connect(connect)).await.expect("connected");
    let mut stream = within(connection.open_bidirectional_stream())
        .await
        .expect("stream opened");
    write_frame(
        &mut stream,
        &Frame::Hello(felix_wire::Hello {
            min_version: 7,
            max_version: 9,
            features: 0,
            client_name: "future-client".to_owned(),
            token: None,
        }),
    )
    .await;
    let decoder = Decoder::new(Limits::DEFAULT);
    let mut buffer = BytesMut::new();
    match read_frame(&decoder, &mut stream, &mut buffer).await {
        Some(Frame::Error(error)) => assert_eq!(error.code, ErrorCode::UnsupportedVersion),
        other => panic!("expected Error, got {other:?}"),
    }
    // The connection is closed by the broker with application code 2.
    let closed = within(connection.accept_bidirectional_stream()).await;
    match closed {
        Err(s2n_quic::connection::Error::Application { error, .. }) => {
            assert_eq!(*error, ErrorCode::UnsupportedVersion as u64);
        }
        other => panic!("expected an application close, got {other:?}"),
    }
}

// Proves deleting a stream ends its subscriptions with StreamNotFound.
#[tokio::test]
async fn deleting_a_stream_ends_its_subscriptions() {
    let broker = BrokerProcess::start(&[]);
    let client = broker.client().await;
    within(client.create_stream("doomed", 2, StreamKind::InMemory))
        .await
        .expect("stream created");
    let mut subscription =
        within(client.subscribe("doomed", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("subscribed");
    within(client.delete_stream("doomed"))
        .await
        .expect("deleted");
    match within(subscription.next()).await {
        Some(Err(error)) => assert_eq!(error.code(), Some(ErrorCode::StreamNotFound), "{error}"),
        other => panic!("expected StreamNotFound, got {other:?}"),
    }
    assert!(
        within(subscription.next()).await.is_none(),
        "the subscription is over"
    );
    let missing = within(client.describe_stream("doomed")).await;
    assert_eq!(
        missing.err().and_then(|error| error.code()),
        Some(ErrorCode::StreamNotFound)
    );
    client.close().await;
}

// Proves a batch larger than the whole in-flight budget still goes through (it takes the
// whole budget), and `insecure` connects without a CA.
#[tokio::test]
async fn batch_larger_than_budget_and_insecure_client() {
    let broker = BrokerProcess::start(&[]);
    let mut config = broker.client_config();
    config.ca = None;
    config.insecure = true;
    config.publish_inflight_bytes = 4096;
    let client = within(felix_client::Client::connect(config))
        .await
        .expect("insecure client connects");
    within(client.create_stream("big", 1, StreamKind::InMemory))
        .await
        .expect("stream created");
    let big: Vec<Record> = (0..4).map(|_| keyed("k", "y".repeat(10_000))).collect();
    for round in 0..3u64 {
        let acks = within(client.publish("big", &big)).await.expect("acked");
        assert_eq!(acks[0].first_offset, round * 4);
    }
    client.close().await;
}

// Proves SIGTERM closes connections with ShuttingDown and the broker exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_connections_and_exits_zero() {
    let mut broker = BrokerProcess::start(&[]);
    let client = broker.client().await;
    within(client.create_stream("s", 1, StreamKind::InMemory))
        .await
        .expect("stream created");
    let mut subscription =
        within(client.subscribe("s", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("subscribed");
    let status = tokio::task::block_in_place(|| broker.terminate());
    assert!(
        status.success(),
        "exit status {status:?}; stderr:\n{}",
        broker.stderr_text()
    );
    match within(subscription.next()).await {
        Some(Err(error)) => assert!(error.to_string().contains("shutting down"), "{error}"),
        other => panic!("expected a shutdown error, got {other:?}"),
    }
}

// Proves a client that does not offer ALPN felix/1 is refused at once by a TLS alert (a QUIC
// transport close in the 0x100-0x1ff crypto range: handshake_failure), not left to time out,
// and the broker goes on serving.
#[tokio::test]
async fn a_wrong_alpn_is_refused_at_once() {
    let broker = BrokerProcess::start(&[]);
    let ca = std::fs::read_to_string(broker.ca_path()).expect("dev cert readable");
    for protocols in [
        &[b"h3".as_slice()][..],
        &[b"felix/2".as_slice(), b"other".as_slice()][..],
    ] {
        let tls = s2n_quic::provider::tls::default::Client::builder()
            .with_certificate(ca.as_str())
            .and_then(|builder| builder.with_application_protocols(protocols.iter().copied()))
            .and_then(|builder| builder.build())
            .expect("tls client");
        let endpoint = s2n_quic::Client::builder()
            .with_tls(tls)
            .expect("tls provider")
            .with_io("127.0.0.1:0")
            .expect("io provider")
            .start()
            .expect("client endpoint");
        let connect =
            s2n_quic::client::Connect::new(broker.quic_addr).with_server_name("localhost");
        match within(endpoint.connect(connect)).await {
            Err(s2n_quic::connection::Error::Transport { code, .. }) => {
                let code = code.as_u64();
                assert!(
                    (0x100..0x200).contains(&code),
                    "a TLS alert closes it, got code {code:#x}"
                );
            }
            other => panic!("expected a TLS refusal, got {:?}", other.map(|_| ())),
        }
    }
    let client = broker.client().await;
    within(client.list_streams()).await.expect("still serving");
    client.close().await;
}
