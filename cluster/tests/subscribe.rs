//! Subscribing to replicated shards on every member (`felix_cluster::subscribe`), through
//! three cluster services in one process (real QUIC peer connections with mutual TLS on
//! loopback, real Felix logs with fdatasync):
//! - a subscriber on each member, leader or follower, receives every committed record of the
//!   shards it selected once, in offset order, with the offsets and payloads every member's
//!   copy holds, while publishes go through all three members and the leader of shard 0 is
//!   stopped and restarted; the stopped member's subscriber hears `Ended(Stopped)`, and a
//!   subscriber on the restarted member reads everything from the start;
//! - a subscriber holds at most its credits of batches, and resumes from its cursor;
//! - refusals name what is wrong.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_cluster::publish::{PublishAck, PublishAnswer, PublishError};
use felix_cluster::service::Service;
use felix_cluster::shard::ShardRecord;
use felix_cluster::subscribe::{
    CREDITS, Delivered, Start, SubscribeError, SubscribeRequest, SubscriptionEvent,
    SubscriptionSink,
};

mod common;

use common::{Cluster, DEADLINE, Slot, create_stream, read_shard, settled_ends, wait_until};

const STREAM: &str = "orders";
const SHARDS: u32 = 2;
const TIMEOUT: Duration = Duration::from_secs(10);

/// Subscribes `id` on `service` to every shard from `start`; the events arrive on the
/// returned receiver.
fn subscribe(
    service: &Service,
    id: u64,
    shards: Vec<(u32, Start)>,
    max_records: usize,
) -> Receiver<SubscriptionEvent> {
    let (events, received) = channel();
    service.subscribe(
        SubscribeRequest {
            id,
            stream: STREAM.to_owned(),
            shards,
            max_records,
            max_bytes: 1 << 20,
        },
        SubscriptionSink::new(move |event| {
            let _ = events.send(event);
        }),
    );
    received
}

fn all_from(start: Start) -> Vec<(u32, Start)> {
    (0..SHARDS).map(|shard| (shard, start)).collect()
}

/// What one subscriber received: per shard, `(offset, payload)` in arrival order.
#[derive(Debug, Default)]
struct Received {
    started: Vec<(u32, u64)>,
    records: BTreeMap<u32, Vec<(u64, Bytes)>>,
    ended: Option<SubscribeError>,
}

/// Consumes `events` on its own thread, giving a credit back on member `member`'s service
/// for each batch, until it holds every record below `ends` (once set) or hears `Ended`.
fn consume(
    slot: Slot,
    id: u64,
    events: Receiver<SubscriptionEvent>,
    ends: Arc<Mutex<Option<Vec<u64>>>>,
) -> std::thread::JoinHandle<Received> {
    std::thread::spawn(move || {
        let mut received = Received::default();
        let deadline = Instant::now() + DEADLINE * 3;
        loop {
            let done = ends.lock().unwrap().as_ref().is_some_and(|ends| {
                (0..SHARDS).all(|shard| {
                    received
                        .records
                        .get(&shard)
                        .and_then(|records| records.last())
                        .map_or(0, |(offset, _)| offset + 1)
                        >= ends[shard as usize]
                })
            });
            if done {
                return received;
            }
            assert!(
                Instant::now() < deadline,
                "subscriber {id} is stuck: {received:?}"
            );
            match events.recv_timeout(Duration::from_millis(100)) {
                Ok(SubscriptionEvent::Started(started)) => received.started = started,
                Ok(SubscriptionEvent::Records(batch)) => {
                    for Delivered {
                        shard,
                        offset,
                        record,
                    } in batch
                    {
                        received
                            .records
                            .entry(shard)
                            .or_default()
                            .push((offset, record.payload));
                    }
                    if let Some(service) = slot.lock().unwrap().as_ref() {
                        service.credit(id);
                    }
                }
                Ok(SubscriptionEvent::Ended(error)) => {
                    received.ended = Some(error);
                    return received;
                }
                Ok(SubscriptionEvent::Refused(error)) => panic!("subscriber {id} refused: {error}"),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => panic!("subscriber {id}: sink dropped"),
            }
        }
    })
}

