//! Scratch buffers: one per operation, taken from the process's pool (`pool.rs`). A [`Scratch`]
//! stays out of the pool until every list posted through it has completed, even when the
//! operation that used it is cancelled: its drop hands the outstanding completion to a task
//! that returns the buffer afterwards. Every list of an operation is posted through
//! [`Scratch::execute`], as a [`StepList`] (which adds the announce WRITE and the lease word's
//! READ, `step_list.rs`).

use std::sync::Arc;

use rdkv_fabric::lock;
use rdkv_fabric::{MemoryRegion, PostedList, WorkCompletionStatus, WorkRequest};

use crate::error::Result;
use crate::fault::{Injection, Moment, Step, StepKind};
use crate::progress::{Progress, Waiting};

use super::pool::ScratchBuffer;
use super::*;

/// Bytes of one scratch buffer.
pub(crate) const SCRATCH_SIZE: u64 = 64 * 1024;
/// Offset of the bucket area in a scratch buffer (two combined buckets).
pub(crate) const BUCKETS_AT: u64 = 0;
/// Offset of the 8-byte CAS results (up to 32 of them).
pub(crate) const CAS_RESULTS_AT: u64 = 256;
/// Offset of the block to write.
pub(crate) const WRITE_BLOCK_AT: u64 = 512;
/// Offset of the area candidate blocks are read into.
pub(crate) const READ_BLOCKS_AT: u64 = WRITE_BLOCK_AT + 16 * 1024;
/// Offset of the node's lease word, READ at the end of every list: past the largest block to
/// write, before the candidate blocks.
const LEASE_WORD_AT: u64 = READ_BLOCKS_AT - 8;
const _: () = assert!(WRITE_BLOCK_AT + rdkv_common::layout::MAX_BLOCK_SIZE <= LEASE_WORD_AT);
/// The work request id of the lease word's READ.
const LEASE_REQUEST_ID: u64 = u64::MAX - 1;
/// Bytes of the candidate block area.
pub(crate) const READ_BLOCKS_SIZE: u64 = SCRATCH_SIZE - READ_BLOCKS_AT;

impl NodeConnection {
    /// Takes a scratch buffer, waiting while the connection has its configured concurrency in
    /// flight, or while the process's pool is at its memory limit.
    pub(crate) async fn scratch(self: &Arc<Self>, progress: Arc<Progress>) -> Result<Scratch> {
        let permit = match self.scratch_permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                self.counters.scratch_waits.add(1);
                self.scratch_permits
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the scratch semaphore is never closed")
            }
        };
        let buffer = self.fabric.take().await?;
        permit.forget();
        Ok(Scratch {
            operation: self.announcer.start(),
            announced: false,
            posting: false,
            reached_fabric: false,
            connection: self.clone(),
            buffer: Some(buffer),
            base: 0,
            outstanding: None,
            round_trips: 0,
            progress,
        })
    }
}

/// A scratch buffer and the posting of lists through it: one operation, from taking the buffer
/// to the completion of its last list (its number in the announce word, `announce.rs`).
pub(crate) struct Scratch {
    /// The operation's number in the connection's announce word.
    operation: u64,
    /// Whether the operation's first list (which carries the announce WRITE) was posted.
    announced: bool,
    /// Set while a post is in progress: cancelled then, the list may be queued with no
    /// `PostedList` to wait for (`post` yields before it returns, for doorbell batching).
    posting: bool,
    /// The last step's list was handed to the queue pair (it may have run); false when it
    /// failed before (refused, or failed by the fault injector before posting).
    reached_fabric: bool,
    /// The connection.
    connection: Arc<NodeConnection>,
    /// The buffer (taken back out only by `drop`).
    buffer: Option<ScratchBuffer>,
    /// Offset of the operation's area in the buffer's region.
    pub(crate) base: u64,
    /// A posted list not yet completed (set only while awaiting).
    outstanding: Option<PostedList>,
    /// Round trips made through this buffer by the current operation.
    pub(crate) round_trips: u64,
    /// What the current operation has posted (read by the client after a failure or deadline).
    progress: Arc<Progress>,
}

impl Scratch {
    /// The connection.
    pub(crate) fn connection(&self) -> &Arc<NodeConnection> {
        &self.connection
    }

    /// The buffer's region.
    pub(crate) fn region(&self) -> &MemoryRegion {
        match &self.buffer {
            Some(buffer) => &buffer.region,
            None => unreachable!("a scratch buffer is taken out only when it is dropped"),
        }
    }

