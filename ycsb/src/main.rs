//! `rdkv-ycsb`: YCSB-style load and run phases against rdkv, Redis, an in-process rdkv or an
//! in-process map, plots, and a side-by-side comparison with Redis.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use rdkv_ycsb::compare::{self, CompareOptions};
use rdkv_ycsb::driver::Driver;
use rdkv_ycsb::exit::{self, ExitStatus, OperationsFailed};
use rdkv_ycsb::measurement::Report;
use rdkv_ycsb::properties::{Properties, Workload};
use rdkv_ycsb::runner::{self, RunOptions};
use rdkv_ycsb::{plot, workloads};

/// YCSB-style benchmarks for rdkv, with Redis and in-process baselines.
#[derive(Debug, Parser)]
#[command(version, about, after_help = exit::HELP)]
struct Arguments {
    #[command(subcommand)]
    command: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Insert `recordcount` records (YCSB's load phase).
    #[command(after_help = exit::HELP)]
    Load(PhaseArguments),
    /// Run `operationcount` operations of the workload's mix (YCSB's run phase).
    #[command(after_help = exit::HELP)]
    Run(PhaseArguments),
    /// Plot throughput over time and latency CDFs from JSON reports (`run --json`), or a
    /// comparison's ops/s per workload and store (`compare --json`).
    Plot {
        /// Output file: .svg or .png.
        #[arg(long, short = 'o')]
        output: PathBuf,
        /// JSON reports written by `load`/`run --json`, or one comparison written by
        /// `compare --json`.
        #[arg(required = true)]
        reports: Vec<PathBuf>,
    },
    /// Start a local rdkv cluster and redis-server, load both, run workloads against each in
    /// turn, and print one table with the ratios.
    #[command(after_help = exit::HELP)]
    Compare {
        /// Records loaded into each store.
        #[arg(long, default_value_t = 100_000)]
        records: u64,
        /// Seconds each workload runs against each store (in each round).
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Rounds of the whole comparison, each running every store in turn (each rdkv store on a
        /// fresh cluster, loaded), so that drift on the machine hits every store alike. The table
        /// gives each store's medians and the rounds' range of ops/s, and a note under it names
        /// every store and workload whose rounds disagree by more than 20%.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
        rounds: u64,
        /// Concurrent tasks per store.
        #[arg(long, default_value_t = 64)]
        threads: usize,
        /// rdkv nodes.
        #[arg(long, default_value_t = 1)]
        nodes: u32,
        /// Copies of each key (the cluster file's `replicas`: 1 to 3, at most --nodes).
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// Workloads (letters), run in this order.
        #[arg(long, value_delimiter = ',', default_value = "a,b,c,d,f")]
        workloads: Vec<String>,
        /// The redis-server program.
        #[arg(long, default_value = "redis-server")]
        redis_server: PathBuf,
        /// Each node's heap ("256M"); by default it is sized by the rule in docs/operations.md
        /// (2 × live data + chunks + 0.25 s of writes at 100k writes/s).
        #[arg(long, value_parser = rdkv_cluster_file::units::parse_size)]
        heap_size: Option<u64>,
        /// Also write the figures as JSON, which `plot` draws: {"comparison": {records,
        /// record_size, seconds, threads, nodes, replicas, heap_size, rounds}, "workloads":
        /// [{"workload": "C", "stores": {"rdkv shm": {median_throughput, min_throughput,
        /// max_throughput, "rounds": [one report per round, as `run --json` writes]}, …}}]},
        /// stores keyed by the names the table prints, in the order they ran.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Exit 0 even when operations of the runs returned ERROR (they are still counted in the
        /// table). A load with errors stops the comparison regardless.
        #[arg(long)]
        allow_errors: bool,
        /// The stores, run in this order: rdkv over shm and over soft, Redis over TCP and over
        /// its Unix socket, the in-process ceiling (memory), and the harness's own ceiling
        /// (map: an in-process hash map, which every line is also compared to).
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "rdkv-shm,rdkv-soft,redis-tcp,redis-unix,memory,map"
        )]
        stores: Vec<compare::Store>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DriverName {
    /// rdkv through a cluster file (--config).
    Rdkv,
    /// Redis at --redis-url.
    Redis,
    /// An in-process rdkv server on the loopback fabric (the ceiling); `run` loads first.
    Memory,
    /// An in-process hash map (the harness's own ceiling: no store protocol); `run` loads
    /// first.
    Map,
}

#[derive(Debug, Args)]
struct PhaseArguments {
    /// The store.
    #[arg(long, value_enum, default_value = "rdkv")]
    driver: DriverName,
    /// The cluster file (rdkv driver).
    #[arg(long, short = 'c', default_value = "examples/local-3node.toml")]
    config: PathBuf,
    /// The rdkv driver's fabric: auto (a node's shm fabric when this host is the node's, else
    /// the cluster's), shm (required), or the cluster's (soft, verbs).
    #[arg(long, default_value = "auto")]
    fabric: rdkv_client::FabricChoice,
    /// The Redis URL (redis driver; `unix:///path/to/redis.sock` for a Unix socket).
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// A workload property file, or a shipped one by name (workloada … workloadf).
    #[arg(short = 'P', long = "workload", default_value = "workloada")]
    workload: String,
    /// Property overrides: -p recordcount=100000.
    #[arg(short = 'p', value_name = "KEY=VALUE")]
    properties: Vec<String>,
    /// Concurrent tasks.
    #[arg(long, alias = "concurrency", default_value_t = 1)]
    threads: usize,
    /// Throttle to this many operations per second in total.
    #[arg(long)]
    target: Option<f64>,
    /// Stop after this many seconds (0: no limit); overrides `-p maxexecutiontime=N`.
    #[arg(long)]
    max_execution_time: Option<u64>,
    /// Also write the figures as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// For `run`: load the records first, in the same process.
    #[arg(long)]
    load: bool,
    /// Exit 0 even when operations returned ERROR (they are still reported, as Return=ERROR).
    #[arg(long)]
    allow_errors: bool,
}

fn load_workload(arguments: &PhaseArguments) -> anyhow::Result<Workload> {
    let path = Path::new(&arguments.workload);
    let stem = path
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or(&arguments.workload)
        .to_string();
    let mut properties = if path.exists() {
        Properties::load(path)?
    } else if let Some(text) = workloads::builtin(&arguments.workload) {
        Properties::parse(&arguments.workload, text)?
    } else {
        anyhow::bail!(
            "{}: no such workload file, and not a shipped workload (workloada … workloadf)",
            arguments.workload
        );
    };
    for assignment in &arguments.properties {
        properties.set_override(assignment)?;
    }
    for unknown in properties.unknown_keys() {
        eprintln!("warning: property `{unknown}` is not used by the core workload");
    }
    Ok(Workload::from_properties(&stem, &properties)?)
}

async fn driver(arguments: &PhaseArguments, workload: &Workload) -> anyhow::Result<Driver> {
    Ok(match arguments.driver {
        DriverName::Rdkv => {
            let driver = Driver::rdkv(&arguments.config, arguments.fabric, arguments.threads)?;
            driver.reach().await?;
            driver
        }
        DriverName::Redis => Driver::redis(&arguments.redis_url)
            .await
            .with_context(|| format!("connect to Redis at {}", arguments.redis_url))?,
        DriverName::Memory => {
            Driver::memory(
                workload.record_count * 2,
                workload.record_size(),
                arguments.threads,
            )
            .await?
        }
        DriverName::Map => Driver::map(workload.record_count),
    })
}

fn emit(report: &Report, json: Option<&Path>) -> anyhow::Result<()> {
    rdkv_common::out!("{}", report.to_ycsb_text());
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_vec_pretty(report)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let _logging = rdkv_common::process::init_logging("warn");
    let status = match execute(Arguments::parse().command).await {
        Ok(status) => status,
        Err(error) => {
            // One line with its causes, never a backtrace (whatever RUST_BACKTRACE says).
            eprintln!(
                "rdkv-ycsb: error: {}",
                exit::one_line(&format!("{error:#}"))
            );
            ExitStatus::after_error(&error)
        }
    };
    status.into()
}

async fn execute(command: Action) -> anyhow::Result<ExitStatus> {
    Ok(match command {
        Action::Load(arguments) => {
            let workload = load_workload(&arguments)?;
            let driver = Arc::new(driver(&arguments, &workload).await?);
            let report =
                runner::load(&workload, driver.clone(), options(&arguments, &workload)).await;
            driver.close().await;
            let report = report?;
            emit(&report, arguments.json.as_deref())?;
            conclude(
                OperationsFailed::from_reports("load", &[&report]),
                arguments.allow_errors,
            )
        }
        Action::Run(arguments) => {
            let workload = load_workload(&arguments)?;
            let driver = Arc::new(driver(&arguments, &workload).await?);
            let phases = load_and_run(&arguments, &workload, driver.clone()).await;
            // Closed on errors too: an in-process server torn down without it logs errors.
            driver.close().await;
            let (loaded, report) = phases?;
            emit(&report, arguments.json.as_deref())?;
            let reports: Vec<&Report> = loaded.iter().chain([&report]).collect();
            let what = if loaded.is_some() {
                "load and run"
            } else {
                "run"
            };
            conclude(
                OperationsFailed::from_reports(what, &reports),
                arguments.allow_errors,
            )
        }
        Action::Plot { output, reports } => {
            plot::plot_files(&reports, &output)?;
            eprintln!("wrote {}", output.display());
            ExitStatus::Success
        }
        Action::Compare {
            records,
            seconds,
            rounds,
            threads,
            nodes,
            replicas,
            workloads,
            redis_server,
            heap_size,
            json,
            allow_errors,
            stores,
        } => {
            let options = CompareOptions {
                stores,
                records,
                seconds,
                rounds: usize::try_from(rounds)?,
                threads,
                nodes,
                replicas,
                workloads,
                redis_server,
                progress: true,
                heap_size,
            };
            let comparison = compare::compare(&options).await?;
            rdkv_common::outln!("{}", comparison.table());
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&comparison)?)
                    .with_context(|| format!("write {}", path.display()))?;
            }
            let reports: Vec<&Report> = comparison.reports().collect();
            conclude(
                OperationsFailed::from_reports("compare", &reports),
                allow_errors,
            )
        }
    })
}

