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
//! core's outbox (`felix_core::Core::return_message`) and the sender retries; what waits there
//! is bounded by what caused it (the ingress queue, the requests received, the credits).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// One core's wake-up line.
struct Parking {
    eventfd: EventFd,
    parked: AtomicBool,
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

    /// Takes up to `max` messages addressed to `to`, round-robin over its source cores.
    pub fn drain(&self, to: u16, max: usize, out: &mut Vec<CoreMessage>) {
        let start = out.len();
        loop {
            let before = out.len();
            for from in 0..self.cores {
                if from == to {
                    continue;
                }
                if let Some(message) = self.queue(from, to).pop() {
                    out.push(message);
                }
            }
            if out.len() == before || out.len() - start >= max {
                return;
            }
        }
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
    use super::*;

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
