//! The Iggy load generator (cargo feature `iggy`): the `iggy` 0.10 client crate over QUIC
//! against the iggy-server [`crate::iggy::IggyServer`] started per cell, landing in the same
//! records and steady-window statistics as the Felix and NATS drivers.
//!
//! Per cell: one stream (`bench`) with one topic (`bench`) of one partition per Felix shard
//! (`settings.shards`), created by an admin connection. Iggy's QUIC client holds its connection
//! for the whole of a request and its answer (one request in flight per connection), so each
//! publisher opens `min(in_flight, CONNECTIONS_PER_PUBLISHER_MAX)` connections ("lanes"), each
//! with one SendMessages of `batch` messages outstanding. Sends rotate over the partitions by
//! partition id, offset per lane, as the Felix generator's keys rotate over shards. A SendMessages
//! is answered after the server appended it (and, with `sync = "always"`, wrote and fsynced it):
//! that is the acked mode. Iggy has no unacknowledged publish, so there is no fire-and-forget arm.
//!
//! Counting is at the server: its `/metrics` `messages` gauge once a second (x payload), CPU from
//! `/proc/<pid>/stat`, context switches from `/proc/<pid>/task/*/status`.
//!
//! Latency cells: one publisher, one lane, one request in flight; the ack time of the measured
//! sends (after the warm-up count) is recorded. No consumer is timed (no delivery latency).
//!
//! Threads: the generators are tasks on the driver's own multi-thread tokio runtime (the iggy
//! client spawns one task per request), the sampler has its own thread.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use iggy::prelude::{
    Client, ClientWrapper, CompressionAlgorithm, Identifier, IggyClient, IggyExpiry, IggyMessage,
    MaxTopicSize, MessageClient, Partitioning, QuicClientConfig, StreamClient, TopicClient,
    UserClient,
};
use iggy::quic::quic_client::QuicClient;

use crate::BenchError;
use crate::cell::{CellDriver, CellRun};
use crate::generator::{
    LatencyCounts, PublisherResult, assemble_run, drain, join_load, nanos_since, new_histogram,
    record_ns,
};
use crate::iggy::{IggyServer, ROOT_PASSWORD, ROOT_USER, STREAM, TOPIC};
use crate::plan::{Arm, Cell, Measure, Mode, Settings};
use crate::sampler::{Counters, SampleSource, Sampler};
use crate::stats::{Counts, Span};

/// Most QUIC connections per publisher: 8. The client keeps one request in flight per
/// connection; 8 publishers x 8 lanes = 64 requests outstanding keeps the server busy without
/// making hundreds of connections (each a login) on the generator's one CPU.
pub const CONNECTIONS_PER_PUBLISHER_MAX: u32 = 8;

/// Time to connect every lane and create the stream and topic.
const SETUP_DEADLINE: Duration = Duration::from_secs(120);

/// Longest wait for one SendMessages answer: 30 s. An fsynced 256 KiB batch takes milliseconds;
/// a request never answered (seen once in ~60 runs: a lane's answer never came while the server
/// sat idle) fails the cell instead of hanging the campaign.
const SEND_DEADLINE: Duration = Duration::from_secs(30);

/// Longest wait for a lane's client to shut down after its last send; then it is dropped.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(2);

/// The Iggy load generator.
pub struct IggyDriver {
    server_bin: PathBuf,
    work_dir: PathBuf,
    runtime: tokio::runtime::Runtime,
    latency: LatencyCounts,
    /// How each started server ended, one line per run.
    pub server_exits: Vec<String>,
}

impl std::fmt::Debug for IggyDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IggyDriver")
            .field("server_bin", &self.server_bin)
            .finish_non_exhaustive()
    }
}

impl IggyDriver {
    /// A driver that starts `server_bin` per cell in `work_dir`.
    pub fn new(
        server_bin: PathBuf,
        work_dir: PathBuf,
        latency: LatencyCounts,
    ) -> Result<IggyDriver, BenchError> {
        // quinn's rustls needs a process-wide crypto provider when several are compiled in;
        // already set (by the NATS driver or the Felix client) is fine.
        let _ = rustls_provider();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("felix-bench-iggy")
            .build()
            .map_err(|e| BenchError::Driver {
                cell: "-".to_string(),
                detail: format!("cannot start the tokio runtime: {e}"),
            })?;
        Ok(IggyDriver {
            server_bin,
            work_dir,
            runtime,
            latency,
            server_exits: Vec::new(),
        })
    }
}

