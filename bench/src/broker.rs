//! The broker under test: either one the runner starts per cell (`felix broker` as a child
//! process, fresh data directory, ports chosen by the kernel) or one already running whose
//! addresses the operator gives.
//!
//! A started broker gets the arm's environment on top of this process's environment with every
//! inherited `FELIX_*` variable removed (so the operator's shell cannot change what a cell
//! measures), then `FELIX_DATA_DIR`, `FELIX_BIND=127.0.0.1:0` and `FELIX_METRICS_BIND=
//! 127.0.0.1:0`. Its addresses come from the lines `felix: quic listening on <addr>` and
//! `felix: metrics listening on <addr>` on its stdout; the client trusts the development
//! certificate it writes to `<data dir>/tls/dev-cert.pem`. Its stderr goes to a log file.
//!
//! Threads: one reader thread per started broker drains its stdout until it exits.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::BenchError;

/// Time a started broker has to print both listening lines. A cold start generates a TLS pair
/// (tens of milliseconds) and binds two sockets; 30 s leaves room for a loaded machine.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Time a broker has to exit after SIGTERM before it is killed. It closes its connections with
/// `ShuttingDown` and syncs durable logs; 10 s is generous for that and bounds a hung broker.
pub const STOP_DEADLINE: Duration = Duration::from_secs(10);

/// How often the exit of a stopping broker is polled. 20 ms adds at most that to a cell's
/// set-up time and costs nothing measurable.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Last bytes of the broker's log quoted in a start-up error.
const LOG_TAIL_BYTES: usize = 2000;

/// Prefix of the broker's QUIC listening line on stdout.
pub const QUIC_LINE_PREFIX: &str = "felix: quic listening on ";
/// Prefix of the broker's metrics listening line on stdout.
pub const METRICS_LINE_PREFIX: &str = "felix: metrics listening on ";

/// Development certificate the broker writes under its data directory.
pub const DEV_CERT_RELATIVE: &str = "tls/dev-cert.pem";

/// Where and how to reach a broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerEndpoint {
    /// QUIC (UDP) address.
    pub quic_addr: SocketAddr,
    /// Prometheus HTTP address.
    pub metrics_addr: SocketAddr,
    /// CA certificate (PEM) the clients trust.
    pub ca: PathBuf,
    /// The broker's process id, for its CPU time from /proc (None: unknown, e.g. a remote or
    /// in-process broker; CPU then comes from a metric or reads 0).
    pub pid: Option<u32>,
}