    /// Posts a list (one step of `operation`) and waits for its completions; counts one round
    /// trip. Any failed status marks the connection broken and is returned as the first failed
    /// status. The connection's fault injector, if any, may stall or fail the step before it is
    /// posted or after it ran.
    ///
    /// Where the provider can run the list inside the post (`shm` with its executor free:
    /// [`rdkv_fabric::QueuePair::post_inline`]) it does, with the same outcome and no
    /// completion to wait for; otherwise the list is posted and its completions awaited.
    pub(crate) async fn execute(
        &mut self,
        operation: &'static str,
        kind: StepKind,
        list: StepList,
    ) -> Result<(), ExecuteError> {
        let number = self.round_trips as u32;
        self.reached_fabric = false;
        self.progress.wait_for(Waiting::Step(kind));
        let injecting = self.connection.fault_injector.is_some();
        if injecting {
            self.inject(operation, kind, number, Moment::Before).await?;
        }
        // Before any READ or CAS of this operation: the node learns it started. Last, after
        // every other request of the list ran: the node's lease word.
        let announce = (!self.announced).then(|| self.connection.announcer.request());
        self.announced = true;
        let list = list.into_posted(announce, self.lease_word_request());
        let counters = &self.connection.counters;
        counters.round_trips.add(1);
        self.round_trips += 1;
        counters.verbs.add(list.len() as u64);
        self.progress.posting(kind);
        let posted_at = std::time::Instant::now();
        let inline = self.connection.queue_pair.post_inline(&list);
        let failed = match inline {
            Some(Ok(outcome)) => {
                self.reached_fabric = true;
                // A unit of tokio's cooperative budget per list, as `post` spends: an operation
                // whose lists all run inside their posts still yields now and then, and a
                // deadline around a loop of steps can fire.
                step_list::recycle(list);
                tokio::task::consume_budget().await;
                outcome.err().map(|failure| failure.completion.status)
            }
            Some(Err(error)) => {
                self.progress.not_posted(kind);
                return Err(ExecuteError::Post(error));
            }
            None => self.post_and_wait(kind, list, posted_at).await?,
        };
        if let Some(status) = failed {
            self.connection.mark_broken();
            if status == WorkCompletionStatus::NotExecuted {
                // The responder stopped before it ran this request and every later one of
                // the list (its CAS, last): for certain, the step had no effect.
                self.progress.not_posted(kind);
                self.reached_fabric = false;
            }
            return Err(ExecuteError::Completion(status));
        }
        if !self.lease_covers(posted_at) {
            // What the list read may be stale, and what it wrote may be hidden: the node did
            // not serve under its lease throughout (paused, cut off, or stopped serving).
            self.connection.mark_broken();
            self.connection.counters.lease_refusals.add(1);
            return Err(ExecuteError::LeaseLapsed {
                address: self.connection.address,
            });
        }
        if injecting {
            self.inject(operation, kind, number, Moment::After).await?;
        }
        Ok(())
    }

    /// Posts `list` through the queue pair and waits for its completions: the status of the
    /// first that failed, if any. Cancelled meanwhile, the drop keeps the buffer until the list
    /// completes (`outstanding`) or retires it (`posting`).
    async fn post_and_wait(
        &mut self,
        kind: StepKind,
        mut list: Vec<WorkRequest>,
        posted_at: std::time::Instant,
    ) -> Result<Option<WorkCompletionStatus>, ExecuteError> {
        self.posting = true;
        let posted = self
            .connection
            .queue_pair
            .post_from_at(&mut list, posted_at)
            .await;
        self.posting = false;
        step_list::recycle(list);
        let posted = match posted {
            Ok(posted) => posted,
            Err(error) => {
                self.progress.not_posted(kind);
                return Err(ExecuteError::Post(error));
            }
        };
        self.reached_fabric = true;
        self.outstanding = Some(posted);
        let completions = match self.outstanding.as_mut() {
            Some(posted) => posted.await,
            None => rdkv_fabric::Completions::new(),
        };
        self.outstanding = None;
        Ok(completions
            .iter()
            .find(|completion| completion.status != WorkCompletionStatus::Success)
            .map(|completion| completion.status))
    }

    /// The READ of the node's lease word into this operation's area, fenced: on a NIC it runs
    /// only once every earlier READ and atomic of the list has completed.
    fn lease_word_request(&self) -> WorkRequest {
        let lease_key = self.connection.keys.lease_key;
        WorkRequest::read(
            LEASE_REQUEST_ID,
            self.region().segment(self.base + LEASE_WORD_AT, 8),
            rdkv_fabric::RemoteSegment {
                address: lease_key.address,
                remote_key: lease_key.key,
            },
        )
        .with_fence()
    }

