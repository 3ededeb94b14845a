//! Elections that a returning node cannot force (`docs/protocol.md`, *Views and fencing*):
//! openraft's own election timer is off (`enable_elect: false`), and this module stands for
//! election in its place, after a **pre-vote** (Raft's, Ongaro's thesis §9.6).
//!
//! - **When.** As openraft did: `election_timeout_max` (its leader lease) plus a random
//!   250–400 ms after the node's vote last changed or was refreshed (accepting a leader's
//!   heartbeat, granting a vote, standing for election and starting all refresh it), so a
//!   follower stands 0.65–0.8 s after the leader's last heartbeat; a candidate whose election
//!   elected nobody, or whose pre-vote failed, tries again 250–400 ms later.
//! - **The pre-vote.** The node asks every peer whether it would vote for it, without raising
//!   its term. A peer says yes only where openraft's vote would not refuse the candidate for its
//!   leader: it has not accepted a leader within `election_timeout_max` (a leader: no majority
//!   has accepted it within that long), and the candidate's log is at least as new as its own.
//!   Only with a majority of yeses, itself counted, does the node raise its term and ask for
//!   votes (`Raft::trigger().elect()`).
//!
//! Why: a node's higher term makes the leader step down, even when the leader refuses the
//! vote, and a leader that steps down drops its lease (`lease.rs`) and stops serving until it
//! is elected again. A node back from a restart, resumed after a pause, or started after the
//! others elected stood for election before it heard the leader, and every such return
//! stopped the leader for 0.3–0.7 s. With the pre-vote it finds the leader alive and leaves
//! the term alone. Where no majority hears a leader (it died, or is cut off), every peer
//! says yes and the election starts when it did before.
//!
//! The pre-vote only decides whether a real election starts: the real vote (openraft's, with
//! its leader lease and its checks of term and log) decides who leads, so the pre-vote adds no
//! case to Raft's safety argument.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::{LogId, ServerState};
use rand::Rng;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::network::PeerClient;
use super::types::{PeerId, PeerReply, PeerRequest};
use super::{ViewService, ELECTION_TIMEOUT_MILLISECONDS};

/// How often a leader checks that it still leads (from Raft's metrics, without asking Raft);
/// a follower sleeps until its election is due, then reads its vote again.
const LEADER_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// Openraft's leader lease (`election_timeout_max`): a voter refuses to vote for this long
/// after it last accepted a leader's heartbeat, and a follower waits this long plus the
/// election timeout before it stands.
pub(super) const LEADER_LEASE: Duration = Duration::from_millis(ELECTION_TIMEOUT_MILLISECONDS.1);

/// How long a pre-vote waits for a peer's answer: three heartbeat intervals, as a lease
/// request. The pre-vote ends as soon as a majority said yes, so a dead peer delays nothing
/// that a majority of live ones can decide.
const PRE_VOTE_TIMEOUT: Duration = Duration::from_millis(300);

/// What the election timer and the pre-vote read of this node's Raft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct VoteClock {
    /// Whether this node leads.
    leading: bool,
    /// Whether its vote is for an elected leader (committed), not for a candidate.
    committed: bool,
    /// The node its vote is for (`None`: none yet, the vote of a fresh node at term 0).
    voted_for: Option<PeerId>,
    /// When its vote last changed or was refreshed: a leader's heartbeat accepted, a vote
    /// granted, an election won or started, or the process started.
    refreshed: Option<Instant>,
}

/// A random election timeout, 250–400 ms, as openraft draws it.
fn random_election_timeout() -> Duration {
    let (low, high) = ELECTION_TIMEOUT_MILLISECONDS;
    Duration::from_millis(rand::thread_rng().gen_range(low..high))
}

/// When a node whose vote is as `clock` says, and whose last try (a pre-vote or an election)
/// was at `last_try`, stands for election next: `timeout` after its vote last changed or was
/// refreshed (plus the leader lease, if its vote is for an elected leader: openraft's timing),
/// and no sooner than `timeout` after its last try. `None`: now.
fn election_due(
    clock: &VoteClock,
    last_try: Option<Instant>,
    timeout: Duration,
) -> Option<Instant> {
    let lease = if clock.committed {
        LEADER_LEASE
    } else {
        Duration::ZERO
    };
    let from_vote = clock.refreshed.map(|at| at + lease + timeout);
    let from_try = last_try.map(|at| at + timeout);
    from_vote.max(from_try)
}

