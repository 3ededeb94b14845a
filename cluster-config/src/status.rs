//! `rdkv-cluster status`: each node's stats over an authenticated monitoring connection (no
//! queue pair, no keys), as a table, and an exit code a script can trust: 0 only when every
//! node is up.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdkv_common::protocol::{fetch_stats, fetch_view, ClusterView, MonitoredNode, ServerStats};
use rdkv_common::ControlError;

use crate::config::ClusterConfig;
use crate::units::format_bytes;

/// A node's state, as `status` shows it.
#[derive(Debug, Clone)]
pub enum NodeState {
    /// It answered with its stats.
    Up(Box<ServerStats>),
    /// It refused the cluster's secret (or this client's protocol version): the file's secret
    /// is not the node's.
    Refused(String),
    /// It did not answer.
    Down(String),
}

/// One node's state for `status`.
#[derive(Debug, Clone)]
pub struct NodeStatus {
    /// The node's id.
    pub id: u32,
    /// Its control address.
    pub address: SocketAddr,
    /// Up with its stats, refused, or down with why.
    pub state: NodeState,
}

/// Whether a node's refusal is of the secret (or the version): `authentication failed: …`. A
/// node can also refuse a monitor because every slot it may take is taken (`the node is
/// full: …`), which is not a secret problem.
pub fn refused_the_secret(reason: &str) -> bool {
    reason.starts_with("authentication failed") || reason.starts_with("protocol version mismatch")
}

/// `status`'s exit code: 0 every node up, 1 a node down (or refusing for another reason, as a
/// full node does), 3 a node refused the secret.
pub fn exit_code(statuses: &[NodeStatus]) -> u8 {
    if statuses.iter().any(
        |status| matches!(&status.state, NodeState::Refused(reason) if refused_the_secret(reason)),
    ) {
        3
    } else if statuses
        .iter()
        .all(|status| matches!(status.state, NodeState::Up(_)))
    {
        0
    } else {
        1
    }
}

/// Asks every node for its stats.
pub async fn status(config: &ClusterConfig) -> Vec<NodeStatus> {
    let mut statuses = Vec::new();
    for node in &config.nodes {
        let monitored = MonitoredNode {
            address: node.control_address,
            id: Some(node.id),
            secret: &config.secret,
        };
        let state = match fetch_stats(monitored, Duration::from_secs(2)).await {
            Ok(stats) => NodeState::Up(Box::new(stats)),
            Err(ControlError::Refused { reason }) => NodeState::Refused(reason),
            Err(error) => NodeState::Down(error.to_string()),
        };
        statuses.push(NodeStatus {
            id: node.id,
            address: node.control_address,
            state,
        });
    }
    statuses
}

/// How long `up` waits for its nodes to serve data: the first election and the leases take
/// about a second.
pub const SERVING_TIMEOUT: Duration = Duration::from_secs(15);

