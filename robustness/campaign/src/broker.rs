//! A `felix broker` child process for the campaigns: loopback ports chosen by the kernel
//! (`FELIX_BIND=127.0.0.1:0`, `FELIX_METRICS_BIND=127.0.0.1:0`), a data directory the caller
//! owns (so a restart reuses it), no inherited `FELIX_*` variable, stderr appended to a log
//! file. The addresses come from the lines it prints on stdout; clients trust the development
//! certificate it writes under its data directory.
//!
//! Threads: one per started process drains its stdout until it exits.

use std::fs::File;
use std::io::{BufRead as _, BufReader, Read as _, Seek as _, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use felix_client::ClientConfig;

use crate::CampaignError;

/// Time a broker has to print its listening lines. A cold start generates a TLS pair and
/// recovers the durable logs (tens of milliseconds here); 60 s leaves room for a loaded
/// 2-CPU machine and a log of many segments.
pub const STARTUP_DEADLINE: Duration = Duration::from_secs(60);

/// Last bytes of the broker's log quoted in errors.
const LOG_TAIL_BYTES: u64 = 4000;

/// Prefix of the broker's QUIC listening line on stdout.
const QUIC_LINE: &str = "felix: quic listening on ";
/// Prefix of the broker's metrics listening line on stdout.
const METRICS_LINE: &str = "felix: metrics listening on ";
/// The development certificate the broker writes under its data directory.
const DEV_CERT: &str = "tls/dev-cert.pem";

/// How to start a broker.
#[derive(Debug, Clone)]
pub struct BrokerOptions {
    /// The `felix` binary.
    pub felix: PathBuf,
    /// Its data directory (kept across restarts).
    pub data_dir: PathBuf,
    /// Extra environment (`FELIX_*` settings); the data directory and ports are set here.
    pub env: Vec<(String, String)>,
    /// File its stderr is appended to.
    pub log: PathBuf,
}

impl BrokerOptions {
    fn command(&self) -> Result<Command, CampaignError> {
        let mut command = Command::new(&self.felix);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("FELIX_") {
                command.env_remove(name);
            }
        }
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| CampaignError::io("cannot open the broker log", &self.log, e))?;
        command
            .arg("broker")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("FELIX_DATA_DIR", &self.data_dir)
            .env("FELIX_BIND", "127.0.0.1:0")
            .env("FELIX_METRICS_BIND", "127.0.0.1:0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        Ok(command)
    }
}

/// A running `felix broker`. Dropping it kills (SIGKILL) and reaps the process.
pub struct Broker {
    child: Child,
    quic_addr: SocketAddr,
    metrics_addr: SocketAddr,
    data_dir: PathBuf,
    log: PathBuf,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("pid", &self.child.id())
            .field("quic_addr", &self.quic_addr)
            .finish_non_exhaustive()
    }
}

/// Starts the process and a thread forwarding its stdout lines.
fn spawn(options: &BrokerOptions) -> Result<(Child, mpsc::Receiver<String>), CampaignError> {
    let mut child = options
        .command()?
        .spawn()
        .map_err(|e| CampaignError::io("cannot start", &options.felix, e))?;
    let (lines, receiver) = mpsc::channel();
    if let Some(stdout) = child.stdout.take() {
        let spawned = std::thread::Builder::new()
            .name("felix-campaign-broker-stdout".to_owned())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    // After start-up nobody listens; keep draining so the broker never blocks.
                    let _ = lines.send(line);
                }
            });
        if let Err(error) = spawned {
            let _ = child.kill();
            let _ = child.wait();
            return Err(CampaignError::io(
                "cannot start a thread for",
                &options.felix,
                error,
            ));
        }
    }
    Ok((child, receiver))
}

/// The last bytes of a log file, for error messages.
#[must_use]
pub fn log_tail(log: &Path) -> String {
    let Ok(mut file) = File::open(log) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut tail = Vec::new();
    let _ = file.read_to_end(&mut tail);
    String::from_utf8_lossy(&tail).trim().to_owned()
}

