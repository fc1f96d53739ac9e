//! The core plan: which CPUs run data-plane loops, how many QUIC endpoints each has and on
//! which ports, which CPU takes housekeeping and IRQs, and how shards map to cores.

use std::fmt::Write as _;
use std::str::FromStr;

use crate::cpulist::{CPU_INDEX_MAX, format_cpu_list, parse_cpu_list};
use crate::{AffinityError, Cpu, Topology};

/// With fewer usable CPUs than this, every CPU runs a data-plane loop and housekeeping shares
/// data-plane core 0. Giving one CPU away on a 2- or 3-CPU machine would cost a third to a
/// half of the data plane for work (timers, metrics, admin, IRQs) that is mostly idle.
pub const HOUSEKEEPING_RESERVE_CPUS_MIN: usize = 4;

/// Most QUIC endpoints one data-plane core may run (FELIX_QUIC_LISTENERS / cores, rounded up).
///
/// Each endpoint is one UDP socket and one s2n-quic endpoint driven by the same single
/// thread; past a few, more endpoints only add polling work. 8 leaves room to experiment
/// while refusing values that are surely typos (e.g. 64 listeners on 2 cores).
pub const LISTENERS_PER_CORE_MAX: u32 = 8;

/// Largest port number.
const PORT_MAX: u32 = u16::MAX as u32;

/// Which CPUs run data-plane loops (the value of FELIX_DATAPLANE_CORES).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpuSelection {
    /// `N`: the first N CPUs in the default order (the default data-plane CPUs, then the CPU
    /// that would have been reserved for housekeeping), placed in ascending CPU order.
    /// Always >= 1.
    Count(u32),
    /// A CPU list such as `0,2-3` (a single CPU is written `3-3`, since a bare number is a
    /// count). Ascending, no duplicates, never empty.
    List(Vec<usize>),
}

impl CpuSelection {
    /// Parses FELIX_DATAPLANE_CORES: a bare number is a count, anything else a CPU list.
    pub fn parse(text: &str) -> Result<CpuSelection, AffinityError> {
        let invalid = |reason: String| AffinityError::InvalidCpuSelection {
            value: text.to_string(),
            reason,
        };
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(invalid(
                "empty; give a core count (e.g. 2) or a CPU list (e.g. 0,2-3)".to_string(),
            ));
        }
        if trimmed.bytes().all(|b| b.is_ascii_digit()) {
            let count_max = CPU_INDEX_MAX + 1;
            return match trimmed.parse::<u32>() {
                Ok(0) => Err(invalid("the core count must be at least 1".to_string())),
                Ok(count) if count as usize <= count_max => Ok(CpuSelection::Count(count)),
                _ => Err(invalid(format!("the core count is above {count_max}"))),
            };
        }
        let cpus = parse_cpu_list(trimmed).map_err(invalid)?;
        debug_assert!(
            !cpus.is_empty(),
            "a non-empty, non-numeric list has a CPU or fails"
        );
        Ok(CpuSelection::List(cpus))
    }
}

impl FromStr for CpuSelection {
    type Err = AffinityError;

    fn from_str(text: &str) -> Result<CpuSelection, AffinityError> {
        CpuSelection::parse(text)
    }
}

/// Inputs to [`CorePlan::new`], already parsed from configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanOptions {
    /// FELIX_DATAPLANE_CORES; `None` for the default (see [`CorePlan::new`]).
    pub dataplane_cores: Option<CpuSelection>,
    /// FELIX_QUIC_LISTENERS, total endpoints; `None` for one per data-plane core.
    pub quic_listeners: Option<u32>,
    /// The shared SO_REUSEPORT port; core i's own port is `base_port + 1 + i`. 0 asks the OS
    /// for every port at bind time (tests).
    pub base_port: u16,
}

/// One data-plane core in the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataplaneCore {
    /// Position in the plan, 0-based: the value [`CorePlan::shard_core`] returns.
    pub index: u16,
    /// The CPU its thread is pinned to.
    pub cpu: Cpu,
    /// QUIC endpoints it runs on the shared port (may be 0 when there are fewer listeners
    /// than cores).
    pub listeners: u32,
    /// Its own port (core-aware clients reach its shards there directly); 0 when the base
    /// port is 0 and the port is assigned at bind time.
    pub own_port: u16,
}

/// The core plan: built once at start-up, read by the broker, printed at start-up and by
/// `felix config`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorePlan {
    topology: Topology,
    cores: Vec<DataplaneCore>,
    housekeeping_cpu: usize,
    housekeeping_shared: bool,
    shared_port: u16,
    listeners: u32,
}

