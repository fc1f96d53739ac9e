//! Authentication, authorization and connection limits as the per-core state machine decides
//! them (docs/security.md), driven by hand: who a handshake makes a connection, what its rules
//! let it do on every request kind, what it may see, token verdicts and revocation, and each
//! limit's refusal with its counter.

mod support;

use bytes::Bytes;
use felix_auth::{Policy, Principal, Rules, TokenRefusal, VerifiedToken};
use felix_core::{AuthRefusal, ConnectionId, ConnectionLimits, Flow, Limit, Security, StreamId};
use felix_wire::{
    AckMode, CreateStream, ErrorCode, FEATURE_TOKEN, Frame, Hello, PROTOCOL_VERSION,
    ShardSelection, StartPosition, StreamKind, Subscribe,
};
use support::{Broker, Conn, ingress, publish, record};

fn rules(text: &str) -> Policy {
    Policy::from_rules(Rules::parse(text).expect("valid rules"))
}

fn principal(name: &str) -> Principal {
    Principal::new(name).expect("a valid principal")
}

fn hello(token: Option<&'static [u8]>) -> Frame {
    Frame::Hello(Hello {
        min_version: PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        features: 0,
        client_name: "security-test".to_owned(),
        token: token.map(Bytes::from_static),
    })
}

/// Opens a connection on `core` as `peer` (a verified client certificate's principal) and
/// sends a Hello without a token; returns the connection, its hello stream, the flow and
/// what the stream wrote.
fn handshake(
    broker: &mut Broker,
    core: usize,
    peer: Option<Principal>,
) -> (ConnectionId, StreamId, Flow, Vec<Frame>, bool) {
    let id = broker.cores[core]
        .handle_connection_opened(peer)
        .expect("below the per-core limit");
    let stream = broker.cores[core].handle_stream_opened(id);
    let flow = broker.feed(core, stream, hello(None));
    let (frames, finished) = broker.read_all(core, stream);
    (id, stream, flow, frames, finished)
}

/// A connection authenticated as `name` (through a client certificate) on `core`.
fn connect_as(broker: &mut Broker, core: usize, name: &str) -> Conn {
    let (id, requests, flow, frames, _) = handshake(broker, core, Some(principal(name)));
    assert_eq!(flow, Flow::Continue, "{frames:?}");
    assert!(
        matches!(frames.as_slice(), [Frame::HelloOk(_)]),
        "{frames:?}"
    );
    Conn { core, id, requests }
}

/// Sends one request on the connection's request stream and returns its answers.
fn request(broker: &mut Broker, conn: &Conn, frame: Frame) -> Vec<Frame> {
    let flow = broker.feed(conn.core, conn.requests, frame);
    assert!(matches!(flow, Flow::Continue | Flow::Blocked), "{flow:?}");
    broker.settle();
    broker.read(conn.core, conn.requests)
}

fn create(request_id: u64, name: &str, shard_count: u32) -> Frame {
    Frame::CreateStream(CreateStream {
        request_id,
        name: name.to_owned(),
        shard_count,
        kind: StreamKind::InMemory,
    })
}

fn subscribe(request_id: u64, stream: &str) -> Frame {
    Frame::Subscribe(Subscribe {
        request_id,
        stream: stream.to_owned(),
        shards: ShardSelection::All,
        from: StartPosition::Latest,
    })
}

/// The one `Error` in `frames`: its request id, code and message.
fn error_of(frames: &[Frame]) -> (u64, ErrorCode, String) {
    match frames {
        [Frame::Error(error)] => (error.request_id, error.code, error.message.clone()),
        other => panic!("expected one Error, got {other:?}"),
    }
}

