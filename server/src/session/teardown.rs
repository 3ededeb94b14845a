//! The ordered teardown of a session (see the module docs of `session`).
//!
//! Draining a queue pair may block: on `verbs` it polls the NIC's completion queue until every
//! posted request has completed or flushed, bounded by the device's `retry_timeout` plus one
//! second. So the teardown runs on tokio's blocking pool (`spawn_blocking`, at most 512
//! threads), never on an async worker, and the operations of other sessions on the same runtime
//! go on while it waits. `client/tests/teardown.rs` holds one teardown for 4 s
//! (`ServerConfig::teardown_stall`) on a one-thread runtime and checks that another client's
//! 200 operations finish meanwhile.

use super::*;

impl Session {
    /// The ordered teardown described in the module docs: queue pair to ERROR, drain, invalidate
    /// every window, destroy the queue pair, seal the chunks. A requester that the drain found
    /// still inside a request (an `shm` client stopped there: `QueuePair::requester_out`) keeps
    /// its grant and announce word, so that nothing it may still touch is reused, until it is
    /// out ([`hold_until_out`]).
    pub(super) async fn teardown(&mut self) {
        let queue_pair = self.queue_pair.take();
        if queue_pair.is_some() {
            self.attachment()
                .data_connections
                .fetch_sub(1, Ordering::Relaxed);
        }
        let mut windows: Vec<MemoryWindow> = self.windows.drain(..).collect();
        windows.extend(self.chunk_window.take().map(|(_, window)| window));
        let node = self.node.clone();
        let connection_id = self.connection_id;
        let stall = node.config.teardown_stall;
        let ordered = move || {
            if let Some(queue_pair) = &queue_pair {
                queue_pair.modify_to_error();
                queue_pair.drain();
                if !queue_pair.requester_out() {
                    // At once, before the window revocations below (each waits up to
                    // `retry_timeout` for this requester): its READs from now on are discarded
                    // by the requester itself, so snapshots need not wait for it.
                    node.announcements.fence_reads(connection_id);
                }
            }
            if !stall.is_zero() {
                // Fault injection (tests only): a drain as slow as a NIC's can be.
                std::thread::sleep(stall);
            }
            for window in windows {
                window.invalidate();
            }
            if queue_pair
                .as_ref()
                .is_some_and(|queue_pair| !queue_pair.requester_out())
            {
                return queue_pair;
            }
            drop(queue_pair);
            release(&node, connection_id);
            None
        };
        // A verbs drain polls the NIC for flushes; an shm drain and window revocation wait
        // until the client is outside its requests (at most retry_timeout, for one that
        // stopped inside one): off the async workers.
        let may_block = self.attachment().capabilities().teardown_may_block;
        let inside = if !may_block && stall.is_zero() {
            // The emulated fabric drains at once: no blocking thread for it.
            ordered()
        } else {
            match tokio::task::spawn_blocking(ordered).await {
                Ok(inside) => inside,
                Err(error) => {
                    tracing::error!(%error, connection_id, "session teardown failed");
                    None
                }
            }
        };
        if let Some(queue_pair) = inside {
            // Its READs after the fence are discarded by its own requester (`shm` checks after
            // each copy that the queue pair still receives), so it holds no snapshot back
            // (`fence_reads` above); a WRITE it was inside may still land, so its grant, its
            // sealed grants and its word stay.
            self.node.announcements.fence_reads(connection_id);
            tracing::warn!(
                connection = connection_id,
                "the client stopped inside a request: its grant and announce word are kept until it leaves it or its process ends"
            );
            self.node
                .counters
                .connections_held
                .fetch_add(1, Ordering::Relaxed);
            tokio::spawn(hold_until_out(self.node.clone(), connection_id, queue_pair));
        }
    }
}

/// Gives a torn-down connection's grant and announce word back: nothing of it runs any more.
fn release(node: &Node, connection_id: u64) {
    node.heap.seal_owned_by(connection_id);
    // Drained: nothing of this connection is in flight any more.
    node.announcements.release(connection_id);
    // Its extents and any tentative slot it left are the collector's now.
    node.collector.wake();
}

/// Keeps `queue_pair` (and with it the requester's epoch slot) until its requester is out of
/// the request it stopped inside, or its process is gone, then releases the connection.
async fn hold_until_out(node: Arc<Node>, connection_id: u64, queue_pair: QueuePair) {
    let mut checks = tokio::time::interval(CHECK_INTERVAL);
    loop {
        checks.tick().await;
        if queue_pair.requester_out() {
            break;
        }
    }
    drop(queue_pair);
    release(&node, connection_id);
    node.counters
        .connections_held
        .fetch_sub(1, Ordering::Relaxed);
}
