//! Test support: runs the real `felix` binary as a broker on ephemeral ports with a fresh data
//! directory, parses the ports it prints, and kills it when the guard is dropped.

#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use felix_client::{Client, ClientConfig};

/// Log segment size of test brokers (see `spawn`).
const TEST_SEGMENT_BYTES: &str = "4MiB";

/// A UDP port on loopback that no socket holds now, for an address a broker is told to bind
/// later (a cluster member's peer endpoint, named in every member's peer list before any
/// starts). Drawn at random from below the kernel's ephemeral range: every other socket of
/// the parallel tests (brokers, clients, relays) binds port 0, which the kernel takes from
/// that range only, so none of them can take this port between the check and the broker's
/// bind (a port asked of the OS with bind(0) and released could be handed out again at once).
pub fn free_peer_port() -> u16 {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    const FLOOR: u16 = 10_000;
    assert!(
        ephemeral_low > FLOOR + 1_000,
        "the ephemeral port range starts at {ephemeral_low}: no room below it for peer ports"
    );
    for _ in 0..1_000 {
        let port = rand::random_range(FLOOR..ephemeral_low);
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free UDP port in {FLOOR}..{ephemeral_low}");
}

/// Generous deadline for anything a test waits for (loaded 2-core machine, parallel tests).
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The `felix` binary with no FELIX_* variable inherited from the test's environment.
pub fn felix() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_felix"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("FELIX_") {
            command.env_remove(name);
        }
    }
    command.stdin(Stdio::null());
    command
}

/// Kills and reaps the child when dropped (also when a test panics).
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Collects a child's stderr on a thread, for failure messages.
pub fn collect(mut stream: impl std::io::Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = Arc::clone(&text);
    std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(read) = stream.read(&mut buffer) {
            if read == 0 {
                break;
            }
            if let Ok(mut sink) = sink.lock() {
                sink.push_str(&String::from_utf8_lossy(&buffer[..read]));
            }
        }
    });
    text
}

