//! Host commands: `felix tune` (check, apply or print the host settings of a profile) and
//! `felix preflight` (the checks a node must pass before taking load). The tuners and checks
//! live in felix-tuning (`host`, `preflight`); this module picks them for the configured
//! profile and prints them. docs/operations.md describes both.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use felix_tuning::Config;
use felix_tuning::host::{self, HostPlan, Profile, RealFs};
use felix_tuning::preflight::{self, Check, Outcome};

/// Bytes written by each disk probe of `felix preflight`: enough for a stable rate, small
/// enough to take a second or two on a slow disk.
const PROBE_BYTES: u64 = 64 << 20;
/// How long each don't-fragment probe waits for its echo reply (three tries).
const DF_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Options of `felix tune` besides its subcommands.
#[derive(Debug, Args)]
pub(crate) struct TuneArgs {
    /// Check the host and print a table; exit non-zero when a required setting is off (the
    /// default).
    #[arg(long, conflicts_with_all = ["apply", "script"])]
    check: bool,
    /// Change the host (as root), then check again.
    #[arg(long, conflicts_with = "script")]
    apply: bool,
    /// Print the shell script that would apply the profile.
    #[arg(long)]
    script: bool,
    /// The host profile (FELIX_HOST_PROFILE): azure, baremetal or test.
    #[arg(long, value_name = "PROFILE")]
    pub(crate) profile: Option<String>,
}

/// Options of `felix preflight`.
#[derive(Debug, Args)]
pub(crate) struct PreflightArgs {
    /// One JSON array instead of lines.
    #[arg(long)]
    json: bool,
    /// A peer to send a full-size don't-fragment probe to (repeatable).
    #[arg(long = "peer", value_name = "IP")]
    peers: Vec<IpAddr>,
    /// The host profile (FELIX_HOST_PROFILE): azure, baremetal or test.
    #[arg(long, value_name = "PROFILE")]
    pub(crate) profile: Option<String>,
    /// Minimum sequential write rate with fdatasync after each 256 KiB write, MB/s
    /// (default: the profile's).
    #[arg(long, value_name = "MB_PER_S")]
    min_write_mbps: Option<f64>,
    /// Largest p99 of a 4 KiB write plus fdatasync, milliseconds (default: the profile's).
    #[arg(long, value_name = "MS")]
    max_fsync_p99_ms: Option<u64>,
    /// Least free space on the data volume, GiB.
    #[arg(long, value_name = "GIB", default_value_t = 4)]
    min_free_gib: u64,
    /// Skip the disk probes (they write 2 x 64 MiB into the data directory).
    #[arg(long)]
    no_disk_probe: bool,
}

/// What the host should look like under `config`'s profile.
pub(crate) fn host_plan(config: &Config) -> anyhow::Result<HostPlan> {
    let profile: Profile = config
        .host_profile
        .parse()
        .map_err(|error| anyhow::anyhow!("FELIX_HOST_PROFILE: {error}"))?;
    // Housekeeping and IRQs get the CPUs the core plan leaves free (none when every CPU
    // runs the data plane).
    let (dataplane_cpus, housekeeping_cpus) = match felix_broker::core_plan(config) {
        Ok(plan) => {
            let dataplane: Vec<usize> = plan.cores().iter().map(|core| core.cpu.os_index).collect();
            let housekeeping = plan
                .topology()
                .cpus
                .iter()
                .map(|cpu| cpu.os_index)
                .filter(|cpu| !dataplane.contains(cpu))
                .collect();
            (dataplane, housekeeping)
        }
        Err(_) => (Vec::new(), Vec::new()),
    };
    Ok(HostPlan {
        profile,
        udp_buffer_bytes: config.udp_recv_buffer.max(config.udp_send_buffer),
        data_nic: (config.data_nic != "auto").then(|| config.data_nic.clone()),
        housekeeping_cpus,
        dataplane_cpus,
    })
}

/// `felix tune --check | --apply | --script`. Returns whether every required setting is on.
pub(crate) fn tune(config: &Config, args: &TuneArgs) -> anyhow::Result<bool> {
    let plan = host_plan(config)?;
    if args.script {
        print!("{}", host::render_script(&plan));
        return Ok(true);
    }
    // --check conflicts with the others; it is what runs when neither is given.
    if args.apply && !args.check {
        let applied = host::apply(&plan, &RealFs);
        for change in &applied {
            match &change.outcome {
                host::Outcome::Changed => println!("set {}", change.setting),
                host::Outcome::NotApplicable(why) => println!("left {}: {why}", change.setting),
                host::Outcome::Failed(why) => println!("could not set {}: {why}", change.setting),
            }
        }
        let masked = applied
            .iter()
            .any(|c| c.tuner == "upgrades" && c.outcome == host::Outcome::Changed);
        if masked {
            stop_masked_units();
        }
        if !applied.is_empty() {
            println!();
        }
    }
    let findings = host::check(&plan, &RealFs);
    print!("{}", host::render_table(&findings));
    let off: Vec<_> = host::required_off(&findings).collect();
    if off.is_empty() {
        println!("\nprofile {}: every required setting is on", plan.profile);
        Ok(true)
    } else {
        println!(
            "\nprofile {}: {} required setting(s) off; `felix tune --apply` (as root) or \
             `felix tune --script` fixes them",
            plan.profile,
            off.len()
        );
        Ok(false)
    }
}

