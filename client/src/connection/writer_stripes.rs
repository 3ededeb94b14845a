//! Writer turns: writers of one key in one process go one at a time (`docs/protocol.md`).

use super::*;

/// Stripes of the per-key writer turns (see `NodeConnection::writer_turn`).
pub(super) const WRITER_STRIPES: usize = 1024;

impl NodeConnection {
    /// Waits for this process's turn to write the key at `location`: writers of one key (and
    /// of the few keys sharing its stripe) go one at a time, so a hot key's writers do not
    /// spend their round trips losing CAS races to each other. Writers in other processes
    /// still race, and lose with a back-off. Take it before [`NodeConnection::scratch`].
    pub(crate) async fn writer_turn(
        &self,
        location: &rdkv_common::layout::KeyLocation,
    ) -> tokio::sync::MutexGuard<'_, ()> {
        let stripe = (location.combined_buckets[0]
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u64::from(location.fingerprint))
            % self.writer_stripes.len() as u64) as usize;
        self.writer_stripes[stripe].lock().await
    }
}
