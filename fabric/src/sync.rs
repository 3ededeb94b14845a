//! Taking a lock whose data a panicking thread may have poisoned: [`lock`] for a `Mutex`,
//! [`read_lock`] and [`write_lock`] for an `RwLock`.
//!
//! Every lock in rdkv guards state that is consistent at every unlock point (no critical
//! section leaves a half-written value behind it), so a panic elsewhere never leaves the data
//! unusable: these recover it instead of spreading the panic to every later caller.
//!
//! The one definition in the workspace. It lives in this crate because `rdkv-fabric` is the
//! bottom of the dependency graph (`rdkv-common`, the server and the client all depend on it,
//! and it depends on none of them); a crate of its own for three functions would weigh more
//! than it holds.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `mutex`, recovering the data if a panicking thread poisoned it (see the module docs).
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Takes `rwlock` for reading, recovering the data if a panicking thread poisoned it.
pub fn read_lock<T: ?Sized>(rwlock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    rwlock
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Takes `rwlock` for writing, recovering the data if a panicking thread poisoned it.
pub fn write_lock<T: ?Sized>(rwlock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    rwlock
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_gives_its_data_back() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let rwlock = std::sync::Arc::new(RwLock::new(2));
        let (poisoned_mutex, poisoned_rwlock) = (mutex.clone(), rwlock.clone());
        let _ = std::thread::spawn(move || {
            let _mutex = poisoned_mutex.lock();
            let _rwlock = poisoned_rwlock.write();
            panic!("poison both");
        })
        .join();
        assert!(mutex.is_poisoned() && rwlock.is_poisoned());
        *lock(&mutex) += 1;
        *write_lock(&rwlock) += 1;
        assert_eq!((*lock(&mutex), *read_lock(&rwlock)), (2, 3));
    }
}