/// Installs ring as rustls's process default provider if none is set yet.
fn rustls_provider() -> bool {
    async_nats::rustls::crypto::ring::default_provider()
        .install_default()
        .is_ok()
}

/// Lanes (connections) per publisher for `in_flight` requests outstanding.
pub fn lanes_per_publisher(in_flight: u32) -> u32 {
    in_flight.clamp(1, CONNECTIONS_PER_PUBLISHER_MAX)
}

impl CellDriver for IggyDriver {
    fn run_cell(
        &mut self,
        settings: &Settings,
        cell: &Cell,
        arm: &Arm,
        _trial: u32,
    ) -> Result<CellRun, BenchError> {
        let label = cell.label();
        if arm.iggy.is_none() {
            return Err(BenchError::Driver {
                cell: label,
                detail: format!("arm {:?} is not an Iggy arm", arm.name),
            });
        }
        if !self.server_bin.is_file() {
            return Err(BenchError::Driver {
                cell: label,
                detail: format!(
                    "iggy-server binary {} not found: pass --iggy with an iggy-server {} build \
                     from the Apache Iggy project",
                    self.server_bin.display(),
                    crate::iggy::IGGY_SERVER_VERSION
                ),
            });
        }
        std::fs::create_dir_all(&self.work_dir).map_err(|e| BenchError::io(&self.work_dir, e))?;
        let server = IggyServer::start(
            &self.server_bin,
            arm,
            &self.work_dir,
            settings.server_cpus.as_deref(),
        )?;
        let job = IggyJob {
            quic_addr: server.quic_addr,
            source: SampleSource {
                metrics_addr: server.http_addr,
                pid: Some(server.pid),
                counters: Counters::Iggy {
                    payload_bytes: cell.shape.payload_bytes,
                },
            },
            partitions: settings.shards.max(1),
            warmup: Duration::from_secs(u64::from(settings.warmup_s)),
            cell: *cell,
            latency: self.latency,
        };
        let result = self
            .runtime
            .block_on(job.run())
            .map_err(|detail| BenchError::Driver {
                cell: label.clone(),
                detail,
            });
        self.server_exits
            .push(crate::broker::exit_line(&label, &arm.name, server.stop()));
        result
    }
}

/// One cell's work against a started server.
struct IggyJob {
    quic_addr: SocketAddr,
    source: SampleSource,
    partitions: u32,
    warmup: Duration,
    cell: Cell,
    latency: LatencyCounts,
}

impl IggyJob {
    async fn connect(&self, name: &str) -> Result<IggyClient, String> {
        let config = QuicClientConfig {
            server_address: self.quic_addr.to_string(),
            server_name: "localhost".to_string(),
            ..QuicClientConfig::default()
        };
        let quic =
            QuicClient::create(Arc::new(config)).map_err(|e| format!("{name} QUIC client: {e}"))?;
        let client = IggyClient::create(ClientWrapper::Quic(quic), None, None);
        client
            .connect()
            .await
            .map_err(|e| format!("{name} connection: {e}"))?;
        client
            .login_user(ROOT_USER, ROOT_PASSWORD)
            .await
            .map_err(|e| format!("{name} login: {e}"))?;
        Ok(client)
    }

