//! The configuration as the broker applies it: the core plan, the durable settings, the MTU
//! bound, the engine and ingress settings. A bad value is an error naming its variable.

use felix_affinity::{CorePlan, CpuSelection, PlanOptions, Topology};
use felix_core::{DurableSettings, IngressSettings};
use felix_engine::EngineConfig;
use felix_tuning::Config;
use felix_wire::Limits;

use crate::BrokerError;

/// The largest QUIC MTU the broker uses: s2n-quic corrupts memory with GSO above 32768
/// (docs/design/machine.md, UDP and QUIC), and 16384 measured fastest below that bound.
pub const MTU_UPPER_BOUND_CLAMP: u16 = 16_384;
/// The smallest: QUIC requires 1200-byte datagrams on every path (RFC 9000 section 14).
pub const MTU_UPPER_BOUND_MIN: u16 = 1200;

/// Parses FELIX_DATAPLANE_CORES and FELIX_QUIC_LISTENERS (`auto` = the plan's default).
pub fn plan_options(config: &Config) -> Result<PlanOptions, BrokerError> {
    let dataplane_cores = match config.dataplane_cores.trim() {
        "auto" => None,
        text => Some(CpuSelection::parse(text)?),
    };
    let quic_listeners = match config.quic_listeners.trim() {
        "auto" => None,
        text => Some(text.parse::<u32>().map_err(|error| BrokerError::Setting {
            env: "FELIX_QUIC_LISTENERS",
            value: text.to_owned(),
            reason: format!("expected auto or a whole number: {error}"),
        })?),
    };
    Ok(PlanOptions {
        dataplane_cores,
        quic_listeners,
        base_port: config.bind.port(),
    })
}

/// Detects the topology and builds the core plan from the configuration.
pub fn core_plan(config: &Config) -> Result<CorePlan, BrokerError> {
    let topology = Topology::detect()?;
    Ok(CorePlan::new(&topology, &plan_options(config)?)?)
}

/// The durable settings (FELIX_DURABLE_*, FELIX_STORAGE_IO_URING) as the logs use them.
pub fn durable_settings(config: &Config) -> Result<DurableSettings, BrokerError> {
    let fsync = match config.durable_fsync_mode.as_str() {
        "on_commit" => felix_storage::FsyncMode::OnCommit,
        "periodic" => felix_storage::FsyncMode::Periodic {
            interval: std::time::Duration::from_millis(config.durable_fsync_interval_ms),
        },
        other => {
            return Err(BrokerError::Setting {
                env: "FELIX_DURABLE_FSYNC_MODE",
                value: other.to_owned(),
                reason: "expected periodic or on_commit".to_owned(),
            });
        }
    };
    Ok(DurableSettings {
        fsync,
        backend: if config.storage_io_uring {
            felix_storage::BackendChoice::IoUring
        } else {
            felix_storage::BackendChoice::Pwrite
        },
        segment_bytes: config.durable_segment_bytes,
        retention_bytes: (config.durable_retention_bytes > 0)
            .then_some(config.durable_retention_bytes),
        retention_age: (config.durable_retention_seconds > 0)
            .then(|| std::time::Duration::from_secs(config.durable_retention_seconds)),
    })
}

/// FELIX_MTU_UPPER_BOUND as the broker applies it: below 1200 is an error, above 16384 is
/// clamped with a warning.
pub fn effective_mtu(config: &Config) -> Result<u16, BrokerError> {
    let requested = config.mtu_upper_bound;
    if requested < u64::from(MTU_UPPER_BOUND_MIN) {
        return Err(BrokerError::Setting {
            env: "FELIX_MTU_UPPER_BOUND",
            value: requested.to_string(),
            reason: format!("QUIC needs at least {MTU_UPPER_BOUND_MIN}"),
        });
    }
    if requested > u64::from(MTU_UPPER_BOUND_CLAMP) {
        tracing::warn!(
            requested,
            clamped = MTU_UPPER_BOUND_CLAMP,
            "FELIX_MTU_UPPER_BOUND={requested} clamped to {MTU_UPPER_BOUND_CLAMP}: s2n-quic corrupts memory with GSO above 32768"
        );
        return Ok(MTU_UPPER_BOUND_CLAMP);
    }
    // Checked against the u16 clamp just above.
    Ok(u16::try_from(requested).unwrap_or(MTU_UPPER_BOUND_CLAMP))
}

/// The frame limits the decoders enforce and `HelloOk` announces.
#[must_use]
pub fn limits(config: &Config) -> Limits {
    Limits {
        max_frame_bytes: config.max_frame_bytes,
        max_batch_records: config.max_batch_records,
        ..Limits::DEFAULT
    }
}

/// Each core engine's bounds.
#[must_use]
pub fn engine_config(config: &Config) -> EngineConfig {
    let limits = limits(config);
    EngineConfig {
        // The tuning crate bounds this to 16,777,216, which fits any usize we run on.
        ring_max_records: usize::try_from(config.replay_ring_max_records).unwrap_or(usize::MAX),
        ring_max_bytes: config.replay_ring_max_bytes,
        subscriber_queue_max_bytes: config.subscriber_queue_max_bytes,
        max_shards: limits.max_shards,
        max_name_bytes: limits.max_name_bytes,
    }
}

/// Each core's ingress queue (docs/semantics.md, 3 Publishing).
#[must_use]
pub fn ingress_settings(config: &Config) -> IngressSettings {
    IngressSettings {
        depth: config.ingress_queue_depth,
        budget_bytes: config.ingress_byte_budget,
        fire_and_forget_waits: config.pub_ingress_wait,
        ack_on_commit: config.ack_on_commit,
        commit_wait: std::time::Duration::from_millis(config.publish_queue_wait_ms),
    }
}
