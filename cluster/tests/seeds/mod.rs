//! The seeds a simulation runs, chosen by environment variables, and the name of the seed a
//! failure happened at (shared by the seeded simulations in this directory).

/// Runs `run` for the seeds `<prefix>_FIRST..<prefix>_FIRST + <prefix>_SEEDS` (by default
/// `first` and `seeds`), naming the seed of a failure and how to run it alone.
pub fn for_seeds(
    what: &str,
    prefix: &str,
    first: u64,
    seeds: u64,
    run: impl Fn(u64) + std::panic::RefUnwindSafe,
) {
    let var = |name: &str, default: u64| {
        std::env::var(format!("{prefix}_{name}"))
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let seeds = var("SEEDS", seeds);
    let first = var("FIRST", first);
    for seed in first..first + seeds {
        if let Err(panic) = std::panic::catch_unwind(|| run(seed)) {
            eprintln!(
                "{what} simulation failed at seed {seed} \
                 ({prefix}_FIRST={seed} {prefix}_SEEDS=1 reproduces it)"
            );
            std::panic::resume_unwind(panic);
        }
    }
}
