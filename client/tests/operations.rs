//! Every client operation against an in-process server, on the `soft` and `loopback` fabrics.

use rdkv_client::{CasOutcome, Client, ClientConfig, Error, InsertOutcome};
use rdkv_common::layout::{MAX_KEY_LENGTH, MAX_VALUE_LENGTH};
use rdkv_fabric::Backend;
use rdkv_server::{RunningServer, ServerConfig};

const SECRET: &[u8] = b"operations-test-secret";

async fn start(fabric: Backend) -> (RunningServer, Client) {
    start_seeded(fabric, None).await
}

/// [`start`] with the table's hash seed fixed (`None`: a random one, as a node picks).
async fn start_seeded(fabric: Backend, hash_seed: Option<u64>) -> (RunningServer, Client) {
    let mut config = ServerConfig::local(SECRET);
    config.fabric = fabric;
    config.hash_seed = hash_seed;
    let server = rdkv_server::start(config).await.expect("start server");
    let client = Client::connect(ClientConfig::new(server.control_address(), fabric, SECRET))
        .await
        .expect("connect");
    (server, client)
}

async fn every_operation(fabric: Backend) {
    let (_server, client) = start(fabric).await;
    assert_eq!(client.get(b"missing").await.expect("get"), None);
    client.put(b"alpha", b"one").await.expect("put");
    assert_eq!(
        client.get(b"alpha").await.expect("get").as_deref(),
        Some(&b"one"[..])
    );
    client.put(b"alpha", b"two").await.expect("put replaces");
    assert_eq!(
        client.get(b"alpha").await.expect("get").as_deref(),
        Some(&b"two"[..])
    );

    assert!(
        !client.insert(b"alpha", b"three").await.expect("insert"),
        "insert refuses a present key"
    );
    assert!(
        client.insert(b"beta", b"b").await.expect("insert"),
        "insert adds an absent key"
    );
    assert!(client.update(b"beta", b"bb").await.expect("update"));
    assert!(
        !client.update(b"gamma", b"g").await.expect("update"),
        "update refuses an absent key"
    );
    assert_eq!(client.get(b"gamma").await.expect("get"), None);

    assert_eq!(
        client
            .compare_and_swap(b"beta", b"bb", b"bbb")
            .await
            .expect("cas"),
        CasOutcome::Swapped
    );
    assert_eq!(
        client
            .compare_and_swap(b"beta", b"bb", b"x")
            .await
            .expect("cas"),
        CasOutcome::Mismatch(Some(bytes::Bytes::from_static(b"bbb")))
    );
    assert_eq!(
        client
            .compare_and_swap(b"nobody", b"a", b"b")
            .await
            .expect("cas"),
        CasOutcome::Mismatch(None)
    );

    let values = client
        .batch_get(&[b"alpha", b"beta", b"nobody"])
        .await
        .expect("batch_get");
    assert_eq!(values[0].as_deref(), Some(&b"two"[..]));
    assert_eq!(values[1].as_deref(), Some(&b"bbb"[..]));
    assert_eq!(values[2], None);

    assert!(client.delete(b"alpha").await.expect("delete"));
    assert!(
        !client.delete(b"alpha").await.expect("delete again"),
        "deleting an absent key says so"
    );
    assert_eq!(client.get(b"alpha").await.expect("get"), None);
    client
        .put(b"alpha", b"back")
        .await
        .expect("put after delete");
    assert_eq!(
        client.get(b"alpha").await.expect("get").as_deref(),
        Some(&b"back"[..])
    );
}

