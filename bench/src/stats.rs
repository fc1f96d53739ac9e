//! Pure arithmetic on what a cell recorded (no IO, no clock).
//!
//! Method (docs/semantics.md, 7 Measuring performance): throughput is measured at the
//! broker from its cumulative counters read once a second; a cell's number is the median
//! one-second rate over the steady window, which is the interval in which all generators were
//! running, less its first and last 10%. Per-generator rates are never summed.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::BenchError;

/// Fraction of the all-running interval dropped at each end. The reference trims 10%: enough to
/// leave out connection set-up and the drain at the deadline, and in a 90 s cell it keeps ~72 s.
pub const STEADY_TRIM_FRACTION: f64 = 0.10;

/// Fewest one-second rates a steady-window median may be taken from. Below three, a median is
/// one value or the mean of two, with nothing to outvote a single disturbed second.
pub const STEADY_POINTS_MIN: usize = 3;

/// Slack when testing whether a rate's interval lies inside the window: sample times are read
/// from a clock in seconds as f64, and a boundary that coincides exactly must count as inside.
const WINDOW_EPSILON_S: f64 = 1e-9;

/// Bytes in a megabyte as the reports print it (decimal, like fio's and the reference's MB/s).
pub const BYTES_PER_MB: f64 = 1e6;

/// One reading of the broker's cumulative counters.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the cell started (the sampler's clock).
    pub t_s: f64,
    /// Payload bytes accepted (shed publishes not counted).
    pub payload_bytes: u64,
    /// Bytes appended to durable logs (payload + framing).
    pub append_bytes: u64,
    /// UDP bytes received on the broker's QUIC ports.
    pub wire_bytes: u64,
    /// Records accepted.
    pub records: u64,
    /// CPU seconds used by the broker process (user + system).
    pub cpu_seconds: f64,
    /// The kernel's UDP `RcvbufErrors` (receive-buffer drops).
    pub udp_rcvbuf_errors: u64,
    /// Publishes shed by a full ingress queue.
    #[serde(default)]
    pub publishes_shed: u64,
    /// Publishes refused by a full ingress queue.
    #[serde(default)]
    pub publishes_refused: u64,
    /// fsyncs (fdatasync calls) of durable logs.
    #[serde(default)]
    pub fsyncs: u64,
    /// Context switches (voluntary + involuntary) of every thread of the broker process, from
    /// `/proc/<pid>/task/*/status`; 0 when the broker's pid is unknown.
    #[serde(default)]
    pub ctx_switches: u64,
}

/// The change of every counter between two consecutive samples, divided by the time between them.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Rate {
    /// Start of the interval, seconds since cell start.
    pub t0_s: f64,
    /// End of the interval, seconds since cell start.
    pub t1_s: f64,
    pub payload_bytes_per_s: f64,
    pub append_bytes_per_s: f64,
    pub wire_bytes_per_s: f64,
    pub records_per_s: f64,
    /// Broker CPU cores in use: d(cpu_seconds)/dt.
    pub cpu_cores: f64,
    pub udp_rcvbuf_errors_per_s: f64,
    pub publishes_shed_per_s: f64,
    pub publishes_refused_per_s: f64,
    pub fsyncs_per_s: f64,
    #[serde(default)]
    pub ctx_switches_per_s: f64,
}

