//! The built-in scenarios: a bucket's starting contents and each client's script.
//!
//! Values follow one convention: client `c` writes `v{c}{n}` in its `n`-th operation (from 1),
//! and values present at the start are `v1` ..= `v9`. Every value is written once.

use crate::bucket::{Block, Bucket, Slot, MAX_SLOTS};
use crate::error::{Error, Result};
use crate::key_value::{Key, Operation, Value, MAX_KEYS, VALUE_LIMIT};

/// The retry budget of most scenarios: two restarts, three attempts in all.
pub const DEFAULT_RETRY_BUDGET: u8 = 2;

/// The most clients a scenario may have.
pub const MAX_CLIENTS: usize = 4;

/// A bucket's starting contents and the clients' scripts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// The name used on the command line.
    pub name: &'static str,
    /// What the scenario exercises.
    pub summary: &'static str,
    /// How many slots the bucket has (the model's `S`).
    pub slot_count: usize,
    /// How many times one operation may restart before it gives up and stays pending (see
    /// [`crate::model`]): bounds the state space.
    pub retry_budget: u8,
    /// Committed blocks present at the start, by slot position.
    pub initial: Vec<(usize, Block)>,
    /// Each client's operations, client 1 first, run in order.
    pub scripts: Vec<Vec<Operation>>,
}

/// `get(k)`.
pub fn get(key: u8) -> Operation {
    Operation::Get { key: Key(key) }
}

/// `put(k, v)`.
pub fn put(key: u8, value: u8) -> Operation {
    Operation::Put {
        key: Key(key),
        value: Value(value),
    }
}

/// `insert(k, v)`.
pub fn insert(key: u8, value: u8) -> Operation {
    Operation::Insert {
        key: Key(key),
        value: Value(value),
    }
}

/// `update(k, v)`.
pub fn update(key: u8, value: u8) -> Operation {
    Operation::Update {
        key: Key(key),
        value: Value(value),
    }
}

/// `delete(k)`.
pub fn delete(key: u8) -> Operation {
    Operation::Delete { key: Key(key) }
}

/// `compare_and_swap(k, expected, new)`.
pub fn compare_and_swap(key: u8, expected: u8, new: u8) -> Operation {
    Operation::CompareAndSwap {
        key: Key(key),
        expected: Value(expected),
        new: Value(new),
    }
}

/// A committed block `k = v` at the start.
fn block(key: u8, value: u8) -> Block {
    Block {
        key: Key(key),
        value: Value(value),
    }
}

impl Scenario {
    /// Every built-in scenario.
    pub fn all() -> Vec<Scenario> {
        vec![
            Scenario {
                name: "duplicate-put",
                summary: "k2 sits in slot 0; c2 deletes it while c1 and c2 both put the absent \
                          k1, so the two puts can pick different first empty slots",
                slot_count: 3,
                retry_budget: DEFAULT_RETRY_BUDGET,
                initial: vec![(0, block(2, 1))],
                scripts: vec![vec![put(1, 11)], vec![delete(2), put(1, 22)]],
            },
            Scenario {
                name: "duplicate-insert",
                summary: "like duplicate-put, with inserts, and c3 reading k1 meanwhile",
                slot_count: 3,
                retry_budget: DEFAULT_RETRY_BUDGET,
                initial: vec![(0, block(2, 1))],
                scripts: vec![
                    vec![insert(1, 11)],
                    vec![delete(2), insert(1, 22)],
                    vec![get(1)],
                ],
            },
            Scenario {
                name: "slot-reuse",
                summary: "c1 inserts, deletes and re-inserts k1 (slots are freed and reused) \
                          while c2 puts k1 and c3 reads it",
                slot_count: 3,
                retry_budget: DEFAULT_RETRY_BUDGET,
                initial: vec![],
                scripts: vec![
                    vec![insert(1, 11), delete(1), insert(1, 13)],
                    vec![put(1, 21)],
                    vec![get(1)],
                ],
            },
            Scenario {
                name: "every-operation",
                summary: "every operation kind: update and compare-and-swap of a present k1 \
                          race its delete and re-insert, while c3 puts k2 and reads k1",
                slot_count: 3,
                retry_budget: DEFAULT_RETRY_BUDGET,
                initial: vec![(1, block(1, 1))],
                scripts: vec![
                    vec![update(1, 11), compare_and_swap(1, 11, 12)],
                    vec![delete(1), insert(1, 22)],
                    vec![put(2, 31), get(1)],
                ],
            },
            Scenario {
                name: "put-then-update",
                summary: "c1 puts the absent k1, updates it in place and deletes it while c2 \
                          puts k1 and then reads it",
                slot_count: 3,
                retry_budget: DEFAULT_RETRY_BUDGET,
                initial: vec![],
                scripts: vec![
                    vec![put(1, 11), update(1, 12), delete(1)],
                    vec![put(1, 21), get(1)],
                ],
            },
            Scenario {
                name: "three-puts",
                summary: "three clients put the absent k1 at once into a three-slot bucket",
                slot_count: 3,
                retry_budget: 1,
                initial: vec![],
                scripts: vec![vec![put(1, 11)], vec![put(1, 21)], vec![put(1, 31)]],
            },
        ]
    }

