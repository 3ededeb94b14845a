//! The shared index bucket: a row of slot words, each pointing at an immutable block.
//!
//! The model collapses rdkv's two combined buckets into one bucket of `slot_count` slots that
//! every key may use: the most adversarial shape, where any key's insert can land before or
//! after any other key's slot. A slot word is read or compare-and-swapped atomically, one slot
//! per step. Blocks are immutable and never reused while referenced, so reading a slot word and
//! the block it points at is one atomic step too: the model stores the block's key and value in
//! the slot word itself.

use std::fmt;

use crate::key_value::{Key, Value};

/// The most slots a model bucket can have (the state stores a fixed-size array).
pub const MAX_SLOTS: usize = 4;

/// An immutable key-value block in the heap. Values are unique, so a block is named by its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    /// The key stored in the block.
    pub key: Key,
    /// The value stored in the block.
    pub value: Value,
}

impl fmt::Display for Block {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}={}", self.key, self.value)
    }
}

/// One 8-byte slot word.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The word 0.
    #[default]
    Empty,
    /// Points at a block that readers take (the old protocol has only this kind).
    Committed(Block),
    /// New protocol only: a block placed by an insert that has not yet confirmed it is the
    /// key's only copy. Readers skip it.
    Tentative(Block),
}

impl Slot {
    /// The block, if the slot is committed and holds `key`.
    pub fn committed_block_of(self, key: Key) -> Option<Block> {
        match self {
            Slot::Committed(block) if block.key == key => Some(block),
            _ => None,
        }
    }

    /// The block, if the slot is tentative and holds `key`.
    pub fn tentative_block_of(self, key: Key) -> Option<Block> {
        match self {
            Slot::Tentative(block) if block.key == key => Some(block),
            _ => None,
        }
    }

    /// A short form for bucket pictures: `_`, `k1=v11`, `k1=v11?` (tentative).
    pub fn short(self) -> String {
        match self {
            Slot::Empty => "_".to_string(),
            Slot::Committed(block) => block.to_string(),
            Slot::Tentative(block) => format!("{block}?"),
        }
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Slot::Empty => write!(formatter, "empty"),
            Slot::Committed(block) => write!(formatter, "{block}"),
            Slot::Tentative(block) => write!(formatter, "tentative {block}"),
        }
    }
}

/// A bucket of slot words: the shared index, or a client's (possibly partial) copy of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// The slot words; positions at or past `slot_count` stay empty and unused.
    slots: [Slot; MAX_SLOTS],
    /// How many slots the bucket has (the model's `S`).
    slot_count: u8,
}

impl Bucket {
    /// A bucket of `slot_count` empty slots.
    ///
    /// # Panics
    ///
    /// If `slot_count` is 0 or over [`MAX_SLOTS`] (scenarios are validated before use).
    pub fn empty(slot_count: usize) -> Self {
        assert!(
            (1..=MAX_SLOTS).contains(&slot_count),
            "a bucket has 1..={MAX_SLOTS} slots"
        );
        Self {
            slots: [Slot::Empty; MAX_SLOTS],
            slot_count: slot_count as u8,
        }
    }

    /// How many slots the bucket has.
    pub fn slot_count(&self) -> usize {
        usize::from(self.slot_count)
    }

    /// The word at `position`.
    pub fn slot(&self, position: usize) -> Slot {
        self.slots[position]
    }

    /// Overwrites the word at `position` (setting up a scenario, or a client's copy).
    pub fn set(&mut self, position: usize, slot: Slot) {
        self.slots[position] = slot;
    }

    /// Atomic compare-and-swap of one word: if it equals `expected` it becomes `replacement`.
    /// Returns the word found (the swap happened iff it equals `expected`).
    pub fn compare_and_swap(&mut self, position: usize, expected: Slot, replacement: Slot) -> Slot {
        let found = self.slots[position];
        if found == expected {
            self.slots[position] = replacement;
        }
        found
    }

    /// The positions and blocks of the committed slots holding `key`, lowest position first.
    pub fn committed_matches(&self, key: Key) -> impl Iterator<Item = (usize, Block)> + '_ {
        self.positions().filter_map(move |position| {
            Some((position, self.slots[position].committed_block_of(key)?))
        })
    }

    /// The value an atomic reader would return for `key`: the committed match at the lowest
    /// position (both protocols; the old one has only committed slots).
    pub fn visible_value(&self, key: Key) -> Option<Value> {
        self.committed_matches(key)
            .next()
            .map(|(_, block)| block.value)
    }

    /// The lowest empty position.
    pub fn first_empty(&self) -> Option<usize> {
        self.positions()
            .find(|&position| self.slots[position] == Slot::Empty)
    }

    /// Every position, lowest first.
    pub fn positions(&self) -> std::ops::Range<usize> {
        0..self.slot_count()
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let words: Vec<String> = self
            .positions()
            .map(|position| self.slots[position].short())
            .collect();
        write!(formatter, "[{}]", words.join(" | "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(key: u8, value: u8) -> Block {
        Block {
            key: Key(key),
            value: Value(value),
        }
    }

    #[test]
    fn the_lowest_committed_match_is_visible_and_tentative_slots_are_not() {
        let mut bucket = Bucket::empty(3);
        bucket.set(0, Slot::Tentative(block(1, 11)));
        bucket.set(1, Slot::Committed(block(2, 21)));
        bucket.set(2, Slot::Committed(block(1, 12)));
        assert_eq!(bucket.visible_value(Key(1)), Some(Value(12)));
        assert_eq!(bucket.visible_value(Key(2)), Some(Value(21)));
        assert_eq!(bucket.visible_value(Key(3)), None);
        assert_eq!(bucket.first_empty(), None);
        assert_eq!(bucket.to_string(), "[k1=v11? | k2=v21 | k1=v12]");
    }

    #[test]
    fn compare_and_swap_swaps_only_on_equality() {
        let mut bucket = Bucket::empty(2);
        let word = Slot::Committed(block(1, 11));
        assert_eq!(bucket.compare_and_swap(1, Slot::Empty, word), Slot::Empty);
        assert_eq!(bucket.compare_and_swap(1, Slot::Empty, Slot::Empty), word);
        assert_eq!(bucket.slot(1), word);
        assert_eq!(bucket.first_empty(), Some(0));
    }
}
