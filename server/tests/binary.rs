//! The `rdkv-server` binary: its ready line, clear errors, and graceful shutdown on SIGTERM.
//! (These tests also make `cargo test --workspace` build the binary that other crates' process
//! tests run.)

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BINARY: &str = env!("CARGO_BIN_EXE_rdkv-server");

#[test]
fn a_missing_secret_is_a_clear_error() {
    let output = Command::new(BINARY)
        .args(["--listen", "127.0.0.1:0", "--fabric-listen", "127.0.0.1:0"])
        .env_remove("RDKV_SECRET")
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--secret-file") && stderr.contains("RDKV_SECRET"),
        "{stderr}"
    );
}

#[test]
fn a_bad_size_names_the_field() {
    let output = Command::new(BINARY)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--fabric-listen",
            "127.0.0.1:0",
            "--index-size",
            "64",
        ])
        .env("RDKV_SECRET", "s")
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("index_size"), "{stderr}");
}

#[test]
fn it_prints_a_ready_line_and_stops_cleanly_on_sigterm() {
    let mut child = Command::new(BINARY)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--fabric-listen",
            "127.0.0.1:0",
            "--heap-size",
            "4M",
        ])
        .env("RDKV_SECRET", "s")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("ready line");
    assert!(
        line.starts_with("rdkv-server ready node=1 control=127.0.0.1:"),
        "{line}"
    );
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let started = Instant::now();
    let exit = loop {
        if let Some(exit) = child.try_wait().expect("wait") {
            break exit;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no exit within 10 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "exit status {exit}");
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("stderr");
    assert!(stderr.contains("server stopped"), "{stderr}");
}
