//! What every rdkv binary does the same way: structured logging to stderr, and waiting for
//! SIGINT or SIGTERM.

/// The log writer's guard: dropping it flushes what is queued (for at most a second).
static LOG_WRITER: std::sync::Mutex<Option<tracing_appender::non_blocking::WorkerGuard>> =
    std::sync::Mutex::new(None);

/// Flushes the queued log lines (for at most a second) and stops the writer.
fn flush_log() {
    let guard = LOG_WRITER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take();
    drop(guard);
}

/// Keeps the log writer running; dropping it flushes what is queued (for at most a second).
#[must_use = "logging stops when the guard is dropped"]
pub struct LogGuard(());

impl Drop for LogGuard {
    fn drop(&mut self) {
        flush_log();
    }
}

/// Exits the process now with `code`, after flushing the log (at most a second); destructors
/// of other threads do not run.
pub fn exit_now(code: i32) -> ! {
    flush_log();
    std::process::exit(code)
}

/// Logs to stderr with `tracing`, at `RUST_LOG` or else `default_level`; colours only on a
/// terminal, so piped and forwarded logs stay plain text.
///
/// Lines go through a bounded queue to a writer thread, and are dropped (not waited for) when
/// the queue is full: a reader that stops reading a node's stderr (a launcher suspended with
/// Ctrl-Z, a full pipe) can delay its log but never stall the node, and so never its shutdown.
pub fn init_logging(default_level: &str) -> LogGuard {
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr());
    init_logging_to(default_level, std::io::stderr(), colours)
}

/// Logs as [`init_logging`] does, into `writer` (a node's log file), with or without colours.
pub fn init_logging_to(
    default_level: &str,
    writer: impl std::io::Write + Send + 'static,
    colours: bool,
) -> LogGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .finish(writer);
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(colours)
        .try_init();
    *LOG_WRITER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(guard);
    LogGuard(())
}

/// Ends a binary: `Ok` is exit code 0; an error prints as one line with its causes
/// (`program: error: what: why`), never a backtrace whatever `RUST_BACKTRACE` says, and is exit
/// code 1.
pub fn exit_with(outcome: anyhow::Result<()>, program: &str) -> std::process::ExitCode {
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // The queued log lines first: the error must be the last line (a launcher reports
            // a node's last line as why it did not start).
            flush_log();
            eprintln!("{program}: error: {error:#}");
            std::process::ExitCode::from(1)
        }
    }
}

/// Writes to stdout; when the reader is gone (`rdkv get k | head -c 1`, a closed pipe), ends
/// the program quietly with exit code 0 instead of panicking: what was asked for was read.
pub fn write_stdout(arguments: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let stdout = std::io::stdout();
    let mut handle = stdout.lock();
    let written = handle.write_fmt(arguments).and_then(|()| handle.flush());
    if let Err(error) = written {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            drop(handle);
            exit_now(0);
        }
        eprintln!("error: write to stdout: {error}");
        exit_now(1);
    }
}

/// `print!` through [`write_stdout`]: no panic on a closed pipe.
#[macro_export]
macro_rules! out {
    ($($argument:tt)*) => {
        $crate::process::write_stdout(format_args!($($argument)*))
    };
}

/// `println!` through [`write_stdout`]: no panic on a closed pipe.
#[macro_export]
macro_rules! outln {
    ($($argument:tt)*) => {
        $crate::process::write_stdout(format_args!("{}\n", format_args!($($argument)*)))
    };
}

/// Resolves on the first SIGINT, SIGTERM or SIGHUP (the terminal or ssh session closed: a
/// foreground launcher must not leave its nodes behind).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(mut terminate), Ok(mut interrupt), Ok(mut hangup)) => {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
                _ = hangup.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("signal received: shutting down");
}

/// Linux reports process times in `/proc` in USER_HZ ticks, 100 per second on every
/// architecture's user-space ABI.
const USER_HZ: u64 = 100;

/// CPU time (user + system, all threads) a process has used so far, from `/proc/PID/stat`
/// (`None` for this process); `None` when it cannot be read (the process is gone). 10 ms
/// resolution: measure over seconds.
pub fn cpu_time(pid: Option<u32>) -> Option<std::time::Duration> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let after_name = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 and 15 of the whole line (utime, stime) are 12 and 13 after the name.
    let user: u64 = fields.get(11)?.parse().ok()?;
    let system: u64 = fields.get(12)?.parse().ok()?;
    Some(std::time::Duration::from_millis(
        (user + system) * 1000 / USER_HZ,
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_time_grows_with_work() {
        use std::time::{Duration, Instant};
        let before = super::cpu_time(None).expect("this process's CPU time");
        // Spins until the count has grown by 100 ms, not for a fixed wall time: with both cores
        // busy (load average 8) a thread gets a fraction of a core, so 200 ms of wall time can
        // be under 100 ms of CPU time. The bound only ends a hang, a count that never grows.
        let started = Instant::now();
        let mut spin = 0u64;
        let mut after = before;
        while after - before < Duration::from_millis(100) {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "{before:?} → {after:?} after {:?} of spinning",
                started.elapsed()
            );
            for _ in 0..100_000 {
                spin = std::hint::black_box(spin.wrapping_add(1));
            }
            after = super::cpu_time(None).expect("this process's CPU time");
        }
        assert_eq!(super::cpu_time(Some(u32::MAX)), None, "no such process");
    }
}