impl Broker {
    /// Starts `felix broker` and waits (up to [`STARTUP_DEADLINE`]) for its listening lines.
    pub fn start(options: &BrokerOptions) -> Result<Broker, CampaignError> {
        let (mut child, lines) = spawn(options)?;
        let deadline = Instant::now() + STARTUP_DEADLINE;
        let (mut quic, mut metrics) = (None, None);
        while quic.is_none() || metrics.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            let failure = match lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(addr) = line.strip_prefix(QUIC_LINE) {
                        quic = addr.trim().parse().ok();
                    } else if let Some(addr) = line.strip_prefix(METRICS_LINE) {
                        metrics = addr.trim().parse().ok();
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    format!("no listening lines within {STARTUP_DEADLINE:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => "it exited while starting".to_owned(),
            };
            let _ = child.kill();
            let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
            return Err(CampaignError::Broker(format!(
                "the broker did not start: {failure} ({status}); {} ends with:\n{}",
                options.log.display(),
                log_tail(&options.log)
            )));
        }
        match (quic, metrics) {
            (Some(quic_addr), Some(metrics_addr)) => Ok(Broker {
                child,
                quic_addr,
                metrics_addr,
                data_dir: options.data_dir.clone(),
                log: options.log.clone(),
            }),
            // The loop above only ends with both set.
            _ => Err(CampaignError::Broker("listening lines lost".to_owned())),
        }
    }

    /// Starts `felix broker`, waits `delay` (without waiting for it to listen) and SIGKILLs
    /// it: a kill during start-up (log recovery, binding). Returns whether it was still
    /// running when killed.
    pub fn start_and_kill_after(
        options: &BrokerOptions,
        delay: Duration,
    ) -> Result<bool, CampaignError> {
        let (mut child, _lines) = spawn(options)?;
        std::thread::sleep(delay);
        let running = matches!(child.try_wait(), Ok(None));
        let _ = child.kill();
        child
            .wait()
            .map_err(|e| CampaignError::io("cannot reap", &options.felix, e))?;
        Ok(running)
    }

    /// The process id (valid until [`Broker::kill`] reaps it).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    #[must_use]
    pub fn quic_addr(&self) -> SocketAddr {
        self.quic_addr
    }

    #[must_use]
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    #[must_use]
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// A client configuration trusting this broker's development certificate.
    #[must_use]
    pub fn client_config(&self, name: &str) -> ClientConfig {
        let mut config = ClientConfig::new(self.quic_addr);
        config.ca = Some(self.data_dir.join(DEV_CERT));
        config.client_name = name.to_owned();
        config
    }

    /// SIGKILLs the broker (no shutdown of any kind) and reaps it. Calling it again returns
    /// the same status.
    pub fn kill(&mut self) -> Result<ExitStatus, CampaignError> {
        // It may have been killed already (a kill switch); then this finds a zombie, fine.
        let _ = self.child.kill();
        self.child
            .wait()
            .map_err(|e| CampaignError::io("cannot reap the broker", &self.log, e))
    }

    /// Its exit status if it has exited (this reaps it: fire no [`KillSwitch`] of it after).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Whether the process has died (a zombie not yet reaped, or gone), without reaping it,
    /// so its [`KillSwitch`] stays safe to fire.
    #[must_use]
    pub fn has_died(&self) -> bool {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())) else {
            return true;
        };
        // `pid (comm) state ...`: the state follows the last ')'.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X")
    }

    /// Resident memory (VmRSS of /proc/<pid>/status) in bytes; `None` once it is gone.
    #[must_use]
    pub fn rss_bytes(&self) -> Option<u64> {
        rss_bytes(self.pid())
    }

    /// A kill switch for this process (see [`KillSwitch`]).
    #[must_use]
    pub fn kill_switch(&self) -> KillSwitch {
        KillSwitch {
            pid: i32::try_from(self.pid()).unwrap_or(i32::MAX),
            fired: AtomicBool::new(false),
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// VmRSS of process `pid` in bytes, from /proc/<pid>/status.
#[must_use]
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

/// SIGKILLs one broker process from any thread or task, at most once: publisher tasks fire it
/// right after an ack, the segment watcher right after a roll. Only fire it while the
/// [`Broker`] it came from has not been reaped (the campaign reaps after firing), so the pid
/// cannot have been reused.
#[derive(Debug)]
pub struct KillSwitch {
    pid: i32,
    fired: AtomicBool,
}

impl KillSwitch {
    /// Sends SIGKILL the first time; returns whether this call sent it.
    pub fn fire(&self) -> bool {
        if self.fired.swap(true, Ordering::SeqCst) {
            return false;
        }
        let pid = nix::unistd::Pid::from_raw(self.pid);
        // The process may already be dead (crashed on its own): nothing to kill then.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        true
    }

    #[must_use]
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }
}
