//! The sweep of extra copies: committed keys this node holds although the view does not name
//! it among their copies (`docs/protocol.md`, *Refill*, *Extra copies*).
//!
//! While a member is down or fills, the writes of its keys go to the next node of each key's
//! ranking, which stands in for it. Once the member serves again, the stand-in's copies are
//! never read (GETs read the primary) and no write reaches them, but they hold heap, count in
//! `keys`, and keep the values of keys deleted later. The sweep removes them.
//!
//! It runs in the collector's pass, at most once per view, and only under a view that
//! - has nobody filling (while a member fills, its stand-ins are the copies a failure of the
//!   filling member falls back on),
//! - has this node serving, with its lease, worked out from the lease's expiry at that instant
//!   (a node cut off or paused may not know the newest view),
//! - this node has known for at least the failure timeout (views that churn are not swept).
//!
//! Each removal is a compare-and-swap of the exact committed word the scan read, to empty, made
//! only while the node still knows that view and still holds its lease: a word that a write replaced or locked meanwhile,
//! or any word after a view change, stays. A removed slot's block is unreferenced and comes
//! back through the collector like a deleted key's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rdkv_common::layout::Slot;
use rdkv_common::protocol::{ClusterView, MemberState};
use rdkv_common::sharding;
use rdkv_fabric::lock;

use crate::config::ServerConfig;
use crate::table::TableRegion;
use crate::view::ViewService;

/// The sweep's state: which view it last completed under, and what it removed.
#[derive(Debug, Default)]
pub struct Sweep {
    /// The epoch of the view this node knows, and since when (the sweep waits for a view to
    /// hold for the failure timeout).
    known: Mutex<Option<(u64, Instant)>>,
    /// The epoch of the last view swept to the end (0: none yet).
    swept_epoch: AtomicU64,
    /// Extra copies removed since start.
    removed: AtomicU64,
}

impl Sweep {
    /// Extra copies removed since start.
    pub fn removed(&self) -> u64 {
        self.removed.load(Ordering::Relaxed)
    }

    /// The epoch of the last view swept to the end (0: none yet).
    pub fn swept_epoch(&self) -> u64 {
        self.swept_epoch.load(Ordering::Relaxed)
    }

    /// The view to sweep under now, if one is due: see the module's rules.
    fn due(
        &self,
        config: &ServerConfig,
        view_service: &ViewService,
        replicas: usize,
    ) -> Option<ClusterView> {
        let view = view_service.current();
        let epoch = view.epoch;
        let settled = {
            let mut known = lock(&self.known);
            match *known {
                Some((seen, since)) if seen == epoch => since.elapsed() >= config.failure_timeout,
                _ => {
                    *known = Some((epoch, Instant::now()));
                    false
                }
            }
        };
        let me = config.node_id;
        let eligible = settled
            && self.swept_epoch.load(Ordering::Relaxed) != epoch
            && view.members.len() > replicas
            && view.members.iter().all(|member| {
                member.state == MemberState::Serving || member.state == MemberState::Down
            })
            && view
                .members
                .iter()
                .any(|member| member.node_id == me && member.state == MemberState::Serving)
            && view_service.serving_now().is_ok();
        eligible.then_some(view)
    }

    /// Removes the committed slots of `slots` (the collector's scan of `table`) whose key's
    /// copies under the view (`view_service`'s) exclude this node (`config`'s), when a sweep is
    /// due; removed slots leave `slots`. Returns how many it removed.
    pub(crate) fn run(
        &self,
        config: &ServerConfig,
        view_service: &ViewService,
        table: &TableRegion,
        slots: &mut Vec<(u64, Slot)>,
    ) -> u64 {
        let Some(replicas) = config.cluster.as_ref().map(|cluster| cluster.replicas) else {
            return 0;
        };
        let Some(view) = self.due(config, view_service, replicas) else {
            return 0;
        };
        let me = config.node_id;
        let serving = view.serving();
        let mut block = Vec::new();
        let mut removed = 0u64;
        let mut interrupted = false;
        slots.retain(|(index_offset, slot)| {
            if interrupted || !slot.is_committed() || slot.is_tombstone() {
                return true;
            }
            // Not an intact block (the slot changed since the scan): the next view's sweep.
            let Some(decoded) = table.read_block(*slot, &mut block) else {
                return true;
            };
            let ours = sharding::replicas(decoded.key, &serving, replicas)
                .into_iter()
                .any(|index| serving[index] == me);
            if ours {
                return true;
            }
            if view_service.epoch() != view.epoch || view_service.serving_now().is_err() {
                interrupted = true;
                return true;
            }
            let emptied = table.empty_slot(*index_offset, *slot);
            removed += u64::from(emptied);
            !emptied
        });
        self.removed.fetch_add(removed, Ordering::Relaxed);
        if !interrupted {
            self.swept_epoch.store(view.epoch, Ordering::Relaxed);
        }
        if removed > 0 || interrupted {
            tracing::info!(
                node = me,
                epoch = view.epoch,
                removed,
                interrupted,
                "swept the copies the view no longer names on this node"
            );
        }
        removed
    }
}
