//! felix-sim: a seeded simulation of the broker's per-core state machines.
//!
//! One run (one seed) builds N cores of the real `felix_core::Core`, each with its real
//! durable log on the storage crate's fault backend, core 0's real catalogue file, a mesh of
//! bounded FIFO queues per ordered pair of cores, M clients and a logical clock, then takes a
//! few thousand random steps: clients connect, create and delete streams, publish acked and
//! fire-and-forget batches, subscribe, lag, resume, close streams and connections; messages
//! between cores are delivered in a random interleaving (FIFO per pair, as the mesh allows);
//! log rounds and catch-up read fetches complete late, fdatasync fails, the disk fills up, the power is cut, time
//! passes. After every step every core's invariants hold, and every answer a client reads is
//! checked against what it knows (`oracle.rs`). At the end the run drains to a quiet state
//! and checks liveness (every request answered, every subscriber caught up), exact publish
//! counts per core, and durability after a final power cut.
//!
//! Everything random comes from the seed ([`rng::Rng`]); the same seed replays the same run,
//! step for step ([`Outcome::digest`]). A failure prints the seed, the steps leading to it
//! and the command that replays it.
//!
//! The cluster run (`cluster.rs`, `felix-sim --cluster`): three brokers, each with cores of
//! the real machine and the real cluster member, over a simulated peer network with loss,
//! partitions and broker kills with power cuts; audited for acknowledged records kept
//! exactly once, identical copies and dense offsets.
//!
//! Threads: a run lives on one thread (the machines are not `Send`); the runner runs seeds
//! on a few threads side by side.

mod client;
pub mod cluster;
mod oracle;
pub mod rng;
mod trace;
mod world;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use felix_storage::{FsyncMode, PowerCut};

pub use trace::{TRACE_LINES_KEPT, Trace};
pub use world::Stats;

use crate::client::Role;
use crate::world::World;

/// Steps of one run by default: long enough for streams to be created, loaded, deleted and
/// crashed under, short enough that 200 seeds fit in CI's few minutes.
pub const STEPS_DEFAULT: u64 = 1500;
/// Steps of one cluster run by default (5 ms of simulated time each: 20 s).
pub const CLUSTER_STEPS_DEFAULT: u64 = 4000;
/// Drain rounds at the end of a run before it must be quiet: each round delivers every
/// message, completes every round and reads every stream, so a correct broker is quiet
/// after a few; hitting the bound means something keeps itself busy (a livelock).
const QUIESCE_ROUNDS_MAX: u32 = 200;

/// What a passing run did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub seed: u64,
    /// FNV-1a of the step log: equal for two runs of one seed.
    pub digest: u64,
    pub stats: Stats,
}

/// A failing run: the panic message and the last steps.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub message: String,
    pub tail: Vec<String>,
    pub steps_logged: u64,
}

impl Failure {
    /// A run of `seed` that panicked: its message and the last steps of its `trace`.
    fn of_panic(seed: u64, panic: &(dyn std::any::Any + Send), trace: &Trace) -> Failure {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Failure {
            seed,
            message,
            tail: trace.tail().cloned().collect(),
            steps_logged: trace.written,
        }
    }
}

/// Runs one seed. `echo`: print every step as it happens.
pub fn run_seed(seed: u64, steps: u64, echo: bool) -> Result<Outcome, Failure> {
    let mut world = World::new(seed, steps, Trace::new(TRACE_LINES_KEPT, echo));
    let result = catch_unwind(AssertUnwindSafe(|| run(&mut world)));
    match result {
        Ok(()) => Ok(Outcome {
            seed,
            digest: world.trace.digest(),
            stats: world.stats.clone(),
        }),
        Err(panic) => Err(Failure::of_panic(seed, panic.as_ref(), &world.trace)),
    }
}

fn run(world: &mut World) {
    for step in 0..world.shape.steps {
        world
            .trace
            .line(format!("#{step} t={}us", world.clock.as_micros()));
        take_step(world);
        if world.halted {
            // The process exits on a fatal storage error; the machine comes back from disk.
            let cut = power_cut(world);
            world.crash(cut);
        }
    }
    quiesce(world);
    final_checks(world);
    let cut = match world.shape.fsync {
        FsyncMode::OnCommit => Some(PowerCut::DropUnsynced),
        // Periodic mode acks before fdatasync: only a process crash keeps every ack.
        FsyncMode::Periodic { .. } => None,
    };
    world.crash(cut);
}

/// How the broker dies: a power cut where acks wait for fdatasync, else a process crash.
fn power_cut(world: &mut World) -> Option<PowerCut> {
    match world.shape.fsync {
        FsyncMode::OnCommit => match world.rng.below(3) {
            0 => Some(PowerCut::DropUnsynced),
            1 => Some(PowerCut::TearUnsynced {
                seed: world.rng.next_u64(),
            }),
            _ => None,
        },
        FsyncMode::Periodic { .. } => None,
    }
}

