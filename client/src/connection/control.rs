//! The control task, which owns the control stream (requests in order, heartbeats while idle),
//! and the requests that go through it: chunks, stats, goodbye.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use rdkv_common::protocol::{read_frame, write_frame, ClientMessage, ServerMessage, ServerStats};
use rdkv_common::ControlError;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::counters::Counters;
use crate::error::{Error, Result};

use super::*;

/// A request to the control task.
pub(super) struct ControlRequest {
    /// What to send.
    message: ClientMessage,
    /// Where the reply goes.
    reply: oneshot::Sender<Result<ServerMessage, ControlError>>,
}

impl NodeConnection {
    /// Sends a control request and waits for its reply.
    pub(crate) async fn control(&self, message: ClientMessage) -> Result<ServerMessage> {
        let (reply, answer) = oneshot::channel();
        let lost = || Error::NodeUnreachable {
            address: self.address,
            reason: "the control connection is closed".into(),
        };
        if self
            .control
            .send(ControlRequest { message, reply })
            .await
            .is_err()
        {
            self.mark_broken();
            return Err(lost());
        }
        match answer.await {
            Ok(Ok(message)) => Ok(message),
            Ok(Err(error)) => {
                self.mark_broken();
                Err(Error::NodeUnreachable {
                    address: self.address,
                    reason: error.to_string(),
                })
            }
            Err(_) => {
                self.mark_broken();
                Err(lost())
            }
        }
    }

    /// The server's counters.
    pub(crate) async fn stats(&self) -> Result<ServerStats> {
        match self.control(ClientMessage::Stats).await? {
            ServerMessage::Stats(stats) => Ok(*stats),
            ServerMessage::Refused { reason } => Err(Error::Refused { reason }),
            other => Err(Error::Refused {
                reason: format!("unexpected reply {other:?}"),
            }),
        }
    }

    /// Says goodbye; the server tears the connection down in order.
    pub(crate) async fn close(&self) {
        let (reply, answer) = oneshot::channel();
        let sent = self
            .control
            .send(ControlRequest {
                message: ClientMessage::Goodbye,
                reply,
            })
            .await;
        if sent.is_ok() {
            // The control task answers once the last counters and the goodbye are written.
            let _ = tokio::time::timeout(CONNECT_TIMEOUT, answer).await;
        }
        self.mark_broken();
    }
}

/// Owns the control stream: forwards requests in order and heartbeats while idle. The node
/// speaks unasked only to end the session (a fence at a view change, a stop notice, or just
/// its close at shutdown or lease expiry): the task then marks the connection `broken` at
/// once, so the next operation takes another lane or a fresh connection instead of posting
/// to a queue pair the node no longer answers (with a lane per worker, each stale lane cost a
/// failed attempt and a view fetch: found when `soft` got lanes).
pub(super) async fn control_task(
    mut stream: TcpStream,
    mut requests: mpsc::Receiver<ControlRequest>,
    heartbeat: Duration,
    counters: Arc<Counters>,
    broken: Arc<AtomicBool>,
    lease_clock: Arc<std::sync::Mutex<rdkv_common::lease::ClockBound>>,
) {
    /// Marks the connection broken however the task ends: a heartbeat has nobody to hear its
    /// failure (a fence read as its answer, a failed write, no reply), and the data path must
    /// stop using the connection then too.
    struct BrokenOnExit(Arc<AtomicBool>);
    impl Drop for BrokenOnExit {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Release);
        }
    }
    let _broken_on_exit = BrokenOnExit(broken);
    let mut ticks = tokio::time::interval(heartbeat);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut probe = [0u8; 1];
    loop {
        let (message, reply) = tokio::select! {
            request = requests.recv() => match request {
                Some(request) => (request.message, Some(request.reply)),
                None => return,
            },
            _ = ticks.tick() => (ClientMessage::Heartbeat { counters: counters.take_report() }, None),
            // Peeking consumes nothing, so losing this branch of the select loses no byte.
            peeked = stream.peek(&mut probe) => {
                if matches!(peeked, Ok(length) if length > 0) {
                    read_unasked_notice(&mut stream, &counters).await;
                }
                return;
            }
        };
        let goodbye = message == ClientMessage::Goodbye;
        if goodbye {
            report_last_counters(&mut stream, &counters).await;
        }
        let asked = std::time::Instant::now();
        let outcome = match write_frame(&mut stream, &message).await {
            Ok(()) if goodbye => {
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(ServerMessage::HeartbeatAck {
                        epoch: 0,
                        node_clock_ms: 0,
                    }));
                }
                return;
            }
            Ok(()) => {
                tokio::time::timeout(CONNECT_TIMEOUT, read_frame::<_, ServerMessage>(&mut stream))
                    .await
                    .unwrap_or(Err(ControlError::Unexpected(
                        "no reply within the timeout".into(),
                    )))
            }
            Err(error) => Err(error),
        };
        let outcome = interpret_reply(outcome, asked, &counters, &lease_clock);
        let failed = outcome.is_err();
        if let Some(reply) = reply {
            let _ = reply.send(outcome);
        }
        if failed {
            return;
        }
    }
}

