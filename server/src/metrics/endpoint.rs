//! The metrics endpoint: `GET /metrics` over HTTP/1.1, served by `hyper`.
//!
//! The endpoint is unauthenticated, so everything a connection can make the node hold is
//! bounded (`MetricsLimits`, `docs/operations.md`, *Metrics*):
//!
//! - open connections: at most `max_connections`, applied after `accept`, a new one closing
//!   the oldest (`super::connections`);
//! - a request head: `header_read_timeout` for the whole head (hyper's own timer, not one per
//!   read), from the accept or from the end of the previous response, so an idle keep-alive
//!   connection is closed after it too; at most `MAX_BUFFER_BYTES` of it;
//! - a connection's life: `connection_lifetime`, then the response being written gets
//!   `header_read_timeout` more and the connection is closed.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rdkv_common::protocol::ServerStats;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::connections::{Admission, EndpointCounters, OpenConnections};
use super::Metrics;
use crate::config::MetricsLimits;
use crate::pending::{ACCEPT_BACKOFF, ACCEPT_WARNING_EVERY};

/// The largest read buffer of one connection (hyper's least is 8 KiB): a longer request head
/// is answered 431 and the connection closed.
const MAX_BUFFER_BYTES: usize = 16 * 1024;

/// Builds the stats snapshot that a scrape renders.
type Snapshot = dyn Fn() -> ServerStats + Send + Sync;

/// Serves `GET /metrics` on `listener` under `limits` until `shutdown`, then closes every
/// connection and returns once their tasks have ended.
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    snapshot: impl Fn() -> ServerStats + Send + Sync + 'static,
    limits: MetricsLimits,
    shutdown: CancellationToken,
) {
    let snapshot: Arc<Snapshot> = Arc::new(snapshot);
    let connections = OpenConnections::new(limits.max_connections, metrics.endpoint.clone());
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_BUFFER_BYTES)
        .keep_alive(true);
    let builder = Arc::new(builder);
    let tasks = TaskTracker::new();
    let mut last_accept_warning: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors or memory: back off rather than spin, and say so at
                // most once a second.
                if last_accept_warning
                    .is_none_or(|warned: Instant| warned.elapsed() >= ACCEPT_WARNING_EVERY)
                {
                    last_accept_warning = Some(Instant::now());
                    tracing::warn!(%error, "metrics accept failed: backing off");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
                continue;
            }
        };
        // The limit is applied to accepted connections: this one stays, the oldest goes.
        let admission = connections.admit(shutdown.child_token());
        tasks.spawn(serve_connection(
            builder.clone(),
            stream,
            admission,
            metrics.clone(),
            snapshot.clone(),
            limits,
        ));
    }
    tasks.close();
    tasks.wait().await;
}

/// How a connection's serving ended.
enum Ended {
    /// Hyper finished it: the peer closed, a head timed out, or the request was bad.
    Finished(Result<(), hyper::Error>),
    /// A newer connection evicted it, or the endpoint stopped.
    Closed,
    /// It reached `connection_lifetime`.
    LifetimeOver,
}

/// Serves one connection's requests until it ends, is evicted, or outlives its lifetime.
async fn serve_connection(
    builder: Arc<http1::Builder>,
    stream: TcpStream,
    admission: Admission,
    metrics: Arc<Metrics>,
    snapshot: Arc<Snapshot>,
    limits: MetricsLimits,
) {
    let counters = metrics.endpoint.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let response = answer(&request, &metrics, &*snapshot);
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    let ended = tokio::select! {
        finished = connection.as_mut() => Ended::Finished(finished),
        _ = admission.close.cancelled() => Ended::Closed,
        _ = tokio::time::sleep(limits.connection_lifetime) => Ended::LifetimeOver,
    };
    let finished = match ended {
        Ended::Finished(finished) => finished,
        Ended::Closed => return,
        Ended::LifetimeOver => {
            // Let the response being written finish (bounded), then close.
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                finished = connection.as_mut() => finished,
                _ = admission.close.cancelled() => return,
                _ = tokio::time::sleep(limits.header_read_timeout) => return,
            }
        }
    };
    record(finished, &counters);
}

/// Counts a connection that hyper ended because no whole request head arrived within the
/// header-read timeout (a slow head, or an idle connection); logs why any other ended with an error (at debug level: outsiders cause these at
/// will).
fn record(finished: Result<(), hyper::Error>, counters: &EndpointCounters) {
    match finished {
        Ok(()) => {}
        Err(error) if error.is_timeout() => counters.timed_out.inc(),
        Err(error) => tracing::debug!(%error, "metrics connection ended"),
    }
}

/// The answer to one request: the metrics for `GET /metrics` (or `HEAD`), else 404.
fn answer(
    request: &Request<Incoming>,
    metrics: &Metrics,
    snapshot: &Snapshot,
) -> Response<Full<Bytes>> {
    let wants_metrics = request.uri().path() == "/metrics"
        && matches!(*request.method(), Method::GET | Method::HEAD);
    if !wants_metrics {
        let mut response = Response::new(Full::new(Bytes::from_static(b"try GET /metrics here\n")));
        *response.status_mut() = StatusCode::NOT_FOUND;
        return response;
    }
    let mut response = Response::new(Full::new(Bytes::from(metrics.render(&snapshot()))));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(prometheus::TEXT_FORMAT),
    );
    response
}

/// Binds the metrics listener.
pub(crate) async fn bind(address: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}
