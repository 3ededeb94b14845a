//! The control plane: messages between a client and a server, their framing, and the HMAC
//! handshake. `docs/protocol.md` describes the conversation.
//!
//! Frames are a little-endian `u32` length followed by that many bytes of bincode. A frame over
//! [`MAX_FRAME_SIZE`], or one that does not decode, is an error that closes only that connection.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::ControlError;
use crate::layout::TableGeometry;
use rdkv_fabric::{QueuePairEndpoint, RemoteKey};

/// The control protocol version.
pub const PROTOCOL_VERSION: u32 = 28;
/// The largest control frame, in bytes.
pub const MAX_FRAME_SIZE: u32 = 64 * 1024;
/// Bytes of an authentication nonce and proof.
pub const PROOF_LENGTH: usize = 32;

/// What a client sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientMessage {
    /// The answer to the server's challenge.
    Authenticate {
        /// The client's protocol version.
        protocol_version: u32,
        /// Data (a queue pair and keys) or monitoring only (stats, no fabric resources).
        purpose: Purpose,
        /// HMAC-SHA256 over the challenge with the cluster secret.
        proof: [u8; PROOF_LENGTH],
        /// A name for logs.
        client_name: String,
        /// The client is on the node's host and asks for its `shm` fabric (which the node
        /// advertised in its challenge); otherwise the node's main fabric.
        shared_memory: bool,
        /// The client routes by the cluster view (a cluster client): a filling node refuses
        /// a data client that does not, which would read its partial table.
        routes_by_view: bool,
    },
    /// The client's queue pair, to connect the server's to it.
    ConnectQueuePair {
        /// The client queue pair's endpoint.
        endpoint: QueuePairEndpoint,
    },
    /// A fresh heap grant for this client, with room for at least `needed` bytes; seals the
    /// client's current grant.
    AllocateChunk {
        /// The client's started-operations count (its announce word's first half) when it
        /// stopped placing blocks in its current chunk: every operation that placed a block
        /// there has a number up to this one, so the chunk's writers are done once the
        /// connection has announced it quiescent through this count (`docs/protocol.md`,
        /// *Heap space*).
        started: u64,
        /// The bytes of the block that found the current grant full (at most one chunk).
        needed: u64,
    },
    /// Renews the lease, and reports the client's counters since its last report (the server
    /// sums them, so `rdkv stats` can show round trips per operation cluster-wide).
    Heartbeat {
        /// Counter increments since the last report.
        counters: ClientCounters,
    },
    /// The server's counters.
    Stats,
    /// Stop the node (`rdkv-cluster down`): it stops accepting, tears every connection down in
    /// order and exits. Any authenticated connection may ask; the secret is the authority.
    Shutdown,
    /// A clean goodbye.
    Goodbye,
    /// The cluster view as this node knows it (`docs/architecture.md`, *Cluster view*).
    FetchView,
    /// A message of the nodes' consensus on the view, from a peer node: opaque to the control
    /// plane, answered with [`ServerMessage::Peer`]. The secret is the authority, as for
    /// `Shutdown`.
    Peer {
        /// The encoded consensus request.
        payload: Vec<u8>,
    },
    /// Stop the whole cluster cleanly (`rdkv-cluster down`): the node asks the view's leader
    /// to commit the stop, at which every serving node fences its clients and keeps its keys
    /// for its final snapshot (`docs/operations.md`, *Persistence*). Answered with
    /// [`ServerMessage::ClusterStopped`].
    StopCluster,
    /// Write a snapshot now (`rdkv-cluster snapshot`); answered with
    /// [`ServerMessage::SnapshotWritten`] once it is on disk.
    Snapshot,
    /// The operator has seen the view's [`CopySetLoss`] records up to `up_to_epoch`
    /// (`rdkv-cluster ack-loss`): the node asks the view's leader to clear them. Answered
    /// with [`ServerMessage::LossesAcknowledged`].
    AcknowledgeLosses {
        /// Records of this epoch and earlier are cleared.
        up_to_epoch: u64,
    },
    /// Add a member to the view or remove one (`rdkv-cluster add-node`, `remove-node`):
    /// the node asks the view's leader to start the change (`docs/protocol.md`, *Membership
    /// changes*). Answered with [`ServerMessage::MembershipChanged`] once it is committed.
    ChangeMembership(MembershipChange),
}

/// A change of the view's members, asked by the operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MembershipChange {
    /// Node `node_id`, running and not a member, joins: a Raft learner first, then a voter, and
    /// a member of the view that fills before it serves.
    Add {
        /// The new member's id.
        node_id: u32,
        /// Its control address, which the members started before it cannot know.
        control_address: String,
    },
    /// Member `node_id` leaves: it keeps serving while its keys get their copies on the
    /// members that stay, then it is out of the view and of Raft. A member that is `down` is
    /// removed at once, and the others copy its keys again from their other copies
    /// (re-replication).
    Remove {
        /// The leaving member.
        node_id: u32,
        /// Remove a member that is `down` even where it holds the only copy of its keys
        /// (`replicas = 1`): they are lost, and the view records the loss.
        lose_keys: bool,
    },
}

impl ClientMessage {
    /// The message's name, for logs (never its fields: `Authenticate` carries a proof).
    pub fn kind(&self) -> &'static str {
        match self {
            ClientMessage::Authenticate { .. } => "Authenticate",
            ClientMessage::ConnectQueuePair { .. } => "ConnectQueuePair",
            ClientMessage::AllocateChunk { .. } => "AllocateChunk",
            ClientMessage::Heartbeat { .. } => "Heartbeat",
            ClientMessage::Stats => "Stats",
            ClientMessage::Shutdown => "Shutdown",
            ClientMessage::Goodbye => "Goodbye",
            ClientMessage::FetchView => "FetchView",
            ClientMessage::Peer { .. } => "Peer",
            ClientMessage::StopCluster => "StopCluster",
            ClientMessage::Snapshot => "Snapshot",
            ClientMessage::AcknowledgeLosses { .. } => "AcknowledgeLosses",
            ClientMessage::ChangeMembership(_) => "ChangeMembership",
        }
    }
}

/// The longest client name a node logs; longer names are cut there.
pub const MAX_CLIENT_NAME_LOGGED: usize = 64;

