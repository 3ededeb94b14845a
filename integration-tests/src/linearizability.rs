//! A linearizability checker for a key-value register history, in the style of Wing & Gong's
//! search with porcupine's memoization.
//!
//! Linearizability is local (compositional), so the history is split per key and each key is
//! checked against a register model: `get`, `put`, `delete` and `compare_and_swap`. The search
//! walks the calls in time order, tries to linearize each pending call whose effect is
//! consistent with the model state, backtracks when a return is reached before its call was
//! linearized, and remembers every (linearized set, state) pair already explored.

use std::collections::{HashMap, HashSet};

/// An operation on one key. Values are unique `u64`s, so a read names the write it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Read the value.
    Get,
    /// Write a value.
    Put(u64),
    /// Write a value only if the key is absent.
    Insert(u64),
    /// Write a value only if the key is present.
    Update(u64),
    /// Remove the key.
    Delete,
    /// Replace `expected` with `new`.
    CompareAndSwap {
        /// The value required.
        expected: u64,
        /// The value written.
        new: u64,
    },
}

/// What the operation returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `get`: the value, or absent.
    Value(Option<u64>),
    /// `put`: done.
    Written,
    /// `delete`: whether the key existed.
    Deleted(bool),
    /// `compare_and_swap`: swapped.
    Swapped,
    /// `compare_and_swap`: not swapped; the value seen.
    Mismatch(Option<u64>),
    /// `insert`: whether it inserted (false: the key was present).
    Inserted(bool),
    /// `update`: whether it updated (false: the key was absent).
    Updated(bool),
    /// The operation failed with an error that says it may have applied: it took effect at
    /// some point after its call, or never. Record it with `ret = u64::MAX`.
    Unknown,
}

/// One completed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// The key.
    pub key: u64,
    /// The operation.
    pub operation: Operation,
    /// Its result.
    pub outcome: Outcome,
    /// When it was called (any monotonic unit).
    pub call: u64,
    /// When it returned.
    pub ret: u64,
}

/// The register model: the new state, or `None` if `outcome` is impossible in `state`.
fn step(state: Option<u64>, operation: Operation, outcome: Outcome) -> Option<Option<u64>> {
    match (operation, outcome) {
        (Operation::Get, Outcome::Value(value)) => (value == state).then_some(state),
        (Operation::Put(value), Outcome::Written) => Some(Some(value)),
        (Operation::Delete, Outcome::Deleted(existed)) => {
            (existed == state.is_some()).then_some(None)
        }
        (Operation::CompareAndSwap { expected, new }, Outcome::Swapped) => {
            (state == Some(expected)).then_some(Some(new))
        }
        (Operation::CompareAndSwap { expected, .. }, Outcome::Mismatch(seen)) => {
            (state != Some(expected) && seen == state).then_some(state)
        }
        (Operation::Insert(value), Outcome::Inserted(inserted)) => {
            (inserted == state.is_none()).then_some(if inserted { Some(value) } else { state })
        }
        (Operation::Update(value), Outcome::Updated(updated)) => {
            (updated == state.is_some()).then_some(if updated { Some(value) } else { state })
        }
        // An operation that may have applied: linearized here, it has its effect; its return
        // is at the end of time, so "never applied" is the same as "applied after everything".
        (operation, Outcome::Unknown) => Some(match operation {
            Operation::Get => state,
            Operation::Put(value) => Some(value),
            Operation::Insert(value) => state.or(Some(value)),
            Operation::Update(value) => state.map(|_| value),
            Operation::Delete => None,
            Operation::CompareAndSwap { expected, new } => {
                if state == Some(expected) {
                    Some(new)
                } else {
                    state
                }
            }
        }),
        _ => None,
    }
}

/// The result of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every key's history is linearizable.
    Linearizable,
    /// This key's history is not.
    Violation {
        /// The key.
        key: u64,
        /// Its operations.
        operations: usize,
    },
}

/// Checks a whole history, key by key.
pub fn check(history: &[Event]) -> Verdict {
    let mut per_key: HashMap<u64, Vec<Event>> = HashMap::new();
    for event in history {
        per_key.entry(event.key).or_default().push(*event);
    }
    let mut keys: Vec<u64> = per_key.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let events = &per_key[&key];
        if !check_key(events) {
            return Verdict::Violation {
                key,
                operations: events.len(),
            };
        }
    }
    Verdict::Linearizable
}

/// One entry of the time-ordered call/return list.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The operation's index.
    operation: usize,
    /// Call (true) or return.
    is_call: bool,
    /// Previous live entry.
    previous: Option<usize>,
    /// Next live entry.
    next: Option<usize>,
}

/// The calls and returns not linearized yet, in time order: a doubly linked list over
/// `entries`. Linearizing a call takes it and its return out; backtracking puts them back.
struct CallList {
    /// Every call and return, in time order.
    entries: Vec<Entry>,
    /// The first entry still in the list.
    head: Option<usize>,
    /// Where each operation's return is in `entries`.
    return_of: Vec<usize>,
}

