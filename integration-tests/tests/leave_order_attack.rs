//! Attacks on the whole-cluster start after nodes stopped one at a time (a final snapshot's
//! `fenced_at` deciding over older copies: `server/src/reconcile/authority.rs`,
//! `docs/protocol.md`, *Which copy decides*): stop orders and interrupted starts that lost
//! acknowledged writes or brought deleted keys back, now fixed, and the two cases the rule
//! leaves open, as ignored tests that name them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_client::Client;
use rdkv_integration_tests::cluster::Cluster;
use rdkv_integration_tests::history::{
    assert_none_wrong, delete_or_overwrite, key_of, stop_and_wait_down, summary, write_first,
    wrong_keys, History, Op,
};
use rdkv_integration_tests::view::{
    cluster_command, nodes_of, output_text, pid_of, signal, wait_serving, wait_torn_down,
};

/// One cluster at a time: each test starts three nodes, stops and starts them, and two at once
/// on a loaded 2-core machine would time each other out.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Three nodes of `replicas` copies with `failure_timeout` and `extra` settings.
fn cluster_ft(tag: &str, replicas: usize, failure_timeout: &str, extra: &str) -> Cluster {
    Cluster::up_with(&format!("lo2-{tag}-r{replicas}"), |text| {
        text.replace("replicas = 2", &format!("replicas = {replicas}"))
            .replace(
                "failure_timeout = \"1s\"",
                &format!("failure_timeout = \"{failure_timeout}\""),
            )
            .replace(
                "operation_deadline = \"2s\"",
                &format!("operation_deadline = \"2s\"\n{extra}"),
            )
    })
}

/// The key's copies by the whole membership (nodes 1, 2, 3).
fn copies_of(key: &[u8], replicas: usize) -> Vec<u32> {
    let members = [1u32, 2, 3];
    rdkv_common::sharding::replicas(key, &members, replicas)
        .into_iter()
        .map(|index| members[index])
        .collect()
}

/// The wrong keys counted by their copies by the whole membership.
fn by_copies(wrong: &[String], replicas: usize) -> BTreeMap<Vec<u32>, usize> {
    let mut counts = BTreeMap::new();
    for line in wrong {
        let key = line.split(' ').next().unwrap_or_default();
        let mut copies = copies_of(key.as_bytes(), replicas);
        copies.sort_unstable();
        *counts.entry(copies).or_insert(0) += 1;
    }
    counts
}

/// Deletes every key of `writer` (300), recording each outcome; returns how many were acked.
async fn delete_all(client: &Client, writer: usize, history: &mut History) -> usize {
    let mut acked = 0;
    for index in 0..300 {
        let key = key_of(writer, index);
        let ok = client.delete(&key).await.is_ok();
        acked += usize::from(ok);
        history.entry(key).or_default().push(Op { value: None, ok });
    }
    acked
}

/// Puts `tag-INDEX` into every key of `writer` (300), recording each outcome.
async fn overwrite_all(client: &Client, writer: usize, tag: &str, history: &mut History) -> usize {
    let mut acked = 0;
    for index in 0..300 {
        let key = key_of(writer, index);
        let value = format!("{tag}-{index}").into_bytes();
        let ok = client.put(&key, &value).await.is_ok();
        acked += usize::from(ok);
        history.entry(key).or_default().push(Op {
            value: Some(value),
            ok,
        });
    }
    acked
}

/// `up`, then every key must read as its history allows.
async fn finish(cluster: &Cluster, history: &History, replicas: usize, what: &str) {
    let up = output_text(&cluster_command(cluster, "up", None));
    eprintln!("up: {up}");
    wait_serving(cluster, Duration::from_secs(90)).await;
    let wrong = wrong_keys(cluster, history).await;
    eprintln!("wrong keys by copies: {:?}", by_copies(&wrong, replicas));
    assert_none_wrong(&wrong, history.len(), what);
}

