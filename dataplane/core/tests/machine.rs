//! The per-core state machine driven by hand: the handshake, publish routing and the merged
//! ack, catalogue changes through core 0, subscriptions across cores under credits, and the
//! durable ack as one output written straight to the stream it answers.

mod support;

use felix_core::{CatalogChange, DurableLog, DurableSettings, Flow, REMOTE_DELIVERY_CREDITS};
use felix_storage::{BackendChoice, FaultBackend, FsyncMode};
use felix_wire::{
    AckMode, ErrorCode, Frame, Hello, PROTOCOL_VERSION, ShardSelection, StartPosition, StreamKind,
    Subscribe,
};
use support::{Broker, ingress, key_on_core, publish, record};

#[test]
fn handshake_refusals_close_the_connection() {
    // Proves a bad version or a first frame other than Hello is answered and closes.
    let mut broker = Broker::new(1, ingress());
    for first in [
        Frame::Hello(Hello {
            min_version: PROTOCOL_VERSION + 1,
            max_version: PROTOCOL_VERSION + 1,
            features: 0,
            client_name: "new".to_owned(),
            token: None,
        }),
        Frame::ListStreams { request_id: 1 },
    ] {
        let id = broker.cores[0]
            .handle_connection_opened(None)
            .expect("room");
        let stream = broker.cores[0].handle_stream_opened(id);
        assert_eq!(broker.feed(0, stream, first), Flow::Done);
        let now = broker.now();
        let transmit = broker.cores[0].poll_transmit(now, stream);
        assert!(!transmit.chunks.is_empty() && transmit.finish);
        assert!(matches!(
            transmit.close_connection,
            Some(ErrorCode::UnsupportedVersion | ErrorCode::ProtocolViolation)
        ));
        assert!(!broker.cores[0].handshake_done(id));
    }
}

#[test]
fn a_split_publish_is_acked_once_in_shard_order() {
    // Proves a naive client's batch spanning cores is split by owner, each part appended on
    // its owner, and answered by one Ack in ascending shard order with dense offsets.
    let mut broker = Broker::new(3, ingress());
    let conn = broker.connect(1);
    assert!(matches!(
        broker.create(&conn, "orders", 6, StreamKind::InMemory),
        Frame::StreamInfo(info) if info.shards.iter().all(|s| s.core == (s.shard % 3) as u16)
    ));
    let records: Vec<_> = (0..30).map(|i| record(&format!("key-{i}"), "p")).collect();
    assert_eq!(
        broker.feed(
            1,
            conn.requests,
            publish(7, AckMode::Acked, "orders", records.clone())
        ),
        Flow::Continue
    );
    assert!(
        broker.read(1, conn.requests).is_empty(),
        "parts on other cores are pending"
    );
    assert_eq!(broker.cores[1].counters().cross_core_hops, 2);
    broker.settle();
    let frames = broker.read(1, conn.requests);
    let Frame::Ack(ack) = &frames[0] else {
        panic!("{frames:?}")
    };
    assert_eq!(ack.request_id, 7);
    let shards: Vec<u32> = ack.shards.iter().map(|a| a.shard).collect();
    let mut sorted = shards.clone();
    sorted.sort_unstable();
    assert_eq!(shards, sorted);
    for shard_ack in &ack.shards {
        let expected = records
            .iter()
            .filter(|r| felix_wire::shard_for_key(&r.key, 6) == shard_ack.shard)
            .count();
        assert_eq!(
            (shard_ack.first_offset, shard_ack.count as usize),
            (0, expected)
        );
    }
}

