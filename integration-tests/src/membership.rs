//! Membership changes seen by tests (`tests/membership.rs`, `tests/membership_failures.rs`):
//! three nodes with a fourth listed in their cluster file, a checked load of separate clients,
//! preloaded keys read back, and the `rdkv-cluster add-node` / `remove-node` commands.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rdkv_client::{Client, ClientBuilder};
use rdkv_common::ports::ReservedPorts;
use rdkv_common::protocol::MemberState;

use crate::cluster::{rdkv_cluster, Cluster};
use crate::linearizability::{Event, Outcome};
use crate::view::{state_of, up_settled_edited, wait_for_view, Nodes};
use crate::workload::{random_operation, Mix};

/// Keys of the checked load (`key-0` …).
pub const KEYS: u64 = 24;

/// A `[[node]]` section for node 4 on reserved ports.
pub fn fourth_node(ports: &ReservedPorts) -> String {
    let ports = ports.ports();
    format!(
        "\n[[node]]\nid = 4\ncontrol_address = \"127.0.0.1:{}\"\nfabric_address = \"127.0.0.1:{}\"\nmetrics_address = \"127.0.0.1:{}\"\nindex_size = \"1M\"\nheap_size = \"4M\"\nchunk_size = \"256K\"\nhugepages = \"auto\"\n",
        ports[0], ports[1], ports[2]
    )
}

/// What one load client saw.
#[derive(Default)]
pub struct Seen {
    /// Its operations, as the checker's events (an operation that may have applied: `Unknown`).
    pub events: Vec<Event>,
    /// The errors of its operations.
    pub errors: Vec<String>,
}

/// Runs a bounded random load on `KEYS` keys until `stop` (or 100,000 operations).
pub async fn load(client: Client, index: u64, start: Instant, stop: Arc<AtomicBool>) -> Seen {
    let mut random = rand::rngs::StdRng::seed_from_u64(index);
    let mut seen = Seen::default();
    let mut counter = 0u64;
    while !stop.load(Ordering::Relaxed) && counter < 100_000 {
        counter += 1;
        let key = random.gen_range(0..KEYS);
        let unique = (index << 32) | counter;
        let call = start.elapsed().as_nanos() as u64;
        let mix = Mix {
            gets: 40,
            puts: 30,
            deletes: 12,
        };
        let (operation, result) =
            random_operation(&client, &mut random, key, unique, &seen.events, mix).await;
        let ret = start.elapsed().as_nanos() as u64;
        match result {
            Ok(outcome) => seen.events.push(Event {
                key,
                operation,
                outcome,
                call,
                ret,
            }),
            Err(error) => {
                if error.may_have_applied() {
                    seen.events.push(Event {
                        key,
                        operation,
                        outcome: Outcome::Unknown,
                        call,
                        ret: u64::MAX,
                    });
                }
                seen.errors
                    .push(format!("{operation:?} on key-{key}: {error}"));
            }
        }
    }
    client.close().await;
    seen
}

/// Asserts that `rdkv-cluster COMMAND FILE --node N --run-dir DIR` refused with one line on
/// standard error saying `says`, and exit 1.
pub async fn assert_refused(
    command: &'static str,
    file: String,
    run_directory: String,
    node: u32,
    says: &str,
) {
    let output = membership_command(command, file, run_directory, node).await;
    let text = crate::view::output_text(&output);
    assert_eq!(
        output.status.code(),
        Some(1),
        "{command} --node {node}: {text}"
    );
    assert!(text.contains(says), "{command} --node {node}: {text}");
    assert_eq!(
        String::from_utf8_lossy(&output.stderr).lines().count(),
        1,
        "{command} --node {node}: one line: {text}"
    );
}

/// Runs `rdkv-cluster COMMAND FILE --node N --run-dir DIR` off the runtime; its output.
pub async fn membership_command(
    command: &'static str,
    file: String,
    run_directory: String,
    node: u32,
) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        let node = node.to_string();
        rdkv_cluster(&[
            command,
            file.as_str(),
            "--node",
            node.as_str(),
            "--run-dir",
            run_directory.as_str(),
        ])
    })
    .await
    .expect("the command's thread")
}

