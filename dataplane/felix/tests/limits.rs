//! Every resource limit end to end (docs/security.md, "What each limit protects"), with the
//! real binary over QUIC on loopback: each limit exceeded gets its documented error (or close
//! code) and counter, and a healthy client on the same broker keeps being served after each.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_client::{Client, ErrorCode, ShardSelection, StartPosition, StreamKind, record};
use felix_wire::{AckMode, Frame, Publish, Record, Subscribe};
use futures::StreamExt as _;
use support::{BrokerProcess, DEADLINE, hello, labelled_value, raw_quic, within};

/// A healthy client publishes one acked record to `stream` (created if missing).
async fn still_served(client: &Client, stream: &str) {
    if within(client.describe_stream(stream)).await.is_err() {
        within(client.create_stream(stream, 1, StreamKind::InMemory))
            .await
            .expect("the healthy client creates its stream");
    }
    let acks = within(client.publish(stream, &[record("k", "alive")]))
        .await
        .expect("the healthy client is still served");
    assert_eq!(acks.len(), 1);
}

fn limit_count(broker: &BrokerProcess, limit: &str) -> f64 {
    labelled_value(
        &broker.metrics(),
        &format!("felix_limit_exceeded_total{{limit=\"{limit}\"}}"),
    )
    .unwrap_or(0.0)
}

fn error_of(frame: Option<Frame>) -> felix_wire::ErrorFrame {
    match frame {
        Some(Frame::Error(error)) => error,
        other => panic!("expected an Error frame, got {other:?}"),
    }
}

fn raw_publish(request_id: u64, stream: &str, records: Vec<Record>) -> Frame {
    Frame::Publish(Publish {
        request_id,
        ack: AckMode::Acked,
        stream: stream.to_owned(),
        records,
    })
}

fn raw_record(key_bytes: usize, payload_bytes: usize) -> Record {
    Record {
        key: Bytes::from(vec![b'k'; key_bytes]),
        payload: Bytes::from(vec![b'p'; payload_bytes]),
    }
}

// Proves FELIX_MAX_CONNECTIONS_PER_CORE: on a one-core broker, the connection beyond the limit
// is closed with limit_exceeded (code 6) and counted, and the open ones keep being served.
#[tokio::test]
async fn connections_per_core() {
    let broker = BrokerProcess::start(&[
        ("FELIX_DATAPLANE_CORES", "1"),
        ("FELIX_MAX_CONNECTIONS_PER_CORE", "2"),
    ]);
    let healthy = within(Client::connect(broker.naive_client_config()))
        .await
        .expect("first connection");
    let mut second = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("second connection");
    let (_hello, answer) = second.handshake(&hello(None)).await;
    assert!(matches!(answer, Some(Frame::HelloOk(_))), "{answer:?}");
    let mut third = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("the QUIC handshake completes");
    assert_eq!(
        third.closed_with().await,
        Some(ErrorCode::LimitExceeded as u64)
    );
    assert_eq!(limit_count(&broker, "connections_per_core"), 1.0);
    still_served(&healthy, "per-core").await;
}

