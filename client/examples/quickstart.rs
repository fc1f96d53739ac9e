//! Quickstart: create a stream, subscribe, publish, print what arrives.
//!
//! Start a broker first (`make run`, or `felix broker`), then:
//! `cargo run -p felix-client --example quickstart`.
//! It reaches FELIX_ADDR (default 127.0.0.1:7400) and trusts FELIX_CA (default: the broker's
//! development certificate under `$XDG_DATA_HOME/felix` or `~/.local/share/felix`).

use std::path::PathBuf;

use felix_client::{Client, ClientConfig, ShardSelection, StartPosition, StreamKind, record};
use futures::StreamExt as _;

/// Where `felix broker` writes its development certificate by default.
fn default_ca() -> PathBuf {
    let data = match (std::env::var_os("XDG_DATA_HOME"), std::env::var_os("HOME")) {
        (Some(xdg), _) => PathBuf::from(xdg).join("felix"),
        (None, Some(home)) => PathBuf::from(home).join(".local/share/felix"),
        (None, None) => PathBuf::from("felix-data"),
    };
    data.join("tls/dev-cert.pem")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("FELIX_ADDR").unwrap_or_else(|_| "127.0.0.1:7400".to_owned());
    let mut config = ClientConfig::new(addr.parse()?);
    config.ca = Some(std::env::var_os("FELIX_CA").map_or_else(default_ca, PathBuf::from));
    let client = Client::connect(config).await?;

    // A stream of 4 shards; creating it again is fine for this example.
    match client
        .create_stream("quickstart", 4, StreamKind::InMemory)
        .await
    {
        Ok(info) => println!(
            "created stream {} with {} shards",
            info.name,
            info.shards.len()
        ),
        Err(error) if error.code() == Some(felix_client::ErrorCode::StreamExists) => {
            println!("stream quickstart already exists");
        }
        Err(error) => return Err(error.into()),
    }

    // Subscribe before publishing: `Latest` delivers what is appended from now on.
    let mut subscription = client
        .subscribe("quickstart", ShardSelection::All, StartPosition::Latest)
        .await?;

    let records = [
        record("alice", "hello"),
        record("bob", "from"),
        record("carol", "felix"),
    ];
    for ack in client.publish("quickstart", &records).await? {
        println!(
            "acked: shard {} offsets {}..{}",
            ack.shard,
            ack.first_offset,
            ack.first_offset + u64::from(ack.count) - 1
        );
    }

    for _ in 0..records.len() {
        let Some(delivered) = subscription.next().await else {
            break;
        };
        let delivered = delivered?;
        println!(
            "received shard {} offset {} key {}: {}",
            delivered.shard,
            delivered.offset,
            String::from_utf8_lossy(&delivered.key),
            String::from_utf8_lossy(&delivered.payload)
        );
    }
    subscription.close().await;
    client.close().await;
    Ok(())
}
