//! The cluster's side of the move: the leader's commits (the change's first and last views, a
//! crashed node `down`), each node applying views at its own pace, a crash, and the move's own
//! task (the refill of a joining node, the hand-over of a leaving one); and the end-of-move
//! property.

use crate::key_value::Operation;

use super::{
    CopierStage, MemberState, MembershipAction, MembershipModel, MembershipState, Move, MoveRule,
    Stage, View, KEY, MOVING,
};

impl MembershipModel {
    /// The leader's commits, the nodes' applies, a crash and the move's task step.
    pub(super) fn cluster_actions(
        &self,
        state: &MembershipState,
        actions: &mut Vec<MembershipAction>,
    ) {
        let newest = state.newest_view();
        // A crash strikes while the change runs: from its first view until its last.
        let moving = state.views.len() > 1 && state.copier.stage != CopierStage::Done;
        if state.views.len() == 1 {
            actions.push(MembershipAction::Begin);
        }
        if state.copier.stage == CopierStage::Asking && newest.states[MOVING] == self.moving_state()
        {
            actions.push(MembershipAction::Finish);
        }
        for (index, node) in state.nodes.iter().enumerate() {
            let id = index as u8;
            if node.alive && node.applied < state.newest() {
                actions.push(MembershipAction::Apply(id));
            }
            if self.crash && !state.crashed && moving && node.alive {
                actions.push(MembershipAction::Crash(id));
            }
            let marked = matches!(
                newest.states[index],
                MemberState::Down | MemberState::Absent
            );
            if !node.alive && !marked {
                actions.push(MembershipAction::MarkDown(id));
            }
        }
        if self.copier_enabled(state) {
            actions.push(MembershipAction::Copier);
        }
    }

    /// The moving node's state while the change runs.
    fn moving_state(&self) -> MemberState {
        match self.change {
            Move::Join => MemberState::Joining,
            Move::Leave => MemberState::Leaving,
        }
    }

    /// The leader commits the view that `action` asks for.
    pub(super) fn commit_view(&self, state: &mut MembershipState, action: MembershipAction) {
        let mut view = View {
            promoted: false,
            ..state.newest_view()
        };
        match action {
            MembershipAction::Begin => view.states[MOVING] = self.moving_state(),
            MembershipAction::Finish => {
                view.states[MOVING] = match self.change {
                    Move::Join => MemberState::Serving,
                    Move::Leave => MemberState::Absent,
                };
                view.promoted = self.change == Move::Join;
                state.copier.stage = if view.promoted && self.rule.promotion_waits() {
                    state.copier.plan = state.views.len() as u8;
                    CopierStage::Confirming
                } else {
                    CopierStage::Done
                };
            }
            MembershipAction::MarkDown(node) => view.states[usize::from(node)] = MemberState::Down,
            _ => unreachable!("not a commit"),
        }
        state.views.push(view);
    }

    /// Whether the move's task can take a step: it runs on the moving node, while the change
    /// has it joining or leaving (a leaving node by the view it applied).
    fn copier_enabled(&self, state: &MembershipState) -> bool {
        let node = &state.nodes[MOVING];
        if !node.alive {
            return false;
        }
        let moving = self.moving_state();
        match state.copier.stage {
            CopierStage::Idle => {
                let own = state.views[usize::from(node.applied)].states[MOVING];
                state.newest_view().states[MOVING] == moving
                    && (self.change == Move::Join || own == moving)
            }
            CopierStage::Waiting => self.members_applied(state),
            CopierStage::Confirming => self.promotion_applied(state),
            CopierStage::Scanning | CopierStage::Verifying | CopierStage::Stopping => true,
            CopierStage::Copying | CopierStage::Asking | CopierStage::Done => false,
        }
    }

    /// Whether the members the task waits for applied its plan: a refill waits for the members
    /// that serve, a hand-over for every member not down (unless [`MoveRule::NoWait`]).
    fn members_applied(&self, state: &MembershipState) -> bool {
        if self.change == Move::Leave && self.rule == MoveRule::NoWait {
            return true;
        }
        let plan = state.copier.plan;
        let view = state.views[usize::from(plan)];
        (0..super::NODES).all(|node| {
            let waited = match self.change {
                Move::Join => matches!(
                    view.states[node],
                    MemberState::Serving | MemberState::Leaving
                ),
                Move::Leave => {
                    !matches!(view.states[node], MemberState::Absent | MemberState::Down)
                }
            };
            !waited || state.nodes[node].applied >= plan
        })
    }

    /// Whether every member but the promoted node that is not down in the view the promoted
    /// node applied applied the promotion's view (or a newer one): `confirm_promotion` in
    /// `server/src/refill.rs` polls them, and a member committed down meanwhile drops out of
    /// the wait by the newer view. Views only grow, so one look at them all stands for the
    /// polls.
    fn promotion_applied(&self, state: &MembershipState) -> bool {
        let promotion = state.copier.plan;
        let view = state.views[usize::from(state.nodes[MOVING].applied)];
        (0..super::NODES).all(|node| {
            node == MOVING
                || matches!(view.states[node], MemberState::Absent | MemberState::Down)
                || state.nodes[node].applied >= promotion
        })
    }

