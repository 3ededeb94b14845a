//! The consensus's storage: the vote, the log and the applied view, in memory and, when the
//! node has a state file, written to it (atomically: a temporary file, fsync, rename) before
//! any call that changes them returns. Raft is safe across restarts only if a node remembers
//! its vote and its log; `rdkv-cluster` gives every node a state file in its run directory.
//! The state is a few hundred bytes (views change rarely), so it is rewritten whole.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{LogState, RaftLogReader, RaftSnapshotBuilder, Snapshot, SnapshotMeta};
use openraft::{
    AnyError, BasicNode, Entry, EntryPayload, LogId, Membership, RaftStorage, StorageError,
    StorageIOError, StoredMembership, Vote,
};
use rdkv_fabric::lock;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use rdkv_common::protocol::MemberState;

use super::types::{PeerId, TypeConfig, ViewReply, ViewState};

/// The state file's first bytes: its format. Version 2 added the epoch at which each member's
/// record last changed (`MemberRecord::since`) and the filling round to `Promote`; version 3
/// the last stop and the loss records (`ViewState`), and reads a version 2 file
/// ([`upgraded_from_2`]). A file of another format is refused with a one-line error, never
/// misread.
const FILE_HEADER: &[u8] = b"rdkv-view-state 3\n";

/// The header of the format before [`FILE_HEADER`].
const FILE_HEADER_2: &[u8] = b"rdkv-view-state 2\n";

/// Everything the node must remember.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Persisted {
    /// The last vote.
    vote: Option<Vote<PeerId>>,
    /// The last committed log id known.
    committed: Option<LogId<PeerId>>,
    /// The log, by index.
    log: BTreeMap<u64, Entry<TypeConfig>>,
    /// The last log id purged (the log is never purged: views change rarely).
    last_purged: Option<LogId<PeerId>>,
    /// The last log id applied to the view.
    last_applied: Option<LogId<PeerId>>,
    /// The last membership applied.
    membership: StoredMembership<PeerId, BasicNode>,
    /// The view.
    view: ViewState,
    /// The last snapshot installed or built: its meta and its bytes (the view).
    snapshot: Option<(SnapshotMeta<PeerId, BasicNode>, Vec<u8>)>,
}

/// Decodes a state file's bytes, of this format or the one before.
fn decode(path: &std::path::Path, bytes: &[u8]) -> Result<Persisted, crate::Error> {
    let undecodable = |error: bincode::Error| crate::Error::ViewState {
        path: path.to_path_buf(),
        reason: format!("{error}; delete the file to start this node's view afresh"),
    };
    if let Some(body) = bytes.strip_prefix(FILE_HEADER) {
        return bincode::deserialize(body).map_err(undecodable);
    }
    if let Some(body) = bytes.strip_prefix(FILE_HEADER_2) {
        let before: PersistedBefore3 = bincode::deserialize(body).map_err(undecodable)?;
        return Ok(upgraded_from_2(before));
    }
    Err(crate::Error::ViewState {
        path: path.to_path_buf(),
        reason: "written by another version of rdkv, or not a view state file; stop every node of the cluster and delete their view state files to start the view afresh".into(),
    })
}

/// A state file of format 2: [`Persisted`] with the view as it was then.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct PersistedBefore3 {
    vote: Option<Vote<PeerId>>,
    committed: Option<LogId<PeerId>>,
    log: BTreeMap<u64, Entry<TypeConfig>>,
    last_purged: Option<LogId<PeerId>>,
    last_applied: Option<LogId<PeerId>>,
    membership: StoredMembership<PeerId, BasicNode>,
    view: ViewStateBefore3,
    #[allow(dead_code)] // Read to reach the end; the snapshot is of the old view's format.
    snapshot: Option<(SnapshotMeta<PeerId, BasicNode>, Vec<u8>)>,
}

/// The view of format 2: the epoch and the records.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct ViewStateBefore3 {
    epoch: u64,
    members: BTreeMap<u32, super::types::MemberRecord>,
}

