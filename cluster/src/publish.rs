//! Publishing into a replicated shard from this member (docs/cluster.md, "The publish path").
//!
//! Each shard group a member holds has one [`Producer`]: the member's idempotent producer on
//! that shard. A publish batch gets the producer's next sequence number and is proposed to the
//! group; a follower's proposal is forwarded by Raft to the leader, so a publish entering any
//! replica reaches the shard without a forwarding protocol of Felix's own. The batch's caller is
//! answered when the entry is **applied on this member**: applied means committed, and
//! committed means that a majority including the leader has the entry fsynced (Quorum).
//!
//! Proposals can be lost (a leader change drops what the old leader had not replicated, a
//! forward can be lost on the way), and raft-rs never retries them. So a batch stays pending
//! until applied, and pending batches older than [`PROPOSE_AGAIN_TICKS`] are proposed again, in
//! sequence order; after a new leader, or once one of ours is refused because one before it
//! was lost, every pending batch is proposed again at the next tick (at most once per
//! [`PROPOSE_ALL_TICKS`]), so a leader change costs a publish about an election, not seconds
//! of batches each waiting out its own retry and being refused behind a lost one. The shard
//! applies each (producer, sequence) once (`shard.rs`): a retry of an applied batch takes no
//! offsets, and a batch that skips a lost one is refused until the lost one is in. Every
//! answered batch is therefore in the shard exactly once, at the offsets its answer gives,
//! and a producer's batches are in the shard in the order they were given.
//!
//! A caller whose deadline passes is answered [`PublishError::Timeout`] (the outcome is then
//! unknown: the batch may still commit), but the batch stays pending, because the batches
//! after it cannot be applied before it. Pending batches are bounded ([`PENDING_BATCHES_MAX`],
//! [`PENDING_BYTES_MAX`]); beyond, a publish is refused at once with [`PublishError::Busy`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::shard::{Batch, ShardApplied, ShardRecord};

/// Ticks (of `service::TICK`) a pending batch waits before it is proposed again.
pub const PROPOSE_AGAIN_TICKS: u64 = 10;

/// Fewest ticks between two proposals of every pending batch at once (after a new leader, or
/// a batch refused because one before it was lost).
pub const PROPOSE_ALL_TICKS: u64 = 3;

/// Batches pending per shard group before new publishes are refused.
pub const PENDING_BATCHES_MAX: usize = 4_096;

/// Bytes of pending batches per shard group before new publishes are refused.
pub const PENDING_BYTES_MAX: usize = 64 << 20;

/// Where an answered batch's records are: offsets `first_offset..first_offset + count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishAck {
    pub first_offset: u64,
    pub count: u32,
}

/// Why a publish was not answered with offsets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    #[error("stream {stream:?} is not a replicated stream of this cluster")]
    NoSuchStream { stream: String },
    #[error("shard {shard} of stream {stream:?} is not replicated on this member")]
    NotReplicatedHere { stream: String, shard: u32 },
    #[error("shard {shard} of stream {stream:?} has {pending} batches pending; retry later")]
    Busy {
        stream: String,
        shard: u32,
        pending: usize,
    },
    #[error(
        "not committed within {0:?}: the batch may still commit (publish it again with the \
         same producer sequence to learn its offsets)"
    )]
    Timeout(Duration),
    #[error("the cluster service stopped")]
    Stopped,
    #[error("member {member}, the shard's owner, cannot be reached")]
    OwnerUnreachable { member: u64 },
    #[error("member {member} does not own the shard (its placement changed?)")]
    NotOwner { member: u64 },
    #[error(
        "the batch was committed, but its offsets are no longer known (this member caught up \
         from a snapshot past it)"
    )]
    OffsetsUnknown,
}

/// Called exactly once with a publish's outcome, on the service loop's thread (it must not block).
/// An answer dropped without being called (a request still queued when the service stops)
/// answers [`PublishError::Stopped`], so no caller waits forever.
pub struct PublishAnswer(Option<AnswerFn>);

type AnswerFn = Box<dyn FnOnce(Result<PublishAck, PublishError>) + Send>;