#[test]
fn catalogue_changes_run_through_core_zero_and_park_their_stream() {
    // Proves a create on core 2 parks its stream, goes to core 0, is applied everywhere,
    // and only then answered; a durable create is persisted before it is applied.
    let mut broker = Broker::new(3, ingress());
    let conn = broker.connect(2);
    let create = Frame::CreateStream(felix_wire::CreateStream {
        request_id: 5,
        name: "d".to_owned(),
        shard_count: 3,
        kind: StreamKind::Durable,
    });
    assert_eq!(broker.feed(2, conn.requests, create), Flow::Blocked);
    assert!(!broker.cores[2].accepts_frames(conn.requests));
    assert!(broker.deliver_one(0), "the change reaches core 0");
    let write = broker.cores[0]
        .poll_catalog_write()
        .expect("a durable change is persisted first");
    assert!(
        matches!(&write.change, CatalogChange::Add(entry) if entry.name == "d" && entry.stream_id == 0)
    );
    assert!(
        broker.cores[0].engine().lookup("d").is_none(),
        "nothing is applied before it is persisted"
    );
    let now = broker.now();
    broker.cores[0].handle_catalog_written(now, write.id, Ok(()));
    broker.settle();
    for core in &broker.cores {
        assert!(
            core.engine().lookup("d").is_some(),
            "applied on core {}",
            core.index()
        );
    }
    let frames = broker.read(2, conn.requests);
    assert!(matches!(frames.as_slice(), [Frame::StreamInfo(info)] if info.request_id == 5));
    assert!(broker.cores[2].accepts_frames(conn.requests));
    // A failed write refuses the create and changes nothing.
    let create = Frame::CreateStream(felix_wire::CreateStream {
        request_id: 6,
        name: "e".to_owned(),
        shard_count: 1,
        kind: StreamKind::Durable,
    });
    assert_eq!(broker.feed(2, conn.requests, create), Flow::Blocked);
    assert!(broker.deliver_one(0));
    let write = broker.cores[0]
        .poll_catalog_write()
        .expect("persisted first");
    let now = broker.now();
    broker.cores[0].handle_catalog_written(now, write.id, Err("disk full".to_owned()));
    broker.settle();
    let frames = broker.read(2, conn.requests);
    assert!(
        matches!(frames.as_slice(), [Frame::Error(e)] if e.code == ErrorCode::StorageFailed && e.request_id == 6),
        "{frames:?}"
    );
    assert!(
        broker
            .cores
            .iter()
            .all(|core| core.engine().lookup("e").is_none())
    );
}

#[test]
fn remote_subscription_parts_send_at_most_their_credits() {
    // Proves an owner core sends a subscriber core at most REMOTE_DELIVERY_CREDITS batches
    // until credits come back, and per-shard order holds across the batches.
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "feed", 2, StreamKind::InMemory);
    let subscription = broker.open(&conn);
    let flow = broker.feed(
        0,
        subscription,
        Frame::Subscribe(Subscribe {
            request_id: 9,
            stream: "feed".to_owned(),
            shards: ShardSelection::List(vec![1]),
            from: StartPosition::Latest,
        }),
    );
    assert_eq!(flow, Flow::Subscribed);
    broker.settle();
    let frames = broker.read(0, subscription);
    assert!(matches!(frames.as_slice(), [Frame::Subscribed(s)] if s.shards == vec![(1, 0)]));
    // Publish on core 1 (the owner of shard 1) in many small batches.
    let publisher = broker.connect(1);
    let key = key_on_core(2, 2, 1);
    for id in 0..20 {
        let payload = "y".repeat(600 * 1024);
        let frame = publish(
            100 + id,
            AckMode::FireAndForget,
            "feed",
            vec![record(&key, &payload)],
        );
        assert_eq!(broker.feed(1, publisher.requests, frame), Flow::Continue);
    }
    broker.settle();
    // Each delivery batch holds at most ~1 MiB: 20 records of 600 KiB need more batches
    // than the credits, so the owner stopped at the credits.
    assert_eq!(broker.queued_for(0), 0);
    let mut offsets = Vec::new();
    let mut rounds = 0;
    loop {
        let frames = broker.read(0, subscription);
        let batches = frames.len();
        assert!(
            batches <= REMOTE_DELIVERY_CREDITS as usize,
            "{batches} batches in one round"
        );
        for frame in frames {
            let Frame::Delivery(delivery) = frame else {
                panic!("a delivery")
            };
            offsets.extend(delivery.records.iter().map(|r| r.offset));
        }
        broker.settle();
        rounds += 1;
        if offsets.len() == 20 || rounds > 40 {
            break;
        }
    }
    assert_eq!(
        offsets,
        (0..20).collect::<Vec<u64>>(),
        "per-shard order, no gap or duplicate"
    );
}

#[test]
fn deleting_a_stream_ends_its_subscriptions_on_every_core() {
    // Proves a delete ends a subscription spanning cores with StreamNotFound, and the stream
    // finishes after the error.
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "gone", 4, StreamKind::InMemory);
    let subscription = broker.open(&conn);
    let flow = broker.feed(
        0,
        subscription,
        Frame::Subscribe(Subscribe {
            request_id: 3,
            stream: "gone".to_owned(),
            shards: ShardSelection::All,
            from: StartPosition::Earliest,
        }),
    );
    assert_eq!(flow, Flow::Subscribed);
    broker.settle();
    assert_eq!(broker.read(0, subscription).len(), 1, "Subscribed");
    let other = broker.connect(1);
    let delete = Frame::DeleteStream {
        request_id: 4,
        name: "gone".to_owned(),
    };
    assert_eq!(broker.feed(1, other.requests, delete), Flow::Blocked);
    broker.settle();
    assert!(matches!(
        broker.read(1, other.requests).as_slice(),
        [Frame::Done { request_id: 4 }]
    ));
    let (frames, finished) = broker.read_all(0, subscription);
    assert!(finished, "the subscription stream finishes");
    assert!(
        matches!(frames.as_slice(), [Frame::Error(e)] if e.code == ErrorCode::StreamNotFound && e.request_id == 3),
        "{frames:?}"
    );
}

