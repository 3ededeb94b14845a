//! Latency histograms per operation (HdrHistogram, microseconds), return codes, and YCSB's
//! text output, plus the same figures as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// The operations YCSB measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum OperationKind {
    /// INSERT.
    Insert,
    /// READ.
    Read,
    /// UPDATE.
    Update,
    /// SCAN.
    Scan,
    /// READ-MODIFY-WRITE.
    ReadModifyWrite,
}

impl OperationKind {
    /// YCSB's label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Insert => "INSERT",
            Self::Read => "READ",
            Self::Update => "UPDATE",
            Self::Scan => "SCAN",
            Self::ReadModifyWrite => "READ-MODIFY-WRITE",
        }
    }
}

/// How one operation ended, as YCSB's `Status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// `Return=OK`.
    Ok,
    /// `Return=NOT_FOUND`.
    NotFound,
    /// `Return=ERROR`.
    Error,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Self::Ok => "OK",
            Self::NotFound => "NOT_FOUND",
            Self::Error => "ERROR",
        }
    }
}

/// One operation kind's measurements.
#[derive(Debug, Clone)]
struct KindMeasurements {
    histogram: Histogram<u64>,
    outcomes: BTreeMap<Outcome, u64>,
}

impl KindMeasurements {
    fn new() -> Self {
        Self {
            histogram: Histogram::new_with_bounds(1, 60_000_000, 3)
                .expect("valid histogram bounds"),
            outcomes: BTreeMap::new(),
        }
    }
}

/// Measurements of one task or of a whole phase.
#[derive(Debug, Clone, Default)]
pub struct Measurements {
    kinds: BTreeMap<OperationKind, KindMeasurements>,
}

impl Measurements {
    /// Records one operation.
    pub fn record(&mut self, kind: OperationKind, latency_us: u64, outcome: Outcome) {
        let entry = self.kinds.entry(kind).or_insert_with(KindMeasurements::new);
        entry.histogram.saturating_record(latency_us.max(1));
        *entry.outcomes.entry(outcome).or_insert(0) += 1;
    }

    /// Adds another task's measurements.
    pub fn merge(&mut self, other: &Measurements) {
        for (kind, theirs) in &other.kinds {
            let ours = self
                .kinds
                .entry(*kind)
                .or_insert_with(KindMeasurements::new);
            let _ = ours.histogram.add(&theirs.histogram);
            for (outcome, count) in &theirs.outcomes {
                *ours.outcomes.entry(*outcome).or_insert(0) += count;
            }
        }
    }

    /// Operations recorded.
    pub fn operations(&self) -> u64 {
        self.kinds.values().map(|kind| kind.histogram.len()).sum()
    }

    /// The summary of every kind.
    pub fn summaries(&self) -> Vec<KindSummary> {
        self.kinds
            .iter()
            .map(|(kind, measured)| {
                let histogram = &measured.histogram;
                let mut cdf = Vec::new();
                for step in 1..100 {
                    let quantile = f64::from(step) / 100.0;
                    cdf.push((histogram.value_at_quantile(quantile), quantile));
                }
                for quantile in [0.995, 0.999, 0.9999, 1.0] {
                    cdf.push((histogram.value_at_quantile(quantile), quantile));
                }
                KindSummary {
                    kind: *kind,
                    operations: histogram.len(),
                    average_us: histogram.mean(),
                    min_us: histogram.min(),
                    max_us: histogram.max(),
                    p50_us: histogram.value_at_quantile(0.50),
                    p95_us: histogram.value_at_quantile(0.95),
                    p99_us: histogram.value_at_quantile(0.99),
                    outcomes: measured
                        .outcomes
                        .iter()
                        .map(|(outcome, count)| (outcome.label().to_string(), *count))
                        .collect(),
                    cdf,
                }
            })
            .collect()
    }
}

