//! The tuners of each profile. Each is one struct with its `check`, `apply` and `render`, next
//! to each other so that the three say the same thing. docs/operations.md has the table of
//! settings and the reason for each value.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

use super::{Applied, Finding, HostFs, HostPlan, Outcome, Profile, Severity, Status, Tuner};

/// The least net.core.rmem_max / wmem_max even when the broker's UDP buffers are smaller:
/// 25 MiB holds about 40 ms of a 5 Gbit/s burst, what a core drains between two polls under
/// load (the broker asks for its FELIX_UDP_*_BUFFER and the kernel caps it at these).
pub const UDP_BUFFER_MAX_MIN: u64 = 26_214_400;
/// net.core.rmem_default / wmem_default: sockets that do not ask (the client library, tools)
/// get 4 MiB instead of 208 KiB.
const UDP_BUFFER_DEFAULT_MIN: u64 = 4_194_304;
/// net.core.netdev_max_backlog: packets queued per CPU between the NIC and the stack; the
/// default 1000 drops bursts of small QUIC packets at high packet rates.
const NETDEV_BACKLOG_MIN: u64 = 32_768;
/// vm.swappiness: keep the broker's replay rings in memory (1, not 0: 0 also stops the kernel
/// from swapping anonymous memory under real pressure, which turns pressure into the OOM
/// killer sooner).
const SWAPPINESS_MAX: u64 = 1;
/// fs.aio-max-nr: io_uring and AIO requests in flight host-wide; the default 65536 is short
/// for several cores each with a deep queue on several NVMe drives.
const AIO_MAX_NR_MIN: u64 = 1_048_576;
/// The data NIC's MTU on profiles that set it: the largest Azure allows inside a virtual
/// network, which lets QUIC carry about 2.6x the payload per packet of 1500.
pub const AZURE_MTU: u32 = 3900;
/// The units that install updates (and restart services) behind the operator's back; the
/// upgrades tuner masks them (`felix tune --apply` then reloads systemd and stops them).
pub const UPGRADE_UNITS: [&str; 3] = [
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "unattended-upgrades.service",
];

const PROC_SYS: &str = "/proc/sys";
const CPU_DIR: &str = "/sys/devices/system/cpu";
const NET_DIR: &str = "/sys/class/net";
const NVME_DIR: &str = "/sys/class/nvme";
const BLOCK_DIR: &str = "/sys/block";
const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";
const SYSTEMD_ETC: &str = "/etc/systemd/system";
const ROUTE_TABLE: &str = "/proc/net/route";

/// The profile's tuners, in the order they are checked, applied and rendered.
pub(super) fn for_plan(plan: &HostPlan) -> Vec<Box<dyn Tuner>> {
    let mut tuners: Vec<Box<dyn Tuner>> = vec![Box::new(Sysctl::for_plan(plan))];
    if let Some(mtu) = profile_mtu(plan.profile) {
        tuners.push(Box::new(Mtu {
            nic: plan.data_nic.clone(),
            mtu,
        }));
    }
    tuners.push(Box::new(Governor {
        severity: match plan.profile {
            // On a physical server a power-saving governor adds wake-up latency to every
            // packet; in a VM the host owns the frequency and the file is usually absent.
            Profile::Baremetal => Severity::Required,
            Profile::Azure | Profile::Test => Severity::Recommended,
        },
    }));
    tuners.push(Box::new(Irq {
        housekeeping: plan.housekeeping_cpus.iter().copied().collect(),
    }));
    tuners.push(Box::new(Nvme));
    tuners.push(Box::new(Thp));
    tuners.push(Box::new(Upgrades {
        severity: match plan.profile {
            // An appliance is upgraded by replacing its image; a bare-metal host may have
            // its own patch policy.
            Profile::Azure | Profile::Test => Severity::Required,
            Profile::Baremetal => Severity::Recommended,
        },
    }));
    tuners
}

/// The MTU a profile sets on the data NIC (`None`: left as the network has it).
#[must_use]
pub fn profile_mtu(profile: Profile) -> Option<u32> {
    match profile {
        Profile::Azure | Profile::Test => Some(AZURE_MTU),
        Profile::Baremetal => None,
    }
}

/// The interface of the IPv4 default route in `/proc/net/route`, if there is one.
#[must_use]
pub fn default_route_nic(fs: &dyn HostFs) -> Option<String> {
    let table = fs.read(Path::new(ROUTE_TABLE)).ok()?;
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        (fields.len() > 7 && fields[1] == "00000000" && fields[7] == "00000000")
            .then(|| fields[0].to_owned())
    })
}