/// Three nodes, two copies, every node stopped one at a time (SIGTERM): node 1, every key
/// overwritten (its stand-in, node 3, takes the keys of nodes 1 and 2), node 2, then every key
/// deleted while node 3 serves alone (its lease, 9/10 of a 4 s `failure_timeout`, runs on),
/// node 3. Every acked delete must hold after `up`. The keys whose copies by the whole
/// membership are nodes 1 and 2 were deleted on node 3 alone, a stand-in: node 2's final
/// snapshot decides over node 1's, and node 3's absence decides over nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "finding: a delete acknowledged while every copy of the key by the whole membership was stopped (the view recorded the loss) comes back from the copy that stopped last"]
async fn deletes_on_the_last_node_alone_stay_deleted() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft("lone-delete", 2, "4s", "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 1).await;
    let (nodes, secret) = nodes_of(&cluster);
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    let overwritten = overwrite_all(&client, 1, "second", &mut history).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    let deleted = delete_all(&client, 1, &mut history).await;
    client.close().await;
    eprintln!(
        "overwritten {overwritten}, deleted on node 3 alone {deleted}; ops {:?}",
        summary(&history)
    );
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    finish(
        &cluster,
        &history,
        2,
        "nodes 1, 2, 3 stopped one at a time, deletes on node 3 alone",
    )
    .await;
}

/// How many times node `id`'s log says it loaded a snapshot.
fn loads_of(cluster: &Cluster, id: u32) -> usize {
    rdkv_integration_tests::view::log_of(cluster, id)
        .matches("snapshot loaded")
        .count()
}

