//! Attacks on the leases (`docs/protocol.md`, *Views and fencing*; `server/src/view/lease.rs`):
//! flapping partitions, a cluster split three ways, a leader cut from one follower only, and
//! forged `Peer` lease requests. Each test is bounded in time.
//!
//! Three in-process nodes with `replicas = 2` and `failure_timeout = 1 s`; the nodes' control
//! traffic to each other runs through proxies the test cuts (as in `partition.rs`), clients
//! reach every node through proxies that stay up.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;

use support::partition::{Partitionable, FAILURE_TIMEOUT, NODES};

use rdkv_client::{Client, ClientBuilder};
use rdkv_common::protocol::{MemberState, MonitoredNode, PeerConnection};
use rdkv_common::sharding;
use rdkv_server::RunningServer;
use tokio::time::timeout;

const SECRET: &[u8] = b"lease-attack-secret";

/// `count` keys whose primary (over all three serving) is node index `index`.
fn keys_with_primary(index: usize, count: usize, prefix: &str) -> Vec<Vec<u8>> {
    (0..100_000)
        .map(|number| format!("{prefix}-{number}").into_bytes())
        .filter(|key| sharding::replicas(key, &[1, 2, 3], 2)[0] == index)
        .take(count)
        .collect()
}

fn value_of(number: u64) -> Vec<u8> {
    format!("{number:020}").into_bytes()
}

fn number_of(value: &[u8]) -> u64 {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| panic!("a value this test wrote: {value:?}"))
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut chain = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        chain.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    chain
}

/// A failure that a caller may retry: the client says so, or it ran out its deadline having
/// applied nothing.
fn retryable(error: &rdkv_client::Error) -> bool {
    error.is_retryable()
        || matches!(
            error,
            rdkv_client::Error::TimedOut {
                may_have_applied: false,
                ..
            }
        )
}

/// A node's own view, as a direct client fetched it: its epoch and that node's state.
fn describe(
    view: &Result<
        rdkv_client::Result<rdkv_common::protocol::ClusterView>,
        tokio::time::error::Elapsed,
    >,
    node: u32,
) -> String {
    match view {
        Ok(Ok(view)) => format!(
            "epoch {} state {:?}",
            view.epoch,
            view.members
                .iter()
                .find(|member| member.node_id == node)
                .map(|member| member.state)
        ),
        other => format!("view unknown: {other:?}"),
    }
}

/// A tiny deterministic generator (the flapping's pauses).
struct Lcg(u64);

impl Lcg {
    fn next_in(&mut self, low: u64, high: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        low + (self.0 >> 33) % (high - low)
    }
}

