//! The operation runner: every operation of a [`Client`] runs under its deadline and ends
//! counted here. [`Client::run`] runs a single-copy operation on the key's node: it retries on
//! a fresh connection only when the failure came before any compare-and-swap of it was posted,
//! and retires a connection left with the operation's tentative slot. [`Client::run_replicated`]
//! runs an operation of a replicated cluster, whose passes route by the view themselves
//! (`replicated/operation.rs`).

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkv_common::layout::check_key_value;

use crate::client::Client;
use crate::connection::{DirectWrite, NodeConnection};
use crate::deadline;
use crate::error::{Error, Result};
use crate::fairness::yield_if_never_waited;
use crate::lanes::current_lane;
use crate::node::Node;
use crate::operations::MutationOutcome;
use crate::progress::{Progress, Waiting};

/// What an operation counts as, besides an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A GET: counted under `gets` once it has looked (by the GET itself), or here when it
    /// failed before.
    Get,
    /// A write: counted under `mutations`, whatever its outcome.
    Mutation,
    /// A refill's read of a node's table: not an operation of the application, not counted.
    Scan,
}

/// A failure of an operation that may have applied, by an error that does not say so:
/// [`Error::Unresolved`]; any other failure as it is.
pub(crate) fn unresolved_if_applied(
    operation: &'static str,
    progress: &Progress,
    error: Error,
) -> Error {
    if progress.may_have_applied() && !error.may_have_applied() {
        Error::Unresolved {
            operation,
            source: Box::new(error),
        }
    } else {
        error
    }
}

impl Client {
    /// Runs one operation on `key`'s node under the deadline. A failure is retried on a fresh
    /// connection only when it is retryable and the operation posted no CAS yet, at most once
    /// per lane (each failed connection is marked broken, and a node that restarted took every
    /// lane's down: one retry could land on another lane's dead connection); a failure after a
    /// publishing CAS was posted becomes [`Error::Unresolved`], and a deadline says whether the
    /// operation may have applied.
    pub(crate) async fn run<T, Attempt, Outcome>(
        &self,
        kind: Kind,
        operation: &'static str,
        key: &[u8],
        mut attempt: Attempt,
    ) -> Result<T>
    where
        Attempt: FnMut(Arc<NodeConnection>, Arc<Progress>) -> Outcome,
        Outcome: Future<Output = Result<T>>,
    {
        let node = self.node_for(key);
        let progress = Progress::start();
        // Never longer than the node's own deadline: its heap reuse and its clearing of
        // abandoned tentative slots rely on it.
        let deadline = node
            .server_deadline()
            .map_or(self.deadline, |server| self.deadline.min(server));
        // Retires the connection if the operation ends, fails or is cancelled (by this
        // deadline or by its caller dropping the future) with its tentative slot outstanding.
        let guard = RetireOnAbandon {
            node,
            progress: progress.clone(),
            latest: Mutex::new(None),
        };
        let work = async {
            let mut retries = 0;
            loop {
                progress.wait_for(Waiting::Connection);
                let connection = match node.connection().await {
                    Ok(connection) => connection,
                    Err(error) if error.is_not_serving() => {
                        // Starting, resuming or reconciling: it serves within seconds, and
                        // the deadline bounds the wait (with one copy, no other node can).
                        progress.wait_for(Waiting::NodeServing);
                        tokio::time::sleep(NOT_SERVING_RETRY).await;
                        continue;
                    }
                    Err(error) => return Err(error),
                };
                if self.replicas == 1
                    && self.nodes.len() > 1
                    && !progress.cas_posted()
                    && self.follower.newer_view_reported()
                {
                    // A member may be joining or leaving: with one copy, the key's writes then
                    // reach its current and next copies, by the replicated path.
                    self.follower.refresh_in_task().await;
                    if self.follower.single_copy_by_view() {
                        return Err(Error::NodeUnreachable {
                            address: node.config.node.control_address,
                            reason: crate::error::VIEW_MOVED.into(),
                        });
                    }
                }
                guard.attempting_on(&connection);
                match attempt(connection.clone(), progress.clone()).await {
                    Err(error)
                        if error.is_retryable()
                            && retries < node.lanes.len()
                            && !progress.cas_posted() =>
                    {
                        tracing::debug!(%error, operation, "retrying on a fresh connection");
                        connection.mark_broken();
                        retries += 1;
                    }
                    Err(error) => return Err(unresolved_if_applied(operation, &progress, error)),
                    outcome => return outcome,
                }
            }
        };
        let outcome = yield_if_never_waited(deadline::timeout(deadline, work))
            .await
            .unwrap_or_else(
                |_| Err(self.past_single_copy_deadline(operation, deadline, &progress)),
            );
        drop(guard);
        Progress::recycle(progress);
        self.count(kind, &outcome);
        outcome
    }

    /// A single-copy GET by direct access to the key's node (`connection/direct_get.rs`), on
    /// this thread's lane's connection when it is up: whether the key is present, its value in
    /// `value`. `None` when it cannot be done that way now (`value` empty), and the caller runs
    /// the ordinary GET. It never waits, so it needs no deadline.
    pub(crate) fn get_direct(&self, key: &[u8], value: &mut Vec<u8>) -> Option<bool> {
        if check_key_value(key, &[]).is_err() {
            return None;
        }
        let node = self.node_for(key);
        let connection = node.lanes[current_lane(node.lanes.len())].healthy_connection()?;
        if !connection.offers_direct_access() {
            // `soft`, `verbs`: never by direct access; spare the key's location and guess.
            return None;
        }
        let location = connection.welcome.geometry.locate(key);
        // Counted as an operation by the connection (`Counters::direct_gets`).
        connection.get_direct(key, &location, value)
    }

