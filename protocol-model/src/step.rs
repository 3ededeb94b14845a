//! One atomic step of one client, and the description of it that counterexamples print.
//!
//! `Transition::run` performs exactly one shared-memory access (one slot READ or one slot CAS)
//! plus the local decisions that follow it, then updates the bookkeeping the properties need.
//! The parts both protocols share live here: reading the bucket, deciding after the first read,
//! in-place replacement, placing a block, restarting, and returning. The protocol-specific parts
//! live in `old_protocol` and `new_protocol`.
//!
//! An operation's invocation is recorded at its first step and its return at its last step. That
//! is the strictest real-time placement a client can produce (any later return, or earlier
//! invocation, only gives the linearizability tester more freedom), so checking it covers the rest.

use std::fmt;

use crate::bucket::{Block, Bucket, Slot};
use crate::client::{OperationId, Phase};
use crate::key_value::{Key, Operation, Outcome};
use crate::model::{block_of, record_invocation, record_return, IndexModel, ModelState, Protocol};
use crate::{new_protocol, old_protocol};

/// The shared-memory access of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// An atomic READ of one slot (and of the block it points at).
    Read {
        /// The slot read.
        slot: u8,
        /// The word found.
        found: Slot,
    },
    /// An atomic CAS of one slot.
    CompareAndSwap {
        /// The slot.
        slot: u8,
        /// The word the client expected.
        expected: Slot,
        /// The word it wanted to write.
        replacement: Slot,
        /// The word found (the swap happened iff it equals `expected`).
        found: Slot,
    },
}

impl fmt::Display for Access {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Access::Read { slot, found } => write!(formatter, "read slot {slot} -> {found}"),
            Access::CompareAndSwap {
                slot,
                expected,
                replacement,
                found,
            } => {
                write!(formatter, "cas slot {slot} {expected} => {replacement}: ")?;
                if found == expected {
                    write!(formatter, "swapped")
                } else {
                    write!(formatter, "failed, found {found}")
                }
            }
        }
    }
}

/// What the step did to the operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// The operation goes on.
    Continue,
    /// The operation starts over from its first read, or reads the bucket again after placing
    /// its block (old: a lost CAS on the winner; new: a kill that found its slot changed).
    Restart {
        /// Why.
        reason: &'static str,
        /// Whether only the re-read after placing is repeated.
        reread_only: bool,
    },
    /// The operation returned.
    Returned(Outcome),
    /// The operation used its retry budget and gave up; it stays pending in the history.
    GaveUp {
        /// Why the last attempt failed.
        reason: &'static str,
    },
}

/// A description of one step, for counterexamples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// The client, numbered from 1.
    pub client: u8,
    /// The operation the step belongs to.
    pub operation: Operation,
    /// Whether this step invoked the operation.
    pub invoked: bool,
    /// The slot access.
    pub access: Access,
    /// What followed.
    pub effect: Effect,
}

impl fmt::Display for Event {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut action = self.access.to_string();
        match self.effect {
            Effect::Continue => {}
            Effect::Restart {
                reason,
                reread_only: false,
            } => action.push_str(&format!("; starts over ({reason})")),
            Effect::Restart {
                reason,
                reread_only: true,
            } => action.push_str(&format!("; reads the bucket again ({reason})")),
            Effect::Returned(outcome) => action.push_str(&format!("; returns {outcome}")),
            Effect::GaveUp { reason } => {
                action.push_str(&format!("; gives up ({reason}), left pending"))
            }
        }
        let marker = if self.invoked { "*" } else { " " };
        write!(
            formatter,
            "c{} {marker}{:<16} {action}",
            self.client,
            self.operation.to_string()
        )
    }
}

/// A step in progress: a copy of the state being changed, and what the step did so far.
pub(crate) struct Transition<'model> {
    /// The model (scenario and protocol).
    pub(crate) model: &'model IndexModel,
    /// The state after the step, built up in place.
    pub(crate) state: ModelState,
    /// The index of the stepping client in `state.clients`.
    client: usize,
    /// The operation the client is in.
    pub(crate) operation: Operation,
    /// Whether this step invoked the operation.
    invoked: bool,
    /// The slot access, once made.
    access: Option<Access>,
    /// What followed the access.
    effect: Effect,
}

impl<'model> Transition<'model> {
    /// Client number `client + 1` takes its next step from `previous`.
    pub(crate) fn run(
        model: &'model IndexModel,
        previous: &ModelState,
        client: usize,
    ) -> (ModelState, Event) {
        let mut state = previous.clone();
        let client_state = &mut state.clients[client];
        let operation_index = client_state.operation_index;
        let operation = model.scenario.scripts[client][usize::from(operation_index)];
        let invoked = client_state.phase == Phase::Start;
        if invoked {
            client_state.phase = Phase::Read { next: 0 };
            client_state.restarts = 0;
            client_state.snapshot = Bucket::empty(model.scenario.slot_count);
            record_invocation(
                &mut state.history,
                OperationId {
                    client: client as u8 + 1,
                    index: operation_index,
                },
                operation,
            );
        }
        let mut transition = Transition {
            model,
            state,
            client,
            operation,
            invoked,
            access: None,
            effect: Effect::Continue,
        };
        transition.advance();
        transition.finish(previous)
    }