#[test]
fn rules_allow_and_deny_every_request_kind_by_stream_name() {
    // Proves each rule kind (publish, subscribe, admin, wildcard, `*` principal) allows what it
    // grants and denies the rest with PermissionDenied naming the principal, the operation and
    // the stream, before the stream is looked up; across two cores (forwarded parts).
    let policy = rules(
        "ops admin *; alice publish,subscribe orders.*; bob subscribe orders.eu; * subscribe public",
    );
    let mut broker = Broker::with_security(
        2,
        ingress(),
        Security::new(false, policy, ConnectionLimits::DEFAULT),
    );
    let ops = connect_as(&mut broker, 0, "ops");
    for (id, name) in [(1, "orders.eu"), (2, "secret"), (3, "public")] {
        let answer = request(&mut broker, &ops, create(id, name, 4));
        assert!(
            matches!(answer.as_slice(), [Frame::StreamInfo(_)]),
            "{answer:?}"
        );
    }
    let alice = connect_as(&mut broker, 1, "alice");
    let records = || {
        (0..8)
            .map(|i| record(&format!("k{i}"), "v"))
            .collect::<Vec<_>>()
    };
    let acked = request(
        &mut broker,
        &alice,
        publish(10, AckMode::Acked, "orders.eu", records()),
    );
    assert!(
        matches!(acked.as_slice(), [Frame::Ack(ack)] if ack.request_id == 10),
        "{acked:?}"
    );
    for (id, frame, operation, stream) in [
        (
            11,
            publish(11, AckMode::Acked, "secret", records()),
            "publish",
            "secret",
        ),
        (
            12,
            publish(12, AckMode::Acked, "nowhere", records()),
            "publish",
            "nowhere",
        ),
        (13, create(13, "orders.us", 1), "create", "orders.us"),
        (
            14,
            Frame::DeleteStream {
                request_id: 14,
                name: "orders.eu".to_owned(),
            },
            "delete",
            "orders.eu",
        ),
        (
            15,
            Frame::DescribeStream {
                request_id: 15,
                name: "secret".to_owned(),
            },
            "describe",
            "secret",
        ),
    ] {
        let (request_id, code, message) = error_of(&request(&mut broker, &alice, frame));
        assert_eq!((request_id, code), (id, ErrorCode::PermissionDenied));
        assert_eq!(
            message,
            format!("alice may not {operation} stream {stream:?}")
        );
    }
    // A denied fire-and-forget publish gets no answer and is counted.
    assert!(
        request(
            &mut broker,
            &alice,
            publish(0, AckMode::FireAndForget, "secret", records())
        )
        .is_empty()
    );
    let denied = broker.cores[1].counters().denied;
    assert_eq!(
        denied,
        [3, 0, 1, 1, 1, 0],
        "publish x3, create, delete, describe"
    );
    // Describe of a stream alice may use works; the list holds only what she may see.
    let described = request(
        &mut broker,
        &alice,
        Frame::DescribeStream {
            request_id: 16,
            name: "orders.eu".to_owned(),
        },
    );
    assert!(
        matches!(described.as_slice(), [Frame::StreamInfo(_)]),
        "{described:?}"
    );
    let listed = request(&mut broker, &alice, Frame::ListStreams { request_id: 17 });
    let [Frame::StreamList { streams, .. }] = listed.as_slice() else {
        panic!("{listed:?}")
    };
    let names: Vec<&str> = streams.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["orders.eu", "public"]);
    // Subscriptions: granted by name (own rule, `*` rule), refused otherwise.
    for (name, allowed) in [("orders.eu", true), ("public", true), ("secret", false)] {
        let stream = broker.open(&alice);
        assert_eq!(
            broker.feed(1, stream, subscribe(20, name)),
            Flow::Subscribed
        );
        broker.settle();
        let (frames, finished) = broker.read_all(1, stream);
        if allowed {
            assert!(
                matches!(frames.as_slice(), [Frame::Subscribed(_)]),
                "{name}: {frames:?}"
            );
            assert!(!finished);
        } else {
            let (request_id, code, message) = error_of(&frames);
            assert_eq!((request_id, code), (20, ErrorCode::PermissionDenied));
            assert_eq!(message, "alice may not subscribe stream \"secret\"");
            assert!(finished, "a refused subscription ends its stream");
        }
    }
    // bob may subscribe to orders.eu only, and publishes nowhere.
    let bob = connect_as(&mut broker, 0, "bob");
    let (_, code, _) = error_of(&request(
        &mut broker,
        &bob,
        publish(30, AckMode::Acked, "orders.eu", records()),
    ));
    assert_eq!(code, ErrorCode::PermissionDenied);
    let listed = request(&mut broker, &bob, Frame::ListStreams { request_id: 31 });
    assert!(
        matches!(listed.as_slice(), [Frame::StreamList { streams, .. }] if streams.len() == 2),
        "bob sees orders.eu and public: {listed:?}"
    );
}

