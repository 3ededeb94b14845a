//! `rdkv-cluster add-node` and `remove-node`: changing the view's members of a running
//! cluster (`docs/operations.md`, *Growing and shrinking a cluster*; `docs/protocol.md`,
//! *Membership changes*).
//!
//! - **add-node**: the node, listed in the edited cluster file and not a member of the view,
//!   is started here with `--join`; a member is asked to have the leader add it (a Raft
//!   learner, a member of the view, a voter); the command waits until it is refilled and
//!   serves.
//! - **remove-node**: a member is asked to have the leader retire the node (leaving); the node
//!   hands its keys over to the members that take them and is removed from the view; the
//!   command waits for that, then stops the node. A member that is `down` is removed at once,
//!   and the command waits until the members that serve have re-replicated its keys.

use std::path::Path;
use std::time::{Duration, Instant};

use rdkv_cluster_file::ClusterConfig;
use rdkv_common::protocol::{
    fetch_stats, request_membership_change, ClusterView, MemberState, MembershipChange,
    MonitoredNode,
};

use crate::error::{Error, Result};
use crate::{launcher, status};

/// How long a member is given to have the leader commit a change (a learner catching up on
/// the view's log, a joint configuration committing).
const CHANGE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long `remove-node` waits for the node's hand-over and removal.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(300);

/// `add-node`: starts node `node_id` with `--join`, has the leader add it, and waits until it
/// serves. Lines go to `say`.
///
/// # Errors
/// [`Error::Refused`] with the reason and the fix: the node is not in the file, is a member
/// already, failed to start, or was not added or not serving in time.
pub async fn add_node(
    config: &ClusterConfig,
    run_directory: &Path,
    node_id: u32,
    say: impl Fn(&str),
) -> Result<()> {
    let node = config
        .nodes
        .iter()
        .find(|node| node.id == node_id)
        .ok_or_else(|| {
            Error::Refused(format!(
                "node {node_id} is not in {}: add its [[node]] section (id, control_address, fabric_address, sizes) first",
                config.path.display()
            ))
        })?;
    let view = current_view(config, Some(node_id)).await?;
    match view.members.iter().find(|member| member.node_id == node_id) {
        Some(member) if member.state == MemberState::Serving => {
            say(&format!("node {node_id} is a member already, serving"));
            return Ok(());
        }
        Some(_) => say(&format!(
            "node {node_id} is a member already ({}): waiting until it serves",
            view.summary()
        )),
        None if !launcher::running_nodes(&[node], run_directory).is_empty() => say(&format!(
            "node {node_id} runs already (started with --join): asking the leader to add it"
        )),
        None => {
            let started = launcher::start_joining(config, run_directory, node_id)?;
            say(&format!(
                "node {node_id}: started (pid {}) to join the cluster",
                started.ready.pid
            ));
        }
    }
    let change = MembershipChange::Add {
        node_id,
        control_address: node.control_address.to_string(),
    };
    let epoch = ask_members(config, node_id, change).await?;
    say(&format!(
        "node {node_id}: a member at epoch {epoch}; it fills from the members before it serves"
    ));
    status::wait_member_serving(config, node_id, status::REFILL_WAIT, &say)
        .await
        .map_err(|last| {
            Error::Refused(format!(
                "node {node_id} is not serving after {:?} ({last}); `rdkv-cluster status {}` shows its refill",
                status::REFILL_WAIT,
                config.path.display()
            ))
        })?;
    say(&format!("node {node_id}: serving"));
    Ok(())
}

