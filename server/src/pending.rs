//! Connections that have not authenticated yet, and the limits on them.
//!
//! Anyone who can reach the control port can open connections, so unauthenticated ones get a
//! smaller budget than `max_connections` and can never take an authenticated client's slot:
//!
//! - at most `max_unauthenticated_connections` at once (default 256); a new one evicts the
//!   oldest;
//! - at most `max_pending_per_address` from one source address (default 64); a new one evicts
//!   that address's oldest;
//! - each has `handshake_deadline` in all to authenticate (default 10 s; see `session`).
//!
//! The three are `[cluster]` settings of the cluster file (`ConnectionLimits`).
//!
//! Eviction, not refusal: a legitimate client authenticates within a round trip or two of its
//! connect, so it is the newest pending connection while it does, and a flood of idle
//! connections pushes out only older idle ones. An evicted connection is closed and counted.

use rdkv_cluster_config::config::ConnectionLimits;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use tokio_util::sync::CancellationToken;

/// One pending connection.
#[derive(Debug)]
struct Pending {
    /// Where it comes from.
    source: IpAddr,
    /// Cancels its handshake.
    evict: CancellationToken,
}

/// The unauthenticated connections of a node, oldest first (connection ids grow).
#[derive(Debug)]
pub struct PendingHandshakes {
    limits: ConnectionLimits,
    pending: Mutex<BTreeMap<u64, Pending>>,
    /// Connections evicted since start.
    pub evicted: AtomicU64,
}

impl PendingHandshakes {
    /// No connection pending yet, under `limits`.
    pub fn new(limits: ConnectionLimits) -> Self {
        Self {
            limits,
            pending: Mutex::new(BTreeMap::new()),
            evicted: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Pending>> {
        self.pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Admits connection `id` from `source`, whose handshake `evict` cancels; evicts the
    /// oldest pending connection of that source, or of all, when over a limit.
    pub fn admit(&self, id: u64, source: IpAddr, evict: CancellationToken) {
        let mut pending = self.lock();
        pending.insert(id, Pending { source, evict });
        let from_source: Vec<u64> = pending
            .iter()
            .filter(|(_, entry)| entry.source == source)
            .map(|(id, _)| *id)
            .collect();
        let mut victims = Vec::new();
        if from_source.len() > self.limits.max_pending_per_address {
            victims.push(from_source[0]);
        } else if pending.len() > self.limits.max_unauthenticated {
            victims.extend(pending.keys().next().copied());
        }
        for victim in victims {
            if let Some(entry) = pending.remove(&victim) {
                entry.evict.cancel();
                self.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Connection `id` authenticated or ended: it is no longer pending.
    pub fn settle(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Unauthenticated connections now.
    pub fn count(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_is_evicted_overall_and_per_address() {
        let limits = ConnectionLimits::default();
        let pending = PendingHandshakes::new(limits);
        let tokens: Vec<CancellationToken> = (0..limits.max_unauthenticated as u64 + 1)
            .map(|id| {
                let token = CancellationToken::new();
                // Spread over many addresses: only the global limit applies.
                let source = IpAddr::from([10, 0, (id / 16) as u8, (id % 16) as u8]);
                pending.admit(id, source, token.clone());
                token
            })
            .collect();
        assert!(tokens[0].is_cancelled(), "the oldest went");
        assert!(tokens[1..].iter().all(|token| !token.is_cancelled()));
        assert_eq!(pending.count(), limits.max_unauthenticated);

        let one_source = PendingHandshakes::new(limits);
        let source = IpAddr::from([127, 0, 0, 1]);
        let tokens: Vec<CancellationToken> = (0..limits.max_pending_per_address as u64 + 1)
            .map(|id| {
                let token = CancellationToken::new();
                one_source.admit(id, source, token.clone());
                token
            })
            .collect();
        assert!(tokens[0].is_cancelled());
        assert_eq!(one_source.count(), limits.max_pending_per_address);
        assert_eq!(one_source.evicted.load(Ordering::Relaxed), 1);
        // An authenticated connection leaves the budget.
        one_source.settle(1);
        assert_eq!(one_source.count(), limits.max_pending_per_address - 1);
    }
}
