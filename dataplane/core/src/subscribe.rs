//! Subscriptions (docs/semantics.md, 4 Subscribing).
//!
//! A subscription stream on core C is a slot fed by C's engine (the shards C owns) and by
//! the engines of the other owner cores, which push delivery batches back to C under a
//! credit of [`REMOTE_DELIVERY_CREDITS`] batches per subscription; C gives a credit back for
//! each batch its writer takes. Beyond that the records wait in the owner's engine queue,
//! where the lag bound ends the subscription as it does for local subscribers. Each shard
//! comes from one owner core over one FIFO queue, so per-shard order holds.
//!
//! A subscription to a replicated stream of the cluster (`cluster.rs`) has one source instead:
//! the cluster service, which reads this member's copy and sends batches under the same
//! credits.

use std::collections::VecDeque;

use felix_auth::Operation;
use felix_engine::{EngineError, SubscriptionId, select_shards};
use felix_wire::{
    DeliveredRecord, ErrorCode, Frame, ShardSelection, StartPosition, Subscribe, Subscribed,
};

use crate::config::{DELIVERY_BYTES_MAX, DELIVERY_RECORDS_MAX, REMOTE_DELIVERY_CREDITS, StreamId};
use crate::core::{Core, Flow, Request, Role, error_frame};
use crate::message::CoreMessage;

/// Where a subscription stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for `waiting` owner cores to register their parts.
    Registering { waiting: u16 },
    /// `Subscribed` written: deliveries flow.
    Active,
    /// Refused or ended: the error is written, the stream finishes.
    Over,
}

/// Where a batch of a subscription stream came from: its credit goes back there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Core { owner: u16, id: SubscriptionId },
    Cluster { token: u64 },
}

/// The state of one subscription stream on its core.
#[derive(Debug)]
pub(crate) struct SubscriptionSlot {
    request_id: u64,
    phase: Phase,
    /// This core's engine subscription, for the shards it owns.
    pub(crate) local: Option<SubscriptionId>,
    /// The other owner cores' engine subscriptions.
    remotes: Vec<(u16, SubscriptionId)>,
    /// A replicated stream's subscription: the token of its request to the cluster service,
    /// until the service refused or ended it.
    pub(crate) cluster: Option<u64>,
    /// Batches from owner cores (or the cluster), oldest first; at most
    /// [`REMOTE_DELIVERY_CREDITS`] per source.
    remote_batches: VecDeque<(Source, Vec<DeliveredRecord>)>,
    /// `(shard, first offset delivered)` per shard, gathered while registering.
    start: Vec<(u32, u64)>,
    /// From `Subscribed` on: `(shard, next offset to deliver)` per selected shard, ascending,
    /// advanced by every record written. A subscription ended for lagging tells the client to
    /// resume from exactly these positions (every selected shard, whichever core lagged).
    next: Vec<(u32, u64)>,
    /// The refusal of the lowest core that refused while registering.
    refusal: Option<(u16, EngineError)>,
    /// Set when an owner ended the subscription (lagged, stream deleted).
    ended: Option<EngineError>,
    /// The code of the error that ended it, from the moment an owner ended it (kept after the
    /// error is written): the shell resets a stalled stream with it.
    ending: Option<ErrorCode>,
    /// Counted in the subscribers gauge (from `Subscribed` on).
    counted: bool,
}

impl SubscriptionSlot {
    pub(crate) fn assert_invariants(&self) {
        let owners = self.remotes.len().max(1);
        assert!(
            self.remote_batches.len() <= owners * REMOTE_DELIVERY_CREDITS as usize,
            "remote batches stay within the credits: {} batches from {:?}, parts {:?}, {:?}",
            self.remote_batches.len(),
            self.remote_batches
                .iter()
                .map(|(source, _)| *source)
                .collect::<Vec<_>>(),
            self.remotes,
            self.phase
        );
        assert!(
            self.cluster.is_none() || (self.local.is_none() && self.remotes.is_empty()),
            "a cluster subscription has no engine parts"
        );
        match self.phase {
            Phase::Registering { .. } => assert!(!self.counted, "counted from Subscribed on"),
            Phase::Active => assert!(self.counted, "an active subscription is counted"),
            Phase::Over => {}
        }
    }
}

/// The parts feeding a subscription stream, taken out of its slot to be undone.
struct Parts {
    local: Option<SubscriptionId>,
    remotes: Vec<(u16, SubscriptionId)>,
    cluster: Option<u64>,
}

