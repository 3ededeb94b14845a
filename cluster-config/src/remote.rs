//! Nodes on other hosts, through OpenSSH.
//!
//! Every call is `ssh -o BatchMode=yes -o ConnectTimeout=10 [ssh_options] [-l ssh_user] --
//! HOST sh -c SCRIPT`: the user's own ssh config, keys and agent; never a password prompt. On the
//! host, the node's files live in `remote_run_dir` (relative paths are from the login
//! directory): the cluster file, the secret (mode 0600), `node-ID.pid`, `node-ID.out` (the
//! ready line) and `node-ID.log` (`rdkv-server --log-file`: appended to, rotated by size).
//!
//! - start: one call writes the secret, a second writes the cluster file and starts
//!   `remote_binary --config FILE --node ID --secret-file SECRET` under `setsid nohup`, then
//!   waits there for its ready line (or its exit, with the log's last lines);
//! - stop: `rdkv-cluster` asks over the control plane first (no ssh needed); this module's
//!   stop is the fallback: SIGTERM by the pid file, SIGKILL after 15 s;
//! - logs: `tail` of the node's log.

use std::io::Write;
use std::process::{Command, Stdio};

use crate::config::{ClusterConfig, NodeConfig};
use crate::error::{Error, Result};

/// A string as one single-quoted POSIX shell word.
pub fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The ssh command for `host`, ready for its remote command.
fn ssh(config: &ClusterConfig, host: &str) -> Command {
    let mut command = Command::new("ssh");
    command
        .args(["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"])
        .args(&config.ssh.options);
    if let Some(user) = &config.ssh.user {
        command.args(["-l", user]);
    }
    // `--` before the host: a host cannot pass for an option.
    command.arg("--").arg(host);
    command
}

