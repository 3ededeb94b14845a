//! The metrics endpoint cannot be held by outsiders (issue 39): connections that trickle a
//! request head, or say nothing, do not keep a scrape from being answered; the limit on open
//! connections closes the oldest, never refuses the newest; and slow heads, idle keep-alive
//! connections and long-lived connections are closed at their bounds (`MetricsLimits`).
//!
//! Nothing here asserts how fast anything is: each wait has a generous bound only so that a
//! broken endpoint fails the test instead of hanging it.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use rdkv_server::config::MetricsLimits;
use rdkv_server::{RunningServer, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

const SECRET: &[u8] = b"metrics-secret";
/// The longest any wait here may take before the test fails instead of hanging.
const HANG_GUARD: Duration = Duration::from_secs(20);
/// A request head that never ends: the start of a request, then one header's value forever.
const ENDLESS_HEAD: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: rdkv\r\nX-Slow: ";
/// A whole request on a connection that stays open for more.
const KEEP_ALIVE_REQUEST: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: rdkv\r\n\r\n";

/// A server on loopback port 0 whose metrics endpoint (also on port 0) has `limits`.
async fn server(limits: MetricsLimits) -> (RunningServer, SocketAddr) {
    let mut config = ServerConfig::local(SECRET);
    config.metrics_address = Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    config.metrics_limits = limits;
    let server = rdkv_server::start(config).await.expect("start");
    let address = server.metrics_address().expect("a metrics address");
    (server, address)
}

/// Limits whose timeouts no step of a test reaches, with `max_connections` connections.
fn patient_limits(max_connections: usize) -> MetricsLimits {
    MetricsLimits {
        max_connections,
        header_read_timeout: Duration::from_secs(120),
        connection_lifetime: Duration::from_secs(120),
    }
}

/// Scrapes `address` once on a new connection; panics unless it is answered 200 with the
/// metrics. Returns every sample by name (labels stripped).
async fn scrape(address: SocketAddr) -> HashMap<String, f64> {
    let exchange = async {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: rdkv\r\nConnection: close\r\n\r\n")
            .await
            .expect("request");
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.expect("response");
        response
    };
    let response = tokio::time::timeout(HANG_GUARD, exchange)
        .await
        .expect("the scrape was not answered within the hang guard");
    let response = String::from_utf8(response).expect("a text response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain"), "{head}");
    body.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| {
            let (name, value) = line.rsplit_once(' ').expect("name value");
            let name = name.split('{').next().unwrap_or(name);
            (name.to_string(), value.parse().expect("a numeric sample"))
        })
        .collect()
}

