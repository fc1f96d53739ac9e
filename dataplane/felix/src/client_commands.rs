//! Client commands: `felix stream ...`, `felix pub`, `felix sub`. They run on a current-thread
//! tokio runtime on the main thread and talk to the broker through felix-client.

use std::collections::VecDeque;
use std::future::Future;
use std::io::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Args;
use felix_client::{
    Client, ClientConfig, ClusterAck, ClusterClient, PendingAck, Record, ShardAck, ShardSelection,
    StartPosition, StreamKind,
};
use felix_tuning::Config;
use futures::StreamExt as _;
use tokio::io::AsyncBufReadExt as _;

use crate::StreamCommand;

/// Acked publishes `felix pub` keeps in flight: enough to hide the round trip when piping
/// many lines, few enough that acks print promptly.
const PUB_IN_FLIGHT_MAX: usize = 64;
/// How long `felix pub` waits for more stdin lines before sending a partial batch, so
/// interactive input is not held back while piped input still fills batches.
const STDIN_BATCH_LINGER: Duration = Duration::from_millis(10);

#[derive(Debug, Args)]
pub(crate) struct PubArgs {
    /// Stream to publish to.
    stream: String,
    /// Records (payloads); when none are given, each stdin line is one record.
    records: Vec<String>,
    /// Key of every record (picks the shard).
    #[arg(long, default_value = "")]
    key: String,
    /// Records per publish request (stdin lines are grouped up to this many).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Fire-and-forget: no acks (errors are not reported either).
    #[arg(long, conflicts_with = "cluster")]
    no_ack: bool,
    /// Plain publishes: no producer id, so a retried batch may be stored twice, and no
    /// retries (by default acked publishes go out as an idempotent producer and are retried
    /// after a retryable answer, with --cluster also through another member after a lost
    /// connection; docs/semantics.md, "Idempotent producers").
    #[arg(long)]
    no_idempotence: bool,
    /// The producer id (hex) to publish as, instead of a random one: sending the same
    /// records in the same order again as that producer stores none of them twice.
    #[arg(long, value_parser = parse_producer_id, conflicts_with = "no_idempotence")]
    producer_id: Option<u64>,
    /// A cluster's replicated stream: send each shard's records straight to the member
    /// leading it (the cluster client, docs/cluster.md); --ca must trust every member's
    /// certificate. Without it, the member at --addr takes every record (and forwards).
    #[arg(long)]
    cluster: bool,
}

#[derive(Debug, Args)]
pub(crate) struct SubArgs {
    /// Stream to read.
    stream: String,
    /// Where to start: `latest`, `earliest`, or `SHARD:OFFSET,...` (other shards: latest).
    #[arg(long, default_value = "latest", value_parser = parse_start)]
    from: StartPosition,
    /// Only these shards, e.g. `0,1` (default: all).
    #[arg(long, value_delimiter = ',')]
    shards: Option<Vec<u32>>,
    /// Exit after this many records.
    #[arg(long)]
    count: Option<u64>,
    /// Prefix each record with `shard:offset key `.
    #[arg(long)]
    meta: bool,
}

fn parse_start(text: &str) -> Result<StartPosition, String> {
    match text {
        "latest" => Ok(StartPosition::Latest),
        "earliest" => Ok(StartPosition::Earliest),
        positions => positions
            .split(',')
            .map(|position| {
                let (shard, offset) = position.split_once(':').ok_or_else(|| {
                    format!("expected latest, earliest or SHARD:OFFSET,..., got {position:?}")
                })?;
                let shard = shard
                    .trim()
                    .parse::<u32>()
                    .map_err(|error| format!("bad shard {shard:?}: {error}"))?;
                let offset = offset
                    .trim()
                    .parse::<u64>()
                    .map_err(|error| format!("bad offset {offset:?}: {error}"))?;
                Ok((shard, offset))
            })
            .collect::<Result<Vec<_>, String>>()
            .map(StartPosition::Offsets),
    }
}