/// Format 2's state in this format: no loss recorded; the last stop is the one every member
/// is still down or resumed since, if there is one (a cluster stopped by `down`, then upgraded);
/// the old snapshot is dropped (the log is never purged: it holds every entry).
fn upgraded_from_2(before: PersistedBefore3) -> Persisted {
    let members = before.view.members;
    let mut since = members.values().map(|record| record.since);
    let first = since.next();
    let one_stop = members
        .values()
        .all(|record| record.state != MemberState::Serving)
        && since.all(|epoch| Some(epoch) == first);
    Persisted {
        vote: before.vote,
        committed: before.committed,
        log: before.log,
        last_purged: before.last_purged,
        last_applied: before.last_applied,
        membership: before.membership,
        view: ViewState {
            epoch: before.view.epoch,
            // Format 2 kept no such set: a member that ever joined may have served.
            ever_served: members
                .iter()
                .filter(|(_, record)| record.incarnation != 0)
                .map(|(node_id, _)| *node_id)
                .collect(),
            members,
            last_stop: first.filter(|_| one_stop),
            ..ViewState::default()
        },
        snapshot: None,
    }
}

/// A cluster stop applied: its epoch and the members it took from serving.
pub type StopApplied = (u64, Vec<u32>);

/// The storage shared by Raft's log store, state machine, log readers and snapshot builders.
#[derive(Debug, Clone)]
pub struct Store {
    /// The state.
    state: Arc<Mutex<Persisted>>,
    /// Where it is written, if anywhere.
    file: Option<Arc<PathBuf>>,
    /// The applied view, for readers that must not wait for Raft.
    view: Arc<watch::Sender<ViewState>>,
    /// The last [`ViewCommand::Stop`](super::types::ViewCommand::Stop) applied by this
    /// process: its epoch and the members it took from serving (in memory: only the process
    /// that applied it writes a snapshot for it).
    last_stop: Arc<Mutex<Option<StopApplied>>>,
    /// The cluster's `replicas`: this many members without a whole copy at once lose keys.
    replicas: usize,
}

fn io_error(error: impl std::error::Error + 'static) -> StorageError<PeerId> {
    StorageError::IO {
        source: StorageIOError::write(AnyError::new(&error)),
    }
}

impl Store {
    /// Opens the store: the state file's contents when it has some for these `node_ids`, else
    /// a fresh state whose view has every node serving (none, for a node that joins a running
    /// cluster: it learns the view from the leader's log). A state file whose view names a
    /// node `node_ids` lacks (the cluster file changed) is set aside as `FILE.old`, with a
    /// warning; `node_ids` may list nodes the view does not have (not added yet, or removed).
    ///
    /// # Errors
    /// The state file exists but cannot be read or decoded.
    pub fn open(
        file: Option<PathBuf>,
        node_ids: &[u32],
        replicas: usize,
        joining: bool,
    ) -> Result<Self, crate::Error> {
        // A node that joins a running cluster learns the view from the leader's log: the first
        // entry's membership names the members the view began with (`apply_to_state_machine`).
        let fresh = Persisted {
            view: if joining {
                ViewState::default()
            } else {
                ViewState::initial(node_ids)
            },
            ..Persisted::default()
        };
        let state = match &file {
            Some(path) if path.exists() => {
                let bytes = std::fs::read(path).map_err(|source| crate::Error::ViewState {
                    path: path.clone(),
                    reason: source.to_string(),
                })?;
                let persisted = decode(path, &bytes)?;
                let known: Vec<u32> = persisted.view.members.keys().copied().collect();
                let mut wanted = node_ids.to_vec();
                wanted.sort_unstable();
                // The cluster file may list nodes the view has not added yet, or no longer has
                // (`rdkv-cluster add-node`, `remove-node`): the view's members decide.
                let listed = known.iter().all(|node_id| wanted.contains(node_id));
                if listed && !known.is_empty() {
                    persisted
                } else {
                    let aside = path.with_extension("old");
                    tracing::warn!(
                        file = %path.display(),
                        ?known,
                        ?wanted,
                        "the view state was written for other nodes; set aside as {}",
                        aside.display()
                    );
                    let _ = std::fs::rename(path, &aside);
                    fresh
                }
            }
            _ => fresh,
        };
        let (view, _) = watch::channel(state.view.clone());
        Ok(Self {
            state: Arc::new(Mutex::new(state)),
            file: file.map(Arc::new),
            view: Arc::new(view),
            last_stop: Arc::default(),
            replicas,
        })
    }

    /// The cluster's `replicas`.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Whether the store has ever held a log entry or a vote (Raft was initialized here).
    pub fn has_history(&self) -> bool {
        let state = self.lock();
        state.vote.is_some() || !state.log.is_empty()
    }