/// Runs `script` on the node's host under `sh -c`, with `input` on its stdin; returns stdout.
fn run(
    config: &ClusterConfig,
    node: &NodeConfig,
    host: &str,
    script: &str,
    input: &[u8],
) -> Result<String> {
    let failure = |message: String| Error::Node {
        node: node.id,
        message,
    };
    let mut child = ssh(config, host)
        .arg(format!("sh -c {}", shell_quote(script)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|error| {
            failure(format!(
                "run ssh to {host}: {error}; install OpenSSH's client (`apt-get install openssh-client`)"
            ))
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input)
            .map_err(|error| failure(format!("send to ssh {host}: {error}")))?;
    }
    let output = child
        .wait_with_output()
        .map_err(|error| failure(format!("wait for ssh {host}: {error}")))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        return Ok(stdout);
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let detail = stderr.trim().lines().collect::<Vec<_>>().join("\n  ");
    Err(failure(match output.status.code() {
        Some(255) => format!(
            "ssh to {host} failed: {detail}; check `ssh -o BatchMode=yes {host} true` works (keys or agent, known_hosts), and ssh_user / ssh_options in the cluster file"
        ),
        _ => format!("on {host}: {detail}"),
    }))
}

/// The node's run directory on its host, quoted; a leading `~/` is the login directory.
fn directory(config: &ClusterConfig) -> String {
    let directory = &config.ssh.remote_run_dir;
    match directory.strip_prefix("~/") {
        Some(rest) => format!("\"$HOME\"/{}", shell_quote(rest)),
        None => shell_quote(directory),
    }
}

/// Shell functions: `alive PID` (the process exists and is not a zombie) and `node_process PID
/// ID` (it is node ID's `rdkv-server`: a pid file outlives its process, and the pid may since
/// belong to anything, so nothing is signalled unless this holds; pids 0, 1 and negative ones
/// never are).
const ALIVE: &str = r#"alive() { [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status"; }
node_process() { [ "$1" -gt 1 ] 2>/dev/null && alive "$1" && tr '\000' ' ' < "/proc/$1/cmdline" | grep -q "rdkv-server .*--node $2 "; }"#;

/// Starts the node on `host` and returns its ready line and pid.
///
/// # Errors
/// [`Error::Node`] with what ssh or the node said (the log's last lines when it exited).
pub fn start(config: &ClusterConfig, node: &NodeConfig, host: &str) -> Result<(String, u32)> {
    let directory = directory(config);
    let secret_script = format!(
        "umask 077 && mkdir -p -- {directory} && cat > {directory}/secret && chmod 600 {directory}/secret"
    );
    run(config, node, host, &secret_script, &config.secret)?;
    let id = node.id;
    let binary = shell_quote(&config.ssh.remote_binary);
    // The node's snapshots: where the file says, else beside its other files.
    let data_dir = match &node.data_dir {
        Some(_) => String::new(),
        None => format!(r#" --data-dir "$dir/node-{id}.data""#),
    };
    let script = format!(
        r#"set -e
umask 077
dir={directory}
mkdir -p -- "$dir"
{ALIVE}
pidfile="$dir/node-{id}.pid"
if [ -f "$pidfile" ] && node_process "$(cat "$pidfile")" {id}; then
  echo "already running there (pid $(cat "$pidfile")); stop it with rdkv-cluster down, or restart --node {id}" >&2
  exit 3
fi
cat > "$dir/cluster.toml"
chmod 600 "$dir/cluster.toml"
: > "$dir/node-{id}.out"
setsid nohup {binary} --config "$dir/cluster.toml" --node {id} --secret-file "$dir/secret" \
  --view-state "$dir/node-{id}.view"{data_dir} --log-file "$dir/node-{id}.log" \
  > "$dir/node-{id}.out" 2>> "$dir/node-{id}.log" < /dev/null &
pid=$!
echo "$pid" > "$pidfile"
tries=0
while [ "$tries" -lt 300 ]; do
  if grep -q '^rdkv-server ready' "$dir/node-{id}.out"; then
    head -n 1 "$dir/node-{id}.out"
    echo "pid=$pid"
    exit 0
  fi
  if ! alive "$pid"; then
    echo "it exited before it was ready:" >&2
    tail -n 8 "$dir/node-{id}.log" >&2
    rm -f "$pidfile"
    exit 4
  fi
  sleep 0.1
  tries=$((tries + 1))
done
echo "no ready line within 30s:" >&2
tail -n 8 "$dir/node-{id}.log" >&2
kill "$pid"
exit 5
"#
    );
    let file = std::fs::read(&config.path).map_err(|error| Error::Node {
        node: id,
        message: format!("read {}: {error}", config.path.display()),
    })?;
    let output = run(config, node, host, &script, &file)?;
    let ready_line = output
        .lines()
        .find(|line| line.starts_with("rdkv-server ready"))
        .map(str::to_string);
    let pid = output
        .lines()
        .find_map(|line| line.strip_prefix("pid="))
        .and_then(|pid| pid.trim().parse().ok());
    match (ready_line, pid) {
        (Some(line), Some(pid)) => Ok((line, pid)),
        _ => Err(Error::Node {
            node: id,
            message: format!(
                "failed to start on {host}: no ready line in `{}`",
                output.trim()
            ),
        }),
    }
}

/// Stops the node on `host` by its pid file (SIGTERM, SIGKILL after 15 s); one line of what
/// happened.
///
/// # Errors
/// [`Error::Node`] when ssh fails.
pub fn stop(config: &ClusterConfig, node: &NodeConfig, host: &str) -> Result<String> {
    let id = node.id;
    let script = format!(
        r#"{ALIVE}
pidfile={directory}/node-{id}.pid
if [ ! -f "$pidfile" ]; then echo "not running (no pid file there)"; exit 0; fi
pid=$(cat "$pidfile")
if ! node_process "$pid" {id}; then rm -f "$pidfile"; echo "already stopped (stale pid file: $pid is not node {id}'s rdkv-server; removed)"; exit 0; fi
kill -TERM "$pid"
tries=0
while alive "$pid" && [ "$tries" -lt 150 ]; do sleep 0.1; tries=$((tries + 1)); done
if alive "$pid"; then kill -KILL "$pid"; echo "killed (pid $pid) after 15s"; else echo "stopped by SIGTERM (pid $pid)"; fi
rm -f "$pidfile"
"#,
        directory = directory(config),
    );
    run(config, node, host, &script, &[]).map(|output| format!("{} on {host}", output.trim()))
}

/// Removes the node's pid file on `host` after it stopped some other way (best effort).
pub fn forget(config: &ClusterConfig, node: &NodeConfig, host: &str) {
    let script = format!("rm -f {}/node-{}.pid", directory(config), node.id);
    let _ = run(config, node, host, &script, &[]);
}

/// The last `lines` lines of the node's log on `host`.
///
/// # Errors
/// [`Error::Node`] when ssh fails or there is no log.
pub fn logs(config: &ClusterConfig, node: &NodeConfig, host: &str, lines: usize) -> Result<String> {
    let script = format!("tail -n {lines} {}/node-{}.log", directory(config), node.id);
    run(config, node, host, &script, &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words_survive_quotes_and_spaces() {
        assert_eq!(shell_quote("plain"), "'plain'");
        assert_eq!(shell_quote("it's a dir"), r"'it'\''s a dir'");
        let output = Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", shell_quote("a 'b' $c \"d\"")))
            .output()
            .expect("sh");
        assert_eq!(String::from_utf8_lossy(&output.stdout), "a 'b' $c \"d\"");
    }
}