impl SubscriptionSlot {
    fn take_parts(&mut self) -> Parts {
        Parts {
            local: self.local.take(),
            remotes: std::mem::take(&mut self.remotes),
            cluster: self.cluster.take(),
        }
    }
}

/// An owner-side subscription whose records go to a subscription stream on another core.
#[derive(Debug)]
pub(crate) struct RemoteSubscription {
    to: u16,
    slot: StreamId,
    pub(crate) credits: u32,
}

impl Core {
    /// The first frame of a stream is `Subscribe`: register on this core for the shards it
    /// owns and on each other owner core for the rest; `Subscribed` follows once all did.
    pub(crate) fn start_subscription(&mut self, stream: StreamId, subscribe: Subscribe) -> Flow {
        let Subscribe {
            request_id,
            stream: name,
            shards,
            from,
        } = subscribe;
        let mut slot = Box::new(SubscriptionSlot {
            request_id,
            phase: Phase::Registering { waiting: 0 },
            local: None,
            remotes: Vec::new(),
            cluster: None,
            remote_batches: VecDeque::new(),
            start: Vec::new(),
            next: Vec::new(),
            ending: None,
            refusal: None,
            ended: None,
            counted: false,
        });
        let connection = self.streams.get(&stream).map(|state| state.connection);
        let admitted = self
            .authorize(stream, Operation::Subscribe, &name)
            .and_then(|()| self.count_subscription(stream, connection));
        let selected = match (admitted, self.engine.lookup(&name)) {
            // Authorized (by name, before the lookup) and counted first: a refusal says
            // nothing of the stream.
            (Err(error), _) => Err(error),
            // A replicated stream of the cluster: the service serves all its shards.
            (Ok(()), None) if self.is_cluster_stream(&name) => {
                let shard_count = self.cluster_shard_count(&name).expect("a cluster stream");
                match select_shards(&shards, &from, shard_count) {
                    Ok(selected) => {
                        self.start_cluster_subscription(stream, slot, name, &selected, &from);
                        return Flow::Subscribed;
                    }
                    Err(error) => Err(error),
                }
            }
            (Ok(()), None) => Err(EngineError::stream_not_found(&name)),
            // The selection is checked once, here; each owner checks only its offsets.
            (Ok(()), Some(meta)) => select_shards(&shards, &from, meta.shard_count),
        };
        let selected = match selected {
            Ok(selected) => selected,
            Err(error) => {
                tracing::debug!(%error, stream = name, "subscribe refused");
                slot.refusal = Some((self.index, error));
                self.stream_mut(stream).role = Role::Subscription(slot);
                self.end_registration(stream);
                return Flow::Subscribed;
            }
        };
        let mut waiting = 0;
        for core in 0..self.core_count {
            let shards: Vec<u32> = selected
                .iter()
                .copied()
                .filter(|&shard| self.owner(shard) == core)
                .collect();
            if shards.is_empty() {
                continue;
            }
            let position = match &from {
                StartPosition::Offsets(positions) => StartPosition::Offsets(
                    positions
                        .iter()
                        .copied()
                        .filter(|(shard, _)| self.owner(*shard) == core)
                        .collect(),
                ),
                other => other.clone(),
            };
            if core != self.index {
                let token = self.token();
                self.requests
                    .insert(token, Request::Subscribe { stream, core });
                self.send(
                    core,
                    CoreMessage::Subscribe {
                        from: self.index,
                        token,
                        slot: stream,
                        stream: name.clone(),
                        shards,
                        start: position,
                    },
                );
                waiting += 1;
                continue;
            }
            match self
                .engine
                .subscribe(&name, &ShardSelection::List(shards), &position)
            {
                Ok(subscription) => {
                    self.local_subscriptions.insert(subscription.id, stream);
                    slot.local = Some(subscription.id);
                    slot.start.extend(subscription.start);
                }
                Err(error) => {
                    // Like a sequential registration: the cores after a refusal are not asked.
                    slot.refusal = Some((core, error));
                    break;
                }
            }
        }
        slot.phase = Phase::Registering { waiting };
        self.stream_mut(stream).role = Role::Subscription(slot);
        if waiting == 0 {
            self.end_registration(stream);
        }
        Flow::Subscribed
    }

