//! Writer turns: writers of one key in one process go one at a time (`docs/protocol.md`). The
//! stripes belong to the node, shared by the connections of all its lanes.

use super::*;

/// Stripes of the per-key writer turns (see `NodeConnection::writer_turn`).
const WRITER_STRIPES: usize = 1024;

/// The writer turns of one node in this process: a mutex per stripe of keys.
#[derive(Debug)]
pub(crate) struct WriterStripes(Box<[tokio::sync::Mutex<()>]>);

impl Default for WriterStripes {
    fn default() -> Self {
        Self(
            (0..WRITER_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
        )
    }
}

impl NodeConnection {
    /// Waits for this process's turn to write the key at `location`: writers of one key (and
    /// of the few keys sharing its stripe) go one at a time, whichever lane they use, so a hot
    /// key's writers do not spend their round trips losing CAS races to each other. Writers in
    /// other processes still race, and lose with a back-off. Take it before
    /// [`NodeConnection::scratch`].
    pub(crate) async fn writer_turn(
        &self,
        location: &rdkv_common::layout::KeyLocation,
    ) -> tokio::sync::MutexGuard<'_, ()> {
        self.writer_stripe(location).lock().await
    }

    /// The writer turn for the key at `location` if nobody in this process holds it now (a
    /// direct update, which never waits: `direct_update.rs`).
    pub(crate) fn try_writer_turn(
        &self,
        location: &rdkv_common::layout::KeyLocation,
    ) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        self.writer_stripe(location).try_lock().ok()
    }

    /// The stripe of the key at `location`.
    fn writer_stripe(
        &self,
        location: &rdkv_common::layout::KeyLocation,
    ) -> &tokio::sync::Mutex<()> {
        let stripes = &self.writer_stripes.0;
        let stripe = (location.combined_buckets[0]
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u64::from(location.fingerprint))
            % stripes.len() as u64) as usize;
        &stripes[stripe]
    }
}
