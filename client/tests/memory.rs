//! Client memory: what a client pins comes back when it closes. Alone in its file (so in its
//! own process under `cargo test`), because the pinned-bytes gauge counts the whole process.

use std::time::Duration;

use rdkv_client::{Client, ClientConfig};
use rdkv_fabric::Backend;
use rdkv_server::ServerConfig;

const SECRET: &[u8] = b"memory-test-secret";

/// A closed client gives its pinned scratch memory back: nothing it started (the announce
/// flusher included) keeps its registered memory alive. Its connection closes in a task, so
/// the gauge is polled, within a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_client_unpins_its_memory() {
    let server = rdkv_server::start(ServerConfig::local(SECRET))
        .await
        .expect("start server");
    let before = rdkv_fabric::memory::pinned_bytes();
    let client = Client::connect(ClientConfig::new(
        server.control_address(),
        Backend::Soft,
        SECRET,
    ))
    .await
    .expect("connect");
    for index in 0..50u32 {
        client
            .put(format!("pin-{index}").as_bytes(), b"value")
            .await
            .expect("put");
    }
    assert!(
        rdkv_fabric::memory::pinned_bytes() > before,
        "the client pinned its scratch buffers"
    );
    // Let the announce flusher write its last word and go back to waiting: the connection must
    // not stay pinned by a flusher that is idle when the client closes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.close().await;
    drop(client);
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while rdkv_fabric::memory::pinned_bytes() > before {
        assert!(
            std::time::Instant::now() < until,
            "{} bytes still pinned after the client closed ({before} before it connected)",
            rdkv_fabric::memory::pinned_bytes()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
