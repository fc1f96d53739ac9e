//! felix-campaign: robustness campaigns against the real `felix` binary over loopback.
//!
//! This crate owns:
//! - [`crash`]: the SIGKILL crash campaign (`felix-crash-campaign`, `make crash-campaign`):
//!   durable on_commit streams under acked load, the broker killed at random moments and
//!   restarted on the same data directory, an audit of every acknowledged and every delivered
//!   record after each restart;
//! - [`soak`]: the soak (`felix-soak`, `make soak`): a mixed workload against one broker for a
//!   fixed time, with resident-memory, durability, ordering and error checks;
//! - [`smallfs`]: a small real file system (size-limited tmpfs, else a loop-mounted ext4 image)
//!   for the ENOSPC test (`dataplane/felix/tests/enospc.rs`);
//! - the pieces they share: [`broker`] (a `felix broker` child process on ephemeral loopback
//!   ports) and [`record`] (self-describing records that can be checked byte for byte).
//!
//! Every run is bounded in count and time and stops by itself; brokers bind 127.0.0.1 port 0
//! and get fresh temporary data directories. What the campaigns prove and their figures:
//! docs/reliability.md.

pub mod broker;
pub mod crash;
mod error;
pub mod record;
pub mod smallfs;
pub mod soak;

pub use error::CampaignError;
