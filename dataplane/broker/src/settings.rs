//! The configuration as the broker applies it: the core plan, the durable settings, the MTU
//! bound, the engine and ingress settings. A bad value is an error naming its variable.

use felix_affinity::{CorePlan, CpuSelection, PlanOptions, Topology};
use felix_core::{ConnectionLimits, DurableSettings, IngressSettings, Security};
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

/// The durable settings (FELIX_DURABLE_*, FELIX_STORAGE_IO_URING, FELIX_STORAGE_DIRECT_IO,
/// FELIX_STORAGE_ROUNDS_IN_FLIGHT) as the logs use them.
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
        direct_io: config.storage_direct_io,
        // 1..=2, checked by the settings table (tuning/src/settings.rs).
        rounds_in_flight: usize::try_from(config.storage_rounds_in_flight).unwrap_or(1),
        segment_bytes: config.durable_segment_bytes,
        retention_bytes: (config.durable_retention_bytes > 0)
            .then_some(config.durable_retention_bytes),
        retention_age: (config.durable_retention_seconds > 0)
            .then(|| std::time::Duration::from_secs(config.durable_retention_seconds)),
    })
}

/// The smallest segment [`fit_segments`] picks when the disk is short: 16 MiB still holds
/// four rounds of the log's 4 MiB maximum.
const FITTED_SEGMENT_BYTES_MIN: u64 = 16 << 20;

/// Free space each core's log may take in preallocated segments at the fitted size: four
/// segments per core, so a core can roll (and retention delete) before the disk is full.
const FITTED_SEGMENTS_PER_CORE: u64 = 4;

/// The segment size to preallocate given `free_bytes` on the data volume and `cores` logs:
/// the configured size when four segments per core fit, else the largest power of two that
/// does (at least 16 MiB, never above the configured size).
#[must_use]
pub fn fitted_segment_bytes(configured: u64, free_bytes: u64, cores: usize) -> u64 {
    let budget = free_bytes / (FITTED_SEGMENTS_PER_CORE * cores.max(1) as u64);
    if budget >= configured {
        return configured;
    }
    let power_of_two = if budget == 0 {
        0
    } else {
        1u64 << budget.ilog2()
    };
    power_of_two.max(FITTED_SEGMENT_BYTES_MIN).min(configured)
}

/// Fits `durable.segment_bytes` to the data volume's free space (see
/// [`fitted_segment_bytes`]) and says what it chose in the start-up log. Logs are created
/// lazily (a core's first segment when its first durable shard lands), so nothing is
/// preallocated here.
pub fn fit_segments(durable: &mut DurableSettings, data_dir: &std::path::Path, cores: usize) {
    let configured = durable.segment_bytes;
    match felix_tuning::preflight::free_space_bytes(data_dir) {
        Ok(free) => {
            let fitted = fitted_segment_bytes(configured, free, cores);
            durable.segment_bytes = fitted;
            if fitted < configured {
                tracing::warn!(
                    segment_bytes = fitted,
                    configured = configured,
                    free_bytes = free,
                    cores,
                    dir = %data_dir.display(),
                    "durable log segments smaller than FELIX_DURABLE_SEGMENT_BYTES: the data volume has room for fewer than 4 per core"
                );
            } else {
                tracing::info!(
                    segment_bytes = fitted,
                    free_bytes = free,
                    cores,
                    dir = %data_dir.display(),
                    "durable log segments (created when a core gets its first durable shard)"
                );
            }
        }
        Err(error) => tracing::warn!(
            %error,
            dir = %data_dir.display(),
            segment_bytes = configured,
            "cannot read the data volume's free space; keeping FELIX_DURABLE_SEGMENT_BYTES"
        ),
    }
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
        max_payload_bytes: config.max_payload_bytes,
        max_key_bytes: config.max_key_bytes,
        max_shards: config.max_shards_per_stream,
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
        max_streams: config.max_streams,
    }
}

