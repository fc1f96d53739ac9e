//! Prometheus metrics: the registry, the handles the core thread updates (resolved once at
//! start-up, never looked up per publish), and the `GET /metrics` endpoint served by tiny_http
//! on its own housekeeping thread. Handles are prometheus-client atomics, shared by `Arc`.
//! The state machine counts in plain integers (`felix_core::CoreCounters`); [`CoreExport`]
//! adds what changed to the handles after each input.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU64};

use felix_core::{AuthRefusal, CoreCounters, Limit, OPERATIONS};
use felix_wire::ErrorCode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::BrokerError;

type Label = [(&'static str, &'static str); 1];
type CoreLabel = [(&'static str, String); 1];
/// A float gauge (CPU seconds).
type CpuGauge = Gauge<f64, AtomicU64>;

/// One data-plane core's handles (label `core="i"`), resolved once at start-up.
#[derive(Clone)]
pub struct CoreMetrics {
    /// Publish requests that arrived on this core (`felix_core_publishes_total`).
    pub publishes: Counter,
    /// Payload bytes of accepted publishes that arrived on this core.
    pub payload_bytes: Counter,
    /// Records of accepted publishes that arrived on this core.
    pub records: Counter,
    /// Messages carrying publish work sent to another core (`felix_core_cross_core_hops_total`).
    pub cross_core_hops: Counter,
    /// Producer batches answered with their original ack, storing nothing (retries), on the
    /// shards this core owns (`felix_core_producer_duplicates_total`).
    pub producer_duplicates: Counter,
    /// Producer batches refused `out_of_sequence` (`felix_core_producer_out_of_sequence_total`).
    pub producer_out_of_sequence: Counter,
    /// Producers forgotten to keep the per-shard table bounded
    /// (`felix_core_producer_evictions_total`).
    pub producer_evictions: Counter,
    /// Jobs in this core's ingress queue.
    pub ingress_depth: Gauge,
    /// Publishes shed by this core's ingress queue.
    pub shed: Counter,
    /// Publishes refused by this core's ingress queue.
    pub refused: Counter,
    /// Publishes that waited for ingress room.
    pub waits: Counter,
    /// The core's durable log (per-core series and the totals they add to).
    pub durable: DurableMetrics,
    /// UDP payload bytes received by this core's QUIC endpoints (`felix_core_wire_bytes_total`).
    wire_bytes: Counter,
    /// All cores' wire bytes (`felix_wire_bytes_total`).
    total_wire_bytes: Counter,
    /// Kernel thread id of this core's thread, 0 until the thread started (read on scrape).
    tid: Arc<AtomicI32>,
}

/// s2n-quic event subscriber counting every UDP datagram a core's endpoint receives (wire
/// bytes: QUIC, TLS and Felix framing included). Two relaxed atomic adds per datagram.
#[derive(Debug, Clone)]
pub struct WireBytes {
    core: Counter,
    total: Counter,
}

impl s2n_quic::provider::event::Subscriber for WireBytes {
    type ConnectionContext = ();

    fn create_connection_context(
        &mut self,
        _meta: &s2n_quic::provider::event::ConnectionMeta,
        _info: &s2n_quic::provider::event::ConnectionInfo,
    ) -> Self::ConnectionContext {
    }

    fn on_datagram_received(
        &mut self,
        _context: &mut Self::ConnectionContext,
        _meta: &s2n_quic::provider::event::ConnectionMeta,
        event: &s2n_quic::provider::event::events::DatagramReceived,
    ) {
        let bytes = u64::from(event.len);
        self.core.inc_by(bytes);
        self.total.inc_by(bytes);
    }
}

impl CoreMetrics {
    /// The event subscriber that counts this core's wire bytes.
    #[must_use]
    pub fn wire_bytes_counter(&self) -> WireBytes {
        WireBytes {
            core: self.wire_bytes.clone(),
            total: self.total_wire_bytes.clone(),
        }
    }

    /// Records the core thread's id, so scrapes can read its CPU time.
    pub fn set_tid(&self, tid: i32) {
        self.tid.store(tid, std::sync::atomic::Ordering::Relaxed);
    }
}

/// fdatasync latency buckets in seconds: powers of two from 2 us to ~8.4 s, aligned with the
/// storage crate's log2 microsecond buckets so each sample lands in the matching bucket.
const FSYNC_SECONDS_BUCKETS: usize = 23;
const FSYNC_SECONDS_FIRST_BUCKET: f64 = 2e-6;

/// One core's durable-log handles, plus the broker-wide totals each core adds to. Updated by
/// the core from its log's counters after each pump ([`DurableMetrics::observe`]).
#[derive(Clone)]
pub struct DurableMetrics {
    append_bytes: Counter,
    fsyncs: Counter,
    fsync_records: Counter,
    fsync_bytes: Counter,
    records_pending: Gauge,
    recovery_seconds: CpuGauge,
    recovery_truncated_bytes: Gauge,
    total_append_bytes: Counter,
    total_fsyncs: Counter,
    total_fsync_records: Counter,
    total_fsync_bytes: Counter,
    total_records_pending: Gauge,
    total_recovery_truncated_bytes: Gauge,
    /// Offsets `felix log repair` quarantined, all cores (`felix_quarantined_records`).
    total_quarantined_records: Gauge,
    /// Quarantined offsets catch-up reads skipped (`felix_quarantine_skipped_records_total`).
    total_quarantine_skipped: Counter,
    /// Log bytes given back after streams were deleted (`felix_released_bytes_total`).
    total_released_bytes: Counter,
    /// The writer's work, all cores: `felix_log_direct_rounds_total`,
    /// `felix_log_direct_tail_reads_total`, `felix_log_direct_padding_bytes_total`,
    /// `felix_log_segments_created_total`, `felix_log_segments_made_ahead_total`.
    writer: WriterCounters,
    /// Catch-up read chunks found in memory (`felix_read_cache_hits_total`) and read from the
    /// disk by the logs' reader threads (`felix_read_fetches_total`).
    total_read_cache_hits: Counter,
    total_read_fetches: Counter,
    fsync_seconds: Histogram,
}

/// Broker-wide counters of the durable writers (`DurableMetrics::writer`).
#[derive(Clone, Default)]
struct WriterCounters {
    direct_rounds: Counter,
    direct_tail_reads: Counter,
    direct_padding_bytes: Counter,
    segments_created: Counter,
    segments_made_ahead: Counter,
}

/// The log counters already exported by one core (the next update adds the difference).
#[derive(Debug, Clone, Default)]
pub struct DurableExported {
    direct_rounds: u64,
    direct_tail_reads: u64,
    direct_padding_bytes: u64,
    segments_created: u64,
    segments_made_ahead: u64,
    append_bytes: u64,
    fsyncs: u64,
    fsync_records: u64,
    fsync_bytes: u64,
    records_pending: i64,
    quarantine_skipped: u64,
    released_bytes: u64,
    read_cache_hits: u64,
    read_fetches: u64,
    latency_buckets: [u64; felix_storage::LATENCY_BUCKETS],
}

impl DurableMetrics {
    /// Sets the recovery gauges (once, after the core's log opened).
    pub fn set_recovery(&self, seconds: f64, truncated_bytes: u64, quarantined_records: u64) {
        self.total_quarantined_records
            .inc_by(i64::try_from(quarantined_records).unwrap_or(i64::MAX));
        self.recovery_seconds.set(seconds);
        let truncated = i64::try_from(truncated_bytes).unwrap_or(i64::MAX);
        self.recovery_truncated_bytes.set(truncated);
        self.total_recovery_truncated_bytes.inc_by(truncated);
    }

    /// Adds what changed in `counters` since `exported`, and sets the pending gauge.
    pub fn observe(
        &self,
        counters: &felix_storage::Counters,
        records_pending: u64,
        quarantine_skipped: u64,
        exported: &mut DurableExported,
    ) {
        for (counter, now, seen) in [
            (
                &self.total_quarantine_skipped,
                quarantine_skipped,
                &mut exported.quarantine_skipped,
            ),
            (
                &self.total_released_bytes,
                counters.released_bytes,
                &mut exported.released_bytes,
            ),
            (
                &self.writer.direct_rounds,
                counters.direct_rounds,
                &mut exported.direct_rounds,
            ),
            (
                &self.writer.direct_tail_reads,
                counters.direct_tail_reads,
                &mut exported.direct_tail_reads,
            ),
            (
                &self.writer.direct_padding_bytes,
                counters.direct_padding_bytes,
                &mut exported.direct_padding_bytes,
            ),
            (
                &self.writer.segments_created,
                counters.segments_created,
                &mut exported.segments_created,
            ),
            (
                &self.writer.segments_made_ahead,
                counters.segments_made_ahead,
                &mut exported.segments_made_ahead,
            ),
            (
                &self.total_read_cache_hits,
                counters.read_cache_hits.get(),
                &mut exported.read_cache_hits,
            ),
            (
                &self.total_read_fetches,
                counters.read_fetches.get(),
                &mut exported.read_fetches,
            ),
        ] {
            if now > *seen {
                counter.inc_by(now - *seen);
                *seen = now;
            }
        }
        let add = |counter: &Counter, total: &Counter, now: u64, seen: &mut u64| {
            let delta = now.saturating_sub(*seen);
            if delta > 0 {
                counter.inc_by(delta);
                total.inc_by(delta);
                *seen = now;
            }
        };
        add(
            &self.append_bytes,
            &self.total_append_bytes,
            counters.append_bytes,
            &mut exported.append_bytes,
        );
        add(
            &self.fsyncs,
            &self.total_fsyncs,
            counters.fsyncs,
            &mut exported.fsyncs,
        );
        add(
            &self.fsync_records,
            &self.total_fsync_records,
            counters.fsync_records,
            &mut exported.fsync_records,
        );
        add(
            &self.fsync_bytes,
            &self.total_fsync_bytes,
            counters.fsync_bytes,
            &mut exported.fsync_bytes,
        );
        let pending = i64::try_from(records_pending).unwrap_or(i64::MAX);
        if pending != exported.records_pending {
            self.records_pending.set(pending);
            self.total_records_pending
                .inc_by(pending - exported.records_pending);
            exported.records_pending = pending;
        }
        // Storage bucket i holds [2^i, 2^(i+1)) us: observe 1.5 * 2^i us, which falls in the
        // histogram bucket whose upper bound is 2^(i+1) us (the sum is approximate). Bounded
        // by the fsyncs since the last update.
        for (bucket, (now, seen)) in counters
            .fsync_latency
            .buckets
            .iter()
            .zip(exported.latency_buckets.iter_mut())
            .enumerate()
        {
            let value = 1.5e-6 * f64::from(1u32 << bucket.min(31));
            for _ in *seen..*now {
                self.fsync_seconds.observe(value);
            }
            *seen = *now;
        }
    }
}

/// The machine's counters already exported by one core (the next export adds the change).
#[derive(Debug, Default)]
pub struct CoreExport {
    last: CoreCounters,
}

impl CoreExport {
    /// Adds what changed in `now` since the last export to the core's and the totals'
    /// handles. Counters only grow; gauges move by their difference. About twenty compares
    /// when nothing changed.
    pub fn export(&mut self, now: &CoreCounters, metrics: &Metrics, core: &CoreMetrics) {
        let last = &mut self.last;
        let add = |counters: &[&Counter], now: u64, seen: &mut u64| {
            if now != *seen {
                let delta = now - *seen;
                for counter in counters {
                    counter.inc_by(delta);
                }
                *seen = now;
            }
        };
        add(&[&core.publishes], now.publishes, &mut last.publishes);
        add(
            &[&core.payload_bytes, &metrics.payload_bytes],
            now.payload_bytes,
            &mut last.payload_bytes,
        );
        add(
            &[&core.records, &metrics.records],
            now.records,
            &mut last.records,
        );
        add(
            &[&metrics.publishes_acked],
            now.publishes_acked,
            &mut last.publishes_acked,
        );
        add(
            &[&metrics.publishes_fire_and_forget],
            now.publishes_fire_and_forget,
            &mut last.publishes_fire_and_forget,
        );
        add(&[&metrics.acks], now.acks, &mut last.acks);
        add(
            &[&core.shed, &metrics.publishes_shed],
            now.shed,
            &mut last.shed,
        );
        add(
            &[&core.refused, &metrics.publishes_refused],
            now.refused,
            &mut last.refused,
        );
        add(&[&core.waits], now.waits, &mut last.waits);
        add(
            &[&core.cross_core_hops],
            now.cross_core_hops,
            &mut last.cross_core_hops,
        );
        add(
            &[&core.producer_duplicates],
            now.producer_duplicates,
            &mut last.producer_duplicates,
        );
        add(
            &[&core.producer_out_of_sequence],
            now.producer_out_of_sequence,
            &mut last.producer_out_of_sequence,
        );
        add(
            &[&core.producer_evictions],
            now.producer_evictions,
            &mut last.producer_evictions,
        );
        add(
            &[&metrics.delivered_records],
            now.delivered_records,
            &mut last.delivered_records,
        );
        for (index, counter) in metrics.errors.iter().enumerate() {
            add(&[counter], now.errors[index], &mut last.errors[index]);
        }
        add(
            &[&metrics.authenticated],
            now.authenticated,
            &mut last.authenticated,
        );
        for (index, counter) in metrics.auth_refused.iter().enumerate() {
            add(
                &[counter],
                now.auth_refused[index],
                &mut last.auth_refused[index],
            );
        }
        for (index, counter) in metrics.denied.iter().enumerate() {
            add(&[counter], now.denied[index], &mut last.denied[index]);
        }
        for (index, counter) in metrics.limits_exceeded.iter().enumerate() {
            add(
                &[counter],
                now.limits_exceeded[index],
                &mut last.limits_exceeded[index],
            );
        }
        let gauge = |gauges: &[&Gauge], now: u64, seen: &mut u64| {
            if now != *seen {
                let delta = i64::try_from(now).unwrap_or(i64::MAX)
                    - i64::try_from(*seen).unwrap_or(i64::MAX);
                for gauge in gauges {
                    gauge.inc_by(delta);
                }
                *seen = now;
            }
        };
        gauge(
            &[&metrics.subscribers],
            now.subscribers,
            &mut last.subscribers,
        );
        gauge(
            &[&metrics.connections],
            now.connections,
            &mut last.connections,
        );
        gauge(
            &[&core.ingress_depth, &metrics.ingress_depth],
            now.ingress_depth,
            &mut last.ingress_depth,
        );
    }
}

/// The broker's counters and gauges. Cloning shares the same atomics.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Payload bytes of accepted publishes (`felix_payload_bytes_total`).
    pub payload_bytes: Counter,
    /// Records of accepted publishes (`felix_records_total`).
    pub records: Counter,
    /// Accepted publishes with `ack="acked"`.
    pub publishes_acked: Counter,
    /// Accepted publishes with `ack="fire_and_forget"`.
    pub publishes_fire_and_forget: Counter,
    /// `Ack` frames sent (`felix_acks_total`).
    pub acks: Counter,
    /// Errors by code, indexed like [`ErrorCode::ALL`] (`felix_errors_total{code}`).
    errors: [Counter; ErrorCode::ALL.len()],
    /// Live subscriptions (`felix_subscribers`).
    pub subscribers: Gauge,
    /// Records written to subscribers (`felix_delivered_records_total`).
    pub delivered_records: Counter,
    /// Open QUIC connections (`felix_connections`).
    pub connections: Gauge,
    /// Publishes shed by the ingress queues, all cores (`felix_publishes_shed_total`).
    pub publishes_shed: Counter,
    /// Publishes refused by the ingress queues, all cores (`felix_publishes_refused_total`).
    pub publishes_refused: Counter,
    /// Jobs in all ingress queues (`felix_ingress_queue_depth`).
    pub ingress_depth: Gauge,
    cores: Arc<[CoreMetrics]>,
    cpu_seconds: Arc<[CpuGauge]>,
    /// The kernel's UDP `RcvbufErrors` (host-wide, /proc/net/snmp), read on scrape.
    udp_rcvbuf_errors: Gauge,
    /// Handshakes accepted (`felix_authenticated_total`).
    authenticated: Counter,
    /// Handshakes refused and connections revoked with `Unauthenticated`, indexed like
    /// [`AuthRefusal::ALL`] (`felix_auth_refused_total{reason}`).
    auth_refused: [Counter; AuthRefusal::ALL.len()],
    /// Requests refused with `PermissionDenied`, indexed like [`OPERATIONS`]
    /// (`felix_permission_denied_total{operation}`).
    denied: [Counter; OPERATIONS.len()],
    /// Limits clients ran into, indexed like [`Limit::ALL`]
    /// (`felix_limit_exceeded_total{limit}`).
    limits_exceeded: [Counter; Limit::ALL.len()],
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(1)
    }
}

