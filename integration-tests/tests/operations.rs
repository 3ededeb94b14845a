//! Operating a cluster through `rdkv-cluster` as a script would: `down` without pid files (the
//! authenticated `Shutdown`), `restart --node` while the other nodes serve, `status`'s exit
//! codes (down, wrong secret), a generated systemd unit, two "remote" nodes started
//! through a real OpenSSH `sshd` on 127.0.0.1 (a throw-away host key and authorized key), and
//! what `up` in the foreground says when a node is killed, restarted or stopped.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::ClientBuilder;
use rdkv_common::ports::ReservedPorts;
use rdkv_integration_tests::cluster::{generate_cluster_file, rdkv_cluster, Cluster, ForegroundUp};
use rdkv_integration_tests::process::workspace_binary;

fn text(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn control_addresses(file: &Path) -> Vec<SocketAddr> {
    rdkv_cluster_config::load(file)
        .expect("the cluster file")
        .nodes
        .iter()
        .map(|node| node.control_address)
        .collect()
}

fn answers(address: SocketAddr) -> bool {
    TcpStream::connect_timeout(&address, Duration::from_millis(300)).is_ok()
}

#[test]
fn down_stops_a_cluster_whose_pid_files_were_deleted() {
    let cluster = Cluster::up("down-no-pids");
    let addresses = control_addresses(&cluster.file);
    assert!(addresses.iter().all(|address| answers(*address)));
    for entry in std::fs::read_dir(&cluster.run_directory).expect("the run directory") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|extension| extension == "pid") {
            std::fs::remove_file(path).expect("remove a pid file");
        }
    }
    let started = Instant::now();
    let down = rdkv_cluster(&[
        "down",
        text(&cluster.file),
        "--run-dir",
        text(&cluster.run_directory),
    ]);
    let took = started.elapsed();
    assert!(down.status.success(), "{}", stderr(&down));
    let report = stdout(&down);
    assert_eq!(
        report
            .matches("stopped (shutdown over the control plane")
            .count(),
        3,
        "{report}"
    );
    assert!(
        addresses.iter().all(|address| !answers(*address)),
        "a node still answers after down"
    );
    // Ctrl-C-fast, not the 5.5 s of waiting on unreaped children.
    assert!(took < Duration::from_secs(3), "down took {took:?}");
    let status = rdkv_cluster(&["status", text(&cluster.file)]);
    assert_eq!(status.status.code(), Some(1), "{}", stdout(&status));
}

