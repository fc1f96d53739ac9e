//! The drain: what is done after every input to a [`Core`] to carry out everything the input
//! produced, written once and shared by the broker's shell (`dataplane/broker/src/shell.rs`),
//! the simulation (`dataplane/sim/src/world.rs`) and the fuzz machine (`fuzz/src/machine.rs`),
//! so that the simulation and the fuzzer run the shipped ordering.
//!
//! The driver owns the order of the steps and the rounds; the caller carries out each output
//! through [`Effects`] (a real mesh, catalogue file, durable log and token store in the
//! broker; simulated queues, injected faults and held answers in the simulation and the fuzz
//! machine). Like [`Core`], the driver does no IO and reads no clock: `now` is handed in.
//! Dispatch is static (the caller's `Effects` type is a generic parameter) and a drain that
//! only moves messages allocates nothing.
//!
//! One round, in this order:
//! 1. the outbox into the mesh while the queues have room ([`send_messages`]);
//! 2. catalogue writes ([`Effects::write_catalog`]; core 0), each one means another round;
//! 3. cluster requests ([`Effects::route_cluster`]); one the caller cannot route (not a
//!    cluster member) is refused here ([`refuse_cluster`]) and means another round;
//! 4. token checks ([`Effects::check_token`]), each one means another round;
//! 5. the durable log, at most once per drain, when the machine has log work
//!    ([`Effects::pump_log`]); a pump means another round;
//! 6. events ([`Effects::stream_ready`]).
//!
//! Rounds stop when one asked for no other, or after [`DRAIN_ROUNDS_MAX`]; then
//! [`Effects::drained`] runs (deadlines and wake-ups, metrics, checks).

use std::ops::ControlFlow;

use felix_wire::ErrorCode;

use crate::{CatalogWrite, ClusterRefusal, ClusterRequest, Core, CoreMessage, Event, Now};
use crate::{StreamId, TokenCheck};

/// Rounds of [`drain`]: each round carries out every queued output, and an output can cause
/// one more round (a catalogue write answered, a pump's completions), so two or three rounds
/// suffice; the bound only guards against a defect looping forever.
pub const DRAIN_ROUNDS_MAX: usize = 8;

/// How the caller carries out the outputs of the core it drives. Every method is called with
/// the core not borrowed by the driver: an implementation answers at once through
/// [`Effects::core`] (`handle_catalog_written`, `handle_token_checked`, ...) or holds the
/// output and answers at a later input.
pub trait Effects {
    /// The machine being drained.
    fn core(&mut self) -> &mut Core;

    /// Puts `message` into the queue from this core to core `to`, or gives it back when that
    /// queue is full (the driver returns it to the outbox, where it goes out first next time).
    ///
    /// # Errors
    /// The message, when the queue has no room.
    fn send(&mut self, to: u16, message: CoreMessage) -> Result<(), CoreMessage>;

    /// A queue was full: announce that this core waits for room before the one retry (the
    /// room protocol of `dataplane/broker/src/mesh.rs`). Nothing by default.
    fn wait_for_room(&mut self) {}

    /// The retry after [`Effects::wait_for_room`] emptied the outbox: withdraw the
    /// announcement. Nothing by default.
    fn room_found(&mut self) {}

    /// Persists a catalogue change (core 0): answer with `Core::handle_catalog_written` now,
    /// or hold it and answer later.
    fn write_catalog(&mut self, now: Now, write: CatalogWrite);

    /// Hands a request to the cluster service.
    ///
    /// # Errors
    /// The request, when this node is not a cluster member: the driver refuses it
    /// ([`refuse_cluster`]).
    fn route_cluster(&mut self, now: Now, request: ClusterRequest) -> Result<(), ClusterRequest>;

    /// Checks a hello's token: answer with `Core::handle_token_checked` now, or hold it and
    /// answer later.
    fn check_token(&mut self, now: Now, check: TokenCheck);

