//! What the foreground `rdkv-cluster up` says about its local nodes while it runs, besides
//! their forwarded log lines: one line when a node exits, and the log of a node that another
//! command (`restart`, `up --node N --detach`) started again.
//!
//! - Exits: `up` listens for SIGCHLD and then asks each of its children with `try_wait`, which
//!   reaps an exited one at once (no zombie). A node that exits on its own or is killed gets
//!   one line, `node 3 exited: killed by signal 9 (SIGKILL); …` or `node 3 exited with status
//!   1; …`; one that stopped cleanly (exit status 0: `down`, `restart`, a SIGTERM from
//!   elsewhere) gets `node 3 stopped cleanly (exit status 0)`. `up`'s own Ctrl-C stop happens
//!   after [`report_until`] has returned, so it prints nothing here.
//! - A node that is no longer `up`'s child: one thread per such node checks its pid file every
//!   [`FOLLOW_POLL`] until the file names a new running `rdkv-server` of that node, says so,
//!   and follows its log file (`node-N.log`, where `restart` sends it) from that process's
//!   start line (the file holds the earlier runs' lines before it): lines
//!   of at most [`MAX_LINE`] bytes (a longer one is printed in pieces), waiting
//!   [`FOLLOW_POLL`] at the end of the file, until that process has gone; then it waits for
//!   the next one. A process whose stderr is not that file (`up --node N` in another
//!   terminal) is named, not followed: an old log file there is not its. The threads stop
//!   when [`report_until`] returns.
use std::collections::BTreeMap;
use std::fs::File;
use std::future::Future;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};

use crate::launcher::{is_alive, log_file, node_pid, say, StartedNode};

/// How often a follower looks for a restarted node, and for new lines at the end of its log.
pub const FOLLOW_POLL: Duration = Duration::from_millis(250);
/// The longest log line a follower holds; a longer one is printed in pieces.
pub const MAX_LINE: usize = 16 * 1024;
/// How much of a log a follower reads before it checks whether it should stop.
const READ_BEFORE_CHECK: u64 = 1024 * 1024;
/// How often exits are looked for when SIGCHLD cannot be listened for.
const SWEEP_WITHOUT_SIGCHLD: Duration = Duration::from_secs(1);

/// How a child ended, as the `up` terminal says it: `exited: killed by signal 9 (SIGKILL)`,
/// `exited with status 1`, or `stopped cleanly (exit status 0)`.
pub fn describe_exit(status: ExitStatus) -> String {
    if let Some(number) = status.signal() {
        let name = Signal::try_from(number).map_or("an unknown signal", Signal::as_str);
        let core = if status.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        return format!("exited: killed by signal {number} ({name}{core})");
    }
    match status.code() {
        Some(0) => "stopped cleanly (exit status 0)".to_string(),
        Some(code) => format!("exited with status {code}"),
        None => format!("exited ({status})"),
    }
}

/// Runs until `until` completes (`up`'s Ctrl-C), saying meanwhile when one of `nodes`' local
/// children exits (and reaping it), and following the log of a node started again by another
/// command. `restart_command(id)` is the command that starts node `id` again, for the line of
/// a node that did not stop cleanly. Every follower has stopped when this returns.
pub async fn report_until<F: Future>(
    nodes: &mut [StartedNode],
    run_directory: &Path,
    restart_command: impl Fn(u32) -> String,
    until: F,
) -> F::Output {
    let mut children = match signal(SignalKind::child()) {
        Ok(children) => Some(children),
        Err(error) => {
            say(&format!(
                "warning: cannot listen for SIGCHLD ({error}); looking for exited nodes every {SWEEP_WITHOUT_SIGCHLD:?}"
            ));
            None
        }
    };
    let mut followers = BTreeMap::new();
    tokio::pin!(until);
    let output = loop {
        // First, also for the exits before SIGCHLD was listened for: a node may die while
        // `up` waits for the cluster to serve.
        report_exits(nodes, run_directory, &restart_command, &mut followers);
        tokio::select! {
            output = &mut until => break output,
            () = next_child_exit(&mut children) => {}
        }
    };
    let _ = tokio::task::spawn_blocking(move || stop_followers(followers)).await;
    output
}

/// Waits for SIGCHLD, or (without it) for the next sweep.
async fn next_child_exit(children: &mut Option<tokio::signal::unix::Signal>) {
    if let Some(signal) = children {
        if signal.recv().await.is_some() {
            return;
        }
        // The signal driver has gone: sweep on a timer from now on.
        *children = None;
    }
    tokio::time::sleep(SWEEP_WITHOUT_SIGCHLD).await;
}

