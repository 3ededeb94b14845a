//! Opening a connection: TCP connect, the HMAC challenge, the queue pair, the keys, and the
//! control task (`docs/protocol.md`, *Handshake*).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkv_common::lease::ClockBound;
use rdkv_common::protocol::{
    check_challenge_node, compute_proof, read_frame, write_frame, ClientMessage, Purpose,
    ServerMessage, PROTOCOL_VERSION,
};
use rdkv_common::ControlError;
use rdkv_fabric::QueuePairConfig;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};

use crate::counters::Counters;
use crate::error::{Error, Result};

use super::*;

/// What a node's refusal to serve data now says ([`crate::Error::is_not_serving`]).
pub(crate) const NOT_SERVING: &str = "does not serve data now";
/// How long connecting and each handshake step may take.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads one handshake reply, bounded in time.
async fn read_reply(stream: &mut TcpStream) -> Result<ServerMessage, ControlError> {
    tokio::time::timeout(CONNECT_TIMEOUT, read_frame::<_, ServerMessage>(stream))
        .await
        .unwrap_or(Err(ControlError::Unexpected(
            "handshake step timed out".into(),
        )))
}

/// Why authentication did not give a welcome.
enum Evictable {
    /// The node closed the connection before answering the proof.
    Closed,
    /// Anything else.
    Failed(Error),
}

impl From<Error> for Evictable {
    fn from(error: Error) -> Self {
        Self::Failed(error)
    }
}

/// Attempts at authenticating when the node closes the connection during it. Three were too
/// few: a helper's attack (2026-12-05) saw 4–8 of 150 `rdkv put`s fail under a flood from the
/// client's own address when the client ran at a lower priority, and clients of a node with
/// `max_connections = 8` (an unauthenticated budget of two) evict each other's handshakes.
const AUTHENTICATE_ATTEMPTS: u32 = 8;

/// The pause before authentication attempt `n` (from the second): `n` × this, so that eight
/// attempts wait 70 ms in all, well inside any operation deadline, and the flood that evicted
/// the last one has moved on.
const AUTHENTICATE_BACKOFF: Duration = Duration::from_millis(2);

/// TCP connect, challenge, proof: the welcome, on an authenticated stream.
async fn authenticate(
    config: &ClientConfig,
    purpose: Purpose,
) -> std::result::Result<(TcpStream, rdkv_common::protocol::Welcome, ClockBound), Evictable> {
    let address = config.node.control_address;
    let unreachable = |reason: String| Error::NodeUnreachable { address, reason };
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
        .await
        .map_err(|_| unreachable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
        .map_err(|error| unreachable(error.to_string()))?;
    let _ = stream.set_nodelay(true);
    // A close (or reset) during authentication may be an eviction (see `open`).
    let closed_or_failed = |error: ControlError| match &error {
        ControlError::Closed => Evictable::Closed,
        ControlError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ) =>
        {
            Evictable::Closed
        }
        _ => Evictable::Failed(unreachable(format!("handshake: {error}"))),
    };
    let ServerMessage::Challenge {
        protocol_version,
        nonce,
        node_id,
        shm_socket,
    } = read_reply(&mut stream).await.map_err(closed_or_failed)?
    else {
        return Err(Evictable::from(unreachable(
            "the server did not start with a challenge".into(),
        )));
    };
    check_challenge_node(config.node.id, node_id).map_err(|error| Error::AuthenticationFailed {
        address,
        reason: error.to_string(),
    })?;
    if protocol_version != PROTOCOL_VERSION {
        return Err(Evictable::from(Error::AuthenticationFailed {
                address,
                reason: format!(
                    "protocol version mismatch: the server speaks {protocol_version}, this client {PROTOCOL_VERSION}"
                ),
            }));
    }
    let shared_memory = match (config.node.shared_memory, shm_socket.as_deref()) {
        (SharedMemory::Off, _) => false,
        (SharedMemory::Auto, Some(socket)) => reachable_here(socket),
        (SharedMemory::Auto, None) => false,
        (SharedMemory::Require, Some(socket)) if reachable_here(socket) => true,
        (SharedMemory::Require, offered) => {
            return Err(Evictable::from(Error::Refused {
                reason: match offered {
                    None => format!(
                        "node {node_id} at {address} offers no shm fabric (its cluster file sets shm = \"off\", or rdkv-server runs without --shm-socket); use --fabric soft"
                    ),
                    Some(socket) => format!(
                        "node {node_id}'s shm socket {} is not reachable from this process (another host, or another user: the socket is mode 0600); use --fabric soft",
                        socket.display()
                    ),
                },
            }))
        }
    };
    let asked = std::time::Instant::now();
    write_frame(
        &mut stream,
        &ClientMessage::Authenticate {
            protocol_version: PROTOCOL_VERSION,
            purpose,
            proof: compute_proof(&config.secret, node_id, &nonce),
            client_name: config.name.clone(),
            shared_memory,
            routes_by_view: config.routes_by_view,
        },
    )
    .await
    .map_err(closed_or_failed)?;
    let welcome = match read_reply(&mut stream).await.map_err(closed_or_failed) {
        Ok(ServerMessage::Welcome(welcome)) => *welcome,
        Ok(ServerMessage::Refused { reason }) => {
            return Err(Evictable::from(refusal(node_id, address, reason)))
        }
        Ok(ServerMessage::NotServing { epoch, reason }) => {
            // Retryable: the client goes to the key's next copy once the view names it.
            return Err(Evictable::from(unreachable(format!(
                "node {node_id} {NOT_SERVING} (view epoch {epoch}): {reason}"
            ))));
        }
        Ok(other) => {
            return Err(Evictable::from(unreachable(format!(
                "unexpected handshake reply {other:?}"
            ))))
        }
        Err(error) => return Err(error),
    };
    let clock = ClockBound::new(asked, std::time::Instant::now(), welcome.node_clock_ms);
    Ok((stream, welcome, clock))
}

