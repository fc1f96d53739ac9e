//! Ingress overload on logical time (docs/semantics.md, 3 Publishing): a two-core broker
//! whose core 1 takes no messages until the test releases it, so a publish forwarded from
//! core 0 to core 1 holds core 0's only ingress slot for exactly as long as the test wants.
//! These replace the end-to-end tests that paused a real core through a test-only knob.

mod support;

use std::time::Duration;

use felix_core::{Flow, INGRESS_EXHAUSTED_MESSAGE};
use felix_wire::{AckMode, ErrorCode, Frame, StreamKind};
use support::{Broker, Conn, ingress, key_on_core, publish, record};

/// A two-core broker with a one-job ingress queue, stream "held" (2 shards), a client on
/// core 0 and a key owned by core 1; core 1's inbox is held.
fn held_broker(settings: felix_core::IngressSettings) -> (Broker, Conn, String) {
    let mut broker = Broker::new(2, settings);
    let conn = broker.connect(0);
    assert!(matches!(
        broker.create(&conn, "held", 2, StreamKind::InMemory),
        Frame::StreamInfo(_)
    ));
    let key = key_on_core(2, 2, 1);
    broker.held[1] = true;
    (broker, conn, key)
}

fn one_job() -> felix_core::IngressSettings {
    felix_core::IngressSettings {
        depth: 1,
        ..ingress()
    }
}

