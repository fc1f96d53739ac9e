//! Pinning the calling thread, reading its affinity mask, and per-thread CPU time.

use std::fmt;
use std::path::PathBuf;

use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::time::{ClockId, clock_gettime};
use nix::unistd::{Pid, SysconfVar, sysconf};

use crate::AffinityError;
use crate::cpulist::CPU_INDEX_MAX;

/// Pins the calling thread to one CPU (`sched_setaffinity` on the calling thread only).
///
/// Call it first thing on each data-plane thread. A CPU above [`CPU_INDEX_MAX`], offline, or
/// outside the process's cgroup is an error; the thread's mask is then unchanged.
pub fn pin_current_thread(os_cpu: usize) -> Result<(), AffinityError> {
    let mut set = CpuSet::new();
    set.set(os_cpu)
        .map_err(|_| AffinityError::CpuIndexOutOfRange {
            cpu: os_cpu,
            max: CPU_INDEX_MAX,
        })?;
    // Pid 0 means the calling thread, not the whole process.
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|source| AffinityError::Syscall {
        call: "sched_setaffinity",
        source,
    })
}

/// The CPUs the calling thread may run on, ascending (`sched_getaffinity`).
///
/// On an unpinned thread (e.g. the main thread before any pinning) this is the process's
/// mask; on a pinned data-plane thread it is that thread's one CPU.
pub fn current_thread_allowed_cpus() -> Result<Vec<usize>, AffinityError> {
    let set = sched_getaffinity(Pid::from_raw(0)).map_err(|source| AffinityError::Syscall {
        call: "sched_getaffinity",
        source,
    })?;
    // is_set fails only for an index >= CpuSet::count(), which the range excludes.
    Ok((0..CpuSet::count())
        .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
        .collect())
}

/// CPU time (user + system) the calling thread has used, in seconds
/// (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`, nanosecond resolution).
pub fn thread_cpu_seconds() -> Result<f64, AffinityError> {
    let time = clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).map_err(|source| {
        AffinityError::Syscall {
            call: "clock_gettime(CLOCK_THREAD_CPUTIME_ID)",
            source,
        }
    })?;
    Ok(time.tv_sec() as f64 + time.tv_nsec() as f64 / 1e9)
}

/// A kernel thread id (`gettid`), the name of a thread in /proc/self/task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tid(pub i32);

impl Tid {
    /// The calling thread's id. A data-plane thread records it at start so the broker can read
    /// its CPU time from another thread.
    pub fn current() -> Tid {
        Tid(nix::unistd::gettid().as_raw())
    }
}

impl fmt::Display for Tid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// CPU time (user + system) used by a thread of this process, in seconds, from
/// `/proc/self/task/<tid>/stat` (resolution: one clock tick, usually 10 ms).
///
/// Callable from any thread, e.g. the metrics thread sampling each data-plane core once a
/// second. A thread that has exited is a read error.
pub fn thread_cpu_seconds_of(tid: Tid) -> Result<f64, AffinityError> {
    let path = PathBuf::from(format!("/proc/self/task/{tid}/stat"));
    let text = std::fs::read_to_string(&path).map_err(|source| AffinityError::Read {
        path: path.clone(),
        source,
    })?;
    let ticks = proc_stat_cpu_ticks(&text).map_err(|detail| AffinityError::Parse {
        path: path.clone(),
        detail,
    })?;
    let ticks_per_second = match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(hz)) if hz > 0 => hz,
        Ok(_) => {
            return Err(AffinityError::Parse {
                path,
                detail: "sysconf(_SC_CLK_TCK) gave no positive tick rate".to_string(),
            });
        }
        Err(source) => {
            return Err(AffinityError::Syscall {
                call: "sysconf(_SC_CLK_TCK)",
                source,
            });
        }
    };
    Ok(ticks as f64 / ticks_per_second as f64)
}

/// utime + stime (fields 14 and 15 of proc(5) `stat`), in clock ticks.
///
/// The command name (field 2) is in parentheses and may itself hold spaces and `)`, so the
/// fields are counted from the last `)`.
fn proc_stat_cpu_ticks(stat: &str) -> Result<u64, String> {
    /// Index of utime among the fields after the command name (field 3, state, is index 0).
    const UTIME_AFTER_COMM: usize = 14 - 3;
    let (_, rest) = stat
        .rsplit_once(')')
        .ok_or_else(|| "no ')' closing the command name".to_string())?;
    let mut fields = rest.split_whitespace().skip(UTIME_AFTER_COMM);
    let mut next_ticks = |name: &str| -> Result<u64, String> {
        let field = fields.next().ok_or_else(|| format!("no {name} field"))?;
        field
            .parse::<u64>()
            .map_err(|_| format!("{name} field {field:?} is not a tick count"))
    };
    let utime = next_ticks("utime")?;
    let stime = next_ticks("stime")?;
    utime
        .checked_add(stime)
        .ok_or_else(|| "utime + stime overflows".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_parser_counts_fields_from_the_last_paren() {
        // Proves utime+stime are found even when the thread name holds spaces and parens.
        let stat = "4242 (felix) core (0)) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    123 45 0 0 20 0 3 0 777 1000 50 18446744073709551615";
        assert_eq!(proc_stat_cpu_ticks(stat), Ok(168));
    }

    #[test]
    fn proc_stat_parser_rejects_truncated_lines() {
        // Proves a short or malformed stat line is an error, not a panic or a zero.
        assert!(proc_stat_cpu_ticks("4242 felix S 1").is_err());
        assert!(proc_stat_cpu_ticks("4242 (felix) S 1 2 3").is_err());
        assert!(proc_stat_cpu_ticks("4242 (felix) S 1 1 1 0 -1 0 0 0 0 0 x 4").is_err());
    }
}
