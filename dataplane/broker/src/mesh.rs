//! Cross-core messaging: one bounded lock-free queue (crossbeam `ArrayQueue`) per ordered pair
//! of data-plane cores, wired once at start-up, plus one eventfd per core to wake it when it is
//! parked. Shared by every core thread through an `Arc`; no lock anywhere.
//!
//! Protocol (per receiving core): the receiver drains its inbound queues in batches; when it
//! finds nothing for [`SPIN_BEFORE_PARK`] it sets its `parked` flag, checks the queues once more
//! and only then waits on its eventfd. A sender pushes, then writes the eventfd only if the
//! receiver announced it is parked (`SeqCst` on both sides, so either the receiver sees the
//! message in its re-check or the sender sees the flag). Waking an idle core costs ~25-30 us on
//! this class of VM (docs/design/machine.md), so the spin keeps busy cores from paying it per
//! message.
//!
//! Messages are `felix_core::CoreMessage`s, owned values carrying their source core; the
//! answer goes back to it. A full queue is backpressure: the message stays in the sending
//! core's outbox (`felix_core::Core::return_message`); what waits there is bounded by what
//! caused it (the ingress queue, the requests received, the credits).
//!
//! Waiting for room (per sending core): a core whose outbox is blocked by a full queue does not
//! spin. It announces it waits for room ([`Mesh::wait_for_room`]: its `wants_room` flag, stored
//! then a `SeqCst` fence), retries the send once, and if still blocked parks on its own eventfd
//! exactly like an idle core ([`Mesh::park`], so inbound messages wake it too: it keeps
//! draining its own inbound queues while blocked, else two cores blocked on each other would
//! deadlock). A receiver, after popping from a source's queue in [`Mesh::drain`], issues a
//! `SeqCst` fence, then takes that source's `wants_room` flag and, if it was set, writes the
//! source's eventfd. Store-fence-retry on one side and pop-fence-load on the other (Dekker):
//! either the sender's retry sees the freed slot or the receiver sees the flag, so a blocked
//! sender is never left parked beside a queue with room. The flag says only "some destination
//! was full", so a wake-up may be for another queue than the one blocking it: the sender then
//! retries, fails, and parks again (at most one retry per wake-up). The eventfd counts writes,
//! so a wake-up written before the sender waits is not lost. The flags other cores read and
//! write sit on their own cache lines ([`Parking`] is 128-byte aligned).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use felix_core::CoreMessage;
use felix_storage::EventFd;

/// Messages one ordered core pair can hold. 1024 covers a full ingress queue (512 jobs) of
/// forwarded publishes plus their answers and delivery credits; beyond it senders wait.
pub const QUEUE_CAPACITY: usize = 1024;
/// Messages handled per drain round before the pump yields to the core's connections, so a
/// flood of cross-core work cannot starve the QUIC endpoints.
pub const DRAIN_BATCH: usize = 256;
/// How long an idle pump keeps polling before it parks on its eventfd: about the cost of one
/// wake-up (~25-30 us measured), so a core that is busy anyway never pays a wake-up.
pub const SPIN_BEFORE_PARK: Duration = Duration::from_micros(40);

/// One core's wake-up line. Aligned to 128 bytes (two cache lines, as adjacent-line
/// prefetchers pair them) so one core's flags, written by it and read by every other core, do
/// not share a line with another core's.
#[repr(align(128))]
struct Parking {
    eventfd: EventFd,
    /// Waiting for inbound messages: senders write the eventfd.
    parked: AtomicBool,
    /// Blocked by a full queue to another core: receivers that pop from its queues write the
    /// eventfd (see the module docs).
    wants_room: AtomicBool,
}

/// The queues and wake-up lines of every core. Built once, before the core threads start.
pub struct Mesh {
    cores: u16,
    /// Indexed `from * cores + to`; the diagonal is unused (a core never messages itself).
    queues: Vec<ArrayQueue<CoreMessage>>,
    parking: Vec<Parking>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("cores", &self.cores)
            .finish_non_exhaustive()
    }
}