#[test]
fn the_shard_map_of_hello_ok_holds_only_visible_streams() {
    // Proves HelloOk's shard map leaks no stream the principal has no permission on.
    let policy = rules("ops admin *; carol publish logs.*");
    let mut broker = Broker::with_security(
        1,
        ingress(),
        Security::new(false, policy, ConnectionLimits::DEFAULT),
    );
    let ops = connect_as(&mut broker, 0, "ops");
    for (id, name) in [(1, "logs.app"), (2, "payroll")] {
        request(&mut broker, &ops, create(id, name, 1));
    }
    let (_, _, _, frames, _) = handshake(&mut broker, 0, Some(principal("carol")));
    let [Frame::HelloOk(ok)] = frames.as_slice() else {
        panic!("{frames:?}")
    };
    let names: Vec<&str> = ok
        .shard_map
        .iter()
        .map(|route| route.name.as_str())
        .collect();
    assert_eq!(names, ["logs.app"]);
    let (_, _, _, frames, _) = handshake(&mut broker, 0, Some(principal("ops")));
    assert!(matches!(frames.as_slice(), [Frame::HelloOk(ok)] if ok.shard_map.len() == 2));
}

#[test]
fn auth_required_refuses_a_hello_without_credentials() {
    // Proves FELIX_AUTH=required refuses a Hello with neither certificate nor token
    // (Unauthenticated, then the connection closes), and accepts a certificate's principal.
    let mut broker = Broker::with_security(
        1,
        ingress(),
        Security::new(true, Policy::open(), ConnectionLimits::DEFAULT),
    );
    let (id, stream, flow, frames, finished) = handshake(&mut broker, 0, None);
    assert_eq!(flow, Flow::Done);
    let (request_id, code, message) = error_of(&frames);
    assert_eq!((request_id, code), (0, ErrorCode::Unauthenticated));
    assert!(message.contains("FELIX_AUTH=required"), "{message}");
    assert!(finished);
    assert!(!broker.cores[0].handshake_done(id));
    let now = broker.now();
    assert_eq!(
        broker.cores[0].poll_transmit(now, stream).close_connection,
        Some(ErrorCode::Unauthenticated)
    );
    assert_eq!(broker.cores[0].counters().auth_refused, [1, 0, 0, 0, 0]);
    let dave = connect_as(&mut broker, 0, "dave");
    assert_eq!(
        broker.cores[0].principal_of(dave.id),
        Some(&principal("dave"))
    );
    // Open mode: no credential is the principal anonymous.
    let mut open = Broker::new(1, ingress());
    let conn = open.connect(0);
    assert_eq!(
        open.cores[0].principal_of(conn.id),
        Some(&Principal::anonymous())
    );
}

