//! Which copies a whole-cluster start may take: a copy loaded from a final snapshot of a node
//! that stopped serving while the view had it serving decides over the copy of the same key
//! from a node that stopped serving before it, absent or not (`docs/protocol.md`,
//! *Reconciliation*, *Which copy decides*; the stateright model `protocol-model/src/
//! leave_order.rs`).
//!
//! Versions alone cannot tell a delete from a copy that never had the key: a snapshot holds
//! no tombstones. When nodes stop one at a time, the first to stop keeps the keys deleted
//! after it in its snapshot, and newest-wins would bring them back. What orders the copies
//! is when each node stopped serving:
//!
//! - A node that stopped serving at epoch `F` while the view had it serving as this process
//!   (a clean leave, or a lapsed lease), and wrote its final snapshot once every connection
//!   was torn down, holds every write acknowledged of the keys it is a copy of until then: no
//!   such write completes without it until a view moves the keys. It accepted no write after,
//!   and every write it had accepted came over a connection of epoch `F` or earlier. Its
//!   snapshot says `F` (`fenced_at`).
//! - So a node `X` among the key's first `replicas` by the whole membership (a serving node
//!   among those is always one of the key's copies) with `F_X` above another final snapshot's
//!   `F_Q` holds every acknowledged write `Q`'s copy holds, or a later one: `X`'s copy, or the
//!   key's absence from it, decides. Two stops at the same epoch decide nothing over each
//!   other (both hold the same acknowledged writes); the newest version wins.
//! - A snapshot's header epoch is no bound: a node keeps applying views while it tears its
//!   connections down, and one that stopped serving early may write its file after a later
//!   stop (the model's first counterexample to comparing header epochs).
//!
//! A snapshot written on a schedule, or at a stop whose teardowns did not finish, neither
//! decides nor is decided over: its copies may come from any later epoch, and a crash keeps
//! each key as of its snapshot or later (`docs/operations.md`, *Persistence*).
//!
//! Epochs count in one view's history: a cluster started from another run directory (its
//! view state new, its `data_dir` the same) counts from 1 again, and a snapshot of the old
//! history could claim a large epoch over a newer one. A copy therefore decides only over one
//! whose node stopped serving no later than its own, by the nodes' clocks: a guard that can
//! only keep a copy (newest-wins then holds), never drop one.

use std::collections::BTreeMap;

use rdkv_common::sharding;

use crate::snapshot::file::Fence;

/// What a member's table says of its copies: when the node that wrote the snapshot it holds
/// stopped serving, if it did while the view had it serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Provenance {
    /// `None`: not a final snapshot of a node the view had serving, or a table that changed
    /// since it was loaded.
    pub fenced_at: Option<Fence>,
}

impl Provenance {
    /// Whether this table's copies decide over `other`'s of a key both are copies of.
    fn decides_over(&self, other: &Provenance) -> bool {
        let (Some(mine), Some(theirs)) = (self.fenced_at, other.fenced_at) else {
            return false;
        };
        theirs.epoch < mine.epoch && theirs.unix_ms <= mine.unix_ms
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
    /// The provenance of each filling member's table.
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

    /// A final snapshot of a node that stopped serving at `epoch`, a second per epoch.
    fn stopped_at(epoch: u64) -> Provenance {
        Provenance {
            fenced_at: Some(Fence {
                epoch,
                unix_ms: 1_000 * epoch,
            }),
        }
    }

    #[test]
    fn a_copy_decides_over_one_whose_node_stopped_serving_before() {
        assert!(stopped_at(6).decides_over(&stopped_at(5)));
        assert!(!stopped_at(5).decides_over(&stopped_at(6)));
        // The same epoch: both hold the same acknowledged writes.
        assert!(!stopped_at(6).decides_over(&stopped_at(6)));
    }

    #[test]
    fn a_table_that_names_no_stop_neither_decides_nor_is_decided_over() {
        let none = Provenance { fenced_at: None };
        assert!(!stopped_at(9).decides_over(&none));
        assert!(!none.decides_over(&stopped_at(3)));
    }

    /// A snapshot of an earlier view history (a cluster started from another run directory
    /// with the same data directories) claims large epochs, but its node stopped serving
    /// before: it decides nothing over the newer one.
    #[test]
    fn a_stop_of_an_earlier_view_history_decides_nothing_whatever_its_epoch() {
        let old_history = Provenance {
            fenced_at: Some(Fence {
                epoch: 50,
                unix_ms: 1_000,
            }),
        };
        let new_history = Provenance {
            fenced_at: Some(Fence {
                epoch: 3,
                unix_ms: 9_000,
            }),
        };
        assert!(!old_history.decides_over(&new_history));
        assert!(!new_history.decides_over(&old_history));
    }

    #[test]
    fn only_a_copy_by_the_whole_membership_decides() {
        let members = vec![1, 2, 3];
        let mut provenance = BTreeMap::new();
        provenance.insert(1, stopped_at(5));
        provenance.insert(2, stopped_at(6));
        provenance.insert(3, stopped_at(7));
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