impl CallList {
    /// Every call and return of `events`, linked in time order.
    fn new(events: &[Event]) -> Self {
        let count = events.len();
        // Calls sort before returns at equal times: equal stamps count as concurrent.
        let mut order: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * count);
        for (index, event) in events.iter().enumerate() {
            order.push((event.call, true, index));
            order.push((event.ret, false, index));
        }
        order.sort_by_key(|(time, is_call, index)| (*time, !*is_call, *index));
        let mut entries: Vec<Entry> = order
            .iter()
            .map(|(_, is_call, operation)| Entry {
                operation: *operation,
                is_call: *is_call,
                previous: None,
                next: None,
            })
            .collect();
        let mut return_of = vec![0usize; count];
        for (position, entry) in entries.iter().enumerate() {
            if !entry.is_call {
                return_of[entry.operation] = position;
            }
        }
        let length = entries.len();
        for (position, entry) in entries.iter_mut().enumerate() {
            entry.previous = position.checked_sub(1);
            entry.next = (position + 1 < length).then_some(position + 1);
        }
        Self {
            entries,
            head: (length > 0).then_some(0usize),
            return_of,
        }
    }

    /// Takes the call at `call` and its return out of the list.
    fn remove_operation(&mut self, call: usize) {
        let operation = self.entries[call].operation;
        self.unlink(call);
        self.unlink(self.return_of[operation]);
    }

    /// Puts the call at `call` and its return back, as they were before
    /// [`CallList::remove_operation`].
    fn restore_operation(&mut self, call: usize) {
        let operation = self.entries[call].operation;
        self.relink(self.return_of[operation]);
        self.relink(call);
    }

    /// Removes one entry from the list (it keeps its own links, for [`CallList::relink`]).
    fn unlink(&mut self, position: usize) {
        let Entry { previous, next, .. } = self.entries[position];
        match previous {
            Some(previous) => self.entries[previous].next = next,
            None => self.head = next,
        }
        if let Some(next) = next {
            self.entries[next].previous = previous;
        }
    }

    /// Puts an unlinked entry back between its neighbours.
    fn relink(&mut self, position: usize) {
        let Entry { previous, next, .. } = self.entries[position];
        match previous {
            Some(previous) => self.entries[previous].next = Some(position),
            None => self.head = Some(position),
        }
        if let Some(next) = next {
            self.entries[next].previous = Some(position);
        }
    }
}

