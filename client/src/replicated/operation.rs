//! The client's side of a replicated cluster: a GET from the key's primary under the view
//! ([`Client::get_replicated`]) and a write on the key's replicas ([`Client::mutate_replicated`]),
//! each in passes that route by the view, connect, and go again under a newer view after a node
//! failed, within the deadline of [`Client::run_replicated`].

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::Arc;

use bytes::Bytes;

use super::{mutate, resume, steal, Attempt, Held, Locked, Patience, Resumed, Write};
use crate::client::Client;
use crate::connection::NodeConnection;
use crate::error::{Error, Result};
use crate::operations::{self, back_off, MutationOutcome, RACE_ATTEMPTS};
use crate::progress::{Progress, Waiting};
use crate::runner::{unresolved_if_applied, Kind};
use crate::view_following::Route;

/// How a pass of a replicated write ends: `Break` with the write's outcome, or `Continue` to
/// the next pass.
type Pass = ControlFlow<Result<MutationOutcome>>;

impl Client {
    /// A GET on a replicated cluster: from the key's primary under the view. A node that fails
    /// (before the view shows it down) is retried under the next view, within the deadline.
    pub(crate) async fn get_replicated(&self, key: &[u8]) -> Result<Option<Bytes>> {
        let progress = Arc::new(Progress::default());
        let follower = &self.follower;
        let work = async {
            loop {
                progress.wait_for(Waiting::View);
                follower.follow_reported_epoch().await;
                let primary = self.replica_nodes(key, Route::read(self.replicas));
                if primary.is_empty() {
                    // The view is reconciling: no node's copy is the newest yet.
                    progress.wait_for(Waiting::Reconciliation);
                    follower.await_new_view().await;
                    if let Some(down) = follower.cluster_down("get") {
                        return Err(down);
                    }
                    continue;
                }
                let planned: Vec<u32> = primary.iter().map(|node| node.id).collect();
                progress.wait_for(Waiting::Connection);
                let attempt = async {
                    let connections = self.connections_to(&primary).await?;
                    if follower.replica_ids(key, Route::read(self.replicas)) != planned {
                        // Another task adopted a newer view while this one connected: the
                        // node planned under the older one may be filling in it.
                        return Ok(None);
                    }
                    if follower.behind(&connections) {
                        // The connection names a newer view: route by it, once the client has
                        // it (a node that joined since the client's view, filling in its own,
                        // may be this key's primary in the client's).
                        progress.wait_for(Waiting::View);
                        follower.await_new_view().await;
                        return Ok(None);
                    }
                    if follower.newer_view_reported() && follower.refresh_in_task().await {
                        // Another node reported a newer view: route by it.
                        return Ok(None);
                    }
                    operations::get(&connections[0], progress.clone(), key)
                        .await
                        .map(|found| Some(found.map(|value| value.to_bytes())))
                };
                match follower
                    .watched(key, Route::read(self.replicas), &planned, attempt)
                    .await
                {
                    // The view moved the key, or a connection named a newer view: again.
                    None | Some(Ok(None)) => {}
                    Some(Ok(Some(value))) => return Ok(value),
                    Some(Err(error)) if error.is_retryable() => {
                        progress.wait_for(Waiting::View);
                        follower.await_new_view().await;
                        if let Some(down) = follower.cluster_down("get") {
                            return Err(down);
                        }
                    }
                    Some(Err(error)) => return Err(error),
                }
            }
        };
        self.run_replicated(Kind::Get, "get", &progress, work).await
    }

    /// A mutation on a replicated cluster ([`crate::replicated`]): on the key's replicas
    /// under the view. A failure before any CAS that could show the write, or a stolen lock,
    /// starts it again (under the next view after a node failure); a failure after one is
    /// [`Error::Unresolved`].
    pub(crate) async fn mutate_replicated(
        &self,
        operation: &'static str,
        key: &[u8],
        write: Write<'_>,
    ) -> Result<MutationOutcome> {
        let progress = Arc::new(Progress::default());
        let mut writing = ReplicatedOperation {
            client: self,
            operation,
            key,
            write,
            progress: progress.clone(),
            patience: Patience::default(),
            held: None,
            last_primary: None,
            attempts: 0,
        };
        let work = async {
            // Only passes that reached the key's replicas count: a pass that waited for the
            // view (a reconciliation lasts seconds) or for a connection made no attempt. The
            // deadline bounds the waiting.
            while writing.attempts < RACE_ATTEMPTS {
                if let ControlFlow::Break(outcome) = writing.pass().await {
                    return outcome;
                }
            }
            Err(Error::Contention {
                operation,
                attempts: RACE_ATTEMPTS,
            })
        };
        self.run_replicated(Kind::Mutation, operation, &progress, work)
            .await
    }
}