/// Waits, up to `timeout`, until every node of `ids` answers that it serves data (it holds its
/// lease from the cluster's majority and the view has it); the nodes that still do not, with
/// why.
pub async fn wait_serving(
    config: &ClusterConfig,
    ids: &[u32],
    timeout: Duration,
) -> Vec<(u32, String)> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut waiting = Vec::new();
        for node in config.nodes.iter().filter(|node| ids.contains(&node.id)) {
            let monitored = MonitoredNode {
                address: node.control_address,
                id: Some(node.id),
                secret: &config.secret,
            };
            match fetch_stats(monitored, Duration::from_secs(1)).await {
                Ok(stats) if stats.serving_data => {}
                Ok(_) => waiting.push((
                    node.id,
                    "it does not serve data yet (no lease from a majority of the nodes, or its rejoin is not in the view)".to_string(),
                )),
                Err(error) => waiting.push((node.id, error.to_string())),
            }
        }
        if waiting.is_empty() || Instant::now() >= deadline {
            return waiting;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The cluster view, from the leader when a node that answered names one, else from the first
/// node that answers; `None` when no node answers.
pub async fn view(config: &ClusterConfig, statuses: &[NodeStatus]) -> Option<ClusterView> {
    let leader = statuses.iter().find_map(|status| match &status.state {
        NodeState::Up(stats) if stats.view_leader != 0 => Some(stats.view_leader),
        _ => None,
    });
    let mut order: Vec<&crate::config::NodeConfig> = config.nodes.iter().collect();
    order.sort_by_key(|node| Some(node.id) != leader);
    for node in order {
        let monitored = MonitoredNode {
            address: node.control_address,
            id: Some(node.id),
            secret: &config.secret,
        };
        if let Ok(view) = fetch_view(monitored, Duration::from_secs(2)).await {
            return Some(view);
        }
    }
    None
}

/// The `view:` line under the table.
pub fn view_line(view: Option<&ClusterView>) -> String {
    match view {
        Some(view) => format!("view: {}", view.summary()),
        None => "view: no node answered".to_string(),
    }
}

/// A `refill:` line for each node the view has filling (back after a restart or an absence,
/// copying its keys from its peers): how far its scan of their tables got, and the keys it
/// copied (`docs/operations.md`, *Replication and failover*).
pub fn refill_lines(view: Option<&ClusterView>, statuses: &[NodeStatus]) -> Vec<String> {
    let Some(view) = view else {
        return Vec::new();
    };
    view.members
        .iter()
        .filter(|member| member.state == rdkv_common::protocol::MemberState::Filling)
        .map(|member| {
            let stats = statuses.iter().find_map(|status| match &status.state {
                NodeState::Up(stats) if status.id == member.node_id => Some(stats),
                _ => None,
            });
            match stats {
                Some(stats) if stats.refill_buckets_total > 0 => format!(
                    "refill: node {} filling: {}% of its peers' index scanned ({} of {} buckets), {} keys copied",
                    member.node_id,
                    stats.refill_buckets_scanned * 100 / stats.refill_buckets_total,
                    stats.refill_buckets_scanned,
                    stats.refill_buckets_total,
                    stats.refill_keys_copied
                ),
                Some(_) => format!("refill: node {} filling: starting", member.node_id),
                None => format!("refill: node {} filling: it does not answer", member.node_id),
            }
        })
        .collect()
}

/// Renders rows as a table with aligned columns.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|title| title.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(padded.join("  ").trim_end());
        out.push('\n');
    };
    line(header.iter().map(|title| title.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
    out
}

/// The `status` table.
pub fn status_table(statuses: &[NodeStatus]) -> String {
    let rows: Vec<Vec<String>> = statuses
        .iter()
        .map(|status| match &status.state {
            NodeState::Up(stats) => vec![
                status.id.to_string(),
                // Up, but holding no lease or not in the view as this process: it serves
                // no data (`docs/operations.md`, *Replication and failover*).
                if stats.serving_data {
                    "up"
                } else {
                    "not-serving"
                }
                .into(),
                status.address.to_string(),
                format!("{}s", stats.uptime_seconds),
                stats.connections.to_string(),
                format!(
                    "{}/{}/{}",
                    stats.queue_pairs[3],
                    stats.queue_pairs[2] + stats.queue_pairs[1] + stats.queue_pairs[0],
                    stats.queue_pairs[4]
                ),
                stats.live_memory_regions.to_string(),
                stats.live_memory_windows.to_string(),
                format_bytes(stats.pinned_bytes),
                format!(
                    "{} / {}",
                    format_bytes(stats.heap_used_bytes),
                    format_bytes(stats.heap_size_bytes)
                ),
                stats.keys.to_string(),
                if stats.view_leader == status.id {
                    format!("{} (leader)", stats.view_epoch)
                } else {
                    stats.view_epoch.to_string()
                },
            ],
            NodeState::Refused(reason) | NodeState::Down(reason) => {
                let state = match &status.state {
                    NodeState::Refused(reason) if refused_the_secret(reason) => "auth failed",
                    NodeState::Refused(_) => "refused",
                    _ => "down",
                };
                let mut row = vec![
                    status.id.to_string(),
                    state.into(),
                    status.address.to_string(),
                ];
                row.extend(std::iter::repeat_n("-".to_string(), 8));
                row.push(reason.clone());
                row
            }
        })
        .collect();
    table(
        &[
            "node",
            "state",
            "control",
            "uptime",
            "conns",
            "QPs rts/setup/err",
            "MRs",
            "MWs",
            "pinned",
            "heap used",
            "keys",
            "view epoch",
        ],
        &rows,
    ) + &heap_warnings(statuses)
}

/// One line per node whose heap is under 10% free, naming the fix.
fn heap_warnings(statuses: &[NodeStatus]) -> String {
    statuses
        .iter()
        .filter_map(|status| {
            let NodeState::Up(stats) = &status.state else {
                return None;
            };
            stats.heap_low().then(|| {
                format!(
                    "warning: node {} heap under 10% free ({} of {}): writes may wait for reclamation; raise heap_size (docs/operations.md, Sizing the heap)\n",
                    status.id,
                    rdkv_cluster_file::units::format_bytes(stats.heap_free_bytes),
                    rdkv_cluster_file::units::format_bytes(stats.heap_size_bytes)
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u32, state: NodeState) -> NodeStatus {
        NodeStatus {
            id,
            address: "127.0.0.1:1".parse().expect("an address"),
            state,
        }
    }

    #[test]
    fn tables_align_columns() {
        let text = table(&["a", "long header"], &[vec!["value".into(), "x".into()]]);
        assert_eq!(text, "a      long header\nvalue  x\n");
    }

    #[test]
    fn the_exit_code_is_zero_only_when_every_node_is_up() {
        let up = || NodeState::Up(Box::default());
        assert_eq!(exit_code(&[node(1, up()), node(2, up())]), 0);
        assert_eq!(
            exit_code(&[node(1, up()), node(2, NodeState::Down("refused".into()))]),
            1
        );
        let refused =
            NodeState::Refused("authentication failed: the client's secret does not match".into());
        let statuses = [node(1, refused), node(2, NodeState::Down("x".into()))];
        assert_eq!(exit_code(&statuses), 3);
        let text = status_table(&statuses);
        assert!(text.contains("auth failed"), "{text}");
        // A full node's refusal is not a secret problem: 1, and shown as refused.
        let full = NodeState::Refused(
            "the node is full: 40 authenticated connections are open (cluster.max_connections)"
                .into(),
        );
        let statuses = [node(1, full), node(2, up())];
        assert_eq!(exit_code(&statuses), 1);
        let text = status_table(&statuses);
        assert!(
            text.contains("refused") && !text.contains("auth failed"),
            "{text}"
        );
    }

    #[test]
    fn a_filling_node_shows_its_refill_progress() {
        use rdkv_common::protocol::{MemberState, ViewMember};
        let member = |node_id, state| ViewMember { node_id, state };
        let view = ClusterView {
            epoch: 7,
            leader: Some(1),
            members: vec![
                member(1, MemberState::Serving),
                member(2, MemberState::Filling),
                member(3, MemberState::Filling),
            ],
        };
        let stats = ServerStats {
            refill_buckets_scanned: 4_096,
            refill_buckets_total: 16_384,
            refill_keys_copied: 1_234,
            ..ServerStats::default()
        };
        let statuses = [
            node(1, NodeState::Up(Box::default())),
            node(2, NodeState::Up(Box::new(stats))),
            node(3, NodeState::Down("refused".into())),
        ];
        assert_eq!(
            refill_lines(Some(&view), &statuses),
            vec![
                "refill: node 2 filling: 25% of its peers' index scanned (4096 of 16384 buckets), 1234 keys copied".to_string(),
                "refill: node 3 filling: it does not answer".to_string(),
            ]
        );
        assert!(refill_lines(None, &statuses).is_empty());
    }
}
