//! The cluster's read-only status as a client asks for it: plain HTTP/1.0 to a member's
//! metrics endpoint (`GET /v1/cluster/status`), used by `felix cluster status` and the cluster
//! tests, and the status as a table for people and as Prometheus gauges. Creating, deleting
//! and reading streams is not served there: those are QUIC requests under the broker's
//! authentication and rules (`CreateClusterStream`, `DeleteClusterStream`, `ReadShard` in
//! docs/wire-protocol.md; `felix_client::Client`).

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::control::{Fsync, StreamKind};
use crate::service::ClusterStatus;

/// Largest answer read (a status lists every stream's shards).
const ANSWER_BYTES_MAX: u64 = 64 << 20;

/// Why an admin request failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{method} http://{addr}{path}: {detail}")]
    Http {
        method: &'static str,
        addr: SocketAddr,
        path: &'static str,
        detail: String,
    },
    #[error("the broker answered {status}: {message}")]
    Refused { status: u16, message: String },
}

/// One HTTP/1.0 request; returns the status code and the body.
fn request(
    addr: SocketAddr,
    method: &'static str,
    path: &'static str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String), AdminError> {
    let fail = |detail: String| AdminError::Http {
        method,
        addr,
        path,
        detail,
    };
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| fail(e.to_string()))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| fail(e.to_string()))?;
    let body = body.unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| fail(e.to_string()))?;
    let mut raw = Vec::new();
    stream
        .take(ANSWER_BYTES_MAX + 1)
        .read_to_end(&mut raw)
        .map_err(|e| fail(e.to_string()))?;
    if raw.len() as u64 > ANSWER_BYTES_MAX {
        return Err(fail(format!("answer larger than {ANSWER_BYTES_MAX} bytes")));
    }
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(fail("no HTTP header end".to_owned()));
    };
    let status = head
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| fail(format!("no status in {head:?}")))?;
    Ok((status, body.to_owned()))
}

fn refused(status: u16, body: &str) -> AdminError {
    let message = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned))
        .unwrap_or_else(|| body.trim().to_owned());
    AdminError::Refused { status, message }
}

/// The cluster as the broker whose metrics endpoint is `addr` sees it.
pub fn status(addr: SocketAddr, timeout: Duration) -> Result<ClusterStatus, AdminError> {
    let (status, body) = request(addr, "GET", "/v1/cluster/status", None, timeout)?;
    if status != 200 {
        return Err(refused(status, &body));
    }
    serde_json::from_str(&body).map_err(|error| AdminError::Http {
        method: "GET",
        addr,
        path: "/v1/cluster/status",
        detail: format!("unreadable status: {error}"),
    })
}

/// A committed record of a replicated shard as `felix cluster read --json` prints it (key and
/// payload in hex).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadRecord {
    pub offset: u64,
    pub timestamp_us: u64,
    #[serde(with = "hex_bytes")]
    pub key: Vec<u8>,
    #[serde(with = "hex_bytes")]
    pub payload: Vec<u8>,
}

mod hex_bytes {
    use std::fmt::Write as _;

    pub fn serialize<S: serde::Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        let mut text = String::with_capacity(bytes.len() * 2);
        for byte in bytes {
            let _ = write!(text, "{byte:02x}");
        }
        s.serialize_str(&text)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text: String = serde::Deserialize::deserialize(d)?;
        if !text.len().is_multiple_of(2) {
            return Err(serde::de::Error::custom("odd hex length"));
        }
        text.as_bytes()
            .chunks(2)
            .map(|pair| {
                std::str::from_utf8(pair)
                    .ok()
                    .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                    .ok_or_else(|| serde::de::Error::custom("not hex"))
            })
            .collect()
    }
}