/// `0-3,8` for {0, 1, 2, 3, 8}, the kernel's cpu-list format.
#[must_use]
pub fn cpu_list(cpus: &BTreeSet<usize>) -> String {
    let mut parts = Vec::new();
    let mut iter = cpus.iter().copied().peekable();
    while let Some(first) = iter.next() {
        let mut last = first;
        while iter.peek() == Some(&(last + 1)) {
            last += 1;
            iter.next();
        }
        parts.push(if first == last {
            first.to_string()
        } else {
            format!("{first}-{last}")
        });
    }
    parts.join(",")
}

/// Parses the kernel's cpu-list format (`0-3,8`); `None` when malformed.
#[must_use]
pub fn parse_cpu_list(text: &str) -> Option<BTreeSet<usize>> {
    let mut cpus = BTreeSet::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => {
                cpus.insert(part.parse().ok()?);
            }
        }
    }
    Some(cpus)
}

/// Why a value could not be read, as a [`Status::NotApplicable`] reason.
fn unreadable(path: &Path, error: &io::Error) -> String {
    match error.kind() {
        io::ErrorKind::NotFound => format!("no such file {}", path.display()),
        io::ErrorKind::PermissionDenied => format!("permission denied reading {}", path.display()),
        _ => format!("cannot read {}: {error}", path.display()),
    }
}

/// What a failed write means: the host does not have or allow this (n/a), or the caller must
/// do something (failed).
fn write_outcome(path: &Path, result: io::Result<()>) -> Outcome {
    let Err(error) = result else {
        return Outcome::Changed;
    };
    match (error.kind(), error.raw_os_error()) {
        (io::ErrorKind::NotFound, _) => {
            Outcome::NotApplicable(format!("no such file {}", path.display()))
        }
        (_, Some(libc::EROFS)) => {
            Outcome::NotApplicable(format!("read-only file system at {}", path.display()))
        }
        (_, Some(libc::EACCES | libc::EPERM)) => Outcome::Failed(format!(
            "permission denied writing {} (run as root)",
            path.display()
        )),
        _ => Outcome::Failed(format!("cannot write {}: {error}", path.display())),
    }
}

/// The selected word of a sysfs choice file: `none` for `[none] mq-deadline`.
fn selected(text: &str) -> &str {
    match (text.find('['), text.find(']')) {
        (Some(open), Some(close)) if open < close => &text[open + 1..close],
        _ => text.trim(),
    }
}

fn read_trimmed(fs: &dyn HostFs, path: &Path) -> io::Result<String> {
    fs.read(path).map(|text| text.trim().to_owned())
}

/// A finding for a single file compared with one wanted value.
struct FileSetting<'a> {
    tuner: &'static str,
    setting: String,
    path: &'a Path,
    severity: Severity,
    required: String,
    fix: String,
}

impl FileSetting<'_> {
    /// Reads the file, maps it with `current` (what to show) and `ok` (whether it is wanted).
    fn check(
        self,
        fs: &dyn HostFs,
        current: impl Fn(&str) -> String,
        ok: impl Fn(&str) -> bool,
    ) -> Finding {
        let (current, status) = match fs.read(self.path) {
            Ok(text) => {
                let status = if ok(&text) { Status::Ok } else { Status::Off };
                (current(&text), status)
            }
            Err(error) => (
                "-".to_owned(),
                Status::NotApplicable(unreadable(self.path, &error)),
            ),
        };
        let fix = if status == Status::Off {
            self.fix
        } else {
            String::new()
        };
        Finding {
            tuner: self.tuner,
            setting: self.setting,
            current,
            required: self.required,
            severity: self.severity,
            status,
            fix,
        }
    }
}

fn applied(tuner: &'static str, setting: &str, outcome: Outcome) -> Applied {
    Applied {
        tuner,
        setting: setting.to_owned(),
        outcome,
    }
}

// ---------------------------------------------------------------------------------------------
// sysctl

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bound {
    AtLeast,
    AtMost,
}

struct SysctlEntry {
    key: &'static str,
    bound: Bound,
    value: u64,
    severity: Severity,
}

impl SysctlEntry {
    fn path(&self) -> PathBuf {
        Path::new(PROC_SYS).join(self.key.replace('.', "/"))
    }

    fn holds(&self, current: u64) -> bool {
        match self.bound {
            Bound::AtLeast => current >= self.value,
            Bound::AtMost => current <= self.value,
        }
    }

    fn required(&self) -> String {
        match self.bound {
            Bound::AtLeast => format!(">= {}", self.value),
            Bound::AtMost => format!("<= {}", self.value),
        }
    }
}

/// Kernel settings under /proc/sys: raised to a minimum (or lowered to a maximum), never
/// moved the other way.
struct Sysctl {
    entries: Vec<SysctlEntry>,
}

