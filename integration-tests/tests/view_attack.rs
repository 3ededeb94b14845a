//! Attacks on the cluster view (`docs/architecture.md`, *Cluster view*): nodes stopped with
//! SIGSTOP (alive but silent), repeated restarts, a two-node cluster that loses a node, a
//! member whose state file was deleted, and hostile `Peer` payloads on an authenticated
//! connection. Each test runs its own real cluster; the tests of this file run one at a time
//! (a lock) so that the 2-core CI machines see one cluster at a time.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_common::protocol::{MemberState, MonitoredNode, PeerConnection};
use rdkv_integration_tests::view::*;

/// One cluster at a time (a tokio mutex: each test has its own runtime, and a failed test
/// does not poison it).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A SIGSTOPped follower is committed down once, stays down while stopped, and after SIGCONT
/// rejoins once (one more epoch) and stays; the leader does not change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_follower_leaves_once_and_rejoins_once() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, view, leader) =
        up_settled("va-stop-follower", 3).await.parts();
    let follower = *ids.iter().find(|id| **id != leader).expect("another node");

    let stopped = signal(&cluster, follower, Signal::SIGSTOP);
    let _resume = Resume(pid_of(&cluster, follower));
    let (down, seen) = wait_for_state(&nodes, &secret, leader, follower, MemberState::Down).await;
    eprintln!(
        "stopped follower {follower} down after {:?}",
        seen - stopped
    );
    assert_eq!(down.epoch, view.epoch + 1, "{down:?}");
    // Stopped for 3 failure timeouts in all: nothing else changes meanwhile.
    let log_before = log_of(&cluster, leader).len();
    let logged_from = Instant::now();
    tokio::time::sleep((stopped + FAILURE_TIMEOUT * 3).saturating_duration_since(Instant::now()))
        .await;
    eprintln!(
        "the leader logged {:.0} bytes/s while the follower was stopped",
        log_of(&cluster, leader).len().saturating_sub(log_before) as f64
            / logged_from.elapsed().as_secs_f64()
    );
    let still = view_of(&nodes, &secret, leader)
        .await
        .expect("the leader answers");
    assert_eq!(still.epoch, down.epoch, "{still:?}");

    let resumed = signal(&cluster, follower, Signal::SIGCONT);
    let (back, seen) =
        wait_for_state(&nodes, &secret, leader, follower, MemberState::Serving).await;
    eprintln!(
        "resumed follower {follower} serving after {:?}",
        seen - resumed
    );
    // Watch the leader for 3 s: the same leader, no other epoch.
    let mut leaders = Vec::new();
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(3) {
        if let Some(seen) = view_of(&nodes, &secret, leader).await {
            if leaders.last() != Some(&seen.leader) {
                leaders.push(seen.leader);
            }
            assert_eq!(seen.epoch, back.epoch, "the view changed again: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let settled = wait_settled(&nodes, &secret, &ids, Duration::from_secs(5))
        .await
        .expect("all three agree");
    assert_eq!(
        settled.epoch,
        view.epoch + 3,
        "one down, one join (filling) and one promotion: {settled:?}"
    );
    eprintln!("leaders the old leader named after the resume: {leaders:?}");
}

/// A SIGSTOPped leader is replaced and committed down; after SIGCONT the three settle on one
/// leader and one view with it serving, and nothing changes for 2 s more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_is_replaced_and_the_cluster_settles_after_it_resumes() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("va-stop-leader", 3).await.parts();
    let survivor = *ids.iter().find(|id| **id != leader).expect("another node");

    let stopped = signal(&cluster, leader, Signal::SIGSTOP);
    let _resume = Resume(pid_of(&cluster, leader));
    let (after, seen) = wait_for_view(&nodes, &secret, survivor, Duration::from_secs(10), |seen| {
        state_of(seen, leader) == Some(MemberState::Down)
            && seen.leader.is_some_and(|new| new != leader)
    })
    .await
    .expect("a new leader commits the stopped one down");
    eprintln!(
        "stopped leader {leader} down after {:?}, new leader {:?}",
        seen - stopped,
        after.leader
    );
    tokio::time::sleep((stopped + FAILURE_TIMEOUT * 3).saturating_duration_since(Instant::now()))
        .await;
    let resumed = signal(&cluster, leader, Signal::SIGCONT);
    let settled = wait_settled(&nodes, &secret, &ids, Duration::from_secs(10))
        .await
        .expect("all three agree again");
    eprintln!(
        "settled {:?} after the resume: {settled:?}",
        resumed.elapsed()
    );
    tokio::time::sleep(FAILURE_TIMEOUT * 2).await;
    let later = wait_settled(&nodes, &secret, &ids, Duration::from_secs(5))
        .await
        .expect("still agreed");
    assert_eq!(
        later.epoch, settled.epoch,
        "the view changed again: {later:?}"
    );
    // The resumed old leader's failure detector must not act on its stale leadership (it
    // knows it was paused: its ticks stopped) and try to commit its healthy peers down.
    let log = log_of(&cluster, leader);
    let spurious = log
        .lines()
        .filter(|line| line.contains("missed its heartbeats"))
        .count();
    assert_eq!(
        spurious, 0,
        "the resumed old leader tried to mark its peers down"
    );
}

/// Five quick restarts of one node: five to fifteen epochs (a join as filling and a promotion
/// each, and a join again for a restart during a refill), the cluster settles, and the
/// state file grows by a few dozen bytes per epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_quick_restarts_are_five_epochs_and_the_cluster_settles() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, view, leader) = up_settled("va-restarts", 3).await.parts();
    let follower = *ids.iter().find(|id| **id != leader).expect("another node");
    let size_before = state_file_size(&cluster, leader);
    for _ in 0..5 {
        // The epoch before the restart: the node may join before the command returns.
        let epoch = view_of(&nodes, &secret, leader)
            .await
            .map_or(0, |seen| seen.epoch);
        let restart = cluster_command(&cluster, "restart", Some(follower));
        assert!(
            restart.status.success(),
            "{}",
            String::from_utf8_lossy(&restart.stderr)
        );
        // Until it has joined as the new incarnation (else two restarts are one epoch).
        wait_for_view(&nodes, &secret, leader, Duration::from_secs(10), |seen| {
            seen.epoch > epoch && state_of(seen, follower) == Some(MemberState::Serving)
        })
        .await
        .expect("the restarted node joins");
    }
    let settled = wait_settled(&nodes, &secret, &ids, Duration::from_secs(10))
        .await
        .expect("the cluster settles after the restarts");
    let epochs = settled.epoch - view.epoch;
    let growth = state_file_size(&cluster, leader).saturating_sub(size_before);
    eprintln!("5 restarts: {epochs} epochs, state file +{growth} bytes");
    // A join (filling) and a promotion per restart; a restart during a refill joins again.
    assert!((5..=15).contains(&epochs), "{epochs} epochs for 5 restarts");
    assert!(growth < 200 * epochs, "{growth} bytes for {epochs} epochs");
}