/// The status as `felix cluster status` prints it: this member's view, the members, and each
/// stream's shards with their leader and replicas.
#[must_use]
pub fn render(status: &ClusterStatus) -> String {
    let node = &status.node;
    let mut out = String::new();
    let leader = node.leader.map_or_else(
        || "none (election in progress)".to_owned(),
        |id| id.to_string(),
    );
    let _ = writeln!(
        out,
        "member {} ({:?}), term {}, control-plane leader {leader}, commit {}, applied {}",
        node.id, node.role, node.term, node.commit, node.applied
    );
    let _ = writeln!(out, "\nmembers:");
    let _ = writeln!(
        out,
        "  {:<4} {:<24} {:<24} {:>5} {:>10} {:>9}",
        "id", "client address", "peer address", "cores", "connected", "raft lag"
    );
    for member in status.state.members.values() {
        let connected = if member.id == node.id {
            "self"
        } else if status.connected.contains(&member.id) {
            "yes"
        } else {
            "no"
        };
        let lag = node
            .peers
            .iter()
            .find(|p| p.id == member.id)
            .map_or_else(|| "-".to_owned(), |p| p.lag.to_string());
        let _ = writeln!(
            out,
            "  {:<4} {:<24} {:<24} {:>5} {:>10} {:>9}",
            member.id, member.client_addr, member.peer_addr, member.cores, connected, lag
        );
    }
    for log in &status.raft_logs {
        let _ = writeln!(
            out,
            "\nshard groups' raft log ({}): {} bytes, {} groups",
            log.fsync.name(),
            log.bytes,
            log.groups
        );
    }
    if status.state.streams.is_empty() {
        let _ = writeln!(out, "\nstreams: none");
    }
    for stream in status.state.streams.values() {
        let _ = writeln!(
            out,
            "\nstream {} ({}, {} shards, {} replicas)",
            stream.name,
            match (stream.kind, stream.fsync) {
                (StreamKind::Durable, Fsync::OnCommit) => "durable, fsync on_commit",
                (StreamKind::Durable, Fsync::Periodic) => "durable, fsync periodic",
                (StreamKind::InMemory, _) => "in memory",
            },
            stream.shards.len(),
            stream.replicas
        );
        let _ = writeln!(
            out,
            "  {:<6} {:<7} {:<5} {:<10} {:<7} {:>11} {:>11} {:>8} state",
            "shard", "placed", "core", "replicas", "leader", "oldest", "next offset", "max lag"
        );
        for (shard, placement) in stream.shards.iter().enumerate() {
            let replicas: Vec<String> = placement.replicas.iter().map(u64::to_string).collect();
            let group = crate::groups::group_id(
                stream.incarnation,
                u32::try_from(shard).unwrap_or(u32::MAX),
            );
            let held = status.shards.iter().find(|s| s.group == group);
            let (leader, oldest, next_offset, lag, state) = match held {
                None if stream.kind == StreamKind::Durable => (
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                    "not held here",
                ),
                None => (
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                    "one copy",
                ),
                Some(held) => (
                    held.leader
                        .map_or_else(|| "none".to_owned(), |leader| leader.to_string()),
                    held.oldest_offset.to_string(),
                    held.next_offset.to_string(),
                    held.progress
                        .iter()
                        .map(|p| p.lag)
                        .max()
                        .map_or_else(|| "-".to_owned(), |lag| lag.to_string()),
                    if held.under_replicated {
                        "under-replicated"
                    } else if held.fetching_from.is_some() {
                        "fetching missed records"
                    } else if held.leader.is_none() {
                        "electing"
                    } else {
                        "ok"
                    },
                ),
            };
            let _ = writeln!(
                out,
                "  {:<6} {:<7} {:<5} {:<10} {:<7} {:>11} {:>11} {:>8} {state}",
                shard,
                placement.leader,
                placement.core,
                replicas.join(","),
                leader,
                oldest,
                next_offset,
                lag
            );
        }
    }
    out
}

