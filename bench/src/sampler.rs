//! Reads the broker's cumulative counters once a second into [`Sample`]s.
//!
//! Sources: the broker's Prometheus `/metrics` (plain HTTP/1.0 GET over a `TcpStream`), the
//! broker process's CPU time from `/proc/<pid>/stat` when no CPU metric exists, and the kernel's
//! UDP `RcvbufErrors` from `/proc/net/snmp`. A NATS peer is read from its monitoring port
//! instead ([`Counters`]): `/jsz` (messages and bytes summed over every JetStream stream) or
//! `/varz` (core `in_msgs` / `in_bytes`). Context switches of the broker process are summed over
//! `/proc/<pid>/task/*/status` (see [`process_ctx_switches`]). Every metric name the bench reads is in
//! [`metric_names`]; each metric is the sum of every series of its family across labels, so a
//! per-core broker (`{core="3"}` labels) and a single-core one read the same way.
//!
//! Threads: [`Sampler`] runs one housekeeping thread per cell; the first sample is taken on the
//! caller's thread before the generators start and the last after they finish.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::BenchError;
use crate::stats::Sample;

/// The metric names the bench reads, in one place: the broker's metric set is still moving
/// (thread-per-core, per-core series), and only this module needs to follow it. Names are the
/// sample names as exposed (counters with their `_total` suffix).
pub mod metric_names {
    /// Payload bytes of accepted publishes.
    pub const PAYLOAD_BYTES: &str = "felix_payload_bytes_total";
    /// Records of accepted publishes.
    pub const RECORDS: &str = "felix_records_total";
    /// Bytes appended to durable logs (payload + framing); absent until durable streams land.
    pub const APPEND_BYTES: &[&str] = &["felix_append_bytes_total", "felix_log_append_bytes_total"];
    /// UDP bytes received on the QUIC ports; absent until the broker counts them.
    pub const WIRE_BYTES: &[&str] = &["felix_wire_bytes_total"];
    /// Fire-and-forget publishes shed by a full ingress queue (all cores).
    pub const SHED: &[&str] = &[
        "felix_publishes_shed_total",
        "felix_core_ingress_shed_total",
    ];
    /// Publishes refused by a full ingress queue (all cores).
    pub const REFUSED: &[&str] = &[
        "felix_publishes_refused_total",
        "felix_core_ingress_refused_total",
    ];
    /// Error family; without a refusal counter, refusals are its series with [`REFUSED_CODE`].
    pub const ERRORS: &str = "felix_errors_total";
    /// The error code of a publish refused for lack of ingress room.
    pub const REFUSED_CODE: (&str, &str) = ("code", "ingress_budget_exhausted");
    /// Whole-process broker CPU seconds, when exported.
    pub const PROCESS_CPU_SECONDS: &[&str] =
        &["felix_cpu_seconds_total", "process_cpu_seconds_total"];
    /// CPU seconds of the data-plane core threads only (a gauge per core), used when neither a
    /// process metric nor the broker's pid is available.
    pub const CORE_CPU_SECONDS: &str = "felix_core_cpu_seconds";
    /// fsync / fdatasync calls of durable logs.
    pub const FSYNCS: &[&str] = &["felix_fsyncs_total", "felix_log_fsyncs_total"];
}

/// Connect and read timeout of one scrape. The endpoint answers in well under a millisecond;
/// 2 s means a broker too busy to answer costs one missed sample, not a stuck cell.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest `/metrics` answer read: 16 MiB. Per-core series for hundreds of cores stay far
/// below; a larger answer is a defect and is refused rather than buffered.
pub const SCRAPE_BYTES_MAX: u64 = 16 * 1024 * 1024;

/// Sampling period: one second, the broker-counter cadence the method is defined on.
pub const SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// Linux reports /proc/<pid>/stat times in USER_HZ ticks, fixed at 100 by the kernel ABI on
/// every architecture we run on (it is not CONFIG_HZ).
const USER_HZ: f64 = 100.0;

