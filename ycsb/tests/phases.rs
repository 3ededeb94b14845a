//! A short load and run of workload A against an in-process rdkv server, counted and printed in
//! YCSB's format; workload E refused; plots drawn.

use std::sync::Arc;
use std::time::Duration;

use rdkv_client::{Client, ClientConfig};
use rdkv_fabric::Backend;
use rdkv_server::ServerConfig;
use rdkv_ycsb::driver::Driver;
use rdkv_ycsb::measurement::OperationKind;
use rdkv_ycsb::properties::{Properties, Workload};
use rdkv_ycsb::runner::{self, RunOptions};
use rdkv_ycsb::workloads;

fn shipped(name: &str, overrides: &[&str]) -> Workload {
    let mut properties =
        Properties::parse(name, workloads::builtin(name).expect("shipped")).expect("parses");
    for assignment in overrides {
        properties.set_override(assignment).expect("override");
    }
    Workload::from_properties(name, &properties).expect("valid")
}

const OPTIONS: RunOptions = RunOptions {
    threads: 8,
    target: None,
    max_execution_time: None,
    progress: false,
};

async fn in_process_driver() -> (rdkv_server::RunningServer, Arc<Driver>) {
    let mut config = ServerConfig::local(b"ycsb-test");
    config.heap_size = 32 << 20;
    config.chunk_size = 256 << 10;
    let server = rdkv_server::start(config).await.expect("server");
    let mut client_config =
        ClientConfig::new(server.control_address(), Backend::Soft, b"ycsb-test");
    client_config.concurrency = 8;
    let client = Client::connect(client_config).await.expect("client");
    let driver = Driver::Rdkv {
        client: Arc::new(client),
        _server: None,
        name: "rdkv",
    };
    (server, Arc::new(driver))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_and_run_workload_a_count_every_operation() {
    let (_server, driver) = in_process_driver().await;
    let workload = shipped("workloada", &["recordcount=2000", "operationcount=5000"]);
    let loaded = runner::load(&workload, driver.clone(), OPTIONS)
        .await
        .expect("load");
    assert_eq!(loaded.operations, 2000);
    let inserts = loaded.kind(OperationKind::Insert).expect("inserts");
    assert_eq!(inserts.outcomes.get("OK"), Some(&2000));

    let ran = runner::run(&workload, driver.clone(), OPTIONS)
        .await
        .expect("run");
    assert_eq!(ran.operations, 5000);
    let reads = ran.kind(OperationKind::Read).expect("reads");
    let updates = ran.kind(OperationKind::Update).expect("updates");
    assert_eq!(reads.operations + updates.operations, 5000);
    assert_eq!(
        reads.outcomes.get("OK"),
        Some(&reads.operations),
        "every loaded key is found"
    );
    assert_eq!(updates.outcomes.get("OK"), Some(&updates.operations));
    assert!(
        (2000..3000).contains(&reads.operations),
        "about half reads: {}",
        reads.operations
    );
    let figures = ran.rdkv.expect("rdkv figures");
    // A GET takes 2 round trips, or 1 when the slot cache's guess holds (the loaded keys were
    // written by this process, so nearly all do).
    assert!(
        (1.0..1.5).contains(&figures.round_trips_per_read),
        "a GET takes 1 round trip with a guess, 2 without: {}",
        figures.round_trips_per_read
    );

    let text = ran.to_ycsb_text();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("[OVERALL], RunTime(ms), "));
    assert!(lines[1].starts_with("[OVERALL], Throughput(ops/sec), "));
    assert_eq!(
        lines[2],
        format!("[READ], Operations, {}", reads.operations)
    );
    for (index, prefix) in [
        "[READ], AverageLatency(us), ",
        "[READ], MinLatency(us), ",
        "[READ], MaxLatency(us), ",
        "[READ], 95thPercentileLatency(us), ",
        "[READ], 99thPercentileLatency(us), ",
    ]
    .iter()
    .enumerate()
    {
        assert!(lines[3 + index].starts_with(prefix), "{}", lines[3 + index]);
    }
    assert_eq!(lines[8], format!("[READ], Return=OK, {}", reads.operations));
    assert_eq!(
        lines[9],
        format!("[UPDATE], Operations, {}", updates.operations)
    );
    assert!(text.contains(&format!(
        "[RDKV], RoundTripsPerRead, {}\n",
        figures.round_trips_per_read
    )));

    // A time limit bounds a run that asks for far more operations.
    let bounded = runner::run(
        &shipped(
            "workloadc",
            &["recordcount=2000", "operationcount=100000000"],
        ),
        driver.clone(),
        RunOptions {
            max_execution_time: Some(Duration::from_millis(500)),
            ..OPTIONS
        },
    )
    .await
    .expect("run");
    assert!(
        bounded.runtime_ms < 3000,
        "stopped by the time limit: {} ms",
        bounded.runtime_ms
    );

    // Workload E is refused, not faked.
    let error = runner::run(
        &shipped("workloade", &["recordcount=2000"]),
        driver.clone(),
        OPTIONS,
    )
    .await
    .expect_err("scans are refused");
    assert!(
        error
            .to_string()
            .contains("workload E (scans) cannot run on rdkv"),
        "{error}"
    );

    // Throttling holds the rate near the target.
    let throttled = runner::run(
        &shipped("workloadc", &["recordcount=2000", "operationcount=400"]),
        driver.clone(),
        RunOptions {
            target: Some(400.0),
            ..OPTIONS
        },
    )
    .await
    .expect("run");
    assert!(
        throttled.runtime_ms >= 900,
        "400 operations at 400/s take about a second: {} ms",
        throttled.runtime_ms
    );
    driver.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plots_are_drawn_as_svg_and_png() {
    let (_server, driver) = in_process_driver().await;
    let workload = shipped("workloadc", &["recordcount=500", "operationcount=3000"]);
    runner::load(&workload, driver.clone(), OPTIONS)
        .await
        .expect("load");
    let report = runner::run(&workload, driver.clone(), OPTIONS)
        .await
        .expect("run");
    let directory = std::env::temp_dir().join(format!("rdkv-ycsb-plot-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    for name in ["plot.svg", "plot.png"] {
        let path = directory.join(name);
        match rdkv_ycsb::plot::plot(std::slice::from_ref(&report), &path) {
            Ok(()) => assert!(
                std::fs::metadata(&path).expect("written").len() > 1000,
                "{name}"
            ),
            Err(error) => panic!(
                "{name}: {error} (plots need a TrueType font: apt-get install fonts-dejavu-core)"
            ),
        }
    }
    if let Ok(svg) = std::fs::read_to_string(directory.join("plot.svg")) {
        assert!(
            svg.contains("<svg") && svg.contains("Latency CDF"),
            "an SVG with its captions"
        );
    }
    let error = rdkv_ycsb::plot::plot(std::slice::from_ref(&report), &directory.join("plot.bmp"))
        .unwrap_err();
    assert!(
        error.to_string().contains(".svg or .png") || error.to_string().contains("TrueType"),
        "{error}"
    );
    let _ = std::fs::remove_dir_all(&directory);
    driver.close().await;
}

/// `insertstart` and `insertcount` split a load between loaders, as YCSB's: two loads of half
/// each insert their own records (600 keys in all), and a run over `recordcount` finds every
/// key. A part past `recordcount` is refused, naming the properties.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_loaders_each_insert_their_part_of_recordcount() {
    let (server, driver) = in_process_driver().await;
    for start in ["0", "300"] {
        let part = shipped(
            "workloadc",
            &[
                "recordcount=600",
                &format!("insertstart={start}"),
                "insertcount=300",
            ],
        );
        let loaded = runner::load(&part, driver.clone(), OPTIONS)
            .await
            .expect("load");
        let inserts = loaded.kind(OperationKind::Insert).expect("inserts");
        assert_eq!(
            inserts.outcomes.get("OK"),
            Some(&300),
            "loader from {start}"
        );
    }
    assert_eq!(server.stats().keys, 600, "two disjoint parts of 300");
    let whole = shipped("workloadc", &["recordcount=600", "operationcount=3000"]);
    let ran = runner::run(&whole, driver.clone(), OPTIONS)
        .await
        .expect("run");
    let reads = ran.kind(OperationKind::Read).expect("reads");
    assert_eq!(reads.operations, 3000);
    assert_eq!(
        reads.outcomes.get("OK"),
        Some(&3000),
        "every record of both parts is found: {:?}",
        reads.outcomes
    );

    let mut properties = Properties::parse(
        "workloadc",
        workloads::builtin("workloadc").expect("shipped"),
    )
    .expect("parses");
    for assignment in ["recordcount=600", "insertstart=400", "insertcount=300"] {
        properties.set_override(assignment).expect("override");
    }
    let refused = Workload::from_properties("workloadc", &properties).expect_err("past the end");
    assert!(
        refused
            .to_string()
            .contains("insertstart = 400 and insertcount = 300 go past recordcount = 600"),
        "{refused}"
    );
}
