//! Runs real cells against a real nats-server 2.15 through the NATS driver, when the binary is
//! there (`bench/scripts/get-nats.sh` puts it in target/nats/; FELIX_BENCH_NATS_SERVER names
//! another). CI does not fetch it, so there the test prints why it skipped and passes.

use std::path::PathBuf;

use felix_bench::cell::{CellDriver, CellRecord, Facts};
use felix_bench::generator::LatencyCounts;
use felix_bench::nats::{DEFAULT_NATS_SERVER, NatsDriver};
use felix_bench::plan::Plan;

fn server() -> Option<PathBuf> {
    let path = std::env::var_os("FELIX_BENCH_NATS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(DEFAULT_NATS_SERVER)
        });
    path.is_file().then_some(path)
}

fn run(plan: &str, latency: LatencyCounts) -> Option<Vec<CellRecord>> {
    let Some(bin) = server() else {
        println!(
            "SKIP: no nats-server at {DEFAULT_NATS_SERVER} (run bench/scripts/get-nats.sh) or FELIX_BENCH_NATS_SERVER"
        );
        return None;
    };
    let plan = Plan::parse(plan).unwrap();
    let work = tempfile::tempdir().unwrap();
    let mut driver = NatsDriver::new(bin, work.path().to_path_buf(), latency).unwrap();
    let mut out = Vec::new();
    for run in plan.schedule() {
        let (cell, arm) = (&plan.cells[run.cell], &plan.arms[run.arm]);
        let result = driver
            .run_cell(&plan.settings, cell, arm, run.trial)
            .unwrap();
        out.push(CellRecord::from_run(
            &plan.settings,
            cell,
            arm,
            run.trial,
            Facts::gather(),
            result,
        ));
    }
    Some(out)
}

#[test]
fn atomic_batches_with_fsync_are_counted_at_the_server() {
    // Proves a JetStream file cell with sync_interval: always and atomic batches of 64 over TLS yields server-counted throughput, CPU, context switches and no shed.
    let Some(records) = run(
        "[settings]\nduration_s = 5\ntrials = 1\nshards = 4\n\
         [[arms]]\nname = \"nats\"\nsystem = \"nats\"\nsync = \"always\"\natomic_batch = true\n\
         [[cells]]\nkind = \"durable\"\npayload = 256\nbatch = 64\nmode = \"acked\"\n\
         publishers = 2\nin_flight = 4\n",
        LatencyCounts::default(),
    ) else {
        return;
    };
    let r = &records[0];
    assert!(r.error.is_none(), "{:?}", r.error);
    let o = r.outputs.as_ref().unwrap();
    assert!(o.throughput.records_per_s > 0.0);
    assert_eq!(
        o.throughput.payload_bytes_per_s,
        o.throughput.records_per_s * 256.0
    );
    // Stream bytes carry NATS's per-message framing on top of the payload.
    assert!(o.throughput.append_bytes_per_s > o.throughput.payload_bytes_per_s);
    assert!(o.throughput.cpu_cores > 0.0);
    assert!(o.throughput.ctx_switches_per_s > 0.0);
    assert_eq!(o.shed.shed.records, 0, "every sent record is stored");
    assert!(o.ack_latency.is_some());
}

#[test]
fn latency_and_core_cells_run_against_nats() {
    // Proves a latency cell gets ack and delivery percentiles from ordered consumers, and a core fire-and-forget cell is counted from /varz.
    let Some(records) = run(
        "[settings]\nduration_s = 5\ntrials = 1\nshards = 2\n\
         [[arms]]\nname = \"mem\"\nsystem = \"nats\"\nstorage = \"memory\"\n\
         [[arms]]\nname = \"core\"\nsystem = \"nats\"\nmode = \"core\"\ntls = false\n\
         [[cells]]\nkind = \"in-memory\"\npayload = 64\nbatch = 1\nmode = \"acked\"\n\
         publishers = 1\nin_flight = 1\nmeasure = \"latency\"\narms = [\"mem\"]\n\
         [[cells]]\nkind = \"in-memory\"\npayload = 64\nbatch = 8\nmode = \"fire-and-forget\"\n\
         publishers = 1\nin_flight = 1\narms = [\"core\"]\n",
        LatencyCounts {
            warmup: 100,
            measured: 1_000,
        },
    ) else {
        return;
    };
    let lat = &records[0];
    assert!(lat.error.is_none(), "{:?}", lat.error);
    let o = lat.outputs.as_ref().unwrap();
    let (ack, delivery) = (o.ack_latency.unwrap(), o.delivery_latency.unwrap());
    assert!(ack.p50_us > 0.0 && ack.p50_us <= ack.p99_us);
    assert!(delivery.p50_us > 0.0 && delivery.p50_us <= delivery.p999_us);
    let core = &records[1];
    assert!(core.error.is_none(), "{:?}", core.error);
    let o = core.outputs.as_ref().unwrap();
    assert!(o.throughput.records_per_s > 0.0);
    assert!(o.throughput.wire_bytes_per_s > 0.0);
}