/// `down` of nodes 1 and 2: the last one still answers FetchView and `status` at once, and
/// stops within 2 s itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_node_standing_answers_and_stops_promptly() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret) = up("va-last-node", 3);
    let ids: Vec<u32> = nodes.iter().map(|(id, _)| *id).collect();
    wait_settled(&nodes, &secret, &ids, Duration::from_secs(20))
        .await
        .expect("the cluster settles");
    for id in [1, 2] {
        stop_within(&cluster, id, Duration::from_secs(3));
    }
    tokio::time::sleep(FAILURE_TIMEOUT * 2).await;
    for _ in 0..10 {
        let started = Instant::now();
        let view = view_of(&nodes, &secret, 3).await;
        assert!(
            view.is_some() && started.elapsed() < Duration::from_millis(300),
            "{view:?} after {:?}",
            started.elapsed()
        );
    }
    let started = Instant::now();
    let status = cluster_command(&cluster, "status", None);
    let printed = String::from_utf8_lossy(&status.stdout);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "status took {:?}",
        started.elapsed()
    );
    assert!(printed.contains("view: epoch"), "{printed}");
    stop_within(&cluster, 3, Duration::from_secs(2));
}

/// `rdkv-cluster down --node ID` succeeds within `limit`.
fn stop_within(cluster: &rdkv_integration_tests::cluster::Cluster, id: u32, limit: Duration) {
    let started = Instant::now();
    let down = cluster_command(cluster, "down", Some(id));
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(
        started.elapsed() < limit,
        "down --node {id} took {:?}",
        started.elapsed()
    );
}

