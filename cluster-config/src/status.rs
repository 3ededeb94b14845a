//! `rdkv-cluster status`: each node's stats and view over an authenticated monitoring
//! connection (no queue pair, no keys), every node asked at once within [`ANSWER_DEADLINE`],
//! as a table and a `view:` line, and an exit code a script can trust: 0 only when every node
//! answers.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdkv_common::protocol::{fetch_report, fetch_stats, ClusterView, MonitoredNode, ServerStats};
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
    /// It could not be asked: nothing accepted the connection (refused, unreachable, or no
    /// connect within [`ANSWER_DEADLINE`]), or the conversation failed (closed, malformed).
    Down(String),
    /// The connection was accepted but the node did not answer within [`ANSWER_DEADLINE`]: a
    /// stopped (SIGSTOP), hung or starved process, whose kernel still accepts for it.
    NoAnswer(String),
}

/// One node's state for `status`.
#[derive(Debug, Clone)]
pub struct NodeStatus {
    /// The node's id.
    pub id: u32,
    /// Its control address.
    pub address: SocketAddr,
    /// Up with its stats, refused, down or silent with why.
    pub state: NodeState,
    /// The cluster view it knows, when it answered: the `view:` line is the newest of these.
    pub view: Option<ClusterView>,
}

/// Whether a node's refusal is of the secret (or the version): `authentication failed: …`. A
/// node can also refuse a monitor because every slot it may take is taken (`the node is
/// full: …`), which is not a secret problem.
pub fn refused_the_secret(reason: &str) -> bool {
    reason.starts_with("authentication failed") || reason.starts_with("protocol version mismatch")
}

/// When a node (`only`, or any) refuses the cluster file's secret: one line that says so and
/// names the fix, for `down` and `restart` to stop on before they ask anything (each node's
/// refusal, repeated per step, made a line of 1,500 characters).
pub async fn secret_refusal(config: &ClusterConfig, only: Option<u32>) -> Option<String> {
    let statuses = status(config).await;
    let refused: Vec<&NodeStatus> = statuses
        .iter()
        .filter(|status| only.is_none_or(|id| id == status.id))
        .filter(|status| matches!(&status.state, NodeState::Refused(reason) if refused_the_secret(reason)))
        .collect();
    let first = refused.first()?;
    let NodeState::Refused(reason) = &first.state else {
        return None;
    };
    let ids: Vec<String> = refused.iter().map(|status| status.id.to_string()).collect();
    Some(format!(
        "node{} {} refused this cluster file's secret ({reason}); nothing was stopped",
        if ids.len() > 1 { "s" } else { "" },
        ids.join(", "),
    ))
}

/// `status`'s exit code: 0 every node up, 1 a node down, not answering (a stopped node is not
/// a healthy one; the state column tells it from a down one) or refusing for another reason
/// (as a full node does), 3 a node refused the secret.
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

/// How long `status` gives each node, from the start of its connect to the end of its answer
/// (challenge, proof, stats, view). Every node is asked at once, so this bounds the whole
/// command, and a script that polls `status` gets an answer in about a second whatever the
/// nodes do.
///
/// One second, the shortest `failure_timeout` a cluster file may set
/// ([`MIN_FAILURE_TIMEOUT`](crate::config::MIN_FAILURE_TIMEOUT)): a node silent this long may
/// already be on its way out of the view, so `status` waits no longer on it than its peers
/// may. A healthy node answers in milliseconds: the slowest part is its exact key count, one
/// scan of its index shared with the other queries (about 1 ms per 8 MiB of index in a release
/// build, as the collector's scan of the same index, `docs/benchmarks.md`), which leaves room
/// for an index of a few GiB, or for a loaded machine.
pub const ANSWER_DEADLINE: Duration = crate::config::MIN_FAILURE_TIMEOUT;

/// Asks every node at once for its stats and the view it knows, each within
/// [`ANSWER_DEADLINE`]; one row per node of the file, in its order.
pub async fn status(config: &ClusterConfig) -> Vec<NodeStatus> {
    let asks = config.nodes.iter().map(|node| async move {
        let monitored = MonitoredNode {
            address: node.control_address,
            id: Some(node.id),
            secret: &config.secret,
        };
        let (state, view) = match fetch_report(monitored, ANSWER_DEADLINE).await {
            Ok(report) => (NodeState::Up(Box::new(report.stats)), Some(report.view)),
            Err(ControlError::Refused { reason }) => (NodeState::Refused(reason), None),
            Err(error @ ControlError::NoAnswer { .. }) => {
                (NodeState::NoAnswer(error.to_string()), None)
            }
            Err(error) => (NodeState::Down(error.to_string()), None),
        };
        NodeStatus {
            id: node.id,
            address: node.control_address,
            state,
            view,
        }
    });
    futures_util::future::join_all(asks).await
}