/// Every committed record of every shard, read from `service`'s copy.
fn copy_of(service: &Service) -> Vec<Vec<Bytes>> {
    (0..SHARDS)
        .map(|shard| {
            read_shard(service, STREAM, shard)
                .into_iter()
                .map(|(_, record)| record.payload)
                .collect()
        })
        .collect()
}

/// `received` holds each shard's records once, in order, from its start on, as `copy` does.
fn assert_matches_copy(who: &str, received: &Received, copy: &[Vec<Bytes>], complete: bool) {
    for (shard, start) in &received.started {
        let got = received.records.get(shard).map_or(&[][..], Vec::as_slice);
        for (position, (offset, payload)) in got.iter().enumerate() {
            assert_eq!(
                *offset,
                start + position as u64,
                "{who}: shard {shard}'s offsets are consecutive from its start"
            );
            assert_eq!(
                copy[*shard as usize].get(usize::try_from(*offset).expect("small")),
                Some(payload),
                "{who}: shard {shard} offset {offset} is the committed record"
            );
        }
        if complete {
            assert_eq!(
                start + got.len() as u64,
                copy[*shard as usize].len() as u64,
                "{who}: shard {shard} delivered to the end"
            );
        }
    }
}

#[test]
fn subscribers_on_every_member_read_committed_records_once_in_order_through_a_leader_stop() {
    let ids = [1u64, 2, 3];
    let cluster = Cluster::new(&ids);
    let slots = cluster.start_slots(&ids);
    let status = |id: u64| {
        slots[&id]
            .lock()
            .unwrap()
            .as_ref()
            .expect("running")
            .status()
    };
    {
        let guards: Vec<_> = ids.iter().map(|id| slots[id].lock().unwrap()).collect();
        let services: Vec<&Service> = guards.iter().map(|g| g.as_ref().unwrap()).collect();
        create_stream(&services, STREAM, SHARDS);
    }

    // A subscriber on every member from the start, before anything is published.
    let ends: Arc<Mutex<Option<Vec<u64>>>> = Arc::default();
    let mut subscribers = Vec::new();
    for id in ids {
        let events = subscribe(
            slots[&id].lock().unwrap().as_ref().unwrap(),
            10 + id,
            all_from(Start::Earliest),
            7,
        );
        subscribers.push((
            id,
            consume(Arc::clone(&slots[&id]), 10 + id, events, Arc::clone(&ends)),
        ));
    }

    // Publish through every member in turn; stop shard 0's leader part-way and restart it.
    let batches = 120u64;
    let (answer, answered) = channel::<Result<PublishAck, PublishError>>();
    let mut victim = None;
    let mut sent = 0;
    let mut answers = 0;
    for batch in 0..batches {
        if batch == batches / 3 {
            let leader = status(1).shards[0].leader.expect("a leader");
            let service = slots[&leader].lock().unwrap().take().expect("running");
            service.shutdown().expect("a clean stop");
            eprintln!("stopped member {leader}, the leader of shard 0");
            victim = Some(leader);
        }
        if batch == 2 * batches / 3 {
            let leader = victim.expect("stopped");
            *slots[&leader].lock().unwrap() = Some(cluster.start(leader));
            eprintln!("restarted member {leader}");
        }
        let through = ids[usize::try_from(batch).expect("small") % ids.len()];
        let guard = slots[&through].lock().unwrap();
        let Some(service) = guard.as_ref() else {
            continue;
        };
        let shard = u32::try_from(batch % u64::from(SHARDS)).expect("small");
        let records = (0..1 + batch % 3)
            .map(|r| ShardRecord {
                timestamp_us: batch,
                key: Bytes::new(),
                payload: Bytes::from(format!("b{batch}-r{r}")),
            })
            .collect();
        let answer = answer.clone();
        service.publish(
            STREAM,
            shard,
            records,
            TIMEOUT,
            PublishAnswer::new(move |result| {
                let _ = answer.send(result);
            }),
        );
        sent += 1;
        drop(guard);
        // Keep a few in flight: wait for one answer every fourth publish.
        if sent % 4 == 0 {
            // Answered (acked, or refused: a timed-out batch may still commit).
            let _outcome = answered
                .recv_timeout(TIMEOUT + DEADLINE)
                .expect("every publish is answered");
            answers += 1;
        }
    }
    let victim = victim.expect("stopped");
    // Every publish is answered (a timed-out one may still commit: see below).
    while answers < sent {
        let _outcome = answered
            .recv_timeout(TIMEOUT + DEADLINE)
            .expect("every publish is answered");
        answers += 1;
    }

    // Every member catches up to the same ends with nothing pending anywhere (a batch still
    // pending would commit after the ends are taken); the subscribers then stop there.
    let ends_of = |id: u64| settled_ends(slots[&id].lock().unwrap().as_ref().expect("running"));
    wait_until("every member holds the same records, none pending", || {
        let first = ends_of(1);
        first
            .as_ref()
            .is_some_and(|first| first.len() == SHARDS as usize && first.iter().sum::<u64>() > 0)
            && ids.iter().all(|id| ends_of(*id) == first)
    });
    // A subscriber on the restarted member, from the start: it reads its own copy's log.
    let late = subscribe(
        slots[&victim].lock().unwrap().as_ref().unwrap(),
        99,
        all_from(Start::Earliest),
        64,
    );
    subscribers.push((
        victim,
        consume(Arc::clone(&slots[&victim]), 99, late, Arc::clone(&ends)),
    ));
    *ends.lock().unwrap() = ends_of(1);

    let copy = copy_of(slots[&1].lock().unwrap().as_ref().unwrap());
    for (index, (id, subscriber)) in subscribers.into_iter().enumerate() {
        let received = subscriber.join().expect("subscriber");
        let who = format!("subscriber {index} on member {id}");
        let total: usize = received.records.values().map(Vec::len).sum();
        if index < ids.len() && id == victim {
            // The first subscriber on the stopped member: a prefix, then `stopped`.
            assert_eq!(received.ended, Some(SubscribeError::Stopped), "{who}");
            assert_matches_copy(&who, &received, &copy, false);
        } else {
            assert_eq!(received.ended, None, "{who}");
            assert_eq!(
                received.started,
                vec![(0, 0), (1, 0)],
                "{who} starts at the oldest offsets"
            );
            assert_matches_copy(&who, &received, &copy, true);
        }
        eprintln!("{who}: {total} records, ended: {:?}", received.ended);
    }
    // Every member's copy is the same (the subscribers compared against member 1's).
    for id in ids {
        assert_eq!(
            copy_of(slots[&id].lock().unwrap().as_ref().unwrap()),
            copy,
            "member {id}"
        );
    }
}