impl Sysctl {
    fn for_plan(plan: &HostPlan) -> Sysctl {
        let udp_max = plan.udp_buffer_bytes.max(UDP_BUFFER_MAX_MIN);
        let entry = |key, bound, value, severity| SysctlEntry {
            key,
            bound,
            value,
            severity,
        };
        Sysctl {
            entries: vec![
                // Without these the kernel silently caps the broker's UDP buffers and drops
                // datagrams under bursts.
                entry(
                    "net.core.rmem_max",
                    Bound::AtLeast,
                    udp_max,
                    Severity::Required,
                ),
                entry(
                    "net.core.wmem_max",
                    Bound::AtLeast,
                    udp_max,
                    Severity::Required,
                ),
                entry(
                    "net.core.rmem_default",
                    Bound::AtLeast,
                    UDP_BUFFER_DEFAULT_MIN,
                    Severity::Recommended,
                ),
                entry(
                    "net.core.wmem_default",
                    Bound::AtLeast,
                    UDP_BUFFER_DEFAULT_MIN,
                    Severity::Recommended,
                ),
                entry(
                    "net.core.netdev_max_backlog",
                    Bound::AtLeast,
                    NETDEV_BACKLOG_MIN,
                    Severity::Recommended,
                ),
                entry(
                    "vm.swappiness",
                    Bound::AtMost,
                    SWAPPINESS_MAX,
                    Severity::Recommended,
                ),
                entry(
                    "fs.aio-max-nr",
                    Bound::AtLeast,
                    AIO_MAX_NR_MIN,
                    Severity::Recommended,
                ),
            ],
        }
    }

    fn finding(&self, fs: &dyn HostFs, entry: &SysctlEntry) -> Finding {
        let path = entry.path();
        FileSetting {
            tuner: self.name(),
            setting: entry.key.to_owned(),
            path: &path,
            severity: entry.severity,
            required: entry.required(),
            fix: format!("sysctl -w {}={}", entry.key, entry.value),
        }
        .check(
            fs,
            |text| text.trim().to_owned(),
            |text| text.trim().parse().is_ok_and(|v| entry.holds(v)),
        )
    }
}

impl Tuner for Sysctl {
    fn name(&self) -> &'static str {
        "sysctl"
    }

    fn check(&self, fs: &dyn HostFs) -> Vec<Finding> {
        self.entries.iter().map(|e| self.finding(fs, e)).collect()
    }

    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied> {
        let mut out = Vec::new();
        for entry in &self.entries {
            if self.finding(fs, entry).status != Status::Off {
                continue;
            }
            let path = entry.path();
            let outcome = write_outcome(&path, fs.write(&path, &format!("{}\n", entry.value)));
            out.push(applied(self.name(), entry.key, outcome));
        }
        out
    }

    fn render(&self) -> String {
        let mut out = String::from(
            "# sysctl: UDP buffers, backlog, swappiness, aio (moved to the bound, never past it)\n\
             felix_sysctl() {\n\
             \tf=$R/proc/sys/$(echo \"$1\" | tr . /)\n\
             \tif [ ! -e \"$f\" ]; then\n\
             \t\techo \"felix-tune: $1: not on this host\" >&2\n\
             \t\treturn 0\n\
             \tfi\n\
             \tcurrent=$(cat \"$f\")\n\
             \tcase $2 in\n\
             \tat-least) [ \"$current\" -lt \"$3\" ] || return 0 ;;\n\
             \tat-most) [ \"$current\" -gt \"$3\" ] || return 0 ;;\n\
             \tesac\n\
             \techo \"$3\" > \"$f\" || echo \"felix-tune: $1: cannot set\" >&2\n\
             }\n",
        );
        for entry in &self.entries {
            let bound = match entry.bound {
                Bound::AtLeast => "at-least",
                Bound::AtMost => "at-most",
            };
            out.push_str(&format!(
                "felix_sysctl {} {bound} {}\n",
                entry.key, entry.value
            ));
        }
        out
    }
}

