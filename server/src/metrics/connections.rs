//! The metrics endpoint's open connections, oldest first, and the limit on them.
//!
//! Anyone who reaches the metrics address can connect, so the limit is applied after
//! `accept`, never before it: a connection past `MetricsLimits::max_connections` is still
//! accepted, and the oldest open one is closed to make room. Connections that say nothing, or
//! trickle a request head, can then never hold the endpoint: a scraper is the newest
//! connection while it asks, and a flood pushes out only older connections. Each eviction is
//! counted, and the connections open now are a gauge.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus::{IntCounter, IntGauge};
use rdkv_fabric::lock;
use tokio_util::sync::CancellationToken;

/// What the endpoint reports about itself, registered with the node's other metrics.
#[derive(Debug, Clone)]
pub(crate) struct EndpointCounters {
    /// Connections open now (`rdkv_metrics_connections`).
    pub(crate) connections: IntGauge,
    /// Connections closed to make room for newer ones
    /// (`rdkv_metrics_connections_evicted_total`).
    pub(crate) evicted: IntCounter,
    /// Connections closed because no whole request head arrived within the header-read
    /// timeout: a slow head, or an idle (keep-alive) connection
    /// (`rdkv_metrics_connections_timed_out_total`).
    pub(crate) timed_out: IntCounter,
}

/// The open connections, by accept order, under one lock.
#[derive(Debug, Default)]
struct Registry {
    /// The id the next admitted connection gets: ids grow, so the first entry is the oldest.
    next_id: u64,
    /// Each open connection's close token, by id.
    open: BTreeMap<u64, CancellationToken>,
}

/// The endpoint's open connections, at most `max_connections` of them.
#[derive(Debug)]
pub(crate) struct OpenConnections {
    /// Connections open at once; admitting one more closes the oldest.
    max_connections: usize,
    /// The open connections; held only for a map operation, never across an `.await`.
    registry: Mutex<Registry>,
    /// Where the count and the evictions are reported.
    counters: EndpointCounters,
}

/// One admitted connection's place among the open ones; dropping it (its connection ended)
/// gives the place back.
#[derive(Debug)]
pub(crate) struct Admission {
    /// The set it belongs to.
    connections: Arc<OpenConnections>,
    /// Its id there.
    id: u64,
    /// Cancelled when a newer connection evicts it (or the endpoint stops): its task then
    /// drops the connection, which closes the socket.
    pub(crate) close: CancellationToken,
}

impl OpenConnections {
    /// No connection open yet; at most `max_connections` (at least one) at once.
    pub(crate) fn new(max_connections: usize, counters: EndpointCounters) -> Arc<Self> {
        counters.connections.set(0);
        Arc::new(Self {
            max_connections: max_connections.max(1),
            registry: Mutex::new(Registry::default()),
            counters,
        })
    }

    /// Admits a connection just accepted, which `close` closes; when that makes one too many,
    /// closes the oldest open one (cancels its token) and counts it.
    pub(crate) fn admit(self: &Arc<Self>, close: CancellationToken) -> Admission {
        let mut registry = lock(&self.registry);
        let id = registry.next_id;
        registry.next_id += 1;
        registry.open.insert(id, close.clone());
        while registry.open.len() > self.max_connections {
            if let Some((_, oldest)) = registry.open.pop_first() {
                oldest.cancel();
                self.counters.evicted.inc();
            }
        }
        self.counters
            .connections
            .set(gauge_value(registry.open.len()));
        Admission {
            connections: self.clone(),
            id,
            close,
        }
    }

    /// Connections open now (evicted ones no longer count, even while their tasks close
    /// them).
    #[cfg(test)]
    fn count(&self) -> usize {
        lock(&self.registry).open.len()
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut registry = lock(&self.connections.registry);
        registry.open.remove(&self.id);
        self.connections
            .counters
            .connections
            .set(gauge_value(registry.open.len()));
    }
}

/// `count` as a gauge's value.
fn gauge_value(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters() -> EndpointCounters {
        EndpointCounters {
            connections: IntGauge::new("connections", "open").expect("a gauge"),
            evicted: IntCounter::new("evicted_total", "evicted").expect("a counter"),
            timed_out: IntCounter::new("timed_out_total", "timed out").expect("a counter"),
        }
    }

    #[test]
    fn the_newest_is_admitted_and_the_oldest_closed() {
        let counters = counters();
        let connections = OpenConnections::new(3, counters.clone());
        let admissions: Vec<Admission> = (0..5)
            .map(|_| connections.admit(CancellationToken::new()))
            .collect();
        let closed: Vec<bool> = admissions
            .iter()
            .map(|admission| admission.close.is_cancelled())
            .collect();
        assert_eq!(closed, [true, true, false, false, false]);
        assert_eq!(connections.count(), 3);
        assert_eq!(counters.connections.get(), 3);
        assert_eq!(counters.evicted.get(), 2);

        // An evicted connection's end frees nothing more; an open one's frees its place.
        let mut admissions = admissions.into_iter();
        drop(admissions.next());
        assert_eq!(connections.count(), 3);
        drop(admissions.next_back());
        assert_eq!(connections.count(), 2);
        assert_eq!(counters.connections.get(), 2);
        let newest = connections.admit(CancellationToken::new());
        assert!(!newest.close.is_cancelled());
        assert_eq!(counters.evicted.get(), 2, "room was free: nobody evicted");
        drop(newest);
        drop(admissions);
        assert_eq!(connections.count(), 0);
        assert_eq!(counters.connections.get(), 0);
    }
}