/// Per-interval rates from consecutive samples. A counter that goes backwards refuses the cell.
pub fn rates(cell: &str, samples: &[Sample]) -> Result<Vec<Rate>, BenchError> {
    if samples.len() < 2 {
        return Err(BenchError::TooFewSamples {
            cell: cell.to_string(),
            samples: samples.len(),
        });
    }
    for (index, s) in samples.iter().enumerate() {
        if !s.t_s.is_finite() || !s.cpu_seconds.is_finite() {
            return Err(BenchError::BadSample {
                cell: cell.to_string(),
                index,
                detail: format!(
                    "time {} or cpu_seconds {} is not a finite number",
                    s.t_s, s.cpu_seconds
                ),
            });
        }
    }
    let mut out = Vec::with_capacity(samples.len() - 1);
    for (i, pair) in samples.windows(2).enumerate() {
        let (a, b) = (&pair[0], &pair[1]);
        let dt = b.t_s - a.t_s;
        if dt <= 0.0 {
            return Err(BenchError::BadSample {
                cell: cell.to_string(),
                index: i + 1,
                detail: format!(
                    "time {}s does not come after the previous sample's {}s",
                    b.t_s, a.t_s
                ),
            });
        }
        let d = |counter: &'static str, before: u64, after: u64| -> Result<f64, BenchError> {
            match after.checked_sub(before) {
                Some(delta) => Ok(delta as f64 / dt),
                None => Err(BenchError::CounterReset {
                    cell: cell.to_string(),
                    counter,
                    t_s: b.t_s,
                    before: before as f64,
                    after: after as f64,
                }),
            }
        };
        let cpu_delta = b.cpu_seconds - a.cpu_seconds;
        if cpu_delta < 0.0 {
            return Err(BenchError::CounterReset {
                cell: cell.to_string(),
                counter: "cpu_seconds",
                t_s: b.t_s,
                before: a.cpu_seconds,
                after: b.cpu_seconds,
            });
        }
        let rate = Rate {
            t0_s: a.t_s,
            t1_s: b.t_s,
            payload_bytes_per_s: d("payload_bytes", a.payload_bytes, b.payload_bytes)?,
            append_bytes_per_s: d("append_bytes", a.append_bytes, b.append_bytes)?,
            wire_bytes_per_s: d("wire_bytes", a.wire_bytes, b.wire_bytes)?,
            records_per_s: d("records", a.records, b.records)?,
            cpu_cores: cpu_delta / dt,
            udp_rcvbuf_errors_per_s: d(
                "udp_rcvbuf_errors",
                a.udp_rcvbuf_errors,
                b.udp_rcvbuf_errors,
            )?,
            publishes_shed_per_s: d("publishes_shed", a.publishes_shed, b.publishes_shed)?,
            publishes_refused_per_s: d(
                "publishes_refused",
                a.publishes_refused,
                b.publishes_refused,
            )?,
            fsyncs_per_s: d("fsyncs", a.fsyncs, b.fsyncs)?,
            // A thread that exits takes its switches with it, so this sum may fall: clamp to
            // 0 rather than refuse the cell (the broker's threads live as long as the process).
            ctx_switches_per_s: b.ctx_switches.saturating_sub(a.ctx_switches) as f64 / dt,
        };
        debug_assert!(rate.t1_s > rate.t0_s);
        out.push(rate);
    }
    Ok(out)
}

/// When one load generator was issuing publishes, in seconds since cell start.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub start_s: f64,
    pub end_s: f64,
}

/// The interval whose one-second rates make a cell's number.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SteadyWindow {
    /// The interval in which all generators were running: [max(starts), min(ends)].
    pub all_running: Span,
    /// `all_running` less its first and last [`STEADY_TRIM_FRACTION`].
    pub start_s: f64,
    pub end_s: f64,
}

/// The steady window of a cell from its generators' spans.
pub fn steady_window(cell: &str, spans: &[Span]) -> Result<SteadyWindow, BenchError> {
    if spans.is_empty() {
        return Err(BenchError::BadGenerators {
            cell: cell.to_string(),
            detail: "no generator reported when it ran".to_string(),
        });
    }
    for (i, s) in spans.iter().enumerate() {
        if !s.start_s.is_finite() || !s.end_s.is_finite() || s.end_s < s.start_s {
            return Err(BenchError::BadGenerators {
                cell: cell.to_string(),
                detail: format!(
                    "generator {} ran from {}s to {}s, which is not an interval",
                    i + 1,
                    s.start_s,
                    s.end_s
                ),
            });
        }
    }
    let start_s = spans.iter().map(|s| s.start_s).fold(f64::MIN, f64::max);
    let end_s = spans.iter().map(|s| s.end_s).fold(f64::MAX, f64::min);
    if start_s >= end_s {
        return Err(BenchError::NeverAllRunning {
            cell: cell.to_string(),
            start_s,
            end_s,
        });
    }
    let trim_s = (end_s - start_s) * STEADY_TRIM_FRACTION;
    let window = SteadyWindow {
        all_running: Span { start_s, end_s },
        start_s: start_s + trim_s,
        end_s: end_s - trim_s,
    };
    debug_assert!(window.start_s < window.end_s);
    Ok(window)
}