/// A write on a replicated cluster, across its passes.
struct ReplicatedOperation<'a> {
    /// The client.
    client: &'a Client,
    /// The operation's name, for errors.
    operation: &'static str,
    /// The key.
    key: &'a [u8],
    /// What it writes.
    write: Write<'a>,
    /// What the write has posted, across its passes.
    progress: Arc<Progress>,
    /// Another writer's lock this write keeps finding, and since when.
    patience: Patience,
    /// The write's lock, when a pass's connections failed while it held it: the next pass
    /// resumes it.
    held: Option<Held>,
    /// The key's primary in the last pass.
    last_primary: Option<SocketAddr>,
    /// The passes that connected to the key's replicas and made an attempt (or resumed one).
    attempts: u32,
}

impl ReplicatedOperation<'_> {
    /// One pass: route by the view, connect to the key's replicas, then resume the held lock
    /// or make an attempt.
    async fn pass(&mut self) -> Pass {
        let Some((connections, planned)) = self.connect().await? else {
            return ControlFlow::Continue(());
        };
        let again = self.attempts;
        self.attempts += 1;
        self.check_primary(connections[0].address)?;
        if let Some(lock) = self.held.take() {
            // The last attempt's connections failed while it held its lock: go on from there
            // if the key's primary is still that node.
            return self.resume(&connections, &planned, lock).await;
        }
        self.attempt(&connections, &planned, again).await
    }

    /// Routes by the view and connects to the key's replicas: their connections and ids,
    /// primary first. `None`: the next pass (the view moved the key while it connected, a
    /// connection failed, or one named a newer view).
    async fn connect(
        &mut self,
    ) -> ControlFlow<Result<MutationOutcome>, Option<(Vec<Arc<NodeConnection>>, Vec<u32>)>> {
        let client = self.client;
        let follower = &client.follower;
        self.progress.wait_for(Waiting::View);
        follower.follow_reported_epoch().await;
        let nodes = client.replica_nodes(self.key, Route::Copies(client.replicas));
        if nodes.is_empty() {
            // No member serves: no node's copy is the newest yet (`ViewFollower::reconciling`).
            self.progress.wait_for(Waiting::Reconciliation);
            follower.await_new_view().await;
            if !self.progress.may_have_applied() {
                if let Some(down) = follower.cluster_down(self.operation) {
                    return ControlFlow::Break(Err(down));
                }
            }
            return ControlFlow::Continue(None);
        }
        let planned: Vec<u32> = nodes.iter().map(|node| node.id).collect();
        self.progress.wait_for(Waiting::Connection);
        let connecting = client.connections_to(&nodes);
        let connections = match follower
            .watched(
                self.key,
                Route::Copies(client.replicas),
                &planned,
                connecting,
            )
            .await
        {
            None => return ControlFlow::Continue(None),
            Some(Ok(connections)) => connections,
            Some(Err(error)) if error.is_retryable() => {
                self.await_new_view().await;
                if !self.progress.may_have_applied() {
                    if let Some(down) = follower.cluster_down(self.operation) {
                        return ControlFlow::Break(Err(down));
                    }
                }
                return ControlFlow::Continue(None);
            }
            Some(Err(error)) => return ControlFlow::Break(Err(error)),
        };
        if follower.replica_ids(self.key, Route::Copies(client.replicas)) != planned {
            // Another task adopted a newer view while this one connected: route by it.
            return ControlFlow::Continue(None);
        }
        if follower.behind(&connections) {
            // A connection names a newer view: route by it, once the client has it.
            self.await_new_view().await;
            return ControlFlow::Continue(None);
        }
        if follower.newer_view_reported() && follower.refresh_in_task().await {
            // Another node reported a newer view: route by it.
            return ControlFlow::Continue(None);
        }
        ControlFlow::Continue(Some((connections, planned)))
    }

    /// Ends the write [`Error::Unresolved`] when the key's primary is no longer the last
    /// pass's and a backup took the write: a backup whose lock was taken over keeps the value
    /// until the thief rolls it back, and the view may have made that backup the primary first
    /// (found by the model check).
    fn check_primary(&mut self, primary: SocketAddr) -> Pass {
        let previous = self.last_primary.replace(primary);
        match previous.filter(|_| self.progress.backup_posted()) {
            Some(previous) if previous != primary => ControlFlow::Break(Err(Error::Unresolved {
                operation: self.operation,
                source: Box::new(Error::NodeUnreachable {
                    address: previous,
                    reason: format!(
                        "a new cluster view moved the key's primary (to the node at {primary}) after a backup took the write"
                    ),
                }),
            })),
            _ => ControlFlow::Continue(()),
        }
    }

    /// Goes on with the write's lock `lock` ([`resume`]), on `connections` (the key's replicas
    /// `planned` under the view now).
    async fn resume(
        &mut self,
        connections: &[Arc<NodeConnection>],
        planned: &[u32],
        mut lock: Held,
    ) -> Pass {
        let (client, operation) = (self.client, self.operation);
        let primary = connections[0].address;
        if primary != lock.primary {
            if !self.progress.may_have_applied() {
                return ControlFlow::Continue(());
            }
            return ControlFlow::Break(Err(Error::Unresolved {
                operation,
                source: Box::new(Error::NodeUnreachable {
                    address: lock.primary,
                    reason: format!(
                        "a new cluster view moved the key's primary (to the node at {primary}) while the write held its lock there"
                    ),
                }),
            }));
        }
        let progress = self.progress.clone();
        let resuming = resume(
            connections,
            progress,
            operation,
            self.key,
            self.write,
            &mut lock,
        );
        let watched =
            client
                .follower
                .watched(self.key, Route::Copies(client.replicas), planned, resuming);
        let Some(resumed) = watched.await else {
            // The view moved the key meanwhile: decided on the next pass.
            self.held = Some(lock);
            return ControlFlow::Continue(());
        };
        match resumed {
            Ok(Resumed::Applied) => ControlFlow::Break(Ok(MutationOutcome::Applied)),
            Ok(Resumed::Again) => ControlFlow::Continue(()),
            Ok(Resumed::Unknown) => ControlFlow::Break(Err(Error::Unresolved {
                operation,
                source: Box::new(Error::Refused {
                    reason: "the write's commit was cut, and its lock was gone when it looked again (committed and overwritten since, or taken over)".into(),
                }),
            })),
            Err(error) if error.is_retryable() => {
                self.held = Some(lock);
                self.await_new_view().await;
                ControlFlow::Continue(())
            }
            // As for a first attempt (found by review: a resume's failed commit or backup was
            // reported as certainly not applied).
            Err(error) => ControlFlow::Break(Err(self.unresolved_if_applied(error))),
        }
    }

    /// One attempt at the write ([`mutate`]) on `connections` (the key's replicas `planned`).
    async fn attempt(
        &mut self,
        connections: &[Arc<NodeConnection>],
        planned: &[u32],
        again: u32,
    ) -> Pass {
        let (client, operation, key) = (self.client, self.operation, self.key);
        let progress = self.progress.clone();
        let attempting = mutate(
            connections,
            progress,
            operation,
            key,
            self.write,
            &mut self.patience,
            &mut self.held,
        );
        let watched =
            client
                .follower
                .watched(key, Route::Copies(client.replicas), planned, attempting);
        let Some(attempt) = watched.await else {
            // The view moved the key while the attempt ran (a node stopped answering without
            // failing its connections). With its lock placed, the next pass resumes it or
            // reports it; with a backup written and no lock, it is unresolved; else it starts
            // again.
            if self.held.is_none() && self.progress.may_have_applied() {
                return ControlFlow::Break(Err(Error::Unresolved {
                    operation,
                    source: Box::new(Error::Refused {
                        reason: "the view moved the key while the write ran".into(),
                    }),
                }));
            }
            return ControlFlow::Continue(());
        };
        match attempt {
            Ok(Attempt::Done(outcome)) => ControlFlow::Break(Ok(outcome)),
            Ok(Attempt::Steal(locked)) => self.steal(connections, &locked).await,
            Ok(Attempt::Again) => {
                back_off(again).await;
                ControlFlow::Continue(())
            }
            // Cut while it held (or placed) its lock: resumed on the next pass. Or nothing of
            // the write can be visible: its lock, if placed, is taken over after the patience.
            Err(error)
                if error.is_retryable()
                    && (self.held.is_some() || !self.progress.may_have_applied()) =>
            {
                self.await_new_view().await;
                ControlFlow::Continue(())
            }
            Err(error) => ControlFlow::Break(Err(self.unresolved_if_applied(error))),
        }
    }

    /// Takes over another writer's lock `locked` ([`steal`]); the write then starts again.
    async fn steal(&mut self, connections: &[Arc<NodeConnection>], locked: &Locked) -> Pass {
        // The takeover has a progress of its own: none of it is this write.
        let takeover = Arc::new(Progress::default());
        if let Err(error) = steal(connections, takeover, self.operation, self.key, locked).await {
            if !error.is_retryable() {
                return ControlFlow::Break(Err(error));
            }
            self.await_new_view().await;
        }
        self.patience = Patience::default();
        ControlFlow::Continue(())
    }

    /// Waits for the view after a node failed ([`crate::view_following`]).
    async fn await_new_view(&self) {
        self.progress.wait_for(Waiting::View);
        self.client.follower.await_new_view().await;
    }

    /// `error`, or [`Error::Unresolved`] when the write may have applied and `error` does not
    /// say so.
    fn unresolved_if_applied(&self, error: Error) -> Error {
        unresolved_if_applied(self.operation, &self.progress, error)
    }
}
