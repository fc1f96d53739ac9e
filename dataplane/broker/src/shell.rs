//! [`Shell`]: what one core's tasks share on the core's thread: the state machine, its
//! durable log, the catalogue file (core 0), the stream writers' wake-ups, the connection
//! handles and the metrics export. Every input goes through [`Shell::input`], which hands the
//! machine the time and then carries out everything the input produced ([`Shell::drain`]).
//! No `RefCell` borrow is ever held across an `.await`.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use felix_auth::{Checked, TokenStore};
use felix_core::driver::{self, Effects};
use felix_core::{
    Catalog, CatalogWrite, ClusterRequest, ConnectionId, Core, CoreMessage, DurableLog, Now,
    StreamId, TokenCheck,
};
use felix_storage::{ErrorChain, StorageError};
use felix_wire::{Decoder, ErrorCode};
use tokio::sync::{Notify, watch};

use crate::auth::SlowCheck;
use crate::mesh::Mesh;
use crate::metrics::{CoreExport, CoreMetrics, DurableExported, Metrics};

/// Exit code of the process after a fatal storage error (EX_IOERR from sysexits.h), so a
/// supervisor can tell it from a configuration error.
pub const FATAL_STORAGE_EXIT_CODE: i32 = 74;

/// One core's shared state.
pub(crate) struct Shell {
    pub index: u16,
    pub core: RefCell<Core>,
    pub log: RefCell<DurableLog>,
    /// Core 0: the durable catalogue file, written when the machine asks.
    catalog: Option<RefCell<Catalog>>,
    pub mesh: Arc<Mesh>,
    /// Each open stream's writer task, woken by `StreamReady`.
    writers: RefCell<HashMap<StreamId, Rc<Notify>>>,
    /// Open connections, so the machine (a refused handshake) and shutdown can close them.
    pub connections: RefCell<HashMap<ConnectionId, s2n_quic::connection::Handle>>,
    /// Notified whenever a connection leaves `connections`.
    pub connections_changed: Notify,
    /// Wakes the timer task: the log has more reads to answer, or a deadline moved.
    pub timers_changed: Notify,
    /// The earliest deadline the timer task sleeps until (to notice an earlier one).
    pub next_deadline: Cell<Option<Instant>>,
    pub decoder: Decoder,
    /// The decoder of hello streams until `HelloOk`: frames bounded by FELIX_HELLO_MAX_BYTES.
    pub hello_decoder: Decoder,
    /// The tokens in force (replaced whole on SIGHUP).
    tokens: watch::Receiver<Arc<TokenStore>>,
    /// FELIX_HELLO_TIMEOUT_MS: time a connection has to get its handshake answered.
    pub hello_timeout: std::time::Duration,
    /// Bytes of undecoded frames one connection's streams may hold (connection.rs,
    /// `ReadBudget`).
    pub connection_read_budget: u64,
    /// Token checks that need argon2, for the token task (one per parked hello).
    pub slow_checks: RefCell<VecDeque<SlowCheck>>,
    /// Wakes the token task.
    pub token_work: Notify,
    metrics: Metrics,
    pub core_metrics: CoreMetrics,
    exported: RefCell<CoreExport>,
    durable_exported: RefCell<DurableExported>,
    /// The link to the cluster service, when this broker is a cluster member.
    cluster: Option<crate::cluster::CoreLink>,
}

/// The time now, as the machine takes it.
pub(crate) fn now() -> Now {
    let unix_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
        });
    Now {
        at: Instant::now(),
        unix_us,
    }
}