/// `insert_or_get` returns the value present; `compare_and_swap_expecting(None)` requires the
/// key to be absent and otherwise returns the value present.
async fn inserts_and_swaps_return_the_value_present(fabric: Backend) {
    let (_server, client) = start(fabric).await;
    assert_eq!(
        client.insert_or_get(b"lock", b"ada").await.expect("insert"),
        InsertOutcome::Inserted
    );
    assert_eq!(
        client
            .insert_or_get(b"lock", b"grace")
            .await
            .expect("insert"),
        InsertOutcome::Present(bytes::Bytes::from_static(b"ada")),
        "a present key's value comes back"
    );
    assert_eq!(
        client.get(b"lock").await.expect("get").as_deref(),
        Some(&b"ada"[..]),
        "a refused insert changes nothing"
    );

    assert_eq!(
        client
            .compare_and_swap_expecting(b"counter", None, b"1")
            .await
            .expect("cas expecting absent"),
        CasOutcome::Swapped,
        "expecting absence, an absent key is set"
    );
    assert_eq!(
        client.get(b"counter").await.expect("get").as_deref(),
        Some(&b"1"[..])
    );
    assert_eq!(
        client
            .compare_and_swap_expecting(b"counter", None, b"x")
            .await
            .expect("cas expecting absent"),
        CasOutcome::Mismatch(Some(bytes::Bytes::from_static(b"1"))),
        "expecting absence, a present key is a mismatch with its value"
    );
    assert_eq!(
        client
            .compare_and_swap_expecting(b"counter", Some(b"1"), b"2")
            .await
            .expect("cas expecting a value"),
        CasOutcome::Swapped
    );
    assert_eq!(
        client
            .compare_and_swap_expecting(b"nobody", Some(b"1"), b"2")
            .await
            .expect("cas expecting a value"),
        CasOutcome::Mismatch(None)
    );
    assert_eq!(
        client.get(b"counter").await.expect("get").as_deref(),
        Some(&b"2"[..])
    );
    assert_eq!(client.get(b"nobody").await.expect("get"), None);
}

async fn values_from_empty_to_the_maximum(fabric: Backend) {
    let (_server, client) = start(fabric).await;
    for length in [0usize, 1, 7, 47, 48, 1000, 4096, MAX_VALUE_LENGTH] {
        let value: Vec<u8> = (0..length)
            .map(|index| (index * 7 + length) as u8)
            .collect();
        let key = format!("value-{length}");
        client.put(key.as_bytes(), &value).await.expect("put");
        assert_eq!(
            client.get(key.as_bytes()).await.expect("get").as_deref(),
            Some(value.as_slice()),
            "value of {length} bytes"
        );
    }
    let error = client
        .put(b"too-big", &vec![0u8; MAX_VALUE_LENGTH + 1])
        .await
        .expect_err("one byte over the maximum");
    assert!(
        matches!(error, Error::ValueTooLarge { length, limit } if length == MAX_VALUE_LENGTH + 1 && limit == MAX_VALUE_LENGTH),
        "{error}"
    );
    assert!(
        error.to_string().contains(&MAX_VALUE_LENGTH.to_string()),
        "the message names the limit: {error}"
    );
}

async fn keys_from_one_byte_to_the_maximum(fabric: Backend) {
    let (_server, client) = start(fabric).await;
    for length in [1usize, 2, 16, 100, MAX_KEY_LENGTH] {
        let key: Vec<u8> = (0..length).map(|index| (index * 13 + 1) as u8).collect();
        client.put(&key, &length.to_le_bytes()).await.expect("put");
        assert_eq!(
            client.get(&key).await.expect("get").as_deref(),
            Some(&length.to_le_bytes()[..]),
            "key of {length} bytes"
        );
    }
    assert!(matches!(
        client.put(b"", b"v").await,
        Err(Error::InvalidKey { length: 0, .. })
    ));
    assert!(matches!(
        client.get(&vec![1u8; MAX_KEY_LENGTH + 1]).await,
        Err(Error::InvalidKey {
            limit: MAX_KEY_LENGTH,
            ..
        })
    ));
}

/// GETs key-0..200 expecting `expected`: (GET round trips, guesses, stale guesses).
async fn get_all(client: &Client, expected: &[u8]) -> (u64, u64, u64) {
    let before = client.counters();
    for index in 0..200 {
        assert_eq!(
            client
                .get(format!("key-{index}").as_bytes())
                .await
                .expect("get")
                .as_deref(),
            Some(expected)
        );
    }
    let after = client.counters();
    (
        after.get_round_trips - before.get_round_trips,
        after.slot_guesses - before.slot_guesses,
        after.slot_guess_misses - before.slot_guess_misses,
    )
}