/// One sample line: metric name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Series {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Parsed Prometheus text: every sample line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    series: Vec<Series>,
}

impl Scrape {
    /// Parses the Prometheus / OpenMetrics text format; lines it cannot read are skipped.
    pub fn parse(text: &str) -> Scrape {
        let mut series = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, labels, rest) = match line.find(['{', ' ']) {
                Some(i) if line.as_bytes()[i] == b'{' => {
                    let Some(close) = line[i..].rfind('}') else {
                        continue;
                    };
                    (
                        &line[..i],
                        parse_labels(&line[i + 1..i + close]),
                        &line[i + close + 1..],
                    )
                }
                Some(i) => (&line[..i], Vec::new(), &line[i..]),
                None => continue,
            };
            let Some(value) = rest
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
            else {
                continue;
            };
            series.push(Series {
                name: name.to_string(),
                labels,
                value,
            });
        }
        Scrape { series }
    }

    /// The sum of every series named `name`, or `None` when there is none.
    pub fn sum(&self, name: &str) -> Option<f64> {
        self.sum_where(name, None)
    }

    /// The sum of the series named `name` whose label `k` equals `v` (all series when `None`).
    pub fn sum_where(&self, name: &str, label: Option<(&str, &str)>) -> Option<f64> {
        let mut found = None;
        for series in &self.series {
            if series.name != name {
                continue;
            }
            if let Some((k, v)) = label
                && !series.labels.iter().any(|(lk, lv)| lk == k && lv == v)
            {
                continue;
            }
            *found.get_or_insert(0.0) += series.value;
        }
        found
    }

    /// The first of `names` that exists, summed.
    pub fn sum_any(&self, names: &[&str]) -> Option<f64> {
        names.iter().find_map(|n| self.sum(n))
    }
}

fn parse_labels(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        let Some(stripped) = after.strip_prefix('"') else {
            break;
        };
        // Label values escape `"` as `\"`; find the closing quote that is not escaped.
        let bytes = stripped.as_bytes();
        let mut end = None;
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => i += 2,
                b'"' => {
                    end = Some(i);
                    break;
                }
                _ => i += 1,
            }
        }
        let Some(end) = end else { break };
        out.push((key, stripped[..end].replace("\\\"", "\"")));
        rest = &stripped[end + 1..];
    }
    out
}

fn counter(value: Option<f64>) -> u64 {
    // Counters are non-negative integers; a float encoding (e.g. 1.5e9) converts exactly
    // below 2^53, and a missing metric reads 0.
    value.map_or(0, |v| {
        if v.is_finite() && v > 0.0 {
            v as u64
        } else {
            0
        }
    })
}

/// `GET /metrics` over plain HTTP/1.0; the body of a 200 answer.
pub fn scrape(addr: SocketAddr) -> Result<String, BenchError> {
    http_get(addr, "/metrics")
}

/// One plain HTTP/1.0 GET of `path`; the body of a 200 answer.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<String, BenchError> {
    let fail = |detail: String| BenchError::Sampler(format!("GET http://{addr}{path}: {detail}"));
    let mut stream =
        TcpStream::connect_timeout(&addr, SCRAPE_TIMEOUT).map_err(|e| fail(e.to_string()))?;
    stream
        .set_read_timeout(Some(SCRAPE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(SCRAPE_TIMEOUT)))
        .map_err(|e| fail(e.to_string()))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| fail(e.to_string()))?;
    let mut raw = Vec::new();
    stream
        .take(SCRAPE_BYTES_MAX + 1)
        .read_to_end(&mut raw)
        .map_err(|e| fail(e.to_string()))?;
    if raw.len() as u64 > SCRAPE_BYTES_MAX {
        return Err(fail(format!("answer larger than {SCRAPE_BYTES_MAX} bytes")));
    }
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(fail("no HTTP header end".to_string()));
    };
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(fail(format!("answer {status:?}")));
    }
    Ok(body.to_string())
}

