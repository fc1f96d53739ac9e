//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong reading the topology, building the core plan, pinning a
/// thread or reading a thread's CPU time.
///
/// Messages that come from FELIX_DATAPLANE_CORES or FELIX_QUIC_LISTENERS name the variable,
/// so start-up can stop with the message as it is.
#[derive(Debug, thiserror::Error)]
pub enum AffinityError {
    /// hwloc could not load the topology, or gave one without the facts we need.
    #[error("hwloc topology: {0}")]
    Hwloc(String),

    /// A sysfs or procfs file could not be read.
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A sysfs or procfs file held something we could not parse.
    #[error("parsing {path}: {detail}")]
    Parse { path: PathBuf, detail: String },

    /// After restricting to the CPUs this process may run on, no CPU was left.
    #[error(
        "no usable CPU: the topology ({topology}) and the allowed CPUs ({allowed}) do not overlap"
    )]
    NoCpus { topology: String, allowed: String },

    /// FELIX_DATAPLANE_CORES is not a count or a CPU list.
    #[error("FELIX_DATAPLANE_CORES={value:?}: {reason}")]
    InvalidCpuSelection { value: String, reason: String },

    /// FELIX_DATAPLANE_CORES names a CPU this process may not run on.
    #[error(
        "FELIX_DATAPLANE_CORES: CPU {cpu} is not in the topology or this process's affinity mask (usable CPUs: {usable})"
    )]
    CpuNotAvailable { cpu: usize, usable: String },

    /// FELIX_DATAPLANE_CORES asks for more cores than there are usable CPUs.
    #[error("FELIX_DATAPLANE_CORES={requested}: only {usable} CPUs are usable")]
    TooManyCores { requested: u32, usable: usize },

    /// FELIX_QUIC_LISTENERS is 0.
    #[error("FELIX_QUIC_LISTENERS must be at least 1")]
    NoListeners,

    /// FELIX_QUIC_LISTENERS would put more endpoints on one core than the bound allows.
    #[error(
        "FELIX_QUIC_LISTENERS={listeners} over {cores} data-plane cores puts {per_core} on one core; at most {max} per core"
    )]
    TooManyListeners {
        listeners: u32,
        cores: usize,
        per_core: u32,
        max: u32,
    },

    /// A data-plane core's own port would be above 65535.
    #[error(
        "base port {base_port} with {cores} data-plane cores needs own ports up to {last_port}, above 65535"
    )]
    PortOverflow {
        base_port: u16,
        cores: usize,
        last_port: u32,
    },

    /// A CPU index is beyond what an affinity mask can hold.
    #[error("CPU {cpu} is beyond the largest CPU index an affinity mask holds ({max})")]
    CpuIndexOutOfRange { cpu: usize, max: usize },

    /// A system call failed.
    #[error("{call}")]
    Syscall {
        call: &'static str,
        #[source]
        source: nix::Error,
    },
}
