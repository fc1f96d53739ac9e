//! Against this machine: hwloc and sysfs topology, pinning, per-thread CPU time.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use felix_affinity::{
    AffinityError, CPU_INDEX_MAX, CorePlan, PlanOptions, Tid, Topology, TopologySource,
    current_thread_allowed_cpus, pin_current_thread, thread_cpu_seconds, thread_cpu_seconds_of,
};

/// CPU time the burner thread spends before it reports: long enough that tick-resolution
/// accounting in /proc (10 ms ticks at the usual 100 Hz) cannot round it to zero.
const BURN_CPU_SECONDS: f64 = 0.3;

/// How far /proc may lag the thread's own clock: utime and stime are each truncated to a
/// tick (10 ms at the USER_HZ of 100 that /proc uses), plus one tick of margin for rounding.
const PROC_TICK_SLACK_SECONDS: f64 = 0.03;

/// How long an exited thread's /proc entry may linger after join() returns (join wakes when
/// the kernel clears the tid, slightly before the task is released).
const EXITED_TASK_DEADLINE: Duration = Duration::from_secs(30);

#[test]
fn hwloc_sees_cpus_and_agrees_with_sysfs() {
    // Proves hwloc finds at least one CPU and the same usable CPU set as the sysfs fallback.
    let hwloc = Topology::detect_hwloc().expect("hwloc loads this machine's topology");
    let sysfs = Topology::detect_sysfs().expect("sysfs describes this machine");
    assert_eq!(hwloc.source, TopologySource::Hwloc);
    assert_eq!(sysfs.source, TopologySource::Sysfs);
    assert!(!hwloc.cpus.is_empty());
    assert_eq!(hwloc.os_indices(), sysfs.os_indices());
    assert_eq!(
        hwloc.os_indices(),
        current_thread_allowed_cpus().expect("sched_getaffinity"),
        "an unpinned test thread may run on every CPU the topology lists"
    );
    let detected = Topology::detect().expect("detect");
    assert_eq!(detected, hwloc, "detect() prefers hwloc when it works");
    let plan = CorePlan::new(&detected, &PlanOptions::default()).expect("default plan");
    assert!(plan.core_count() >= 1);
}

#[test]
fn pinned_thread_reports_exactly_its_cpu() {
    // Proves pinning: a thread pinned to CPU c is allowed exactly [c], for every usable CPU.
    let allowed = current_thread_allowed_cpus().expect("sched_getaffinity");
    assert!(!allowed.is_empty());
    for &cpu in &allowed {
        let seen = thread::spawn(move || {
            pin_current_thread(cpu)?;
            current_thread_allowed_cpus()
        })
        .join()
        .expect("the pinning thread does not panic")
        .expect("pinning to a usable CPU works");
        assert_eq!(seen, vec![cpu]);
    }
    // Spawned threads were pinned, not this one.
    assert_eq!(
        current_thread_allowed_cpus().expect("sched_getaffinity"),
        allowed
    );
}

#[test]
fn pinning_to_an_impossible_cpu_fails_and_changes_nothing() {
    // Proves a CPU past the mask size or outside the machine is an error, mask untouched.
    let result = thread::spawn(|| {
        let before = current_thread_allowed_cpus()?;
        let too_big = pin_current_thread(CPU_INDEX_MAX + 1);
        let offline = if before.contains(&CPU_INDEX_MAX) {
            None
        } else {
            Some(pin_current_thread(CPU_INDEX_MAX))
        };
        let after = current_thread_allowed_cpus()?;
        Ok::<_, AffinityError>((before, too_big, offline, after))
    })
    .join()
    .expect("no panic");
    let (before, too_big, offline, after) = result.expect("reading the mask works");
    assert!(matches!(
        too_big,
        Err(AffinityError::CpuIndexOutOfRange {
            cpu: 1024,
            max: 1023
        })
    ));
    if let Some(offline) = offline {
        assert!(
            matches!(offline, Err(AffinityError::Syscall { .. })),
            "{offline:?}"
        );
    }
    assert_eq!(before, after);
}

#[test]
fn thread_cpu_time_is_readable_by_the_thread_and_by_tid() {
    // Proves a busy thread's CPU time shows in its own clock and in /proc read from another thread.
    let (tid_tx, tid_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let burner = thread::spawn(move || -> Result<f64, AffinityError> {
        let mut spins: u64 = 0;
        while thread_cpu_seconds()? < BURN_CPU_SECONDS {
            spins = std::hint::black_box(spins.wrapping_add(1));
        }
        let own_before = thread_cpu_seconds()?;
        tid_tx
            .send((Tid::current(), own_before))
            .expect("the test thread is waiting");
        // Blocks (no CPU use) until the test has read our /proc entry.
        release_rx.recv().expect("the test releases us");
        thread_cpu_seconds()
    });
    let (tid, own_before) = tid_rx.recv().expect("the burner reports its tid");
    let from_proc = thread_cpu_seconds_of(tid).expect("/proc/self/task/<tid>/stat is readable");
    release_tx.send(()).expect("the burner is waiting");
    let own_after = burner
        .join()
        .expect("no panic")
        .expect("the thread clock works");

    assert!(own_before >= BURN_CPU_SECONDS);
    assert!(
        from_proc >= own_before - PROC_TICK_SLACK_SECONDS,
        "/proc says {from_proc} s, the thread said {own_before} s"
    );
    assert!(
        from_proc <= own_after + PROC_TICK_SLACK_SECONDS,
        "/proc says {from_proc} s, the thread said {own_after} s at exit"
    );
    let deadline = Instant::now() + EXITED_TASK_DEADLINE;
    while thread_cpu_seconds_of(tid).is_ok() {
        assert!(
            Instant::now() < deadline,
            "an exited thread keeps its /proc entry"
        );
        thread::yield_now();
    }
    assert!(matches!(
        thread_cpu_seconds_of(tid),
        Err(AffinityError::Read { .. })
    ));
    assert!(thread_cpu_seconds_of(Tid::current()).expect("own entry") >= 0.0);
}