/// CPU seconds (user + system) of process `pid` from `/proc/<pid>/stat`.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_proc_stat_cpu(&text)
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line, in seconds. The command name
/// (field 2) is in parentheses and may hold spaces, so fields are counted after the last `)`.
pub fn parse_proc_stat_cpu(text: &str) -> Option<f64> {
    let after = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After ')': field 3 (state) is index 0, so utime (14) is index 11 and stime (15) index 12.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

/// The kernel's UDP `RcvbufErrors` from `/proc/net/snmp` (0 when unreadable).
pub fn udp_rcvbuf_errors() -> u64 {
    std::fs::read_to_string("/proc/net/snmp")
        .ok()
        .and_then(|t| parse_snmp_udp(&t, "RcvbufErrors"))
        .unwrap_or(0)
}

/// One field of the `Udp:` header/value line pair of `/proc/net/snmp`.
pub fn parse_snmp_udp(text: &str, field: &str) -> Option<u64> {
    let mut udp = text.lines().filter(|l| l.starts_with("Udp:"));
    let header = udp.next()?;
    let values = udp.next()?;
    let index = header.split_whitespace().position(|h| h == field)?;
    values.split_whitespace().nth(index)?.parse().ok()
}

/// Where a sample's numbers come from.
/// Which counters a broker exposes on its metrics / monitoring address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Counters {
    /// Felix's Prometheus `/metrics`.
    #[default]
    Felix,
    /// nats-server `/jsz`: stored messages and bytes summed over every stream; payload bytes
    /// are messages x the cell's payload size (the reference counts "records the server
    /// stored times the payload size"), stream bytes (with NATS's per-message framing) go to
    /// `append_bytes`.
    NatsJetStream { payload_bytes: u32 },
    /// nats-server `/varz`: `in_msgs` x payload size as payload, `in_bytes` as wire bytes.
    NatsCore { payload_bytes: u32 },
    /// iggy-server's Prometheus `/metrics`: the `messages` gauge (messages appended, counted
    /// by the server after each append, shared by every server shard) x payload size.
    Iggy { payload_bytes: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleSource {
    pub metrics_addr: SocketAddr,
    /// Broker process for CPU time (when no CPU metric exists) and context switches.
    pub pid: Option<u32>,
    pub counters: Counters,
}

impl SampleSource {
    /// One reading at `t_s` seconds since the cell start.
    pub fn sample(&self, t_s: f64) -> Result<Sample, BenchError> {
        let mut sample = match self.counters {
            Counters::Felix => {
                let scrape = Scrape::parse(&scrape(self.metrics_addr)?);
                sample_from(&scrape, t_s, self.pid)
            }
            Counters::NatsJetStream { payload_bytes } => {
                let body = http_get(self.metrics_addr, "/jsz")?;
                nats_sample(&body, t_s, payload_bytes, "messages", "bytes", false)?
            }
            Counters::NatsCore { payload_bytes } => {
                let body = http_get(self.metrics_addr, "/varz")?;
                nats_sample(&body, t_s, payload_bytes, "in_msgs", "in_bytes", true)?
            }
            Counters::Iggy { payload_bytes } => iggy_sample(
                &Scrape::parse(&scrape(self.metrics_addr)?),
                t_s,
                payload_bytes,
            )?,
        };
        if self.counters != Counters::Felix {
            sample.cpu_seconds = self.pid.and_then(process_cpu_seconds).unwrap_or(0.0);
            sample.udp_rcvbuf_errors = udp_rcvbuf_errors();
        }
        sample.ctx_switches = self.pid.and_then(process_ctx_switches).unwrap_or(0);
        Ok(sample)
    }
}

/// A sample from a nats-server monitoring answer (`/jsz` or `/varz` JSON): `msgs_field`
/// counts records, `bytes_field` goes to wire bytes (core) or append bytes (JetStream).
pub fn nats_sample(
    body: &str,
    t_s: f64,
    payload_bytes: u32,
    msgs_field: &str,
    bytes_field: &str,
    core: bool,
) -> Result<Sample, BenchError> {
    let value: serde_json::Value = serde_json::from_str(body)
        .map_err(|e| BenchError::Sampler(format!("nats monitoring answer is not JSON: {e}")))?;
    let field = |name: &str| {
        value
            .get(name)
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| {
                BenchError::Sampler(format!(
                    "nats monitoring answer has no unsigned `{name}` field"
                ))
            })
    };
    let records = field(msgs_field)?;
    let bytes = field(bytes_field)?;
    let mut sample = Sample {
        t_s,
        records,
        payload_bytes: records.saturating_mul(u64::from(payload_bytes)),
        ..Sample::default()
    };
    if core {
        sample.wire_bytes = bytes;
    } else {
        sample.append_bytes = bytes;
    }
    Ok(sample)
}

/// Name of iggy-server's gauge of messages appended (its `/metrics`, server 0.8).
pub const IGGY_MESSAGES: &str = "messages";

/// A sample from an iggy-server `/metrics` scrape: the `messages` gauge is the record count,
/// times the cell's payload size the payload bytes.
pub fn iggy_sample(scrape: &Scrape, t_s: f64, payload_bytes: u32) -> Result<Sample, BenchError> {
    let records = scrape
        .sum(IGGY_MESSAGES)
        .ok_or_else(|| BenchError::Sampler(format!("iggy /metrics has no `{IGGY_MESSAGES}`")))?;
    let records = counter(Some(records));
    Ok(Sample {
        t_s,
        records,
        payload_bytes: records.saturating_mul(u64::from(payload_bytes)),
        ..Sample::default()
    })
}

/// Context switches (voluntary + involuntary) of every live thread of process `pid`, summed
/// over `/proc/<pid>/task/*/status`. `/proc/<pid>/status` alone counts only the main thread.
/// (perf-event 0.4 can count a pid's `context-switches`, but `inherit` covers only threads
/// created after the counter is opened and a broker's threads exist by the time its ports are
/// known, so it would need one counter per thread; /proc gives the same totals without
/// perf_event_open permissions.)
pub fn process_ctx_switches(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    for task in tasks.flatten() {
        // A thread that exited between listing and reading is simply not counted.
        if let Ok(text) = std::fs::read_to_string(task.path().join("status")) {
            total = total.saturating_add(parse_ctx_switches(&text).unwrap_or(0));
        }
    }
    Some(total)
}

/// `voluntary_ctxt_switches` + `nonvoluntary_ctxt_switches` of one `/proc/.../status` text.
pub fn parse_ctx_switches(status: &str) -> Option<u64> {
    let mut voluntary = None;
    let mut involuntary = None;
    for line in status.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim().parse::<u64>().ok();
        match name.trim() {
            "voluntary_ctxt_switches" => voluntary = value,
            "nonvoluntary_ctxt_switches" => involuntary = value,
            _ => {}
        }
    }
    Some(voluntary?.saturating_add(involuntary?))
}