#[test]
fn a_subscriber_holds_at_most_its_credits_and_refusals_name_the_mistake() {
    let ids = [1u64, 2, 3];
    let cluster = Cluster::new(&ids);
    let services: Vec<Service> = ids.iter().map(|id| cluster.start(*id)).collect();
    let refs: Vec<&Service> = services.iter().collect();
    create_stream(&refs, STREAM, SHARDS);
    let follower = refs
        .iter()
        .copied()
        .find(|service| {
            let status = service.status();
            status.shards[0].leader != Some(status.node.id)
        })
        .expect("a follower of shard 0");

    // Refusals.
    let refused = |events: Receiver<SubscriptionEvent>| match events.recv_timeout(DEADLINE) {
        Ok(SubscriptionEvent::Refused(error)) => error,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let unknown = {
        let (events, received) = channel();
        follower.subscribe(
            SubscribeRequest {
                id: 1,
                stream: "nope".to_owned(),
                shards: vec![(0, Start::Latest)],
                max_records: 10,
                max_bytes: 1 << 20,
            },
            SubscriptionSink::new(move |event| {
                let _ = events.send(event);
            }),
        );
        refused(received)
    };
    assert!(
        matches!(unknown, SubscribeError::NoSuchStream { .. }),
        "{unknown}"
    );
    let beyond = refused(subscribe(follower, 2, vec![(0, Start::Offset(5))], 10));
    assert_eq!(
        beyond,
        SubscribeError::BeyondEnd {
            shard: 0,
            offset: 5,
            next: 0
        }
    );
    let no_shard = refused(subscribe(follower, 3, vec![(SHARDS, Start::Latest)], 10));
    assert!(
        matches!(no_shard, SubscribeError::NoSuchShard { .. }),
        "{no_shard}"
    );

    // Subscription 7 on shard 0 from the start, two records per batch, never credited.
    let events = subscribe(follower, 7, vec![(0, Start::Earliest)], 2);
    assert!(matches!(
        events.recv_timeout(DEADLINE),
        Ok(SubscriptionEvent::Started(started)) if started == vec![(0, 0)]
    ));
    let in_use = refused(subscribe(follower, 7, vec![(0, Start::Latest)], 2));
    assert_eq!(in_use, SubscribeError::IdInUse(7));
    wait_until("the status counts the subscription", || {
        follower.status().subscriptions == 1
    });
    let published = 20u64;
    for n in 0..published {
        let record = ShardRecord {
            timestamp_us: n,
            key: Bytes::new(),
            payload: Bytes::from(format!("r{n}")),
        };
        let ack = refs[usize::try_from(n).expect("small") % 3]
            .publish_wait(STREAM, 0, vec![record], TIMEOUT)
            .expect("acked");
        assert_eq!(ack.count, 1);
    }
    // Once the follower applied all twenty (its status shows it, and every round pumps the
    // subscriptions before the status is refreshed), exactly CREDITS batches were sent.
    wait_until("the follower applied every record", || {
        follower.status().shards[0].next_offset == published
    });
    let batches: Vec<Vec<Delivered>> = events
        .try_iter()
        .map(|event| match event {
            SubscriptionEvent::Records(batch) => batch,
            other => panic!("expected records, got {other:?}"),
        })
        .collect();
    assert_eq!(batches.len(), CREDITS as usize, "no more than the credits");
    // A batch holds what was committed when it was read, at most two records.
    assert!(batches.iter().all(|batch| (1..=2).contains(&batch.len())));
    // Each credit brings one more batch, from where the cursor stopped, to the end.
    let mut offsets: Vec<u64> = batches.iter().flatten().map(|d| d.offset).collect();
    while (offsets.len() as u64) < published {
        follower.credit(7);
        match events.recv_timeout(DEADLINE) {
            Ok(SubscriptionEvent::Records(batch)) => {
                offsets.extend(batch.iter().map(|d| d.offset));
            }
            other => panic!("expected records, got {other:?}"),
        }
    }
    assert_eq!(offsets, (0..published).collect::<Vec<_>>());

    // An unsubscribed subscription is forgotten; a stopping service ends the others.
    follower.unsubscribe(7);
    let again = subscribe(follower, 8, vec![(0, Start::Offset(published))], 2);
    assert!(matches!(
        again.recv_timeout(DEADLINE),
        Ok(SubscriptionEvent::Started(started)) if started == vec![(0, published)]
    ));
    drop(services);
    assert!(matches!(
        again.recv_timeout(DEADLINE),
        Ok(SubscriptionEvent::Ended(SubscribeError::Stopped))
    ));
    // Subscription 7 heard nothing after its last batch, not even the stop.
    assert!(matches!(
        events.try_recv(),
        Err(std::sync::mpsc::TryRecvError::Disconnected)
    ));
}