impl Metrics {
    /// Registers every metric (all error codes pre-registered, so they show 0 before the
    /// first error) and resolves every handle.
    #[must_use]
    pub fn new(core_count: u16) -> Metrics {
        let mut registry = Registry::default();
        // prometheus-client appends `_total` to counter names when encoding.
        let payload_bytes = Counter::default();
        registry.register(
            "felix_payload_bytes",
            "Payload bytes of accepted publishes",
            payload_bytes.clone(),
        );
        let records = Counter::default();
        registry.register(
            "felix_records",
            "Records of accepted publishes",
            records.clone(),
        );
        let publishes = Family::<Label, Counter>::default();
        registry.register(
            "felix_publishes",
            "Accepted publish requests by ack mode",
            publishes.clone(),
        );
        let publishes_acked = publishes.get_or_create(&[("ack", "acked")]).clone();
        let publishes_fire_and_forget = publishes
            .get_or_create(&[("ack", "fire_and_forget")])
            .clone();
        let acks = Counter::default();
        registry.register("felix_acks", "Ack frames sent", acks.clone());
        let error_family = Family::<Label, Counter>::default();
        registry.register(
            "felix_errors",
            "Errors by wire error code (answered or not)",
            error_family.clone(),
        );
        let errors =
            ErrorCode::ALL.map(|code| error_family.get_or_create(&[("code", code.name())]).clone());
        let subscribers = Gauge::default();
        registry.register(
            "felix_subscribers",
            "Live subscriptions",
            subscribers.clone(),
        );
        let delivered_records = Counter::default();
        registry.register(
            "felix_delivered_records",
            "Records written to subscribers",
            delivered_records.clone(),
        );
        let connections = Gauge::default();
        registry.register(
            "felix_connections",
            "Open QUIC connections",
            connections.clone(),
        );
        let publishes_shed = Counter::default();
        registry.register(
            "felix_publishes_shed",
            "Publishes shed by the ingress queues (all cores)",
            publishes_shed.clone(),
        );
        let publishes_refused = Counter::default();
        registry.register(
            "felix_publishes_refused",
            "Publishes refused by the ingress queues (all cores)",
            publishes_refused.clone(),
        );
        let ingress_depth = Gauge::default();
        registry.register(
            "felix_ingress_queue_depth",
            "Jobs in the ingress queues (all cores)",
            ingress_depth.clone(),
        );
        let udp_rcvbuf_errors = Gauge::default();
        registry.register(
            "felix_udp_rcvbuf_errors",
            "The kernel's UDP RcvbufErrors (datagrams dropped because a socket receive buffer \
             was full; host-wide, from /proc/net/snmp, read on scrape)",
            udp_rcvbuf_errors.clone(),
        );
        let authenticated = Counter::default();
        registry.register(
            "felix_authenticated",
            "Handshakes accepted (a principal authenticated, or anonymous)",
            authenticated.clone(),
        );
        let refused_family = Family::<Label, Counter>::default();
        registry.register(
            "felix_auth_refused",
            "Handshakes refused, and connections revoked, with unauthenticated, by reason",
            refused_family.clone(),
        );
        let auth_refused = AuthRefusal::ALL.map(|reason| {
            refused_family
                .get_or_create(&[("reason", reason.name())])
                .clone()
        });
        let denied_family = Family::<Label, Counter>::default();
        registry.register(
            "felix_permission_denied",
            "Requests refused with permission_denied, by operation",
            denied_family.clone(),
        );
        let denied = OPERATIONS.map(|operation| {
            denied_family
                .get_or_create(&[("operation", operation.name())])
                .clone()
        });
        let limit_family = Family::<Label, Counter>::default();
        registry.register(
            "felix_limit_exceeded",
            "Requests, streams and connections refused by a limit, by limit",
            limit_family.clone(),
        );
        let limits_exceeded = Limit::ALL.map(|limit| {
            limit_family
                .get_or_create(&[("limit", limit.name())])
                .clone()
        });
        let (cores, cpu_seconds) = register_cores(&mut registry, core_count);
        Metrics {
            authenticated,
            auth_refused,
            denied,
            limits_exceeded,
            registry: Arc::new(registry),
            publishes_shed,
            publishes_refused,
            ingress_depth,
            cores,
            cpu_seconds,
            udp_rcvbuf_errors,
            payload_bytes,
            records,
            publishes_acked,
            publishes_fire_and_forget,
            acks,
            errors,
            subscribers,
            delivered_records,
            connections,
        }
    }