#[test]
fn status_exits_zero_only_when_every_node_is_up_and_names_a_wrong_secret() {
    let cluster = Cluster::up("status-codes");
    let file = text(&cluster.file);
    let all_up = rdkv_cluster(&["status", file]);
    assert_eq!(all_up.status.code(), Some(0), "{}", stdout(&all_up));

    let wrong = cluster.file.with_file_name("wrong-secret.toml");
    let original = std::fs::read_to_string(&cluster.file).expect("the cluster file");
    std::fs::write(
        &wrong,
        original.replace("local-dev-secret-change-me", "not-the-cluster-secret"),
    )
    .expect("write");
    let refused = rdkv_cluster(&["status", text(&wrong)]);
    assert_eq!(refused.status.code(), Some(3), "{}", stdout(&refused));
    assert_eq!(stdout(&refused).matches("auth failed").count(), 3);
    // `down` with that file stops nothing, in one line, exit 3.
    let refused_down = rdkv_cluster(&["down", text(&wrong)]);
    assert_eq!(
        refused_down.status.code(),
        Some(3),
        "{}",
        stderr(&refused_down)
    );
    let said = stderr(&refused_down);
    let error: Vec<&str> = said
        .lines()
        .filter(|line| line.contains("error:"))
        .collect();
    assert_eq!(error.len(), 1, "{said}");
    assert!(
        error[0].contains("nodes 1, 2, 3 refused this cluster file's secret")
            && error[0].contains("nothing was stopped")
            && error[0].len() < 400,
        "{said}"
    );
    let still_up = rdkv_cluster(&["status", file]);
    assert_eq!(still_up.status.code(), Some(0), "{}", stdout(&still_up));

    let down = rdkv_cluster(&[
        "down",
        file,
        "--node",
        "2",
        "--run-dir",
        text(&cluster.run_directory),
    ]);
    assert!(down.status.success(), "{}", stderr(&down));
    let one_down = rdkv_cluster(&["status", file]);
    assert_eq!(one_down.status.code(), Some(1), "{}", stdout(&one_down));
    let table = stdout(&one_down);
    let row = table
        .lines()
        .find(|line| line.starts_with("2 "))
        .expect("node 2's row");
    assert!(row.contains("down"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_brings_one_node_back_refilled_while_the_others_serve() {
    let cluster = Cluster::up("restart");
    let config = rdkv_cluster_config::load(&cluster.file).expect("the cluster file");
    let client = Arc::new(
        ClientBuilder::cluster(&config)
            .build()
            .expect("a cluster client"),
    );
    let keys: Vec<Vec<u8>> = (0..300)
        .map(|index| format!("restart-{index}").into_bytes())
        .collect();
    for key in &keys {
        client
            .put(key, b"before")
            .await
            .expect("put before the restart");
    }
    let (on_two, elsewhere): (Vec<Vec<u8>>, Vec<Vec<u8>>) = keys
        .iter()
        .cloned()
        .partition(|key| client.node_of(key) == 2);
    assert!(!on_two.is_empty() && !elsewhere.is_empty());

    // Load on the other nodes' keys for the whole restart: every operation must succeed.
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let load = {
        let (client, stop, failures, done) =
            (client.clone(), stop.clone(), failures.clone(), done.clone());
        let keys = elsewhere.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            for key in keys.iter().cycle() {
                if stop.load(Ordering::Relaxed) || started.elapsed() > Duration::from_secs(60) {
                    break;
                }
                match client.get(key).await {
                    Ok(Some(value)) if value.as_ref() == b"before" => {}
                    _ => {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let restart = tokio::task::spawn_blocking({
        let file = cluster.file.clone();
        let run_directory = cluster.run_directory.clone();
        move || {
            rdkv_cluster(&[
                "restart",
                text(&file),
                "--node",
                "2",
                "--run-dir",
                text(&run_directory),
            ])
        }
    })
    .await
    .expect("restart ran");
    stop.store(true, Ordering::Relaxed);
    load.await.expect("the load task");
    assert!(restart.status.success(), "{}", stderr(&restart));
    let report = stdout(&restart);
    assert!(report.contains("node 2: stopped"), "{report}");
    assert!(report.contains("node 2: started"), "{report}");
    assert!(done.load(Ordering::Relaxed) > 0);
    assert_eq!(
        failures.load(Ordering::Relaxed),
        0,
        "the other nodes' keys failed during the restart"
    );

    // The example keeps two copies of each key: the restarted node's keys were read from
    // their second copy meanwhile (it serves nothing before the view has its rejoin), and it
    // is refilled; it serves new writes.
    for key in &on_two {
        assert_eq!(
            client
                .get(key)
                .await
                .expect("get after the restart")
                .as_deref(),
            Some(&b"before"[..]),
            "a key of the restarted node"
        );
    }
    for key in &elsewhere {
        assert_eq!(
            client.get(key).await.expect("get").as_deref(),
            Some(&b"before"[..])
        );
    }
    client
        .put(&on_two[0], b"after")
        .await
        .expect("put to the restarted node");
    assert_eq!(
        client.get(&on_two[0]).await.expect("get").as_deref(),
        Some(&b"after"[..])
    );
    let status = rdkv_cluster(&["status", text(&cluster.file)]);
    assert_eq!(status.status.code(), Some(0), "{}", stdout(&status));
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_or_parses_as_a_unit() {
    let directory = std::env::temp_dir().join(format!("rdkv-systemd-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    // Nothing is started: the ports are released at once.
    let (file, _) = generate_cluster_file(&directory);
    let output = rdkv_cluster(&["systemd", text(&file), "--node", "2"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let unit = stdout(&output);
    let sections = rdkv_cluster_config::systemd::parse_unit(&unit).expect("unit syntax");
    let service = &sections
        .iter()
        .find(|(name, _)| name == "Service")
        .expect("a [Service]")
        .1;
    let value = |key: &str| {
        service
            .iter()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value.clone())
            .unwrap_or_default()
    };
    assert!(value("ExecStart").contains("--node 2 --secret-file %d/rdkv-secret"));
    assert!(value("LimitMEMLOCK").ends_with('M'));
    assert_eq!(value("Restart"), "on-failure");
    let path = directory.join("rdkv-local-3node-node-2.service");
    std::fs::write(&path, &unit).expect("write the unit");
    match Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
    {
        Ok(verify) => assert!(
            verify.status.success() && verify.stderr.is_empty(),
            "systemd-analyze verify: {}{}",
            stdout(&verify),
            stderr(&verify)
        ),
        Err(error) => {
            eprintln!("systemd-analyze is not here ({error}): checked the unit syntax only")
        }
    }
    let _ = std::fs::remove_dir_all(&directory);
}

/// A throw-away OpenSSH server on 127.0.0.1, killed when dropped.
struct SshServer {
    child: Child,
    directory: PathBuf,
    config: PathBuf,
    /// Its port, reserved before sshd binds it and held until sshd is killed (sshd cannot
    /// report a port it chose itself; see `rdkv_common::ports`). Dropped after `drop`.
    _port: ReservedPorts,
}

impl Drop for SshServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

fn run_ok(command: &mut Command) {
    let output = command.output().expect("run a setup command");
    assert!(output.status.success(), "{command:?}: {}", stderr(&output));
}

impl SshServer {
    /// Starts `sshd -D` on a reserved loopback port, accepting one fresh key; writes an ssh config
    /// with the hosts `rdkv-remote-a` and `rdkv-remote-b` pointing at it.
    fn start(directory: &Path) -> Self {
        let sshd = Path::new("/usr/sbin/sshd");
        assert!(
            sshd.exists(),
            "/usr/sbin/sshd is not installed: apt-get install openssh-server"
        );
        std::fs::create_dir_all(directory).expect("directory");
        // sshd's privilege separation directory (it refuses to start without it).
        let _ = std::fs::create_dir_all("/run/sshd");
        for key in ["host_key", "client_key"] {
            run_ok(
                Command::new("ssh-keygen")
                    .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                    .arg(directory.join(key)),
            );
        }
        std::fs::copy(
            directory.join("client_key.pub"),
            directory.join("authorized_keys"),
        )
        .expect("authorized_keys");
        let reserved = ReservedPorts::loopback(1).expect("reserve a loopback port");
        let port = reserved.ports()[0];
        let path = |name: &str| directory.join(name).display().to_string();
        std::fs::write(
            directory.join("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {}\nAuthorizedKeysFile {}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\nPidFile {}\n",
                path("host_key"),
                path("authorized_keys"),
                path("sshd.pid"),
            ),
        )
        .expect("sshd_config");
        let config = directory.join("ssh_config");
        std::fs::write(
            &config,
            format!(
                "Host rdkv-remote-a rdkv-remote-b\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n",
                path("client_key"),
            ),
        )
        .expect("ssh_config");
        let child = Command::new(sshd)
            .arg("-D")
            .arg("-f")
            .arg(directory.join("sshd_config"))
            .arg("-E")
            .arg(directory.join("sshd.log"))
            .stdin(Stdio::null())
            .spawn()
            .expect("start sshd");
        let server = Self {
            child,
            directory: directory.to_path_buf(),
            config,
            _port: reserved,
        };
        // Ready when an ssh round trip works (bounded: sshd binds within milliseconds).
        let started = Instant::now();
        loop {
            let probe = Command::new("ssh")
                .arg("-F")
                .arg(&server.config)
                .args(["-o", "BatchMode=yes", "rdkv-remote-a", "true"])
                .output()
                .expect("run ssh");
            if probe.status.success() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "sshd did not accept the key: {}\n{}",
                stderr(&probe),
                std::fs::read_to_string(directory.join("sshd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }
}

fn rdkv(file: &Path, arguments: &[&str]) -> std::process::Output {
    Command::new(workspace_binary("rdkv"))
        .args(["--config", text(file)])
        .args(arguments)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run rdkv")
}

#[test]
#[ignore = "needs OpenSSH's sshd (apt-get install openssh-server); CI runs it: cargo test -p rdkv-integration-tests --test operations -- --ignored"]
fn two_nodes_on_remote_hosts_through_sshd_on_loopback() {
    let directory = std::env::temp_dir().join(format!("rdkv-ssh-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let sshd = SshServer::start(&directory.join("sshd"));
    let (local, ports) = generate_cluster_file(&directory);
    let remote_run_directory = directory.join("remote run dir");
    let settings = format!(
        "operation_deadline = \"2s\"\nssh_options = [\"-F\", \"{}\"]\nremote_binary = \"{}\"\nremote_run_dir = \"{}\"",
        sshd.config.display(),
        workspace_binary("rdkv-server").display(),
        remote_run_directory.display()
    );
    let file_text = std::fs::read_to_string(&local)
        .expect("the cluster file")
        .replace("operation_deadline = \"2s\"", &settings)
        .replace(
            "[[node]]\nid = 2\n",
            "[[node]]\nid = 2\nhost = \"rdkv-remote-a\"\n",
        )
        .replace(
            "[[node]]\nid = 3\n",
            "[[node]]\nid = 3\nhost = \"rdkv-remote-b\"\n",
        );
    let file = directory.join("remote.toml");
    std::fs::write(&file, file_text).expect("write the cluster file");
    let run_directory = directory.join("run");
    let cluster = Cluster {
        file: file.clone(),
        run_directory: run_directory.clone(),
        ports,
    };
    let run_dir = text(&run_directory);

    let up = rdkv_cluster(&["up", text(&file), "--detach", "--run-dir", run_dir]);
    assert!(up.status.success(), "up: {}", stderr(&up));
    let table = stdout(&up);
    assert!(
        table.contains("rdkv-remote-a") && table.contains("rdkv-remote-b"),
        "{table}"
    );
    // The remote nodes run from the remote run directory, with the file and secret shipped.
    for name in ["cluster.toml", "secret", "node-2.pid", "node-3.pid"] {
        assert!(
            remote_run_directory.join(name).exists(),
            "{name} is missing on the host"
        );
    }

    // A CLI round trip on keys of every node.
    let config = rdkv_cluster_config::load(&file).expect("the cluster file");
    let router = ClientBuilder::cluster(&config)
        .build()
        .expect("a cluster client");
    let mut keys_by_node = std::collections::BTreeMap::new();
    for index in 0..64 {
        let key = format!("ssh-{index}");
        keys_by_node
            .entry(router.node_of(key.as_bytes()))
            .or_insert(key);
    }
    assert_eq!(keys_by_node.len(), 3, "64 keys cover the three nodes");
    for key in keys_by_node.values() {
        let put = rdkv(&file, &["put", key, "over-ssh"]);
        assert!(put.status.success(), "put {key}: {}", stderr(&put));
        let get = rdkv(&file, &["get", key]);
        assert!(get.status.success(), "get {key}: {}", stderr(&get));
        assert_eq!(stdout(&get).trim_end(), "over-ssh");
    }

    let restart = rdkv_cluster(&["restart", text(&file), "--node", "2", "--run-dir", run_dir]);
    assert!(restart.status.success(), "restart: {}", stderr(&restart));
    assert!(
        stdout(&restart).contains("on rdkv-remote-a"),
        "{}",
        stdout(&restart)
    );
    let status = rdkv_cluster(&["status", text(&file)]);
    assert_eq!(status.status.code(), Some(0), "{}", stdout(&status));
    let key_on_two = &keys_by_node[&2];
    let put = rdkv(&file, &["put", key_on_two, "after-restart"]);
    assert!(put.status.success(), "{}", stderr(&put));
    assert_eq!(
        stdout(&rdkv(&file, &["get", key_on_two])).trim_end(),
        "after-restart"
    );

    let logs = rdkv_cluster(&[
        "logs",
        text(&file),
        "--node",
        "3",
        "--lines",
        "500",
        "--run-dir",
        run_dir,
    ]);
    assert!(logs.status.success(), "{}", stderr(&logs));
    assert!(stdout(&logs).contains("server ready"), "{}", stdout(&logs));

    let down = rdkv_cluster(&["down", text(&file), "--run-dir", run_dir]);
    assert!(down.status.success(), "down: {}", stderr(&down));
    assert_eq!(
        stdout(&down)
            .lines()
            .filter(|line| line.starts_with("node ") && line.contains(": stopped"))
            .count(),
        3,
        "{}",
        stdout(&down)
    );
    for address in control_addresses(&file) {
        assert!(!answers(address), "{address} still answers after down");
    }
    drop(cluster);
    drop(sshd);
    let _ = std::fs::remove_dir_all(&directory);
}

#[test]
fn down_never_signals_a_process_that_is_not_the_node() {
    let cluster = Cluster::up("foreign-pid");
    let pid_file = cluster.run_directory.join("node-3.pid");
    let node_pid: i32 = std::fs::read_to_string(&pid_file)
        .expect("node 3's pid file")
        .trim()
        .parse()
        .expect("a pid");
    // Node 3 crashes; its pid is reused by an unrelated process.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(node_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill node 3");
    let mut bystander = Command::new("sleep").arg("30").spawn().expect("sleep");
    let node_three = control_addresses(&cluster.file)[2];
    let started = Instant::now();
    while answers(node_three) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "node 3 still answers"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for pid in [
        bystander.id().to_string(),
        "-1".into(),
        "0".into(),
        "1".into(),
    ] {
        std::fs::write(&pid_file, format!("{pid}\n")).expect("write the pid file");
        let down = rdkv_cluster(&[
            "down",
            text(&cluster.file),
            "--node",
            "3",
            "--run-dir",
            text(&cluster.run_directory),
        ]);
        assert!(down.status.success(), "{}", stderr(&down));
        let report = stdout(&down);
        assert!(
            report.contains("not running") || report.contains("already stopped"),
            "pid {pid}: {report}"
        );
        assert!(
            bystander.try_wait().expect("wait").is_none(),
            "down signalled the bystander (pid file {pid})"
        );
    }
    let _ = bystander.kill();
    let _ = bystander.wait();
}

/// How long a three-node cluster may take to start and serve in the foreground: generous, for
/// a loaded two-core machine (it takes about two seconds unloaded).
const FOREGROUND_START_BOUND: Duration = Duration::from_secs(120);
/// How long a line about a node may take to appear in `up`'s output: generous, likewise (the
/// exit line comes at once on SIGCHLD; a restarted node is noticed within a quarter second of
/// its pid file).
const FOREGROUND_REPORT_BOUND: Duration = Duration::from_secs(60);

/// The state letter in `/proc/PID/stat` and the parent pid, or `None` when the pid is gone.
fn process_state(pid: i32) -> Option<(String, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?.to_string();
    let parent = fields.next()?.parse().ok()?;
    Some((state, parent))
}

/// A cluster from a generated file started by a foreground `up` (in `tag`'s temporary
/// directory), once it forwards the nodes' logs. The [`Cluster`] is made first, so that its
/// `down` runs after `up` has been interrupted.
fn foreground_cluster(tag: &str) -> (Cluster, ForegroundUp) {
    let directory = std::env::temp_dir().join(format!("rdkv-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let (file, ports) = generate_cluster_file(&directory);
    let run_directory = directory.join("run");
    let cluster = Cluster {
        file: file.clone(),
        run_directory: run_directory.clone(),
        ports,
    };
    let mut up = ForegroundUp::start(&file, &run_directory);
    up.wait_for_line(
        0,
        |line| line.starts_with("forwarding node logs"),
        FOREGROUND_START_BOUND,
    );
    (cluster, up)
}

#[test]
fn up_in_the_foreground_reports_a_killed_node_and_follows_its_restart() {
    let (cluster, mut up) = foreground_cluster("foreground");
    let (file, run_directory) = (cluster.file.clone(), cluster.run_directory.clone());
    let read_pid = |node: u32| -> i32 {
        std::fs::read_to_string(run_directory.join(format!("node-{node}.pid")))
            .expect("the pid file")
            .trim()
            .parse()
            .expect("a pid")
    };

    // SIGKILL: one line naming the signal, and the process reaped (no zombie under `up`).
    let killed = read_pid(3);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(killed),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill node 3");
    let exit_line = up.wait_for_line(
        0,
        |line| line.starts_with("node 3 exited: killed by signal 9 (SIGKILL); its log: "),
        FOREGROUND_REPORT_BOUND,
    );
    // `up` reaps before it prints the line: the pid is gone (or, reused, not a zombie of up's).
    if let Some((state, parent)) = process_state(killed) {
        assert!(
            state != "Z" && parent != up.pid() as i32,
            "node 3 (pid {killed}) is still {state} under parent {parent}:\n{}",
            up.text()
        );
    }

    // `restart` from another shell: `up` says so and follows the new process's log file.
    let restart = rdkv_cluster(&[
        "restart",
        text(&file),
        "--node",
        "3",
        "--run-dir",
        text(&run_directory),
    ]);
    assert!(restart.status.success(), "{}", stderr(&restart));
    let restarted = read_pid(3);
    up.wait_for_line(
        exit_line,
        |line| {
            line.starts_with(&format!(
                "node 3 was started again by another command (pid {restarted}); its log: "
            )) && line.ends_with("node-3.log, followed here")
        },
        FOREGROUND_REPORT_BOUND,
    );
    up.wait_for_line(
        exit_line,
        |line| line.starts_with("[node 3] ") && line.contains("server ready"),
        FOREGROUND_REPORT_BOUND,
    );

    // A clean stop (`down --node 2`) is said as such, not as an alarm.
    let down = rdkv_cluster(&[
        "down",
        text(&file),
        "--node",
        "2",
        "--run-dir",
        text(&run_directory),
    ]);
    assert!(down.status.success(), "{}", stderr(&down));
    up.wait_for_line(
        exit_line,
        |line| line == "node 2 stopped cleanly (exit status 0)",
        FOREGROUND_REPORT_BOUND,
    );

    // Ctrl-C still stops the nodes in order, the restarted one included, and exits 0.
    let status = up.interrupt(FOREGROUND_REPORT_BOUND);
    let transcript = up.text();
    assert_eq!(status.code(), Some(0), "{transcript}");
    let position = |wanted: &str| {
        up.transcript
            .iter()
            .position(|line| line == wanted)
            .unwrap_or_else(|| panic!("no line `{wanted}`:\n{transcript}"))
    };
    let stops = [
        position("stopping the cluster"),
        position("node 1: stopped"),
        position("node 2: had already exited"),
        position("node 3: had already exited"),
        position("node 3: stopped its restarted process"),
    ];
    assert!(stops.is_sorted(), "{stops:?}:\n{transcript}");
    let alarms = up
        .transcript
        .iter()
        .filter(|line| line.starts_with("node ") && line.contains(" exited"))
        .filter(|line| !line.ends_with(": had already exited"))
        .count();
    assert_eq!(alarms, 1, "only node 3's kill is an alarm:\n{transcript}");
    assert!(
        !transcript.contains("is no longer running"),
        "up's own stop is not reported as an exit:\n{transcript}"
    );
    assert!(
        process_state(restarted).is_none_or(|(state, _)| state == "Z"),
        "the restarted node 3 (pid {restarted}) still runs:\n{transcript}"
    );
}

/// Ctrl-C on the foreground `up` stops the cluster as `down` does (the view first): the next
/// `up` resumes from the final snapshots with every key, and no loss is recorded.
#[test]
fn ctrl_c_on_the_foreground_up_keeps_every_key() {
    let (cluster, mut up) = foreground_cluster("ctrl-c");
    let (file, run_directory) = (cluster.file.clone(), cluster.run_directory.clone());
    for index in 0..20 {
        let put = rdkv(
            &file,
            &["put", &format!("ctrl-c:{index}"), &format!("value {index}")],
        );
        assert!(put.status.success(), "{}", stderr(&put));
    }
    let status = up.interrupt(Duration::from_secs(60));
    assert!(status.success(), "{}", up.text());
    assert!(
        up.text().contains("cluster stopped at view epoch"),
        "{}",
        up.text()
    );

    let again = rdkv_cluster(&[
        "up",
        text(&file),
        "--run-dir",
        text(&run_directory),
        "--detach",
    ]);
    assert!(again.status.success(), "{}", stderr(&again));
    for index in 0..20 {
        let get = rdkv(&file, &["get", &format!("ctrl-c:{index}")]);
        assert_eq!(
            stdout(&get).trim_end(),
            format!("value {index}"),
            "{}",
            stderr(&get)
        );
    }
    let status = rdkv_cluster(&["status", text(&file), "--run-dir", text(&run_directory)]);
    assert!(
        !stdout(&status).contains("keys may have been lost"),
        "{}",
        stdout(&status)
    );
    drop(cluster);
}
