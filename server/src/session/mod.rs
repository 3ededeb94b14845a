//! One client session: the HMAC handshake, the client's queue pair and memory windows, heap
//! chunks, heartbeats, and teardown in the order the design fixes.
//!
//! Teardown (disconnect, lease expiry, queue pair ERROR, server shutdown, or any control error):
//!
//! 1. move the queue pair to ERROR;
//! 2. drain it, so no request of this client is executing;
//! 3. invalidate its memory windows (its rkeys now fail with REM_ACCESS_ERR);
//! 4. destroy the queue pair;
//! 5. seal its chunks, which the collector reclaims once nothing references them.
//!
//! A file per role: `handshake` (authentication, the queue pair, the window binds), `serve`
//! (control requests, heartbeats, chunks, lease and queue pair checks), `teardown` (the order
//! above); here, the session's loop. What every session shares is the node's state
//! (`crate::node`); a session knows the attachment (fabric) its client came through.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkv_common::protocol::{read_frame, write_frame, ClientMessage, ServerMessage};
use rdkv_common::ControlError;
use rdkv_fabric::{MemoryWindow, QueuePair};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::gate::Pass;
use crate::node::{Attachment, Node, MAIN_ATTACHMENT, SEND_QUEUE_DEPTH};

mod handshake;
mod heap_hold;
mod serve;
mod teardown;

/// How long a client has for each handshake step.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a connection checks its lease and its queue pair.
const CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Why a reconciling node (`ViewService::reconciling`) admits no data client.
const RECONCILING: &str = "the cluster is reconciling: every node is filling or resuming (all were stopped or crashed), and none serves until the members are back and agree on the newest copy of each key (`rdkv-cluster status` shows what they wait for); try again in a few seconds";

/// Serves one control connection until it ends, then tears its resources down.
pub(crate) async fn serve(
    node: Arc<Node>,
    stream: TcpStream,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let connection_id = node.next_connection.fetch_add(1, Ordering::Relaxed);
    let span = tracing::info_span!("connection", node = node.config.node_id, connection = connection_id, %peer);
    async move {
        node.counters.connections.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let mut session = Session {
            node: node.clone(),
            connection_id,
            queue_pair: None,
            windows: Vec::new(),
            chunk_window: None,
            pass: node.gate.enter_connection(connection_id, peer),
            slot: None,
            monitor: false,
            attachment: MAIN_ATTACHMENT,
            view_at_connect: None,
            routes_by_view: false,
            refill_peer: false,
        };
        // Unauthenticated until proven: a handshake that a newer connection evicts ends.
        let evict = shutdown.child_token();
        // A duplicate of the socket lets eviction see bytes that wait unread.
        let socket = std::os::fd::AsFd::as_fd(&stream)
            .try_clone_to_owned()
            .ok()
            .map(std::net::TcpStream::from);
        let spoke = node
            .pending
            .admit(connection_id, peer.ip(), evict.clone(), socket);
        let reason = session.run(stream, shutdown, evict, spoke).await;
        node.pending.settle(connection_id);
        node.counters.connections.fetch_sub(1, Ordering::Relaxed);
        let quiet = [
            crate::Error::ClientDisconnected.to_string(),
            crate::Error::Evicted.to_string(),
            // A monitor that closed without a goodbye, after its handshake.
            serve::DISCONNECTED.to_string(),
        ];
        if session.slot.is_some() && !session.monitor {
            // A client's connection: counted in the summary line a minute.
            node.connection_summary.closed();
        }
        if session.monitor {
            // A stats poll (`status`, `rdkv stats`, a peer's view fetch), however it ended: its
            // program prints what went wrong.
            tracing::debug!(%reason, "connection closed");
        } else if session.slot.is_some() && !session.monitor {
            // A client's connection: in the summary line a minute, and here at DEBUG.
            tracing::debug!(%reason, "connection closed");
        } else if session.slot.is_some() || reason == crate::Error::ShuttingDown.to_string() {
            // A shutdown's cancelled handshakes are logged each: the operator caused them, once.
            tracing::info!(%reason, "connection closed");
        } else if !quiet.contains(&reason) {
            // Garbage, a wrong secret, a handshake that ran out of time: anyone who reaches
            // the port can cause these at will, so at most a line a second says so (the
            // counters, `authentication_failures` among them, count every one).
            if let Some(left_out) = node.unauthenticated_ends.take() {
                tracing::info!(%reason, left_out, "connection closed before authenticating (at most a line a second: left_out counts the others since the last)");
            }
        } else {
            // A port probe (`rdkv-cluster up`'s readiness check, a load balancer): not news.
            tracing::debug!("connection closed before it said anything");
        }
    }
    .instrument(span)
    .await;
}

