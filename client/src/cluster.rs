//! The cluster client (docs/cluster.md, "The cluster client"): publishes each shard's records
//! of a replicated stream straight to the member leading that shard, so no publish waits for
//! a forward from a follower to the leader.
//!
//! It learns the cluster from any member (`DescribeCluster`, answered with a `ClusterMap`:
//! the members' client addresses and each replicated shard's leader), keeps one [`Client`]
//! per member it has published to (opened lazily, core-aware within the member), and splits
//! each batch by shard, keeping each shard's records in batch order.
//!
//! It publishes as **one idempotent producer for the whole cluster** (`ClientConfig::idempotent`,
//! the default): one producer id (`ClientConfig::producer_id`, else random) and one sequence
//! per replicated shard, whichever member a batch goes through. A part whose outcome is
//! unknown (its member's connection went, the member could not commit it in time, or it was
//! refused for a reason a retry cures) is sent again with the same producer id and sequence,
//! after the cluster map is refreshed, to the shard's leader as now known or through any
//! member that answers (which forwards it), at most `ClientConfig::publish_retries` times
//! with a doubling backoff from `ClientConfig::publish_retry_backoff`. The shard's Raft group
//! applies each (producer, sequence) once, so a batch retried across a leader change is
//! stored once and acknowledged with its first offsets. A part that fails for good is the
//! caller's error (its records may still commit), and that shard's later batches go out
//! under a fresh producer id. With `idempotent` off, each part goes out once as a plain
//! publish and an error goes to the caller, who decides whether to publish again (which may
//! then store the records twice). Streams that are not replicated go through the seed member
//! as with a plain [`Client`].
//!
//! Every member must present a certificate the configuration trusts (`ClientConfig::ca` may
//! hold several PEM certificates: one CA for the cluster, or each member's development
//! certificate).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use felix_wire::{
    ClusterMap, CreateClusterStream, DeliveredRecord, ErrorCode, Frame, FsyncMode, ReadShard,
    Record, ShardAck, StreamKind,
};

use crate::{
    Client, ClientConfig, ClientError, PUBLISH_RETRY_BACKOFF_MAX, PendingAck, ProducerState,
    random_producer_id, retryable, sequenced_acks,
};

/// What the client knows of the cluster.
#[derive(Debug, Default)]
struct Map {
    /// Member id to client address.
    members: HashMap<u16, SocketAddr>,
    /// Replicated stream to the leader of each shard (0: none known).
    leaders: HashMap<String, Vec<u16>>,
}

impl Map {
    fn from_frame(map: &ClusterMap) -> Map {
        Map {
            members: map
                .members
                .iter()
                .filter_map(|member| Some((member.id, member.addr.parse().ok()?)))
                .collect(),
            leaders: map
                .streams
                .iter()
                .map(|route| (route.name.clone(), route.leaders.clone()))
                .collect(),
        }
    }
}

/// Splits `records` by the leader of each record's shard, keeping batch order within each
/// part; parts in the order their first record came.
fn split(map: &Map, stream: &str, records: &[Record]) -> Vec<Part> {
    let Some(leaders) = map.leaders.get(stream).filter(|l| !l.is_empty()) else {
        return vec![Part {
            member: None,
            records: records.to_vec(),
        }];
    };
    let shard_count = u32::try_from(leaders.len()).unwrap_or(u32::MAX);
    let mut parts: Vec<Part> = Vec::new();
    for record in records {
        let shard = felix_wire::shard_for_key(&record.key, shard_count);
        let member = Some(leaders[shard as usize]);
        match parts.iter_mut().find(|part| part.member == member) {
            Some(part) => part.records.push(record.clone()),
            None => parts.push(Part {
                member,
                records: vec![record.clone()],
            }),
        }
    }
    parts
}