impl CorePlan {
    /// Builds the plan.
    ///
    /// Default data-plane CPUs: all usable CPUs when there are fewer than
    /// [`HOUSEKEEPING_RESERVE_CPUS_MIN`], otherwise all but the first CPU of the
    /// lowest-numbered package (package 0 on any ordinary machine), which is kept for
    /// housekeeping and IRQs. `options.dataplane_cores` overrides that; a listed CPU missing
    /// from `topology` (offline, or outside the affinity mask) is an error naming it.
    /// Housekeeping goes to the reserved CPU if unused, else the lowest unused CPU, else it
    /// shares data-plane core 0. Data-plane cores are numbered in ascending CPU order.
    pub fn new(topology: &Topology, options: &PlanOptions) -> Result<CorePlan, AffinityError> {
        assert!(!topology.cpus.is_empty(), "a Topology is never empty");
        let reserved = reserved_cpu(topology);
        let default_order: Vec<Cpu> = {
            let mut order: Vec<Cpu> = topology
                .cpus
                .iter()
                .filter(|cpu| Some(cpu.os_index) != reserved)
                .copied()
                .collect();
            order.extend(reserved.and_then(|r| topology.cpu(r)).copied());
            order
        };
        let dataplane: Vec<Cpu> = match &options.dataplane_cores {
            None => {
                let keep = default_order.len() - usize::from(reserved.is_some());
                default_order[..keep].to_vec()
            }
            Some(CpuSelection::Count(count)) => {
                if *count == 0 {
                    return Err(AffinityError::InvalidCpuSelection {
                        value: "0".to_string(),
                        reason: "the core count must be at least 1".to_string(),
                    });
                }
                let Some(cpus) = default_order.get(..*count as usize) else {
                    return Err(AffinityError::TooManyCores {
                        requested: *count,
                        usable: default_order.len(),
                    });
                };
                cpus.to_vec()
            }
            Some(CpuSelection::List(list)) => {
                let mut cpus = Vec::with_capacity(list.len());
                for &os_index in list {
                    let cpu =
                        topology
                            .cpu(os_index)
                            .ok_or_else(|| AffinityError::CpuNotAvailable {
                                cpu: os_index,
                                usable: format_cpu_list(&topology.os_indices()),
                            })?;
                    cpus.push(*cpu);
                }
                cpus
            }
        };
        // Plan order is ascending CPU order whatever the selection, so a count that takes the
        // reserved CPU too puts it at core 0, where housekeeping shares a core.
        let mut dataplane = dataplane;
        dataplane.sort_unstable_by_key(|cpu| cpu.os_index);
        // A List built by hand (not parsed) may repeat a CPU; one loop per CPU.
        dataplane.dedup_by_key(|cpu| cpu.os_index);
        assert!(
            !dataplane.is_empty(),
            "every branch yields at least one CPU"
        );
        assert!(
            dataplane.len() <= CPU_INDEX_MAX + 1,
            "core indices fit in u16"
        );

        let is_dataplane = |os_index: usize| dataplane.iter().any(|c| c.os_index == os_index);
        let (housekeeping_cpu, housekeeping_shared) = match reserved {
            Some(cpu) if !is_dataplane(cpu) => (cpu, false),
            _ => match topology.cpus.iter().find(|c| !is_dataplane(c.os_index)) {
                Some(unused) => (unused.os_index, false),
                None => (dataplane[0].os_index, true),
            },
        };

        let core_count = dataplane.len();
        let listeners = options.quic_listeners.unwrap_or(core_count as u32);
        if listeners == 0 {
            return Err(AffinityError::NoListeners);
        }
        let per_core_max = listeners.div_ceil(core_count as u32);
        if per_core_max > LISTENERS_PER_CORE_MAX {
            return Err(AffinityError::TooManyListeners {
                listeners,
                cores: core_count,
                per_core: per_core_max,
                max: LISTENERS_PER_CORE_MAX,
            });
        }

        let last_own_port = u32::from(options.base_port) + core_count as u32;
        if options.base_port != 0 && last_own_port > PORT_MAX {
            return Err(AffinityError::PortOverflow {
                base_port: options.base_port,
                cores: core_count,
                last_port: last_own_port,
            });
        }

        let cores: Vec<DataplaneCore> = dataplane
            .iter()
            .enumerate()
            .map(|(i, cpu)| {
                // Round-robin: listener j goes to core j % core_count.
                let extra = u32::from((i as u32) < listeners % core_count as u32);
                let own_port = if options.base_port == 0 {
                    0
                } else {
                    // Checked above: base_port + core_count <= 65535 and i < core_count.
                    options.base_port + 1 + i as u16
                };
                DataplaneCore {
                    index: i as u16,
                    cpu: *cpu,
                    listeners: listeners / core_count as u32 + extra,
                    own_port,
                }
            })
            .collect();
        debug_assert_eq!(cores.iter().map(|c| c.listeners).sum::<u32>(), listeners);

        Ok(CorePlan {
            topology: topology.clone(),
            cores,
            housekeeping_cpu,
            housekeeping_shared,
            shared_port: options.base_port,
            listeners,
        })
    }

