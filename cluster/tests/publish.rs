//! Publishing into replicated shards through three cluster services in one process, each on
//! its own thread with real QUIC peer connections (mutual TLS) on loopback and real Felix logs
//! with fdatasync (`felix_cluster::publish`). Three publishers publish through the three
//! members at once while the leader of shard 0 is stopped and restarted on the same data;
//! then every member's copy is read back and audited:
//! - each shard's offsets are dense from 0 and every member holds the same records at them;
//! - every acknowledged batch is there exactly where its ack said, in its order;
//! - no record is there twice (retried proposals are applied once), none from nowhere.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use felix_cluster::control::{Command, Fsync, Outcome, StreamKind};
use felix_cluster::publish::{PublishAck, PublishAnswer, PublishError};
use felix_cluster::service::Service;
use felix_cluster::shard::ShardRecord;

mod common;

use common::{Cluster, DEADLINE, read_shard, settled_ends, wait_until};

const STREAM: &str = "orders";
const SHARDS: u32 = 3;
/// Batches each publisher sends (bounded: the test stops by itself).
const BATCHES: u64 = 200;
/// How long a publish may take to commit before its caller hears `timeout`.
const TIMEOUT: Duration = Duration::from_secs(10);
/// Batches each publisher keeps in flight.
const WINDOW: usize = 8;

fn payload(publisher: u64, batch: u64, record: u64) -> Bytes {
    Bytes::from(format!("p{publisher}-b{batch}-r{record}"))
}

/// An acknowledged batch: its shard, offsets and payloads.
#[derive(Debug)]
struct Acked {
    shard: u32,
    first_offset: u64,
    payloads: Vec<Bytes>,
}

#[test]
fn acked_batches_are_on_every_member_once_through_a_leader_restart() {
    acked_batches_survive_a_leader_restart(Fsync::OnCommit);
}

/// The same with periodic acknowledgements: a member counts an entry once written; a stopped
/// service (no power cut) must lose none of them.
#[test]
fn periodic_acked_batches_are_on_every_member_once_through_a_leader_restart() {
    acked_batches_survive_a_leader_restart(Fsync::Periodic);
}

