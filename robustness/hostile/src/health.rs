//! The healthy client checked between cases: a felix-client connection kept for the whole run
//! subscribes, publishes one record and gets it back within a deadline, and a fresh connection
//! is accepted and answers a request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use felix_client::{
    Client, ClientConfig, ClientError, ErrorCode, ShardSelection, StartPosition, StreamKind, record,
};
use futures::StreamExt as _;

use crate::Target;

/// Stream the health check publishes to and subscribes from.
pub const HEALTH_STREAM: &str = "hostile-health";
/// Time one health check may take: generous, on a loaded 2-CPU machine with a debug build.
pub const HEALTH_DEADLINE: Duration = Duration::from_secs(30);

/// A client configuration for `target`: one connection to its shared port, one publish stream
/// (so the connection counts against the broker's limits stay predictable).
#[must_use]
pub fn client_config(target: &Target, name: &str) -> ClientConfig {
    let mut config = ClientConfig::new(target.quic_addr);
    config.ca = Some(target.ca_pem.clone());
    config.server_name = target.server_name.clone();
    config.client_name = name.to_owned();
    config.core_aware = false;
    config.pub_shard_streams = 1;
    config
}

pub(crate) struct Health {
    client: Arc<Client>,
    fresh: ClientConfig,
    round: u64,
}

impl Health {
    /// Connects the long-lived healthy client and makes sure its stream exists.
    pub(crate) async fn connect(target: &Target) -> Result<Health, String> {
        let client = tokio::time::timeout(
            HEALTH_DEADLINE,
            Client::connect(client_config(target, "felix-hostile-healthy")),
        )
        .await
        .map_err(|_| "the healthy client did not connect in time".to_owned())?
        .map_err(|error| format!("the healthy client cannot connect: {error}"))?;
        match client
            .create_stream(HEALTH_STREAM, 2, StreamKind::InMemory)
            .await
        {
            Ok(_) => {}
            Err(error) if error.code() == Some(ErrorCode::StreamExists) => {}
            Err(error) => return Err(format!("cannot create {HEALTH_STREAM}: {error}")),
        }
        Ok(Health {
            client: Arc::new(client),
            fresh: client_config(target, "felix-hostile-fresh"),
            round: 0,
        })
    }

    /// The long-lived client.
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// The long-lived client, shared: the cases' admin requests go through it.
    pub(crate) fn admin(&self) -> Arc<Client> {
        Arc::clone(&self.client)
    }

    /// One check: how long it took, or what failed.
    pub(crate) async fn check(&mut self) -> Result<Duration, String> {
        self.round += 1;
        let started = Instant::now();
        match tokio::time::timeout(HEALTH_DEADLINE, self.check_once()).await {
            Ok(Ok(())) => Ok(started.elapsed()),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(format!(
                "the health check did not finish within {HEALTH_DEADLINE:?}"
            )),
        }
    }

    async fn check_once(&self) -> Result<(), String> {
        let client = &self.client;
        let mut subscription = client
            .subscribe(HEALTH_STREAM, ShardSelection::All, StartPosition::Latest)
            .await
            .map_err(|error| format!("the healthy client cannot subscribe: {error}"))?;
        let payload = format!("alive-{}", self.round);
        client
            .publish(HEALTH_STREAM, &[record("health", payload.clone())])
            .await
            .map_err(|error| format!("the healthy client's publish failed: {error}"))?;
        loop {
            match subscription.next().await {
                Some(Ok(delivered)) if delivered.payload == payload.as_bytes() => break,
                // An earlier round's record cannot come (subscribed at latest), but be lenient.
                Some(Ok(_)) => {}
                Some(Err(error)) => {
                    return Err(format!("the healthy subscription failed: {error}"));
                }
                None => return Err("the healthy subscription ended".to_owned()),
            }
        }
        drop(subscription);
        // A new connection is accepted (retrying while a flood's slots are being released).
        let deadline = Instant::now() + HEALTH_DEADLINE;
        let fresh = loop {
            match Client::connect(self.fresh.clone()).await {
                Ok(fresh) => break fresh,
                Err(error) if Instant::now() < deadline && retriable(&error) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => return Err(format!("a fresh client cannot connect: {error}")),
            }
        };
        let listed = fresh
            .list_streams()
            .await
            .map_err(|error| format!("a fresh client cannot list streams: {error}"))?;
        fresh.close().await;
        if !listed.iter().any(|summary| summary.name == HEALTH_STREAM) {
            return Err(format!("{HEALTH_STREAM} is missing from the stream list"));
        }
        Ok(())
    }

    /// Closes the client once the cases have let go of it (else it is dropped, which closes
    /// its connection too).
    pub(crate) async fn close(self) {
        if let Ok(client) = Arc::try_unwrap(self.client) {
            client.close().await;
        }
    }
}

/// A refusal that goes away once other connections are released.
fn retriable(error: &ClientError) -> bool {
    match error {
        ClientError::Server { code, .. } => *code == ErrorCode::LimitExceeded,
        ClientError::Connect { reason, .. } | ClientError::Closed(reason) => {
            reason.contains("limit_exceeded")
        }
        _ => false,
    }
}