    /// Counts one error with `code`.
    pub fn error(&self, code: ErrorCode) {
        // ALL lists every variant, so the position always exists; 16 compares, no lookup.
        if let Some(index) = ErrorCode::ALL.iter().position(|known| *known == code) {
            self.errors[index].inc();
        }
    }

    #[must_use]
    pub fn registry(&self) -> Arc<Registry> {
        Arc::clone(&self.registry)
    }

    /// Core `index`'s handles.
    #[must_use]
    pub fn core(&self, index: u16) -> CoreMetrics {
        self.cores[usize::from(index)].clone()
    }

    /// Reads each started core thread's CPU time from /proc into its gauge. Called by the
    /// metrics thread before each render, never by a data-plane core.
    pub fn refresh_cpu(&self) {
        for (core, gauge) in self.cores.iter().zip(self.cpu_seconds.iter()) {
            let tid = core.tid.load(std::sync::atomic::Ordering::Relaxed);
            if tid == 0 {
                continue;
            }
            match felix_affinity::thread_cpu_seconds_of(felix_affinity::Tid(tid)) {
                Ok(seconds) => {
                    gauge.set(seconds);
                }
                Err(error) => tracing::debug!(%error, tid, "cannot read a core's CPU time"),
            }
        }
    }

    /// Reads the kernel's UDP receive-buffer drops into their gauge (metrics thread only).
    fn refresh_udp_drops(&self) {
        match std::fs::read_to_string("/proc/net/snmp") {
            Ok(text) => match udp_rcvbuf_errors(&text) {
                Some(drops) => {
                    self.udp_rcvbuf_errors
                        .set(i64::try_from(drops).unwrap_or(i64::MAX));
                }
                None => tracing::debug!("no Udp RcvbufErrors in /proc/net/snmp"),
            },
            Err(error) => tracing::debug!(%error, "cannot read /proc/net/snmp"),
        }
    }

