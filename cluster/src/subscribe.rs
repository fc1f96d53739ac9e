//! Subscribing to replicated shards on any member (docs/cluster.md, "Subscribing").
//!
//! A subscription reads this member's copy of each selected shard: only applied entries have
//! offsets (`shard.rs`), and applied means committed, so a subscriber on any replica (leader
//! or follower) sees committed records only, in each shard's offset order, the same records
//! at the same offsets on every member.
//!
//! Delivery is pull-shaped, like the data plane's cross-core deliveries (`felix-core`'s
//! `subscribe.rs`): a subscription holds at most [`CREDITS`] batches in flight; the caller
//! gives a credit back for each batch it has written ([`crate::service::Service::credit`]).
//! A subscription with credits reads its next batch straight from the shard's log whenever
//! the shard has records past its cursor (after every round of the service). Nothing queues
//! per subscriber, so a slow subscriber never lags out: it reads behind, from the log, until
//! the records it wants are compacted away ([`SubscribeError::TooOld`]).

use std::collections::{BTreeMap, VecDeque};

use felix_storage::{Backend, SystemBackend};

use crate::control::ControlState;
use crate::groups::Groups;
use crate::memory::{
    DataFrame, FETCH_RETRY_TICKS, Fetch, FetchRefusal, Fetched, MemoryShards, ShardKey,
};
use crate::shard::{ReadError, ShardRecord};

/// Batches a subscription may have in flight (written by the caller and not yet credited).
pub const CREDITS: u32 = 4;

/// Where a shard's delivery starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The oldest record this member still holds of the shard.
    Earliest,
    /// The next record committed.
    Latest,
    /// This offset (at most the next offset; at least the oldest held).
    Offset(u64),
}

/// A delivered record: its shard and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub shard: u32,
    pub offset: u64,
    pub record: ShardRecord,
}

/// Why a subscription was refused or ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    #[error("stream {stream:?} is not a replicated stream of this cluster")]
    NoSuchStream { stream: String },
    #[error("stream {stream:?} has {shards} shards: there is no shard {shard}")]
    NoSuchShard {
        stream: String,
        shard: u32,
        shards: usize,
    },
    #[error(
        "shard {shard} of stream {stream:?} is not replicated on this member (its replicas: \
         {replicas:?}); subscribe on one of them"
    )]
    NotReplicatedHere {
        stream: String,
        shard: u32,
        replicas: Vec<u64>,
    },
    #[error("shard {shard}: offset {offset} is no longer held; the oldest is {oldest}")]
    TooOld {
        shard: u32,
        offset: u64,
        oldest: u64,
    },
    #[error("shard {shard}: offset {offset} is beyond the next offset to be committed ({next})")]
    BeyondEnd { shard: u32, offset: u64, next: u64 },
    #[error("stream {stream:?} was deleted")]
    Deleted { stream: String },
    #[error("subscription id {0} is in use")]
    IdInUse(u64),

    #[error("reading shard {shard}: {reason}")]
    Read { shard: u32, reason: String },
    #[error(
        "shard {shard}: the subscriber fell behind the in-memory ring (next offset {next}, the \
         oldest held {oldest})"
    )]
    Lagged { shard: u32, next: u64, oldest: u64 },
    #[error(
        "shard {shard}: its owner, member {owner}, did not answer (or does not know the stream)"
    )]
    OwnerUnreachable { shard: u32, owner: u64 },
    #[error(
        "shard {shard}: its owner, member {owner}, restarted and holds nothing up to offset \
         {next} any more (an in-memory shard starts empty after a restart)"
    )]
    OwnerRestarted { shard: u32, owner: u64, next: u64 },
    #[error("the cluster service stopped")]
    Stopped,
}

/// What a subscriber hears, in this order: `Started` or `Refused`; then `Records` batches
/// (one per credit) until `Ended`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubscriptionEvent {
    /// Registered: `(shard, first offset delivered)` per selected shard, ascending.
    Started(Vec<(u32, u64)>),
    Refused(SubscribeError),
    /// Records of one or more selected shards, each shard's in offset order.
    Records(Vec<Delivered>),
    Ended(SubscribeError),
}

type SinkFn = Box<dyn FnMut(SubscriptionEvent) + Send>;

/// Where a subscription's events go: called on the service loop's thread (it must not block).
/// A sink dropped before its subscription was refused or ended (the service stopped) hears
/// `Ended(Stopped)`, so no subscriber waits forever.
pub struct SubscriptionSink {
    send: Option<SinkFn>,
}

