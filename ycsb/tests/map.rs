//! The `map` store, the harness over an in-process hash map: `rdkv-ycsb run --driver map` loads
//! and runs every operation of a workload (and the update-only mix that
//! `scripts/bench/instructions.sh` counts), and `compare --stores map,…` measures every line
//! against it, in the table and in the JSON, keyed `map`.

mod support;

use support::{ycsb, TestDirectory};

/// The report `run --json` wrote at `path`.
fn report(path: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("the JSON is written")).expect("JSON")
}

/// The `[KIND], Operations, N` counts of YCSB's text output.
fn operations(stdout: &[u8], kind: &str) -> Option<u64> {
    String::from_utf8_lossy(stdout).lines().find_map(|line| {
        line.strip_prefix(&format!("[{kind}], Operations, "))
            .and_then(|count| count.parse().ok())
    })
}

#[test]
fn run_on_the_map_loads_then_counts_every_operation() {
    let directory = TestDirectory::new("map-run");
    for (workload, kinds) in [
        ("workloada", &["READ", "UPDATE"][..]),
        ("workloadf", &["READ", "READ-MODIFY-WRITE"][..]),
    ] {
        let json = directory.file(&format!("{workload}.json"));
        let output = ycsb(&[
            "run",
            "--driver",
            "map",
            "-P",
            workload,
            "-p",
            "recordcount=500",
            "-p",
            "operationcount=3000",
            "--threads",
            "4",
            "--json",
            &json,
        ]);
        let report = report(&json);
        assert_eq!(report["driver"], "map", "{report}");
        assert_eq!(report["operations"], 3000, "{report}");
        let counted: u64 = kinds
            .iter()
            .map(|kind| operations(&output.stdout, kind).unwrap_or(0))
            .sum();
        assert_eq!(counted, 3000, "{workload}: every operation of the mix");
        // The run found every loaded record: no NOT_FOUND, no ERROR.
        for kind in report["kinds"].as_array().expect("kinds") {
            assert_eq!(kind["outcomes"]["OK"], kind["operations"], "{kind}");
        }
    }

    // The update-only mix that scripts/bench/instructions.sh counts.
    let output = ycsb(&[
        "run",
        "--driver",
        "map",
        "-P",
        "workloada",
        "-p",
        "readproportion=0",
        "-p",
        "updateproportion=1",
        "-p",
        "recordcount=500",
        "-p",
        "operationcount=2000",
        "--threads",
        "4",
    ]);
    assert_eq!(operations(&output.stdout, "UPDATE"), Some(2000));
    assert_eq!(operations(&output.stdout, "READ"), None);
}

#[test]
fn compare_measures_every_line_against_the_map() {
    let directory = TestDirectory::new("map-compare");
    let json = directory.file("compare.json");
    let output = ycsb(&[
        "compare",
        "--stores",
        "memory,map",
        "--workloads",
        "c",
        "--records",
        "200",
        "--seconds",
        "0.3",
        "--threads",
        "2",
        "--json",
        &json,
    ]);
    let table = String::from_utf8_lossy(&output.stdout);
    let cells = |store: &str| -> Vec<String> {
        let line = table
            .lines()
            .find(|line| line.starts_with(&format!("| C | {store} |")))
            .unwrap_or_else(|| panic!("a C line for {store}:\n{table}"));
        line.split('|')
            .map(|cell| cell.trim().to_string())
            .collect()
    };
    // No Redis ran: `-` against it; the map against itself is 1.
    assert_eq!(&cells("map")[4..6], ["-", "1.00×"]);
    let memory = cells("memory (ceiling)");
    assert_eq!(memory[4], "-");
    assert!(memory[5].ends_with('×'), "{memory:?}");

    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON is written")).expect("JSON");
    let stores = &written["workloads"][0]["stores"];
    let map = &stores["map"];
    assert!(
        map["median_throughput"]
            .as_f64()
            .is_some_and(|ops| ops > 0.0),
        "{map}"
    );
    assert_eq!(map["vs_map"], 1.0, "{map}");
    assert_eq!(map["rounds"][0]["driver"], "map", "{map}");
    assert!(
        stores["memory (ceiling)"]["vs_map"]
            .as_f64()
            .is_some_and(|ratio| ratio > 0.0),
        "{stores}"
    );
}