/// The rates whose whole interval lies inside the window; at least [`STEADY_POINTS_MIN`].
pub fn select_steady<'a>(
    cell: &str,
    window: &SteadyWindow,
    rates: &'a [Rate],
) -> Result<Vec<&'a Rate>, BenchError> {
    let inside: Vec<&Rate> = rates
        .iter()
        .filter(|r| {
            r.t0_s >= window.start_s - WINDOW_EPSILON_S && r.t1_s <= window.end_s + WINDOW_EPSILON_S
        })
        .collect();
    if inside.len() < STEADY_POINTS_MIN {
        return Err(BenchError::TooFewSteadyPoints {
            cell: cell.to_string(),
            points: inside.len(),
            min: STEADY_POINTS_MIN,
            start_s: window.start_s,
            end_s: window.end_s,
        });
    }
    Ok(inside)
}

/// The median of `values` (mean of the middle two for an even count); `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    })
}

/// A cell's throughput: the median of each steady-window one-second rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub window: SteadyWindow,
    /// How many one-second rates the medians were taken over.
    pub points: usize,
    pub payload_bytes_per_s: f64,
    pub append_bytes_per_s: f64,
    pub wire_bytes_per_s: f64,
    pub records_per_s: f64,
    pub cpu_cores: f64,
    pub udp_rcvbuf_errors_per_s: f64,
    pub fsyncs_per_s: f64,
    /// Broker context switches per second (all threads; 0 when its pid is unknown).
    #[serde(default)]
    pub ctx_switches_per_s: f64,
}

impl Throughput {
    /// Broker context switches per accepted record (0 when nothing was accepted).
    pub fn ctx_switches_per_record(&self) -> f64 {
        if self.records_per_s > 0.0 {
            self.ctx_switches_per_s / self.records_per_s
        } else {
            0.0
        }
    }
}

/// Rates, steady window and medians in one step.
pub fn cell_throughput(
    cell: &str,
    samples: &[Sample],
    spans: &[Span],
) -> Result<Throughput, BenchError> {
    let all = rates(cell, samples)?;
    let window = steady_window(cell, spans)?;
    let steady = select_steady(cell, &window, &all)?;
    let med = |f: fn(&Rate) -> f64| -> f64 {
        let values: Vec<f64> = steady.iter().map(|r| f(r)).collect();
        // select_steady returned at least STEADY_POINTS_MIN (> 0) rates, so the median exists.
        median(&values).unwrap_or(f64::NAN)
    };
    Ok(Throughput {
        window,
        points: steady.len(),
        payload_bytes_per_s: med(|r| r.payload_bytes_per_s),
        append_bytes_per_s: med(|r| r.append_bytes_per_s),
        wire_bytes_per_s: med(|r| r.wire_bytes_per_s),
        records_per_s: med(|r| r.records_per_s),
        cpu_cores: med(|r| r.cpu_cores),
        udp_rcvbuf_errors_per_s: med(|r| r.udp_rcvbuf_errors_per_s),
        fsyncs_per_s: med(|r| r.fsyncs_per_s),
        ctx_switches_per_s: med(|r| r.ctx_switches_per_s),
    })
}

