//! The failure detector, active on the leader: every heartbeat interval it commits `down`
//! for each member not heard from for `failure_timeout` (by its lease requests where nodes hold
//! leases, by its answers to the leader's heartbeats elsewhere; a join counts as either), while
//! it hears a majority. It decides under the pending-down lock that lease grants take
//! (`lease.rs`), so a member it commits down gets no lease meanwhile.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_common::protocol::MemberState;
use rdkv_fabric::lock;
use tokio_util::sync::CancellationToken;

use super::types::ViewCommand;
use super::{election, ViewService, HEARTBEAT_INTERVAL};

/// The last `down` the failure detector proposed per member, with the epoch it was proposed
/// under: not again until the view changes (it applied, or the member rejoined) or 4 failure
/// timeouts pass.
type Proposed = BTreeMap<u32, (Instant, u64)>;

/// What the failure detector carries from one tick to the next.
#[derive(Debug, Default)]
struct FailureDetector {
    /// Since when this node leads, as the detector counts silence: `None` while it does not
    /// lead, and after a pause (it counts afresh).
    leader_since: Option<Instant>,
    /// The last other leader this node followed: its silence is counted from before this
    /// node's election ([`ViewService::old_leader_lease_floor`]).
    previous_leader: Option<u32>,
    /// The downs proposed, so that none is proposed again at every tick.
    proposed: Proposed,
    /// Whether a consensus stopped on a fatal error was reported (once is enough).
    reported_fatal: bool,
    /// Members down for `replace_after`, and voters the view does not name
    /// (`replacement.rs`).
    replacement: super::replacement::Replacement,
}

