//! Which CPUs exist, how they group into cores, packages and NUMA nodes, and which of them
//! this process may run on.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use crate::cpulist::{CPU_INDEX_MAX, format_cpu_list, parse_cpu_list};
use crate::{AffinityError, current_thread_allowed_cpus};

/// Where the machine's sysfs is mounted.
const SYSFS_ROOT: &str = "/sys";

/// How a [`Topology`] was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologySource {
    /// The hwloc library (through `hwlocality`): the normal case.
    Hwloc,
    /// Files under /sys/devices/system: used when hwloc fails, and by tests.
    Sysfs,
}

impl fmt::Display for TopologySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TopologySource::Hwloc => "hwloc",
            TopologySource::Sysfs => "sysfs",
        })
    }
}

/// One logical CPU (an hwloc PU; a Linux "cpuN").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cpu {
    /// The OS's CPU number, as used by `sched_setaffinity` and /sys/devices/system/cpu/cpuN.
    pub os_index: usize,
    /// The physical core within its package (sysfs `core_id`); SMT siblings share it.
    pub core_id: usize,
    /// The physical package (socket) (sysfs `physical_package_id`).
    pub package: usize,
    /// The NUMA node whose CPU list holds this CPU; 0 when the kernel has no NUMA nodes.
    pub numa_node: usize,
}

/// The CPUs this process may run on, in ascending `os_index` order.
///
/// Read once at start-up, on a thread that has not been pinned yet (the main thread): the
/// restriction uses the calling thread's affinity mask.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Usable CPUs, ascending by `os_index`; never empty.
    pub cpus: Vec<Cpu>,
    /// How the topology was read.
    pub source: TopologySource,
}

impl Topology {
    /// Reads the topology with hwloc, or from sysfs when hwloc fails, restricted to the CPUs
    /// the calling thread may run on.
    pub fn detect() -> Result<Topology, AffinityError> {
        Topology::detect_reporting().map(|(topology, _)| topology)
    }

    /// Like [`Topology::detect`], also returning why hwloc was not used (for the start-up log)
    /// when the sysfs fallback was taken.
    pub fn detect_reporting() -> Result<(Topology, Option<AffinityError>), AffinityError> {
        match Topology::detect_hwloc() {
            Ok(topology) => Ok((topology, None)),
            Err(hwloc_error) => Ok((Topology::detect_sysfs()?, Some(hwloc_error))),
        }
    }

    /// Reads the topology with hwloc only, restricted to the calling thread's allowed CPUs.
    pub fn detect_hwloc() -> Result<Topology, AffinityError> {
        let topology = Topology {
            cpus: read_hwloc()?,
            source: TopologySource::Hwloc,
        };
        topology.restricted_to(&current_thread_allowed_cpus()?)
    }

    /// Reads the topology from /sys only, restricted to the calling thread's allowed CPUs.
    pub fn detect_sysfs() -> Result<Topology, AffinityError> {
        Topology::from_sysfs_root(Path::new(SYSFS_ROOT))?
            .restricted_to(&current_thread_allowed_cpus()?)
    }

    /// Reads every online CPU from a sysfs tree rooted at `root` (the real one is `/sys`; tests
    /// pass a fake tree), with no affinity restriction.
    ///
    /// Reads `devices/system/cpu/online`, each `devices/system/cpu/cpuN/topology/{core_id,
    /// physical_package_id}`, and `devices/system/node/nodeK/cpulist` when that folder exists.
    pub fn from_sysfs_root(root: &Path) -> Result<Topology, AffinityError> {
        let cpu_dir = root.join("devices/system/cpu");
        let online_path = cpu_dir.join("online");
        let online =
            parse_cpu_list(&read_text(&online_path)?).map_err(|detail| AffinityError::Parse {
                path: online_path.clone(),
                detail,
            })?;
        if online.is_empty() {
            return Err(AffinityError::Parse {
                path: online_path,
                detail: "no CPU is online".to_string(),
            });
        }
        let numa_of_cpu = read_sysfs_numa(&root.join("devices/system/node"))?;
        let mut cpus = Vec::with_capacity(online.len());
        for os_index in online {
            let topology_dir = cpu_dir.join(format!("cpu{os_index}/topology"));
            // The kernel writes -1 when the platform does not say (some VMs, some arches):
            // then the CPU is its own core, and every such CPU is in package 0.
            let core_id = read_sysfs_id(&topology_dir.join("core_id"))?.unwrap_or(os_index);
            let package = read_sysfs_id(&topology_dir.join("physical_package_id"))?.unwrap_or(0);
            cpus.push(Cpu {
                os_index,
                core_id,
                package,
                numa_node: numa_of_cpu.get(&os_index).copied().unwrap_or(0),
            });
        }
        Ok(Topology {
            cpus,
            source: TopologySource::Sysfs,
        })
    }

    /// Keeps only the CPUs in `allowed`; an error if none is left.
    pub fn restricted_to(mut self, allowed: &[usize]) -> Result<Topology, AffinityError> {
        let before = self.os_indices();
        self.cpus.retain(|cpu| allowed.contains(&cpu.os_index));
        if self.cpus.is_empty() {
            let mut allowed = allowed.to_vec();
            allowed.sort_unstable();
            allowed.dedup();
            return Err(AffinityError::NoCpus {
                topology: format_cpu_list(&before),
                allowed: format_cpu_list(&allowed),
            });
        }
        Ok(self)
    }

