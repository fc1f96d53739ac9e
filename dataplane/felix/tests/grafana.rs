//! The Grafana dashboard (docs/grafana/felix.json): well-formed (unique panel ids, every panel
//! and query on the `${DS_PROMETHEUS}` input), and every metric its PromQL names is one a real
//! broker exports on `GET /metrics` — checked against a three-member cluster (whose members
//! serve the broker's metrics and the cluster's gauges) with a replicated durable stream, a
//! member's own durable stream, acked publishes into both and a subscriber.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use felix_client::{ShardSelection, StartPosition, StreamKind, record};
use support::{BrokerProcess, DEADLINE, felix, within};

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/grafana/felix.json");

/// The datasource every panel and query must use: the dashboard's import input, so it imports
/// into any Grafana whatever its Prometheus is called.
const DATASOURCE_UID: &str = "${DS_PROMETHEUS}";

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(DASHBOARD).expect("read docs/grafana/felix.json");
    serde_json::from_str(&text).expect("docs/grafana/felix.json is JSON")
}

/// Every panel, rows' nested panels included (a collapsed row holds its panels inside it).
fn panels(dashboard: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    let mut todo: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .expect("the dashboard has panels")
        .iter()
        .collect();
    while let Some(panel) = todo.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            todo.extend(nested);
        }
        out.push(panel);
    }
    out
}

/// Every PromQL text of the dashboard: each query's `expr` and each templating query.
fn queries(dashboard: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push(target["expr"].as_str().unwrap_or_default().to_owned());
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(query) = variable["query"]["query"].as_str() {
            out.push(query.to_owned());
        }
        if let Some(query) = variable["query"].as_str() {
            out.push(query.to_owned());
        }
    }
    out
}

/// The metric names a PromQL text mentions: every `felix_[a-z0-9_]+` identifier. Felix's
/// label values never start with `felix_`, and the dashboard names no other metric family.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_';
    let mut at = 0;
    while let Some(found) = expr[at..].find("felix_") {
        let start = at + found;
        let mut end = start + "felix_".len();
        while end < bytes.len() && ident(bytes[end]) {
            end += 1;
        }
        // Only a whole identifier: not the tail of `my_felix_x`.
        if start == 0 || !(ident(bytes[start - 1]) || bytes[start - 1].is_ascii_uppercase()) {
            names.insert(expr[start..end].to_owned());
        }
        at = end;
    }
    names
}

/// What an exposition offers a query: the names of its samples, and each family's type from
/// its `# TYPE` line.
struct Exposition {
    samples: BTreeSet<String>,
    types: BTreeMap<String, String>,
}

fn exposition(text: &str) -> Exposition {
    let mut samples = BTreeSet::new();
    let mut types = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                types.insert(name.to_owned(), kind.to_owned());
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            samples.insert(line[..end].to_owned());
        }
    }
    Exposition { samples, types }
}

impl Exposition {
    /// Whether Prometheus scraping this exposition would have a series named `name`: a sample
    /// of that name, a gauge family with no sample yet (a cluster shard gauge before any
    /// shard), a counter's `_total`, or a histogram's `_bucket` / `_sum` / `_count`.
    fn offers(&self, name: &str) -> bool {
        if self.samples.contains(name) {
            return true;
        }
        let typed = |base: &str, kinds: &[&str]| {
            self.types
                .get(base)
                .is_some_and(|kind| kinds.contains(&kind.as_str()))
        };
        if typed(name, &["gauge", "unknown"]) {
            return true;
        }
        if let Some(base) = name.strip_suffix("_total")
            && typed(base, &["counter"])
        {
            return true;
        }
        ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .is_some_and(|base| typed(base, &["histogram"]))
        })
    }
}

// Proves the dashboard is importable anywhere: unique panel ids, the DS_PROMETHEUS input, every
// panel and query on it, a description and a query on every panel that shows data.
#[test]
fn dashboard_is_well_formed() {
    let dashboard = dashboard();
    assert!(
        dashboard["schemaVersion"].as_u64().unwrap_or(0) >= 36,
        "schemaVersion of a current Grafana"
    );
    let inputs = dashboard["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs
            .iter()
            .any(|input| input["name"] == "DS_PROMETHEUS" && input["pluginId"] == "prometheus"),
        "a DS_PROMETHEUS datasource input: {inputs:?}"
    );
    let mut ids = BTreeSet::new();
    let mut shown = 0;
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or("(untitled)");
        let id = panel["id"].as_u64().expect("every panel has a numeric id");
        assert!(ids.insert(id), "panel id {id} used twice (second: {title})");
        assert_eq!(
            panel["datasource"]["uid"], DATASOURCE_UID,
            "panel {title:?} uses the DS_PROMETHEUS input"
        );
        if panel["type"] == "row" {
            continue;
        }
        shown += 1;
        let description = panel["description"].as_str().unwrap_or_default();
        assert!(
            description.len() > 40,
            "panel {title:?} says what it shows and what a bad value means"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title:?} has a query");
        for target in targets {
            assert_eq!(
                target["datasource"]["uid"], DATASOURCE_UID,
                "a query of {title:?} uses the DS_PROMETHEUS input"
            );
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(
                !metric_names(expr).is_empty(),
                "query {expr:?} of {title:?} names a Felix metric"
            );
        }
    }
    assert!(shown >= 20, "only {shown} panels");
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating variables")
    {
        assert_eq!(
            variable["datasource"]["uid"], DATASOURCE_UID,
            "variable {} uses the DS_PROMETHEUS input",
            variable["name"]
        );
    }
}