fn take_step(world: &mut World) {
    let clients = world.clients.len();
    match world
        .rng
        .weighted(&[30, 30, 22, 25, 12, 6, 2, 3, 1, 2, 1, 1, 8])
    {
        0 => {
            let client = world.rng.index(clients);
            world.client_request(client);
        }
        1 => {
            let feedable = world.feedable();
            if !feedable.is_empty() {
                let at = feedable[world.rng.index(feedable.len())];
                world.feed(at);
            }
        }
        2 => {
            let streams: Vec<_> = world
                .all_streams()
                .into_iter()
                .filter(|at| !world.clients[at.client].conns[at.conn].streams[at.stream].lagging)
                .collect();
            if !streams.is_empty() {
                let at = streams[world.rng.index(streams.len())];
                world.read(at);
            }
        }
        3 => {
            let count = world.rng.range(1, 4);
            for _ in 0..count {
                if !world.deliver_message() {
                    break;
                }
            }
        }
        4 => {
            let inject = world.rng.chance(world.shape.fault_rate * 20);
            world.complete_round(inject);
        }
        5 => {
            let by = if world.rng.chance(100) {
                Duration::from_millis(world.rng.range(100, 3000))
            } else {
                Duration::from_micros(world.rng.range(1, 20_000))
            };
            world.advance(by);
        }
        6 => {
            let subscriptions: Vec<_> = world
                .all_streams()
                .into_iter()
                .filter(|at| {
                    matches!(
                        world.clients[at.client].conns[at.conn].streams[at.stream].role,
                        Role::Subscription(_)
                    )
                })
                .collect();
            if !subscriptions.is_empty() {
                let at = subscriptions[world.rng.index(subscriptions.len())];
                let stream = &mut world.clients[at.client].conns[at.conn].streams[at.stream];
                stream.lagging = !stream.lagging;
            }
        }
        7 => {
            let streams = world.all_streams();
            if !streams.is_empty() {
                let at = streams[world.rng.index(streams.len())];
                world.trace.line(format!("c{} closes a stream", at.client));
                world.close_stream(at, true);
            }
        }
        8 => {
            let client = world.rng.index(clients);
            if !world.clients[client].conns.is_empty() {
                let conn = world.rng.index(world.clients[client].conns.len());
                if world.changing(client, conn) {
                    return;
                }
                world.trace.line(format!("c{client} disconnects"));
                world.close_conn(client, conn);
            }
        }
        9 => {
            let streams = world.all_streams();
            if !streams.is_empty() {
                let at = streams[world.rng.index(streams.len())];
                world.fin(at);
            }
        }
        10 => {
            let streams = world.all_streams();
            if !streams.is_empty() {
                let at = streams[world.rng.index(streams.len())];
                world.garbage(at);
            }
        }
        12 => {
            world.complete_fetch();
        }
        _ => {
            if world.stats.crashes < u64::from(world.shape.crashes_max)
                && world.rng.chance(world.shape.fault_rate * 30)
            {
                let cut = power_cut(world);
                world.crash(cut);
            }
        }
    }
}

/// Drains everything: feeds every queued frame, delivers every message, completes every
/// round, lets every deadline pass, reads every stream; until nothing moves.
fn quiesce(world: &mut World) {
    world.trace.line("quiesce".to_owned());
    for stream in world.all_streams() {
        world.clients[stream.client].conns[stream.conn].streams[stream.stream].lagging = false;
    }
    let wait = world.shape.ingress.commit_wait + Duration::from_millis(250);
    for _ in 0..QUIESCE_ROUNDS_MAX {
        let before = (world.trace.written, world.stats.frames);
        while let Some(&at) = world.feedable().first() {
            world.feed(at);
        }
        while world.deliver_message() {}
        while world.complete_round(false) {}
        while world.complete_fetch() {}
        world.advance(wait);
        let mut streams = world.all_streams();
        streams.reverse();
        for at in streams {
            // Reading may close streams (and shift indices): re-check each.
            if at.conn < world.clients[at.client].conns.len()
                && at.stream < world.clients[at.client].conns[at.conn].streams.len()
            {
                world.read(at);
            }
        }
        if world.halted {
            let cut = power_cut(world);
            world.crash(cut);
            continue;
        }
        if world.quiet()
            && world.feedable().is_empty()
            && before == (world.trace.written, world.stats.frames)
        {
            return;
        }
    }
    panic!("the broker did not become quiet in {QUIESCE_ROUNDS_MAX} drain rounds");
}

