//! Linearizability of a real `rdkv-server` process: 16 concurrent clients on 8 keys, a mix of
//! get, put, delete and compare-and-swap, at least 20,000 operations; the history must pass the
//! checker (whose own tests show that broken histories fail it).

use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rdkv_client::{CasOutcome, Client, ClientConfig};
use rdkv_common::fabric::Backend;
use rdkv_integration_tests::linearizability::{check, Event, Operation, Outcome, Verdict};
use rdkv_integration_tests::process::ServerProcess;

const CLIENTS: u64 = 16;
const KEYS: u64 = 8;
const OPERATIONS_PER_CLIENT: u64 = 1_250;

fn decode(value: Option<bytes::Bytes>) -> Option<u64> {
    value.map(|bytes| {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[..8]);
        u64::from_le_bytes(word)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_history_against_a_server_process_is_linearizable() {
    let server = ServerProcess::start(
        "linearizability",
        &["--heap-size", "32M", "--chunk-size", "256K"],
    );
    let start = Instant::now();
    let mut tasks = Vec::new();
    for client_index in 0..CLIENTS {
        let mut config =
            ClientConfig::new(server.control_address, Backend::Soft, b"linearizability");
        config.concurrency = 1;
        let client = Arc::new(Client::connect(config).await.expect("connect"));
        tasks.push(tokio::spawn(async move {
            let mut random = rand::rngs::StdRng::seed_from_u64(client_index);
            let mut events = Vec::new();
            let mut last_seen = [0u64; KEYS as usize];
            for counter in 0..OPERATIONS_PER_CLIENT {
                let key = random.gen_range(0..KEYS);
                let key_bytes = format!("key-{key}");
                let unique = (client_index << 32) | (counter + 1);
                let choice = random.gen_range(0..100);
                let call = start.elapsed().as_nanos() as u64;
                let (operation, outcome, call) = if choice < 40 {
                    let value = decode(client.get(key_bytes.as_bytes()).await.expect("get"));
                    if let Some(value) = value {
                        last_seen[key as usize] = value;
                    }
                    (Operation::Get, Outcome::Value(value), call)
                } else if choice < 70 {
                    client
                        .put(key_bytes.as_bytes(), &unique.to_le_bytes())
                        .await
                        .expect("put");
                    (Operation::Put(unique), Outcome::Written, call)
                } else if choice < 82 {
                    let existed = client.delete(key_bytes.as_bytes()).await.expect("delete");
                    (Operation::Delete, Outcome::Deleted(existed), call)
                } else {
                    // Read-modify-write: read, then swap what was read (the read is an event too).
                    let value = decode(client.get(key_bytes.as_bytes()).await.expect("get"));
                    let read_at = start.elapsed().as_nanos() as u64;
                    events.push(Event {
                        key,
                        operation: Operation::Get,
                        outcome: Outcome::Value(value),
                        call,
                        ret: read_at,
                    });
                    if let Some(value) = value {
                        last_seen[key as usize] = value;
                    }
                    let expected = last_seen[key as usize];
                    let call = start.elapsed().as_nanos() as u64;
                    let outcome = client
                        .compare_and_swap(
                            key_bytes.as_bytes(),
                            &expected.to_le_bytes(),
                            &unique.to_le_bytes(),
                        )
                        .await
                        .expect("compare_and_swap");
                    let outcome = match outcome {
                        CasOutcome::Swapped => Outcome::Swapped,
                        CasOutcome::Mismatch(current) => Outcome::Mismatch(decode(current)),
                    };
                    (
                        Operation::CompareAndSwap {
                            expected,
                            new: unique,
                        },
                        outcome,
                        call,
                    )
                };
                let ret = start.elapsed().as_nanos() as u64;
                events.push(Event {
                    key,
                    operation,
                    outcome,
                    call,
                    ret,
                });
            }
            events
        }));
    }
    let mut history = Vec::new();
    for task in tasks {
        history.extend(task.await.expect("client task"));
    }
    assert!(history.len() as u64 >= CLIENTS * OPERATIONS_PER_CLIENT);
    assert!(history.len() >= 20_000);
    let swaps = history
        .iter()
        .filter(|event| event.outcome == Outcome::Swapped)
        .count();
    let deletes = history
        .iter()
        .filter(|event| event.outcome == Outcome::Deleted(true))
        .count();
    assert!(
        swaps > 100 && deletes > 100,
        "the mix exercised CAS ({swaps}) and delete ({deletes})"
    );
    let checked = Instant::now();
    assert_eq!(check(&history), Verdict::Linearizable);
    eprintln!(
        "{} operations in {:?}, checked in {:?}; server pid {}",
        history.len(),
        checked.duration_since(start),
        checked.elapsed(),
        server.id()
    );
}
