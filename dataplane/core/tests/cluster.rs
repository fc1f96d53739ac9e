//! Publishes to the cluster's replicated streams on one core (`cluster.rs`), driven by hand:
//! a batch is split by shard into parts for the cluster service, the ack waits for every
//! part and carries the offsets the cluster gave, in shard order; a refused part answers the
//! publish with its error; a stream of the broker's own catalogue wins over a cluster stream
//! of the same name; the ingress job is held until every part is answered. Subscriptions to
//! replicated streams: one request to the cluster service per subscription stream, deliveries
//! under credits, refusals and ends written as errors, an unsubscribe when the stream goes.

mod support;

use std::collections::HashMap;

use felix_core::{
    ClusterPublish, ClusterRefusal, ClusterRequest, ClusterShard, ClusterStart, ClusterSubscribe,
    ClusterView,
};
use felix_wire::{
    AckMode, DeliveredRecord, ErrorCode, Frame, ShardAck, ShardSelection, StartPosition, StreamKind,
};
use support::{Broker, ingress, publish, record};

/// Tells core `core` the cluster's replicated streams (name, shard count), led by member 2
/// of members 1-3; this is member 1.
fn set_view(broker: &mut Broker, core: usize, streams: &[(&str, usize)]) {
    let view = ClusterView {
        member: 1,
        members: (1..=3)
            .map(|id| felix_wire::ClusterMember {
                id,
                addr: format!("127.0.0.1:74{id}0"),
            })
            .collect(),
        streams: streams
            .iter()
            .map(|(name, shards)| {
                let shards = (0..*shards)
                    .map(|shard| ClusterShard {
                        leader: 2,
                        oldest_offset: 0,
                        next_offset: 10 * shard as u64,
                    })
                    .collect();
                let stream = felix_core::ClusterStream {
                    kind: StreamKind::Durable,
                    shards,
                };
                ((*name).to_owned(), stream)
            })
            .collect::<HashMap<_, _>>(),
    };
    broker.cores[core].set_cluster_view(std::sync::Arc::new(view));
}

fn requests(broker: &mut Broker, core: usize) -> Vec<ClusterRequest> {
    std::iter::from_fn(|| broker.cores[core].poll_cluster()).collect()
}

fn parts(broker: &mut Broker, core: usize) -> Vec<ClusterPublish> {
    requests(broker, core)
        .into_iter()
        .map(|request| match request {
            ClusterRequest::Publish(part) => part,
            other => panic!("a publish part, not {other:?}"),
        })
        .collect()
}