/// Reaps every child of `nodes` that has exited and is not reported yet: one line each, and a
/// follower for whatever process starts the node again.
fn report_exits(
    nodes: &mut [StartedNode],
    run_directory: &Path,
    restart_command: &impl Fn(u32) -> String,
    followers: &mut BTreeMap<u32, Follower>,
) {
    for node in nodes.iter_mut() {
        let id = node.ready.id;
        let Some(child) = node.child.as_mut() else {
            continue;
        };
        if followers.contains_key(&id) {
            continue;
        }
        let status = match child.try_wait() {
            Ok(Some(status)) => status,
            Ok(None) | Err(_) => continue,
        };
        let line = if status.success() {
            format!("node {id} {}", describe_exit(status))
        } else {
            format!(
                "node {id} {}; its log: the [node {id}] lines above; {}",
                describe_exit(status),
                restart_command(id)
            )
        };
        say(&line);
        let old_pid = node.ready.pid as i32;
        followers.insert(id, Follower::start(id, old_pid, run_directory));
    }
}

/// A thread that follows the processes another command starts for one node.
struct Follower {
    /// Dropped to tell the thread to stop (it notices within [`FOLLOW_POLL`]).
    stop: SyncSender<()>,
    /// The thread, joined once told to stop.
    thread: std::thread::JoinHandle<()>,
}

impl Follower {
    fn start(id: u32, old_pid: i32, run_directory: &Path) -> Self {
        let (stop, stopped) = mpsc::sync_channel(1);
        let run_directory = run_directory.to_path_buf();
        let thread = std::thread::spawn(move || follow_node(id, old_pid, &run_directory, &stopped));
        Self { stop, thread }
    }
}

/// Tells every follower to stop, then waits for each (a quarter of a second at most, plus one
/// read).
fn stop_followers(followers: BTreeMap<u32, Follower>) {
    let threads: Vec<_> = followers
        .into_values()
        .map(|follower| {
            drop(follower.stop);
            follower.thread
        })
        .collect();
    for thread in threads {
        let _ = thread.join();
    }
}

/// Waits `period`; true when the follower has been told to stop.
fn told_to_stop(stopped: &Receiver<()>, period: Duration) -> bool {
    !matches!(stopped.recv_timeout(period), Err(RecvTimeoutError::Timeout))
}

/// Node `id`'s follower: each time its pid file names a new running process, says so and
/// prints its log until it has gone.
fn follow_node(id: u32, mut old_pid: i32, run_directory: &Path, stopped: &Receiver<()>) {
    let path = log_file(run_directory, id);
    loop {
        let pid = loop {
            if let Some(pid) = node_pid(run_directory, id).filter(|pid| *pid != old_pid) {
                break pid;
            }
            if told_to_stop(stopped, FOLLOW_POLL) {
                return;
            }
        };
        let followed = if logs_to(pid, &path) {
            say(&format!(
                "node {id} was started again by another command (pid {pid}); its log: {}, followed here",
                path.display()
            ));
            follow_log(id, pid, &path, stopped)
        } else {
            // `up --node N` in another terminal: its log goes there, and an old log file here
            // is not its.
            say(&format!(
                "node {id} was started again by another command (pid {pid}); it does not log to {}: its log is where that command sends it",
                path.display()
            ));
            wait_gone(pid, stopped)
        };
        if !followed {
            return;
        }
        say(&format!(
            "node {id} (pid {pid}, started by another command) is no longer running; its log: {}",
            path.display()
        ));
        old_pid = pid;
    }
}

/// Whether process `pid`'s stderr is the file `path`.
fn logs_to(pid: i32, path: &Path) -> bool {
    match (
        std::fs::read_link(format!("/proc/{pid}/fd/2")),
        std::fs::canonicalize(path),
    ) {
        (Ok(stderr), Ok(path)) => stderr == path,
        _ => false,
    }
}

/// Waits until process `pid` has gone; false when told to stop first.
fn wait_gone(pid: i32, stopped: &Receiver<()>) -> bool {
    while is_alive(pid) {
        if told_to_stop(stopped, FOLLOW_POLL) {
            return false;
        }
    }
    true
}

/// Prints node `id`'s log lines from `path`, from its start, while process `pid` runs, and
/// what it wrote before it went. False when told to stop first.
fn follow_log(id: u32, pid: i32, path: &Path, stopped: &Receiver<()>) -> bool {
    let mut log: Option<LogReader> = None;
    loop {
        // Looked at before reading: the lines written before the process went are read too.
        let running = is_alive(pid);
        if log.is_none() {
            log = File::open(path)
                .ok()
                .map(|file| LogReader::from_run_of(file, pid));
        }
        let at_end = log.as_mut().is_none_or(|log| log.print_new_lines(id));
        if !running && at_end {
            if let Some(log) = log.as_mut() {
                log.print_rest(id);
            }
            return true;
        }
        let period = if at_end { FOLLOW_POLL } else { Duration::ZERO };
        if told_to_stop(stopped, period) {
            return false;
        }
    }
}

/// Where the last `needle` starts in `haystack`.
fn find_last(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .rposition(|window| window == needle)
}