#[test]
fn a_token_parks_the_hello_until_the_shell_answers() {
    // Proves a Hello with a token waits for the shell's verdict: accepted as the token's
    // principal (HelloOk with the TOKEN feature), or refused with Unauthenticated and closed;
    // and a reload that drops the token revokes the connection it authenticated.
    let mut broker = Broker::new(1, ingress());
    let verdicts: [(Result<VerifiedToken, TokenRefusal>, Option<ErrorCode>); 3] = [
        (
            Ok(VerifiedToken {
                id: "00000000000000aa".to_owned(),
                principal: principal("erin"),
            }),
            None,
        ),
        (Err(TokenRefusal::Wrong), Some(ErrorCode::Unauthenticated)),
        (Err(TokenRefusal::Unknown), Some(ErrorCode::Unauthenticated)),
    ];
    let mut accepted = None;
    for (verdict, refusal) in verdicts {
        let id = broker.cores[0]
            .handle_connection_opened(None)
            .expect("room");
        let stream = broker.cores[0].handle_stream_opened(id);
        assert_eq!(
            broker.feed(0, stream, hello(Some(b"felix_token"))),
            Flow::Blocked
        );
        assert!(
            !broker.cores[0].accepts_frames(stream),
            "parked while checked"
        );
        let check = broker.cores[0]
            .poll_token_check()
            .expect("a token to check");
        assert_eq!(
            (check.stream, &check.token[..]),
            (stream, &b"felix_token"[..])
        );
        assert!(
            !format!("{check:?}").contains("felix_token"),
            "Debug hides the token"
        );
        let now = broker.now();
        broker.cores[0].handle_token_checked(now, stream, verdict);
        let (frames, finished) = broker.read_all(0, stream);
        match refusal {
            None => {
                let [Frame::HelloOk(ok)] = frames.as_slice() else {
                    panic!("{frames:?}")
                };
                assert_eq!(ok.features, FEATURE_TOKEN);
                assert!(!finished && broker.cores[0].accepts_frames(stream));
                assert_eq!(broker.cores[0].principal_of(id), Some(&principal("erin")));
                accepted = Some(id);
            }
            Some(code) => {
                let (_, got, message) = error_of(&frames);
                assert_eq!(got, code);
                assert!(message.starts_with("the token was refused"), "{message}");
                assert!(finished);
            }
        }
    }
    assert_eq!(broker.cores[0].counters().auth_refused, [0, 0, 1, 1, 0]);
    let accepted = accepted.expect("the first verdict accepted");
    // A reload keeping the token revokes nothing; one dropping it revokes the connection.
    assert!(
        broker.cores[0]
            .handle_tokens_reloaded(|_, _| true)
            .is_empty()
    );
    assert_eq!(
        broker.cores[0].handle_tokens_reloaded(|id, _| id != "00000000000000aa"),
        vec![accepted]
    );
    assert_eq!(
        broker.cores[0].counters().auth_refused[AuthRefusal::Revoked as usize],
        1
    );
    // A verdict for a stream that closed meanwhile is dropped.
    let id = broker.cores[0]
        .handle_connection_opened(None)
        .expect("room");
    let stream = broker.cores[0].handle_stream_opened(id);
    assert_eq!(broker.feed(0, stream, hello(Some(b"t"))), Flow::Blocked);
    let now = broker.now();
    broker.cores[0].handle_stream_closed(now, stream);
    broker.cores[0].handle_token_checked(now, stream, Err(TokenRefusal::Wrong));
    broker.collect();
}

#[test]
fn connection_limits_refuse_with_limit_exceeded_and_count() {
    // Proves connections per core, connections per principal over every core (released when
    // one closes), streams per connection and subscriptions per connection each refuse with
    // LimitExceeded naming its setting, count by kind, and leave other clients served.
    let limits = ConnectionLimits {
        connections_per_core: 3,
        connections_per_principal: 2,
        streams_per_connection: 3,
        subscriptions_per_connection: 1,
    };
    let mut broker =
        Broker::with_security(2, ingress(), Security::new(false, Policy::open(), limits));
    // Per principal, over both cores.
    let first = connect_as(&mut broker, 0, "frank");
    let _second = connect_as(&mut broker, 1, "frank");
    let (_, _, flow, frames, finished) = handshake(&mut broker, 1, Some(principal("frank")));
    assert_eq!(flow, Flow::Done);
    let (_, code, message) = error_of(&frames);
    assert_eq!(code, ErrorCode::LimitExceeded);
    assert!(
        message.contains("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL"),
        "{message}"
    );
    assert!(finished);
    broker.cores[0].handle_connection_closed(first.id);
    let again = connect_as(&mut broker, 0, "frank");
    // Per core: core 0 holds `again`; two more fill it, a fourth is refused.
    let other = connect_as(&mut broker, 0, "grace");
    let _third = connect_as(&mut broker, 0, "heidi");
    assert_eq!(
        broker.cores[0].handle_connection_opened(None),
        Err(ErrorCode::LimitExceeded)
    );
    // Streams per connection: the hello stream and two more; the fourth is refused.
    let s1 = broker.open(&other);
    let s2 = broker.open(&other);
    let s3 = broker.open(&other);
    let (frames, finished) = broker.read_all(0, s3);
    let (_, code, message) = error_of(&frames);
    assert_eq!(code, ErrorCode::LimitExceeded);
    assert!(
        message.contains("FELIX_MAX_STREAMS_PER_CONNECTION"),
        "{message}"
    );
    assert!(finished);
    let now = broker.now();
    broker.cores[0].handle_stream_closed(now, s3);
    broker.cores[0].handle_stream_closed(now, s2);
    // Subscriptions per connection: the second is refused; the first keeps going.
    request(&mut broker, &again, create(1, "events", 2));
    assert_eq!(broker.feed(0, s1, subscribe(5, "events")), Flow::Subscribed);
    broker.settle();
    assert!(matches!(
        broker.read(0, s1).as_slice(),
        [Frame::Subscribed(_)]
    ));
    let s4 = broker.open(&other);
    assert_eq!(broker.feed(0, s4, subscribe(6, "events")), Flow::Subscribed);
    broker.settle();
    let (frames, _) = broker.read_all(0, s4);
    let (request_id, code, message) = error_of(&frames);
    assert_eq!((request_id, code), (6, ErrorCode::LimitExceeded));
    assert!(
        message.contains("FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION"),
        "{message}"
    );
    // Another client is still served.
    let acked = request(
        &mut broker,
        &again,
        publish(7, AckMode::Acked, "events", vec![record("k", "v")]),
    );
    assert!(matches!(acked.as_slice(), [Frame::Ack(_)]), "{acked:?}");
    let mut counted = [0u64; Limit::ALL.len()];
    for core in &mut broker.cores {
        for (total, count) in counted.iter_mut().zip(core.counters().limits_exceeded) {
            *total += count;
        }
    }
    for (limit, count) in Limit::ALL.iter().zip(counted) {
        let expected = match limit {
            Limit::ConnectionsPerCore
            | Limit::ConnectionsPerPrincipal
            | Limit::StreamsPerConnection
            | Limit::SubscriptionsPerConnection => 1,
            _ => 0,
        };
        assert_eq!(count, expected, "{limit:?}");
    }
}