/// Nodes stopped one at a time (SIGTERM: node 1, deletes and overwrites, node 2, node 3), as
/// in `nodes_stopped_one_at_a_time_keep_every_delete_and_write`; then `up`, but every node is
/// stopped again (SIGTERM, as Ctrl-C of `up`, `systemctl stop`, or an `up` that failed on one
/// node and stopped the others) once each loaded its snapshot and before the reconciliation
/// ran (it waits 5 s for a serving peer). Each writes a final snapshot again, holding exactly
/// what it loaded, so it says what the loaded one said (`fenced_at` included). Before, it
/// carried no `fenced_at`, the next `up` reconciled by versions alone, and node 1's copies of
/// the keys deleted after it stopped came back (about 100 of 300).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_interrupted_before_the_reconciliation_keeps_every_delete() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft("interrupted-up", 2, "1s", "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 2).await;
    let (nodes, secret) = nodes_of(&cluster);
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    delete_or_overwrite(&client, 2, &mut history).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    client.close().await;
    eprintln!("ops {:?}", summary(&history));
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    let before: Vec<usize> = (1..=3).map(|id| loads_of(&cluster, id)).collect();
    let old_pids: Vec<_> = (1..=3).map(|id| pid_of(&cluster, id)).collect();
    let up = rdkv_integration_tests::view::up_in_background(&cluster);
    let started = Instant::now();
    loop {
        let loaded = (1..=3u32).all(|id| {
            loads_of(&cluster, id) > before[id as usize - 1]
                && pid_of(&cluster, id) != old_pids[id as usize - 1]
        });
        if loaded {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the nodes never loaded their snapshots"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "every node loaded its snapshot after {:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in 1..=3 {
        let log = rdkv_integration_tests::view::log_of(&cluster, id);
        assert!(
            !log.contains("reconciled: this node holds"),
            "node {id} reconciled before the stop: the attack missed its window"
        );
    }
    for id in 1..=3 {
        signal(&cluster, id, Signal::SIGTERM);
    }
    for id in 1..=3 {
        wait_torn_down(pid_of(&cluster, id), Duration::from_secs(20));
    }
    let up = up.join().expect("up");
    eprintln!("interrupted up: {}", output_text(&up));
    finish(
        &cluster,
        &history,
        2,
        "nodes stopped one at a time, up interrupted before the reconciliation, up",
    )
    .await;
}

/// Nodes stopped one at a time (SIGTERM: node 1, deletes and overwrites, node 2, node 3), then
/// an `up` that fails on node 3 (its snapshot unreadable: here garbage in its place, standing
/// for any start failure of one node); `up` stops the nodes it started. Node 3's snapshot is
/// put back and `up` runs again: every delete must hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_up_that_failed_on_one_node_keeps_every_delete() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft("failed-up", 2, "1s", "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 4).await;
    let (nodes, secret) = nodes_of(&cluster);
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    delete_or_overwrite(&client, 4, &mut history).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    client.close().await;
    eprintln!("ops {:?}", summary(&history));
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    let snapshot = cluster.run_directory.join("node-3.data/snapshot.rdkv");
    let aside = cluster.run_directory.join("node-3-snapshot.aside");
    std::fs::rename(&snapshot, &aside).expect("set node 3's snapshot aside");
    std::fs::write(&snapshot, b"not a snapshot").expect("garbage");
    let failed = cluster_command(&cluster, "up", None);
    eprintln!(
        "up with node 3 failing (exit {:?}): {}",
        failed.status.code(),
        output_text(&failed)
    );
    for id in 1..=2u32 {
        let log = rdkv_integration_tests::view::log_of(&cluster, id);
        let last = log
            .lines()
            .rev()
            .find(|line| line.contains("snapshot written"))
            .unwrap_or_default()
            .to_string();
        eprintln!(
            "node {id} last snapshot: {}",
            last.chars().take(300).collect::<String>()
        );
    }
    std::fs::rename(&aside, &snapshot).expect("put node 3's snapshot back");
    finish(
        &cluster,
        &history,
        2,
        "nodes stopped one at a time, an up that failed on node 3, up",
    )
    .await;
}

/// A pass over a fresh writer's 300 keys: put `first` into each (when `fresh`), or delete the
/// even ones and overwrite the odd ones.
async fn pass(client: &Client, writer: usize, history: &mut History) {
    if history
        .keys()
        .any(|key| key.starts_with(format!("a38-{writer}-").as_bytes()))
    {
        delete_or_overwrite(client, writer, history).await;
    } else {
        for index in 0..300 {
            let key = key_of(writer, index);
            let value = format!("first-{index}").into_bytes();
            let ok = client.put(&key, &value).await.is_ok();
            history.entry(key).or_default().push(Op {
                value: Some(value),
                ok,
            });
        }
    }
}

/// Node 1 paused (SIGSTOP) until the view has it down, deletes and overwrites meanwhile, then
/// SIGCONT and at once SIGTERM of node 1 (its lease lapsed while its stale view had it
/// serving: it may write `fenced_at` = the epoch before its down); deletes and overwrites,
/// nodes 2 and 3 stopped one at a time; `up`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_paused_past_its_lease_then_stopped_keeps_every_delete() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft("paused-stop", 2, "1s", "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let (nodes, secret) = nodes_of(&cluster);
    let mut history = History::new();
    pass(&client, 30, &mut history).await;
    pass(&client, 31, &mut history).await;
    let pid = pid_of(&cluster, 1);
    signal(&cluster, 1, Signal::SIGSTOP);
    let resume = rdkv_integration_tests::view::Resume(pid);
    rdkv_integration_tests::view::wait_for_view(
        &nodes,
        &secret,
        3,
        Duration::from_secs(20),
        |view| {
            rdkv_integration_tests::view::state_of(view, 1)
                == Some(rdkv_common::protocol::MemberState::Down)
        },
    )
    .await
    .unwrap_or_else(|last| panic!("node 1 never down: {last:?}"));
    pass(&client, 30, &mut history).await;
    pass(&client, 32, &mut history).await;
    signal(&cluster, 1, Signal::SIGCONT);
    signal(&cluster, 1, Signal::SIGTERM);
    drop(resume);
    wait_torn_down(pid, Duration::from_secs(20));
    let log = rdkv_integration_tests::view::log_of(&cluster, 1);
    for line in log
        .lines()
        .filter(|line| line.contains("snapshot written") || line.contains("stopped serving"))
    {
        eprintln!("node 1: {}", line.chars().take(300).collect::<String>());
    }
    pass(&client, 31, &mut history).await;
    pass(&client, 32, &mut history).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    client.close().await;
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    eprintln!("ops {:?}", summary(&history));
    finish(
        &cluster,
        &history,
        2,
        "node 1 paused past its lease, resumed and stopped; 2, 3 stopped",
    )
    .await;
}

