//! The core plan against fake sysfs trees: topology reading, defaults, FELIX_DATAPLANE_CORES,
//! listeners, ports, shard mapping and the rendered text.

use std::fs;
use std::path::Path;

use felix_affinity::{
    AffinityError, CorePlan, Cpu, CpuSelection, PlanOptions, Topology, TopologySource, shard_core,
};
use tempfile::TempDir;

/// One CPU of a fake tree: (os_index, core_id, physical_package_id).
type FakeCpu = (usize, i64, i64);

/// Writes a fake sysfs tree: `online`, each CPU's topology ids, and optional NUMA node lists.
fn fake_sysfs(online: &str, cpus: &[FakeCpu], nodes: &[(usize, &str)]) -> TempDir {
    let root = tempfile::tempdir().expect("a temp dir can be created");
    let cpu_dir = root.path().join("devices/system/cpu");
    fs::create_dir_all(&cpu_dir).expect("create cpu dir");
    fs::write(cpu_dir.join("online"), format!("{online}\n")).expect("write online");
    for &(os_index, core_id, package) in cpus {
        let dir = cpu_dir.join(format!("cpu{os_index}/topology"));
        fs::create_dir_all(&dir).expect("create topology dir");
        fs::write(dir.join("core_id"), format!("{core_id}\n")).expect("write core_id");
        fs::write(dir.join("physical_package_id"), format!("{package}\n"))
            .expect("write physical_package_id");
    }
    for &(node, cpulist) in nodes {
        let dir = root.path().join(format!("devices/system/node/node{node}"));
        fs::create_dir_all(&dir).expect("create node dir");
        fs::write(dir.join("cpulist"), format!("{cpulist}\n")).expect("write cpulist");
    }
    root
}

/// A 2-CPU VM like this machine: one package, two cores, one NUMA node.
fn two_cpu_tree() -> TempDir {
    fake_sysfs("0-1", &[(0, 0, 0), (1, 1, 0)], &[(0, "0-1")])
}

/// 8 CPUs numbered the way Linux numbers a 2-socket, 2-core, SMT-2 machine: packages
/// interleave (0,1,0,1 ...) and SMT siblings come after all first threads.
fn eight_cpu_tree() -> TempDir {
    fake_sysfs(
        "0-7",
        &[
            (0, 0, 0),
            (1, 1, 0),
            (2, 0, 1),
            (3, 1, 1),
            (4, 0, 0),
            (5, 1, 0),
            (6, 0, 1),
            (7, 1, 1),
        ],
        &[(0, "0-1,4-5"), (1, "2-3,6-7")],
    )
}

fn read(root: &Path) -> Topology {
    Topology::from_sysfs_root(root).expect("the fake tree is well formed")
}

fn options(base_port: u16) -> PlanOptions {
    PlanOptions {
        dataplane_cores: None,
        quic_listeners: None,
        base_port,
    }
}

fn plan_cpus(plan: &CorePlan) -> Vec<usize> {
    plan.cores().iter().map(|core| core.cpu.os_index).collect()
}

fn cpu(os_index: usize, core_id: usize, package: usize, numa_node: usize) -> Cpu {
    Cpu {
        os_index,
        core_id,
        package,
        numa_node,
    }
}

#[test]
fn sysfs_tree_is_read_exactly() {
    // Proves every field of every CPU comes from the right sysfs file, NUMA lists included.
    let tree = eight_cpu_tree();
    let topology = read(tree.path());
    let expected = Topology {
        cpus: vec![
            cpu(0, 0, 0, 0),
            cpu(1, 1, 0, 0),
            cpu(2, 0, 1, 1),
            cpu(3, 1, 1, 1),
            cpu(4, 0, 0, 0),
            cpu(5, 1, 0, 0),
            cpu(6, 0, 1, 1),
            cpu(7, 1, 1, 1),
        ],
        source: TopologySource::Sysfs,
    };
    assert_eq!(topology, expected);
    assert_eq!(topology.core_count(), 4);
    assert_eq!(topology.package_count(), 2);
    assert_eq!(topology.numa_node_count(), 2);
}

#[test]
fn sysfs_without_numa_or_with_unknown_ids_falls_back_documented_way() {
    // Proves a missing node folder means NUMA node 0 and a -1 id means "own core, package 0".
    let tree = fake_sysfs("0,2", &[(0, -1, -1), (2, 5, 0)], &[]);
    let topology = read(tree.path());
    assert_eq!(topology.cpus, vec![cpu(0, 0, 0, 0), cpu(2, 5, 0, 0)]);
}

