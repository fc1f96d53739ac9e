//! Topology and the core plan: which CPU runs what, and pinning threads to it.
//!
//! Felix runs one pinned thread per data-plane core (docs/semantics.md, 1 Shape; the plan's
//! decisions are in docs/design/per-core.md). This crate owns:
//!
//! - **the topology** ([`Topology`]): the CPUs this process may run on, with core, package and
//!   NUMA node, read with hwloc ([`Topology::detect`]) or, when hwloc fails, from sysfs; a fake
//!   sysfs tree can be read with [`Topology::from_sysfs_root`];
//! - **the core plan** ([`CorePlan`]): the data-plane CPUs (FELIX_DATAPLANE_CORES, parsed by
//!   [`CpuSelection::parse`]), the housekeeping/IRQ CPU, QUIC listeners per core
//!   (FELIX_QUIC_LISTENERS), each core's own port, the shard -> core rule ([`shard_core`]),
//!   and its text for start-up logs and `felix config` ([`CorePlan::render`]);
//! - **pinning and per-thread CPU time**: [`pin_current_thread`],
//!   [`current_thread_allowed_cpus`], [`thread_cpu_seconds`], [`thread_cpu_seconds_of`].
//!
//! It depends on no other Felix crate and holds no state of its own.
//!
//! ## Threads
//!
//! - Topology detection ([`Topology::detect`] and friends) restricts to the **calling
//!   thread's** affinity mask: call it once at start-up on the main thread, before any pinning.
//!   Detection reads much of /sys: never call it on a data-plane core's loop.
//! - [`CorePlan`] and [`CpuSelection`] are plain values: any thread, `Send + Sync`; the broker
//!   builds the plan on the main thread and copies what each core needs.
//! - [`pin_current_thread`], [`current_thread_allowed_cpus`] and [`thread_cpu_seconds`] act on
//!   the calling thread: a data-plane thread pins itself first thing, then records
//!   [`Tid::current`]. [`thread_cpu_seconds_of`] reads any thread of this process by tid and
//!   is meant for the housekeeping/metrics thread.

#![forbid(unsafe_code)]

mod cpulist;
mod error;
mod plan;
mod thread;
mod topology;

pub use cpulist::{CPU_INDEX_MAX, format_cpu_list, parse_cpu_list};
pub use error::AffinityError;
pub use plan::{
    CorePlan, CpuSelection, DataplaneCore, HOUSEKEEPING_RESERVE_CPUS_MIN, LISTENERS_PER_CORE_MAX,
    PlanOptions, shard_core,
};
pub use thread::{
    Tid, current_thread_allowed_cpus, pin_current_thread, thread_cpu_seconds, thread_cpu_seconds_of,
};
pub use topology::{Cpu, Topology, TopologySource};
