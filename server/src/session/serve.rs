//! Serving an established session: control requests (chunks, stats, goodbye), heartbeats,
//! and the lease and queue pair checks.

use std::sync::atomic::Ordering;
use std::time::Instant;

use rdkv_common::protocol::{ClientMessage, ServerMessage};
use rdkv_common::ControlError;
use rdkv_fabric::{AccessFlags, QueuePairState};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::*;

/// The reason a session ends when its client says goodbye.
pub(super) const GOODBYE: &str = "client said goodbye";
/// Why a session ends whose client closed without a goodbye.
pub(super) const DISCONNECTED: &str = "client disconnected";

/// How long a fence's notice may wait for room in the client's socket: the queue pair is in
/// ERROR already, so a client that does not read only misses the notice.
const NOTICE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(20);

impl Session {
    /// At a fence: the queue pair to ERROR before anything else (its requests flush and the
    /// responder stops), so that a notice the client does not read cannot hold it open (found
    /// by review); the ordered teardown follows.
    fn stop_answering(&self) {
        if let Some(queue_pair) = &self.queue_pair {
            queue_pair.modify_to_error();
        }
    }

    /// The node stopped serving data (`reason`): the queue pair to ERROR, the client told (best
    /// effort); returns why the session ends.
    async fn fence_not_serving(&self, writer: &mut OwnedWriteHalf, reason: String) -> String {
        self.node
            .counters
            .connections_fenced
            .fetch_add(1, Ordering::Relaxed);
        let epoch = self.node.view.epoch();
        self.stop_answering();
        let notice = ServerMessage::NotServing {
            epoch,
            reason: reason.clone(),
        };
        let _ = Self::send_notice(writer, &notice).await;
        format!("fenced: this node stopped serving data ({reason})")
    }

    /// The connection held the heap's reuse back, silent, under pressure (`heap_hold.rs`):
    /// the queue pair to ERROR at once; the ordered teardown that follows releases its
    /// announce word only after the drain. No notice: the client is stopped or hung; when it
    /// runs again its requests fail, and it reconnects. Returns why the session ends.
    fn fence_heap_hold(&self, hold: super::heap_hold::Hold, limit: std::time::Duration) -> String {
        self.node
            .counters
            .heap_fences
            .fetch_add(1, Ordering::Relaxed);
        self.stop_answering();
        tracing::warn!(
            connection = self.connection_id,
            started = hold.started,
            quiescent = hold.quiescent,
            silent_ms = hold.silent_for.as_millis() as u64,
            limit_ms = limit.as_millis() as u64,
            "fenced a connection that held heap reuse back: its oldest operation in flight unfinished past heap_hold_limit with the heap under pressure, or past operation_deadline (a stopped or hung client; it reconnects)"
        );
        format!(
            "fenced: held heap reuse back, operation {} unfinished for {:?} ({}..={} in flight)",
            hold.quiescent + 1,
            hold.silent_for,
            hold.quiescent + 1,
            hold.started
        )
    }

    /// A fence's notice: best effort, within [`NOTICE_TIMEOUT`].
    async fn send_notice(
        writer: &mut OwnedWriteHalf,
        message: &ServerMessage,
    ) -> Result<(), crate::Error> {
        match tokio::time::timeout(NOTICE_TIMEOUT, Self::send(writer, message)).await {
            Ok(sent) => sent,
            Err(_) => Err(crate::Error::ClientDisconnected),
        }
    }
}

