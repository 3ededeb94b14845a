//! Shutdown is bounded in every phase of a node's life (issue 15): a real `rdkv-server` gets
//! SIGTERM during start-up, with handshakes stalled, under client load and under status probes,
//! and must exit with status 0 well within its own bound (`SHUTDOWN_BOUND`, 10 s); so must a
//! node asked to stop by an authenticated `Shutdown` under load. Clients of a stopped node get
//! errors, never hangs. Only the bounds are timed; what the node logged is checked too.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientConfig};
use rdkv_common::protocol::{
    fetch_stats, read_frame, request_shutdown, MonitoredNode, ServerMessage,
};
use rdkv_fabric::Backend;
use rdkv_integration_tests::process::{ObservedServer, Stopped};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

const SECRET: &str = "shutdown-test-secret";
/// How long a node may take to exit after it is told to stop.
const EXIT_BOUND: Duration = Duration::from_secs(3);
/// Small tables: start-up and teardown have little to pin and unpin.
const SIZES: &[&str] = &["--heap-size", "16M", "--index-size", "1M"];
/// The deadline of each client operation and status probe: it ends a hang (with both cores
/// busy, a probe of a node logging at full pipe took over 2 s).
const OPERATION_DEADLINE: Duration = Duration::from_secs(10);
/// How long a load loop may run before it counts as hung.
const LOOP_BOUND: Duration = Duration::from_secs(30);
/// How many operations a load loop may run.
const LOOP_OPERATIONS: u64 = 1_000_000;
/// How long a load loop may take to end once the node is gone.
const LOOPS_END_BOUND: Duration = Duration::from_secs(10);

/// The log line of a node that stopped after all its teardowns.
const STOPPED_LINE: &str = "server stopped";
/// The log line of a node that gave up on some teardowns.
const BOUND_REACHED_LINE: &str = "shutdown bound reached";

/// The node at `address` (its id unchecked), with the secret.
fn monitored(address: SocketAddr) -> MonitoredNode<'static> {
    MonitoredNode {
        address,
        id: None,
        secret: SECRET.as_bytes(),
    }
}

/// Waits for the exit without holding up the runtime's other tasks (the load's loops).
fn wait_exit(server: &mut ObservedServer) -> Stopped {
    tokio::task::block_in_place(|| server.wait_exit(EXIT_BOUND))
}

/// Checks that the node stopped cleanly: status 0, after every teardown.
fn assert_stopped_in_order(stopped: &Stopped, phase: &str) {
    stopped.assert_exited_cleanly(phase);
    assert_eq!(
        stopped.lines_with(STOPPED_LINE),
        1,
        "{phase}: no `{STOPPED_LINE}`:\n{}",
        stopped.stderr
    );
    assert_eq!(
        stopped.lines_with(BOUND_REACHED_LINE),
        0,
        "{phase}: {}",
        stopped.stderr
    );
}

#[test]
fn sigterm_once_the_node_catches_it_during_start_up_exits_0() {
    let mut server = ObservedServer::spawn(SECRET, SIZES);
    // The earliest moment a SIGTERM can ask for a clean stop; the node is then most likely
    // still allocating and pinning its table, before its ready line.
    server.wait_until_catching_sigterm(Duration::from_secs(10));
    let stopped = server.terminate_and_wait(EXIT_BOUND);
    stopped.assert_exited_cleanly("start-up");
    assert_eq!(
        stopped.lines_with("signal received: shutting down"),
        1,
        "{}",
        stopped.stderr
    );
}

#[test]
fn sigterm_right_after_spawn_ends_the_process_within_the_bound() {
    use std::os::unix::process::ExitStatusExt;
    let mut server = ObservedServer::spawn(SECRET, SIZES);
    let stopped = server.terminate_and_wait(EXIT_BOUND);
    // Before the process installs its handler (while the dynamic loader runs, say), SIGTERM's
    // default action ends it; after, it stops cleanly. Either way it is gone within the bound.
    let status = stopped.status.unwrap_or_else(|| {
        panic!(
            "still running {EXIT_BOUND:?} after SIGTERM; its log:\n{}",
            stopped.stderr
        )
    });
    assert!(
        status.code() == Some(0) || status.signal() == Some(nix::libc::SIGTERM),
        "{status:?}; its log:\n{}",
        stopped.stderr
    );
}