    /// The registry in the Prometheus/OpenMetrics text format (CPU gauges and UDP drops
    /// refreshed first).
    #[must_use]
    pub fn render(&self) -> String {
        self.refresh_cpu();
        self.refresh_udp_drops();
        render(&self.registry)
    }
}

/// Registers the per-core families and resolves one handle set per core.
fn register_cores(
    registry: &mut Registry,
    core_count: u16,
) -> (Arc<[CoreMetrics]>, Arc<[CpuGauge]>) {
    let counter = |registry: &mut Registry, name: &str, help: &str| {
        let family = Family::<CoreLabel, Counter>::default();
        registry.register(name, help, family.clone());
        family
    };
    let gauge = |registry: &mut Registry, name: &str, help: &str| {
        let family = Family::<CoreLabel, Gauge>::default();
        registry.register(name, help, family.clone());
        family
    };
    let publishes = counter(
        registry,
        "felix_core_publishes",
        "Publish requests that arrived on the core",
    );
    let payload = counter(
        registry,
        "felix_core_payload_bytes",
        "Payload bytes of accepted publishes that arrived on the core",
    );
    let records = counter(
        registry,
        "felix_core_records",
        "Records of accepted publishes that arrived on the core",
    );
    let hops = counter(
        registry,
        "felix_core_cross_core_hops",
        "Messages carrying publish work sent to another core",
    );
    let producer_duplicates = counter(
        registry,
        "felix_core_producer_duplicates",
        "Producer batches answered with their original ack, storing nothing (retries), on the \
         shards the core owns",
    );
    let producer_out_of_sequence = counter(
        registry,
        "felix_core_producer_out_of_sequence",
        "Producer batches refused out_of_sequence on the shards the core owns",
    );
    let producer_evictions = counter(
        registry,
        "felix_core_producer_evictions",
        "Producers forgotten to keep the core's per-shard producer tables bounded",
    );
    let depth = gauge(
        registry,
        "felix_core_ingress_queue_depth",
        "Jobs in the core's ingress queue",
    );
    let shed = counter(
        registry,
        "felix_core_ingress_shed",
        "Publishes shed by the core's ingress queue",
    );
    let refused = counter(
        registry,
        "felix_core_ingress_refused",
        "Publishes refused by the core's ingress queue",
    );
    let waits = counter(
        registry,
        "felix_core_ingress_waits",
        "Publishes that waited for ingress room",
    );
    let append_bytes = counter(
        registry,
        "felix_core_append_bytes",
        "Bytes appended to the core's durable log: 28 bytes of framing + key + payload per \
         record",
    );
    let fsyncs = counter(
        registry,
        "felix_core_fsyncs",
        "fdatasyncs of the core's durable log",
    );
    let fsync_records = counter(
        registry,
        "felix_core_fsync_records",
        "Records made durable by the core's fdatasyncs (divide by fsyncs for the fan-in)",
    );
    let fsync_bytes = counter(
        registry,
        "felix_core_fsync_bytes",
        "Framed bytes made durable by the core's fdatasyncs",
    );
    let pending = gauge(
        registry,
        "felix_core_durable_records_pending",
        "Durable records given an offset and not yet committed on the core",
    );
    let recovery_truncated = gauge(
        registry,
        "felix_core_recovery_truncated_bytes",
        "Bytes the core's log recovery truncated at start-up (a torn tail)",
    );
    let recovery_seconds = Family::<CoreLabel, CpuGauge>::default();
    registry.register(
        "felix_core_recovery_seconds",
        "Seconds the core's log recovery took at start-up",
        recovery_seconds.clone(),
    );
    let total_append_bytes = Counter::default();
    registry.register(
        "felix_append_bytes",
        "Bytes appended to the durable logs (all cores): payload + key + 28 per record",
        total_append_bytes.clone(),
    );
    let total_fsyncs = Counter::default();
    registry.register(
        "felix_fsyncs",
        "fdatasyncs of the durable logs (all cores)",
        total_fsyncs.clone(),
    );
    let total_fsync_records = Counter::default();
    registry.register(
        "felix_fsync_records",
        "Records made durable by fdatasyncs (all cores); records per fsync = this / fsyncs",
        total_fsync_records.clone(),
    );
    let total_fsync_bytes = Counter::default();
    registry.register(
        "felix_fsync_bytes",
        "Framed bytes made durable by fdatasyncs (all cores)",
        total_fsync_bytes.clone(),
    );
    let total_pending = Gauge::default();
    registry.register(
        "felix_durable_records_pending",
        "Durable records given an offset and not yet committed (all cores)",
        total_pending.clone(),
    );
    let total_truncated = Gauge::default();
    registry.register(
        "felix_recovery_truncated_bytes",
        "Bytes log recovery truncated at start-up (all cores)",
        total_truncated.clone(),
    );
    let total_quarantined = Gauge::default();
    registry.register(
        "felix_quarantined_records",
        "Durable log offsets quarantined by felix log repair: records lost to damage, never \
         handed out again (all cores)",
        total_quarantined.clone(),
    );
    let total_quarantine_skipped = Counter::default();
    registry.register(
        "felix_quarantine_skipped_records",
        "Quarantined offsets subscriptions skipped while catching up from the log (all cores)",
        total_quarantine_skipped.clone(),
    );
    let total_released = Counter::default();
    registry.register(
        "felix_released_bytes",
        "Durable log bytes given back after their streams were deleted (all cores)",
        total_released.clone(),
    );
    let writer = WriterCounters::default();
    for (name, help, counter) in [
        (
            "felix_log_direct_rounds",
            "Durable log rounds written with O_DIRECT (all cores)",
            &writer.direct_rounds,
        ),
        (
            "felix_log_direct_tail_reads",
            "Direct rounds that first read their segment's last partial block back (after \
             recovery or a failed round; all cores)",
            &writer.direct_tail_reads,
        ),
        (
            "felix_log_direct_padding_bytes",
            "Zeros direct writes put past their rounds: block padding and zeros written ahead of \
             small rounds (all cores)",
            &writer.direct_padding_bytes,
        ),
        (
            "felix_log_segments_created",
            "Durable log segments started (all cores)",
            &writer.segments_created,
        ),
        (
            "felix_log_segments_made_ahead",
            "Durable log segments whose file was made ahead, off the core's thread (all cores)",
            &writer.segments_made_ahead,
        ),
    ] {
        registry.register(name, help, counter.clone());
    }
    let total_read_cache_hits = Counter::default();
    registry.register(
        "felix_read_cache_hits",
        "Catch-up read chunks (256 KiB) the durable logs found in memory without blocking: the \
         page cache, or a chunk fetched for an earlier read (all cores)",
        total_read_cache_hits.clone(),
    );
    let total_read_fetches = Counter::default();
    registry.register(
        "felix_read_fetches",
        "Catch-up read chunks the durable logs' reader threads read from the disk because the \
         page cache did not hold them; those reads were answered later (all cores)",
        total_read_fetches.clone(),
    );
    let fsync_seconds = Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        FSYNC_SECONDS_FIRST_BUCKET,
        2.0,
        FSYNC_SECONDS_BUCKETS as u16,
    ));
    registry.register(
        "felix_fsync_seconds",
        "fdatasync latency of the durable logs (all cores), as measured by the writer",
        fsync_seconds.clone(),
    );
    let wire = counter(
        registry,
        "felix_core_wire_bytes",
        "UDP payload bytes received by the core's QUIC endpoints (QUIC, TLS and Felix framing \
         included)",
    );
    let total_wire = Counter::default();
    registry.register(
        "felix_wire_bytes",
        "UDP payload bytes received by the broker's QUIC endpoints (all cores)",
        total_wire.clone(),
    );
    let cpu = Family::<CoreLabel, Gauge<f64, AtomicU64>>::default();
    registry.register(
        "felix_core_cpu_seconds",
        "CPU seconds used by the core's thread (read from /proc on scrape)",
        cpu.clone(),
    );
    let mut cores = Vec::with_capacity(usize::from(core_count));
    let mut cpus = Vec::with_capacity(usize::from(core_count));
    for index in 0..core_count {
        let label: CoreLabel = [("core", index.to_string())];
        cores.push(CoreMetrics {
            publishes: publishes.get_or_create_owned(&label),
            payload_bytes: payload.get_or_create_owned(&label),
            records: records.get_or_create_owned(&label),
            cross_core_hops: hops.get_or_create_owned(&label),
            producer_duplicates: producer_duplicates.get_or_create_owned(&label),
            producer_out_of_sequence: producer_out_of_sequence.get_or_create_owned(&label),
            producer_evictions: producer_evictions.get_or_create_owned(&label),
            ingress_depth: depth.get_or_create_owned(&label),
            shed: shed.get_or_create_owned(&label),
            refused: refused.get_or_create_owned(&label),
            waits: waits.get_or_create_owned(&label),
            durable: DurableMetrics {
                append_bytes: append_bytes.get_or_create_owned(&label),
                fsyncs: fsyncs.get_or_create_owned(&label),
                fsync_records: fsync_records.get_or_create_owned(&label),
                fsync_bytes: fsync_bytes.get_or_create_owned(&label),
                records_pending: pending.get_or_create_owned(&label),
                recovery_seconds: recovery_seconds.get_or_create_owned(&label),
                recovery_truncated_bytes: recovery_truncated.get_or_create_owned(&label),
                total_append_bytes: total_append_bytes.clone(),
                total_fsyncs: total_fsyncs.clone(),
                total_fsync_records: total_fsync_records.clone(),
                total_fsync_bytes: total_fsync_bytes.clone(),
                total_records_pending: total_pending.clone(),
                total_recovery_truncated_bytes: total_truncated.clone(),
                total_quarantined_records: total_quarantined.clone(),
                total_quarantine_skipped: total_quarantine_skipped.clone(),
                total_released_bytes: total_released.clone(),
                writer: writer.clone(),
                total_read_cache_hits: total_read_cache_hits.clone(),
                total_read_fetches: total_read_fetches.clone(),
                fsync_seconds: fsync_seconds.clone(),
            },
            wire_bytes: wire.get_or_create_owned(&label),
            total_wire_bytes: total_wire.clone(),
            tid: Arc::new(AtomicI32::new(0)),
        });
        cpus.push(cpu.get_or_create_owned(&label));
    }
    (cores.into(), cpus.into())
}