/// A [`Sample`] from one scrape plus /proc.
pub fn sample_from(scrape: &Scrape, t_s: f64, pid: Option<u32>) -> Sample {
    use metric_names as m;
    // Whole process first (metric, else /proc), core threads only as the last resort.
    let cpu_seconds = scrape
        .sum_any(m::PROCESS_CPU_SECONDS)
        .or_else(|| pid.and_then(process_cpu_seconds))
        .or_else(|| scrape.sum(m::CORE_CPU_SECONDS))
        .unwrap_or(0.0);
    Sample {
        t_s,
        payload_bytes: counter(scrape.sum(m::PAYLOAD_BYTES)),
        append_bytes: counter(scrape.sum_any(m::APPEND_BYTES)),
        wire_bytes: counter(scrape.sum_any(m::WIRE_BYTES)),
        records: counter(scrape.sum(m::RECORDS)),
        cpu_seconds,
        udp_rcvbuf_errors: udp_rcvbuf_errors(),
        publishes_shed: counter(scrape.sum_any(m::SHED)),
        publishes_refused: counter(
            scrape
                .sum_any(m::REFUSED)
                .or_else(|| scrape.sum_where(m::ERRORS, Some(m::REFUSED_CODE))),
        ),
        fsyncs: counter(scrape.sum_any(m::FSYNCS)),
        // Filled in by SampleSource::sample from /proc when the pid is known.
        ctx_switches: 0,
    }
}

