//! A client's operation, one access per step: GETs read the key's primary (or its one copy);
//! writes read the primary and each backup, lock the primary, CAS each backup from the word
//! read (reading it again and checking the lock when that fails), and commit. An access that
//! fails (a fenced connection, a node that does not serve, a crashed one, a client behind the
//! node's view) resumes, restarts or ends the operation as the client's `replicated` path does.

use stateright::semantics::ConsistencyTester;

use crate::client::OperationId;
use crate::key_value::{Operation, Outcome, Value};

use super::{
    CopierStage, MembershipAction, MembershipModel, MembershipState, Stage, Word, KEY, MOVING,
    NODES,
};

/// What a write puts in place, or how the operation ends without writing.
fn decide(operation: Operation, present: Option<Value>) -> Result<Value, Outcome> {
    match operation {
        Operation::Get { .. } => Err(Outcome::Found(present)),
        Operation::CompareAndSwap { expected, .. } if present != Some(expected) => {
            Err(Outcome::Mismatch(present))
        }
        Operation::Put { value, .. } | Operation::CompareAndSwap { new: value, .. } => Ok(value),
        other => unreachable!("the scripts use get, put and compare-and-swap, not {other}"),
    }
}

impl MembershipModel {
    /// The client steps and view fetches that are enabled.
    pub(super) fn client_actions(
        &self,
        state: &MembershipState,
        actions: &mut Vec<MembershipAction>,
    ) {
        let copier = self.copier_client();
        for (index, client) in state.clients.iter().enumerate() {
            let runs = if index == copier {
                state.copier.stage == CopierStage::Copying && state.nodes[MOVING].alive
            } else {
                client.stage != Stage::Finished
            };
            if !runs {
                continue;
            }
            actions.push(MembershipAction::Step(index as u8));
            // A fetch answers with the newest view a running node applied.
            let newest = state
                .nodes
                .iter()
                .filter(|node| node.alive)
                .map(|node| node.applied)
                .max()
                .unwrap_or(0);
            if newest > client.view {
                actions.push(MembershipAction::Learn {
                    client: index as u8,
                    epoch: newest,
                });
            }
        }
    }

    /// The operation client `client` runs.
    fn operation_of(&self, state: &MembershipState, client: usize) -> Operation {
        if client == self.copier_client() {
            let value = state
                .copier
                .value
                .expect("a copy runs with the value it read");
            return Operation::CompareAndSwap {
                key: KEY,
                expected: value,
                new: value,
            };
        }
        self.scripts[client][usize::from(state.clients[client].operation)]
    }

    /// The operation's id in the history.
    fn operation_id(state: &MembershipState, client: usize) -> OperationId {
        OperationId {
            client: client as u8,
            index: state.clients[client].operation,
        }
    }

    /// The block a write of client `client` puts in place: one per operation.
    fn own_block(state: &MembershipState, client: usize) -> u8 {
        16 + 16 * client as u8 + state.clients[client].operation.min(15)
    }

    /// Invokes `operation` as client `client`'s next, under the view it routes by.
    pub(super) fn invoke(&self, state: &mut MembershipState, client: usize, operation: Operation) {
        let id = Self::operation_id(state, client);
        if state.history.on_invoke(id, operation).is_err() {
            state.linearizable = false;
        }
        let current = &mut state.clients[client];
        current.placed = false;
        Self::start(current);
    }

    /// Starts the operation (again) under the view the client routes by.
    fn start(client: &mut super::Client) {
        client.stage = Stage::ReadPrimary;
        client.epoch = client.view;
        client.seen = None;
        client.expected = [None; NODES];
        client.lock = None;
    }

    /// Ends client `client`'s operation with `outcome` (`None`: unresolved, pending forever).
    fn finish(&self, state: &mut MembershipState, client: usize, outcome: Option<Outcome>) {
        let id = Self::operation_id(state, client);
        if client != self.copier_client() {
            let written = self.operation_of(state, client).written_value();
            match (outcome, written) {
                (Some(Outcome::Applied), Some(value)) => state.acknowledged = Some(value),
                (None, Some(value)) => state.unresolved.insert(value),
                _ => {}
            }
        }
        if let Some(outcome) = outcome {
            if state.history.on_return(id, outcome).is_err() {
                state.linearizable = false;
            }
            state.linearizable &= state.history.is_consistent();
        }
        let current = &mut state.clients[client];
        current.operation += 1;
        current.stage = Stage::Idle;
        current.lock = None;
        if client == self.copier_client() {
            // An unresolved copy fails the refill or hand-over, which starts over.
            state.copier.stage = match outcome {
                Some(_) => CopierStage::Verifying,
                None => CopierStage::Idle,
            };
        }
    }

