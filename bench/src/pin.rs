//! The pinned method: the server under test on one CPU set, the load generator on another.
//!
//! On a small machine the generator competes with the broker for the same CPUs, and a cell then
//! measures whichever of the two ran out first. With `server_cpus` and `generator_cpus` in a
//! plan's settings (or `--server-cpus` / `--generator-cpus`), every broker the runner starts
//! (Felix and nats-server alike) gets the server set as its affinity mask before it executes,
//! and every thread of the `felix-bench` process (runtime workers, sampler, runner) is moved to
//! the generator set. Felix's core plan follows the mask it starts with (one data-plane core per
//! allowed CPU); the Go runtime sizes GOMAXPROCS from it.
//!
//! Each cell then records how many server CPUs there were, and the report says per cell whether
//! the server used them up (server-bound: at least [`SERVER_BOUND_FRACTION`] of them) or the
//! generator was the limit, with the server's CPU-seconds per GB and per million records.

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sched::{CpuSet, sched_setaffinity};
use nix::unistd::Pid;

use crate::BenchError;

/// A cell is server-bound when the broker used at least this fraction of its CPUs (the median
/// one-second rate of its CPU time over the steady window). Below it, something else (the
/// generator, the disk, the network, pacing) limited the rate.
pub const SERVER_BOUND_FRACTION: f64 = 0.95;

/// Parses a kernel CPU list (`0`, `0-3,8`) from a plan or a flag; empty is an error.
pub fn parse_cpus(what: &str, text: &str) -> Result<Vec<usize>, BenchError> {
    let cpus = felix_affinity::parse_cpu_list(text)
        .map_err(|why| BenchError::Plan(format!("{what}: {why} (in {text:?})")))?;
    if cpus.is_empty() {
        return Err(BenchError::Plan(format!(
            "{what}: names no CPU (expected a list such as 0 or 0-3,8)"
        )));
    }
    Ok(cpus)
}

fn cpu_set(cpus: &[usize]) -> Result<CpuSet, BenchError> {
    let mut set = CpuSet::new();
    for &cpu in cpus {
        set.set(cpu)
            .map_err(|e| BenchError::Plan(format!("CPU {cpu} cannot be pinned: {e}")))?;
    }
    Ok(set)
}

/// Moves every thread of this process onto `cpus` (threads created later inherit the mask of
/// the thread creating them, so the generator's runtime and helper threads stay there).
pub fn pin_this_process(cpus: &[usize]) -> Result<(), BenchError> {
    let set = cpu_set(cpus)?;
    let tasks = std::fs::read_dir("/proc/self/task")
        .map_err(|e| BenchError::io(std::path::Path::new("/proc/self/task"), e))?;
    for task in tasks {
        let Ok(task) = task else { continue };
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<i32>().ok())
        else {
            continue;
        };
        match sched_setaffinity(Pid::from_raw(tid), &set) {
            Ok(()) => {}
            // A thread that exited since the directory was read.
            Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => {
                return Err(BenchError::Plan(format!(
                    "cannot pin the load generator to CPUs {}: sched_setaffinity: {e} \
                     (are they online and in this cgroup?)",
                    felix_affinity::format_cpu_list(cpus)
                )));
            }
        }
    }
    Ok(())
}

/// Makes `command`'s process start with `cpus` as its affinity mask (set in the child between
/// fork and exec, so the server's first thread already has it).
pub fn pin_command(command: &mut Command, cpus: &[usize]) -> Result<(), BenchError> {
    let set = cpu_set(cpus)?;
    // SAFETY: the closure runs in the forked child before exec; it calls only
    // sched_setaffinity(2) (a plain system call, async-signal-safe) on a set built before the
    // fork, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            sched_setaffinity(Pid::from_raw(0), &set).map_err(std::io::Error::from)
        });
    }
    Ok(())
}

/// CPUs this process may run on now (the count the report divides by when nothing is pinned).
pub fn allowed_cpu_count() -> usize {
    felix_affinity::current_thread_allowed_cpus()
        .map(|cpus| cpus.len())
        .unwrap_or(0)
        .max(1)
}

/// Whether a server that used `cores_used` of `server_cpus` CPUs was the limit.
pub fn server_bound(cores_used: f64, server_cpus: usize) -> bool {
    server_cpus > 0 && cores_used >= SERVER_BOUND_FRACTION * server_cpus as f64
}

/// `server` when every finished trial was server-bound, `generator` when none was, `mixed`
/// otherwise; `None` without trials.
pub fn limit_label(server_bound_trials: usize, trials: usize) -> Option<&'static str> {
    match server_bound_trials {
        _ if trials == 0 => None,
        n if n == trials => Some("server"),
        0 => Some("generator"),
        _ => Some("mixed"),
    }
}

/// Server CPU-seconds per GB (10^9 payload bytes) at `cores_used` and `bytes_per_s`.
pub fn cpu_seconds_per_gb(cores_used: f64, bytes_per_s: f64) -> Option<f64> {
    (bytes_per_s > 0.0).then(|| cores_used / (bytes_per_s / 1e9))
}

/// Server CPU-seconds per million records at `cores_used` and `records_per_s`.
pub fn cpu_seconds_per_million_records(cores_used: f64, records_per_s: f64) -> Option<f64> {
    (records_per_s > 0.0).then(|| cores_used / (records_per_s / 1e6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_empty_is_refused() {
        assert_eq!(parse_cpus("server_cpus", "0").unwrap(), vec![0]);
        assert_eq!(
            parse_cpus("server_cpus", "0-2,5").unwrap(),
            vec![0, 1, 2, 5]
        );
        let e = parse_cpus("settings: server_cpus", " ").unwrap_err();
        assert!(e.to_string().contains("server_cpus: names no CPU"), "{e}");
        let e = parse_cpus("settings: generator_cpus", "3-1").unwrap_err();
        assert!(e.to_string().contains("generator_cpus"), "{e}");
    }

    #[test]
    fn bound_and_per_unit_costs() {
        assert!(server_bound(0.96, 1));
        assert!(!server_bound(0.94, 1));
        assert!(server_bound(1.9, 2));
        assert!(!server_bound(1.0, 0));
        // 0.5 cores at 250 MB/s: 2 CPU-seconds per GB; at 1 M records/s: 0.5 per million.
        assert_eq!(cpu_seconds_per_gb(0.5, 250e6), Some(2.0));
        assert_eq!(cpu_seconds_per_million_records(0.5, 1e6), Some(0.5));
        assert_eq!(cpu_seconds_per_gb(0.5, 0.0), None);
    }

    #[test]
    fn a_pinned_child_starts_with_the_mask() {
        let allowed = felix_affinity::current_thread_allowed_cpus().unwrap();
        let cpu = allowed[0];
        let mut command = Command::new("grep");
        command.args(["Cpus_allowed_list", "/proc/self/status"]);
        pin_command(&mut command, &[cpu]).unwrap();
        let output = command.output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            text.split_whitespace().last(),
            Some(cpu.to_string().as_str())
        );
    }
}