/// Streams a child's stdout lines to a channel, read with deadlines.
pub fn lines(stream: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

/// Next line before the deadline, or None if the stream ended or the deadline passed.
pub fn next_line(lines: &mpsc::Receiver<String>, deadline: Instant) -> Option<String> {
    let left = deadline.saturating_duration_since(Instant::now());
    lines.recv_timeout(left).ok()
}

/// A running broker process.
pub struct BrokerProcess {
    // Declared first so the process dies before the data directory is removed.
    child: ChildGuard,
    pub data_dir: tempfile::TempDir,
    pub quic_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub stderr: Arc<Mutex<String>>,
    /// Every stdout line printed up to the `quic listening` line (plan, pinning, buffers).
    pub startup_lines: Vec<String>,
    /// Each data-plane core's own address (`felix: core <i> listening on <addr>`), by index.
    pub core_addrs: Vec<SocketAddr>,
    stdout: mpsc::Receiver<String>,
    /// The environment it was started with (kept for `restart`).
    env: Vec<(String, String)>,
}

/// What one `felix broker` start produced.
struct Started {
    child: ChildGuard,
    quic_addr: SocketAddr,
    metrics_addr: SocketAddr,
    stderr: Arc<Mutex<String>>,
    startup_lines: Vec<String>,
    core_addrs: Vec<SocketAddr>,
    stdout: mpsc::Receiver<String>,
}

impl BrokerProcess {
    /// Starts `felix broker` with loopback ephemeral ports, a fresh data dir and `env`.
    pub fn start(env: &[(&str, &str)]) -> BrokerProcess {
        let data_dir = tempfile::tempdir().expect("temp dir");
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect();
        let started = Self::spawn(data_dir.path(), &env);
        BrokerProcess {
            child: started.child,
            data_dir,
            quic_addr: started.quic_addr,
            metrics_addr: started.metrics_addr,
            stderr: started.stderr,
            startup_lines: started.startup_lines,
            core_addrs: started.core_addrs,
            stdout: started.stdout,
            env,
        }
    }

    /// Kills the broker with SIGKILL (no shutdown of any kind) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.0.kill();
        self.child.0.wait().expect("broker reaped");
    }

    /// Starts the broker again on the same data directory and environment (new ports). The
    /// previous process must have exited (`kill` or `terminate`).
    pub fn restart(&mut self) {
        let started = Self::spawn(self.data_dir.path(), &self.env);
        self.child = started.child;
        self.quic_addr = started.quic_addr;
        self.metrics_addr = started.metrics_addr;
        self.stderr = started.stderr;
        self.startup_lines = started.startup_lines;
        self.core_addrs = started.core_addrs;
        self.stdout = started.stdout;
    }

    fn spawn(data_dir: &std::path::Path, env: &[(String, String)]) -> Started {
        let mut child = felix()
            .arg("broker")
            .env("FELIX_DATA_DIR", data_dir)
            .env("FELIX_BIND", "127.0.0.1:0")
            .env("FELIX_METRICS_BIND", "127.0.0.1:0")
            // A core with a durable shard preallocates segments; the 1 GiB default times the
            // tests running in parallel would fill a CI disk. Tests that care set their own.
            .env("FELIX_DURABLE_SEGMENT_BYTES", TEST_SEGMENT_BYTES)
            .envs(env.iter().map(|(name, value)| (name, value)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("felix binary starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = collect(child.stderr.take().expect("piped stderr"));
        let child = ChildGuard(child);
        let stdout = lines(stdout);
        let deadline = Instant::now() + DEADLINE;
        let mut quic_addr = None;
        let mut metrics_addr = None;
        let mut startup_lines = Vec::new();
        let mut core_addrs = Vec::new();
        while quic_addr.is_none() || metrics_addr.is_none() {
            let Some(line) = next_line(&stdout, deadline) else {
                drop(child);
                panic!(
                    "broker did not announce its ports; stderr:\n{}",
                    stderr.lock().map(|text| text.clone()).unwrap_or_default()
                );
            };
            startup_lines.push(line.clone());
            if let Some(rest) = line.strip_prefix("felix: core ")
                && let Some((index, addr)) = rest.split_once(" listening on ")
            {
                let index: usize = index.parse().expect("core index parses");
                assert_eq!(index, core_addrs.len(), "cores are announced in order");
                core_addrs.push(addr.parse().expect("core address parses"));
            }
            if let Some(addr) = line.strip_prefix("felix: quic listening on ") {
                quic_addr = Some(addr.parse().expect("quic address parses"));
            } else if let Some(addr) = line.strip_prefix("felix: metrics listening on ") {
                metrics_addr = Some(addr.parse().expect("metrics address parses"));
            }
        }
        Started {
            child,
            quic_addr: quic_addr.expect("loop ends with an address"),
            metrics_addr: metrics_addr.expect("loop ends with an address"),
            stderr,
            startup_lines,
            core_addrs,
            stdout,
        }
    }

    /// The development certificate the broker generated (the client's CA).
    pub fn ca_path(&self) -> PathBuf {
        self.data_dir.path().join("tls/dev-cert.pem")
    }

    pub fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new(self.quic_addr);
        config.ca = Some(self.ca_path());
        config.client_name = "felix-tests".to_owned();
        config
    }

    /// A client that ignores the shard map: one connection to the shared port, one publish
    /// stream, so each publish call is exactly one request at the broker.
    pub fn naive_client_config(&self) -> ClientConfig {
        let mut config = self.client_config();
        config.core_aware = false;
        config.pub_shard_streams = 1;
        config
    }

    /// A connected client (within the deadline).
    pub async fn client(&self) -> Client {
        within(Client::connect(self.client_config()))
            .await
            .expect("client connects")
    }

    /// `felix` configured to reach this broker, for CLI tests.
    pub fn cli(&self) -> Command {
        let mut command = felix();
        command
            .env("FELIX_DATA_DIR", self.data_dir.path())
            .env("FELIX_ADDR", self.quic_addr.to_string());
        command
    }

    /// The body of `GET /metrics`.
    pub fn metrics(&self) -> String {
        let mut stream = TcpStream::connect(self.metrics_addr).expect("metrics endpoint accepts");
        stream
            .set_read_timeout(Some(DEADLINE))
            .expect("timeout set");
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: felix\r\n\r\n")
            .expect("request written");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("response read");
        assert!(response.starts_with("HTTP/1."), "not HTTP: {response}");
        assert!(response.contains(" 200 "), "not 200: {response}");
        response
    }

    pub fn stderr_text(&self) -> String {
        self.stderr
            .lock()
            .map(|text| text.clone())
            .unwrap_or_default()
    }

    /// Sends signal `name` (`HUP`, ...) and returns at once.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.0.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name} failed");
    }

    /// The broker's resident memory in bytes (VmRSS of /proc/<pid>/status).
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.0.id()))
            .expect("the broker's /proc status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().strip_suffix("kB"))
            .and_then(|kib| kib.trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .expect("VmRSS in kB")
    }

    /// The names of the broker's threads (`/proc/<pid>/task/*/comm`).
    pub fn thread_names(&self) -> Vec<String> {
        let tasks = format!("/proc/{}/task", self.child.0.id());
        let mut names: Vec<String> = std::fs::read_dir(&tasks)
            .expect("the broker's /proc tasks")
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .map(|name| name.trim_end().to_owned())
            .collect();
        names.sort();
        names
    }

    /// Sends SIGTERM and waits (within the deadline) for the broker to exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.stop_with("TERM")
    }

    /// Sends signal `name` (`TERM`, `INT`) and waits (within the deadline) for the broker to
    /// exit.
    pub fn stop_with(&mut self, name: &str) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.0.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name} failed");
        // Its stdout closes when it exits; only then is waiting for it bounded.
        let deadline = Instant::now() + DEADLINE;
        while next_line(&self.stdout, deadline).is_some() {}
        assert!(
            Instant::now() < deadline,
            "broker did not exit after SIGTERM"
        );
        self.child.0.wait().expect("broker reaped")
    }
}