impl Mesh {
    pub fn new(cores: u16) -> std::io::Result<Mesh> {
        assert!(cores >= 1, "at least one data-plane core");
        let pairs = usize::from(cores) * usize::from(cores);
        let queues = (0..pairs)
            .map(|_| ArrayQueue::new(QUEUE_CAPACITY))
            .collect();
        let parking = (0..cores)
            .map(|_| {
                Ok(Parking {
                    eventfd: EventFd::new().map_err(std::io::Error::other)?,
                    parked: AtomicBool::new(false),
                    wants_room: AtomicBool::new(false),
                })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Mesh {
            cores,
            queues,
            parking,
        })
    }

    pub fn cores(&self) -> u16 {
        self.cores
    }

    fn queue(&self, from: u16, to: u16) -> &ArrayQueue<CoreMessage> {
        assert!(from != to, "a core never messages itself");
        &self.queues[usize::from(from) * usize::from(self.cores) + usize::from(to)]
    }

    /// Pushes without waiting; gives the message back when the queue is full.
    pub fn try_send(&self, from: u16, to: u16, message: CoreMessage) -> Result<(), CoreMessage> {
        self.queue(from, to).push(message)?;
        self.wake(to);
        Ok(())
    }

    fn wake(&self, to: u16) {
        let parking = &self.parking[usize::from(to)];
        if parking.parked.load(Ordering::SeqCst) {
            parking.eventfd.notify();
        }
    }

    /// Takes up to `max` messages addressed to `to`, round-robin over its source cores; then
    /// wakes each source it took from that waits for room ([`Mesh::wait_for_room`]).
    pub fn drain(&self, to: u16, max: usize, out: &mut Vec<CoreMessage>) {
        let start = out.len();
        // Bit `from` (cores past 127 fall back to checking every source).
        let mut popped: u128 = 0;
        loop {
            let before = out.len();
            for from in 0..self.cores {
                if from == to {
                    continue;
                }
                if let Some(message) = self.queue(from, to).pop() {
                    out.push(message);
                    popped |= 1u128.checked_shl(u32::from(from)).unwrap_or(u128::MAX);
                }
            }
            if out.len() == before || out.len() - start >= max {
                break;
            }
        }
        if popped != 0 {
            self.wake_blocked(to, popped);
        }
    }

    /// After pops from the sources in `popped` (bit per core): the pop-fence-load half of the
    /// room protocol (module docs).
    fn wake_blocked(&self, to: u16, popped: u128) {
        fence(Ordering::SeqCst);
        for from in (0..self.cores).filter(|&from| from != to) {
            let bit = 1u128.checked_shl(u32::from(from)).unwrap_or(u128::MAX);
            let parking = &self.parking[usize::from(from)];
            if popped & bit != 0
                && parking.wants_room.load(Ordering::SeqCst)
                && parking.wants_room.swap(false, Ordering::SeqCst)
            {
                parking.eventfd.notify();
            }
        }
    }

    /// Core `from` found a destination queue full: announces that it waits for room, so the
    /// receivers that pop from its queues wake it (the store-fence half of the room protocol,
    /// module docs). The caller must then retry its sends once before it parks
    /// ([`Mesh::park`]); when they all went through, it calls [`Mesh::room_found`].
    pub fn wait_for_room(&self, from: u16) {
        self.parking[usize::from(from)]
            .wants_room
            .store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Core `from` no longer waits for room (its outbox is empty).
    pub fn room_found(&self, from: u16) {
        self.parking[usize::from(from)]
            .wants_room
            .store(false, Ordering::Relaxed);
    }

    fn has_inbound(&self, to: u16) -> bool {
        (0..self.cores).any(|from| from != to && !self.queue(from, to).is_empty())
    }

    /// A duplicate of core `to`'s eventfd, for its `AsyncFd`.
    pub fn eventfd_of(&self, to: u16) -> std::io::Result<OwnedFd> {
        self.parking[usize::from(to)]
            .eventfd
            .as_fd()
            .try_clone_to_owned()
    }

    /// Resets core `to`'s eventfd after a wake-up.
    pub fn reset(&self, to: u16) {
        self.parking[usize::from(to)].eventfd.drain();
    }

    /// Announces that core `to` is about to park. Returns false (and withdraws) when a message
    /// arrived meanwhile, in which case the caller drains instead of parking.
    pub fn park(&self, to: u16) -> bool {
        let parking = &self.parking[usize::from(to)];
        parking.parked.store(true, Ordering::SeqCst);
        if self.has_inbound(to) {
            parking.parked.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    pub fn unpark(&self, to: u16) {
        self.parking[usize::from(to)]
            .parked
            .store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, AsRawFd};

    use super::*;

    /// Bound on one wait for a wake-up in the thread test: only a lost wake-up (a protocol
    /// defect) ever reaches it; never a speed assert.
    const WAKE_BOUND_MS: i32 = 30_000;

    /// Whether core `core`'s eventfd becomes readable within `timeout_ms` (0: now).
    fn readable(mesh: &Mesh, core: u16, timeout_ms: i32) -> bool {
        let fd = mesh.eventfd_of(core).expect("eventfd");
        let mut pfd = libc::pollfd {
            fd: fd.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            // SAFETY: one valid pollfd on the stack, count 1.
            let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
            if rc >= 0 {
                return rc == 1 && pfd.revents & libc::POLLIN != 0;
            }
            let error = std::io::Error::last_os_error();
            assert_eq!(error.kind(), std::io::ErrorKind::Interrupted, "{error}");
        }
    }

    fn applied(token: u64) -> CoreMessage {
        CoreMessage::Applied { token }
    }

    #[test]
    fn a_sender_waiting_for_room_is_woken_by_the_receivers_drain() {
        // Proves the room protocol: a drain wakes a source that announced it waits for room
        // (once per announcement), not one that did not, and not a source it took nothing from;
        // the retry after announcing sees a slot freed before it.
        let mesh = Mesh::new(3).expect("mesh");
        for token in 0..QUEUE_CAPACITY as u64 {
            assert!(mesh.try_send(0, 1, applied(token)).is_ok());
        }
        assert!(mesh.try_send(0, 1, applied(9)).is_err(), "full");
        let mut out = Vec::new();
        // Nobody announced: a drain wakes no one.
        mesh.drain(1, 1, &mut out);
        assert!(!readable(&mesh, 0, 0));
        // A slot freed before the announcement: the retry takes it.
        mesh.wait_for_room(0);
        assert!(
            mesh.try_send(0, 1, applied(10)).is_ok(),
            "the retry sees the slot"
        );
        mesh.room_found(0);
        // Blocked again, announced, retry fails: the receiver's next drain wakes it.
        assert!(mesh.try_send(0, 1, applied(11)).is_err());
        mesh.wait_for_room(0);
        assert!(mesh.try_send(0, 1, applied(11)).is_err());
        assert!(mesh.try_send(2, 1, applied(20)).is_ok());
        // One pass takes one message from each source (cores 0 and 2).
        mesh.drain(1, 1, &mut out);
        assert!(readable(&mesh, 0, 0), "woken by the drain");
        assert!(!readable(&mesh, 2, 0), "core 2 never waited");
        mesh.reset(0);
        // The wake-up took the announcement: further drains do not write again.
        mesh.drain(1, 2, &mut out);
        assert!(!readable(&mesh, 0, 0), "one wake-up per announcement");
        // A drain that takes nothing from core 0 does not wake it.
        let mesh = Mesh::new(3).expect("mesh");
        mesh.wait_for_room(0);
        assert!(mesh.try_send(2, 1, applied(1)).is_ok());
        mesh.drain(1, usize::MAX, &mut out);
        assert!(!readable(&mesh, 0, 0), "took nothing from core 0");
    }

    #[test]
    fn a_flooding_sender_parks_until_a_slow_receiver_drains() {
        // Proves, with two threads, that a sender flooding a full queue waits on its eventfd
        // instead of spinning, and every wake-up comes from a receiver's drain: all messages
        // arrive in order, the sender fails at most two sends per wake-up (the send and its
        // retry), it never waits longer than the bound (a lost wake-up), and it waits no more
        // often than the receiver drained from it.
        const MESSAGES: u64 = 20 * QUEUE_CAPACITY as u64;
        //
        // The receiver starts draining only once the sender is committed to waiting (its send
        // and retry both failed), so the queue fills and the sender waits at least once however
        // the two threads are scheduled on a loaded machine.
        let mesh = std::sync::Arc::new(Mesh::new(2).expect("mesh"));
        let (sender_waits, first_wait) = std::sync::mpsc::channel::<()>();
        let receiver = {
            let mesh = std::sync::Arc::clone(&mesh);
            std::thread::spawn(move || {
                first_wait.recv().expect("the sender waits once");
                let mut got = Vec::with_capacity(MESSAGES as usize);
                let mut batch = Vec::new();
                let mut drains = 0u64;
                while (got.len() as u64) < MESSAGES {
                    // Small batches: the receiver is slower than the sender.
                    mesh.drain(1, 16, &mut batch);
                    if batch.is_empty() {
                        if mesh.park(1) {
                            assert!(readable(&mesh, 1, WAKE_BOUND_MS), "receiver never woken");
                            mesh.reset(1);
                        }
                        mesh.unpark(1);
                        continue;
                    }
                    drains += 1;
                    for message in batch.drain(..) {
                        let CoreMessage::Applied { token } = message else {
                            panic!("unexpected message");
                        };
                        got.push(token);
                    }
                    std::thread::yield_now();
                }
                (got, drains)
            })
        };
        let mut failed_sends = 0u64;
        let mut waits = 0u64;
        for token in 0..MESSAGES {
            let mut message = applied(token);
            loop {
                match mesh.try_send(0, 1, message) {
                    Ok(()) => break,
                    Err(back) => message = back,
                }
                failed_sends += 1;
                mesh.wait_for_room(0);
                match mesh.try_send(0, 1, message) {
                    Ok(()) => {
                        mesh.room_found(0);
                        break;
                    }
                    Err(back) => message = back,
                }
                failed_sends += 1;
                if waits == 0 {
                    sender_waits.send(()).expect("receiver alive");
                }
                assert!(
                    readable(&mesh, 0, WAKE_BOUND_MS),
                    "a blocked sender was never woken (lost wake-up)"
                );
                mesh.reset(0);
                waits += 1;
            }
        }
        let (got, drains) = receiver.join().expect("receiver");
        assert_eq!(got, (0..MESSAGES).collect::<Vec<_>>(), "all, in order");
        assert!(waits > 0, "the queue filled: the sender had to wait");
        // Every failed send is paid for by a wake-up (the send and its retry) or by a drain
        // that freed a slot between the two: a spinning sender would fail without bound.
        assert!(
            failed_sends <= 2 * waits + drains,
            "{failed_sends} failed sends for {waits} waits and {drains} drains"
        );
        assert!(waits <= drains, "{waits} waits but only {drains} drains");
    }

    #[test]
    fn queues_are_fifo_per_pair_and_bounded() {
        // Proves per-pair FIFO order, the capacity bound, and that drain takes from every source.
        let mesh = Mesh::new(3).expect("mesh");
        for token in 0..QUEUE_CAPACITY as u64 {
            assert!(mesh.try_send(0, 1, CoreMessage::Applied { token }).is_ok());
        }
        assert!(
            mesh.try_send(0, 1, CoreMessage::Applied { token: 9 })
                .is_err()
        );
        assert!(
            mesh.try_send(2, 1, CoreMessage::Applied { token: 7 })
                .is_ok()
        );
        let mut out = Vec::new();
        mesh.drain(1, usize::MAX, &mut out);
        assert_eq!(out.len(), QUEUE_CAPACITY + 1);
        let from_zero: Vec<u64> = out
            .iter()
            .filter_map(|message| match message {
                CoreMessage::Applied { token } if *token != 7 => Some(*token),
                _ => None,
            })
            .collect();
        assert!(from_zero.windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn park_is_refused_while_a_message_waits() {
        // Proves the re-check after announcing a park: a waiting message cancels the park.
        let mesh = Mesh::new(2).expect("mesh");
        assert!(mesh.park(1));
        mesh.unpark(1);
        assert!(
            mesh.try_send(0, 1, CoreMessage::Applied { token: 1 })
                .is_ok()
        );
        assert!(!mesh.park(1));
    }
}