/// After masking the upgrade units: makes systemd see the masks and stops what is running
/// (as the rendered script does). Nothing to do on a host without systemd.
fn stop_masked_units() {
    if !std::path::Path::new("/run/systemd/system").is_dir() {
        return;
    }
    let run = |args: &[&str]| match std::process::Command::new("systemctl").args(args).status() {
        Ok(status) if status.success() => {}
        Ok(status) => println!("systemctl {}: {status}", args.join(" ")),
        Err(error) => println!("systemctl {}: {error}", args.join(" ")),
    };
    run(&["daemon-reload"]);
    let mut stop = vec!["stop"];
    stop.extend(host::UPGRADE_UNITS);
    run(&stop);
}

/// Logs, once at broker start-up, each required host setting that is off, with its fix.
/// Never refuses to start.
pub(crate) fn log_host_settings(config: &Config) {
    let plan = match host_plan(config) {
        Ok(plan) => plan,
        Err(error) => {
            tracing::warn!("host check skipped: {error:#}");
            return;
        }
    };
    let findings = host::check(&plan, &RealFs);
    for finding in host::required_off(&findings) {
        tracing::warn!(
            "host setting {} is {} (profile {} requires {}); fix: {}",
            finding.setting,
            finding.current,
            plan.profile,
            finding.required,
            finding.fix
        );
    }
}

/// The profile's disk minimums: (MB/s of 256 KiB writes with fdatasync, p99 of a 4 KiB
/// write plus fdatasync). Azure's local NVMe RAID0 does well over 1 GB/s; a bare-metal NVMe
/// at least a few hundred MB/s; the test image runs on emulated disks.
fn disk_minimums(profile: Profile) -> (f64, Duration) {
    match profile {
        Profile::Azure => (500.0, Duration::from_millis(5)),
        Profile::Baremetal => (200.0, Duration::from_millis(10)),
        Profile::Test => (1.0, Duration::from_secs(1)),
    }
}

/// `felix preflight`. Returns whether every check passed (warnings pass).
pub(crate) fn preflight(config: &Config, args: &PreflightArgs) -> anyhow::Result<bool> {
    let plan = host_plan(config)?;
    let mut checks = Vec::new();
    // The tuners' required settings, one line each, and the upgrade units on every profile
    // (a warning where masking them is only recommended).
    for finding in host::check(&plan, &RealFs) {
        let required = finding.severity == host::Severity::Required;
        // The MTU has its own check below (the NIC, then the path to each peer).
        if (!required && finding.tuner != "upgrades") || finding.tuner == "mtu" {
            continue;
        }
        let (outcome, detail) = match &finding.status {
            host::Status::Ok => (Outcome::Pass, finding.current.clone()),
            host::Status::Off => (
                if required {
                    Outcome::Fail
                } else {
                    Outcome::Warn
                },
                format!(
                    "{} ({} {}); fix: {}",
                    finding.current, finding.severity, finding.required, finding.fix
                ),
            ),
            host::Status::NotApplicable(why) => (Outcome::Skip, why.clone()),
        };
        checks.push(Check::new(finding.setting.clone(), outcome, detail));
    }
    // The data NIC and the path to each peer at the profile's MTU.
    let nic = plan
        .data_nic
        .clone()
        .or_else(|| host::default_route_nic(&RealFs));
    let mtu = host::profile_mtu(plan.profile);
    match (&nic, mtu) {
        (Some(nic), Some(required)) => checks.push(preflight::mtu_check(nic, required)),
        (Some(nic), None) => checks.push(match preflight::nic_mtu(nic) {
            Ok(current) => Check::new(format!("mtu {nic}"), Outcome::Pass, current.to_string()),
            Err(error) => Check::new(format!("mtu {nic}"), Outcome::Skip, error.to_string()),
        }),
        (None, _) => checks.push(Check::new(
            "mtu",
            Outcome::Skip,
            "no data NIC: no default route, and FELIX_DATA_NIC is auto",
        )),
    }
    let probe_size = match (mtu, &nic) {
        (Some(required), _) => Some(required as usize),
        (None, Some(nic)) => preflight::nic_mtu(nic).ok().map(|mtu| mtu as usize),
        (None, None) => None,
    };
    for peer in &args.peers {
        checks.push(match probe_size {
            Some(size) => preflight::df_probe(*peer, size, DF_PROBE_TIMEOUT),
            None => Check::new(format!("path mtu {peer}"), Outcome::Skip, "no MTU to probe"),
        });
    }
    // The data volume.
    let dir = &config.data_dir;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the data directory {}", dir.display()))?;
    let azure = plan.profile == Profile::Azure;
    checks.push(preflight::data_volume_check(
        dir,
        azure,
        azure.then_some("Microsoft NVMe Direct Disk"),
    ));
    if !args.no_disk_probe {
        let (min_mbps, max_p99) = disk_minimums(plan.profile);
        let min_mbps = args.min_write_mbps.unwrap_or(min_mbps);
        let max_p99 = args.max_fsync_p99_ms.map_or(max_p99, Duration::from_millis);
        checks.push(preflight::write_rate(dir, PROBE_BYTES, min_mbps));
        checks.push(preflight::fdatasync_latency(dir, PROBE_BYTES / 16, max_p99));
    }
    checks.push(preflight::free_space(dir, args.min_free_gib << 30));
    let mut clock = preflight::clock_sync();
    if plan.profile == Profile::Test && clock.outcome == Outcome::Fail {
        // The test image boots without a time source.
        clock.outcome = Outcome::Warn;
    }
    checks.push(clock);
    if args.json {
        print!("{}", preflight::render_json(&checks));
    } else {
        print!("{}", preflight::render_lines(&checks));
    }
    Ok(!preflight::failed(&checks))
}
