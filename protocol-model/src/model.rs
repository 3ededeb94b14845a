//! The stateright model: the shared bucket, every client, the recorded history, and the
//! properties checked in every reachable state.
//!
//! An action is "client `c` takes its next atomic step" (one slot READ or one slot CAS, with
//! the local decisions that follow it). The checker explores every interleaving, which also
//! covers a client that stalls between any two of its steps for as long as the others run.
//!
//! # Visible value
//!
//! The value an atomic reader would return for a key in a state: the committed slot holding
//! the key at the lowest position, under both protocols (the old one has only committed slots;
//! the new one has at most one). Tentative slots are never visible. `no resurrection` and the
//! insert property are stated over visible values; `linearizable` is stated over what the
//! clients' non-atomic reads actually returned.
//!
//! # Bounding restarts
//!
//! A lost race restarts an operation. To keep the state space finite, each operation may
//! restart at most the scenario's `retry_budget` times; the next restart gives up instead. A
//! given-up operation reports nothing: its invocation stays pending in the linearizability
//! history, which lets the tester place it anywhere after its invocation or leave it out. That
//! is sound whether or not the operation had taken effect (the old protocol's put can give up
//! after its block was already visible). The client then goes on with its script, as a caller
//! that got `Contention` would. A new-protocol insert that gives up after placing leaves its
//! tentative slot behind, like an inserter that died there: the others must cope with it.
//!
//! # What the model leaves out
//!
//! Torn slot reads and checksum failures (they only make a lookup read again), the writer
//! turns of one process (they only remove interleavings), back-off (timing, not safety), the
//! second combined bucket (one shared bucket is the more adversarial shape), and the
//! collector and compactor (the compactor's move is a committed-to-committed CAS of one key,
//! the same shape as an update). Lists of work requests posted together (place + re-read, a
//! delete's CASes, the kills) are modeled one slot access per step, so the others can act
//! between any two of them: a superset of what the NIC does.

use std::fmt;
use std::str::FromStr;

use stateright::semantics::{ConsistencyTester, LinearizabilityTester};
use stateright::{Model, Property};

use crate::bucket::{Block, Bucket};
use crate::client::{ClientState, OperationId, Phase};
use crate::error::{Error, Result};
use crate::key_value::{Key, KeyValueSpec, Operation, Outcome, ValueSet};
use crate::scenario::Scenario;
use crate::step::{Event, Transition};

/// Property: every history is linearizable against [`KeyValueSpec`].
pub const LINEARIZABLE: &str = "linearizable";
/// Property: a value that was visible and then overwritten or deleted is never visible again.
pub const NO_RESURRECTION: &str = "no resurrection";
/// Property: an insert that reported `exists` never had its value visible, before or after.
pub const INSERT_EXISTS_NEVER_VISIBLE: &str =
    "an insert that reports exists never had its value visible";
/// Property (new protocol only): no key is ever committed in two slots at once.
pub const ONE_COMMITTED_SLOT_PER_KEY: &str = "at most one committed slot per key";

/// Which index-slot protocol the clients run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Today's client (`client/src/operations.rs`): inserts CAS a committed word into the first
    /// empty slot, then resolve duplicates by position (the lowest wins).
    Old,
    /// The fix, as `client/src/operations.rs` implements it and `docs/protocol.md` states it:
    /// inserts place a tentative word, re-read, abort if the key is committed elsewhere, else
    /// kill the other tentative slots of the key, then commit. Readers skip tentative slots. A
    /// kill that finds its block committed aborts; one that finds anything else reads the
    /// bucket again before deciding.
    New,
    /// The fix as first drafted: identical to [`Protocol::New`] except that a kill that finds
    /// anything but its block committed goes on to commit without reading again. The rival may
    /// have committed and then been replaced in place (an update, a compare-and-swap, the
    /// compactor) since the re-read, so the kill finds another block of the key, and the
    /// inserter commits a second copy (the checker finds this in `put-then-update`).
    NewDraft,
}

impl Protocol {
    /// Every protocol, in the order reports list them.
    pub const ALL: [Protocol; 3] = [Protocol::Old, Protocol::New, Protocol::NewDraft];

    /// Whether slot words can be tentative (the new protocol and its draft).
    pub fn has_tentative_slots(self) -> bool {
        matches!(self, Protocol::New | Protocol::NewDraft)
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            Protocol::Old => "old",
            Protocol::New => "new",
            Protocol::NewDraft => "new-draft",
        })
    }
}

