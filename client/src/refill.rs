//! What a node's refill (`server/src/refill.rs`, `docs/protocol.md`, *Refill*) asks of its
//! client of the cluster: to follow the view at once, each peer's table size, one-sided scans
//! of a peer's table (`scan.rs`), which keys the node must copy, and the copy of one key
//! through its primary's lock. Hidden from the documentation: applications have no use for
//! them.

use std::sync::Arc;

use rdkv_common::protocol::ClusterView;

use crate::client::Client;
use crate::error::{Error, Result};
use crate::operations::{Mutation, MutationOutcome};
use crate::progress::Progress;
use crate::replicated::Write;
use crate::runner::Kind;

impl Client {
    /// Fetches the cluster view and routes by it from now on (a node refilling itself uses
    /// this to include itself as filling). The view, or why none could be fetched. The client
    /// routes by this view unless it already knew a newer one ([`Client::routes_only_by`]
    /// says which): the view comes from the leader, and the newest a majority reports may be
    /// older or newer than the leader's.
    ///
    /// # Errors
    /// As [`Client::view`].
    #[doc(hidden)]
    pub async fn follow_view(&self) -> Result<ClusterView> {
        self.follower.refresh_in_task().await;
        let view = self.view().await?;
        self.follower.adopt(&view);
        Ok(view)
    }

    /// Whether this client routes by the view of `epoch`, and no node told it of a newer one
    /// (in a connection's welcome, a heartbeat's answer or a fence): what a refill planned by
    /// that view still holds. A refill's peer that restarted and rejoined meanwhile welcomes
    /// its connection with the newer epoch of its rejoin.
    #[doc(hidden)]
    pub fn routes_only_by(&self, epoch: u64) -> bool {
        self.follower.epoch() == epoch && self.view_epoch() <= epoch
    }

    /// The combined buckets of node `node_id`'s index (connecting to it if needed).
    ///
    /// # Errors
    /// [`Error::Config`] for a node not in the cluster; connection errors.
    #[doc(hidden)]
    pub async fn combined_buckets_of(&self, node_id: u32) -> Result<u64> {
        let node = self.node_by_id(node_id).ok_or_else(|| Error::Config {
            reason: format!("node {node_id} is not in the cluster"),
        })?;
        let connection = node.connection().await?;
        Ok(connection.welcome.geometry.combined_bucket_count())
    }

    /// The keys and values in combined buckets `first ..` (at most [`crate::SCAN_BUCKETS`])
    /// of node `node_id`'s index, read one-sided (refill, `docs/protocol.md`).
    ///
    /// # Errors
    /// As [`Client::get`].
    #[doc(hidden)]
    pub async fn scan_node(
        &self,
        node_id: u32,
        first: u64,
        count: u64,
    ) -> Result<Vec<crate::scan::ScannedKey>> {
        let node = self
            .node_by_id(node_id)
            .ok_or_else(|| Error::Config {
                reason: format!("node {node_id} is not in the cluster"),
            })?
            .clone();
        let progress = Arc::new(Progress::default());
        let work = async {
            let connection = node.connection().await?;
            crate::scan::scan_buckets(&connection, progress.clone(), first, count).await
        };
        self.run_replicated(Kind::Scan, "scan", &progress, work)
            .await
    }

    /// Whether node `me` must copy `key` from node `source` while it fills: `source` is the
    /// key's primary and `me` one of the copies the view is heading for.
    #[doc(hidden)]
    pub fn refill_target(&self, key: &[u8], source: u32, me: u32) -> bool {
        let replicas = self.follower.write_replicas(key, self.replicas);
        replicas.first() == Some(&source) && replicas.contains(&me)
    }

    /// Whether leaving node `me` must hand `key` over: it is one of the key's copies now (a
    /// leaving node is never one of the copies the view is heading for).
    #[doc(hidden)]
    pub fn handover_target(&self, key: &[u8], me: u32) -> bool {
        self.follower
            .write_replicas(key, self.replicas)
            .contains(&me)
    }

    /// Whether node `me` must re-replicate `key` after a member was removed while down: it is
    /// the key's primary, so each key is copied by one node.
    #[doc(hidden)]
    pub fn rereplication_target(&self, key: &[u8], me: u32) -> bool {
        self.follower.write_replicas(key, self.replicas).first() == Some(&me)
    }

    /// Copies `key`'s `value` to every replica the view is heading for, through the primary's
    /// lock (a compare-and-swap of the value with itself): `Ok(false)` when the value changed
    /// meanwhile (its writer wrote every replica already).
    ///
    /// # Errors
    /// As [`Client::compare_and_swap`].
    #[doc(hidden)]
    pub async fn refill_copy(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        // Counted under its kind like any write (by the runner), so that a node's counters add
        // up (a restarted node's refill copies showed as operations of no kind in `rdkv
        // stats`).
        let outcome = self
            .mutate_replicated(
                "refill",
                key,
                Write::Value(value, Mutation::CompareAndSwap { expected: value }),
            )
            .await?;
        Ok(outcome == MutationOutcome::Applied)
    }
}