/// Runs a client command on a fresh current-thread runtime.
pub(crate) fn block_on<F: Future<Output = anyhow::Result<()>>>(future: F) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot build the tokio runtime")?;
    runtime.block_on(future)
}

/// Set once by `main` from `--no-core-aware`, before any client command runs.
pub(crate) static NO_CORE_AWARE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn client_config(config: &Config) -> ClientConfig {
    let mut client = ClientConfig::new(config.addr);
    client.server_name = config.server_name.clone();
    client.ca = Some(config.ca_path());
    client.insecure = config.insecure;
    client.publish_inflight_bytes = config.publish_inflight_bytes;
    client.client_name = concat!("felix-cli/", env!("CARGO_PKG_VERSION")).to_owned();
    client.core_aware = !NO_CORE_AWARE.get().copied().unwrap_or(false);
    // The tuning crate bounds FELIX_PUB_SHARD_STREAMS to 0..=64.
    client.pub_shard_streams = u32::try_from(config.pub_shard_streams).unwrap_or(4);
    client.token = config.token.clone();
    // The tuning crate refuses one of the two without the other.
    if let (Some(cert), Some(key)) = (&config.client_cert, &config.client_key) {
        client.identity = Some(felix_client::ClientIdentity {
            cert: cert.clone(),
            key: key.clone(),
        });
    }
    client
}

pub(crate) async fn connect(config: &Config) -> anyhow::Result<Client> {
    Ok(Client::connect(client_config(config)).await?)
}

/// A producer id in hex (`0x` optional), not 0.
fn parse_producer_id(text: &str) -> Result<u64, String> {
    let digits = text.trim_start_matches("0x");
    match u64::from_str_radix(digits, 16) {
        Ok(0) => Err("a producer id is not 0".to_owned()),
        Ok(id) => Ok(id),
        Err(error) => Err(format!("a producer id is up to 16 hex digits: {error}")),
    }
}

fn kind_name(kind: StreamKind) -> &'static str {
    match kind {
        StreamKind::InMemory => "in-memory",
        StreamKind::Durable => "durable",
    }
}

pub(crate) async fn stream(config: &Config, command: StreamCommand) -> anyhow::Result<()> {
    let client = connect(config).await?;
    match command {
        StreamCommand::Create {
            name,
            shards,
            durable,
        } => {
            let kind = if durable {
                StreamKind::Durable
            } else {
                StreamKind::InMemory
            };
            let info = client.create_stream(&name, shards, kind).await?;
            println!(
                "created stream {}: {} shards, {}",
                info.name,
                info.shards.len(),
                kind_name(info.kind)
            );
        }
        StreamCommand::List => {
            let streams = client.list_streams().await?;
            println!("NAME\tKIND\tSHARDS");
            for stream in streams {
                println!(
                    "{}\t{}\t{}",
                    stream.name,
                    kind_name(stream.kind),
                    stream.shard_count
                );
            }
        }
        StreamCommand::Describe { name } => {
            let info = client.describe_stream(&name).await?;
            println!(
                "stream {}: {} shards, {}, hash fnv1a64 % shards",
                info.name,
                info.shards.len(),
                kind_name(info.kind)
            );
            println!("SHARD\tCORE\tOLDEST\tNEXT");
            for shard in info.shards {
                println!(
                    "{}\t{}\t{}\t{}",
                    shard.shard, shard.core, shard.oldest_offset, shard.next_offset
                );
            }
        }
        StreamCommand::Delete { name } => {
            client.delete_stream(&name).await?;
            println!("deleted stream {name}");
        }
    }
    client.close().await;
    Ok(())
}

