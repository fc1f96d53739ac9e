//! docs/wire-protocol.md section 6 against a real broker: each announced limit's default in
//! the doc is what a broker started with default settings announces in `HelloOk`.

mod support;

use support::BrokerProcess;

const WIRE_PROTOCOL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/wire-protocol.md");

/// The `Default` column of the section 6 limits table, by limit name (`max_shards`), as
/// numbers (`16,777,216 (16 MiB)` is 16777216).
fn documented_defaults() -> Vec<(String, u64)> {
    let text = std::fs::read_to_string(WIRE_PROTOCOL).expect("read docs/wire-protocol.md");
    let section = text
        .split("\n## 6. Limits")
        .nth(1)
        .and_then(|rest| rest.split("\n## 7.").next())
        .expect("docs/wire-protocol.md has a section 6, Limits");
    let mut rows = Vec::new();
    let mut default_column = None;
    for line in section.lines().filter(|line| line.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if let Some(column) = cells.iter().position(|cell| *cell == "Default") {
            default_column = Some(column);
            continue;
        }
        let (Some(column), Some(limit)) = (default_column, cells.first()) else {
            continue;
        };
        let Some(limit) = limit
            .strip_prefix("`max_")
            .and_then(|l| l.strip_suffix('`'))
        else {
            // The rule under the header, or the protocol's fixed limits (no Default column).
            continue;
        };
        let digits: String = cells[column]
            .split(" (")
            .next()
            .unwrap_or_default()
            .chars()
            .filter(|c| *c != ',')
            .collect();
        let value = digits
            .parse()
            .unwrap_or_else(|_| panic!("max_{limit}: default {:?} is a number", cells[column]));
        rows.push((format!("max_{limit}"), value));
    }
    rows
}

// Proves the section 6 defaults table is what a default broker announces, limit by limit.
#[test]
fn wire_protocol_defaults_are_what_a_default_broker_announces() {
    let documented = documented_defaults();
    let broker = BrokerProcess::start(&[]);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let limits = runtime.block_on(async {
        let client = broker.client().await;
        let limits = client.hello().limits;
        client.close().await;
        limits
    });
    let announced = [
        ("max_frame_bytes", u64::from(limits.max_frame_bytes)),
        ("max_batch_records", u64::from(limits.max_batch_records)),
        ("max_payload_bytes", u64::from(limits.max_payload_bytes)),
        ("max_key_bytes", u64::from(limits.max_key_bytes)),
        ("max_name_bytes", u64::from(limits.max_name_bytes)),
        ("max_shards", u64::from(limits.max_shards)),
    ];
    let documented_names: Vec<&str> = documented.iter().map(|(name, _)| name.as_str()).collect();
    let announced_names: Vec<&str> = announced.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        documented_names, announced_names,
        "docs/wire-protocol.md section 6 lists every limit HelloOk announces, in its order"
    );
    for ((name, doc), (_, real)) in documented.iter().zip(announced) {
        assert_eq!(
            *doc, real,
            "docs/wire-protocol.md section 6: {name} default {doc}, a default broker announces \
             {real}"
        );
    }
}