/// One operation kind's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindSummary {
    /// The kind.
    pub kind: OperationKind,
    /// Operations.
    pub operations: u64,
    /// Mean latency.
    pub average_us: f64,
    /// Minimum latency.
    pub min_us: u64,
    /// Maximum latency.
    pub max_us: u64,
    /// Median latency.
    pub p50_us: u64,
    /// 95th percentile.
    pub p95_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Return codes and their counts.
    pub outcomes: BTreeMap<String, u64>,
    /// (latency µs, quantile) points for CDF plots.
    pub cdf: Vec<(u64, f64)>,
}

/// rdkv's own figures for a phase.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RdkvFigures {
    /// Round trips per operation.
    pub round_trips_per_operation: f64,
    /// Round trips per READ.
    pub round_trips_per_read: f64,
    /// Round trips per operation that it waited for one after another: replicated writes run
    /// some on several nodes at once (the replicas' lookups, the backups' CASes), which
    /// `round_trips_per_operation` counts each.
    #[serde(default)]
    pub round_trips_in_sequence_per_operation: f64,
    /// Work requests per operation.
    pub verbs_per_operation: f64,
    /// Lost slot CAS races.
    pub cas_failures: u64,
    /// Checksum retries.
    pub checksum_retries: u64,
    /// Operations that waited for a scratch buffer (more tasks than the client lets run at
    /// once per connection).
    #[serde(default)]
    pub scratch_waits: u64,
}

/// Everything one load or run phase measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// `load` or `run`.
    pub phase: String,
    /// The workload's name.
    pub workload: String,
    /// The driver.
    pub driver: String,
    /// Tasks issuing operations.
    pub threads: usize,
    /// Wall time of the phase.
    pub runtime_ms: u64,
    /// Operations per second over the phase.
    pub throughput: f64,
    /// Operations.
    pub operations: u64,
    /// Per operation kind.
    pub kinds: Vec<KindSummary>,
    /// rdkv's round trips and verbs.
    pub rdkv: Option<RdkvFigures>,
    /// (seconds since start, operations per second in that second).
    pub timeseries: Vec<(f64, f64)>,
    /// The first failed operation's message, for the one-line summary of a failed phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// CPU time this process (the client) used per operation over the phase, in µs, all
    /// threads, user and system (`/proc/self/stat`, 10 ms resolution).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cpu_us_per_operation: Option<f64>,
    /// CPU time the store's server processes used per operation over the phase, in µs
    /// (`rdkv-ycsb compare`, which starts them, fills it in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cpu_us_per_operation: Option<f64>,
}