    /// Whether the lease word the list just read says that the node served, under its lease,
    /// from before `posted_at` until after now (`rdkv_common::lease`).
    fn lease_covers(&self, posted_at: std::time::Instant) -> bool {
        let completed_at = std::time::Instant::now();
        let Ok(word) = self.region().load_u64(self.base + LEASE_WORD_AT) else {
            return false;
        };
        let clock = *lock(&self.connection.lease_clock);
        clock.covers(u64::from_le(word), posted_at, completed_at)
    }

    /// Reserves heap space for the operation's block (before it posts anything). The operation is
    /// parked meanwhile: its number is announced finished, so an operation waiting for a chunk
    /// never holds back the reclamation it waits for, and it gets a new number with its
    /// reservation.
    pub(crate) async fn place_block(&mut self, length: u64) -> Result<BlockPlace> {
        debug_assert!(!self.announced, "a block is placed before the first list");
        self.connection.announcer.finish(self.operation);
        let (place, operation) = self.connection.place_block(length, &self.progress).await?;
        self.operation = operation;
        Ok(place)
    }

    /// Whether the last step's list was handed to the queue pair (so it may have run).
    pub(crate) fn reached_fabric(&self) -> bool {
        self.reached_fabric
    }

    /// The operation's tentative slot is gone (committed, withdrawn, or never placed).
    pub(crate) fn tentative_resolved(&self) {
        self.progress.tentative_resolved();
    }

    /// A replicated write is about to put its value in a backup that lacks the key (an insert
    /// there, not a [`StepKind::Backup`] CAS).
    pub(crate) fn backup_posting(&self) {
        self.progress.backup_posting();
    }

    /// A CAS of `kind` completed without swapping: count the lost race, and if it was a
    /// publishing CAS, record that it had no effect.
    pub(crate) fn lost_race(&self, kind: StepKind) {
        self.connection.counters.cas_failures.add(1);
        if kind.publishes() {
            self.progress.lost();
        }
    }

    /// Asks the fault injector about one step; an injected failure breaks the connection as a
    /// real one would.
    async fn inject(
        &self,
        operation: &'static str,
        kind: StepKind,
        number: u32,
        moment: Moment,
    ) -> Result<(), ExecuteError> {
        let Some(injector) = &self.connection.fault_injector else {
            return Ok(());
        };
        let step = Step {
            operation,
            kind,
            number,
            moment,
        };
        match injector.inject(&step) {
            Injection::Proceed => Ok(()),
            Injection::Stall(pause) => {
                tokio::time::sleep(pause).await;
                Ok(())
            }
            Injection::WaitFor(gate) => {
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
                Ok(())
            }
            Injection::Fail(status) => {
                self.connection.mark_broken();
                Err(ExecuteError::Completion(status))
            }
        }
    }
}

/// Why a posted list failed.
#[derive(Debug)]
pub(crate) enum ExecuteError {
    /// The post itself was refused (queue pair not RTS, bad list).
    Post(rdkv_fabric::Error),
    /// A request completed with this status.
    Completion(WorkCompletionStatus),
    /// Every request succeeded, but the node's lease word did not cover the list: the node
    /// was not serving under its lease throughout (paused, cut off, or stopped serving), so
    /// what it read may be stale and what it wrote may be hidden.
    LeaseLapsed {
        /// The node's control address.
        address: std::net::SocketAddr,
    },
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.posting {
            // Cancelled inside `post`: the list may be queued, and a READ or CAS result may
            // still land in this buffer, with nothing here to wait for. The buffer stays out of
            // the pool and the connection is retired; its memory goes with the connection.
            // (Requests queued now execute before any later announce WRITE, so announcing the
            // finish is still true on the node's side.)
            self.connection.mark_broken();
            self.connection.announcer.finish(self.operation);
            if let Some(buffer) = self.buffer.take() {
                lock(&self.connection.retired_buffers).push(buffer.region);
                self.connection.fabric.retire();
            }
            return;
        }
        let fabric = self.connection.fabric.clone();
        let permits = self.connection.scratch_permits.clone();
        let announcer = self.connection.announcer.clone();
        let buffer = self.buffer.take();
        let operation = self.operation;
        // The operation is over once every list it posted has completed.
        let give_back = move || {
            if let Some(buffer) = buffer {
                fabric.give_back(buffer);
            }
            permits.add_permits(1);
            announcer.finish(operation);
        };
        match self.outstanding.take() {
            None => give_back(),
            // Cancelled while a list was in flight: the NIC may still write into this buffer,
            // so it goes back only after the list completes.
            Some(posted) => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        posted.await;
                        give_back();
                    });
                }
                // No runtime: the list can never be awaited, so the operation never announces
                // its finish; the node falls back to its quarantine for this connection.
                Err(_) => std::mem::forget(posted),
            },
        }
    }
}
