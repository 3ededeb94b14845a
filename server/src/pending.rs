//! Connections that have not authenticated yet, and the limits on them.
//!
//! Anyone who can reach the control port can open connections, so unauthenticated ones get
//! their own, smaller budget, apart from the `max_connections` slots of authenticated ones, and
//! can never take an authenticated client's slot:
//!
//! - at most `max_unauthenticated_connections` at once (default 256); a new one evicts the
//!   oldest;
//! - at most `max_pending_per_address` from one source address (default 64); a new one evicts
//!   that address's oldest;
//! - each has `handshake_deadline` in all to authenticate (default 10 s; see `session`).
//!
//! The three are `[cluster]` settings of the cluster file (`ConnectionLimits`).
//!
//! A connection that proves the secret takes one of the `max_connections` authenticated slots
//! in the same step as it leaves the pending set (`PendingHandshakes::authenticate`), and holds
//! it until its session ends; with every slot taken it is refused, with a reason that names
//! the setting. Monitoring connections (`rdkv-cluster status`, `rdkv stats`) may also use
//! `MONITOR_RESERVE` slots past `max_connections`, so a node full of clients still answers its
//! operator; peer nodes (their Raft messages, and a restarted peer's refill) may use
//! `PEER_RESERVE` more, which neither clients nor monitors can take, so a node full of either
//! keeps its consensus and lets a restarted peer fill. The node accepts up to
//! `max_connections + MONITOR_RESERVE + PEER_RESERVE + max_unauthenticated_connections + 1`
//! connections at once, so a new connection is always accepted and can evict a silent one: a
//! single shared budget let silent connections hold the last slots of a node whose
//! authenticated connections filled the rest, and eviction, which runs only for an accepted
//! connection, never ran.
//!
//! Eviction, not refusal: a legitimate client authenticates within a round trip or two of its
//! connect, so it is the newest pending connection while it does, and a flood of idle
//! connections pushes out only older idle ones. Eviction also spares a connection that has
//! spoken (its first frame was read, or bytes wait in its socket): the oldest silent one goes
//! first, so a client whose Authenticate the node has not got round to reading under load is
//! never the victim of a flood that says nothing. Only when every candidate has spoken does
//! the oldest go. An evicted connection is closed and counted.

use std::collections::BTreeMap;
use std::net::{IpAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkv_cluster_file::config::ConnectionLimits;
use rdkv_fabric::lock;
use tokio_util::sync::CancellationToken;

/// How long an accept loop (the control port's, the metrics port's) waits after a failed
/// accept (out of file descriptors): retrying at once would spin.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often, at most, a failed accept is logged.
pub(crate) const ACCEPT_WARNING_EVERY: Duration = Duration::from_secs(1);

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

/// The unauthenticated connections of a node, oldest first (connection ids grow), and the
/// count of its authenticated ones.
#[derive(Debug)]
pub struct PendingHandshakes {
    limits: ConnectionLimits,
    /// Authenticated connections at once.
    max_connections: usize,
    pending: Mutex<BTreeMap<u64, Pending>>,
    /// Authenticated connections now, by class (each `AuthenticatedSlot` counts one).
    open: Arc<OpenByClass>,
    /// Connections evicted since start.
    pub evicted: AtomicU64,
    /// Connections refused since start because every authenticated slot was taken.
    pub refused_full: AtomicU64,
}

/// Authenticated slots past `max_connections` that monitoring connections (and peers) may use.
pub const MONITOR_RESERVE: usize = 32;

/// Authenticated slots past the monitors' reserve that only peer nodes may use: a Raft
/// connection and a refill connection from each of up to 32 peers.
pub const PEER_RESERVE: usize = 64;

/// Who a connection that proved the secret is, for the slots it may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotClass {
    /// A client's data connection or lane: `max_connections`.
    Client,
    /// A monitoring connection: also the monitors' reserve.
    Monitor,
    /// A peer node's consensus or refill connection: also the peers' reserve.
    Peer,
}

/// Authenticated connections now, by `SlotClass` (indexed by `SlotClass::index`).
type OpenByClass = [AtomicUsize; 3];

/// One authenticated slot, held by its session until it ends.
#[derive(Debug)]
pub struct AuthenticatedSlot {
    open: Arc<OpenByClass>,
    class: SlotClass,
}

impl AuthenticatedSlot {
    /// Authenticated connections of this slot's class now, this one included.
    pub fn open_of_its_class(&self) -> usize {
        self.open[self.class.index()].load(Ordering::Acquire)
    }
}