/// A client's name as a node logs it: at most [`MAX_CLIENT_NAME_LOGGED`] characters, control
/// characters escaped, so that a name cannot forge log lines.
pub fn loggable_client_name(name: &str) -> String {
    name.chars()
        .take(MAX_CLIENT_NAME_LOGGED)
        .flat_map(|character| {
            let escaped: Vec<char> = if character.is_control() {
                character.escape_default().collect()
            } else {
                vec![character]
            };
            escaped
        })
        .collect()
}

/// Why a client connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Purpose {
    /// One-sided operations: the server creates a queue pair and issues keys.
    Data,
    /// Stats only (`rdkv-cluster status`, `rdkv stats`): no queue pair, no keys.
    Monitor,
    /// An extra lane of a client that has its first connection to the node (a lane per
    /// worker): as `Data`, but the node admits it only while at most half of its
    /// `max_connections` (rounded up) are open, so one client's extra lanes never take the slots that other
    /// clients' first connections need (`docs/architecture.md`, *Client lanes*).
    Lane,
    /// A peer node's consensus connection (the cluster view's Raft messages): as `Monitor`,
    /// but from slots of its own that no client or monitor can take, so a node full of
    /// clients or monitors keeps its consensus (`docs/protocol.md`, *Control frames*).
    Peer,
    /// A refilling peer node's data connection: as `Data`, from the peers' own slots, so a
    /// node full of clients cannot hold a restarted peer in `filling`.
    Refill,
}

impl Purpose {
    /// Whether the connection gets a queue pair and keys.
    pub fn is_data(self) -> bool {
        matches!(self, Purpose::Data | Purpose::Lane | Purpose::Refill)
    }
}

/// What a server sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ServerMessage {
    /// The first message: a nonce to prove the secret over.
    Challenge {
        /// The server's protocol version.
        protocol_version: u32,
        /// Random bytes.
        nonce: [u8; PROOF_LENGTH],
        /// The node's id.
        node_id: u32,
        /// The Unix-domain socket of the node's `shm` fabric, when it offers one (a client on
        /// the same host may ask for it).
        shm_socket: Option<std::path::PathBuf>,
    },
    /// Authentication passed: the table and the server's queue pair.
    Welcome(Box<Welcome>),
    /// The server's queue pair is connected (RTS) and the keys are bound to it; one-sided
    /// requests may start. (Windows are bound only now: a bind is a send-queue work request,
    /// which real verbs accept only in RTS.)
    QueuePairReady(ConnectionKeys),
    /// A monitoring connection is authenticated; it may ask for stats.
    MonitorReady {
        /// The node's id.
        node_id: u32,
    },
    /// A heap grant (whole 4 KiB extents, at most one chunk) and the WRITE key over it that
    /// only this connection holds; the key's length is the grant's.
    Chunk {
        /// The grant's heap offset.
        heap_offset: u64,
        /// The WRITE key, bound to this connection's queue pair.
        key: RemoteKey,
    },
    /// No room now. `reclaimable` extents are sealed or quarantined and will come back once
    /// nothing references them: worth retrying shortly when it is above zero.
    ChunkUnavailable {
        /// Extents on their way back to the free list.
        reclaimable: u64,
        /// What to do if it persists.
        reason: String,
    },
    /// The lease was renewed.
    HeartbeatAck {
        /// The epoch of the cluster view the node knows: a client learns of new views here.
        epoch: u64,
        /// The node's clock ([`crate::lease::NodeClock`]) when it answered: the client
        /// recalibrates its reading of the lease word.
        node_clock_ms: u64,
    },
    /// The server's counters.
    Stats(Box<ServerStats>),
    /// The node fenced this data connection: the cluster view moved keys (`docs/protocol.md`,
    /// *Views and fencing*). Sent instead of the next answer, then the connection closes; the
    /// client fetches the view and connects again.
    Fenced {
        /// The view's epoch now.
        epoch: u64,
    },
    /// The node does not serve data now (cut off from the cluster's majority, down in the
    /// view, or restarted and not rejoined yet): sent instead of the welcome, or instead of
    /// the next answer on a data connection, which then closes. The client goes to the key's
    /// next copy once the view names it.
    NotServing {
        /// The view's epoch the node knows.
        epoch: u64,
        /// Why, as a line.
        reason: String,
    },
    /// The node is shutting down, as asked.
    ShuttingDown {
        /// The node's id.
        node_id: u32,
    },
    /// The request was refused; the reason names the fix where there is one.
    Refused {
        /// Why.
        reason: String,
    },
    /// The cluster view, as the answering node knows it.
    View(ClusterView),
    /// The answer to a [`ClientMessage::Peer`].
    Peer {
        /// The encoded consensus reply.
        payload: Vec<u8>,
    },
    /// A [`ClientMessage::ChangeMembership`] is committed: the view's epoch after it.
    MembershipChanged {
        /// The view's epoch with the change.
        epoch: u64,
    },
    /// The stop of the whole cluster is committed at this epoch.
    ClusterStopped {
        /// The view's epoch at the stop.
        epoch: u64,
    },
    /// A snapshot is on disk.
    SnapshotWritten {
        /// The node's id.
        node_id: u32,
        /// Where.
        path: String,
        /// Its keys.
        keys: u64,
        /// Its bytes.
        bytes: u64,
        /// How long it took, in milliseconds.
        took_ms: u64,
    },
    /// The view's loss records up to the epoch asked for are cleared.
    LossesAcknowledged {
        /// How many records were cleared.
        cleared: u64,
    },
}

/// A view in which every copy of some keys was down (or still filling) at once: those keys
/// may be lost, or be older than what was acknowledged (`docs/operations.md`, *When copies are
/// lost*). The view keeps it until an operator acknowledges it (`rdkv-cluster ack-loss`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopySetLoss {
    /// The epoch of the view that had them all down.
    pub epoch: u64,
    /// The members that held no whole copy then (down, or filling), in id order.
    pub nodes: Vec<u32>,
}

impl std::fmt::Display for CopySetLoss {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes: Vec<String> = self.nodes.iter().map(u32::to_string).collect();
        let nodes = match nodes.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => nodes.join(""),
        };
        if self.nodes.len() == 1 {
            return write!(
                formatter,
                "keys may have been lost: the copies on node {nodes} were down at epoch {}",
                self.epoch
            );
        }
        write!(
            formatter,
            "keys may have been lost: the copies on nodes {nodes} were down together at epoch {}",
            self.epoch
        )
    }
}

