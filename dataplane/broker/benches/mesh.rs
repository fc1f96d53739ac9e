//! Cross-core mesh (`src/mesh.rs`) between two real threads, driven through the mesh's own API
//! (`Mesh::try_send` / `drain` / `park` / `unpark`, the per-core eventfd and `Mesh::reset`)
//! with the broker's own `CoreMessage` in `QUEUE_CAPACITY`-slot queues. The core's tokio pump
//! is replaced by a plain-thread loop following the same protocol, with a blocking `poll` on
//! the eventfd (bounded by a timeout) in place of `AsyncFd::readable`. The sender is the bench
//! thread, pinned to CPU 0; the receiver thread is pinned to CPU 1 (both when allowed).
//!
//! - `mesh/throughput_256`: one-way, batches of 256 messages core 0 -> core 1; the receiver
//!   drains in `DRAIN_BATCH` rounds and parks after `SPIN_BEFORE_PARK` idle, as the pump does.
//! - `mesh/round_trip/busy_poll`: one message 0 -> 1 and its echo 1 -> 0; nobody parks.
//! - `mesh/round_trip/parked`: the same, but the receiver is parked on its eventfd before each
//!   send, so every round trip pays one eventfd wake-up (~25-30 us on this VM). Only the
//!   send -> echo time is measured, not the wait for the receiver to park.
//!
//! Every wait is bounded (`TIMEOUT`), so a broken protocol fails the bench instead of hanging.
//!
//! `cargo bench -p felix-broker --bench mesh -- --warm-up-time 1 --measurement-time 3`

use std::hint::spin_loop;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use felix_broker::mesh::{DRAIN_BATCH, Mesh, QUEUE_CAPACITY, SPIN_BEFORE_PARK};
use felix_core::CoreMessage;

const SENDER: u16 = 0;
const RECEIVER: u16 = 1;
const SENDER_CPU: usize = 0;
const RECEIVER_CPU: usize = 1;
/// Messages per throughput iteration.
const BATCH: u64 = 256;
/// Longest any single wait may take before the bench panics instead of hanging.
const TIMEOUT: Duration = Duration::from_secs(10);
/// The receiver's blocking poll is bounded too, so it re-checks its stop flag.
const POLL_TIMEOUT_MS: i32 = 100;
/// Once the receiver says it is about to block, leave it this long to fall asleep in the
/// kernel, so the next send pays a real wake-up.
const SETTLE: Duration = Duration::from_micros(30);

/// What the receiving core does with its messages.
#[derive(Clone, Copy)]
enum Mode {
    /// Count them; park after `SPIN_BEFORE_PARK` idle (the core pump's protocol).
    Count,
    /// Echo each back to the sender; never park.
    EchoBusy,
    /// Echo each back to the sender; park as soon as nothing is waiting.
    EchoParking,
}

struct Shared {
    mesh: Mesh,
    stop: AtomicBool,
    received: AtomicU64,
    /// Set by the receiver right before it blocks on its eventfd, cleared when it wakes.
    blocking: AtomicBool,
}

/// The receiving core: a thread running `receive` until dropped.
struct Peer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Peer {
    fn start(mode: Mode, pinned: bool) -> Peer {
        let shared = Arc::new(Shared {
            mesh: Mesh::new(2).expect("mesh"),
            stop: AtomicBool::new(false),
            received: AtomicU64::new(0),
            blocking: AtomicBool::new(false),
        });
        let eventfd = shared.mesh.eventfd_of(RECEIVER).expect("receiver eventfd");
        let thread = std::thread::Builder::new()
            .name("mesh-receiver".to_owned())
            .spawn({
                let shared = Arc::clone(&shared);
                move || {
                    if pinned {
                        pin(RECEIVER_CPU);
                    }
                    receive(&shared, &eventfd, mode);
                }
            })
            .expect("spawn the receiver");
        Peer {
            shared,
            thread: Some(thread),
        }
    }