    /// Registers a subscription to a replicated stream with the cluster service; `Subscribed`
    /// follows its answer ([`Core::handle_cluster_subscribed`]).
    fn start_cluster_subscription(
        &mut self,
        stream: StreamId,
        mut slot: Box<SubscriptionSlot>,
        name: String,
        selected: &[u32],
        from: &StartPosition,
    ) {
        let start = |shard: u32| match from {
            StartPosition::Earliest => crate::ClusterStart::Earliest,
            StartPosition::Latest => crate::ClusterStart::Latest,
            StartPosition::Offsets(positions) => positions
                .iter()
                .find(|(listed, _)| *listed == shard)
                .map_or(crate::ClusterStart::Latest, |(_, offset)| {
                    crate::ClusterStart::Offset(*offset)
                }),
        };
        let token = self.token();
        slot.cluster = Some(token);
        slot.phase = Phase::Registering { waiting: 1 };
        self.stream_mut(stream).role = Role::Subscription(slot);
        self.cluster_subscriptions.insert(token, stream);
        let (max_records, max_bytes) = self.delivery_bounds();
        self.cluster_out
            .push_back(crate::ClusterRequest::Subscribe(crate::ClusterSubscribe {
                token,
                stream: name,
                shards: selected
                    .iter()
                    .map(|&shard| (shard, start(shard)))
                    .collect(),
                max_records,
                max_bytes,
            }));
    }

    /// The cluster service registered (or refused) subscription `token`.
    pub fn handle_cluster_subscribed(
        &mut self,
        token: u64,
        result: Result<Vec<(u32, u64)>, crate::ClusterRefusal>,
    ) {
        // Gone: its stream closed (the unsubscribe is on its way).
        let Some(&stream) = self.cluster_subscriptions.get(&token) else {
            return;
        };
        let slot = self
            .slot_mut(stream)
            .expect("a cluster subscription's slot");
        match result {
            Ok(start) => {
                if let Phase::Registering { waiting } = &mut slot.phase {
                    *waiting = 0;
                    slot.start = start;
                    self.end_registration(stream);
                }
            }
            Err(refusal) => {
                // The service forgot it: nothing to undo there.
                slot.cluster = None;
                let registering = matches!(slot.phase, Phase::Registering { .. });
                if registering {
                    slot.phase = Phase::Registering { waiting: 0 };
                    slot.refusal = Some((0, refusal.into_error()));
                }
                self.cluster_subscriptions.remove(&token);
                if registering {
                    self.end_registration(stream);
                }
            }
        }
    }

    /// A batch of committed records of subscription `token`, from the cluster service.
    pub fn handle_cluster_delivery(&mut self, token: u64, records: Vec<DeliveredRecord>) {
        let Some(&stream) = self.cluster_subscriptions.get(&token) else {
            return;
        };
        if let Some(target) = self.slot_mut(stream)
            && target.phase != Phase::Over
        {
            target
                .remote_batches
                .push_back((Source::Cluster { token }, records));
            self.mark_ready(stream);
        }
    }

    /// The cluster service ended subscription `token` (stream deleted, records compacted,
    /// service stopped); records already delivered go out first.
    pub fn handle_cluster_ended(&mut self, token: u64, refusal: crate::ClusterRefusal) {
        let Some(&stream) = self.cluster_subscriptions.get(&token) else {
            return;
        };
        let slot = self
            .slot_mut(stream)
            .expect("a cluster subscription's slot");
        if matches!(slot.phase, Phase::Registering { .. }) {
            // Ended before it started (the service stopped with the request queued).
            self.handle_cluster_subscribed(token, Err(refusal));
            return;
        }
        self.cluster_subscriptions.remove(&token);
        let slot = self
            .slot_mut(stream)
            .expect("a cluster subscription's slot");
        slot.cluster = None;
        let error = refusal.into_error();
        slot.ending.get_or_insert(error.code);
        slot.ended.get_or_insert(error);
        self.mark_ready(stream);
    }

    /// The bounds of one delivered batch: records and bytes.
    fn delivery_bounds(&self) -> (usize, usize) {
        let max_records = DELIVERY_RECORDS_MAX
            .min(usize::try_from(self.limits.max_batch_records).unwrap_or(usize::MAX));
        let max_bytes = DELIVERY_BYTES_MAX
            .min(usize::try_from(self.limits.max_frame_bytes / 2).unwrap_or(usize::MAX));
        (max_records, max_bytes)
    }