/// Bytes and records, e.g. what the generators sent or what the broker accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Counts {
    pub bytes: u64,
    pub records: u64,
}

/// What the generators sent and the broker did not accept.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Shed {
    pub sent: Counts,
    pub accepted: Counts,
    /// sent - accepted.
    pub shed: Counts,
    /// shed.bytes / sent.bytes.
    pub bytes_fraction: f64,
    /// shed.records / sent.records.
    pub records_fraction: f64,
}

/// Shed = sent - accepted, in bytes and records and as fractions of what was sent.
pub fn shed(cell: &str, sent: Counts, accepted: Counts) -> Result<Shed, BenchError> {
    if sent.bytes == 0 || sent.records == 0 {
        return Err(BenchError::NothingSent {
            cell: cell.to_string(),
        });
    }
    let over = |what: &'static str, s: u64, a: u64| BenchError::AcceptedExceedsSent {
        cell: cell.to_string(),
        what,
        sent: s,
        accepted: a,
    };
    let bytes = sent
        .bytes
        .checked_sub(accepted.bytes)
        .ok_or_else(|| over("bytes", sent.bytes, accepted.bytes))?;
    let records = sent
        .records
        .checked_sub(accepted.records)
        .ok_or_else(|| over("records", sent.records, accepted.records))?;
    Ok(Shed {
        sent,
        accepted,
        shed: Counts { bytes, records },
        bytes_fraction: bytes as f64 / sent.bytes as f64,
        records_fraction: records as f64 / sent.records as f64,
    })
}

/// Little's law: the wait a request must see when `outstanding` is kept in flight against a
/// broker completing `throughput` per second (wait = outstanding / throughput).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LittlesLaw {
    pub outstanding_bytes: f64,
    pub outstanding_records: f64,
    /// outstanding_bytes / payload bytes per second.
    pub wait_s_from_bytes: f64,
    /// outstanding_records / records per second.
    pub wait_s_from_records: f64,
}

/// The predicted wait in bytes terms and in records terms.
pub fn littles_law(
    cell: &str,
    outstanding: Counts,
    payload_bytes_per_s: f64,
    records_per_s: f64,
) -> Result<LittlesLaw, BenchError> {
    if payload_bytes_per_s.is_nan()
        || records_per_s.is_nan()
        || payload_bytes_per_s <= 0.0
        || records_per_s <= 0.0
    {
        return Err(BenchError::NoThroughput {
            cell: cell.to_string(),
        });
    }
    let outstanding_bytes = outstanding.bytes as f64;
    let outstanding_records = outstanding.records as f64;
    Ok(LittlesLaw {
        outstanding_bytes,
        outstanding_records,
        wait_s_from_bytes: outstanding_bytes / payload_bytes_per_s,
        wait_s_from_records: outstanding_records / records_per_s,
    })
}

/// Median, minimum and maximum of one figure over a cell's finished trials.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrialSpread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub trials: usize,
}

impl TrialSpread {
    /// (max - min) / median: how far the trials disagree; 0 for one trial.
    pub fn relative_range(&self) -> f64 {
        if self.median == 0.0 {
            0.0
        } else {
            (self.max - self.min) / self.median.abs()
        }
    }
}

/// Aggregates trials; `None` when no trial finished.
pub fn aggregate_trials(values: &[f64]) -> Option<TrialSpread> {
    let median = median(values)?;
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    debug_assert!(min <= median && median <= max);
    Some(TrialSpread {
        median,
        min,
        max,
        trials: values.len(),
    })
}

/// The unit a latency histogram was recorded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyUnit {
    Nanos,
    Micros,
}

impl LatencyUnit {
    fn to_us(self, v: u64) -> f64 {
        match self {
            LatencyUnit::Nanos => v as f64 / 1e3,
            LatencyUnit::Micros => v as f64,
        }
    }
}

