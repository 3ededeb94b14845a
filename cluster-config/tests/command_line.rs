//! `rdkv-cluster`'s command line as a script sees it: its help lists the exit codes, and a
//! missing cluster file is one line and exit 1. (Also what makes `cargo test --workspace` build
//! `rdkv-cluster`, which `integration-tests` runs: cargo builds a package's binaries for its
//! own integration tests only, and without this file a fresh clone's test run failed 27 tests
//! with `target/debug/rdkv-cluster is missing`.)

use std::process::Command;

fn rdkv_cluster() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rdkv-cluster"));
    command.env("RUST_BACKTRACE", "1");
    command
}

#[test]
fn help_lists_the_exit_codes() {
    let output = rdkv_cluster()
        .arg("--help")
        .output()
        .expect("run rdkv-cluster");
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for code in [
        "  0  done",
        "  1  failed",
        "  2  invalid command line",
        "  3  `status`",
    ] {
        assert!(help.contains(code), "no {code:?} in:\n{help}");
    }
    // A stopped node's row, and what it exits.
    assert!(help.contains("(`no answer`"), "{help}");
}

#[test]
fn a_missing_cluster_file_is_one_line_and_exit_1() {
    let output = rdkv_cluster()
        .args(["status", "/nonexistent/rdkv-cluster.toml"])
        .output()
        .expect("run rdkv-cluster");
    assert_eq!(output.status.code(), Some(1));
    let error = String::from_utf8_lossy(&output.stderr);
    assert_eq!(error.trim().lines().count(), 1, "{error}");
    assert!(error.contains("cannot read the cluster file"), "{error}");
}