/// Scrapes until `condition` holds for the samples (a server-side effect of something already
/// done); panics after the hang guard.
async fn scrape_until(
    address: SocketAddr,
    what: &str,
    condition: impl Fn(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    loop {
        let samples = scrape(address).await;
        if condition(&samples) {
            return samples;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not seen within the hang guard; last samples {samples:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the node closes `stream` (a read sees the end, or an error); panics after the
/// hang guard.
async fn wait_closed(stream: &mut TcpStream) {
    let mut buffer = [0u8; 4096];
    let closed = async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(HANG_GUARD, closed)
        .await
        .expect("the node kept the connection open past the hang guard");
}

/// Connects and sends one byte of a request head every `every` until the node closes the
/// connection; returns once it has.
async fn trickle_until_closed(mut stream: TcpStream, every: Duration) {
    let trickle = async {
        for byte in ENDLESS_HEAD.iter().chain(std::iter::repeat(&b'a')) {
            if stream.write_all(&[*byte]).await.is_err() {
                return;
            }
            let mut buffer = [0u8; 256];
            match tokio::time::timeout(every, stream.read(&mut buffer)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(_)) | Err(_) => {}
            }
        }
    };
    tokio::time::timeout(HANG_GUARD, trickle)
        .await
        .expect("the node kept a trickling connection open past the hang guard");
}

/// Reads one response on a keep-alive connection: its status line and body. `None` when the
/// node closed the connection first.
async fn read_response(stream: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    let head_end = loop {
        if let Some(end) = received.windows(4).position(|window| window == b"\r\n\r\n") {
            break end + 4;
        }
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return None,
            Ok(read) => received.extend_from_slice(&buffer[..read]),
        }
    };
    let head = String::from_utf8_lossy(&received[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .expect("a content-length");
    while received.len() < head_end + length {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return None,
            Ok(read) => received.extend_from_slice(&buffer[..read]),
        }
    }
    let status = head.lines().next().unwrap_or_default().to_string();
    Some((status, received[head_end..].to_vec()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_trickling_connections_do_not_keep_a_scrape_from_being_answered() {
    let (_server, address) = server(patient_limits(64)).await;
    // Each connection has begun its head before the scrape connects.
    let mut trickling = JoinSet::new();
    for _ in 0..16 {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        stream.write_all(&ENDLESS_HEAD[..1]).await.expect("a byte");
        trickling.spawn(async move {
            // One byte every 300 ms, never finishing, until the test ends.
            for byte in ENDLESS_HEAD[1..].iter().chain(std::iter::repeat(&b'a')) {
                if stream.write_all(&[*byte]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
    }

    let samples = scrape(address).await;
    assert_eq!(
        samples["rdkv_metrics_connections"], 17.0,
        "the sixteen were held open while the scrape was answered"
    );
    assert_eq!(samples["rdkv_metrics_connections_evicted_total"], 0.0);
    trickling.abort_all();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_idle_connections_evict_the_oldest_and_a_scrape_is_answered() {
    const IDLE: usize = 500;
    const LIMIT: usize = 64;
    let (_server, address) = server(patient_limits(LIMIT)).await;
    let mut idle = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        idle.push(TcpStream::connect(address).await.expect("connect"));
    }

    // The node accepts in order: the scrape is the newest of 501, and the limit closed the
    // oldest of them.
    let samples = scrape(address).await;
    assert_eq!(samples["rdkv_metrics_connections"], LIMIT as f64);
    assert_eq!(
        samples["rdkv_metrics_connections_evicted_total"],
        (IDLE + 1 - LIMIT) as f64
    );
    wait_closed(&mut idle[0]).await;
    wait_closed(&mut idle[IDLE - LIMIT]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_and_idle_connections_are_closed_at_the_head_timeout() {
    let (_server, address) = server(MetricsLimits {
        max_connections: 64,
        header_read_timeout: Duration::from_secs(2),
        connection_lifetime: Duration::from_secs(120),
    })
    .await;

    // A head trickled a byte every 200 ms: no read waits long, the whole head does.
    let slow = TcpStream::connect(address).await.expect("connect");
    trickle_until_closed(slow, Duration::from_millis(200)).await;
    // A connection that says nothing.
    let mut silent = TcpStream::connect(address).await.expect("connect");
    wait_closed(&mut silent).await;
    // A keep-alive connection, idle after its first answer.
    let mut kept = TcpStream::connect(address).await.expect("connect");
    kept.write_all(KEEP_ALIVE_REQUEST).await.expect("request");
    let (status, _) = read_response(&mut kept).await.expect("an answer");
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    wait_closed(&mut kept).await;

    // All three were closed by the head timeout, and counted.
    scrape_until(address, "three connections timed out", |samples| {
        samples["rdkv_metrics_connections_timed_out_total"] == 3.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_keep_alive_connection_is_closed_at_its_lifetime() {
    let (_server, address) = server(MetricsLimits {
        max_connections: 64,
        header_read_timeout: Duration::from_secs(120),
        connection_lifetime: Duration::from_secs(1),
    })
    .await;
    let mut stream = TcpStream::connect(address).await.expect("connect");
    let mut answered = 0u32;
    let requests = async {
        loop {
            if stream.write_all(KEEP_ALIVE_REQUEST).await.is_err() {
                return;
            }
            match read_response(&mut stream).await {
                Some((status, _)) => {
                    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
                    answered += 1;
                }
                None => return,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(HANG_GUARD, requests)
        .await
        .expect("the node kept a busy connection open past the hang guard");
    assert!(answered >= 1, "the connection was served before it closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_paths_are_not_found() {
    let (_server, address) = server(MetricsLimits::default()).await;
    let mut stream = TcpStream::connect(address).await.expect("connect");
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: rdkv\r\n\r\n")
        .await
        .expect("request");
    let (status, body) = tokio::time::timeout(HANG_GUARD, read_response(&mut stream))
        .await
        .expect("answered within the hang guard")
        .expect("an answer");
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    assert_eq!(body, b"try GET /metrics here\n");
}