/// What every core enforces: FELIX_AUTH, FELIX_RULES (parsed here: a syntax error names the
/// variable) and the connection limits. FELIX_AUTH=required with neither FELIX_CLIENT_CA nor
/// FELIX_TOKENS_FILE would refuse every client: refused too.
pub fn security(config: &Config) -> Result<Security, BrokerError> {
    let auth_required = match config.auth.as_str() {
        "off" => false,
        "required" => true,
        other => {
            return Err(BrokerError::Setting {
                env: "FELIX_AUTH",
                value: other.to_owned(),
                reason: "expected off or required".to_owned(),
            });
        }
    };
    if auth_required && config.client_ca.is_none() && config.tokens_file.is_none() {
        return Err(BrokerError::Setting {
            env: "FELIX_AUTH",
            value: config.auth.clone(),
            reason: "no client could authenticate: set FELIX_CLIENT_CA (client certificates) \
                     or FELIX_TOKENS_FILE (bearer tokens), or both"
                .to_owned(),
        });
    }
    let rules = felix_auth::Rules::parse(&config.rules).map_err(|error| BrokerError::Setting {
        env: "FELIX_RULES",
        value: config.rules.clone(),
        reason: error.to_string(),
    })?;
    let limits = ConnectionLimits {
        connections_per_core: config.max_connections_per_core,
        connections_per_principal: config.max_connections_per_principal,
        streams_per_connection: config.max_streams_per_connection,
        subscriptions_per_connection: config.max_subscriptions_per_connection,
    };
    Ok(Security::new(
        auth_required,
        felix_auth::Policy::from_rules(rules),
        limits,
    ))
}

/// The limits of the connections' first moments and of QUIC itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionSettings {
    /// FELIX_HELLO_TIMEOUT_MS: time to get the handshake answered.
    pub hello_timeout: std::time::Duration,
    /// FELIX_HELLO_MAX_BYTES: the frame bound on the hello stream until `HelloOk`.
    pub hello_max_bytes: u32,
    /// FELIX_IDLE_TIMEOUT_MS: the QUIC idle timeout.
    pub idle_timeout: std::time::Duration,
    /// QUIC's own bound on open client streams: FELIX_MAX_STREAMS_PER_CONNECTION plus
    /// [`STREAMS_REFUSED_SLACK`], so that the broker can answer the streams beyond the limit
    /// with `LimitExceeded` instead of leaving the client blocked without a word.
    pub quic_streams_max: u64,
}

/// Streams QUIC lets a client open beyond FELIX_MAX_STREAMS_PER_CONNECTION: each is answered
/// `LimitExceeded` and finished at once; past these, QUIC flow control stops the client.
pub const STREAMS_REFUSED_SLACK: u64 = 8;

#[must_use]
pub fn connection_settings(config: &Config) -> ConnectionSettings {
    ConnectionSettings {
        hello_timeout: std::time::Duration::from_millis(config.hello_timeout_ms),
        hello_max_bytes: config.hello_max_bytes,
        idle_timeout: std::time::Duration::from_millis(config.idle_timeout_ms),
        quic_streams_max: u64::from(config.max_streams_per_connection) + STREAMS_REFUSED_SLACK,
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

#[cfg(test)]
mod tests {
    use super::fitted_segment_bytes;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn segments_fit_the_free_space() {
        // Room for four 1 GiB segments per core: the configured size.
        assert_eq!(fitted_segment_bytes(GIB, 8 * GIB, 2), GIB);
        // A laptop with 3 GiB free and 2 cores: 3 GiB / 8 = 384 MiB -> 256 MiB.
        assert_eq!(fitted_segment_bytes(GIB, 3 * GIB, 2), 256 * MIB);
        // Almost full: never below 16 MiB.
        assert_eq!(fitted_segment_bytes(GIB, 10 * MIB, 4), 16 * MIB);
        assert_eq!(fitted_segment_bytes(GIB, 0, 1), 16 * MIB);
        // Never above what was configured, even when that is below the floor.
        assert_eq!(fitted_segment_bytes(64 << 10, 0, 1), 64 << 10);
    }
}