#[test]
fn broken_sysfs_is_an_error_naming_the_file() {
    // Proves unreadable or garbled sysfs input is reported with its path, never a panic.
    let missing = fake_sysfs("0-1", &[(0, 0, 0)], &[]);
    let err = Topology::from_sysfs_root(missing.path()).expect_err("cpu1 has no topology");
    assert!(err.to_string().contains("cpu1/topology/core_id"), "{err}");

    let garbled = fake_sysfs("0-x", &[], &[]);
    let err = Topology::from_sysfs_root(garbled.path()).expect_err("online is garbled");
    assert!(matches!(err, AffinityError::Parse { .. }), "{err}");
    assert!(err.to_string().contains("online"), "{err}");

    let bad_id = fake_sysfs("0", &[(0, 0, 0)], &[]);
    let id_path = bad_id
        .path()
        .join("devices/system/cpu/cpu0/topology/core_id");
    fs::write(id_path, "zero\n").expect("overwrite core_id");
    let err = Topology::from_sysfs_root(bad_id.path()).expect_err("core_id is garbled");
    assert!(err.to_string().contains("core_id"), "{err}");
}

#[test]
fn restriction_keeps_allowed_cpus_and_refuses_an_empty_set() {
    // Proves the affinity restriction drops CPUs outside the mask and never yields no CPU.
    let tree = eight_cpu_tree();
    let restricted = read(tree.path())
        .restricted_to(&[6, 2, 3, 99])
        .expect("three CPUs overlap");
    assert_eq!(restricted.os_indices(), vec![2, 3, 6]);
    let err = read(tree.path())
        .restricted_to(&[8, 9])
        .expect_err("nothing overlaps");
    assert_eq!(
        err.to_string(),
        "no usable CPU: the topology (0-7) and the allowed CPUs (8-9) do not overlap"
    );
}

#[test]
fn two_cpus_are_both_data_plane_and_housekeeping_is_shared() {
    // Proves the 2-CPU default: both CPUs run data-plane loops, housekeeping shares core 0.
    let tree = two_cpu_tree();
    let plan = CorePlan::new(&read(tree.path()), &options(7400)).expect("default plan");
    assert_eq!(plan_cpus(&plan), vec![0, 1]);
    assert_eq!(plan.housekeeping_cpu(), 0);
    assert!(plan.housekeeping_shared());
    assert_eq!(
        plan.render(),
        "\
core plan (topology from sysfs)
  usable CPUs: 0-1 (2 CPUs, 2 cores, 1 package, 1 NUMA node)
  housekeeping and IRQs: cpu 0 (shared with data-plane core 0)
  shared port (SO_REUSEPORT): 7400
  data-plane cores: 2, QUIC listeners on the shared port: 2
    core 0: cpu 0 (package 0, NUMA node 0), listeners 1, own port 7401
    core 1: cpu 1 (package 0, NUMA node 0), listeners 1, own port 7402
  shards: shard s is owned by data-plane core s % 2
"
    );
}