/// `acked 3 records: shard 1 offsets 5..7` (inclusive ranges, one per shard touched).
fn describe_acks(acks: &[ShardAck]) -> String {
    let records: u64 = acks.iter().map(|ack| u64::from(ack.count)).sum();
    let shards: Vec<String> = acks
        .iter()
        .map(|ack| {
            let last = ack.first_offset + u64::from(ack.count).saturating_sub(1);
            if ack.count == 1 {
                format!("shard {} offset {}", ack.shard, ack.first_offset)
            } else {
                format!("shard {} offsets {}..{}", ack.shard, ack.first_offset, last)
            }
        })
        .collect();
    let noun = if records == 1 { "record" } else { "records" };
    format!("acked {records} {noun}: {}", shards.join(", "))
}

/// What `felix pub` publishes through.
enum Sender {
    Plain(Box<Client>),
    /// `--cluster`: straight to each shard's leader.
    Cluster(Box<ClusterClient>),
}

/// A publish in flight.
enum InFlight {
    Plain(PendingAck),
    Cluster(ClusterAck),
}

/// Sends batches, keeping acked ones in flight and printing their acks in order.
struct Publisher<'a> {
    client: &'a Sender,
    stream: String,
    no_ack: bool,
    in_flight: VecDeque<InFlight>,
    sent_records: u64,
}

impl Publisher<'_> {
    async fn send(&mut self, batch: Vec<Record>) -> anyhow::Result<()> {
        self.sent_records += batch.len() as u64;
        if self.in_flight.len() >= PUB_IN_FLIGHT_MAX {
            self.settle_one().await?;
        }
        match self.client {
            Sender::Plain(client) if self.no_ack => {
                client.publish_no_ack(&self.stream, &batch).await?;
            }
            Sender::Plain(client) => {
                let pending = client.publish_pipelined(&self.stream, &batch).await?;
                self.in_flight.push_back(InFlight::Plain(pending));
            }
            Sender::Cluster(client) => {
                let pending = client.publish_pipelined(&self.stream, &batch).await?;
                self.in_flight.push_back(InFlight::Cluster(pending));
            }
        }
        Ok(())
    }

    async fn settle_one(&mut self) -> anyhow::Result<()> {
        let acks = match (self.in_flight.pop_front(), self.client) {
            (None, _) => return Ok(()),
            (Some(InFlight::Plain(pending)), _) => pending.await,
            (Some(InFlight::Cluster(pending)), Sender::Cluster(client)) => {
                client.settle(pending).await
            }
            (Some(InFlight::Cluster(_)), Sender::Plain(_)) => {
                unreachable!("cluster publishes come from a cluster client")
            }
        };
        println!("{}", describe_acks(&acks.context("publish refused")?));
        Ok(())
    }

    async fn finish(&mut self) -> anyhow::Result<()> {
        while !self.in_flight.is_empty() {
            self.settle_one().await?;
        }
        if self.no_ack {
            println!("sent {} records without ack", self.sent_records);
        }
        Ok(())
    }
}

pub(crate) async fn publish(config: &Config, args: PubArgs) -> anyhow::Result<()> {
    let mut client_config = client_config(config);
    if args.no_idempotence {
        client_config.idempotent = false;
        client_config.publish_retries = 0;
    }
    client_config.producer_id = args.producer_id;
    let client = if args.cluster {
        Sender::Cluster(Box::new(ClusterClient::connect(client_config).await?))
    } else {
        Sender::Plain(Box::new(Client::connect(client_config).await?))
    };
    let key = Bytes::from(args.key.into_bytes());
    let batch_size = usize::try_from(args.batch).unwrap_or(usize::MAX);
    let record = |payload: String| Record {
        key: key.clone(),
        payload: Bytes::from(payload.into_bytes()),
    };
    let mut publisher = Publisher {
        client: &client,
        stream: args.stream.clone(),
        no_ack: args.no_ack,
        in_flight: VecDeque::new(),
        sent_records: 0,
    };
    let sent = if args.records.is_empty() {
        publish_stdin(&mut publisher, batch_size, record).await
    } else {
        publish_arguments(
            &mut publisher,
            batch_size,
            args.records.into_iter().map(record),
        )
        .await
    };
    // Report the acks of what was sent before a failure, then the failure.
    let finished = publisher.finish().await;
    sent?;
    finished?;
    if let Sender::Plain(client) = client {
        client.close().await;
    }
    Ok(())
}

