//! In-memory cluster streams (`felix_cluster::memory`) through three cluster services in one
//! process (real QUIC peer connections with mutual TLS on loopback): each shard has one copy,
//! on its owner; publishes through any member reach the owner (forwarded), and a subscriber on
//! any member pulls the owner's records: every subscriber receives each shard's records once,
//! in offset order, as the acks placed them. With an owner stopped, publishes to its shards
//! through the others are answered `unavailable`-class errors while the other shards go on,
//! and a subscription to its shard is refused once the owner does not answer.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_cluster::control::{Command, Outcome, StreamKind};
use felix_cluster::publish::PublishError;
use felix_cluster::service::Service;
use felix_cluster::shard::ShardRecord;
use felix_cluster::subscribe::{
    Start, SubscribeError, SubscribeRequest, SubscriptionEvent, SubscriptionSink,
};

mod common;

use common::{Cluster, DEADLINE, wait_until};

const STREAM: &str = "ticks";
const SHARDS: u32 = 3;

fn subscribe(service: &Service, id: u64, start: Start) -> Receiver<SubscriptionEvent> {
    let (events, received) = channel();
    service.subscribe(
        SubscribeRequest {
            id,
            stream: STREAM.to_owned(),
            shards: (0..SHARDS).map(|shard| (shard, start)).collect(),
            max_records: 5,
            max_bytes: 1 << 20,
        },
        SubscriptionSink::new(move |event| {
            let _ = events.send(event);
        }),
    );
    received
}

/// Reads `events` (giving a credit back per batch) until `total` records arrived; returns
/// them per shard as `(offset, payload)`.
fn collect(
    service: &Service,
    id: u64,
    events: &Receiver<SubscriptionEvent>,
    total: usize,
) -> BTreeMap<u32, Vec<(u64, Bytes)>> {
    let mut got: BTreeMap<u32, Vec<(u64, Bytes)>> = BTreeMap::new();
    let deadline = Instant::now() + DEADLINE;
    while got.values().map(Vec::len).sum::<usize>() < total {
        assert!(
            Instant::now() < deadline,
            "subscriber {id} stalled: {got:?}"
        );
        match events.recv_timeout(Duration::from_millis(100)) {
            Ok(SubscriptionEvent::Started(_)) => {}
            Ok(SubscriptionEvent::Records(batch)) => {
                for delivered in batch {
                    got.entry(delivered.shard)
                        .or_default()
                        .push((delivered.offset, delivered.record.payload));
                }
                service.credit(id);
            }
            Ok(other) => panic!("subscriber {id}: {other:?}"),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => panic!("subscriber {id}: sink dropped"),
        }
    }
    got
}

#[test]
fn in_memory_shards_live_on_their_owner_and_any_member_publishes_and_subscribes() {
    let ids = [1u64, 2, 3];
    let cluster = Cluster::new(&ids);
    let mut services: BTreeMap<u64, Service> =
        ids.iter().map(|id| (*id, cluster.start(*id))).collect();
    // Every member registered first: placement spreads the owners over those registered.
    wait_until("every member is registered", || {
        services
            .values()
            .all(|service| service.status().state.members.len() == ids.len())
    });
    wait_until("the stream is created", || {
        matches!(
            services[&1].propose(
                Command::CreateStream {
                    name: STREAM.into(),
                    kind: StreamKind::InMemory,
                    shards: SHARDS,
                    replicas: 1,
                    fsync: Default::default(),
                },
                Duration::from_secs(5),
            ),
            Ok(Outcome::Done)
        )
    });
    wait_until("every member knows the stream", || {
        services
            .values()
            .all(|service| service.view().borrow().streams.contains_key(STREAM))
    });
    let owners: Vec<u64> = services[&1].view().borrow().streams[STREAM]
        .shards
        .iter()
        .map(|shard| shard.leader.expect("an owner"))
        .collect();
    let mut spread = owners.clone();
    spread.sort_unstable();
    spread.dedup();
    assert_eq!(spread.len(), 3, "one shard on each member: {owners:?}");

    // A subscriber on every member from the start, before anything is published.
    let subscribers: Vec<(u64, Receiver<SubscriptionEvent>)> = ids
        .iter()
        .map(|id| (*id, subscribe(&services[id], 10 + id, Start::Earliest)))
        .collect();
    for (id, events) in &subscribers {
        assert!(
            matches!(
                events.recv_timeout(DEADLINE),
                Ok(SubscriptionEvent::Started(started)) if started == vec![(0, 0), (1, 0), (2, 0)]
            ),
            "subscriber on member {id}"
        );
    }

    // Publish through every member to every shard: each ack gives the next offset.
    let mut expected: BTreeMap<u32, Vec<(u64, Bytes)>> = BTreeMap::new();
    let batches = 45u64;
    for n in 0..batches {
        let through = ids[usize::try_from(n).expect("small") % 3];
        let shard = u32::try_from(n / 3 % u64::from(SHARDS)).expect("small");
        let payload = Bytes::from(format!("n{n}"));
        let ack = services[&through]
            .publish_wait(
                STREAM,
                shard,
                vec![ShardRecord {
                    timestamp_us: n,
                    key: Bytes::new(),
                    payload: payload.clone(),
                }],
                Duration::from_secs(10),
            )
            .unwrap_or_else(|error| panic!("publish {n} through {through}: {error}"));
        let mine = expected.entry(shard).or_default();
        assert_eq!(
            ack.first_offset,
            mine.len() as u64,
            "dense offsets per shard"
        );
        mine.push((ack.first_offset, payload));
    }
    for (id, events) in &subscribers {
        let got = collect(&services[id], 10 + id, events, batches as usize);
        assert_eq!(got, expected, "subscriber on member {id}");
    }
    // A late subscriber from an offset, on a member that does not own shard 0.
    let late_on = ids
        .iter()
        .copied()
        .find(|id| *id != owners[0])
        .expect("two");
    let late = subscribe(&services[&late_on], 99, Start::Offset(3));
    let got = collect(&services[&late_on], 99, &late, (batches as usize) - 9);
    for (shard, records) in &got {
        assert_eq!(
            &expected[shard][3..],
            &records[..],
            "shard {shard} from offset 3"
        );
    }

    // Stop shard 0's owner: its shard is unreachable, the others go on.
    let stopped = owners[0];
    services
        .remove(&stopped)
        .expect("running")
        .shutdown()
        .expect("a clean stop");
    let other = ids.iter().copied().find(|id| *id != stopped).expect("two");
    let record = || {
        vec![ShardRecord {
            timestamp_us: 0,
            key: Bytes::new(),
            payload: Bytes::from_static(b"after"),
        }]
    };
    let refused = services[&other].publish_wait(STREAM, 0, record(), Duration::from_secs(2));
    assert!(
        matches!(
            refused,
            Err(PublishError::Timeout(_) | PublishError::OwnerUnreachable { .. })
        ),
        "{refused:?}"
    );
    let live_shard =
        u32::try_from(owners.iter().position(|o| *o != stopped).expect("two")).expect("small");
    services[&other]
        .publish_wait(STREAM, live_shard, record(), Duration::from_secs(10))
        .expect("a live owner's shard takes publishes");
    let unanswered = subscribe(&services[&other], 100, Start::Latest);
    assert!(
        matches!(
            unanswered.recv_timeout(DEADLINE),
            Ok(SubscriptionEvent::Refused(SubscribeError::OwnerUnreachable { owner, .. })) if owner == stopped
        ),
        "a subscription to the stopped owner's shard is refused"
    );
}