    /// Pumps the machine's durable log (`Core::pump_log` on the log the implementation
    /// owns). `Break` means a fatal storage error halted the node (the simulation and the
    /// fuzz machine; the broker's process exits instead): the drain stops at once.
    fn pump_log(&mut self, now: Now) -> ControlFlow<()>;

    /// `Event::StreamReady`: wake the stream's writer.
    fn stream_ready(&mut self, stream: StreamId);

    /// After the rounds (not after a halt): wake-ups for deadlines and log work left for
    /// later, metrics, checks.
    fn drained(&mut self, now: Now);
}

/// Carries out everything the last input to `effects.core()` produced (the module
/// documentation gives the order). `Break` when a pump halted the node.
pub fn drain<E: Effects>(effects: &mut E, now: Now) -> ControlFlow<()> {
    // The log is pumped at most once per input: a pump that left reads for later says so
    // (`PumpReport::more`) and the caller comes back for them (the broker's timer task), so
    // one input never reads more than LOG_READS_PER_PUMP_MAX chunks on the core's thread.
    let mut pumped = false;
    for _ in 0..DRAIN_ROUNDS_MAX {
        let mut more = false;
        if effects.core().outbox_len() > 0 {
            send_messages(effects);
        }
        while let Some(write) = effects.core().poll_catalog_write() {
            effects.write_catalog(now, write);
            more = true;
        }
        while let Some(request) = effects.core().poll_cluster() {
            if let Err(request) = effects.route_cluster(now, request) {
                refuse_cluster(effects.core(), now, request);
                more = true;
            }
        }
        while let Some(check) = effects.core().poll_token_check() {
            effects.check_token(now, check);
            more = true;
        }
        if !pumped && effects.core().has_log_work() {
            effects.pump_log(now)?;
            pumped = true;
            more = true;
        }
        while let Some(event) = effects.core().poll_event() {
            match event {
                Event::StreamReady(stream) => effects.stream_ready(stream),
            }
        }
        if !more {
            break;
        }
    }
    effects.drained(now);
    ControlFlow::Continue(())
}

/// Moves outbox messages into the mesh while the queues have room. When a queue is full,
/// announces that this core waits for room ([`Effects::wait_for_room`]) and retries once:
/// when that empties the outbox the announcement is withdrawn ([`Effects::room_found`]);
/// what is still blocked waits in the outbox for the caller's next try (the broker's pump,
/// woken when a receiver drains). True when the outbox is empty.
pub fn send_messages<E: Effects>(effects: &mut E) -> bool {
    if try_send_messages(effects) {
        return true;
    }
    effects.wait_for_room();
    if try_send_messages(effects) {
        effects.room_found();
        return true;
    }
    false
}

/// One pass of [`send_messages`]: each destination in order, oldest message first, until its
/// queue is full; true when the outbox is empty.
fn try_send_messages<E: Effects>(effects: &mut E) -> bool {
    let (index, cores) = {
        let core = effects.core();
        (core.index(), core.core_count)
    };
    let mut sent_all = true;
    for to in (0..cores).filter(|&to| to != index) {
        while let Some(message) = effects.core().poll_message(to) {
            if let Err(message) = effects.send(to, message) {
                effects.core().return_message(to, message);
                sent_all = false;
                break;
            }
        }
    }
    sent_all
}

