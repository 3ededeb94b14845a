//! Per-thread pools of objects an operation is done with (lists, progress records, value
//! vectors), for the next operation of the same thread: the steady path allocates nothing.
//! Each pool is a `thread_local!` of a `RefCell<Vec<T>>`; these two calls take from it and give
//! back to it, bounded.

use std::cell::RefCell;
use std::thread::LocalKey;

/// How many objects a thread keeps in one pool: one per task a worker commonly runs.
pub(crate) const KEPT: usize = 64;

/// The last object of `pool` that `fits`, if it has one (a thread being torn down has none).
pub(crate) fn take<T>(
    pool: &'static LocalKey<RefCell<Vec<T>>>,
    fits: impl FnOnce(&T) -> bool,
) -> Option<T> {
    pool.try_with(|spare| {
        let mut spare = spare.try_borrow_mut().ok()?;
        if fits(spare.last()?) {
            spare.pop()
        } else {
            None
        }
    })
    .ok()
    .flatten()
}

/// Gives `object` back to `pool`, unless it holds [`KEPT`] already (then it is dropped).
pub(crate) fn keep<T>(pool: &'static LocalKey<RefCell<Vec<T>>>, object: T) {
    let _ = pool.try_with(|spare| {
        if let Ok(mut spare) = spare.try_borrow_mut() {
            if spare.len() < KEPT {
                spare.push(object);
            }
        }
    });
}