    /// The topology the plan was built from.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The data-plane cores in plan order (index 0 first); never empty.
    pub fn cores(&self) -> &[DataplaneCore] {
        &self.cores
    }

    /// How many data-plane cores there are (>= 1).
    pub fn core_count(&self) -> u16 {
        // new() asserts the count fits: at most CPU_INDEX_MAX + 1 = 1024 cores.
        self.cores.len() as u16
    }

    /// The CPU for housekeeping and IRQs.
    pub fn housekeeping_cpu(&self) -> usize {
        self.housekeeping_cpu
    }

    /// True when the housekeeping CPU is also data-plane core 0's CPU.
    pub fn housekeeping_shared(&self) -> bool {
        self.housekeeping_shared
    }

    /// The shared SO_REUSEPORT port (the base port; 0 = assigned at bind time).
    pub fn shared_port(&self) -> u16 {
        self.shared_port
    }

    /// Total QUIC endpoints on the shared port, over all cores.
    pub fn listener_count(&self) -> u32 {
        self.listeners
    }

    /// The data-plane core index that owns `shard`: `shard % core_count`.
    pub fn shard_core(&self, shard: u32) -> u16 {
        shard_core(shard, self.core_count())
    }

    /// The owning core index of each shard `0..shard_count`.
    pub fn cores_for_shards(&self, shard_count: u32) -> Vec<u16> {
        (0..shard_count)
            .map(|shard| self.shard_core(shard))
            .collect()
    }

    /// Multi-line description for the start-up log and `felix config`; ends with a newline.
    pub fn render(&self) -> String {
        let t = &self.topology;
        let mut out = String::new();
        // Writing to a String cannot fail; the results are ignored on purpose.
        let _ = writeln!(out, "core plan (topology from {})", t.source);
        let _ = writeln!(
            out,
            "  usable CPUs: {} ({}, {}, {}, {})",
            format_cpu_list(&t.os_indices()),
            counted(t.cpus.len(), "CPU"),
            counted(t.core_count(), "core"),
            counted(t.package_count(), "package"),
            counted(t.numa_node_count(), "NUMA node"),
        );
        let housekeeping_note = if self.housekeeping_shared {
            "shared with data-plane core 0"
        } else {
            "not a data-plane core"
        };
        let _ = writeln!(
            out,
            "  housekeeping and IRQs: cpu {} ({housekeeping_note})",
            self.housekeeping_cpu
        );
        if self.shared_port == 0 {
            let _ = writeln!(out, "  shared port (SO_REUSEPORT): assigned at bind time");
        } else {
            let _ = writeln!(out, "  shared port (SO_REUSEPORT): {}", self.shared_port);
        }
        let _ = writeln!(
            out,
            "  data-plane cores: {}, QUIC listeners on the shared port: {}",
            self.cores.len(),
            self.listeners
        );
        for core in &self.cores {
            let own_port = if core.own_port == 0 {
                "assigned at bind time".to_string()
            } else {
                core.own_port.to_string()
            };
            let _ = writeln!(
                out,
                "    core {}: cpu {} (package {}, NUMA node {}), listeners {}, own port {}",
                core.index,
                core.cpu.os_index,
                core.cpu.package,
                core.cpu.numa_node,
                core.listeners,
                own_port
            );
        }
        let _ = writeln!(
            out,
            "  shards: shard s is owned by data-plane core s % {}",
            self.cores.len()
        );
        out
    }
}

/// The data-plane core index that owns `shard` among `core_count` cores: `shard % core_count`.
///
/// Pure, so clients and every core compute the same owner. `core_count` must be >= 1.
pub fn shard_core(shard: u32, core_count: u16) -> u16 {
    assert!(
        core_count > 0,
        "a core plan has at least one data-plane core"
    );
    // The remainder is below core_count, so it fits in u16.
    (shard % u32::from(core_count)) as u16
}

/// `1 package`, `2 packages`.
fn counted(count: usize, noun: &str) -> String {
    let plural = if count == 1 { "" } else { "s" };
    format!("{count} {noun}{plural}")
}

/// The CPU kept for housekeeping by default: the first CPU of the lowest-numbered package,
/// or none when there are too few CPUs to give one away.
fn reserved_cpu(topology: &Topology) -> Option<usize> {
    if topology.cpus.len() < HOUSEKEEPING_RESERVE_CPUS_MIN {
        return None;
    }
    // cpus is ascending by os_index, so min_by_key keeps the first CPU of the lowest package.
    topology
        .cpus
        .iter()
        .min_by_key(|cpu| cpu.package)
        .map(|cpu| cpu.os_index)
}
