//! Versions and newest-wins recovery after a crash of every node, for the replication model
//! ([`crate::replication`], scenarios `*-crash`; `docs/protocol.md`, *Versions* and
//! *Reconciliation*).
//!
//! Every block carries a version. A writer gives its blocks one above every version it read on
//! the key's replicas; a thief gives its rollback copies one above the lock's block and every
//! backup copy it read before swapping it (the protocol [`ReplicationProtocol::Lock`]), or, in
//! the broken variant [`ReplicationProtocol::RollbackKeepsVersion`], the old value's own
//! version; a compactor's move keeps it.
//!
//! Each node may write a snapshot of its slot once, at any step (the node's visible value and
//! its block's version; a tombstone or an empty slot is no key), and every node may crash at
//! once, at any step: memory is lost, each node loads its snapshot (at first, the initial
//! value's, version 0), and the newest copy by version wins on every node. The properties,
//! checked in the state after the crash:
//!
//! - [`NEWEST_COPIES_AGREE`]: no two snapshots hold different values of the same version, so
//!   every replica keeps the same copy;
//! - [`AS_OF_THE_LAST_SNAPSHOT`]: the winning value was on some node at or after the latest
//!   snapshot's moment (moments count the writes committed so far): the key is as of its last
//!   snapshot or later, never a value that an earlier rollback or commit had replaced by then.
//!
//! [`ReplicationProtocol::Lock`]: crate::replication::ReplicationProtocol::Lock
//! [`ReplicationProtocol::RollbackKeepsVersion`]: crate::replication::ReplicationProtocol::RollbackKeepsVersion

use std::collections::BTreeMap;

use crate::key_value::Value;

/// Property: after the crash, no two snapshots hold different values of the same version.
pub const NEWEST_COPIES_AGREE: &str = "newest-wins recovery leaves the copies agreeing";
/// Property: after the crash, the newest copy was on a node at or after the last snapshot.
pub const AS_OF_THE_LAST_SNAPSHOT: &str = "each key is as of its last snapshot or later";

/// The nodes of the model.
const NODES: usize = 2;

/// What a node's snapshot holds of the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Disk {
    /// The value, with its block's version; `None`: no key (absent, or a tombstone).
    pub copy: Option<(Value, u8)>,
    /// The writes committed when it was taken.
    pub moment: u8,
}

/// The snapshots, the crash, and what recovery needs to judge the outcome.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Recovery {
    /// Each node's snapshot.
    pub disks: [Disk; NODES],
    /// Which nodes wrote their one snapshot of the run.
    pub snapshotted: [bool; NODES],
    /// Writes committed so far (own writes' commits on the primary).
    pub commits: u8,
    /// Each value's last moment on some node (as a slot's value, or under a lock).
    pub last_present: BTreeMap<Value, u8>,
    /// Every node crashed (the run ends there).
    pub crashed: bool,
}

impl Recovery {
    /// Before any step: both nodes' snapshots hold `initial` at version 0.
    pub fn new(initial: Option<Value>) -> Self {
        let disk = Disk {
            copy: initial.map(|value| (value, 0)),
            moment: 0,
        };
        let mut last_present = BTreeMap::new();
        if let Some(value) = initial {
            last_present.insert(value, 0);
        }
        Self {
            disks: [disk; NODES],
            snapshotted: [false; NODES],
            commits: 0,
            last_present,
            crashed: false,
        }
    }

    /// Notes the values the nodes show now (`visible`: each node's value, if any).
    pub fn note_present(&mut self, visible: [Option<Value>; NODES]) {
        for value in visible.into_iter().flatten() {
            let moment = self.last_present.entry(value).or_insert(self.commits);
            *moment = (*moment).max(self.commits);
        }
    }

    /// Node `node` writes its snapshot: `visible` at `version`.
    pub fn snapshot(&mut self, node: usize, visible: Option<Value>, version: u8) {
        self.disks[node] = Disk {
            copy: visible.map(|value| (value, version)),
            moment: self.commits,
        };
        self.snapshotted[node] = true;
    }

    /// Whether two snapshots hold different values of the same version (checked once crashed).
    pub fn copies_disagree(&self) -> bool {
        let copies: Vec<(Value, u8)> = self.disks.iter().filter_map(|disk| disk.copy).collect();
        copies.iter().any(|(value, version)| {
            copies
                .iter()
                .any(|(other, other_version)| version == other_version && value != other)
        })
    }

    /// The copy that wins: the highest version (the first node's on a tie).
    pub fn winner(&self) -> Option<(Value, u8)> {
        self.disks.iter().filter_map(|disk| disk.copy).fold(
            None,
            |best: Option<(Value, u8)>, copy| match best {
                Some(best) if best.1 >= copy.1 => Some(best),
                _ => Some(copy),
            },
        )
    }

    /// Whether the winner is as of the latest snapshot or later (checked once crashed).
    pub fn as_of_the_last_snapshot(&self) -> bool {
        let latest = self.disks.iter().map(|disk| disk.moment).max().unwrap_or(0);
        match self.winner() {
            Some((value, _)) => self
                .last_present
                .get(&value)
                .is_some_and(|moment| *moment >= latest),
            // No copy anywhere: only right if no snapshot held the key.
            None => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_version_wins_and_a_tie_of_two_values_is_a_disagreement() {
        let mut recovery = Recovery::new(Some(Value(1)));
        recovery.commits = 1;
        recovery.note_present([Some(Value(11)), Some(Value(11))]);
        recovery.snapshot(0, Some(Value(11)), 2);
        assert_eq!(recovery.winner(), Some((Value(11), 2)));
        assert!(!recovery.copies_disagree() && recovery.as_of_the_last_snapshot());
        recovery.snapshot(1, Some(Value(21)), 2);
        assert!(recovery.copies_disagree());
        // A value gone before the latest snapshot's moment must not win.
        let mut stale = Recovery::new(Some(Value(1)));
        stale.note_present([Some(Value(1)), Some(Value(31))]);
        stale.snapshot(1, Some(Value(31)), 3);
        stale.commits = 1;
        stale.note_present([Some(Value(11)), Some(Value(11))]);
        stale.snapshot(0, Some(Value(11)), 2);
        assert_eq!(stale.winner(), Some((Value(31), 3)));
        assert!(!stale.as_of_the_last_snapshot());
    }
}
