//! On the leader, at each failure-detector tick: the members it replaces and the voters it
//! tidies (`docs/protocol.md`, *Membership changes*).
//!
//! - **`replace_after`** (cluster file, off by default): a member that has been `down` that
//!   long, by this leader's count (a new leader counts from its election), is removed as
//!   `rdkv-cluster remove-node` removes a dead member ([`ViewService::lead_dead_removal`]);
//!   the members that serve then re-replicate its keys (`crate::rereplication`). Never with
//!   one copy of each key (the member holds the only copy of its keys), nor while the members
//!   are no more than `replicas` (the others cannot take one more copy): logged once.
//! - **Voters the view does not name**: a leader that crashed between `RemoveMember` and the
//!   voter change left one; it is taken out of Raft's voters once the view has lacked it for
//!   [`ORPHAN_VOTER_GRACE`] (a removal under way does that step itself first).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_common::protocol::{MemberState, MembershipChange};

use super::ViewService;

/// How long a Raft voter may be missing from the view before the leader removes it.
const ORPHAN_VOTER_GRACE: Duration = Duration::from_secs(5);

/// The shortest time between two tries of one replacement.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// What the leader carries between ticks.
#[derive(Debug, Default)]
pub(super) struct Replacement {
    /// Members down, since when this leader saw them down.
    down_since: BTreeMap<u32, Instant>,
    /// Voters the view does not name, since when.
    orphans_since: BTreeMap<u32, Instant>,
    /// The last try per member, so a refused one is not tried at every tick.
    tried: BTreeMap<u32, Instant>,
    /// Members not replaced because they hold the only copy of their keys, or nothing could
    /// take their copies (logged once).
    warned_not_replaced: BTreeSet<u32>,
    /// Set while a removal runs (one at a time, in a task of its own, so that the failure
    /// detector never waits for it).
    in_flight: Arc<AtomicBool>,
}

impl ViewService {
    /// On the leader: replaces the members down for `replace_after`, and removes the voters
    /// the view does not name; see the module.
    pub(super) fn tend_members(self: &Arc<Self>, state: &mut Replacement) {
        // A member removed while it was down, started again as the leader it was: the others
        // refuse its entries, and it leads nobody.
        if let Some(refusal) = self.liveness.take_non_member_refusal() {
            self.say_removed(&refusal);
        }
        let now = Instant::now();
        let (down, members): (Vec<u32>, BTreeSet<u32>) = {
            let view = self.view.borrow();
            let down = view
                .members
                .iter()
                .filter(|(node_id, record)| {
                    record.state == MemberState::Down && view.ever_served.contains(node_id)
                })
                .map(|(node_id, _)| *node_id)
                .collect();
            (down, view.members.keys().copied().collect())
        };
        state.down_since.retain(|node_id, _| down.contains(node_id));
        for node_id in &down {
            state.down_since.entry(*node_id).or_insert(now);
        }
        let orphans: Vec<u32> = self
            .voters()
            .into_iter()
            .filter_map(|peer| u32::try_from(peer).ok())
            .filter(|node_id| !members.is_empty() && !members.contains(node_id))
            .collect();
        state
            .orphans_since
            .retain(|node_id, _| orphans.contains(node_id));
        for node_id in &orphans {
            state.orphans_since.entry(*node_id).or_insert(now);
        }
        if state.in_flight.load(Ordering::Acquire) {
            return;
        }
        if let Some(orphan) = state
            .orphans_since
            .iter()
            .find(|(_, since)| since.elapsed() >= ORPHAN_VOTER_GRACE)
            .map(|(node_id, _)| *node_id)
        {
            self.spawn_removal(state, orphan, Removal::Voter);
            return;
        }
        if let Some(node_id) = self.due_replacement(state) {
            self.spawn_removal(state, node_id, Removal::Member);
        }
    }

    /// The member down for `replace_after` to remove now, if any (not tried within
    /// [`RETRY_AFTER`]); with one copy of each key, none (logged once per member).
    fn due_replacement(&self, state: &mut Replacement) -> Option<u32> {
        let replace_after = self.replace_after?;
        let due: Vec<u32> = state
            .down_since
            .iter()
            .filter(|(_, since)| since.elapsed() >= replace_after)
            .map(|(node_id, _)| *node_id)
            .collect();
        state
            .warned_not_replaced
            .retain(|node_id| due.contains(node_id));
        let replicas = self.store.replicas();
        let members = self.view.borrow().members.len();
        if replicas <= 1 || members <= replicas {
            // With one copy its keys would be lost; with no more members than copies, the
            // others cannot hold one more copy of its keys: its return refills it instead.
            for node_id in due {
                if state.warned_not_replaced.insert(node_id) {
                    tracing::warn!(
                        node_id,
                        ?replace_after,
                        replicas,
                        members,
                        "a member has been down for replace_after, and is not replaced: with replicas = 1 it holds the only copy of its keys, and with no more members than replicas nothing can take its copies (bring it back, or `rdkv-cluster remove-node`)"
                    );
                }
            }
            return None;
        }
        due.into_iter().find(|node_id| {
            state
                .tried
                .get(node_id)
                .is_none_or(|at| at.elapsed() >= RETRY_AFTER)
        })
    }

    /// Runs one removal in a task of its own.
    fn spawn_removal(self: &Arc<Self>, state: &mut Replacement, node_id: u32, removal: Removal) {
        state.tried.insert(node_id, Instant::now());
        state.in_flight.store(true, Ordering::Release);
        let in_flight = state.in_flight.clone();
        let service = self.clone();
        let replace_after = self.replace_after;
        tokio::spawn(async move {
            match removal {
                Removal::Voter => match service.remove_voter(node_id).await {
                    Ok(()) => tracing::info!(
                        node_id,
                        "removed a Raft voter that the view no longer names (a removal cut short)"
                    ),
                    Err(reason) => {
                        tracing::warn!(node_id, %reason, "removing a voter the view no longer names")
                    }
                },
                Removal::Member => {
                    tracing::warn!(
                        node_id,
                        ?replace_after,
                        "a member has been down for replace_after: removing it, and copying its keys again on the members that serve"
                    );
                    let change = MembershipChange::Remove {
                        node_id,
                        lose_keys: false,
                    };
                    match service.lead_membership_change(change).await {
                        Ok(epoch) => {
                            tracing::info!(node_id, epoch, "member down for replace_after removed")
                        }
                        Err(reason) => {
                            tracing::warn!(node_id, %reason, "member down for replace_after not removed yet")
                        }
                    }
                }
            }
            in_flight.store(false, Ordering::Release);
        });
    }
}

/// What [`ViewService::spawn_removal`] removes.
#[derive(Debug, Clone, Copy)]
enum Removal {
    /// A Raft voter that the view does not name.
    Voter,
    /// A member down for `replace_after`.
    Member,
}