    /// On a first start: the log's first entry, every node a voter, as `Raft::initialize`
    /// writes it (index 0, term 0), but without the election that `initialize` starts at once.
    /// Every node writes the same entry, so their logs agree on it. Elections start only after
    /// a pre-vote (`election.rs`): one started at once made the leader step down when the
    /// last node of a fresh cluster started after the others had elected it.
    ///
    /// # Errors
    /// The state file cannot be written.
    #[allow(clippy::result_large_err)] // openraft's error type: its traits return it
    pub fn initialize(
        &self,
        members: BTreeMap<PeerId, BasicNode>,
    ) -> Result<(), StorageError<PeerId>> {
        let entry = Entry::<TypeConfig> {
            log_id: LogId::default(),
            payload: EntryPayload::Membership(Membership::from(members)),
        };
        self.change(|state| {
            state.log.insert(entry.log_id.index, entry);
        })
    }

    /// The id of the last entry in the log (or the last purged one), as Raft's vote compares
    /// logs: a candidate whose last log id is older than a voter's gets no vote from it.
    pub fn last_log_id(&self) -> Option<LogId<PeerId>> {
        let state = self.lock();
        state
            .log
            .values()
            .next_back()
            .map(|entry| entry.log_id)
            .or(state.last_purged)
    }

    /// The last stop this process applied: its epoch and the members it stopped.
    pub fn last_stop(&self) -> Option<StopApplied> {
        lock(&self.last_stop).clone()
    }

    /// The applied view, changing as commands apply.
    pub fn view(&self) -> watch::Receiver<ViewState> {
        self.view.subscribe()
    }

