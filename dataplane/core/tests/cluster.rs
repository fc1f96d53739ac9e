//! Publishes to the cluster's replicated streams on one core (`cluster.rs`), driven by hand:
//! a batch is split by shard into parts for the cluster service, the ack waits for every
//! part and carries the offsets the cluster gave, in shard order; a refused part answers the
//! publish with its error; a stream of the broker's own catalogue wins over a cluster stream
//! of the same name; the ingress job is held until every part is answered.

mod support;

use std::collections::HashMap;

use felix_core::{ClusterPublish, ClusterRefusal};
use felix_wire::{AckMode, ErrorCode, Frame, ShardAck, StreamKind};
use support::{Broker, ingress, publish, record};

fn parts(broker: &mut Broker, core: usize) -> Vec<ClusterPublish> {
    std::iter::from_fn(|| broker.cores[core].poll_cluster_publish()).collect()
}

#[test]
fn a_publish_is_split_by_shard_and_acked_with_the_clusters_offsets() {
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(1);
    broker.cores[1].set_cluster_streams(HashMap::from([("payments".to_owned(), 4)]));
    let records: Vec<_> = (0..12).map(|i| record(&format!("k{i}"), "p")).collect();
    let _ = broker.feed(
        1,
        conn.requests,
        publish(9, AckMode::Acked, "payments", records.clone()),
    );
    let handed = parts(&mut broker, 1);
    let mut shards: Vec<u32> = handed.iter().map(|part| part.shard).collect();
    shards.sort_unstable();
    shards.dedup();
    assert_eq!(shards.len(), handed.len(), "one part per shard");
    for part in &handed {
        let expected: Vec<_> = records
            .iter()
            .filter(|r| felix_wire::shard_for_key(&r.key, 4) == part.shard)
            .cloned()
            .collect();
        assert_eq!(part.records, expected, "a part keeps the batch's order");
        assert_eq!(part.stream, "payments");
    }
    // Answered in reverse: nothing goes out before the last part.
    let now = broker.now();
    for part in handed.iter().rev() {
        assert!(
            broker.read(1, conn.requests).is_empty(),
            "no ack before every part"
        );
        let ack = ShardAck {
            shard: part.shard,
            first_offset: 100 * u64::from(part.shard),
            count: u32::try_from(part.records.len()).expect("small"),
        };
        broker.cores[1].handle_cluster_answer(now, part.token, Ok(ack));
        // An answer for a token answered already changes nothing.
        broker.cores[1].handle_cluster_answer(now, part.token, Ok(ack));
    }
    broker.collect();
    let frames = broker.read(1, conn.requests);
    let [Frame::Ack(ack)] = &frames[..] else {
        panic!("one ack: {frames:?}")
    };
    assert_eq!(ack.request_id, 9);
    let got: Vec<(u32, u64)> = ack
        .shards
        .iter()
        .map(|a| (a.shard, a.first_offset))
        .collect();
    let want: Vec<(u32, u64)> = shards.iter().map(|s| (*s, 100 * u64::from(*s))).collect();
    assert_eq!(got, want, "the cluster's offsets, in shard order");
    assert_eq!(broker.cores[1].counters().records, 12);
}

#[test]
fn a_refused_part_answers_the_publish_with_its_error() {
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    broker.cores[0].set_cluster_streams(HashMap::from([("payments".to_owned(), 2)]));
    let records = vec![record("a", "1"), record("b", "2"), record("c", "3")];
    let _ = broker.feed(
        0,
        conn.requests,
        publish(3, AckMode::Acked, "payments", records),
    );
    let handed = parts(&mut broker, 0);
    assert!(!handed.is_empty());
    let now = broker.now();
    for (n, part) in handed.iter().enumerate() {
        let result = if n == 0 {
            Err(ClusterRefusal {
                code: ErrorCode::Unavailable,
                message: "no quorum".to_owned(),
            })
        } else {
            Ok(ShardAck {
                shard: part.shard,
                first_offset: 0,
                count: u32::try_from(part.records.len()).expect("small"),
            })
        };
        broker.cores[0].handle_cluster_answer(now, part.token, result);
    }
    broker.collect();
    let frames = broker.read(0, conn.requests);
    let [Frame::Error(error)] = &frames[..] else {
        panic!("one error: {frames:?}")
    };
    assert_eq!((error.request_id, error.code), (3, ErrorCode::Unavailable));
    assert_eq!(error.message, "no quorum");
}