/// The cluster's metrics in OpenMetrics text (without the closing `# EOF`), appended to the
/// broker's `/metrics` by a member: its role and term, the control plane's commit and applied
/// indexes, each member's connection and (on the leader) replication lag, and per stream
/// shard the member placed to lead it.
#[must_use]
pub fn render_metrics(status: &ClusterStatus) -> String {
    let node = &status.node;
    let mut out = String::new();
    let gauge = |out: &mut String, name: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
    };
    // A gauge with a sample per replicated shard this member holds.
    let shard_gauge = |out: &mut String,
                       name: &str,
                       help: &str,
                       value: &dyn Fn(&crate::groups::ShardStatus) -> u64| {
        gauge(out, name, help);
        for held in &status.shards {
            let _ = writeln!(
                out,
                "{name}{{stream=\"{}\",shard=\"{}\"}} {}",
                label(&held.stream),
                held.shard,
                value(held)
            );
        }
    };
    gauge(
        &mut out,
        "felix_cluster_leader",
        "1 when this member leads the control plane.",
    );
    let _ = writeln!(
        out,
        "felix_cluster_leader {}",
        u8::from(node.role == crate::node::Role::Leader)
    );
    gauge(
        &mut out,
        "felix_cluster_term",
        "The control plane's Raft term.",
    );
    let _ = writeln!(out, "felix_cluster_term {}", node.term);
    gauge(
        &mut out,
        "felix_cluster_commit_index",
        "The control plane's last committed Raft index, as this member knows it.",
    );
    let _ = writeln!(out, "felix_cluster_commit_index {}", node.commit);
    gauge(
        &mut out,
        "felix_cluster_applied_index",
        "The control plane's last Raft index this member applied.",
    );
    let _ = writeln!(out, "felix_cluster_applied_index {}", node.applied);
    gauge(
        &mut out,
        "felix_cluster_subscriptions",
        "Subscriptions to cluster streams this member serves.",
    );
    let _ = writeln!(out, "felix_cluster_subscriptions {}", status.subscriptions);
    gauge(
        &mut out,
        "felix_cluster_peer_connected",
        "1 when this member's connection to the peer is up.",
    );
    for member in status.state.members.keys().filter(|id| **id != node.id) {
        let _ = writeln!(
            out,
            "felix_cluster_peer_connected{{peer=\"{member}\"}} {}",
            u8::from(status.connected.contains(member))
        );
    }
    gauge(
        &mut out,
        "felix_cluster_peer_lag_entries",
        "On the control plane's leader: entries each member is behind.",
    );
    for peer in &node.peers {
        let _ = writeln!(
            out,
            "felix_cluster_peer_lag_entries{{peer=\"{}\"}} {}",
            peer.id, peer.lag
        );
    }
    shard_gauge(
        &mut out,
        "felix_cluster_shard_raft_leader",
        "The member leading each replicated shard this member holds (0: none known).",
        &|held| held.leader.unwrap_or(0),
    );
    shard_gauge(
        &mut out,
        "felix_cluster_shard_pending_batches",
        "This member's publish batches into each replicated shard it holds, not applied yet.",
        &|held| held.pending as u64,
    );
    shard_gauge(
        &mut out,
        "felix_cluster_shard_record_log_bytes",
        "Bytes of this member's record log of each replicated shard it holds (records kept \
         by FELIX_DURABLE_RETENTION_*).",
        &|held| held.record_log_bytes,
    );
    shard_gauge(
        &mut out,
        "felix_cluster_shard_raft_log_entry_bytes",
        "Bytes of entries of each replicated shard's group kept in this member's shared Raft \
         log behind its snapshot (released by its next compaction).",
        &|held| held.raft_log_entry_bytes,
    );
    // A gauge with a sample per shared Raft log (fsync mode) this member opened.
    let raft_log_gauge =
        |out: &mut String,
         name: &str,
         help: &str,
         value: &dyn Fn(&crate::groups::RaftLogStatus) -> u64| {
            gauge(out, name, help);
            for log in &status.raft_logs {
                let _ = writeln!(
                    out,
                    "{name}{{fsync=\"{}\"}} {}",
                    log.fsync.name(),
                    value(log)
                );
            }
        };
    raft_log_gauge(
        &mut out,
        "felix_cluster_raft_log_bytes",
        "Bytes of this member's shared Raft log of the shard groups of each fsync mode (every \
         group's entries, states and snapshots).",
        &|log| log.bytes,
    );
    raft_log_gauge(
        &mut out,
        "felix_cluster_raft_log_groups",
        "Shard groups with their Raft log in this member's shared Raft log of each fsync mode.",
        &|log| log.groups as u64,
    );
    shard_gauge(
        &mut out,
        "felix_cluster_shard_oldest_offset",
        "The oldest offset of each replicated shard this member still holds.",
        &|held| held.oldest_offset,
    );
    shard_gauge(
        &mut out,
        "felix_cluster_shard_missing_records",
        "Offsets of each replicated shard this member's record log misses and fetches from a \
         peer (it installed a snapshot after falling behind a compaction); 0 normally.",
        &|held| {
            held.fetching_from
                .map_or(0, |from| held.next_offset.saturating_sub(from))
        },
    );
    // Each family's samples follow its own descriptors (OpenMetrics: a family is contiguous).
    let led = || {
        status
            .shards
            .iter()
            .filter(|s| s.role == crate::node::Role::Leader)
    };
    gauge(
        &mut out,
        "felix_cluster_shard_under_replicated",
        "On a replicated shard's leader: 1 when fewer replicas than placed are in sync.",
    );
    for held in led() {
        let _ = writeln!(
            out,
            "felix_cluster_shard_under_replicated{{stream=\"{}\",shard=\"{}\"}} {}",
            label(&held.stream),
            held.shard,
            u8::from(held.under_replicated)
        );
    }
    gauge(
        &mut out,
        "felix_cluster_shard_lag_entries",
        "On a replicated shard's leader: entries its furthest replica is behind.",
    );
    for held in led() {
        let lag = held.progress.iter().map(|p| p.lag).max().unwrap_or(0);
        let _ = writeln!(
            out,
            "felix_cluster_shard_lag_entries{{stream=\"{}\",shard=\"{}\"}} {lag}",
            label(&held.stream),
            held.shard
        );
    }
    gauge(
        &mut out,
        "felix_cluster_shard_leader",
        "The member placed to lead each shard of each stream.",
    );
    for stream in status.state.streams.values() {
        for (shard, placement) in stream.shards.iter().enumerate() {
            let _ = writeln!(
                out,
                "felix_cluster_shard_leader{{stream=\"{}\",shard=\"{shard}\"}} {}",
                label(&stream.name),
                placement.leader
            );
        }
    }
    out
}