/// Two nodes, one dies: the survivor (the leader) cannot commit it down (no majority). It must
/// not grow its state file meanwhile, and when the dead node returns, the view must not mark
/// the node down after it came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_node_leader_with_a_dead_peer_does_not_grow_its_log() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, view, leader) = up_settled("va-two-nodes", 2).await.parts();
    let other = *ids.iter().find(|id| **id != leader).expect("another node");
    signal(&cluster, other, Signal::SIGKILL);
    tokio::time::sleep(FAILURE_TIMEOUT + Duration::from_millis(500)).await;
    let first = state_file_size(&cluster, leader);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let growth = state_file_size(&cluster, leader).saturating_sub(first);
    let started = Instant::now();
    let status = cluster_command(&cluster, "status", None);
    let status_took = started.elapsed();
    let during = view_of(&nodes, &secret, leader)
        .await
        .expect("the survivor answers");
    eprintln!(
        "2 nodes, {other} dead: the survivor's state file grew {growth} bytes in 5 s; status took {status_took:?}; view {during:?}; {}",
        String::from_utf8_lossy(&status.stdout).lines().last().unwrap_or_default()
    );

    let up = cluster_command(&cluster, "up", Some(other));
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    // It joins as a new incarnation: a new epoch.
    wait_for_view(&nodes, &secret, leader, Duration::from_secs(10), |seen| {
        seen.epoch > view.epoch && state_of(seen, other) == Some(MemberState::Serving)
    })
    .await
    .expect("the returned node joins");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let back = wait_settled(&nodes, &secret, &ids, Duration::from_secs(10))
        .await
        .expect("the two settle");
    let downs_after_return = log_of(&cluster, leader)
        .lines()
        .filter(|line| line.contains("view committed") && line.contains("MarkDown"))
        .count();
    eprintln!("after the return: {back:?}, {downs_after_return} MarkDown committed");
    let mut problems = Vec::new();
    if growth > 100 {
        problems.push(format!(
            "the leader's state file grew {growth} bytes in 5 s with its peer dead (uncommittable MarkDown entries appended every failure_timeout)"
        ));
    }
    if downs_after_return > 0 {
        problems.push(format!(
            "node {other} was committed down only after it came back ({downs_after_return} stale MarkDown), epoch {} -> {}",
            view.epoch, back.epoch
        ));
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// A follower whose state file is deleted while it is stopped (what the corrupt-file error
/// says to do) restarts: the cluster must settle with one leader, and no node's Raft may die.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_restarted_without_its_state_file_does_not_kill_the_leader() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("va-wiped", 3).await.parts();
    let follower = *ids.iter().find(|id| **id != leader).expect("another node");
    let down = cluster_command(&cluster, "down", Some(follower));
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    std::fs::remove_file(cluster.run_directory.join(format!("node-{follower}.view")))
        .expect("delete the state file");
    let up = cluster_command(&cluster, "up", Some(follower));
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    let settled = wait_settled(&nodes, &secret, &ids, Duration::from_secs(8)).await;
    let panicked: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|id| log_of(&cluster, *id).contains("panicked at"))
        .collect();
    assert!(
        settled.is_ok() && panicked.is_empty(),
        "views: {settled:?}; Raft panicked on nodes {panicked:?}: {}",
        panicked
            .first()
            .map(|id| log_of(&cluster, *id)
                .lines()
                .skip_while(|line| !line.contains("panicked at"))
                .take(2)
                .collect::<Vec<_>>()
                .join(" "))
            .unwrap_or_default()
    );
}

/// Bincode of `PeerRequest::Join { node_id, incarnation }` (variant 3).
fn join_payload(node_id: u32, incarnation: u64) -> Vec<u8> {
    let mut payload = 3u32.to_le_bytes().to_vec();
    payload.extend(node_id.to_le_bytes());
    payload.extend(incarnation.to_le_bytes());
    payload
}

/// The variant of a bincode `PeerReply` (3: Join, 4: Malformed).
fn reply_variant(reply: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(reply.get(..4)?.try_into().ok()?))
}

async fn peer(nodes: &Nodes, secret: &[u8], id: u32) -> PeerConnection {
    let node = MonitoredNode {
        address: address(nodes, id),
        id: Some(id),
        secret,
    };
    PeerConnection::open(node, Duration::from_secs(2))
        .await
        .expect("an authenticated peer connection")
}