impl SubscriptionSink {
    pub fn new(send: impl FnMut(SubscriptionEvent) + Send + 'static) -> Self {
        SubscriptionSink {
            send: Some(Box::new(send)),
        }
    }

    fn event(&mut self, event: SubscriptionEvent) {
        let last = matches!(
            event,
            SubscriptionEvent::Refused(_) | SubscriptionEvent::Ended(_)
        );
        if let Some(send) = &mut self.send {
            send(event);
        }
        if last {
            self.send = None;
        }
    }
}

impl Drop for SubscriptionSink {
    fn drop(&mut self) {
        if let Some(mut send) = self.send.take() {
            send(SubscriptionEvent::Ended(SubscribeError::Stopped));
        }
    }
}

impl std::fmt::Debug for SubscriptionSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.send.is_some() {
            "SubscriptionSink(open)"
        } else {
            "SubscriptionSink(over)"
        })
    }
}

/// What a subscription asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeRequest {
    /// Chosen by the caller, unique among its open subscriptions on this member.
    pub id: u64,
    pub stream: String,
    /// `(shard, start)` per selected shard, each shard once.
    pub shards: Vec<(u32, Start)>,
    /// Bounds of one delivered batch.
    pub max_records: usize,
    pub max_bytes: usize,
}

/// Where a cursor's records come from.
#[derive(Debug)]
enum Source {
    /// A replicated shard's group on this member.
    Group(u64),
    /// An in-memory shard this member owns.
    Local(ShardKey),
    /// An in-memory shard another member owns: fetched from it (`memory.rs`).
    Remote(Remote),
}

#[derive(Debug)]
struct Remote {
    owner: u64,
    key: ShardKey,
    /// The fetch in flight: its request and the tick it was sent at.
    fetch: Option<(u64, u64)>,
    /// Records fetched, from the cursor on.
    ready: VecDeque<(u64, ShardRecord)>,
}

#[derive(Debug)]
struct Cursor {
    shard: u32,
    source: Source,
    next: u64,
    /// Where it starts, until the start is resolved (a remote shard's owner tells its range).
    unresolved: Option<Start>,
}

#[derive(Debug)]
struct Subscription {
    stream: String,
    cursors: Vec<Cursor>,
    /// `Started` was sent: every cursor's start is resolved.
    started: bool,
    /// The tick it was registered at (a remote owner must answer within
    /// [`RESOLVE_TICKS_MAX`]).
    registered_at: u64,
    /// The cursor to look at first in the next round (shards take turns).
    turn: usize,
    credits: u32,
    max_records: usize,
    max_bytes: usize,
    sink: SubscriptionSink,
}

/// Ticks a subscription waits for remote owners to tell where it starts.
pub const RESOLVE_TICKS_MAX: u64 = 50;

/// The subscriptions this member serves.
#[derive(Debug, Default)]
pub struct Subscriptions {
    open: BTreeMap<u64, Subscription>,
    /// Fetches in flight: request to (subscription, cursor).
    fetches: BTreeMap<u64, (u64, usize)>,
    next_request: u64,
}