// Proves the metric-name rules: whole identifiers only, counters by `_total`, histograms by
// their series suffixes, gauges without samples by their TYPE line, nothing else.
#[test]
fn metric_names_are_matched_as_prometheus_would_see_them() {
    assert_eq!(
        metric_names(
            "sum(rate(felix_fsync_seconds_bucket{code=\"felix_x\"}[5m])) / my_felix_y + felix_z"
        )
        .into_iter()
        .collect::<Vec<_>>(),
        ["felix_fsync_seconds_bucket", "felix_x", "felix_z"]
    );
    let text = "# TYPE felix_acks counter\nfelix_acks_total 3\n\
                # TYPE felix_fsync_seconds histogram\nfelix_fsync_seconds_sum 0.1\n\
                # TYPE felix_cluster_shard_leader gauge\n# EOF\n";
    let offered = exposition(text);
    for name in [
        "felix_acks_total",
        "felix_fsync_seconds_sum",
        "felix_fsync_seconds_bucket",
        "felix_cluster_shard_leader",
    ] {
        assert!(offered.offers(name), "{name} is offered");
    }
    for name in [
        "felix_acks",
        "felix_acks_count",
        "felix_fsync_seconds",
        "felix_nope",
    ] {
        assert!(!offered.offers(name), "{name} is not offered");
    }
}

/// Three members on loopback with development certificates (as tests/cluster.rs starts them).
fn start_cluster(certs: &Path) -> Vec<BrokerProcess> {
    let output = felix()
        .args(["cluster", "dev-certs", "--out"])
        .arg(certs)
        .args(["--node", "1", "--node", "2", "--node", "3"])
        .output()
        .expect("felix runs");
    assert!(
        output.status.success(),
        "felix cluster dev-certs: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let peers: Vec<String> = (1..=3)
        .map(|id| format!("{id}=127.0.0.1:{}", support::free_peer_port()))
        .collect();
    let peers = peers.join(",");
    let path = |name: String| certs.join(name).display().to_string();
    (1..=3)
        .map(|id: u64| {
            let id_text = id.to_string();
            let ca = path("ca.pem".to_owned());
            let cert = path(format!("node-{id}.pem"));
            let key = path(format!("node-{id}.key"));
            BrokerProcess::start(&[
                ("FELIX_CLUSTER_NODE_ID", id_text.as_str()),
                ("FELIX_CLUSTER_PEERS", peers.as_str()),
                ("FELIX_CLUSTER_CA", ca.as_str()),
                ("FELIX_CLUSTER_CERT", cert.as_str()),
                ("FELIX_CLUSTER_KEY", key.as_str()),
            ])
        })
        .collect()
}

/// Creates the replicated durable stream through `member` (a QUIC admin request), asking
/// again while the control plane has no leader yet (the members just started).
async fn create_replicated(member: &BrokerProcess, name: &str) {
    let deadline = Instant::now() + DEADLINE * 2;
    loop {
        let client = member.client().await;
        let created = within(client.create_cluster_stream(
            name,
            2,
            StreamKind::Durable,
            3,
            felix_wire::FsyncMode::OnCommit,
        ))
        .await;
        client.close().await;
        let Err(error) = created else { return };
        assert!(
            Instant::now() < deadline,
            "the replicated stream was not created: {error}\n{}",
            member.stderr_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// Proves every metric the dashboard queries exists in a real broker's /metrics (a cluster
// member's, so the cluster gauges are there too), after traffic made its labelled series.
#[test]
fn every_metric_the_dashboard_queries_is_exported() {
    let dashboard = dashboard();
    let queried: BTreeSet<String> = queries(&dashboard)
        .iter()
        .flat_map(|expr| metric_names(expr))
        .collect();
    println!("the dashboard queries {} metrics", queried.len());
    assert!(
        queried.len() >= 40,
        "only {} metrics: {queried:?}",
        queried.len()
    );

    let certs = tempfile::tempdir().expect("temp dir");
    let members = start_cluster(certs.path());
    let member = &members[0];
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        create_replicated(member, "replicated").await;
        let client = member.client().await;
        within(client.create_stream("local", 2, StreamKind::Durable))
            .await
            .expect("the member's own durable stream is created");
        let mut subscription =
            within(client.subscribe("local", ShardSelection::All, StartPosition::Earliest))
                .await
                .expect("subscribed");
        let records = vec![record("k1", "one"), record("k2", "two")];
        within(client.publish("local", &records))
            .await
            .expect("acked into the member's own stream");
        within(client.publish("replicated", &records))
            .await
            .expect("acked into the replicated stream (its shards elected leaders)");
        for _ in 0..records.len() {
            let received = within(futures::StreamExt::next(&mut subscription)).await;
            assert!(
                matches!(received, Some(Ok(_))),
                "a record delivered: {received:?}"
            );
        }
        subscription.close().await;
        client.close().await;
    });

    let text = member.metrics();
    let offered = exposition(&text);
    let missing: Vec<&String> = queried
        .iter()
        .filter(|name| !offered.offers(name))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/grafana/felix.json queries metrics the broker does not export: {missing:?}\n\
         /metrics of a cluster member:\n{text}"
    );
}