/// A GET of a key whose slot this process saw last is one round trip (the slot cache's guess:
/// the block READ rides with a READ of the guessed slot's word); without a guess it is two; a
/// guess that another client's update made stale is chased to the slot's new word in a second
/// round trip, and never returns the old value (`docs/protocol.md`, *Guessed blocks*).
async fn a_get_takes_two_round_trips(fabric: Backend) {
    // A fixed hash seed: with a random one, another of the 200 keys shares key-0's fingerprint
    // in its buckets now and then, and the GET of deleted key-0 below then READs that key's
    // block too, a third round trip (CI saw it once, 2026-12-05).
    let (server, client) = start_seeded(fabric, Some(0x5EED)).await;
    let mut uncached = ClientConfig::new(server.control_address(), fabric, SECRET);
    uncached.slot_cache_entries = 0;
    let other = Client::connect(uncached).await.expect("connect");
    for index in 0..200 {
        client
            .put(format!("key-{index}").as_bytes(), b"value")
            .await
            .expect("put");
    }
    // Two keys of the 200 may share a set of the cache with a third and lose their entry
    // (rarely): those GETs guess nothing and take two round trips.
    let (round_trips, guesses, stale) = get_all(&client, b"value").await;
    assert!(guesses >= 195, "{guesses} of 200 GETs guessed");
    assert_eq!(
        (round_trips, stale),
        (400 - guesses, 0),
        "GETs of keys this client wrote: one round trip each with a guess, every guess true"
    );
    assert_eq!(
        get_all(&other, b"value").await,
        (400, 0, 0),
        "200 GETs without a slot cache: exactly 2 round trips each"
    );
    for index in 0..200 {
        other
            .put(format!("key-{index}").as_bytes(), b"newer")
            .await
            .expect("put");
    }
    let (round_trips, guesses_now, stale) = get_all(&client, b"newer").await;
    assert_eq!(
        (round_trips, guesses_now, stale),
        (400, 2 * guesses, guesses),
        "stale guesses: the slot's new word, chased once, gives the new value in two round trips"
    );
    let (round_trips, guesses, stale) = get_all(&client, b"newer").await;
    assert_eq!(
        (round_trips, stale),
        (400 - guesses, 0),
        "the guesses were corrected"
    );
    // A cached GET posts four requests: the announce WRITE, the READ of the guessed slot's
    // word alone (a narrow guess), the block's READ and the node's lease word's READ.
    assert_eq!(
        counted_get(&client, b"key-1", b"newer").await,
        (1, 4),
        "a narrow guess: one round trip, four requests"
    );
    other.delete(b"key-0").await.expect("delete");
    // The guess is stale and its slot empty, so nothing to chase: the buckets are read.
    let before = client.counters();
    assert_eq!(client.get(b"key-0").await.expect("get"), None);
    let after = client.counters();
    assert_eq!(after.get_round_trips - before.get_round_trips, 2);
    // A narrow guess that ended in the buckets sends the next GETs wide (the bucket READs
    // with the guessed block's, and the lease word's: five requests) until enough guesses held.
    assert_eq!(
        counted_get(&client, b"key-1", b"newer").await,
        (1, 5),
        "a wide guess after a stale narrow one: one round trip, five requests"
    );
    for _ in 0..16 {
        client.get(b"key-1").await.expect("get");
    }
    assert_eq!(
        counted_get(&client, b"key-1", b"newer").await,
        (1, 4),
        "narrow guesses again once guesses held"
    );
}

/// GETs `key` expecting `expected`: (round trips, requests posted).
async fn counted_get(client: &Client, key: &[u8], expected: &[u8]) -> (u64, u64) {
    let before = client.counters();
    assert_eq!(
        client.get(key).await.expect("get").as_deref(),
        Some(expected)
    );
    let after = client.counters();
    // The flusher's announce WRITE of an earlier operation may go out meanwhile (on a busy
    // machine its 5 ms pause can end during this GET): it is not the GET's.
    let flushes = after.announce_flushes - before.announce_flushes;
    (
        after.round_trips - before.round_trips,
        after.verbs - before.verbs - flushes,
    )
}

