//! The load and run phases: `threads` async tasks issue operations, bounded in count and in time,
//! optionally throttled to a target rate, with live progress.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use crate::driver::Driver;
use crate::generator::KeyChooser;
use crate::measurement::{Measurements, OperationKind, Outcome, Report};
use crate::properties::Workload;

/// Knobs of one phase.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// Async tasks issuing operations.
    pub threads: usize,
    /// Operations per second across all tasks, if throttled.
    pub target: Option<f64>,
    /// Stop after this long even if operations remain.
    pub max_execution_time: Option<Duration>,
    /// Show progress (a bar on a terminal, status lines otherwise).
    pub progress: bool,
}

/// The value every driver stores for every record: `fieldcount × fieldlength` bytes from a fixed
/// seed, identical across drivers.
pub fn record_value(workload: &Workload) -> Arc<Vec<u8>> {
    let mut random = rand::rngs::StdRng::seed_from_u64(0x5943_5342);
    Arc::new(
        (0..workload.record_size())
            .map(|_| random.gen_range(b'a'..=b'z'))
            .collect(),
    )
}

/// What each task does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Load,
    Run,
}

/// Inserts the records `insertstart` .. `insertstart + insertcount` (by default all
/// `recordcount` of them).
///
/// # Errors
/// Workload E's scans, which no driver supports.
pub async fn load(
    workload: &Workload,
    driver: Arc<Driver>,
    options: RunOptions,
) -> anyhow::Result<Report> {
    execute(workload, driver, options, Phase::Load).await
}

/// Runs `operationcount` operations of the workload's mix.
///
/// # Errors
/// A workload with scans: refused with the driver's reason, not faked.
pub async fn run(
    workload: &Workload,
    driver: Arc<Driver>,
    options: RunOptions,
) -> anyhow::Result<Report> {
    if workload.proportions.scan > 0.0 {
        if let Some(reason) = driver.scan_refusal() {
            anyhow::bail!("{reason}");
        }
    }
    execute(workload, driver, options, Phase::Run).await
}

/// What every task of a phase shares.
struct PhaseState {
    /// The workload (its keys, its mix).
    workload: Workload,
    /// The store the operations go to.
    driver: Arc<Driver>,
    /// Loading records or running the mix.
    phase: Phase,
    /// Tasks issuing operations.
    threads: usize,
    /// Operations the phase issues across its tasks, unless its time limit comes first.
    total: u64,
    /// What every insert and update writes.
    value: Arc<Vec<u8>>,
    /// Operations completed, for the progress and the time series.
    done: AtomicU64,
    /// Set when the phase has ended.
    stop: AtomicBool,
    /// Insert key numbers handed out, and inserts completed: reads choose among completed ones
    /// (YCSB's acknowledged counter), so "latest" reads do not chase inserts still in flight.
    inserted: (AtomicU64, AtomicU64),
    /// Picks the keys of reads and updates.
    chooser: KeyChooser,
    /// The phase's first failure.
    first_error: OnceLock<String>,
    /// When the phase began.
    started: Instant,
    /// When the phase must stop, if it has a time limit.
    deadline: Option<Instant>,
    /// Operations per second for each task, if throttled.
    per_task_rate: Option<f64>,
}

/// What the progress loop gathered while the tasks ran.
struct Gathered {
    /// Every task's measurements, merged.
    merged: Measurements,
    /// (seconds since the start, operations per second over the last interval).
    timeseries: Vec<(f64, f64)>,
    /// How long the phase took.
    runtime: Duration,
}

/// Runs a phase: `threads` tasks share its operations, and the progress loop gathers what
/// they measured into the phase's report.
async fn execute(
    workload: &Workload,
    driver: Arc<Driver>,
    options: RunOptions,
    phase: Phase,
) -> anyhow::Result<Report> {
    let threads = options.threads.max(1);
    let total = match phase {
        Phase::Load => workload.insert_count,
        Phase::Run => workload.operation_count,
    };
    let value = record_value(workload);
    let chooser =
        KeyChooser::from_name(&workload.request_distribution).map_err(anyhow::Error::msg)?;
    let counters_before = driver.rdkv_counters();
    let cpu_before = rdkv_common::process::cpu_time(None);
    let started = Instant::now();
    let state = Arc::new(PhaseState {
        workload: workload.clone(),
        driver: driver.clone(),
        phase,
        threads,
        total,
        value,
        done: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        inserted: (
            AtomicU64::new(workload.record_count),
            AtomicU64::new(workload.record_count),
        ),
        chooser,
        first_error: OnceLock::new(),
        started,
        deadline: options.max_execution_time.map(|limit| started + limit),
        per_task_rate: options.target.map(|target| target / threads as f64),
    });
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..threads as u64 {
        tasks.spawn(run_task(state.clone(), task));
    }
    let gathered = gather(&state, tasks, options).await?;
    let operations = gathered.merged.operations();
    let client_cpu_us_per_operation = cpu_before
        .zip(rdkv_common::process::cpu_time(None))
        .filter(|_| operations > 0)
        .map(|(before, after)| (after - before).as_secs_f64() * 1e6 / operations as f64);
    let runtime = gathered.runtime;
    Ok(Report {
        client_cpu_us_per_operation,
        server_cpu_us_per_operation: None,
        phase: match phase {
            Phase::Load => "load".into(),
            Phase::Run => "run".into(),
        },
        workload: workload.name.clone(),
        driver: driver.name().into(),
        threads,
        runtime_ms: runtime.as_millis() as u64,
        throughput: operations as f64 / runtime.as_secs_f64().max(1e-9),
        operations,
        kinds: gathered.merged.summaries(),
        rdkv: Driver::rdkv_figures(counters_before, driver.rdkv_counters()),
        timeseries: gathered.timeseries,
        first_error: state.first_error.get().cloned(),
    })
}

