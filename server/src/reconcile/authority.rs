//! Which copies a whole-cluster start may take: a copy loaded from a final snapshot of a node
//! that stopped serving while the view had it serving decides over an older copy of the same
//! key, absent or not (`docs/protocol.md`, *Reconciliation*).
//!
//! Versions alone cannot tell a delete from a copy that never had the key: a snapshot holds
//! no tombstones. When nodes stop one at a time, the first to stop keeps the keys deleted
//! after it in its snapshot, and newest-wins would bring them back. What orders the copies
//! is when each node stopped:
//!
//! - A node that stopped serving at epoch `F` while the view had it serving as this process
//!   (a clean leave, or a lapsed lease), and wrote its final snapshot once every connection
//!   was torn down, holds every write acknowledged of the keys it is a copy of up to `F`: no
//!   such write completes without it until a view moves the keys. Its snapshot says `F`
//!   (`fenced_at`).
//! - A final snapshot's copies were all accepted under its view epoch `E` or earlier (the
//!   node served nothing while it wrote it).
//! - So a final snapshot of epoch `E` holds nothing that a key's other copy with `F ≥ E` lacks
//!   or has older, when that copy's node is one of the key's copies by the whole membership
//!   (a node serving is always one of the first `replicas` of the key's ranking over the
//!   serving members when it is among the first of the ranking over every member). That
//!   copy, or its absence, decides.
//! - Two final snapshots each within the other's (`E ≤ F` both ways: every epoch the same)
//!   hold the same acknowledged writes: neither decides, and the newest version wins.
//!
//! A snapshot written on a schedule, or at a stop whose teardowns did not finish, neither
//! decides nor is decided over: its copies may come from later than its epoch, and a crash
//! keeps each key as of its snapshot or later (`docs/operations.md`, *Persistence*).
//!
//! Epochs count in one view's history: a cluster started from another run directory (its
//! view state new, its `data_dir` the same) counts from 1 again, and a snapshot of the old
//! history could claim a large epoch over a newer one. A snapshot therefore decides only over
//! one written no later than itself, by the writers' clocks: a guard that can only keep a
//! copy (newest-wins then holds), never drop one.

use std::collections::BTreeMap;

use rdkv_common::sharding;

/// What a member's loaded snapshot says of its copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Provenance {
    /// The view epoch the snapshot was taken under (0: the node loaded none).
    pub epoch: u64,
    /// The epoch its node stopped serving at, for a final snapshot of a node the view had
    /// serving; `None` otherwise.
    pub fenced_at: Option<u64>,
    /// When its writing began, in milliseconds since the Unix epoch, by its node's clock.
    pub created_unix_ms: u64,
}

impl Provenance {
    /// Whether this snapshot's copies decide over `other`'s of a key both are copies of.
    fn decides_over(&self, other: &Provenance) -> bool {
        let Some(fenced_at) = self.fenced_at else {
            return false;
        };
        // Only a final snapshot's copies are bounded by its epoch.
        let Some(other_fenced_at) = other.fenced_at else {
            return false;
        };
        let covers = other.epoch <= fenced_at;
        let covered = self.epoch <= other_fenced_at;
        let written_before = other.created_unix_ms <= self.created_unix_ms;
        covers && !covered && written_before
    }
}

/// The copies of keys that a whole-cluster start may take: every member's [`Provenance`],
/// and the whole membership the keys' copies are ranked over.
#[derive(Debug, Clone)]
pub(crate) struct Authority {
    /// Every member of the view, down ones included, in id order.
    pub members: Vec<u32>,
    /// The cluster's `replicas`.
    pub replicas: usize,
    /// The provenance of each filling member's loaded snapshot.
    pub provenance: BTreeMap<u32, Provenance>,
}

impl Authority {
    /// Whether `source`'s copy of `key` (or its absence) is superseded by another member's:
    /// then it is not taken, and a node holding it drops it.
    pub(crate) fn superseded(&self, source: u32, key: &[u8]) -> bool {
        let Some(own) = self.provenance.get(&source) else {
            return false;
        };
        sharding::replicas(key, &self.members, self.replicas)
            .into_iter()
            .map(|index| self.members[index])
            .filter(|copy| *copy != source)
            .any(|copy| {
                self.provenance
                    .get(&copy)
                    .is_some_and(|theirs| theirs.decides_over(own))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A final snapshot written at a moment that follows its epoch.
    fn final_at(epoch: u64, fenced_at: u64) -> Provenance {
        Provenance {
            epoch,
            fenced_at: Some(fenced_at),
            created_unix_ms: 1_000 * epoch,
        }
    }

    fn on_schedule(epoch: u64) -> Provenance {
        Provenance {
            epoch,
            fenced_at: None,
            created_unix_ms: 1_000 * epoch,
        }
    }

    #[test]
    fn a_final_snapshot_decides_over_one_taken_before_it_stopped_serving() {
        // Node 1 left at epoch 5 (its snapshot written under 6), node 2 at epoch 6.
        assert!(final_at(7, 6).decides_over(&final_at(6, 5)));
        assert!(!final_at(6, 5).decides_over(&final_at(7, 6)));
        // The same epoch everywhere: both hold the same acknowledged writes.
        assert!(!final_at(6, 6).decides_over(&final_at(6, 6)));
        // Taken after the other stopped serving: it may hold later writes.
        assert!(!final_at(7, 6).decides_over(&final_at(8, 7)));
    }

    #[test]
    fn a_snapshot_on_a_schedule_neither_decides_nor_is_decided_over() {
        assert!(!final_at(9, 9).decides_over(&on_schedule(3)));
        assert!(!on_schedule(9).decides_over(&final_at(3, 2)));
        assert!(!final_at(9, 9).decides_over(&Provenance {
            epoch: 0,
            fenced_at: None,
            created_unix_ms: 0,
        }));
    }

    /// A snapshot of an earlier view history (a cluster started from another run directory
    /// with the same data directories) claims large epochs, but was written before: it
    /// decides nothing over the newer one.
    #[test]
    fn a_snapshot_written_earlier_decides_nothing_whatever_its_epochs() {
        let old_history = Provenance {
            epoch: 51,
            fenced_at: Some(50),
            created_unix_ms: 1_000,
        };
        let new_history = Provenance {
            epoch: 4,
            fenced_at: Some(3),
            created_unix_ms: 9_000,
        };
        assert!(!old_history.decides_over(&new_history));
        assert!(!new_history.decides_over(&old_history));
    }

    #[test]
    fn only_a_copy_by_the_whole_membership_decides() {
        let members = vec![1, 2, 3];
        let mut provenance = BTreeMap::new();
        provenance.insert(1, final_at(6, 5));
        provenance.insert(2, final_at(7, 6));
        provenance.insert(3, final_at(8, 7));
        let authority = Authority {
            members: members.clone(),
            replicas: 2,
            provenance,
        };
        for index in 0..300u32 {
            let key = format!("key-{index}").into_bytes();
            let copies: Vec<u32> = sharding::replicas(&key, &members, 2)
                .into_iter()
                .map(|at| members[at])
                .collect();
            for source in [1u32, 2, 3] {
                // The nodes stopped in id order: a copy that stopped later decides; a node
                // that stopped after every copy (a stand-in) may hold later writes.
                assert_eq!(
                    authority.superseded(source, &key),
                    copies.iter().any(|copy| *copy > source),
                    "key {index}, copies {copies:?}, source {source}"
                );
            }
        }
    }
}
