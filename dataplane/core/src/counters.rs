//! The counters one core state machine keeps: plain integers, updated on the core's thread;
//! the shell exports them to its metrics (counters only grow, gauges are read as they are).

use felix_wire::ErrorCode;

use crate::security::{AuthRefusal, Limit};

/// Totals since the core started, and a few gauges.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CoreCounters {
    /// Publish requests that arrived on this core (shed, refused and failed ones included).
    pub publishes: u64,
    /// Payload bytes of accepted publishes that arrived on this core (shed ones excluded).
    pub payload_bytes: u64,
    /// Records of accepted publishes that arrived on this core.
    pub records: u64,
    /// Accepted acked publishes (their `Ack` was written, or owed to a stream that closed).
    pub publishes_acked: u64,
    /// Accepted fire-and-forget publishes.
    pub publishes_fire_and_forget: u64,
    /// Acked publishes answered with an error other than a refusal (unknown stream, disk
    /// full, ...).
    pub acked_failed: u64,
    /// Fire-and-forget publishes that failed after they arrived (unknown stream, ...).
    pub fire_and_forget_failed: u64,
    /// `Ack` frames written.
    pub acks: u64,
    /// Publishes shed by this core's ingress queue.
    pub shed: u64,
    /// Publishes refused by this core's ingress queue (`IngressBudgetExhausted`).
    pub refused: u64,
    /// Publishes that waited for ingress room.
    pub waits: u64,
    /// Waiting publishes withdrawn because their stream closed (never admitted or answered).
    pub withdrawn: u64,
    /// Messages carrying publish work sent to another core.
    pub cross_core_hops: u64,
    /// Producer batches answered with their original ack, storing nothing (retries), on the
    /// shards this core owns.
    pub producer_duplicates: u64,
    /// Producer batches refused with `OutOfSequence` on the shards this core owns.
    pub producer_out_of_sequence: u64,
    /// Producers forgotten to make room (`PRODUCERS_PER_SHARD_MAX` per shard).
    pub producer_evictions: u64,
    /// Errors by code, indexed like [`ErrorCode::ALL`] (answered to a client or not).
    pub errors: [u64; ErrorCode::ALL.len()],
    /// Records written to subscribers of this core.
    pub delivered_records: u64,
    /// Gauge: subscriptions registered on this core's streams.
    pub subscribers: u64,
    /// Gauge: open connections of this core.
    pub connections: u64,
    /// Gauge: jobs in this core's ingress queue.
    pub ingress_depth: u64,
    /// Gauge: payload bytes those jobs hold.
    pub ingress_bytes: u64,
    /// Gauge: publishes waiting for ingress room.
    pub ingress_waiting: u64,
    /// Handshakes accepted (a principal authenticated, or `anonymous`).
    pub authenticated: u64,
    /// Handshakes refused with `Unauthenticated`, and connections revoked, by reason
    /// (indexed like [`AuthRefusal::ALL`]).
    pub auth_refused: [u64; AuthRefusal::ALL.len()],
    /// Requests refused with `PermissionDenied`, by operation (indexed like
    /// [`crate::OPERATIONS`]).
    pub denied: [u64; crate::OPERATIONS.len()],
    /// Limits a client ran into, by kind (indexed like [`Limit::ALL`]).
    pub limits_exceeded: [u64; Limit::ALL.len()],
}

impl CoreCounters {
    /// Counts one error with `code`.
    pub fn error(&mut self, code: ErrorCode) {
        // ALL lists every variant, so the position always exists; 16 compares, no lookup.
        if let Some(index) = ErrorCode::ALL.iter().position(|known| *known == code) {
            self.errors[index] += 1;
        }
    }

    /// Counts one client running into `limit`.
    pub fn limit(&mut self, limit: Limit) {
        self.limits_exceeded[limit.index()] += 1;
    }

    /// Counts one refused handshake (or revoked connection).
    pub fn auth_refusal(&mut self, refusal: AuthRefusal) {
        self.auth_refused[refusal.index()] += 1;
    }

    /// Errors counted with `code`.
    #[must_use]
    pub fn errors_of(&self, code: ErrorCode) -> u64 {
        ErrorCode::ALL
            .iter()
            .position(|known| *known == code)
            .map_or(0, |index| self.errors[index])
    }
}