impl Session {
    pub(super) async fn serve_requests(
        &mut self,
        writer: &mut OwnedWriteHalf,
        messages: &mut mpsc::Receiver<Result<ClientMessage, ControlError>>,
        shutdown: &CancellationToken,
    ) -> String {
        let node = self.node.clone();
        let mut last_heard = Instant::now();
        let mut checks = tokio::time::interval(CHECK_INTERVAL);
        let mut hold_watch = super::heap_hold::HoldWatch::new(Instant::now());
        // A data connection is fenced when the view moves keys (a member down, filling or
        // promoted): every access made under the old view then fails, and its client fetches
        // the view (`docs/protocol.md`, *Views and fencing*).
        let mut view_changes = node.view.subscribe().filter(|_| self.queue_pair.is_some());
        let connected_under = self.view_at_connect.clone();
        // A data connection is also fenced when the node stops serving data (no lease, or the
        // view has it down): `crate::view`'s `lease.rs`.
        let mut serving = self
            .queue_pair
            .as_ref()
            .map(|_| node.view.serving_changes());
        loop {
            if let Some(Err(reason)) = serving
                .as_mut()
                .map(|serving| serving.borrow_and_update().clone())
            {
                return self.fence_not_serving(writer, reason).await;
            }
            let serving_changed = async {
                match serving.as_mut() {
                    Some(changes) => {
                        if changes.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            let view_changed = async {
                match view_changes.as_mut() {
                    Some(changes) => changes.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return "server shutting down".into(),
                () = serving_changed => continue,
                alive = view_changed => {
                    let (Some(changes), Some(before)) = (view_changes.as_ref(), connected_under.as_ref()) else {
                        continue;
                    };
                    if !alive {
                        view_changes = None;
                        continue;
                    }
                    let now = changes.borrow().clone();
                    if now.placement_differs(before) {
                        node.counters.connections_fenced.fetch_add(1, Ordering::Relaxed);
                        // The client reads it as the answer to its next request (a heartbeat
                        // at the latest), and learns the epoch.
                        self.stop_answering();
                        let _ = Self::send_notice(writer, &ServerMessage::Fenced { epoch: now.epoch }).await;
                        return format!("fenced: the cluster view moved keys (epoch {})", now.epoch);
                    }
                }
                _ = checks.tick() => {
                    if let Some(reason) = self.periodic_check(last_heard, &mut hold_watch) {
                        return reason;
                    }
                }
                message = messages.recv() => {
                    let message = match message {
                        None | Some(Err(ControlError::Closed)) => return DISCONNECTED.into(),
                        Some(Err(error)) => return format!("bad frame: {error}"),
                        Some(Ok(message)) => message,
                    };
                    last_heard = Instant::now();
                    node.counters.control_messages.fetch_add(1, Ordering::Relaxed);
                    let reply = match self.answer(message, writer, shutdown).await {
                        Ok(reply) => reply,
                        Err(reason) => return reason,
                    };
                    if let Err(error) = Self::send(writer, &reply).await {
                        return with_causes(&error);
                    }
                }
            }
        }
    }

    /// The checks made every [`CHECK_INTERVAL`]: the lease (`last_heard`), the queue pair's
    /// state, and whether the connection holds the heap (`heap_hold.rs`). `Some`: why the
    /// session ends.
    fn periodic_check(
        &self,
        last_heard: Instant,
        hold_watch: &mut super::heap_hold::HoldWatch,
    ) -> Option<String> {
        let lease = self.node.config.lease_timeout;
        if last_heard.elapsed() > lease {
            return Some(format!("lease expired (nothing heard for {lease:?})"));
        }
        let queue_pair = self.queue_pair.as_ref()?;
        if queue_pair.state() == QueuePairState::Error {
            return Some("queue pair entered ERROR".into());
        }
        if !self.refill_peer && self.node.view.reconciling() {
            // Every member fills (the last serving one went): no read or write until the
            // filling members agree on the newest copy of each key.
            return Some(format!("fenced: {RECONCILING}"));
        }
        let limit = self.node.config.heap_hold_limit();
        let hold = hold_watch.check(&self.node, self.connection_id, limit, Instant::now())?;
        Some(self.fence_heap_hold(hold, limit))
    }

    /// The reply to one control request after the handshake, or why the session ends.
    async fn answer(
        &mut self,
        message: ClientMessage,
        writer: &mut OwnedWriteHalf,
        shutdown: &CancellationToken,
    ) -> Result<ServerMessage, String> {
        let node = self.node.clone();
        Ok(match message {
            ClientMessage::AllocateChunk { started, needed } if self.queue_pair.is_some() => {
                self.allocate_chunk(started, needed)
            }
            ClientMessage::Heartbeat { counters } => {
                node.counters.add_client_report(&counters);
                ServerMessage::HeartbeatAck {
                    epoch: node.view.epoch(),
                    node_clock_ms: node.view.clock().now_ms(),
                }
            }
            ClientMessage::Stats => {
                let keys = node.exact_keys().await;
                ServerMessage::Stats(Box::new(node.stats(keys)))
            }
            ClientMessage::Shutdown => {
                tracing::info!("shutdown requested over the control plane");
                let goodbye = ServerMessage::ShuttingDown {
                    node_id: node.config.node_id,
                };
                let _ = Self::send(writer, &goodbye).await;
                // Out of the view first, so its keys move at once (`view/leave.rs`).
                node.view.leave().await;
                shutdown.cancel();
                return Err("it asked the node to shut down".into());
            }
            ClientMessage::StopCluster => match node.view.stop_cluster().await {
                Ok(epoch) => {
                    tracing::info!(
                        epoch,
                        "the whole cluster stops (asked over the control plane)"
                    );
                    ServerMessage::ClusterStopped { epoch }
                }
                Err(reason) => ServerMessage::Refused {
                    reason: format!("the cluster's stop was not committed: {reason}"),
                },
            },
            ClientMessage::Snapshot => crate::persistence::snapshot_on_request(&node).await,
            ClientMessage::ChangeMembership(change) => {
                match node.view.change_membership(change.clone()).await {
                    Ok(epoch) => {
                        tracing::info!(?change, epoch, "membership change committed");
                        ServerMessage::MembershipChanged { epoch }
                    }
                    Err(reason) => ServerMessage::Refused {
                        reason: format!("the membership change was not committed: {reason}"),
                    },
                }
            }
            ClientMessage::AcknowledgeLosses { up_to_epoch } => {
                match node.view.acknowledge_losses(up_to_epoch).await {
                    Ok(cleared) => {
                        tracing::warn!(
                            up_to_epoch,
                            cleared,
                            "loss records acknowledged (over the control plane)"
                        );
                        ServerMessage::LossesAcknowledged { cleared }
                    }
                    Err(reason) => ServerMessage::Refused {
                        reason: format!("the acknowledgement was not committed: {reason}"),
                    },
                }
            }
            ClientMessage::Goodbye => return Err(GOODBYE.into()),
            ClientMessage::FetchView => ServerMessage::View(node.view.current()),
            ClientMessage::Peer { payload } => ServerMessage::Peer {
                payload: node.view.handle_peer(&payload).await,
            },
            other => {
                let reason = format!("unexpected message after the handshake: {}", other.kind());
                return Err(Self::refuse(writer, reason).await.to_string());
            }
        })
    }

    /// Seals the client's grant (its operations up to `started` may still be writing there)
    /// and hands it a new one with room for `needed` bytes (`heap.rs` sizes it).
    fn allocate_chunk(&mut self, started: u64, needed: u64) -> ServerMessage {
        let node = &self.node;
        // A writer: its old grant is sealed, or it waits for reclamation.
        node.collector.wake();
        let Some(queue_pair) = &self.queue_pair else {
            return ServerMessage::Refused {
                reason: "no queue pair".into(),
            };
        };
        if needed > node.heap.chunk_size() {
            return ServerMessage::Refused {
                reason: format!(
                    "a block of {needed} bytes is larger than a chunk ({} bytes)",
                    node.heap.chunk_size()
                ),
            };
        }
        let Some(grant) = node.heap.allocate(self.connection_id, started, needed) else {
            return ServerMessage::ChunkUnavailable {
                reclaimable: node
                    .heap
                    .reclaimable_extents(crate::compactor::live_share_now(&node.heap)),
                reason: format!(
                    "heap full: {} of {} MiB in use or waiting to be reclaimed; raise heap_size (docs/operations.md, Sizing the heap: 2 x live data + (writers + 2) chunks + 0.25 s of writes)",
                    mebibytes(node.heap.used_bytes()),
                    mebibytes(node.heap.size_bytes()),
                ),
            };
        };
        // The old grant is sealed: its window goes to the heap, revoked when its writers are
        // done.
        if let Some((sealed, window)) = self.chunk_window.take() {
            node.heap.keep_window(sealed, window);
        }
        let table = &self.attachment().table;
        let window = table.domain.allocate_memory_window();
        match queue_pair.bind_memory_window(
            &window,
            &table.region,
            table.heap_address() + grant.heap_offset(),
            grant.length(),
            AccessFlags::REMOTE_WRITE,
        ) {
            Ok(key) => {
                self.chunk_window = Some((grant.first_extent, window));
                ServerMessage::Chunk {
                    heap_offset: grant.heap_offset(),
                    key,
                }
            }
            Err(error) => ServerMessage::Refused {
                reason: format!("bind chunk window: {error}"),
            },
        }
    }
}

/// Bytes as MiB with one decimal, for messages.
fn mebibytes(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}
