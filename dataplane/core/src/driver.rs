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
