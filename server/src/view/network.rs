//! The consensus's network: Raft's messages to a peer node ride on an authenticated control
//! connection to that node (`ClientMessage::Peer`), which a link task holds (`peer_link.rs`):
//! opened on first use, kept across a caller's timeout, and reopened after a failure. Every
//! answer, a late one too, is recorded in [`Liveness`], which is what the leader's failure
//! detector and its lease read.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use rdkv_fabric::lock;
use tokio::sync::oneshot;

use super::peer_link::{Exchange, LinkTarget, PeerLink};
use super::types::{PeerId, PeerReply, PeerRequest, TypeConfig};
use super::HEARTBEAT_INTERVAL;

/// When each peer last answered this node.
#[derive(Debug, Default)]
pub struct Liveness {
    /// The last answer's time, by node id.
    heard: Mutex<HashMap<u32, Instant>>,
    /// On a leader: by node id, when the peer's newest lease request arrived.
    lease_requested: Mutex<HashMap<u32, Instant>>,
    /// On a leader: by node id, when the newest of its `AppendEntries` that the peer accepted
    /// (it had voted for no later leader) was sent. The leader's lease counts from these.
    accepted: Mutex<HashMap<u32, Instant>>,
    /// A peer's refusal of this node's `AppendEntries` because the view does not name it (a
    /// member removed while it was down, started again as the leader it was): taken by
    /// `replacement.rs`, which says so.
    refused_as_non_member: Mutex<Option<String>>,
}

impl Liveness {
    /// The last refusal of this node's `AppendEntries` because it is not a member, if one came
    /// since the last call.
    pub fn take_non_member_refusal(&self) -> Option<String> {
        lock(&self.refused_as_non_member).take()
    }

    /// Records an answer from `node_id`.
    pub fn heard(&self, node_id: u32) {
        lock(&self.heard).insert(node_id, Instant::now());
    }

    /// When `node_id` last answered, if ever.
    pub fn last_heard(&self, node_id: u32) -> Option<Instant> {
        lock(&self.heard).get(&node_id).copied()
    }

    /// Records a lease request from `node_id`, arriving now: a sign of life too.
    pub fn lease_requested(&self, node_id: u32) {
        self.heard(node_id);
        lock(&self.lease_requested).insert(node_id, Instant::now());
    }

    /// When `node_id`'s newest lease request arrived, if ever.
    pub fn last_lease_request(&self, node_id: u32) -> Option<Instant> {
        lock(&self.lease_requested).get(&node_id).copied()
    }

    /// Records that `node_id` accepted an `AppendEntries` sent at `sent`.
    pub(super) fn accepted(&self, node_id: u32, sent: Instant) {
        let mut accepted = lock(&self.accepted);
        let newest = accepted.entry(node_id).or_insert(sent);
        *newest = (*newest).max(sent);
    }

    /// When the newest of this node's `AppendEntries` that `node_id` accepted was sent, if any.
    pub fn last_accepted(&self, node_id: u32) -> Option<Instant> {
        lock(&self.accepted).get(&node_id).copied()
    }

    /// The latest time by which `quorum` nodes, this one (counted as now) and `peers`, had
    /// accepted this node's leadership: every peer's acceptance was sent no earlier.
    pub fn quorum_accepted(&self, peers: &[u32], quorum: usize) -> Option<Instant> {
        let accepted = lock(&self.accepted);
        let mut times: Vec<Instant> = peers
            .iter()
            .filter_map(|peer| accepted.get(peer).copied())
            .chain(std::iter::once(Instant::now()))
            .collect();
        times.sort_unstable_by(|left, right| right.cmp(left));
        times.get(quorum.checked_sub(1)?).copied()
    }
}

/// Makes a [`PeerClient`] per peer.
#[derive(Debug, Clone)]
pub struct Network {
    /// The peers' control addresses, from this node's own configuration: the membership in
    /// Raft's log carries the addresses of the node that initialized it.
    pub addresses: Arc<std::collections::BTreeMap<u32, SocketAddr>>,
    /// The cluster secret.
    pub secret: Arc<[u8]>,
    /// Answers seen.
    pub liveness: Arc<Liveness>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: PeerId, node: &BasicNode) -> PeerClient {
        PeerClient {
            target: target as u32,
            address: u32::try_from(target)
                .ok()
                .and_then(|target| self.addresses.get(&target).copied())
                .or_else(|| node.addr.parse().ok()),
            secret: self.secret.clone(),
            liveness: self.liveness.clone(),
            link: None,
        }
    }
}

/// Raft's messages to one peer.
#[derive(Debug)]
pub struct PeerClient {
    /// The peer's id.
    target: u32,
    /// Its control address (`None`: the membership named one that does not parse).
    address: Option<SocketAddr>,
    /// The cluster secret.
    secret: Arc<[u8]>,
    /// Answers seen.
    liveness: Arc<Liveness>,
    /// The link to the peer, started on the first call.
    link: Option<PeerLink>,
}

/// Why a peer call failed before the peer's Raft answered.
#[derive(Debug, thiserror::Error)]
#[error("peer node {node}: {reason}")]
struct PeerFailure {
    /// The peer.
    node: u32,
    /// What went wrong.
    reason: String,
}