/// Samples a broker once a second on its own thread until [`Sampler::finish`].
pub struct Sampler {
    source: SampleSource,
    first_payload_bytes: u64,
    start: Instant,
    stop: mpsc::Sender<()>,
    thread: Option<JoinHandle<(Vec<Sample>, usize)>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// Takes the first sample now (an unreachable endpoint fails the cell here, before any
    /// load), then one every [`SAMPLE_PERIOD`] after `start` on a housekeeping thread.
    pub fn start(source: SampleSource, start: Instant) -> Result<Sampler, BenchError> {
        let first = source.sample(start.elapsed().as_secs_f64())?;
        let first_payload_bytes = first.payload_bytes;
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("felix-bench-sampler".to_string())
            .spawn(move || {
                let mut samples = vec![first];
                let mut missed = 0usize;
                let mut tick = 1u32;
                loop {
                    let due = start + SAMPLE_PERIOD * tick;
                    tick += 1;
                    let wait = due.saturating_duration_since(Instant::now());
                    match stopped.recv_timeout(wait) {
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        // Asked to stop, or the sampler handle is gone.
                        _ => break,
                    }
                    match source.sample(start.elapsed().as_secs_f64()) {
                        Ok(s) => samples.push(s),
                        Err(_) => missed += 1,
                    }
                }
                (samples, missed)
            })
            .map_err(|e| BenchError::Sampler(format!("cannot start the sampler thread: {e}")))?;
        Ok(Sampler {
            source,
            first_payload_bytes,
            start,
            stop,
            thread: Some(thread),
        })
    }

    /// The payload bytes counter at the first sample.
    pub fn first_payload_bytes(&self) -> u64 {
        self.first_payload_bytes
    }

    /// The payload bytes accepted so far (a scrape on the caller's thread).
    pub fn payload_bytes_now(&self) -> Result<u64, BenchError> {
        Ok(self
            .source
            .sample(self.start.elapsed().as_secs_f64())?
            .payload_bytes)
    }

