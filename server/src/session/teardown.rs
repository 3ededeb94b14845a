//! The ordered teardown of a session (see the module docs of `session`).

use super::*;

impl Session {
    /// The ordered teardown described in the module docs.
    pub(super) fn teardown(&mut self) {
        if let Some(queue_pair) = &self.queue_pair {
            queue_pair.modify_to_error();
            queue_pair.drain();
        }
        for window in self.windows.drain(..) {
            window.invalidate();
        }
        if let Some(window) = self.chunk_window.take() {
            window.invalidate();
        }
        for (window, _) in self.retired_chunk_windows.drain(..) {
            window.invalidate();
        }
        self.queue_pair = None;
        self.shared.heap.seal_owned_by(self.connection_id);
    }
}
