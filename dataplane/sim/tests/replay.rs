//! The simulation's own guarantees: a seed replays exactly, and a handful of seeds pass
//! (the full campaign is `make sim`).

#[test]
fn a_seed_replays_step_for_step() {
    // Proves two runs of one seed log the same steps (the digest covers every line), and
    // another seed does not.
    let first = felix_sim::run_seed(7, 600, false).expect("seed 7 passes");
    let again = felix_sim::run_seed(7, 600, false).expect("seed 7 passes again");
    let other = felix_sim::run_seed(8, 600, false).expect("seed 8 passes");
    assert_eq!(first.digest, again.digest);
    assert_ne!(first.digest, other.digest);
}

#[test]
fn a_few_seeds_pass() {
    // Proves the invariants hold on a small sample (every run exercises publishes).
    let (outcomes, failures) = felix_sim::run_seeds(100, 16, 800, 2);
    assert!(
        failures.is_empty(),
        "seeds failed: {:?}",
        failures
            .iter()
            .map(|failure| (failure.seed, failure.message.as_str()))
            .collect::<Vec<_>>()
    );
    assert_eq!(outcomes.len(), 16);
    assert!(
        outcomes
            .iter()
            .map(|outcome| outcome.stats.frames)
            .sum::<u64>()
            > 0
    );
}

#[test]
fn seeds_that_found_defects_pass() {
    // Proves the defects these seeds found stay fixed: 741, 789 and 853 (small log pending
    // bound, a write failing with ENOSPC) once moved held appends into the log between reaping
    // a rejected round and rolling the engine back, so a shard the log had forgotten took them
    // at a later offset and a later Synced event named records the engine had dropped.
    for seed in [741, 789, 853] {
        if let Err(failure) = felix_sim::run_seed(seed, 1500, false) {
            panic!("seed {seed} failed: {}", failure.message);
        }
    }
}

/// The cluster run replays too, and a few of its seeds pass (more run in `make sim`); seed 39
/// found acks of batches whose offsets a member no longer knew (`shard::RECENT_BATCHES`).
#[test]
fn cluster_seeds_replay_and_pass() {
    let first = felix_sim::run_cluster_seed(39, 4000, false).expect("cluster seed 39 passes");
    let again = felix_sim::run_cluster_seed(39, 4000, false).expect("cluster seed 39 again");
    assert_eq!(
        first.digest, again.digest,
        "a cluster seed replays step for step"
    );
    assert!(first.stats.acked > 0, "the run acknowledged publishes");
    let (outcomes, failures) = felix_sim::run_cluster_seeds(0, 4, 4000, 2);
    assert!(
        failures.is_empty(),
        "{:?}",
        failures
            .iter()
            .map(|f| (f.seed, &f.message))
            .collect::<Vec<_>>()
    );
    assert_eq!(outcomes.len(), 4);
}