impl Shell {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        core: Core,
        log: DurableLog,
        catalog: Option<Catalog>,
        mesh: Arc<Mesh>,
        decoders: (Decoder, Decoder),
        tokens: watch::Receiver<Arc<TokenStore>>,
        hello_timeout: std::time::Duration,
        connection_read_budget: u64,
        metrics: Metrics,
        core_metrics: CoreMetrics,
        cluster: Option<crate::cluster::CoreLink>,
    ) -> Shell {
        let (decoder, hello_decoder) = decoders;
        Shell {
            index: core.index(),
            core: RefCell::new(core),
            log: RefCell::new(log),
            catalog: catalog.map(RefCell::new),
            mesh,
            writers: RefCell::new(HashMap::new()),
            connections: RefCell::new(HashMap::new()),
            connections_changed: Notify::new(),
            timers_changed: Notify::new(),
            next_deadline: Cell::new(None),
            decoder,
            hello_decoder,
            tokens,
            hello_timeout,
            connection_read_budget,
            slow_checks: RefCell::new(VecDeque::new()),
            token_work: Notify::new(),
            metrics,
            core_metrics,
            exported: RefCell::new(CoreExport::default()),
            durable_exported: RefCell::new(DurableExported::default()),
            cluster,
        }
    }

    /// Runs one input on the machine, then carries out what it produced.
    pub fn input<R>(&self, input: impl FnOnce(&mut Core, Now) -> R) -> R {
        let now = now();
        let mut core = self.core.borrow_mut();
        let result = input(&mut core, now);
        self.drain(&mut core, now);
        result
    }

    /// Registers a stream's writer (woken on `StreamReady`).
    pub fn add_writer(&self, stream: StreamId) -> Rc<Notify> {
        let notify = Rc::new(Notify::new());
        self.writers.borrow_mut().insert(stream, Rc::clone(&notify));
        notify
    }

    pub fn remove_writer(&self, stream: StreamId) {
        self.writers.borrow_mut().remove(&stream);
    }

    /// Carries out the machine's outputs: messages into the mesh (what does not fit stays in
    /// the outbox, retried by the pump), catalogue writes (core 0, on this thread: they are
    /// rare and the answer waits for the disk anyway), cluster requests, token checks, the
    /// durable log (at most once per input), writer wake-ups, the timer task's deadline and
    /// the metrics. The order and the rounds are felix-core's driver
    /// (`dataplane/core/src/driver.rs`), shared with felix-sim and the fuzz machine;
    /// [`ShellEffects`] is what this shell does for each output.
    pub fn drain(&self, core: &mut Core, now: Now) {
        // The broker's pump never halts (a fatal storage error exits the process).
        let _ = driver::drain(&mut ShellEffects { shell: self, core }, now);
    }

    /// Answers a token check at once when no hashing is needed (a malformed or unknown token,
    /// or one verified since the last reload), else queues it for the token task.
    fn check_token(&self, core: &mut Core, now: Now, check: TokenCheck) {
        let store = Arc::clone(&self.tokens.borrow());
        match store.check_fast(&check.token) {
            Ok(Checked::Verified(verified)) => {
                core.handle_token_checked(now, check.stream, Ok(verified));
            }
            Err(refusal) => core.handle_token_checked(now, check.stream, Err(refusal)),
            Ok(Checked::NeedsHash) => {
                self.slow_checks.borrow_mut().push_back(SlowCheck {
                    stream: check.stream,
                    token: check.token,
                    store,
                });
                self.token_work.notify_one();
            }
        }
    }

    /// Moves outbox messages into the mesh while the queues have room. When a queue is full,
    /// announces that this core waits for room and retries once (`Mesh::wait_for_room`, the
    /// room protocol of mesh.rs): what is still blocked then is sent by the pump once a
    /// receiver's drain wakes it (`driver::send_messages`).
    pub fn send_messages(&self, core: &mut Core) {
        driver::send_messages(&mut ShellEffects { shell: self, core });
    }

    /// Pumps the durable log; a fatal storage error stops the process here, before any
    /// later ack can be written.
    pub fn pump_log(&self, core: &mut Core, now: Now) {
        let mut log = self.log.borrow_mut();
        let before = log.next_deadline();
        match core.pump_log(&mut log, now) {
            Ok(report) => {
                if report.more || before != log.next_deadline() {
                    self.timers_changed.notify_one();
                }
            }
            Err(error) => fatal_exit(usize::from(self.index), &error),
        }
        self.core_metrics.durable.observe(
            log.counters(),
            core.engine().durable_counters().records_pending,
            core.engine().durable_counters().quarantine_skipped,
            &mut self.durable_exported.borrow_mut(),
        );
    }

    /// Applies retention to the durable log (the timer task, every few seconds).
    pub fn apply_retention(&self, core: &mut Core, now: Now) {
        let result = core.apply_retention(&mut self.log.borrow_mut(), now);
        if let Err(error) = result {
            if error.is_fatal() {
                fatal_exit(usize::from(self.index), &error);
            }
            tracing::warn!(core = self.index, error = %ErrorChain(&error), "retention failed; retrying later");
        }
    }

    /// Clean shutdown: write and fdatasync what the log holds.
    pub fn shutdown_log(&self, timeout: std::time::Duration) {
        let result: Result<(), StorageError> = {
            let mut core = self.core.borrow_mut();
            core.shutdown_log(&mut self.log.borrow_mut(), timeout)
        };
        match result {
            Ok(()) => tracing::info!(core = self.index, "durable log flushed"),
            Err(error) if error.is_fatal() => fatal_exit(usize::from(self.index), &error),
            Err(error) => {
                tracing::error!(core = self.index, error = %ErrorChain(&error), "durable log flush failed")
            }
        }
    }

    /// Closes a connection (a refused handshake, or shutdown) if it is still open.
    pub fn close_connection(&self, connection: ConnectionId, code: ErrorCode) {
        if let Some(handle) = self.connections.borrow().get(&connection) {
            handle.close(close_code(code));
        }
    }
}

