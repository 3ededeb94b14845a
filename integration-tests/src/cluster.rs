//! A cluster launched from `examples/local-3node.toml` through the `rdkv-cluster` binary, on
//! ports reserved for it, for tests that need real node processes: detached ([`Cluster`]) or
//! with `up` in the foreground ([`ForegroundUp`]).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use rdkv_common::ports::ReservedPorts;

use crate::process::workspace_binary;

/// The example file with every port replaced by a reserved one, written into `directory`; and
/// the reservation, which the caller holds until the cluster is stopped.
///
/// The nodes' ports must be in the file before they start (each node dials its peers, clients
/// read it), so the nodes cannot bind port 0 themselves: the ports are bound to port 0 here and
/// held ([`ReservedPorts`]), and the nodes bind them alongside the reservation. No other
/// process can take one before a node binds it, or while `rdkv-cluster restart` has a node
/// down.
pub fn generate_cluster_file(directory: &Path) -> (PathBuf, ReservedPorts) {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/local-3node.toml");
    let mut text = std::fs::read_to_string(example).expect("read the example");
    let example_ports = [
        "7400", "7401", "7402", "7410", "7411", "7412", "7420", "7421", "7422",
    ];
    let reserved = ReservedPorts::loopback(example_ports.len()).expect("reserve loopback ports");
    for (port, reserved) in example_ports.iter().zip(reserved.ports()) {
        text = text.replace(&format!(":{port}\""), &format!(":{reserved}\""));
    }
    let path = directory.join("cluster.toml");
    std::fs::write(&path, text).expect("write the cluster file");
    // It holds the secret: readable by its owner only (else every command warns).
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod 600 the cluster file");
    (path, reserved)
}

/// Scrapes a node's metrics endpoint (`GET /metrics`, within 5 s) and parses every sample;
/// panics unless the answer is a 200 in Prometheus's text format.
pub fn scrape(address: SocketAddr) -> HashMap<String, f64> {
    let mut stream =
        TcpStream::connect_timeout(&address, Duration::from_secs(5)).expect("connect to metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("a read timeout");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: rdkv\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain"), "{head}");
    let mut samples = HashMap::new();
    for line in body
        .lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
    {
        let (name, value) = line.rsplit_once(' ').expect("name value");
        samples.insert(
            name.to_string(),
            value.parse::<f64>().expect("a numeric sample"),
        );
    }
    samples
}

/// Runs `rdkv-cluster` with `arguments`.
pub fn rdkv_cluster(arguments: &[&str]) -> std::process::Output {
    Command::new(workspace_binary("rdkv-cluster"))
        .args(arguments)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run rdkv-cluster")
}

/// Stops the cluster even if the test fails.
pub struct Cluster {
    /// The cluster file.
    pub file: PathBuf,
    /// The run directory.
    pub run_directory: PathBuf,
    /// The ports the file names, held until the nodes are stopped (dropped after `down`, as
    /// fields drop after `drop`).
    pub ports: ReservedPorts,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = rdkv_cluster(&[
            "down",
            self.file.to_str().unwrap_or_default(),
            "--run-dir",
            self.run_directory.to_str().unwrap_or_default(),
        ]);
        // RDKV_KEEP_TEST_DIRS=1 keeps the cluster file and the nodes' logs and data for a look.
        if std::env::var_os("RDKV_KEEP_TEST_DIRS").is_none() {
            let _ =
                std::fs::remove_dir_all(self.file.parent().unwrap_or(Path::new("/nonexistent")));
        }
    }
}

impl Cluster {
    /// Generates a cluster file from the example in a fresh directory named after `tag` and
    /// starts the cluster detached (`rdkv-cluster up --detach`); panics with its stderr if it
    /// does not start.
    pub fn up(tag: &str) -> Self {
        Self::up_with(tag, |text| text)
    }

