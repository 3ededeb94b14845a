//! [`StepList`]: the work requests of one step of an operation, and the two that every step's
//! list gains when [`Scratch::execute`](super::Scratch::execute) posts it: the announce WRITE
//! at the front of the operation's first list (before any READ or CAS of it, the node learns
//! that it started: `announce.rs`) and the READ of the node's lease word at the end. The list
//! keeps room for both from the start, so that neither makes it grow while it is posted, and
//! this file is the one place that knows they join.

use rdkv_fabric::WorkRequest;

/// Requests [`StepList::into_posted`] adds: the announce WRITE and the lease word's READ.
const ADDED_WHEN_POSTED: usize = 2;

/// The requests of one step, with room for what posting adds ([`ADDED_WHEN_POSTED`]).
#[derive(Debug, Default)]
pub(crate) struct StepList {
    /// The step's own requests, in order.
    requests: Vec<WorkRequest>,
}

thread_local! {
    /// This thread's lists that were posted, emptied with their capacity kept, for the next
    /// steps ([`StepList::new`], [`recycle`]): no allocation per list on the steady path.
    static SPARE_LISTS: std::cell::RefCell<Vec<Vec<WorkRequest>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// The most requests a kept list may have room for (a longer one, a large batch's, is freed).
const SPARE_LIST_ROOM: usize = 64;

/// Keeps `list`, posted or run and so no longer needed, emptied, for a later step of this
/// thread ([`StepList::new`]).
pub(crate) fn recycle(mut list: Vec<WorkRequest>) {
    if list.capacity() == 0 || list.capacity() > SPARE_LIST_ROOM {
        return;
    }
    list.clear();
    crate::spare::keep(&SPARE_LISTS, list);
}

impl StepList {
    /// An empty list: one this thread posted before ([`recycle`]), with its room, if there is
    /// one; otherwise it allocates when requests join (with room for what posting adds).
    pub(crate) fn new() -> Self {
        let requests = crate::spare::take(&SPARE_LISTS, |_| true).unwrap_or_default();
        Self { requests }
    }

    /// An empty list with room for `requests` of the step's own and for what posting adds.
    pub(crate) fn with_room_for(requests: usize) -> Self {
        let mut list = Self::new();
        list.reserve(requests);
        list
    }

    /// A list of one request.
    pub(crate) fn of(request: WorkRequest) -> Self {
        let mut list = Self::with_room_for(1);
        list.push(request);
        list
    }

    /// A list of `request`, if there is one, with room for `more` of the step's own after it.
    pub(crate) fn starting_with(request: Option<WorkRequest>, more: usize) -> Self {
        let mut list = Self::with_room_for(more + 1);
        list.requests.extend(request);
        list
    }

    /// Makes room for `requests` more of the step's own, and for what posting adds.
    pub(crate) fn reserve(&mut self, requests: usize) {
        self.requests.reserve_exact(requests + ADDED_WHEN_POSTED);
    }

    /// Appends a request.
    pub(crate) fn push(&mut self, request: WorkRequest) {
        self.requests.push(request);
    }

    /// Appends requests (reserve room for them first).
    pub(crate) fn extend(&mut self, requests: impl IntoIterator<Item = WorkRequest>) {
        self.requests.extend(requests);
    }

    /// The list as posted: `announce` first (the operation's first list only), the step's own
    /// requests, then `lease_word`, which reads the node's lease word after all of them.
    pub(crate) fn into_posted(
        self,
        announce: Option<WorkRequest>,
        lease_word: WorkRequest,
    ) -> Vec<WorkRequest> {
        let mut list = self.requests;
        if let Some(announce) = announce {
            list.insert(0, announce);
        }
        // Only the tail reports: a list's caller looks only for a failed request, and a
        // failed or flushed request completes whether it was signaled or not.
        for request in &mut list {
            request.signaled = false;
        }
        list.push(lease_word.with_signaled(true));
        list
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkv_fabric::{LocalSegment, RemoteSegment};

    fn request(id: u64) -> WorkRequest {
        WorkRequest::read(
            id,
            LocalSegment {
                address: 0,
                length: 8,
                local_key: 0,
            },
            RemoteSegment {
                address: 0,
                remote_key: 0,
            },
        )
    }

    #[test]
    fn posting_adds_the_announce_first_and_the_lease_word_last_without_growing() {
        let mut list = StepList::with_room_for(2);
        list.extend([request(1), request(2)]);
        let capacity = list.requests.capacity();
        let posted = list.into_posted(Some(request(0)), request(9));
        let ids: Vec<u64> = posted.iter().map(|request| request.id).collect();
        assert_eq!(ids, [0, 1, 2, 9]);
        assert_eq!(
            posted.capacity(),
            capacity,
            "the list did not grow when posted"
        );
    }

    #[test]
    fn a_later_list_has_no_announce() {
        let posted = StepList::of(request(1)).into_posted(None, request(9));
        let ids: Vec<u64> = posted.iter().map(|request| request.id).collect();
        assert_eq!(ids, [1, 9]);
    }
}
