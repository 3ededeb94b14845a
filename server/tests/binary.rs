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

/// A small node on the verbs fabric.
const VERBS_NODE: [&str; 8] = [
    "--fabric",
    "verbs",
    "--listen",
    "127.0.0.1:0",
    "--index-size",
    "1M",
    "--heap-size",
    "4M",
];

/// `--fabric verbs` either runs (a build with the feature on a machine with an RDMA device:
/// then the test checks that it gets ready) or exits with an error that names the fix: rebuild
/// with the feature, or load a driver / rxe. It never crashes.
#[test]
fn the_verbs_fabric_without_a_device_or_the_feature_is_a_clear_error() {
    let has_device = std::fs::read_dir("/sys/class/infiniband")
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false);
    if has_device && cfg!(feature = "verbs") {
        the_verbs_fabric_with_a_device_gets_ready();
        return;
    }
    let output = Command::new(BINARY)
        .args(VERBS_NODE)
        .env("RDKV_SECRET", "binary-test-secret")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(1), "an error exit, not a crash");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let expected = if cfg!(feature = "verbs") {
        "RDMA device unavailable"
    } else {
        "--features verbs"
    };
    assert!(stderr.contains(expected), "{stderr}");
}

/// On a machine with an RDMA device and a verbs build: the server opens the device and prints
/// its ready line.
fn the_verbs_fabric_with_a_device_gets_ready() {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(BINARY)
        .args(VERBS_NODE)
        .env("RDKV_SECRET", "binary-test-secret")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let stdout = child.stdout.take().expect("piped stdout");
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line.starts_with("rdkv-server ready"));
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        ready,
        "the server on the verbs fabric printed its ready line"
    );
}

/// A verbs build on a machine without `libibverbs.so.1` (hidden here by bind-mounting /dev/null
/// over it in a private mount namespace, as root) exits naming the package to install. It needs
/// root, `unshare` and libibverbs1 installed; `scripts/softroce/run.sh` runs it on the host.
#[cfg(feature = "verbs")]
#[test]
#[ignore = "needs root, unshare and libibverbs1; scripts/softroce/run.sh runs it with --include-ignored"]
fn the_verbs_fabric_without_the_verbs_library_is_a_clear_error() {
    let library = std::fs::canonicalize("/usr/lib/x86_64-linux-gnu/libibverbs.so.1")
        .expect("libibverbs.so.1 is installed (apt-get install libibverbs1), so it can be hidden");
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| output.stdout.trim_ascii() == b"0");
    assert!(
        is_root,
        "hiding the library needs root (a private mount namespace)"
    );
    let script = format!(
        "mount --bind /dev/null '{}' && exec '{BINARY}' --fabric verbs --listen 127.0.0.1:0 \
         --index-size 1M --heap-size 4M",
        library.display()
    );
    let output = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .env("RDKV_SECRET", "binary-test-secret")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run unshare (util-linux)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("apt-get install libibverbs1"),
        "names the package: {stderr}"
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
        .env("RDKV_SECRET", "binary-test-secret")
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("index_size"), "{stderr}");
}