/// Reads the one frame a node sends unasked (a fence, a stop notice) and records its epoch
/// before the task ends, so an operation that finds the connection broken also finds the newer
/// epoch.
async fn read_unasked_notice(stream: &mut TcpStream, counters: &Counters) {
    let notice =
        tokio::time::timeout(CONNECT_TIMEOUT, read_frame::<_, ServerMessage>(stream)).await;
    if let Ok(Ok(ServerMessage::Fenced { epoch } | ServerMessage::NotServing { epoch, .. })) =
        notice
    {
        counters
            .view_epoch
            .fetch_max(epoch, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Before a goodbye: reports the last counters, and waits (bounded) for the node's answer.
async fn report_last_counters(stream: &mut TcpStream, counters: &Counters) {
    let report = ClientMessage::Heartbeat {
        counters: counters.take_report(),
    };
    if write_frame(stream, &report).await.is_ok() {
        let _ = tokio::time::timeout(CONNECT_TIMEOUT, read_frame::<_, ServerMessage>(stream)).await;
    }
}

/// What a reply means for the request's sender: a heartbeat's answer records the view epoch
/// and calibrates the lease clock (the node read its clock between `asked` and now); a fence or
/// a stop notice is an error that ends the connection.
fn interpret_reply(
    outcome: Result<ServerMessage, ControlError>,
    asked: std::time::Instant,
    counters: &Counters,
    lease_clock: &std::sync::Mutex<rdkv_common::lease::ClockBound>,
) -> Result<ServerMessage, ControlError> {
    match outcome {
        Ok(ServerMessage::HeartbeatAck {
            epoch,
            node_clock_ms,
        }) => {
            counters
                .view_epoch
                .fetch_max(epoch, std::sync::atomic::Ordering::Relaxed);
            // The node read its clock between our write and its answer's arrival.
            let calibration = rdkv_common::lease::ClockBound::new(
                asked,
                std::time::Instant::now(),
                node_clock_ms,
            );
            *rdkv_fabric::lock(lease_clock) = calibration;
            Ok(ServerMessage::HeartbeatAck {
                epoch,
                node_clock_ms,
            })
        }
        Ok(ServerMessage::NotServing { epoch, reason }) => {
            counters
                .view_epoch
                .fetch_max(epoch, std::sync::atomic::Ordering::Relaxed);
            Err(ControlError::Unexpected(format!(
                "the node stopped serving data and fenced this connection: {reason}"
            )))
        }
        Ok(ServerMessage::Fenced { epoch }) => {
            // The view moved keys: this connection is done; the next operation fetches
            // the view and connects again.
            counters
                .view_epoch
                .fetch_max(epoch, std::sync::atomic::Ordering::Relaxed);
            Err(ControlError::Unexpected(format!(
                "the node fenced this connection: the cluster view moved keys (epoch {epoch})"
            )))
        }
        other => other,
    }
}