#[test]
fn eight_cpus_give_seven_data_plane_cores_and_one_housekeeping() {
    // Proves the >= 4 CPU default reserves the first CPU of package 0, and the exact text.
    let tree = eight_cpu_tree();
    let plan = CorePlan::new(&read(tree.path()), &options(7400)).expect("default plan");
    assert_eq!(plan_cpus(&plan), vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(plan.housekeeping_cpu(), 0);
    assert!(!plan.housekeeping_shared());
    assert_eq!(
        plan.render(),
        "\
core plan (topology from sysfs)
  usable CPUs: 0-7 (8 CPUs, 4 cores, 2 packages, 2 NUMA nodes)
  housekeeping and IRQs: cpu 0 (not a data-plane core)
  shared port (SO_REUSEPORT): 7400
  data-plane cores: 7, QUIC listeners on the shared port: 7
    core 0: cpu 1 (package 0, NUMA node 0), listeners 1, own port 7401
    core 1: cpu 2 (package 1, NUMA node 1), listeners 1, own port 7402
    core 2: cpu 3 (package 1, NUMA node 1), listeners 1, own port 7403
    core 3: cpu 4 (package 0, NUMA node 0), listeners 1, own port 7404
    core 4: cpu 5 (package 0, NUMA node 0), listeners 1, own port 7405
    core 5: cpu 6 (package 1, NUMA node 1), listeners 1, own port 7406
    core 6: cpu 7 (package 1, NUMA node 1), listeners 1, own port 7407
  shards: shard s is owned by data-plane core s % 7
"
    );
}

#[test]
fn reserved_cpu_comes_from_the_lowest_package_left_in_the_mask() {
    // Proves that when package 0 is outside the mask, the first CPU of the next package is kept.
    let tree = eight_cpu_tree();
    let topology = read(tree.path())
        .restricted_to(&[2, 3, 6, 7])
        .expect("package 1 is allowed");
    let plan = CorePlan::new(&topology, &options(7400)).expect("default plan");
    assert_eq!(plan_cpus(&plan), vec![3, 6, 7]);
    assert_eq!(plan.housekeeping_cpu(), 2);
    assert!(!plan.housekeeping_shared());
}

#[test]
fn dataplane_cores_parse_counts_and_lists() {
    // Proves FELIX_DATAPLANE_CORES: a bare number is a count, anything else a CPU list.
    assert_eq!(
        CpuSelection::parse("2").expect("count"),
        CpuSelection::Count(2)
    );
    assert_eq!(
        CpuSelection::parse(" 2\n").expect("count"),
        CpuSelection::Count(2)
    );
    assert_eq!(
        CpuSelection::parse("0,2-3").expect("list"),
        CpuSelection::List(vec![0, 2, 3])
    );
    assert_eq!(
        "3-3".parse::<CpuSelection>().expect("single-CPU list"),
        CpuSelection::List(vec![3])
    );
}

#[test]
fn dataplane_cores_refuse_garbage_empty_and_out_of_range() {
    // Proves bad FELIX_DATAPLANE_CORES values are refused with a message naming the variable.
    for bad in [
        "",
        "  ",
        "0",
        "abc",
        "two",
        "1,",
        ",1",
        "2-",
        "3-1",
        "1,1",
        "-2",
        "1.5",
        "0x3",
        "1025",
        "99999999999",
        "0-5000",
    ] {
        let err = CpuSelection::parse(bad).expect_err(bad);
        assert!(
            matches!(err, AffinityError::InvalidCpuSelection { .. }),
            "{bad:?}: {err}"
        );
        assert!(
            err.to_string().starts_with("FELIX_DATAPLANE_CORES="),
            "{err}"
        );
    }
    assert_eq!(
        CpuSelection::parse("").expect_err("empty").to_string(),
        "FELIX_DATAPLANE_CORES=\"\": empty; give a core count (e.g. 2) or a CPU list (e.g. 0,2-3)"
    );
}

#[test]
fn dataplane_count_takes_the_default_order() {
    // Proves a count takes default data-plane CPUs first and the reserved CPU last.
    let tree = eight_cpu_tree();
    let topology = read(tree.path());
    let with = |selection: &str| {
        CorePlan::new(
            &topology,
            &PlanOptions {
                dataplane_cores: Some(CpuSelection::parse(selection).expect("valid")),
                ..options(7400)
            },
        )
    };
    let three = with("3").expect("3 of 8");
    assert_eq!(plan_cpus(&three), vec![1, 2, 3]);
    assert_eq!(
        (three.housekeeping_cpu(), three.housekeeping_shared()),
        (0, false)
    );

    let all = with("8").expect("8 of 8");
    assert_eq!(plan_cpus(&all), vec![0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(
        (all.housekeeping_cpu(), all.housekeeping_shared()),
        (0, true)
    );

    let err = with("9").expect_err("only 8 CPUs");
    assert_eq!(
        err.to_string(),
        "FELIX_DATAPLANE_CORES=9: only 8 CPUs are usable"
    );

    let two_cpus = two_cpu_tree();
    let one = CorePlan::new(
        &read(two_cpus.path()),
        &PlanOptions {
            dataplane_cores: Some(CpuSelection::Count(1)),
            ..options(7400)
        },
    )
    .expect("1 of 2");
    assert_eq!(plan_cpus(&one), vec![0]);
    assert_eq!(
        (one.housekeeping_cpu(), one.housekeeping_shared()),
        (1, false)
    );
}

#[test]
fn dataplane_list_selects_cpus_and_names_a_missing_one() {
    // Proves a CPU list is taken as given and a CPU outside the topology/mask is named.
    let tree = eight_cpu_tree();
    let topology = read(tree.path())
        .restricted_to(&[0, 1, 2, 3])
        .expect("mask");
    let with = |selection: &str| {
        CorePlan::new(
            &topology,
            &PlanOptions {
                dataplane_cores: Some(CpuSelection::parse(selection).expect("valid")),
                ..options(7400)
            },
        )
    };
    let plan = with("0,2-3").expect("all listed CPUs usable");
    assert_eq!(plan_cpus(&plan), vec![0, 2, 3]);
    assert_eq!(
        (plan.housekeeping_cpu(), plan.housekeeping_shared()),
        (1, false)
    );

    let err = with("1,6").expect_err("CPU 6 is outside the mask");
    assert!(
        matches!(err, AffinityError::CpuNotAvailable { cpu: 6, .. }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "FELIX_DATAPLANE_CORES: CPU 6 is not in the topology or this process's affinity mask \
         (usable CPUs: 0-3)"
    );
}

#[test]
fn listeners_spread_round_robin_within_bounds() {
    // Proves FELIX_QUIC_LISTENERS is spread round-robin, must be >= 1, and <= 8 per core.
    let tree = two_cpu_tree();
    let topology = read(tree.path());
    let with = |listeners: u32| {
        CorePlan::new(
            &topology,
            &PlanOptions {
                quic_listeners: Some(listeners),
                ..options(7400)
            },
        )
    };
    let per_core =
        |plan: CorePlan| -> Vec<u32> { plan.cores().iter().map(|c| c.listeners).collect() };
    assert_eq!(per_core(with(3).expect("3 on 2 cores")), vec![2, 1]);
    assert_eq!(per_core(with(1).expect("1 on 2 cores")), vec![1, 0]);
    assert_eq!(
        per_core(with(16).expect("8 per core is allowed")),
        vec![8, 8]
    );
    assert_eq!(with(5).expect("5 on 2 cores").listener_count(), 5);

    assert!(matches!(with(0), Err(AffinityError::NoListeners)));
    let err = with(17).expect_err("9 on one core");
    assert_eq!(
        err.to_string(),
        "FELIX_QUIC_LISTENERS=17 over 2 data-plane cores puts 9 on one core; at most 8 per core"
    );
}

#[test]
fn ports_follow_the_base_and_refuse_overflow() {
    // Proves core i's own port is base + 1 + i, the last one may be 65535 but not above.
    let tree = eight_cpu_tree();
    let topology = read(tree.path());
    let own_ports = |base: u16| -> Result<Vec<u16>, AffinityError> {
        let plan = CorePlan::new(&topology, &options(base))?;
        assert_eq!(plan.shared_port(), base);
        Ok(plan.cores().iter().map(|c| c.own_port).collect())
    };
    assert_eq!(
        own_ports(7400).expect("fits"),
        (7401..=7407).collect::<Vec<u16>>()
    );
    assert_eq!(
        own_ports(65528).expect("fits exactly"),
        (65529..=65535).collect::<Vec<u16>>()
    );
    let err = own_ports(65529).expect_err("one past 65535");
    assert_eq!(
        err.to_string(),
        "base port 65529 with 7 data-plane cores needs own ports up to 65536, above 65535"
    );
    assert!(matches!(
        own_ports(u16::MAX),
        Err(AffinityError::PortOverflow { .. })
    ));
}

#[test]
fn base_port_zero_defers_every_port_to_bind_time() {
    // Proves base port 0 (tests) records own ports as 0 and says so in the rendered plan.
    let tree = two_cpu_tree();
    let plan = CorePlan::new(
        &read(tree.path()),
        &PlanOptions {
            quic_listeners: Some(3),
            ..options(0)
        },
    )
    .expect("plan");
    assert!(plan.cores().iter().all(|core| core.own_port == 0));
    assert_eq!(
        plan.render(),
        "\
core plan (topology from sysfs)
  usable CPUs: 0-1 (2 CPUs, 2 cores, 1 package, 1 NUMA node)
  housekeeping and IRQs: cpu 0 (shared with data-plane core 0)
  shared port (SO_REUSEPORT): assigned at bind time
  data-plane cores: 2, QUIC listeners on the shared port: 3
    core 0: cpu 0 (package 0, NUMA node 0), listeners 2, own port assigned at bind time
    core 1: cpu 1 (package 0, NUMA node 0), listeners 1, own port assigned at bind time
  shards: shard s is owned by data-plane core s % 2
"
    );
}

#[test]
fn shards_map_to_cores_by_remainder() {
    // Proves shard -> core is shard % data-plane core count, as a pure function and on a plan.
    let tree = fake_sysfs("0-2", &[(0, 0, 0), (1, 1, 0), (2, 2, 0)], &[]);
    let plan = CorePlan::new(&read(tree.path()), &options(7400)).expect("plan");
    assert_eq!(plan.core_count(), 3);
    assert_eq!(
        plan.cores_for_shards(10),
        vec![0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    );
    assert_eq!(plan.cores_for_shards(0), Vec::<u16>::new());
    assert_eq!(plan.shard_core(47), 2);
    assert_eq!(shard_core(47, 7), 5);
    assert_eq!(shard_core(u32::MAX, 1024), 1023);
}