/// `RcvbufErrors` of the `Udp:` table of /proc/net/snmp (a header line of names followed by a
/// line of values).
fn udp_rcvbuf_errors(snmp: &str) -> Option<u64> {
    let mut udp = snmp.lines().filter(|line| line.starts_with("Udp:"));
    let names = udp.next()?;
    let values = udp.next()?;
    let column = names
        .split_whitespace()
        .position(|name| name == "RcvbufErrors")?;
    values.split_whitespace().nth(column)?.parse().ok()
}

fn render(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing into a String cannot fail; an encoding error would be a metric defect.
    if let Err(error) = prometheus_client::encoding::text::encode(&mut text, registry) {
        tracing::error!(%error, "cannot encode metrics");
    }
    text
}

/// The `/metrics` HTTP endpoint on its housekeeping thread. Dropping it stops the thread.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    local_addr: SocketAddr,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl MetricsServer {
    /// Binds `addr` and starts serving `GET /metrics` from `registry`, and the cluster's
    /// admin requests once `cluster` holds the service (`cluster.rs`).
    pub fn start(
        addr: SocketAddr,
        metrics: Metrics,
        cluster: ClusterSlot,
    ) -> Result<MetricsServer, BrokerError> {
        let bind_error = |reason: String| BrokerError::MetricsBind { addr, reason };
        let server =
            tiny_http::Server::http(addr).map_err(|error| bind_error(error.to_string()))?;
        let local_addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| bind_error("bound to a non-IP address".to_owned()))?;
        let server = Arc::new(server);
        let serving = Arc::clone(&server);
        let thread = std::thread::Builder::new()
            .name("felix-metrics".to_owned())
            .spawn(move || serve(&serving, &metrics, &cluster))
            .map_err(|source| BrokerError::Thread {
                name: "felix-metrics",
                source,
            })?;
        Ok(MetricsServer {
            server,
            local_addr,
            thread: Some(thread),
        })
    }

    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Where the metrics thread finds the cluster service, set once the broker started it.