    fn lock(&self) -> MutexGuard<'_, Persisted> {
        lock(&self.state)
    }

    /// Writes the state to the file (if any) before returning.
    #[allow(clippy::result_large_err)] // openraft's error type: its traits return it
    fn persist(&self, state: &Persisted) -> Result<(), StorageError<PeerId>> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let bytes = bincode::serialize(state).map_err(io_error)?;
        let temporary = path.with_extension("tmp");
        {
            use std::io::Write;
            let mut file = std::fs::File::create(&temporary).map_err(io_error)?;
            file.write_all(FILE_HEADER).map_err(io_error)?;
            file.write_all(&bytes).map_err(io_error)?;
            file.sync_all().map_err(io_error)?;
        }
        std::fs::rename(&temporary, path.as_ref()).map_err(io_error)?;
        Ok(())
    }

    /// Changes the state with `change`, persists it, and returns what `change` returned.
    #[allow(clippy::result_large_err)] // openraft's error type: its traits return it
    fn change<T>(
        &self,
        change: impl FnOnce(&mut Persisted) -> T,
    ) -> Result<T, StorageError<PeerId>> {
        let mut state = self.lock();
        let outcome = change(&mut state);
        self.persist(&state)?;
        Ok(outcome)
    }

    #[allow(clippy::result_large_err)] // openraft's error type: its traits return it
    fn snapshot_of(state: &Persisted) -> Result<Snapshot<TypeConfig>, StorageError<PeerId>> {
        let bytes = bincode::serialize(&state.view).map_err(io_error)?;
        let meta = SnapshotMeta {
            last_log_id: state.last_applied,
            last_membership: state.membership.clone(),
            snapshot_id: format!(
                "{}-{}",
                state.last_applied.map_or(0, |log_id| log_id.index),
                state.view.epoch
            ),
        };
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftLogReader<TypeConfig> for Store {
    async fn try_get_log_entries<Range: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: Range,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<PeerId>> {
        let state = self.lock();
        Ok(state
            .log
            .range(range)
            .map(|(_, entry)| entry.clone())
            .collect())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for Store {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<PeerId>> {
        let snapshot = {
            let state = self.lock();
            Self::snapshot_of(&state)?
        };
        let bytes = snapshot.snapshot.get_ref().clone();
        let meta = snapshot.meta.clone();
        self.change(|state| state.snapshot = Some((meta, bytes)))?;
        Ok(snapshot)
    }
}

impl RaftStorage<TypeConfig> for Store {
    type LogReader = Store;
    type SnapshotBuilder = Store;

    async fn save_vote(&mut self, vote: &Vote<PeerId>) -> Result<(), StorageError<PeerId>> {
        self.change(|state| state.vote = Some(*vote))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<PeerId>>, StorageError<PeerId>> {
        Ok(self.lock().vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<PeerId>>,
    ) -> Result<(), StorageError<PeerId>> {
        self.change(|state| state.committed = committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<PeerId>>, StorageError<PeerId>> {
        Ok(self.lock().committed)
    }

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<PeerId>> {
        let last_log_id = self.last_log_id();
        Ok(LogState {
            last_purged_log_id: self.lock().last_purged,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn append_to_log<Entries>(&mut self, entries: Entries) -> Result<(), StorageError<PeerId>>
    where
        Entries: IntoIterator<Item = Entry<TypeConfig>> + Send,
    {
        self.change(|state| {
            for entry in entries {
                state.log.insert(entry.log_id.index, entry);
            }
        })
    }

    async fn delete_conflict_logs_since(
        &mut self,
        log_id: LogId<PeerId>,
    ) -> Result<(), StorageError<PeerId>> {
        self.change(|state| {
            state.log.split_off(&log_id.index);
        })
    }

    async fn purge_logs_upto(&mut self, log_id: LogId<PeerId>) -> Result<(), StorageError<PeerId>> {
        self.change(|state| {
            state.log = state.log.split_off(&(log_id.index + 1));
            state.last_purged = Some(log_id);
        })
    }

    async fn last_applied_state(
        &mut self,
    ) -> Result<(Option<LogId<PeerId>>, StoredMembership<PeerId, BasicNode>), StorageError<PeerId>>
    {
        let state = self.lock();
        Ok((state.last_applied, state.membership.clone()))
    }

    async fn apply_to_state_machine(
        &mut self,
        entries: &[Entry<TypeConfig>],
    ) -> Result<Vec<ViewReply>, StorageError<PeerId>> {
        let (replies, view) = self.change(|state| {
            let mut replies = Vec::with_capacity(entries.len());
            for entry in entries {
                state.last_applied = Some(entry.log_id);
                match &entry.payload {
                    EntryPayload::Blank => {}
                    EntryPayload::Normal(command) => {
                        let serving = state.view.serving_members();
                        let before = state.view.epoch;
                        let at_risk = state.view.at_risk(self.replicas);
                        let short = state.view.restarted_short(command, self.replicas);
                        let after = state.view.apply(command);
                        if *command == super::types::ViewCommand::Stop && after != before {
                            *lock(&self.last_stop) = Some((after, serving));
                        }
                        let loss = state.view.record_loss(&at_risk, self.replicas).or_else(|| {
                            short.and_then(|node_id| {
                                state.view.record_restart_loss(node_id, before)
                            })
                        });
                        if let Some(loss) = loss {
                            tracing::error!(
                                epoch = loss.epoch,
                                nodes = ?loss.nodes,
                                "{loss}: keys whose copies were all on them are missing, or older than acknowledged, unless those nodes come back with them; `rdkv-cluster ack-loss FILE` clears this once seen"
                            );
                        }
                    }
                    EntryPayload::Membership(membership) => {
                        if state.view.members.is_empty() && state.view.epoch == 0 {
                            // A joining node replaying the log: the view began with the
                            // first membership's voters, all serving.
                            let voters: Vec<u32> = membership
                                .voter_ids()
                                .filter_map(|id| u32::try_from(id).ok())
                                .collect();
                            state.view = ViewState::initial(&voters);
                        }
                        state.membership =
                            StoredMembership::new(Some(entry.log_id), membership.clone());
                    }
                }
                replies.push(ViewReply {
                    epoch: state.view.epoch,
                });
            }
            (replies, state.view.clone())
        })?;
        self.view.send_replace(view);
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<PeerId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<PeerId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<PeerId>> {
        let bytes = snapshot.into_inner();
        let view: ViewState = bincode::deserialize(&bytes).map_err(io_error)?;
        let meta = meta.clone();
        self.change(|state| {
            state.view = view.clone();
            state.last_applied = meta.last_log_id;
            state.membership = meta.last_membership.clone();
            state.snapshot = Some((meta, bytes));
        })?;
        self.view.send_replace(view);
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<PeerId>> {
        let state = self.lock();
        Ok(state.snapshot.as_ref().map(|(meta, bytes)| Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(bytes.clone())),
        }))
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};

    use super::*;
    use crate::view::types::ViewCommand;

    fn entry(index: u64, command: ViewCommand) -> Entry<TypeConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(command),
        }
    }

    #[tokio::test]
    async fn the_vote_log_and_view_survive_a_restart_and_another_cluster_s_state_is_set_aside() {
        let directory =
            std::env::temp_dir().join(format!("rdkv-view-store-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("directory");
        let file = directory.join("node-1.view");
        let _ = std::fs::remove_file(&file);
        let mut store = Store::open(Some(file.clone()), &[1, 2, 3], 2, false).expect("open");
        assert!(!store.has_history());
        store.save_vote(&Vote::new(3, 2)).await.expect("vote");
        let entries = vec![
            entry(
                1,
                ViewCommand::Join {
                    node_id: 1,
                    incarnation: 5,
                },
            ),
            entry(2, ViewCommand::MarkDown { node_id: 3 }),
        ];
        store.append_to_log(entries.clone()).await.expect("append");
        store.apply_to_state_machine(&entries).await.expect("apply");
        drop(store);

        let mut reopened = Store::open(Some(file.clone()), &[3, 2, 1], 2, false).expect("reopen");
        assert!(reopened.has_history());
        assert_eq!(
            reopened.read_vote().await.expect("vote"),
            Some(Vote::new(3, 2))
        );
        let log = reopened.try_get_log_entries(0..10).await.expect("log");
        assert_eq!(log.len(), 2);
        let view = reopened.view().borrow().clone();
        assert_eq!(view.epoch, 2);
        assert_eq!(view.public(None).serving(), vec![1, 2]);
        drop(reopened);

        // The cluster file now names other nodes: a fresh start, the old state kept aside.
        let other =
            Store::open(Some(file.clone()), &[1, 2], 2, false).expect("open for other nodes");
        assert!(!other.has_history());
        assert!(file.with_extension("old").exists());
        let _ = std::fs::remove_dir_all(&directory);
    }

    #[test]
    fn a_corrupt_state_file_is_a_one_line_error_naming_the_fix() {
        let directory =
            std::env::temp_dir().join(format!("rdkv-view-corrupt-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("directory");
        let file = directory.join("node-1.view");
        let mut corrupt = FILE_HEADER.to_vec();
        corrupt.extend_from_slice(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff");
        std::fs::write(&file, &corrupt).expect("write");
        let error = Store::open(Some(file.clone()), &[1, 2], 2, false).expect_err("corrupt");
        let message = error.to_string();
        assert!(message.contains("delete the file"), "{message}");
        assert!(!message.contains('\n'));
        // A file of an earlier format (no header) is refused, not misread.
        std::fs::write(&file, b"\x01\x00\x00\x00\x00\x00\x00\x00\x02").expect("write");
        let error = Store::open(Some(file), &[1, 2], 2, false).expect_err("an earlier format");
        let message = error.to_string();
        assert!(message.contains("another version of rdkv"), "{message}");
        assert!(!message.contains('\n'));
        let _ = std::fs::remove_dir_all(&directory);
    }

    /// A node of the version before (format 2), stopped by `down` and upgraded, reads its
    /// state file: the log and the records stay, and the stop is known (its resume is no loss).
    #[test]
    fn a_state_file_of_format_2_is_read_and_its_stop_kept() {
        let directory =
            std::env::temp_dir().join(format!("rdkv-view-format-2-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("directory");
        let file = directory.join("node-1.view");
        let record = |since| super::super::types::MemberRecord {
            state: MemberState::Down,
            incarnation: 7,
            since,
        };
        let before = PersistedBefore3 {
            vote: Some(Vote::new(2, 1)),
            committed: None,
            log: BTreeMap::new(),
            last_purged: None,
            last_applied: None,
            membership: StoredMembership::default(),
            view: ViewStateBefore3 {
                epoch: 9,
                members: (1..=3).map(|id| (id, record(9))).collect(),
            },
            snapshot: None,
        };
        let mut bytes = FILE_HEADER_2.to_vec();
        bytes.extend(bincode::serialize(&before).expect("encode"));
        std::fs::write(&file, bytes).expect("write");
        let store = Store::open(Some(file), &[1, 2, 3], 2, false).expect("a format 2 file opens");
        let view = store.view().borrow().clone();
        assert_eq!(view.epoch, 9);
        assert_eq!(view.last_stop, Some(9));
        assert!(view.without_whole_copy().is_empty());
        let _ = std::fs::remove_dir_all(&directory);
    }
}