    /// Performs the step the client's phase names.
    fn advance(&mut self) {
        let slot_count = self.model.scenario.slot_count as u8;
        match self.phase() {
            Phase::Start | Phase::Finished => {
                unreachable!("a started client with operations left is never in this phase")
            }
            Phase::Read { next } => {
                self.read(next);
                if next + 1 < slot_count {
                    self.set_phase(Phase::Read { next: next + 1 });
                } else {
                    self.decide_after_read();
                }
            }
            Phase::Reread { next, mine } => {
                self.read(next);
                if next + 1 < slot_count {
                    self.set_phase(Phase::Reread {
                        next: next + 1,
                        mine,
                    });
                } else {
                    match self.model.protocol {
                        Protocol::Old => old_protocol::resolve_duplicates(self, mine),
                        Protocol::New | Protocol::NewDraft => {
                            new_protocol::confirm_placement(self, mine)
                        }
                    }
                }
            }
            Phase::Replace {
                slot,
                expected,
                replacement,
                outcome,
            } => {
                if self.compare_and_swap(slot, expected, replacement) {
                    self.complete(outcome);
                } else {
                    self.restart("lost the CAS race");
                }
            }
            Phase::Place { slot } => {
                let block = self.written_block();
                let word = match self.model.protocol {
                    Protocol::Old => Slot::Committed(block),
                    Protocol::New | Protocol::NewDraft => Slot::Tentative(block),
                };
                if self.compare_and_swap(slot, Slot::Empty, word) {
                    self.start_reading(Phase::Reread {
                        next: 0,
                        mine: slot,
                    });
                } else {
                    self.restart("the empty slot was taken");
                }
            }
            Phase::OverwriteWinner {
                winner,
                expected,
                mine,
            } => old_protocol::overwrite_winner(self, winner, expected, mine),
            Phase::RemoveDuplicate { mine, outcome } => {
                old_protocol::remove_duplicate(self, mine, outcome)
            }
            Phase::ClearForDelete { slot } => old_protocol::clear_for_delete(self, slot),
            Phase::Kill { slot, mine, tally } => new_protocol::kill(self, slot, mine, tally),
            Phase::Abort { mine } => new_protocol::abort(self, mine),
            Phase::Commit { mine } => new_protocol::commit(self, mine),
        }
    }

    /// After the last slot of the first read: the decisions both protocols share.
    fn decide_after_read(&mut self) {
        let key = self.key();
        let matches: Vec<(usize, Block)> = self.snapshot_matches(key);
        match self.operation {
            Operation::Get { .. } => {
                self.complete(Outcome::Found(
                    matches.first().map(|(_, block)| block.value),
                ));
                return;
            }
            Operation::Delete { .. } => {
                match self.model.protocol {
                    Protocol::Old => old_protocol::start_delete(self, &matches),
                    Protocol::New | Protocol::NewDraft => {
                        new_protocol::start_delete(self, &matches)
                    }
                }
                return;
            }
            _ => {}
        }
        if self.model.protocol.has_tentative_slots() && matches.len() > 1 {
            self.restart("read two committed slots of the key");
            return;
        }
        match (self.operation, matches.first().copied()) {
            (Operation::Insert { .. }, Some(_)) => self.complete(Outcome::Exists),
            (Operation::Update { .. }, None) => self.complete(Outcome::Absent),
            (Operation::CompareAndSwap { .. }, None) => self.complete(Outcome::Mismatch(None)),
            (Operation::CompareAndSwap { expected, .. }, Some((_, block)))
                if block.value != expected =>
            {
                self.complete(Outcome::Mismatch(Some(block.value)))
            }
            (_, Some((position, block))) => {
                let replacement = Slot::Committed(self.written_block());
                self.set_phase(Phase::Replace {
                    slot: position as u8,
                    expected: Slot::Committed(block),
                    replacement,
                    outcome: Outcome::Applied,
                });
            }
            (_, None) => match self.snapshot().first_empty() {
                Some(position) => self.set_phase(Phase::Place {
                    slot: position as u8,
                }),
                None => self.restart("no empty slot"),
            },
        }
    }

    /// The stepping client's phase.
    fn phase(&self) -> Phase {
        self.state.clients[self.client].phase
    }

    /// Sets the stepping client's next phase.
    pub(crate) fn set_phase(&mut self, phase: Phase) {
        self.state.clients[self.client].phase = phase;
    }

