//! The key-value interface the index offers its clients, and its sequential specification.
//!
//! [`Operation`] and [`Outcome`] are the six client operations and what each can report, with
//! small integer keys and values so that model states stay small. [`KeyValueSpec`] is the
//! reference a linearizable index must be indistinguishable from: a map from key to an optional
//! value, one operation at a time. stateright's `LinearizabilityTester` checks recorded
//! histories against it.

use std::fmt;

use stateright::semantics::SequentialSpec;

/// The largest key number: keys are `k1` ..= `k3`.
pub const MAX_KEYS: usize = 3;

/// The largest value number plus one: a [`ValueSet`] is a 64-bit mask.
pub const VALUE_LIMIT: u8 = 64;

/// A key, numbered from 1 (`k1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub u8);

impl Key {
    /// Every key a model may use, in order.
    pub fn all() -> impl Iterator<Item = Key> {
        (1..=MAX_KEYS as u8).map(Key)
    }

    /// The key's index into a `[_; MAX_KEYS]` array.
    fn index(self) -> usize {
        usize::from(self.0) - 1
    }
}

impl fmt::Display for Key {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "k{}", self.0)
    }
}

/// A value. Every value is written by at most one operation, so a value also names the
/// immutable block that holds it: by convention client `c` writes `v{c}{n}` in its `n`-th
/// operation, and values present before any client starts are `v1` ..= `v9`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value(pub u8);

impl fmt::Display for Value {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "v{}", self.0)
    }
}

/// A set of values, as a bit mask (values are below [`VALUE_LIMIT`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ValueSet(u64);

impl ValueSet {
    /// Adds `value`.
    pub fn insert(&mut self, value: Value) {
        self.0 |= 1 << value.0;
    }

    /// Whether `value` is in the set.
    pub fn contains(self, value: Value) -> bool {
        self.0 & (1 << value.0) != 0
    }

    /// Whether the two sets share a value.
    pub fn intersects(self, other: ValueSet) -> bool {
        self.0 & other.0 != 0
    }
}

/// One client operation, as the client library offers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    /// Read the key's value.
    Get {
        /// The key read.
        key: Key,
    },
    /// Insert or replace (upsert).
    Put {
        /// The key written.
        key: Key,
        /// The new value.
        value: Value,
    },
    /// Insert only if the key is absent.
    Insert {
        /// The key written.
        key: Key,
        /// The new value.
        value: Value,
    },
    /// Replace only if the key is present.
    Update {
        /// The key written.
        key: Key,
        /// The new value.
        value: Value,
    },
    /// Remove the key.
    Delete {
        /// The key removed.
        key: Key,
    },
    /// Replace only if the current value equals `expected`.
    CompareAndSwap {
        /// The key written.
        key: Key,
        /// The value required.
        expected: Value,
        /// The new value.
        new: Value,
    },
}

impl Operation {
    /// The key the operation acts on.
    pub fn key(self) -> Key {
        match self {
            Operation::Get { key }
            | Operation::Put { key, .. }
            | Operation::Insert { key, .. }
            | Operation::Update { key, .. }
            | Operation::Delete { key }
            | Operation::CompareAndSwap { key, .. } => key,
        }
    }

    /// The value the operation writes, if it writes one.
    pub fn written_value(self) -> Option<Value> {
        match self {
            Operation::Get { .. } | Operation::Delete { .. } => None,
            Operation::Put { value, .. }
            | Operation::Insert { value, .. }
            | Operation::Update { value, .. } => Some(value),
            Operation::CompareAndSwap { new, .. } => Some(new),
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operation::Get { key } => write!(formatter, "get({key})"),
            Operation::Put { key, value } => write!(formatter, "put({key},{value})"),
            Operation::Insert { key, value } => write!(formatter, "insert({key},{value})"),
            Operation::Update { key, value } => write!(formatter, "update({key},{value})"),
            Operation::Delete { key } => write!(formatter, "delete({key})"),
            Operation::CompareAndSwap { key, expected, new } => {
                write!(formatter, "cas({key},{expected}->{new})")
            }
        }
    }
}

/// What an operation reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Get: the value, or `None` when the key is absent.
    Found(Option<Value>),
    /// Put, insert, update or compare-and-swap: the new value is in place.
    Applied,
    /// Insert: the key was present.
    Exists,
    /// Update: the key was absent.
    Absent,
    /// Delete: whether the key was present (and is now removed).
    Deleted {
        /// Whether the key was present.
        existed: bool,
    },
    /// Compare-and-swap: the value differed; here is what it was (`None`: absent).
    Mismatch(Option<Value>),
}