    /// Every owner answered: `Subscribed`, or the first refusal (and every part undone).
    fn end_registration(&mut self, stream: StreamId) {
        let slot = self
            .slot_mut(stream)
            .expect("a registering subscription stream");
        let request_id = slot.request_id;
        match slot.refusal.take() {
            Some((_, error)) => {
                slot.phase = Phase::Over;
                // Batches the parts that did register sent meanwhile are not delivered.
                slot.remote_batches.clear();
                let parts = slot.take_parts();
                self.unsubscribe_parts(parts);
                self.write_error(stream, error.to_frame(request_id));
                self.stream_mut(stream).finishing = true;
            }
            None => {
                slot.phase = Phase::Active;
                slot.counted = true;
                let mut shards = std::mem::take(&mut slot.start);
                shards.sort_unstable_by_key(|(shard, _)| *shard);
                slot.next.clone_from(&shards);
                self.counters.subscribers += 1;
                self.write(
                    stream,
                    &Frame::Subscribed(Subscribed { request_id, shards }),
                );
            }
        }
    }

    /// Counts a subscription against its connection's FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION;
    /// `LimitExceeded` (counted) when it holds that many already.
    fn count_subscription(
        &mut self,
        stream: StreamId,
        connection: Option<crate::ConnectionId>,
    ) -> Result<(), EngineError> {
        let limit = self.security().limits.subscriptions_per_connection;
        let Some(open) = connection.and_then(|id| self.subscriptions_open_mut(id)) else {
            // The connection is closing: the stream closes with it.
            return Ok(());
        };
        if *open >= limit {
            self.counters
                .limit(crate::Limit::SubscriptionsPerConnection);
            return Err(EngineError::new(
                ErrorCode::LimitExceeded,
                u64::from(limit),
                format!(
                    "the connection holds its limit of {limit} open subscriptions \
                     (FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION)"
                ),
            ));
        }
        *open += 1;
        self.stream_mut(stream).subscription_counted = true;
        Ok(())
    }

    /// The code of the error an owner ended `stream`'s subscription with (lagged, stream
    /// deleted), written or about to be. A shell whose write to that stream is blocked by a
    /// client that stopped reading resets the stream with it (docs/wire-protocol.md, 10).
    #[must_use]
    pub fn subscription_ending(&self, stream: StreamId) -> Option<ErrorCode> {
        match &self.streams.get(&stream)?.role {
            Role::Subscription(slot) => slot.ending,
            _ => None,
        }
    }

    fn slot_mut(&mut self, stream: StreamId) -> Option<&mut SubscriptionSlot> {
        match &mut self.streams.get_mut(&stream)?.role {
            Role::Subscription(slot) => Some(slot),
            _ => None,
        }
    }

    /// Forgets engine subscriptions here and on their owner cores, and the cluster's.
    fn unsubscribe_parts(&mut self, parts: Parts) {
        let Parts {
            local,
            remotes,
            cluster,
        } = parts;
        if let Some(id) = local {
            self.local_subscriptions.remove(&id);
            self.engine.unsubscribe(id);
        }
        for (core, id) in remotes {
            self.send(core, CoreMessage::Unsubscribe { id });
        }
        if let Some(token) = cluster {
            self.cluster_subscriptions.remove(&token);
            self.cluster_out
                .push_back(crate::ClusterRequest::Unsubscribe { token });
        }
    }

    /// The subscription stream closed: its parts are forgotten everywhere.
    pub(crate) fn drop_subscription(&mut self, mut slot: SubscriptionSlot) {
        if slot.counted {
            self.counters.subscribers -= 1;
        }
        let parts = slot.take_parts();
        self.unsubscribe_parts(parts);
    }

    /// The owner's side: registers a part whose records go to another core.
    pub(crate) fn subscribe_for(
        &mut self,
        from: u16,
        token: u64,
        slot: StreamId,
        stream: &str,
        shards: Vec<u32>,
        start: &StartPosition,
    ) {
        let result = self
            .engine
            .subscribe(stream, &ShardSelection::List(shards), start);
        let result = result.map(|subscription| {
            self.remote_subscriptions.insert(
                subscription.id,
                RemoteSubscription {
                    to: from,
                    slot,
                    credits: REMOTE_DELIVERY_CREDITS,
                },
            );
            (subscription.id, subscription.start)
        });
        // Queued before any Deliver of this part (the engine's DeliveryReady is handled by
        // `settle`, after this): the subscriber learns the part before its records.
        self.send(from, CoreMessage::SubscribeDone { token, result });
    }

