//! Real `rdkv-server` processes for tests: started on port 0, ready when they print their
//! ready line (no sleeping), killed when dropped.
//!
//! [`ServerProcess`] logs only warnings, to the test's stderr. [`ObservedServer`] captures its
//! info log, can be signalled at any point of its life (even before it is ready), and reports
//! how it stopped: exit status, time from the signal, and what it logged.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A workspace binary next to this test executable (`target/<profile>/NAME`). `cargo test
/// --workspace` builds `rdkv-server` and `rdkv-cluster` because their packages have
/// integration tests.
pub fn workspace_binary(name: &str) -> PathBuf {
    let executable = std::env::current_exe().expect("the test executable's path");
    let profile_directory = executable
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps");
    let binary = profile_directory.join(name);
    assert!(
        binary.exists(),
        "{} is missing: build it with `cargo build --workspace --bins` (cargo test --workspace does)",
        binary.display()
    );
    binary
}

/// The `rdkv-server` binary.
pub fn server_binary() -> PathBuf {
    workspace_binary("rdkv-server")
}

/// Raises this process's open-files soft limit to the hard one, for tests that hold
/// thousands of sockets (a flood, a thousand clients); panics if the hard limit is under 4,096.
pub fn raise_open_files() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("setrlimit");
    assert!(
        hard >= 4_096,
        "the test needs 4,096 open files; the hard limit is {hard}"
    );
}

/// A running server process.
pub struct ServerProcess {
    /// The child.
    child: Child,
    /// Its control address.
    pub control_address: SocketAddr,
    /// Its soft NIC address.
    pub fabric_address: SocketAddr,
}

/// A Unix-socket path for a test's shm fabric, unique in this process (in the temporary
/// directory; a stale file from an earlier run is replaced by the node).
pub fn shm_socket_path(name: &str) -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "rdkv-test-{name}-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ))
}

impl ServerProcess {
    /// Starts `rdkv-server` on loopback with port 0 and `extra` arguments, and waits for its
    /// ready line.
    pub fn start(secret: &str, extra: &[&str]) -> Self {
        Self::start_at(secret, "127.0.0.1:0", "127.0.0.1:0", extra)
    }

    /// Starts `rdkv-server` on the given control and fabric addresses (to restart a node where
    /// it was), with `extra` arguments, and waits for its ready line.
    pub fn start_at(secret: &str, control: &str, fabric: &str, extra: &[&str]) -> Self {
        let mut command = Command::new(server_binary());
        command
            .args(["--listen", control, "--fabric-listen", fabric])
            .args(extra);
        Self::start_command(secret, command)
    }

