//! Walks a plan's schedule through a [`CellDriver`] and appends one JSON line per run to
//! `<out>/cells.jsonl`, flushed after each run so a campaign stopped half way keeps what it
//! measured. A run that fails is recorded with its error and the campaign goes on.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::BenchError;
use crate::cell::{CellDriver, CellRecord, Facts};
use crate::plan::Plan;
use crate::progress::Progress;

/// Name of the results file inside the output directory.
pub const RECORDS_FILE: &str = "cells.jsonl";

/// What a campaign run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSummary {
    pub records_path: PathBuf,
    pub runs: usize,
    pub failed: usize,
}

/// Runs every scheduled run of `plan` through `driver`, recording each to `out/cells.jsonl`
/// with the session's `facts` (time set per run) and printing one result line per run.
pub fn run_plan(
    plan: &Plan,
    driver: &mut dyn CellDriver,
    out: &Path,
    progress: &Progress,
    facts: &Facts,
) -> Result<RunSummary, BenchError> {
    std::fs::create_dir_all(out).map_err(|e| BenchError::io(out, e))?;
    let records_path = out.join(RECORDS_FILE);
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&records_path)
        .map_err(|e| BenchError::io(&records_path, e))?;
    let schedule = plan.schedule();
    let mut failed = 0;
    for run in &schedule {
        let cell = &plan.cells[run.cell];
        let arm = &plan.arms[run.arm];
        progress.start_run(&format!(
            "{} trial {} arm {}",
            cell.label(),
            run.trial,
            arm.name
        ));
        let facts = facts.now();
        let record = match driver.run_cell(&plan.settings, cell, arm, run.trial) {
            Ok(result) => CellRecord::from_run(&plan.settings, cell, arm, run.trial, facts, result),
            Err(e) => CellRecord::failed(&plan.settings, cell, arm, run.trial, facts, &e),
        };
        if record.error.is_some() {
            failed += 1;
        }
        progress.println(&record.result_line());
        let line = record.to_json_line()?;
        writeln!(file, "{line}")
            .and_then(|()| file.flush())
            .map_err(|e| BenchError::io(&records_path, e))?;
        progress.finish_run();
    }
    progress.finish(&format!("{} runs, {failed} failed", schedule.len()));
    Ok(RunSummary {
        records_path,
        runs: schedule.len(),
        failed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::CellRun;
    use crate::cell::tests::fixed_run;
    use crate::plan::{Arm, Cell, Settings};
    use crate::report::read_records;

    /// Replays fixed recorded runs; fails the run of one chosen arm. This exercises the runner's
    /// loop and recording only; it stands in for no component under test.
    struct Replay {
        calls: Vec<(usize, u32, String)>,
        fail_arm: &'static str,
    }

    impl CellDriver for Replay {
        fn run_cell(
            &mut self,
            _settings: &Settings,
            cell: &Cell,
            arm: &Arm,
            trial: u32,
        ) -> Result<CellRun, BenchError> {
            self.calls.push((cell.number, trial, arm.name.clone()));
            if arm.name == self.fail_arm {
                return Err(BenchError::Driver {
                    cell: cell.label(),
                    detail: "broker unreachable".to_string(),
                });
            }
            Ok(fixed_run(4_096_000, 0))
        }
    }

    #[test]
    fn runner_follows_the_schedule_and_records_every_run() {
        // Proves every scheduled run is driven in order and recorded as one JSON line, failures included.
        let plan = Plan::parse(
            "[settings]\nbroker = \"h:1\"\nduration_s = 20\ntrials = 2\n\
             [[arms]]\nname = \"a\"\n[[arms]]\nname = \"b\"\n\
             [[cells]]\nkind = \"in-memory\"\npayload = 4096\nbatch = 64\nmode = \"acked\"\n\
             publishers = 1\nin_flight = [1, 4]\n",
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut driver = Replay {
            calls: Vec::new(),
            fail_arm: "b",
        };
        let summary = run_plan(
            &plan,
            &mut driver,
            dir.path(),
            &Progress::hidden(8),
            &Facts::default(),
        )
        .unwrap();
        assert_eq!((summary.runs, summary.failed), (8, 4));
        let order: Vec<(usize, u32, &str)> = driver
            .calls
            .iter()
            .map(|(c, t, a)| (*c, *t, a.as_str()))
            .collect();
        assert_eq!(
            order,
            vec![
                (1, 1, "a"),
                (1, 1, "b"),
                (1, 2, "b"),
                (1, 2, "a"),
                (2, 1, "a"),
                (2, 1, "b"),
                (2, 2, "b"),
                (2, 2, "a"),
            ]
        );
        let records = read_records(dir.path()).unwrap();
        assert_eq!(records.len(), 8);
        assert!(
            records[1]
                .error
                .as_deref()
                .unwrap()
                .contains("broker unreachable")
        );
        assert!(records[0].outputs.is_some());
    }
}
