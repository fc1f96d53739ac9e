//! The don't-fragment probe across a veth pair between two network namespaces: passes when
//! both ends have MTU 3900, fails (no reply) when the far end is 1500, fails at send (local
//! MTU) when the near end is 1500. Needs root and `ip`; skipped with a message otherwise.

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::Duration;

use felix_tuning::preflight::{Check, Outcome, df_probe};

/// Runs `ip args`; the error names the command and its stderr.
fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|error| format!("ip {}: {error}", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Two namespaces joined by a veth pair; deleting the namespaces on drop removes the pair.
struct Namespaces {
    near: String,
    far: String,
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in [&self.near, &self.far] {
            if let Err(error) = ip(&["netns", "del", name]) {
                eprintln!("cleanup: {error}");
            }
        }
    }
}

/// near (10.239.0.1/24, veth `fpn<pid>`) <-> far (10.239.0.2/24, veth `fpf<pid>`), MTU 3900.
fn setup() -> Result<Namespaces, String> {
    let pid = std::process::id();
    let namespaces = Namespaces {
        near: format!("felix-preflight-near-{pid}"),
        far: format!("felix-preflight-far-{pid}"),
    };
    ip(&["netns", "add", &namespaces.near])?;
    ip(&["netns", "add", &namespaces.far])?;
    let near_if = format!("fpn{pid}");
    let far_if = format!("fpf{pid}");
    ip(&[
        "link",
        "add",
        &near_if,
        "netns",
        &namespaces.near,
        "type",
        "veth",
        "peer",
        "name",
        &far_if,
        "netns",
        &namespaces.far,
    ])?;
    for (ns, nic, addr) in [
        (&namespaces.near, &near_if, "10.239.0.1/24"),
        (&namespaces.far, &far_if, "10.239.0.2/24"),
    ] {
        ip(&["-n", ns, "addr", "add", addr, "dev", nic])?;
        ip(&["-n", ns, "link", "set", "dev", nic, "mtu", "3900", "up"])?;
        ip(&["-n", ns, "link", "set", "dev", "lo", "up"])?;
    }
    Ok(namespaces)
}

/// `df_probe` run on a thread that has entered network namespace `ns` (setns is per-thread).
fn probe_in(ns: &str, peer: &str, size: usize) -> Check {
    let path = format!("/run/netns/{ns}");
    let peer: IpAddr = peer.parse().unwrap();
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: setns on a namespace descriptor we hold open; affects this thread only.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        df_probe(peer, size, Duration::from_secs(2))
    })
    .join()
    .unwrap()
}

#[test]
fn df_probe_across_veth() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: creating network namespaces needs root");
        return;
    }
    if Command::new("ip").arg("-V").output().is_err() {
        eprintln!("skipped: the `ip` command (iproute2) is not installed");
        return;
    }
    let namespaces = match setup() {
        Ok(namespaces) => namespaces,
        Err(error) => {
            eprintln!("skipped: cannot set up network namespaces: {error}");
            return;
        }
    };
    let pid = std::process::id();

    let pass = probe_in(&namespaces.near, "10.239.0.2", 3900);
    eprintln!("{pass:?}");
    assert_eq!(pass.outcome, Outcome::Pass, "{pass:?}");

    // The far end drops the 3900-byte packets its 1500 MTU cannot take: no reply.
    ip(&[
        "-n",
        &namespaces.far,
        "link",
        "set",
        "dev",
        &format!("fpf{pid}"),
        "mtu",
        "1500",
    ])
    .unwrap();
    let no_reply = probe_in(&namespaces.near, "10.239.0.2", 3900);
    eprintln!("{no_reply:?}");
    assert_eq!(no_reply.outcome, Outcome::Fail, "{no_reply:?}");
    assert!(
        no_reply.detail.starts_with("no reply to a 3900-byte"),
        "{no_reply:?}"
    );
    let small = probe_in(&namespaces.near, "10.239.0.2", 1500);
    assert_eq!(small.outcome, Outcome::Pass, "{small:?}");

    // The near end refuses to send a don't-fragment packet above its own MTU.
    ip(&[
        "-n",
        &namespaces.near,
        "link",
        "set",
        "dev",
        &format!("fpn{pid}"),
        "mtu",
        "1500",
    ])
    .unwrap();
    let local = probe_in(&namespaces.near, "10.239.0.2", 3900);
    eprintln!("{local:?}");
    assert_eq!(local.outcome, Outcome::Fail, "{local:?}");
    assert!(
        local.detail.starts_with("local MTU below 3900"),
        "{local:?}"
    );

    // The unprivileged datagram socket path, once the namespace allows it.
    let ping_range = Command::new("ip")
        .args(["netns", "exec", &namespaces.near, "sysctl", "-qw"])
        .arg("net.ipv4.ping_group_range=0 2147483647")
        .status();
    if ping_range.is_ok_and(|status| status.success()) {
        let dgram = probe_in(&namespaces.near, "10.239.0.2", 1500);
        eprintln!("{dgram:?}");
        assert_eq!(dgram.outcome, Outcome::Pass, "{dgram:?}");
        assert!(dgram.detail.ends_with("(datagram socket)"), "{dgram:?}");
        let dgram_local = probe_in(&namespaces.near, "10.239.0.2", 3900);
        assert_eq!(dgram_local.outcome, Outcome::Fail, "{dgram_local:?}");
    } else {
        eprintln!("not testing the datagram socket: cannot set ping_group_range");
    }
}