/// The cluster view: which nodes serve, agreed by the nodes' consensus (`docs/architecture.md`,
/// *Cluster view*). Every change of a member's state makes a new epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterView {
    /// Bumped by every committed change; 0 before the first (a node that has not joined a
    /// consensus yet, or a one-node cluster: its own view, epoch 1).
    pub epoch: u64,
    /// The consensus leader the answering node knows of.
    pub leader: Option<u32>,
    /// Every member, in id order, with its state (the cluster file's nodes at a cluster's
    /// first start; members are added and removed through the view).
    pub members: Vec<ViewMember>,
    /// Views that had every copy of some keys down at once, not acknowledged yet (the most
    /// recent [`MAX_LOSSES_KEPT`]).
    pub losses: Vec<CopySetLoss>,
}

/// The loss records a view keeps until they are acknowledged: the oldest give way (the count
/// of every one is [`ServerStats::copy_sets_lost`]).
pub const MAX_LOSSES_KEPT: usize = 16;

impl ClusterView {
    /// The ids of the members that serve data, in id order: the ranking's candidates for a
    /// key's primary (serving and leaving members).
    pub fn serving(&self) -> Vec<u32> {
        self.members
            .iter()
            .filter(|member| member.state.serves_data())
            .map(|member| member.node_id)
            .collect()
    }

    /// The ids of the members in `state`, in id order.
    pub fn in_state(&self, state: MemberState) -> Vec<u32> {
        self.members
            .iter()
            .filter(|member| member.state == state)
            .map(|member| member.node_id)
            .collect()
    }

    /// The ids of the filling members (back after an absence, or joining), in id order.
    pub fn filling(&self) -> Vec<u32> {
        self.members
            .iter()
            .filter(|member| member.state.is_filling())
            .map(|member| member.node_id)
            .collect()
    }

    /// Whether a membership change is under way: a member joining or leaving.
    pub fn changing_members(&self) -> bool {
        self.members
            .iter()
            .any(|member| matches!(member.state, MemberState::Joining | MemberState::Leaving))
    }

    /// `epoch 3, leader 1: 1 serving, 2 serving, 3 down` (for `rdkv-cluster status` and logs).
    pub fn summary(&self) -> String {
        let members: Vec<String> = self
            .members
            .iter()
            .map(|member| format!("{} {}", member.node_id, member.state))
            .collect();
        let leader = self.leader.map_or_else(
            || "no leader".to_string(),
            |leader| format!("leader {leader}"),
        );
        format!("epoch {}, {leader}: {}", self.epoch, members.join(", "))
    }
}

/// One member of a [`ClusterView`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewMember {
    /// The node's id.
    pub node_id: u32,
    /// Its state in this view.
    pub state: MemberState,
}

/// A member's state in a view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemberState {
    /// Answering its peers; its keys are served by it.
    Serving,
    /// Missed its peers' heartbeats for `failure_timeout`: out of the ranking until it comes
    /// back.
    Down,
    /// Back after a restart or an absence: it gets every write of the keys it is a replica
    /// of, and copies the rest from their primaries; it serves once promoted.
    Filling,
    /// A member added by `rdkv-cluster add-node` that has not served yet: filling, as a
    /// member back after an absence is, with nothing of its own (the nodes' records say
    /// `Filling`; the public view tells the two apart).
    Joining,
    /// A member being removed by `rdkv-cluster remove-node`: it serves its keys as before
    /// while they get their copies on the members that stay, which every write reaches too;
    /// then it is out of the view.
    Leaving,
}

impl MemberState {
    /// Whether a member in this state serves data: a key's primary is the first of its
    /// ranking over these members.
    pub fn serves_data(self) -> bool {
        matches!(self, MemberState::Serving | MemberState::Leaving)
    }

    /// Whether a member in this state fills: it gets every write of the keys it will hold and
    /// copies the rest before it serves.
    pub fn is_filling(self) -> bool {
        matches!(self, MemberState::Filling | MemberState::Joining)
    }
}

impl std::fmt::Display for MemberState {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            MemberState::Serving => "serving",
            MemberState::Down => "down",
            MemberState::Filling => "filling",
            MemberState::Joining => "joining",
            MemberState::Leaving => "leaving",
        })
    }
}

/// What an authenticated client needs to run one-sided operations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The server's id for this connection.
    pub connection_id: u64,
    /// The table's shape and hash seed.
    pub geometry: TableGeometry,
    /// The server queue pair to connect to.
    pub server_endpoint: QueuePairEndpoint,
    /// Heartbeat at least this often, in milliseconds, or the lease expires.
    pub lease_timeout_ms: u64,
    /// The deadline of one operation, in milliseconds.
    pub operation_deadline_ms: u64,
    /// The epoch of the cluster view the connection was made under: a client whose view is
    /// older fetches it before it routes by it (the connection is fenced when the view moves
    /// keys).
    pub view_epoch: u64,
    /// The node's clock ([`crate::lease::NodeClock`]) when it sent this: the client's first
    /// calibration of the lease word's milliseconds.
    pub node_clock_ms: u64,
}

/// The keys of one data connection, bound to its server queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionKeys {
    /// READ and ATOMIC over the index.
    pub index_key: RemoteKey,
    /// READ over the heap.
    pub heap_key: RemoteKey,
    /// WRITE over this connection's announce word (`ANNOUNCE_SIZE` bytes: operations
    /// started, then operations finished through, both little-endian u64).
    pub announce_key: RemoteKey,
    /// READ over the node's lease word ([`crate::lease::LeaseWord`], 8 bytes, little-endian),
    /// which ends every list the client posts.
    pub lease_key: RemoteKey,
}

/// Bytes of a connection's announce word: its started-operations count, then the count it is
/// quiescent through (every operation numbered up to it has finished), little-endian u64s.
pub const ANNOUNCE_SIZE: u64 = 16;