#[test]
fn stream_and_shard_limits_refuse_creates() {
    // Proves FELIX_MAX_STREAMS and FELIX_MAX_SHARDS_PER_STREAM refuse a create with
    // LimitExceeded and the request's id, counted on core 0 by kind.
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(1);
    let engine_max = broker.cores[0].engine().config().max_shards;
    let (request_id, code, message) = error_of(&request(
        &mut broker,
        &conn,
        create(3, "wide", engine_max + 1),
    ));
    assert_eq!((request_id, code), (3, ErrorCode::LimitExceeded));
    assert!(message.contains("FELIX_MAX_SHARDS_PER_STREAM"), "{message}");
    assert_eq!(
        broker.cores[0].counters().limits_exceeded[Limit::ShardsPerStream as usize],
        1
    );
}

#[test]
fn cluster_admin_requests_need_the_same_rules_as_the_brokers_own() {
    // Proves the cluster's admin requests are checked by the connection's rules before they
    // reach the cluster service (create and delete need `admin` on the name, a read needs
    // `subscribe`), an allowed one parks its stream until the service answers (`Done`, or the
    // records read, cut to one frame's worth), and a broker outside any cluster refuses them.
    use felix_core::{ClusterAdmin, ClusterAdminAnswer, ClusterRefusal, ClusterRequest};
    use felix_wire::{CreateClusterStream, DeliveredRecord, FsyncMode, ReadShard};

    let policy = rules("ops admin *; reader subscribe *");
    let mut broker = Broker::with_security(
        1,
        ingress(),
        Security::new(false, policy, ConnectionLimits::DEFAULT),
    );
    broker.cores[0].set_cluster_view(std::sync::Arc::new(felix_core::ClusterView {
        member: 1,
        ..felix_core::ClusterView::default()
    }));
    let create_cluster = |request_id: u64| {
        Frame::CreateClusterStream(CreateClusterStream {
            request_id,
            name: "orders".to_owned(),
            shard_count: 3,
            kind: StreamKind::Durable,
            replicas: 3,
            fsync: FsyncMode::OnCommit,
        })
    };
    let read = |request_id: u64| {
        Frame::ReadShard(ReadShard {
            request_id,
            stream: "orders".to_owned(),
            shard: 1,
            from: 5,
            max_records: 1_000_000,
        })
    };
    let delete = |request_id: u64| Frame::DeleteClusterStream {
        request_id,
        name: "orders".to_owned(),
    };
    let handed = |broker: &mut Broker| -> Vec<ClusterRequest> {
        std::iter::from_fn(|| broker.cores[0].poll_cluster()).collect()
    };
    // Denied before anything reaches the service.
    let reader = connect_as(&mut broker, 0, "reader");
    for (id, frame, operation) in [(1, create_cluster(1), "create"), (2, delete(2), "delete")] {
        let (request_id, code, message) = error_of(&request(&mut broker, &reader, frame));
        assert_eq!((request_id, code), (id, ErrorCode::PermissionDenied));
        assert_eq!(
            message,
            format!("reader may not {operation} stream \"orders\"")
        );
    }
    let ops = connect_as(&mut broker, 0, "ops");
    let (_, code, _) = error_of(&request(&mut broker, &ops, read(3)));
    assert_eq!(code, ErrorCode::PermissionDenied, "ops has no subscribe");
    assert!(
        handed(&mut broker).is_empty(),
        "nothing denied was handed on"
    );
    // Allowed: handed to the service, the stream waits for the answer.
    assert!(request(&mut broker, &ops, create_cluster(4)).is_empty());
    let [ClusterRequest::Admin { token, admin }] = &handed(&mut broker)[..] else {
        panic!("one admin request")
    };
    assert_eq!(
        admin,
        &ClusterAdmin::Create {
            name: "orders".to_owned(),
            kind: StreamKind::Durable,
            shard_count: 3,
            replicas: 3,
            fsync: FsyncMode::OnCommit,
        }
    );
    broker.cores[0].handle_cluster_admin(*token, Ok(ClusterAdminAnswer::Done));
    broker.cores[0].handle_cluster_admin(*token, Ok(ClusterAdminAnswer::Done));
    broker.settle();
    let frames = broker.read(0, ops.requests);
    assert!(
        matches!(frames.as_slice(), [Frame::Done { request_id: 4 }]),
        "one Done, a second answer ignored: {frames:?}"
    );
    // A read, capped at the broker's batch limit, answered with what fits one frame.
    assert!(request(&mut broker, &reader, read(5)).is_empty());
    let [ClusterRequest::Admin { token, admin }] = &handed(&mut broker)[..] else {
        panic!("one admin request")
    };
    let ClusterAdmin::Read { max_records, .. } = admin else {
        panic!("a read: {admin:?}")
    };
    assert_eq!(*max_records, felix_wire::Limits::DEFAULT.max_batch_records);
    let big = Bytes::from(vec![7u8; 4 << 20]);
    let records: Vec<DeliveredRecord> = (5..15)
        .map(|offset| DeliveredRecord {
            shard: 1,
            offset,
            timestamp_us: 1,
            key: Bytes::from_static(b"k"),
            payload: big.clone(),
        })
        .collect();
    broker.cores[0].handle_cluster_admin(*token, Ok(ClusterAdminAnswer::Records(records)));
    broker.settle();
    let frames = broker.read(0, reader.requests);
    let [Frame::Records(answer)] = frames.as_slice() else {
        panic!("one Records: {frames:?}")
    };
    assert_eq!(answer.request_id, 5);
    let offsets: Vec<u64> = answer.records.iter().map(|r| r.offset).collect();
    assert_eq!(
        offsets,
        vec![5, 6, 7],
        "as many 4 MiB records as fit 16 MiB"
    );
    // A refusal from the service reaches the client with its code.
    assert!(request(&mut broker, &ops, delete(6)).is_empty());
    let [ClusterRequest::Admin { token, .. }] = &handed(&mut broker)[..] else {
        panic!("one admin request")
    };
    broker.cores[0].handle_cluster_admin(
        *token,
        Err(ClusterRefusal {
            code: ErrorCode::StreamNotFound,
            detail: 0,
            message: "no stream named \"orders\"".to_owned(),
        }),
    );
    broker.settle();
    let (request_id, code, _) = error_of(&broker.read(0, ops.requests));
    assert_eq!((request_id, code), (6, ErrorCode::StreamNotFound));

    // A broker outside any cluster refuses them at once.
    let mut single = Broker::new(1, ingress());
    let conn = single.connect(0);
    for frame in [create_cluster(7), delete(8), read(9)] {
        let (_, code, message) = error_of(&request(&mut single, &conn, frame));
        assert_eq!(code, ErrorCode::InvalidArgument);
        assert!(message.contains("not a cluster member"), "{message}");
    }
    assert!(
        std::iter::from_fn(|| single.cores[0].poll_cluster())
            .next()
            .is_none()
    );
}