    /// A single-copy update or upsert of a present key by direct access to its node
    /// (`connection/direct_update.rs`), on this thread's lane's connection when it is up.
    /// `None` when it cannot be done that way now (nothing was published), and the caller
    /// runs the ordinary write. Counted here when it is done. It never waits, so it needs no
    /// deadline.
    pub(crate) fn update_direct(
        &self,
        operation: &'static str,
        key: &[u8],
        value: &[u8],
    ) -> Option<Result<MutationOutcome>> {
        if check_key_value(key, value).is_err() {
            return None;
        }
        let node = self.node_for(key);
        let connection = node.lanes[current_lane(node.lanes.len())].healthy_connection()?;
        if !connection.offers_direct_access() {
            return None;
        }
        let location = connection.welcome.geometry.locate(key);
        let outcome = match connection.update_direct(operation, key, value, &location) {
            DirectWrite::Applied => Ok(MutationOutcome::Applied),
            DirectWrite::NotHere => return None,
            DirectWrite::Unresolved(error) => Err(error),
        };
        self.count(Kind::Mutation, &outcome);
        Some(outcome)
    }

    /// The error of a single-copy operation past its deadline. Out of heap for the whole
    /// deadline (the node answered that chunks were on their way back, and none came), the heap
    /// is too small for this write rate, which is TableFull, not a timeout; nothing was
    /// published, as a block is placed first. A node that never answered the request (stopped,
    /// or this process stopped past its deadline) is a timeout that says so.
    fn past_single_copy_deadline(
        &self,
        operation: &'static str,
        deadline: Duration,
        progress: &Progress,
    ) -> Error {
        if progress.waiting_for() == Waiting::HeapReclaim && !progress.may_have_applied() {
            return Error::TableFull {
                reason: format!(
                    "heap full: no heap chunk came back within the {deadline:?} deadline; \
                     raise heap_size (`rdkv-cluster resize FILE --node N --heap-size SIZE`; docs/operations.md, Sizing the heap)"
                ),
            };
        }
        self.past_deadline(operation, deadline, progress)
    }

    /// Runs `work`, an operation of a replicated cluster whose record is `progress`, under the
    /// cluster's deadline ([`Client::replicated_deadline`]), and counts it.
    pub(crate) async fn run_replicated<T>(
        &self,
        kind: Kind,
        operation: &'static str,
        progress: &Progress,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let deadline = self.replicated_deadline();
        let outcome = yield_if_never_waited(deadline::timeout(deadline, work))
            .await
            .unwrap_or_else(|_| Err(self.past_deadline(operation, deadline, progress)));
        self.count(kind, &outcome);
        outcome
    }

    /// The error of an operation past its deadline: what it waited for (with the nodes'
    /// silence when it waited for the view) and whether it may have applied.
    fn past_deadline(
        &self,
        operation: &'static str,
        deadline: Duration,
        progress: &Progress,
    ) -> Error {
        let waiting_for = progress.waiting_for();
        Error::TimedOut {
            operation,
            deadline,
            waiting_for: waiting_for.describe(),
            unanswered: (waiting_for == Waiting::View)
                .then(|| self.follower.unanswered())
                .flatten(),
            may_have_applied: progress.may_have_applied(),
        }
    }

    /// Counts an operation that ended with `outcome`: every one, under its kind too (a GET
    /// counts itself only once it has looked: a failed one is counted here; mutations are
    /// counted here either way).
    fn count<T>(&self, kind: Kind, outcome: &Result<T>) {
        if kind == Kind::Scan {
            return;
        }
        self.counters.operations.add(1);
        if kind == Kind::Mutation {
            self.counters.mutations.add(1);
        }
        if outcome.is_err() {
            self.counters.failures.add(1);
            if kind == Kind::Get {
                self.counters.gets.add(1);
            }
        }
    }
}

/// How long a single-copy operation waits before it asks again a node that answered that it
/// does not serve data yet.
const NOT_SERVING_RETRY: Duration = Duration::from_millis(100);

/// Retires the operation's connection when it is dropped with the operation's tentative slot
/// still outstanding: after a failure, a deadline, or the caller cancelling the operation (found
/// by attacking the client: a cancelled insert's slot stayed until the client disconnected).
struct RetireOnAbandon<'client> {
    /// The key's node.
    node: &'client Node,
    /// The operation's progress.
    progress: Arc<Progress>,
    /// The connection of the latest attempt.
    latest: Mutex<Option<Arc<NodeConnection>>>,
}

impl RetireOnAbandon<'_> {
    /// The operation's next attempt runs on `connection`.
    fn attempting_on(&self, connection: &Arc<NodeConnection>) {
        *self
            .latest
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(connection.clone());
    }
}

impl Drop for RetireOnAbandon<'_> {
    fn drop(&mut self) {
        if !self.progress.tentative_outstanding() {
            return;
        }
        let connection = self
            .latest
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(connection) = connection {
            self.node.retire(&connection);
        }
    }
}