/// A server's counters, as `rdkv stats` and the metrics endpoint show them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStats {
    /// The node's id.
    pub node_id: u32,
    /// Seconds since start.
    pub uptime_seconds: u64,
    /// Control connections open now (authenticated or not).
    pub connections: u64,
    /// Queue pairs per state (RESET, INIT, RTR, RTS, ERR).
    pub queue_pairs: [i64; 5],
    /// Live memory regions.
    pub live_memory_regions: i64,
    /// Live memory windows.
    pub live_memory_windows: i64,
    /// Pinned bytes.
    pub pinned_bytes: u64,
    /// Heap bytes in extents that are owned, sealed or quarantined.
    pub heap_used_bytes: u64,
    /// Heap bytes.
    pub heap_size_bytes: u64,
    /// Heap bytes free now.
    pub heap_free_bytes: u64,
    /// Over the last 1,024 extents reclaimed: milliseconds from the scan that found an extent
    /// unreferenced to its reuse, median, 99th percentile and largest (zeros before any).
    pub heap_reuse_delay_ms: [u64; 3],
    /// Committed keys, counted by a scan of the index made for this snapshot: exact when no
    /// write is in flight.
    pub keys: u64,
    /// Heap grants handed out since start.
    pub chunk_allocations: u64,
    /// Heap extents reclaimed since start.
    pub extents_reclaimed: u64,
    /// Live blocks moved out of sparse extents by compaction since start.
    pub blocks_relocated: u64,
    /// Abandoned tentative slots cleared by the collector since start.
    pub tentatives_cleared: u64,
    /// Heap collector passes since start.
    pub collector_passes: u64,
    /// Tombstone slots (replicated deletes) the collector cleared a quarantine after they
    /// were written.
    pub tombstones_cleared: u64,
    /// Committed keys the collector removed because the view does not name this node among
    /// their copies: a stand-in's copies once the member it stood in for serves again.
    pub extra_copies_removed: u64,
    /// The epoch of the last view under which this node swept its extra copies to the end
    /// (0: none yet). A removal waits for every member's sweep of the newest view
    /// (`docs/protocol.md`, *Membership changes*).
    pub swept_epoch: u64,
    /// The index's slots (buckets × slots per bucket): `keys` over this is its load factor.
    pub index_slots: u64,
    /// The collector's interval now, in milliseconds: `collector_interval` while it has work,
    /// stretched up to 8 times that while the index does not change.
    pub collector_interval_ms: u64,
    /// Control messages handled since start.
    pub control_messages: u64,
    /// One-sided requests handled by server application code: always 0 by construction (the
    /// NIC engine serves them), reported so that anyone can check.
    pub data_path_requests: u64,
    /// Soft NIC frames sent (responses), a measure of one-sided traffic.
    pub fabric_frames_sent: i64,
    /// Connections the soft NIC closed before their hello: evicted by newer ones.
    pub fabric_hellos_refused: i64,
    /// Connections the soft NIC closed because their whole hello missed the deadline.
    pub fabric_hellos_timed_out: i64,
    /// Soft NIC connections reading their hello now.
    pub fabric_hellos_pending: i64,
    /// Soft NIC connections being served now (one per connected client queue pair).
    pub fabric_connections: i64,
    /// The soft NIC's engine threads (0 on verbs: the NIC does the work).
    pub fabric_engine_threads: i64,
    /// Times a soft NIC connection stopped being read because its peer did not take its
    /// answers (backpressure at `fabric_response_buffer`).
    pub fabric_output_stalls: i64,
    /// Soft NIC connections whose responder refused a request (longer than the 1 MiB
    /// `max_message_size`, malformed, or outside its key's rights): each moved its queue pair
    /// to ERROR, as on rxe.
    pub fabric_responder_errors: i64,
    /// The node's main fabric (its clients on other hosts use it).
    pub fabric: Option<rdkv_fabric::Backend>,
    /// Data connections (with a queue pair) on the main fabric now.
    pub data_connections: u64,
    /// Data connections on the node's `shm` fabric now (clients on its host).
    pub shm_data_connections: u64,
    /// Authentication failures since start.
    pub authentication_failures: u64,
    /// Unauthenticated control connections now.
    pub pending_handshakes: u64,
    /// Authenticated control connections now (of `max_connections`): data clients, their
    /// lanes, monitors and peers.
    pub authenticated_connections: u64,
    /// Connections refused since start because all `max_connections` authenticated slots
    /// were taken.
    pub connections_refused_full: u64,
    /// Unauthenticated connections evicted by newer ones since start (too many at once).
    pub handshakes_evicted: u64,
    /// Control connections closed since start because their whole handshake passed
    /// `handshake_deadline`, or one of its messages its own timeout.
    pub handshakes_timed_out: u64,
    /// The epoch of the cluster view this node knows.
    pub view_epoch: u64,
    /// The consensus leader this node knows of (0: none).
    pub view_leader: u32,
    /// Members the node's view has down.
    pub view_members_down: u64,
    /// Members the node's view has joining (`rdkv-cluster add-node`).
    pub view_members_joining: u64,
    /// Members the node's view has leaving (`rdkv-cluster remove-node`).
    pub view_members_leaving: u64,
    /// Views this node committed as the consensus leader since start.
    pub views_committed: u64,
    /// Data connections ended because the view moved keys (`docs/protocol.md`, *Views and
    /// fencing*).
    pub connections_fenced: u64,
    /// Data connections fenced because, under heap pressure, they held reuse back with an
    /// operation in flight and announced nothing for `heap_hold_limit` (`docs/protocol.md`,
    /// *Heap space*).
    pub heap_fences: u64,
    /// Heap bytes in sealed grants held for a requester stopped inside a request with the
    /// grant's window (`shm`: a client process stopped mid-WRITE, whose WRITE may still land):
    /// kept until it leaves the request or its process ends (`docs/protocol.md`, *Heap space*).
    pub heap_held_bytes: u64,
    /// Torn-down data connections kept because their client stopped inside a request (`shm`):
    /// each keeps its queue pair, announce word and grants until the client leaves the request
    /// or its process ends.
    pub connections_held: u64,
    /// Data connections refused because the node was not serving data.
    pub connections_refused_not_serving: u64,
    /// Extra lanes refused because over half of `max_connections` were open.
    pub lanes_refused: u64,
    /// Whether the node serves data now: it holds its lease from the cluster's majority and
    /// the view has it as this process (`docs/protocol.md`, *Views and fencing*).
    pub serving_data: bool,
    /// Times the node stopped serving data since it started, for any reason (a lost lease, a
    /// view that has it down, a clean leave).
    pub serving_stops: u64,
    /// Of `serving_stops`, those for want of a lease: it ran out before a renewal from the
    /// majority came (a cut, a paused or starved process), or the node dropped the lease it
    /// held as the leader when it stopped leading (`docs/operations.md`, *Leases under load*).
    pub lease_lapses: u64,
    /// Refill (a node filling after a restart) or reconciliation (every node started again
    /// after a crash): index buckets of the peers scanned so far, of `refill_buckets_total`
    /// (0 of 0: neither since start).
    pub refill_buckets_scanned: u64,
    /// Refill: the peers' index buckets to scan in all.
    pub refill_buckets_total: u64,
    /// Refill: keys copied from their primaries.
    pub refill_keys_copied: u64,
    /// Refill: bytes of the keys and values it copied.
    pub refill_bytes_copied: u64,
    /// Hand-over of a leaving member (`rdkv-cluster remove-node`): its keys copied to the
    /// members that take them (`docs/protocol.md`, *Membership changes*).
    pub handover_keys_copied: u64,
    /// Hand-over: bytes of the keys and values it copied.
    pub handover_bytes_copied: u64,
    /// Hand-over: this node's index buckets scanned, of `handover_buckets_total` (0 of 0: no
    /// hand-over since start).
    pub handover_buckets_scanned: u64,
    /// Hand-over: this node's index buckets to scan.
    pub handover_buckets_total: u64,
    /// Re-replication (a member removed while `down`): whether this node still has to copy
    /// the keys it is the primary of to their full set of copies.
    pub rereplication_pending: bool,
    /// The epoch of the view under which this node last finished a re-replication (0: none
    /// since start).
    pub rereplicated_epoch: u64,
    /// Re-replication: keys copied through their primary lock.
    pub rereplication_keys_copied: u64,
    /// Re-replication: bytes of the keys and values it copied.
    pub rereplication_bytes_copied: u64,
    /// Re-replication: this node's index buckets scanned, of `rereplication_buckets_total`.
    pub rereplication_buckets_scanned: u64,
    /// Re-replication: this node's index buckets to scan.
    pub rereplication_buckets_total: u64,
    /// The view epoch at which this node last finished the newest-wins reconciliation of a
    /// whole-cluster start (0: none since start; `docs/protocol.md`, *Reconciliation*).
    pub reconciled_epoch: u64,
    /// Reconciliation: keys this node took from a peer whose copy was newer than its own.
    pub reconciled_keys: u64,
    /// Reconciliation: keys this node removed because the copy of a node that stopped later
    /// decided they were absent (deleted after this node's snapshot).
    pub reconciled_removed: u64,
    /// Snapshots written since start (`docs/operations.md`, *Persistence*).
    pub snapshots_written: u64,
    /// Snapshots that failed since start (a full disk, say): the previous one is kept.
    pub snapshots_failed: u64,
    /// Whether the last snapshot tried failed.
    pub snapshot_failing: bool,
    /// When the last snapshot was complete, in milliseconds since the Unix epoch (0: none
    /// since start).
    pub last_snapshot_unix_ms: u64,
    /// How long the last snapshot took, in milliseconds.
    pub last_snapshot_duration_ms: u64,
    /// The last snapshot's bytes.
    pub last_snapshot_bytes: u64,
    /// The last snapshot's keys.
    pub last_snapshot_keys: u64,
    /// Keys loaded from a snapshot at start.
    pub snapshot_keys_loaded: u64,
    /// The epoch at which the node that wrote the snapshot loaded at start stopped serving
    /// data while the view had it serving, while that snapshot still describes the node's
    /// table (0: none, or no longer: a client connected, or a refill ran). A whole-cluster
    /// start lets such a copy decide over older ones (`docs/protocol.md`, *Reconciliation*).
    pub snapshot_loaded_fenced_at: u64,
    /// When that node stopped serving, in milliseconds since the Unix epoch by its clock.
    pub snapshot_loaded_fenced_unix_ms: u64,
    /// Views the cluster committed in which every copy of some keys was down at once, since
    /// the view began (kept by the view: the same on every node that applied it).
    pub copy_sets_lost: u64,
    /// What this node's clients reported about their one-sided work.
    pub client_counters: ClientCounters,
}