impl ViewService {
    /// On the leader: commits `down` for every serving member not heard from for the
    /// failure timeout. A follower hears only the leader, so a new leader counts the others'
    /// silence from its election, and the old leader's from its last heartbeat, but from no
    /// earlier than [`Self::old_leader_lease_floor`] before its election (others may have
    /// renewed the old leader's lease after this node last heard it: `lease.rs`): a dead
    /// leader is marked down `failure_timeout` after it died, or at the election if that
    /// comes later (followers wait 0.65-0.8 s before they stand: `election.rs`).
    pub(super) async fn detect_failures(self: Arc<Self>, shutdown: CancellationToken) {
        let mut ticks = tokio::time::interval(HEARTBEAT_INTERVAL);
        let mut detector = FailureDetector::default();
        let mut last_tick = Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            if last_tick.elapsed() > HEARTBEAT_INTERVAL * 3 {
                // This process was paused (SIGSTOP, a stalled machine): what it knew of its
                // peers is stale, and so may its leadership be. Count afresh.
                detector.leader_since = None;
            }
            last_tick = Instant::now();
            if self.consensus_stopped(&mut detector.reported_fatal) {
                continue;
            }
            let leader = self.leader();
            if leader != Some(self.node_id) {
                detector.leader_since = None;
                if leader.is_some() {
                    detector.previous_leader = leader;
                }
                self.pending_down_lock().clear();
                continue;
            }
            self.prune_pending_down();
            let since = *detector.leader_since.get_or_insert_with(Instant::now);
            let heard_within = self.heard_within(since, detector.previous_leader);
            self.commit_silent_down(&heard_within, &mut detector.proposed)
                .await;
            self.tend_members(&mut detector.replacement);
        }
    }

    /// Whether this node's Raft stopped on a fatal error: it then knows no leader and commits
    /// nothing. The first time, says so in the log (`reported` remembers it).
    fn consensus_stopped(&self, reported: &mut bool) -> bool {
        if let Some(raft) = &self.raft {
            if let Err(fatal) = &raft.metrics().borrow().running_state {
                if !*reported {
                    tracing::error!(
                        node = self.node_id,
                        %fatal,
                        "the cluster view's consensus stopped on this node: it knows no leader and commits nothing; restart the node"
                    );
                    *reported = true;
                }
                return true;
            }
        }
        false
    }

    /// Ends each pending down whose member's record changed since the decision (marked down,
    /// and perhaps back already; found by CI: a member that rejoined before this check stayed
    /// pending, refused every lease). The view is read first, not held with the lock: lease
    /// grants take the lock, then read the view.
    fn prune_pending_down(&self) {
        let records: Vec<(u32, u64)> = self
            .view
            .borrow()
            .members
            .iter()
            .filter(|(_, record)| record.state != MemberState::Down)
            .map(|(id, record)| (*id, record.since))
            .collect();
        self.pending_down_lock()
            .retain(|id, decided_at| records.contains(&(*id, *decided_at)));
    }

    /// Whether a member was heard from within the failure timeout, on a leader that has led
    /// since `since`: its silence counts from `since` at the earliest, and the previous
    /// leader's from [`Self::old_leader_lease_floor`] before it.
    fn heard_within(
        &self,
        since: Instant,
        previous_leader: Option<u32>,
    ) -> impl Fn(u32) -> bool + '_ {
        let needs_lease = self.needs_lease();
        move |id: u32| {
            // Where nodes hold leases, a follower is alive when its lease requests arrive: one
            // whose requests do not (it cannot reach this node, though this node's heartbeats
            // reach it) serves nothing, and must leave the view so that its keys move. The
            // previous leader too, once it follows (found by attack: a leader whose messages
            // to one follower were cut lost an election to it, then could not reach the new
            // leader, and stayed in the view, serving nothing).
            let signs = if needs_lease {
                self.liveness.last_lease_request(id)
            } else {
                self.liveness.last_heard(id)
            };
            let counted_from = if Some(id) == previous_leader {
                since
                    .checked_sub(Self::old_leader_lease_floor())
                    .unwrap_or(since)
            } else {
                since
            };
            let heard = signs.map_or(counted_from, |heard| heard.max(counted_from));
            heard.elapsed() <= self.failure_timeout
        }
    }

    /// On the leader: proposes `down` for every serving member that `heard_within` finds
    /// silent, while it hears a majority.
    async fn commit_silent_down(
        &self,
        heard_within: &impl Fn(u32) -> bool,
        proposed: &mut Proposed,
    ) {
        let (silent, members, epoch): (Vec<u32>, usize, u64) = {
            let view = self.view.borrow();
            let silent = view
                .members
                .iter()
                .filter(|(id, record)| **id != self.node_id && record.state != MemberState::Down)
                .map(|(id, _)| *id)
                .filter(|id| !heard_within(*id))
                .collect();
            (silent, view.members.len(), view.epoch)
        };
        // Only a leader that hears a majority (itself included) can commit anything: without
        // one, a proposal would sit in its log, be retried, and commit late, after the member
        // came back (found by attack: a two-node cluster's leader grew its log every
        // failure_timeout).
        let heard = 1 + self
            .member_ids()
            .into_iter()
            .filter(|id| *id != self.node_id && heard_within(*id))
            .count();
        if heard * 2 <= members {
            return;
        }
        for node_id in silent {
            self.propose_down(node_id, epoch, heard_within, proposed)
                .await;
        }
    }

    /// Commits `node_id` down from the view at `epoch`, unless it was proposed under that epoch
    /// within 4 failure timeouts, or it was heard from after all.
    async fn propose_down(
        &self,
        node_id: u32,
        epoch: u64,
        heard_within: &impl Fn(u32) -> bool,
        proposed: &mut Proposed,
    ) {
        if proposed
            .get(&node_id)
            .is_some_and(|(at, under)| *under == epoch && at.elapsed() < self.failure_timeout * 4)
        {
            return;
        }
        let record_since = self
            .view
            .borrow()
            .members
            .get(&node_id)
            .map_or(0, |record| record.since);
        {
            // Decided under the lock that lease grants take: a request that arrived since the
            // decision above got its grant before this check, and counts; one that arrives
            // after gets none (found by review: a grant in the moment before the commit let a
            // node serve past the view without it).
            let mut pending = self.pending_down_lock();
            if heard_within(node_id) {
                return;
            }
            pending.insert(node_id, record_since);
        }
        proposed.insert(node_id, (Instant::now(), epoch));
        tracing::warn!(
            node = self.node_id,
            down = node_id,
            failure_timeout = ?self.failure_timeout,
            "a member missed its heartbeats: committing a view without it"
        );
        if let Err(reason) = self.commit(ViewCommand::MarkDown { node_id }).await {
            tracing::warn!(node = self.node_id, down = node_id, %reason, "view not committed");
        }
    }

    /// The members this leader is committing down (their lease requests get no grant).
    pub(super) fn pending_down_lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u32, u64>> {
        lock(&self.pending_down)
    }

    /// How long before its election a new leader may start counting the old leader's
    /// silence. A follower refuses to vote for `election_timeout_max` after it last accepted
    /// a leader's heartbeat (openraft's leader lease), so every heartbeat that a majority
    /// accepted from the old leader was sent that long before the election at least, unless
    /// the old leader voted for the new one itself (openraft's leader grants a vote for a newer
    /// term once it has led that long): that old leader dropped its lease when it voted
    /// (`lease.rs`). The old leader's own lease ends `9/10 × failure_timeout` after such a
    /// heartbeat at most, so counting its silence from `election_timeout_max` before the
    /// election commits it down `failure_timeout / 10` after its lease ended, at the earliest.
    pub(super) fn old_leader_lease_floor() -> Duration {
        election::LEADER_LEASE
    }
}
