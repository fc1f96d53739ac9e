//! The tuners against in-memory and on-disk copies of /proc, /sys and /etc with exact
//! expected output; the rendered script run (with FELIX_TUNE_ROOT) against one copy must leave
//! it exactly as `apply` leaves another, and passes shellcheck.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::*;

/// One node of a fixture tree.
enum Entry {
    File(&'static str, &'static str),
    Link(&'static str, &'static str),
    Dir(&'static str),
}

use Entry::{Dir, File, Link};

/// An Azure L-series VM as the tuners see it: 4 CPUs without cpufreq, the synthetic NIC eth0
/// (MTU 1500, the default route) with its accelerated-networking VF enP1s1 (MSI interrupts on
/// every CPU), two local NVMe drives, THP `always`, one upgrade unit already masked.
fn azure_vm() -> Vec<Entry> {
    vec![
        File("/proc/sys/net/core/rmem_max", "212992\n"),
        File("/proc/sys/net/core/wmem_max", "212992\n"),
        File("/proc/sys/net/core/rmem_default", "212992\n"),
        // Already above the minimum: left alone (raised, never lowered).
        File("/proc/sys/net/core/wmem_default", "8388608\n"),
        File("/proc/sys/net/core/netdev_max_backlog", "1000\n"),
        File("/proc/sys/vm/swappiness", "60\n"),
        File("/proc/sys/fs/aio-max-nr", "65536\n"),
        File(
            "/proc/net/route",
            // A subnet route first, then the default route.
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
             eth0\t0000000A\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0\n\
             eth0\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n",
        ),
        File("/sys/class/net/lo/mtu", "65536\n"),
        File("/sys/class/net/eth0/mtu", "1500\n"),
        File("/sys/class/net/enP1s1/mtu", "1500\n"),
        File("/sys/class/net/enP1s1/device/msi_irqs/40", "msix\n"),
        File("/sys/class/net/enP1s1/device/msi_irqs/41", "msix\n"),
        File("/proc/irq/40/smp_affinity_list", "0-3\n"),
        File("/proc/irq/41/smp_affinity_list", "2\n"),
        Dir("/sys/devices/system/cpu/cpu0"),
        Dir("/sys/devices/system/cpu/cpu1"),
        Dir("/sys/devices/system/cpu/cpu2"),
        Dir("/sys/devices/system/cpu/cpu3"),
        File("/sys/devices/system/cpu/online", "0-3\n"),
        File("/sys/class/nvme/nvme0/device/msi_irqs/50", "msix\n"),
        File("/sys/class/nvme/nvme0/device/msi_irqs/51", "msix\n"),
        File("/sys/class/nvme/nvme0/device/msi_irqs/52", "msix\n"),
        File("/proc/irq/50/smp_affinity_list", "0-3\n"),
        File("/proc/irq/51/smp_affinity_list", "0-1\n"),
        File("/proc/irq/52/smp_affinity_list", "2-3\n"),
        File("/sys/class/nvme/nvme1/device/msi_irqs/60", "msix\n"),
        File("/sys/class/nvme/nvme1/device/msi_irqs/61", "msix\n"),
        // Already on the housekeeping CPU.
        File("/proc/irq/60/smp_affinity_list", "0\n"),
        File("/proc/irq/61/smp_affinity_list", "0-3\n"),
        File("/sys/block/nvme0n1/queue/scheduler", "[none] mq-deadline\n"),
        File("/sys/block/nvme0n1/queue/nomerges", "0\n"),
        File("/sys/block/nvme1n1/queue/scheduler", "[mq-deadline] none\n"),
        File("/sys/block/nvme1n1/queue/nomerges", "0\n"),
        File("/sys/block/sda/queue/scheduler", "[mq-deadline] none\n"),
        File("/sys/block/sda/queue/nomerges", "0\n"),
        File(
            "/sys/kernel/mm/transparent_hugepage/enabled",
            "[always] madvise never\n",
        ),
        Dir("/etc/systemd/system"),
        Link(
            "/etc/systemd/system/unattended-upgrades.service",
            "/dev/null",
        ),
    ]
}

fn azure_plan() -> HostPlan {
    HostPlan {
        profile: Profile::Azure,
        // Below the 25 MiB floor: the floor wins.
        udp_buffer_bytes: 8 << 20,
        data_nic: None,
        housekeeping_cpus: vec![0],
        dataplane_cpus: vec![1, 2, 3],
    }
}

fn mem(entries: &[Entry]) -> MemFs {
    entries.iter().fold(MemFs::new(), |fs, entry| match *entry {
        File(path, text) => fs.with_file(path, text),
        Link(path, target) => fs.with_link(path, target),
        Dir(path) => fs.with_dir(path),
    })
}

fn disk(entries: &[Entry], root: &Path) {
    let at = |path: &str| root.join(path.trim_start_matches('/'));
    for entry in entries {
        match *entry {
            File(path, text) => {
                std::fs::create_dir_all(at(path).parent().unwrap()).unwrap();
                std::fs::write(at(path), text).unwrap();
            }
            Link(path, target) => {
                std::fs::create_dir_all(at(path).parent().unwrap()).unwrap();
                std::os::unix::fs::symlink(target, at(path)).unwrap();
            }
            Dir(path) => std::fs::create_dir_all(at(path)).unwrap(),
        }
    }
}

/// Every file (contents) and link (target) under `root`, by path relative to it.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(root).unwrap().to_owned();
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                out.insert(rel, format!("-> {}", target.display()));
            } else if meta.is_dir() {
                walk(root, &path, out);
            } else {
                out.insert(rel, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// A QEMU guest (the appliance image's `test` profile) or a small physical server: a virtio
/// NIC whose interrupts belong to the PCI function above its `device` link, cpufreq with
/// `powersave`, one NVMe drive, nothing masked.
fn qemu_guest() -> Vec<Entry> {
    vec![
        File("/proc/sys/net/core/rmem_max", "212992\n"),
        File("/proc/sys/net/core/wmem_max", "212992\n"),
        File("/proc/sys/net/core/rmem_default", "212992\n"),
        File("/proc/sys/net/core/wmem_default", "212992\n"),
        File("/proc/sys/net/core/netdev_max_backlog", "1000\n"),
        File("/proc/sys/vm/swappiness", "0\n"),
        File("/proc/sys/fs/aio-max-nr", "65536\n"),
        File(
            "/proc/net/route",
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
             ens3\t00000000\t0202000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n",
        ),
        File("/sys/class/net/ens3/mtu", "1500\n"),
        Dir("/sys/devices/pci0000:00/0000:00:03.0/virtio0"),
        File("/sys/devices/pci0000:00/0000:00:03.0/msi_irqs/24", "msix\n"),
        File("/sys/devices/pci0000:00/0000:00:03.0/msi_irqs/25", "msix\n"),
        Link(
            "/sys/class/net/ens3/device",
            "../../../devices/pci0000:00/0000:00:03.0/virtio0",
        ),
        File("/proc/irq/24/smp_affinity_list", "0-1\n"),
        File("/proc/irq/25/smp_affinity_list", "1\n"),
        File(
            "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
            "powersave\n",
        ),
        File(
            "/sys/devices/system/cpu/cpu1/cpufreq/scaling_governor",
            "powersave\n",
        ),
        File("/sys/devices/system/cpu/online", "0-1\n"),
        // Lexically 100 < 99: the admin queue is the lowest number, not the first name.
        File("/sys/class/nvme/nvme0/device/msi_irqs/99", "msix\n"),
        File("/sys/class/nvme/nvme0/device/msi_irqs/100", "msix\n"),
        File("/proc/irq/99/smp_affinity_list", "0-1\n"),
        File("/proc/irq/100/smp_affinity_list", "0-1\n"),
        File("/sys/block/nvme0n1/queue/scheduler", "[mq-deadline] none\n"),
        File("/sys/block/nvme0n1/queue/nomerges", "0\n"),
        File(
            "/sys/kernel/mm/transparent_hugepage/enabled",
            "always [madvise] never\n",
        ),
        File(
            "/etc/systemd/system/multi-user.target.wants/ssh.service",
            "[Unit]\n",
        ),
    ]
}

fn qemu_plan(profile: Profile) -> HostPlan {
    HostPlan {
        profile,
        udp_buffer_bytes: 64 << 20,
        data_nic: None,
        housekeeping_cpus: vec![0],
        dataplane_cpus: vec![1],
    }
}

const AZURE_BEFORE: &str = "\
SETTING                                        CURRENT      REQUIRED     SEVERITY     STATUS
net.core.rmem_max                              212992       >= 26214400  required     OFF
net.core.wmem_max                              212992       >= 26214400  required     OFF
net.core.rmem_default                          212992       >= 4194304   recommended  OFF
net.core.wmem_default                          8388608      >= 4194304   recommended  ok
net.core.netdev_max_backlog                    1000         >= 32768     recommended  OFF
vm.swappiness                                  60           <= 1         recommended  OFF
fs.aio-max-nr                                  65536        >= 1048576   recommended  OFF
mtu eth0                                       1500         3900         required     OFF
cpu frequency governor                         -            performance  recommended  n/a: no cpufreq under /sys/devices/system/cpu (a VM, or a fixed frequency)
irq affinity enP1s1 (irq 40-41)                0-3          within 0     recommended  OFF
irq affinity nvme0 (irq 50; 2 kernel-managed)  0-3          within 0     recommended  OFF
irq affinity nvme1 (irq 60; 1 kernel-managed)  0            within 0     recommended  ok
nvme0n1 scheduler                              none         none         recommended  ok
nvme0n1 nomerges                               0            2            recommended  OFF
nvme1n1 scheduler                              mq-deadline  none         recommended  OFF
nvme1n1 nomerges                               0            2            recommended  OFF
transparent huge pages                         always       madvise      recommended  OFF
unit apt-daily.timer                           not masked   masked       required     OFF
unit apt-daily-upgrade.timer                   not masked   masked       required     OFF
unit unattended-upgrades.service               masked       masked       required     ok
";

const AZURE_AFTER: &str = "\
SETTING                                        CURRENT   REQUIRED     SEVERITY     STATUS
net.core.rmem_max                              26214400  >= 26214400  required     ok
net.core.wmem_max                              26214400  >= 26214400  required     ok
net.core.rmem_default                          4194304   >= 4194304   recommended  ok
net.core.wmem_default                          8388608   >= 4194304   recommended  ok
net.core.netdev_max_backlog                    32768     >= 32768     recommended  ok
vm.swappiness                                  1         <= 1         recommended  ok
fs.aio-max-nr                                  1048576   >= 1048576   recommended  ok
mtu eth0                                       3900      3900         required     ok
cpu frequency governor                         -         performance  recommended  n/a: no cpufreq under /sys/devices/system/cpu (a VM, or a fixed frequency)
irq affinity enP1s1 (irq 40-41)                0         within 0     recommended  ok
irq affinity nvme0 (irq 50; 2 kernel-managed)  0         within 0     recommended  ok
irq affinity nvme1 (irq 60; 1 kernel-managed)  0         within 0     recommended  ok
nvme0n1 scheduler                              none      none         recommended  ok
nvme0n1 nomerges                               2         2            recommended  ok
nvme1n1 scheduler                              none      none         recommended  ok
nvme1n1 nomerges                               2         2            recommended  ok
transparent huge pages                         madvise   madvise      recommended  ok
unit apt-daily.timer                           masked    masked       required     ok
unit apt-daily-upgrade.timer                   masked    masked       required     ok
unit unattended-upgrades.service               masked    masked       required     ok
";

#[test]
fn check_reports_every_setting_of_the_azure_profile() {
    let fs = mem(&azure_vm());
    let findings = check(&azure_plan(), &fs);
    assert_eq!(render_table(&findings), AZURE_BEFORE);
    let off: Vec<&str> = required_off(&findings)
        .map(|f| f.setting.as_str())
        .collect();
    assert_eq!(
        off,
        [
            "net.core.rmem_max",
            "net.core.wmem_max",
            "mtu eth0",
            "unit apt-daily.timer",
            "unit apt-daily-upgrade.timer"
        ]
    );
    let fixes: Vec<&str> = required_off(&findings).map(|f| f.fix.as_str()).collect();
    assert_eq!(
        fixes,
        [
            "sysctl -w net.core.rmem_max=26214400",
            "sysctl -w net.core.wmem_max=26214400",
            "ip link set dev eth0 mtu 3900",
            "systemctl mask --now apt-daily.timer",
            "systemctl mask --now apt-daily-upgrade.timer"
        ]
    );
    // Nothing that is on has a fix.
    assert!(
        findings
            .iter()
            .filter(|f| f.status != Status::Off)
            .all(|f| f.fix.is_empty())
    );
}

#[test]
fn apply_changes_what_is_off_and_nothing_else() {
    let fs = mem(&azure_vm());
    let plan = azure_plan();
    let changed: Vec<(&str, String)> = apply(&plan, &fs)
        .into_iter()
        .map(|a| {
            assert_eq!(a.outcome, Outcome::Changed, "{a:?}");
            (a.tuner, a.setting)
        })
        .collect();
    let expected = [
        ("sysctl", "net.core.rmem_max"),
        ("sysctl", "net.core.wmem_max"),
        ("sysctl", "net.core.rmem_default"),
        ("sysctl", "net.core.netdev_max_backlog"),
        ("sysctl", "vm.swappiness"),
        ("sysctl", "fs.aio-max-nr"),
        ("mtu", "mtu eth0"),
        ("irq", "irq affinity enP1s1 (irq 40-41)"),
        ("irq", "irq affinity nvme0 (irq 50; 2 kernel-managed)"),
        ("nvme", "nvme0n1 nomerges"),
        ("nvme", "nvme1n1 scheduler"),
        ("nvme", "nvme1n1 nomerges"),
        ("thp", "transparent huge pages"),
        ("upgrades", "unit apt-daily.timer"),
        ("upgrades", "unit apt-daily-upgrade.timer"),
    ]
    .map(|(t, s)| (t, s.to_owned()));
    assert_eq!(changed, expected);
    assert_eq!(render_table(&check(&plan, &fs)), AZURE_AFTER);
    // What was already right is untouched: a larger default stays larger, the I/O queues
    // stay where the kernel spread them, a non-NVMe disk keeps its scheduler.
    assert_eq!(
        fs.read(Path::new("/proc/sys/net/core/wmem_default"))
            .unwrap(),
        "8388608\n"
    );
    assert_eq!(
        fs.read(Path::new("/proc/irq/52/smp_affinity_list"))
            .unwrap(),
        "2-3\n"
    );
    assert_eq!(
        fs.read(Path::new("/sys/block/sda/queue/scheduler"))
            .unwrap(),
        "[mq-deadline] none\n"
    );
    assert_eq!(
        fs.read(Path::new("/proc/irq/40/smp_affinity_list"))
            .unwrap(),
        "0\n"
    );
    assert_eq!(
        fs.read_link(Path::new("/etc/systemd/system/apt-daily.timer"))
            .unwrap(),
        Path::new("/dev/null")
    );
    // A second apply has nothing left to do.
    assert_eq!(apply(&plan, &fs), []);
}

#[test]
fn a_host_without_the_files_says_not_applicable_instead_of_failing() {
    let fs = MemFs::new();
    for profile in Profile::ALL {
        let plan = HostPlan {
            profile,
            ..azure_plan()
        };
        let findings = check(&plan, &fs);
        for finding in &findings {
            assert!(
                matches!(finding.status, Status::NotApplicable(_)),
                "{profile}: {finding:?}"
            );
        }
        assert_eq!(required_off(&findings).count(), 0);
        assert_eq!(apply(&plan, &fs), [], "{profile}");
    }
    let table = render_table(&check(&azure_plan(), &fs));
    let reasons: Vec<&str> = table
        .lines()
        .skip(1)
        .map(|l| l.split("n/a: ").nth(1).unwrap())
        .collect();
    assert_eq!(
        reasons,
        [
            "no such file /proc/sys/net/core/rmem_max",
            "no such file /proc/sys/net/core/wmem_max",
            "no such file /proc/sys/net/core/rmem_default",
            "no such file /proc/sys/net/core/wmem_default",
            "no such file /proc/sys/net/core/netdev_max_backlog",
            "no such file /proc/sys/vm/swappiness",
            "no such file /proc/sys/fs/aio-max-nr",
            "no data NIC: no default route in /proc/net/route and FELIX_DATA_NIC is auto",
            "no cpufreq under /sys/devices/system/cpu (a VM, or a fixed frequency)",
            "no NIC or NVMe device with MSI interrupts",
            "no NVMe drive in /sys/block",
            "no such file /sys/kernel/mm/transparent_hugepage/enabled",
            "no /etc/systemd/system: not a systemd host",
            "no /etc/systemd/system: not a systemd host",
            "no /etc/systemd/system: not a systemd host",
        ]
    );
}

#[test]
fn write_errors_say_what_to_do() {
    let fs = mem(&azure_vm())
        .read_only("/proc/sys/net/core/rmem_max")
        .with_write_error("/proc/sys/net/core/wmem_max", libc::EROFS)
        .with_write_error("/proc/irq/50/smp_affinity_list", libc::EIO)
        .with_write_error("/sys/block/nvme1n1/queue/scheduler", libc::EINVAL);
    let outcomes: BTreeMap<String, Outcome> = apply(&azure_plan(), &fs)
        .into_iter()
        .map(|a| (a.setting, a.outcome))
        .collect();
    assert_eq!(
        outcomes["net.core.rmem_max"],
        Outcome::Failed(
            "permission denied writing /proc/sys/net/core/rmem_max (run as root)".to_owned()
        )
    );
    assert_eq!(
        outcomes["net.core.wmem_max"],
        Outcome::NotApplicable("read-only file system at /proc/sys/net/core/wmem_max".to_owned())
    );
    assert_eq!(
        outcomes["irq affinity nvme0 (irq 50; 2 kernel-managed)"],
        Outcome::NotApplicable("irq 50: affinity is managed by the kernel".to_owned())
    );
    assert_eq!(
        outcomes["nvme1n1 scheduler"],
        Outcome::Failed(format!(
            "cannot write /sys/block/nvme1n1/queue/scheduler: {}",
            std::io::Error::from_raw_os_error(libc::EINVAL)
        ))
    );
    // The others went through.
    assert_eq!(outcomes["mtu eth0"], Outcome::Changed);
    assert_eq!(outcomes.len(), 15);
}

#[test]
fn upgrades_never_replace_the_operators_own_unit() {
    let fs = mem(&azure_vm())
        .with_file("/etc/systemd/system/apt-daily.timer", "[Timer]\n")
        .with_link(
            "/etc/systemd/system/apt-daily-upgrade.timer",
            "/lib/systemd/system/x.timer",
        );
    let outcomes: Vec<Outcome> = apply(&azure_plan(), &fs)
        .into_iter()
        .filter(|a| a.tuner == "upgrades")
        .map(|a| a.outcome)
        .collect();
    assert_eq!(
        outcomes,
        [
            Outcome::Failed(
                "/etc/systemd/system/apt-daily.timer exists and is not a link; remove it first"
                    .to_owned()
            ),
            Outcome::Failed(
                "/etc/systemd/system/apt-daily-upgrade.timer links to /lib/systemd/system/x.timer; \
                 remove it first"
                    .to_owned()
            ),
        ]
    );
    assert_eq!(
        fs.read(Path::new("/etc/systemd/system/apt-daily.timer"))
            .unwrap(),
        "[Timer]\n"
    );
}

#[test]
fn no_housekeeping_cpu_leaves_interrupts_alone() {
    let fs = mem(&azure_vm());
    let plan = HostPlan {
        housekeeping_cpus: Vec::new(),
        dataplane_cpus: vec![0, 1, 2, 3],
        ..azure_plan()
    };
    let irq: Vec<Finding> = check(&plan, &fs)
        .into_iter()
        .filter(|f| f.tuner == "irq")
        .collect();
    assert_eq!(irq.len(), 1);
    assert_eq!(
        irq[0].status,
        Status::NotApplicable(
            "no housekeeping CPU: every CPU runs a data-plane core (FELIX_DATAPLANE_CORES)"
                .to_owned()
        )
    );
    assert!(apply(&plan, &fs).iter().all(|a| a.tuner != "irq"));
    assert_eq!(
        fs.read(Path::new("/proc/irq/40/smp_affinity_list"))
            .unwrap(),
        "0-3\n"
    );
    assert!(render_script(&plan).contains(
        "# irq: no housekeeping CPU (every CPU runs a data-plane core): nothing to move\n"
    ));
}

#[test]
fn larger_udp_buffers_raise_the_sysctl_floor() {
    let plan = HostPlan {
        udp_buffer_bytes: 64 << 20,
        ..azure_plan()
    };
    let findings = check(&plan, &mem(&azure_vm()));
    assert_eq!(findings[0].required, ">= 67108864");
    assert_eq!(findings[1].required, ">= 67108864");
    assert_eq!(findings[0].fix, "sysctl -w net.core.rmem_max=67108864");
    assert!(render_script(&plan).contains("felix_sysctl net.core.rmem_max at-least 67108864\n"));
    assert_eq!(
        sysctl_conf(&plan),
        "# Felix host profile azure: written by felix (felix_tuning::host::sysctl_conf).\n\
         net.core.rmem_max = 67108864\n\
         net.core.wmem_max = 67108864\n\
         net.core.rmem_default = 4194304\n\
         net.core.wmem_default = 4194304\n\
         net.core.netdev_max_backlog = 32768\n\
         vm.swappiness = 1\n\
         fs.aio-max-nr = 1048576\n"
    );
}

#[test]
fn profiles_pick_their_tuners_and_severities() {
    let fs = mem(&qemu_guest());
    let table = |profile| {
        check(&qemu_plan(profile), &fs)
            .into_iter()
            .map(|f| format!("{} {} {}", f.setting, f.severity, f.status))
            .collect::<Vec<_>>()
    };
    let baremetal = table(Profile::Baremetal);
    // No MTU tuner on bare metal; the governor is required there.
    assert!(!baremetal.iter().any(|l| l.starts_with("mtu")));
    assert!(baremetal.contains(&"cpu frequency governor required OFF".to_owned()));
    assert!(baremetal.contains(&"unit apt-daily.timer recommended OFF".to_owned()));
    let test = table(Profile::Test);
    assert!(test.contains(&"mtu ens3 required OFF".to_owned()));
    assert!(test.contains(&"cpu frequency governor recommended OFF".to_owned()));
    assert!(test.contains(&"unit apt-daily.timer required OFF".to_owned()));
    // The virtio NIC's interrupts are found through its PCI function; NVMe's admin queue is
    // the lowest-numbered vector; swappiness 0 is within "at most 1".
    assert!(test.contains(&"irq affinity ens3 (irq 24-25) recommended OFF".to_owned()));
    assert!(
        test.contains(&"irq affinity nvme0 (irq 99; 1 kernel-managed) recommended OFF".to_owned())
    );
    assert!(test.contains(&"vm.swappiness recommended ok".to_owned()));
    assert!(test.contains(&"transparent huge pages recommended ok".to_owned()));
    assert_eq!(default_route_nic(&fs).as_deref(), Some("ens3"));
    // A configured NIC wins over the default route.
    let plan = HostPlan {
        data_nic: Some("ens4".to_owned()),
        ..qemu_plan(Profile::Test)
    };
    let mtu: Vec<Finding> = check(&plan, &fs)
        .into_iter()
        .filter(|f| f.tuner == "mtu")
        .collect();
    assert_eq!(mtu[0].setting, "mtu ens4");
    assert_eq!(
        mtu[0].status,
        Status::NotApplicable("no such file /sys/class/net/ens4/mtu".to_owned())
    );
    assert!(render_script(&plan).contains("nic=ens4\n"));
}

/// Applies the plan to one on-disk copy of `entries` with [`RootFs`] and runs the rendered
/// script on another with FELIX_TUNE_ROOT; the two copies must end up identical, and changed.
fn script_matches_apply(entries: &[Entry], plan: &HostPlan) {
    let applied = tempfile::tempdir().unwrap();
    let scripted = tempfile::tempdir().unwrap();
    disk(entries, applied.path());
    disk(entries, scripted.path());
    let before = snapshot(applied.path());
    let outcomes = apply(plan, &RootFs::new(applied.path()));
    assert!(
        outcomes.iter().all(|a| a.outcome == Outcome::Changed),
        "{outcomes:?}"
    );
    let script = scripted.path().join("tune.sh");
    std::fs::write(&script, render_script(plan)).unwrap();
    let output = Command::new("sh")
        .arg(&script)
        .env("FELIX_TUNE_ROOT", scripted.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}: {stderr}", plan.profile);
    assert_eq!(stderr, "", "{}", plan.profile);
    std::fs::remove_file(&script).unwrap();
    let after = snapshot(applied.path());
    assert_ne!(before, after, "{}: apply changed nothing", plan.profile);
    assert_eq!(after, snapshot(scripted.path()), "{}", plan.profile);
    // And checking the scripted copy finds every applicable setting on.
    let findings = check(plan, &RootFs::new(scripted.path()));
    for finding in findings {
        assert!(
            matches!(finding.status, Status::Ok | Status::NotApplicable(_)),
            "{}: {finding:?}",
            plan.profile
        );
    }
}

#[test]
fn the_script_does_what_apply_does() {
    script_matches_apply(&azure_vm(), &azure_plan());
    for profile in Profile::ALL {
        script_matches_apply(&qemu_guest(), &qemu_plan(profile));
    }
    let plan = HostPlan {
        data_nic: Some("ens3".to_owned()),
        ..qemu_plan(Profile::Test)
    };
    script_matches_apply(&qemu_guest(), &plan);
}

/// The azure profile's script, reviewed line by line, in `testdata/azure.sh`. After a
/// deliberate change, `FELIX_BLESS=1 cargo test -p felix-tuning` rewrites the file; review
/// its diff.
#[test]
fn the_azure_script_is_exactly_the_reviewed_one() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/host/testdata/azure.sh");
    let script = render_script(&azure_plan());
    if std::env::var_os("FELIX_BLESS").is_some() {
        std::fs::write(&golden, &script).unwrap();
    }
    assert_eq!(script, std::fs::read_to_string(&golden).unwrap());
}

#[test]
fn rendered_scripts_pass_shellcheck() {
    if Command::new("shellcheck")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: shellcheck is not installed (make deps installs it)");
        return;
    }
    let mut plans = Vec::new();
    for profile in Profile::ALL {
        plans.push(qemu_plan(profile));
        plans.push(HostPlan {
            data_nic: Some("eth1".to_owned()),
            housekeeping_cpus: Vec::new(),
            ..qemu_plan(profile)
        });
    }
    for plan in plans {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("tune.sh");
        std::fs::write(&script, render_script(&plan)).unwrap();
        let output = Command::new("shellcheck")
            .args(["--shell=sh", "--severity=style"])
            .arg(&script)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{plan:?}\n{}",
            String::from_utf8_lossy(&output.stdout)
        );
    }
}

#[test]
fn cpu_lists_round_trip() {
    let cpus = parse_cpu_list("0-3,8,10-11\n").unwrap();
    assert_eq!(
        cpus.iter().copied().collect::<Vec<_>>(),
        [0, 1, 2, 3, 8, 10, 11]
    );
    assert_eq!(cpu_list(&cpus), "0-3,8,10-11");
    assert_eq!(cpu_list(&parse_cpu_list("5").unwrap()), "5");
    assert_eq!(cpu_list(&parse_cpu_list("").unwrap()), "");
    assert_eq!(parse_cpu_list("3-1"), None);
    assert_eq!(parse_cpu_list("x"), None);
}

#[test]
fn checking_this_host_reads_without_failing() {
    // Whatever this machine has, every finding has a status and nothing panics; the table
    // has one line per finding.
    for profile in Profile::ALL {
        let plan = qemu_plan(profile);
        let findings = check(&plan, &RealFs);
        assert!(!findings.is_empty());
        assert_eq!(render_table(&findings).lines().count(), findings.len() + 1);
    }
}