impl PublishAnswer {
    pub fn new(answer: impl FnOnce(Result<PublishAck, PublishError>) + Send + 'static) -> Self {
        PublishAnswer(Some(Box::new(answer)))
    }

    /// Answers the caller.
    pub fn answer(mut self, result: Result<PublishAck, PublishError>) {
        if let Some(answer) = self.0.take() {
            answer(result);
        }
    }
}

impl Drop for PublishAnswer {
    fn drop(&mut self) {
        if let Some(answer) = self.0.take() {
            answer(Err(PublishError::Stopped));
        }
    }
}

impl std::fmt::Debug for PublishAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "PublishAnswer(waiting)"
        } else {
            "PublishAnswer(answered)"
        })
    }
}

struct Pending {
    data: Vec<u8>,
    /// `None` once the caller was answered (its deadline passed).
    answer: Option<PublishAnswer>,
    deadline: Instant,
    timeout: Duration,
    /// The tick it was last proposed at; `None`: never (no leader was known).
    proposed_at: Option<u64>,
}

/// This member's idempotent producer on one shard group.
pub(crate) struct Producer {
    id: u64,
    next_sequence: u64,
    pending: BTreeMap<u64, Pending>,
    pending_bytes: usize,
    /// Every pending batch is due at the next tick (a new leader, or a gap: one of ours was
    /// lost, so the ones after it are refused until it is in).
    propose_all: bool,
    /// The tick every pending batch was last proposed at once.
    proposed_all_at: Option<u64>,
}

impl Producer {
    /// A producer with an id no earlier run of this member used on this shard: the member id
    /// over the start time's low 48 bits of nanoseconds.
    pub(crate) fn new(member: u64, boot: u64) -> Producer {
        Producer {
            id: (member << 48) | (boot & ((1 << 48) - 1)),
            next_sequence: 1,
            pending: BTreeMap::new(),
            pending_bytes: 0,
            propose_all: false,
            proposed_all_at: None,
        }
    }

    /// The group's leader changed: what was forwarded to the old one may be lost, so every
    /// pending batch is proposed again at the next tick, in sequence order, rather than a
    /// [`PROPOSE_AGAIN_TICKS`] wait after its last proposal.
    pub(crate) fn leader_changed(&mut self) {
        if !self.pending.is_empty() {
            self.propose_all = true;
        }
    }

    /// Takes a batch: returns its sequence and the entry data to propose now, or gives the
    /// answer back with the number pending when too much is.
    pub(crate) fn add(
        &mut self,
        records: Vec<ShardRecord>,
        deadline: Instant,
        timeout: Duration,
        answer: PublishAnswer,
        client: Option<(u64, u64)>,
    ) -> Result<(u64, Vec<u8>), (PublishAnswer, usize)> {
        if self.pending.len() >= PENDING_BATCHES_MAX || self.pending_bytes >= PENDING_BYTES_MAX {
            return Err((answer, self.pending.len()));
        }
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        let data = Batch {
            producer: self.id,
            sequence,
            client,
            records,
        }
        .encode();
        self.pending_bytes += data.len();
        self.pending.insert(
            sequence,
            Pending {
                data: data.clone(),
                answer: Some(answer),
                deadline,
                timeout,
                proposed_at: None,
            },
        );
        Ok((sequence, data))
    }

    /// The batch `sequence` was proposed at tick `tick`.
    pub(crate) fn proposed(&mut self, sequence: u64, tick: u64) {
        if let Some(pending) = self.pending.get_mut(&sequence) {
            pending.proposed_at = Some(tick);
        }
    }

    /// An entry applied on this member: answers the batch if it is one of ours and took its
    /// offsets (or is a retry of one that did). A refused (out-of-order) batch stays pending.
    pub(crate) fn applied(&mut self, applied: &ShardApplied) {
        if applied.producer != self.id {
            return;
        }
        if applied.out_of_order {
            // One of ours before it was lost: without this, each batch after the gap would
            // wait its own PROPOSE_AGAIN_TICKS, and be refused again if the lost one had not
            // got in by then (seconds of stall after a leader change).
            self.propose_all = true;
            return;
        }
        let Some(pending) = self.pending.remove(&applied.sequence) else {
            return;
        };
        self.pending_bytes -= pending.data.len();
        if let Some(answer) = pending.answer {
            // A batch has at least one record: a count of 0 is a duplicate older than the
            // offsets the shard keeps (`shard::RECENT_BATCHES`). It is in the shard, where is
            // not known: never acknowledged with offsets it does not have.
            answer.answer(if applied.count == 0 {
                Err(PublishError::OffsetsUnknown)
            } else {
                Ok(PublishAck {
                    first_offset: applied.first_offset,
                    count: applied.count,
                })
            });
        }
    }

