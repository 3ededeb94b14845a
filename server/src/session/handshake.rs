//! The handshake: challenge, HMAC proof, then (only for an authenticated client) the queue
//! pair, the welcome and the window binds (`docs/protocol.md`, *Handshake*).

use std::sync::atomic::Ordering;

use rand::RngCore;
use rdkv_common::protocol::{
    verify_proof, ClientMessage, ConnectionKeys, Purpose, ServerMessage, Welcome, ANNOUNCE_SIZE,
    PROOF_LENGTH, PROTOCOL_VERSION,
};
use rdkv_common::ControlError;
use rdkv_fabric::{AccessFlags, QueuePairConfig};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;

use super::*;
use crate::pending::{Refusal, SlotClass};

/// Messages from the client, as the reader task delivers them.
type Messages = mpsc::Receiver<Result<ClientMessage, ControlError>>;

impl Session {
    /// The whole handshake: authenticate; a monitoring client is done there; a data client
    /// then gets its queue pair (welcome) and, once connected, its keys.
    pub(super) async fn handshake(
        &mut self,
        writer: &mut OwnedWriteHalf,
        messages: &mut Messages,
    ) -> Result<(), crate::Error> {
        if !self.authenticate(writer, messages).await?.is_data() {
            return Self::send(
                writer,
                &ServerMessage::MonitorReady {
                    node_id: self.node.config.node_id,
                },
            )
            .await;
        }
        self.welcome(writer).await?;
        self.connect_and_bind(writer, messages).await
    }

    /// Challenge, proof, version check; returns the client's purpose. Nothing is created
    /// before this succeeds.
    async fn authenticate(
        &mut self,
        writer: &mut OwnedWriteHalf,
        messages: &mut Messages,
    ) -> Result<Purpose, crate::Error> {
        let node = self.node.clone();
        self.pass.step("handshake: waiting for Authenticate");
        let mut nonce = [0u8; PROOF_LENGTH];
        rand::thread_rng().fill_bytes(&mut nonce);
        Self::send(
            writer,
            &ServerMessage::Challenge {
                protocol_version: PROTOCOL_VERSION,
                nonce,
                node_id: node.config.node_id,
                shm_socket: node.same_host_socket(),
            },
        )
        .await?;
        let ClientMessage::Authenticate {
            protocol_version,
            purpose,
            proof,
            client_name,
            shared_memory,
            routes_by_view,
        } = Self::next_message(messages).await?
        else {
            return Err(crate::Error::UnexpectedMessage {
                expected: "Authenticate as the first message",
            });
        };
        if protocol_version != PROTOCOL_VERSION {
            let reason = format!(
                "protocol version mismatch: the server speaks {PROTOCOL_VERSION}, the client {protocol_version}; upgrade the older side"
            );
            return Err(Self::refuse(writer, reason).await);
        }
        if !verify_proof(&node.config.secret, node.config.node_id, &nonce, &proof) {
            node.counters
                .authentication_failures
                .fetch_add(1, Ordering::Relaxed);
            let reason =
                "authentication failed: the client's secret does not match this node's; use the same `secret` (or secret file) as the cluster file the node started from"
                    .to_string();
            return Err(Self::refuse(writer, reason).await);
        }
        let client_name = rdkv_common::protocol::loggable_client_name(&client_name);
        let slot = match node
            .pending
            .authenticate(self.connection_id, slot_class(purpose))
        {
            Ok(slot) => slot,
            // A newer connection evicted this one while its Authenticate was on the way:
            // end now, before the welcome (the client retries a close during authentication).
            Err(Refusal::Evicted) => return Err(crate::Error::Evicted),
            Err(Refusal::Full { max_connections }) => {
                let reason = format!(
                    "the node is full: {max_connections} authenticated connections are open (cluster.max_connections; monitors and peers have reserves of their own); close idle clients or raise max_connections"
                );
                return Err(Self::refuse(writer, reason).await);
            }
        };
        let open = slot.open_of_its_class();
        if purpose == Purpose::Lane && open > node.config.max_connections.div_ceil(2) {
            // Extra lanes take at most half the node: the rest stays for first connections,
            // which would otherwise be refused as the node filled with another client's lanes.
            node.counters.lanes_refused.fetch_add(1, Ordering::Relaxed);
            drop(slot);
            let reason = format!(
                "no room for an extra lane: {open} of max_connections {} are open, and extra lanes take at most half (the client's first connection serves)",
                node.config.max_connections
            );
            return Err(Self::refuse(writer, reason).await);
        }
        self.slot = Some(slot);
        // A client that asks for shared memory where none is offered gets the main fabric:
        // the welcome's endpoint says which.
        self.attachment = node
            .same_host_attachment()
            .filter(|_| shared_memory)
            .unwrap_or(MAIN_ATTACHMENT);
        self.routes_by_view = routes_by_view;
        self.refill_peer = purpose == Purpose::Refill;
        let fabric = self.attachment().device().backend();
        self.monitor = matches!(purpose, Purpose::Monitor | Purpose::Peer);
        // Not news one by one: monitors poll often, and clients' connections are counted in
        // a line a minute (`crate::connection_summary`).
        tracing::debug!(%client_name, ?purpose, %fabric, "client authenticated");
        if !self.monitor {
            node.connection_summary.opened();
        }
        Ok(purpose)
    }