/// A client of a Felix cluster: straight to each shard's leader (module docs).
pub struct ClusterClient {
    /// The configuration of every member connection (its address replaced).
    config: ClientConfig,
    /// The member the client was pointed at.
    seed: Arc<Client>,
    /// The seed's member id (0: the seed is not a cluster member).
    seed_id: u16,
    /// Connections to members, by member id: each opened once, by the first part that needs
    /// it; parts for other members never wait behind that handshake (a stopped or cut-off
    /// member's takes `ClientConfig::connect_timeout`).
    members: Mutex<HashMap<u16, Arc<MemberSlot>>>,
    map: Mutex<Arc<Map>>,
    /// A part failed in a way a stale map explains: refresh before the next publish.
    stale: AtomicBool,
    /// One refresh at a time, and the latest one's outcome: a caller that finds a refresh
    /// asked after the moment it needs the map to be from takes that one's outcome instead of
    /// asking again ([`ClusterClient::refresh_since`]).
    refreshing: tokio::sync::Mutex<Option<Refreshed>>,
    /// `DescribeCluster` requests sent ([`ClusterClient::map_requests`]).
    map_requests: AtomicU64,
    /// The cluster-wide idempotent producer: per replicated shard, its producer id and last
    /// sequence (`None`: `ClientConfig::idempotent` is off).
    producer: Option<Arc<ProducerState>>,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient")
            .field("seed", &self.config.addr)
            .field("seed_id", &self.seed_id)
            .finish_non_exhaustive()
    }
}

/// How long a part waits for its acks before the client checks whether its shard's leader
/// moved, and how often after that ([`ClusterClient::await_part`]).
const LEADER_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// Time one member is given to answer `DescribeCluster` in [`ClusterClient::refresh`],
/// connecting included.
const MAP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A waiting part takes a cluster map asked for at most this long before its check
/// ([`ClusterClient::await_part`]): however many parts wait, the members are asked about
/// twice a second, not once per part and second.
const MAP_FRESH: std::time::Duration = std::time::Duration::from_millis(500);

/// The latest refresh of the cluster map: when it was asked for, and whether a member gave it.
#[derive(Debug, Clone, Copy)]
struct Refreshed {
    asked: tokio::time::Instant,
    learned: bool,
}

/// One member's connection, opened once by whichever part gets there first (the others wait
/// for that connect, not one of their own); emptied again by [`ClusterClient::forget`].
type MemberSlot = tokio::sync::OnceCell<Arc<Client>>;

/// Where one publish's records go.
struct Part {
    /// The shards' leader; 0: no leader known (any member takes it and forwards); `None`: not
    /// a replicated stream (through the seed).
    member: Option<u16>,
    records: Vec<Record>,
}

impl ClusterClient {
    /// Connects to the member at `config.addr` and asks it for the cluster map.
    pub async fn connect(config: ClientConfig) -> Result<ClusterClient, ClientError> {
        let seed = Arc::new(Client::connect(config.clone()).await?);
        let producer = cluster_producer(&config, &seed);
        let map = seed.describe_cluster().await?;
        let mut members = HashMap::new();
        if map.member != 0 {
            let slot = Arc::new(MemberSlot::new_with(Some(Arc::clone(&seed))));
            members.insert(map.member, slot);
        }
        let client = ClusterClient {
            seed_id: map.member,
            config,
            seed,
            members: Mutex::new(members),
            map: Mutex::new(Arc::new(Map::from_frame(&map))),
            stale: AtomicBool::new(false),
            refreshing: tokio::sync::Mutex::new(None),
            map_requests: AtomicU64::new(1),
            producer,
        };
        Ok(client)
    }

    /// The member the client was pointed at, on the connection made at start (subscriptions
    /// and admin go through it; it is not opened again if that member dies).
    #[must_use]
    pub fn seed(&self) -> &Client {
        &self.seed
    }

    /// The member leading shard `shard` of replicated stream `stream`, as last learned.
    #[must_use]
    pub fn leader(&self, stream: &str, shard: u32) -> Option<u16> {
        self.map()
            .leaders
            .get(stream)
            .and_then(|leaders| leaders.get(shard as usize).copied())
            .filter(|leader| *leader != 0)
    }