/// A label value with its backslashes and quotes escaped (OpenMetrics).
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_family_is_contiguous_after_its_descriptors() {
        use crate::groups::ShardStatus;
        use crate::node::{NodeStatus, PeerProgress, Role};
        let shard = |stream: &str, shard: u32| ShardStatus {
            stream: stream.to_owned(),
            shard,
            group: 1,
            placed_leader: 1,
            leader: Some(1),
            role: Role::Leader,
            term: 2,
            commit: 3,
            next_offset: 4,
            oldest_offset: 0,
            recorded_offset: 4,
            record_log_bytes: 4096,
            raft_log_entry_bytes: 2048,
            snapshot_index: 0,
            fetching_from: None,
            replicas: vec![1, 2, 3],
            progress: vec![PeerProgress {
                id: 2,
                matched: 3,
                lag: 1,
            }],
            under_replicated: shard == 1,
            pending: 0,
            fsync: Fsync::OnCommit,
        };
        let status = ClusterStatus {
            node: NodeStatus {
                id: 1,
                role: Role::Leader,
                leader: Some(1),
                term: 2,
                commit: 3,
                applied: 3,
                last_index: 3,
                peers: Vec::new(),
            },
            state: crate::control::ControlState::default(),
            connected: vec![2],
            shards: vec![shard("a", 0), shard("a", 1), shard("b", 0)],
            subscriptions: 2,
            raft_logs: vec![crate::groups::RaftLogStatus {
                fsync: Fsync::OnCommit,
                bytes: 8 << 20,
                groups: 3,
            }],
        };
        let text = render_metrics(&status);
        let mut finished: Vec<String> = Vec::new();
        let mut current = String::new();
        for line in text.lines() {
            let family = match line.strip_prefix("# ") {
                Some(descriptor) => descriptor.split_whitespace().nth(1).unwrap_or_default(),
                None => line.split(['{', ' ']).next().unwrap_or_default(),
            };
            if family != current {
                assert!(
                    !finished.iter().any(|f| f == family),
                    "{family} comes back after another family:\n{text}"
                );
                finished.push(std::mem::replace(&mut current, family.to_owned()));
            }
        }
        assert!(text.contains("felix_cluster_shard_under_replicated{stream=\"a\",shard=\"1\"} 1"));
        assert!(text.contains("felix_cluster_shard_lag_entries{stream=\"b\",shard=\"0\"} 1"));
        assert!(text.contains("felix_cluster_raft_log_bytes{fsync=\"on_commit\"} 8388608"));
        assert!(text.contains("felix_cluster_raft_log_groups{fsync=\"on_commit\"} 3"));
        assert!(
            text.contains(
                "felix_cluster_shard_raft_log_entry_bytes{stream=\"a\",shard=\"1\"} 2048"
            )
        );
    }

    #[test]
    fn read_records_round_trip_in_hex_and_bad_hex_is_refused() {
        let record = ReadRecord {
            offset: 7,
            timestamp_us: 9,
            key: b"k\x00\xff".to_vec(),
            payload: (0..=255).collect(),
        };
        let json = serde_json::to_string(&record).unwrap();
        assert!(json.contains("\"6b00ff\""), "{json}");
        assert_eq!(serde_json::from_str::<ReadRecord>(&json).unwrap(), record);
        for bad in ["\"6\"", "\"zz\"", "\"\u{e9}a\""] {
            let json = format!(r#"{{"offset":0,"timestamp_us":0,"key":{bad},"payload":""}}"#);
            assert!(serde_json::from_str::<ReadRecord>(&json).is_err(), "{bad}");
        }
    }
}
