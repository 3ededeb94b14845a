//! The `rdkv` binary against an in-process server on port 0 (through a generated cluster file):
//! binary keys from hex, files and stdin; raw and hex output; insert; and errors as one line
//! with exit code 2, even with `RUST_BACKTRACE=1`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use rdkv_common::ports::ReservedPorts;
use rdkv_server::{RunningServer, ServerConfig};

const SECRET: &str = "cli-test-secret-0";

/// A one-node cluster: the server, the runtime it runs on, and its cluster file in a directory
/// of its own (removed on drop).
struct Cluster {
    /// The cluster file.
    file: PathBuf,
    /// The directory holding the file and the tests' key files.
    directory: PathBuf,
    /// The node (stops when dropped, before the runtime).
    _server: RunningServer,
    /// Runs the server's tasks while the test thread waits for the binary.
    _runtime: tokio::runtime::Runtime,
}

impl Cluster {
    fn start(name: &str) -> Self {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let server = runtime
            .block_on(rdkv_server::start(ServerConfig::local(SECRET.as_bytes())))
            .expect("start server");
        let fabric_address = server.fabric_address().expect("the soft fabric's address");
        let directory =
            std::env::temp_dir().join(format!("rdkv-cli-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("directory");
        let file = directory.join("cluster.toml");
        std::fs::write(
            &file,
            format!(
                "[cluster]\nname = \"cli-test\"\nsecret = \"{SECRET}\"\nfabric = \"soft\"\n\n\
                 [[node]]\nid = 1\ncontrol_address = \"{}\"\nfabric_address = \"{fabric_address}\"\n\
                 index_size = \"256K\"\nheap_size = \"4M\"\nchunk_size = \"64K\"\n",
                server.control_address()
            ),
        )
        .expect("write the cluster file");
        Self {
            file,
            directory,
            _server: server,
            _runtime: runtime,
        }
    }

    /// Runs `rdkv --config FILE arguments…` with `stdin`, returning exit code, stdout and
    /// stderr.
    fn rdkv(&self, arguments: &[&str], stdin: &[u8]) -> (i32, Vec<u8>, String) {
        run_rdkv(
            &[
                &["--config", self.file.to_str().expect("utf-8 path")],
                arguments,
            ]
            .concat(),
            stdin,
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

fn run_rdkv(arguments: &[&str], stdin: &[u8]) -> (i32, Vec<u8>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rdkv"))
        .args(arguments)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run rdkv");
    let mut input = child.stdin.take().expect("stdin");
    // A command that does not read stdin may exit first: a broken pipe is fine.
    let _ = input.write_all(stdin);
    drop(input);
    let output = child.wait_with_output().expect("rdkv's output");
    (
        output.status.code().unwrap_or(-1),
        output.stdout,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The stderr of a failed command: exactly one line, no backtrace.
fn assert_one_line(stderr: &str) {
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
    assert!(stderr.starts_with("rdkv: "), "{stderr}");
}

#[test]
fn binary_keys_come_from_hex_files_and_stdin() {
    let cluster = Cluster::start("binary");
    let key = [0x00, 0xff, 0x0a];
    let (code, _, stderr) = cluster.rdkv(
        &["put", "--key-hex", "00ff0a", "--value-hex", "de00ad"],
        b"",
    );
    assert_eq!(code, 0, "{stderr}");

    // Piped, the raw value is exact: no newline added.
    let (code, stdout, _) = cluster.rdkv(&["get", "--key-hex", "00FF0A"], b"");
    assert_eq!((code, stdout), (0, vec![0xde, 0x00, 0xad]));
    let (code, stdout, _) = cluster.rdkv(&["get", "--key-hex", "0x00ff0a", "--hex"], b"");
    assert_eq!((code, stdout), (0, b"de00ad\n".to_vec()));

    let key_file = cluster.directory.join("key.bin");
    std::fs::write(&key_file, key).expect("write the key file");
    let key_path = key_file.to_str().expect("utf-8 path");
    let (code, stdout, _) = cluster.rdkv(&["get", "--key-file", key_path, "--hex"], b"");
    assert_eq!((code, stdout), (0, b"de00ad\n".to_vec()));
    // The key from stdin, exactly (its trailing newline is part of it).
    let (code, stdout, _) = cluster.rdkv(&["get", "--key-file", "-", "--hex"], &key);
    assert_eq!((code, stdout), (0, b"de00ad\n".to_vec()));

    // The key from a file and the value from stdin.
    let (code, _, stderr) = cluster.rdkv(&["put", "--key-file", key_path], b"from stdin");
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, _) = cluster.rdkv(&["get", "--key-hex", "00ff0a"], b"");
    assert_eq!((code, stdout), (0, b"from stdin".to_vec()));

    let (code, _, stderr) = cluster.rdkv(&["del", "--key-file", "-"], &key);
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, stderr) = cluster.rdkv(&["get", "--key-hex", "00ff0a"], b"");
    assert_eq!((code, stdout.as_slice()), (1, &b""[..]), "not found");
    assert_eq!(stderr, "rdkv: 0x00ff0a: not found\n");
    let (code, _, _) = cluster.rdkv(&["del", "--key-hex", "00ff0a"], b"");
    assert_eq!(code, 1, "not found");
}

#[test]
fn key_and_value_cannot_both_claim_stdin() {
    let cluster = Cluster::start("stdin");
    for command in ["put", "insert"] {
        let (code, _, stderr) = cluster.rdkv(&[command, "--key-file", "-"], b"key");
        assert_eq!(code, 2, "{stderr}");
        assert_one_line(&stderr);
        assert!(stderr.contains("cannot both come from stdin"), "{stderr}");
    }
    let (code, _, stderr) = cluster.rdkv(&["put", "--key-file", "-", "value"], b"key");
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, _) = cluster.rdkv(&["get", "key"], b"");
    assert_eq!((code, stdout), (0, b"value".to_vec()));
}

#[test]
fn insert_and_cas_report_the_value_present() {
    let cluster = Cluster::start("insert");
    assert_eq!(cluster.rdkv(&["insert", "lock", "ada"], b"").0, 0);
    let (code, stdout, stderr) = cluster.rdkv(&["insert", "lock", "grace"], b"");
    assert_eq!((code, stdout), (1, b"ada".to_vec()), "{stderr}");
    assert!(stderr.contains("lock: present"), "{stderr}");
    let (code, stdout, _) = cluster.rdkv(&["insert", "lock", "grace", "--hex"], b"");
    assert_eq!((code, stdout), (1, b"616461\n".to_vec()));

    let (code, _, stderr) = cluster.rdkv(&["cas", "lock", "grace", "linus", "--hex"], b"");
    assert_eq!(code, 1, "not swapped");
    assert!(stderr.contains("the value is 616461 (hex)"), "{stderr}");
    let (code, _, stderr) = cluster.rdkv(&["cas", "--value-hex", "lock", "616461", "00"], b"");
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, _) = cluster.rdkv(&["get", "lock", "--hex"], b"");
    assert_eq!((code, stdout), (0, b"00\n".to_vec()));
    let (code, _, stderr) = cluster.rdkv(&["cas", "absent", "x", "y"], b"");
    assert_eq!(code, 1);
    assert!(stderr.contains("the key is absent"), "{stderr}");
}

#[test]
fn errors_are_one_line_with_exit_code_two() {
    let cluster = Cluster::start("errors");
    let (code, _, stderr) = cluster.rdkv(&["get", "--key-hex", "0g"], b"");
    assert_eq!(code, 2, "{stderr}");
    assert_one_line(&stderr);
    assert!(
        stderr.contains("--key-hex") && stderr.contains("not hexadecimal"),
        "{stderr}"
    );

    let (code, _, stderr) = cluster.rdkv(&["get", "--key-file", "/nonexistent/key"], b"");
    assert_eq!(code, 2, "{stderr}");
    assert_one_line(&stderr);
    assert!(stderr.contains("No such file"), "the cause: {stderr}");

    let (code, _, stderr) = run_rdkv(&["--config", "/nonexistent/cluster.toml", "get", "k"], b"");
    assert_eq!(code, 2, "{stderr}");
    assert_one_line(&stderr);
    assert!(stderr.contains("No such file"), "the cause: {stderr}");

    // A node that is not listening: the operation and the cause, on one line. The address is
    // reserved (bound, never listened on) until the end of the test, so no other test's
    // listener can take it meanwhile (`rdkv_common::ports`).
    let reserved = ReservedPorts::loopback(1).expect("reserve a loopback port");
    let closed_port = reserved.addresses()[0];
    let text = std::fs::read_to_string(&cluster.file).expect("read the cluster file");
    let control_line = text
        .lines()
        .find(|line| line.starts_with("control_address"))
        .expect("a control address");
    let down = cluster.directory.join("down.toml");
    std::fs::write(
        &down,
        text.replace(
            control_line,
            &format!("control_address = \"{closed_port}\""),
        ),
    )
    .expect("write the cluster file");
    let (code, _, stderr) = run_rdkv(
        &["--config", down.to_str().expect("utf-8 path"), "get", "k"],
        b"",
    );
    assert_eq!(code, 2, "{stderr}");
    assert_one_line(&stderr);
    assert!(
        stderr.starts_with("rdkv: get k: node unreachable"),
        "{stderr}"
    );
}

#[test]
fn help_documents_the_exit_codes_and_the_key_flags() {
    let (code, stdout, _) = run_rdkv(&["--help"], b"");
    let help = String::from_utf8_lossy(&stdout);
    assert_eq!(code, 0);
    assert!(help.contains("Exit codes:"), "{help}");
    let (code, stdout, _) = run_rdkv(&["get", "--help"], b"");
    let help = String::from_utf8_lossy(&stdout);
    assert_eq!(code, 0);
    assert!(help.contains("--key-hex") && help.contains("--key-file") && help.contains("--hex"));
}

/// `rdkv stats` with a wrong secret says the node refused the secret (`auth failed`, as
/// `rdkv-cluster status` does), not that it is down.
#[test]
fn stats_with_a_wrong_secret_says_auth_failed() {
    let cluster = Cluster::start("stats-secret");
    let text = std::fs::read_to_string(&cluster.file).expect("the cluster file");
    let wrong = cluster.directory.join("wrong-secret.toml");
    std::fs::write(&wrong, text.replace(SECRET, "not-the-cluster-secret")).expect("write");
    let (code, stdout, _stderr) = run_rdkv(
        &["--config", wrong.to_str().expect("utf-8 path"), "stats"],
        b"",
    );
    let stdout = String::from_utf8_lossy(&stdout);
    assert_eq!(code, 2, "{stdout}");
    let row = stdout
        .lines()
        .find(|line| line.starts_with("1 "))
        .unwrap_or_else(|| panic!("no row for node 1: {stdout}"));
    assert!(row.contains("auth failed"), "{row}");
    assert!(!row.contains(" down "), "{row}");
}

/// A reader that closes the pipe early (`rdkv get KEY | head -c 1`, `| true`) wanted no more:
/// `get` ends quietly with exit 0, as every other output does (it printed `Broken pipe` and
/// exited 2).
#[test]
fn a_closed_pipe_ends_get_quietly_with_exit_0() {
    let cluster = Cluster::start("pipe");
    let value = vec![b'v'; 16_000];
    let (code, _, stderr) = cluster.rdkv(&["put", "piped"], &value);
    assert_eq!(code, 0, "{stderr}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rdkv"))
        .args([
            "--config",
            cluster.file.to_str().expect("utf-8 path"),
            "get",
            "piped",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run rdkv");
    // The reader goes before rdkv writes: its write meets a closed pipe.
    drop(child.stdout.take());
    let output = child.wait_with_output().expect("rdkv's output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}