/// Three nodes up with `replicas`, settled, and node 4 then listed in their cluster file
/// (as the operator edits it before `add-node`): the cluster, every node's address (node 4's
/// too), the secret, the leader, a client made from the file before node 4 was in it, and
/// node 4's ports, reserved until the caller drops them.
pub async fn three_nodes_and_a_fourth_listed(
    tag: &str,
    replicas: usize,
) -> (Cluster, Nodes, Vec<u8>, u32, Client, ReservedPorts) {
    let settled = up_settled_edited(tag, 3, |text| {
        text.replace("replicas = 2", &format!("replicas = {replicas}"))
            .replace("operation_deadline = \"2s\"", "operation_deadline = \"8s\"")
    })
    .await;
    let (cluster, mut nodes, secret, _, _, leader) = settled.parts();
    let stale = ClientBuilder::cluster_file(&cluster.file)
        .build()
        .expect("client");
    let fourth_ports = ReservedPorts::loopback(3).expect("reserve ports for node 4");
    let mut text = std::fs::read_to_string(&cluster.file).expect("read the cluster file");
    text.push_str(&fourth_node(&fourth_ports));
    std::fs::write(&cluster.file, text).expect("write the cluster file");
    let fourth_address = format!("127.0.0.1:{}", fourth_ports.ports()[0])
        .parse()
        .expect("an address");
    nodes.push((4, fourth_address));
    (cluster, nodes, secret, leader, stale, fourth_ports)
}

/// Writes `count` keys (8 writers), each acknowledged; their names and values.
pub async fn preload(file: &std::path::Path, count: usize) -> Vec<(String, String)> {
    let mut writers = Vec::new();
    for writer in 0..8 {
        let client = ClientBuilder::cluster_file(file).build().expect("client");
        writers.push(tokio::spawn(async move {
            let mut written = Vec::new();
            for index in (writer..count).step_by(8) {
                let key = format!("preloaded-{index}");
                let value = format!("value-{index}");
                client
                    .put(key.as_bytes(), value.as_bytes())
                    .await
                    .unwrap_or_else(|error| panic!("preloading {key}: {error}"));
                written.push((key, value));
            }
            client.close().await;
            written
        }));
    }
    let mut preloaded = Vec::new();
    for writer in writers {
        preloaded.extend(writer.await.expect("preload task"));
    }
    preloaded
}

/// Reads every preloaded key back through a client of the cluster file; panics naming those
/// missing or different (`when` says at which step).
pub async fn assert_read_back(file: &std::path::Path, preloaded: &[(String, String)], when: &str) {
    let client = ClientBuilder::cluster_file(file).build().expect("client");
    let mut lost = Vec::new();
    for (key, value) in preloaded {
        match client.get(key.as_bytes()).await {
            Ok(Some(found)) if found.as_ref() == value.as_bytes() => {}
            other => lost.push(format!("{key}: {other:?}")),
        }
    }
    client.close().await;
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged writes not read back {when}: {:?}",
        lost.len(),
        preloaded.len(),
        &lost[..lost.len().min(8)]
    );
}

/// Four nodes up with `replicas = 2` (the example's three and a fourth on reserved ports),
/// settled, with `edit` applied to the file first: the cluster, every node's address, the
/// secret, and node 4's ports, reserved until the caller drops them.
pub async fn four_nodes(
    tag: &str,
    edit: impl FnOnce(String) -> String,
) -> (Cluster, Nodes, Vec<u8>, ReservedPorts) {
    let fourth_ports = ReservedPorts::loopback(3).expect("reserve ports for node 4");
    let section = fourth_node(&fourth_ports);
    let settled = up_settled_edited(tag, 3, |text| {
        edit(text.replace("operation_deadline = \"2s\"", "operation_deadline = \"8s\"")) + &section
    })
    .await;
    let (cluster, nodes, secret, _, _, _) = settled.parts();
    (cluster, nodes, secret, fourth_ports)
}

/// Waits (30 s at most) until node `observer`'s view has node `id` in `state` (`None`: not a
/// member).
pub async fn wait_state(
    nodes: &Nodes,
    secret: &[u8],
    observer: u32,
    id: u32,
    state: Option<MemberState>,
) {
    wait_for_view(nodes, secret, observer, Duration::from_secs(30), |view| {
        state_of(view, id) == state
    })
    .await
    .unwrap_or_else(|last| panic!("node {observer} never saw node {id} {state:?}; last: {last:?}"));
}
