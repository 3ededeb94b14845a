//! The clients' connections in one INFO line a minute: each connection's own lines
//! (`client authenticated`, `connection closed`) are DEBUG, since a client that connects
//! often (a CLI in a shell loop: two lines per node per command) would otherwise fill the log.
//! The line comes only for a minute in which a connection opened or closed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::node::Node;

/// How often the summary line may come.
pub(crate) const SUMMARY_PERIOD: Duration = Duration::from_secs(60);

/// Clients' connections (data connections and their lanes; not monitors or peer nodes)
/// opened and closed since the last summary.
#[derive(Debug, Default)]
pub(crate) struct ConnectionSummary {
    /// Authenticated since the last summary.
    opened: AtomicU64,
    /// Ended, after authenticating, since the last summary.
    closed: AtomicU64,
}

impl ConnectionSummary {
    /// A client's connection authenticated.
    pub(crate) fn opened(&self) {
        self.opened.fetch_add(1, Ordering::Relaxed);
    }

    /// A client's authenticated connection ended.
    pub(crate) fn closed(&self) {
        self.closed.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts since the last call, `(opened, closed)`, and zero again; `None` when both
    /// are zero (no line to write).
    pub(crate) fn take(&self) -> Option<(u64, u64)> {
        let opened = self.opened.swap(0, Ordering::Relaxed);
        let closed = self.closed.swap(0, Ordering::Relaxed);
        (opened + closed > 0).then_some((opened, closed))
    }
}

/// Writes the summary line every [`SUMMARY_PERIOD`] in which a connection opened or closed,
/// until shutdown.
pub(crate) async fn summary_loop(node: Arc<Node>, shutdown: CancellationToken) {
    let mut ticks = tokio::time::interval(SUMMARY_PERIOD);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate: nothing to say yet.
    ticks.tick().await;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        if let Some((opened, closed)) = node.connection_summary.take() {
            tracing::info!(
                opened,
                closed,
                control_connections_now = node.counters.connections.load(Ordering::Relaxed),
                "client connections in the last minute (each one's lines: RUST_LOG=info,rdkv_server::session=debug)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_counts_since_the_last_and_is_silent_when_nothing_happened() {
        let summary = ConnectionSummary::default();
        assert_eq!(summary.take(), None);
        for _ in 0..3 {
            summary.opened();
        }
        summary.closed();
        assert_eq!(summary.take(), Some((3, 1)));
        assert_eq!(summary.take(), None, "counted from zero again");
        summary.closed();
        assert_eq!(summary.take(), Some((0, 1)));
    }
}
