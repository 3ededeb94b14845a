//! The control handshake's deadline covers the whole handshake, not each read or each message
//! (issue 14): a client that trickles its first frame a byte at a time, and one that
//! authenticates and then never asks for its queue pair, are both closed at
//! `handshake_deadline`, well before the per-message timeout (5 s), and counted.

use std::time::{Duration, Instant};

use rdkv_common::protocol::{read_frame, ServerMessage};
use rdkv_server::{RunningServer, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod support;

const SECRET: &[u8] = b"deadline-test-secret";
const DEADLINE: Duration = Duration::from_secs(2);

async fn server() -> RunningServer {
    let mut config = ServerConfig::local(SECRET);
    config.limits.handshake_deadline = DEADLINE;
    rdkv_server::start(config).await.expect("start")
}

/// Waits until the node closes `stream`, writing one byte of `trickle` every 200 ms while it
/// is open (none when empty); returns how long after `since` it closed (bounded by 20 s).
async fn closed_after(stream: &mut TcpStream, trickle: &[u8], since: Instant) -> Duration {
    let mut next = 0;
    let mut buffer = [0u8; 256];
    while since.elapsed() < Duration::from_secs(20) {
        if next < trickle.len() && stream.write_all(&trickle[next..=next]).await.is_err() {
            return since.elapsed();
        }
        next += 1;
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return since.elapsed(),
            Ok(Ok(_)) | Err(_) => {}
        }
    }
    panic!("the node kept the connection open for 20 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handshake_is_closed_at_the_whole_handshake_deadline() {
    let server = server().await;

    // A first frame trickled a byte every 200 ms: no read ever waits long.
    let since = Instant::now();
    let mut stream = TcpStream::connect(server.control_address())
        .await
        .expect("connect");
    let ServerMessage::Challenge { .. } = read_frame(&mut stream).await.expect("challenge") else {
        panic!("no challenge");
    };
    let mut trickle = 200u32.to_le_bytes().to_vec();
    trickle.extend([7u8; 200]);
    let trickled = closed_after(&mut stream, &trickle, since).await;
    eprintln!("a trickled first frame: closed after {trickled:?}");

    // Authenticated at once, then silent: each message on time, the handshake not.
    let since = Instant::now();
    let mut stream = TcpStream::connect(server.control_address())
        .await
        .expect("connect");
    let ServerMessage::Welcome(_) = support::authenticate(&mut stream, SECRET, false, "slow").await
    else {
        panic!("no welcome");
    };
    let silent = closed_after(&mut stream, &[], since).await;
    eprintln!("authenticated, then silent: closed after {silent:?}");

    for closed in [trickled, silent] {
        assert!(
            closed >= DEADLINE - Duration::from_millis(100)
                && closed < Duration::from_millis(4_500),
            "closed after {closed:?}: the deadline is {DEADLINE:?}, a message's own timeout 5 s"
        );
    }
    assert_eq!(server.stats().handshakes_timed_out, 2);
}