impl ViewService {
    /// This node's Raft's vote clock; `None` when its Raft has stopped (or in a one-node
    /// cluster).
    async fn vote_clock(&self) -> Option<VoteClock> {
        let raft = self.raft.as_ref()?;
        raft.with_raft_state(|state| VoteClock {
            leading: state.server_state == ServerState::Leader,
            committed: state.vote_ref().is_committed(),
            voted_for: Some(state.vote_ref().leader_id())
                .filter(|leader| leader.get_term() > 0)
                .and_then(|leader| leader.voted_for()),
            refreshed: state.vote_last_modified().map(|at| at.into_std()),
        })
        .await
        .ok()
    }

    /// On every node of a cluster: stands for election when it has heard no leader for its
    /// election timeout and a majority says yes to its pre-vote.
    pub(super) async fn stand_for_election(self: Arc<Self>, shutdown: CancellationToken) {
        let Some(raft) = self.raft.clone() else {
            return;
        };
        let mut timeout = random_election_timeout();
        let mut last_try: Option<Instant> = None;
        // Kept between pre-votes: one connection per peer.
        let mut voters: BTreeMap<u32, PeerClient> = BTreeMap::new();
        // How long to sleep before the next look: a leader looks every 50 ms; a follower
        // sleeps until its election is due (a heartbeat meanwhile only makes it later).
        let mut sleep = Duration::ZERO;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(sleep) => {}
            }
            sleep = LEADER_CHECK_INTERVAL;
            if self.leader() == Some(self.node_id) {
                continue;
            }
            let Some(clock) = self.vote_clock().await else {
                continue;
            };
            if clock.leading {
                continue;
            }
            if let Some(due) = election_due(&clock, last_try, timeout) {
                let now = Instant::now();
                if now < due {
                    sleep = due - now;
                    continue;
                }
            }
            sleep = Duration::ZERO;
            last_try = Some(Instant::now());
            timeout = random_election_timeout();
            let won = tokio::select! {
                _ = shutdown.cancelled() => return,
                won = self.pre_vote(&mut voters) => won,
            };
            if !won {
                continue;
            }
            // A vote granted or a heartbeat accepted while the pre-vote ran: a candidate or a
            // leader is alive, and an election now would raise the term past it (found by the
            // fresh-cluster test on a loaded machine: a node voted for the first candidate
            // during its pre-vote, then stood for the next term and unseated it).
            if self.vote_clock().await != Some(clock) {
                tracing::debug!(
                    node = self.node_id,
                    "the vote changed during the pre-vote: no election"
                );
                continue;
            }
            if let Err(fatal) = raft.trigger().elect().await {
                tracing::debug!(node = self.node_id, %fatal, "election not started");
            }
        }
    }

    /// Asks every peer for its pre-vote; whether a majority, this node counted, said yes.
    /// Calls still waiting once a majority said yes are dropped, with their connections.
    async fn pre_vote(&self, voters: &mut BTreeMap<u32, PeerClient>) -> bool {
        let last_log_id = self.store.last_log_id();
        let members = self.member_addresses();
        let quorum = self.member_ids().len() / 2 + 1;
        let mut granted = 1;
        let mut calls = JoinSet::new();
        for (&peer, &address) in &members {
            if peer == self.node_id {
                continue;
            }
            let mut client = voters
                .remove(&peer)
                .unwrap_or_else(|| PeerClient::to(peer, address, self.secret.clone()));
            let request = PeerRequest::PreVote {
                node_id: self.node_id,
                last_log_id,
            };
            calls.spawn(async move {
                let answer = client.ask(&request, PRE_VOTE_TIMEOUT).await;
                (peer, client, answer)
            });
        }
        let mut refusals = Vec::new();
        while granted < quorum {
            let Some(joined) = calls.join_next().await else {
                break;
            };
            let Ok((peer, client, answer)) = joined else {
                continue;
            };
            let _ = voters.insert(peer, client);
            match answer {
                Ok(PeerReply::PreVote(Ok(()))) => granted += 1,
                Ok(PeerReply::PreVote(Err(reason))) | Err(reason) => {
                    refusals.push(format!("node {peer}: {reason}"));
                }
                Ok(other) => refusals.push(format!("node {peer}: unexpected answer {other:?}")),
            }
        }
        let won = granted >= quorum;
        if let Some(refusal) = refusals
            .iter()
            .find(|refusal| refusal.contains("is not a member of this cluster"))
        {
            self.say_removed(refusal);
        }
        if won {
            tracing::info!(
                node = self.node_id,
                granted,
                "no leader heard, and a majority would vote for this node: standing for election"
            );
        } else {
            tracing::debug!(
                node = self.node_id,
                granted,
                ?refusals,
                "no leader heard, but no majority would vote for this node: no election"
            );
        }
        won
    }

    /// A peer's pre-vote request: yes unless this node has a leader or a candidate it keeps
    /// to, or a newer log than the candidate's. It keeps to
    /// - the leader whose heartbeat it accepted within the leader lease (openraft's vote
    ///   refuses the candidate then too);
    /// - the candidate it voted for within the lease: that candidate may be winning, and
    ///   openraft's vote, which keeps no lease for a candidate, would let the next term
    ///   unseat it;
    /// - itself, as the leader, within the lease after its election (openraft's vote refuses
    ///   then too), and while a majority accepted one of its heartbeats within the lease.
    ///
    /// Its own candidacy is no reason: two candidates whose election split must be able to
    /// pre-vote for each other at once.
    pub(super) async fn grant_pre_vote(
        &self,
        candidate: u32,
        last_log_id: Option<LogId<PeerId>>,
    ) -> PeerReply {
        PeerReply::PreVote(self.pre_vote_refusal(candidate, last_log_id).await)
    }

    /// Why this node would not vote for `candidate` now, if it would not.
    async fn pre_vote_refusal(
        &self,
        candidate: u32,
        last_log_id: Option<LogId<PeerId>>,
    ) -> Result<(), String> {
        if !self.is_member(candidate) {
            return Err(format!("node {candidate} is not a member of this cluster"));
        }
        let Some(clock) = self.vote_clock().await else {
            return Err(format!("node {}'s consensus has stopped", self.node_id));
        };
        if clock.leading {
            if let Some(accepted) = self.quorum_accepted() {
                if accepted.elapsed() <= LEADER_LEASE {
                    return Err(format!(
                        "node {} leads, and a majority accepted it {:?} ago",
                        self.node_id,
                        accepted.elapsed()
                    ));
                }
            }
        }
        let keeps_to = clock.committed
            || clock
                .voted_for
                .is_some_and(|voted_for| voted_for != PeerId::from(self.node_id));
        if let Some(refreshed) = clock.refreshed.filter(|_| keeps_to) {
            if refreshed.elapsed() <= LEADER_LEASE {
                let voted_for = clock.voted_for.unwrap_or_default();
                let what = if clock.leading {
                    "was elected".to_string()
                } else if clock.committed {
                    format!("heard its leader, node {voted_for},")
                } else {
                    format!("voted for node {voted_for}")
                };
                return Err(format!(
                    "node {} {what} {:?} ago",
                    self.node_id,
                    refreshed.elapsed()
                ));
            }
        }
        let own = self.store.last_log_id();
        if last_log_id < own {
            return Err(format!(
                "the candidate's log ends at {last_log_id:?}, before node {}'s ({own:?})",
                self.node_id
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clock(committed: bool, refreshed: Option<Instant>) -> VoteClock {
        VoteClock {
            leading: false,
            committed,
            voted_for: Some(1),
            refreshed,
        }
    }

    #[test]
    fn a_follower_stands_the_lease_plus_the_timeout_after_its_leader_s_last_heartbeat() {
        let heard = Instant::now();
        let timeout = Duration::from_millis(300);
        assert_eq!(
            election_due(&clock(true, Some(heard)), None, timeout),
            Some(heard + LEADER_LEASE + timeout)
        );
        // A candidate's vote (not committed): the timeout alone, as openraft.
        assert_eq!(
            election_due(&clock(false, Some(heard)), None, timeout),
            Some(heard + timeout)
        );
    }

    #[test]
    fn a_failed_pre_vote_waits_a_timeout_before_the_next() {
        let heard = Instant::now();
        let tried = heard + Duration::from_secs(1);
        let timeout = Duration::from_millis(250);
        assert_eq!(
            election_due(&clock(true, Some(heard)), Some(tried), timeout),
            Some(tried + timeout)
        );
        // A leader heard since the try counts from the heartbeat.
        let later = tried + Duration::from_millis(100);
        assert_eq!(
            election_due(&clock(true, Some(later)), Some(tried), timeout),
            Some(later + LEADER_LEASE + timeout)
        );
        assert_eq!(election_due(&clock(false, None), None, timeout), None);
    }

    #[test]
    fn the_timeouts_are_openraft_s() {
        for _ in 0..1000 {
            let timeout = random_election_timeout();
            assert!((Duration::from_millis(ELECTION_TIMEOUT_MILLISECONDS.0)
                ..Duration::from_millis(ELECTION_TIMEOUT_MILLISECONDS.1))
                .contains(&timeout));
        }
    }
}