/// `run`'s phases: the load first when asked (always for the in-process drivers, which start
/// empty), then the run.
async fn load_and_run(
    arguments: &PhaseArguments,
    workload: &Workload,
    driver: Arc<Driver>,
) -> anyhow::Result<(Option<Report>, Report)> {
    let mut loaded = None;
    if arguments.load || matches!(arguments.driver, DriverName::Memory | DriverName::Map) {
        let report = runner::load(
            workload,
            driver.clone(),
            RunOptions {
                max_execution_time: None,
                ..options(arguments, workload)
            },
        )
        .await?;
        eprintln!(
            "loaded {} records in {} ms",
            report.operations, report.runtime_ms
        );
        loaded = Some(report);
    }
    let report = runner::run(workload, driver, options(arguments, workload)).await?;
    Ok((loaded, report))
}

/// The exit status of phases that ran, with a one-line summary on stderr when operations failed.
fn conclude(failed: Option<OperationsFailed>, allow_errors: bool) -> ExitStatus {
    if let Some(failed) = &failed {
        let summary = exit::one_line(&failed.to_string());
        if allow_errors {
            eprintln!("rdkv-ycsb: warning: {summary} (exit 0: --allow-errors)");
        } else {
            eprintln!("rdkv-ycsb: error: {summary} (--allow-errors exits 0 anyway)");
        }
    }
    ExitStatus::after_operations(failed.as_ref(), allow_errors)
}

fn options(arguments: &PhaseArguments, workload: &Workload) -> RunOptions {
    RunOptions {
        threads: arguments.threads,
        target: arguments.target,
        max_execution_time: workload.time_limit(arguments.max_execution_time),
        progress: true,
    }
}
