//! Histories of writes and deletes against a cluster, and the check that after stops,
//! crashes and restarts every key reads as its last acknowledged operation left it, or as one of
//! the operations after it that failed (it may have applied): shared by the tests that attack
//! whole-cluster stops (`tests/stop_attack.rs`, `tests/leave_order_attack.rs`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_client::Client;

use crate::cluster::Cluster;
use crate::view::{pid_of, signal, state_of, wait_for_view, wait_torn_down, Nodes};

/// One operation on a key and whether it returned Ok.
#[derive(Debug, Clone)]
pub struct Op {
    /// `Some(value)`: a put; `None`: a delete.
    pub value: Option<Vec<u8>>,
    /// Whether it returned Ok (acknowledged).
    pub ok: bool,
}

/// Each key's operations, in order.
pub type History = BTreeMap<Vec<u8>, Vec<Op>>;

/// The key `index` of writer `writer`.
pub fn key_of(writer: usize, index: usize) -> Vec<u8> {
    format!("a38-{writer}-{index:05}").into_bytes()
}

/// Writes `keys` keys first (every put must succeed), then overwrites/deletes them round robin
/// until `stop` or `bound`; returns each key's history.
pub async fn writer(
    client: Arc<Client>,
    writer: usize,
    keys: usize,
    stop: Arc<AtomicBool>,
    bound: Duration,
    max_ops: usize,
) -> History {
    let mut history = History::new();
    for index in 0..keys {
        let key = key_of(writer, index);
        let value = format!("init-{writer}-{index}").into_bytes();
        client.put(&key, &value).await.expect("initial put");
        history.entry(key).or_default().push(Op {
            value: Some(value),
            ok: true,
        });
    }
    let started = Instant::now();
    let mut sequence = 0usize;
    while !stop.load(Ordering::Acquire) && started.elapsed() < bound && sequence < max_ops {
        let index = sequence % keys;
        let key = key_of(writer, index);
        let op = if sequence % 7 == 3 {
            let ok = client.delete(&key).await.is_ok();
            Op { value: None, ok }
        } else {
            let value = format!("v{sequence}-{writer}-{index}").into_bytes();
            let ok = client.put(&key, &value).await.is_ok();
            Op {
                value: Some(value),
                ok,
            }
        };
        if !op.ok {
            // Do not spin on a stopped cluster.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        history.entry(key).or_default().push(op);
        sequence += 1;
    }
    history
}

/// The values a key may read as: its last acknowledged operation's, or any later one's.
pub fn acceptable(ops: &[Op]) -> Vec<Option<Vec<u8>>> {
    let last_ok = ops.iter().rposition(|op| op.ok);
    let mut states = Vec::new();
    match last_ok {
        Some(index) => {
            states.push(ops[index].value.clone());
            for op in &ops[index + 1..] {
                states.push(op.value.clone());
            }
        }
        None => {
            states.push(None);
            for op in ops {
                states.push(op.value.clone());
            }
        }
    }
    states
}

/// A value as a short line (`absent` for none).
pub fn shown(value: Option<&[u8]>) -> String {
    value.map_or("absent".into(), |bytes| {
        String::from_utf8_lossy(bytes).chars().take(32).collect()
    })
}

/// The keys that read as no acceptable state, with a description each.
pub async fn wrong_keys(cluster: &Cluster, history: &History) -> Vec<String> {
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut wrong = Vec::new();
    for (key, ops) in history {
        let mut tries = 0;
        let read = loop {
            tries += 1;
            match client.get(key).await {
                Ok(read) => break read,
                Err(error) if tries < 20 => {
                    let _ = error;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(error) => panic!("get {}: {error}", String::from_utf8_lossy(key)),
            }
        };
        let states = acceptable(ops);
        if !states
            .iter()
            .any(|state| state.as_deref() == read.as_deref())
        {
            let last_ok = ops.iter().rposition(|op| op.ok);
            wrong.push(format!(
                "{} read {}, last acked {} (op {:?} of {}), later unacked {}",
                String::from_utf8_lossy(key),
                shown(read.as_deref()),
                last_ok.map_or("none".into(), |index| shown(ops[index].value.as_deref())),
                last_ok,
                ops.len(),
                last_ok.map_or(ops.len(), |index| ops.len() - index - 1)
            ));
        }
    }
    client.close().await;
    wrong
}

/// Fails, counting the deleted keys back and the acknowledged values read absent, when
/// [`wrong_keys`] found any.
pub fn assert_none_wrong(wrong: &[String], total: usize, what: &str) {
    let resurrected = wrong
        .iter()
        .filter(|line| line.contains("last acked absent"))
        .count();
    let lost = wrong
        .iter()
        .filter(|line| line.contains(" read absent,"))
        .count();
    let lost_examples: Vec<&String> = wrong
        .iter()
        .filter(|line| !line.contains("last acked absent"))
        .take(4)
        .collect();
    assert!(
        wrong.is_empty(),
        "{what}: {} of {total} keys wrong ({resurrected} deleted keys back, {lost} acked values read absent, {} others), first {:?}; non-resurrections {:?}",
        wrong.len(),
        wrong.len() - resurrected - lost,
        &wrong[..wrong.len().min(4)],
        lost_examples
    );
}

/// Starts `writers` writers of `keys` keys each on one shared client; returns their handles.
pub fn start_writers(
    client: &Arc<Client>,
    writers: usize,
    keys: usize,
    stop: &Arc<AtomicBool>,
    bound: Duration,
) -> Vec<tokio::task::JoinHandle<History>> {
    (0..writers)
        .map(|index| {
            tokio::spawn(writer(
                client.clone(),
                index,
                keys,
                stop.clone(),
                bound,
                200_000,
            ))
        })
        .collect()
}

/// Waits for every writer; their histories together.
pub async fn join_writers(handles: Vec<tokio::task::JoinHandle<History>>) -> History {
    let mut all = History::new();
    for handle in handles {
        all.extend(handle.await.expect("writer"));
    }
    all
}

/// Operations, and of them the failed ones.
pub fn summary(history: &History) -> (usize, usize) {
    let ops: usize = history.values().map(Vec::len).sum();
    let failed: usize = history
        .values()
        .map(|ops| ops.iter().filter(|op| !op.ok).count())
        .sum();
    (ops, failed)
}

/// Puts `first-INDEX` into 300 keys of `writer` (each must succeed): their history.
pub async fn write_first(client: &Client, writer: usize) -> History {
    let mut history = History::new();
    for index in 0..300 {
        let key = key_of(writer, index);
        let value = format!("first-{index}").into_bytes();
        client.put(&key, &value).await.expect("put");
        history.entry(key).or_default().push(Op {
            value: Some(value),
            ok: true,
        });
    }
    history
}

/// Deletes the even keys of [`write_first`]'s and overwrites the odd ones with
/// `second-INDEX`, recording each outcome in `history`.
pub async fn delete_or_overwrite(client: &Client, writer: usize, history: &mut History) {
    for index in 0..300 {
        let key = key_of(writer, index);
        let op = if index % 2 == 0 {
            let ok = client.delete(&key).await.is_ok();
            Op { value: None, ok }
        } else {
            let value = format!("second-{index}").into_bytes();
            let ok = client.put(&key, &value).await.is_ok();
            Op {
                value: Some(value),
                ok,
            }
        };
        history.entry(key).or_default().push(op);
    }
}

/// SIGTERM of node `id`; waits until its process is gone and `observer`'s view has it down,
/// and with `new_leader`, under another leader (the next node's leave needs one to commit it).
/// Without `new_leader` (a stop that leaves less than a majority running: its leave needs its
/// own vote within the node's 2 s bound, which a loaded machine can miss, and nothing commits
/// it later), a leave that was not committed is said and the test goes on: the view then keeps
/// the node serving, and the writes of its keys fail.
pub async fn stop_and_wait_down(
    cluster: &Cluster,
    nodes: &Nodes,
    secret: &[u8],
    id: u32,
    observer: u32,
    new_leader: bool,
) {
    signal(cluster, id, Signal::SIGTERM);
    wait_torn_down(pid_of(cluster, id), Duration::from_secs(20));
    let limit = Duration::from_secs(if new_leader { 30 } else { 10 });
    let seen = wait_for_view(nodes, secret, observer, limit, |view| {
        state_of(view, id) == Some(rdkv_common::protocol::MemberState::Down)
            && (!new_leader || view.leader.is_some_and(|leader| leader != id))
    })
    .await;
    match seen {
        Ok(_) => {}
        Err(last) if new_leader => {
            panic!("node {observer} never saw node {id} down under another leader; last: {last:?}")
        }
        Err(last) => {
            eprintln!("node {id}'s leave was not committed; node {observer}'s view: {last:?}")
        }
    }
}
