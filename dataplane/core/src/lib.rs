//! felix-core: the per-core state machine of the broker, sans-IO.
//!
//! Owns everything one data-plane core decides: publish routing and splitting (each record's
//! shard computed once), ingress admission, the cross-core protocol (tokens, answers, delivery
//! credits, the outbox per destination core), subscription slots, durable waiters and log
//! catch-up requests, and on core 0 the serialized catalogue changes. [`Core`] owns no thread,
//! socket, file, clock or channel: inputs arrive as `handle_*(now, ...)` calls (a decoded frame
//! from a connection's stream, a message from another core, a log completion, a timer) and
//! outputs are drained with `poll_*` calls (bytes for a stream, messages for other cores,
//! catalogue writes, events that wake a stream's writer, the next deadline). The broker crate
//! is the IO shell that feeds it; the simulation (`dataplane/sim`) feeds many of them on a
//! logical clock, with the storage crate's fault backend, and replays any failure from a seed.
//!
//! [`driver`] is the drain every caller runs after each input (the order in which outputs are
//! carried out, and its rounds), through an [`Effects`] implementation of its own: the shell,
//! the simulation and the fuzz machine share it.
//!
//! Two modules carry out storage outputs and are shared by the shell and the simulation, so
//! both do exactly the same thing: [`durable`] (the core's log, driven by
//! [`Core::pump_log`]) and [`catalog`] (`catalog.json`, written on core 0's
//! [`CatalogWrite`]s). They do file IO when called; `Core` itself never does.
//!
//! Threads: a `Core` lives on its data-plane core's thread for its whole life (its engine's
//! shard state is deliberately not shared); other cores are reached only through messages.

mod admin;
pub mod admission;
pub mod catalog;
mod cluster;
mod config;
mod core;
mod counters;
pub mod driver;
pub mod durable;
mod message;
mod producer;
mod publish;
pub mod security;
mod subscribe;

pub use crate::admission::{Admission, AdmissionEvent, Decision, Policy, Ticket};
pub use crate::catalog::{CATALOG_FILE, Catalog, CatalogChange, CatalogEntry, CatalogError};
pub use crate::cluster::{
    ClusterAdmin, ClusterAdminAnswer, ClusterPublish, ClusterRefusal, ClusterRequest, ClusterShard,
    ClusterStart, ClusterStream, ClusterSubscribe, ClusterView,
};
pub use crate::config::{
    ACCESS_CACHE_ENTRIES_MAX, ConnectionId, CoreConfig, DELIVERY_BYTES_MAX, DELIVERY_RECORDS_MAX,
    HELLO_SHARD_MAP_FRAME_SHARE, INGRESS_EXHAUSTED_MESSAGE, IngressSettings, Now,
    REMOTE_DELIVERY_CREDITS, StreamId,
};
pub use crate::core::{CatalogWrite, Core, Event, Flow, Transmit};
pub use crate::counters::CoreCounters;
pub use crate::driver::{DRAIN_ROUNDS_MAX, Effects};
pub use crate::durable::{DurableLog, DurableSettings, PumpReport, RecoverySummary, log_dir};
pub use crate::message::{AdminRequest, CoreMessage};
pub use crate::producer::{PRODUCERS_PER_SHARD_MAX, ProducerTag, WINDOW as PRODUCER_WINDOW};
pub use crate::security::{AuthRefusal, ConnectionLimits, Limit, OPERATIONS, Security, TokenCheck};
pub use felix_auth::Principal;
