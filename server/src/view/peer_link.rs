//! A node's link to one peer for the view's messages (Raft's, lease requests, pre-votes,
//! joins): a task that owns the authenticated connection and exchanges one request at a time
//! on it, answered in order.
//!
//! A caller waits for its answer only as long as it chose (openraft gives an `AppendEntries`
//! one heartbeat interval, 100 ms), but the link waits longer: at least [`ANSWER_WAIT`]. An
//! answer that comes late still counts as a sign of life ([`Liveness`]), and the connection
//! stays open for the next request. Before the link, a caller's timeout ended the exchange,
//! dropped the connection (or, when openraft's own timer cancelled the call, left it one
//! answer out of step), and the next call first had to reconnect and authenticate, within that
//! same 100 ms. On a loaded host (load average 8 on 2 cores) one slow answer so became a run
//! of failed heartbeats, and the leader's lease, which counts from the newest heartbeat a
//! majority accepted, lapsed on every node at once (`docs/operations.md`, *Leases under
//! load*).
//!
//! A request whose caller gave up before the link could send it is not sent: a heartbeat that
//! late is no use, and skipping it lets the link catch up.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::raft::AppendEntriesResponse;
use rdkv_common::protocol::{MonitoredNode, PeerConnection};
use tokio::sync::{mpsc, oneshot};

use super::network::Liveness;
use super::types::PeerReply;

/// The shortest time the link waits to connect, or for an answer, whatever its caller's
/// timeout: the shortest `failure_timeout`. An answer within it still tells the leader that its
/// follower accepted a heartbeat (its lease counts from when that heartbeat was sent).
pub const ANSWER_WAIT: Duration = Duration::from_secs(1);

/// Requests queued on a link: openraft sends one at a time per peer, and the lease's and the
/// election's clients do too, so more than a few means the link is behind.
const QUEUED_REQUESTS: usize = 4;

/// One request for the link.
#[derive(Debug)]
pub struct Exchange {
    /// The encoded `PeerRequest`.
    pub payload: Vec<u8>,
    /// When the caller asked: an accepted `AppendEntries` counts from then.
    pub sent: Instant,
    /// The caller's timeout: the link waits at least this long, and at least
    /// [`ANSWER_WAIT`].
    pub timeout: Duration,
    /// Where the answer goes; closed when the caller gave up.
    pub answer: oneshot::Sender<Result<PeerReply, String>>,
}

/// The link's end that callers hold: dropping it ends the task once its current exchange is
/// done.
#[derive(Debug)]
pub struct PeerLink {
    /// The requests for the task.
    requests: mpsc::Sender<Exchange>,
}

/// Who the link talks to, and what it records.
#[derive(Debug)]
pub struct LinkTarget {
    /// The peer's id.
    pub node: u32,
    /// Its control address.
    pub address: SocketAddr,
    /// The cluster secret.
    pub secret: Arc<[u8]>,
    /// Answers seen, recorded even when their caller gave up.
    pub liveness: Arc<Liveness>,
}

impl PeerLink {
    /// Starts the link's task on the current tokio runtime.
    pub fn start(target: LinkTarget) -> Self {
        let (requests, queued) = mpsc::channel(QUEUED_REQUESTS);
        tokio::spawn(run(target, queued));
        Self { requests }
    }

    /// Queues `exchange`, waiting while the queue is full; `Err` when the task has ended.
    ///
    /// # Errors
    /// The link's task is gone (the runtime is shutting down).
    pub async fn send(&self, exchange: Exchange) -> Result<(), String> {
        self.requests
            .send(exchange)
            .await
            .map_err(|_| "the peer link has stopped".to_string())
    }
}

/// The link's task: one exchange at a time, until every [`PeerLink`] handle is dropped.
async fn run(target: LinkTarget, mut queued: mpsc::Receiver<Exchange>) {
    let mut connection: Option<PeerConnection> = None;
    while let Some(exchange) = queued.recv().await {
        let Exchange {
            payload,
            sent,
            timeout,
            answer,
        } = exchange;
        if answer.is_closed() {
            continue;
        }
        let wait = timeout.max(ANSWER_WAIT);
        let outcome = exchange_once(&target, &mut connection, payload, wait).await;
        match &outcome {
            Ok(reply) => record(&target, reply, sent),
            Err(_) => connection = None,
        }
        let _gone = answer.send(outcome);
    }
}

/// Sends `payload` on `connection` (opened first if needed) and decodes its answer, all within
/// `wait`. After an error the caller drops the connection: it may be out of step.
async fn exchange_once(
    target: &LinkTarget,
    connection: &mut Option<PeerConnection>,
    payload: Vec<u8>,
    wait: Duration,
) -> Result<PeerReply, String> {
    let started = Instant::now();
    if connection.is_none() {
        let node = MonitoredNode {
            address: target.address,
            id: Some(target.node),
            secret: &target.secret,
        };
        let opened = PeerConnection::open(node, wait)
            .await
            .map_err(|error| error.to_string())?;
        *connection = Some(opened);
    }
    let remaining = wait
        .saturating_sub(started.elapsed())
        .max(Duration::from_millis(1));
    let Some(open) = connection.as_mut() else {
        return Err("no connection".into());
    };
    let answer = open
        .request(payload, remaining)
        .await
        .map_err(|error| error.to_string())?;
    bincode::deserialize(&answer).map_err(|error| format!("undecodable answer: {error}"))
}

/// Records what `reply` says of the peer: alive when its Raft answered (an error, such as a
/// Raft stopped on a fatal error or a refusal, is no sign of life), and an `AppendEntries`
/// sent at `sent` accepted unless it saw a newer leader.
fn record(target: &LinkTarget, reply: &PeerReply, sent: Instant) {
    let answered = matches!(
        reply,
        PeerReply::AppendEntries(Ok(_))
            | PeerReply::Vote(Ok(_))
            | PeerReply::InstallSnapshot(Ok(_))
            | PeerReply::Join(Ok(_))
    );
    if answered {
        target.liveness.heard(target.node);
    }
    if let PeerReply::AppendEntries(Ok(response)) = reply {
        if !matches!(response, AppendEntriesResponse::HigherVote(_)) {
            target.liveness.accepted(target.node, sent);
        }
    }
}