/// `/etc/sysctl.d/90-felix.conf` for the plan: the sysctl tuner's bounds as fixed values.
pub(super) fn sysctl_conf(plan: &HostPlan) -> String {
    let mut out = format!(
        "# Felix host profile {}: written by felix (felix_tuning::host::sysctl_conf).\n",
        plan.profile
    );
    for entry in Sysctl::for_plan(plan).entries {
        out.push_str(&format!("{} = {}\n", entry.key, entry.value));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// mtu

/// The data NIC's MTU.
struct Mtu {
    nic: Option<String>,
    mtu: u32,
}

impl Mtu {
    fn nic(&self, fs: &dyn HostFs) -> Option<String> {
        self.nic.clone().or_else(|| default_route_nic(fs))
    }
}

impl Tuner for Mtu {
    fn name(&self) -> &'static str {
        "mtu"
    }

    fn check(&self, fs: &dyn HostFs) -> Vec<Finding> {
        let Some(nic) = self.nic(fs) else {
            return vec![Finding {
                tuner: self.name(),
                setting: "mtu".to_owned(),
                current: "-".to_owned(),
                required: self.mtu.to_string(),
                severity: Severity::Required,
                status: Status::NotApplicable(
                    "no data NIC: no default route in /proc/net/route and FELIX_DATA_NIC is auto"
                        .to_owned(),
                ),
                fix: String::new(),
            }];
        };
        let path = Path::new(NET_DIR).join(&nic).join("mtu");
        let wanted = self.mtu.to_string();
        vec![
            FileSetting {
                tuner: self.name(),
                setting: format!("mtu {nic}"),
                path: &path,
                severity: Severity::Required,
                required: wanted.clone(),
                fix: format!("ip link set dev {nic} mtu {}", self.mtu),
            }
            .check(
                fs,
                |text| text.trim().to_owned(),
                |text| text.trim() == wanted,
            ),
        ]
    }

    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied> {
        let Some(nic) = self.nic(fs) else {
            return Vec::new();
        };
        if self.check(fs).iter().all(|f| f.status != Status::Off) {
            return Vec::new();
        }
        let path = Path::new(NET_DIR).join(&nic).join("mtu");
        let outcome = write_outcome(&path, fs.write(&path, &format!("{}\n", self.mtu)));
        vec![applied(self.name(), &format!("mtu {nic}"), outcome)]
    }

    fn render(&self) -> String {
        let find = match &self.nic {
            Some(nic) => format!("nic={nic}\n"),
            None => "nic=$(awk '$2 == \"00000000\" && $8 == \"00000000\" { print $1; exit }' \
                     \"$R/proc/net/route\" 2>/dev/null || true)\n"
                .to_owned(),
        };
        format!(
            "# mtu: the data NIC's MTU\n{find}\
             if [ -z \"$nic\" ]; then\n\
             \techo \"felix-tune: mtu: no data NIC (no default route)\" >&2\n\
             elif [ \"$(cat \"$R/sys/class/net/$nic/mtu\")\" != {mtu} ]; then\n\
             \techo {mtu} > \"$R/sys/class/net/$nic/mtu\" || echo \"felix-tune: mtu $nic: cannot set\" >&2\n\
             fi\n",
            mtu = self.mtu
        )
    }
}

// ---------------------------------------------------------------------------------------------
// governor

/// The CPU frequency governor of every CPU.
struct Governor {
    severity: Severity,
}

impl Governor {
    const WANTED: &'static str = "performance";
    const SETTING: &'static str = "cpu frequency governor";

    /// Each CPU's `scaling_governor` file that exists.
    fn files(fs: &dyn HostFs) -> Vec<PathBuf> {
        let Ok(names) = fs.list(Path::new(CPU_DIR)) else {
            return Vec::new();
        };
        let mut cpus: Vec<usize> = names
            .iter()
            .filter_map(|n| n.strip_prefix("cpu")?.parse().ok())
            .collect();
        cpus.sort_unstable();
        cpus.into_iter()
            .map(|cpu| Path::new(CPU_DIR).join(format!("cpu{cpu}/cpufreq/scaling_governor")))
            .filter(|path| fs.read(path).is_ok())
            .collect()
    }
}

impl Tuner for Governor {
    fn name(&self) -> &'static str {
        "governor"
    }

    fn check(&self, fs: &dyn HostFs) -> Vec<Finding> {
        let files = Self::files(fs);
        let mut finding = Finding {
            tuner: self.name(),
            setting: Self::SETTING.to_owned(),
            current: "-".to_owned(),
            required: Self::WANTED.to_owned(),
            severity: self.severity,
            status: Status::NotApplicable(
                "no cpufreq under /sys/devices/system/cpu (a VM, or a fixed frequency)".to_owned(),
            ),
            fix: String::new(),
        };
        if files.is_empty() {
            return vec![finding];
        }
        let values: BTreeSet<String> = files
            .iter()
            .filter_map(|path| read_trimmed(fs, path).ok())
            .collect();
        finding.current = values.iter().cloned().collect::<Vec<_>>().join(",");
        if values.iter().all(|v| v == Self::WANTED) {
            finding.status = Status::Ok;
        } else {
            finding.status = Status::Off;
            finding.fix = "cpupower frequency-set -g performance".to_owned();
        }
        vec![finding]
    }

    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied> {
        let mut failure = None;
        let mut changed = false;
        for path in Self::files(fs) {
            if read_trimmed(fs, &path).is_ok_and(|v| v == Self::WANTED) {
                continue;
            }
            match write_outcome(&path, fs.write(&path, &format!("{}\n", Self::WANTED))) {
                Outcome::Changed => changed = true,
                other => {
                    failure.get_or_insert(other);
                }
            }
        }
        match (failure, changed) {
            (Some(outcome), _) => vec![applied(self.name(), Self::SETTING, outcome)],
            (None, true) => vec![applied(self.name(), Self::SETTING, Outcome::Changed)],
            (None, false) => Vec::new(),
        }
    }

    fn render(&self) -> String {
        "# governor: every CPU at full speed\n\
         for f in \"$R\"/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor; do\n\
         \t[ -e \"$f\" ] || continue\n\
         \tif [ \"$(cat \"$f\")\" != performance ]; then\n\
         \t\techo performance > \"$f\" || echo \"felix-tune: $f: cannot set\" >&2\n\
         \tfi\n\
         done\n"
            .to_owned()
    }
}