impl PeerClient {
    /// Sends `request` on this peer's link (started on first use) and returns the answer
    /// within `timeout`. The link itself waits longer (`peer_link.rs`): a late answer still
    /// counts as a sign of life, and the connection stays open. Cancellation-safe: dropping
    /// the call only drops the wait for its answer.
    async fn call(
        &mut self,
        request: &PeerRequest,
        timeout: Duration,
    ) -> Result<PeerReply, PeerFailure> {
        let failure = |reason: String| PeerFailure {
            node: self.target,
            reason,
        };
        let address = self
            .address
            .ok_or_else(|| failure("no valid control address in the membership".into()))?;
        let payload = bincode::serialize(request).map_err(|error| failure(error.to_string()))?;
        let link = self.link.get_or_insert_with(|| {
            PeerLink::start(LinkTarget {
                node: self.target,
                address,
                secret: self.secret.clone(),
                liveness: self.liveness.clone(),
            })
        });
        let (answer, answered) = oneshot::channel();
        let exchange = Exchange {
            payload,
            sent: Instant::now(),
            timeout,
            answer,
        };
        let waited = tokio::time::timeout(timeout, async {
            link.send(exchange).await?;
            answered
                .await
                .map_err(|_| "the peer link dropped the request".to_string())?
        })
        .await;
        match waited {
            Ok(outcome) => outcome.map_err(failure),
            Err(_) => Err(failure(format!("no answer within {timeout:?}"))),
        }
    }
}

fn unreachable<E: std::error::Error>(failure: PeerFailure) -> RPCError<PeerId, BasicNode, E> {
    RPCError::Unreachable(Unreachable::new(&failure))
}

fn unexpected<E: std::error::Error>(node: u32, reply: PeerReply) -> RPCError<PeerId, BasicNode, E> {
    let failure = PeerFailure {
        node,
        reason: format!("unexpected answer {reply:?}"),
    };
    RPCError::Network(NetworkError::new(&failure))
}

impl RaftNetwork<TypeConfig> for PeerClient {
    /// How long openraft waits after a peer was unreachable before it sends to it again: one
    /// heartbeat interval. Its default, 500 ms, is over half of the shortest lease (0.9 s): on
    /// a loaded host, two slow answers in a row cost the leader its lease (`peer_link.rs`).
    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(HEARTBEAT_INTERVAL))
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<PeerId>, RPCError<PeerId, BasicNode, RaftError<PeerId>>> {
        match self
            .call(&PeerRequest::AppendEntries(rpc), option.hard_ttl())
            .await
            .map_err(unreachable)?
        {
            PeerReply::AppendEntries(Ok(response)) => Ok(response),
            PeerReply::AppendEntries(Err(error)) => Err(RPCError::RemoteError(RemoteError::new(
                PeerId::from(self.target),
                error,
            ))),
            PeerReply::Malformed(reason) if reason.contains("is not a member of this cluster") => {
                let refusal = format!("node {}: {reason}", self.target);
                *lock(&self.liveness.refused_as_non_member) = Some(refusal);
                Err(unexpected(self.target, PeerReply::Malformed(reason)))
            }
            other => Err(unexpected(self.target, other)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<PeerId>,
        RPCError<PeerId, BasicNode, RaftError<PeerId, InstallSnapshotError>>,
    > {
        match self
            .call(&PeerRequest::InstallSnapshot(rpc), option.hard_ttl())
            .await
            .map_err(unreachable)?
        {
            PeerReply::InstallSnapshot(Ok(response)) => Ok(response),
            PeerReply::InstallSnapshot(Err(error)) => Err(RPCError::RemoteError(RemoteError::new(
                PeerId::from(self.target),
                error,
            ))),
            other => Err(unexpected(self.target, other)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<PeerId>,
        option: RPCOption,
    ) -> Result<VoteResponse<PeerId>, RPCError<PeerId, BasicNode, RaftError<PeerId>>> {
        match self
            .call(&PeerRequest::Vote(rpc), option.hard_ttl())
            .await
            .map_err(unreachable)?
        {
            PeerReply::Vote(Ok(response)) => Ok(response),
            PeerReply::Vote(Err(error)) => Err(RPCError::RemoteError(RemoteError::new(
                PeerId::from(self.target),
                error,
            ))),
            other => Err(unexpected(self.target, other)),
        }
    }
}

impl PeerClient {
    /// A client of the peer `target` at `address` that keeps its connection between calls
    /// (the lease's renewals, every 50 ms).
    pub fn to(target: u32, address: SocketAddr, secret: Arc<[u8]>) -> Self {
        Self {
            target,
            address: Some(address),
            secret,
            liveness: Arc::default(),
            link: None,
        }
    }

    /// The peer this client calls.
    pub fn target(&self) -> u32 {
        self.target
    }

    /// Sends `request` and returns the answer within `timeout`.
    ///
    /// # Errors
    /// The call failed (the connection is reopened by the next call).
    pub async fn ask(
        &mut self,
        request: &PeerRequest,
        timeout: Duration,
    ) -> Result<PeerReply, String> {
        self.call(request, timeout)
            .await
            .map_err(|failure| failure.to_string())
    }
}

/// Asks the node at `address` (the leader) to commit `request` (a join), within `timeout`.
///
/// # Errors
/// The call failed, or the leader refused.
pub async fn ask_leader(
    target: u32,
    address: SocketAddr,
    secret: Arc<[u8]>,
    request: &PeerRequest,
    timeout: Duration,
) -> Result<PeerReply, String> {
    PeerClient::to(target, address, secret)
        .ask(request, timeout)
        .await
}
