//! `rdkv-ycsb compare --rounds 2 --json` over the in-process store (no servers to start), and
//! `rdkv-ycsb plot` of the file it wrote: a table with the rounds' range, JSON keyed by the
//! table's store names, and an SVG with a bar per store.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A directory removed on drop.
struct TestDirectory(PathBuf);

impl TestDirectory {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("rdkv-ycsb-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create the test directory");
        Self(path)
    }
}

impl Drop for TestDirectory {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ycsb(arguments: &[&str]) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_rdkv-ycsb"))
        .args(arguments)
        .env_remove("RUST_LOG")
        .output()
        .expect("run rdkv-ycsb");
    assert!(
        output.status.success(),
        "rdkv-ycsb {}: {}\n{}",
        arguments.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

#[test]
fn a_comparison_in_two_rounds_is_tabled_written_and_plotted() {
    let directory = TestDirectory::new("compare-plot");
    let json = directory.0.join("compare.json");
    let svg = directory.0.join("compare.svg");
    let json_argument = json.to_str().expect("a UTF-8 temporary path");
    let output = ycsb(&[
        "compare",
        "--stores",
        "memory",
        "--workloads",
        "c",
        "--records",
        "200",
        "--seconds",
        "0.3",
        "--threads",
        "2",
        "--rounds",
        "2",
        "--json",
        json_argument,
    ]);
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains("medians of 2 rounds"), "{table}");
    let line = table
        .lines()
        .find(|line| line.starts_with("| C | memory (ceiling) |"))
        .unwrap_or_else(|| panic!("a C line for the memory store:\n{table}"));
    assert!(line.contains('–') && line.ends_with("%) |"), "{line}");

    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON is written")).expect("JSON");
    let memory = &written["workloads"][0]["stores"]["memory (ceiling)"];
    assert_eq!(
        memory["rounds"].as_array().map(Vec::len),
        Some(2),
        "{memory}"
    );
    assert!(memory["median_throughput"]
        .as_f64()
        .is_some_and(|ops| ops > 0.0));

    ycsb(&["plot", "-o", svg.to_str().expect("UTF-8"), json_argument]);
    let drawn = std::fs::read_to_string(&svg).expect("the SVG is written");
    assert!(
        drawn.contains("<svg") && drawn.contains("memory (ceiling)"),
        "an SVG with the store's bar and name"
    );
}
