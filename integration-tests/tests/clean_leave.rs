//! A node stopped cleanly (`rdkv-cluster down --node N`) leaves the cluster view at once
//! (`server/src/view/leave.rs`): its keys move to their next copies without waiting for
//! `failure_timeout` of silence. The cluster here has `failure_timeout = "30s"`, so a view
//! without the node within seconds, and a read of its key within the 2 s operation deadline,
//! can only come from the clean leave.

use std::time::{Duration, Instant};

use rdkv_client::Client;
use rdkv_common::protocol::MemberState;
use rdkv_common::sharding;
use rdkv_integration_tests::cluster::Cluster;
use rdkv_integration_tests::view::{
    cluster_command, log_of, state_of, wait_for_view, wait_settled, Nodes,
};

/// Far longer than any bound below: the failure detector cannot be what moved the view.
const FAILURE_TIMEOUT: &str = "30s";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_by_down_leaves_the_view_at_once_and_its_keys_stay_readable() {
    let cluster = Cluster::up_with("clean-leave", |text| {
        text.replace(
            "failure_timeout = \"1s\"",
            &format!("failure_timeout = \"{FAILURE_TIMEOUT}\""),
        )
    });
    let config = rdkv_cluster_config::load(&cluster.file).expect("the generated file is valid");
    let nodes: Nodes = config
        .nodes
        .iter()
        .map(|node| (node.id, node.control_address))
        .collect();
    let ids: Vec<u32> = nodes.iter().map(|(id, _)| *id).collect();
    let view = wait_settled(&nodes, &config.secret, &ids, Duration::from_secs(30))
        .await
        .expect("the cluster settles");
    let leader = view.leader.expect("a leader");
    let victim = *ids.iter().find(|id| **id != leader).expect("a follower");
    // A key whose primary is the node that leaves.
    let key = (0..1_000)
        .map(|index| format!("key-{index}"))
        .find(|key| ids[sharding::replicas(key.as_bytes(), &ids, 2)[0]] == victim)
        .expect("a key of the node");
    let client = Client::from_file(&cluster.file).expect("client");
    client.put(key.as_bytes(), b"kept").await.expect("put");

    let started = Instant::now();
    let down = cluster_command(&cluster, "down", Some(victim));
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    // 10 s: a third of the failure timeout, generous for a loaded machine (it takes
    // milliseconds).
    wait_for_view(
        &nodes,
        &config.secret,
        leader,
        Duration::from_secs(10),
        |view| state_of(view, victim) == Some(MemberState::Down),
    )
    .await
    .expect("the view has the node down well before failure_timeout");
    let moved_after = started.elapsed();
    let value = client
        .get(key.as_bytes())
        .await
        .expect("its key is readable");
    eprintln!(
        "node {victim} down in the view {moved_after:?} after `down` began; its key read back"
    );
    assert_eq!(value.as_deref(), Some(&b"kept"[..]));
    let log = log_of(&cluster, victim);
    assert!(log.contains("left the cluster view"), "{log}");
}