impl ServerStats {
    /// Whether less than a tenth of the heap is free: writes may soon wait for reclamation, or
    /// fail `TableFull` if the live data outgrows the heap.
    pub fn heap_low(&self) -> bool {
        self.heap_size_bytes > 0 && self.heap_free_bytes * 10 < self.heap_size_bytes
    }

    /// The index's load factor in percent: committed keys over slots (0 without an index).
    pub fn index_load_percent(&self) -> u64 {
        (self.keys * 100).checked_div(self.index_slots).unwrap_or(0)
    }

    /// Whether the index is over 80% full: inserts of keys whose candidate slots are all
    /// taken fail `TableFull` from about there (each key has 32 candidate slots).
    pub fn index_high(&self) -> bool {
        self.index_load_percent() > 80
    }
}

/// Client-side counters, as increments: one-sided work is invisible to the server, so clients
/// report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientCounters {
    /// Operations ended, whether they succeeded or failed.
    pub operations: u64,
    /// GETs (failed ones included).
    pub gets: u64,
    /// Mutations (failed ones included).
    pub mutations: u64,
    /// Operations that ended with an error (a miss or a lost compare is not an error).
    pub failures: u64,
    /// Posted lists awaited (network round trips).
    pub round_trips: u64,
    /// Round trips spent by GETs.
    pub get_round_trips: u64,
    /// Work requests posted.
    pub verbs: u64,
    /// Slot CASes that lost a race.
    pub cas_failures: u64,
    /// Checksum retries.
    pub checksum_retries: u64,
}

impl ClientCounters {
    /// Adds another report.
    pub fn add(&mut self, other: &ClientCounters) {
        self.operations += other.operations;
        self.gets += other.gets;
        self.mutations += other.mutations;
        self.failures += other.failures;
        self.round_trips += other.round_trips;
        self.get_round_trips += other.get_round_trips;
        self.verbs += other.verbs;
        self.cas_failures += other.cas_failures;
        self.checksum_retries += other.checksum_retries;
    }

    /// Round trips per operation.
    pub fn round_trips_per_operation(&self) -> f64 {
        if self.operations == 0 {
            0.0
        } else {
            self.round_trips as f64 / self.operations as f64
        }
    }

    /// Round trips per GET.
    pub fn round_trips_per_get(&self) -> f64 {
        if self.gets == 0 {
            0.0
        } else {
            self.get_round_trips as f64 / self.gets as f64
        }
    }

    /// Work requests per operation.
    pub fn verbs_per_operation(&self) -> f64 {
        if self.operations == 0 {
            0.0
        } else {
            self.verbs as f64 / self.operations as f64
        }
    }
}

/// The HMAC over a challenge: the domain, the node id the challenge named, the nonce. Binding
/// the node id means a proof made for node 1's challenge is worthless at any other node, and a
/// client that checks the id it was shown against the node it meant to reach cannot be used
/// as an oracle by a relay in front of another node.
fn proof_mac(secret: &[u8], node_id: u32, nonce: &[u8; PROOF_LENGTH]) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(b"rdkv-auth-v2");
    mac.update(&node_id.to_le_bytes());
    mac.update(nonce);
    mac
}

