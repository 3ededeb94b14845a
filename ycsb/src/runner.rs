//! The load and run phases: `threads` async tasks issue operations, bounded in count and in time,
//! optionally throttled to a target rate, with live progress.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
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

/// Inserts `recordcount` records.
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

async fn execute(
    workload: &Workload,
    driver: Arc<Driver>,
    options: RunOptions,
    phase: Phase,
) -> anyhow::Result<Report> {
    let threads = options.threads.max(1);
    let total = match phase {
        Phase::Load => workload.record_count,
        Phase::Run => workload.operation_count,
    };
    let value = record_value(workload);
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Insert key numbers handed out, and inserts completed: reads choose among completed ones
    // (YCSB's acknowledged counter), so "latest" reads do not chase inserts still in flight.
    let inserted = Arc::new((
        AtomicU64::new(workload.record_count),
        AtomicU64::new(workload.record_count),
    ));
    let chooser =
        KeyChooser::from_name(&workload.request_distribution).map_err(anyhow::Error::msg)?;
    let counters_before = driver.rdkv_counters();
    let started = Instant::now();
    let deadline = options.max_execution_time.map(|limit| started + limit);
    let per_task_rate = options.target.map(|target| target / threads as f64);

    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..threads as u64 {
        let driver = driver.clone();
        let workload = workload.clone();
        let value = value.clone();
        let done = done.clone();
        let stop = stop.clone();
        let inserted = inserted.clone();
        let chooser = chooser.clone();
        tasks.spawn(async move {
            let mut random = rand::rngs::StdRng::seed_from_u64(0x7964_7362 ^ task);
            let mut measurements = Measurements::default();
            let mine = total / threads as u64 + u64::from(task < total % threads as u64);
            for sequence in 0..mine {
                if stop.load(Ordering::Relaxed)
                    || deadline.is_some_and(|deadline| Instant::now() >= deadline)
                {
                    break;
                }
                if let Some(rate) = per_task_rate {
                    let due = started + Duration::from_secs_f64(sequence as f64 / rate);
                    tokio::time::sleep_until(due.into()).await;
                }
                let (kind, outcome, latency) = match phase {
                    Phase::Load => {
                        let key = workload.key(task + sequence * threads as u64);
                        let begun = Instant::now();
                        let outcome = driver.insert(&key, &value).await;
                        (
                            OperationKind::Insert,
                            status(outcome.map(|()| true)),
                            begun.elapsed(),
                        )
                    }
                    Phase::Run => {
                        one_operation(&driver, &workload, &chooser, &inserted, &value, &mut random)
                            .await
                    }
                };
                measurements.record(kind, latency.as_micros() as u64, outcome);
                done.fetch_add(1, Ordering::Relaxed);
            }
            measurements
        });
    }

    let progress = Progress::start(total, options.progress);
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
                let now = done.load(Ordering::Relaxed);
                let elapsed = started.elapsed().as_secs_f64();
                timeseries.push((elapsed, (now - last) as f64 / (elapsed - last_time).max(1e-3)));
                progress.update(now, now - last, elapsed);
                last = now;
                last_time = elapsed;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    progress.finish();
    let runtime = started.elapsed();
    // The last, partial second.
    let final_count = done.load(Ordering::Relaxed);
    if runtime.as_secs_f64() - last_time > 0.05 {
        timeseries.push((
            runtime.as_secs_f64(),
            (final_count - last) as f64 / (runtime.as_secs_f64() - last_time),
        ));
    }
    let operations = merged.operations();
    Ok(Report {
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
        kinds: merged.summaries(),
        rdkv: Driver::rdkv_figures(counters_before, driver.rdkv_counters()),
        timeseries,
    })
}

fn status(outcome: Result<bool, String>) -> Outcome {
    match outcome {
        Ok(true) => Outcome::Ok,
        Ok(false) => Outcome::NotFound,
        Err(error) => {
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
) -> (OperationKind, Outcome, Duration) {
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
    (kind, status(outcome), begun.elapsed())
}

/// Live progress: a bar with ops/s on a terminal, a status line every 10 s otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    enabled: bool,
}

impl Progress {
    fn start(total: u64, enabled: bool) -> Self {
        if !enabled || !std::io::stderr().is_terminal() {
            return Self { bar: None, enabled };
        }
        let bar = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} ops {msg}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        Self {
            bar: Some(bar),
            enabled,
        }
    }

    fn update(&self, done: u64, last_second: u64, elapsed: f64) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(done);
                bar.set_message(format!("{last_second} ops/s"));
            }
            None if !self.enabled => {}
            None => {
                let seconds = elapsed.round() as u64;
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