/// Nodes stopped one at a time (SIGTERM: node 1, deletes and overwrites, node 2, node 3).
/// Then node `alone` is started by itself (`up --node N`, as a host that boots first), and
/// stopped again (SIGTERM) before the others come: its new final snapshot holds what it loaded
/// and says what that one said (before, it carried no `fenced_at`, and 50 to 107 deleted keys
/// came back). Then `up`: every delete must hold.
async fn one_node_started_and_stopped_first(alone: u32) {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft(
        &format!("alone-{alone}"),
        2,
        "1s",
        "snapshot_interval = \"0s\"",
    );
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 7).await;
    let (nodes, secret) = nodes_of(&cluster);
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    delete_or_overwrite(&client, 7, &mut history).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    client.close().await;
    eprintln!("ops {:?}", summary(&history));
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    let before = loads_of(&cluster, alone);
    let old_pid = pid_of(&cluster, alone);
    let up = rdkv_integration_tests::view::up_later(&cluster, Some(alone), Duration::ZERO);
    let started = Instant::now();
    while !(loads_of(&cluster, alone) > before && pid_of(&cluster, alone) != old_pid) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "node {alone} never loaded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    signal(&cluster, alone, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, alone), Duration::from_secs(20));
    let up = up.join().expect("up");
    eprintln!(
        "up --node {alone} alone: {}",
        output_text(&up).chars().take(300).collect::<String>()
    );
    let log = rdkv_integration_tests::view::log_of(&cluster, alone);
    if let Some(line) = log
        .lines()
        .rev()
        .find(|line| line.contains("snapshot written"))
    {
        eprintln!(
            "node {alone}: {}",
            line.chars().take(300).collect::<String>()
        );
    }
    finish(
        &cluster,
        &history,
        2,
        &format!("nodes stopped one at a time, node {alone} started alone and stopped, up"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_stopped_node_started_alone_and_stopped_keeps_every_delete() {
    one_node_started_and_stopped_first(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_stopped_node_started_alone_and_stopped_keeps_every_delete() {
    one_node_started_and_stopped_first(2).await;
}

/// Node 1 stopped, every key overwritten (node 3 stands in for the keys of nodes 1 and 2 and
/// takes copies of them), node 1 started again (it refills and serves: node 3's copies of
/// those keys are extra now, until its sweep, which waits `failure_timeout` on a view), every
/// key deleted at once, then nodes 1, 2 and 3 stopped one at a time; `up`. Node 2's absence
/// decides over node 1's copies, but node 3 stopped later: its stale extra copy is taken.
async fn stale_extra_copy(failure_timeout: &str, pause: Duration) {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft(
        &format!(
            "extra-copy-{}-{}",
            failure_timeout.replace('"', ""),
            pause.as_millis()
        ),
        2,
        failure_timeout,
        "snapshot_interval = \"0s\"",
    );
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 9).await;
    let (nodes, secret) = nodes_of(&cluster);
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    let overwritten = overwrite_all(&client, 9, "second", &mut history).await;
    let up = output_text(&cluster_command(&cluster, "up", Some(1)));
    eprintln!(
        "overwritten {overwritten}; up --node 1: {}",
        up.chars().take(200).collect::<String>()
    );
    wait_serving(&cluster, Duration::from_secs(60)).await;
    let started = Instant::now();
    let deleted = delete_all(&client, 9, &mut history).await;
    eprintln!("deleted {deleted} in {:?}", started.elapsed());
    tokio::time::sleep(pause).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    client.close().await;
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    let log = rdkv_integration_tests::view::log_of(&cluster, 3);
    for line in log.lines().filter(|line| {
        line.contains("sweep") || line.contains("extra cop") || line.contains("no longer")
    }) {
        eprintln!("node 3: {}", line.chars().take(250).collect::<String>());
    }
    eprintln!("ops {:?}", summary(&history));
    finish(
        &cluster,
        &history,
        2,
        "node 1 stopped and started, deletes, nodes 1, 2, 3 stopped one at a time",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "finding: a stand-in's extra copy not swept yet when every node stops one at a time outlives the delete that the key's deciding copy holds"]
async fn a_stale_extra_copy_brings_no_deleted_key_back() {
    stale_extra_copy("1s", Duration::ZERO).await;
}

/// No acknowledged write lost through a stale provenance. Every node stopped one at a time and
/// `up`: each process loaded a final snapshot with a `fenced_at`, and stops reporting it once a
/// client connects (before, it reported it however long it served after). Nodes 2 and 3 stopped one at a time (SIGTERM); node 1 serves alone for its
/// lease and acknowledges overwrites of its keys. Node 1 paused (SIGSTOP) while nodes 2 and 3
/// are started again (`up --node 2`, `--node 3`): the view has node 1 down; resumed, it rejoins
/// as the same process, filling, with its table (no member serves, so it does not empty
/// itself), and the three reconcile. Node 1's copies are judged by the snapshot it loaded at
/// the first `up` no more: its newer copies win by version. Before, they were judged by that
/// snapshot (an epoch long before nodes 2 and 3 stopped), nodes 2 and 3's final snapshots
/// decided over them, and all 300 overwrites node 1 acknowledged alone were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_node_rejoining_a_reconciliation_keeps_its_newer_writes() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft("stale-provenance", 2, "1s", "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 40).await;
    let (nodes, secret) = nodes_of(&cluster);
    // Phase A: a one-at-a-time stop and `up`: every process loads a final snapshot.
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    client.close().await;
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    let up = output_text(&cluster_command(&cluster, "up", None));
    eprintln!("first up: {}", up.chars().take(200).collect::<String>());
    wait_serving(&cluster, Duration::from_secs(90)).await;
    let client = Client::from_file(&cluster.file).expect("a client");
    // Phase B: overwrites on every copy, nodes 2 and 3 stopped, overwrites on node 1 alone.
    overwrite_all(&client, 40, "second", &mut history).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 1, true).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 3, 1, false).await;
    let started = Instant::now();
    let alone = overwrite_all(&client, 40, "alone", &mut history).await;
    eprintln!(
        "overwrites acked by node 1 alone: {alone} of 300 in {:?}",
        started.elapsed()
    );
    client.close().await;
    // Phase C: node 1 paused while 2 and 3 come back; resumed once the view has it down.
    let pid = pid_of(&cluster, 1);
    signal(&cluster, 1, Signal::SIGSTOP);
    let resume = rdkv_integration_tests::view::Resume(pid);
    let old = [pid_of(&cluster, 2), pid_of(&cluster, 3)];
    let ups = [
        rdkv_integration_tests::view::up_later(&cluster, Some(2), Duration::ZERO),
        rdkv_integration_tests::view::up_later(&cluster, Some(3), Duration::from_millis(200)),
    ];
    let waited = Instant::now();
    let pid_now = |id: u32| {
        std::fs::read_to_string(cluster.run_directory.join(format!("node-{id}.pid")))
            .ok()
            .and_then(|text| text.trim().parse::<i32>().ok())
            .map(nix::unistd::Pid::from_raw)
    };
    while pid_now(2).is_none_or(|pid| pid == old[0]) || pid_now(3).is_none_or(|pid| pid == old[1]) {
        assert!(
            waited.elapsed() < Duration::from_secs(20),
            "nodes 2 and 3 never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rdkv_integration_tests::view::wait_for_view(
        &nodes,
        &secret,
        2,
        Duration::from_secs(30),
        |view| {
            rdkv_integration_tests::view::state_of(view, 1)
                == Some(rdkv_common::protocol::MemberState::Down)
        },
    )
    .await
    .unwrap_or_else(|last| panic!("node 1 never down: {last:?}"));
    drop(resume);
    for up in ups {
        let up = up.join().expect("up");
        eprintln!(
            "up --node: {}",
            output_text(&up).chars().take(200).collect::<String>()
        );
    }
    wait_serving(&cluster, Duration::from_secs(120)).await;
    for id in 1..=3 {
        let log = rdkv_integration_tests::view::log_of(&cluster, id);
        if let Some(line) = log.lines().rev().find(|line| line.contains("reconciled:")) {
            eprintln!("node {id}: {}", line.chars().take(400).collect::<String>());
        }
    }
    let wrong = wrong_keys(&cluster, &history).await;
    eprintln!("wrong keys by copies: {:?}", by_copies(&wrong, 2));
    for line in wrong.iter().take(6) {
        eprintln!("  {line}");
    }
    assert_none_wrong(
        &wrong,
        history.len(),
        "up after a one-at-a-time stop; 2, 3 stopped; node 1 alone; 1 paused while 2, 3 restart",
    );
}

/// `replicas = 1`, every node stopped one at a time (SIGTERM), then `up` with the file raised
/// to `replicas = 2`: no key is lost. The final snapshots were written with one copy each, so
/// they decide nothing under two (a node that was no copy of a key then would have had its
/// absence decide over the one copy: 17 of 30 keys were removed, found by a walkthrough); the
/// nodes reconcile by version, and each key gets its second copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raising_replicas_across_one_at_a_time_stops_loses_no_key() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_ft("raised", 1, "1s", "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let history = write_first(&client, 11).await;
    client.close().await;
    let (nodes, secret) = nodes_of(&cluster);
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    let text = std::fs::read_to_string(&cluster.file).expect("the cluster file");
    assert!(text.contains("replicas = 1"), "{text}");
    std::fs::write(&cluster.file, text.replace("replicas = 1", "replicas = 2"))
        .expect("raise replicas");
    finish(
        &cluster,
        &history,
        2,
        "replicas = 1, stopped one at a time, up with replicas = 2",
    )
    .await;
}