#[test]
fn own_streams_win_and_unknown_names_are_not_found() {
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    let _ = broker.create(&conn, "local", 1, StreamKind::InMemory);
    broker.cores[0].set_cluster_streams(HashMap::from([("local".to_owned(), 3)]));
    let _ = broker.feed(
        0,
        conn.requests,
        publish(1, AckMode::Acked, "local", vec![record("k", "v")]),
    );
    assert!(
        parts(&mut broker, 0).is_empty(),
        "the broker's own stream takes it"
    );
    let _ = broker.feed(
        0,
        conn.requests,
        publish(2, AckMode::Acked, "elsewhere", vec![record("k", "v")]),
    );
    let frames = broker.read(0, conn.requests);
    assert!(
        matches!(&frames[0], Frame::Ack(ack) if ack.request_id == 1),
        "{frames:?}"
    );
    assert!(
        matches!(&frames[1], Frame::Error(e) if e.request_id == 2 && e.code == ErrorCode::StreamNotFound),
        "{frames:?}"
    );
    // Told the cluster stream is gone, the core routes nothing more to it.
    broker.cores[0].set_cluster_streams(HashMap::new());
    assert!(!broker.cores[0].is_cluster_stream("local"));
}

#[test]
fn the_ingress_job_is_held_until_every_part_is_answered() {
    // One job at a time: a second publish waits while the first's parts are in the cluster.
    let mut settings = ingress();
    settings.depth = 1;
    let mut broker = Broker::new(1, settings);
    let first = broker.connect(0);
    let second = broker.connect(0);
    broker.cores[0].set_cluster_streams(HashMap::from([("payments".to_owned(), 1)]));
    let _ = broker.feed(
        0,
        first.requests,
        publish(1, AckMode::Acked, "payments", vec![record("k", "1")]),
    );
    let handed = parts(&mut broker, 0);
    assert_eq!(handed.len(), 1);
    let flow = broker.feed(
        0,
        second.requests,
        publish(2, AckMode::Acked, "payments", vec![record("k", "2")]),
    );
    assert_eq!(flow, felix_core::Flow::Blocked, "the queue is full");
    assert!(parts(&mut broker, 0).is_empty());
    let now = broker.now();
    broker.cores[0].handle_cluster_answer(
        now,
        handed[0].token,
        Ok(ShardAck {
            shard: 0,
            first_offset: 0,
            count: 1,
        }),
    );
    broker.collect();
    let next = parts(&mut broker, 0);
    assert_eq!(
        next.len(),
        1,
        "the waiting publish runs once the first is answered"
    );
    assert_eq!(next[0].records, vec![record("k", "2")]);
}

#[test]
fn subscribing_to_a_replicated_stream_is_refused_saying_why() {
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    broker.cores[0].set_cluster_streams(HashMap::from([("payments".to_owned(), 2)]));
    let stream = broker.open(&conn);
    let subscribe = Frame::Subscribe(felix_wire::Subscribe {
        request_id: 4,
        stream: "payments".to_owned(),
        shards: felix_wire::ShardSelection::All,
        from: felix_wire::StartPosition::Earliest,
    });
    let _ = broker.feed(0, stream, subscribe);
    let frames = broker.read(0, stream);
    let [Frame::Error(error)] = &frames[..] else {
        panic!("one error: {frames:?}")
    };
    assert_eq!(
        (error.request_id, error.code),
        (4, ErrorCode::InvalidArgument)
    );
    assert!(
        error.message.contains("replicated cluster stream"),
        "{}",
        error.message
    );
}