// ---------------------------------------------------------------------------------------------
// irq

/// A device whose interrupts should stay off the data-plane cores.
struct IrqDevice {
    name: String,
    /// The IRQs this tuner moves, with their `smp_affinity_list` files.
    irqs: Vec<u32>,
    /// IRQs left to the kernel (NVMe I/O queues: kernel-managed, one per CPU).
    managed: usize,
}

/// IRQ affinity of NIC and NVMe interrupts onto the housekeeping CPUs.
struct Irq {
    housekeeping: BTreeSet<usize>,
}

impl Irq {
    const SETTING: &'static str = "irq affinity";

    fn affinity_path(irq: u32) -> PathBuf {
        PathBuf::from(format!("/proc/irq/{irq}/smp_affinity_list"))
    }

    /// The MSI interrupts of a PCI device directory (`.../device`), sorted.
    fn msi_irqs(fs: &dyn HostFs, device: &Path) -> Vec<u32> {
        let mut irqs: Vec<u32> = fs
            .list(&device.join("msi_irqs"))
            .unwrap_or_default()
            .iter()
            .filter_map(|n| n.parse().ok())
            .collect();
        irqs.sort_unstable();
        irqs
    }

    /// Every NIC and NVMe controller with MSI interrupts.
    fn devices(fs: &dyn HostFs) -> Vec<IrqDevice> {
        let mut devices = Vec::new();
        for nic in fs.list(Path::new(NET_DIR)).unwrap_or_default() {
            let device = Path::new(NET_DIR).join(&nic).join("device");
            let mut irqs = Self::msi_irqs(fs, &device);
            // A virtio NIC's `device` is the virtio bus device; its interrupts belong to the
            // PCI function above it.
            let virtio = fs
                .read_link(&device)
                .ok()
                .and_then(|target| {
                    Some(target.file_name()?.to_string_lossy().starts_with("virtio"))
                })
                .unwrap_or(false);
            if irqs.is_empty() && virtio {
                irqs = Self::msi_irqs(fs, &device.join(".."));
            }
            if !irqs.is_empty() {
                devices.push(IrqDevice {
                    name: nic,
                    irqs,
                    managed: 0,
                });
            }
        }
        for ctrl in fs.list(Path::new(NVME_DIR)).unwrap_or_default() {
            let irqs = Self::msi_irqs(fs, &Path::new(NVME_DIR).join(&ctrl).join("device"));
            // The first vector is the admin queue; the I/O queues after it are spread over
            // all CPUs by the kernel (managed affinity: writes fail with EIO) and complete on
            // the CPU that submitted, which is what a core's own log wants.
            if let Some(&admin) = irqs.first() {
                devices.push(IrqDevice {
                    name: ctrl,
                    irqs: vec![admin],
                    managed: irqs.len() - 1,
                });
            }
        }
        devices
    }

    fn setting(device: &IrqDevice) -> String {
        let irqs: BTreeSet<usize> = device.irqs.iter().map(|&irq| irq as usize).collect();
        let mut setting = format!("{} {} (irq {}", Self::SETTING, device.name, cpu_list(&irqs));
        if device.managed > 0 {
            setting.push_str(&format!("; {} kernel-managed", device.managed));
        }
        setting.push(')');
        setting
    }

    /// The device's IRQs with their current CPUs (IRQs without an affinity file skipped).
    fn affinities(fs: &dyn HostFs, device: &IrqDevice) -> Vec<(u32, Option<BTreeSet<usize>>)> {
        device
            .irqs
            .iter()
            .filter_map(|&irq| {
                let text = fs.read(&Self::affinity_path(irq)).ok()?;
                Some((irq, parse_cpu_list(&text)))
            })
            .collect()
    }