/// HMAC-SHA256 proof of the secret over node `node_id`'s challenge.
pub fn compute_proof(
    secret: &[u8],
    node_id: u32,
    nonce: &[u8; PROOF_LENGTH],
) -> [u8; PROOF_LENGTH] {
    proof_mac(secret, node_id, nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a proof for this node's challenge in constant time.
pub fn verify_proof(
    secret: &[u8],
    node_id: u32,
    nonce: &[u8; PROOF_LENGTH],
    proof: &[u8; PROOF_LENGTH],
) -> bool {
    proof_mac(secret, node_id, nonce)
        .verify_slice(proof)
        .is_ok()
}

/// Refuses a challenge from another node than the one meant (`expected`, when known): a
/// relay in front of node 2 that passes on node 1's challenge, to get a proof for node 1.
///
/// # Errors
/// [`ControlError::Refused`] naming both ids.
pub fn check_challenge_node(expected: Option<u32>, named: u32) -> Result<(), ControlError> {
    match expected {
        Some(expected) if expected != named => Err(ControlError::Refused {
            reason: format!(
                "the node at this address says it is node {named}, not node {expected}: a wrong address in the cluster file, or something relaying to another node"
            ),
        }),
        _ => Ok(()),
    }
}

/// Writes one frame.
///
/// # Errors
/// [`ControlError::FrameTooLarge`] or [`ControlError::Io`].
pub async fn write_frame<W, M>(writer: &mut W, message: &M) -> Result<(), ControlError>
where
    W: AsyncWrite + Unpin,
    M: Serialize,
{
    let bytes = bincode::serialize(message).map_err(|error| ControlError::Malformed {
        reason: error.to_string(),
    })?;
    let length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    if length > MAX_FRAME_SIZE {
        return Err(ControlError::FrameTooLarge {
            length,
            max: MAX_FRAME_SIZE,
        });
    }
    let mut frame = Vec::with_capacity(4 + bytes.len());
    frame.extend_from_slice(&length.to_le_bytes());
    frame.extend_from_slice(&bytes);
    writer.write_all(&frame).await.map_err(ControlError::Io)?;
    writer.flush().await.map_err(ControlError::Io)
}

/// Reads one frame.
///
/// # Errors
/// [`ControlError::Closed`] at a clean end of stream, [`ControlError::FrameTooLarge`] before
/// reading an oversize body, [`ControlError::Malformed`] when the body does not decode.
pub async fn read_frame<R, M>(reader: &mut R) -> Result<M, ControlError>
where
    R: AsyncRead + Unpin,
    M: for<'de> Deserialize<'de>,
{
    let mut length = [0u8; 4];
    match reader.read_exact(&mut length).await {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ControlError::Closed)
        }
        Err(error) => return Err(ControlError::Io(error)),
    }
    let length = u32::from_le_bytes(length);
    if length > MAX_FRAME_SIZE {
        return Err(ControlError::FrameTooLarge {
            length,
            max: MAX_FRAME_SIZE,
        });
    }
    let mut body = vec![0u8; length as usize];
    reader.read_exact(&mut body).await.map_err(|error| {
        if error.kind() == std::io::ErrorKind::UnexpectedEof {
            ControlError::Closed
        } else {
            ControlError::Io(error)
        }
    })?;
    bincode::deserialize(&body).map_err(|error| ControlError::Malformed {
        reason: error.to_string(),
    })
}

/// What answers at a control address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Nothing: the connection is refused or times out.
    Nothing,
    /// An rdkv node, which named its id in its challenge.
    Node(u32),
    /// Something that is not an rdkv node (no challenge within the timeout).
    Other,
}

/// Connects to `address` and reads the first frame, without answering it (blocking, bounded
/// by `timeout` per step): whether an rdkv node listens there, and which. The node logs such
/// a probe at debug level only.
pub fn probe_node(address: std::net::SocketAddr, timeout: std::time::Duration) -> Probe {
    use std::io::Read;
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&address, timeout) else {
        return Probe::Nothing;
    };
    if stream.set_read_timeout(Some(timeout)).is_err() {
        return Probe::Other;
    }
    let mut length = [0u8; 4];
    if stream.read_exact(&mut length).is_err() {
        return Probe::Other;
    }
    let length = u32::from_le_bytes(length);
    if length > MAX_FRAME_SIZE {
        return Probe::Other;
    }
    let mut body = vec![0u8; length as usize];
    if stream.read_exact(&mut body).is_err() {
        return Probe::Other;
    }
    match bincode::deserialize::<ServerMessage>(&body) {
        Ok(ServerMessage::Challenge { node_id, .. }) => Probe::Node(node_id),
        _ => Probe::Other,
    }
}

/// A node to monitor: where, its id when known (checked against its challenge), the secret.
#[derive(Debug, Clone, Copy)]
pub struct MonitoredNode<'a> {
    /// Its control address.
    pub address: std::net::SocketAddr,
    /// Its id in the cluster file; `None` accepts whichever node answers.
    pub id: Option<u32>,
    /// The cluster secret.
    pub secret: &'a [u8],
}

/// Opens an authenticated monitoring connection (no queue pair, no keys).
///
/// # Errors
/// [`ControlError::Refused`] when the node refuses the secret or the version; the others when
/// it cannot be reached or answers oddly.
async fn monitor_connection(
    node: MonitoredNode<'_>,
    purpose: Purpose,
) -> Result<tokio::net::TcpStream, ControlError> {
    let stream = tokio::net::TcpStream::connect(node.address)
        .await
        .map_err(ControlError::Io)?;
    authenticate_monitor(stream, node, purpose).await
}