/// Garbage `Peer` payloads get `Malformed` and change nothing; Joins for a node id that is not
/// in the cluster must not grow the log (each is committed as an entry that changes nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peer_payloads_are_refused_and_do_not_grow_the_log() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, view, leader) =
        up_settled("va-peer-payloads", 3).await.parts();
    let mut connection = peer(&nodes, &secret, leader).await;
    let timeout = Duration::from_secs(3);

    // Random bytes (the first word never a valid variant), wrong types, 60 KiB, empty.
    let mut payloads: Vec<Vec<u8>> = (0..50)
        .map(|index| {
            let mut bytes: Vec<u8> = (0..(index * 37) % 2000 + 4)
                .map(|_| rand::random())
                .collect();
            bytes[3] = 0x80;
            bytes
        })
        .collect();
    payloads.push(vec![]);
    payloads.push(vec![0xab; 60 * 1024]);
    payloads.push(4u32.to_le_bytes().to_vec()); // a PeerReply-only variant
    payloads.push(vec![1, 0, 0, 0, 1]); // a Vote cut short
    payloads.push(vec![3, 0, 0, 0, 1, 0, 0, 0]); // a Join cut short
    payloads.push(vec![
        0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
    ]); // huge length
    let started = Instant::now();
    for payload in payloads {
        let reply = connection
            .request(payload, timeout)
            .await
            .expect("an answer");
        assert_eq!(reply_variant(&reply), Some(4), "Malformed expected");
    }
    eprintln!("56 malformed payloads answered in {:?}", started.elapsed());

    // Joins for a node id the cluster does not have.
    let size_before = state_file_size(&cluster, leader);
    let started = Instant::now();
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..100 {
        let reply = connection
            .request(join_payload(99, rand::random()), timeout)
            .await
            .expect("an answer");
        *answers
            .entry(format!("{:?}", reply_variant(&reply)))
            .or_default() += 1;
    }
    let took = started.elapsed();
    let growth = state_file_size(&cluster, leader).saturating_sub(size_before);
    let after = wait_settled(&nodes, &secret, &ids, Duration::from_secs(5))
        .await
        .expect("the cluster still agrees");
    eprintln!(
        "100 Joins for unknown node 99 in {took:?}: answers {answers:?}, leader state file +{growth} bytes, epoch {} -> {}",
        view.epoch, after.epoch
    );
    let mut problems = Vec::new();
    if after.epoch != view.epoch {
        problems.push(format!(
            "an unknown node's joins changed the view: {after:?}"
        ));
    }
    if growth >= 1024 {
        problems.push(format!(
            "100 Joins for a node not in the cluster grew the leader's state file by {growth} bytes (one log entry each)"
        ));
    }

    // Joins for a real member under made-up incarnations: each is an epoch, and the member
    // then rejoins as itself, another epoch (the secret is the authority: measured only).
    let follower = *ids.iter().find(|id| **id != leader).expect("a follower");
    for _ in 0..10 {
        connection
            .request(join_payload(follower, rand::random()), timeout)
            .await
            .expect("an answer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let flapped = wait_settled(&nodes, &secret, &ids, Duration::from_secs(5))
        .await
        .expect("the cluster agrees again");
    eprintln!(
        "10 Joins for member {follower} under made-up incarnations: epoch {} -> {}",
        after.epoch, flapped.epoch
    );
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Bincode of `PeerRequest::Vote(VoteRequest { vote: { leader_id: { term, node_id },
/// committed: false }, last_log_id: Some({ leader_id: { term, node_id }, index }) })`.
fn vote_payload(term: u64, node_id: u64, index: u64) -> Vec<u8> {
    let mut payload = 1u32.to_le_bytes().to_vec();
    payload.extend(term.to_le_bytes());
    payload.extend(node_id.to_le_bytes());
    payload.push(0);
    payload.push(1);
    payload.extend(term.to_le_bytes());
    payload.extend(node_id.to_le_bytes());
    payload.extend(index.to_le_bytes());
    payload
}

/// One authenticated Vote frame with the largest term, sent to a follower: the cluster must
/// still have a leader and agree a few seconds later, and no node's Raft may panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vote_with_the_largest_term_does_not_wedge_the_cluster() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("va-max-term", 3).await.parts();
    let follower = *ids.iter().find(|id| **id != leader).expect("another node");
    let mut connection = peer(&nodes, &secret, follower).await;
    // The follower refuses votes while its leader's lease holds: stop the leader past it.
    signal(&cluster, leader, Signal::SIGSTOP);
    let resume = Resume(pid_of(&cluster, leader));
    tokio::time::sleep(Duration::from_millis(900)).await;
    let reply = connection
        .request(vote_payload(u64::MAX, 7, u64::MAX), Duration::from_secs(3))
        .await
        .expect("an answer");
    drop(resume);
    eprintln!("vote reply variant {:?}: {reply:?}", reply_variant(&reply));
    let settled = wait_settled(&nodes, &secret, &ids, Duration::from_secs(8)).await;
    let panicked: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|id| log_of(&cluster, *id).contains("panicked at"))
        .collect();
    for id in &ids {
        let log = log_of(&cluster, *id);
        if let Some(line) = log.lines().find(|line| line.contains("panicked at")) {
            let at = log.find(line).unwrap_or(0);
            eprintln!("node {id}: {}", &log[at..(at + 400).min(log.len())]);
        }
    }
    // The vote is in the state files: does a restart of the whole cluster heal it?
    let mut after_restart = None;
    if settled.is_err() {
        let down = cluster_command(&cluster, "down", None);
        assert!(
            down.status.success(),
            "{}",
            String::from_utf8_lossy(&down.stderr)
        );
        let up = cluster_command(&cluster, "up", None);
        assert!(
            up.status.success(),
            "{}",
            String::from_utf8_lossy(&up.stderr)
        );
        after_restart = Some(wait_settled(&nodes, &secret, &ids, Duration::from_secs(8)).await);
    }
    assert!(
        settled.is_ok() && panicked.is_empty(),
        "views: {settled:?}; Raft panicked on nodes {panicked:?}; after `down` and `up` of the whole cluster: {after_restart:?}"
    );
}