fn refusal(frame: &Frame) -> (u64, ErrorCode, &str) {
    match frame {
        Frame::Error(error) => (error.request_id, error.code, error.message.as_str()),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn full_ingress_sheds_fire_and_forget_and_refuses_acked() {
    // Proves shed = sent - accepted for fire-and-forget and the exact refusal text for acked.
    let (mut broker, conn, key) = held_broker(one_job());
    let stream = conn.requests;
    let x = "x".repeat(100);
    // Holds the only slot: its part waits in core 1's held inbox.
    let flow = broker.feed(
        0,
        stream,
        publish(10, AckMode::Acked, "held", vec![record(&key, &x)]),
    );
    assert_eq!(flow, Flow::Continue);
    assert_eq!(broker.queued_for(1), 1);
    let sent = 5;
    for request_id in 0..sent {
        let frame = publish(
            20 + request_id,
            AckMode::FireAndForget,
            "held",
            vec![record(&key, &x)],
        );
        assert_eq!(broker.feed(0, stream, frame), Flow::Continue);
    }
    assert_eq!(
        broker.feed(
            0,
            stream,
            publish(30, AckMode::Acked, "held", vec![record(&key, &x)])
        ),
        Flow::Continue
    );
    let frames = broker.read(0, stream);
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(
        refusal(&frames[0]),
        (
            30,
            ErrorCode::IngressBudgetExhausted,
            INGRESS_EXHAUSTED_MESSAGE
        )
    );
    assert_eq!(
        INGRESS_EXHAUSTED_MESSAGE,
        "publish ingress byte budget exhausted"
    );
    broker.held[1] = false;
    broker.settle();
    let frames = broker.read(0, stream);
    assert!(
        matches!(frames.as_slice(), [Frame::Ack(ack)] if ack.request_id == 10),
        "the held publish completes: {frames:?}"
    );
    let counters = broker.cores[0].counters().clone();
    assert_eq!(counters.shed, sent, "the queue was full for every one");
    assert_eq!(counters.publishes_fire_and_forget + counters.shed, sent);
    assert_eq!(counters.refused, 1);
    assert_eq!(counters.errors_of(ErrorCode::IngressBudgetExhausted), 1);
    assert_eq!(counters.ingress_depth, 0);
}

#[test]
fn ingress_wait_sheds_nothing_and_other_streams_keep_serving() {
    // Proves FELIX_PUB_INGRESS_WAIT=1 makes fire-and-forget wait (sent = accepted), and a
    // connection with a waiting publish still answers on its other streams.
    let (mut broker, conn, key) = held_broker(felix_core::IngressSettings {
        fire_and_forget_waits: true,
        ..one_job()
    });
    let stream = conn.requests;
    let sent = 4;
    let mut flows = Vec::new();
    for request_id in 0..sent {
        flows.push(broker.feed(
            0,
            stream,
            publish(
                request_id,
                AckMode::FireAndForget,
                "held",
                vec![record(&key, "x")],
            ),
        ));
        if flows.last() == Some(&Flow::Blocked) {
            break;
        }
    }
    // The first takes the slot, the second waits and parks its stream: later frames of that
    // stream are not read (QUIC flow control holds them).
    assert_eq!(flows, vec![Flow::Continue, Flow::Blocked]);
    assert!(!broker.cores[0].accepts_frames(stream));
    assert_eq!(broker.cores[0].counters().waits, 1);
    let other = broker.open(&conn);
    assert_eq!(
        broker.feed(0, other, Frame::ListStreams { request_id: 99 }),
        Flow::Continue
    );
    let frames = broker.read(0, other);
    assert!(
        matches!(frames.as_slice(), [Frame::StreamList { request_id: 99, streams }] if streams.len() == 1),
        "another stream of the connection is served: {frames:?}"
    );
    // Core 1 takes its messages: the slot frees, the waiter is admitted, the stream goes on.
    broker.held[1] = false;
    broker.settle();
    assert!(broker.cores[0].accepts_frames(stream));
    for request_id in 2..sent {
        let flow = broker.feed(
            0,
            stream,
            publish(
                request_id,
                AckMode::FireAndForget,
                "held",
                vec![record(&key, "x")],
            ),
        );
        assert!(matches!(flow, Flow::Continue | Flow::Blocked));
        broker.settle();
    }
    let counters = broker.cores[0].counters().clone();
    assert_eq!(
        counters.publishes_fire_and_forget, sent,
        "every one was accepted"
    );
    assert_eq!(counters.shed, 0);
}

#[test]
fn ack_on_commit_waits_then_is_refused() {
    // Proves an ack-on-commit publish waits FELIX_PUBLISH_QUEUE_WAIT_MS for room, and is
    // refused at that deadline, not before (on logical time).
    let (mut broker, conn, key) = held_broker(felix_core::IngressSettings {
        ack_on_commit: true,
        commit_wait: Duration::from_millis(300),
        ..one_job()
    });
    let stream = conn.requests;
    assert_eq!(
        broker.feed(
            0,
            stream,
            publish(1, AckMode::Acked, "held", vec![record(&key, "x")])
        ),
        Flow::Continue
    );
    assert_eq!(
        broker.feed(
            0,
            stream,
            publish(2, AckMode::Acked, "held", vec![record(&key, "x")])
        ),
        Flow::Blocked
    );
    broker.advance(Duration::from_millis(299));
    assert!(broker.read(0, stream).is_empty(), "still waiting at 299 ms");
    assert!(!broker.cores[0].accepts_frames(stream));
    broker.advance(Duration::from_millis(1));
    let frames = broker.read(0, stream);
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(
        refusal(&frames[0]),
        (
            2,
            ErrorCode::IngressBudgetExhausted,
            INGRESS_EXHAUSTED_MESSAGE
        )
    );
    assert!(broker.cores[0].accepts_frames(stream), "the stream goes on");
    broker.held[1] = false;
    broker.settle();
    let frames = broker.read(0, stream);
    assert!(matches!(frames.as_slice(), [Frame::Ack(ack)] if ack.request_id == 1));
}

#[test]
fn waiters_are_admitted_oldest_first_one_per_freed_slot() {
    // Proves one waiting publish is admitted per freed slot, oldest first, across streams.
    let (mut broker, conn, key) = held_broker(felix_core::IngressSettings {
        fire_and_forget_waits: true,
        ..one_job()
    });
    assert_eq!(
        broker.feed(
            0,
            conn.requests,
            publish(1, AckMode::FireAndForget, "held", vec![record(&key, "x")])
        ),
        Flow::Continue
    );
    let streams: Vec<_> = (0..3).map(|_| broker.open(&conn)).collect();
    for (index, &stream) in streams.iter().enumerate() {
        let frame = publish(
            10 + index as u64,
            AckMode::FireAndForget,
            "held",
            vec![record(&key, "x")],
        );
        assert_eq!(broker.feed(0, stream, frame), Flow::Blocked);
    }
    // Each forwarded part answered frees the slot once: exactly the oldest waiter goes on.
    for admitted in 0..streams.len() {
        assert!(broker.deliver_one(1), "core 1 takes the held part");
        assert!(broker.deliver_one(0), "core 0 gets its answer");
        for (index, &stream) in streams.iter().enumerate() {
            assert_eq!(
                broker.cores[0].accepts_frames(stream),
                index <= admitted,
                "after {} freed slots, waiter {index}",
                admitted + 1
            );
        }
    }
}

#[test]
fn closing_a_parked_stream_withdraws_its_publish() {
    // Proves a stream closed while its publish waits frees nothing it did not hold and the
    // next waiter still gets the slot.
    let (mut broker, conn, key) = held_broker(felix_core::IngressSettings {
        fire_and_forget_waits: true,
        ..one_job()
    });
    assert_eq!(
        broker.feed(
            0,
            conn.requests,
            publish(1, AckMode::FireAndForget, "held", vec![record(&key, "x")])
        ),
        Flow::Continue
    );
    let first = broker.open(&conn);
    let second = broker.open(&conn);
    for (stream, id) in [(first, 2), (second, 3)] {
        let frame = publish(id, AckMode::FireAndForget, "held", vec![record(&key, "x")]);
        assert_eq!(broker.feed(0, stream, frame), Flow::Blocked);
    }
    let now = broker.now();
    broker.cores[0].handle_stream_closed(now, first);
    broker.collect();
    assert_eq!(broker.cores[0].counters().ingress_waiting, 1);
    broker.held[1] = false;
    broker.settle();
    assert!(
        broker.cores[0].accepts_frames(second),
        "the next waiter was admitted"
    );
    let counters = broker.cores[0].counters().clone();
    assert_eq!(
        counters.publishes_fire_and_forget, 2,
        "the first and the second"
    );
    assert_eq!((counters.ingress_depth, counters.ingress_waiting), (0, 0));
}