/// The handshake of a monitoring connection on a connected `stream`: challenge, proof,
/// `MonitorReady`.
///
/// # Errors
/// As [`monitor_connection`].
async fn authenticate_monitor(
    mut stream: tokio::net::TcpStream,
    node: MonitoredNode<'_>,
    purpose: Purpose,
) -> Result<tokio::net::TcpStream, ControlError> {
    let ServerMessage::Challenge { nonce, node_id, .. } = read_frame(&mut stream).await? else {
        return Err(ControlError::Unexpected("no challenge".into()));
    };
    check_challenge_node(node.id, node_id)?;
    let secret = node.secret;
    write_frame(
        &mut stream,
        &ClientMessage::Authenticate {
            protocol_version: PROTOCOL_VERSION,
            purpose,
            proof: compute_proof(secret, node_id, &nonce),
            client_name: "rdkv-monitor".into(),
            shared_memory: false,
            routes_by_view: false,
        },
    )
    .await?;
    match read_frame(&mut stream).await? {
        ServerMessage::MonitorReady { .. } => Ok(stream),
        ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

/// Runs a monitoring conversation within `timeout`.
async fn within<T>(
    timeout: std::time::Duration,
    conversation: impl std::future::Future<Output = Result<T, ControlError>>,
) -> Result<T, ControlError> {
    tokio::time::timeout(timeout, conversation)
        .await
        .unwrap_or(Err(ControlError::TimedOut { timeout }))
}

/// Opens a monitoring connection (no queue pair, no keys) and fetches the server's stats. Their
/// `connections` leaves out this monitoring connection itself.
///
/// # Errors
/// [`ControlError`] when the node cannot be reached, refuses the secret
/// ([`ControlError::Refused`]), or answers oddly.
pub async fn fetch_stats(
    node: MonitoredNode<'_>,
    timeout: std::time::Duration,
) -> Result<ServerStats, ControlError> {
    match ask(node, timeout, ClientMessage::Stats).await? {
        ServerMessage::Stats(mut stats) => {
            stats.connections = stats.connections.saturating_sub(1);
            Ok(*stats)
        }
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

/// One question on a fresh monitoring connection, within `timeout`: the answer (a refusal is
/// [`ControlError::Refused`]), then a goodbye.
async fn ask(
    node: MonitoredNode<'_>,
    timeout: std::time::Duration,
    question: ClientMessage,
) -> Result<ServerMessage, ControlError> {
    within(timeout, async {
        let mut stream = monitor_connection(node, Purpose::Monitor).await?;
        let reply = ask_on(&mut stream, &question).await;
        let _ = write_frame(&mut stream, &ClientMessage::Goodbye).await;
        reply
    })
    .await
}

/// One question on an open monitoring connection: the answer, a refusal as
/// [`ControlError::Refused`].
async fn ask_on(
    stream: &mut tokio::net::TcpStream,
    question: &ClientMessage,
) -> Result<ServerMessage, ControlError> {
    write_frame(stream, question).await?;
    match read_frame(stream).await? {
        ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
        reply => Ok(reply),
    }
}

/// A node's answer to `rdkv-cluster status`: its stats and the cluster view it knows.
#[derive(Debug, Clone)]
pub struct NodeReport {
    /// Its stats; their `connections` leaves out the monitoring connection that asked.
    pub stats: ServerStats,
    /// The cluster view it knows.
    pub view: ClusterView,
}

/// Asks a node for its stats and the view it knows, both on one monitoring connection, all
/// within `timeout` from the start of the connect (connect, challenge, proof, two questions).
///
/// # Errors
/// [`ControlError::NoAnswer`] when the connection was accepted but the node did not answer
/// in time (a stopped or hung process); [`ControlError::Io`] of kind
/// [`std::io::ErrorKind::TimedOut`] when not even the connect completed in time; the others as
/// [`fetch_stats`].
pub async fn fetch_report(
    node: MonitoredNode<'_>,
    timeout: std::time::Duration,
) -> Result<NodeReport, ControlError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let stream = tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect(node.address))
        .await
        .map_err(|_| {
            ControlError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connect did not complete within {timeout:?}"),
            ))
        })?
        .map_err(ControlError::Io)?;
    let conversation = async {
        let mut stream = authenticate_monitor(stream, node, Purpose::Monitor).await?;
        let stats = match ask_on(&mut stream, &ClientMessage::Stats).await? {
            ServerMessage::Stats(mut stats) => {
                stats.connections = stats.connections.saturating_sub(1);
                *stats
            }
            other => return Err(ControlError::Unexpected(format!("{other:?}"))),
        };
        let view = match ask_on(&mut stream, &ClientMessage::FetchView).await? {
            ServerMessage::View(view) => view,
            other => return Err(ControlError::Unexpected(format!("{other:?}"))),
        };
        let _ = write_frame(&mut stream, &ClientMessage::Goodbye).await;
        Ok(NodeReport { stats, view })
    };
    tokio::time::timeout_at(deadline, conversation)
        .await
        .unwrap_or(Err(ControlError::NoAnswer { timeout }))
}

/// Asks a node to shut down over an authenticated monitoring connection; returns once the node
/// has acknowledged (it then stops accepting and exits after its teardowns).
///
/// # Errors
/// As [`fetch_stats`].
pub async fn request_shutdown(
    node: MonitoredNode<'_>,
    timeout: std::time::Duration,
) -> Result<u32, ControlError> {
    within(timeout, async {
        let mut stream = monitor_connection(node, Purpose::Monitor).await?;
        write_frame(&mut stream, &ClientMessage::Shutdown).await?;
        match read_frame(&mut stream).await? {
            ServerMessage::ShuttingDown { node_id } => Ok(node_id),
            ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
            other => Err(ControlError::Unexpected(format!("{other:?}"))),
        }
    })
    .await
}