#[test]
fn a_durable_ack_is_written_to_its_stream_once_the_round_is_synced() {
    // Proves the one hand-off of a durable ack: nothing before the round's fdatasync
    // completes; after the pump, the Ack is in the stream's output, no other step between.
    let dir = tempfile::tempdir().expect("temp dir");
    let mut broker = Broker::new(1, ingress());
    let (backend, fault) = FaultBackend::new(false).expect("fault backend");
    let settings = DurableSettings {
        fsync: FsyncMode::OnCommit,
        backend: BackendChoice::Pwrite,
        direct_io: true,
        rounds_in_flight: 2,
        segment_bytes: 1 << 20,
        retention_bytes: None,
        retention_age: None,
    };
    let mut log = DurableLog::open(0, settings.log_config(dir.path(), 0), backend).expect("log");
    let conn = broker.connect(0);
    let create = Frame::CreateStream(felix_wire::CreateStream {
        request_id: 1,
        name: "d".to_owned(),
        shard_count: 2,
        kind: StreamKind::Durable,
    });
    assert_eq!(broker.feed(0, conn.requests, create), Flow::Blocked);
    let write = broker.cores[0]
        .poll_catalog_write()
        .expect("persisted first");
    let now = broker.now();
    broker.cores[0].handle_catalog_written(now, write.id, Ok(()));
    assert_eq!(broker.read(0, conn.requests).len(), 1, "StreamInfo");
    let records = vec![record("a", "1"), record("b", "2"), record("c", "3")];
    assert_eq!(
        broker.feed(0, conn.requests, publish(2, AckMode::Acked, "d", records)),
        Flow::Continue
    );
    assert!(broker.cores[0].has_log_work());
    let now = broker.now();
    broker.cores[0].pump_log(&mut log, now).expect("pumped");
    assert!(
        broker.read(0, conn.requests).is_empty(),
        "no ack before the fdatasync"
    );
    assert_eq!(fault.held_rounds(), 1);
    assert_eq!(
        broker.cores[0].counters().ingress_depth,
        1,
        "the job waits for the commit"
    );
    assert!(fault.complete_next());
    broker.cores[0].pump_log(&mut log, now).expect("pumped");
    let frames = broker.read(0, conn.requests);
    assert!(
        matches!(frames.as_slice(), [Frame::Ack(ack)] if ack.request_id == 2),
        "{frames:?}"
    );
    assert_eq!(fault.syncs_completed(), 1);
    assert_eq!(broker.cores[0].counters().ingress_depth, 0);
}

