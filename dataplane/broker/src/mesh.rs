//! Cross-core messaging: one bounded lock-free queue (crossbeam `ArrayQueue`) per ordered pair
//! of data-plane cores, wired once at start-up, plus one eventfd per core to wake it when it is
//! parked. Shared by every core thread through an `Arc`; no lock anywhere.
//!
//! Protocol (per receiving core): the receiver drains its inbound queues in batches; when it
//! finds nothing for [`SPIN_BEFORE_PARK`] it sets its `parked` flag, checks the queues once more
//! and only then waits on its eventfd. A sender pushes, then writes the eventfd only if the
//! receiver announced it is parked (`SeqCst` on both sides, so either the receiver sees the
//! message in its re-check or the sender sees the flag). Waking an idle core costs ~25-30 us on
//! this class of VM (MACHINE-NOTES), so the spin keeps busy cores from paying it per message.
//!
//! Messages are owned values carrying their source core; the answer goes back to it. A full
//! queue is backpressure: the sender yields and retries; nothing grows without bound.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use felix_engine::{EngineError, ShardState, StreamDescription, SubscriptionId};
use felix_wire::{DeliveredRecord, Record, ShardAck, StartPosition, StreamKind};

/// Messages one ordered core pair can hold. 1024 covers a full ingress queue (512 jobs) of
/// forwarded publishes plus their answers and delivery credits; beyond it senders wait.
pub const QUEUE_CAPACITY: usize = 1024;
/// Messages handled per drain round before the pump yields to the core's connections, so a
/// flood of cross-core work cannot starve the QUIC endpoints.
pub const DRAIN_BATCH: usize = 256;
/// How long an idle pump keeps polling before it parks on its eventfd: about the cost of one
/// wake-up (~25-30 us measured), so a core that is busy anyway never pays a wake-up.
pub const SPIN_BEFORE_PARK: Duration = Duration::from_micros(40);

/// A catalogue change, serialized through core 0.
#[derive(Debug, Clone)]
pub enum AdminRequest {
    Create {
        name: String,
        shard_count: u32,
        kind: StreamKind,
        /// A durable stream's catalogue id: `None` until core 0 assigns it.
        stream_id: Option<u32>,
    },
    Delete {
        name: String,
    },
}

/// Everything cores say to each other. `token` matches an answer to its request on the
/// requesting core; `from` is the requesting core.
#[derive(Debug)]
pub enum CoreMessage {
    /// Append records (all owned by the receiver) and answer with `PublishDone`.
    Publish {
        from: u16,
        token: u64,
        stream: String,
        records: Vec<Record>,
        now_us: u64,
    },
    PublishDone {
        token: u64,
        result: Result<Vec<ShardAck>, EngineError>,
    },
    /// To core 0: validate and apply a catalogue change everywhere, answer with `AdminDone`.
    Admin {
        from: u16,
        token: u64,
        request: AdminRequest,
    },
    /// From core 0: apply a change core 0 already validated; answer with `Applied`.
    Apply {
        token: u64,
        request: AdminRequest,
    },
    Applied {
        token: u64,
    },
    AdminDone {
        token: u64,
        result: Result<StreamDescription, EngineError>,
    },
    /// The receiver's view of its own shards of a stream; answer with `DescribeDone`.
    Describe {
        from: u16,
        token: u64,
        stream: String,
    },
    DescribeDone {
        token: u64,
        result: Result<Vec<ShardState>, EngineError>,
    },
    /// Register a subscription for `shards` (all owned by the receiver) whose records go to
    /// core `from`, slot `slot`; answer with `SubscribeDone`.
    Subscribe {
        from: u16,
        token: u64,
        slot: u64,
        stream: String,
        shards: Vec<u32>,
        start: StartPosition,
    },
    SubscribeDone {
        token: u64,
        result: Result<(SubscriptionId, Vec<(u32, u64)>), EngineError>,
    },
    /// Records for slot `slot` on the receiver, from the owner's subscription `id`.
    Deliver {
        slot: u64,
        owner: u16,
        id: SubscriptionId,
        records: Vec<DeliveredRecord>,
    },
    /// The owner ended its part of slot `slot` (lagged, stream deleted).
    Ended {
        slot: u64,
        error: EngineError,
    },
    /// The subscriber core wrote one delivery batch of subscription `id`: one more may come.
    Credit {
        id: SubscriptionId,
    },
    /// The subscriber went away: forget subscription `id`.
    Unsubscribe {
        id: SubscriptionId,
    },
}

/// One core's wake-up line.
struct Parking {
    eventfd: OwnedFd,
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

fn eventfd() -> std::io::Result<OwnedFd> {
    // SAFETY: eventfd has no pointer arguments; the result is checked before use.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor returned by eventfd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
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
                    eventfd: eventfd()?,
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
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to an eventfd this mesh owns. A failure
            // (EAGAIN at the counter's maximum) means the core is already signalled.
            let _ = unsafe {
                libc::write(
                    parking.eventfd.as_raw_fd(),
                    std::ptr::from_ref(&one).cast::<libc::c_void>(),
                    8,
                )
            };
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
        self.parking[usize::from(to)].eventfd.try_clone()
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

/// Reads (and so resets) an eventfd counter; nothing to do if it was already zero.
pub fn reset_eventfd(fd: &OwnedFd) {
    let mut value: u64 = 0;
    // SAFETY: reads at most 8 bytes into a live u64 from a non-blocking eventfd we own.
    let _ = unsafe {
        libc::read(
            fd.as_raw_fd(),
            std::ptr::from_mut(&mut value).cast::<libc::c_void>(),
            8,
        )
    };
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