    pub(crate) fn handle_subscribe_done(
        &mut self,
        token: u64,
        result: Result<(SubscriptionId, Vec<(u32, u64)>), EngineError>,
    ) {
        let Some(Request::Subscribe { stream, core }) = self.requests.remove(&token) else {
            panic!("SubscribeDone {token} answers a subscribe");
        };
        let Some(slot) = self.slot_mut(stream) else {
            // The stream closed meanwhile: undo the part.
            if let Ok((id, _)) = result {
                self.send(core, CoreMessage::Unsubscribe { id });
            }
            return;
        };
        let Phase::Registering { waiting } = &mut slot.phase else {
            // Refused meanwhile (extra data): undo the part.
            if let Ok((id, _)) = result {
                self.send(core, CoreMessage::Unsubscribe { id });
            }
            return;
        };
        *waiting -= 1;
        let done = *waiting == 0;
        match result {
            Ok((id, start)) => {
                slot.remotes.push((core, id));
                slot.start.extend(start);
            }
            Err(error) => {
                if slot
                    .refusal
                    .as_ref()
                    .is_none_or(|(lowest, _)| core < *lowest)
                {
                    slot.refusal = Some((core, error));
                }
            }
        }
        if done {
            self.end_registration(stream);
        }
    }

    /// Bytes after `Subscribe` on a subscription stream: refused, the subscription undone.
    pub(crate) fn refuse_extra_data(&mut self, stream: StreamId) {
        let Some(slot) = self.slot_mut(stream) else {
            return;
        };
        if slot.phase == Phase::Over {
            return;
        }
        slot.phase = Phase::Over;
        let counted = std::mem::take(&mut slot.counted);
        let parts = slot.take_parts();
        slot.remote_batches.clear();
        if counted {
            self.counters.subscribers -= 1;
        }
        self.unsubscribe_parts(parts);
        self.write_error(
            stream,
            error_frame(
                ErrorCode::ProtocolViolation,
                "a subscription stream carries exactly one Subscribe frame".to_owned(),
            ),
        );
        self.stream_mut(stream).finishing = true;
    }

    /// Puts the next delivery batch of an active subscription into its stream's output:
    /// this core's records first, then a batch from an owner core (its credit goes back),
    /// and once nothing is left, the error that ended the subscription.
    pub(crate) fn fill_delivery(&mut self, stream: StreamId) {
        let (max_records, max_bytes) = self.delivery_bounds();
        let Some(slot) = self.slot_mut(stream) else {
            return;
        };
        if slot.phase != Phase::Active {
            return;
        }
        let local = slot.local;
        let mut records = match local {
            Some(id) => self.engine.poll_delivery(id, max_records, max_bytes),
            None => Vec::new(),
        };
        let slot = self.slot_mut(stream).expect("looked up above");
        if records.is_empty()
            && let Some((source, batch)) = slot.remote_batches.pop_front()
        {
            records = batch;
            match source {
                Source::Core { owner, id } => self.send(owner, CoreMessage::Credit { id }),
                Source::Cluster { token } => self
                    .cluster_out
                    .push_back(crate::ClusterRequest::Credit { token }),
            }
        }
        if !records.is_empty() {
            let slot = self.slot_mut(stream).expect("looked up above");
            for record in &records {
                let position = slot
                    .next
                    .binary_search_by_key(&record.shard, |(shard, _)| *shard)
                    .expect("only selected shards are delivered");
                // Consecutive, but for offsets quarantined by `felix log repair` (records
                // lost to damage), which a catch-up skips.
                assert!(
                    record.offset >= slot.next[position].1,
                    "a subscription delivers each shard's offsets in order"
                );
                slot.next[position].1 = record.offset + 1;
            }
            self.counters.delivered_records += records.len() as u64;
            self.write_delivery(stream, &records);
            return;
        }
        // Records already queued went out before the error that ended the subscription.
        let slot = self.slot_mut(stream).expect("looked up above");
        if let Some(mut error) = slot.ended.take() {
            tracing::debug!(%error, "subscription ended by an owner core");
            slot.phase = Phase::Over;
            if error.code == ErrorCode::SubscriberLagged {
                // The owner that lagged knows its own shards only: list every selected shard,
                // where this stream's deliveries stop.
                error = EngineError::new(ErrorCode::SubscriberLagged, 0, lag_message(&slot.next));
            }
            let request_id = slot.request_id;
            self.write_error(stream, error.to_frame(request_id));
            self.stream_mut(stream).finishing = true;
        }
    }

