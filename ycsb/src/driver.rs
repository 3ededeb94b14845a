//! The stores a workload runs against: `rdkv` (a cluster file), `redis` (a URL, one multiplexed
//! async connection), `memory` (an in-process rdkv server on the `loopback` fabric: the
//! ceiling of the protocol's CPU cost) and `map` (an in-process `DashMap`: the harness's own
//! ceiling, no store protocol at all). Every driver stores one value blob per record.

use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;
use rdkv_client::{CasOutcome, Client, ClientBuilder, ClientConfig};
use rdkv_fabric::Backend;
use rdkv_server::{RunningServer, ServerConfig};

use crate::measurement::RdkvFigures;

/// How many times a read-modify-write retries after its compare-and-swap lost a race.
const READ_MODIFY_WRITE_ATTEMPTS: u32 = 16;

/// A store under test.
pub enum Driver {
    /// rdkv through its client library.
    Rdkv {
        /// The client.
        client: Arc<Client>,
        /// The in-process server of the `memory` driver.
        _server: Option<RunningServer>,
        /// `rdkv`, a comparison's store name, or `memory`.
        name: &'static str,
    },
    /// Redis through the `redis` crate.
    Redis {
        /// A multiplexed connection shared by every task.
        connection: redis::aio::MultiplexedConnection,
    },
    /// An in-process `DashMap`: what the harness costs by itself (key choice, measurement,
    /// tasks), with a store that does the least an in-memory store can.
    Map {
        /// Each record's value by key. A value is [`Bytes`]: a GET clones it (a reference
        /// count, no copy of the value), an insert or update copies the written value in and
        /// replaces the old one.
        records: DashMap<String, Bytes>,
    },
}

/// Lets the runtime run something else once the task has used its budget (128 operations of
/// the map driver, whose operations never wait): the other tasks and the phase's progress
/// ticks get their turn, as they do while a real store's operation waits.
async fn give_way() {
    tokio::task::consume_budget().await;
}

/// What an operation returned.
pub type DriverResult<T> = Result<T, String>;

impl Driver {
    /// rdkv from a cluster file, with `concurrency` operations in flight per connection (the
    /// run's task count: fewer would make tasks wait for scratch buffers, not for the store).
    ///
    /// # Errors
    /// An invalid cluster file.
    pub fn rdkv(
        cluster_file: &std::path::Path,
        fabric: rdkv_client::FabricChoice,
        concurrency: usize,
    ) -> anyhow::Result<Self> {
        Ok(Self::Rdkv {
            client: Arc::new(
                ClientBuilder::cluster_file(cluster_file)
                    .fabric(fabric)
                    .concurrency(concurrency.clamp(1, 64))
                    .build()?,
            ),
            _server: None,
            name: "rdkv",
        })
    }

    /// Connects an rdkv client to every node before anything is measured. Fails (nothing
    /// measured, exit code 2) when a node answers and refuses this client: it does not offer the
    /// fabric asked for (`--fabric shm`), or the secret is wrong. Nodes that do not answer are
    /// measured as they are: their keys' operations fail (exit code 1, or 0 with
    /// `--allow-errors`).
    ///
    /// # Errors
    /// The refusal, naming the node and the fix.
    pub async fn reach(&self) -> anyhow::Result<()> {
        let Self::Rdkv { client, .. } = self else {
            return Ok(());
        };
        match client.connect_all().await {
            Err(rdkv_client::Error::ConnectFailed { source, .. })
                if matches!(*source, rdkv_client::Error::Refused { .. }) =>
            {
                // The refusal names the node, its address and the fix.
                anyhow::bail!("nothing measured: {source}")
            }
            _ => Ok(()),
        }
    }

    /// An in-process rdkv server on the loopback fabric, sized for `records` of `record_size`.
    ///
    /// # Errors
    /// Memory limits (the table is pinned) or a failed connection.
    pub async fn memory(
        records: u64,
        record_size: usize,
        concurrency: usize,
    ) -> anyhow::Result<Self> {
        let mut config = ServerConfig::local(b"rdkv-ycsb-memory");
        config.fabric = Backend::Loopback;
        let block = (record_size as u64 + 64 + 16).div_ceil(64) * 64;
        // Three times the live blocks, in whole chunks (at least 4 MiB): a small run fits the
        // common 8 MiB memlock limit (1,000 YCSB records: a heap of 4.25 MiB).
        let heap = (records * block * 3).max(4 << 20);
        config.chunk_size = if heap < (32 << 20) {
            256 << 10
        } else {
            1 << 20
        };
        config.heap_size = heap.next_multiple_of(config.chunk_size);
        config.index_size = (records * 64).max(1 << 20).next_power_of_two();
        let server = rdkv_server::start(config).await?;
        let mut client_config = ClientConfig::new(
            server.control_address(),
            Backend::Loopback,
            b"rdkv-ycsb-memory",
        );
        client_config.concurrency = concurrency.clamp(1, 64);
        let client = Client::connect(client_config).await?;
        Ok(Self::Rdkv {
            client: Arc::new(client),
            _server: Some(server),
            name: "memory",
        })
    }

    /// An empty in-process map, with room for `records` records.
    pub fn map(records: u64) -> Self {
        Self::Map {
            records: DashMap::with_capacity(usize::try_from(records).unwrap_or(usize::MAX)),
        }
    }

    /// Redis at `url` (for example `redis://127.0.0.1:6379`).
    ///
    /// # Errors
    /// The URL is invalid or the server does not answer.
    pub async fn redis(url: &str) -> anyhow::Result<Self> {
        let client = redis::Client::open(url)?;
        let connection = client.get_multiplexed_async_connection().await?;
        Ok(Self::Redis { connection })
    }