    /// Creates the client's queue pair (INIT) and sends the welcome with its endpoint. Only an
    /// authenticated client gets here.
    async fn welcome(&mut self, writer: &mut OwnedWriteHalf) -> Result<(), crate::Error> {
        let node = self.node.clone();
        let serving = node.view.serving().and_then(|()| {
            if node.view.filling() && !self.routes_by_view {
                Err("this node is filling (being refilled after a restart or an absence) and its table is partial: connect with a cluster client (the cluster file), which reads the key's serving copy".to_string())
            } else if !self.refill_peer && node.view.reconciling() {
                Err(RECONCILING.to_string())
            } else {
                Ok(())
            }
        });
        if let Err(reason) = serving {
            // Cut off from the cluster's majority, down in the view, or restarted and not
            // rejoined yet: the client goes to another copy (`docs/protocol.md`, *Views and
            // fencing*).
            node.counters
                .connections_refused_not_serving
                .fetch_add(1, Ordering::Relaxed);
            let message = ServerMessage::NotServing {
                epoch: node.view.epoch(),
                reason: reason.clone(),
            };
            let _ = Self::send(writer, &message).await;
            return Err(crate::Error::Refused {
                reason: format!("not serving data: {reason}"),
            });
        }
        if !node.view.reconciling() {
            // A client's writes, or a refill's, may reach the table from now on: the snapshot
            // it loaded no longer describes it (`crate::reconcile`).
            node.snapshots.table_touched();
        }
        self.pass.step("handshake: creating the queue pair");
        let attachment = node.attachment(self.attachment);
        let table = &attachment.table;
        let queue_pair = table
            .domain
            .create_queue_pair(
                &attachment.completion_queue,
                QueuePairConfig {
                    max_send_wr: SEND_QUEUE_DEPTH,
                },
            )
            .map_err(|source| self.setup_failed("create the queue pair", source))?;
        queue_pair
            .modify_to_init()
            .map_err(|source| self.setup_failed("move the queue pair to INIT", source))?;
        self.view_at_connect = node
            .view
            .subscribe()
            .map(|changes| changes.borrow().clone());
        let welcome = Welcome {
            view_epoch: node.view.epoch(),
            node_clock_ms: node.view.clock().now_ms(),
            connection_id: self.connection_id,
            geometry: table.geometry,
            server_endpoint: queue_pair.endpoint(),
            lease_timeout_ms: node.config.lease_timeout.as_millis() as u64,
            operation_deadline_ms: node.config.operation_deadline.as_millis() as u64,
        };
        self.queue_pair = Some(queue_pair);
        attachment.data_connections.fetch_add(1, Ordering::Relaxed);
        Self::send(writer, &ServerMessage::Welcome(Box::new(welcome))).await
    }

    /// Connects the queue pair to the client's endpoint (RTR, RTS), binds the client's windows
    /// to it ([`Session::bind_windows`]), and sends the keys.
    async fn connect_and_bind(
        &mut self,
        writer: &mut OwnedWriteHalf,
        messages: &mut Messages,
    ) -> Result<(), crate::Error> {
        self.pass.step("handshake: waiting for ConnectQueuePair");
        let ClientMessage::ConnectQueuePair { endpoint } = Self::next_message(messages).await?
        else {
            return Err(crate::Error::UnexpectedMessage {
                expected: "ConnectQueuePair after Welcome",
            });
        };
        // Clients only dial: a soft endpoint naming an address would make this node dial it
        // (anywhere the client chose), so it is refused.
        if let rdkv_fabric::QueuePairEndpoint::Soft(soft) = &endpoint {
            if let Some(address) = soft.address {
                return Err(Self::refuse(
                    writer,
                    format!(
                        "a client's soft endpoint must not name a listen address (it named {address}): clients dial the node"
                    ),
                )
                .await);
            }
        }
        let Some(queue_pair) = &self.queue_pair else {
            // `welcome` created it and only the teardown takes it.
            return Err(crate::Error::UnexpectedMessage {
                expected: "Authenticate (this session has no queue pair)",
            });
        };
        self.pass.step("handshake: connecting the queue pair");
        queue_pair
            .connect(&endpoint)
            .await
            .map_err(|source| self.setup_failed("connect the queue pair", source))?;
        let keys = match self.bind_windows() {
            Ok(keys) => keys,
            Err(BindFailure::NoAnnounceWord) => {
                let held = self.node.counters.connections_held.load(Ordering::Relaxed);
                let reason = if held > 0 {
                    format!(
                        "no announce word free: max_connections ({}) reached, {held} of them kept for clients stopped inside a request (resume or kill those processes: rdkv_connections_held)",
                        self.node.config.max_connections
                    )
                } else {
                    format!(
                        "no announce word free: {} data connections are open (max_connections)",
                        self.node.config.max_connections
                    )
                };
                return Err(Self::refuse(writer, reason).await);
            }
            Err(BindFailure::Setup(error)) => return Err(error),
        };
        Self::send(writer, &ServerMessage::QueuePairReady(keys)).await
    }