    /// Client `client` takes its next step.
    pub(super) fn step(&self, state: &mut MembershipState, client: usize) {
        let stage = state.clients[client].stage;
        if stage == Stage::Idle {
            match self.scripts[client].get(usize::from(state.clients[client].operation)) {
                Some(&operation) => self.invoke(state, client, operation),
                None => state.clients[client].stage = Stage::Finished,
            }
            return;
        }
        let operation = self.operation_of(state, client);
        let route = self.route_at(state, state.clients[client].epoch);
        let backups = route.copies.get(1..).unwrap_or_default();
        match stage {
            Stage::ReadPrimary => self.read_primary(state, client, operation),
            Stage::ReadBackup(index) => {
                let backup = backups[usize::from(index)];
                let Some(word) = self.access(state, client, backup) else {
                    return self.fail(state, client);
                };
                let current = &mut state.clients[client];
                current.expected[backup] = Some(word);
                current.stage = if usize::from(index) + 1 < backups.len() {
                    Stage::ReadBackup(index + 1)
                } else {
                    Stage::Lock
                };
            }
            Stage::Lock => self.lock(state, client, route.copies[0], backups.len()),
            Stage::Swap(index) => self.swap(state, client, operation, backups, index),
            Stage::Reread(index) => {
                let Some(word) = self.access(state, client, backups[usize::from(index)]) else {
                    return self.fail(state, client);
                };
                state.clients[client].stage = Stage::Check(index, word);
            }
            Stage::Check(index, read) => self.check_lock(state, client, backups, index, read),
            Stage::Commit => self.commit(state, client, operation),
            Stage::Steal(word) => self.steal(state, client, route.copies[0], word),
            Stage::Idle | Stage::Finished => unreachable!("not an access"),
        }
    }

    /// An access of client `client` to node `node`'s slot: the word, or `None` when it fails.
    /// A connection holds while the node's view is the one the operation runs under or an
    /// older one: a node that applied a newer view fenced it (or, on a new connection, welcomes
    /// the client with that view, and the client waits for it), and the client learns that
    /// view. It fails too when the node does not serve, and, under
    /// [`super::MoveRule::SameView`], while the node is behind the operation's view.
    pub(super) fn access(
        &self,
        state: &mut MembershipState,
        client: usize,
        node: usize,
    ) -> Option<Word> {
        let serves = state.serves(node, self.rule);
        let applied = state.nodes[node].applied;
        let current = &mut state.clients[client];
        if applied > current.epoch {
            current.view = current.view.max(applied);
            return None;
        }
        let behind = self.rule.same_view() && applied < current.epoch;
        (serves && !behind).then_some(state.nodes[node].word)
    }

    /// An access failed: a lock holder whose primary stays resumes under the view the client
    /// routes by (READ every backup again, check the lock, CAS, commit); one whose primary moved
    /// ends unresolved, as does a write a backup took before its primary moved; anything else
    /// starts again.
    fn fail(&self, state: &mut MembershipState, client: usize) {
        let current = state.clients[client];
        let primary = |epoch| self.route_at(state, epoch).copies.first().copied();
        let now = primary(current.view);
        if let Some((node, _)) = current.lock {
            if now != Some(usize::from(node)) {
                return self.finish(state, client, None);
            }
            let backups = self.route_at(state, current.view).copies.len() - 1;
            let resumed = &mut state.clients[client];
            resumed.epoch = resumed.view;
            resumed.expected = [None; NODES];
            resumed.stage = if backups > 0 {
                Stage::Reread(0)
            } else {
                Stage::Commit
            };
            return;
        }
        if current.placed && primary(current.epoch) != now {
            return self.finish(state, client, None);
        }
        Self::start(&mut state.clients[client]);
    }

