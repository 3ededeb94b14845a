//! `rdkv-ycsb compare --rounds 2 --json` over the in-process store (no servers to start), and
//! `rdkv-ycsb plot` of the file it wrote: a table with the rounds' range, JSON keyed by the
//! table's store names, and an SVG with a bar per store.

mod support;

use support::{ycsb, TestDirectory};

#[test]
fn a_comparison_in_two_rounds_is_tabled_written_and_plotted() {
    let directory = TestDirectory::new("compare-plot");
    let json = directory.file("compare.json");
    let svg = directory.file("compare.svg");
    let json_argument = json.as_str();
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

    ycsb(&["plot", "-o", &svg, json_argument]);
    let drawn = std::fs::read_to_string(&svg).expect("the SVG is written");
    assert!(
        drawn.contains("<svg") && drawn.contains("memory (ceiling)"),
        "an SVG with the store's bar and name"
    );
}