#[test]
fn a_publish_is_split_by_shard_and_acked_with_the_clusters_offsets() {
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(1);
    set_view(&mut broker, 1, &[("payments", 4)]);
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
    set_view(&mut broker, 0, &[("payments", 2)]);
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
                detail: 0,
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
    set_view(&mut broker, 0, &[("local", 3)]);
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
    set_view(&mut broker, 0, &[]);
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
    set_view(&mut broker, 0, &[("payments", 1)]);
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

fn subscribe_frame(request_id: u64, shards: ShardSelection, from: StartPosition) -> Frame {
    Frame::Subscribe(felix_wire::Subscribe {
        request_id,
        stream: "payments".to_owned(),
        shards,
        from,
    })
}

/// Subscribes on a fresh stream of `conn` and returns the stream and the request the cluster
/// service got.
fn cluster_subscribe(
    broker: &mut Broker,
    conn: &support::Conn,
    shards: ShardSelection,
    from: StartPosition,
) -> (felix_core::StreamId, ClusterSubscribe) {
    let stream = broker.open(conn);
    let _ = broker.feed(conn.core, stream, subscribe_frame(4, shards, from));
    let handed = requests(broker, conn.core);
    let [ClusterRequest::Subscribe(subscribe)] = &handed[..] else {
        panic!("one subscribe: {handed:?}")
    };
    (stream, subscribe.clone())
}

/// The service's answer once it stopped.
fn stopped() -> ClusterRefusal {
    ClusterRefusal {
        code: ErrorCode::Unavailable,
        detail: 0,
        message: "the cluster service stopped".to_owned(),
    }
}

fn delivered(shard: u32, offset: u64) -> DeliveredRecord {
    DeliveredRecord {
        shard,
        offset,
        timestamp_us: 1,
        key: bytes::Bytes::new(),
        payload: bytes::Bytes::from(format!("{shard}:{offset}")),
    }
}

#[test]
fn a_replicated_subscription_is_served_by_the_cluster_under_credits() {
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(1);
    set_view(&mut broker, 1, &[("payments", 3)]);
    let (stream, subscribe) = cluster_subscribe(
        &mut broker,
        &conn,
        ShardSelection::List(vec![2, 0]),
        StartPosition::Offsets(vec![(2, 5)]),
    );
    assert_eq!(subscribe.stream, "payments");
    assert_eq!(
        subscribe.shards,
        vec![(0, ClusterStart::Latest), (2, ClusterStart::Offset(5))],
        "selected shards ascending; unlisted ones from latest"
    );
    assert!(subscribe.max_records > 0 && subscribe.max_bytes > 0);
    assert!(
        broker.read(1, stream).is_empty(),
        "Subscribed waits for the service"
    );
    let token = subscribe.token;
    broker.cores[1].handle_cluster_subscribed(token, Ok(vec![(0, 3), (2, 5)]));
    broker.collect();
    let frames = broker.read(1, stream);
    let [Frame::Subscribed(subscribed)] = &frames[..] else {
        panic!("Subscribed: {frames:?}")
    };
    assert_eq!(subscribed.shards, vec![(0, 3), (2, 5)]);
    assert_eq!(broker.cores[1].counters().subscribers, 1);

    // Two batches: each written in order, each written batch gives a credit back.
    broker.cores[1].handle_cluster_delivery(token, vec![delivered(0, 3), delivered(2, 5)]);
    broker.cores[1].handle_cluster_delivery(token, vec![delivered(2, 6)]);
    broker.collect();
    assert!(
        requests(&mut broker, 1).is_empty(),
        "no credit before a write"
    );
    let frames = broker.read(1, stream);
    let offsets: Vec<(u32, u64)> = frames
        .iter()
        .flat_map(|frame| match frame {
            Frame::Delivery(delivery) => delivery.records.iter().map(|r| (r.shard, r.offset)),
            other => panic!("deliveries only: {other:?}"),
        })
        .collect();
    assert_eq!(offsets, vec![(0, 3), (2, 5), (2, 6)]);
    assert_eq!(
        requests(&mut broker, 1),
        vec![ClusterRequest::Credit { token }; 2],
        "a credit per batch written"
    );

    // The stream goes: the service hears it; late batches for it are dropped.
    let now = broker.now();
    broker.cores[1].handle_stream_closed(now, stream);
    broker.collect();
    assert_eq!(
        requests(&mut broker, 1),
        vec![ClusterRequest::Unsubscribe { token }]
    );
    broker.cores[1].handle_cluster_delivery(token, vec![delivered(0, 4)]);
    broker.cores[1].handle_cluster_ended(
        token,
        ClusterRefusal {
            code: ErrorCode::Unavailable,
            detail: 0,
            message: "late".to_owned(),
        },
    );
    broker.collect();
    assert!(requests(&mut broker, 1).is_empty());
    assert_eq!(broker.cores[1].counters().subscribers, 0);
}

#[test]
fn a_replicated_subscription_refused_or_ended_says_why() {
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    set_view(&mut broker, 0, &[("payments", 2)]);

    // The core checks the selection itself: the service is not asked.
    let stream = broker.open(&conn);
    let _ = broker.feed(
        0,
        stream,
        subscribe_frame(4, ShardSelection::List(vec![2]), StartPosition::Latest),
    );
    assert!(requests(&mut broker, 0).is_empty());
    let frames = broker.read(0, stream);
    assert!(
        matches!(&frames[..], [Frame::Error(e)] if e.code == ErrorCode::InvalidArgument),
        "{frames:?}"
    );

    // Refused by the service (too old, with the oldest offset held): nothing to undo.
    let (stream, subscribe) = cluster_subscribe(
        &mut broker,
        &conn,
        ShardSelection::All,
        StartPosition::Offsets(vec![(1, 2)]),
    );
    broker.cores[0].handle_cluster_subscribed(
        subscribe.token,
        Err(ClusterRefusal {
            code: ErrorCode::TooOld,
            detail: 7,
            message: "shard 1: offset 2 is no longer held; the oldest is 7".to_owned(),
        }),
    );
    broker.collect();
    let (frames, finished) = broker.read_all(0, stream);
    let [Frame::Error(error)] = &frames[..] else {
        panic!("one error: {frames:?}")
    };
    assert_eq!(
        (error.request_id, error.code, error.detail),
        (4, ErrorCode::TooOld, 7)
    );
    assert!(finished, "the stream finishes");
    assert!(requests(&mut broker, 0).is_empty(), "no unsubscribe");

    // Ended after a batch: the batch goes out first, then the error.
    let (ended, subscribe) = cluster_subscribe(
        &mut broker,
        &conn,
        ShardSelection::All,
        StartPosition::Latest,
    );
    broker.cores[0].handle_cluster_subscribed(subscribe.token, Ok(vec![(0, 0), (1, 0)]));
    broker.cores[0].handle_cluster_delivery(subscribe.token, vec![delivered(1, 0)]);
    broker.cores[0].handle_cluster_ended(subscribe.token, stopped());
    broker.collect();
    let (frames, finished) = broker.read_all(0, ended);
    assert!(
        matches!(
            &frames[..],
            [Frame::Subscribed(_), Frame::Delivery(_), Frame::Error(e)]
                if e.code == ErrorCode::Unavailable
        ),
        "{frames:?}"
    );
    assert!(finished);
    assert_eq!(
        requests(&mut broker, 0),
        vec![ClusterRequest::Credit {
            token: subscribe.token
        }],
        "the written batch's credit, no unsubscribe: the service ended it"
    );

    // Ended before it started (the service stopped with the request queued): refused.
    let (stream, subscribe) = cluster_subscribe(
        &mut broker,
        &conn,
        ShardSelection::All,
        StartPosition::Latest,
    );
    broker.cores[0].handle_cluster_ended(subscribe.token, stopped());
    broker.collect();
    let (frames, finished) = broker.read_all(0, stream);
    assert!(
        matches!(&frames[..], [Frame::Error(e)] if e.code == ErrorCode::Unavailable),
        "{frames:?}"
    );
    assert!(finished);
    // Counted while their streams are open (as a local subscription is).
    assert_eq!(
        broker.cores[0].counters().subscribers,
        1,
        "the one that started"
    );
    let now = broker.now();
    broker.cores[0].handle_stream_closed(now, ended);
    broker.cores[0].handle_stream_closed(now, stream);
    broker.collect();
    assert_eq!(broker.cores[0].counters().subscribers, 0);
    assert!(
        requests(&mut broker, 0).is_empty(),
        "nothing to undo at the service"
    );
}

#[test]
fn extra_data_on_a_replicated_subscription_unsubscribes_it() {
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    set_view(&mut broker, 0, &[("payments", 1)]);
    let (stream, subscribe) = cluster_subscribe(
        &mut broker,
        &conn,
        ShardSelection::All,
        StartPosition::Latest,
    );
    broker.cores[0].handle_cluster_subscribed(subscribe.token, Ok(vec![(0, 0)]));
    broker.collect();
    let _ = broker.feed(
        0,
        stream,
        subscribe_frame(5, ShardSelection::All, StartPosition::Latest),
    );
    assert_eq!(
        requests(&mut broker, 0),
        vec![ClusterRequest::Unsubscribe {
            token: subscribe.token
        }]
    );
    let (frames, _) = broker.read_all(0, stream);
    assert!(
        matches!(frames.last(), Some(Frame::Error(e)) if e.code == ErrorCode::ProtocolViolation),
        "{frames:?}"
    );
}

#[test]
fn describe_list_and_the_cluster_map_show_replicated_streams() {
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(1);
    let _ = broker.create(&conn, "local", 1, StreamKind::InMemory);
    set_view(&mut broker, 1, &[("payments", 3), ("local", 2)]);

    let _ = broker.feed(
        1,
        conn.requests,
        Frame::DescribeStream {
            request_id: 1,
            name: "payments".to_owned(),
        },
    );
    let _ = broker.feed(1, conn.requests, Frame::ListStreams { request_id: 2 });
    let _ = broker.feed(1, conn.requests, Frame::DescribeCluster { request_id: 3 });
    let frames = broker.read(1, conn.requests);
    let [
        Frame::StreamInfo(info),
        Frame::StreamList { streams, .. },
        Frame::ClusterMap(map),
    ] = &frames[..]
    else {
        panic!("three answers: {frames:?}")
    };
    // The member's offsets, and each shard's owner core among this broker's two.
    assert_eq!(info.request_id, 1);
    assert_eq!(info.kind, StreamKind::Durable);
    let shards: Vec<(u32, u16, u64)> = info
        .shards
        .iter()
        .map(|s| (s.shard, s.core, s.next_offset))
        .collect();
    assert_eq!(shards, vec![(0, 0, 0), (1, 1, 10), (2, 0, 20)]);
    // The own "local" stream shadows the cluster's of the same name, in every answer.
    let listed: Vec<(&str, StreamKind, u32)> = streams
        .iter()
        .map(|s| (s.name.as_str(), s.kind, s.shard_count))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("local", StreamKind::InMemory, 1),
            ("payments", StreamKind::Durable, 3)
        ]
    );
    assert_eq!((map.request_id, map.member), (3, 1));
    assert_eq!(map.members.len(), 3);
    assert_eq!(map.members[1].addr, "127.0.0.1:7420");
    assert_eq!(
        map.streams,
        vec![felix_wire::ClusterRoute {
            name: "payments".to_owned(),
            leaders: vec![2, 2, 2],
        }]
    );

    // A broker outside any cluster answers an empty map.
    let mut single = Broker::new(1, ingress());
    let conn = single.connect(0);
    let _ = single.feed(0, conn.requests, Frame::DescribeCluster { request_id: 9 });
    let frames = single.read(0, conn.requests);
    assert!(
        matches!(&frames[..], [Frame::ClusterMap(map)] if map.member == 0 && map.members.is_empty() && map.streams.is_empty()),
        "{frames:?}"
    );
}