    /// A tick: answers callers whose deadline passed, and returns the batches to propose
    /// again (in sequence order): those never proposed, and those proposed
    /// [`PROPOSE_AGAIN_TICKS`] or more ago; every one after a new leader or a gap (at most
    /// once per [`PROPOSE_ALL_TICKS`]).
    pub(crate) fn due(&mut self, tick: u64, now: Instant) -> Vec<(u64, Vec<u8>)> {
        let all = self.propose_all
            && self
                .proposed_all_at
                .is_none_or(|at| tick - at >= PROPOSE_ALL_TICKS);
        if all {
            self.propose_all = false;
            self.proposed_all_at = Some(tick);
        }
        let mut due = Vec::new();
        for (sequence, pending) in &mut self.pending {
            if pending.deadline <= now
                && let Some(answer) = pending.answer.take()
            {
                answer.answer(Err(PublishError::Timeout(pending.timeout)));
            }
            if all
                || pending
                    .proposed_at
                    .is_none_or(|at| tick - at >= PROPOSE_AGAIN_TICKS)
            {
                due.push((*sequence, pending.data.clone()));
            }
        }
        due
    }

    /// Batches pending.
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The group stopped (its stream was deleted, or the service stops): every waiting caller
    /// is answered with `error`.
    pub(crate) fn fail_all(&mut self, error: &PublishError) {
        for (_, pending) in std::mem::take(&mut self.pending) {
            if let Some(answer) = pending.answer {
                answer.answer(Err(error.clone()));
            }
        }
        self.pending_bytes = 0;
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.fail_all(&PublishError::Stopped);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;

    use super::*;
    use crate::node::Machine;
    use crate::shard::ShardState;

    type Answers = Arc<Mutex<Vec<(u64, Result<PublishAck, PublishError>)>>>;

    fn answer_into(answers: &Answers, tag: u64) -> PublishAnswer {
        let answers = Arc::clone(answers);
        PublishAnswer::new(move |result| answers.lock().unwrap().push((tag, result)))
    }

    fn records(n: usize) -> Vec<ShardRecord> {
        (0..n)
            .map(|i| ShardRecord {
                timestamp_us: 0,
                key: Bytes::new(),
                payload: Bytes::from(vec![i as u8; 8]),
            })
            .collect()
    }

    #[test]
    fn a_lost_batch_is_proposed_again_and_every_batch_is_answered_once_in_order() {
        let answers = Answers::default();
        let mut producer = Producer::new(3, 77);
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let timeout = Duration::from_secs(60);
        let (_, first) = producer
            .add(records(2), later, timeout, answer_into(&answers, 1), None)
            .unwrap_or_else(|_| panic!("room"));
        producer.proposed(1, 0);
        let (_, second) = producer
            .add(records(3), later, timeout, answer_into(&answers, 2), None)
            .unwrap_or_else(|_| panic!("room"));
        producer.proposed(2, 0);
        // The first proposal is lost: the second is applied first and refused.
        let mut shard = ShardState::default();
        let refused = shard.apply(1, &second).unwrap();
        assert!(refused.out_of_order);
        producer.applied(&refused);
        assert!(answers.lock().unwrap().is_empty());
        // The refusal shows a gap: both are due at the next tick, in order (not a
        // PROPOSE_AGAIN_TICKS wait each).
        let due = producer.due(1, now);
        assert_eq!(
            due.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![1, 2],
            "due in sequence order"
        );
        for (sequence, _) in &due {
            producer.proposed(*sequence, 1);
        }
        // Once proposed again, nothing is due before PROPOSE_AGAIN_TICKS.
        assert!(producer.due(PROPOSE_AGAIN_TICKS, now).is_empty());
        for (index, (_, data)) in (2..).zip(&due) {
            let applied = shard.apply(index, data).unwrap();
            producer.applied(&applied);
        }
        // The original of batch 1, late: a duplicate, answered nothing more.
        let late = shard.apply(4, &first).unwrap();
        assert!(late.duplicate);
        producer.applied(&late);
        let answers = answers.lock().unwrap();
        assert_eq!(
            *answers,
            vec![
                (
                    1,
                    Ok(PublishAck {
                        first_offset: 0,
                        count: 2
                    })
                ),
                (
                    2,
                    Ok(PublishAck {
                        first_offset: 2,
                        count: 3
                    })
                ),
            ]
        );
        assert_eq!(producer.pending(), 0);
    }

    #[test]
    fn a_new_leader_makes_every_pending_batch_due_at_once_at_most_every_few_ticks() {
        let answers = Answers::default();
        let mut producer = Producer::new(3, 77);
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let timeout = Duration::from_secs(60);
        for tag in 1..=3 {
            producer
                .add(records(1), later, timeout, answer_into(&answers, tag), None)
                .unwrap_or_else(|_| panic!("room"));
            producer.proposed(tag, 10);
        }
        assert!(producer.due(11, now).is_empty(), "proposed a tick ago");
        producer.leader_changed();
        let due: Vec<u64> = producer.due(12, now).iter().map(|(s, _)| *s).collect();
        assert_eq!(due, vec![1, 2, 3]);
        for sequence in &due {
            producer.proposed(*sequence, 12);
        }
        // Another change right away waits PROPOSE_ALL_TICKS, then proposes all again.
        producer.leader_changed();
        assert!(producer.due(13, now).is_empty());
        assert_eq!(producer.due(12 + PROPOSE_ALL_TICKS, now).len(), 3);
        // With nothing pending a leader change asks for nothing.
        let mut idle = Producer::new(4, 1);
        idle.leader_changed();
        assert!(!idle.propose_all);
    }

    #[test]
    fn a_caller_past_its_deadline_hears_timeout_but_the_batch_stays_pending() {
        let answers = Answers::default();
        let mut producer = Producer::new(1, 5);
        let now = Instant::now();
        let timeout = Duration::from_millis(10);
        let (_, data) = producer
            .add(
                records(1),
                now + timeout,
                timeout,
                answer_into(&answers, 1),
                None,
            )
            .unwrap_or_else(|_| panic!("room"));
        producer.proposed(1, 0);
        let _ = producer.due(1, now + Duration::from_secs(1));
        assert!(matches!(
            answers.lock().unwrap()[..],
            [(1, Err(PublishError::Timeout(_)))]
        ));
        assert_eq!(producer.pending(), 1, "later batches need it applied first");
        let mut shard = ShardState::default();
        producer.applied(&shard.apply(1, &data).unwrap());
        assert_eq!(producer.pending(), 0);
        assert_eq!(answers.lock().unwrap().len(), 1, "answered once");
    }

    #[test]
    fn too_much_pending_is_refused_and_a_stopped_group_answers_everyone() {
        let answers = Answers::default();
        let mut producer = Producer::new(1, 5);
        let later = Instant::now() + Duration::from_secs(60);
        for tag in 0..PENDING_BATCHES_MAX as u64 {
            assert!(
                producer
                    .add(
                        records(1),
                        later,
                        Duration::ZERO,
                        answer_into(&answers, tag),
                        None,
                    )
                    .is_ok()
            );
        }
        let Err((answer, pending)) = producer.add(
            records(1),
            later,
            Duration::ZERO,
            answer_into(&answers, 0),
            None,
        ) else {
            panic!("a full producer refuses");
        };
        assert_eq!(pending, PENDING_BATCHES_MAX);
        // An answer dropped unanswered (here: the refused one) answers `stopped` itself.
        drop(answer);
        assert_eq!(answers.lock().unwrap().len(), 1);
        drop(producer);
        let answers = answers.lock().unwrap();
        assert_eq!(answers.len(), PENDING_BATCHES_MAX + 1);
        assert!(
            answers
                .iter()
                .all(|(_, r)| *r == Err(PublishError::Stopped))
        );
    }
}