    /// Binds the client's windows to its connected queue pair (a type-2 bind is a work request
    /// on the send queue, so only in RTS), each over the attachment's registration: the index
    /// and heap READ windows, the announce word's WRITE window, the lease word's READ window.
    fn bind_windows(&mut self) -> Result<ConnectionKeys, BindFailure> {
        self.pass.step("handshake: binding memory windows");
        let node = self.node.clone();
        let attachment = node.attachment(self.attachment);
        let table = &attachment.table;
        let connection_id = self.connection_id;
        let Some(queue_pair) = &self.queue_pair else {
            return Err(BindFailure::Setup(crate::Error::UnexpectedMessage {
                expected: "Authenticate (this session has no queue pair)",
            }));
        };
        // On verbs a bind is a work request whose completion the binder polls for (up to twice
        // the device's retry_timeout): tell tokio, so this worker's other tasks move on.
        let may_block = attachment.capabilities().binds_may_block;
        // Each window joins the session as soon as it is bound: a later failure leaves it to
        // the ordered teardown (queue pair to ERROR and drained before any key is revoked).
        let windows = &mut self.windows;
        let mut bind = |step, region, access, address, length| {
            let window = table.domain.allocate_memory_window();
            let key = off_async_worker(may_block, || {
                queue_pair.bind_memory_window(&window, region, address, length, access)
            })
            .map_err(|source| {
                BindFailure::Setup(crate::Error::QueuePairSetup {
                    step,
                    connection_id,
                    source,
                })
            })?;
            windows.push(window);
            Ok(key)
        };
        let index_key = bind(
            "bind a memory window",
            &table.region,
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
            table.index_address(),
            table.geometry.index_size(),
        )?;
        let heap_key = bind(
            "bind a memory window",
            &table.region,
            AccessFlags::REMOTE_READ,
            table.heap_address(),
            table.geometry.heap_size,
        )?;
        // The announce word: one per connection, bounded by max_connections like the sessions.
        let announce_address = node
            .announcements
            .claim(connection_id)
            .ok_or(BindFailure::NoAnnounceWord)?;
        let announce_key = bind(
            "bind the announce window",
            &attachment.announce_region,
            AccessFlags::REMOTE_WRITE,
            announce_address,
            ANNOUNCE_SIZE,
        )?;
        // The node's lease word, READ at the end of every list (`rdkv_common::lease`).
        let lease_key = bind(
            "bind the lease word's window",
            &attachment.announce_region,
            AccessFlags::REMOTE_READ,
            node.announcements.lease_word_address(),
            8,
        )?;
        tracing::debug!(
            index_key = index_key.key,
            heap_key = heap_key.key,
            qp_number = queue_pair.qp_number(),
            "keys issued"
        );
        Ok(ConnectionKeys {
            index_key,
            heap_key,
            announce_key,
            lease_key,
        })
    }
}

/// Why [`Session::bind_windows`] failed.
enum BindFailure {
    /// Every announce word is taken: the client is refused, in words.
    NoAnnounceWord,
    /// A bind failed.
    Setup(crate::Error),
}

impl Session {
    fn setup_failed(&self, step: &'static str, source: rdkv_fabric::Error) -> crate::Error {
        crate::Error::QueuePairSetup {
            step,
            connection_id: self.connection_id,
            source,
        }
    }
}

/// Runs a call that may block (a verbs window bind polls for its completion) without stalling
/// the other tasks of this async worker: on a multi-threaded runtime through
/// `block_in_place`, which hands them to other workers; elsewhere (a current-thread runtime in
/// a test) directly. A call that cannot block (`may_block` false: the soft fabric's binds
/// finish at once) runs directly: `block_in_place` would start a replacement worker thread for
/// every handshake, and 1,000 clients connecting would leave a node with 100 idle threads.
fn off_async_worker<T>(may_block: bool, call: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|handle| handle.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) if may_block => {
            tokio::task::block_in_place(call)
        }
        _ => call(),
    }
}

/// The authenticated slots a connection of `purpose` may take (`crate::pending`).
fn slot_class(purpose: Purpose) -> SlotClass {
    match purpose {
        Purpose::Data | Purpose::Lane => SlotClass::Client,
        Purpose::Monitor => SlotClass::Monitor,
        Purpose::Peer | Purpose::Refill => SlotClass::Peer,
    }
}