/// The environment a started broker gets: this process's variables without `FELIX_*`, the
/// arm's, then the runner's own (data directory and loopback ports with port 0).
pub fn broker_env(arm_env: &BTreeMap<String, String>, data_dir: &Path) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = arm_env
        .iter()
        .filter(|(k, _)| !is_runner_owned(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.push(("FELIX_DATA_DIR".to_string(), data_dir.display().to_string()));
    env.push(("FELIX_BIND".to_string(), "127.0.0.1:0".to_string()));
    env.push(("FELIX_METRICS_BIND".to_string(), "127.0.0.1:0".to_string()));
    env
}

/// Variables the runner sets itself; an arm cannot move the data directory or the ports.
fn is_runner_owned(name: &str) -> bool {
    matches!(name, "FELIX_DATA_DIR" | "FELIX_BIND" | "FELIX_METRICS_BIND")
}

/// A `felix` command with a clean `FELIX_*` environment plus `env`.
fn felix_command(bin: &Path, env: &[(String, String)]) -> Command {
    let mut command = Command::new(bin);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("FELIX_") {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    command
}

/// The effective broker configuration for an arm: the output of `felix config` run with the
/// environment the broker would get.
pub fn effective_config(
    bin: &Path,
    arm_env: &BTreeMap<String, String>,
    data_dir: &Path,
    server_cpus: Option<&[usize]>,
) -> Result<String, BenchError> {
    let mut command = felix_command(bin, &broker_env(arm_env, data_dir));
    // The core plan `felix config` prints follows the mask, as the broker's will.
    if let Some(cpus) = server_cpus {
        crate::pin::pin_command(&mut command, cpus)?;
    }
    let output = command
        .arg("config")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| BenchError::io(bin, e))?;
    if !output.status.success() {
        return Err(BenchError::Broker(format!(
            "`{} config` failed ({}): {}",
            bin.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Parses one stdout line of the broker into (is_quic, address) when it is a listening line.
pub fn parse_listening_line(line: &str) -> Option<(bool, SocketAddr)> {
    let line = line.trim();
    if let Some(rest) = line.strip_prefix(QUIC_LINE_PREFIX) {
        return rest.trim().parse().ok().map(|a| (true, a));
    }
    if let Some(rest) = line.strip_prefix(METRICS_LINE_PREFIX) {
        return rest.trim().parse().ok().map(|a| (false, a));
    }
    None
}

/// A `felix broker` child process. Dropping it kills the process if [`SpawnedBroker::stop`]
/// was not called.
pub struct SpawnedBroker {
    process: ServerProcess,
    endpoint: BrokerEndpoint,
}

impl std::fmt::Debug for SpawnedBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpawnedBroker")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// Empties `dir` (removing it if present) and creates it again.
pub fn wipe_dir(dir: &Path) -> Result<(), BenchError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(BenchError::io(dir, e)),
    }
    std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))
}

impl SpawnedBroker {
    /// Wipes `data_dir`, starts `bin broker` with the arm's environment (on `server_cpus` when
    /// given: the pinned method, src/pin.rs), and waits (up to [`STARTUP_TIMEOUT`]) for both
    /// listening lines. Stderr is appended to `log`.
    pub fn start(
        bin: &Path,
        arm_env: &BTreeMap<String, String>,
        data_dir: &Path,
        log: &Path,
        server_cpus: Option<&[usize]>,
    ) -> Result<SpawnedBroker, BenchError> {
        wipe_dir(data_dir)?;
        let stderr = File::options()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| BenchError::io(log, e))?;
        let mut command = felix_command(bin, &broker_env(arm_env, data_dir));
        if let Some(cpus) = server_cpus {
            crate::pin::pin_command(&mut command, cpus)?;
        }
        let mut child = command
            .arg("broker")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| BenchError::io(bin, e))?;
        let pid = child.id();
        let (lines_tx, lines_rx) = mpsc::channel::<String>();
        if let Some(stdout) = child.stdout.take() {
            let spawned = std::thread::Builder::new()
                .name("felix-bench-broker-stdout".to_string())
                .spawn(move || {
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        // The receiver goes away after start-up; keep draining so the broker
                        // never blocks on a full pipe.
                        let _ = lines_tx.send(line);
                    }
                });
            if let Err(e) = spawned {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BenchError::io(log, e));
            }
        }
        let mut broker = SpawnedBroker {
            process: ServerProcess::new(child, log.to_path_buf()),
            endpoint: BrokerEndpoint {
                quic_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
                metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
                ca: data_dir.join(DEV_CERT_RELATIVE),
                pid: Some(pid),
            },
        };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let (mut quic, mut metrics) = (None, None);
        while quic.is_none() || metrics.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines_rx.recv_timeout(left) {
                Ok(line) => match parse_listening_line(&line) {
                    Some((true, addr)) => quic = Some(addr),
                    Some((false, addr)) => metrics = Some(addr),
                    None => {}
                },
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(broker.start_failure(&format!(
                        "no listening lines within {STARTUP_TIMEOUT:?} (is FELIX_METRICS_BIND off in the arm?)"
                    )));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(broker.start_failure("it exited before listening"));
                }
            }
        }
        // Both were set by the loop above.
        if let (Some(q), Some(m)) = (quic, metrics) {
            broker.endpoint.quic_addr = q;
            broker.endpoint.metrics_addr = m;
        }
        Ok(broker)
    }

    fn start_failure(&mut self, why: &str) -> BenchError {
        self.process.kill();
        let tail = std::fs::read(self.process.log())
            .map(|bytes| {
                let from = bytes.len().saturating_sub(LOG_TAIL_BYTES);
                String::from_utf8_lossy(&bytes[from..]).trim().to_string()
            })
            .unwrap_or_default();
        BenchError::Broker(format!(
            "the broker did not start: {why}; its log {} ends with:\n{tail}",
            self.process.log().display()
        ))
    }

    /// Where to reach it.
    pub fn endpoint(&self) -> &BrokerEndpoint {
        &self.endpoint
    }

    /// SIGTERM, then SIGKILL if it has not exited within [`STOP_DEADLINE`]. Returns a
    /// description of how it ended (`exited: 0`, `killed after 10 s`).
    pub fn stop(mut self) -> Result<String, BenchError> {
        self.process.stop()
    }
}