    /// The usable CPUs' OS indices, ascending.
    pub fn os_indices(&self) -> Vec<usize> {
        self.cpus.iter().map(|cpu| cpu.os_index).collect()
    }

    /// The CPU with this OS index, if it is usable.
    pub fn cpu(&self, os_index: usize) -> Option<&Cpu> {
        self.cpus.iter().find(|cpu| cpu.os_index == os_index)
    }

    /// How many distinct packages the usable CPUs span.
    pub fn package_count(&self) -> usize {
        distinct(self.cpus.iter().map(|cpu| cpu.package))
    }

    /// How many distinct physical cores the usable CPUs span.
    pub fn core_count(&self) -> usize {
        distinct(self.cpus.iter().map(|cpu| (cpu.package, cpu.core_id)))
    }

    /// How many distinct NUMA nodes the usable CPUs span.
    pub fn numa_node_count(&self) -> usize {
        distinct(self.cpus.iter().map(|cpu| cpu.numa_node))
    }
}

fn distinct<T: Ord>(items: impl Iterator<Item = T>) -> usize {
    items.collect::<std::collections::BTreeSet<T>>().len()
}

/// Reads every PU with hwloc, ascending by OS index, unrestricted by our affinity mask.
fn read_hwloc() -> Result<Vec<Cpu>, AffinityError> {
    use hwlocality::object::types::ObjectType;

    let topology = hwlocality::Topology::new().map_err(|e| AffinityError::Hwloc(e.to_string()))?;
    // In hwloc 2 NUMA nodes are memory children, not ancestors of PUs: map them by cpuset.
    let mut numa_of_cpu = BTreeMap::new();
    for node in topology.objects_with_type(ObjectType::NUMANode) {
        let (Some(node_index), Some(cpuset)) = (node.os_index(), node.cpuset()) else {
            continue;
        };
        // take_while bounds the walk: an hwloc cpuset may be infinite, and is iterated in order.
        for cpu in cpuset
            .iter_set()
            .map(usize::from)
            .take_while(|&cpu| cpu <= CPU_INDEX_MAX)
        {
            numa_of_cpu.entry(cpu).or_insert(node_index);
        }
    }
    let mut cpus = Vec::new();
    for pu in topology.objects_with_type(ObjectType::PU) {
        let os_index = pu
            .os_index()
            .ok_or_else(|| AffinityError::Hwloc("a PU has no OS index".to_string()))?;
        if os_index > CPU_INDEX_MAX {
            return Err(AffinityError::CpuIndexOutOfRange {
                cpu: os_index,
                max: CPU_INDEX_MAX,
            });
        }
        let ancestor_index = |ty| pu.first_ancestor_with_type(ty).and_then(|o| o.os_index());
        cpus.push(Cpu {
            os_index,
            // Same fallbacks as sysfs: a PU with no core is its own core; no package means 0.
            core_id: ancestor_index(ObjectType::Core).unwrap_or(os_index),
            package: ancestor_index(ObjectType::Package).unwrap_or(0),
            numa_node: numa_of_cpu.get(&os_index).copied().unwrap_or(0),
        });
    }
    if cpus.is_empty() {
        return Err(AffinityError::Hwloc("no PU in the topology".to_string()));
    }
    cpus.sort_unstable_by_key(|cpu| cpu.os_index);
    Ok(cpus)
}

/// Maps each CPU to its NUMA node from `node_dir/nodeK/cpulist`; empty when `node_dir` is
/// absent (kernels built without NUMA). A CPU listed by two nodes keeps the lower node.
fn read_sysfs_numa(node_dir: &Path) -> Result<BTreeMap<usize, usize>, AffinityError> {
    let mut numa_of_cpu = BTreeMap::new();
    if !node_dir.is_dir() {
        return Ok(numa_of_cpu);
    }
    let read_error = |source| AffinityError::Read {
        path: node_dir.to_path_buf(),
        source,
    };
    let mut nodes = Vec::new();
    for entry in fs::read_dir(node_dir).map_err(read_error)? {
        let entry = entry.map_err(read_error)?;
        let name = entry.file_name();
        let Some(digits) = name.to_str().and_then(|n| n.strip_prefix("node")) else {
            continue;
        };
        if let Ok(node) = digits.parse::<usize>() {
            nodes.push(node);
        }
    }
    nodes.sort_unstable();
    for node in nodes {
        let path = node_dir.join(format!("node{node}/cpulist"));
        let cpus = parse_cpu_list(&read_text(&path)?)
            .map_err(|detail| AffinityError::Parse { path, detail })?;
        for cpu in cpus {
            numa_of_cpu.entry(cpu).or_insert(node);
        }
    }
    Ok(numa_of_cpu)
}

/// Reads a sysfs id file; `None` when the kernel wrote a negative id ("unknown").
fn read_sysfs_id(path: &Path) -> Result<Option<usize>, AffinityError> {
    let text = read_text(path)?;
    let parse_error = || AffinityError::Parse {
        path: path.to_path_buf(),
        detail: format!("{:?} is not an integer id", text.trim()),
    };
    let value: i64 = text.trim().parse().map_err(|_| parse_error())?;
    if value < 0 {
        return Ok(None);
    }
    usize::try_from(value).map(Some).map_err(|_| parse_error())
}

fn read_text(path: &Path) -> Result<String, AffinityError> {
    fs::read_to_string(path).map_err(|source| AffinityError::Read {
        path: PathBuf::from(path),
        source,
    })
}