    /// As [`Cluster::up`], with the generated file's text changed by `edit` first.
    pub fn up_with(tag: &str, edit: impl FnOnce(String) -> String) -> Self {
        let directory = std::env::temp_dir().join(format!("rdkv-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("directory");
        let (file, ports) = generate_cluster_file(&directory);
        let text = std::fs::read_to_string(&file).expect("read the generated file");
        std::fs::write(&file, edit(text)).expect("write the edited file");
        let run_directory = directory.join("run");
        let up = rdkv_cluster(&[
            "up",
            file.to_str().expect("utf-8 path"),
            "--detach",
            "--run-dir",
            run_directory.to_str().expect("utf-8 path"),
        ]);
        // Built first, so that a failed start still stops the nodes it started (its drop runs
        // as the panic unwinds: a node that never served kept running after the test).
        let cluster = Self {
            file,
            run_directory,
            ports,
        };
        assert!(
            up.status.success(),
            "up failed: {}{}",
            String::from_utf8_lossy(&up.stdout),
            String::from_utf8_lossy(&up.stderr)
        );
        cluster
    }
}

/// How many of `up`'s lines may wait in the channel for the test to read them.
const UP_LINES_QUEUED: usize = 10_000;

/// `rdkv-cluster up FILE --run-dir DIR` in the foreground, its stdout and stderr read line by
/// line; interrupted (SIGINT, as Ctrl-C) and waited for when dropped. (Pair it with a
/// [`Cluster`] made first, whose drop runs `down` after this one's.)
pub struct ForegroundUp {
    /// The `up` process.
    child: Child,
    /// Its lines, from one thread per pipe: lines of stdout and of stderr written close
    /// together may arrive in either order.
    lines: Receiver<String>,
    /// Every line received so far, for searching and for failure messages.
    pub transcript: Vec<String>,
}

impl ForegroundUp {
    /// Starts `up` in the foreground on the cluster file `file`.
    pub fn start(file: &Path, run_directory: &Path) -> Self {
        let mut child = Command::new(workspace_binary("rdkv-cluster"))
            .arg("up")
            .arg(file)
            .arg("--run-dir")
            .arg(run_directory)
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start rdkv-cluster up");
        let (sender, lines) = mpsc::sync_channel(UP_LINES_QUEUED);
        let stdout = child.stdout.take().expect("its stdout");
        let stderr = child.stderr.take().expect("its stderr");
        let pipes: [Box<dyn Read + Send>; 2] = [Box::new(stdout), Box::new(stderr)];
        for pipe in pipes {
            let sender = sender.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    if sender.send(line).is_err() {
                        return;
                    }
                }
            });
        }
        Self {
            child,
            lines,
            transcript: Vec::new(),
        }
    }

    /// The pid of the `up` process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The index in [`ForegroundUp::transcript`] of the first line at `from` or later that
    /// satisfies `wanted`, reading more lines for at most `bound`; panics with the transcript
    /// when none comes.
    pub fn wait_for_line(
        &mut self,
        from: usize,
        wanted: impl Fn(&str) -> bool,
        bound: Duration,
    ) -> usize {
        let deadline = Instant::now() + bound;
        let mut index = from;
        loop {
            while index < self.transcript.len() {
                if wanted(&self.transcript[index]) {
                    return index;
                }
                index += 1;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.transcript.push(line),
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no such line from up within {bound:?}:\n{}", self.text())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("up ended without such a line:\n{}", self.text())
                }
            }
        }
    }

    /// Sends SIGINT (Ctrl-C) and waits, at most `bound`, until `up` has exited and both its
    /// pipes are closed, reading every line; its exit status.
    pub fn interrupt(&mut self, bound: Duration) -> ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let deadline = Instant::now() + bound;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.transcript.push(line),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "up did not end within {bound:?} of SIGINT:\n{}",
                        self.text()
                    )
                }
            }
        }
        self.child.wait().expect("wait for up")
    }

    /// The transcript as one text.
    pub fn text(&self) -> String {
        self.transcript.join("\n")
    }
}

impl Drop for ForegroundUp {
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        // Stopping three nodes takes a fraction of a second; generous on a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            // Read on, so that `up` never waits on a full pipe.
            while self.lines.try_recv().is_ok() {}
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
