//! A client's connections over its life: `connect_all` connects every node of a cluster up
//! front (or names the node it could not reach), and dropping a client says goodbye like
//! `close` does, so its last counters reach the node.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

mod support;
use support::eventually;

use rdkv_client::{Client, ClientBuilder, ClientConfig, ClusterConfig, Error};
use rdkv_common::ports::ReservedPorts;
use rdkv_fabric::Backend;
use rdkv_server::{RunningServer, ServerConfig};

const SECRET: &[u8] = b"lifecycle-test-secret";

async fn start_server() -> RunningServer {
    start_node(1).await
}

/// A server that is node `id` (clients of a cluster check the id its challenge names).
async fn start_node(id: u32) -> RunningServer {
    let mut config = ServerConfig::local(SECRET);
    config.node_id = id;
    rdkv_server::start(config).await.expect("start server")
}

/// A cluster of nodes at these control addresses (ids from 1, in order), on `soft`.
fn cluster(control_addresses: &[SocketAddr]) -> ClusterConfig {
    support::cluster("lifecycle-test", SECRET, Backend::Soft, control_addresses)
}

/// An address where nothing listens, and the reservation that keeps it so: a port bound and
/// held, never listened on (a port merely released could be taken by another test's listener).
fn closed_address() -> (ReservedPorts, SocketAddr) {
    let reserved = ReservedPorts::loopback(1).expect("reserve a loopback port");
    let address = reserved.addresses()[0];
    (reserved, address)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_all_connects_every_node_up_front() {
    let first = start_node(1).await;
    let second = start_node(2).await;
    let client = ClientBuilder::cluster(&cluster(&[
        first.control_address(),
        second.control_address(),
    ]))
    .build()
    .expect("a cluster client");
    assert_eq!(
        first.stats().connections,
        0,
        "a built cluster client connects lazily"
    );
    assert_eq!(
        second.stats().connections,
        0,
        "a built cluster client connects lazily"
    );
    client.connect_all().await.expect("connect every node");
    assert!(
        first.stats().connections >= 1,
        "the first lane, before it returns"
    );
    assert!(
        second.stats().connections >= 1,
        "the first lane, before it returns"
    );
    // The second worker's lane to each node opens in the background.
    eventually("a lane per worker to each node", || {
        first.stats().connections == 2 && second.stats().connections == 2
    })
    .await;

    // Operations on both nodes use those connections: none opens another.
    let mut nodes_used = std::collections::HashSet::new();
    for index in 0..64u32 {
        let key = format!("key-{index}");
        client.put(key.as_bytes(), b"value").await.expect("put");
        nodes_used.insert(client.node_of(key.as_bytes()));
    }
    assert_eq!(nodes_used.len(), 2, "the keys spread over both nodes");
    assert_eq!(first.stats().connections, 2);
    assert_eq!(second.stats().connections, 2);
    assert_eq!(client.counters().reconnects, 0);
    client.connect_all().await.expect("already connected");
    assert_eq!(first.stats().connections, 2, "no third connection");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_all_names_the_node_it_cannot_reach() {
    let live = start_server().await;
    let (_reserved, closed) = closed_address();
    let client = ClientBuilder::cluster(&cluster(&[live.control_address(), closed]))
        .build()
        .expect("a cluster client");
    let error = client.connect_all().await.expect_err("node 2 is down");
    match &error {
        Error::ConnectFailed {
            node,
            address,
            source,
        } => {
            assert_eq!((*node, *address), (2, closed), "{error}");
            assert!(
                matches!(**source, Error::NodeUnreachable { .. }),
                "{source}"
            );
        }
        other => panic!("not ConnectFailed: {other}"),
    }
    assert!(error.to_string().contains("node 2"), "{error}");
    assert!(error.is_retryable() && !error.may_have_applied());
    assert!(live.stats().connections >= 1, "the live node is connected");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_client_says_goodbye() {
    // A long lease: the client's next heartbeat (every lease / 3) is far off, so only the
    // goodbye can deliver the counters of the operations below.
    let mut config = ServerConfig::local(SECRET);
    config.lease_timeout = Duration::from_secs(120);
    let server = rdkv_server::start(config).await.expect("start server");
    // One lane: a second lane, opened in the background by the first put on another worker's
    // lane, would send its first heartbeat at once, with the counters so far (this test
    // failed so whenever the test thread's lane was not the first).
    let mut client_config = ClientConfig::new(server.control_address(), Backend::Soft, SECRET);
    client_config.lanes = Some(1);
    let client = Client::connect(client_config).await.expect("connect");
    // The connection's first heartbeat goes out at once (and reports nothing yet); the next
    // one is a third of the lease away.
    eventually("the first heartbeat", || {
        server.stats().control_messages >= 1
    })
    .await;
    for index in 0..10u32 {
        client
            .put(&index.to_le_bytes(), b"value")
            .await
            .expect("put");
    }
    assert_eq!(server.stats().client_counters.operations, 0);
    assert_eq!(server.stats().connections, 1);
    drop(client);
    eventually(
        "the dropped client's goodbye reported its 10 operations",
        || server.stats().client_counters.operations == 10,
    )
    .await;
    eventually("the dropped client's connection was torn down", || {
        server.stats().connections == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_operations_are_counted_under_their_kind_and_as_failures() {
    let (_reserved, closed) = closed_address();
    let client = ClientBuilder::cluster(&cluster(&[closed]))
        .build()
        .expect("a cluster client");
    client.get(b"key").await.expect_err("nothing listens");
    client
        .put(b"key", b"value")
        .await
        .expect_err("nothing listens");
    client
        .batch_get(&[b"one".as_slice(), b"two".as_slice()])
        .await
        .expect_err("nothing listens");
    let counters = client.counters();
    assert_eq!(counters.operations, 4, "{counters:?}");
    assert_eq!(counters.failures, 4, "{counters:?}");
    assert_eq!(counters.gets, 3, "{counters:?}");
    assert_eq!(counters.mutations, 1, "{counters:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_count_is_exact_at_rest() {
    let server = start_server().await;
    let client = ClientBuilder::cluster(&cluster(&[server.control_address()]))
        .build()
        .expect("a cluster client");
    for index in 0..37u32 {
        client
            .put(format!("counted-{index}").as_bytes(), b"value")
            .await
            .expect("put");
    }
    client.delete(b"counted-0").await.expect("delete");
    // At once, not after the collector's next scan.
    assert_eq!(client.server_stats().await.expect("stats").keys, 36);
    assert_eq!(server.stats().keys, 36);
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_names_another_id_is_refused() {
    // Node 1 of this server answers at the address the cluster file gives node 2: a wrong
    // address, or a relay that passes node 1's challenge on to get a proof for it.
    let server = start_server().await;
    let (_reserved, closed) = closed_address();
    let client = ClientBuilder::cluster(&cluster(&[closed, server.control_address()]))
        .build()
        .expect("a cluster client");
    let key = (0..1_000u32)
        .map(|index| format!("relay-{index}"))
        .find(|key| client.node_of(key.as_bytes()) == 2)
        .expect("a key of node 2");
    let error = client.get(key.as_bytes()).await.expect_err("refused");
    let text = error.to_string();
    assert!(text.contains("says it is node 1, not node 2"), "{text}");
    assert_eq!(
        server.stats().authentication_failures,
        0,
        "no proof was sent"
    );
    let stats = client.cluster_stats().await;
    let node_two = stats[1].1.as_ref().expect_err("refused too");
    assert!(node_two.to_string().contains("not node 2"), "{node_two}");
}

/// Puts and reads back 256 keys from 32 tasks spread over the runtime's workers.
async fn put_and_get_from_many_tasks(client: &std::sync::Arc<Client>) {
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..32u32 {
        let client = client.clone();
        tasks.spawn(async move {
            for index in 0..8u32 {
                let key = format!("lane-{task}-{index}");
                client
                    .put(key.as_bytes(), key.as_bytes())
                    .await
                    .expect("put");
                let value = client.get(key.as_bytes()).await.expect("get");
                assert_eq!(value.as_deref(), Some(key.as_bytes()));
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.expect("a task ran to its end");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_opens_a_lane_per_worker_over_every_fabric() {
    // Loopback stands for the fabrics that cost the node no CPU per operation (shm, verbs);
    // soft gets a lane per worker too, since its doorbells carry a batch each.
    for fabric in [Backend::Loopback, Backend::Soft] {
        let mut config = ServerConfig::local(SECRET);
        config.fabric = fabric;
        let node = rdkv_server::start(config).await.expect("start server");
        let mut node_cluster = cluster(&[node.control_address()]);
        node_cluster.fabric = fabric;
        let client = std::sync::Arc::new(
            ClientBuilder::cluster(&node_cluster)
                .build()
                .expect("a cluster client"),
        );
        client.connect_all().await.expect("connect every lane");
        // The first lane opened in connect_all, the second in the background.
        eventually("a lane per tokio worker", || node.stats().connections == 2).await;
        put_and_get_from_many_tasks(&client).await;
        assert_eq!(
            node.stats().connections,
            2,
            "{fabric:?}: the operations used those lanes"
        );
        assert_eq!(client.counters().reconnects, 0, "{fabric:?}");
        client.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_the_node_has_no_room_for_never_holds_an_operation() {
    // Room for one connection: the node refuses the client's second lane (it retries every
    // second in the background); operations must not wait for it. Over soft too,
    // which gets a lane per worker since the eighth pass.
    for fabric in [Backend::Loopback, Backend::Soft] {
        let mut config = ServerConfig::local(SECRET);
        config.fabric = fabric;
        config.max_connections = 1;
        config.limits.max_unauthenticated = 1;
        let node = rdkv_server::start(config).await.expect("start server");
        let mut node_cluster = cluster(&[node.control_address()]);
        node_cluster.fabric = fabric;
        let client = std::sync::Arc::new(
            ClientBuilder::cluster(&node_cluster)
                .build()
                .expect("a cluster client"),
        );
        let started = Instant::now();
        put_and_get_from_many_tasks(&client).await;
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{fabric:?}: 256 puts and gets took {:?}: an operation waited for a lane",
            started.elapsed()
        );
        assert_eq!(node.stats().authenticated_connections, 1, "{fabric:?}");
        assert_eq!(client.counters().failures, 0, "{fabric:?}");
    }
}

/// A client's extra lanes take at most half a node: three clients of eight workers each
/// against a node with room for four connections all get through. Before the node refused
/// extra lanes past half its `max_connections`, the first client's lanes took every slot and
/// the others' operations waited out their deadlines in the node's accept backlog (found by
/// attacking a lane per worker over soft).
#[test]
fn extra_lanes_never_shut_other_clients_out() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(8)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut config = ServerConfig::local(SECRET);
        config.max_connections = 4;
        config.limits.max_unauthenticated = 3;
        let node = rdkv_server::start(config).await.expect("start server");
        let node_cluster = cluster(&[node.control_address()]);
        let first = std::sync::Arc::new(
            ClientBuilder::cluster(&node_cluster)
                .build()
                .expect("a cluster client"),
        );
        put_and_get_from_many_tasks(&first).await;
        // Its extra lanes open in the background until the node refuses them at its half
        // (they retry every second); without that they took all four slots.
        eventually("the first client's extra lanes settle", || {
            let stats = node.stats();
            stats.lanes_refused >= 1 || stats.authenticated_connections == 4
        })
        .await;
        let others: Vec<_> = (0..2)
            .map(|_| {
                std::sync::Arc::new(
                    ClientBuilder::cluster(&node_cluster)
                        .build()
                        .expect("a cluster client"),
                )
            })
            .collect();
        let started = Instant::now();
        for client in &others {
            // Every put and get succeeds (the helper asserts it), well within the deadline.
            put_and_get_from_many_tasks(client).await;
        }
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "two more clients' operations took {:?}",
            started.elapsed()
        );
        let stats = node.stats();
        assert!(
            stats.authenticated_connections <= 4,
            "{}",
            stats.authenticated_connections
        );
        assert!(stats.lanes_refused >= 1, "the node refused extra lanes");
        for client in others.iter().chain([&first]) {
            assert_eq!(client.counters().failures, 0);
        }
        for client in others.iter().chain([&first]) {
            client.close().await;
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_builder_connects_every_node_of_a_cluster_with_its_settings() {
    let first = start_node(1).await;
    let second = start_node(2).await;
    let client = ClientBuilder::cluster(&cluster(&[
        first.control_address(),
        second.control_address(),
    ]))
    .concurrency(4)
    .lanes(1)
    .fabric(rdkv_client::FabricChoice::Cluster(Backend::Soft))
    .connect()
    .await
    .expect("connect every node");
    // One lane each: exactly one connection per node, before any operation.
    assert_eq!(first.stats().connections, 1);
    assert_eq!(second.stats().connections, 1);
    assert_eq!(client.node_ids(), [1, 2]);
    client.put(b"built", b"value").await.expect("put");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_builder_refuses_a_fabric_the_cluster_does_not_run_and_a_lazy_client_of_one_node() {
    let config = cluster(&[closed_address().1]);
    let error = ClientBuilder::cluster(&config)
        .fabric(rdkv_client::FabricChoice::Cluster(Backend::Loopback))
        .build()
        .expect_err("the cluster runs soft");
    assert!(
        matches!(&error, Error::Config { reason } if reason.contains("the cluster runs soft")),
        "{error}"
    );
    let one = ClientConfig::new(closed_address().1, Backend::Soft, SECRET);
    let error = ClientBuilder::node(one)
        .build()
        .expect_err("a client of one node connects at once");
    assert!(matches!(error, Error::Config { .. }), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_out_of_bounds_is_taken_as_the_nearer_bound() {
    let node = start_node(1).await;
    for concurrency in [0, usize::MAX] {
        let mut config = ClientConfig::new(node.control_address(), Backend::Soft, SECRET);
        config.concurrency = concurrency;
        let client = ClientBuilder::node(config)
            .connect()
            .await
            .unwrap_or_else(|error| panic!("concurrency {concurrency}: {error}"));
        client.put(b"bounded", b"value").await.expect("put");
        client.close().await;
        let client = ClientBuilder::cluster(&cluster(&[node.control_address()]))
            .concurrency(concurrency)
            .fabric(rdkv_client::FabricChoice::Cluster(Backend::Soft))
            .connect()
            .await
            .unwrap_or_else(|error| panic!("cluster, concurrency {concurrency}: {error}"));
        assert_eq!(
            client.get(b"bounded").await.expect("get").as_deref(),
            Some(&b"value"[..])
        );
        client.close().await;
    }
}
