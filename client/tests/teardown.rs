//! A session's teardown (queue pair to ERROR, drain, revoke, destroy) may block, as a verbs
//! drain waiting for the NIC's flushes does (up to `retry_timeout` + 1 s). It runs on tokio's
//! blocking pool, so it never stalls the operations of other connections on the same runtime.

use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientConfig};
use rdkv_fabric::{Backend, QueuePairState};
use rdkv_server::ServerConfig;

const SECRET: &[u8] = b"teardown-test-secret";

/// One runtime thread for the server and both clients: a teardown on it would stop them all.
#[tokio::test(flavor = "current_thread")]
async fn a_slow_teardown_does_not_stall_other_connections() {
    let stall = Duration::from_secs(4);
    let mut config = ServerConfig::local(SECRET);
    config.teardown_stall = stall;
    let server = rdkv_server::start(config).await.expect("start server");
    let connect = || {
        Client::connect(ClientConfig::new(
            server.control_address(),
            Backend::Soft,
            SECRET,
        ))
    };
    let steady = connect().await.expect("connect the steady client");
    steady.put(b"steady", b"before").await.expect("put");
    let leaving = connect().await.expect("connect the leaving client");
    leaving.put(b"leaving", b"value").await.expect("put");

    let in_error = || server.stats().queue_pairs[QueuePairState::Error.index()];
    assert_eq!(in_error(), 0);
    drop(leaving);
    // The leaving connection's teardown has begun once its queue pair is in ERROR; it then
    // holds for `stall` before it destroys the queue pair.
    let waiting_since = Instant::now();
    while in_error() == 0 {
        assert!(
            waiting_since.elapsed() < Duration::from_secs(10),
            "the leaving client's teardown never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let started = Instant::now();
    for index in 0..100u32 {
        let key = format!("key-{index}");
        steady
            .put(key.as_bytes(), b"during the teardown")
            .await
            .expect("put during another connection's teardown");
        assert!(steady.get(key.as_bytes()).await.expect("get").is_some());
    }
    // Were the teardown on the runtime's one thread, no operation could have run before it
    // ended (and the wait above would have found no queue pair in ERROR).
    assert_eq!(
        in_error(),
        1,
        "200 operations took {:?}, longer than the teardown's {stall:?} hold: the check proves nothing",
        started.elapsed()
    );
}
