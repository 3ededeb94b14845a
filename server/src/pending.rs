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
//! connections pushes out only older idle ones. Eviction also spares a connection that has
//! spoken (its first frame was read, or bytes wait in its socket): the oldest silent one goes
//! first, so a client whose Authenticate the node has not got round to reading under load is
//! never the victim of a flood that says nothing. Only when every candidate has spoken does
//! the oldest go. An evicted connection is closed and counted.

use rdkv_cluster_config::config::ConnectionLimits;
use std::collections::BTreeMap;
use std::net::{IpAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio_util::sync::CancellationToken;

/// One pending connection.
#[derive(Debug)]
struct Pending {
    /// Where it comes from.
    source: IpAddr,
    /// Cancels its handshake.
    evict: CancellationToken,
    /// Set by its reader once a first frame arrived.
    spoke: Arc<AtomicBool>,
    /// A duplicate of its socket (non-blocking, shared with the session), to see whether
    /// bytes wait unread.
    socket: Option<TcpStream>,
}

impl Pending {
    /// Whether it has said anything: a frame was read, or bytes wait in its socket.
    fn has_spoken(&self) -> bool {
        self.spoke.load(Ordering::Acquire)
            || self
                .socket
                .as_ref()
                .is_some_and(|socket| matches!(socket.peek(&mut [0u8; 1]), Ok(read) if read > 0))
    }
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

    /// Admits connection `id` from `source`, whose handshake `evict` cancels and whose socket
    /// `socket` duplicates; evicts a pending connection of that source, or of all, when over
    /// a limit: the oldest that has not spoken, else the oldest. Returns the flag its reader
    /// sets once a first frame arrives.
    pub fn admit(
        &self,
        id: u64,
        source: IpAddr,
        evict: CancellationToken,
        socket: Option<TcpStream>,
    ) -> Arc<AtomicBool> {
        let spoke = Arc::new(AtomicBool::new(false));
        let mut pending = self.lock();
        pending.insert(
            id,
            Pending {
                source,
                evict,
                spoke: spoke.clone(),
                socket,
            },
        );
        let from_source: Vec<u64> = pending
            .iter()
            .filter(|(_, entry)| entry.source == source)
            .map(|(id, _)| *id)
            .collect();
        let candidates: Vec<u64> = if from_source.len() > self.limits.max_pending_per_address {
            from_source
        } else if pending.len() > self.limits.max_unauthenticated {
            pending.keys().copied().collect()
        } else {
            Vec::new()
        };
        let victim = candidates
            .iter()
            .copied()
            .find(|candidate| {
                pending
                    .get(candidate)
                    .is_some_and(|entry| !entry.has_spoken())
            })
            .or_else(|| candidates.first().copied());
        if let Some(entry) = victim.and_then(|victim| pending.remove(&victim)) {
            entry.evict.cancel();
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        spoke
    }

    /// Connection `id` ended: it is no longer pending.
    pub fn settle(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Connection `id` authenticated: it leaves the budget, and no later connection can evict
    /// it. False when it was evicted first: eviction and authentication race (the evictor may
    /// have looked just before its Authenticate arrived), and the session must then end
    /// before it sends anything more, so the client sees a close during authentication, which
    /// it retries, never a close after its welcome.
    #[must_use]
    pub fn authenticated(&self, id: u64) -> bool {
        self.lock().remove(&id).is_some()
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
                pending.admit(id, source, token.clone(), None);
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
                one_source.admit(id, source, token.clone(), None);
                token
            })
            .collect();
        assert!(tokens[0].is_cancelled());
        assert_eq!(one_source.count(), limits.max_pending_per_address);
        assert_eq!(one_source.evicted.load(Ordering::Relaxed), 1);
        // An authenticated connection leaves the budget.
        assert!(one_source.authenticated(1));
        assert_eq!(one_source.count(), limits.max_pending_per_address - 1);
        // One evicted before its authentication was checked is told so.
        assert!(!one_source.authenticated(0), "connection 0 was evicted");
    }

    #[test]
    fn an_authenticated_connection_is_never_evicted() {
        let limits = ConnectionLimits::default();
        let pending = PendingHandshakes::new(limits);
        let source = IpAddr::from([127, 0, 0, 1]);
        let first = CancellationToken::new();
        pending.admit(0, source, first.clone(), None);
        assert!(pending.authenticated(0));
        for id in 1..=limits.max_pending_per_address as u64 * 2 {
            pending.admit(id, source, CancellationToken::new(), None);
        }
        assert!(!first.is_cancelled(), "an authenticated connection stays");
        assert_eq!(pending.count(), limits.max_pending_per_address);
    }

    #[test]
    fn a_connection_that_has_spoken_is_spared() {
        let limits = ConnectionLimits::default();
        let pending = PendingHandshakes::new(limits);
        let source = IpAddr::from([127, 0, 0, 1]);
        let mut flags = Vec::new();
        let tokens: Vec<CancellationToken> = (0..limits.max_pending_per_address as u64)
            .map(|id| {
                let token = CancellationToken::new();
                flags.push(pending.admit(id, source, token.clone(), None));
                token
            })
            .collect();
        // The oldest has spoken (its Authenticate was read, not yet checked).
        flags[0].store(true, Ordering::Release);
        let newest = CancellationToken::new();
        pending.admit(1_000, source, newest.clone(), None);
        assert!(!tokens[0].is_cancelled(), "the one that spoke stays");
        assert!(tokens[1].is_cancelled(), "the oldest silent one went");
        assert!(!newest.is_cancelled());
    }

    #[test]
    fn bytes_waiting_in_the_socket_count_as_speaking() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let limits = ConnectionLimits {
            max_pending_per_address: 2,
            ..ConnectionLimits::default()
        };
        let pending = PendingHandshakes::new(limits);
        let mut clients = Vec::new();
        let mut tokens = Vec::new();
        for id in 0..3u64 {
            let mut client = std::net::TcpStream::connect(address).expect("connect");
            let (accepted, peer) = listener.accept().expect("accept");
            accepted.set_nonblocking(true).expect("non-blocking");
            if id == 0 {
                // The oldest sent its first frame; nobody has read it yet.
                client.write_all(b"hello").expect("write");
                let mut byte = [0u8; 1];
                while !matches!(accepted.peek(&mut byte), Ok(1)) {
                    std::thread::yield_now();
                }
            }
            let token = CancellationToken::new();
            pending.admit(id, peer.ip(), token.clone(), Some(accepted));
            tokens.push(token);
            clients.push(client);
        }
        assert!(!tokens[0].is_cancelled(), "bytes waiting: spared");
        assert!(tokens[1].is_cancelled(), "the oldest silent one went");
        assert!(!tokens[2].is_cancelled());
    }
}
