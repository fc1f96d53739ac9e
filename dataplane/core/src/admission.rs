//! Ingress admission (docs/semantics.md, 3 Publishing: the ingress queue), sans-IO: one per
//! data-plane core, used from that core's thread only. Time is passed in; nothing here touches
//! a clock, a socket or a task.
//!
//! A job (one publish request's share of a core's work) occupies a slot and its payload bytes
//! from [`Admission::handle_request`] until [`Admission::handle_complete`]. When a job does not
//! fit, the caller's [`Policy`] decides: shed it, refuse it, or queue it as a waiter. Waiters
//! are admitted strictly oldest first, one at a time as room frees up (no thundering herd),
//! and a new request never overtakes a waiter. A job larger than the whole byte budget is
//! admitted only when nothing else is held, since it could never fit otherwise.
//!
//! Output: [`Admission::poll_event`] yields `Admitted(ticket)` / `Expired(ticket)` in the order
//! they happened; [`Admission::poll_timeout`] gives the earliest waiter deadline.

use std::collections::VecDeque;
use std::time::Instant;

/// What to do with a job that does not fit now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Drop it and count it (fire-and-forget, the default).
    Shed,
    /// Answer at once with `IngressBudgetExhausted` (an acked publish that acks on enqueue).
    Refuse,
    /// Queue until room frees up, or until `deadline` passes (then it is refused).
    Wait { deadline: Option<Instant> },
}

/// Identifies a waiter until it is admitted or expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// The immediate answer to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Holding a slot and its bytes now; call `handle_complete` with the same bytes later.
    Admitted,
    Shed,
    Refused,
    /// Queued; an `Admitted(ticket)` or `Expired(ticket)` event follows.
    Waiting(Ticket),
}

/// Something that happened to a waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionEvent {
    /// The waiter now holds a slot and its bytes.
    Admitted(Ticket),
    /// The waiter's deadline passed; it holds nothing and must be refused.
    Expired(Ticket),
}

#[derive(Debug)]
struct Waiter {
    ticket: Ticket,
    bytes: u64,
    deadline: Option<Instant>,
}

/// One core's ingress queue: depth and byte budget, plus the FIFO of waiters.
#[derive(Debug)]
pub struct Admission {
    depth_max: u64,
    budget_bytes: u64,
    depth: u64,
    held_bytes: u64,
    /// Bounded by the callers: each waiter is one parked publish, and a stream parks at most
    /// one (later publishes on it queue behind it), so this is at most the open streams.
    waiters: VecDeque<Waiter>,
    next_ticket: u64,
    events: VecDeque<AdmissionEvent>,
}

impl Admission {
    /// `depth_max` >= 1 jobs; `budget_bytes` of payload (0 admits one job at a time).
    #[must_use]
    pub fn new(depth_max: u64, budget_bytes: u64) -> Admission {
        assert!(depth_max >= 1, "the ingress queue holds at least one job");
        Admission {
            depth_max,
            budget_bytes,
            depth: 0,
            held_bytes: 0,
            waiters: VecDeque::new(),
            next_ticket: 1,
            events: VecDeque::new(),
        }
    }

    /// Jobs held now.
    #[must_use]
    pub fn depth(&self) -> u64 {
        self.depth
    }

    /// Payload bytes held now.
    #[must_use]
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Waiters queued now.
    #[must_use]
    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    fn fits(&self, bytes: u64) -> bool {
        if self.depth >= self.depth_max {
            return false;
        }
        if bytes > self.budget_bytes {
            // Larger than the whole budget: only alone, else it could never run.
            return self.depth == 0;
        }
        self.held_bytes + bytes <= self.budget_bytes
    }

    fn take(&mut self, bytes: u64) {
        self.depth += 1;
        self.held_bytes += bytes;
        assert!(self.depth <= self.depth_max, "depth stays within its bound");
    }