async fn publish_arguments(
    publisher: &mut Publisher<'_>,
    batch_size: usize,
    records: impl Iterator<Item = Record>,
) -> anyhow::Result<()> {
    let records: Vec<Record> = records.collect();
    for batch in records.chunks(batch_size) {
        publisher.send(batch.to_vec()).await?;
    }
    Ok(())
}

async fn publish_stdin(
    publisher: &mut Publisher<'_>,
    batch_size: usize,
    record: impl Fn(String) -> Record,
) -> anyhow::Result<()> {
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut batch = Vec::with_capacity(batch_size);
    loop {
        let line = if batch.is_empty() {
            lines.next_line().await.context("cannot read stdin")?
        } else {
            // `next_line` is cancel safe: a timed-out read loses nothing.
            match tokio::time::timeout(STDIN_BATCH_LINGER, lines.next_line()).await {
                Ok(line) => line.context("cannot read stdin")?,
                Err(_) => {
                    publisher.send(std::mem::take(&mut batch)).await?;
                    continue;
                }
            }
        };
        let Some(line) = line else { break };
        batch.push(record(line));
        if batch.len() >= batch_size {
            publisher.send(std::mem::take(&mut batch)).await?;
        }
    }
    if !batch.is_empty() {
        publisher.send(batch).await?;
    }
    Ok(())
}

pub(crate) async fn subscribe(config: &Config, args: SubArgs) -> anyhow::Result<()> {
    let client = connect(config).await?;
    let shards = match args.shards {
        Some(list) => ShardSelection::List(list),
        None => ShardSelection::All,
    };
    let mut subscription = client.subscribe(&args.stream, shards, args.from).await?;
    let start: Vec<String> = subscription
        .start()
        .iter()
        .map(|(shard, offset)| format!("{shard}:{offset}"))
        .collect();
    // On stderr so stdout stays records only; scripts and tests wait for this line.
    eprintln!(
        "felix: subscribed to {} from {}",
        args.stream,
        start.join(",")
    );
    if args.count == Some(0) {
        subscription.close().await;
        client.close().await;
        return Ok(());
    }
    let mut received = 0u64;
    while let Some(record) = subscription.next().await {
        let record = record.context("subscription ended")?;
        let mut stdout = std::io::stdout().lock();
        if args.meta {
            write!(
                stdout,
                "{}:{} {} ",
                record.shard,
                record.offset,
                String::from_utf8_lossy(&record.key)
            )?;
        }
        writeln!(stdout, "{}", String::from_utf8_lossy(&record.payload))?;
        stdout.flush()?;
        received += 1;
        if args.count.is_some_and(|count| received >= count) {
            break;
        }
    }
    subscription.close().await;
    client.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves --from parses all three spellings and rejects junk.
    #[test]
    fn parse_start_positions() {
        assert_eq!(parse_start("latest"), Ok(StartPosition::Latest));
        assert_eq!(parse_start("earliest"), Ok(StartPosition::Earliest));
        assert_eq!(
            parse_start("0:5,3:7"),
            Ok(StartPosition::Offsets(vec![(0, 5), (3, 7)]))
        );
        assert!(parse_start("0-5").is_err());
        assert!(parse_start("x:1").is_err());
    }

    // Proves the ack line uses inclusive offset ranges per shard.
    #[test]
    fn ack_line_format() {
        let acks = [
            ShardAck {
                shard: 1,
                first_offset: 5,
                count: 3,
            },
            ShardAck {
                shard: 2,
                first_offset: 0,
                count: 1,
            },
        ];
        assert_eq!(
            describe_acks(&acks),
            "acked 4 records: shard 1 offsets 5..7, shard 2 offset 0"
        );
    }
}
