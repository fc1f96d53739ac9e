//! `felix tune listeners` against real brokers on loopback: the built binary starts one broker
//! per listener count, loads it briefly and prints a row per count and a recommendation.
//! Nothing here asserts on speed: the machine running the tests is small and shared.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use felix_tuning::Config;

/// Most listener counts the test sweeps (`--max`), to keep it short.
const MAX_COUNTS: usize = 2;
/// Generous bound on the whole sweep: per count a broker start (30 s worst case), 1.5 s of
/// load, draining and a stop (10 s worst case), on a loaded 2-core machine.
const SWEEP_DEADLINE: Duration = Duration::from_secs(240);

/// The data-plane core count a broker started with no FELIX_* setting plans, computed the way
/// the sweep does (the listener count does not change it).
fn default_core_count() -> usize {
    let config = Config::load(None, Vec::<(String, String)>::new(), &[]).expect("defaults load");
    felix_broker::core_plan(&config)
        .expect("core plan")
        .cores()
        .len()
}

/// Reads a pipe to its end on a thread.
fn read_all(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

// Proves the sweep runs a real broker per listener count with a short load, prints a header,
// exactly one measured row per count 1..=min(2, cores) in order, and a recommendation line
// with the config-file key, and exits successfully, leaving no temporary directory behind.
#[test]
fn tune_listeners_prints_a_row_per_count() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut command = Command::new(env!("CARGO_BIN_EXE_felix"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("FELIX_") {
            command.env_remove(name);
        }
    }
    let mut child = command
        .args(["tune", "listeners", "--seconds", "1", "--max"])
        .arg(MAX_COUNTS.to_string())
        // The brokers' temporary directories go here, so the test can check they are removed.
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("felix starts");
    // Read both pipes on threads so a full pipe can never stall the sweep.
    let stdout = read_all(child.stdout.take().expect("piped stdout"));
    let stderr = read_all(child.stderr.take().expect("piped stderr"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > SWEEP_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("felix tune listeners did not finish within {SWEEP_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = stdout.join().expect("stdout reader");
    let stderr = stderr.join().expect("stderr reader");
    assert!(
        status.success(),
        "exit {status}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let lines: Vec<&str> = stdout.lines().collect();
    let header = lines
        .iter()
        .position(|line| {
            line.split_whitespace().next() == Some("LISTENERS") && line.contains("RECORDS/S")
        })
        .unwrap_or_else(|| panic!("no table header in:\n{stdout}"));
    for column in ["MB/S", "BROKER CPU (cores)", "CPU-S PER M RECORDS"] {
        assert!(
            lines[header].contains(column),
            "{column} missing:\n{stdout}"
        );
    }
    let rows: Vec<Vec<&str>> = lines[header + 1..]
        .iter()
        .take_while(|line| !line.trim().is_empty())
        .map(|line| line.split_whitespace().collect())
        .collect();
    let expected: Vec<String> = (1..=MAX_COUNTS.min(default_core_count()))
        .map(|count| count.to_string())
        .collect();
    let counts: Vec<&str> = rows.iter().map(|row| row[0]).collect();
    assert_eq!(counts, expected, "one row per count:\n{stdout}");
    for row in &rows {
        assert_eq!(row.len(), 5, "a measured row has five cells:\n{stdout}");
        let records_per_second: f64 = row[1].parse().expect("RECORDS/S is a number");
        assert!(records_per_second > 0.0, "the load was acked:\n{stdout}");
        for cell in &row[2..4] {
            let _: f64 = cell.parse().expect("a number");
        }
    }
    let recommended = lines
        .iter()
        .find_map(|line| line.strip_prefix("recommended: FELIX_QUIC_LISTENERS="))
        .unwrap_or_else(|| panic!("no recommendation in:\n{stdout}"));
    let (count, rest) = recommended
        .split_once(' ')
        .expect("count, then the config file line");
    assert!(expected.iter().any(|swept| swept == count), "{recommended}");
    assert!(
        rest.contains(&format!("quic_listeners = \"{count}\"")),
        "{recommended}"
    );

    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("temp dir lists")
        .filter_map(Result::ok)
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .starts_with("felix-tune-listeners-")
        })
        .map(|entry| entry.path())
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}