    /// A job of `bytes` payload bytes asks for room at `now`.
    pub fn handle_request(&mut self, now: Instant, bytes: u64, policy: Policy) -> Decision {
        // Expired waiters must not hold up a request that would now fit.
        self.handle_timeout(now);
        if self.waiters.is_empty() && self.fits(bytes) {
            self.take(bytes);
            return Decision::Admitted;
        }
        match policy {
            Policy::Shed => Decision::Shed,
            Policy::Refuse => Decision::Refused,
            Policy::Wait { deadline } => {
                if deadline.is_some_and(|deadline| deadline <= now) {
                    return Decision::Refused;
                }
                let ticket = Ticket(self.next_ticket);
                self.next_ticket += 1;
                self.waiters.push_back(Waiter {
                    ticket,
                    bytes,
                    deadline,
                });
                Decision::Waiting(ticket)
            }
        }
    }

    /// A job admitted with `bytes` completed: frees its slot and admits waiters, oldest first,
    /// while the oldest fits.
    pub fn handle_complete(&mut self, now: Instant, bytes: u64) {
        assert!(self.depth > 0, "a completed job was admitted");
        assert!(self.held_bytes >= bytes, "a job frees what it took");
        self.depth -= 1;
        self.held_bytes -= bytes;
        self.handle_timeout(now);
        self.admit_waiters();
    }