// Proves FELIX_MAX_CONNECTIONS_PER_PRINCIPAL counts one principal over every core: its
// connection beyond the limit is refused with limit_exceeded naming the setting, another
// principal connects meanwhile, and once one closes the principal connects again.
#[tokio::test]
async fn connections_per_principal() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = dir.path().join("tokens");
    let token = |principal: &str| {
        let output = support::felix()
            .args(["token", "add", principal, "--file"])
            .arg(&tokens)
            .output()
            .expect("felix token add");
        assert!(output.status.success());
        String::from_utf8(output.stdout)
            .expect("UTF-8")
            .trim()
            .to_owned()
    };
    let (mia, noah) = (token("mia"), token("noah"));
    let broker = BrokerProcess::start(&[
        ("FELIX_TOKENS_FILE", tokens.to_str().expect("UTF-8 path")),
        ("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL", "2"),
    ]);
    let as_principal = |token: &str, core: usize| {
        let mut config = broker.naive_client_config();
        config.token = Some(token.to_owned());
        config.addr = broker.core_addrs[core % broker.core_addrs.len()];
        config
    };
    let first = within(Client::connect(as_principal(&mia, 0)))
        .await
        .expect("mia 1");
    let second = within(Client::connect(as_principal(&mia, 1)))
        .await
        .expect("mia 2, on the other core");
    let refused = within(Client::connect(as_principal(&mia, 0)))
        .await
        .expect_err("mia 3 is over the limit");
    assert_eq!(refused.code(), Some(ErrorCode::LimitExceeded), "{refused}");
    assert!(
        refused
            .to_string()
            .contains("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL"),
        "{refused}"
    );
    let other = within(Client::connect(as_principal(&noah, 0)))
        .await
        .expect("noah has his own count");
    still_served(&other, "per-principal").await;
    first.close().await;
    let deadline = Instant::now() + DEADLINE;
    let again = loop {
        match within(Client::connect(as_principal(&mia, 0))).await {
            Ok(client) => break client,
            Err(error) => {
                assert_eq!(error.code(), Some(ErrorCode::LimitExceeded), "{error}");
                assert!(Instant::now() < deadline, "mia's slot was never released");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    still_served(&again, "per-principal").await;
    still_served(&second, "per-principal").await;
    assert!(limit_count(&broker, "connections_per_principal") >= 1.0);
}

// Proves the per-connection and per-request limits on one broker: streams per connection,
// subscriptions per connection, streams in the catalogue, shards per stream, key, payload and
// batch bounds, and the Hello's size and time bounds; each answered with its error (the
// stream or connection it ends, nothing more) and counted, the healthy client served after
// each.
#[tokio::test]
async fn request_and_connection_limits() {
    let broker = BrokerProcess::start(&[
        ("FELIX_MAX_STREAMS_PER_CONNECTION", "4"),
        ("FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION", "1"),
        ("FELIX_MAX_STREAMS", "3"),
        ("FELIX_MAX_SHARDS_PER_STREAM", "8"),
        ("FELIX_MAX_KEY_BYTES", "16"),
        ("FELIX_MAX_PAYLOAD_BYTES", "1KiB"),
        ("FELIX_MAX_BATCH_RECORDS", "4"),
        ("FELIX_HELLO_MAX_BYTES", "1KiB"),
        ("FELIX_HELLO_TIMEOUT_MS", "1000"),
    ]);
    let healthy = broker.client().await;
    assert_eq!(
        healthy.limits().max_shards,
        8,
        "HelloOk announces the shard bound"
    );
    assert_eq!(healthy.limits().max_key_bytes, 16);
    assert_eq!(healthy.limits().max_payload_bytes, 1024);
    within(healthy.create_stream("limits", 2, StreamKind::InMemory))
        .await
        .expect("created");

    // Shards per stream and streams in the catalogue.
    let wide = within(healthy.create_stream("wide", 9, StreamKind::InMemory))
        .await
        .expect_err("9 shards");
    assert_eq!(wide.code(), Some(ErrorCode::LimitExceeded), "{wide}");
    assert!(
        wide.to_string().contains("FELIX_MAX_SHARDS_PER_STREAM"),
        "{wide}"
    );
    for name in ["second", "third"] {
        within(healthy.create_stream(name, 1, StreamKind::InMemory))
            .await
            .expect("within the stream limit");
    }
    let fourth = within(healthy.create_stream("fourth", 1, StreamKind::InMemory))
        .await
        .expect_err("a fourth stream");
    assert_eq!(fourth.code(), Some(ErrorCode::LimitExceeded), "{fourth}");
    assert!(fourth.to_string().contains("FELIX_MAX_STREAMS"), "{fourth}");
    still_served(&healthy, "limits").await;

    // Streams per connection: the hello stream and three more; the fifth is refused.
    let mut raw = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("raw connection");
    let (mut requests, answer) = raw.handshake(&hello(None)).await;
    assert!(matches!(answer, Some(Frame::HelloOk(_))), "{answer:?}");
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(raw.open().await);
    }
    let mut refused = raw.open().await;
    // The stream exists for the broker once it carries a byte.
    refused.write(&Frame::ListStreams { request_id: 1 }).await;
    let error = error_of(refused.read().await);
    assert_eq!(error.code, ErrorCode::LimitExceeded);
    assert!(
        error.message.contains("FELIX_MAX_STREAMS_PER_CONNECTION"),
        "{}",
        error.message
    );
    assert_eq!(refused.read().await, None, "the refused stream is finished");
    // The others work; subscriptions per connection: one, then refused.
    open[0]
        .write(&Frame::Subscribe(Subscribe {
            request_id: 2,
            stream: "limits".to_owned(),
            shards: felix_wire::ShardSelection::All,
            from: felix_wire::StartPosition::Latest,
        }))
        .await;
    assert!(matches!(open[0].read().await, Some(Frame::Subscribed(_))));
    open[1]
        .write(&Frame::Subscribe(Subscribe {
            request_id: 3,
            stream: "limits".to_owned(),
            shards: felix_wire::ShardSelection::All,
            from: felix_wire::StartPosition::Latest,
        }))
        .await;
    let error = error_of(open[1].read().await);
    assert_eq!(
        (error.request_id, error.code),
        (3, ErrorCode::LimitExceeded)
    );
    assert!(
        error
            .message
            .contains("FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION"),
        "{}",
        error.message
    );

    // Key, payload and batch bounds, each on a request stream of its own: the frame is
    // refused with limit_exceeded and that stream finished; the connection goes on.
    let cases = [
        (
            raw_publish(4, "limits", vec![raw_record(17, 1)]),
            "key length",
        ),
        (
            raw_publish(5, "limits", vec![raw_record(1, 1025)]),
            "payload length",
        ),
        (
            raw_publish(6, "limits", (0..5).map(|_| raw_record(1, 1)).collect()),
            "record count",
        ),
    ];
    for (frame, what) in cases {
        open[2].write(&frame).await;
        let error = error_of(open[2].read().await);
        assert_eq!(
            (error.request_id, error.code),
            (0, ErrorCode::LimitExceeded)
        );
        assert!(error.message.contains(what), "{}", error.message);
        assert_eq!(open[2].read().await, None, "that stream is finished");
        open[2] = raw.open().await;
    }
    requests.write(&Frame::ListStreams { request_id: 7 }).await;
    assert!(matches!(
        requests.read().await,
        Some(Frame::StreamList { .. })
    ));
    still_served(&healthy, "limits").await;

    // A Hello body over FELIX_HELLO_MAX_BYTES: refused from its header, connection closed.
    let mut big = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("raw connection");
    let mut stream = big.open().await;
    let mut header = Vec::from(2048u32.to_le_bytes());
    header.extend_from_slice(&[0x01, 0]);
    stream.write_bytes(Bytes::from(header)).await;
    let error = error_of(stream.read().await);
    assert_eq!(error.code, ErrorCode::FrameTooLarge);
    assert_eq!(
        big.closed_with().await,
        Some(ErrorCode::FrameTooLarge as u64)
    );

    // No Hello within FELIX_HELLO_TIMEOUT_MS: closed with protocol_violation (a connection
    // that opens nothing, and one that sends half a Hello).
    let mut silent = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("raw connection");
    let mut partial = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("raw connection");
    let mut half = partial.open().await;
    half.write_bytes(Bytes::from_static(&[20, 0, 0, 0, 0x01, 0, 1, 0]))
        .await;
    assert_eq!(
        silent.closed_with().await,
        Some(ErrorCode::ProtocolViolation as u64)
    );
    assert_eq!(
        partial.closed_with().await,
        Some(ErrorCode::ProtocolViolation as u64)
    );

    for (limit, at_least) in [
        ("shards_per_stream", 1.0),
        ("streams", 1.0),
        ("streams_per_connection", 1.0),
        ("subscriptions_per_connection", 1.0),
        ("key_bytes", 1.0),
        ("payload_bytes", 1.0),
        ("batch_records", 1.0),
        ("hello_bytes", 1.0),
        ("hello_time", 2.0),
    ] {
        assert!(limit_count(&broker, limit) >= at_least, "{limit}");
    }
    still_served(&healthy, "limits").await;
    healthy.close().await;
}

// Proves FELIX_IDLE_TIMEOUT_MS: a connection that sends nothing (no keep-alives) is closed by
// the broker, while the Felix client, which sends keep-alives, stays connected past it.
#[tokio::test]
async fn idle_connections_are_closed() {
    let broker = BrokerProcess::start(&[("FELIX_IDLE_TIMEOUT_MS", "1000")]);
    let healthy = broker.client().await;
    let mut idle = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("raw connection");
    let (_stream, answer) = idle.handshake(&hello(None)).await;
    assert!(matches!(answer, Some(Frame::HelloOk(_))));
    // The broker's idle timer closes it silently (QUIC idle timeout, no close frame).
    let closed = within(idle.connection.accept_bidirectional_stream()).await;
    assert!(
        !matches!(closed, Ok(Some(_))),
        "the idle connection is closed: {closed:?}"
    );
    // Well past the idle timeout, the keep-alive client is still served.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    still_served(&healthy, "idle").await;
    healthy.close().await;
}

// Proves the subscriber backlog bound (FELIX_SUBSCRIBER_QUEUE_MAX_BYTES) holds for a
// subscriber that never reads: the broker's resident memory stays bounded while it is
// stalled, a reading subscriber of the same stream gets every record, and the stalled one is
// ended while still stalled (its stream reset with subscriber_lagged).
#[tokio::test]
async fn a_stalled_subscriber_is_bounded() {
    const RECORDS: usize = 2_000;
    const PAYLOAD_BYTES: usize = 16 * 1024;
    /// 16 x 16 KiB = 256 KiB per publish: a quarter of the backlog bound.
    const BATCH: usize = 16;
    // Small rings, so that what the broker holds is the subscribers' share, not the replay.
    let broker = BrokerProcess::start(&[
        ("FELIX_SUBSCRIBER_QUEUE_MAX_BYTES", "1MiB"),
        ("FELIX_REPLAY_RING_MAX_RECORDS", "64"),
    ]);
    let publisher = broker.client().await;
    within(publisher.create_stream("firehose", 2, StreamKind::InMemory))
        .await
        .expect("created");
    let rss_before = broker.rss_bytes();
    // The stalled subscriber: a raw stream that subscribes and then never reads.
    let mut raw = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("raw connection");
    let (_requests, answer) = raw.handshake(&hello(None)).await;
    assert!(matches!(answer, Some(Frame::HelloOk(_))));
    let mut stalled = raw.open().await;
    stalled
        .write(&Frame::Subscribe(Subscribe {
            request_id: 1,
            stream: "firehose".to_owned(),
            shards: felix_wire::ShardSelection::All,
            from: felix_wire::StartPosition::Latest,
        }))
        .await;
    assert!(matches!(stalled.read().await, Some(Frame::Subscribed(_))));
    let reader = broker.client().await;
    let mut reading =
        within(reader.subscribe("firehose", ShardSelection::All, StartPosition::Latest))
            .await
            .expect("reading subscriber");
    let payload = "x".repeat(PAYLOAD_BYTES);
    // The reader reports its progress; the publisher stays within one batch of it, so the
    // reading subscriber's backlog never nears the bound on a slow machine (it must not be
    // the one ended).
    let (progress, mut received) = tokio::sync::watch::channel(0usize);
    let consume = tokio::spawn(async move {
        let mut got = 0usize;
        while got < RECORDS {
            match within(reading.next()).await {
                Some(Ok(_)) => got += 1,
                other => panic!("the reading subscriber ended after {got}: {other:?}"),
            }
            progress.send_replace(got);
        }
        got
    });
    let mut peak = 0;
    for batch in 0..RECORDS / BATCH {
        let records: Vec<_> = (0..BATCH)
            .map(|index| record(format!("k{batch}-{index}"), payload.clone()))
            .collect();
        within(publisher.publish("firehose", &records))
            .await
            .expect("acked");
        peak = peak.max(broker.rss_bytes());
        let sent = (batch + 1) * BATCH;
        within(received.wait_for(|&got| got + BATCH >= sent))
            .await
            .expect("the reader is alive");
    }
    assert_eq!(within(consume).await.expect("reader task"), RECORDS);
    // 32 MiB went through; the stalled subscriber may hold its 1 MiB backlog plus what QUIC
    // buffers for it. Generous: 64 MiB over the start, far below the 32 MiB x copies a
    // missing bound would pile up.
    let grown = peak.saturating_sub(rss_before);
    eprintln!(
        "broker RSS {rss_before} bytes before, peak {peak} with a stalled subscriber ({grown} grown)"
    );
    assert!(
        grown < 64 << 20,
        "broker memory grew by {grown} bytes with a stalled subscriber"
    );
    // While it still reads nothing, the broker ends the stalled subscription (its stream is
    // reset after a grace): only the reading subscriber is left.
    let deadline = Instant::now() + DEADLINE;
    while support::metric_value(&broker.metrics(), "felix_subscribers") != Some(1) {
        assert!(
            Instant::now() < deadline,
            "the stalled subscriber was not ended while stalled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Reading now, it finds deliveries, then the end: the reset (or the error, had it been
    // written before the stall).
    loop {
        match stalled.read().await {
            Some(Frame::Delivery(_)) => {}
            Some(Frame::Error(error)) => {
                assert_eq!(error.code, ErrorCode::SubscriberLagged, "{}", error.message);
                break;
            }
            None => break,
            other => panic!("expected deliveries then the end, got {other:?}"),
        }
        assert!(Instant::now() < deadline, "never ended");
    }
    still_served(&publisher, "firehose").await;
}

// Proves the bound on undecoded frame bytes one connection makes the broker hold
// (FELIX_BROKER_PUB_CONN_RECV_WINDOW + FELIX_MAX_FRAME_BYTES): a client that opens many
// streams and leaves a large frame unfinished on each does not grow the broker's memory by the
// bytes it sent; its connection works again once it resets those streams; a healthy client is
// served throughout.
#[tokio::test]
async fn unfinished_frames_are_bounded_per_connection() {
    const STREAMS: usize = 24;
    const FRAME_BYTES: usize = 1 << 20;
    let broker = BrokerProcess::start(&[
        ("FELIX_MAX_FRAME_BYTES", "1MiB"),
        ("FELIX_MAX_PAYLOAD_BYTES", "1MiB"),
        ("FELIX_BROKER_PUB_CONN_RECV_WINDOW", "1MiB"),
        ("FELIX_BROKER_PUB_STREAM_RECV_WINDOW", "1MiB"),
        ("FELIX_MAX_STREAMS_PER_CONNECTION", "64"),
    ]);
    let healthy = broker.client().await;
    let rss_before = broker.rss_bytes();
    let mut raw = raw_quic(&broker, broker.quic_addr, None)
        .await
        .expect("raw connection");
    let (mut requests, answer) = raw.handshake(&hello(None)).await;
    assert!(matches!(answer, Some(Frame::HelloOk(_))));
    // Each stream: a Publish header announcing a 1 MiB body, then all of it but the last byte.
    let mut header = Vec::from(u32::try_from(FRAME_BYTES).expect("small").to_le_bytes());
    header.extend_from_slice(&[0x20, 0]);
    let mut partial = header;
    partial.resize(6 + FRAME_BYTES - 1, b'x');
    let partial = Bytes::from(partial);
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        let mut stream = raw.open().await;
        // The broker stops reading at its bound: a send may wait for credit; give up on it.
        let _ = tokio::time::timeout(
            Duration::from_millis(500),
            stream.stream.send(partial.clone()),
        )
        .await;
        streams.push(stream);
    }
    // Wait until the bytes stop arriving (the broker stopped reading, or read everything):
    // the wire-bytes counter unchanged for a second, with at least the budget received.
    let wire = || support::metric_value(&broker.metrics(), "felix_wire_bytes_total").unwrap_or(0);
    let deadline = Instant::now() + DEADLINE;
    let mut last = wire();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = wire();
        if now == last && now >= 2 * FRAME_BYTES as u64 {
            break;
        }
        assert!(Instant::now() < deadline, "the bytes never settled");
        last = now;
    }
    let peak = broker.rss_bytes();
    let grown = peak.saturating_sub(rss_before);
    eprintln!(
        "{} MiB offered in unfinished frames, {last} wire bytes received; broker RSS grew by \
         {grown} bytes",
        (STREAMS * FRAME_BYTES) >> 20
    );
    assert!(
        grown < 16 << 20,
        "broker memory grew by {grown} bytes holding unfinished frames"
    );
    still_served(&healthy, "unfinished").await;
    // Resetting the unfinished streams frees the budget: the connection works again.
    for stream in &mut streams {
        let _ = stream.stream.reset(0u32.into());
    }
    requests.write(&Frame::ListStreams { request_id: 3 }).await;
    assert!(matches!(
        requests.read().await,
        Some(Frame::StreamList { request_id: 3, .. })
    ));
    still_served(&healthy, "unfinished").await;
    healthy.close().await;
}