/// Whether a node's advertised `shm` socket is on this host and this process may use it: a
/// socket that accepts a connection from here (the node's, mode 0600: same user). The probe
/// connection closes at once; the node's accept thread reads its end and moves on.
fn reachable_here(socket: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(socket).is_ok_and(|metadata| metadata.file_type().is_socket())
        && std::os::unix::net::UnixStream::connect(socket).is_ok()
}

/// [`authenticate`], again when the node closes the connection during it: a node under a flood
/// of unauthenticated connections evicts the oldest silent one, and ours can be it between the
/// challenge and our proof. That close (never a wrong secret, which is refused in words) is
/// worth a few more tries.
async fn authenticate_with_retries(
    config: &ClientConfig,
    purpose: Purpose,
) -> Result<(TcpStream, Welcome, ClockBound)> {
    let address = config.node.control_address;
    let mut attempt = 1;
    loop {
        match authenticate(config, purpose).await {
            Err(Evictable::Closed) if attempt < AUTHENTICATE_ATTEMPTS => {
                attempt += 1;
                tracing::debug!(%address, attempt, "closed during authentication; connecting again");
                tokio::time::sleep(AUTHENTICATE_BACKOFF * attempt).await;
            }
            Err(Evictable::Closed) => {
                return Err(Error::NodeUnreachable {
                    address,
                    reason: format!(
                        "the node closed the connection during authentication, {AUTHENTICATE_ATTEMPTS} times: it is stopping, or a flood of unauthenticated connections evicts ours (docs/protocol.md, Control frames)"
                    ),
                })
            }
            Err(Evictable::Failed(error)) => return Err(error),
            Ok(authenticated) => return Ok(authenticated),
        }
    }
}

/// Starts the connection's control task on `stream` (heartbeats every third of the lease,
/// control requests): returns its request channel, the flag it sets when the connection
/// breaks, and the lease clock its heartbeats keep.
fn start_control_task(
    stream: TcpStream,
    welcome: &Welcome,
    clock: ClockBound,
    counters: Arc<Counters>,
) -> (
    mpsc::Sender<ControlRequest>,
    Arc<AtomicBool>,
    Arc<Mutex<ClockBound>>,
) {
    let (control, requests) = mpsc::channel(16);
    let heartbeat =
        Duration::from_millis(welcome.lease_timeout_ms / 3).max(Duration::from_millis(10));
    let broken = Arc::new(AtomicBool::new(false));
    let lease_clock = Arc::new(Mutex::new(clock));
    tokio::spawn(control_task(
        stream,
        requests,
        heartbeat,
        counters,
        broken.clone(),
        lease_clock.clone(),
    ));
    (control, broken, lease_clock)
}