/// Asks a node to have the whole cluster stopped (the view's `Stop`); the epoch of the stop.
///
/// # Errors
/// As [`fetch_stats`]; [`ControlError::Refused`] when the stop cannot be committed (no leader,
/// no quorum).
pub async fn request_cluster_stop(
    node: MonitoredNode<'_>,
    timeout: std::time::Duration,
) -> Result<u64, ControlError> {
    match ask(node, timeout, ClientMessage::StopCluster).await? {
        ServerMessage::ClusterStopped { epoch } => Ok(epoch),
        ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

/// Asks a node to have the view's leader commit a membership change (`rdkv-cluster add-node`,
/// `remove-node`); the epoch of the view with it.
///
/// # Errors
/// As [`request_cluster_stop`].
pub async fn request_membership_change(
    node: MonitoredNode<'_>,
    change: MembershipChange,
    timeout: std::time::Duration,
) -> Result<u64, ControlError> {
    match ask(node, timeout, ClientMessage::ChangeMembership(change)).await? {
        ServerMessage::MembershipChanged { epoch } => Ok(epoch),
        ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

/// Asks a node to have the view's loss records up to `up_to_epoch` cleared
/// (`rdkv-cluster ack-loss`); how many were cleared.
///
/// # Errors
/// As [`request_cluster_stop`].
pub async fn request_loss_acknowledgement(
    node: MonitoredNode<'_>,
    up_to_epoch: u64,
    timeout: std::time::Duration,
) -> Result<u64, ControlError> {
    match ask(
        node,
        timeout,
        ClientMessage::AcknowledgeLosses { up_to_epoch },
    )
    .await?
    {
        ServerMessage::LossesAcknowledged { cleared } => Ok(cleared),
        ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

/// What [`request_snapshot`] reports: where the node wrote its snapshot, and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotReport {
    /// The node.
    pub node_id: u32,
    /// The file.
    pub path: String,
    /// Keys in it.
    pub keys: u64,
    /// Its bytes.
    pub bytes: u64,
    /// Milliseconds it took.
    pub took_ms: u64,
}

/// Asks a node to write a snapshot now; returns once it is on disk.
///
/// # Errors
/// As [`fetch_stats`]; [`ControlError::Refused`] when the node has no data directory or the
/// write failed (the reason says why).
pub async fn request_snapshot(
    node: MonitoredNode<'_>,
    timeout: std::time::Duration,
) -> Result<SnapshotReport, ControlError> {
    match ask(node, timeout, ClientMessage::Snapshot).await? {
        ServerMessage::SnapshotWritten {
            node_id,
            path,
            keys,
            bytes,
            took_ms,
        } => Ok(SnapshotReport {
            node_id,
            path,
            keys,
            bytes,
            took_ms,
        }),
        ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

/// Fetches the cluster view a node knows, over a monitoring connection.
///
/// # Errors
/// As [`fetch_stats`].
pub async fn fetch_view(
    node: MonitoredNode<'_>,
    timeout: std::time::Duration,
) -> Result<ClusterView, ControlError> {
    match ask(node, timeout, ClientMessage::FetchView).await? {
        ServerMessage::View(view) => Ok(view),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

/// A node's authenticated connection to a peer node, for the consensus on the view: one
/// request at a time, each answered in order.
#[derive(Debug)]
pub struct PeerConnection {
    /// The authenticated monitoring connection.
    stream: tokio::net::TcpStream,
}

impl PeerConnection {
    /// Connects and authenticates within `timeout`.
    ///
    /// # Errors
    /// As [`fetch_stats`].
    pub async fn open(
        node: MonitoredNode<'_>,
        timeout: std::time::Duration,
    ) -> Result<Self, ControlError> {
        let stream = within(timeout, monitor_connection(node, Purpose::Peer)).await?;
        Ok(Self { stream })
    }

    /// Sends `payload` and returns the peer's answer, within `timeout`. After an error the
    /// connection is out of step: drop it.
    ///
    /// # Errors
    /// As [`fetch_stats`].
    pub async fn request(
        &mut self,
        payload: Vec<u8>,
        timeout: std::time::Duration,
    ) -> Result<Vec<u8>, ControlError> {
        let stream = &mut self.stream;
        within(timeout, async move {
            write_frame(stream, &ClientMessage::Peer { payload }).await?;
            match read_frame(stream).await? {
                ServerMessage::Peer { payload } => Ok(payload),
                ServerMessage::Refused { reason } => Err(ControlError::Refused { reason }),
                other => Err(ControlError::Unexpected(format!("{other:?}"))),
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip() {
        let (mut left, mut right) = tokio::io::duplex(1 << 16);
        let heartbeat = ClientMessage::Heartbeat {
            counters: ClientCounters {
                operations: 3,
                ..ClientCounters::default()
            },
        };
        write_frame(&mut left, &heartbeat).await.expect("write");
        let message: ClientMessage = read_frame(&mut right).await.expect("read");
        assert_eq!(message, heartbeat);
    }

    #[tokio::test]
    async fn oversize_and_malformed_frames_are_refused() {
        let (mut left, mut right) = tokio::io::duplex(1 << 16);
        left.write_all(&(MAX_FRAME_SIZE + 1).to_le_bytes())
            .await
            .expect("write");
        let error = read_frame::<_, ClientMessage>(&mut right)
            .await
            .unwrap_err();
        assert!(
            matches!(error, ControlError::FrameTooLarge { length, .. } if length == MAX_FRAME_SIZE + 1)
        );

        let (mut left, mut right) = tokio::io::duplex(1 << 16);
        left.write_all(&3u32.to_le_bytes()).await.expect("write");
        left.write_all(&[0xFF, 0xFF, 0xFF]).await.expect("write");
        let error = read_frame::<_, ClientMessage>(&mut right)
            .await
            .unwrap_err();
        assert!(matches!(error, ControlError::Malformed { .. }), "{error}");

        let (left, mut right) = tokio::io::duplex(1 << 16);
        drop(left);
        assert!(matches!(
            read_frame::<_, ClientMessage>(&mut right).await,
            Err(ControlError::Closed)
        ));
    }

    #[test]
    fn proofs_verify_only_with_the_same_secret_node_and_nonce() {
        let nonce = [7u8; PROOF_LENGTH];
        let proof = compute_proof(b"secret", 1, &nonce);
        assert!(verify_proof(b"secret", 1, &nonce, &proof));
        assert!(!verify_proof(b"other", 1, &nonce, &proof));
        assert!(!verify_proof(b"secret", 1, &[8u8; PROOF_LENGTH], &proof));
        // A proof for node 1's challenge is worthless at node 2.
        assert!(!verify_proof(b"secret", 2, &nonce, &proof));
        assert!(check_challenge_node(Some(2), 2).is_ok());
        assert!(check_challenge_node(None, 1).is_ok());
        let refused = check_challenge_node(Some(2), 1).unwrap_err().to_string();
        assert!(refused.contains("node 1, not node 2"), "{refused}");
    }

    /// A listener that never accepts stands for a stopped node: its kernel completes the
    /// connect into the backlog, and nothing ever reads. Once it is gone the connect is refused.
    #[tokio::test]
    async fn a_report_tells_a_silent_node_from_one_that_is_not_there() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a listener");
        let node = MonitoredNode {
            address: listener.local_addr().expect("its address"),
            id: Some(1),
            secret: b"secret",
        };
        let timeout = std::time::Duration::from_millis(100);
        let silent = fetch_report(node, timeout).await.unwrap_err();
        assert!(
            matches!(silent, ControlError::NoAnswer { timeout: allowed } if allowed == timeout),
            "{silent}"
        );
        drop(listener);
        let gone = fetch_report(node, timeout).await.unwrap_err();
        assert!(
            matches!(&gone, ControlError::Io(error) if error.kind() == std::io::ErrorKind::ConnectionRefused),
            "{gone}"
        );
    }
}