impl FromStr for Protocol {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        match name {
            "old" => Ok(Protocol::Old),
            "new" => Ok(Protocol::New),
            "new-draft" => Ok(Protocol::NewDraft),
            _ => Err(Error::UnknownProtocol {
                name: name.to_string(),
            }),
        }
    }
}

/// A model to check: a scenario run under one protocol.
#[derive(Clone, Debug)]
pub struct IndexModel {
    /// The bucket's starting contents and the clients' scripts.
    pub scenario: Scenario,
    /// The protocol every client runs.
    pub protocol: Protocol,
}

/// One reachable state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModelState {
    /// The shared bucket.
    pub bucket: Bucket,
    /// Every client's local state, client 1 first.
    pub clients: Vec<ClientState>,
    /// Invocations and returns so far.
    pub history: LinearizabilityTester<OperationId, KeyValueSpec>,
    /// Whether `history` is linearizable; computed when a return is recorded (a history that is
    /// not linearizable stays so when it grows).
    pub linearizable: bool,
    /// Every value that has been the visible value of its key in some state so far.
    pub ever_visible: ValueSet,
    /// Values that were visible and then stopped being visible (replaced or deleted).
    pub overwritten: ValueSet,
    /// Values of inserts that reported `exists`.
    pub reported_exists: ValueSet,
}

/// An action: the client (numbered from 1) that takes its next step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientStep {
    /// The client, numbered from 1.
    pub client: u8,
}

impl IndexModel {
    /// A model of `scenario` under `protocol`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidScenario`] when the scenario does not fit the model (see
    /// [`Scenario::validate`]).
    pub fn new(scenario: Scenario, protocol: Protocol) -> Result<Self> {
        scenario.validate()?;
        Ok(Self { scenario, protocol })
    }

    /// The properties checked under this model's protocol, by name.
    pub fn property_names(&self) -> Vec<&'static str> {
        self.properties()
            .iter()
            .map(|property| property.name)
            .collect()
    }

    /// Takes `action` from `state`: the next state and a description of the step.
    pub fn transition(&self, state: &ModelState, action: ClientStep) -> (ModelState, Event) {
        Transition::run(self, state, usize::from(action.client) - 1)
    }

    /// Whether the property named `name` holds in `state`.
    ///
    /// # Panics
    ///
    /// If no property has that name.
    pub fn holds(&self, name: &'static str, state: &ModelState) -> bool {
        (self.property(name).condition)(self, state)
    }
}

impl Model for IndexModel {
    type State = ModelState;
    type Action = ClientStep;

    fn init_states(&self) -> Vec<ModelState> {
        let slot_count = self.scenario.slot_count;
        let bucket = self.scenario.initial_bucket();
        let mut ever_visible = ValueSet::default();
        for key in Key::all() {
            if let Some(value) = bucket.visible_value(key) {
                ever_visible.insert(value);
            }
        }
        let initial_map = Key::all()
            .filter_map(|key| Some((key, bucket.visible_value(key)?)))
            .collect::<Vec<_>>();
        vec![ModelState {
            bucket,
            clients: self
                .scenario
                .scripts
                .iter()
                .map(|script| ClientState::new(slot_count, script.len()))
                .collect(),
            history: LinearizabilityTester::new(KeyValueSpec::new(initial_map)),
            linearizable: true,
            ever_visible,
            overwritten: ValueSet::default(),
            reported_exists: ValueSet::default(),
        }]
    }

    fn actions(&self, state: &ModelState, actions: &mut Vec<ClientStep>) {
        for (index, client) in state.clients.iter().enumerate() {
            if client.phase != Phase::Finished {
                actions.push(ClientStep {
                    client: index as u8 + 1,
                });
            }
        }
    }

    fn next_state(&self, state: &ModelState, action: ClientStep) -> Option<ModelState> {
        Some(self.transition(state, action).0)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(LINEARIZABLE, |_, state: &ModelState| state.linearizable),
            Property::always(NO_RESURRECTION, |_, state: &ModelState| {
                Key::all().all(|key| match state.bucket.visible_value(key) {
                    Some(value) => !state.overwritten.contains(value),
                    None => true,
                })
            }),
            Property::always(INSERT_EXISTS_NEVER_VISIBLE, |_, state: &ModelState| {
                !state.reported_exists.intersects(state.ever_visible)
            }),
        ];
        if self.protocol.has_tentative_slots() {
            properties.push(Property::always(
                ONE_COMMITTED_SLOT_PER_KEY,
                |_, state: &ModelState| {
                    Key::all().all(|key| state.bucket.committed_matches(key).count() <= 1)
                },
            ));
        }
        properties
    }
}