impl Subscriptions {
    /// Open subscriptions.
    #[must_use]
    pub fn len(&self) -> usize {
        self.open.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Registers a subscription: its sink hears `Started` with the start offsets (once every
    /// remote owner told its range), or `Refused`. Its records follow from
    /// [`Subscriptions::pump`].
    pub fn add<B: Backend>(
        &mut self,
        request: SubscribeRequest,
        mut sink: SubscriptionSink,
        view: &View<'_, B>,
        tick: u64,
    ) {
        match self.register(&request, view) {
            Ok(cursors) => {
                let mut subscription = Subscription {
                    stream: request.stream,
                    cursors,
                    started: false,
                    registered_at: tick,
                    turn: 0,
                    credits: CREDITS,
                    max_records: request.max_records.max(1),
                    max_bytes: request.max_bytes.max(1),
                    sink,
                };
                subscription.start_if_resolved();
                self.open.insert(request.id, subscription);
            }
            Err(error) => sink.event(SubscriptionEvent::Refused(error)),
        }
    }

    fn register<B: Backend>(
        &self,
        request: &SubscribeRequest,
        view: &View<'_, B>,
    ) -> Result<Vec<Cursor>, SubscribeError> {
        if self.open.contains_key(&request.id) {
            return Err(SubscribeError::IdInUse(request.id));
        }
        let stream = &request.stream;
        let Some(placement) = view.state.streams.get(stream) else {
            return Err(SubscribeError::NoSuchStream {
                stream: stream.clone(),
            });
        };
        let mut cursors = Vec::with_capacity(request.shards.len());
        for &(shard, start) in &request.shards {
            let Some(shard_placement) = placement.shards.get(shard as usize) else {
                return Err(SubscribeError::NoSuchShard {
                    stream: stream.clone(),
                    shard,
                    shards: placement.shards.len(),
                });
            };
            let (source, range) = match placement.kind {
                crate::control::StreamKind::Durable => {
                    let group = crate::groups::group_id(placement.incarnation, shard);
                    let Some(range) = view.groups.range(group) else {
                        return Err(SubscribeError::NotReplicatedHere {
                            stream: stream.clone(),
                            shard,
                            replicas: shard_placement.replicas.clone(),
                        });
                    };
                    (Source::Group(group), Some(range))
                }
                crate::control::StreamKind::InMemory => {
                    let key = (placement.incarnation, shard);
                    match view.memory.get(key) {
                        Some(ring) => (Source::Local(key), Some(ring.range())),
                        None => (
                            Source::Remote(Remote {
                                owner: shard_placement.leader,
                                key,
                                fetch: None,
                                ready: VecDeque::new(),
                            }),
                            None,
                        ),
                    }
                }
            };
            let mut cursor = Cursor {
                shard,
                source,
                next: 0,
                unresolved: Some(start),
            };
            if let Some(range) = range {
                cursor.resolve(range)?;
            }
            cursors.push(cursor);
        }
        Ok(cursors)
    }

    /// The caller wrote a batch of subscription `id`: it may have one more in flight.
    pub fn credit(&mut self, id: u64) {
        if let Some(subscription) = self.open.get_mut(&id) {
            subscription.credits = (subscription.credits + 1).min(CREDITS);
        }
    }

    /// The caller is gone: the subscription is forgotten (its sink hears nothing more).
    pub fn remove(&mut self, id: u64) {
        if let Some(mut subscription) = self.open.remove(&id) {
            subscription.sink.send = None;
            self.forget_fetches(&subscription);
        }
    }

    /// Forgets the fetches in flight of a subscription that is gone (an owner that never
    /// answers would otherwise leave them behind).
    fn forget_fetches(&mut self, subscription: &Subscription) {
        for cursor in &subscription.cursors {
            if let Source::Remote(Remote {
                fetch: Some((request, _)),
                ..
            }) = &cursor.source
            {
                self.fetches.remove(request);
            }
        }
    }

    /// Sends every subscription with credits its next batches, read from the shards (and
    /// asks remote owners for more: `out`, frames to send by member); ends those whose shard
    /// is gone (stream deleted) or whose next records were dropped.
    pub fn pump<B: Backend>(
        &mut self,
        view: &View<'_, B>,
        tick: u64,
        out: &mut Vec<(u64, DataFrame)>,
    ) {
        let mut ended = Vec::new();
        let mut fetching = Vec::new();
        for (id, subscription) in &mut self.open {
            if !subscription.started && tick - subscription.registered_at > RESOLVE_TICKS_MAX {
                let owner = subscription
                    .cursors
                    .iter()
                    .find_map(|cursor| match (&cursor.source, cursor.unresolved) {
                        (Source::Remote(remote), Some(_)) => Some((cursor.shard, remote.owner)),
                        _ => None,
                    })
                    .unwrap_or_default();
                ended.push((
                    *id,
                    SubscribeError::OwnerUnreachable {
                        shard: owner.0,
                        owner: owner.1,
                    },
                ));
                continue;
            }
            match subscription.pump(view) {
                Ok(()) => {}
                Err(error) => {
                    ended.push((*id, error));
                    continue;
                }
            }
            for (position, cursor) in subscription.cursors.iter().enumerate() {
                if let Source::Remote(remote) = &cursor.source {
                    let due = remote
                        .fetch
                        .is_none_or(|(_, sent)| tick - sent >= FETCH_RETRY_TICKS);
                    let wanted = cursor.unresolved.is_some()
                        || (subscription.started && remote.ready.is_empty());
                    if due && wanted {
                        fetching.push((*id, position));
                    }
                }
            }
        }
        for (id, position) in fetching {
            let request = self.next_request;
            self.next_request += 1;
            let Some(subscription) = self.open.get_mut(&id) else {
                continue;
            };
            let (max_records, max_bytes) = (subscription.max_records, subscription.max_bytes);
            let cursor = &mut subscription.cursors[position];
            let Source::Remote(remote) = &mut cursor.source else {
                continue;
            };
            if let Some((old, _)) = remote.fetch.replace((request, tick)) {
                self.fetches.remove(&old);
            }
            self.fetches.insert(request, (id, position));
            // A probe (the start not resolved yet) asks for the range only.
            let (from, max_records) = if cursor.unresolved.is_some() {
                (u64::MAX, 0)
            } else {
                (cursor.next, max_records)
            };
            out.push((
                remote.owner,
                DataFrame::Fetch(Fetch {
                    request,
                    key: remote.key,
                    from,
                    max_records: u32::try_from(max_records).unwrap_or(u32::MAX),
                    max_bytes: u32::try_from(max_bytes).unwrap_or(u32::MAX),
                }),
            ));
        }
        self.end(ended);
    }

    /// An owner answered fetch `request`.
    pub fn fetched(&mut self, request: u64, result: Result<Fetched, FetchRefusal>) {
        let Some((id, position)) = self.fetches.remove(&request) else {
            return;
        };
        let Some(subscription) = self.open.get_mut(&id) else {
            return;
        };
        let stream = subscription.stream.clone();
        let cursor = &mut subscription.cursors[position];
        let shard = cursor.shard;
        let Source::Remote(remote) = &mut cursor.source else {
            return;
        };
        let answered = remote.fetch.take_if(|(current, _)| *current == request);
        let outcome = match result {
            // An owner that has not applied the stream's creation yet: asked again when the
            // fetch is due for a retry (FETCH_RETRY_TICKS after it was sent; not at once, which
            // would ping-pong), until RESOLVE_TICKS_MAX.
            Err(FetchRefusal::NotHere) if cursor.unresolved.is_some() => {
                remote.fetch = answered;
                if let Some((request, _)) = answered {
                    self.fetches.insert(request, (id, position));
                }
                Ok(())
            }
            Err(FetchRefusal::NotHere) => Err(SubscribeError::Deleted { stream }),
            Err(FetchRefusal::TooOld { oldest }) => Err(SubscribeError::Lagged {
                shard,
                next: cursor.next,
                oldest,
            }),
            Ok(fetched) if cursor.unresolved.is_some() => {
                cursor.resolve((fetched.oldest, fetched.next)).map(|()| {
                    subscription.start_if_resolved();
                })
            }
            Ok(fetched) if fetched.next < cursor.next => Err(SubscribeError::OwnerRestarted {
                shard,
                owner: remote.owner,
                next: cursor.next,
            }),
            Ok(fetched) => {
                let mut expected = remote
                    .ready
                    .back()
                    .map_or(cursor.next, |(offset, _)| offset + 1);
                for (offset, record) in fetched.records {
                    // A late answer to an earlier fetch repeats records: only the next ones.
                    if offset == expected {
                        remote.ready.push_back((offset, record));
                        expected += 1;
                    }
                }
                Ok(())
            }
        };
        if let Err(error) = outcome {
            // `end` refuses a subscription that had not started.
            self.end(vec![(id, error)]);
        }
    }

    fn end(&mut self, ended: Vec<(u64, SubscribeError)>) {
        for (id, error) in ended {
            if let Some(mut subscription) = self.open.remove(&id) {
                self.forget_fetches(&subscription);
                tracing::debug!(id, %error, "cluster subscription ended");
                let event = if subscription.started {
                    SubscriptionEvent::Ended(error)
                } else {
                    SubscriptionEvent::Refused(error)
                };
                subscription.sink.event(event);
            }
        }
    }

    /// Ends every subscription: the service stops.
    pub fn stop_all(&mut self) {
        self.fetches.clear();
        for (_, mut subscription) in std::mem::take(&mut self.open) {
            subscription
                .sink
                .event(SubscriptionEvent::Ended(SubscribeError::Stopped));
        }
    }
}

/// What subscriptions read: the control plane's state, the shard groups and the in-memory
/// shards this member owns.
#[derive(Debug, Clone, Copy)]
pub struct View<'a, B: Backend = SystemBackend> {
    pub state: &'a ControlState,
    pub groups: &'a Groups<B>,
    pub memory: &'a MemoryShards,
}

impl Cursor {
    /// Resolves the start against the shard's `(oldest, next)`.
    fn resolve(&mut self, (oldest, next): (u64, u64)) -> Result<(), SubscribeError> {
        let shard = self.shard;
        let Some(start) = self.unresolved.take() else {
            return Ok(());
        };
        self.next = match start {
            Start::Earliest => oldest,
            Start::Latest => next,
            Start::Offset(offset) if offset > next => {
                return Err(SubscribeError::BeyondEnd {
                    shard,
                    offset,
                    next,
                });
            }
            Start::Offset(offset) if offset < oldest => {
                return Err(SubscribeError::TooOld {
                    shard,
                    offset,
                    oldest,
                });
            }
            Start::Offset(offset) => offset,
        };
        Ok(())
    }

