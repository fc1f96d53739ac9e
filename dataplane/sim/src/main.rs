//! `felix-sim`: runs seeds of the simulation (`make sim`).
//!
//! ```text
//! felix-sim [--cluster] [--seeds N] [--first S] [--seed S] [--steps K] [--threads T] [--log all]
//! ```
//! `--cluster` runs the cluster run (three brokers with their cores and cluster members,
//! `cluster.rs`) instead of the single broker's.
//! `--seed S` runs one seed (and prints its step log with `--log all`); `--seeds N` runs
//! `S..S+N` from `--first S` (default 0). A failure prints the seed, its last steps and the
//! command that replays it, and the exit status is 1.

use std::process::ExitCode;
use std::time::Instant;

use felix_sim::{
    CLUSTER_STEPS_DEFAULT, STEPS_DEFAULT, Stats, run_cluster_seed, run_cluster_seeds, run_seed,
    run_seeds,
};

struct Options {
    first: u64,
    count: u64,
    steps: u64,
    threads: usize,
    echo: bool,
    single: bool,
    cluster: bool,
}

fn parse() -> Result<Options, String> {
    let mut options = Options {
        first: 0,
        count: 200,
        steps: STEPS_DEFAULT,
        threads: std::thread::available_parallelism().map_or(1, usize::from),
        echo: false,
        single: false,
        cluster: false,
    };
    let mut steps_given = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let number = |text: String, name: &str| {
            text.parse::<u64>()
                .map_err(|error| format!("{name} {text:?}: {error}"))
        };
        match arg.as_str() {
            "--seeds" => options.count = number(value("--seeds")?, "--seeds")?,
            "--first" => options.first = number(value("--first")?, "--first")?,
            "--seed" => {
                options.first = number(value("--seed")?, "--seed")?;
                options.count = 1;
                options.single = true;
            }
            "--steps" => {
                options.steps = number(value("--steps")?, "--steps")?;
                steps_given = true;
            }
            "--cluster" => options.cluster = true,
            "--threads" => {
                options.threads =
                    usize::try_from(number(value("--threads")?, "--threads")?).unwrap_or(1);
            }
            "--log" => options.echo = value("--log")? == "all",
            "--help" | "-h" => {
                return Err(
                    "usage: felix-sim [--cluster] [--seeds N] [--first S] [--seed S] [--steps K] \
                            [--threads T] [--log all]"
                        .to_owned(),
                );
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if options.cluster && !steps_given {
        options.steps = CLUSTER_STEPS_DEFAULT;
    }
    Ok(options)
}

fn main() -> ExitCode {
    let options = match parse() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("felix-sim: {message}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    if options.cluster {
        return cluster_main(&options, started);
    }
    let (outcomes, failures) = if options.single {
        match run_seed(options.first, options.steps, options.echo) {
            Ok(outcome) => (vec![outcome], Vec::new()),
            Err(failure) => (Vec::new(), vec![failure]),
        }
    } else {
        run_seeds(options.first, options.count, options.steps, options.threads)
    };
    for failure in &failures {
        print_failure(failure, "felix-sim", "SEED", options.steps);
    }
    let mut total = Stats::default();
    for outcome in &outcomes {
        total.add(&outcome.stats);
        if options.single {
            println!("seed {} digest {:016x}", outcome.seed, outcome.digest);
        }
    }
    print_tally(
        "felix-sim",
        &options,
        outcomes.len(),
        failures.len(),
        started,
    );
    println!(
        "felix-sim: exercised {} frames, {} acks, {} deliveries, {} refused, {} shed, {} waits, \
         {} lagged ({} resumed), {} messages, {} log rounds ({} writes alone, {} newest first, {} pumps \
         leaving two in flight), {} crashes ({} power cuts, {} torn), {} \
         fsync failures, {} disk-full writes, {} log pumps holding appends (pending bound full), {} \
         catalogue failures, {} durable records \
         checked after crashes, {} requests denied by rules, {} catch-up read fetches",
        total.frames,
        total.acks,
        total.deliveries,
        total.refused,
        total.shed,
        total.waits,
        total.lagged,
        total.resumed,
        total.messages,
        total.rounds,
        total.writes_alone,
        total.newest_first,
        total.two_in_flight,
        total.crashes,
        total.power_cuts,
        total.torn_cuts,
        total.fsync_failures,
        total.disk_full,
        total.appends_held,
        total.catalog_failures,
        total.durable_checked,
        total.denied,
        total.fetches
    );
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `--cluster`: runs cluster seeds and prints what they exercised.
fn cluster_main(options: &Options, started: Instant) -> ExitCode {
    let (outcomes, failures) = if options.single {
        match run_cluster_seed(options.first, options.steps, options.echo) {
            Ok(outcome) => (vec![outcome], Vec::new()),
            Err(failure) => (Vec::new(), vec![failure]),
        }
    } else {
        run_cluster_seeds(options.first, options.count, options.steps, options.threads)
    };
    for failure in &failures {
        print_failure(
            failure,
            "felix-sim --cluster",
            "CLUSTER_SIM_SEED",
            options.steps,
        );
    }
    let mut total = felix_sim::cluster::ClusterStats::default();
    for outcome in &outcomes {
        total.add(&outcome.stats);
        if options.single {
            println!("seed {} digest {:016x}", outcome.seed, outcome.digest);
        }
    }
    print_tally(
        "felix-sim --cluster",
        options,
        outcomes.len(),
        failures.len(),
        started,
    );
    println!(
        "felix-sim --cluster: exercised {} publishes ({} acked, {} refused, {} idempotent retries), \
         {} records audited, {} broker kills with power cuts, {} partitions, {} record-log \
         reads that waited for their fetch",
        total.publishes,
        total.acked,
        total.refused,
        total.retries,
        total.records,
        total.kills,
        total.partitions,
        total.fetches
    );
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A failed seed: its message, its last steps and how to replay it (`make sim` with `seed_var`
/// set, or `command` with `--seed`).
fn print_failure(failure: &felix_sim::Failure, command: &str, seed_var: &str, steps: u64) {
    eprintln!(
        "\n{command}: seed {} FAILED after {} logged steps: {}",
        failure.seed, failure.steps_logged, failure.message
    );
    eprintln!("--- the last {} lines of its step log:", failure.tail.len());
    for line in &failure.tail {
        eprintln!("{line}");
    }
    eprintln!(
        "--- replay: {seed_var}={} make sim   (or {command} --seed {} --steps {steps} --log all)",
        failure.seed, failure.seed
    );
}

/// How many seeds passed and failed, and how long they took.
fn print_tally(command: &str, options: &Options, passed: usize, failed: usize, started: Instant) {
    println!(
        "{command}: {} seeds from {} x {} steps: {passed} passed, {failed} failed in {:.1} s",
        passed + failed,
        options.first,
        options.steps,
        started.elapsed().as_secs_f64()
    );
}
