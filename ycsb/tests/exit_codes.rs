//! The `rdkv-ycsb` binary's exit codes and error lines, as scripts see them: a run against a
//! cluster that is not running exits 1 (0 with `--allow-errors`), bad input exits 2, each with
//! one summary line on stderr and never a backtrace, even with `RUST_BACKTRACE=1`; and the
//! `maxexecutiontime` property bounds a run.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A cluster file whose node is at loopback ports where nothing listens: every operation fails
/// with "connection refused".
struct StoppedCluster {
    directory: PathBuf,
    file: PathBuf,
    /// The node's ports, bound and held but never listened on, so that no other test's
    /// listener takes one meanwhile (`rdkv_common::ports`).
    _ports: rdkv_common::ports::ReservedPorts,
}

impl StoppedCluster {
    fn new(name: &str) -> Self {
        let directory = std::env::temp_dir().join(format!(
            "rdkv-ycsb-exit-codes-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&directory).expect("create the test directory");
        let reserved =
            rdkv_common::ports::ReservedPorts::loopback(2).expect("reserve loopback ports");
        let ports = reserved.ports();
        let text = format!(
            "[cluster]\nname = \"stopped\"\nsecret = \"rdkv-ycsb-exit-codes\"\nfabric = \"soft\"\noperation_deadline = \"2s\"\n\n[[node]]\nid = 1\ncontrol_address = \"127.0.0.1:{}\"\nfabric_address = \"127.0.0.1:{}\"\nindex_size = \"1M\"\nheap_size = \"4M\"\nchunk_size = \"256K\"\n",
            ports[0], ports[1]
        );
        let file = directory.join("cluster.toml");
        std::fs::write(&file, text).expect("write the cluster file");
        Self {
            directory,
            file,
            _ports: reserved,
        }
    }
}

impl Drop for StoppedCluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// Runs `rdkv-ycsb` with `RUST_BACKTRACE=1`, as this environment sets it.
fn ycsb(arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rdkv-ycsb"))
        .args(arguments)
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run rdkv-ycsb")
}

/// The stderr lines that start with `prefix`, after checking that no backtrace was printed.
fn stderr_lines_starting(output: &Output, prefix: &str) -> Vec<String> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.to_lowercase().contains("backtrace"),
        "no backtrace:\n{stderr}"
    );
    stderr
        .lines()
        .filter(|line| line.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_run_against_a_stopped_cluster_exits_1_unless_errors_are_allowed() {
    let cluster = StoppedCluster::new("run");
    let config = cluster.file.to_str().expect("a UTF-8 path");
    let phase = [
        "-c",
        config,
        "-p",
        "recordcount=10",
        "-p",
        "operationcount=20",
        "--threads",
        "2",
    ];

    let failed = ycsb(&[&["run"], &phase[..]].concat());
    assert_eq!(failed.status.code(), Some(1), "{failed:?}");
    let stdout = String::from_utf8_lossy(&failed.stdout);
    assert!(stdout.contains("Return=ERROR"), "the report: {stdout}");
    let errors = stderr_lines_starting(&failed, "rdkv-ycsb: error: ");
    assert_eq!(errors.len(), 1, "one summary line: {errors:?}");
    assert!(
        errors[0].contains("run: 20 of 20 operations failed (Return=ERROR); the first: ")
            && errors[0].contains("--allow-errors"),
        "{}",
        errors[0]
    );

    let allowed = ycsb(&[&["run", "--allow-errors"], &phase[..]].concat());
    assert_eq!(allowed.status.code(), Some(0), "{allowed:?}");
    assert!(String::from_utf8_lossy(&allowed.stdout).contains("Return=ERROR, "));
    assert!(stderr_lines_starting(&allowed, "rdkv-ycsb: error: ").is_empty());
    let warnings = stderr_lines_starting(&allowed, "rdkv-ycsb: warning: ");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("20 of 20 operations failed"),
        "{}",
        warnings[0]
    );

    let load = ycsb(&[&["load"], &phase[..]].concat());
    assert_eq!(load.status.code(), Some(1), "{load:?}");
    let errors = stderr_lines_starting(&load, "rdkv-ycsb: error: ");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("load: 10 of 10 operations failed"),
        "{}",
        errors[0]
    );
}

#[test]
fn bad_input_exits_2_with_one_line() {
    let cluster = StoppedCluster::new("input");
    let missing = cluster.directory.join("missing.toml");
    for (arguments, expected) in [
        (
            vec!["run", "-c", missing.to_str().expect("a UTF-8 path")],
            "missing.toml",
        ),
        (
            vec!["run", "-P", "workloadz"],
            "workloadz: no such workload file",
        ),
        (
            vec!["run", "-p", "maxexecutiontime=soon"],
            "maxexecutiontime = `soon` is not a whole number of seconds",
        ),
    ] {
        let output = ycsb(&arguments);
        assert_eq!(output.status.code(), Some(2), "{arguments:?}: {output:?}");
        let errors = stderr_lines_starting(&output, "rdkv-ycsb: error: ");
        assert_eq!(errors.len(), 1, "{arguments:?}: {errors:?}");
        assert!(errors[0].contains(expected), "{}", errors[0]);
        assert!(output.stdout.is_empty(), "nothing measured");
    }
}

#[test]
fn help_lists_the_exit_codes() {
    for arguments in [
        vec!["--help"],
        vec!["run", "--help"],
        vec!["compare", "--help"],
    ] {
        let output = ycsb(&arguments);
        assert_eq!(output.status.code(), Some(0));
        let help = String::from_utf8_lossy(&output.stdout);
        assert!(help.contains("Exit codes:"), "{arguments:?}: {help}");
        for code in ["  0  ", "  1  ", "  2  "] {
            assert!(help.contains(code), "{arguments:?}: {code}");
        }
    }
}

#[test]
fn the_maxexecutiontime_property_bounds_a_run() {
    // The in-process store, and far more operations than one second allows.
    let output = ycsb(&[
        "run",
        "--driver",
        "memory",
        "-P",
        "workloadc",
        "-p",
        "recordcount=100",
        "-p",
        "operationcount=1000000000",
        "-p",
        "maxexecutiontime=1",
    ]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let runtime_ms: u64 = stdout
        .lines()
        .find_map(|line| line.strip_prefix("[OVERALL], RunTime(ms), "))
        .and_then(|value| value.parse().ok())
        .expect("a RunTime line");
    assert!(
        (1000..30_000).contains(&runtime_ms),
        "stopped by the one-second limit: {runtime_ms} ms"
    );
}