/// One task's share of the phase: its operations, until the phase stops or its time is up.
async fn run_task(state: Arc<PhaseState>, task: u64) -> Measurements {
    let threads = state.threads as u64;
    let mut random = rand::rngs::StdRng::seed_from_u64(0x7964_7362 ^ task);
    let mut measurements = Measurements::default();
    let mine = state.total / threads + u64::from(task < state.total % threads);
    for sequence in 0..mine {
        if state.stop.load(Ordering::Relaxed)
            || state
                .deadline
                .is_some_and(|deadline| Instant::now() >= deadline)
        {
            break;
        }
        if let Some(rate) = state.per_task_rate {
            let due = state.started + Duration::from_secs_f64(sequence as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let workload = &state.workload;
        let (kind, outcome, latency) = match state.phase {
            Phase::Load => {
                let key = workload.key(workload.insert_start + task + sequence * threads);
                let begun = Instant::now();
                let outcome = state.driver.insert(&key, &state.value).await;
                (
                    OperationKind::Insert,
                    outcome.map(|()| true),
                    begun.elapsed(),
                )
            }
            Phase::Run => {
                one_operation(
                    &state.driver,
                    workload,
                    &state.chooser,
                    &state.inserted,
                    &state.value,
                    &mut random,
                )
                .await
            }
        };
        let outcome = status(outcome, &state.first_error);
        measurements.record(kind, latency.as_micros() as u64, outcome);
        state.done.fetch_add(1, Ordering::Relaxed);
    }
    measurements
}

/// Waits for the tasks, sampling the operations done every second for the progress display
/// and the time series (and the last, partial second at the end).
async fn gather(
    state: &PhaseState,
    mut tasks: tokio::task::JoinSet<Measurements>,
    options: RunOptions,
) -> anyhow::Result<Gathered> {
    let progress = Progress::start(state.total, options.max_execution_time, options.progress);
    let mut timeseries = Vec::new();
    let mut ticks = tokio::time::interval(Duration::from_secs(1));
    ticks.tick().await;
    let mut last = 0u64;
    let mut last_time = 0.0f64;
    let mut merged = Measurements::default();
    loop {
        tokio::select! {
            joined = tasks.join_next() => match joined {
                Some(result) => merged.merge(&result?),
                None => break,
            },
            _ = ticks.tick() => {
                let now = state.done.load(Ordering::Relaxed);
                let since_start = state.started.elapsed();
                let elapsed = since_start.as_secs_f64();
                timeseries.push((elapsed, (now - last) as f64 / (elapsed - last_time).max(1e-3)));
                progress.update(now, now - last, since_start);
                last = now;
                last_time = elapsed;
            }
        }
    }
    state.stop.store(true, Ordering::Relaxed);
    progress.finish();
    let runtime = state.started.elapsed();
    // The last, partial second.
    let final_count = state.done.load(Ordering::Relaxed);
    if runtime.as_secs_f64() - last_time > 0.05 {
        timeseries.push((
            runtime.as_secs_f64(),
            (final_count - last) as f64 / (runtime.as_secs_f64() - last_time),
        ));
    }
    Ok(Gathered {
        merged,
        timeseries,
        runtime,
    })
}

/// The outcome of one operation; the first failure of a phase is kept in `first_error`.
fn status(outcome: Result<bool, String>, first_error: &OnceLock<String>) -> Outcome {
    match outcome {
        Ok(true) => Outcome::Ok,
        Ok(false) => Outcome::NotFound,
        Err(error) => {
            if first_error.get().is_none() {
                let _ = first_error.set(error.clone());
            }
            // The first few failures of a run are shown; the rest are counted (Return=ERROR).
            static SHOWN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            if SHOWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 5 {
                tracing::warn!(%error, "operation failed (the first 5 failures are shown)");
            } else {
                tracing::debug!(%error, "operation failed");
            }
            Outcome::Error
        }
    }
}

async fn one_operation(
    driver: &Driver,
    workload: &Workload,
    chooser: &KeyChooser,
    inserted: &(AtomicU64, AtomicU64),
    value: &[u8],
    random: &mut rand::rngs::StdRng,
) -> (OperationKind, Result<bool, String>, Duration) {
    let mix = workload.proportions;
    let total = mix.read + mix.update + mix.insert + mix.scan + mix.read_modify_write;
    let pick = random.gen::<f64>() * total;
    let (next_insert, acknowledged) = inserted;
    let records = acknowledged.load(Ordering::Relaxed);
    let existing_key =
        |random: &mut rand::rngs::StdRng| workload.key(chooser.next(records, random));
    let kind = if pick < mix.read {
        OperationKind::Read
    } else if pick < mix.read + mix.update {
        OperationKind::Update
    } else if pick < mix.read + mix.update + mix.insert {
        OperationKind::Insert
    } else {
        OperationKind::ReadModifyWrite
    };
    let key = match kind {
        OperationKind::Insert => workload.key(next_insert.fetch_add(1, Ordering::Relaxed)),
        _ => existing_key(random),
    };
    let begun = Instant::now();
    let outcome = match kind {
        OperationKind::Read => driver.read(&key).await,
        OperationKind::Update => driver.update(&key, value).await.map(|()| true),
        OperationKind::Insert => {
            let outcome = driver.insert(&key, value).await.map(|()| true);
            acknowledged.fetch_add(1, Ordering::Relaxed);
            outcome
        }
        _ => driver.read_modify_write(&key, value).await,
    };
    (kind, outcome, begun.elapsed())
}

/// Bar positions of a time-limited phase: the bar shows tenths of a percent.
const PROGRESS_STEPS: u64 = 1000;

/// How far a phase is, from 0 to 1: done / total operations, or elapsed / limit when a time limit
/// is set, whichever is further along (the phase ends at the first limit reached).
fn completed_fraction(done: u64, total: u64, elapsed: Duration, limit: Option<Duration>) -> f64 {
    let by_operations = if total == 0 {
        1.0
    } else {
        done as f64 / total as f64
    };
    let by_time = limit.map_or(0.0, |limit| {
        if limit.is_zero() {
            1.0
        } else {
            elapsed.as_secs_f64() / limit.as_secs_f64()
        }
    });
    by_operations.max(by_time).clamp(0.0, 1.0)
}

/// Live progress: a bar with ops/s on a terminal, a status line every 10 s otherwise. Without a
/// time limit the bar counts operations; with one it follows [`completed_fraction`] and shows the
/// operations done in its message.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    enabled: bool,
    /// Operations the phase would issue without a time limit.
    total: u64,
    /// The phase's time limit, if any.
    limit: Option<Duration>,
}

impl Progress {
    fn start(total: u64, limit: Option<Duration>, enabled: bool) -> Self {
        if !enabled || !std::io::stderr().is_terminal() {
            return Self {
                bar: None,
                enabled,
                total,
                limit,
            };
        }
        let (length, template) = match limit {
            None => (total, "{elapsed_precise} [{bar:40}] {pos}/{len} ops {msg}"),
            Some(_) => (
                PROGRESS_STEPS,
                "{elapsed_precise} [{bar:40}] {percent:>3}% {msg}",
            ),
        };
        let bar = indicatif::ProgressBar::new(length);
        if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        Self {
            bar: Some(bar),
            enabled,
            total,
            limit,
        }
    }

    fn update(&self, done: u64, last_second: u64, elapsed: Duration) {
        match (&self.bar, self.limit) {
            (Some(bar), None) => {
                bar.set_position(done);
                bar.set_message(format!("{last_second} ops/s"));
            }
            (Some(bar), Some(limit)) => {
                let fraction = completed_fraction(done, self.total, elapsed, Some(limit));
                bar.set_position((fraction * PROGRESS_STEPS as f64) as u64);
                bar.set_message(format!(
                    "{done}/{} ops, {last_second} ops/s, {} s limit",
                    self.total,
                    limit.as_secs_f64()
                ));
            }
            (None, _) if !self.enabled => {}
            (None, _) => {
                let seconds = elapsed.as_secs_f64().round() as u64;
                if seconds > 0 && seconds % 10 == 0 {
                    eprintln!("{seconds} sec: {done} operations; {last_second} current ops/sec");
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_follows_time_when_limited_and_the_further_limit_when_both() {
        let seconds = Duration::from_secs;
        // No time limit: operations.
        assert_eq!(completed_fraction(250, 1000, seconds(50), None), 0.25);
        // The time limit of a run asking for far more operations than it will do: time.
        let fraction = completed_fraction(347_743, 100_000_000, seconds(15), Some(seconds(60)));
        assert_eq!(fraction, 0.25);
        // Both: whichever is further along.
        assert_eq!(
            completed_fraction(900, 1000, seconds(6), Some(seconds(60))),
            0.9
        );
        assert_eq!(
            completed_fraction(100, 1000, seconds(30), Some(seconds(60))),
            0.5
        );
        // Never past the end, and nothing to do is done.
        assert_eq!(
            completed_fraction(10, 1000, seconds(90), Some(seconds(60))),
            1.0
        );
        assert_eq!(completed_fraction(0, 0, seconds(0), None), 1.0);
        assert_eq!(
            completed_fraction(0, 1000, seconds(0), Some(Duration::ZERO)),
            1.0
        );
    }
}