/// Reads a growing log file line by line, holding at most [`MAX_LINE`] bytes.
struct LogReader {
    /// The file, read from where the last call stopped.
    reader: BufReader<File>,
    /// The start of a line whose end has not been written yet.
    partial: Vec<u8>,
}

impl LogReader {
    fn new(file: File) -> Self {
        Self {
            reader: BufReader::new(file),
            partial: Vec::new(),
        }
    }

    /// A reader of the lines of process `pid`'s run: from its start line (a node appends to
    /// its log, after the earlier runs' lines), or from the end of the file when that line is
    /// not written yet (then everything after it is this run's).
    fn from_run_of(mut file: File, pid: i32) -> Self {
        // The line `rdkv_server::log_file::RotatingLog` writes first.
        let marker = format!("rdkv-server (pid {pid}) started: ");
        let mut text = Vec::new();
        let start = match file.read_to_end(&mut text) {
            Ok(_) => find_last(&text, marker.as_bytes()).unwrap_or(text.len()),
            Err(_) => 0,
        };
        let _ = file.seek(SeekFrom::Start(start as u64));
        Self::new(file)
    }

    /// Prints the complete lines written since the last call, up to [`READ_BEFORE_CHECK`]
    /// bytes; true when it reached the end of the file.
    fn print_new_lines(&mut self, id: u32) -> bool {
        let mut read_total = 0;
        while read_total < READ_BEFORE_CHECK {
            let room = (MAX_LINE - self.partial.len()) as u64;
            match (&mut self.reader)
                .take(room)
                .read_until(b'\n', &mut self.partial)
            {
                Ok(0) | Err(_) => return true,
                Ok(read) => read_total += read as u64,
            }
            if self.partial.ends_with(b"\n") || self.partial.len() >= MAX_LINE {
                self.print_rest(id);
            }
        }
        false
    }

    /// Prints the line held, if any.
    fn print_rest(&mut self, id: u32) {
        if self.partial.is_empty() {
            return;
        }
        let line = String::from_utf8_lossy(&self.partial);
        eprintln!("[node {id}] {}", line.trim_end_matches(['\n', '\r']));
        self.partial.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn exits_are_described_by_signal_or_status() {
        let killed = ExitStatus::from_raw(9);
        assert_eq!(
            describe_exit(killed),
            "exited: killed by signal 9 (SIGKILL)"
        );
        let failed = ExitStatus::from_raw(1 << 8);
        assert_eq!(describe_exit(failed), "exited with status 1");
        let clean = ExitStatus::from_raw(0);
        assert_eq!(describe_exit(clean), "stopped cleanly (exit status 0)");
        let dumped = ExitStatus::from_raw(11 | 0x80);
        assert_eq!(
            describe_exit(dumped),
            "exited: killed by signal 11 (SIGSEGV, core dumped)"
        );
    }

    #[test]
    fn a_run_is_followed_from_its_start_line_after_the_earlier_runs() {
        let path = std::env::temp_dir().join(format!("rdkv-log-run-{}", std::process::id()));
        std::fs::write(
            &path,
            "rdkv-server (pid 41) started: x\nold run\nrdkv-server (pid 42) started: x\nnew run\n",
        )
        .expect("write the log");
        let mut reader = LogReader::from_run_of(File::open(&path).expect("open"), 42);
        let mut rest = String::new();
        reader.reader.read_to_string(&mut rest).expect("read");
        assert_eq!(rest, "rdkv-server (pid 42) started: x\nnew run\n");
        let mut reader = LogReader::from_run_of(File::open(&path).expect("open"), 43);
        let mut rest = String::new();
        reader.reader.read_to_string(&mut rest).expect("read");
        assert_eq!(
            rest, "",
            "a run whose start line is not written yet: from the end"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn the_log_reader_holds_a_partial_line_and_splits_a_long_one() {
        let path = std::env::temp_dir().join(format!("rdkv-log-reader-{}", std::process::id()));
        let mut writer = File::create(&path).expect("create the log");
        let mut reader = LogReader::new(File::open(&path).expect("open the log"));
        writer.write_all(b"first\nsecond wi").expect("write");
        assert!(reader.print_new_lines(1));
        assert_eq!(reader.partial, b"second wi", "the partial line is held");
        writer.write_all(b"thout its end yet\n").expect("write");
        assert!(reader.print_new_lines(1));
        assert!(reader.partial.is_empty(), "the finished line was printed");
        writer
            .write_all(&vec![b'x'; MAX_LINE + 10])
            .expect("write a long line");
        assert!(reader.print_new_lines(1));
        assert_eq!(reader.partial.len(), 10, "cut at {MAX_LINE} bytes");
        reader.print_rest(1);
        assert!(reader.partial.is_empty());
        let _ = std::fs::remove_file(&path);
    }
}