#[test]
fn connection_limit_mistakes_are_command_line_errors() {
    let run = |arguments: &[&str]| {
        let output = Command::new(BINARY)
            .args(["--listen", "127.0.0.1:0", "--fabric-listen", "127.0.0.1:0"])
            .args(arguments)
            .env("RDKV_SECRET", "binary-test-secret")
            .output()
            .expect("run");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    for (arguments, names) in [
        (
            &[
                "--max-connections",
                "100",
                "--max-unauthenticated-connections",
                "100",
            ][..],
            "--max-unauthenticated-connections",
        ),
        (
            &["--fabric-engine-threads", "257"][..],
            "--fabric-engine-threads",
        ),
        (&["--max-connections", "1"][..], "--max-connections"),
        (
            &[
                "--config",
                "nowhere.toml",
                "--node",
                "1",
                "--fabric-engine-threads",
                "2",
            ][..],
            "--config",
        ),
    ] {
        let (code, stderr) = run(arguments);
        assert_eq!(code, Some(2), "{arguments:?}: {stderr}");
        assert!(stderr.contains(names), "{arguments:?}: {stderr}");
    }
}

/// Starts a node on loopback port 0 with `extra` arguments and returns it with its ready
/// line, once printed.
fn start_node(extra: &[&str], stderr: Stdio) -> (std::process::Child, String) {
    let mut child = Command::new(BINARY)
        .args(["--listen", "127.0.0.1:0", "--fabric-listen", "127.0.0.1:0"])
        .args(extra)
        .env("RDKV_SECRET", "binary-test-secret")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("ready line");
    (child, line)
}

#[test]
fn it_prints_a_ready_line_and_stops_cleanly_on_sigterm() {
    let (mut child, line) = start_node(&["--heap-size", "4M"], Stdio::piped());
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

#[test]
fn the_memlock_trap_is_reported_with_its_fix() {
    // As root the capability CAP_IPC_LOCK lifts RLIMIT_MEMLOCK; drop to an unprivileged user
    // without capabilities to meet the limit that ordinary users meet.
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
        .unwrap_or(false);
    let has_setpriv = Command::new("setpriv").arg("--version").output().is_ok();
    let limit_kib: u64 = Command::new("sh")
        .args(["-c", "ulimit -l"])
        .output()
        .ok()
        .and_then(|output| String::from_utf8_lossy(&output.stdout).trim().parse().ok())
        .unwrap_or(u64::MAX);
    assert!(
        is_root && has_setpriv && limit_kib <= 1 << 20,
        "this test runs the server as an unprivileged user under this machine's memlock limit: \
         it needs root, setpriv (util-linux) and a finite `ulimit -l` (have root={is_root}, \
         setpriv={has_setpriv}, limit={limit_kib} KiB); elsewhere, run with \
         `--skip the_memlock_trap_is_reported_with_its_fix`"
    );
    let heap = format!("{}K", limit_kib * 2);
    let output = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            BINARY,
            "--listen",
            "127.0.0.1:0",
            "--fabric-listen",
            "127.0.0.1:0",
            "--heap-size",
            &heap,
        ])
        .env("RDKV_SECRET", "binary-test-secret")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run as an unprivileged user");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.starts_with("setpriv:"),
        "the unprivileged user (65534) must be able to run {BINARY}: put the checkout where \
         others can read it: {stderr}"
    );
    assert!(stderr.contains("RLIMIT_MEMLOCK"), "{stderr}");
    assert!(
        stderr.contains("ulimit -l") && stderr.contains("limits.conf"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "a clean error, not a crash: {stderr}"
    );
}

#[test]
fn an_idle_node_with_a_large_index_uses_at_most_a_fraction_of_a_core() {
    // The collector scans the whole index every 25 ms; with a large index that used to be a
    // whole core on an idle node (measured: a 256 MiB index, 100% of a core). A pass now rests
    // four times its own length, so the collector takes at most about a fifth of a core.
    let (mut child, line) = start_node(
        &[
            "--index-size",
            "64M",
            "--heap-size",
            "4M",
            "--hugepages",
            "off",
        ],
        Stdio::null(),
    );
    assert!(line.starts_with("rdkv-server ready"), "{line}");
    let pid = child.id();
    let before = rdkv_common::process::cpu_time(Some(pid)).expect("the node's CPU time");
    // Measuring over a fixed window, not waiting for readiness.
    let window = Duration::from_secs(3);
    std::thread::sleep(window);
    let after = rdkv_common::process::cpu_time(Some(pid)).expect("the node's CPU time");
    let _ = child.kill();
    let _ = child.wait();
    let share = (after - before).as_secs_f64() / window.as_secs_f64();
    assert!(
        share < 0.4,
        "an idle node used {:.0}% of a core over {window:?}",
        share * 100.0
    );
}
