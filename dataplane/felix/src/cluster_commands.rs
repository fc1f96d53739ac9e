//! `felix cluster`: the cluster's status from a member's metrics endpoint (`GET
//! /v1/cluster/status`, read-only), its streams and a replicated shard's records over QUIC
//! (`CreateClusterStream`, `DeleteClusterStream`, `ReadShard`: the client options, the
//! broker's authentication and rules, as every other client command), and a development set
//! of peer certificates. docs/cluster.md walks through a three-broker cluster with them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use felix_client::Client;
use felix_tuning::Config;
use felix_wire::{DeliveredRecord, FsyncMode, StreamKind};

use crate::client_commands;

/// How long an admin request may take (a stream creation waits for the control plane).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, Args)]
pub struct AdminArgs {
    /// A member's metrics endpoint (default: FELIX_METRICS_BIND).
    #[arg(long, value_name = "IP:PORT")]
    pub admin: Option<SocketAddr>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum KindArg {
    Durable,
    InMemory,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FsyncArg {
    /// Acknowledged once a majority including the leader fdatasynced it.
    #[value(name = "on_commit")]
    OnCommit,
    /// Acknowledged once a majority including the leader wrote it; each member fdatasyncs
    /// every FELIX_DURABLE_FSYNC_INTERVAL_MS.
    #[value(name = "periodic")]
    Periodic,
}

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Members, the control-plane leader, and each stream's shard leaders and replicas.
    Status {
        #[command(flatten)]
        admin: AdminArgs,
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Create a stream through the control plane; its shards are placed over the members.
    CreateStream {
        name: String,
        /// Number of shards.
        #[arg(long, default_value_t = 1)]
        shards: u32,
        /// Copies of each shard (durable streams; in-memory streams keep one: pass 1).
        #[arg(long, default_value_t = 3)]
        replicas: u8,
        /// Durable (the log, replicated) or in memory (one copy).
        #[arg(long, value_enum, default_value = "durable")]
        kind: KindArg,
        /// When a durable stream's publishes are acknowledged (docs/cluster.md,
        /// "Acknowledgement modes").
        #[arg(long, value_enum, default_value = "on_commit")]
        fsync: FsyncArg,
    },
    /// Delete a stream through the control plane: every member stops serving it and removes
    /// its replicated shards' logs; its subscribers are ended (`stream_not_found`).
    DeleteStream { name: String },
    /// Print committed records of a replicated shard from one member's copy (an audit tool:
    /// every member must print the same records at the same offsets).
    Read {
        stream: String,
        #[arg(long, default_value_t = 0)]
        shard: u32,
        /// First offset to print.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Most records to print.
        #[arg(long, default_value_t = 100)]
        max: u64,
        /// Print JSON (key and payload in hex).
        #[arg(long)]
        json: bool,
    },
    /// Write a development cluster CA and one peer certificate per member.
    DevCerts {
        /// Folder to write ca.pem and node-<id>.pem/.key into (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Member ids (repeatable); default 1, 2 and 3.
        #[arg(long = "node", value_name = "ID")]
        nodes: Vec<u64>,
        /// Host names / IP addresses the certificates are valid for (repeatable); default
        /// localhost and 127.0.0.1.
        #[arg(long = "name", value_name = "HOST")]
        names: Vec<String>,
    },
}

fn admin_addr(config: &Config, admin: &AdminArgs) -> anyhow::Result<SocketAddr> {
    admin.admin.or(config.metrics_bind).context(
        "no metrics endpoint to ask: FELIX_METRICS_BIND is off; pass --admin IP:PORT of a member",
    )
}

pub fn run(config: &Config, command: ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Status { admin, json } => {
            let addr = admin_addr(config, &admin)?;
            let status = felix_cluster::admin::status(addr, ADMIN_TIMEOUT)
                .with_context(|| format!("cannot read the cluster status from {addr}"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{}", felix_cluster::admin::render(&status));
            }
            Ok(())
        }
        ClusterCommand::CreateStream {
            name,
            shards,
            replicas,
            kind,
            fsync,
        } => {
            let (kind, kind_name) = match kind {
                KindArg::Durable => (StreamKind::Durable, "durable"),
                KindArg::InMemory => (StreamKind::InMemory, "in-memory"),
            };
            let (fsync, fsync_name) = match fsync {
                FsyncArg::OnCommit => (FsyncMode::OnCommit, "on_commit"),
                FsyncArg::Periodic => (FsyncMode::Periodic, "periodic"),
            };
            client_commands::block_on(async {
                let client = client_commands::connect(config).await?;
                client
                    .create_cluster_stream(&name, shards, kind, replicas, fsync)
                    .await
                    .with_context(|| format!("cannot create stream {name:?}"))?;
                println!(
                    "created stream {name} ({kind_name}, {shards} shards, {replicas} replicas, \
                     fsync {fsync_name})"
                );
                Ok(())
            })
        }
        ClusterCommand::DeleteStream { name } => client_commands::block_on(async {
            let client = client_commands::connect(config).await?;
            client
                .delete_cluster_stream(&name)
                .await
                .with_context(|| format!("cannot delete stream {name:?}"))?;
            println!("deleted stream {name}");
            Ok(())
        }),
        ClusterCommand::Read {
            stream,
            shard,
            from,
            max,
            json,
        } => client_commands::block_on(async {
            let client = client_commands::connect(config).await?;
            let records = read_records(&client, &stream, shard, from, max)
                .await
                .with_context(|| {
                    format!(
                        "cannot read shard {shard} of {stream:?} from {}",
                        config.addr
                    )
                })?;
            if json {
                let records: Vec<felix_cluster::admin::ReadRecord> = records
                    .into_iter()
                    .map(|record| felix_cluster::admin::ReadRecord {
                        offset: record.offset,
                        timestamp_us: record.timestamp_us,
                        key: record.key.to_vec(),
                        payload: record.payload.to_vec(),
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&records)?);
            } else {
                for record in &records {
                    println!(
                        "{stream}/{shard}@{} key={:?} payload={:?} ({} bytes)",
                        record.offset,
                        String::from_utf8_lossy(&record.key),
                        String::from_utf8_lossy(&record.payload),
                        record.payload.len()
                    );
                }
            }
            Ok(())
        }),
        ClusterCommand::DevCerts { out, nodes, names } => {
            let nodes = if nodes.is_empty() {
                vec![1, 2, 3]
            } else {
                nodes
            };
            let names = if names.is_empty() {
                vec!["localhost".to_owned(), "127.0.0.1".to_owned()]
            } else {
                names
            };
            felix_cluster::pki::write_dev_cluster(&out, &nodes, &names).with_context(|| {
                format!("cannot write the cluster certificates to {}", out.display())
            })?;
            println!(
                "wrote {}/ca.pem and node-<id>.pem/.key for members {nodes:?}; set \
                 FELIX_CLUSTER_CA, FELIX_CLUSTER_CERT and FELIX_CLUSTER_KEY from them",
                out.display()
            );
            Ok(())
        }
    }
}

/// Up to `max` records of the shard's copy on the connected member from `from`, asking again
/// while each answer (at most one frame's worth) leaves some to read.
async fn read_records(
    client: &Client,
    stream: &str,
    shard: u32,
    from: u64,
    max: u64,
) -> anyhow::Result<Vec<DeliveredRecord>> {
    let mut records = Vec::new();
    let mut next = from;
    // Each pass reads at least one record or stops, so this ends after at most `max` passes.
    while (records.len() as u64) < max {
        let want = u32::try_from(max - records.len() as u64).unwrap_or(u32::MAX);
        let read = client.read_shard(stream, shard, next, want).await?;
        let Some(last) = read.last() else { break };
        next = last.offset + 1;
        records.extend(read);
    }
    Ok(records)
}