    fn not_applicable(&self, setting: &str, why: &str) -> Finding {
        Finding {
            tuner: self.name(),
            setting: setting.to_owned(),
            current: "-".to_owned(),
            required: "-".to_owned(),
            severity: Severity::Recommended,
            status: Status::NotApplicable(why.to_owned()),
            fix: String::new(),
        }
    }
}

impl Tuner for Irq {
    fn name(&self) -> &'static str {
        "irq"
    }

    fn check(&self, fs: &dyn HostFs) -> Vec<Finding> {
        if self.housekeeping.is_empty() {
            return vec![self.not_applicable(
                Self::SETTING,
                "no housekeeping CPU: every CPU runs a data-plane core (FELIX_DATAPLANE_CORES)",
            )];
        }
        let devices = Self::devices(fs);
        if devices.is_empty() {
            return vec![
                self.not_applicable(Self::SETTING, "no NIC or NVMe device with MSI interrupts"),
            ];
        }
        let wanted = cpu_list(&self.housekeeping);
        let mut findings = Vec::new();
        for device in &devices {
            let setting = Self::setting(device);
            let affinities = Self::affinities(fs, device);
            if affinities.is_empty() {
                findings.push(self.not_applicable(&setting, "no /proc/irq/N/smp_affinity_list"));
                continue;
            }
            let mut union = BTreeSet::new();
            let mut off = false;
            for (_, cpus) in &affinities {
                match cpus {
                    Some(cpus) => {
                        off |= !cpus.is_subset(&self.housekeeping);
                        union.extend(cpus);
                    }
                    None => off = true,
                }
            }
            findings.push(Finding {
                tuner: self.name(),
                setting,
                current: cpu_list(&union),
                required: format!("within {wanted}"),
                severity: Severity::Recommended,
                status: if off { Status::Off } else { Status::Ok },
                fix: if off {
                    "felix tune --apply".to_owned()
                } else {
                    String::new()
                },
            });
        }
        findings
    }

    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied> {
        if self.housekeeping.is_empty() {
            return Vec::new();
        }
        let wanted = cpu_list(&self.housekeeping);
        let mut out = Vec::new();
        for device in Self::devices(fs) {
            let mut changed = false;
            let mut problem = None;
            for (irq, cpus) in Self::affinities(fs, &device) {
                if cpus.is_some_and(|c| c.is_subset(&self.housekeeping)) {
                    continue;
                }
                let path = Self::affinity_path(irq);
                match fs.write(&path, &format!("{wanted}\n")) {
                    Ok(()) => changed = true,
                    Err(error) if error.raw_os_error() == Some(libc::EIO) => {
                        problem.get_or_insert(Outcome::NotApplicable(format!(
                            "irq {irq}: affinity is managed by the kernel"
                        )));
                    }
                    Err(error) => {
                        problem.get_or_insert(write_outcome(&path, Err(error)));
                    }
                }
            }
            let setting = Self::setting(&device);
            match (problem, changed) {
                (Some(outcome), _) => out.push(applied(self.name(), &setting, outcome)),
                (None, true) => out.push(applied(self.name(), &setting, Outcome::Changed)),
                (None, false) => {}
            }
        }
        out
    }

    fn render(&self) -> String {
        if self.housekeeping.is_empty() {
            return "# irq: no housekeeping CPU (every CPU runs a data-plane core): nothing to move\n"
                .to_owned();
        }
        format!(
            "# irq: NIC interrupts and each NVMe admin queue onto the housekeeping CPUs\n\
             # (NVMe I/O queues are kernel-managed and stay where the kernel put them)\n\
             felix_irq() {{\n\
             \tf=$R/proc/irq/$1/smp_affinity_list\n\
             \t[ -e \"$f\" ] || return 0\n\
             \t{{ echo {cpus} > \"$f\"; }} 2>/dev/null || echo \"felix-tune: irq $1: affinity not changed\" >&2\n\
             }}\n\
             for d in \"$R\"/sys/class/net/*/device \"$R\"/sys/class/net/*/device/..; do\n\
             \tcase \"$d\" in\n\
             \t*/..) case \"$(readlink -f \"${{d%/..}}\")\" in */virtio*) ;; *) continue ;; esac ;;\n\
             \tesac\n\
             \tfor i in \"$d\"/msi_irqs/*; do\n\
             \t\t[ -e \"$i\" ] || continue\n\
             \t\tfelix_irq \"${{i##*/}}\"\n\
             \tdone\n\
             done\n\
             for d in \"$R\"/sys/class/nvme/*/device; do\n\
             \tadmin=\n\
             \tfor i in \"$d\"/msi_irqs/*; do\n\
             \t\t[ -e \"$i\" ] || continue\n\
             \t\tif [ -z \"$admin\" ] || [ \"${{i##*/}}\" -lt \"$admin\" ]; then\n\
             \t\t\tadmin=${{i##*/}}\n\
             \t\tfi\n\
             \tdone\n\
             \t[ -z \"$admin\" ] || felix_irq \"$admin\"\n\
             done\n",
            cpus = cpu_list(&self.housekeeping)
        )
    }
}

