//! A progress bar over a campaign's runs (indicatif), drawn on stderr only when it is a
//! terminal, so logs and CI output stay clean.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the bar redraws while a cell runs: 1 s matches the counter sampling, so the
/// elapsed time moves without spending CPU on the generator machine.
const TICK_INTERVAL: Duration = Duration::from_secs(1);

/// Bar layout: elapsed, bar, runs done of total, ETA, then the current run.
const TEMPLATE: &str = "[{elapsed_precise}] {bar:30} {pos}/{len} runs (eta {eta}) {msg}";

/// Progress over a fixed number of runs.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar over `runs` runs on stderr (hidden when stderr is not a terminal).
    pub fn new(runs: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(runs), ProgressDrawTarget::stderr());
        // TEMPLATE is a constant checked by the progress tests; fall back to the default bar anyway.
        let style =
            ProgressStyle::with_template(TEMPLATE).unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.enable_steady_tick(TICK_INTERVAL);
        Progress { bar }
    }

    /// A bar that draws nothing (tests, `--quiet`).
    pub fn hidden(runs: u64) -> Progress {
        let bar = ProgressBar::hidden();
        bar.set_length(runs);
        Progress { bar }
    }

    /// Shows which run is in progress.
    pub fn start_run(&self, what: &str) {
        self.bar.set_message(what.to_string());
    }

    /// Counts one run as done.
    pub fn finish_run(&self) {
        self.bar.inc(1);
    }

    /// Prints a line above the bar without tearing it.
    pub fn println(&self, line: &str) {
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }

    /// Runs done so far.
    pub fn done(&self) -> u64 {
        self.bar.position()
    }

    /// Ends the bar, leaving a final message.
    pub fn finish(&self, message: &str) {
        self.bar.disable_steady_tick();
        self.bar.finish_with_message(message.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_is_valid_and_runs_are_counted() {
        // Proves the bar template parses and finished runs advance the count.
        assert!(ProgressStyle::with_template(TEMPLATE).is_ok());
        let p = Progress::hidden(3);
        p.start_run("cell 1 trial 1 arm a");
        p.finish_run();
        p.finish_run();
        assert_eq!(p.done(), 2);
        p.finish("done");
    }
}