/// Attack 1: node `target`'s control traffic is cut and healed every 200-400 ms for 5 s while
/// a cluster client writes increasing numbers to keys whose primary it is, and a cluster
/// reader and a reader of that node alone read them. No read may return a number older than
/// the newest write acknowledged before the read started; afterwards the cluster converges.
async fn flapping(
    target_is_leader: bool,
    seed: u64,
    cut_ms: (u64, u64),
    heal_ms: (u64, u64),
    run_for: Duration,
) {
    let cluster = Arc::new(Partitionable::start("lease-attack", SECRET).await);
    support::eventually("every node serves data", || {
        cluster.nodes.iter().all(|node| node.stats().serving_data)
    })
    .await;
    let leader = cluster.nodes[0].stats().view_leader;
    let target = if target_is_leader {
        leader
    } else {
        (1..=NODES).find(|id| *id != leader).unwrap_or(1)
    };
    let keys = Arc::new(keys_with_primary(target as usize - 1, 4, "flap"));
    let acked: Arc<Vec<AtomicU64>> = Arc::new(keys.iter().map(|_| AtomicU64::new(0)).collect());
    let issued = Arc::new(AtomicU64::new(0));
    let writer_client = ClientBuilder::cluster(&cluster.cluster)
        .build()
        .expect("a cluster client");
    for (slot, key) in keys.iter().enumerate() {
        let number = issued.fetch_add(1, Ordering::SeqCst) + 1;
        writer_client
            .put(key, &value_of(number))
            .await
            .expect("first put");
        acked[slot].store(number, Ordering::SeqCst);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let observations: Arc<Mutex<Vec<String>>> = Arc::default();

    // The writer.
    let writer = {
        let (keys, acked, issued, stop) =
            (keys.clone(), acked.clone(), issued.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u64, 0u64);
            let mut slot = 0;
            while !stop.load(Ordering::SeqCst) {
                slot = (slot + 1) % keys.len();
                let number = issued.fetch_add(1, Ordering::SeqCst) + 1;
                match timeout(
                    Duration::from_secs(5),
                    writer_client.put(&keys[slot], &value_of(number)),
                )
                .await
                {
                    Ok(Ok(())) => {
                        acked[slot].fetch_max(number, Ordering::SeqCst);
                        ok += 1;
                    }
                    Ok(Err(_)) => failed += 1,
                    Err(_) => panic!("a put outlived its deadline by 3 s"),
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (ok, failed)
        })
    };
    // The cluster reader.
    let cluster_reader = {
        let (keys, acked, issued, stop, violations) = (
            keys.clone(),
            acked.clone(),
            issued.clone(),
            stop.clone(),
            violations.clone(),
        );
        let client = ClientBuilder::cluster(&cluster.cluster)
            .build()
            .expect("a cluster client");
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u64, 0u64);
            let mut slot = 0;
            while !stop.load(Ordering::SeqCst) {
                slot = (slot + 1) % keys.len();
                let floor = acked[slot].load(Ordering::SeqCst);
                match timeout(Duration::from_secs(5), client.get(&keys[slot])).await {
                    Ok(Ok(Some(value))) => {
                        ok += 1;
                        let number = number_of(&value);
                        let ceiling = issued.load(Ordering::SeqCst);
                        if number < floor || number > ceiling {
                            violations.lock().unwrap().push(format!(
                                "cluster GET of key {slot} read {number}, acknowledged before the read: {floor}"
                            ));
                        }
                    }
                    Ok(Ok(None)) => violations.lock().unwrap().push(format!(
                        "cluster GET of key {slot} read nothing (acknowledged {floor})"
                    )),
                    Ok(Err(_)) => failed += 1,
                    Err(_) => panic!("a get outlived its deadline by 3 s"),
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (ok, failed)
        })
    };
    // The reader of the target node alone.
    let direct_reader = {
        let (keys, acked, stop, violations, observations, cluster) = (
            keys.clone(),
            acked.clone(),
            stop.clone(),
            violations.clone(),
            observations.clone(),
            cluster.clone(),
        );
        tokio::spawn(async move {
            let (mut ok, mut failed, mut connects) = (0u64, 0u64, 0u64);
            let mut direct: Option<Client> = None;
            let mut slot = 0;
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(2)).await;
                if direct.is_none() {
                    connects += 1;
                    match timeout(Duration::from_secs(3), cluster.direct(target)).await {
                        Ok(Ok(client)) => direct = Some(client),
                        _ => {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    }
                }
                let Some(client) = direct.as_ref() else {
                    continue;
                };
                slot = (slot + 1) % keys.len();
                // The node's own view before the read: is it the key's primary there?
                let before = timeout(Duration::from_secs(3), client.view()).await;
                let floor = acked[slot].load(Ordering::SeqCst);
                let read = timeout(Duration::from_secs(5), client.get(&keys[slot])).await;
                match read {
                    Ok(Ok(Some(value))) => {
                        ok += 1;
                        let number = number_of(&value);
                        if number < floor {
                            let state = describe(&before, target);
                            let serving_before = matches!(&before, Ok(Ok(view)) if view.members.iter().any(|member| member.node_id == target && member.state == MemberState::Serving));
                            let line = format!(
                                "direct GET of key {slot} on node {target} read {number}, acknowledged before the read: {floor} (node's view before the read: {state})"
                            );
                            if serving_before {
                                violations.lock().unwrap().push(line);
                            } else {
                                observations.lock().unwrap().push(line);
                            }
                        }
                    }
                    Ok(Ok(None)) => {
                        let serving_before = matches!(&before, Ok(Ok(view)) if view.members.iter().any(|member| member.node_id == target && member.state == MemberState::Serving));
                        let line = format!(
                            "direct GET of key {slot} on node {target} read nothing, acknowledged before the read: {floor} (node's view before the read: {})",
                            describe(&before, target)
                        );
                        if serving_before {
                            violations.lock().unwrap().push(line);
                        } else {
                            observations.lock().unwrap().push(line);
                        }
                    }
                    Ok(Err(_)) => {
                        failed += 1;
                        direct = None;
                    }
                    Err(_) => panic!("a direct get outlived its deadline by 3 s"),
                }
            }
            (ok, failed, connects)
        })
    };

    // The flapping.
    let mut random = Lcg(seed);
    let started = Instant::now();
    let mut flaps = 0;
    while started.elapsed() < run_for {
        cluster.isolate(target, true);
        tokio::time::sleep(Duration::from_millis(random.next_in(cut_ms.0, cut_ms.1))).await;
        cluster.isolate(target, false);
        tokio::time::sleep(Duration::from_millis(random.next_in(heal_ms.0, heal_ms.1))).await;
        flaps += 1;
    }
    let stops = cluster.nodes[target as usize - 1].stats().serving_stops;
    let healed = Instant::now();
    let converged_after = cluster
        .converged(Duration::from_secs(20), "after the flapping")
        .await;
    stop.store(true, Ordering::SeqCst);
    let writes = writer.await.expect("writer");
    let cluster_reads = cluster_reader.await.expect("cluster reader");
    let direct_reads = direct_reader.await.expect("direct reader");
    let epoch = cluster.nodes[0].stats().view_epoch;
    println!(
        "flapping node {target} (leader: {target_is_leader}, seed {seed}): {flaps} cuts in {:?}; it stopped serving {stops} times; converged {converged_after:?} after the last heal ({:?} since), epoch {epoch}; writes ok/failed {writes:?}; cluster reads ok/failed {cluster_reads:?}; direct reads ok/failed/connects {direct_reads:?}",
        started.elapsed(),
        healed.elapsed()
    );
    println!(
        "{} direct reads of node {target} while its own view had it filling (or unknown) were older than acknowledged writes",
        observations.lock().unwrap().len()
    );
    for line in observations.lock().unwrap().iter().take(3) {
        println!("observation: {line}");
    }
    // Every acknowledged write is readable at the end, through the cluster and on the node.
    let final_client = ClientBuilder::cluster(&cluster.cluster)
        .build()
        .expect("a cluster client");
    let direct = timeout(Duration::from_secs(5), cluster.direct(target))
        .await
        .expect("connect in time")
        .expect("connect to the node after convergence");
    for (slot, key) in keys.iter().enumerate() {
        let floor = acked[slot].load(Ordering::SeqCst);
        let through_cluster = final_client
            .get(key)
            .await
            .expect("final get")
            .map(|value| number_of(&value));
        assert!(
            through_cluster.is_some_and(|number| number >= floor),
            "key {slot}: the cluster reads {through_cluster:?}, acknowledged {floor}"
        );
        let on_node = direct
            .get(key)
            .await
            .expect("final direct get")
            .map(|value| number_of(&value));
        assert_eq!(
            on_node, through_cluster,
            "key {slot}: node {target} and the cluster agree"
        );
    }
    let violations = violations.lock().unwrap();
    assert!(
        violations.is_empty(),
        "{} stale reads, first: {:#?}",
        violations.len(),
        violations.iter().take(10).collect::<Vec<_>>()
    );
    assert!(
        writes.0 > 0 && cluster_reads.0 > 0,
        "some operations succeeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_follower_never_serves_a_stale_value_and_the_cluster_converges() {
    flapping(false, 7, (200, 400), (200, 400), Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_leader_never_serves_a_stale_value_and_the_cluster_converges() {
    flapping(true, 11, (200, 400), (200, 400), Duration::from_secs(5)).await;
}

/// Cuts of 0.6-1.4 s (the leader: 1.2-3 s, past the election) straddle the lease (0.9 s) and the failure timeout (1 s): the node
/// stops serving, is committed down, comes back, is refilled, over and over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_flapping_around_the_failure_timeout_never_serves_a_stale_value() {
    flapping(false, 13, (600, 1400), (300, 1500), Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_flapping_around_the_failure_timeout_never_serves_a_stale_value() {
    flapping(true, 17, (1200, 3000), (300, 1500), Duration::from_secs(12)).await;
}

/// Attack 2: every node cut off from every other (no majority anywhere): no node serves data,
/// operations fail retryably within their deadline, no view is committed; healed, every node
/// serves again and every acknowledged write is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_split_three_ways_serves_nothing_then_recovers_every_write() {
    let cluster = Partitionable::start("lease-attack", SECRET).await;
    cluster.converged(Duration::from_secs(10), "at start").await;
    let epoch_before = cluster.nodes[0].stats().view_epoch;
    let client = ClientBuilder::cluster(&cluster.cluster)
        .build()
        .expect("a cluster client");
    let keys: Vec<Vec<u8>> = (0..3)
        .flat_map(|index| keys_with_primary(index, 5, "split"))
        .collect();
    for (number, key) in keys.iter().enumerate() {
        client
            .put(key, &value_of(number as u64))
            .await
            .expect("put before the cut");
    }
    let cut_at = Instant::now();
    cluster.cut_all(true);
    let mut last_stop = None;
    while cluster.nodes.iter().any(|node| node.stats().serving_data) {
        assert!(
            cut_at.elapsed() < FAILURE_TIMEOUT + Duration::from_secs(1),
            "a node still serves {:?} after the split: {:?}",
            cut_at.elapsed(),
            cluster
                .nodes
                .iter()
                .map(|node| node.stats().serving_data)
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    last_stop.get_or_insert(cut_at.elapsed());
    // Operations fail, retryably, within their deadline (2 s) and some slack.
    let mut latencies = Vec::new();
    for (number, key) in keys.iter().enumerate().step_by(5) {
        let started = Instant::now();
        let put = timeout(Duration::from_secs(6), client.put(key, b"during the split"))
            .await
            .expect("a put outlived its deadline by 4 s");
        let put_took = started.elapsed();
        let put_error = put.expect_err("a put succeeded with no node serving");
        assert!(
            !put_error.may_have_applied() && retryable(&put_error),
            "put: {}",
            error_chain(&put_error)
        );
        let started = Instant::now();
        let get = timeout(Duration::from_secs(6), client.get(key))
            .await
            .expect("a get outlived its deadline by 4 s");
        let get_took = started.elapsed();
        let get_error = get.expect_err("a get succeeded with no node serving");
        assert!(
            retryable(&get_error),
            "get {number}: {}",
            error_chain(&get_error)
        );
        assert!(
            put_took < Duration::from_secs(4) && get_took < Duration::from_secs(4),
            "put took {put_took:?}, get {get_took:?}"
        );
        latencies.push((put_took, get_took));
        if number == 0 {
            println!("during the split: put error: {}", error_chain(&put_error));
        }
    }
    // Still nobody serves, and nobody committed a view, well past failure_timeout.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stats: Vec<_> = cluster.nodes.iter().map(RunningServer::stats).collect();
    assert!(
        stats.iter().all(|stats| !stats.serving_data),
        "{:?}",
        cut_at.elapsed()
    );
    assert!(
        stats.iter().all(|stats| stats.view_members_down == 0),
        "a view with a member down was committed during the split"
    );
    let split_for = cut_at.elapsed();
    cluster.cut_all(false);
    let converged_after = cluster
        .converged(Duration::from_secs(20), "after the heal")
        .await;
    // Any put during the split was refused: every key holds its value from before.
    for (number, key) in keys.iter().enumerate() {
        let value = timeout(Duration::from_secs(6), client.get(key))
            .await
            .expect("get in time")
            .expect("get after the heal");
        assert!(
            value.as_deref() == Some(&value_of(number as u64)[..]),
            "key {number} reads {value:?}"
        );
    }
    client
        .put(&keys[0], b"after")
        .await
        .expect("put after the heal");
    println!(
        "split three ways: no node served after {last_stop:?}; put/get failures took {latencies:?}; split for {split_for:?}; converged {converged_after:?} after the heal; epoch {epoch_before} -> {}",
        cluster.nodes[0].stats().view_epoch
    );
}

/// Attack 3: the leader and one follower cannot reach each other; the third node reaches
/// both. The cut follower must stop serving before it is replaced (a direct client of it
/// never reads a replaced value), the cluster must serve every key within a bound, and after
/// the heal everything converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_from_one_follower_only() {
    leader_cut_from_one_follower(Link::BothWays).await;
}

/// Attack 5: only the leader's messages to one follower are lost (its heartbeats and log):
/// the follower's lease requests still reach the leader, but its view cannot follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_deaf_to_the_leader_whose_lease_requests_still_arrive() {
    leader_cut_from_one_follower(Link::LeaderToFollower).await;
}

#[derive(Debug, Clone, Copy)]
enum Link {
    BothWays,
    LeaderToFollower,
}

impl Partitionable {
    fn cut_link(&self, link: Link, leader: u32, follower: u32, cut: bool) {
        match link {
            Link::BothWays => self.cut_between(leader, follower, cut),
            Link::LeaderToFollower => {
                self.links[leader as usize - 1][follower as usize - 1].set_cut(cut)
            }
        }
    }
}

async fn leader_cut_from_one_follower(link: Link) {
    let cluster = Partitionable::start("lease-attack", SECRET).await;
    cluster.converged(Duration::from_secs(10), "at start").await;
    let leader = cluster.nodes[0].stats().view_leader;
    let follower = (1..=NODES).find(|id| *id != leader).unwrap_or(1);
    let third = (1..=NODES)
        .find(|id| *id != leader && *id != follower)
        .unwrap_or(1);
    let client = ClientBuilder::cluster(&cluster.cluster)
        .build()
        .expect("a cluster client");
    let keys: Vec<Vec<u8>> = (0..3)
        .flat_map(|index| keys_with_primary(index, 3, "one-link"))
        .collect();
    for key in &keys {
        client
            .put(key, b"before")
            .await
            .expect("put before the cut");
    }
    let follower_key = keys_with_primary(follower as usize - 1, 1, "one-link").remove(0);
    let direct = cluster.direct(follower).await.expect("direct client");
    let cut_at = Instant::now();
    cluster.cut_link(link, leader, follower, true);
    // Watch: when the follower stops serving, when someone commits a member down, leaders.
    let mut stopped = None;
    let mut down = None;
    let mut leaders = std::collections::BTreeSet::new();
    // Watched for 4 s, and on until a member is down (bounded).
    while cut_at.elapsed() < Duration::from_secs(4)
        || (down.is_none() && cut_at.elapsed() < FAILURE_TIMEOUT + Duration::from_secs(10))
    {
        let stats: Vec<_> = cluster.nodes.iter().map(RunningServer::stats).collect();
        for stats in &stats {
            leaders.insert(stats.view_leader);
        }
        if stopped.is_none() && !stats[follower as usize - 1].serving_data {
            stopped = Some(cut_at.elapsed());
        }
        if down.is_none()
            && [leader, third]
                .iter()
                .any(|id| stats[*id as usize - 1].view_members_down > 0)
        {
            down = Some(cut_at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stats: Vec<_> = cluster.nodes.iter().map(RunningServer::stats).collect();
    println!(
        "{link:?}: leader {leader} cut from follower {follower} (third {third}): the follower stopped serving after {stopped:?}, a member was down after {down:?}; leaders seen {leaders:?}; now (serving, epoch, leader, down): {:?}",
        stats
            .iter()
            .map(|stats| (stats.serving_data, stats.view_epoch, stats.view_leader, stats.view_members_down))
            .collect::<Vec<_>>()
    );
    // The cut follower stops serving before a view without it, and the majority commits it
    // down within the watch (a hang guard, not a speed bound: on a loaded machine it took
    // 3.3 s with a 1 s failure_timeout; speed belongs in benchmarks).
    if let (Some(stopped), Some(down)) = (stopped, down) {
        assert!(
            stopped < down,
            "the follower served until {stopped:?}, down at {down:?}"
        );
    }
    assert!(
        down.is_some(),
        "{link:?}: the follower stopped serving after {stopped:?}, committed down after {down:?}"
    );
    // The cluster serves every key within the deadline: write each.
    let mut failures = Vec::new();
    for key in &keys {
        let started = Instant::now();
        if let Err(error) = timeout(Duration::from_secs(6), client.put(key, b"after"))
            .await
            .expect("put in time")
        {
            failures.push(format!("{:?}: {}", started.elapsed(), error_chain(&error)));
        }
    }
    assert!(
        failures.is_empty(),
        "puts failed 4 s after the cut: {failures:#?}"
    );
    // A node that serves nothing stale: the cut follower reads "after" or nothing.
    match timeout(Duration::from_secs(6), direct.get(&follower_key))
        .await
        .expect("in time")
    {
        Ok(Some(value)) => assert_eq!(
            &value[..],
            b"after",
            "the cut follower served a replaced value"
        ),
        Ok(None) => panic!("the cut follower served nothing for a written key"),
        Err(_) => {}
    }
    let serving: Vec<u32> = (1..=NODES)
        .filter(|id| cluster.nodes[*id as usize - 1].stats().serving_data)
        .collect();
    assert!(serving.len() >= 2, "a majority serves: {serving:?}");
    let healed = Instant::now();
    cluster.cut_link(link, leader, follower, false);
    let converged_after = cluster
        .converged(Duration::from_secs(20), "after the heal")
        .await;
    for key in &keys {
        let value = client.get(key).await.expect("get after the heal");
        assert_eq!(value.as_deref(), Some(&b"after"[..]));
    }
    println!(
        "healed: converged after {converged_after:?} ({:?}), epoch {}",
        healed.elapsed(),
        cluster.nodes[0].stats().view_epoch
    );
}

/// A `Peer` frame's payload: bincode 1 of `PeerRequest::Lease { node_id, epoch }` (variant
/// 5), claiming a view as new as any.
fn lease_request(node_id: u32) -> Vec<u8> {
    let mut payload = 5u32.to_le_bytes().to_vec();
    payload.extend_from_slice(&node_id.to_le_bytes());
    payload.extend_from_slice(&u64::MAX.to_le_bytes());
    payload
}

/// A decoded `PeerReply::Lease` (variant 5, after `Malformed`): `Ok((remaining_ms, epoch))`
/// or `Err(reason)`.
fn lease_reply(payload: &[u8]) -> Result<(u64, u64), String> {
    let word = |at: usize| u32::from_le_bytes(payload[at..at + 4].try_into().unwrap());
    let long = |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().unwrap());
    assert_eq!(
        word(0),
        5,
        "a Lease reply: {payload:?} ({})",
        String::from_utf8_lossy(payload)
    );
    match word(4) {
        0 => Ok((long(8), long(16))),
        1 => {
            let length = long(8) as usize;
            Err(String::from_utf8_lossy(&payload[16..16 + length]).into_owned())
        }
        other => panic!("a Result tag: {other}"),
    }
}

/// Attack 4: forged lease requests, sent by anything that holds the cluster secret (a client
/// does) over a monitoring connection to the leader. One for a node that is not a member is
/// refused; a flood of them does not disturb the cluster; and forged requests for a node that
/// is cut off must not keep it in the view, its keys unserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known limitation (docs/protocol.md, Views and fencing): any holder of the cluster secret may send Peer frames, and forged lease requests keep a cut-off node in the view"]
async fn forged_lease_requests_grant_nothing_and_keep_no_dead_node_in_the_view() {
    let cluster = Partitionable::start("lease-attack", SECRET).await;
    cluster.converged(Duration::from_secs(10), "at start").await;
    let leader = cluster.nodes[0].stats().view_leader;
    let victim = (1..=NODES).find(|id| *id != leader).unwrap_or(1);
    let node = MonitoredNode {
        address: cluster.front[leader as usize - 1].address,
        id: Some(leader),
        secret: SECRET,
    };
    let mut peer = PeerConnection::open(node, Duration::from_secs(2))
        .await
        .expect("a monitoring connection to the leader");
    // Not a member.
    for stranger in [0, 4, u32::MAX] {
        let answer = peer
            .request(lease_request(stranger), Duration::from_secs(2))
            .await
            .expect("an answer");
        let reply = lease_reply(&answer);
        assert!(
            reply
                .as_ref()
                .is_err_and(|reason| reason.contains("not a member")),
            "lease for node {stranger}: {reply:?}"
        );
    }
    // Garbage payloads are answered, not fatal.
    let answer = peer
        .request(vec![5, 0, 0], Duration::from_secs(2))
        .await
        .expect("an answer to a truncated request");
    assert!(!answer.is_empty());
    // A flood of forged requests (for a live follower): nobody stops serving.
    let stops_before: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|node| node.stats().serving_stops)
        .collect();
    let flood_started = Instant::now();
    let mut granted = 0;
    for _ in 0..3000 {
        let answer = peer
            .request(lease_request(victim), Duration::from_secs(2))
            .await
            .expect("an answer");
        if let Ok((remaining, _)) = lease_reply(&answer) {
            assert!(
                remaining <= (FAILURE_TIMEOUT * 3 / 4).as_millis() as u64,
                "a grant of {remaining} ms"
            );
            granted += 1;
        }
    }
    let flood_took = flood_started.elapsed();
    let stops_after: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|node| node.stats().serving_stops)
        .collect();
    assert_eq!(
        stops_before, stops_after,
        "a node stopped serving during the flood"
    );
    println!("3000 forged lease requests took {flood_took:?}, {granted} granted; no node stopped serving");
    // The victim is cut off; forged requests for it keep arriving at the leader.
    let victim_key = keys_with_primary(victim as usize - 1, 1, "forged").remove(0);
    let client = ClientBuilder::cluster(&cluster.cluster)
        .build()
        .expect("a cluster client");
    client.put(&victim_key, b"before").await.expect("put");
    let cut_at = Instant::now();
    cluster.isolate(victim, true);
    // The forger: a lease request for the victim every 50 ms, for 5 s.
    let forger = tokio::spawn(async move {
        let mut sent = 0;
        while cut_at.elapsed() < Duration::from_secs(5) {
            let _ = peer
                .request(lease_request(victim), Duration::from_secs(2))
                .await;
            sent += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        sent
    });
    // 2.5 s after the cut (failure_timeout + 1.5 s), a put of the victim's key, deadline 2 s.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let put_started = cut_at.elapsed();
    let put = timeout(Duration::from_secs(6), client.put(&victim_key, b"after"))
        .await
        .expect("in time")
        .map_err(|error| error_chain(&error));
    let put_ended = cut_at.elapsed();
    let mut down_after = None;
    let mut stopped_after = None;
    while cut_at.elapsed() < Duration::from_secs(5) {
        let stats: Vec<_> = cluster.nodes.iter().map(RunningServer::stats).collect();
        if stopped_after.is_none() && !stats[victim as usize - 1].serving_data {
            stopped_after = Some(cut_at.elapsed());
        }
        if stats[leader as usize - 1].view_members_down > 0 {
            down_after = Some(cut_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let forged = forger.await.expect("forger");
    println!(
        "victim {victim} cut off, {forged} forged lease requests for it (every 50 ms for 5 s): not serving by {stopped_after:?}; the leader committed it down by {down_after:?}; a put of its key from {put_started:?} to {put_ended:?}: {put:?}"
    );
    assert!(
        !cluster.nodes[victim as usize - 1].stats().serving_data,
        "the cut-off victim serves"
    );
    assert!(
        down_after.is_some() && put.is_ok(),
        "forged lease requests kept the cut-off node {victim} in the view for 5 s (failure_timeout {FAILURE_TIMEOUT:?}), its keys unserved; a put of its key: {put:?}"
    );
    cluster.isolate(victim, false);
    cluster
        .converged(Duration::from_secs(20), "after the heal")
        .await;
}

/// Attack 6: a node back from a cut is `filling` (refilled before it serves its keys), and
/// serves data connections meanwhile. A client of that node alone must still read nothing
/// older than what the cluster acknowledged while the node was away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_a_filling_node_alone_reads_nothing_replaced() {
    let cluster = Partitionable::start("lease-attack", SECRET).await;
    cluster.converged(Duration::from_secs(10), "at start").await;
    let leader = cluster.nodes[0].stats().view_leader;
    let follower = (1..=NODES).find(|id| *id != leader).unwrap_or(1);
    let keys = keys_with_primary(follower as usize - 1, 20, "filling");
    let client = ClientBuilder::cluster(&cluster.cluster)
        .build()
        .expect("a cluster client");
    for key in &keys {
        client.put(key, b"before the cut").await.expect("put");
    }
    cluster.isolate(follower, true);
    support::eventually("the majority commits the follower down", || {
        cluster.nodes[leader as usize - 1].stats().view_members_down > 0
    })
    .await;
    for key in &keys {
        client
            .put(key, b"while it was away")
            .await
            .expect("put while away");
    }
    let healed = Instant::now();
    cluster.isolate(follower, false);
    let mut stale = Vec::new();
    let (mut reads, mut refused) = (0, 0);
    let mut serving_after = None;
    while healed.elapsed() < Duration::from_secs(10) && serving_after.is_none() {
        let direct = match timeout(Duration::from_secs(3), cluster.direct(follower)).await {
            Ok(Ok(direct)) => direct,
            _ => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        for key in &keys {
            let state = timeout(Duration::from_secs(3), direct.view()).await;
            let serving = matches!(&state, Ok(Ok(view)) if view.members.iter().any(|member| member.node_id == follower && member.state == MemberState::Serving));
            let Ok(Ok(value)) = timeout(Duration::from_secs(3), direct.get(key)).await else {
                break;
            };
            reads += 1;
            if value.as_deref() != Some(&b"while it was away"[..]) {
                stale.push(format!(
                    "{:?} after the heal, node {follower}'s view {}: {:?}",
                    healed.elapsed(),
                    describe(&state, follower),
                    value.map(|value| String::from_utf8_lossy(&value).into_owned())
                ));
            }
            if serving {
                serving_after = Some(healed.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "node {follower} back from a cut: {reads} direct reads, {refused} connections refused, serving (its own view) after {serving_after:?}; {} reads older than the acknowledged value ({} of them the value from before the cut, {} nothing)",
        stale.len(),
        stale.iter().filter(|line| line.ends_with("Some(\"before the cut\")")).count(),
        stale.iter().filter(|line| line.ends_with("None")).count()
    );
    assert!(
        stale.is_empty(),
        "a client of node {follower} alone read replaced values: {:#?}",
        stale.iter().take(5).collect::<Vec<_>>()
    );
}
