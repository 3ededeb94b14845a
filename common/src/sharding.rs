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

#[cfg(test)]
mod tests {
    use super::*;

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