// ---------------------------------------------------------------------------------------------
// nvme

/// Block-layer settings of every NVMe namespace: no I/O scheduler and no merging (the drive
/// does its own queueing; the log's writes are already large and sequential).
struct Nvme;

impl Nvme {
    fn namespaces(fs: &dyn HostFs) -> Vec<String> {
        fs.list(Path::new(BLOCK_DIR))
            .unwrap_or_default()
            .into_iter()
            .filter(|name| name.starts_with("nvme"))
            .collect()
    }

    fn queue(disk: &str, attr: &str) -> PathBuf {
        Path::new(BLOCK_DIR).join(disk).join("queue").join(attr)
    }

    fn findings(&self, fs: &dyn HostFs, disk: &str) -> [Finding; 2] {
        let scheduler = Self::queue(disk, "scheduler");
        let nomerges = Self::queue(disk, "nomerges");
        [
            FileSetting {
                tuner: self.name(),
                setting: format!("{disk} scheduler"),
                path: &scheduler,
                severity: Severity::Recommended,
                required: "none".to_owned(),
                fix: format!("echo none > {}", scheduler.display()),
            }
            .check(fs, |t| selected(t).to_owned(), |t| selected(t) == "none"),
            FileSetting {
                tuner: self.name(),
                setting: format!("{disk} nomerges"),
                path: &nomerges,
                severity: Severity::Recommended,
                required: "2".to_owned(),
                fix: format!("echo 2 > {}", nomerges.display()),
            }
            .check(fs, |t| t.trim().to_owned(), |t| t.trim() == "2"),
        ]
    }
}

impl Tuner for Nvme {
    fn name(&self) -> &'static str {
        "nvme"
    }

    fn check(&self, fs: &dyn HostFs) -> Vec<Finding> {
        let disks = Self::namespaces(fs);
        if disks.is_empty() {
            return vec![Finding {
                tuner: self.name(),
                setting: "nvme scheduler, nomerges".to_owned(),
                current: "-".to_owned(),
                required: "none, 2".to_owned(),
                severity: Severity::Recommended,
                status: Status::NotApplicable("no NVMe drive in /sys/block".to_owned()),
                fix: String::new(),
            }];
        }
        disks.iter().flat_map(|d| self.findings(fs, d)).collect()
    }

    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied> {
        let mut out = Vec::new();
        for disk in Self::namespaces(fs) {
            let [scheduler, nomerges] = self.findings(fs, &disk);
            for (finding, attr, value) in [
                (scheduler, "scheduler", "none"),
                (nomerges, "nomerges", "2"),
            ] {
                if finding.status == Status::Off {
                    let path = Self::queue(&disk, attr);
                    let outcome = write_outcome(&path, fs.write(&path, &format!("{value}\n")));
                    out.push(applied(self.name(), &finding.setting, outcome));
                }
            }
        }
        out
    }

    fn render(&self) -> String {
        "# nvme: no I/O scheduler and no merging on NVMe namespaces\n\
         for q in \"$R\"/sys/block/nvme*/queue; do\n\
         \t[ -d \"$q\" ] || continue\n\
         \tif ! grep -q '\\[none\\]' \"$q/scheduler\"; then\n\
         \t\techo none > \"$q/scheduler\" || echo \"felix-tune: $q/scheduler: cannot set\" >&2\n\
         \tfi\n\
         \tif [ \"$(cat \"$q/nomerges\")\" != 2 ]; then\n\
         \t\techo 2 > \"$q/nomerges\" || echo \"felix-tune: $q/nomerges: cannot set\" >&2\n\
         \tfi\n\
         done\n"
            .to_owned()
    }
}

// ---------------------------------------------------------------------------------------------
// thp

/// Transparent huge pages only where a program asks (`madvise`): `always` lets khugepaged
/// compact memory behind the broker's back, a latency spike of milliseconds.
struct Thp;

impl Thp {
    const WANTED: &'static str = "madvise";
    const SETTING: &'static str = "transparent huge pages";

