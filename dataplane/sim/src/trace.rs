//! The step log of one run: every line goes into a digest (two runs of a seed must agree
//! line for line) and into a ring of the last lines, printed when the run fails.

use std::collections::VecDeque;

/// Lines kept for the failure report: enough to see the steps leading to a violation.
pub const TRACE_LINES_KEPT: usize = 400;

/// The step log of one run.
#[derive(Debug)]
pub struct Trace {
    lines: VecDeque<String>,
    kept: usize,
    /// FNV-1a over every line, in order.
    digest: u64,
    /// Print every line as it is written (`SIM_LOG=all`).
    echo: bool,
    pub written: u64,
}

impl Trace {
    #[must_use]
    pub fn new(kept: usize, echo: bool) -> Trace {
        Trace {
            lines: VecDeque::with_capacity(kept.min(TRACE_LINES_KEPT)),
            kept,
            digest: 0xcbf2_9ce4_8422_2325,
            echo,
            written: 0,
        }
    }

    pub fn line(&mut self, line: String) {
        for byte in line.bytes().chain(std::iter::once(b'\n')) {
            self.digest ^= u64::from(byte);
            self.digest = self.digest.wrapping_mul(0x0100_0000_01b3);
        }
        if self.echo {
            println!("{line}");
        }
        self.written += 1;
        if self.kept == 0 {
            return;
        }
        if self.lines.len() == self.kept {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }

    #[must_use]
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The last lines, oldest first.
    pub fn tail(&self) -> impl Iterator<Item = &String> {
        self.lines.iter()
    }
}
