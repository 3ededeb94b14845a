//! Three in-process nodes whose control traffic to each other runs through TCP proxies a test
//! can cut and heal, while clients reach every node through proxies that stay up (the data
//! path, the soft fabric, is direct): partitions on loopback, for `partition.rs` and
//! `lease_attack.rs`.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientBuilder, ClientConfig, ClusterConfig};
use rdkv_fabric::Backend;
use rdkv_server::{RunningServer, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::timeout;

/// The nodes' failure timeout.
pub const FAILURE_TIMEOUT: Duration = Duration::from_secs(1);
/// The nodes.
pub const NODES: u32 = 3;

/// A TCP forwarder to a target given after it starts. While cut, it closes its connections
/// and drops new ones at once.
pub struct Proxy {
    /// Where it listens.
    pub address: SocketAddr,
    /// Where it forwards to.
    target: Arc<OnceLock<SocketAddr>>,
    /// Whether it is cut.
    cut: watch::Sender<bool>,
}

impl Proxy {
    /// Starts a proxy with no target yet.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a proxy");
        let address = listener.local_addr().expect("proxy address");
        let target: Arc<OnceLock<SocketAddr>> = Arc::default();
        let cut = watch::Sender::new(false);
        let (forward_to, cuts) = (target.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let Some(to) = forward_to.get().copied() else {
                    continue;
                };
                if *cuts.borrow() {
                    continue;
                }
                let mut cut_now = cuts.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(to).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut_now.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Self {
            address,
            target,
            cut,
        }
    }

    /// Cuts (or heals) it.
    pub fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// The nodes, the proxies clients use (`front[i]`), and the proxies of node `i`'s messages
/// to node `j` (`links[i][j]`); indexes from 0 for node ids from 1.
pub struct Partitionable {
    /// The nodes, ids 1 to 3.
    pub nodes: Vec<RunningServer>,
    /// The proxies clients reach each node through (never cut).
    pub front: Vec<Proxy>,
    /// `links[i][j]`: node `i + 1`'s messages to node `j + 1`.
    pub links: Vec<Vec<Proxy>>,
    /// The cluster, as clients see it (`replicas = 2`).
    pub cluster: ClusterConfig,
    /// The cluster secret.
    secret: Vec<u8>,
}

impl Partitionable {
    /// Starts three nodes of a cluster named `name`, with `secret`.
    pub async fn start(name: &str, secret: &[u8]) -> Self {
        let mut front = Vec::new();
        let mut links = Vec::new();
        for _ in 0..NODES {
            front.push(Proxy::start().await);
            let mut from = Vec::new();
            for _ in 0..NODES {
                from.push(Proxy::start().await);
            }
            links.push(from);
        }
        let front_addresses: Vec<SocketAddr> = front.iter().map(|proxy| proxy.address).collect();
        let mut cluster = super::cluster(name, secret, Backend::Soft, &front_addresses);
        cluster.replicas = 2;
        cluster.failure_timeout = FAILURE_TIMEOUT;
        let shared_cluster = Arc::new(cluster.clone());
        let mut nodes = Vec::new();
        for id in 1..=NODES {
            let index = id as usize - 1;
            let mut config = ServerConfig::local(secret);
            config.node_id = id;
            config.failure_timeout = FAILURE_TIMEOUT;
            config.cluster = Some(shared_cluster.clone());
            config.members = (1..=NODES)
                .map(|peer| {
                    let proxy = if peer == id {
                        &front[index]
                    } else {
                        &links[index][peer as usize - 1]
                    };
                    (peer, proxy.address)
                })
                .collect();
            nodes.push(rdkv_server::start(config).await.expect("start a node"));
        }
        for (index, node) in nodes.iter().enumerate() {
            let _ = front[index].target.set(node.control_address());
            for from in &links {
                let _ = from[index].target.set(node.control_address());
            }
        }
        Self {
            nodes,
            front,
            links,
            cluster,
            secret: secret.to_vec(),
        }
    }

    /// Cuts (or heals) node `id`'s control traffic with the other nodes, both ways.
    pub fn isolate(&self, id: u32, cut: bool) {
        let index = id as usize - 1;
        for other in 0..NODES as usize {
            if other != index {
                self.links[index][other].set_cut(cut);
                self.links[other][index].set_cut(cut);
            }
        }
    }

    /// Cuts (or heals) the control traffic between nodes `a` and `b`, both ways.
    pub fn cut_between(&self, a: u32, b: u32, cut: bool) {
        let (a, b) = (a as usize - 1, b as usize - 1);
        self.links[a][b].set_cut(cut);
        self.links[b][a].set_cut(cut);
    }

    /// Cuts (or heals) every link between nodes.
    pub fn cut_all(&self, cut: bool) {
        for from in &self.links {
            for link in from {
                link.set_cut(cut);
            }
        }
    }

    /// A client of node `id` alone, through its front proxy: what that node serves.
    pub async fn direct(&self, id: u32) -> rdkv_client::Result<Client> {
        let mut config = ClientConfig::new(
            self.front[id as usize - 1].address,
            Backend::Soft,
            &self.secret,
        );
        config.node.id = Some(id);
        Client::connect(config).await
    }

    /// Waits until every node serves data, knows no member down and the same epoch and
    /// leader, within `bound`; how long that took.
    pub async fn converged(&self, bound: Duration, what: &str) -> Duration {
        let started = Instant::now();
        loop {
            let stats: Vec<_> = self.nodes.iter().map(RunningServer::stats).collect();
            let (epoch, leader) = (stats[0].view_epoch, stats[0].view_leader);
            let done = stats.iter().all(|node| {
                node.serving_data
                    && node.view_members_down == 0
                    && node.view_epoch == epoch
                    && node.view_leader == leader
                    && leader != 0
            });
            // Filling members serve data too: wait until the view has every node serving.
            let every_serving = done
                && timeout(
                    Duration::from_secs(3),
                    ClientBuilder::cluster(&self.cluster)
                        .build()
                        .expect("a cluster client")
                        .view(),
                )
                .await
                .is_ok_and(|view| view.is_ok_and(|view| view.serving().len() == NODES as usize));
            if every_serving {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < bound,
                "{what}: not converged within {bound:?}: {:?}",
                stats
                    .iter()
                    .map(|stats| (
                        stats.serving_data,
                        stats.view_epoch,
                        stats.view_leader,
                        stats.view_members_down
                    ))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