    async fn run(self) -> Result<CellRun, String> {
        let s = self.cell.shape;
        if s.mode != Mode::Acked {
            return Err("Iggy has no unacknowledged publish: acked cells only".to_string());
        }
        let lanes = lanes_per_publisher(s.in_flight);
        let setup = async {
            let admin = self.connect("admin").await?;
            let stream = admin
                .create_stream(STREAM)
                .await
                .map_err(|e| format!("create stream: {e}"))?;
            let stream_id = Identifier::numeric(stream.id).map_err(|e| e.to_string())?;
            let topic = admin
                .create_topic(
                    &stream_id,
                    TOPIC,
                    self.partitions,
                    CompressionAlgorithm::None,
                    None,
                    IggyExpiry::NeverExpire,
                    MaxTopicSize::Unlimited,
                )
                .await
                .map_err(|e| format!("create topic: {e}"))?;
            let topic_id = Identifier::numeric(topic.id).map_err(|e| e.to_string())?;
            let mut clients = Vec::with_capacity((s.publishers * lanes) as usize);
            for i in 0..s.publishers * lanes {
                clients.push(self.connect(&format!("lane {i}")).await?);
            }
            Ok::<_, String>((admin, stream_id, topic_id, clients))
        };
        let (admin, stream_id, topic_id, clients) = tokio::time::timeout(SETUP_DEADLINE, setup)
            .await
            .map_err(|_| format!("set-up did not finish within {SETUP_DEADLINE:?}"))??;

        let start = Instant::now();
        let sampler = tokio::task::block_in_place(|| Sampler::start(self.source, start))
            .map_err(|e| e.to_string())?;
        let payload = Bytes::from(vec![0xA5u8; s.payload_bytes as usize]);
        let warmup_end = Instant::now() + self.warmup;
        let deadline = warmup_end + Duration::from_secs(u64::from(s.duration_s));
        let mut tasks = Vec::with_capacity(clients.len());
        for (i, client) in clients.into_iter().enumerate() {
            let lane = IggyLane {
                index: i,
                client,
                stream_id: stream_id.clone(),
                topic_id: topic_id.clone(),
                partitions: self.partitions,
                payload: payload.clone(),
                cell: self.cell,
                start,
                warmup_end,
                deadline,
                latency: self.latency,
            };
            tasks.push(tokio::spawn(lane.run()));
        }
        let (stop_sub, _stop_sub_rx) = tokio::sync::watch::channel(false);
        let (results, failures, _) = join_load(tasks, None, &stop_sub, "consumer").await;
        let sent_bytes: u64 = results.iter().map(|r| r.sent.bytes).sum();
        drain(&sampler, sent_bytes).await;
        let (samples, _missed) =
            tokio::task::block_in_place(|| sampler.finish()).map_err(|e| e.to_string())?;
        drop(admin);
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(assemble_run(
            &self.cell.label(),
            "iggy-l",
            results,
            samples,
            None,
        ))
    }
}

/// One connection of a publisher, one SendMessages outstanding at a time.
struct IggyLane {
    index: usize,
    client: IggyClient,
    stream_id: Identifier,
    topic_id: Identifier,
    partitions: u32,
    payload: Bytes,
    cell: Cell,
    start: Instant,
    warmup_end: Instant,
    deadline: Instant,
    latency: LatencyCounts,
}

impl IggyLane {
    async fn run(self) -> Result<PublisherResult, String> {
        let s = self.cell.shape;
        let records_per_unit = u64::from(s.batch);
        let bytes_per_unit = records_per_unit * u64::from(s.payload_bytes);
        let latency = s.measure == Measure::Latency;
        let measured_from = self.latency.warmup;
        let measured_until = self.latency.warmup + self.latency.measured;
        let span_start = self.warmup_end.max(Instant::now());
        let mut sent = Counts::default();
        let mut hist = new_histogram();
        let mut n = 0u64;
        loop {
            let now = Instant::now();
            let may_issue = if latency {
                n < measured_until || now < self.deadline
            } else {
                now < self.deadline
            };
            if !may_issue {
                break;
            }
            let partition = ((self.index as u64 + n) % u64::from(self.partitions)) as u32;
            let mut messages = Vec::with_capacity(s.batch as usize);
            for _ in 0..s.batch {
                messages.push(
                    IggyMessage::builder()
                        .payload(self.payload.clone())
                        .build()
                        .map_err(|e| format!("message: {e}"))?,
                );
            }
            let send_ns = nanos_since(self.start);
            tokio::time::timeout(
                SEND_DEADLINE,
                self.client.send_messages(
                    &self.stream_id,
                    &self.topic_id,
                    &Partitioning::partition_id(partition),
                    &mut messages,
                ),
            )
            .await
            .map_err(|_| format!("send_messages: no answer within {SEND_DEADLINE:?}"))?
            .map_err(|e| format!("send_messages: {e}"))?;
            let measured = !latency || (n >= measured_from && n < measured_until);
            if measured {
                record_ns(&mut hist, nanos_since(self.start).saturating_sub(send_ns));
            }
            n += 1;
            sent.bytes += bytes_per_unit;
            sent.records += records_per_unit;
        }
        let end = Instant::now();
        let _ = tokio::time::timeout(SHUTDOWN_DEADLINE, self.client.shutdown()).await;
        let t = |i: Instant| i.saturating_duration_since(self.start).as_secs_f64();
        Ok(PublisherResult {
            span: Span {
                start_s: t(span_start),
                end_s: t(end),
            },
            sent,
            refused: 0,
            first_refusal: None,
            ack: Some(hist),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_follow_in_flight_up_to_the_cap() {
        // Proves a publisher opens one connection per request in flight, at least one and at most the cap.
        assert_eq!(lanes_per_publisher(0), 1);
        assert_eq!(lanes_per_publisher(1), 1);
        assert_eq!(lanes_per_publisher(4), 4);
        assert_eq!(lanes_per_publisher(64), CONNECTIONS_PER_PUBLISHER_MAX);
    }
}