impl Drop for AuthenticatedSlot {
    fn drop(&mut self) {
        self.open[self.class.index()].fetch_sub(1, Ordering::AcqRel);
    }
}

impl SlotClass {
    fn index(self) -> usize {
        match self {
            SlotClass::Client => 0,
            SlotClass::Monitor => 1,
            SlotClass::Peer => 2,
        }
    }
}

/// Why a connection that proved the secret did not get a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A newer connection evicted it first.
    Evicted,
    /// Every one of `max_connections` authenticated slots is taken.
    Full {
        /// `max_connections` (with the reserves the connection's class may use).
        max_connections: usize,
    },
}

impl PendingHandshakes {
    /// No connection pending yet, under `limits`, with `max_connections` authenticated slots.
    pub fn new(limits: ConnectionLimits, max_connections: usize) -> Self {
        Self {
            limits,
            max_connections,
            pending: Mutex::new(BTreeMap::new()),
            open: Arc::new(Default::default()),
            evicted: AtomicU64::new(0),
            refused_full: AtomicU64::new(0),
        }
    }

    /// Connections the accept loop may hold at once: every authenticated slot (both reserves
    /// included), the unauthenticated budget, and one more, so that with all full a new
    /// connection is still accepted, and evicts the oldest silent one.
    pub fn accept_limit(&self) -> usize {
        self.authenticated_limit(SlotClass::Peer) + self.limits.max_unauthenticated + 1
    }