/// Awaits `future` within [`DEADLINE`], panicking if it takes longer.
pub async fn within<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, future)
        .await
        .expect("operation finished within the deadline")
}

/// The value of an unlabelled metric line `name value` in a Prometheus text body.
pub fn metric_value(body: &str, name: &str) -> Option<u64> {
    body.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// The value of a labelled metric line `name{labels} value` in a Prometheus text body.
pub fn labelled_value(body: &str, name_and_labels: &str) -> Option<f64> {
    body.lines().find_map(|line| {
        let rest = line.strip_prefix(name_and_labels)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// Sum over every core of a per-core counter `name{core="i"}`.
pub fn sum_over_cores(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|line| line.starts_with(&format!("{name}{{core=")))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A QUIC + TLS connection to a broker with no Felix handshake yet (s2n-quic client, not
/// felix-client): for tests that write frames (or bytes) by hand.
pub struct RawQuic {
    // Kept so the endpoint outlives the connection.
    _endpoint: s2n_quic::Client,
    pub connection: s2n_quic::connection::Connection,
}

/// Connects to `addr` trusting the broker's development certificate, optionally presenting a
/// client certificate (PEM cert, PEM key) for mutual TLS. `Err` is the connection error
/// (a TLS refusal, say).
pub async fn raw_quic(
    broker: &BrokerProcess,
    addr: SocketAddr,
    identity: Option<(&str, &str)>,
) -> Result<RawQuic, s2n_quic::connection::Error> {
    let ca = std::fs::read_to_string(broker.ca_path()).expect("dev cert readable");
    let mut tls = s2n_quic::provider::tls::default::Client::builder()
        .with_certificate(ca.as_str())
        .and_then(|builder| builder.with_application_protocols([felix_wire::ALPN]))
        .expect("tls client");
    if let Some((cert, key)) = identity {
        tls = tls
            .with_client_identity(cert, key)
            .expect("client identity");
    }
    let endpoint = s2n_quic::Client::builder()
        .with_tls(tls.build().expect("tls client"))
        .expect("tls provider")
        .with_io("127.0.0.1:0")
        .expect("io provider")
        .start()
        .expect("client endpoint");
    let connect = s2n_quic::client::Connect::new(addr).with_server_name("localhost");
    let connection = within(endpoint.connect(connect)).await?;
    Ok(RawQuic {
        _endpoint: endpoint,
        connection,
    })
}

/// A Hello of protocol v1 with `token`.
pub fn hello(token: Option<&str>) -> felix_wire::Frame {
    felix_wire::Frame::Hello(felix_wire::Hello {
        min_version: 1,
        max_version: 1,
        features: 0,
        client_name: "raw-test".to_owned(),
        token: token.map(|token| bytes::Bytes::from(token.to_owned())),
    })
}

/// One bidirectional stream of a raw connection, with its receive buffer.
pub struct RawStream {
    pub stream: s2n_quic::stream::BidirectionalStream,
    buffer: bytes::BytesMut,
    decoder: felix_wire::Decoder,
}

impl RawQuic {
    /// Opens a stream.
    pub async fn open(&mut self) -> RawStream {
        let stream = within(self.connection.open_bidirectional_stream())
            .await
            .expect("stream opened");
        RawStream {
            stream,
            buffer: bytes::BytesMut::new(),
            decoder: felix_wire::Decoder::new(felix_wire::Limits::DEFAULT),
        }
    }

    /// Opens the hello stream, sends `hello` and returns the stream and the broker's answer.
    pub async fn handshake(
        &mut self,
        hello: &felix_wire::Frame,
    ) -> (RawStream, Option<felix_wire::Frame>) {
        let mut stream = self.open().await;
        stream.write(hello).await;
        let answer = stream.read().await;
        (stream, answer)
    }

    /// The application close code the broker closed the connection with (waits for it).
    pub async fn closed_with(&mut self) -> Option<u64> {
        match within(self.connection.accept_bidirectional_stream()).await {
            Err(s2n_quic::connection::Error::Application { error, .. }) => Some(*error),
            _ => None,
        }
    }
}

impl RawStream {
    pub async fn write(&mut self, frame: &felix_wire::Frame) {
        let mut out = bytes::BytesMut::new();
        felix_wire::encode(frame, &mut out);
        self.write_bytes(out.freeze()).await;
    }

    pub async fn write_bytes(&mut self, bytes: bytes::Bytes) {
        within(self.stream.send(bytes)).await.expect("sent");
    }

    /// The next frame, or None when the broker finished (or reset) the stream or the
    /// connection is gone.
    pub async fn read(&mut self) -> Option<felix_wire::Frame> {
        loop {
            if let Some(frame) = self
                .decoder
                .decode(&mut self.buffer)
                .expect("broker frames decode")
            {
                return Some(frame);
            }
            match within(self.stream.receive()).await {
                Ok(Some(chunk)) => self.buffer.extend_from_slice(&chunk),
                Ok(None) | Err(_) => return None,
            }
        }
    }
}

/// Waits (within the deadline) until `check` holds, polling every few milliseconds.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !check() {
        assert!(Instant::now() < deadline, "not within the deadline: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
