//! The Apache Iggy side-by-side peer: an `iggy-server` binary the user supplies (`--iggy BIN`,
//! built from the Apache Iggy project; this repository carries neither its code nor a recipe to
//! build it), started per cell with a config file felix-bench writes, and driven over its QUIC
//! transport by the `iggy` client crate (src/iggy_driver.rs, cargo feature `iggy`).
//!
//! This module is what needs no client: the server's config file, the CPU allocation derived
//! from the pinned method, the bound addresses the server reports, and the server process.
//!
//! Per cell: a wiped `work/iggy` directory holding `server.toml` and the data directory. Every
//! listener is on 127.0.0.1 with a kernel-chosen port (QUIC for the load, HTTP for `/metrics`),
//! TCP and WebSocket are off, and so are telemetry, heartbeats and clustering: nothing reaches
//! past loopback. The server writes the addresses it bound to `<data>/runtime/current_config.toml`
//! once every listener is up; felix-bench waits for that file. Inherited `IGGY_*` variables are
//! removed (the arm's `env` may set its own); the root user is `iggy`/`iggy` (set through
//! `IGGY_ROOT_USERNAME` / `IGGY_ROOT_PASSWORD`, loopback only).
//!
//! Durability, in iggy-server 0.8.0's own settings (`[system.partition]`):
//! - `sync = "always"`: `enforce_fsync = true` and `messages_required_to_save = 1`. Every
//!   SendMessages is appended to the partition's journal, which is then at the threshold, so the
//!   handler writes it to the segment file and fsyncs (`sync_all`) the messages file and the
//!   index file before it answers. No group commit: each request pays its own fsync.
//! - `sync = "off"`: the server's defaults. The answer comes once the batch is in the
//!   in-memory journal; it is written to the segment file (without fsync) when a partition has
//!   1,024 messages or 1 MiB buffered, or by the message saver every 30 s (which in 0.8.0
//!   flushes with `fsync: false` whatever its own `enforce_fsync` says). Iggy never fsyncs the
//!   partition: fsync off.

use std::fmt::Write as _;
use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::BenchError;
use crate::broker::{STARTUP_TIMEOUT, ServerProcess, wipe_dir};
use crate::plan::{IggyArm, IggySync};

/// Where `make bench-iggy` expects the server when IGGY_SERVER is not given (it is required
/// there); `--iggy` overrides.
pub const DEFAULT_IGGY_SERVER: &str = "target/iggy/iggy-server";

/// The iggy-server release the figures and the client crate (iggy 0.10.0) were made with.
pub const IGGY_SERVER_VERSION: &str = "0.8.0";

/// Root user created on first start (loopback only, a throwaway data directory per cell).
pub const ROOT_USER: &str = "iggy";
pub const ROOT_PASSWORD: &str = "iggy";

/// Name of the stream and of its one topic.
pub const STREAM: &str = "bench";
pub const TOPIC: &str = "bench";

/// How often the start-up wait looks for the server's bound-address file.
const STARTUP_POLL: Duration = Duration::from_millis(50);

/// iggy-server's `[system.sharding] cpu_allocation` for the server's CPUs: `"a..b"` (one
/// shard per CPU, each pinned to its CPU) for a contiguous set, `"all"` when not pinned. The
/// server pins its shard threads itself, so this must name the same CPUs as the pinned
/// method's mask (its default, `numa:auto`, would spread over every CPU of the machine).
pub fn cpu_allocation(server_cpus: Option<&[usize]>) -> Result<String, BenchError> {
    let Some(cpus) = server_cpus else {
        return Ok("all".to_string());
    };
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let (Some(&first), Some(&last)) = (sorted.first(), sorted.last()) else {
        return Err(BenchError::Broker("iggy: empty server CPU set".to_string()));
    };
    if last - first + 1 != sorted.len() {
        return Err(BenchError::Broker(format!(
            "iggy: server CPUs {cpus:?} are not contiguous; iggy-server's cpu_allocation takes a range"
        )));
    }
    Ok(format!("{first}..{}", last + 1))
}