pub type ClusterSlot = Arc<std::sync::OnceLock<Arc<felix_cluster::service::Service>>>;

fn json_response(status: u16, body: String) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let mut response = tiny_http::Response::from_string(body).with_status_code(status);
    if let Ok(header) = tiny_http::Header::from_bytes("Content-Type", "application/json") {
        response.add_header(header);
    }
    response
}

fn error_json(status: u16, message: &str) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    json_response(status, serde_json::json!({ "error": message }).to_string())
}

fn serve(server: &tiny_http::Server, metrics: &Metrics, cluster: &ClusterSlot) {
    // Ends when `unblock` is called (the iterator then yields None).
    for request in server.incoming_requests() {
        let method = request.method().clone();
        let url = request.url().to_owned();
        let path = url.split('?').next().unwrap_or_default();
        let response = match (&method, path) {
            (tiny_http::Method::Get, "/metrics") => {
                let mut text = metrics.render();
                if let Some(service) = cluster.get() {
                    // The cluster's gauges go before the exposition's closing `# EOF`.
                    let body_end = text.rfind("# EOF").unwrap_or(text.len());
                    text.truncate(body_end);
                    text.push_str(&felix_cluster::admin::render_metrics(&service.status()));
                    text.push_str("# EOF\n");
                }
                let mut response = tiny_http::Response::from_string(text);
                if let Ok(header) = tiny_http::Header::from_bytes("Content-Type", CONTENT_TYPE) {
                    response.add_header(header);
                }
                response
            }
            (_, "/v1/cluster/streams" | "/v1/cluster/read") => error_json(
                404,
                "the metrics endpoint serves metrics and read-only status only: create, delete \
                 and read cluster streams over QUIC (`felix cluster create-stream`, \
                 `delete-stream`, `read`), under the broker's authentication and rules",
            ),
            (_, "/v1/cluster/status") if cluster.get().is_none() => error_json(
                404,
                "this broker is not a cluster member (FELIX_CLUSTER_NODE_ID=0)",
            ),
            (_, "/v1/cluster/status") if cluster.get().is_some_and(|service| service.failed()) => {
                error_json(
                    500,
                    "the cluster service stopped on a fatal error (see the broker's log)",
                )
            }
            (tiny_http::Method::Get, "/v1/cluster/status") => match cluster.get() {
                Some(service) => json_response(
                    200,
                    serde_json::to_string(&service.status()).unwrap_or_default(),
                ),
                None => error_json(404, "not a cluster member"),
            },
            _ => tiny_http::Response::from_string(
                "not found; try GET /metrics (or GET /v1/cluster/status on a cluster member)\n",
            )
            .with_status_code(404),
        };
        if let Err(error) = request.respond(response) {
            tracing::debug!(%error, "metrics client went away");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves RcvbufErrors is read from the Udp value line by its column name.
    #[test]
    fn rcvbuf_errors_parsed_from_snmp() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
            Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors\n\
            Udp: 100 2 3 90 17 0\n\
            UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors\n\
            UdpLite: 0 0 0 0 99 0\n";
        assert_eq!(udp_rcvbuf_errors(snmp), Some(17));
        assert_eq!(udp_rcvbuf_errors("Ip: a\nIp: 1\n"), None);
    }

    // Proves every required metric name is exported and every error code is pre-registered.
    #[test]
    fn render_lists_every_metric_and_code() {
        let metrics = Metrics::new(2);
        metrics.payload_bytes.inc_by(42);
        metrics.core(1).cross_core_hops.inc();
        metrics.error(ErrorCode::TooOld);
        let text = metrics.render();
        for name in [
            "felix_payload_bytes_total 42",
            "felix_records_total 0",
            "felix_publishes_total{ack=\"acked\"} 0",
            "felix_publishes_total{ack=\"fire_and_forget\"} 0",
            "felix_acks_total 0",
            "felix_subscribers 0",
            "felix_delivered_records_total 0",
            "felix_connections 0",
            "felix_errors_total{code=\"too_old\"} 1",
            "felix_publishes_shed_total 0",
            "felix_wire_bytes_total 0",
            "felix_core_wire_bytes_total{core=\"1\"} 0",
            "felix_udp_rcvbuf_errors ",
            "felix_publishes_refused_total 0",
            "felix_ingress_queue_depth 0",
            "felix_core_cross_core_hops_total{core=\"1\"} 1",
            "felix_core_ingress_queue_depth{core=\"0\"} 0",
            "felix_core_cpu_seconds{core=\"1\"} 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        for code in ErrorCode::ALL {
            assert!(text.contains(&format!("felix_errors_total{{code=\"{}\"}}", code.name())));
        }
    }
}