    fn map(&self) -> Arc<Map> {
        Arc::clone(&self.map.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Asks for the cluster map again: from the seed, else from each other member in turn.
    /// Each member is given [`MAP_TIMEOUT`] (a killed or stopped member would otherwise hold
    /// the refresh until its connection's idle timeout). Callers at the same time share
    /// refreshes: one waits for the refresh under way, then at most one more is asked for
    /// all who called during it.
    pub async fn refresh(&self) -> Result<(), ClientError> {
        self.refresh_since(tokio::time::Instant::now()).await
    }

    /// How many times this client has asked a member for the cluster map (`DescribeCluster`),
    /// the one at connect included: a diagnostic of how often it refreshes.
    #[must_use]
    pub fn map_requests(&self) -> u64 {
        self.map_requests.load(Ordering::Relaxed)
    }

    /// Refreshes the cluster map unless a refresh asked for at `since` or later already
    /// ended (or ends while this caller waits for it), whose outcome is then this caller's.
    async fn refresh_since(&self, since: tokio::time::Instant) -> Result<(), ClientError> {
        let mut latest = self.refreshing.lock().await;
        if let Some(done) = *latest
            && done.asked >= since
        {
            return if done.learned {
                Ok(())
            } else {
                Err(ClientError::Closed(
                    "no member gave the cluster map just now".to_owned(),
                ))
            };
        }
        let asked = tokio::time::Instant::now();
        let outcome = self.ask_map().await;
        *latest = Some(Refreshed {
            asked,
            learned: outcome.is_ok(),
        });
        outcome
    }

    /// One refresh: the seed, then each other member in turn.
    async fn ask_map(&self) -> Result<(), ClientError> {
        let timed_out = || ClientError::Closed(format!("no cluster map within {MAP_TIMEOUT:?}"));
        self.map_requests.fetch_add(1, Ordering::Relaxed);
        let mut last = match tokio::time::timeout(MAP_TIMEOUT, self.seed.describe_cluster()).await {
            Ok(Ok(map)) => return self.learn(&map),
            Ok(Err(error)) => error,
            Err(_) => timed_out(),
        };
        let ids: Vec<u16> = self.map().members.keys().copied().collect();
        for id in ids.into_iter().filter(|id| *id != self.seed_id) {
            let asked = tokio::time::timeout(MAP_TIMEOUT, async {
                let client = self.member(id).await?;
                self.map_requests.fetch_add(1, Ordering::Relaxed);
                client.describe_cluster().await
            })
            .await;
            match asked {
                Ok(Ok(map)) => return self.learn(&map),
                Ok(Err(error)) => {
                    self.forget(id);
                    last = error;
                }
                Err(_) => last = timed_out(),
            }
        }
        Err(last)
    }

    fn learn(&self, map: &ClusterMap) -> Result<(), ClientError> {
        *self.map.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(Map::from_frame(map));
        self.stale.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// The connection for a part bound to `member` (see [`Part::member`]): the member's own,
    /// else any member that can be reached (it forwards to the leader).
    async fn route(&self, member: Option<u16>) -> Result<(u16, Arc<Client>), ClientError> {
        let Some(id) = member else {
            return Ok((0, Arc::clone(&self.seed)));
        };
        let mut last = None;
        if id != 0 {
            match self.member(id).await {
                Ok(client) => return Ok((id, client)),
                Err(error) => {
                    tracing::debug!(member = id, %error, "a shard's leader is unreachable");
                    self.stale.store(true, Ordering::Relaxed);
                    last = Some(error);
                }
            }
        }
        let mut ids: Vec<u16> = self.map().members.keys().copied().collect();
        ids.sort_unstable();
        for other in ids.into_iter().filter(|other| *other != id) {
            match self.member(other).await {
                Ok(client) => return Ok((other, client)),
                Err(error) => last = Some(error),
            }
        }
        Err(last
            .unwrap_or_else(|| ClientError::Protocol("the cluster map lists no member".to_owned())))
    }

    /// The connection to member `id`, opened on first use (and again after it failed).
    /// Parts bound to the same member share one connect; the lock is held only to find the
    /// member's slot, never across a handshake.
    async fn member(&self, id: u16) -> Result<Arc<Client>, ClientError> {
        let slot = Arc::clone(
            self.members
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(id)
                .or_default(),
        );
        let client = slot
            .get_or_try_init(|| async {
                let Some(addr) = self.map().members.get(&id).copied() else {
                    return Err(ClientError::Protocol(format!(
                        "member {id} is not in the cluster map"
                    )));
                };
                let mut config = self.config.clone();
                config.addr = addr;
                Ok(Arc::new(Client::connect(config).await?))
            })
            .await?;
        Ok(Arc::clone(client))
    }

    /// Drops the connection to member `id` (it failed): the next part bound there connects
    /// again.
    fn forget(&self, id: u16) {
        self.members
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }

    /// Queues an acked publish: each shard's records go to the member leading it (module
    /// docs); settle the returned [`ClusterAck`] with [`ClusterClient::settle`] for the acks
    /// of every part, one per shard in ascending shard order, or the first part's error.
    pub async fn publish_pipelined(
        &self,
        stream: &str,
        records: &[Record],
    ) -> Result<ClusterAck, ClientError> {
        if self.stale.load(Ordering::Relaxed) {
            // Best effort: with no member answering, the old map is as good as any.
            let _ = self.refresh().await;
        }
        let map = self.map();
        if let Some(producer) = &self.producer
            && let Some(leaders) = map.leaders.get(stream).filter(|l| !l.is_empty())
        {
            if records.is_empty() {
                return Err(ClientError::InvalidArgument("an empty batch".to_owned()));
            }
            let stream: Arc<str> = Arc::from(stream);
            let mut sequenced = Vec::new();
            for (shard, records) in split_by_shard(leaders.len(), records) {
                let (id, sequence) = producer.next(&stream, shard);
                let leader = leaders[shard as usize];
                let mut part = SequencedPart {
                    stream: Arc::clone(&stream),
                    shard,
                    producer: (id, sequence),
                    records,
                    member: leader,
                    sent_leader: leader,
                };
                let first = self.send_part(&mut part, leader).await;
                sequenced.push((part, first));
            }
            return Ok(ClusterAck {
                pending: Vec::new(),
                sequenced,
            });
        }
        let mut pending = Vec::new();
        for part in split(&map, stream, records) {
            let (member, client) = self.route(part.member).await?;
            match client.publish_pipelined(stream, &part.records).await {
                Ok(ack) => pending.push((member, ack)),
                Err(error) => {
                    self.failed(member, &error).await;
                    return Err(error);
                }
            }
        }
        Ok(ClusterAck {
            pending,
            sequenced: Vec::new(),
        })
    }

    /// Sends `part` through the member leading its shard (`leader`, 0 when none is known),
    /// or any member that answers; `part.member` becomes the one it went through. An error
    /// here is the attempt's outcome, like an answer's.
    async fn send_part(&self, part: &mut SequencedPart, leader: u16) -> Attempt {
        part.sent_leader = leader;
        let (member, client) = self.route(Some(leader)).await?;
        part.member = member;
        client
            .send_sequenced(&part.stream, part.shard, part.producer, &part.records)
            .await
    }

    /// Waits for a sequenced part's acks, sending it again (same producer id and sequence)
    /// through the shard's leader as then known after an outcome a retry may cure, at most
    /// `publish_retries` times. A part that fails for good moves its shard to a fresh
    /// producer id (its sequence would be a gap every later batch is refused for).
    async fn settle_part(
        &self,
        mut part: SequencedPart,
        first: Attempt,
    ) -> Result<Vec<ShardAck>, ClientError> {
        let Some(producer) = &self.producer else {
            return Err(ClientError::Protocol(
                "a sequenced part without a producer".to_owned(),
            ));
        };
        let mut attempt = first;
        let mut retries = 0;
        let mut wait = self.config.publish_retry_backoff;
        loop {
            let error = match attempt {
                Ok(answer) => match self.await_part(&part, answer).await {
                    Ok(acks) => return Ok(acks),
                    Err(error) => error,
                },
                Err(error) => error,
            };
            self.failed(part.member, &error).await;
            let (id, sequence) = part.producer;
            // Another batch of the shard failed for good: the shard went on under a new id.
            let abandoned = !producer.current(&part.stream, part.shard, id);
            if retries >= self.config.publish_retries
                || abandoned
                || !retryable_in_cluster(&error, sequence)
            {
                producer.abandon(&part.stream, part.shard, id);
                return Err(error);
            }
            retries += 1;
            tracing::debug!(
                stream = %part.stream,
                shard = part.shard,
                sequence,
                member = part.member,
                %error,
                "a cluster publish part is sent again"
            );
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(PUBLISH_RETRY_BACKOFF_MAX);
            if self.stale.load(Ordering::Relaxed) {
                let _ = self.refresh().await;
            }
            let leader = self.leader(&part.stream, part.shard).unwrap_or(0);
            attempt = self.send_part(&mut part, leader).await;
        }
    }

    /// Waits for a sequenced part's acks. Once it has waited [`LEADER_CHECK`], it looks at
    /// the cluster map again every [`LEADER_CHECK`]: when the shard's leader moved since the
    /// part went out (its member was killed, stopped or cut off, and its connection would
    /// only fail at `ClientConfig::idle_timeout`), the wait ends with an error the retry loop
    /// cures: the part goes again, with the same producer id and sequence, to the new leader,
    /// and the shard applies it once.
    async fn await_part(
        &self,
        part: &SequencedPart,
        answer: tokio::sync::oneshot::Receiver<crate::Answer>,
    ) -> Result<Vec<ShardAck>, ClientError> {
        let acks = sequenced_acks(answer);
        tokio::pin!(acks);
        let mut check =
            tokio::time::interval_at(tokio::time::Instant::now() + LEADER_CHECK, LEADER_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                acks = &mut acks => return acks,
                checked = check.tick() => {
                    // Best effort: a map no member gives stays as it was. A map another
                    // waiting part asked for lately will do.
                    let since = checked.checked_sub(MAP_FRESH).unwrap_or(checked);
                    let _ = self.refresh_since(since).await;
                    let leader = self.leader(&part.stream, part.shard).unwrap_or(0);
                    if leader != 0 && leader != part.sent_leader {
                        return Err(ClientError::Closed(format!(
                            "shard {} of {} is led by member {leader} now, not {}",
                            part.shard, part.stream, part.sent_leader
                        )));
                    }
                }
            }
        }
    }

    /// Publishes and waits for the acks (see [`ClusterClient::publish_pipelined`]).
    pub async fn publish(
        &self,
        stream: &str,
        records: &[Record],
    ) -> Result<Vec<ShardAck>, ClientError> {
        let pending = self.publish_pipelined(stream, records).await?;
        self.settle(pending).await
    }

    /// Waits for a pipelined publish's acks; a failure that a stale map explains marks the
    /// map for a refresh.
    pub async fn settle(&self, ack: ClusterAck) -> Result<Vec<ShardAck>, ClientError> {
        let mut acks = Vec::new();
        let mut first_error = None;
        for (member, pending) in ack.pending {
            match pending.await {
                Ok(part) => acks.extend(part),
                Err(error) => {
                    self.failed(member, &error).await;
                    first_error.get_or_insert(error);
                }
            }
        }
        // The parts wait (and retry) together: one part's leader change does not hold the
        // others' answers back.
        let settled = futures::future::join_all(
            ack.sequenced
                .into_iter()
                .map(|(part, first)| self.settle_part(part, first)),
        )
        .await;
        for outcome in settled {
            match outcome {
                Ok(part) => acks.extend(part),
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        if let Some(error) = first_error {
            return Err(error);
        }
        acks.sort_unstable_by_key(|ack| ack.shard);
        Ok(acks)
    }

    /// A part to `member` failed with `error`.
    async fn failed(&self, member: u16, error: &ClientError) {
        match error {
            ClientError::Server {
                code: ErrorCode::Unavailable | ErrorCode::StreamNotFound,
                ..
            } => self.stale.store(true, Ordering::Relaxed),
            ClientError::Server { .. } => {}
            _ => {
                // The connection is gone: a new one next time, after a refresh.
                self.stale.store(true, Ordering::Relaxed);
                if member != 0 {
                    self.forget(member);
                }
            }
        }
    }
}

/// The acks of a pipelined cluster publish: settle it with [`ClusterClient::settle`].
#[must_use = "the publish is sent; settle it to learn its offsets or its error"]
pub struct ClusterAck {
    /// Parts sent as plain publishes, by the member each went to.
    pending: Vec<(u16, PendingAck)>,
    /// Parts of the cluster's idempotent producer, one per shard, each with its first
    /// attempt (made when the publish was queued).
    sequenced: Vec<(SequencedPart, Attempt)>,
}

impl std::fmt::Debug for ClusterAck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterAck")
            .field("parts", &(self.pending.len() + self.sequenced.len()))
            .finish()
    }
}

/// One attempt of a sequenced part: the receiver of its answer, or why it could not be sent.
type Attempt = Result<tokio::sync::oneshot::Receiver<crate::Answer>, ClientError>;

/// One shard's records of a publish by the cluster's idempotent producer.
struct SequencedPart {
    stream: Arc<str>,
    shard: u32,
    /// The producer id and the sequence every attempt carries.
    producer: (u64, u64),
    records: Vec<Record>,
    /// The member the last attempt went through.
    member: u16,
    /// The shard's leader as the map named it when the last attempt went out (0: none).
    sent_leader: u16,
}

/// The cluster's idempotent producer for `config`, when idempotent publishing is on and the
/// seed member takes producers.
fn cluster_producer(config: &ClientConfig, seed: &Client) -> Option<Arc<ProducerState>> {
    seed.producer_id()?;
    Some(Arc::new(ProducerState {
        id: config.producer_id.unwrap_or_else(random_producer_id),
        shards: Mutex::default(),
    }))
}

/// Whether a sequenced part answered (or failed with) `error` is worth sending again, with
/// the same producer id and sequence: what a plain client retries ([`retryable`]), and what
/// another member may cure: a member's connection gone or not made (the retry goes to the
/// shard's leader as then known, or through any member that answers).
fn retryable_in_cluster(error: &ClientError, sequence: u64) -> bool {
    match error {
        ClientError::Closed(_) | ClientError::Connect { .. } | ClientError::Io(_) => true,
        other => retryable(other, sequence),
    }
}

/// Splits `records` by shard (of `shard_count`), keeping batch order within each; parts in
/// the order their first record came.
fn split_by_shard(shard_count: usize, records: &[Record]) -> Vec<(u32, Vec<Record>)> {
    let shard_count = u32::try_from(shard_count).unwrap_or(u32::MAX);
    let mut parts: Vec<(u32, Vec<Record>)> = Vec::new();
    for record in records {
        let shard = felix_wire::shard_for_key(&record.key, shard_count);
        match parts.iter_mut().find(|(part, _)| *part == shard) {
            Some((_, part)) => part.push(record.clone()),
            None => parts.push((shard, vec![record.clone()])),
        }
    }
    parts
}

impl Client {
    /// The cluster map of the broker this client is connected to (`DescribeCluster`):
    /// members and each replicated shard's leader; `member` 0 when it is not a cluster
    /// member.
    pub async fn describe_cluster(&self) -> Result<ClusterMap, ClientError> {
        match self
            .request(|request_id| Frame::DescribeCluster { request_id })
            .await?
        {
            Frame::ClusterMap(map) => Ok(map),
            other => Err(crate::unexpected("ClusterMap", &other)),
        }
    }

    /// Creates a stream through the cluster's control plane (`CreateClusterStream`): its shards
    /// are placed over the members, `replicas` copies each (an in-memory stream keeps one).
    /// Returns once the creation is applied on the member this client is connected to. Needs
    /// `admin` on the name where the broker has rules (docs/security.md).
    pub async fn create_cluster_stream(
        &self,
        name: &str,
        shard_count: u32,
        kind: StreamKind,
        replicas: u8,
        fsync: FsyncMode,
    ) -> Result<(), ClientError> {
        let name = name.to_owned();
        self.request_done(move |request_id| {
            Frame::CreateClusterStream(CreateClusterStream {
                request_id,
                name,
                shard_count,
                kind,
                replicas,
                fsync,
            })
        })
        .await
    }

    /// Deletes a cluster stream through the control plane (`DeleteClusterStream`): every
    /// member stops serving it and removes its logs. Returns once applied on this member.
    /// Needs `admin` on the name where the broker has rules.
    pub async fn delete_cluster_stream(&self, name: &str) -> Result<(), ClientError> {
        let name = name.to_owned();
        self.request_done(move |request_id| Frame::DeleteClusterStream { request_id, name })
            .await
    }

    /// Up to `max_records` committed records of shard `shard` of cluster stream `stream` from
    /// offset `from`, out of the connected member's own copy (`ReadShard`), in offset order;
    /// empty at the end of the copy. The member may answer fewer (one frame's worth): ask
    /// again from the offset after the last. Needs `subscribe` on the stream where the broker
    /// has rules.
    pub async fn read_shard(
        &self,
        stream: &str,
        shard: u32,
        from: u64,
        max_records: u32,
    ) -> Result<Vec<DeliveredRecord>, ClientError> {
        let stream = stream.to_owned();
        match self
            .request(move |request_id| {
                Frame::ReadShard(ReadShard {
                    request_id,
                    stream,
                    shard,
                    from,
                    max_records,
                })
            })
            .await?
        {
            Frame::Records(records) => Ok(records.records),
            other => Err(crate::unexpected("Records", &other)),
        }
    }

    async fn request_done(&self, frame: impl FnOnce(u64) -> Frame) -> Result<(), ClientError> {
        match self.request(frame).await? {
            Frame::Done { .. } => Ok(()),
            other => Err(crate::unexpected("Done", &other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: String) -> Record {
        crate::record(key.clone(), key)
    }

    #[test]
    fn a_batch_splits_by_shard_in_batch_order() {
        let records: Vec<Record> = (0..40).map(|i| record(format!("k{i}"))).collect();
        let parts = split_by_shard(4, &records);
        let mut shards: Vec<u32> = parts.iter().map(|(shard, _)| *shard).collect();
        shards.sort_unstable();
        shards.dedup();
        assert_eq!(shards.len(), parts.len(), "one part per shard");
        for (shard, part) in &parts {
            let expected: Vec<&Record> = records
                .iter()
                .filter(|r| felix_wire::shard_for_key(&r.key, 4) == *shard)
                .collect();
            assert_eq!(part.iter().collect::<Vec<_>>(), expected);
        }
        let first = felix_wire::shard_for_key(&records[0].key, 4);
        assert_eq!(
            parts[0].0, first,
            "parts in the order their first record came"
        );
        assert_eq!(parts.iter().map(|(_, p)| p.len()).sum::<usize>(), 40);
    }

    /// What another member may cure is sent again; what no retry cures is not.
    #[test]
    fn a_part_is_sent_again_after_a_lost_member_or_an_answer_a_retry_cures() {
        let server = |code, detail| ClientError::Server {
            code,
            detail,
            message: String::new(),
        };
        let again = [
            ClientError::Closed("the connection ended before the ack".to_owned()),
            ClientError::Connect {
                addr: "127.0.0.1:1".parse().expect("addr"),
                reason: "timed out".to_owned(),
            },
            server(ErrorCode::Unavailable, 7),
            server(ErrorCode::IngressBudgetExhausted, 0),
            server(ErrorCode::OutOfSequence, 6),
        ];
        for error in &again {
            assert!(retryable_in_cluster(error, 7), "{error}");
        }
        let final_ = [
            server(ErrorCode::StreamNotFound, 0),
            server(ErrorCode::Unavailable, 0),
            server(ErrorCode::OutOfSequence, 0),
            server(ErrorCode::OutOfSequence, 8),
            ClientError::InvalidArgument("a bad batch".to_owned()),
        ];
        for error in &final_ {
            assert!(!retryable_in_cluster(error, 7), "{error}");
        }
    }

    #[test]
    fn a_batch_splits_by_leader_in_batch_order() {
        let map = Map {
            members: HashMap::new(),
            leaders: HashMap::from([("s".to_owned(), vec![2, 3, 2, 0])]),
        };
        let records: Vec<Record> = (0..40).map(|i| record(format!("k{i}"))).collect();
        let parts = split(&map, "s", &records);
        let members: Vec<Option<u16>> = parts.iter().map(|part| part.member).collect();
        let mut sorted = members.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), members.len(), "one part per leader");
        for part in &parts {
            // Each part holds exactly the records whose shard that member leads, in order.
            let expected: Vec<&Record> = records
                .iter()
                .filter(|r| {
                    let shard = felix_wire::shard_for_key(&r.key, 4) as usize;
                    Some([2, 3, 2, 0][shard]) == part.member
                })
                .collect();
            assert_eq!(part.records.iter().collect::<Vec<_>>(), expected);
        }
        assert_eq!(parts.iter().map(|p| p.records.len()).sum::<usize>(), 40);
        // A stream the map does not know goes whole through the seed.
        let whole = split(&map, "other", &records);
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].member, None);
        assert_eq!(whole[0].records, records);
    }
}
