//! What every rdkv binary does the same way: structured logging to stderr, and waiting for
//! SIGINT or SIGTERM.

/// Logs to stderr with `tracing`, at `RUST_LOG` or else `default_level`; colours only on a
/// terminal, so piped and forwarded logs stay plain text.
pub fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Ends a binary: `Ok` is exit code 0; an error prints as one line with its causes
/// (`program: error: what: why`), never a backtrace whatever `RUST_BACKTRACE` says, and is exit
/// code 1.
pub fn exit_with(outcome: anyhow::Result<()>, program: &str) -> std::process::ExitCode {
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{program}: error: {error:#}");
            std::process::ExitCode::from(1)
        }
    }
}

/// Resolves on the first SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut terminate), Ok(mut interrupt)) => {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("signal received: shutting down");
}

/// `count` distinct loopback ports that were free a moment ago: all are bound at once and then
/// released, so none is handed out twice. (Another process may still take one before it is
/// used; callers bind them promptly.)
///
/// # Errors
/// The OS refuses to bind a loopback port.
pub fn free_loopback_ports(count: usize) -> std::io::Result<Vec<u16>> {
    let listeners = (0..count)
        .map(|_| std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|listener| listener.local_addr().map(|address| address.port()))
        .collect()
}