/// How a cell's server ended, for the run's record: `<cell> arm <arm>: <how>`.
pub(crate) fn exit_line(cell: &str, arm: &str, stopped: Result<String, BenchError>) -> String {
    match stopped {
        Ok(how) => format!("{cell} arm {arm}: {how}"),
        Err(e) => format!("{cell} arm {arm}: stop failed: {e}"),
    }
}

/// A server child process a bench handle owns (the Felix broker, nats-server, iggy-server):
/// stopped with SIGTERM, then SIGKILL, by [`ServerProcess::stop`]; killed when dropped.
pub(crate) struct ServerProcess {
    child: Option<Child>,
    /// Where its output goes (named in errors).
    log: PathBuf,
}

impl ServerProcess {
    pub(crate) fn new(child: Child, log: PathBuf) -> ServerProcess {
        ServerProcess {
            child: Some(child),
            log,
        }
    }

    pub(crate) fn log(&self) -> &Path {
        &self.log
    }

    /// Its exit status if it has exited already (it is then forgotten).
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok().flatten()?;
        self.child = None;
        Some(status)
    }

    /// SIGTERM, then SIGKILL if the process has not exited within [`STOP_DEADLINE`]; returns
    /// how it ended (`exited: 0`, `killed: ...`, `already stopped`).
    pub(crate) fn stop(&mut self) -> Result<String, BenchError> {
        let Some(mut child) = self.child.take() else {
            return Ok("already stopped".to_string());
        };
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        // The child may have exited already; then the signal finds no process, which is fine.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + STOP_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Ok(format!("exited: {status}")),
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Ok(format!(
                        "killed: no exit within {STOP_DEADLINE:?} of SIGTERM"
                    ));
                }
                Ok(None) => std::thread::sleep(EXIT_POLL_INTERVAL),
                Err(e) => return Err(BenchError::io(&self.log, e)),
            }
        }
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_lines_are_parsed() {
        // Proves the broker's two announcement lines yield the QUIC and metrics addresses and others are ignored.
        assert_eq!(
            parse_listening_line("felix: quic listening on 127.0.0.1:40123\n"),
            Some((true, "127.0.0.1:40123".parse().unwrap()))
        );
        assert_eq!(
            parse_listening_line("felix: metrics listening on [::1]:9400"),
            Some((false, "[::1]:9400".parse().unwrap()))
        );
        assert_eq!(
            parse_listening_line("felix: quic listening on nowhere"),
            None
        );
        assert_eq!(parse_listening_line("something else"), None);
    }

    #[test]
    fn arm_env_cannot_move_the_data_dir_or_ports() {
        // Proves the runner's data directory and port-0 binds win over an arm's values.
        let mut arm = BTreeMap::new();
        arm.insert("FELIX_BIND".to_string(), "0.0.0.0:7400".to_string());
        arm.insert("FELIX_ACK_ON_COMMIT".to_string(), "1".to_string());
        let env = broker_env(&arm, Path::new("/tmp/d"));
        let get = |k: &str| {
            env.iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(get("FELIX_BIND"), vec!["127.0.0.1:0"]);
        assert_eq!(get("FELIX_ACK_ON_COMMIT"), vec!["1"]);
        assert_eq!(get("FELIX_DATA_DIR"), vec!["/tmp/d"]);
    }
}