    /// The operation's key.
    pub(crate) fn key(&self) -> Key {
        self.operation.key()
    }

    /// The block the operation writes.
    ///
    /// # Panics
    ///
    /// For get and delete, which never reach a phase that writes a block.
    pub(crate) fn written_block(&self) -> Block {
        block_of(self.operation).expect("only operations that write a value place or swap a block")
    }

    /// The client's copy of the slots.
    pub(crate) fn snapshot(&self) -> &Bucket {
        &self.state.clients[self.client].snapshot
    }

    /// The committed slots of `key` in the client's copy, lowest position first.
    pub(crate) fn snapshot_matches(&self, key: Key) -> Vec<(usize, Block)> {
        self.snapshot().committed_matches(key).collect()
    }

    /// Clears the client's copy and enters a reading phase.
    pub(crate) fn start_reading(&mut self, phase: Phase) {
        let client = &mut self.state.clients[self.client];
        client.snapshot = Bucket::empty(self.model.scenario.slot_count);
        client.phase = phase;
    }

    /// Atomically reads one slot into the client's copy.
    fn read(&mut self, slot: u8) {
        let found = self.state.bucket.slot(usize::from(slot));
        self.state.clients[self.client]
            .snapshot
            .set(usize::from(slot), found);
        self.record_access(Access::Read { slot, found });
    }

    /// Atomically compare-and-swaps one slot; true when it swapped.
    pub(crate) fn compare_and_swap(&mut self, slot: u8, expected: Slot, replacement: Slot) -> bool {
        let found = self
            .state
            .bucket
            .compare_and_swap(usize::from(slot), expected, replacement);
        self.record_access(Access::CompareAndSwap {
            slot,
            expected,
            replacement,
            found,
        });
        found == expected
    }

    /// The word the last CAS found.
    pub(crate) fn last_found(&self) -> Option<Slot> {
        match self.access {
            Some(Access::CompareAndSwap { found, .. }) => Some(found),
            _ => None,
        }
    }

    /// Notes the step's one access.
    fn record_access(&mut self, access: Access) {
        debug_assert!(self.access.is_none(), "a step makes one access");
        self.access = Some(access);
    }

    /// Starts the operation over from its first read, or gives up when its budget is spent.
    pub(crate) fn restart(&mut self, reason: &'static str) {
        self.retry(reason, Phase::Read { next: 0 });
    }

    /// Goes back to the reading phase `phase` (counted against the retry budget), or gives up.
    pub(crate) fn retry(&mut self, reason: &'static str, phase: Phase) {
        if self.state.clients[self.client].restarts >= self.model.scenario.retry_budget {
            self.effect = Effect::GaveUp { reason };
            self.next_operation();
        } else {
            self.state.clients[self.client].restarts += 1;
            self.effect = Effect::Restart {
                reason,
                reread_only: matches!(phase, Phase::Reread { .. }),
            };
            self.start_reading(phase);
        }
    }

    /// Reports `outcome` and moves to the client's next operation.
    pub(crate) fn complete(&mut self, outcome: Outcome) {
        let operation_id = OperationId {
            client: self.client as u8 + 1,
            index: self.state.clients[self.client].operation_index,
        };
        record_return(&mut self.state.history, operation_id, outcome);
        if self.state.linearizable {
            self.state.linearizable = self.state.history.serialized_history().is_some();
        }
        if let (Operation::Insert { value, .. }, Outcome::Exists) = (self.operation, outcome) {
            self.state.reported_exists.insert(value);
        }
        self.effect = Effect::Returned(outcome);
        self.next_operation();
    }

    /// Moves the client to its next operation (or to `Finished`).
    fn next_operation(&mut self) {
        let script_length = self.model.scenario.scripts[self.client].len();
        let slot_count = self.model.scenario.slot_count;
        let client = &mut self.state.clients[self.client];
        client.operation_index += 1;
        client.restarts = 0;
        client.snapshot = Bucket::empty(slot_count);
        client.phase = if usize::from(client.operation_index) < script_length {
            Phase::Start
        } else {
            Phase::Finished
        };
    }

    /// Updates what the properties track, and returns the new state and the step's description.
    fn finish(mut self, previous: &ModelState) -> (ModelState, Event) {
        for key in Key::all() {
            let before = previous.bucket.visible_value(key);
            let after = self.state.bucket.visible_value(key);
            if before != after {
                if let Some(value) = before {
                    self.state.overwritten.insert(value);
                }
            }
            if let Some(value) = after {
                self.state.ever_visible.insert(value);
            }
        }
        let event = Event {
            client: self.client as u8 + 1,
            operation: self.operation,
            invoked: self.invoked,
            access: self
                .access
                .expect("every step makes exactly one slot access"),
            effect: self.effect,
        };
        (self.state, event)
    }
}