fn acked_batches_survive_a_leader_restart(fsync: Fsync) {
    let ids = [1u64, 2, 3];
    let cluster = Cluster::new(&ids);
    let slots = cluster.start_slots(&ids);
    // Runs `f` on member `id`'s service (which must be running).
    let on = |id: u64, f: &mut dyn FnMut(&Service)| {
        f(slots[&id].lock().unwrap().as_ref().expect("running"));
    };
    let status = |id: u64| {
        let mut status = None;
        on(id, &mut |service| status = Some(service.status()));
        status.expect("set")
    };

    // The stream, created through member 1 once a control-plane leader is elected.
    wait_until("the stream is created", || {
        let mut created = false;
        on(1, &mut |service| {
            created = matches!(
                service.propose(
                    Command::CreateStream {
                        name: STREAM.into(),
                        kind: StreamKind::Durable,
                        shards: SHARDS,
                        replicas: 3,
                        fsync,
                    },
                    Duration::from_secs(5),
                ),
                Ok(Outcome::Done)
            );
        });
        created
    });
    wait_until("every member leads or follows every shard", || {
        ids.iter().all(|id| {
            let status = status(*id);
            status.shards.len() == SHARDS as usize
                && status.shards.iter().all(|shard| shard.leader.is_some())
        })
    });
    for id in ids {
        for shard in status(id).shards {
            assert_eq!(
                shard.fsync, fsync,
                "member {id}'s copy runs its log in the asked mode"
            );
        }
    }

    // Three publishers, one through each member, one batch in flight each.
    let publishers: Vec<_> = ids
        .iter()
        .map(|&id| {
            let slot = Arc::clone(&slots[&id]);
            std::thread::spawn(move || {
                let mut acked = Vec::new();
                let mut refused: HashMap<String, u64> = HashMap::new();
                let (answer, answered) =
                    std::sync::mpsc::channel::<(u64, Result<PublishAck, PublishError>)>();
                let mut in_flight: HashMap<u64, (u32, Vec<Bytes>)> = HashMap::new();
                let mut settle = |in_flight: &mut HashMap<u64, (u32, Vec<Bytes>)>| {
                    let (batch, result) = answered
                        .recv_timeout(TIMEOUT + DEADLINE)
                        .expect("every publish is answered");
                    let (shard, payloads) = in_flight.remove(&batch).expect("in flight");
                    match result {
                        Ok(ack) => {
                            assert_eq!(ack.count as usize, payloads.len(), "the ack covers it");
                            acked.push(Acked {
                                shard,
                                first_offset: ack.first_offset,
                                payloads,
                            });
                        }
                        Err(error) => {
                            let kind = match error {
                                PublishError::Timeout(_) => "timeout",
                                PublishError::Stopped => "stopped",
                                PublishError::Busy { .. } => "busy",
                                PublishError::NotReplicatedHere { .. } => "not_here",
                                PublishError::NoSuchStream { .. } => "no_stream",
                                PublishError::OwnerUnreachable { .. }
                                | PublishError::NotOwner { .. } => "in_memory",
                                PublishError::OffsetsUnknown => "offsets_unknown",
                            };
                            *refused.entry(kind.to_owned()).or_default() += 1;
                        }
                    }
                };
                for batch in 0..BATCHES {
                    while in_flight.len() >= WINDOW {
                        settle(&mut in_flight);
                    }
                    let shard = u32::try_from(batch % u64::from(SHARDS)).expect("small");
                    let count = 1 + batch % 4;
                    let payloads: Vec<Bytes> = (0..count).map(|r| payload(id, batch, r)).collect();
                    let records = payloads
                        .iter()
                        .map(|payload| ShardRecord {
                            timestamp_us: batch,
                            key: Bytes::new(),
                            payload: payload.clone(),
                        })
                        .collect();
                    in_flight.insert(batch, (shard, payloads));
                    // Handed over without waiting, so the member can be stopped while
                    // batches are in flight (they are answered `stopped`). While the member
                    // is stopped, its publisher waits for it.
                    let mut records = Some(records);
                    while records.is_some() {
                        if let Some(service) = slot.lock().unwrap().as_ref() {
                            let answer = answer.clone();
                            service.publish(
                                STREAM,
                                shard,
                                records.take().expect("once"),
                                TIMEOUT,
                                PublishAnswer::new(move |result| {
                                    let _ = answer.send((batch, result));
                                }),
                            );
                        } else {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
                while !in_flight.is_empty() {
                    settle(&mut in_flight);
                }
                (id, acked, refused)
            })
        })
        .collect();

    // Stop the leader of shard 0 while the publishers run, then start it again on its data.
    wait_until("some batches are acknowledged", || {
        status(1).shards.iter().any(|s| s.next_offset > 20)
    });
    let victim = status(2).shards[0].leader.expect("a leader");
    let stopped = slots[&victim].lock().unwrap().take().expect("running");
    stopped.shutdown().expect("a clean stop");
    eprintln!("stopped member {victim}, the leader of shard 0");
    let survivor = ids.iter().copied().find(|id| *id != victim).expect("two");
    wait_until("shard 0 has another leader", || {
        status(survivor).shards[0]
            .leader
            .is_some_and(|leader| leader != victim)
    });
    std::thread::sleep(Duration::from_millis(500));
    *slots[&victim].lock().unwrap() = Some(cluster.start(victim));
    eprintln!("restarted member {victim}");

    let mut acked = Vec::new();
    for publisher in publishers {
        let (id, batches, refused) = publisher.join().expect("publisher");
        eprintln!(
            "publisher {id}: {} batches acknowledged, refused: {refused:?}",
            batches.len()
        );
        acked.extend(batches);
    }
    assert!(
        acked.len() as u64 > BATCHES,
        "most batches are acknowledged ({} of {})",
        acked.len(),
        3 * BATCHES
    );

    // Every member catches up to the same end of every shard, nothing pending anywhere (a
    // batch refused `timeout` may still commit; the copies are read after).
    let ends = |id: u64| settled_ends(slots[&id].lock().unwrap().as_ref().expect("running"));
    wait_until("every member holds the same records", || {
        let first = ends(1);
        first
            .as_ref()
            .is_some_and(|first| first.len() == SHARDS as usize)
            && ids.iter().all(|id| ends(*id) == first)
    });

    // Read every member's copy.
    let mut copies: BTreeMap<u64, Vec<Vec<Bytes>>> = BTreeMap::new();
    for id in ids {
        let guard = slots[&id].lock().unwrap();
        let service = guard.as_ref().expect("running");
        let mut shards = Vec::new();
        for shard in 0..SHARDS {
            let mut records = Vec::new();
            for (offset, record) in read_shard(service, STREAM, shard) {
                assert_eq!(offset, records.len() as u64, "offsets are dense");
                records.push(record.payload);
            }
            shards.push(records);
        }
        copies.insert(id, shards);
    }
    let reference = &copies[&1];
    for (id, copy) in &copies {
        assert_eq!(
            copy, reference,
            "member {id} holds the same records as member 1"
        );
    }
    let mut seen = HashSet::new();
    for records in reference {
        for payload in records {
            assert!(seen.insert(payload.clone()), "{payload:?} is there twice");
            let text = std::str::from_utf8(payload).expect("utf8");
            assert!(text.starts_with('p'), "{text} came from nowhere");
        }
    }
    for batch in &acked {
        let records = &reference[batch.shard as usize];
        let at = usize::try_from(batch.first_offset).expect("small");
        assert_eq!(
            records.get(at..at + batch.payloads.len()),
            Some(&batch.payloads[..]),
            "an acknowledged batch is where its ack said"
        );
    }
    eprintln!(
        "audit: {} acknowledged batches, {} records in {SHARDS} shards, the same on 3 members",
        acked.len(),
        seen.len()
    );
}

#[test]
fn every_publish_is_answered_when_the_service_stops_with_requests_queued() {
    // Member 1 of three, alone: its publishes queue on its thread; it stops at once.
    let cluster = Cluster::new(&[1, 2, 3]);
    let service = cluster.start(1);
    let (answer, answered) = std::sync::mpsc::channel();
    let sent = 2_000;
    for n in 0..sent {
        let answer = answer.clone();
        service.publish(
            STREAM,
            0,
            vec![ShardRecord {
                timestamp_us: n,
                key: Bytes::new(),
                payload: Bytes::from_static(b"x"),
            }],
            TIMEOUT,
            PublishAnswer::new(move |result| {
                let _ = answer.send(result);
            }),
        );
    }
    service.shutdown().expect("a clean stop");
    drop(answer);
    // Every publish answered once, without waiting: no stream, or stopped before its turn.
    let answers: Vec<_> = answered.iter().collect();
    assert_eq!(answers.len() as u64, sent);
    assert!(answers.iter().all(|answer| matches!(
        answer,
        Err(PublishError::NoSuchStream { .. } | PublishError::Stopped | PublishError::Busy { .. })
    )));
}
