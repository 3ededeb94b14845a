//! [`Client`]: the public handle. It owns one connection to its node, re-establishes it after a
//! failure, applies the per-operation deadline, and retries an operation on a fresh connection
//! only when the failure came before its final compare-and-swap.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rdkv_common::protocol::ServerStats;

use crate::connection::{ClientConfig, NodeConnection};
use crate::counters::{CounterSnapshot, Counters};
use crate::error::{Error, Result};
use crate::operations::{self, CasOutcome, Mutation, MutationOutcome};

/// An rdkv client. Cheap to share behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct Client {
    /// Settings.
    config: ClientConfig,
    /// The live connection; replaced when it breaks.
    connection: Mutex<Option<Arc<NodeConnection>>>,
    /// Counters.
    counters: Arc<Counters>,
    /// The per-operation deadline.
    deadline: Duration,
}

impl Client {
    /// Connects and authenticates.
    ///
    /// # Errors
    /// [`Error::NodeUnreachable`], [`Error::AuthenticationFailed`], or the fabric's errors
    /// (for example a memlock limit too low for the scratch buffers).
    pub async fn connect(config: ClientConfig) -> Result<Self> {
        let counters = Arc::new(Counters::default());
        let connection = NodeConnection::open(&config, counters.clone()).await?;
        let deadline = config.operation_deadline.unwrap_or(Duration::from_millis(
            connection.welcome.operation_deadline_ms,
        ));
        Ok(Self {
            config,
            connection: Mutex::new(Some(connection)),
            counters,
            deadline,
        })
    }

    /// The live connection, re-established if it broke.
    async fn connection(&self) -> Result<Arc<NodeConnection>> {
        let current = self
            .connection
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        if let Some(connection) = current.filter(|connection| !connection.is_broken()) {
            return Ok(connection);
        }
        let fresh = NodeConnection::open(&self.config, self.counters.clone()).await?;
        self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
        *self
            .connection
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(fresh.clone());
        Ok(fresh)
    }

    /// Runs one operation under the deadline, retrying once on a fresh connection when the
    /// failure is retryable (it happened before any final CAS).
    async fn run<T, Attempt, Outcome>(
        &self,
        operation: &'static str,
        mut attempt: Attempt,
    ) -> Result<T>
    where
        Attempt: FnMut(Arc<NodeConnection>) -> Outcome,
        Outcome: std::future::Future<Output = Result<T>>,
    {
        let work = async {
            let mut retried = false;
            loop {
                let connection = self.connection().await?;
                match attempt(connection.clone()).await {
                    Err(error) if error.is_retryable() && !retried => {
                        tracing::debug!(%error, operation, "retrying on a fresh connection");
                        connection.mark_broken();
                        retried = true;
                    }
                    outcome => return outcome,
                }
            }
        };
        let outcome = tokio::time::timeout(self.deadline, work)
            .await
            .unwrap_or(Err(Error::TimedOut {
                operation,
                deadline: self.deadline,
            }));
        if outcome.is_ok() {
            self.counters.operations.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    }

    async fn mutate(
        &self,
        operation: &'static str,
        key: &[u8],
        value: &[u8],
        mutation: Mutation<'_>,
    ) -> Result<MutationOutcome> {
        let outcome = self
            .run(operation, |connection| async move {
                operations::mutate(&connection, operation, key, value, mutation).await
            })
            .await;
        self.counters.mutations.fetch_add(1, Ordering::Relaxed);
        outcome
    }

    /// The value of `key`, if present. Two round trips (one when no slot has its fingerprint).
    ///
    /// # Errors
    /// [`Error::InvalidKey`], [`Error::TimedOut`], [`Error::NodeUnreachable`],
    /// [`Error::Corrupt`], or a typed work-completion failure.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.run("get", |connection| async move {
            operations::get(&connection, key).await
        })
        .await
    }

    /// The values of several keys, fetched concurrently.
    ///
    /// # Errors
    /// The first error of any key.
    pub async fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Bytes>>> {
        let connection = self.connection().await?;
        let mut tasks = tokio::task::JoinSet::new();
        for (index, key) in keys.iter().enumerate() {
            let connection = connection.clone();
            let key = key.to_vec();
            tasks.spawn(async move { (index, operations::get(&connection, &key).await) });
        }
        let mut values = vec![None; keys.len()];
        let work = async {
            while let Some(joined) = tasks.join_next().await {
                let (index, value) = joined.map_err(|error| Error::Refused {
                    reason: format!("batch task failed: {error}"),
                })?;
                values[index] = value?;
            }
            Ok::<_, Error>(())
        };
        tokio::time::timeout(self.deadline, work)
            .await
            .unwrap_or(Err(Error::TimedOut {
                operation: "batch_get",
                deadline: self.deadline,
            }))?;
        self.counters
            .operations
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(values)
    }

    /// Inserts or replaces.
    ///
    /// # Errors
    /// [`Error::ValueTooLarge`] (naming the limit), [`Error::InvalidKey`], [`Error::TableFull`],
    /// [`Error::TimedOut`], [`Error::Unresolved`], [`Error::NodeUnreachable`].
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.mutate("put", key, value, Mutation::Upsert)
            .await
            .map(drop)
    }

    /// Inserts only if absent; `Ok(false)` when the key was present.
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn insert(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        Ok(self.mutate("insert", key, value, Mutation::Insert).await? == MutationOutcome::Applied)
    }

    /// Replaces only if present; `Ok(false)` when the key was absent.
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn update(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        Ok(self.mutate("update", key, value, Mutation::Update).await? == MutationOutcome::Applied)
    }

    /// Replaces the value with `new` only if it equals `expected`; linearized at the slot CAS.
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn compare_and_swap(
        &self,
        key: &[u8],
        expected: &[u8],
        new: &[u8],
    ) -> Result<CasOutcome> {
        match self
            .mutate(
                "compare_and_swap",
                key,
                new,
                Mutation::CompareAndSwap { expected },
            )
            .await?
        {
            MutationOutcome::Mismatch(current) => Ok(CasOutcome::Mismatch(current)),
            _ => Ok(CasOutcome::Swapped),
        }
    }

    /// Deletes; `Ok(false)` when the key was absent.
    ///
    /// # Errors
    /// As [`Client::get`], plus [`Error::Unresolved`].
    pub async fn delete(&self, key: &[u8]) -> Result<bool> {
        let outcome = self
            .run("delete", |connection| async move {
                operations::delete(&connection, key).await
            })
            .await;
        self.counters.mutations.fetch_add(1, Ordering::Relaxed);
        outcome
    }

    /// This client's counters.
    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    /// The server's counters.
    ///
    /// # Errors
    /// [`Error::NodeUnreachable`] when the node cannot be reached.
    pub async fn server_stats(&self) -> Result<ServerStats> {
        self.connection().await?.stats().await
    }

    /// Says goodbye to the node; the server tears the connection down at once instead of
    /// waiting for the lease to expire.
    pub async fn close(&self) {
        let current = self
            .connection
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(connection) = current {
            connection.close().await;
        }
    }
}
