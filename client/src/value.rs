//! [`Value`]: a value copied out of a block the client read, in a vector this thread reuses.
//! A lookup copies the value of each block it checks (to verify the block) before anyone
//! knows whether it is wanted: an update only checks it, a GET into the caller's vector takes
//! it by swapping vectors. Either way the vector comes back to this thread's spares, and the
//! steady path allocates nothing for it (`client/tests/allocations.rs`).

use std::cell::RefCell;

use bytes::Bytes;

thread_local! {
    /// This thread's emptied value vectors, with their room.
    static SPARE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// The most room a kept vector may have (a larger one, of a rare large value, is freed).
const SPARE_ROOM: usize = 64 * 1024;

/// A value read out of a block, in a vector that goes back to this thread's spares when
/// dropped.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Value(Vec<u8>);

impl Value {
    /// An empty value with room for `length` bytes: a spare vector of this thread, if one has
    /// the room.
    pub(crate) fn with_room(length: usize) -> Self {
        let spare = crate::spare::take(&SPARE, |vector| vector.capacity() >= length);
        Self(spare.unwrap_or_else(|| Vec::with_capacity(length)))
    }

    /// The vector, to fill.
    pub(crate) fn vector(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }

    /// Swaps the value into `into` (the caller's vector), whose old vector becomes this one's
    /// and goes back to the spares when it is dropped.
    pub(crate) fn swap_into(mut self, into: &mut Vec<u8>) {
        std::mem::swap(&mut self.0, into);
    }

    /// The value as [`Bytes`] (a copy: the vector goes back to the spares).
    pub(crate) fn to_bytes(&self) -> Bytes {
        Bytes::copy_from_slice(&self.0)
    }
}

impl std::ops::Deref for Value {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl Clone for Value {
    fn clone(&self) -> Self {
        let mut copy = Value::with_room(self.0.len());
        copy.0.extend_from_slice(&self.0);
        copy
    }
}

impl Drop for Value {
    fn drop(&mut self) {
        let mut vector = std::mem::take(&mut self.0);
        if vector.capacity() == 0 || vector.capacity() > SPARE_ROOM {
            return;
        }
        vector.clear();
        crate::spare::keep(&SPARE, vector);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_value_lends_its_vector_to_the_next_one_of_its_thread() {
        let mut first = Value::with_room(1_000);
        first.vector().extend_from_slice(&[7; 1_000]);
        let address = first.as_ptr();
        drop(first);
        let mut second = Value::with_room(900);
        assert_eq!(
            second.vector().as_ptr(),
            address,
            "the spare vector is reused"
        );
        assert!(second.is_empty());
        second.vector().extend_from_slice(b"value");
        let mut into = Vec::with_capacity(2_000);
        let theirs = into.as_ptr();
        second.swap_into(&mut into);
        assert_eq!(into, b"value");
        assert_eq!(
            Value::with_room(1_500).0.as_ptr(),
            theirs,
            "the caller's old vector is kept"
        );
    }
}