/// How long `up` waits for its nodes to serve data: the first election and the leases take
/// about a second. Longer while a node that does not serve yet scans its peers (a refill, or the
/// reconciliation after a crash of every node): [`wait_serving`].
pub const SERVING_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a scan may go without progress before [`wait_serving`] stops waiting for it.
const SCAN_STALL: Duration = Duration::from_secs(15);

/// Waits until every node of `ids` answers that it serves data (it holds its lease from the
/// cluster's majority and the view has it): up to `timeout`, and on while a node that does
/// not serve yet makes progress scanning its peers (at most [`REFILL_WAIT`], and until a scan
/// stops moving for [`SCAN_STALL`]), calling `progress` with a line about it every 5 s. The
/// nodes that still do not serve, with why.
pub async fn wait_serving(
    config: &ClusterConfig,
    ids: &[u32],
    timeout: Duration,
    progress: &dyn Fn(&str),
) -> Vec<(u32, String)> {
    let started = Instant::now();
    let mut deadline = started + timeout;
    let mut scanned: Vec<(u32, u64)> = Vec::new();
    let mut last_report = Instant::now();
    loop {
        let mut waiting = Vec::new();
        let mut scans = Vec::new();
        for node in config.nodes.iter().filter(|node| ids.contains(&node.id)) {
            let monitored = MonitoredNode {
                address: node.control_address,
                id: Some(node.id),
                secret: &config.secret,
            };
            match fetch_stats(monitored, Duration::from_secs(1)).await {
                Ok(stats) if stats.serving_data => {}
                Ok(stats) => {
                    if stats.refill_buckets_total > 0 {
                        scans.push((
                            node.id,
                            stats.refill_buckets_scanned,
                            stats.refill_buckets_total,
                        ));
                    }
                    waiting.push((
                        node.id,
                        "it does not serve data yet (no lease from a majority of the nodes, its rejoin is not in the view, or the nodes still reconcile their copies after a crash of all of them)".to_string(),
                    ));
                }
                Err(error) => waiting.push((node.id, error.to_string())),
            }
        }
        if waiting.is_empty() {
            return waiting;
        }
        if scanned_further(&mut scanned, &scans) {
            deadline = deadline
                .max(Instant::now() + SCAN_STALL)
                .min(started + REFILL_WAIT);
        }
        if Instant::now() >= deadline {
            return waiting;
        }
        if !scans.is_empty() && last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            let parts: Vec<String> = scans
                .iter()
                .map(|(id, now, total)| {
                    format!(
                        "node {id} {}% ({now} of {total} buckets)",
                        now * 100 / total
                    )
                })
                .collect();
            progress(&format!(
                "waiting for the nodes to serve: scanning their peers (a refill, or the reconciliation after a crash): {}",
                parts.join(", ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether a node's scan (`scans`: id, buckets scanned, of how many) went past the furthest it
/// reached (`furthest`, updated): one that starts over and fails at the same place again does
/// not keep [`wait_serving`] waiting.
fn scanned_further(furthest: &mut Vec<(u32, u64)>, scans: &[(u32, u64, u64)]) -> bool {
    let mut moved = false;
    for (id, now, _) in scans {
        match furthest.iter_mut().find(|(known, _)| known == id) {
            Some((_, reached)) if *now > *reached => {
                *reached = *now;
                moved = true;
            }
            Some(_) => {}
            None => {
                furthest.push((*id, *now));
                moved = true;
            }
        }
    }
    moved
}

/// How long `restart` waits for the node it started to serve again: its refill copies its keys
/// from its peers (about a second for 10,000 keys; a large table takes longer, and `status`
/// shows the progress).
pub const REFILL_WAIT: Duration = Duration::from_secs(300);

/// Waits, up to `timeout`, until node `id`'s own view has it serving (refilled and promoted),
/// calling `progress` with a line every 5 s meanwhile; `Err` with the last state seen.
pub async fn wait_member_serving(
    config: &ClusterConfig,
    id: u32,
    timeout: Duration,
    progress: impl Fn(&str),
) -> Result<(), String> {
    let Some(node) = config.nodes.iter().find(|node| node.id == id) else {
        return Err(format!("node {id} is not in the cluster file"));
    };
    let monitored = MonitoredNode {
        address: node.control_address,
        id: Some(node.id),
        secret: &config.secret,
    };
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut last_state = String::from("it did not answer");
    loop {
        if let Ok(report) = fetch_report(monitored, ANSWER_DEADLINE).await {
            let state = report
                .view
                .members
                .iter()
                .find(|member| member.node_id == id)
                .map(|member| member.state);
            if state == Some(rdkv_common::protocol::MemberState::Serving)
                && report.stats.serving_data
            {
                return Ok(());
            }
            let statuses = [NodeStatus {
                id,
                address: node.control_address,
                state: NodeState::Up(Box::new(report.stats)),
                view: Some(report.view.clone()),
            }];
            last_state = refill_lines(Some(&report.view), &statuses)
                .into_iter()
                .next()
                .unwrap_or_else(|| format!("node {id}: {}", report.view.summary()));
        }
        if started.elapsed() >= timeout {
            return Err(last_state);
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            progress(&last_state);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The cluster view for the `view:` line: the newest (highest epoch) that the nodes which
/// answered know, the leader's own among equals (the leader learns a commit first); `None`
/// when no node answered. No node is asked again: a stopped leader that the others still
/// name costs nothing more.
pub fn view(statuses: &[NodeStatus]) -> Option<&ClusterView> {
    statuses
        .iter()
        .filter_map(|status| {
            let view = status.view.as_ref()?;
            Some((view, view.leader == Some(status.id)))
        })
        .max_by_key(|(view, own)| (view.epoch, *own))
        .map(|(view, _)| view)
}

/// The `view:` line under the table: the view, or why none is known (nodes that answered but
/// refused this file's secret are not "no answer").
pub fn view_line(view: Option<&ClusterView>, statuses: &[NodeStatus]) -> String {
    match view {
        Some(view) => format!("view: {}", view.summary()),
        None if statuses
            .iter()
            .any(|status| matches!(status.state, NodeState::Refused(_))) =>
        {
            "view: not known: the nodes that answered refused this file's secret".to_string()
        }
        None => "view: no node answered".to_string(),
    }
}

/// Why stopping node `node` alone would lose keys, if it would: with `replicas` ≥ 2, the
/// other members out of service ([`members_out`]), with it, make `replicas` members out at
/// once, so the keys whose copies are all on them have none serving; and each of them
/// empties itself and refills from its serving peers when it comes back, so those keys are
/// lost. `None` when the stop is safe, when `node` is out of service already, or when the
/// view cannot be read (`down` then goes on, as it does for a cluster that does not answer).
pub async fn stop_would_lose(config: &ClusterConfig, node: u32) -> Option<String> {
    let replicas = config.replicas;
    if replicas < 2 {
        return None;
    }
    let statuses = status(config).await;
    let out = members_out(view(&statuses)?, &statuses, node)?;
    if out.len() + 1 < replicas {
        return None;
    }
    let names = out
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(" and ");
    Some(format!(
        "refusing to stop node {node}: node{} {names} {} not serving (down, filling or not answering), and with replicas = {replicas} the keys whose copies are all on {names} and {node} would have no copy serving; each refills from its peers when it comes back, so those keys would be lost. Bring {names} back first (`up --node N`, then wait until `status` shows it serving), or pass --force",
        if out.len() > 1 { "s" } else { "" },
        if out.len() > 1 { "are" } else { "is" },
    ))
}

/// The members other than `node` out of service: down or filling in `view`, or serving there
/// but not answering, or answering that they do not serve (killed or restarted less than
/// `failure_timeout` ago, which the view does not show yet). `None` when `node` itself is out
/// of service already: stopping it takes nothing more out.
fn members_out(view: &ClusterView, statuses: &[NodeStatus], node: u32) -> Option<Vec<u32>> {
    use rdkv_common::protocol::MemberState;
    let serves = |id: u32| {
        let in_view = view
            .members
            .iter()
            .any(|member| member.node_id == id && member.state == MemberState::Serving);
        let answers = statuses.iter().any(|status| {
            status.id == id && matches!(&status.state, NodeState::Up(stats) if stats.serving_data)
        });
        in_view && answers
    };
    if !serves(node) {
        return None;
    }
    Some(
        view.members
            .iter()
            .map(|member| member.node_id)
            .filter(|id| *id != node && !serves(*id))
            .collect(),
    )
}

/// A `refill:` line for each node the view has filling (back after a restart or an absence,
/// copying its keys from its peers): how far its scan of their tables got, and the keys it
/// copied (`docs/operations.md`, *Replication and failover*).
pub fn refill_lines(view: Option<&ClusterView>, statuses: &[NodeStatus]) -> Vec<String> {
    let Some(view) = view else {
        return Vec::new();
    };
    // No member serves (every node was stopped or crashed): the filling members reconcile
    // their copies with each other, then are promoted together (`docs/protocol.md`,
    // *Reconciliation*).
    let reconciling = !view.members.iter().any(|member| member.state.serves_data());
    // Members down while nobody serves: the others wait for them (a stop's resume, or the
    // reconciliation) before they serve.
    let down: Vec<String> = view
        .members
        .iter()
        .filter(|member| member.state == rdkv_common::protocol::MemberState::Down)
        .map(|member| member.node_id.to_string())
        .collect();
    view.members
        .iter()
        .filter(|member| member.state.is_filling())
        .map(|member| {
            let stats = statuses.iter().find_map(|status| match &status.state {
                NodeState::Up(stats) if status.id == member.node_id => Some(stats),
                _ => None,
            });
            match stats {
                Some(stats) if reconciling && stats.reconciled_epoch == view.epoch => format!(
                    "refill: node {} filling: reconciled ({} newer copies taken from the other filling members, {} removed as deleted after its snapshot); promoted once every filling member is",
                    member.node_id, stats.reconciled_keys, stats.reconciled_removed
                ),
                Some(_) if reconciling && !down.is_empty() => format!(
                    "refill: node {} filling: waiting for node {} (down) before the members serve together (after a stop of the whole cluster at most 30 s, after a crash 60 s; start it with `up --node N`)",
                    member.node_id,
                    down.join(" and ")
                ),
                Some(stats) if reconciling && stats.refill_buckets_total > 0 => format!(
                    "refill: node {} filling: reconciling with the other filling members (the newest copy of each key wins): {}% of their index scanned ({} of {} buckets)",
                    member.node_id,
                    stats.refill_buckets_scanned * 100 / stats.refill_buckets_total,
                    stats.refill_buckets_scanned,
                    stats.refill_buckets_total
                ),
                Some(_) if reconciling => format!(
                    "refill: node {} filling: reconciling with the other filling members (the newest copy of each key wins)",
                    member.node_id
                ),
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

/// A line for each member joining or leaving (`rdkv-cluster add-node`, `remove-node`): a
/// joining member's refill has its own line ([`refill_lines`]); a leaving member's says how
/// many keys it handed over.
pub fn membership_lines(view: Option<&ClusterView>, statuses: &[NodeStatus]) -> Vec<String> {
    let Some(view) = view else {
        return Vec::new();
    };
    view.members
        .iter()
        .filter_map(|member| {
            let stats = statuses.iter().find_map(|status| match &status.state {
                NodeState::Up(stats) if status.id == member.node_id => Some(stats),
                _ => None,
            });
            match (member.state, stats) {
                (rdkv_common::protocol::MemberState::Joining, _) => Some(format!(
                    "membership: node {} joining: it fills from the members, then serves",
                    member.node_id
                )),
                (rdkv_common::protocol::MemberState::Leaving, Some(stats)) => Some(format!(
                    "membership: node {} leaving: {}% of its table scanned, {} keys ({} bytes) handed over to the members that take them; it leaves the view when every key it holds has its new copies",
                    member.node_id,
                    (stats.handover_buckets_scanned * 100)
                        .checked_div(stats.handover_buckets_total)
                        .unwrap_or(0),
                    stats.handover_keys_copied,
                    stats.handover_bytes_copied
                )),
                (rdkv_common::protocol::MemberState::Leaving, None) => Some(format!(
                    "membership: node {} leaving: it does not answer",
                    member.node_id
                )),
                _ => None,
            }
        })
        .collect()
}

/// A line for each loss the view records and nobody acknowledged yet: `keys may have been
/// lost: the copies on nodes 2 and 3 were down together at epoch 9 (…)`.
pub fn loss_lines(view: Option<&ClusterView>) -> Vec<String> {
    view.map_or_else(Vec::new, |view| {
        view.losses
            .iter()
            .map(|loss| {
                format!("{loss} (keys held only by them are missing or older; `rdkv-cluster ack-loss FILE` once seen)")
            })
            .collect()
    })
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
                format!("{} ({}%)", stats.keys, stats.index_load_percent()),
                if stats.view_leader == status.id {
                    format!("{} (leader)", stats.view_epoch)
                } else {
                    stats.view_epoch.to_string()
                },
            ],
            NodeState::Refused(reason) | NodeState::Down(reason) | NodeState::NoAnswer(reason) => {
                let state = match &status.state {
                    NodeState::Refused(reason) if refused_the_secret(reason) => "auth failed",
                    NodeState::Refused(_) => "refused",
                    NodeState::NoAnswer(_) => "no answer",
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
            "keys (index %)",
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
            let heap = stats.heap_low().then(|| {
                format!(
                    "warning: node {} heap under 10% free ({} of {}): writes may wait for reclamation; raise heap_size (`rdkv-cluster resize FILE --node {} --heap-size SIZE`; docs/operations.md, Sizing the heap)\n",
                    status.id,
                    rdkv_cluster_file::units::format_bytes(stats.heap_free_bytes),
                    rdkv_cluster_file::units::format_bytes(stats.heap_size_bytes),
                    status.id
                )
            });
            let index = stats.index_high().then(|| {
                format!(
                    "warning: node {} index {}% full ({} keys in {} slots): inserts may fail TableFull; raise index_size (`rdkv-cluster resize FILE --node {} --index-size SIZE`)\n",
                    status.id,
                    stats.index_load_percent(),
                    stats.keys,
                    stats.index_slots,
                    status.id
                )
            });
            let both: String = heap.into_iter().chain(index).collect();
            (!both.is_empty()).then_some(both)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scan_that_starts_over_is_progress_only_past_where_it_reached() {
        let mut furthest = Vec::new();
        assert!(scanned_further(&mut furthest, &[(1, 100, 1_000)]));
        assert!(!scanned_further(&mut furthest, &[(1, 100, 1_000)]));
        assert!(scanned_further(&mut furthest, &[(1, 400, 1_000)]));
        // Started over after a failure: not progress until it passes 400 again.
        assert!(!scanned_further(&mut furthest, &[(1, 0, 1_000)]));
        assert!(!scanned_further(&mut furthest, &[(1, 300, 1_000)]));
        assert!(scanned_further(
            &mut furthest,
            &[(1, 500, 1_000), (2, 0, 10)]
        ));
        assert!(scanned_further(&mut furthest, &[(2, 5, 10)]));
    }

    fn node(id: u32, state: NodeState) -> NodeStatus {
        NodeStatus {
            id,
            address: "127.0.0.1:1".parse().expect("an address"),
            state,
            view: None,
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
    fn a_node_that_does_not_answer_is_not_healthy_nor_down() {
        let silent = NodeState::NoAnswer(
            "the connection was accepted, but the node did not answer within 1s".into(),
        );
        let statuses = [node(1, NodeState::Up(Box::default())), node(2, silent)];
        assert_eq!(exit_code(&statuses), 1);
        let text = status_table(&statuses);
        let row = text
            .lines()
            .find(|line| line.starts_with('2'))
            .expect("node 2's row");
        assert!(row.contains("no answer") && !row.contains("down"), "{text}");
    }

    #[test]
    fn the_view_line_is_the_newest_view_an_answering_node_knows() {
        use rdkv_common::protocol::{MemberState, ViewMember};
        let led_by = |epoch, leader| ClusterView {
            epoch,
            leader: Some(leader),
            members: (1..=3)
                .map(|node_id| ViewMember {
                    node_id,
                    state: MemberState::Serving,
                })
                .collect(),
            losses: Vec::new(),
        };
        let answered = |id, known: ClusterView| NodeStatus {
            view: Some(known),
            ..node(id, NodeState::Up(Box::default()))
        };
        // Node 1 still knows the view of epoch 4, led by node 2, which does not answer; node 3
        // has learnt epoch 5 (node 3 leads).
        let statuses = [
            answered(1, led_by(4, 2)),
            node(2, NodeState::NoAnswer("silent".into())),
            answered(3, led_by(5, 3)),
        ];
        assert_eq!(view(&statuses).map(|newest| newest.epoch), Some(5));
        // Equal epochs: the leader's own.
        let statuses = [answered(1, led_by(5, 2)), answered(2, led_by(5, 2))];
        assert!(std::ptr::eq(
            view(&statuses).expect("a view"),
            statuses[1].view.as_ref().expect("node 2's view")
        ));
        let nobody = [node(1, NodeState::Down("refused".into()))];
        assert_eq!(view_line(view(&nobody), &nobody), "view: no node answered");
        let wrong_secret = [node(1, NodeState::Refused("authentication failed".into()))];
        assert!(
            view_line(view(&wrong_secret), &wrong_secret).contains("refused this file's secret")
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
            losses: Vec::new(),
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

    #[test]
    fn members_joining_and_leaving_show_under_the_view() {
        use rdkv_common::protocol::{MemberState, ViewMember};
        let member = |node_id, state| ViewMember { node_id, state };
        let view = ClusterView {
            epoch: 9,
            leader: Some(2),
            members: vec![
                member(1, MemberState::Leaving),
                member(2, MemberState::Serving),
                member(4, MemberState::Joining),
            ],
            losses: Vec::new(),
        };
        let leaving = ServerStats {
            handover_keys_copied: 495,
            handover_bytes_copied: 9_900,
            handover_buckets_scanned: 1_024,
            handover_buckets_total: 4_096,
            ..ServerStats::default()
        };
        let statuses = [
            node(1, NodeState::Up(Box::new(leaving))),
            node(2, NodeState::Up(Box::default())),
            node(4, NodeState::Up(Box::default())),
        ];
        assert_eq!(
            membership_lines(Some(&view), &statuses),
            vec![
                "membership: node 1 leaving: 25% of its table scanned, 495 keys (9900 bytes) handed over to the members that take them; it leaves the view when every key it holds has its new copies".to_string(),
                "membership: node 4 joining: it fills from the members, then serves".to_string(),
            ]
        );
        assert_eq!(
            refill_lines(Some(&view), &statuses),
            vec!["refill: node 4 filling: starting".to_string()],
            "a joining member's refill shows as a restarted one's"
        );
    }

    #[test]
    fn the_members_out_count_the_view_and_the_nodes_answers() {
        use rdkv_common::protocol::{MemberState, ViewMember};
        let view = ClusterView {
            epoch: 4,
            leader: Some(1),
            members: vec![
                ViewMember {
                    node_id: 1,
                    state: MemberState::Serving,
                },
                ViewMember {
                    node_id: 2,
                    state: MemberState::Serving,
                },
                ViewMember {
                    node_id: 3,
                    state: MemberState::Down,
                },
            ],
            losses: Vec::new(),
        };
        let serving = || {
            NodeState::Up(Box::new(ServerStats {
                serving_data: true,
                ..ServerStats::default()
            }))
        };
        let answering = [node(1, serving()), node(2, serving()), node(3, serving())];
        assert_eq!(members_out(&view, &answering, 1), Some(vec![3]));
        assert_eq!(
            members_out(&view, &answering, 3),
            None,
            "node 3 is out already"
        );
        // Killed a moment ago: still serving in the view, but it does not answer.
        let killed = [
            node(1, serving()),
            node(2, NodeState::Down("refused".into())),
            node(3, serving()),
        ];
        assert_eq!(members_out(&view, &killed, 1), Some(vec![2, 3]));
    }

    #[test]
    fn filling_members_with_no_serving_one_show_their_reconciliation() {
        use rdkv_common::protocol::{MemberState, ViewMember};
        let member = |node_id| ViewMember {
            node_id,
            state: MemberState::Filling,
        };
        let view = ClusterView {
            epoch: 9,
            leader: Some(1),
            members: vec![member(1), member(2)],
            losses: Vec::new(),
        };
        let reconciled = ServerStats {
            reconciled_epoch: 9,
            reconciled_keys: 17,
            reconciled_removed: 3,
            ..ServerStats::default()
        };
        let statuses = [
            node(1, NodeState::Up(Box::new(reconciled))),
            node(2, NodeState::Up(Box::default())),
        ];
        assert_eq!(
            refill_lines(Some(&view), &statuses),
            vec![
                "refill: node 1 filling: reconciled (17 newer copies taken from the other filling members, 3 removed as deleted after its snapshot); promoted once every filling member is".to_string(),
                "refill: node 2 filling: reconciling with the other filling members (the newest copy of each key wins)".to_string(),
            ]
        );
        // A member down meanwhile: they wait for it, and the line names it.
        let mut waiting = view.clone();
        waiting.members.push(ViewMember {
            node_id: 3,
            state: MemberState::Down,
        });
        let lines = refill_lines(Some(&waiting), &statuses);
        assert!(
            lines[1].starts_with("refill: node 2 filling: waiting for node 3 (down)")
                && lines[1].contains("`up --node N`"),
            "{lines:?}"
        );
    }
}
