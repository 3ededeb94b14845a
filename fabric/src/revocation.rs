//! What revoking a key found: normally that no requester can still be using it; on `shm`,
//! where the requester runs its own requests, possibly that one stayed inside a request past
//! the retry timeout (a stopped client process) and may still finish it when it resumes.

use std::fmt;

/// A requester that was inside a request when a key it could use was revoked, and still was
/// when the revocation's bound (the retry timeout) passed: an `shm` client process stopped
/// there (SIGSTOP, a debugger, a paused VM). The key fails for every request it begins from
/// now on, but the request it is inside was checked before, so a WRITE of that request may
/// still land in the key's memory when it resumes: that memory must not be reused until
/// [`RequesterInside::left`] says so.
pub struct RequesterInside {
    left: Box<dyn Fn() -> bool + Send + Sync>,
}

impl RequesterInside {
    /// A requester whose departure `left` tells (the providers make them; public for the
    /// tests of what a server does with one).
    pub fn new(left: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self {
            left: Box::new(left),
        }
    }

    /// Whether the requester has left that request since (its epoch moved on), or its process
    /// is gone, or its queue pair is (the server keeps a queue pair whose requester is inside
    /// a request until it is out): nothing it began before the revocation can still touch
    /// the memory. Cheap: a few loads and a non-blocking peek; ask on every pass.
    pub fn left(&self) -> bool {
        (self.left)()
    }

    /// Several requesters found inside: left once every one has.
    pub(crate) fn all(inside: Vec<RequesterInside>) -> Option<RequesterInside> {
        match inside.len() {
            0 => None,
            1 => inside.into_iter().next(),
            _ => Some(Self::new(move || inside.iter().all(RequesterInside::left))),
        }
    }
}

impl fmt::Debug for RequesterInside {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RequesterInside")
            .field("left", &self.left())
            .finish()
    }
}