    /// The move's task takes its next step.
    pub(super) fn copier_step(&self, state: &mut MembershipState) {
        let copier = self.copier_client();
        match state.copier.stage {
            CopierStage::Idle => {
                let plan = state.newest();
                state.copier.plan = plan;
                state.clients[copier].view = state.clients[copier].view.max(plan);
                state.copier.stage = CopierStage::Waiting;
            }
            CopierStage::Waiting => state.copier.stage = CopierStage::Scanning,
            CopierStage::Scanning => self.scan(state),
            CopierStage::Verifying => {
                state.copier.stage = if state.newest() != state.copier.plan {
                    CopierStage::Idle
                } else if self.change == Move::Leave && self.rule != MoveRule::ServesUntilApplied {
                    CopierStage::Stopping
                } else {
                    CopierStage::Asking
                };
            }
            CopierStage::Confirming => state.copier.stage = CopierStage::Done,
            CopierStage::Stopping => {
                // Its lease word reads 0 and its data connections are fenced.
                state.nodes[MOVING].stopped = true;
                state.copier.stage = CopierStage::Asking;
            }
            CopierStage::Copying | CopierStage::Asking | CopierStage::Done => {
                unreachable!("not a step of the task")
            }
        }
    }

    /// The task READs the key's slot (the primary's for a refill, its own for a hand-over)
    /// and copies what it found through the primary's lock (or, [`MoveRule::UnlockedCopy`],
    /// WRITEs it to the next copies).
    fn scan(&self, state: &mut MembershipState) {
        let copier = self.copier_client();
        let plan = state.copier.plan;
        let route = self.route_at(state, plan);
        let source = match self.change {
            Move::Join => route.copies[0],
            Move::Leave => MOVING,
        };
        state.clients[copier].epoch = plan;
        let Some(word) = self.access(state, copier, source) else {
            state.copier.stage = CopierStage::Idle;
            return;
        };
        let Some(value) = word.value else {
            state.copier.stage = CopierStage::Verifying;
            return;
        };
        state.copier.value = Some(value);
        if self.rule == MoveRule::UnlockedCopy {
            return self.write_unlocked(state, &route.copies, source, value);
        }
        state.clients[copier].operation = state.copier.rounds;
        state.copier.rounds += 1;
        state.copier.stage = CopierStage::Copying;
        state.clients[copier].view = plan.max(state.clients[copier].view);
        let copy = Operation::CompareAndSwap {
            key: KEY,
            expected: value,
            new: value,
        };
        self.invoke(state, copier, copy);
        state.clients[copier].epoch = plan;
    }

    /// [`MoveRule::UnlockedCopy`]: WRITE `value` to every copy but `source`, then verify.
    fn write_unlocked(
        &self,
        state: &mut MembershipState,
        copies: &[usize],
        source: usize,
        value: crate::key_value::Value,
    ) {
        for &target in copies.iter().filter(|node| **node != source) {
            if self.access(state, self.copier_client(), target).is_none() {
                state.copier.stage = CopierStage::Idle;
                return;
            }
            state.nodes[target].word = super::Word {
                value: Some(value),
                block: 240 + state.copier.rounds,
                locked: false,
            };
        }
        state.copier.rounds += 1;
        state.copier.stage = CopierStage::Verifying;
    }

    /// [`super::NO_WRITE_LOST`]: once the move ended (nobody joining or leaving, every client
    /// done, every crashed node down), the key's copy by the newest view, if its node runs,
    /// holds the last acknowledged write of the scripts, or a write left unresolved (the
    /// scripts have one writer, so its writes follow one another).
    pub(super) fn nothing_lost(&self, state: &MembershipState) -> bool {
        let newest = state.newest_view();
        let changing = newest
            .states
            .iter()
            .any(|member| matches!(member, MemberState::Joining | MemberState::Leaving));
        let clients_done = state.clients[..self.copier_client()]
            .iter()
            .all(|client| client.stage == Stage::Finished);
        let copier_done = state.copier.stage != CopierStage::Copying;
        let crashes_marked = (0..super::NODES).all(|node| {
            state.nodes[node].alive
                || matches!(newest.states[node], MemberState::Down | MemberState::Absent)
        });
        if state.views.len() == 1 || changing || !clients_done || !copier_done || !crashes_marked {
            return true;
        }
        let Some(reader) = self.route_at(state, state.newest()).read else {
            return true;
        };
        if !state.nodes[reader].alive {
            return true;
        }
        let value = state.nodes[reader].word.value;
        match state.acknowledged {
            None => true,
            Some(acknowledged) => {
                value == Some(acknowledged)
                    || value.is_some_and(|value| state.unresolved.contains(value))
            }
        }
    }
}