#[test]
fn protocol_violations_after_the_handshake_end_only_their_stream() {
    // Proves what docs/wire-protocol.md section 10 says of frames in the wrong place after
    // HelloOk: a server-only frame or a second Hello on a request stream gets Error
    // protocol_violation (request id 0) and that stream finishes; a Subscribe on a request
    // stream gets protocol_violation with its own request id and the stream goes on; a second
    // frame on a subscription stream gets protocol_violation (request id 0) and the
    // subscription ends; a frame cut short by FIN gets malformed (request id 0); the
    // connection and its other streams carry on throughout.
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "edges", 2, StreamKind::InMemory);
    let error_of = |frames: &[Frame]| match frames {
        [Frame::Error(error)] => (error.request_id, error.code, error.message.clone()),
        other => panic!("expected one Error, got {other:?}"),
    };
    for frame in [
        Frame::Done { request_id: 5 },
        Frame::Hello(Hello {
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            features: 0,
            client_name: "again".to_owned(),
            token: None,
        }),
    ] {
        let stream = broker.open(&conn);
        assert_eq!(
            broker.feed(0, stream, Frame::ListStreams { request_id: 1 }),
            Flow::Continue
        );
        assert!(matches!(
            broker.read(0, stream).as_slice(),
            [Frame::StreamList { .. }]
        ));
        assert_eq!(broker.feed(0, stream, frame), Flow::Done);
        let (frames, finished) = broker.read_all(0, stream);
        let (request_id, code, _) = error_of(&frames);
        assert_eq!((request_id, code), (0, ErrorCode::ProtocolViolation));
        assert!(finished, "that stream ends");
    }
    // A Subscribe on a request stream: its own id, the stream goes on.
    let requests = broker.open(&conn);
    assert_eq!(
        broker.feed(0, requests, Frame::ListStreams { request_id: 1 }),
        Flow::Continue
    );
    broker.read(0, requests);
    let subscribe = Frame::Subscribe(Subscribe {
        request_id: 6,
        stream: "edges".to_owned(),
        shards: ShardSelection::All,
        from: StartPosition::Latest,
    });
    assert_eq!(broker.feed(0, requests, subscribe.clone()), Flow::Continue);
    let (request_id, code, _) = error_of(&broker.read(0, requests));
    assert_eq!((request_id, code), (6, ErrorCode::ProtocolViolation));
    assert_eq!(
        broker.feed(0, requests, Frame::ListStreams { request_id: 7 }),
        Flow::Continue
    );
    assert!(matches!(
        broker.read(0, requests).as_slice(),
        [Frame::StreamList { request_id: 7, .. }]
    ));
    // A second frame on a subscription stream ends the subscription (request id 0).
    let subscription = broker.open(&conn);
    assert_eq!(broker.feed(0, subscription, subscribe), Flow::Subscribed);
    broker.settle();
    assert!(matches!(
        broker.read(0, subscription).as_slice(),
        [Frame::Subscribed(_)]
    ));
    let now = broker.now();
    broker.cores[0].handle_extra_data(now, subscription);
    let (frames, finished) = broker.read_all(0, subscription);
    let (request_id, code, _) = error_of(&frames);
    assert_eq!((request_id, code), (0, ErrorCode::ProtocolViolation));
    assert!(finished);
    // A frame cut short by FIN.
    let cut = broker.open(&conn);
    let now = broker.now();
    broker.cores[0].handle_fin(now, cut, true);
    let (frames, finished) = broker.read_all(0, cut);
    let (request_id, code, message) = error_of(&frames);
    assert_eq!((request_id, code), (0, ErrorCode::Malformed));
    assert_eq!(
        message,
        "malformed truncated frame: the stream ended inside a frame"
    );
    assert!(finished);
    // The connection's first stream still serves.
    assert_eq!(
        broker.feed(0, conn.requests, Frame::ListStreams { request_id: 8 }),
        Flow::Continue
    );
    assert!(matches!(
        broker.read(0, conn.requests).as_slice(),
        [Frame::StreamList { request_id: 8, .. }]
    ));
}