/// One connection's server-side resources.
struct Session {
    /// The node's state.
    node: Arc<Node>,
    /// This connection's id.
    connection_id: u64,
    /// The client's queue pair, created only after authentication.
    queue_pair: Option<QueuePair>,
    /// Index and heap READ windows and the announce word's WRITE window, bound to the queue
    /// pair.
    windows: Vec<MemoryWindow>,
    /// The client's current chunk and the WRITE window over it. When the chunk is sealed, the
    /// window goes to the heap, which revokes it once the chunk's writers are done.
    chunk_window: Option<(u64, MemoryWindow)>,
    /// This connection's pass through the server's gate, naming its step.
    pass: Pass,
    /// Its authenticated slot (`crate::pending`), held until the session is dropped, after its
    /// teardown: present once the client proved the secret.
    slot: Option<crate::pending::AuthenticatedSlot>,
    /// A session without a queue pair (`Purpose::Monitor`, `Purpose::Peer`): logged at debug
    /// level.
    monitor: bool,
    /// The node's attachment (`Node::attachments`) the client came through: the fabric its
    /// queue pair, windows and announce word are on.
    attachment: usize,
    /// The view the data connection was made under (its welcome names the epoch); it is
    /// fenced when a later view moves keys.
    view_at_connect: Option<crate::view::types::ViewState>,
    /// Whether the client routes by the cluster view (a cluster client): a filling node
    /// refuses a data client that does not.
    routes_by_view: bool,
    /// Whether the connection is a peer node's refill or reconciliation scan
    /// (`Purpose::Refill`): the only data connection a reconciling node admits.
    refill_peer: bool,
}

/// An error and its causes on one line, for the session's end reason.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        // A cause some error above already printed in its own message is not repeated.
        let text = next.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = next.source();
    }
    line
}

/// Reads frames on its own task, so the session's select loop stays cancellation-safe.
async fn read_messages(
    mut reader: OwnedReadHalf,
    messages: mpsc::Sender<Result<ClientMessage, ControlError>>,
    spoke: Arc<AtomicBool>,
) {
    loop {
        let message = read_frame::<_, ClientMessage>(&mut reader).await;
        let stop = message.is_err();
        if !stop {
            // No longer a silent connection: eviction spares it (`crate::pending`).
            spoke.store(true, Ordering::Release);
        }
        if messages.send(message).await.is_err() || stop {
            return;
        }
    }
}

impl Session {
    /// The attachment the client came through.
    fn attachment(&self) -> &Attachment {
        self.node.attachment(self.attachment)
    }

    async fn run(
        &mut self,
        stream: TcpStream,
        shutdown: CancellationToken,
        evict: CancellationToken,
        spoke: Arc<AtomicBool>,
    ) -> String {
        let (reader, mut writer) = stream.into_split();
        let (sender, mut messages) = mpsc::channel(16);
        let reader_task = tokio::spawn(read_messages(reader, sender, spoke));
        // A shutdown does not wait for a slow client's handshake, nor does a newer
        // unauthenticated connection (`crate::pending`); the whole handshake has a deadline.
        let handshake = tokio::select! {
            _ = evict.cancelled() => Err(if shutdown.is_cancelled() {
                crate::Error::ShuttingDown
            } else {
                crate::Error::Evicted
            }),
            _ = tokio::time::sleep(self.node.config.limits.handshake_deadline) => {
                Err(crate::Error::HandshakeTimedOut { timeout: self.node.config.limits.handshake_deadline })
            }
            outcome = self.handshake(&mut writer, &mut messages) => outcome,
        };
        if matches!(handshake, Err(crate::Error::HandshakeTimedOut { .. })) {
            self.node
                .counters
                .handshakes_timed_out
                .fetch_add(1, Ordering::Relaxed);
        }
        let reason = match handshake {
            Ok(()) => {
                self.pass.step("serving");
                self.serve_requests(&mut writer, &mut messages, &shutdown)
                    .await
            }
            Err(error) => with_causes(&error),
        };
        // Tear down before the socket closes, so a client that sees the close knows its keys
        // are already revoked.
        self.pass
            .step("teardown: queue pair to ERROR, drain, revoke keys");
        self.teardown().await;
        reader_task.abort();
        let _ = reader_task.await;
        drop(writer);
        reason
    }

    async fn next_message(
        messages: &mut mpsc::Receiver<Result<ClientMessage, ControlError>>,
    ) -> Result<ClientMessage, crate::Error> {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, messages.recv()).await {
            Err(_) => Err(crate::Error::HandshakeTimedOut {
                timeout: HANDSHAKE_TIMEOUT,
            }),
            Ok(None) | Ok(Some(Err(ControlError::Closed))) => Err(crate::Error::ClientDisconnected),
            // A peer that closes with our challenge unread resets the connection: a port
            // probe, as much as a close.
            Ok(Some(Err(ControlError::Io(error))))
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                ) =>
            {
                Err(crate::Error::ClientDisconnected)
            }
            Ok(Some(Err(source))) => Err(crate::Error::BadFrame { source }),
            Ok(Some(Ok(message))) => Ok(message),
        }
    }

    async fn send(
        writer: &mut OwnedWriteHalf,
        message: &ServerMessage,
    ) -> Result<(), crate::Error> {
        write_frame(writer, message)
            .await
            .map_err(|source| crate::Error::Send { source })
    }

    /// Tells the client why it is refused (best effort) and returns the error for the log.
    async fn refuse(writer: &mut OwnedWriteHalf, reason: String) -> crate::Error {
        let _ = Self::send(
            writer,
            &ServerMessage::Refused {
                reason: reason.clone(),
            },
        )
        .await;
        crate::Error::Refused { reason }
    }
}