impl Report {
    /// YCSB's text format.
    pub fn to_ycsb_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "[OVERALL], RunTime(ms), {}", self.runtime_ms);
        let _ = writeln!(out, "[OVERALL], Throughput(ops/sec), {}", self.throughput);
        for kind in &self.kinds {
            let label = kind.kind.label();
            let _ = writeln!(out, "[{label}], Operations, {}", kind.operations);
            let _ = writeln!(out, "[{label}], AverageLatency(us), {}", kind.average_us);
            let _ = writeln!(out, "[{label}], MinLatency(us), {}", kind.min_us);
            let _ = writeln!(out, "[{label}], MaxLatency(us), {}", kind.max_us);
            let _ = writeln!(out, "[{label}], 95thPercentileLatency(us), {}", kind.p95_us);
            let _ = writeln!(out, "[{label}], 99thPercentileLatency(us), {}", kind.p99_us);
            // YCSB's order: OK first, then the failures.
            for outcome in ["OK", "NOT_FOUND", "ERROR"] {
                if let Some(count) = kind.outcomes.get(outcome) {
                    let _ = writeln!(out, "[{label}], Return={outcome}, {count}");
                }
            }
        }
        if let Some(rdkv) = &self.rdkv {
            let _ = writeln!(
                out,
                "[RDKV], RoundTripsPerOperation, {}",
                rdkv.round_trips_per_operation
            );
            let _ = writeln!(
                out,
                "[RDKV], RoundTripsPerRead, {}",
                rdkv.round_trips_per_read
            );
            let _ = writeln!(
                out,
                "[RDKV], VerbsPerOperation, {}",
                rdkv.verbs_per_operation
            );
            let _ = writeln!(out, "[RDKV], CasRacesLost, {}", rdkv.cas_failures);
            let _ = writeln!(out, "[RDKV], ChecksumRetries, {}", rdkv.checksum_retries);
            let _ = writeln!(out, "[RDKV], ScratchBufferWaits, {}", rdkv.scratch_waits);
        }
        if let Some(cpu) = self.client_cpu_us_per_operation {
            let _ = writeln!(out, "[CPU], ClientMicrosecondsPerOperation, {cpu:.2}");
        }
        if let Some(cpu) = self.server_cpu_us_per_operation {
            let _ = writeln!(out, "[CPU], ServerMicrosecondsPerOperation, {cpu:.2}");
        }
        out
    }

    /// Operations that returned ERROR (neither OK nor NOT_FOUND).
    pub fn errors(&self) -> u64 {
        self.kinds
            .iter()
            .map(|kind| kind.outcomes.get("ERROR").copied().unwrap_or(0))
            .sum()
    }

    /// The kind's summary, if measured.
    pub fn kind(&self, kind: OperationKind) -> Option<&KindSummary> {
        self.kinds.iter().find(|summary| summary.kind == kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ycsb_text_format_line_by_line() {
        let mut measurements = Measurements::default();
        for latency in [10, 20, 30, 40, 1000] {
            measurements.record(OperationKind::Read, latency, Outcome::Ok);
        }
        measurements.record(OperationKind::Read, 50, Outcome::NotFound);
        measurements.record(OperationKind::Update, 100, Outcome::Error);
        let report = Report {
            phase: "run".into(),
            workload: "workloada".into(),
            driver: "rdkv".into(),
            threads: 1,
            runtime_ms: 2000,
            throughput: 3.5,
            operations: measurements.operations(),
            kinds: measurements.summaries(),
            rdkv: Some(RdkvFigures {
                round_trips_per_operation: 2.5,
                round_trips_per_read: 2.0,
                round_trips_in_sequence_per_operation: 2.5,
                verbs_per_operation: 3.0,
                cas_failures: 1,
                checksum_retries: 0,
                scratch_waits: 0,
            }),
            timeseries: vec![],
            first_error: None,
            client_cpu_us_per_operation: None,
            server_cpu_us_per_operation: None,
        };
        assert_eq!(report.errors(), 1);
        let text = report.to_ycsb_text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "[OVERALL], RunTime(ms), 2000",
                "[OVERALL], Throughput(ops/sec), 3.5",
                "[READ], Operations, 6",
                &format!("[READ], AverageLatency(us), {}", report.kinds[0].average_us),
                "[READ], MinLatency(us), 10",
                "[READ], MaxLatency(us), 1000",
                "[READ], 95thPercentileLatency(us), 1000",
                "[READ], 99thPercentileLatency(us), 1000",
                "[READ], Return=OK, 5",
                "[READ], Return=NOT_FOUND, 1",
                "[UPDATE], Operations, 1",
                "[UPDATE], AverageLatency(us), 100",
                "[UPDATE], MinLatency(us), 100",
                "[UPDATE], MaxLatency(us), 100",
                "[UPDATE], 95thPercentileLatency(us), 100",
                "[UPDATE], 99thPercentileLatency(us), 100",
                "[UPDATE], Return=ERROR, 1",
                "[RDKV], RoundTripsPerOperation, 2.5",
                "[RDKV], RoundTripsPerRead, 2",
                "[RDKV], VerbsPerOperation, 3",
                "[RDKV], CasRacesLost, 1",
                "[RDKV], ChecksumRetries, 0",
                "[RDKV], ScratchBufferWaits, 0",
            ]
        );
        let average = report.kinds[0].average_us;
        assert!((average - 1150.0 / 6.0).abs() < 0.5, "{average}");
        let json = serde_json::to_string(&report).expect("serialise");
        let back: Report = serde_json::from_str(&json).expect("deserialise");
        assert_eq!(back.operations, report.operations);
        assert_eq!(back.kinds[0].outcomes, report.kinds[0].outcomes);
        assert_eq!(back.kinds[0].cdf, report.kinds[0].cdf);
        assert!((back.kinds[0].average_us - report.kinds[0].average_us).abs() < 1e-9);
    }
}