    fn finding(&self, fs: &dyn HostFs) -> Finding {
        FileSetting {
            tuner: self.name(),
            setting: Self::SETTING.to_owned(),
            path: Path::new(THP_ENABLED),
            severity: Severity::Recommended,
            required: Self::WANTED.to_owned(),
            fix: format!("echo {} > {THP_ENABLED}", Self::WANTED),
        }
        .check(
            fs,
            |t| selected(t).to_owned(),
            |t| selected(t) == Self::WANTED,
        )
    }
}

impl Tuner for Thp {
    fn name(&self) -> &'static str {
        "thp"
    }

    fn check(&self, fs: &dyn HostFs) -> Vec<Finding> {
        vec![self.finding(fs)]
    }

    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied> {
        if self.finding(fs).status != Status::Off {
            return Vec::new();
        }
        let path = Path::new(THP_ENABLED);
        let outcome = write_outcome(path, fs.write(path, &format!("{}\n", Self::WANTED)));
        vec![applied(self.name(), Self::SETTING, outcome)]
    }

    fn render(&self) -> String {
        format!(
            "# thp: transparent huge pages only on request\n\
             f=$R{THP_ENABLED}\n\
             if [ -e \"$f\" ] && ! grep -q '\\[{w}\\]' \"$f\"; then\n\
             \techo {w} > \"$f\" || echo \"felix-tune: $f: cannot set\" >&2\n\
             fi\n",
            w = Self::WANTED
        )
    }
}

// ---------------------------------------------------------------------------------------------
// upgrades

/// Automatic package upgrades masked (a unit linked to /dev/null in /etc/systemd/system).
struct Upgrades {
    severity: Severity,
}

impl Upgrades {
    fn link(unit: &str) -> PathBuf {
        Path::new(SYSTEMD_ETC).join(unit)
    }

    fn masked(fs: &dyn HostFs, unit: &str) -> bool {
        fs.read_link(&Self::link(unit))
            .is_ok_and(|target| target == Path::new("/dev/null"))
    }

    fn systemd(fs: &dyn HostFs) -> bool {
        fs.list(Path::new(SYSTEMD_ETC)).is_ok()
    }
}

impl Tuner for Upgrades {
    fn name(&self) -> &'static str {
        "upgrades"
    }

    fn check(&self, fs: &dyn HostFs) -> Vec<Finding> {
        let systemd = Self::systemd(fs);
        UPGRADE_UNITS
            .iter()
            .map(|unit| {
                let (current, status) = if !systemd {
                    (
                        "-",
                        Status::NotApplicable(format!("no {SYSTEMD_ETC}: not a systemd host")),
                    )
                } else if Self::masked(fs, unit) {
                    ("masked", Status::Ok)
                } else {
                    ("not masked", Status::Off)
                };
                Finding {
                    tuner: self.name(),
                    setting: format!("unit {unit}"),
                    current: current.to_owned(),
                    required: "masked".to_owned(),
                    severity: self.severity,
                    fix: if status == Status::Off {
                        format!("systemctl mask --now {unit}")
                    } else {
                        String::new()
                    },
                    status,
                }
            })
            .collect()
    }

    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied> {
        if !Self::systemd(fs) {
            return Vec::new();
        }
        let mut out = Vec::new();
        for unit in UPGRADE_UNITS {
            if Self::masked(fs, unit) {
                continue;
            }
            let link = Self::link(unit);
            let setting = format!("unit {unit}");
            let outcome = match fs.read_link(&link) {
                // A unit file or an enablement link of the operator's own: not replaced.
                Ok(target) => Outcome::Failed(format!(
                    "{} links to {}; remove it first",
                    link.display(),
                    target.display()
                )),
                Err(error) if error.kind() != io::ErrorKind::NotFound => Outcome::Failed(format!(
                    "{} exists and is not a link; remove it first",
                    link.display()
                )),
                Err(_) => write_outcome(&link, fs.symlink(Path::new("/dev/null"), &link)),
            };
            out.push(applied(self.name(), &setting, outcome));
        }
        out
    }

    fn render(&self) -> String {
        let units = UPGRADE_UNITS.join(" ");
        format!(
            "# upgrades: automatic package upgrades masked\n\
             for unit in {units}; do\n\
             \tlink=$R/etc/systemd/system/$unit\n\
             \tif [ \"$(readlink \"$link\")\" = /dev/null ]; then\n\
             \t\t:\n\
             \telif [ -e \"$link\" ] || [ -L \"$link\" ]; then\n\
             \t\techo \"felix-tune: $link is the operator's own; not replaced\" >&2\n\
             \telse\n\
             \t\tln -s /dev/null \"$link\"\n\
             \tfi\n\
             done\n\
             if [ -z \"$R\" ] && [ -d /run/systemd/system ]; then\n\
             \tsystemctl daemon-reload\n\
             \tsystemctl stop {units} || true\n\
             fi\n"
        )
    }
}
