//! A frozen client cannot hold everyone's heap (`docs/protocol.md`, *Heap space*): one client
//! process is stopped with SIGSTOP for 15 s in the middle of a write load while another client
//! writes to a small heap. The node fences the stopped client's connection once it has held
//! reuse back, silent, past `heap_hold_limit` with the heap under pressure; the other writer's
//! operations keep succeeding all along (none fails on heap space); the stopped client, once
//! resumed, finds its connection gone and reconnects; and the history of each, checked, has
//! no write lost or doubled.
//!
//! The stopped client is this test binary run again as a child (`frozen_writer_process`, which
//! does nothing unless [`CHILD_ADDRESS`] is set). It writes keys of its own, so each process
//! checks the history of its keys on its own clock. No throughput is asserted here:
//! `scripts/frozen-client.sh` measures it (`docs/benchmarks.md`, *A frozen client*).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rand::{Rng, SeedableRng};
use rdkv_client::{Client, ClientConfig, SharedMemory};
use rdkv_fabric::Backend;
use rdkv_integration_tests::linearizability::{check, Event, Outcome, Verdict};
use rdkv_integration_tests::process::ServerProcess;
use rdkv_integration_tests::workload::{random_operation_sized, Mix};

const SECRET: &str = "frozen-client-secret";
/// The environment variable that makes `frozen_writer_process` the stopped client, naming the
/// node's control address.
const CHILD_ADDRESS: &str = "RDKV_FROZEN_WRITER";
/// Keys per writer; the child's are numbered from [`CHILD_KEYS_FROM`].
const KEYS: u64 = 8;
const CHILD_KEYS_FROM: u64 = 100;
/// Large values, so that the writers fill the 2 MiB heap within a second when nothing comes
/// back.
const VALUE_SIZE: usize = 1024;
/// Operations in flight per client.
const TASKS: u64 = 4;
/// How long the child stays stopped.
const STOPPED_FOR: Duration = Duration::from_secs(15);
/// Bounds: operations per task, and a whole writer's run.
const MAX_OPERATIONS_PER_TASK: u64 = 2_000_000;
const MAX_RUN: Duration = Duration::from_secs(120);
const MIX: Mix = Mix {
    gets: 20,
    puts: 60,
    deletes: 10,
};

/// One writer's load: [`TASKS`] tasks on `keys`, until `stop` or the bounds; returns the
/// checked-history events, the failures (may have applied, the error) and when each
/// operation that succeeded returned.
struct Load {
    events: Vec<Event>,
    failures: Vec<(bool, String, Instant)>,
    successes: Vec<Instant>,
    reconnected_successes: u64,
}

async fn write_load(client: Arc<Client>, keys_from: u64, stop: Arc<AtomicBool>) -> Load {
    let start = Instant::now();
    let unique = Arc::new(AtomicU64::new(keys_from << 40));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (client, stop, unique) = (client.clone(), stop.clone(), unique.clone());
        tasks.push(tokio::spawn(async move {
            let mut random = rand::rngs::StdRng::seed_from_u64(keys_from + task);
            let mut load = Load {
                events: Vec::new(),
                failures: Vec::new(),
                successes: Vec::new(),
                reconnected_successes: 0,
            };
            for _ in 0..MAX_OPERATIONS_PER_TASK {
                if stop.load(Ordering::Relaxed) || start.elapsed() > MAX_RUN {
                    break;
                }
                let key = keys_from + random.gen_range(0..KEYS);
                let value = unique.fetch_add(1, Ordering::Relaxed) + 1;
                let call = start.elapsed().as_nanos() as u64;
                let (operation, result) = random_operation_sized(
                    &client,
                    &mut random,
                    key,
                    value,
                    &load.events,
                    MIX,
                    VALUE_SIZE,
                )
                .await;
                let ret = start.elapsed().as_nanos() as u64;
                let outcome = match result {
                    Ok(outcome) => {
                        load.successes.push(Instant::now());
                        if client.counters().reconnects > 0 {
                            load.reconnected_successes += 1;
                        }
                        outcome
                    }
                    Err(error) => {
                        let applied = error.may_have_applied();
                        load.failures
                            .push((applied, error.to_string(), Instant::now()));
                        if !applied {
                            continue;
                        }
                        Outcome::Unknown
                    }
                };
                let ret = if outcome == Outcome::Unknown {
                    u64::MAX
                } else {
                    ret
                };
                load.events.push(Event {
                    key,
                    operation,
                    outcome,
                    call,
                    ret,
                });
            }
            load
        }));
    }
    let mut all = Load {
        events: Vec::new(),
        failures: Vec::new(),
        successes: Vec::new(),
        reconnected_successes: 0,
    };
    for task in tasks {
        let load = task.await.expect("a load task");
        all.events.extend(load.events);
        all.failures.extend(load.failures);
        all.successes.extend(load.successes);
        all.reconnected_successes += load.reconnected_successes;
    }
    all
}