/// Liveness and exact counts once quiet.
fn final_checks(world: &mut World) {
    for (index, sim) in world.cores.iter_mut().enumerate() {
        let fed = world.fed[index];
        let counters = sim.core.counters();
        assert_eq!(counters.ingress_depth, 0, "core {index}: jobs still held");
        assert_eq!(counters.ingress_waiting, 0, "core {index}: waiters left");
        assert_eq!(
            counters.refused, fed.refused,
            "core {index}: refusals counted vs read by clients"
        );
        assert_eq!(
            counters.publishes,
            fed.acked + fed.fire_and_forget,
            "core {index}: publishes counted vs fed"
        );
        assert_eq!(
            fed.acked,
            counters.publishes_acked
                + counters.refused
                + counters.acked_failed
                + fed.cancelled_acked,
            "core {index}: every acked publish was acked, refused, failed or cancelled"
        );
        assert_eq!(
            fed.fire_and_forget,
            counters.publishes_fire_and_forget
                + counters.shed
                + counters.fire_and_forget_failed
                + fed.cancelled_fire_and_forget,
            "core {index}: every fire-and-forget publish was taken, shed, failed or cancelled"
        );
    }
    for at in world.all_streams() {
        let stream = &world.clients[at.client].conns[at.conn].streams[at.stream];
        assert!(
            stream.pending.is_empty() || !stream.to_send.is_empty(),
            "c{} stream {} still waits for answers once quiet: {:?}",
            at.client,
            stream.id.0,
            stream.pending.keys().collect::<Vec<_>>()
        );
        if let Role::Subscription(sub) = &stream.role
            && sub.ended.is_none()
            && let Some(id) = sub.incarnation
        {
            for (&shard, &next) in &sub.next {
                if let Some(last) = world.oracle.last_acked(id, shard) {
                    assert!(
                        next > last,
                        "a subscriber of {} got shard {shard} up to {next} only, {last} was acked",
                        sub.name
                    );
                }
            }
        }
    }
}

/// Runs seeds `first..first + count` on `threads` threads; returns the outcomes and failures.
pub fn run_seeds(
    first: u64,
    count: u64,
    steps: u64,
    threads: usize,
) -> (Vec<Outcome>, Vec<Failure>) {
    run_many(
        first,
        count,
        threads,
        |seed| run_seed(seed, steps, false),
        |o| o.seed,
    )
}

/// Runs `run` for seeds `first..first + count` on `threads` threads; returns the outcomes
/// and the failures, each in seed order.
fn run_many<O: Send>(
    first: u64,
    count: u64,
    threads: usize,
    run: impl Fn(u64) -> Result<O, Failure> + Sync,
    seed_of: impl Fn(&O) -> u64,
) -> (Vec<O>, Vec<Failure>) {
    let next = std::sync::atomic::AtomicU64::new(first);
    let results = std::sync::Mutex::new((Vec::new(), Vec::new()));
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= first + count {
                        return;
                    }
                    let result = run(seed);
                    let mut results = results.lock().unwrap_or_else(|poison| poison.into_inner());
                    match result {
                        Ok(outcome) => results.0.push(outcome),
                        Err(failure) => results.1.push(failure),
                    }
                }
            });
        }
    });
    let (mut outcomes, mut failures) = results.into_inner().unwrap_or_else(|p| p.into_inner());
    outcomes.sort_by_key(|outcome| seed_of(outcome));
    failures.sort_by_key(|failure: &Failure| failure.seed);
    (outcomes, failures)
}

/// What a passing cluster run did.
#[derive(Debug, Clone)]
pub struct ClusterOutcome {
    pub seed: u64,
    pub digest: u64,
    pub stats: cluster::ClusterStats,
}

/// Runs one seed of the cluster run (`cluster.rs`). `echo`: print every step as it happens.
pub fn run_cluster_seed(seed: u64, steps: u64, echo: bool) -> Result<ClusterOutcome, Failure> {
    let mut world = cluster::ClusterWorld::new(seed, steps, Trace::new(TRACE_LINES_KEPT, echo));
    let result = catch_unwind(AssertUnwindSafe(|| cluster::run(&mut world)));
    match result {
        Ok(()) => Ok(ClusterOutcome {
            seed,
            digest: world.trace.digest(),
            stats: world.stats.clone(),
        }),
        Err(panic) => Err(Failure::of_panic(seed, panic.as_ref(), &world.trace)),
    }
}

/// Runs cluster seeds `first..first + count` on `threads` threads.
pub fn run_cluster_seeds(
    first: u64,
    count: u64,
    steps: u64,
    threads: usize,
) -> (Vec<ClusterOutcome>, Vec<Failure>) {
    run_many(
        first,
        count,
        threads,
        |seed| run_cluster_seed(seed, steps, false),
        |o| o.seed,
    )
}