impl NodeConnection {
    /// Connects, authenticates, connects the queue pair and starts the control task; writers
    /// take their turns in `writer_stripes`, the node's, and lookups guess from `slot_cache`, the
    /// node's view of the process's cache. `purpose` is `Data` for a client's first lane to
    /// the node and `Lane` for the others (the node admits those only while it is at most half
    /// full).
    pub(crate) async fn open(
        config: &ClientConfig,
        purpose: Purpose,
        counters: Arc<Counters>,
        writer_stripes: Arc<WriterStripes>,
        slot_cache: Arc<SlotCache>,
    ) -> Result<Arc<Self>> {
        let address = config.node.control_address;
        let unreachable = |reason: String| Error::NodeUnreachable { address, reason };
        let (mut stream, welcome, clock) = authenticate_with_retries(config, purpose).await?;

        // The welcome's endpoint says which fabric the node gave this connection: its shm
        // fabric when asked for and offered, else the cluster's.
        let backend = welcome.server_endpoint.backend();
        let capabilities = backend.capabilities();
        if config.node.shared_memory == SharedMemory::Require && !capabilities.shares_memory {
            return Err(Error::Refused {
                reason: format!(
                    "the node at {address} answered with its {backend} fabric, not shm; use --fabric soft"
                ),
            });
        }
        let fabric = ClientFabric::shared(config, backend)?;
        let completion_queue = fabric.device.create_completion_queue(1024)?;
        let queue_pair = fabric
            .domain
            .create_queue_pair(&completion_queue, QueuePairConfig::default())?;
        let slots = config.concurrency.clamp(1, super::config::MAX_CONCURRENCY);
        // The announce word's source bytes; scratch buffers come from the pool per operation.
        let announce_region = fabric.announce_block().await?;
        let connect_queue_pair = ClientMessage::ConnectQueuePair {
            endpoint: queue_pair.endpoint(),
        };
        if capabilities.responder_connects_first {
            // An shm responder takes an attach only once its queue pair is connected to ours:
            // name ours first.
            write_frame(&mut stream, &connect_queue_pair).await?;
            if let Err(error) = queue_pair.connect(&welcome.server_endpoint).await {
                if config.node.shared_memory != SharedMemory::Auto {
                    return Err(error.into());
                }
                // The node's socket did not take the attach (busy, or not the node we
                // reached): this connection goes over the cluster's fabric instead.
                tracing::debug!(%address, %error, "shm attach failed; connecting over the cluster's fabric");
                let mut fallback = config.clone();
                fallback.node.shared_memory = SharedMemory::Off;
                return Box::pin(Self::open(
                    &fallback,
                    purpose,
                    counters,
                    writer_stripes,
                    slot_cache,
                ))
                .await;
            }
        } else {
            queue_pair.connect(&welcome.server_endpoint).await?;
            write_frame(&mut stream, &connect_queue_pair).await?;
        }
        let keys = match read_reply(&mut stream).await {
            Ok(ServerMessage::QueuePairReady(keys)) => keys,
            Ok(ServerMessage::Refused { reason }) => return Err(Error::Refused { reason }),
            other => return Err(unreachable(format!("queue pair not ready: {other:?}"))),
        };

        // The view the connection was made under: a client with an older one fetches it.
        counters
            .view_epoch
            .fetch_max(welcome.view_epoch, std::sync::atomic::Ordering::Relaxed);
        let (control, broken, lease_clock) =
            start_control_task(stream, &welcome, clock, counters.clone());
        let announcer = Arc::new(Announcer::new(announce_region, 0, keys.announce_key));
        let connection = Arc::new(Self {
            address,
            welcome,
            keys,
            queue_pair,
            retired_buffers: Mutex::new(Vec::new()),
            announcer,
            scratch_permits: Arc::new(Semaphore::new(slots)),
            chunk: Mutex::new(None),
            refill: Semaphore::new(1),
            heap_full: Mutex::new(None),
            writer_stripes,
            slot_cache,
            control,
            broken,
            lease_clock,
            counters,
            fault_injector: config.fault_injector.clone(),
            fabric,
        });
        tokio::spawn(announce::flusher(
            Arc::downgrade(&connection),
            connection.announcer.wakeups(),
        ));
        Ok(connection)
    }
}

/// A node's refusal of an Authenticate, as the client's error: a wrong secret or version is
/// [`Error::AuthenticationFailed`] (its reason without the repeated prefix); anything else (a
/// full node, no room for an extra lane) is [`Error::Refused`], naming the node.
fn refusal(node_id: u32, address: SocketAddr, reason: String) -> Error {
    const AUTHENTICATION: &str = "authentication failed: ";
    if let Some(rest) = reason.strip_prefix(AUTHENTICATION) {
        Error::AuthenticationFailed {
            address,
            reason: rest.to_string(),
        }
    } else if reason.starts_with("protocol version mismatch") {
        Error::AuthenticationFailed { address, reason }
    } else {
        Error::Refused {
            reason: format!("node {node_id} at {address}: {reason}"),
        }
    }
}