    /// Stops the thread and takes the last sample now. Returns the samples in time order and
    /// how many periodic scrapes failed.
    pub fn finish(mut self) -> Result<(Vec<Sample>, usize), BenchError> {
        let _ = self.stop.send(());
        let (mut samples, missed) = match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            _ => {
                return Err(BenchError::Sampler(
                    "the sampler thread panicked".to_string(),
                ));
            }
        };
        let last = self.source.sample(self.start.elapsed().as_secs_f64())?;
        samples.push(last);
        Ok((samples, missed))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP felix_payload_bytes Payload bytes\n\
        # TYPE felix_payload_bytes counter\n\
        felix_payload_bytes_total{core=\"0\"} 1000\n\
        felix_payload_bytes_total{core=\"1\"} 234\n\
        felix_records_total 7\n\
        felix_errors_total{code=\"too_old\"} 3\n\
        felix_errors_total{code=\"ingress_budget_exhausted\"} 2\n\
        felix_errors_total{code=\"weird \\\"q\\\"\",core=\"1\"} 5\n\
        process_cpu_seconds_total 1.5e0\n\
        # EOF\n";

    #[test]
    fn every_series_of_a_family_is_summed() {
        // Proves a metric reads as the sum over all its label sets, and a label filter selects refusals only.
        let s = Scrape::parse(TEXT);
        assert_eq!(s.sum("felix_payload_bytes_total"), Some(1234.0));
        assert_eq!(s.sum("felix_records_total"), Some(7.0));
        assert_eq!(s.sum("felix_errors_total"), Some(10.0));
        assert_eq!(
            s.sum_where("felix_errors_total", Some(metric_names::REFUSED_CODE)),
            Some(2.0)
        );
        assert_eq!(s.sum("absent_total"), None);
        let sample = sample_from(&s, 2.0, None);
        assert_eq!(
            (
                sample.payload_bytes,
                sample.records,
                sample.publishes_refused
            ),
            (1234, 7, 2)
        );
        assert_eq!(sample.cpu_seconds, 1.5);
        assert_eq!(sample.append_bytes, 0);
    }

    #[test]
    fn context_switches_are_parsed_from_status_text() {
        // Proves voluntary and involuntary switches are summed, and a text without them reads as None.
        let status = "Name:\tfelix-core-0\nState:\tS (sleeping)\nThreads:\t9\n\
                      voluntary_ctxt_switches:\t1500\nnonvoluntary_ctxt_switches:\t42\n";
        assert_eq!(parse_ctx_switches(status), Some(1542));
        assert_eq!(
            parse_ctx_switches("Name:\tx\nvoluntary_ctxt_switches:\t3\n"),
            None
        );
        assert!(process_ctx_switches(std::process::id()).is_some());
    }

    #[test]
    fn nats_monitoring_answers_become_samples() {
        // Proves /jsz messages x payload is the payload count and /varz in_msgs/in_bytes are read for core NATS.
        let jsz = r#"{"memory":0,"storage":5000,"streams":8,"messages":20,"bytes":5000}"#;
        let s = nats_sample(jsz, 1.0, 200, "messages", "bytes", false).unwrap();
        assert_eq!(
            (s.records, s.payload_bytes, s.append_bytes),
            (20, 4000, 5000)
        );
        let varz = r#"{"in_msgs":10,"in_bytes":2560,"out_msgs":0}"#;
        let s = nats_sample(varz, 1.0, 256, "in_msgs", "in_bytes", true).unwrap();
        assert_eq!((s.records, s.payload_bytes, s.wire_bytes), (10, 2560, 2560));
        assert!(nats_sample("{}", 1.0, 1, "messages", "bytes", false).is_err());
        assert!(nats_sample("not json", 1.0, 1, "messages", "bytes", false).is_err());
    }

    #[test]
    fn iggy_metrics_become_samples() {
        // Proves the iggy-server `messages` gauge (prometheus-client text) is the record count and x payload the payload bytes.
        let text = "# HELP messages total count of messages.\n# TYPE messages gauge\nmessages 1500\n\
                    # HELP streams total count of streams.\n# TYPE streams gauge\nstreams 1\n# EOF\n";
        let s = iggy_sample(&Scrape::parse(text), 2.0, 256).unwrap();
        assert_eq!((s.records, s.payload_bytes, s.t_s), (1500, 384_000, 2.0));
        assert!(iggy_sample(&Scrape::parse("streams 1\n"), 2.0, 256).is_err());
    }

    #[test]
    fn proc_files_are_parsed() {
        // Proves CPU time is utime+stime in USER_HZ ticks even with spaces in the command name, and RcvbufErrors is found by header.
        let stat = "4242 (felix core) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 3 0";
        assert_eq!(parse_proc_stat_cpu(stat), Some(3.0));
        let snmp = "Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors\n\
                    Udp: 100 0 4 90 17 0\n";
        assert_eq!(parse_snmp_udp(snmp, "RcvbufErrors"), Some(17));
        assert_eq!(parse_snmp_udp(snmp, "Nope"), None);
        assert!(process_cpu_seconds(std::process::id()).is_some());
    }
}