/// Answers a cluster request on a node that is not a cluster member: `Unavailable`. The core
/// routes to cluster streams only when told of them, which only a member's link does, so this
/// is a guard, not a path a client normally reaches.
pub fn refuse_cluster(core: &mut Core, now: Now, request: ClusterRequest) {
    let refusal = ClusterRefusal {
        code: ErrorCode::Unavailable,
        detail: 0,
        message: "this broker is not a cluster member".to_owned(),
    };
    match request {
        ClusterRequest::Admin { token, .. } => core.handle_cluster_admin(token, Err(refusal)),
        ClusterRequest::Publish(part) => core.handle_cluster_answer(now, part.token, Err(refusal)),
        ClusterRequest::Subscribe(subscribe) => {
            core.handle_cluster_subscribed(subscribe.token, Err(refusal));
        }
        ClusterRequest::Credit { .. } | ClusterRequest::Unsubscribe { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    //! The driver against real machines, with an [`Effects`] that records what it is asked
    //! to do. The tests read the record, never a clock.

    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use felix_engine::EngineConfig;
    use felix_wire::{CreateStream, Frame, Hello, Limits, PROTOCOL_VERSION, StreamKind};

    use super::*;
    use crate::{CoreConfig, IngressSettings, Security};

    fn now() -> Now {
        // Any fixed instant: the driver never reads a clock, and these tests never advance it.
        Now {
            at: Instant::now(),
            unix_us: 1_800_000_000_000_000,
        }
    }

    /// Core `index` of `cores`, sharing nothing with the others (the tests drive one).
    fn core(index: u16, cores: u16) -> Core {
        Core::new(CoreConfig {
            index,
            core_count: cores,
            core_ports: (0..cores).map(|i| 7400 + i).collect(),
            limits: Limits::DEFAULT,
            engine: EngineConfig::default(),
            ingress: IngressSettings {
                depth: 512,
                budget_bytes: 64 << 20,
                fire_and_forget_waits: false,
                ack_on_commit: false,
                commit_wait: Duration::from_millis(2000),
            },
            next_stream_id: 0,
            security: Arc::new(Security::open()),
        })
    }

    /// A connection with its handshake done; its first stream, now a request stream.
    fn connect(core: &mut Core, now: Now) -> StreamId {
        let connection = core.handle_connection_opened(None).expect("a connection");
        let stream = core.handle_stream_opened(connection);
        let _ = core.handle_frame(
            now,
            stream,
            Frame::Hello(Hello {
                min_version: PROTOCOL_VERSION,
                max_version: PROTOCOL_VERSION,
                features: 0,
                client_name: "driver test".to_owned(),
                token: None,
            }),
        );
        assert!(core.handshake_done(connection));
        // The HelloOk is written; nothing else is pending.
        let _ = core.poll_transmit(now, stream);
        while core.poll_event().is_some() {}
        stream
    }

    fn create(core: &mut Core, now: Now, stream: StreamId, name: &str) {
        let _ = core.handle_frame(
            now,
            stream,
            Frame::CreateStream(CreateStream {
                request_id: 1,
                name: name.to_owned(),
                shard_count: 1,
                kind: StreamKind::Durable,
            }),
        );
    }

    /// Records every call; the mesh queue to each core takes `room` more messages; catalogue
    /// writes are answered at once (written) unless `hold_catalog`; the log is never really
    /// pumped (the machine keeps its log work, so a second pump would show).
    struct Recorder {
        core: Core,
        now: Now,
        calls: Vec<String>,
        room: usize,
        /// `wait_for_room` makes room (a receiver drained meanwhile).
        room_on_wait: bool,
        hold_catalog: bool,
        /// On each `StreamReady`, the client asks for one more durable stream (so every
        /// round has a catalogue write, and the drain would never end on its own).
        create_on_ready: bool,
        created: usize,
        sent: Vec<(u16, String)>,
    }

    impl Recorder {
        fn new(core: Core, now: Now) -> Recorder {
            Recorder {
                core,
                now,
                calls: Vec::new(),
                room: usize::MAX,
                room_on_wait: false,
                hold_catalog: false,
                create_on_ready: false,
                created: 0,
                sent: Vec::new(),
            }
        }

        fn count(&self, call: &str) -> usize {
            self.calls.iter().filter(|c| c.starts_with(call)).count()
        }
    }

    impl Effects for Recorder {
        fn core(&mut self) -> &mut Core {
            &mut self.core
        }

        fn send(&mut self, to: u16, message: CoreMessage) -> Result<(), CoreMessage> {
            if self.room == 0 {
                self.calls.push(format!("full {to}"));
                return Err(message);
            }
            self.room -= 1;
            self.calls.push(format!("send {to}"));
            self.sent.push((to, format!("{message:?}")));
            Ok(())
        }

        fn wait_for_room(&mut self) {
            self.calls.push("wait_for_room".to_owned());
            if self.room_on_wait {
                self.room = usize::MAX;
            }
        }

        fn room_found(&mut self) {
            self.calls.push("room_found".to_owned());
        }

        fn write_catalog(&mut self, now: Now, write: CatalogWrite) {
            self.calls.push("catalog".to_owned());
            if !self.hold_catalog {
                self.core.handle_catalog_written(now, write.id, Ok(()));
            }
        }

        fn route_cluster(
            &mut self,
            _now: Now,
            request: ClusterRequest,
        ) -> Result<(), ClusterRequest> {
            self.calls.push("cluster".to_owned());
            Err(request)
        }

        fn check_token(&mut self, _now: Now, _check: TokenCheck) {
            self.calls.push("token".to_owned());
        }

        fn pump_log(&mut self, _now: Now) -> ControlFlow<()> {
            self.calls.push("pump".to_owned());
            ControlFlow::Continue(())
        }

        fn stream_ready(&mut self, stream: StreamId) {
            self.calls.push("ready".to_owned());
            if self.create_on_ready {
                let now = self.now;
                let _ = self.core.poll_transmit(now, stream);
                self.created += 1;
                create(&mut self.core, now, stream, &format!("s{}", self.created));
            }
        }

        fn drained(&mut self, _now: Now) {
            self.calls.push("drained".to_owned());
        }
    }

    /// One core: the catalogue write is answered, which lands the durable stream (log work)
    /// and answers the client (its stream is ready) in the same round; the next round finds
    /// the log work again but does not pump a second time, and nothing else, so it ends.
    #[test]
    fn round_order_and_one_pump_per_drain() {
        let now = now();
        let mut core = core(0, 1);
        let requests = connect(&mut core, now);
        create(&mut core, now, requests, "s0");
        let mut effects = Recorder::new(core, now);
        assert!(drain(&mut effects, now).is_continue());
        assert_eq!(effects.calls, ["catalog", "pump", "ready", "drained"]);
        assert!(
            effects.core.has_log_work(),
            "the recorder never pumps for real: the log work stays, and one pump was all"
        );

        // A second input pumps again: the bound is per drain, not per machine.
        effects.calls.clear();
        assert!(drain(&mut effects, now).is_continue());
        assert_eq!(effects.calls, ["pump", "drained"]);
    }

    /// Two cores: core 0 answers the catalogue write in round 1, which queues the change for
    /// core 1; messages go first in a round, so the next round sends it. (That an answered
    /// write alone brings another round, with no pump in it, is `rounds_are_bounded`.)
    #[test]
    fn a_message_an_answer_queued_goes_out_in_the_next_round() {
        let now = now();
        let mut core = core(0, 2);
        let requests = connect(&mut core, now);
        create(&mut core, now, requests, "s0");
        assert_eq!(core.outbox_len(), 0);
        let mut effects = Recorder::new(core, now);
        assert!(drain(&mut effects, now).is_continue());
        // Round 1: the write (answered), the pump (the stream landed); round 2: the change
        // goes to core 1.
        assert_eq!(effects.calls, ["catalog", "pump", "send 1", "drained"]);
        assert_eq!(effects.core.outbox_len(), 0);

        // Held for a later answer: nothing follows from it, the next round finds nothing.
        let mut core = self::core(0, 2);
        let requests = connect(&mut core, now);
        create(&mut core, now, requests, "s0");
        let mut effects = Recorder::new(core, now);
        effects.hold_catalog = true;
        assert!(drain(&mut effects, now).is_continue());
        assert_eq!(effects.calls, ["catalog", "drained"]);
    }

    /// A full queue: the message goes back to the outbox, the core announces it waits for
    /// room and retries once; it goes out (the same message) when there is room again.
    #[test]
    fn a_full_queue_returns_the_message_and_retries() {
        let now = now();
        // Core 1 forwards a stream creation to core 0, which serializes them.
        let mut core = core(1, 2);
        let requests = connect(&mut core, now);
        create(&mut core, now, requests, "s0");
        assert_eq!(core.outbox_len(), 1);
        let expected = core
            .outbox_messages()
            .map(|(to, message)| (to, format!("{message:?}")))
            .collect::<Vec<_>>();
        let mut effects = Recorder::new(core, now);
        effects.room = 0;
        assert!(drain(&mut effects, now).is_continue());
        assert_eq!(
            effects.calls,
            ["full 0", "wait_for_room", "full 0", "drained"]
        );
        assert_eq!(
            effects.core.outbox_len(),
            1,
            "the message is back in the outbox"
        );
        assert!(effects.sent.is_empty());

        // Room again (a receiver drained while this core announced it waits).
        effects.calls.clear();
        effects.room_on_wait = true;
        assert!(send_messages(&mut effects), "the retry emptied the outbox");
        assert_eq!(
            effects.calls,
            ["full 0", "wait_for_room", "send 0", "room_found"]
        );
        assert_eq!(effects.core.outbox_len(), 0);
        assert_eq!(effects.sent, expected);

        // Room at once: no announcement.
        let mut core = self::core(1, 2);
        let requests = connect(&mut core, now);
        create(&mut core, now, requests, "s0");
        let mut effects = Recorder::new(core, now);
        assert!(send_messages(&mut effects));
        assert_eq!(effects.calls, ["send 0"]);
    }

    /// Every round brings a new catalogue write (the client asks for another stream whenever
    /// its stream is ready), and after the first round only that write asks for another
    /// round (the log is pumped once): the drain stops after DRAIN_ROUNDS_MAX rounds.
    #[test]
    fn rounds_are_bounded() {
        let now = now();
        let mut core = core(0, 1);
        let requests = connect(&mut core, now);
        create(&mut core, now, requests, "s0");
        let mut effects = Recorder::new(core, now);
        effects.create_on_ready = true;
        assert!(drain(&mut effects, now).is_continue());
        assert_eq!(
            effects.count("catalog"),
            DRAIN_ROUNDS_MAX,
            "{:?}",
            effects.calls
        );
        assert_eq!(effects.count("pump"), 1);
        assert_eq!(effects.calls.last().map(String::as_str), Some("drained"));
        // The last round's request is still waiting for its write (the next input's drain).
        assert!(effects.core.poll_catalog_write().is_some());
    }

    /// A halted pump stops the drain at once: no events, no `drained`.
    #[test]
    fn a_halt_stops_the_drain() {
        struct Halting(Recorder);
        impl Effects for Halting {
            fn core(&mut self) -> &mut Core {
                self.0.core()
            }
            fn send(&mut self, to: u16, message: CoreMessage) -> Result<(), CoreMessage> {
                self.0.send(to, message)
            }
            fn write_catalog(&mut self, now: Now, write: CatalogWrite) {
                self.0.write_catalog(now, write);
            }
            fn route_cluster(
                &mut self,
                now: Now,
                request: ClusterRequest,
            ) -> Result<(), ClusterRequest> {
                self.0.route_cluster(now, request)
            }
            fn check_token(&mut self, now: Now, check: TokenCheck) {
                self.0.check_token(now, check);
            }
            fn pump_log(&mut self, now: Now) -> ControlFlow<()> {
                let _ = self.0.pump_log(now);
                ControlFlow::Break(())
            }
            fn stream_ready(&mut self, stream: StreamId) {
                self.0.stream_ready(stream);
            }
            fn drained(&mut self, now: Now) {
                self.0.drained(now);
            }
        }
        let now = now();
        let mut core = core(0, 1);
        let requests = connect(&mut core, now);
        create(&mut core, now, requests, "s0");
        let mut effects = Halting(Recorder::new(core, now));
        assert!(drain(&mut effects, now).is_break());
        assert_eq!(effects.0.calls, ["catalog", "pump"]);
    }
}
