//! Host tuners: the kernel and system settings a broker node wants, each defined once with a
//! [`Tuner::check`] (what the host has), a [`Tuner::apply`] (change what is off) and a
//! [`Tuner::render`] (the same change as POSIX shell). `felix tune --check/--apply/--script`,
//! the broker's start-up warnings ([`required_off`]) and the VM image build all use these
//! definitions, so the three can not drift apart. See docs/operations.md for the table of
//! settings and why each matters.
//!
//! All `/proc`, `/sys` and `/etc/systemd` access goes through [`HostFs`]: [`RealFs`] on a host,
//! [`MemFs`] (in memory) or [`RootFs`] (a copy of the trees under a folder) in tests. A setting the host does not have (cpufreq in a VM, no NVMe drive, a
//! read-only `/proc/sys` in a container) is [`Status::NotApplicable`] with the reason instead
//! of an error. Numeric sysctls compare "at least" (`vm.swappiness` "at most"); everything else
//! compares equal. [`render`](Tuner::render) depends only on the [`HostPlan`]; devices are found
//! at run time by shell loops and globs, while check and apply look at the actual tree.
//!
//! The `baremetal` profile has no MTU tuner: the NIC's MTU there is whatever the network is
//! built for, so preflight reports it and nothing here sets it.

mod fs;
mod tuners;

#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;

pub use fs::{HostFs, MemFs, RealFs, RootFs};
pub use tuners::{
    AZURE_MTU, UDP_BUFFER_MAX_MIN, UPGRADE_UNITS, cpu_list, default_route_nic, parse_cpu_list,
    profile_mtu,
};

/// Which kind of host the node runs on; selects the tuners and their severities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// Storage-optimized Azure L-series VMs (MTU 3900, local NVMe).
    Azure,
    /// Physical servers: the governor must be `performance`, the MTU is left alone.
    Baremetal,
    /// The appliance image's self-test VM (MTU 3900 on its virtio NIC).
    Test,
}

impl Profile {
    /// Every profile, in the order they are documented.
    pub const ALL: [Profile; 3] = [Profile::Azure, Profile::Baremetal, Profile::Test];

    /// The name used in configuration and on the command line.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Azure => "azure",
            Profile::Baremetal => "baremetal",
            Profile::Test => "test",
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Profile {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Profile::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Profile::ALL.iter().map(|p| p.as_str()).collect();
                format!(
                    "unknown host profile {s:?}: expected one of {}",
                    names.join(", ")
                )
            })
    }
}

/// How much a setting matters. Only required settings that are off fail `felix tune --check`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Better performance; the broker works without it.
    Recommended,
    /// The broker drops data or misses its latency targets without it.
    Required,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Recommended => "recommended",
            Severity::Required => "required",
        })
    }
}

/// What the caller knows about the host, from the configuration and the core plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPlan {
    /// The host profile.
    pub profile: Profile,
    /// The broker's larger configured UDP buffer (SO_RCVBUF/SO_SNDBUF), in bytes.
    pub udp_buffer_bytes: u64,
    /// The data NIC; `None` detects it as the interface of the default route in
    /// `/proc/net/route` (at run time in the rendered script).
    pub data_nic: Option<String>,
    /// The CPUs the core plan leaves to housekeeping and interrupts (may be empty).
    pub housekeeping_cpus: Vec<usize>,
    /// The CPUs running data-plane cores; no interrupt should land on one.
    pub dataplane_cpus: Vec<usize>,
}

/// The state of one setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// The host has the wanted value.
    Ok,
    /// The host has another value; the finding's `fix` changes it.
    Off,
    /// The setting can not be checked or changed here, with the reason (`"no such file
    /// /sys/..."`, `"permission denied"`, `"no housekeeping CPU: ..."`).
    NotApplicable(String),
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Ok => f.write_str("ok"),
            Status::Off => f.write_str("OFF"),
            Status::NotApplicable(why) => write!(f, "n/a: {why}"),
        }
    }
}

