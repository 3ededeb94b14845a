//! Helpers shared by the client's integration tests: a cluster description of in-process nodes
//! and a bounded wait for a server-side effect.

#[allow(dead_code)] // only the partition tests cut links
pub mod partition;
#[allow(dead_code)] // only the replication tests
pub mod replicas;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdkv_client::ClusterConfig;
use rdkv_cluster_file::NodeConfig;
use rdkv_fabric::memory::HugepagePolicy;
use rdkv_fabric::Backend;

/// A cluster named `name` of nodes at these control addresses (ids from 1, in order), on
/// `fabric`, with `secret` and a 2 s operation deadline; each node's table is small.
pub fn cluster(
    name: &str,
    secret: &[u8],
    fabric: Backend,
    control_addresses: &[SocketAddr],
) -> ClusterConfig {
    ClusterConfig {
        path: format!("{name}.toml").into(),
        name: name.into(),
        secret: secret.to_vec(),
        fabric,
        lease_timeout: Duration::from_secs(10),
        failure_timeout: Duration::from_secs(2),
        replace_after: None,
        replicas: 1,
        operation_deadline: Duration::from_secs(2),
        snapshot_interval: Duration::ZERO,
        poll_spin: Duration::ZERO,
        limits: rdkv_cluster_file::config::ConnectionLimits::default(),
        ssh: rdkv_cluster_file::config::SshSettings {
            user: None,
            options: Vec::new(),
            remote_binary: "rdkv-server".into(),
            remote_run_dir: format!(".rdkv/{name}"),
        },
        nodes: control_addresses
            .iter()
            .zip(1..)
            .map(|(&control_address, id)| NodeConfig {
                id,
                host: None,
                control_address,
                fabric_address: None,
                device: None,
                gid_index: None,
                metrics_address: None,
                index_size: 256 * 1024,
                heap_size: 4 * 1024 * 1024,
                chunk_size: 64 * 1024,
                hugepages: HugepagePolicy::Auto,
                max_pinned_share: 0.5,
                shm: rdkv_client::ShmMode::Auto,
                shm_socket: None,
                data_dir: None,
            })
            .collect(),
        warnings: Vec::new(),
    }
}

/// Waits, up to 10 s, for `condition` (a server-side effect of something already done).
#[allow(dead_code)] // not every test binary waits for a server-side effect
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    eventually_showing(what, || (), |()| condition()).await;
}

/// As [`eventually`], with what `probe` saw last in the failure's message.
pub async fn eventually_showing<T: std::fmt::Debug>(
    what: &str,
    mut probe: impl FnMut() -> T,
    mut done: impl FnMut(&T) -> bool,
) {
    let started = Instant::now();
    loop {
        let seen = probe();
        if done(&seen) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what}; last seen: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