/// Percentiles of a latency histogram, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl LatencySummary {
    /// Summarizes a histogram recorded in `unit`; `None` when it holds no value.
    pub fn from_histogram(hist: &Histogram<u64>, unit: LatencyUnit) -> Option<Self> {
        if hist.is_empty() {
            return None;
        }
        Some(LatencySummary {
            count: hist.len(),
            p50_us: unit.to_us(hist.value_at_quantile(0.50)),
            p99_us: unit.to_us(hist.value_at_quantile(0.99)),
            p999_us: unit.to_us(hist.value_at_quantile(0.999)),
            max_us: unit.to_us(hist.max()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples at t = 0, 1, ..., n-1 s with constant per-second increments.
    fn steady_series(n: usize, payload_per_s: u64, records_per_s: u64) -> Vec<Sample> {
        (0..n)
            .map(|i| Sample {
                t_s: i as f64,
                payload_bytes: payload_per_s * i as u64,
                append_bytes: (payload_per_s + 28 * records_per_s) * i as u64,
                wire_bytes: payload_per_s * 102 / 100 * i as u64,
                records: records_per_s * i as u64,
                cpu_seconds: 1.5 * i as f64,
                ..Sample::default()
            })
            .collect()
    }

    #[test]
    fn rates_are_deltas_over_time() {
        // Proves per-interval rates divide each counter's delta by the real (non-1 s) gap.
        let samples = vec![
            Sample {
                t_s: 0.0,
                payload_bytes: 100,
                cpu_seconds: 1.0,
                ..Sample::default()
            },
            Sample {
                t_s: 2.0,
                payload_bytes: 700,
                records: 6,
                cpu_seconds: 4.0,
                ..Sample::default()
            },
        ];
        let r = rates("c", &samples).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].payload_bytes_per_s, 300.0);
        assert_eq!(r[0].records_per_s, 3.0);
        assert_eq!(r[0].cpu_cores, 1.5);
        assert_eq!((r[0].t0_s, r[0].t1_s), (0.0, 2.0));
    }

    #[test]
    fn counter_reset_refuses_the_cell() {
        // Proves a counter going backwards is an error naming the cell and counter, not a negative rate.
        let mut samples = steady_series(5, 1000, 10);
        samples[3].records = 0;
        let err = rates("cell 2 (durable 4096B b64)", &samples).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(
            err,
            BenchError::CounterReset {
                counter: "records",
                ..
            }
        ));
        assert!(msg.contains("cell 2 (durable 4096B b64)"), "{msg}");
        assert!(msg.contains("`records`"), "{msg}");
        let mut cpu = steady_series(5, 1000, 10);
        cpu[2].cpu_seconds = 0.5;
        assert!(matches!(
            rates("c", &cpu),
            Err(BenchError::CounterReset {
                counter: "cpu_seconds",
                ..
            })
        ));
    }

    #[test]
    fn non_increasing_time_is_refused() {
        // Proves a repeated or backwards sample time is an error rather than a division by zero.
        let mut samples = steady_series(4, 1000, 10);
        samples[2].t_s = 1.0;
        assert!(matches!(
            rates("c", &samples),
            Err(BenchError::BadSample { index: 2, .. })
        ));
        assert!(matches!(
            rates("c", &samples[..1]),
            Err(BenchError::TooFewSamples { samples: 1, .. })
        ));
    }

    #[test]
    fn steady_window_is_the_all_running_interval_less_ten_percent() {
        // Proves the window is [max(starts), min(ends)] trimmed by 10% of its length at each end.
        let spans = [
            Span {
                start_s: 0.5,
                end_s: 92.0,
            },
            Span {
                start_s: 2.0,
                end_s: 95.0,
            },
            Span {
                start_s: 1.0,
                end_s: 90.0,
            },
        ];
        let w = steady_window("c", &spans).unwrap();
        assert_eq!(
            w.all_running,
            Span {
                start_s: 2.0,
                end_s: 90.0
            }
        );
        assert!((w.start_s - 10.8).abs() < 1e-9, "{}", w.start_s);
        assert!((w.end_s - 81.2).abs() < 1e-9, "{}", w.end_s);
    }

    #[test]
    fn steady_selection_keeps_only_rates_fully_inside() {
        // Proves staggered generators shrink the window and only fully-contained seconds count.
        // Generators run [2, 22] and [4, 24]: all running [4, 22], 10% of 18 s = 1.8 s, window
        // [5.8, 20.2]. Rates over [6,7] .. [19,20] are inside: 14 of them. Outside values are huge
        // so a leak would move the median.
        let mut samples = Vec::new();
        let mut payload = 0u64;
        for t in 0..=26u64 {
            samples.push(Sample {
                t_s: t as f64,
                payload_bytes: payload,
                records: payload / 100,
                ..Sample::default()
            });
            // The second ending at t+1 carries 1000 B/s inside [6, 20] and 10^6 B/s elsewhere.
            payload += if (6..20).contains(&t) {
                1000
            } else {
                1_000_000
            };
        }
        let spans = [
            Span {
                start_s: 2.0,
                end_s: 22.0,
            },
            Span {
                start_s: 4.0,
                end_s: 24.0,
            },
        ];
        let w = steady_window("c", &spans).unwrap();
        let all = rates("c", &samples).unwrap();
        let inside = select_steady("c", &w, &all).unwrap();
        assert_eq!(inside.len(), 14);
        assert_eq!(inside.first().unwrap().t0_s, 6.0);
        assert_eq!(inside.last().unwrap().t1_s, 20.0);
        let t = cell_throughput("c", &samples, &spans).unwrap();
        assert_eq!(t.payload_bytes_per_s, 1000.0);
        assert_eq!(t.points, 14);
    }

    #[test]
    fn boundary_rates_touching_the_window_count_as_inside() {
        // Proves a rate whose interval ends exactly on the window edge is kept.
        // Span [0, 10]: window [1, 9]; rates [1,2] .. [8,9] are inside: 8.
        let samples = steady_series(11, 500, 5);
        let spans = [Span {
            start_s: 0.0,
            end_s: 10.0,
        }];
        let t = cell_throughput("c", &samples, &spans).unwrap();
        assert_eq!(t.points, 8);
        assert_eq!(t.payload_bytes_per_s, 500.0);
        assert_eq!(t.append_bytes_per_s, 500.0 + 28.0 * 5.0);
        assert_eq!(t.cpu_cores, 1.5);
    }

    #[test]
    fn too_few_steady_points_names_the_cell() {
        // Proves a window holding fewer than 3 one-second rates is an error naming the cell.
        // Span [0, 4]: window [0.4, 3.6] holds only [1,2] and [2,3].
        let samples = steady_series(6, 500, 5);
        let spans = [Span {
            start_s: 0.0,
            end_s: 4.0,
        }];
        let err = cell_throughput("cell 7 (in-memory 256B b1)", &samples, &spans).unwrap_err();
        assert!(matches!(
            err,
            BenchError::TooFewSteadyPoints { points: 2, .. }
        ));
        assert!(err.to_string().contains("cell 7 (in-memory 256B b1)"));
    }

    #[test]
    fn generators_that_never_overlap_are_refused() {
        // Proves disjoint generator spans give a clear error, not an inverted window.
        let spans = [
            Span {
                start_s: 0.0,
                end_s: 5.0,
            },
            Span {
                start_s: 6.0,
                end_s: 10.0,
            },
        ];
        assert!(matches!(
            steady_window("c", &spans),
            Err(BenchError::NeverAllRunning { .. })
        ));
        assert!(matches!(
            steady_window("c", &[]),
            Err(BenchError::BadGenerators { .. })
        ));
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        // Proves the median picks the middle value (odd) or the mean of the middle two (even), unsorted input.
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn trial_aggregation_gives_median_min_max_count() {
        // Proves trials aggregate to their median with the min-max range and the trial count.
        let a = aggregate_trials(&[4400.0, 4380.0, 4420.0]).unwrap();
        assert_eq!(
            a,
            TrialSpread {
                median: 4400.0,
                min: 4380.0,
                max: 4420.0,
                trials: 3
            }
        );
        assert!((a.relative_range() - 40.0 / 4400.0).abs() < 1e-12);
        let two = aggregate_trials(&[10.0, 20.0]).unwrap();
        assert_eq!((two.median, two.trials), (15.0, 2));
        assert_eq!(aggregate_trials(&[]), None);
    }

    #[test]
    fn shed_is_sent_minus_accepted() {
        // Proves shed bytes/records and fractions, and refusal when the broker accepted more than was sent.
        let s = shed(
            "c",
            Counts {
                bytes: 1000,
                records: 10,
            },
            Counts {
                bytes: 980,
                records: 9,
            },
        )
        .unwrap();
        assert_eq!(
            s.shed,
            Counts {
                bytes: 20,
                records: 1
            }
        );
        assert!((s.bytes_fraction - 0.02).abs() < 1e-12);
        assert!((s.records_fraction - 0.1).abs() < 1e-12);
        let none = shed(
            "c",
            Counts {
                bytes: 5,
                records: 1,
            },
            Counts {
                bytes: 5,
                records: 1,
            },
        )
        .unwrap();
        assert_eq!(none.bytes_fraction, 0.0);
        let over = shed(
            "c",
            Counts {
                bytes: 5,
                records: 1,
            },
            Counts {
                bytes: 6,
                records: 1,
            },
        );
        assert!(matches!(
            over,
            Err(BenchError::AcceptedExceedsSent { what: "bytes", .. })
        ));
        assert!(matches!(
            shed("c", Counts::default(), Counts::default()),
            Err(BenchError::NothingSent { .. })
        ));
    }

    #[test]
    fn littles_law_matches_the_reference_example() {
        // Proves wait = outstanding / throughput on the reference's cell: 64x64x64x4096 B at 4.40 GB/s -> 244 ms.
        let records = 64u64 * 64 * 64;
        let outstanding = Counts {
            bytes: records * 4096,
            records,
        };
        let l = littles_law("c", outstanding, 4.40e9, 4.40e9 / 4096.0).unwrap();
        assert!(
            (l.wait_s_from_bytes - 0.244).abs() < 0.0005,
            "{}",
            l.wait_s_from_bytes
        );
        assert!((l.wait_s_from_records - l.wait_s_from_bytes).abs() < 1e-12);
        assert!(matches!(
            littles_law("c", outstanding, 0.0, 1.0),
            Err(BenchError::NoThroughput { .. })
        ));
    }

    #[test]
    fn latency_summary_in_either_unit() {
        // Proves p50/p99/p999/count from a histogram, converting ns to us and passing us through.
        let mut ns = Histogram::<u64>::new(3).unwrap();
        for v in 1..=1000u64 {
            ns.record(v * 1000).unwrap();
        }
        let s = LatencySummary::from_histogram(&ns, LatencyUnit::Nanos).unwrap();
        assert_eq!(s.count, 1000);
        assert!((s.p50_us - 500.0).abs() <= 1.0, "{}", s.p50_us);
        assert!((s.p99_us - 990.0).abs() <= 1.0, "{}", s.p99_us);
        assert!((s.p999_us - 999.0).abs() <= 1.0, "{}", s.p999_us);
        let mut us = Histogram::<u64>::new(3).unwrap();
        us.record(250).unwrap();
        let s = LatencySummary::from_histogram(&us, LatencyUnit::Micros).unwrap();
        assert_eq!((s.count, s.p50_us), (1, 250.0));
        let empty = Histogram::<u64>::new(3).unwrap();
        assert_eq!(
            LatencySummary::from_histogram(&empty, LatencyUnit::Nanos),
            None
        );
    }
}