/// `remove-node`: has the leader retire member `node_id`, waits until it has handed its keys
/// over and is out of the view, then stops it. Lines go to `say`.
///
/// # Errors
/// [`Error::Refused`] with the reason and the fix: the node is not a serving member, the
/// change was not committed, or the hand-over did not end in time.
pub async fn remove_node(
    config: &ClusterConfig,
    run_directory: &Path,
    node_id: u32,
    lose_keys: bool,
    say: impl Fn(&str),
) -> Result<()> {
    if !config.nodes.iter().any(|node| node.id == node_id) {
        return Err(Error::Refused(format!(
            "node {node_id} is not in {}: keep its [[node]] section until remove-node has removed it (its hand-over reads the file)",
            config.path.display()
        )));
    }
    let view = current_view(config, None).await?;
    if !view.members.iter().any(|member| member.node_id == node_id) {
        say(&format!("node {node_id} is not a member of the view"));
        return stop_removed(config, run_directory, node_id, &say).await;
    }
    if dead_member(config, node_id, &say).await? {
        return remove_dead_member(config, run_directory, node_id, lose_keys, &say).await;
    }
    let change = MembershipChange::Remove { node_id, lose_keys };
    let epoch = ask_members(config, node_id, change).await?;
    say(&format!(
        "node {node_id}: leaving at epoch {epoch}; it serves until every key it holds has its new copies"
    ));
    let started = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let view = current_view(config, Some(node_id)).await?;
        if !view.members.iter().any(|member| member.node_id == node_id) {
            break;
        }
        if started.elapsed() >= HANDOVER_WAIT {
            return Err(Error::Refused(format!(
                "node {node_id} is still a member after {HANDOVER_WAIT:?} ({}); its log (`rdkv-cluster logs {} --node {node_id}`) says why",
                view.summary(),
                config.path.display()
            )));
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            say(&handover_line(config, node_id).await);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    say(&format!(
        "node {node_id}: removed from the view; {}",
        handover_line(config, node_id).await
    ));
    stop_removed(config, run_directory, node_id, &say).await
}

/// `remove-node` of member `node_id`, which is `down`: the leader removes it at once (refused
/// with one copy of each key unless `lose_keys`), then the command waits until every member
/// that serves has re-replicated its keys ([`wait_rereplicated`]).
async fn remove_dead_member(
    config: &ClusterConfig,
    run_directory: &Path,
    node_id: u32,
    lose_keys: bool,
    say: &impl Fn(&str),
) -> Result<()> {
    let change = MembershipChange::Remove { node_id, lose_keys };
    let epoch = ask_members(config, node_id, change).await?;
    if config.replicas <= 1 {
        say(&format!(
            "node {node_id}: removed while down at epoch {epoch}; its keys had no other copy and are lost (the view records the loss: `rdkv-cluster status`, then `rdkv-cluster ack-loss`)"
        ));
        return stop_removed(config, run_directory, node_id, say).await;
    }
    say(&format!(
        "node {node_id}: removed while down at epoch {epoch}; the members copy its keys again (re-replication)"
    ));
    wait_rereplicated(config, epoch, say).await?;
    say("re-replication done: every key has its full number of copies");
    stop_removed(config, run_directory, node_id, say).await
}

/// Waits until every member that serves reports a re-replication finished under the view of
/// `epoch` or a later one, and none pending.
async fn wait_rereplicated(config: &ClusterConfig, epoch: u64, say: &impl Fn(&str)) -> Result<()> {
    let started = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let statuses = status::status(config).await;
        let view = status::view(&statuses).cloned();
        let waiting = status::rereplication_waiting(view.as_ref(), &statuses, epoch);
        if waiting.is_empty() {
            return Ok(());
        }
        if started.elapsed() >= HANDOVER_WAIT {
            return Err(Error::Refused(format!(
                "nodes {waiting:?} have not re-replicated after {HANDOVER_WAIT:?}; their logs (`rdkv-cluster logs {}`) say why",
                config.path.display()
            )));
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            for line in status::rereplication_lines(view.as_ref(), &statuses) {
                say(&line);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether member `node_id` is down: the view has it down, or it does not answer and the view
/// marks it down within a few failure timeouts (a node just killed). `false` when it serves
/// and answers.
///
/// # Errors
/// [`Error::Refused`] when it neither answers nor is marked down in that time.
async fn dead_member(config: &ClusterConfig, node_id: u32, say: &impl Fn(&str)) -> Result<bool> {
    let bound = config.failure_timeout * 5 + Duration::from_secs(5);
    let started = Instant::now();
    let mut said = false;
    loop {
        let view = current_view(config, Some(node_id)).await?;
        let state = view
            .members
            .iter()
            .find(|member| member.node_id == node_id)
            .map(|member| member.state);
        if state == Some(MemberState::Down) {
            return Ok(true);
        }
        if state != Some(MemberState::Serving) || answers(config, node_id).await {
            return Ok(false);
        }
        if started.elapsed() >= bound {
            return Err(Error::Refused(format!(
                "node {node_id} does not answer, and the view still has it serving after {bound:?}: `rdkv-cluster status {}` shows why",
                config.path.display()
            )));
        }
        if !said {
            said = true;
            say(&format!(
                "node {node_id} does not answer: waiting for the view to mark it down (failure_timeout)"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether node `node_id` answers with its stats.
async fn answers(config: &ClusterConfig, node_id: u32) -> bool {
    let Some(node) = config.nodes.iter().find(|node| node.id == node_id) else {
        return false;
    };
    let monitored = MonitoredNode {
        address: node.control_address,
        id: Some(node.id),
        secret: &config.secret,
    };
    fetch_stats(monitored, Duration::from_secs(1)).await.is_ok()
}

/// Why node `node_id` (or, with `None`, any node of the file) must not be started by `up` or
/// `restart`: it was a member (a view state in `run_directory`, or a node on another host)
/// and a running cluster's view no longer names it (it was removed, perhaps while it was
/// down). Started, it would not serve as the old member; it joins as a new one through
/// `add-node`. `None` when no member answers. (A local node that never joined has no view
/// state: the launcher refuses it with its own line.)
pub async fn not_a_member(
    config: &ClusterConfig,
    run_directory: &Path,
    node_id: Option<u32>,
) -> Option<String> {
    let statuses = status::status(config).await;
    let view = status::view(&statuses)?;
    if view.members.is_empty() {
        return None;
    }
    let outsider = config
        .nodes
        .iter()
        .filter(|node| {
            node.host.is_some() || launcher::view_state_file(run_directory, node.id).exists()
        })
        .map(|node| node.id)
        .filter(|id| node_id.is_none_or(|node_id| node_id == *id))
        .find(|id| !view.members.iter().any(|member| member.node_id == *id))?;
    Some(format!(
        "node {outsider} is not a member of the running cluster's view (it was removed): it cannot come back as the old member; add it as a new one with `rdkv-cluster add-node {} --node {outsider}`",
        config.path.display()
    ))
}

/// Stops a node that is no longer a member, and says to take it out of the cluster file.
async fn stop_removed(
    config: &ClusterConfig,
    run_directory: &Path,
    node_id: u32,
    say: &impl Fn(&str),
) -> Result<()> {
    for line in launcher::stop(config, run_directory, Some(node_id)).await? {
        say(&line);
    }
    say(&format!(
        "node {node_id}: removed; take its [[node]] section out of {}",
        config.path.display()
    ));
    Ok(())
}

/// The leaving node's hand-over progress, as a line.
async fn handover_line(config: &ClusterConfig, node_id: u32) -> String {
    let Some(node) = config.nodes.iter().find(|node| node.id == node_id) else {
        return format!("node {node_id}: not in the cluster file");
    };
    let monitored = MonitoredNode {
        address: node.control_address,
        id: Some(node.id),
        secret: &config.secret,
    };
    match fetch_stats(monitored, Duration::from_secs(1)).await {
        Ok(stats) => format!(
            "node {node_id}: {} keys ({} bytes) handed over",
            stats.handover_keys_copied, stats.handover_bytes_copied
        ),
        Err(error) => format!("node {node_id}: {error}"),
    }
}

/// The newest view the members answer with (not asking `except`, a node being added or
/// removed).
async fn current_view(config: &ClusterConfig, except: Option<u32>) -> Result<ClusterView> {
    let statuses = status::status(config).await;
    let answered: Vec<status::NodeStatus> = statuses
        .into_iter()
        .filter(|status| Some(status.id) != except)
        .collect();
    status::view(&answered).cloned().ok_or_else(|| {
        Error::Refused(format!(
            "no member of the cluster in {} answered: start it with `rdkv-cluster up` first",
            config.path.display()
        ))
    })
}

/// Asks the members (every node of the file but `node_id`), one after another, to have the
/// leader commit `change`; the epoch of the view with it. A leader being elected is asked
/// again for a few seconds.
async fn ask_members(
    config: &ClusterConfig,
    node_id: u32,
    change: MembershipChange,
) -> Result<u64> {
    let started = Instant::now();
    let mut last_error = String::from("no member answered");
    while started.elapsed() < CHANGE_TIMEOUT {
        for node in config.nodes.iter().filter(|node| node.id != node_id) {
            let monitored = MonitoredNode {
                address: node.control_address,
                id: Some(node.id),
                secret: &config.secret,
            };
            match request_membership_change(monitored, change.clone(), CHANGE_TIMEOUT).await {
                Ok(epoch) => return Ok(epoch),
                Err(rdkv_common::ControlError::Refused { reason })
                    if !reason.contains("leader") && !reason.contains("within") =>
                {
                    return Err(Error::Refused(reason));
                }
                Err(error) => last_error = format!("node {}: {error}", node.id),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(Error::Refused(format!(
        "the membership change was not committed within {CHANGE_TIMEOUT:?}: {last_error}"
    )))
}