/// The iggy-server config file for an arm (merged by the server over its built-in defaults).
pub fn server_config(arm: &IggyArm, data_dir: &Path, cpu_allocation: &str) -> String {
    let mut c = String::new();
    let _ = write!(
        c,
        "[system]\npath = {:?}\n\n",
        data_dir.display().to_string()
    );
    c.push_str("[system.partition]\n");
    match arm.sync {
        IggySync::Always => {
            c.push_str("enforce_fsync = true\nmessages_required_to_save = 1\n\n");
        }
        IggySync::Off => c.push_str("enforce_fsync = false\n\n"),
    }
    let _ = write!(
        c,
        "[system.sharding]\ncpu_allocation = {cpu_allocation:?}\n\n"
    );
    c.push_str(
        "[tcp]\nenabled = false\naddress = \"127.0.0.1:0\"\n\n\
         [quic]\nenabled = true\naddress = \"127.0.0.1:0\"\n\n\
         [http]\nenabled = true\naddress = \"127.0.0.1:0\"\n\n\
         [http.metrics]\nenabled = true\nendpoint = \"/metrics\"\n\n\
         [websocket]\nenabled = false\naddress = \"127.0.0.1:0\"\n\n\
         [heartbeat]\nenabled = false\n\n\
         [telemetry]\nenabled = false\n\n\
         [cluster]\nenabled = false\n",
    );
    c
}

/// The QUIC and HTTP addresses in the server's `runtime/current_config.toml` (written once
/// every listener is bound), if the text is complete.
pub fn parse_bound_addresses(text: &str) -> Option<(SocketAddr, SocketAddr)> {
    let value: toml::Value = toml::from_str(text).ok()?;
    let addr = |section: &str| -> Option<SocketAddr> {
        value.get(section)?.get("address")?.as_str()?.parse().ok()
    };
    let (quic, http) = (addr("quic")?, addr("http")?);
    (quic.port() != 0 && http.port() != 0).then_some((quic, http))
}

/// An iggy-server started for one cell.
pub struct IggyServer {
    process: ServerProcess,
    pub quic_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub pid: u32,
}