impl fmt::Display for Outcome {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Found(Some(value)) => write!(formatter, "{value}"),
            Outcome::Found(None) => write!(formatter, "absent"),
            Outcome::Applied => write!(formatter, "ok"),
            Outcome::Exists => write!(formatter, "exists"),
            Outcome::Absent => write!(formatter, "absent"),
            Outcome::Deleted { existed } => write!(formatter, "existed={existed}"),
            Outcome::Mismatch(Some(value)) => write!(formatter, "mismatch({value})"),
            Outcome::Mismatch(None) => write!(formatter, "mismatch(absent)"),
        }
    }
}

/// The sequential reference: a map from key to an optional value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct KeyValueSpec {
    /// The value of each key (index = key number − 1), `None` when absent.
    values: [Option<Value>; MAX_KEYS],
}

impl KeyValueSpec {
    /// A map holding `initial`.
    pub fn new(initial: impl IntoIterator<Item = (Key, Value)>) -> Self {
        let mut spec = Self::default();
        for (key, value) in initial {
            spec.values[key.index()] = Some(value);
        }
        spec
    }

    /// The value of `key`.
    pub fn value(&self, key: Key) -> Option<Value> {
        self.values[key.index()]
    }
}

impl SequentialSpec for KeyValueSpec {
    type Op = Operation;
    type Ret = Outcome;

    fn invoke(&mut self, operation: &Operation) -> Outcome {
        let current = &mut self.values[operation.key().index()];
        match *operation {
            Operation::Get { .. } => Outcome::Found(*current),
            Operation::Put { value, .. } => {
                *current = Some(value);
                Outcome::Applied
            }
            Operation::Insert { value, .. } => {
                if current.is_some() {
                    Outcome::Exists
                } else {
                    *current = Some(value);
                    Outcome::Applied
                }
            }
            Operation::Update { value, .. } => {
                if current.is_some() {
                    *current = Some(value);
                    Outcome::Applied
                } else {
                    Outcome::Absent
                }
            }
            Operation::Delete { .. } => Outcome::Deleted {
                existed: current.take().is_some(),
            },
            Operation::CompareAndSwap { expected, new, .. } => {
                if *current == Some(expected) {
                    *current = Some(new);
                    Outcome::Applied
                } else {
                    Outcome::Mismatch(*current)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_specification_follows_each_operation() {
        let key = Key(1);
        let mut spec = KeyValueSpec::new([(Key(2), Value(1))]);
        let steps = [
            (Operation::Get { key }, Outcome::Found(None)),
            (
                Operation::Update {
                    key,
                    value: Value(11),
                },
                Outcome::Absent,
            ),
            (
                Operation::CompareAndSwap {
                    key,
                    expected: Value(11),
                    new: Value(12),
                },
                Outcome::Mismatch(None),
            ),
            (
                Operation::Delete { key },
                Outcome::Deleted { existed: false },
            ),
            (
                Operation::Insert {
                    key,
                    value: Value(13),
                },
                Outcome::Applied,
            ),
            (
                Operation::Insert {
                    key,
                    value: Value(14),
                },
                Outcome::Exists,
            ),
            (
                Operation::CompareAndSwap {
                    key,
                    expected: Value(11),
                    new: Value(15),
                },
                Outcome::Mismatch(Some(Value(13))),
            ),
            (
                Operation::CompareAndSwap {
                    key,
                    expected: Value(13),
                    new: Value(16),
                },
                Outcome::Applied,
            ),
            (
                Operation::Put {
                    key,
                    value: Value(17),
                },
                Outcome::Applied,
            ),
            (
                Operation::Update {
                    key,
                    value: Value(18),
                },
                Outcome::Applied,
            ),
            (Operation::Get { key }, Outcome::Found(Some(Value(18)))),
            (
                Operation::Delete { key },
                Outcome::Deleted { existed: true },
            ),
            (
                Operation::Get { key: Key(2) },
                Outcome::Found(Some(Value(1))),
            ),
        ];
        for (operation, outcome) in steps {
            assert_eq!(spec.invoke(&operation), outcome, "{operation}");
        }
    }
}