/// Round trips of writes (`docs/protocol.md`): an insert of an absent key is 3 (block WRITE with
/// the bucket READs; tentative CAS with the re-read; commit), plus one block READ per lookup
/// that meets another key's fingerprint; an update of a present key is exactly 3 (block WRITE
/// with the bucket READs; the key's block READ; replace), and 2 when the slot cache's guess
/// holds (the key's block READ rides with the bucket READs).
async fn writes_take_three_round_trips(fabric: Backend) {
    let (server, client) = start(fabric).await;
    let before = client.counters();
    for index in 0..200 {
        assert!(client
            .insert(format!("key-{index}").as_bytes(), b"value")
            .await
            .expect("insert"));
    }
    let inserted = client.counters();
    for index in 0..200 {
        assert!(client
            .update(format!("key-{index}").as_bytes(), b"other")
            .await
            .expect("update"));
    }
    let updated = client.counters();
    let mut uncached = ClientConfig::new(server.control_address(), fabric, SECRET);
    uncached.slot_cache_entries = 0;
    let other = Client::connect(uncached).await.expect("connect");
    let before_other = other.counters();
    for index in 0..200 {
        assert!(other
            .update(format!("key-{index}").as_bytes(), b"third")
            .await
            .expect("update"));
    }
    let other_round_trips = other.counters().work.round_trips - before_other.work.round_trips;
    let insert_round_trips = inserted.work.round_trips - before.work.round_trips;
    let update_round_trips = updated.work.round_trips - inserted.work.round_trips;
    eprintln!("200 inserts: {insert_round_trips} round trips; 200 updates: {update_round_trips}; 200 updates without a slot cache: {other_round_trips}");
    assert!(
        (600..=640).contains(&insert_round_trips),
        "inserts take 3 round trips, and rarely a 4th for a fingerprint collision: {insert_round_trips}"
    );
    let guessed = updated.slot_guesses - inserted.slot_guesses;
    assert!(guessed >= 195, "{guessed} of 200 updates guessed");
    assert_eq!(
        (
            update_round_trips,
            updated.slot_guess_misses - inserted.slot_guess_misses
        ),
        (600 - guessed, 0),
        "updates of keys this client inserted take exactly 2 round trips with a guess, 3 without"
    );
    assert_eq!(
        other_round_trips, 600,
        "updates without a slot cache take exactly 3 round trips"
    );
    // A cached update's first list is the announce WRITE, the block WRITE, the READ of the
    // guessed slot's word and the block's READ (a narrow guess); then the replace CAS. Each
    // list ends with the READ of the node's lease word. (The
    // GET first: `other`'s updates made this client's guess stale, and the GET's chase
    // corrects it.)
    assert_eq!(
        client.get(b"key-1").await.expect("get").as_deref(),
        Some(&b"third"[..])
    );
    let before = client.counters();
    assert!(client.update(b"key-1", b"fourth").await.expect("update"));
    let after = client.counters();
    // As in `counted_get`: the flusher's announce WRITE of the GET above may go out meanwhile
    // (its 5 ms pause can end during the update on a busy machine: CI failed so once, 8
    // requests); it is not the update's.
    let flushes = after.announce_flushes - before.announce_flushes;
    assert_eq!(
        (
            after.round_trips - before.round_trips,
            after.verbs - before.verbs - flushes
        ),
        (2, 7),
        "a narrow update: two round trips, four requests and a CAS, each list with its lease READ"
    );
}

async fn wrong_secret_is_refused(fabric: Backend) {
    let (server, _client) = start(fabric).await;
    let queue_pairs_before = server.stats().queue_pairs.iter().sum::<i64>();
    let error = Client::connect(ClientConfig::new(
        server.control_address(),
        fabric,
        b"wrong",
    ))
    .await
    .expect_err("a wrong secret");
    assert!(
        matches!(error, Error::AuthenticationFailed { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("secret"), "{error}");
    let stats = server.stats();
    assert_eq!(stats.authentication_failures, 1);
    assert_eq!(
        stats.queue_pairs.iter().sum::<i64>(),
        queue_pairs_before,
        "no queue pair was created for the refused client"
    );
}

macro_rules! per_fabric {
    ($module:ident, $fabric:expr) => {
        mod $module {
            use super::*;
            per_fabric!(@tests $fabric;
                every_operation,
                inserts_and_swaps_return_the_value_present,
                values_from_empty_to_the_maximum,
                keys_from_one_byte_to_the_maximum,
                a_get_takes_two_round_trips,
                writes_take_three_round_trips,
                wrong_secret_is_refused,
            );
        }
    };
    (@tests $fabric:expr; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test($fabric).await;
            }
        )*
    };
}

per_fabric!(soft, Backend::Soft);
per_fabric!(loopback, Backend::Loopback);
