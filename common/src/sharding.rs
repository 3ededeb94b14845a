//! Which node owns a key: rendezvous (highest random weight) hashing over node ids. Adding or
//! removing a node moves only the keys that node gains or loses.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The weight of `node_id` for `key`.
pub fn weight(key: &[u8], node_id: u32) -> u64 {
    xxh3_64_with_seed(
        key,
        u64::from(node_id).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5244_4B56_5348_4152,
    )
}

/// The index (into `node_ids`) of the node that owns `key`: the highest weight, ties to the lower
/// id. `None` only for an empty list.
pub fn owner(key: &[u8], node_ids: &[u32]) -> Option<usize> {
    node_ids
        .iter()
        .enumerate()
        .max_by_key(|(_, id)| (weight(key, **id), std::cmp::Reverse(**id)))
        .map(|(index, _)| index)
}

/// The indexes (into `node_ids`) of the first `count` nodes of `key`'s ranking, highest weight
/// first (ties to the lower id): its replicas, primary first. Fewer when the list is shorter.
/// Removing a node keeps the others in order, so a dead primary's first backup becomes the
/// primary.
pub fn replicas(key: &[u8], node_ids: &[u32], count: usize) -> Vec<usize> {
    let mut ranked: Vec<(u64, std::cmp::Reverse<u32>, usize)> = node_ids
        .iter()
        .enumerate()
        .map(|(index, id)| (weight(key, *id), std::cmp::Reverse(*id), index))
        .collect();
    ranked.sort_unstable_by(|left, right| right.cmp(left));
    ranked
        .into_iter()
        .take(count)
        .map(|(_, _, index)| index)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_are_the_ranking_and_a_removed_node_shifts_the_rest_up() {
        let nodes = [1u32, 2, 3, 4];
        for index in 0..5_000u32 {
            let key = index.to_le_bytes();
            let ranked = replicas(&key, &nodes, 4);
            assert_eq!(ranked.len(), 4);
            assert_eq!(
                Some(ranked[0]),
                owner(&key, &nodes),
                "the primary is the owner"
            );
            let two = replicas(&key, &nodes, 2);
            assert_eq!(two, ranked[..2]);
            // Without the primary, the backups move up in order.
            let dead = nodes[ranked[0]];
            let survivors: Vec<u32> = nodes.iter().copied().filter(|id| *id != dead).collect();
            let after: Vec<u32> = replicas(&key, &survivors, 3)
                .into_iter()
                .map(|index| survivors[index])
                .collect();
            let expected: Vec<u32> = ranked[1..].iter().map(|index| nodes[*index]).collect();
            assert_eq!(after, expected);
        }
        assert!(replicas(b"k", &[], 2).is_empty());
        assert_eq!(replicas(b"k", &[7], 3).len(), 1);
    }

    #[test]
    fn keys_spread_over_nodes_and_removal_moves_only_the_removed_nodes_keys() {
        let nodes = [1u32, 2, 3];
        let mut counts = [0usize; 3];
        let mut moved = 0;
        for index in 0..30_000u32 {
            let key = index.to_le_bytes();
            let owner_of_three = owner(&key, &nodes).expect("owner");
            counts[owner_of_three] += 1;
            let owner_of_two = owner(&key, &[1, 2]).expect("owner");
            if owner_of_three != 2 {
                assert_eq!(
                    owner_of_two, owner_of_three,
                    "keys of surviving nodes stay put"
                );
            } else {
                moved += 1;
            }
        }
        assert!(
            counts.iter().all(|count| (9_000..11_000).contains(count)),
            "{counts:?}"
        );
        assert_eq!(moved, counts[2]);
        assert_eq!(owner(b"k", &[]), None);
    }
}