    /// The built-in scenario called `name`.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownScenario`] when there is none.
    pub fn named(name: &str) -> Result<Scenario> {
        let all = Self::all();
        let known = all
            .iter()
            .map(|scenario| scenario.name)
            .collect::<Vec<_>>()
            .join(", ");
        all.into_iter()
            .find(|scenario| scenario.name == name)
            .ok_or_else(|| Error::UnknownScenario {
                name: name.to_string(),
                known,
            })
    }

    /// Checks the scenario fits the model: 1..=[`MAX_SLOTS`] slots, 1..=[`MAX_CLIENTS`]
    /// clients, keys `k1`..=`k3`, starting blocks in distinct slots with distinct keys, and
    /// every value below 64 and written once.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidScenario`] saying what does not fit.
    pub fn validate(&self) -> Result<()> {
        let invalid = |reason: String| Error::InvalidScenario {
            scenario: self.name,
            reason,
        };
        if !(1..=MAX_SLOTS).contains(&self.slot_count) {
            return Err(invalid(format!(
                "{} slots; the model supports 1..={MAX_SLOTS}",
                self.slot_count
            )));
        }
        if !(1..=MAX_CLIENTS).contains(&self.scripts.len()) {
            return Err(invalid(format!(
                "{} clients; the model supports 1..={MAX_CLIENTS}",
                self.scripts.len()
            )));
        }
        let mut values = Vec::new();
        let mut keys = Vec::new();
        let mut positions = Vec::new();
        for &(position, block) in &self.initial {
            if position >= self.slot_count {
                return Err(invalid(format!("starting block in slot {position}")));
            }
            if positions.contains(&position) || keys.contains(&block.key) {
                return Err(invalid(format!(
                    "slot {position} or key {} starts twice",
                    block.key
                )));
            }
            positions.push(position);
            keys.push(block.key);
            values.push(block.value);
        }
        for script in &self.scripts {
            if script.len() > usize::from(u8::MAX) {
                return Err(invalid("a script over 255 operations".to_string()));
            }
            for operation in script {
                values.extend(operation.written_value());
            }
        }
        let every_key = self.initial.iter().map(|(_, block)| block.key).chain(
            self.scripts
                .iter()
                .flatten()
                .map(|operation| operation.key()),
        );
        for key in every_key {
            if !(1..=MAX_KEYS as u8).contains(&key.0) {
                return Err(invalid(format!("key {key}; keys are k1..=k{MAX_KEYS}")));
            }
        }
        for (index, value) in values.iter().enumerate() {
            if value.0 >= VALUE_LIMIT {
                return Err(invalid(format!(
                    "value {value}; values are below v{VALUE_LIMIT}"
                )));
            }
            if values[..index].contains(value) {
                return Err(invalid(format!("value {value} is written twice")));
            }
        }
        Ok(())
    }

    /// The bucket at the start: the initial blocks, committed.
    pub fn initial_bucket(&self) -> Bucket {
        let mut bucket = Bucket::empty(self.slot_count);
        for &(position, block) in &self.initial {
            bucket.set(position, Slot::Committed(block));
        }
        bucket
    }

    /// The same scenario with a different bucket width.
    pub fn with_slot_count(mut self, slot_count: usize) -> Self {
        self.slot_count = slot_count;
        self
    }

    /// The same scenario with a different retry budget.
    pub fn with_retry_budget(mut self, retry_budget: u8) -> Self {
        self.retry_budget = retry_budget;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_scenario_is_valid_and_named_once() {
        let all = Scenario::all();
        for scenario in &all {
            scenario.validate().expect("built-in scenarios are valid");
            assert_eq!(Scenario::named(scenario.name).as_ref().ok(), Some(scenario));
        }
        assert!(Scenario::named("no-such-scenario").is_err());
    }

    #[test]
    fn a_value_written_twice_is_refused() {
        let scenario = Scenario {
            name: "twice",
            summary: "",
            slot_count: 2,
            retry_budget: DEFAULT_RETRY_BUDGET,
            initial: vec![(0, block(1, 11))],
            scripts: vec![vec![put(1, 11)]],
        };
        assert!(matches!(
            scenario.validate(),
            Err(Error::InvalidScenario { .. })
        ));
    }
}
