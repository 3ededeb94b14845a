//! The `rdkv` binary's exit codes for usage and configuration errors (the round trip against a
//! live cluster is `integration-tests/tests/cluster.rs`, which also needs this package to have
//! an integration test so that `cargo test --workspace` builds `target/*/rdkv`).

use std::process::Command;

fn rdkv() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rdkv"))
}

#[test]
fn help_exits_zero() {
    let output = rdkv().arg("--help").output().expect("run rdkv --help");
    assert!(output.status.success(), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("get"));
}

#[test]
fn a_missing_cluster_file_is_one_line_and_exit_two() {
    let output = rdkv()
        .args(["--config", "/nonexistent/cluster.toml", "get", "key"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run rdkv");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/cluster.toml"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

#[test]
fn an_unknown_command_is_a_usage_error() {
    let output = rdkv().arg("frobnicate").output().expect("run rdkv");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
}
