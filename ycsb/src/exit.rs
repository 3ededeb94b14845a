//! How `rdkv-ycsb` ends, for scripts: the exit codes (also printed by `--help` and listed in
//! `docs/operations.md`), and [`OperationsFailed`], the error that means "the phase ran, but some
//! operations returned ERROR".

use crate::measurement::Report;

/// The exit-code table, as `--help` prints it.
pub const HELP: &str = "\
Exit codes:
  0  done: every operation returned OK or NOT_FOUND, or --allow-errors was given
  1  done, but operations returned ERROR (the report is printed, and a one-line summary on
     stderr); for `compare`, also a load with errors, which stops the comparison
  2  nothing measured: bad arguments, an unreadable workload or cluster file, a store that
     cannot be reached or started, a refused workload (E), or a file that cannot be written";

/// `text` on one line: its lines trimmed and joined with spaces (some causes, such as TOML parse
/// errors, span several lines).
pub fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// An exit code of `rdkv-ycsb`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// 0: every operation returned OK or NOT_FOUND (or errors were allowed).
    Success,
    /// 1: some operations returned ERROR.
    OperationsFailed,
    /// 2: usage, configuration or connection error; nothing was measured.
    Error,
}

impl ExitStatus {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Self::Success => 0,
            Self::OperationsFailed => 1,
            Self::Error => 2,
        }
    }

    /// The status of a command that ran its phases: [`Self::OperationsFailed`] when any
    /// operation failed and errors are not allowed.
    pub fn after_operations(failed: Option<&OperationsFailed>, allow_errors: bool) -> Self {
        match failed {
            Some(_) if !allow_errors => Self::OperationsFailed,
            _ => Self::Success,
        }
    }

    /// The status of a command that stopped with `error`: [`Self::OperationsFailed`] when the
    /// cause is failed operations, [`Self::Error`] otherwise.
    pub fn after_error(error: &anyhow::Error) -> Self {
        if error.downcast_ref::<OperationsFailed>().is_some() {
            Self::OperationsFailed
        } else {
            Self::Error
        }
    }
}

impl From<ExitStatus> for std::process::ExitCode {
    fn from(status: ExitStatus) -> Self {
        Self::from(status.code())
    }
}

/// Some operations of one or more phases returned ERROR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what}: {errors} of {operations} operations failed (Return=ERROR){}",
    first_error.as_ref().map(|error| format!("; the first: {error}")).unwrap_or_default()
)]
pub struct OperationsFailed {
    /// What ran: `run`, `load`, `rdkv load`, `compare`.
    pub what: String,
    /// Operations that returned ERROR.
    pub errors: u64,
    /// Operations in all.
    pub operations: u64,
    /// The first failure's message, to say why without reading the log.
    pub first_error: Option<String>,
}

impl OperationsFailed {
    /// The failures of `reports` together, or `None` when every operation succeeded.
    pub fn from_reports(what: &str, reports: &[&Report]) -> Option<Self> {
        let errors = reports.iter().map(|report| report.errors()).sum::<u64>();
        (errors > 0).then(|| Self {
            what: what.to_string(),
            errors,
            operations: reports.iter().map(|report| report.operations).sum(),
            first_error: reports.iter().find_map(|report| report.first_error.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measurement::{Measurements, OperationKind, Outcome};

    fn report(outcomes: &[Outcome], first_error: Option<&str>) -> Report {
        let mut measurements = Measurements::default();
        for outcome in outcomes {
            measurements.record(OperationKind::Read, 10, *outcome);
        }
        Report {
            phase: "run".into(),
            workload: "workloadc".into(),
            driver: "rdkv".into(),
            threads: 1,
            runtime_ms: 1,
            throughput: 1.0,
            operations: measurements.operations(),
            kinds: measurements.summaries(),
            rdkv: None,
            timeseries: vec![],
            first_error: first_error.map(str::to_string),
            client_cpu_us_per_operation: None,
            server_cpu_us_per_operation: None,
        }
    }

    #[test]
    fn multi_line_causes_are_joined() {
        assert_eq!(
            one_line("read c.toml: TOML parse error at line 1\n  |\n1 | x\n  | ^\n"),
            "read c.toml: TOML parse error at line 1 | 1 | x | ^"
        );
    }

    #[test]
    fn any_error_fails_unless_allowed() {
        let clean = report(&[Outcome::Ok, Outcome::NotFound], None);
        let failing = report(&[Outcome::Ok, Outcome::Error], Some("node unreachable"));
        assert_eq!(OperationsFailed::from_reports("run", &[&clean]), None);
        let failed = OperationsFailed::from_reports("run", &[&clean, &failing]).expect("failed");
        assert_eq!(
            failed.to_string(),
            "run: 1 of 4 operations failed (Return=ERROR); the first: node unreachable"
        );
        assert_eq!(ExitStatus::after_operations(Some(&failed), false).code(), 1);
        assert_eq!(ExitStatus::after_operations(Some(&failed), true).code(), 0);
        assert_eq!(ExitStatus::after_operations(None, false).code(), 0);
        assert_eq!(
            ExitStatus::after_error(&anyhow::Error::new(failed)),
            ExitStatus::OperationsFailed
        );
        assert_eq!(
            ExitStatus::after_error(&anyhow::anyhow!("no such workload")),
            ExitStatus::Error
        );
    }
}