    /// The authenticated connections at which `class` is refused: clients count only
    /// clients (a monitor never takes a client's slot, not even while the node has yet to
    /// handle its close), monitors count clients and monitors, peers count every one.
    pub fn authenticated_limit(&self, class: SlotClass) -> usize {
        match class {
            SlotClass::Client => self.max_connections,
            SlotClass::Monitor => self.max_connections + MONITOR_RESERVE,
            SlotClass::Peer => self.max_connections + MONITOR_RESERVE + PEER_RESERVE,
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Pending>> {
        lock(&self.pending)
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

    /// Connection `id` authenticated: it leaves the unauthenticated budget and takes an
    /// authenticated slot, in one step, and no later connection can evict it.
    ///
    /// `Refusal::Evicted` when it was evicted first: eviction and authentication race (the
    /// evictor may have looked just before its Authenticate arrived), and the session must
    /// then end before it sends anything more, so the client sees a close during
    /// authentication, which it retries, never a close after its welcome.
    /// `Refusal::Full` when every authenticated slot `class` may take is taken.
    pub fn authenticate(&self, id: u64, class: SlotClass) -> Result<AuthenticatedSlot, Refusal> {
        let mut pending = self.lock();
        if pending.remove(&id).is_none() {
            return Err(Refusal::Evicted);
        }
        // Under the lock, so two authentications cannot both take the last slot; a slot
        // dropped meanwhile only makes room.
        let limit = self.authenticated_limit(class);
        if self.counted_against(class) >= limit {
            self.refused_full.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::Full {
                max_connections: limit,
            });
        }
        self.open[class.index()].fetch_add(1, Ordering::AcqRel);
        Ok(AuthenticatedSlot {
            open: self.open.clone(),
            class,
        })
    }

    /// The authenticated connections that count against `class`'s limit.
    fn counted_against(&self, class: SlotClass) -> usize {
        let open = |class: SlotClass| self.open[class.index()].load(Ordering::Acquire);
        match class {
            SlotClass::Client => open(SlotClass::Client),
            SlotClass::Monitor => open(SlotClass::Client) + open(SlotClass::Monitor),
            SlotClass::Peer => self.authenticated_count(),
        }
    }

    /// Unauthenticated connections now.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// Authenticated connections now, of every class.
    pub fn authenticated_count(&self) -> usize {
        self.open
            .iter()
            .map(|open| open.load(Ordering::Acquire))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_is_evicted_overall_and_per_address() {
        let limits = ConnectionLimits::default();
        let pending = PendingHandshakes::new(limits, 1024);
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

        let one_source = PendingHandshakes::new(limits, 1024);
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
        let slot = one_source
            .authenticate(1, SlotClass::Client)
            .expect("a slot");
        assert_eq!(one_source.count(), limits.max_pending_per_address - 1);
        assert_eq!(one_source.authenticated_count(), 1);
        // One evicted before its authentication was checked is told so.
        assert_eq!(
            one_source.authenticate(0, SlotClass::Client).map(drop),
            Err(Refusal::Evicted),
            "connection 0 was evicted"
        );
        drop(slot);
        assert_eq!(one_source.authenticated_count(), 0);
    }

    #[test]
    fn an_authenticated_connection_is_never_evicted() {
        let limits = ConnectionLimits::default();
        let pending = PendingHandshakes::new(limits, 1024);
        let source = IpAddr::from([127, 0, 0, 1]);
        let first = CancellationToken::new();
        pending.admit(0, source, first.clone(), None);
        let _slot = pending.authenticate(0, SlotClass::Client).expect("a slot");
        for id in 1..=limits.max_pending_per_address as u64 * 2 {
            pending.admit(id, source, CancellationToken::new(), None);
        }
        assert!(!first.is_cancelled(), "an authenticated connection stays");
        assert_eq!(pending.count(), limits.max_pending_per_address);
    }

    #[test]
    fn a_connection_that_has_spoken_is_spared() {
        let limits = ConnectionLimits::default();
        let pending = PendingHandshakes::new(limits, 1024);
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
        let pending = PendingHandshakes::new(limits, 1024);
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

    #[test]
    fn a_monitor_never_takes_a_clients_slot() {
        let pending = PendingHandshakes::new(ConnectionLimits::default(), 2);
        let source = IpAddr::from([127, 0, 0, 1]);
        let mut admitted = 0..;
        let mut authenticate = |class| {
            let id = admitted.next().expect("ids");
            pending.admit(id, source, CancellationToken::new(), None);
            pending.authenticate(id, class)
        };
        // Monitors first (a status poll whose close the node has not handled yet), then the
        // clients: every client slot is still there.
        let monitors: Vec<_> = (0..3)
            .map(|_| authenticate(SlotClass::Monitor).expect("a monitor"))
            .collect();
        let clients: Vec<_> = (0..2)
            .map(|_| authenticate(SlotClass::Client).expect("a client's slot"))
            .collect();
        assert_eq!(
            authenticate(SlotClass::Client).map(drop),
            Err(Refusal::Full { max_connections: 2 })
        );
        assert_eq!(clients[1].open_of_its_class(), 2);
        assert_eq!(monitors[0].open_of_its_class(), 3);
        assert_eq!(pending.authenticated_count(), 5);
    }

    #[test]
    fn authenticated_slots_are_counted_apart_from_the_pending_budget() {
        let limits = ConnectionLimits {
            max_unauthenticated: 2,
            max_pending_per_address: 2,
            ..ConnectionLimits::default()
        };
        let pending = PendingHandshakes::new(limits, 2);
        assert_eq!(
            pending.accept_limit(),
            2 + MONITOR_RESERVE + PEER_RESERVE + 2 + 1
        );
        let source = IpAddr::from([127, 0, 0, 1]);
        for id in 0..3 {
            pending.admit(id, source, CancellationToken::new(), None);
        }
        // Two slots: the pending budget (now full) does not take them.
        let first = pending.authenticate(1, SlotClass::Client).expect("a slot");
        let second = pending.authenticate(2, SlotClass::Client).expect("a slot");
        for id in 3..5 {
            pending.admit(id, source, CancellationToken::new(), None);
        }
        assert_eq!(
            pending.count(),
            2,
            "the budget is still there for newcomers"
        );
        assert_eq!(
            pending.authenticate(3, SlotClass::Client).map(drop),
            Err(Refusal::Full { max_connections: 2 })
        );
        assert_eq!(pending.refused_full.load(Ordering::Relaxed), 1);
        // A monitor (a status poll) still gets in, from its reserve, until that is full; a
        // peer then still gets in, from its own.
        let mut monitors = Vec::new();
        for id in 5..5 + MONITOR_RESERVE as u64 {
            pending.admit(id, source, CancellationToken::new(), None);
            monitors.push(
                pending
                    .authenticate(id, SlotClass::Monitor)
                    .expect("the reserve"),
            );
        }
        pending.admit(100, source, CancellationToken::new(), None);
        assert_eq!(
            pending.authenticate(100, SlotClass::Monitor).map(drop),
            Err(Refusal::Full {
                max_connections: 2 + MONITOR_RESERVE
            })
        );
        pending.admit(101, source, CancellationToken::new(), None);
        let peer = pending
            .authenticate(101, SlotClass::Peer)
            .expect("the peers' reserve");
        assert_eq!(pending.authenticated_count(), 2 + MONITOR_RESERVE + 1);
        drop(peer);
        drop(monitors);
        drop(first);
        let _third = pending
            .authenticate(4, SlotClass::Client)
            .expect("a slot freed");
        assert_eq!(pending.authenticated_count(), 2);
        drop(second);
    }
}