    /// Up to `max_records` records from the cursor on (at most `max_bytes`, at least one).
    fn read<B: Backend>(
        &mut self,
        view: &View<'_, B>,
        stream: &str,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<(u64, ShardRecord)>, SubscribeError> {
        let shard = self.shard;
        let from = self.next;
        match &mut self.source {
            Source::Group(group) => {
                let Some((_, next)) = view.groups.range(*group) else {
                    return Err(SubscribeError::Deleted {
                        stream: stream.to_owned(),
                    });
                };
                if from >= next {
                    return Ok(Vec::new());
                }
                // A read waiting for the disk reads nothing yet: the member's next pass, once
                // the record log fetched the bytes (its eventfd wakes the owner), asks again.
                view.groups
                    .read_bytes(*group, from, max_records, max_bytes)
                    .map(Option::unwrap_or_default)
                    .map_err(|error| match error {
                        ReadError::Compacted { oldest } => SubscribeError::TooOld {
                            shard,
                            offset: from,
                            oldest,
                        },
                        ReadError::Failed(reason) => SubscribeError::Read { shard, reason },
                    })
            }
            Source::Local(key) => {
                let Some(ring) = view.memory.get(*key) else {
                    return Err(SubscribeError::Deleted {
                        stream: stream.to_owned(),
                    });
                };
                ring.read(from, max_records, max_bytes)
                    .map_err(|error| match error {
                        ReadError::Compacted { oldest } => SubscribeError::Lagged {
                            shard,
                            next: from,
                            oldest,
                        },
                        ReadError::Failed(reason) => SubscribeError::Read { shard, reason },
                    })
            }
            Source::Remote(remote) => {
                let mut out = Vec::new();
                let mut bytes = 0;
                while out.len() < max_records && (bytes < max_bytes || out.is_empty()) {
                    let Some((offset, record)) = remote.ready.pop_front() else {
                        break;
                    };
                    bytes += record.key.len() + record.payload.len();
                    out.push((offset, record));
                }
                Ok(out)
            }
        }
    }
}

impl Subscription {
    /// Sends `Started` once every cursor's start is resolved.
    fn start_if_resolved(&mut self) {
        if self.started || self.cursors.iter().any(|c| c.unresolved.is_some()) {
            return;
        }
        self.started = true;
        let mut started: Vec<(u32, u64)> = self.cursors.iter().map(|c| (c.shard, c.next)).collect();
        started.sort_unstable();
        self.sink.event(SubscriptionEvent::Started(started));
    }

    fn pump<B: Backend>(&mut self, view: &View<'_, B>) -> Result<(), SubscribeError> {
        if !self.started {
            return Ok(());
        }
        while self.credits > 0 {
            let mut records: Vec<Delivered> = Vec::new();
            let mut bytes = 0;
            let count = self.cursors.len();
            for step in 0..count {
                let position = (self.turn + step) % count;
                let room = self.max_records - records.len();
                let cursor = &mut self.cursors[position];
                let read = cursor.read(view, &self.stream, room, self.max_bytes - bytes)?;
                for (offset, record) in read {
                    cursor.next = offset + 1;
                    bytes += record.key.len() + record.payload.len();
                    records.push(Delivered {
                        shard: cursor.shard,
                        offset,
                        record,
                    });
                }
                if records.len() >= self.max_records || bytes >= self.max_bytes {
                    // This shard filled the batch: the next round starts with the next shard.
                    self.turn = (position + 1) % count;
                    break;
                }
            }
            if records.is_empty() {
                return Ok(());
            }
            self.credits -= 1;
            self.sink.event(SubscriptionEvent::Records(records));
        }
        Ok(())
    }
}
