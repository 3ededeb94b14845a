//! Three in-process nodes for the replication tests, a client of each node alone (what that
//! node's table holds), and a key's replica ids.

use rdkv_client::{Client, ClientConfig};
use rdkv_common::sharding;
use rdkv_fabric::Backend;
use rdkv_server::{RunningServer, ServerConfig};

/// Three in-process nodes, ids 1 to 3.
pub async fn start_three(secret: &[u8]) -> Vec<RunningServer> {
    let mut nodes = Vec::new();
    for id in 1..=3 {
        let mut config = ServerConfig::local(secret);
        config.node_id = id;
        nodes.push(rdkv_server::start(config).await.expect("start a node"));
    }
    nodes
}

/// A client of node `id` alone (ids from 1).
pub async fn node_client(nodes: &[RunningServer], secret: &[u8], id: u32) -> Client {
    let mut config = ClientConfig::new(
        nodes[id as usize - 1].control_address(),
        Backend::Soft,
        secret,
    );
    config.node.id = Some(id);
    Client::connect(config).await.expect("connect to one node")
}

/// A client of each node alone, in id order.
pub async fn node_clients(nodes: &[RunningServer], secret: &[u8]) -> Vec<Client> {
    let mut clients = Vec::new();
    for id in 1..=nodes.len() as u32 {
        clients.push(node_client(nodes, secret, id).await);
    }
    clients
}

/// The ids of `key`'s `count` replicas among nodes 1 to 3, primary first.
pub fn replica_ids(key: &[u8], count: usize) -> Vec<u32> {
    let ids = [1u32, 2, 3];
    sharding::replicas(key, &ids, count)
        .into_iter()
        .map(|index| ids[index])
        .collect()
}
