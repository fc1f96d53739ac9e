//! Runs real cells through the Felix load generator against a real broker started in-process
//! on loopback (a binary cannot be a dev-dependency, so the runner is given the broker's
//! addresses, as `--broker-addr`, `--metrics-addr` and `--ca` do).

use felix_bench::cell::{CellDriver, CellRecord, Facts};
use felix_bench::generator::{FelixDriver, LatencyCounts, Target, external_endpoint};
use felix_bench::plan::Plan;

/// A broker on 127.0.0.1 with kernel-chosen ports and its own data directory.
struct LiveBroker {
    broker: Option<felix_broker::Broker>,
    _dir: tempfile::TempDir,
    endpoint: felix_bench::broker::BrokerEndpoint,
}

impl LiveBroker {
    fn start() -> LiveBroker {
        let dir = tempfile::tempdir().unwrap();
        let env = vec![
            (
                "FELIX_DATA_DIR".to_string(),
                dir.path().display().to_string(),
            ),
            ("FELIX_BIND".to_string(), "127.0.0.1:0".to_string()),
            ("FELIX_METRICS_BIND".to_string(), "127.0.0.1:0".to_string()),
            ("FELIX_LOG".to_string(), "warn".to_string()),
            // Small preallocated segments: the 1 GiB default per core is not needed here.
            (
                "FELIX_DURABLE_SEGMENT_BYTES".to_string(),
                "4MiB".to_string(),
            ),
        ];
        let config = felix_tuning::Config::load(None, env, &[]).unwrap();
        let broker = felix_broker::Broker::start(&config).unwrap();
        let endpoint = external_endpoint(
            broker.quic_addr(),
            broker.metrics_addr().unwrap(),
            config.dev_cert_path(),
            None,
        );
        LiveBroker {
            broker: Some(broker),
            _dir: dir,
            endpoint,
        }
    }
}

impl Drop for LiveBroker {
    fn drop(&mut self) {
        if let Some(broker) = self.broker.take() {
            broker.shutdown_trigger().trigger();
            let _ = broker.wait();
        }
    }
}

fn one_cell_plan(cell: &str) -> Plan {
    Plan::parse(&format!(
        "[settings]\nduration_s = 5\ntrials = 1\nshards = 4\n\
         [[arms]]\nname = \"live\"\n[[cells]]\n{cell}\n"
    ))
    .unwrap()
}

fn run(broker: &LiveBroker, plan: &Plan, latency: LatencyCounts) -> CellRecord {
    let mut driver = FelixDriver::new(Target::External(broker.endpoint.clone()), latency).unwrap();
    let cell = &plan.cells[0];
    let arm = &plan.arms[0];
    let run = driver.run_cell(&plan.settings, cell, arm, 1).unwrap();
    CellRecord::from_run(&plan.settings, cell, arm, 1, Facts::gather(), run)
}

#[test]
fn short_acked_cell_yields_a_well_formed_record() {
    // Proves a 5 s acked in-memory cell against a real broker records broker-side throughput, a steady window, no shed and ack latency.
    let broker = LiveBroker::start();
    let plan = one_cell_plan(
        "kind = \"in-memory\"\npayload = 256\nbatch = 1\nmode = \"acked\"\npublishers = 1\nin_flight = 4",
    );
    let record = run(&broker, &plan, LatencyCounts::default());
    assert!(record.error.is_none(), "{:?}", record.error);
    let o = record.outputs.as_ref().unwrap();
    assert!(o.throughput.payload_bytes_per_s > 0.0);
    assert!(o.throughput.records_per_s > 0.0);
    assert!(o.throughput.points >= 3, "{}", o.throughput.points);
    assert!(o.throughput.window.start_s < o.throughput.window.end_s);
    assert_eq!(o.shed.shed.bytes, 0, "{:?}", o.shed);
    assert_eq!(o.shed.sent.bytes, o.shed.accepted.bytes);
    assert_eq!(o.shed.sent.records * 256, o.shed.sent.bytes);
    assert!(o.littles_law.is_some());
    assert!(o.ack_latency.unwrap().count > 0);
    assert_eq!(record.generators.len(), 1);
    let line = record.to_json_line().unwrap();
    assert!(line.contains("\"payload_bytes_per_s\""));
}

#[test]
fn latency_cell_measures_ack_and_delivery() {
    // Proves a latency cell records exactly the measured publishes for acks and their deliveries to the subscriber.
    let broker = LiveBroker::start();
    let plan = one_cell_plan(
        "kind = \"in-memory\"\npayload = 256\nbatch = 1\nmode = \"acked\"\npublishers = 1\n\
         in_flight = 1\nmeasure = \"latency\"",
    );
    let counts = LatencyCounts {
        warmup: 100,
        measured: 1000,
    };
    let record = run(&broker, &plan, counts);
    assert!(record.error.is_none(), "{:?}", record.error);
    let o = record.outputs.as_ref().unwrap();
    assert_eq!(o.ack_latency.unwrap().count, 1000);
    assert_eq!(o.delivery_latency.unwrap().count, 1000);
    assert_eq!(o.shed.shed.bytes, 0);
}

#[test]
fn fire_and_forget_cell_drains_before_the_last_sample() {
    // Proves fire-and-forget publishers finish gracefully: the broker's accepted bytes catch up with what was sent.
    let broker = LiveBroker::start();
    let plan = one_cell_plan(
        "kind = \"in-memory\"\npayload = 1024\nbatch = 16\nmode = \"fire-and-forget\"\n\
         publishers = 2\nin_flight = 1\nkeys = \"plain\"",
    );
    let record = run(&broker, &plan, LatencyCounts::default());
    assert!(record.error.is_none(), "{:?}", record.error);
    let o = record.outputs.as_ref().unwrap();
    assert!(o.throughput.payload_bytes_per_s > 0.0);
    assert_eq!(o.shed.sent.bytes, o.shed.accepted.bytes, "{:?}", o.shed);
    assert!(o.littles_law.is_none());
}