#[test]
fn a_slow_disk_makes_durable_publishes_wait_never_storage_full() {
    // Proves a disk that holds its rounds makes durable publishes wait, not fail: with the
    // ingress budget far above the log's pending bound, publishes spread over two cores (parts
    // crossing cores) keep coming while no round completes; the log takes appends only while
    // its pending bound has room (never past it), the rest wait in the engine without the
    // core asking for pumps that would move nothing, and once the disk goes on every publish
    // is acked, none with storage_full, with dense offsets per shard.
    const SHARDS: u32 = 2;
    const PUBLISHES: u64 = 60;
    const PER_PUBLISH: usize = 8;
    const PAYLOAD: usize = 700;
    let dirs: Vec<_> = (0..2)
        .map(|_| tempfile::tempdir().expect("temp dir"))
        .collect();
    let mut broker = Broker::new(2, ingress());
    let mut logs = Vec::new();
    let mut faults = Vec::new();
    for (index, dir) in dirs.iter().enumerate() {
        let (backend, fault) = FaultBackend::new(false).expect("fault backend");
        let mut config = felix_storage::LogConfig::new(dir.path());
        config.fsync = FsyncMode::OnCommit;
        config.segment_bytes = 1 << 20;
        config.max_round_bytes = 4096;
        // Three rounds' worth: the publishes below frame ~30x as much per core.
        config.max_pending_bytes = 3 * 4096;
        logs.push(DurableLog::open(index, config, backend).expect("log"));
        faults.push(fault);
    }
    let max_pending = logs[0].log().config().max_pending_bytes;
    let conn = broker.connect(0);
    let create = Frame::CreateStream(felix_wire::CreateStream {
        request_id: 1,
        name: "d".to_owned(),
        shard_count: SHARDS,
        kind: StreamKind::Durable,
    });
    assert_eq!(broker.feed(0, conn.requests, create), Flow::Blocked);
    let write = broker.cores[0]
        .poll_catalog_write()
        .expect("persisted first");
    let now = broker.now();
    broker.cores[0].handle_catalog_written(now, write.id, Ok(()));
    broker.settle();
    assert!(
        matches!(
            broker.read(0, conn.requests).as_slice(),
            [Frame::StreamInfo(_)]
        ),
        "created"
    );
    let keys = [key_on_core(SHARDS, 2, 0), key_on_core(SHARDS, 2, 1)];
    let payload = "p".repeat(PAYLOAD);
    let mut frames = Vec::new();
    // What the shell does after each input: pump a core's log when it says it has log work.
    let pump_wanted = |broker: &mut Broker, logs: &mut Vec<DurableLog<FaultBackend>>| {
        for (index, log) in logs.iter_mut().enumerate() {
            if broker.cores[index].has_log_work() {
                let now = broker.now();
                broker.cores[index].pump_log(log, now).expect("pumped");
                assert!(
                    log.log().pending_bytes() <= max_pending,
                    "core {index}: {} bytes pending, over the bound {max_pending}",
                    log.log().pending_bytes()
                );
            }
        }
        broker.settle();
    };
    for request_id in 0..PUBLISHES {
        let records = (0..PER_PUBLISH)
            .map(|i| record(&keys[i % 2], &payload))
            .collect();
        assert_eq!(
            broker.feed(
                0,
                conn.requests,
                publish(100 + request_id, AckMode::Acked, "d", records)
            ),
            Flow::Continue,
            "the ingress budget admits every publish"
        );
        broker.settle();
        pump_wanted(&mut broker, &mut logs);
        frames.extend(broker.read(0, conn.requests));
    }
    assert!(
        frames.is_empty(),
        "nothing answered while the disk holds: {frames:?}"
    );
    for (index, log) in logs.iter_mut().enumerate() {
        assert_eq!(
            faults[index].held_rounds(),
            1,
            "core {index}: one round in flight"
        );
        assert!(
            broker.cores[index].appends_held(),
            "core {index}: appends wait in the engine"
        );
        assert!(
            !broker.cores[index].has_log_work(),
            "core {index}: held appends are not work until the disk answers (no spinning)"
        );
        // A pump before the disk answers moves nothing and stays held.
        let now = broker.now();
        let report = broker.cores[index].pump_log(log, now).expect("pumped");
        assert_eq!((report.appended, report.refused, report.held), (0, 0, true));
    }
    // The disk goes on: complete rounds one by one, pumping as the log's wake-up would.
    let mut rounds = 0;
    while faults.iter().any(|fault| fault.held_rounds() > 0) {
        rounds += 1;
        assert!(rounds < 10_000, "the rounds never end");
        for (index, log) in logs.iter_mut().enumerate() {
            if faults[index].held_rounds() > 0 {
                assert!(faults[index].complete_next());
                let now = broker.now();
                let report = broker.cores[index].pump_log(log, now).expect("pumped");
                assert_eq!(report.refused, 0);
                assert!(log.log().pending_bytes() <= max_pending);
            }
        }
        broker.settle();
        pump_wanted(&mut broker, &mut logs);
        frames.extend(broker.read(0, conn.requests));
    }
    let mut next = [0u64; SHARDS as usize];
    let mut acked = Vec::new();
    for frame in &frames {
        let Frame::Ack(ack) = frame else {
            panic!("a publish was not acked: {frame:?}")
        };
        acked.push(ack.request_id);
        for shard_ack in &ack.shards {
            let shard = shard_ack.shard as usize;
            assert_eq!(shard_ack.first_offset, next[shard], "dense offsets");
            next[shard] += u64::from(shard_ack.count);
        }
    }
    let want: Vec<u64> = (100..100 + PUBLISHES).collect();
    assert_eq!(acked, want, "every publish acked once, in order");
    let per_shard = PUBLISHES * PER_PUBLISH as u64 / 2;
    assert_eq!(next, [per_shard; SHARDS as usize]);
    for shard in 0..SHARDS {
        let log = &logs[usize::from(felix_affinity::shard_core(shard, 2))];
        let id = felix_engine::LogShardId::new(0, shard).expect("id").0;
        let offsets: Vec<u64> = log
            .log()
            .read(id, 0, usize::MAX, usize::MAX)
            .expect("read")
            .iter()
            .map(|record| record.offset)
            .collect();
        assert_eq!(offsets, (0..per_shard).collect::<Vec<_>>(), "shard {shard}");
    }
    for core in &mut broker.cores {
        assert_eq!(core.counters().ingress_depth, 0, "every admission released");
        assert!(!core.appends_held() && !core.has_log_work());
    }
}