impl std::fmt::Debug for IggyServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IggyServer")
            .field("quic_addr", &self.quic_addr)
            .field("http_addr", &self.http_addr)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl IggyServer {
    /// Starts `bin` for `arm` with a wiped `work_dir/iggy`; its output is appended to
    /// `work_dir/iggy-server.log`. On `server_cpus` when given (the pinned method).
    pub fn start(
        bin: &Path,
        arm: &crate::plan::Arm,
        work_dir: &Path,
        server_cpus: Option<&[usize]>,
    ) -> Result<IggyServer, BenchError> {
        let iggy = arm
            .iggy
            .ok_or_else(|| BenchError::Broker(format!("arm {:?} is not an Iggy arm", arm.name)))?;
        // Absolute: the server runs in `dir` and reads the config path and its data path
        // from there, so a relative `--out` would point it elsewhere.
        let work_dir = std::path::absolute(work_dir).map_err(|e| BenchError::io(work_dir, e))?;
        let work_dir = work_dir.as_path();
        let dir = work_dir.join("iggy");
        wipe_dir(&dir)?;
        let data = dir.join("data");
        let config_path = dir.join("server.toml");
        let config = server_config(&iggy, &data, &cpu_allocation(server_cpus)?);
        std::fs::write(&config_path, config).map_err(|e| BenchError::io(&config_path, e))?;
        let log = work_dir.join("iggy-server.log");
        let open_log = || {
            File::options()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|e| BenchError::io(&log, e))
        };
        let (out, err) = (open_log()?, open_log()?);
        let mut command = Command::new(bin);
        if let Some(cpus) = server_cpus {
            crate::pin::pin_command(&mut command, cpus)?;
        }
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("IGGY_") {
                command.env_remove(&key);
            }
        }
        let child = command
            .current_dir(&dir)
            .env("IGGY_CONFIG_PATH", &config_path)
            .env("IGGY_ROOT_USERNAME", ROOT_USER)
            .env("IGGY_ROOT_PASSWORD", ROOT_PASSWORD)
            .envs(arm.env.iter())
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|e| BenchError::io(bin, e))?;
        let pid = child.id();
        let mut server = IggyServer {
            process: ServerProcess::new(child, log),
            quic_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            pid,
        };
        let bound = data.join("runtime").join("current_config.toml");
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some((quic, http)) = std::fs::read_to_string(&bound)
                .ok()
                .and_then(|t| parse_bound_addresses(&t))
            {
                server.quic_addr = quic;
                server.http_addr = http;
                return Ok(server);
            }
            if let Some(status) = server.process.exited() {
                return Err(BenchError::Broker(format!(
                    "iggy-server exited at start ({status}); see {}",
                    server.process.log().display()
                )));
            }
            if Instant::now() >= deadline {
                server.process.kill();
                return Err(BenchError::Broker(format!(
                    "iggy-server did not write {} within {STARTUP_TIMEOUT:?}; see {}",
                    bound.display(),
                    server.process.log().display()
                )));
            }
            std::thread::sleep(STARTUP_POLL);
        }
    }

    /// SIGTERM, then SIGKILL after `broker::STOP_DEADLINE`; says how it ended.
    pub fn stop(mut self) -> Result<String, BenchError> {
        self.process.stop()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_binds_loopback_and_fsyncs_only_when_asked() {
        // Proves every listener is on 127.0.0.1 (TCP and WebSocket off), and enforce_fsync with a save per message appears only for sync = always.
        let data = Path::new("/tmp/iggy-data");
        let always = server_config(
            &IggyArm {
                sync: IggySync::Always,
            },
            data,
            "0..1",
        );
        let off = server_config(
            &IggyArm {
                sync: IggySync::Off,
            },
            data,
            "all",
        );
        for c in [&always, &off] {
            let v: toml::Value = toml::from_str(c).unwrap();
            assert_eq!(v["system"]["path"].as_str(), Some("/tmp/iggy-data"));
            for section in ["tcp", "quic", "http", "websocket"] {
                let addr: SocketAddr = v[section]["address"].as_str().unwrap().parse().unwrap();
                assert!(addr.ip().is_loopback(), "{section} binds {addr}");
            }
            for off_section in ["tcp", "websocket", "heartbeat", "telemetry", "cluster"] {
                assert_eq!(v[off_section]["enabled"].as_bool(), Some(false));
            }
            assert_eq!(v["http"]["metrics"]["enabled"].as_bool(), Some(true));
        }
        let v: toml::Value = toml::from_str(&always).unwrap();
        assert_eq!(
            v["system"]["partition"]["enforce_fsync"].as_bool(),
            Some(true)
        );
        assert_eq!(
            v["system"]["partition"]["messages_required_to_save"].as_integer(),
            Some(1)
        );
        assert_eq!(
            v["system"]["sharding"]["cpu_allocation"].as_str(),
            Some("0..1")
        );
        let v: toml::Value = toml::from_str(&off).unwrap();
        assert_eq!(
            v["system"]["partition"]["enforce_fsync"].as_bool(),
            Some(false)
        );
        assert!(
            v["system"]["partition"]
                .get("messages_required_to_save")
                .is_none()
        );
    }

    #[test]
    fn cpu_allocation_follows_the_pinned_method() {
        // Proves the server's shard CPUs are the pinned method's set as a range, "all" unpinned, and a gap is refused.
        assert_eq!(cpu_allocation(None).unwrap(), "all");
        assert_eq!(cpu_allocation(Some(&[0])).unwrap(), "0..1");
        assert_eq!(cpu_allocation(Some(&[3, 2, 4])).unwrap(), "2..5");
        assert!(cpu_allocation(Some(&[0, 2])).is_err());
    }

    #[test]
    fn bound_addresses_are_read_from_the_runtime_config() {
        // Proves the QUIC and HTTP ports come from current_config.toml, and a partial or port-0 file gives none.
        let text = "[quic]\nenabled = true\naddress = \"127.0.0.1:40123\"\n\
                    [http]\nenabled = true\naddress = \"127.0.0.1:40999\"\n";
        assert_eq!(
            parse_bound_addresses(text),
            Some((
                "127.0.0.1:40123".parse().unwrap(),
                "127.0.0.1:40999".parse().unwrap()
            ))
        );
        assert_eq!(
            parse_bound_addresses("[quic]\naddress = \"127.0.0.1:4"),
            None
        );
        assert_eq!(parse_bound_addresses(&text.replace("40999", "0")), None);
    }
}
