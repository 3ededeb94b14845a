//! A shutdown that waits names what it waits for: past one second, the server logs once a
//! second `shutdown still waiting` with `waiting_for=` each open connection and its step, and
//! it still ends within its bound. A teardown held for 2.5 s (`ServerConfig::teardown_stall`,
//! as slow as a verbs drain can be) keeps a data client's connection open through the wait.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientConfig};
use rdkv_fabric::Backend;
use rdkv_server::server::SHUTDOWN_BOUND;
use rdkv_server::ServerConfig;

const SECRET: &[u8] = b"shutdown-test-secret";

/// The server's log, written by a `tracing` subscriber.
#[derive(Clone, Default)]
struct CapturedLog(Arc<Mutex<Vec<u8>>>);

impl CapturedLog {
    fn lines(&self) -> Vec<String> {
        let bytes = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Write for CapturedLog {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One runtime thread: the subscriber below is this thread's, and the server's shutdown logs
/// from it (the stalled teardown itself sleeps on the blocking pool).
#[tokio::test(flavor = "current_thread")]
async fn a_slow_shutdown_names_the_connection_it_waits_for_and_ends_within_its_bound() {
    let log = CapturedLog::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _subscriber = tracing::subscriber::set_default(subscriber);

    let stall = Duration::from_millis(2500);
    let mut config = ServerConfig::local(SECRET);
    config.teardown_stall = stall;
    let server = rdkv_server::start(config).await.expect("start server");
    let client = Client::connect(ClientConfig::new(
        server.control_address(),
        Backend::Soft,
        SECRET,
    ))
    .await
    .expect("connect");
    client.put(b"key", b"value").await.expect("put");

    let started = Instant::now();
    tokio::time::timeout(SHUTDOWN_BOUND + Duration::from_secs(2), server.shutdown())
        .await
        .expect("the shutdown ends within its bound");
    let took = started.elapsed();

    let lines = log.lines();
    let waiting: Vec<(usize, &String)> = lines
        .iter()
        .enumerate()
        .filter(|(_, line)| line.contains("shutdown still waiting"))
        .collect();
    // Held 2.5 s, the teardown outlasts the first one-second report.
    assert!(
        !waiting.is_empty(),
        "no `shutdown still waiting` in a shutdown of {took:?}:\n{}",
        lines.join("\n")
    );
    for (_, line) in &waiting {
        assert!(
            line.contains("waiting_for=connection 1 from 127.0.0.1:")
                && line.contains(": teardown: queue pair to ERROR, drain, revoke keys (for "),
            "the wait does not name the connection and its teardown step: {line}"
        );
    }
    // It then finished with every teardown, rather than giving up at the bound.
    let stopped = lines
        .iter()
        .position(|line| line.contains("server stopped"));
    assert!(
        stopped.is_some_and(|stopped| waiting.iter().all(|(index, _)| *index < stopped)),
        "no `server stopped` after the waits:\n{}",
        lines.join("\n")
    );
    assert!(
        !lines
            .iter()
            .any(|line| line.contains("shutdown bound reached")),
        "{}",
        lines.join("\n")
    );
    drop(client);
}