    /// The engine has records for subscription `id`.
    pub(crate) fn delivery_ready(&mut self, id: SubscriptionId) {
        if let Some(&stream) = self.local_subscriptions.get(&id) {
            self.mark_ready(stream);
        } else {
            self.pump_remote(id);
        }
    }

    /// The engine ended subscription `id` (lagged, stream deleted); it already forgot it.
    pub(crate) fn subscription_ended(&mut self, id: SubscriptionId, error: EngineError) {
        if let Some(stream) = self.local_subscriptions.remove(&id) {
            let slot = self.slot_mut(stream).expect("a local subscription's slot");
            slot.local = None;
            slot.ending.get_or_insert(error.code);
            slot.ended.get_or_insert(error);
            self.mark_ready(stream);
        } else if let Some(remote) = self.remote_subscriptions.remove(&id) {
            self.send(
                remote.to,
                CoreMessage::Ended {
                    slot: remote.slot,
                    error,
                },
            );
        }
    }

    /// Sends queued records of an owner-side subscription while it has credits.
    fn pump_remote(&mut self, id: SubscriptionId) {
        let (max_records, max_bytes) = self.delivery_bounds();
        // At most REMOTE_DELIVERY_CREDITS rounds: each takes a credit.
        loop {
            let Some(remote) = self.remote_subscriptions.get(&id) else {
                return;
            };
            if remote.credits == 0 {
                return;
            }
            let (to, slot) = (remote.to, remote.slot);
            let records = self.engine.poll_delivery(id, max_records, max_bytes);
            if records.is_empty() {
                return;
            }
            if let Some(remote) = self.remote_subscriptions.get_mut(&id) {
                remote.credits -= 1;
            }
            self.send(
                to,
                CoreMessage::Deliver {
                    slot,
                    owner: self.index,
                    id,
                    records,
                },
            );
        }
    }

    /// Records from an owner core for one of this core's subscription streams.
    pub(crate) fn handle_deliver(
        &mut self,
        slot: StreamId,
        owner: u16,
        id: SubscriptionId,
        records: Vec<DeliveredRecord>,
    ) {
        // No active slot: the subscriber left (its Unsubscribe is on the way to the owner).
        if let Some(target) = self.slot_mut(slot)
            && target.phase != Phase::Over
        {
            target
                .remote_batches
                .push_back((Source::Core { owner, id }, records));
            self.mark_ready(slot);
        }
    }

    /// An owner ended its part of a subscription stream of this core.
    pub(crate) fn handle_ended(&mut self, slot: StreamId, error: EngineError) {
        if let Some(target) = self.slot_mut(slot) {
            target.ending.get_or_insert(error.code);
            target.ended.get_or_insert(error);
            self.mark_ready(slot);
        }
    }

    /// The subscriber core wrote a batch of owner-side subscription `id`.
    pub(crate) fn handle_credit(&mut self, id: SubscriptionId) {
        if let Some(remote) = self.remote_subscriptions.get_mut(&id) {
            remote.credits = (remote.credits + 1).min(REMOTE_DELIVERY_CREDITS);
        }
        self.pump_remote(id);
    }
}

/// The `SubscriberLagged` message of a subscription stream: `shard:next_offset` for every
/// selected shard, ascending (docs/wire-protocol.md, 5 Error codes). A list too long for an
/// error message ends with ` ...`; the positions are then those the client computes itself:
/// one past the last offset it received of each shard, or the start `Subscribed` gave.
fn lag_message(next: &[(u32, u64)]) -> String {
    use std::fmt::Write as _;
    const ELLIPSIS: &str = " ...";
    let mut message =
        String::from("subscriber fell behind live delivery; resume from shard:next_offset");
    let mut entry = String::new();
    for (shard, offset) in next {
        entry.clear();
        // Writing to a String cannot fail.
        write!(entry, " {shard}:{offset}").expect("String writes are infallible");
        if message.len() + entry.len() + ELLIPSIS.len() > felix_wire::ERROR_MESSAGE_BYTES_MAX {
            message.push_str(ELLIPSIS);
            break;
        }
        message.push_str(&entry);
    }
    message
}