/// One checked setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The tuner's name ([`Tuner::name`]).
    pub tuner: &'static str,
    /// The setting, e.g. `net.core.rmem_max`, `mtu eth0`, `irq 45 (nvme0q1) affinity`.
    pub setting: String,
    /// What the host has (`-` when it could not be read).
    pub current: String,
    /// What is wanted, e.g. `>= 26214400`, `none`, `0-1`.
    pub required: String,
    /// How much it matters.
    pub severity: Severity,
    /// Whether the host has it.
    pub status: Status,
    /// One shell command that fixes it (empty when there is nothing to fix).
    pub fix: String,
}

/// What [`Tuner::apply`] did to one setting that was off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The new value was written.
    Changed,
    /// The host does not allow this change and that is expected, with the reason (a managed
    /// NVMe IRQ refusing a new affinity, a read-only `/proc/sys`, a file that went away).
    NotApplicable(String),
    /// The change failed, with the reason (e.g. `permission denied`: not run as root).
    Failed(String),
}

/// One change attempted by [`Tuner::apply`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The tuner's name.
    pub tuner: &'static str,
    /// The setting, as in [`Finding::setting`].
    pub setting: String,
    /// What happened.
    pub outcome: Outcome,
}

/// One group of related settings.
pub trait Tuner {
    /// A short name (`sysctl`, `mtu`, `governor`, `irq`, `nvme`, `thp`, `upgrades`).
    fn name(&self) -> &'static str;
    /// Reads the host's current values.
    fn check(&self, fs: &dyn HostFs) -> Vec<Finding>;
    /// Writes the wanted value of every setting that is [`Status::Off`]; the caller checks
    /// again afterwards.
    fn apply(&self, fs: &dyn HostFs) -> Vec<Applied>;
    /// The same change as POSIX shell, one part of [`render_script`]; ends with a newline.
    fn render(&self) -> String;
}

/// The profile's tuners, in the order they are checked, applied and rendered.
#[must_use]
pub fn tuners(plan: &HostPlan) -> Vec<Box<dyn Tuner>> {
    tuners::for_plan(plan)
}

/// Checks every tuner of the plan's profile.
#[must_use]
pub fn check(plan: &HostPlan, fs: &dyn HostFs) -> Vec<Finding> {
    tuners(plan).iter().flat_map(|t| t.check(fs)).collect()
}

/// Applies every tuner of the plan's profile; returns one entry per setting that was off.
#[must_use]
pub fn apply(plan: &HostPlan, fs: &dyn HostFs) -> Vec<Applied> {
    tuners(plan).iter().flat_map(|t| t.apply(fs)).collect()
}

/// The shell script that applies the plan's profile (`felix tune --script`, the image build).
#[must_use]
pub fn render_script(plan: &HostPlan) -> String {
    let mut out = format!(
        "#!/bin/sh\n\
         # Generated by `felix tune --script` for the {} profile. FELIX_TUNE_ROOT=DIR applies it\n\
         # to a copy of /proc, /sys and /etc under DIR instead of this host (tests, image builds).\n\
         set -eu\n\
         R=${{FELIX_TUNE_ROOT:-}}\n",
        plan.profile
    );
    for tuner in tuners(plan) {
        out.push('\n');
        out.push_str(&tuner.render());
    }
    out
}

/// The contents of `/etc/sysctl.d/90-felix.conf`: the sysctl tuner's values, so they survive
/// a reboot.
#[must_use]
pub fn sysctl_conf(plan: &HostPlan) -> String {
    tuners::sysctl_conf(plan)
}

/// The findings as a table with aligned columns SETTING, CURRENT, REQUIRED, SEVERITY, STATUS.
#[must_use]
pub fn render_table(findings: &[Finding]) -> String {
    let mut rows = vec![["SETTING", "CURRENT", "REQUIRED", "SEVERITY", "STATUS"].map(String::from)];
    rows.extend(findings.iter().map(|f| {
        [
            f.setting.clone(),
            f.current.clone(),
            f.required.clone(),
            f.severity.to_string(),
            f.status.to_string(),
        ]
    }));
    let mut widths = [0; 5];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(widths) {
            line.push_str(&format!("{cell:width$}  "));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The required settings that are off: what makes `felix tune --check` exit non-zero and what
/// the broker warns about at start-up.
pub fn required_off(findings: &[Finding]) -> impl Iterator<Item = &Finding> {
    findings
        .iter()
        .filter(|f| f.severity == Severity::Required && f.status == Status::Off)
}