    /// READ of the primary (a GET's of the copy it reads): a GET returns the value; a write
    /// decides what it writes, or waits for a lock it finds (taking over a crashed refill's).
    fn read_primary(&self, state: &mut MembershipState, client: usize, operation: Operation) {
        let route = self.route_at(state, state.clients[client].epoch);
        let target = match operation {
            Operation::Get { .. } => route.read,
            _ => route.copies.first().copied(),
        };
        let Some(word) = target.and_then(|node| self.access(state, client, node)) else {
            return self.fail(state, client);
        };
        if word.locked && !matches!(operation, Operation::Get { .. }) {
            let copier = state.clients[self.copier_client()].lock;
            let node = target.expect("read") as u8;
            if !state.nodes[MOVING].alive && copier == Some((node, word)) {
                state.clients[client].stage = Stage::Steal(word);
            } else {
                Self::start(&mut state.clients[client]);
            }
            return;
        }
        match decide(operation, word.value) {
            Err(outcome) => self.finish(state, client, Some(outcome)),
            Ok(_) => {
                let current = &mut state.clients[client];
                current.seen = Some(word);
                current.stage = if route.copies.len() > 1 {
                    Stage::ReadBackup(0)
                } else {
                    Stage::Lock
                };
            }
        }
    }

    /// The lock CAS on `primary`, expecting the word read.
    fn lock(&self, state: &mut MembershipState, client: usize, primary: usize, backups: usize) {
        let Some(word) = self.access(state, client, primary) else {
            return self.fail(state, client);
        };
        if Some(word) != state.clients[client].seen {
            return Self::start(&mut state.clients[client]);
        }
        let lock = Word {
            locked: true,
            ..word
        };
        state.nodes[primary].word = lock;
        let current = &mut state.clients[client];
        current.lock = Some((primary as u8, lock));
        current.stage = if backups > 0 {
            Stage::Swap(0)
        } else {
            Stage::Commit
        };
    }

    /// The CAS of the `index`-th backup, from the word read to the write's; READ it again when
    /// it fails.
    fn swap(
        &self,
        state: &mut MembershipState,
        client: usize,
        operation: Operation,
        backups: &[usize],
        index: u8,
    ) {
        let backup = backups[usize::from(index)];
        let Some(word) = self.access(state, client, backup) else {
            return self.fail(state, client);
        };
        if Some(word) != state.clients[client].expected[backup] {
            state.clients[client].stage = Stage::Reread(index);
            return;
        }
        let value = decide(
            operation,
            state.clients[client].seen.and_then(|seen| seen.value),
        )
        .expect("a write that locked has a value");
        state.nodes[backup].word = Word {
            value: Some(value),
            block: Self::own_block(state, client),
            locked: false,
        };
        let current = &mut state.clients[client];
        current.placed = true;
        current.stage = if usize::from(index) + 1 < backups.len() {
            Stage::Swap(index + 1)
        } else {
            Stage::Commit
        };
    }

    /// After a backup was read again: CAS it from that word only while the lock still holds.
    fn check_lock(
        &self,
        state: &mut MembershipState,
        client: usize,
        backups: &[usize],
        index: u8,
        read: Word,
    ) {
        let (node, lock) = state.clients[client].lock.expect("a lock holder checks");
        let Some(word) = self.access(state, client, usize::from(node)) else {
            return self.fail(state, client);
        };
        if word != lock {
            // Its lock is gone: the write did not happen (the client starts it again).
            return Self::start(&mut state.clients[client]);
        }
        let current = &mut state.clients[client];
        current.expected[backups[usize::from(index)]] = Some(read);
        current.stage = Stage::Swap(index);
    }

    /// The commit CAS: the lock to the write's word.
    fn commit(&self, state: &mut MembershipState, client: usize, operation: Operation) {
        let (node, lock) = state.clients[client].lock.expect("a lock holder commits");
        let Some(word) = self.access(state, client, usize::from(node)) else {
            return self.fail(state, client);
        };
        if word != lock {
            return Self::start(&mut state.clients[client]);
        }
        let value = decide(operation, lock.value).expect("a write that locked has a value");
        state.nodes[usize::from(node)].word = Word {
            value: Some(value),
            block: Self::own_block(state, client),
            locked: false,
        };
        self.finish(state, client, Some(Outcome::Applied));
    }

    /// Takes over a crashed refill's lock: its write put back the value it found, so unlocking
    /// to a fresh copy of it is its rollback. Then the operation starts again.
    fn steal(&self, state: &mut MembershipState, client: usize, primary: usize, lock: Word) {
        let Some(word) = self.access(state, client, primary) else {
            return self.fail(state, client);
        };
        if word == lock {
            state.nodes[primary].word = Word {
                value: lock.value,
                block: 200 + client as u8,
                locked: false,
            };
        }
        Self::start(&mut state.clients[client]);
    }
}
