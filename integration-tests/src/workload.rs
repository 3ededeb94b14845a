//! The load of the checked-history tests (`failover_linearizability.rs`, `paused_node.rs`):
//! one random operation (get, put, delete or compare-and-swap) on a real client, recorded as
//! the linearizability checker's [`Operation`] and [`Outcome`].

use rand::Rng;
use rdkv_client::{CasOutcome, Client};

use crate::linearizability::{Event, Operation, Outcome};

/// How the operations are mixed, in percent: gets, puts and deletes; the rest are
/// compare-and-swaps expecting the last value this client read of the key.
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    /// Percent of gets.
    pub gets: u32,
    /// Percent of puts.
    pub puts: u32,
    /// Percent of deletes.
    pub deletes: u32,
}

/// A value's first 8 bytes as the unique `u64` a writer put.
pub fn decode(value: Option<bytes::Bytes>) -> Option<u64> {
    value.map(|bytes| {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[..8]);
        u64::from_le_bytes(word)
    })
}

/// The last value this client read of `key` (0 if none): what its compare-and-swap expects.
pub fn last_value(events: &[Event], key: u64) -> u64 {
    events
        .iter()
        .rev()
        .find_map(|event| match (event.key == key, event.outcome) {
            (true, Outcome::Value(Some(value))) => Some(value),
            _ => None,
        })
        .unwrap_or(0)
}

/// Runs one operation of `mix` on `key` (`key-{key}`), writing `unique` if it writes; `seen`
/// is this client's history so far.
pub async fn random_operation(
    client: &Client,
    random: &mut impl Rng,
    key: u64,
    unique: u64,
    seen: &[Event],
    mix: Mix,
) -> (Operation, rdkv_client::Result<Outcome>) {
    random_operation_sized(client, random, key, unique, seen, mix, 8).await
}

/// `value` as a written value of `size` bytes (at least 8): its little-endian bytes, then
/// zeros (a heap-filling load writes large values that still decode to one `u64`).
fn padded(value: u64, size: usize) -> Vec<u8> {
    let mut bytes = value.to_le_bytes().to_vec();
    bytes.resize(size.max(8), 0);
    bytes
}

/// [`random_operation`], writing values of `value_size` bytes.
pub async fn random_operation_sized(
    client: &Client,
    random: &mut impl Rng,
    key: u64,
    unique: u64,
    seen: &[Event],
    mix: Mix,
    value_size: usize,
) -> (Operation, rdkv_client::Result<Outcome>) {
    let key_bytes = format!("key-{key}");
    let key_bytes = key_bytes.as_bytes();
    let choice = random.gen_range(0..100);
    if choice < mix.gets {
        let result = client.get(key_bytes).await;
        (
            Operation::Get,
            result.map(|value| Outcome::Value(decode(value))),
        )
    } else if choice < mix.gets + mix.puts {
        let result = client.put(key_bytes, &padded(unique, value_size)).await;
        (Operation::Put(unique), result.map(|()| Outcome::Written))
    } else if choice < mix.gets + mix.puts + mix.deletes {
        let result = client.delete(key_bytes).await;
        (Operation::Delete, result.map(Outcome::Deleted))
    } else {
        let expected = last_value(seen, key);
        let result = client
            .compare_and_swap(
                key_bytes,
                &padded(expected, value_size),
                &padded(unique, value_size),
            )
            .await
            .map(|outcome| match outcome {
                CasOutcome::Swapped => Outcome::Swapped,
                CasOutcome::Mismatch(current) => Outcome::Mismatch(decode(current)),
            });
        let operation = Operation::CompareAndSwap {
            expected,
            new: unique,
        };
        (operation, result)
    }
}