/// Checks one key's history starting from an absent key.
pub fn check_key(events: &[Event]) -> bool {
    let mut calls = CallList::new(events);
    let mut linearized = vec![0u64; events.len().div_ceil(64)];
    let mut state: Option<u64> = None;
    let mut seen: HashSet<(Vec<u64>, Option<u64>)> = HashSet::new();
    let mut stack: Vec<(usize, Option<u64>)> = Vec::new();
    let mut cursor = calls.head;
    loop {
        if calls.head.is_none() {
            return true;
        }
        match cursor.map(|position| (position, calls.entries[position])) {
            Some((position, entry)) if entry.is_call => {
                let event = events[entry.operation];
                if let Some(next_state) = step(state, event.operation, event.outcome) {
                    let mut next_linearized = linearized.clone();
                    next_linearized[entry.operation / 64] |= 1 << (entry.operation % 64);
                    if seen.insert((next_linearized.clone(), next_state)) {
                        stack.push((position, state));
                        state = next_state;
                        linearized = next_linearized;
                        calls.remove_operation(position);
                        cursor = calls.head;
                        continue;
                    }
                }
                cursor = entry.next;
            }
            // A return whose call is not linearized yet, or the end of the list walked off with
            // calls left (impossible when returns follow calls): undo the last choice.
            _ => {
                let Some((call, previous_state)) = stack.pop() else {
                    return false;
                };
                calls.restore_operation(call);
                let operation = calls.entries[call].operation;
                linearized[operation / 64] &= !(1 << (operation % 64));
                state = previous_state;
                cursor = calls.entries[call].next;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(operation: Operation, outcome: Outcome, call: u64, ret: u64) -> Event {
        Event {
            key: 1,
            operation,
            outcome,
            call,
            ret,
        }
    }

    #[test]
    fn sequential_history_passes() {
        let history = [
            event(Operation::Get, Outcome::Value(None), 0, 1),
            event(Operation::Put(5), Outcome::Written, 2, 3),
            event(Operation::Get, Outcome::Value(Some(5)), 4, 5),
            event(
                Operation::CompareAndSwap {
                    expected: 5,
                    new: 6,
                },
                Outcome::Swapped,
                6,
                7,
            ),
            event(
                Operation::CompareAndSwap {
                    expected: 5,
                    new: 7,
                },
                Outcome::Mismatch(Some(6)),
                8,
                9,
            ),
            event(Operation::Delete, Outcome::Deleted(true), 10, 11),
            event(Operation::Delete, Outcome::Deleted(false), 12, 13),
        ];
        assert_eq!(check(&history), Verdict::Linearizable);
    }

    #[test]
    fn overlapping_operations_may_take_either_order() {
        let history = [
            event(Operation::Put(1), Outcome::Written, 0, 10),
            event(Operation::Put(2), Outcome::Written, 1, 9),
            event(Operation::Get, Outcome::Value(Some(1)), 11, 12),
        ];
        assert_eq!(
            check(&history),
            Verdict::Linearizable,
            "put 2 then put 1 explains the read"
        );
    }

    #[test]
    fn a_stale_read_fails() {
        let history = [
            event(Operation::Put(1), Outcome::Written, 0, 1),
            event(Operation::Put(2), Outcome::Written, 2, 3),
            event(Operation::Get, Outcome::Value(Some(1)), 4, 5),
        ];
        assert!(matches!(
            check(&history),
            Verdict::Violation {
                key: 1,
                operations: 3
            }
        ));
    }

    #[test]
    fn a_value_never_written_fails() {
        let history = [
            event(Operation::Put(1), Outcome::Written, 0, 1),
            event(Operation::Get, Outcome::Value(Some(9)), 2, 3),
        ];
        assert!(matches!(check(&history), Verdict::Violation { .. }));
    }

    #[test]
    fn two_successful_swaps_from_one_value_fail() {
        let history = [
            event(Operation::Put(1), Outcome::Written, 0, 1),
            event(
                Operation::CompareAndSwap {
                    expected: 1,
                    new: 2,
                },
                Outcome::Swapped,
                2,
                10,
            ),
            event(
                Operation::CompareAndSwap {
                    expected: 1,
                    new: 3,
                },
                Outcome::Swapped,
                3,
                9,
            ),
        ];
        assert!(matches!(check(&history), Verdict::Violation { .. }));
    }

    #[test]
    fn insert_and_update_follow_presence() {
        let history = [
            event(Operation::Update(1), Outcome::Updated(false), 0, 1),
            event(Operation::Insert(2), Outcome::Inserted(true), 2, 3),
            event(Operation::Insert(3), Outcome::Inserted(false), 4, 5),
            event(Operation::Update(4), Outcome::Updated(true), 6, 7),
            event(Operation::Get, Outcome::Value(Some(4)), 8, 9),
        ];
        assert_eq!(check(&history), Verdict::Linearizable);
        let inserted_over_a_present_key = [
            event(Operation::Put(1), Outcome::Written, 0, 1),
            event(Operation::Insert(2), Outcome::Inserted(true), 2, 3),
        ];
        assert!(matches!(
            check(&inserted_over_a_present_key),
            Verdict::Violation { .. }
        ));
        // The "visible insert reported as exists": the key was absent, an insert's value
        // was read, yet the insert said the key was present.
        let visible_but_reported_present = [
            event(Operation::Delete, Outcome::Deleted(false), 0, 1),
            event(Operation::Insert(3), Outcome::Inserted(false), 2, 20),
            event(Operation::Get, Outcome::Value(Some(3)), 5, 6),
        ];
        assert!(matches!(
            check(&visible_but_reported_present),
            Verdict::Violation { .. }
        ));
    }

    #[test]
    fn an_unknown_outcome_may_apply_or_not() {
        let applied = [
            event(Operation::Put(1), Outcome::Unknown, 0, u64::MAX),
            event(Operation::Get, Outcome::Value(Some(1)), 2, 3),
        ];
        assert_eq!(check(&applied), Verdict::Linearizable);
        let not_applied = [
            event(Operation::Put(1), Outcome::Unknown, 0, u64::MAX),
            event(Operation::Get, Outcome::Value(None), 2, 3),
        ];
        assert_eq!(check(&not_applied), Verdict::Linearizable);
        let applied_then_undone = [
            event(Operation::Put(1), Outcome::Unknown, 0, u64::MAX),
            event(Operation::Get, Outcome::Value(Some(1)), 2, 3),
            event(Operation::Get, Outcome::Value(None), 4, 5),
        ];
        assert!(matches!(
            check(&applied_then_undone),
            Verdict::Violation { .. }
        ));
    }

    #[test]
    fn a_resurrected_value_fails() {
        // The first history, shortened: a slow put's value comes back after newer
        // writes completed.
        let history = [
            event(Operation::Put(1), Outcome::Written, 0, 50),
            event(
                Operation::CompareAndSwap {
                    expected: 1,
                    new: 2,
                },
                Outcome::Swapped,
                10,
                11,
            ),
            event(Operation::Delete, Outcome::Deleted(true), 20, 21),
            event(Operation::Put(3), Outcome::Written, 30, 31),
            event(Operation::Get, Outcome::Value(Some(1)), 60, 61),
        ];
        assert!(matches!(check(&history), Verdict::Violation { .. }));
    }

    #[test]
    fn a_delete_that_claims_absence_of_a_written_key_fails() {
        let history = [
            event(Operation::Put(4), Outcome::Written, 0, 1),
            event(Operation::Delete, Outcome::Deleted(false), 2, 3),
        ];
        assert!(matches!(check(&history), Verdict::Violation { .. }));
    }
}