    fn mesh(&self) -> &Mesh {
        &self.shared.mesh
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the receiver if it is parked; its poll timeout covers the rest.
        let _ =
            self.shared
                .mesh
                .try_send(SENDER, RECEIVER, CoreMessage::Applied { token: u64::MAX });
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn pin(cpu: usize) {
    if let Err(error) = felix_affinity::pin_current_thread(cpu) {
        eprintln!("mesh bench: cannot pin to CPU {cpu} ({error}); running unpinned");
    }
}

/// Spins until `done`, panicking after `TIMEOUT`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    let mut spins = 0u32;
    while !done() {
        spin_loop();
        spins = spins.wrapping_add(1);
        if (spins & 0xff) == 0 && Instant::now() > deadline {
            panic!("mesh bench: timed out waiting for {what}");
        }
    }
}

/// `try_send`, retrying while the queue is full (the core yields and retries the same way).
fn send(mesh: &Mesh, from: u16, to: u16, message: CoreMessage) {
    let mut message = match mesh.try_send(from, to, message) {
        Ok(()) => return,
        Err(back) => back,
    };
    let deadline = Instant::now() + TIMEOUT;
    loop {
        spin_loop();
        message = match mesh.try_send(from, to, message) {
            Ok(()) => return,
            Err(back) => back,
        };
        assert!(
            Instant::now() < deadline,
            "mesh bench: queue {from} -> {to} stayed full"
        );
    }
}

/// Blocks until the eventfd is readable or `POLL_TIMEOUT_MS` passed.
fn wait_readable(eventfd: &OwnedFd) {
    let mut pollfd = libc::pollfd {
        fd: eventfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live, initialized pollfd, count 1, bounded timeout.
    let _ = unsafe { libc::poll(&mut pollfd, 1, POLL_TIMEOUT_MS) };
}

/// The receiving core's pump, as the broker's `runtime::pump` runs it minus the tokio task.
fn receive(shared: &Shared, eventfd: &OwnedFd, mode: Mode) {
    let mesh = &shared.mesh;
    let spin = match mode {
        Mode::Count => Some(SPIN_BEFORE_PARK),
        Mode::EchoBusy => None,
        Mode::EchoParking => Some(Duration::ZERO),
    };
    let echo = !matches!(mode, Mode::Count);
    let mut batch = Vec::with_capacity(DRAIN_BATCH);
    let mut idle_since = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        mesh.drain(RECEIVER, DRAIN_BATCH, &mut batch);
        if !batch.is_empty() {
            let count = batch.len() as u64;
            for message in batch.drain(..) {
                if echo && let CoreMessage::Applied { token } = message {
                    send(mesh, RECEIVER, SENDER, CoreMessage::Applied { token });
                }
            }
            shared.received.fetch_add(count, Ordering::Release);
            idle_since = Instant::now();
            continue;
        }
        match spin {
            None => {
                spin_loop();
                continue;
            }
            Some(spin) if idle_since.elapsed() < spin => {
                spin_loop();
                continue;
            }
            Some(_) => {}
        }
        if !mesh.park(RECEIVER) {
            continue;
        }
        shared.blocking.store(true, Ordering::SeqCst);
        wait_readable(eventfd);
        shared.blocking.store(false, Ordering::SeqCst);
        mesh.reset(RECEIVER);
        mesh.unpark(RECEIVER);
        idle_since = Instant::now();
    }
}

/// One message to the receiver and its echo back; the sender busy-polls for the echo.
fn round_trip(mesh: &Mesh, token: u64, reply: &mut Vec<CoreMessage>) {
    send(mesh, SENDER, RECEIVER, CoreMessage::Applied { token });
    wait_until("the echo", || {
        mesh.drain(SENDER, 1, reply);
        !reply.is_empty()
    });
    match reply.pop() {
        Some(CoreMessage::Applied { token: echoed }) => assert_eq!(echoed, token),
        other => panic!("mesh bench: unexpected echo {other:?}"),
    }
}

fn mesh_benches(c: &mut Criterion) {
    let allowed = felix_affinity::current_thread_allowed_cpus().unwrap_or_default();
    let pinned = allowed.contains(&SENDER_CPU) && allowed.contains(&RECEIVER_CPU);
    if pinned {
        pin(SENDER_CPU);
    } else {
        eprintln!("mesh bench: CPUs {SENDER_CPU} and {RECEIVER_CPU} not both allowed; unpinned");
    }
    eprintln!(
        "mesh bench: CoreMessage is {} bytes, {QUEUE_CAPACITY} per queue",
        std::mem::size_of::<CoreMessage>()
    );

    let mut group = c.benchmark_group("mesh");

    let peer = Peer::start(Mode::Count, pinned);
    group.throughput(Throughput::Elements(BATCH));
    group.bench_function("throughput_256", |b| {
        let mut token = 0u64;
        b.iter_custom(|iters| {
            let mesh = peer.mesh();
            let received = &peer.shared.received;
            let target = received.load(Ordering::Acquire) + iters * BATCH;
            let start = Instant::now();
            for _ in 0..iters * BATCH {
                send(mesh, SENDER, RECEIVER, CoreMessage::Applied { token });
                token = token.wrapping_add(1);
            }
            wait_until("the receiver to drain", || {
                received.load(Ordering::Acquire) >= target
            });
            start.elapsed()
        });
    });
    drop(peer);

    group.throughput(Throughput::Elements(1));
    let peer = Peer::start(Mode::EchoBusy, pinned);
    group.bench_function("round_trip/busy_poll", |b| {
        let mut reply = Vec::with_capacity(1);
        let mut token = 0u64;
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                round_trip(peer.mesh(), token, &mut reply);
                token = token.wrapping_add(1);
            }
            start.elapsed()
        });
    });
    drop(peer);

    let peer = Peer::start(Mode::EchoParking, pinned);
    group.bench_function("round_trip/parked", |b| {
        let mut reply = Vec::with_capacity(1);
        let mut token = 0u64;
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                wait_until("the receiver to park", || {
                    peer.shared.blocking.load(Ordering::SeqCst)
                });
                let settled = Instant::now();
                while settled.elapsed() < SETTLE {
                    spin_loop();
                }
                let start = Instant::now();
                round_trip(peer.mesh(), token, &mut reply);
                total += start.elapsed();
                token = token.wrapping_add(1);
            }
            total
        });
    });
    drop(peer);

    group.finish();
}

criterion_group!(benches, mesh_benches);
criterion_main!(benches);