    /// The driver's name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Rdkv { name, .. } => name,
            Self::Redis { .. } => "redis",
            Self::Map { .. } => "map",
        }
    }

    /// Why scans cannot run, if they cannot.
    pub fn scan_refusal(&self) -> Option<String> {
        Some(match self {
            Self::Rdkv { .. } => "workload E (scans) cannot run on rdkv: its index is a hash table with no key order; run A, B, C, D or F".to_string(),
            Self::Redis { .. } => "workload E (scans) is not implemented for the redis driver: records are plain keys with no ordered index".to_string(),
            Self::Map { .. } => "workload E (scans) cannot run on the map driver: a hash map has no key order".to_string(),
        })
    }

    /// Stores a new record.
    pub async fn insert(&self, key: &str, value: &[u8]) -> DriverResult<()> {
        self.write(key, value).await
    }

    /// Replaces a record.
    pub async fn update(&self, key: &str, value: &[u8]) -> DriverResult<()> {
        self.write(key, value).await
    }

    async fn write(&self, key: &str, value: &[u8]) -> DriverResult<()> {
        match self {
            Self::Rdkv { client, .. } => client
                .put(key.as_bytes(), value)
                .await
                .map_err(|error| error.to_string()),
            Self::Redis { connection } => {
                let mut connection = connection.clone();
                redis::cmd("SET")
                    .arg(key)
                    .arg(value)
                    .query_async::<()>(&mut connection)
                    .await
                    .map_err(|error| error.to_string())
            }
            Self::Map { records } => {
                let value = Bytes::copy_from_slice(value);
                // An update finds its key: no new key string.
                match records.get_mut(key) {
                    Some(mut record) => *record = value,
                    None => {
                        records.insert(key.to_string(), value);
                    }
                }
                give_way().await;
                Ok(())
            }
        }
    }

    /// Reads a record; `Ok(false)` when it is absent.
    pub async fn read(&self, key: &str) -> DriverResult<bool> {
        match self {
            Self::Rdkv { client, .. } => client
                .get(key.as_bytes())
                .await
                .map(|value| value.is_some())
                .map_err(|error| error.to_string()),
            Self::Redis { connection } => {
                let mut connection = connection.clone();
                redis::cmd("GET")
                    .arg(key)
                    .query_async::<Option<Vec<u8>>>(&mut connection)
                    .await
                    .map(|value| value.is_some())
                    .map_err(|error| error.to_string())
            }
            Self::Map { records } => {
                let value = records.get(key).map(|record| record.value().clone());
                give_way().await;
                Ok(value.is_some())
            }
        }
    }

    /// Reads a record, then writes `value` over it: rdkv with `compare_and_swap` (retried when
    /// it loses a race), Redis with GET then SET (as YCSB's Redis binding does), the map under
    /// its entry's lock.
    pub async fn read_modify_write(&self, key: &str, value: &[u8]) -> DriverResult<bool> {
        match self {
            Self::Rdkv { client, .. } => {
                for _ in 0..READ_MODIFY_WRITE_ATTEMPTS {
                    let Some(current) = client
                        .get(key.as_bytes())
                        .await
                        .map_err(|error| error.to_string())?
                    else {
                        return Ok(false);
                    };
                    match client
                        .compare_and_swap(key.as_bytes(), &current, value)
                        .await
                        .map_err(|error| error.to_string())?
                    {
                        CasOutcome::Swapped => return Ok(true),
                        CasOutcome::Mismatch(_) => continue,
                    }
                }
                Err(format!(
                    "read-modify-write lost {READ_MODIFY_WRITE_ATTEMPTS} races in a row"
                ))
            }
            Self::Redis { .. } => {
                if !self.read(key).await? {
                    return Ok(false);
                }
                self.write(key, value).await.map(|()| true)
            }
            Self::Map { records } => {
                let found = match records.get_mut(key) {
                    Some(mut record) => {
                        let _current = record.value().clone();
                        *record = Bytes::copy_from_slice(value);
                        true
                    }
                    None => false,
                };
                give_way().await;
                Ok(found)
            }
        }
    }

    /// rdkv's counters, to compute round trips per operation over a phase.
    pub fn rdkv_counters(&self) -> Option<rdkv_client::CounterSnapshot> {
        match self {
            Self::Rdkv { client, .. } => Some(client.counters()),
            Self::Redis { .. } | Self::Map { .. } => None,
        }
    }

    /// rdkv's figures between two counter snapshots.
    pub fn rdkv_figures(
        before: Option<rdkv_client::CounterSnapshot>,
        after: Option<rdkv_client::CounterSnapshot>,
    ) -> Option<RdkvFigures> {
        let (before, after) = (before?, after?);
        let operations = after.operations.saturating_sub(before.operations).max(1) as f64;
        let gets = after.gets.saturating_sub(before.gets).max(1) as f64;
        Some(RdkvFigures {
            round_trips_per_operation: (after.round_trips - before.round_trips) as f64 / operations,
            round_trips_per_read: (after.get_round_trips - before.get_round_trips) as f64 / gets,
            round_trips_in_sequence_per_operation: ((after.round_trips - before.round_trips)
                .saturating_sub(after.overlapped_round_trips - before.overlapped_round_trips))
                as f64
                / operations,
            verbs_per_operation: (after.verbs - before.verbs) as f64 / operations,
            cas_failures: after.cas_failures - before.cas_failures,
            checksum_retries: after.checksum_retries - before.checksum_retries,
            scratch_waits: after.scratch_waits - before.scratch_waits,
        })
    }

    /// Closes connections cleanly.
    pub async fn close(&self) {
        if let Self::Rdkv { client, .. } = self {
            client.close().await;
        }
    }
}