/// A client of the node alone, over its soft fabric, with one connection (one announce word).
async fn connect(address: std::net::SocketAddr) -> Arc<Client> {
    let mut config = ClientConfig::new(address, Backend::Soft, SECRET.as_bytes());
    config.node.shared_memory = SharedMemory::Off;
    config.lanes = Some(1);
    config.concurrency = TASKS as usize;
    Arc::new(Client::connect(config).await.expect("connect"))
}

/// The stopped client, when run as the child of `a_stopped_client_is_fenced_and_the_other_writer_keeps_writing`:
/// writes until its stdin closes, then prints its history's verdict and its counts.
#[test]
fn frozen_writer_process() {
    let Ok(address) = std::env::var(CHILD_ADDRESS) else {
        return;
    };
    let address = address.parse().expect("a control address");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let stop = Arc::new(AtomicBool::new(false));
    let stop_on_eof = stop.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        while std::io::stdin()
            .read_line(&mut line)
            .is_ok_and(|read| read > 0)
        {
            line.clear();
        }
        stop_on_eof.store(true, Ordering::Relaxed);
    });
    runtime.block_on(async {
        let client = connect(address).await;
        client.put(b"child-ready", b"1").await.expect("a first put");
        println!("ready");
        let _ = std::io::stdout().flush();
        let load = write_load(client.clone(), CHILD_KEYS_FROM, stop).await;
        for (applied, error, _) in &load.failures {
            println!("failure may_have_applied={applied} {error}");
        }
        println!(
            "verdict {:?} operations={} reconnects={} reconnected_successes={}",
            check(&load.events),
            load.events.len(),
            client.counters().reconnects,
            load.reconnected_successes
        );
    });
}

/// The child writer: resumed, killed and reaped when dropped (a test that fails midway leaves
/// no stopped process behind).
struct ChildWriter {
    child: Child,
}

impl Drop for ChildWriter {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns the child writer on `address`; returns once it said it is ready.
fn spawn_child(
    address: std::net::SocketAddr,
) -> (ChildWriter, BufReader<std::process::ChildStdout>) {
    let mut writer = ChildWriter {
        child: Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "frozen_writer_process", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CHILD_ADDRESS, address.to_string())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the child writer"),
    };
    let mut output = BufReader::new(writer.child.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    loop {
        line.clear();
        let read = output.read_line(&mut line).expect("the child's output");
        assert!(read > 0, "the child writer ended before it was ready");
        // libtest prints the test's name on the same line.
        if line.trim_end().ends_with("ready") {
            return (writer, output);
        }
    }
}

async fn heap_fences(monitor: &Client) -> u64 {
    match &monitor.cluster_stats().await[..] {
        [(_, Ok(stats))] => stats.heap_fences,
        other => panic!("stats of the one node: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_client_is_fenced_and_the_other_writer_keeps_writing() {
    let server = ServerProcess::start(SECRET, &["--heap-size", "2M", "--chunk-size", "64K"]);
    let (mut child, mut child_output) = spawn_child(server.control_address);
    let pid = Pid::from_raw(child.child.id() as i32);
    let monitor = connect(server.control_address).await;

    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write_load(
        connect(server.control_address).await,
        0,
        stop.clone(),
    ));
    // Both write for a while; then the child is stopped in the middle of its load.
    tokio::time::sleep(Duration::from_secs(2)).await;
    kill(pid, Signal::SIGSTOP).expect("stop the child");
    let stopped_at = Instant::now();
    tokio::time::sleep(STOPPED_FOR).await;
    let fences_while_stopped = heap_fences(&monitor).await;
    kill(pid, Signal::SIGCONT).expect("resume the child");
    let resumed_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let load = writer.await.expect("the writer");

    drop(child.child.stdin.take());
    let mut report = String::new();
    let mut line = String::new();
    while child_output
        .read_line(&mut line)
        .expect("the child's output")
        > 0
    {
        report.push_str(&line);
        line.clear();
    }
    let status = child.child.wait().expect("the child's exit");
    eprintln!("{report}");

    assert!(
        fences_while_stopped >= 1,
        "the stopped client's connection was not fenced for holding the heap"
    );
    assert!(
        load.failures.is_empty(),
        "the other writer's operations failed: {:?}",
        load.failures
    );
    let while_stopped = load
        .successes
        .iter()
        .filter(|at| **at > stopped_at + Duration::from_secs(5) && **at < resumed_at)
        .count();
    assert!(
        while_stopped > 0,
        "the other writer finished nothing in the last 10 s of the stop"
    );
    assert_eq!(check(&load.events), Verdict::Linearizable);
    assert!(status.success(), "the child writer failed: {report}");
    assert!(
        report.contains("verdict Linearizable"),
        "the stopped client's history: {report}"
    );
    let reconnected = report
        .split_whitespace()
        .find_map(|word| word.strip_prefix("reconnected_successes="))
        .and_then(|count| count.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        reconnected > 0,
        "the stopped client did not reconnect and write again: {report}"
    );
    eprintln!(
        "other writer: {} operations, {while_stopped} in the last 10 s of the stop; {fences_while_stopped} heap fence(s)",
        load.events.len()
    );
}