/// Records an invocation; every operation has its own history thread, so this cannot clash.
pub(crate) fn record_invocation(
    history: &mut LinearizabilityTester<OperationId, KeyValueSpec>,
    operation_id: OperationId,
    operation: Operation,
) {
    history
        .on_invoke(operation_id, operation)
        .expect("each operation is invoked exactly once, on its own history thread");
}

/// Records a return of an invoked operation.
pub(crate) fn record_return(
    history: &mut LinearizabilityTester<OperationId, KeyValueSpec>,
    operation_id: OperationId,
    outcome: Outcome,
) {
    history
        .on_return(operation_id, outcome)
        .expect("an operation returns once, after its invocation");
}

/// The block an operation's value lives in.
pub(crate) fn block_of(operation: Operation) -> Option<Block> {
    Some(Block {
        key: operation.key(),
        value: operation.written_value()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key_value::Value;
    use crate::scenario::{
        compare_and_swap, delete, get, insert, put, update, DEFAULT_RETRY_BUDGET,
    };
    use crate::step::{Access, Effect};

    /// Runs a lone client's script to the end; returns each outcome and the number of steps.
    fn run_alone(protocol: Protocol, script: Vec<Operation>) -> (Vec<Outcome>, usize) {
        let scenario = Scenario {
            name: "alone",
            summary: "one client",
            slot_count: 3,
            retry_budget: DEFAULT_RETRY_BUDGET,
            initial: vec![],
            scripts: vec![script],
        };
        let model = IndexModel::new(scenario, protocol).expect("the scenario is valid");
        let mut state = model.init_states().remove(0);
        let mut outcomes = Vec::new();
        let mut steps = 0;
        while state.clients[0].phase != Phase::Finished {
            let (next, event) = model.transition(&state, ClientStep { client: 1 });
            if let Effect::Returned(outcome) = event.effect {
                outcomes.push(outcome);
            }
            assert!(
                !matches!(event.effect, Effect::Restart { .. } | Effect::GaveUp { .. }),
                "a lone client never loses a race: {event}"
            );
            if let Access::CompareAndSwap {
                expected, found, ..
            } = event.access
            {
                assert_eq!(expected, found, "a lone client's CAS succeeds: {event}");
            }
            state = next;
            steps += 1;
        }
        for property in model.property_names() {
            assert!(model.holds(property, &state), "{property}");
        }
        (outcomes, steps)
    }

    #[test]
    fn a_lone_client_sees_the_sequential_semantics_under_every_protocol() {
        let script = vec![
            get(1),
            update(1, 12),
            insert(1, 13),
            insert(1, 14),
            compare_and_swap(1, 12, 15),
            compare_and_swap(1, 13, 16),
            put(1, 17),
            delete(1),
            delete(1),
            put(1, 18),
            get(1),
        ];
        let expected = vec![
            Outcome::Found(None),
            Outcome::Absent,
            Outcome::Applied,
            Outcome::Exists,
            Outcome::Mismatch(Some(Value(13))),
            Outcome::Applied,
            Outcome::Applied,
            Outcome::Deleted { existed: true },
            Outcome::Deleted { existed: false },
            Outcome::Applied,
            Outcome::Found(Some(Value(18))),
        ];
        for protocol in Protocol::ALL {
            let (outcomes, _) = run_alone(protocol, script.clone());
            assert_eq!(outcomes, expected, "{protocol}");
        }
    }

    #[test]
    fn an_uncontended_insert_takes_one_more_step_under_the_new_protocol() {
        // Old: 3 reads, place, 3 re-reads. New: the same, then the commit.
        let (_, old_steps) = run_alone(Protocol::Old, vec![insert(1, 11)]);
        let (_, new_steps) = run_alone(Protocol::New, vec![insert(1, 11)]);
        assert_eq!(old_steps, 7);
        assert_eq!(new_steps, 8);
    }

    #[test]
    fn protocol_names_round_trip() {
        for protocol in Protocol::ALL {
            assert_eq!(
                protocol.to_string().parse::<Protocol>().ok(),
                Some(protocol)
            );
        }
        assert!("newer".parse::<Protocol>().is_err());
    }
}