    /// Starts `command`, which runs `rdkv-server` (through a shell that sets a limit, say),
    /// with the secret in its environment, and waits for its ready line.
    pub fn start_command(secret: &str, mut command: Command) -> Self {
        let mut child = command
            .env("RDKV_SECRET", secret)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rdkv-server");
        let stdout = child.stdout.take().expect("piped stdout");
        let (control_address, fabric_address) = read_ready_line(&mut BufReader::new(stdout));
        Self {
            child,
            control_address,
            fabric_address,
        }
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads the server's ready line and returns its control and fabric addresses; panics with the
/// line if it is not one (the process exited before it was ready, say).
fn read_ready_line(stdout: &mut impl BufRead) -> (SocketAddr, SocketAddr) {
    let mut line = String::new();
    stdout.read_line(&mut line).expect("read the ready line");
    let field = |name: &str| -> SocketAddr {
        line.split_whitespace()
            .find_map(|part| part.strip_prefix(name))
            .and_then(|address| address.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in the ready line `{line}`"))
    };
    (field("control="), field("fabric="))
}

/// How an [`ObservedServer`] stopped.
#[derive(Debug)]
pub struct Stopped {
    /// Its exit status; `None` when it was still running at the bound (it was then killed).
    pub status: Option<ExitStatus>,
    /// From the wait's start (just after the signal) to the exit, or to the bound.
    pub after: Duration,
    /// Everything it wrote to stderr (its log).
    pub stderr: String,
}

impl Stopped {
    /// Panics, with the log, unless the process exited with status 0.
    pub fn assert_exited_cleanly(&self, phase: &str) {
        assert!(
            self.status.is_some_and(|status| status.code() == Some(0)),
            "{phase}: the node did not exit with status 0 in time: {:?} after {:?}; its log:\n{}",
            self.status,
            self.after,
            self.stderr
        );
    }

    /// How many lines of the log contain `text`.
    pub fn lines_with(&self, text: &str) -> usize {
        self.stderr
            .lines()
            .filter(|line| line.contains(text))
            .count()
    }
}

/// An `rdkv-server` process whose info log (stderr) is captured on a thread, so the child never
/// blocks on a full pipe, and that a test stops with SIGTERM at any point of its life. Killed
/// when dropped, if still running.
pub struct ObservedServer {
    /// The child.
    child: Child,
    /// Its stdout, where the ready line appears; taken by [`ObservedServer::wait_ready`].
    stdout: Option<BufReader<ChildStdout>>,
    /// Its stderr so far.
    log: Arc<Mutex<String>>,
    /// Reads stderr into `log` until the process closes it (exits).
    log_reader: Option<JoinHandle<()>>,
}

impl ObservedServer {
    /// Spawns `rdkv-server` on loopback with port 0 and `extra` arguments, logging at INFO
    /// and each session's lines (DEBUG: `client authenticated`, `connection closed`) too;
    /// returns at once, without waiting for it to be ready.
    pub fn spawn(secret: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(server_binary())
            .args(["--listen", "127.0.0.1:0", "--fabric-listen", "127.0.0.1:0"])
            .args(extra)
            .env("RDKV_SECRET", secret)
            .env("RUST_LOG", "info,rdkv_server::session=debug")
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rdkv-server");
        let stdout = child.stdout.take().map(BufReader::new);
        let mut stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let captured = log.clone();
        let log_reader = std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            while let Ok(read) = stderr.read(&mut buffer) {
                if read == 0 {
                    return;
                }
                captured
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push_str(&String::from_utf8_lossy(&buffer[..read]));
            }
        });
        Self {
            child,
            stdout,
            log,
            log_reader: Some(log_reader),
        }
    }

    /// Spawns it (as [`ObservedServer::spawn`]) and waits for its ready line; returns it and
    /// its control address.
    pub fn start(secret: &str, extra: &[&str]) -> (Self, SocketAddr) {
        let mut server = Self::spawn(secret, extra);
        let control_address = server.wait_ready();
        (server, control_address)
    }

    /// Waits for the ready line and returns the control address.
    ///
    /// # Panics
    /// When called twice, or when the process exits before it is ready.
    pub fn wait_ready(&mut self) -> SocketAddr {
        let mut stdout = self.stdout.take().expect("wait_ready is called once");
        read_ready_line(&mut stdout).0
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has a handler installed for SIGTERM (the `SigCgt` mask of
    /// `/proc/PID/status`): a SIGTERM from now on asks it to stop rather than killing it.
    pub fn catches_sigterm(&self) -> bool {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", self.id())) else {
            return false;
        };
        let sigterm_bit = 1u64 << (nix::sys::signal::Signal::SIGTERM as u64 - 1);
        status
            .lines()
            .find_map(|line| line.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & sigterm_bit != 0)
    }

    /// Waits, checking every millisecond, until the process catches SIGTERM; panics past
    /// `bound`.
    pub fn wait_until_catching_sigterm(&self, bound: Duration) {
        let started = Instant::now();
        while !self.catches_sigterm() {
            assert!(
                started.elapsed() < bound,
                "rdkv-server installed no SIGTERM handler within {bound:?}; its log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let pid = i32::try_from(self.id()).expect("a pid fits in pid_t");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("send SIGTERM to rdkv-server");
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Waits up to `bound` for the process to exit (checking every 10 ms); past it, kills it.
    /// Returns how it stopped, with its whole log.
    pub fn wait_exit(&mut self, bound: Duration) -> Stopped {
        let started = Instant::now();
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if started.elapsed() < bound => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
            }
        };
        let after = started.elapsed();
        // The process is gone, so its stderr is at its end: the reader finishes promptly.
        if let Some(reader) = self.log_reader.take() {
            let _ = reader.join();
        }
        Stopped {
            status,
            after,
            stderr: self.log(),
        }
    }

    /// Sends SIGTERM and waits up to `bound` for the exit, as [`ObservedServer::wait_exit`].
    pub fn terminate_and_wait(&mut self, bound: Duration) -> Stopped {
        self.terminate();
        self.wait_exit(bound)
    }
}

impl Drop for ObservedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