    /// Expires waiters whose deadline is at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let before = self.waiters.len();
        let events = &mut self.events;
        self.waiters.retain(|waiter| {
            let expired = waiter.deadline.is_some_and(|deadline| deadline <= now);
            if expired {
                events.push_back(AdmissionEvent::Expired(waiter.ticket));
            }
            !expired
        });
        if self.waiters.len() != before {
            // The head may have changed to one that fits.
            self.admit_waiters();
        }
    }

    /// Withdraws a waiter (its publisher went away). Returns false if it is not waiting.
    pub fn handle_cancel(&mut self, ticket: Ticket) -> bool {
        let Some(position) = self.waiters.iter().position(|w| w.ticket == ticket) else {
            return false;
        };
        self.waiters.remove(position);
        self.admit_waiters();
        true
    }

    fn admit_waiters(&mut self) {
        while let Some(head) = self.waiters.front() {
            if !self.fits(head.bytes) {
                break;
            }
            let bytes = head.bytes;
            let ticket = head.ticket;
            self.waiters.pop_front();
            self.take(bytes);
            self.events.push_back(AdmissionEvent::Admitted(ticket));
        }
    }

    /// Next event, oldest first.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<AdmissionEvent> {
        self.events.pop_front()
    }

    /// Earliest waiter deadline, if any waiter has one.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.waiters.iter().filter_map(|w| w.deadline).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn drain(admission: &mut Admission) -> Vec<AdmissionEvent> {
        std::iter::from_fn(|| admission.poll_event()).collect()
    }

    #[test]
    fn full_queue_sheds_refuses_or_queues_by_policy() {
        // Proves the three overload answers once depth is exhausted, and that nothing leaks.
        let now = Instant::now();
        let mut admission = Admission::new(1, 1000);
        assert_eq!(
            admission.handle_request(now, 10, Policy::Shed),
            Decision::Admitted
        );
        assert_eq!(
            admission.handle_request(now, 10, Policy::Shed),
            Decision::Shed
        );
        assert_eq!(
            admission.handle_request(now, 10, Policy::Refuse),
            Decision::Refused
        );
        let Decision::Waiting(ticket) =
            admission.handle_request(now, 10, Policy::Wait { deadline: None })
        else {
            panic!("a waiter queues")
        };
        admission.handle_complete(now, 10);
        assert_eq!(
            drain(&mut admission),
            vec![AdmissionEvent::Admitted(ticket)]
        );
        assert_eq!(admission.depth(), 1);
        admission.handle_complete(now, 10);
        assert_eq!((admission.depth(), admission.held_bytes()), (0, 0));
    }

    #[test]
    fn byte_budget_bounds_admission() {
        // Proves the byte budget, not only the depth, refuses a job that would exceed it.
        let now = Instant::now();
        let mut admission = Admission::new(100, 100);
        assert_eq!(
            admission.handle_request(now, 60, Policy::Refuse),
            Decision::Admitted
        );
        assert_eq!(
            admission.handle_request(now, 60, Policy::Refuse),
            Decision::Refused
        );
        assert_eq!(
            admission.handle_request(now, 40, Policy::Refuse),
            Decision::Admitted
        );
    }

    #[test]
    fn waiters_are_admitted_oldest_first_one_per_freed_slot() {
        // Proves FIFO admission: one waiter per freed slot, oldest first, and no overtaking.
        let now = Instant::now();
        let mut admission = Admission::new(2, 1_000_000);
        let wait = Policy::Wait { deadline: None };
        assert_eq!(admission.handle_request(now, 1, wait), Decision::Admitted);
        assert_eq!(admission.handle_request(now, 1, wait), Decision::Admitted);
        let tickets: Vec<Ticket> = (0..3)
            .map(|_| match admission.handle_request(now, 1, wait) {
                Decision::Waiting(ticket) => ticket,
                other => panic!("expected to wait, got {other:?}"),
            })
            .collect();
        admission.handle_complete(now, 1);
        assert_eq!(
            drain(&mut admission),
            vec![AdmissionEvent::Admitted(tickets[0])]
        );
        // A newcomer does not jump ahead of the two still waiting, even with a shed policy.
        assert_eq!(
            admission.handle_request(now, 1, Policy::Shed),
            Decision::Shed
        );
        admission.handle_complete(now, 1);
        admission.handle_complete(now, 1);
        assert_eq!(
            drain(&mut admission),
            vec![
                AdmissionEvent::Admitted(tickets[1]),
                AdmissionEvent::Admitted(tickets[2])
            ]
        );
    }

    #[test]
    fn waiter_expires_at_its_deadline_and_not_before() {
        // Proves an ack-on-commit waiter is refused only once its deadline has passed.
        let start = Instant::now();
        let deadline = start + Duration::from_millis(2000);
        let mut admission = Admission::new(1, 100);
        assert_eq!(
            admission.handle_request(start, 1, Policy::Refuse),
            Decision::Admitted
        );
        let Decision::Waiting(ticket) = admission.handle_request(
            start,
            1,
            Policy::Wait {
                deadline: Some(deadline),
            },
        ) else {
            panic!("a waiter queues")
        };
        assert_eq!(admission.poll_timeout(), Some(deadline));
        admission.handle_timeout(start + Duration::from_millis(1999));
        assert_eq!(drain(&mut admission), vec![]);
        admission.handle_timeout(deadline);
        assert_eq!(drain(&mut admission), vec![AdmissionEvent::Expired(ticket)]);
        assert_eq!(admission.waiting(), 0);
        assert_eq!(admission.poll_timeout(), None);
    }

    #[test]
    fn oversized_job_runs_only_alone() {
        // Proves a job larger than the budget waits for an empty queue, then is admitted.
        let now = Instant::now();
        let mut admission = Admission::new(10, 100);
        assert_eq!(
            admission.handle_request(now, 10, Policy::Refuse),
            Decision::Admitted
        );
        let Decision::Waiting(big) =
            admission.handle_request(now, 500, Policy::Wait { deadline: None })
        else {
            panic!("the big job waits")
        };
        admission.handle_complete(now, 10);
        assert_eq!(drain(&mut admission), vec![AdmissionEvent::Admitted(big)]);
        assert_eq!(admission.held_bytes(), 500);
        assert_eq!(
            admission.handle_request(now, 1, Policy::Refuse),
            Decision::Refused
        );
    }

    #[test]
    fn cancelled_head_lets_the_next_waiter_in() {
        // Proves withdrawing a waiter that blocks the head admits the next one that fits.
        let now = Instant::now();
        let mut admission = Admission::new(10, 100);
        let wait = Policy::Wait { deadline: None };
        assert_eq!(admission.handle_request(now, 50, wait), Decision::Admitted);
        let Decision::Waiting(big) = admission.handle_request(now, 80, wait) else {
            panic!("waits")
        };
        let Decision::Waiting(small) = admission.handle_request(now, 10, wait) else {
            panic!("waits behind")
        };
        assert!(admission.handle_cancel(big));
        assert!(!admission.handle_cancel(big));
        assert_eq!(drain(&mut admission), vec![AdmissionEvent::Admitted(small)]);
    }
}