/// What the shell does for each output of the driver (`dataplane/core/src/driver.rs`): the
/// shell's state, and its core while the core is borrowed for the drain.
struct ShellEffects<'a> {
    shell: &'a Shell,
    core: &'a mut Core,
}

impl Effects for ShellEffects<'_> {
    fn core(&mut self) -> &mut Core {
        self.core
    }

    fn send(&mut self, to: u16, message: CoreMessage) -> Result<(), CoreMessage> {
        self.shell.mesh.try_send(self.shell.index, to, message)
    }

    fn wait_for_room(&mut self) {
        self.shell.mesh.wait_for_room(self.shell.index);
    }

    fn room_found(&mut self) {
        self.shell.mesh.room_found(self.shell.index);
    }

    fn write_catalog(&mut self, now: Now, write: CatalogWrite) {
        let catalog = self
            .shell
            .catalog
            .as_ref()
            .expect("catalogue writes come from core 0, which holds the catalogue");
        let result = catalog
            .borrow_mut()
            .apply(&write.change)
            .map_err(|error| ErrorChain(&error).to_string());
        self.core.handle_catalog_written(now, write.id, result);
    }

    fn route_cluster(&mut self, _now: Now, request: ClusterRequest) -> Result<(), ClusterRequest> {
        match &self.shell.cluster {
            Some(link) => {
                link.send(request);
                Ok(())
            }
            // Not a member: the driver refuses it (`driver::refuse_cluster`).
            None => Err(request),
        }
    }

    fn check_token(&mut self, now: Now, check: TokenCheck) {
        self.shell.check_token(self.core, now, check);
    }

    fn pump_log(&mut self, now: Now) -> ControlFlow<()> {
        self.shell.pump_log(self.core, now);
        ControlFlow::Continue(())
    }

    fn stream_ready(&mut self, stream: StreamId) {
        if let Some(writer) = self.shell.writers.borrow().get(&stream) {
            writer.notify_one();
        }
    }

    fn drained(&mut self, _now: Now) {
        let shell = self.shell;
        let core = &mut *self.core;
        if core.has_log_work() {
            shell.timers_changed.notify_one();
        }
        if let Some(deadline) = core.poll_timeout()
            && shell.next_deadline.get().is_none_or(|next| deadline < next)
        {
            shell.timers_changed.notify_one();
        }
        shell
            .exported
            .borrow_mut()
            .export(core.counters(), &shell.metrics, &shell.core_metrics);
    }
}

/// A wire error code as a QUIC application close code.
pub(crate) fn close_code(code: ErrorCode) -> s2n_quic::application::Error {
    u32::from(code as u16).into()
}

/// Logs a fatal storage error and exits the process at once (no destructors, no further
/// acks): an fdatasync error leaves the page cache in an unknown state, so the only safe
/// continuation is a restart and recovery (docs/design/durable.md).
pub(crate) fn fatal_exit(core: usize, error: &StorageError) -> ! {
    let error = ErrorChain(error);
    tracing::error!(core, error = %error, "fatal durable log error: stopping the broker");
    eprintln!("felix: core {core}: fatal durable log error: {error}; stopping (restart recovers)");
    std::process::exit(FATAL_STORAGE_EXIT_CODE)
}