/// Opens `count` connections to the control port, reads each one's Challenge, and never
/// answers.
async fn stalled_handshakes(address: SocketAddr, count: usize) -> Vec<TcpStream> {
    let mut streams = Vec::with_capacity(count);
    for _ in 0..count {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        let challenge = read_frame::<_, ServerMessage>(&mut stream)
            .await
            .expect("read the challenge");
        assert!(
            matches!(challenge, ServerMessage::Challenge { .. }),
            "{challenge:?}"
        );
        streams.push(stream);
    }
    streams
}

async fn sigterm_with_stalled_handshakes(count: usize) {
    let (mut server, address) = ObservedServer::start(SECRET, SIZES);
    let mut streams = stalled_handshakes(address, count).await;
    server.terminate();
    let stopped = wait_exit(&mut server);
    assert_stopped_in_order(&stopped, "handshake");
    // Each handshake was cancelled, logged with its reason, and its connection closed.
    assert_eq!(
        stopped.lines_with("the server is shutting down"),
        count,
        "{}",
        stopped.stderr
    );
    for stream in &mut streams {
        let after = read_frame::<_, ServerMessage>(stream).await;
        assert!(after.is_err(), "a frame after the challenge: {after:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_stalled_handshake_exits_0() {
    sigterm_with_stalled_handshakes(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_many_stalled_handshakes_exits_0() {
    sigterm_with_stalled_handshakes(16).await;
}

/// Loops of operations against a node, each ending at its first error (or, failing the test,
/// at a bound).
struct Load {
    /// Operations completed, over all loops.
    completed: Arc<AtomicU64>,
    /// Each loop; it returns its first error, or `None` when it hit a bound instead.
    loops: Vec<JoinHandle<Option<String>>>,
}

impl Load {
    /// `count` loops of `operation(loop_index, iteration)`.
    fn start<F, Fut>(count: usize, operation: F) -> Self
    where
        F: Fn(usize, u64) -> Fut + Send + Sync + Clone + 'static,
        Fut: std::future::Future<Output = Result<(), String>> + Send,
    {
        let completed = Arc::new(AtomicU64::new(0));
        let loops = (0..count)
            .map(|loop_index| {
                let completed = completed.clone();
                let operation = operation.clone();
                tokio::spawn(async move {
                    let started = Instant::now();
                    for iteration in 0..LOOP_OPERATIONS {
                        if started.elapsed() > LOOP_BOUND {
                            return None;
                        }
                        if let Err(error) = operation(loop_index, iteration).await {
                            return Some(error);
                        }
                        completed.fetch_add(1, Ordering::Relaxed);
                    }
                    None
                })
            })
            .collect();
        Self { completed, loops }
    }

    /// Waits until `operations` have completed: the load is running.
    async fn wait_for(&self, operations: u64) {
        let started = Instant::now();
        while self.completed.load(Ordering::Relaxed) < operations {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the load completed only {} operations",
                self.completed.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits for every loop, which must end with an error (the node is gone) within
    /// [`LOOPS_END_BOUND`].
    async fn assert_every_loop_fails(self, phase: &str) {
        for (index, handle) in self.loops.into_iter().enumerate() {
            let ended = tokio::time::timeout(LOOPS_END_BOUND, handle)
                .await
                .unwrap_or_else(|_| panic!("{phase}: loop {index} hangs on a stopped node"))
                .expect("the loop does not panic");
            assert!(
                ended.is_some(),
                "{phase}: loop {index} hit a bound instead of an error"
            );
        }
    }
}

/// `count` clients, each putting and getting its own keys in a loop.
async fn client_load(address: SocketAddr, count: usize) -> Load {
    let mut clients = Vec::with_capacity(count);
    for _ in 0..count {
        let mut config = ClientConfig::new(address, Backend::Soft, SECRET.as_bytes());
        config.concurrency = 2;
        config.operation_deadline = Some(OPERATION_DEADLINE);
        clients.push(Arc::new(Client::connect(config).await.expect("connect")));
    }
    let clients = Arc::new(clients);
    Load::start(count, move |client_index, iteration| {
        let clients = clients.clone();
        async move {
            let client = &clients[client_index];
            let key = format!("client-{client_index}-key-{}", iteration % 64);
            client
                .put(key.as_bytes(), &iteration.to_le_bytes())
                .await
                .map_err(|error| error.to_string())?;
            client
                .get(key.as_bytes())
                .await
                .map(|_| ())
                .map_err(|error| error.to_string())
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_client_load_exits_0_and_clients_get_errors() {
    let clients = 3;
    let (mut server, address) = ObservedServer::start(SECRET, SIZES);
    let load = client_load(address, clients).await;
    load.wait_for(300).await;
    server.terminate();
    let stopped = wait_exit(&mut server);
    assert_stopped_in_order(&stopped, "load");
    // Every client's sessions (a lane per tokio worker each) were ended by the shutdown, and
    // torn down before the exit.
    let sessions = stopped.lines_with("purpose=Data") + stopped.lines_with("purpose=Lane");
    assert!(sessions >= clients, "{}", stopped.stderr);
    assert_eq!(
        stopped.lines_with("reason=server shutting down"),
        sessions,
        "{}",
        stopped.stderr
    );
    load.assert_every_loop_fails("load").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_status_probes_exits_0_and_probes_get_errors() {
    let (mut server, address) = ObservedServer::start(SECRET, SIZES);
    let probes = Load::start(4, move |_, _| async move {
        fetch_stats(monitored(address), OPERATION_DEADLINE)
            .await
            .map(|_| ())
            .map_err(|error| error.to_string())
    });
    probes.wait_for(40).await;
    server.terminate();
    let stopped = wait_exit(&mut server);
    assert_stopped_in_order(&stopped, "status probes");
    probes.assert_every_loop_fails("status probes").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authenticated_shutdown_under_client_load_exits_0() {
    let (mut server, address) = ObservedServer::start(SECRET, SIZES);
    let load = client_load(address, 3).await;
    load.wait_for(300).await;
    let node_id = request_shutdown(monitored(address), OPERATION_DEADLINE)
        .await
        .expect("the node acknowledges the shutdown");
    assert_eq!(node_id, 1);
    let stopped = wait_exit(&mut server);
    assert_stopped_in_order(&stopped, "requested shutdown");
    assert_eq!(
        stopped.lines_with("shutdown requested over the control plane"),
        1,
        "{}",
        stopped.stderr
    );
    load.assert_every_loop_fails("requested shutdown").await;
}

/// A node whose stderr nobody reads (a launcher suspended with Ctrl-Z) still stops: its log
/// goes through a bounded queue that drops lines when the pipe is full, so no thread of the
/// node waits on the pipe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_log_pipe_is_full_still_stops() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    /// Kills the node if the test fails before it exits.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut guard = KillOnDrop(
        Command::new(rdkv_integration_tests::process::server_binary())
            .args(["--listen", "127.0.0.1:0", "--fabric-listen", "127.0.0.1:0"])
            .args(SIZES)
            .env("RDKV_SECRET", SECRET)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            // Piped and never read: 64 KiB and it is full.
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rdkv-server"),
    );
    let child = &mut guard.0;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("the ready line");
    let control: SocketAddr = line
        .split_whitespace()
        .find_map(|part| part.strip_prefix("control="))
        .and_then(|address| address.parse().ok())
        .expect("control= in the ready line");
    // Each probe logs two lines of about 200 bytes: 1,000 of them fill the pipe six times over.
    for _ in 0..1_000 {
        fetch_stats(monitored(control), OPERATION_DEADLINE)
            .await
            .expect("the node answers while its log pipe is full");
    }
    let signalled = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if signalled.elapsed() > EXIT_BOUND {
            let _ = child.kill();
            panic!("a node with a full log pipe did not stop within {EXIT_BOUND:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(status.success(), "{status}");
}
