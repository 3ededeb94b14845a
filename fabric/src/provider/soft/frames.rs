//! The frame processing of one soft connection ([`Engine`]), shared by the engine pool of a
//! listening NIC (see `pool.rs`) and the engine task of a dialing-only NIC
//! ([`run_engine_task`]).
//!
//! Requests run through the responder engine (server application code never sees them) and
//! their responses are queued and written once the read buffer is empty; responses complete
//! our own requests in order. End of stream, a read error, a protocol violation, or an
//! outstanding request older than the retry timeout ends the connection: the oldest request
//! completes RETRY_EXC_ERR and the rest flush.

use std::io::ErrorKind;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::provider::engine;
use crate::queue_pair::QueuePairShared;
use crate::types::{Opcode, WorkCompletionStatus};

use super::connection::{FlushMode, SoftConnection};
use super::wire::{self, Frame};

/// How often an idle engine checks the retry timeout and a local close.
pub(crate) const ENGINE_TICK: Duration = Duration::from_millis(50);
/// The read buffer a connection starts with; it grows (up to two largest frames) only when a
/// frame needs it, so an idle connection costs little memory.
const INITIAL_READ_BUFFER: usize = 16 * 1024;
/// The most a connection keeps of a read or response buffer that a burst grew, once idle:
/// what a busy connection reads in one go.
pub(crate) const KEPT_READ_BUFFER: usize = 256 * 1024;

/// Responses encoded and not yet queued for sending.
///
/// A successful WRITE is acknowledged implicitly, as an RC responder coalesces ACKs: the
/// answer of any later request of the same batch acknowledges it (the requester retires every
/// WRITE before the sequence number it is answered, `QueuePairShared::on_response`). Only a
/// WRITE that is the last request answered in a batch gets a response of its own.
#[derive(Default)]
struct Answers {
    /// The encoded responses.
    bytes: Vec<u8>,
    /// How many responses `bytes` holds.
    count: usize,
    /// The responder refused a request: it serves nothing more on this connection.
    refused: bool,
    /// A successful WRITE not answered yet: the next answer acknowledges it, or
    /// [`Answers::acknowledge_deferred`] does.
    deferred: Option<u64>,
}

impl Answers {
    /// Answers request `sequence` with what `serve` appends and the status it returns (`None`:
    /// no answer, as a responder that cannot receive drops a request). Nothing is served once
    /// a request was refused; a refusal stops serving. A success of a request that carries no
    /// data back (`implicit`: a WRITE) is deferred, to be acknowledged by the next answer.
    fn answer(
        &mut self,
        sequence: u64,
        implicit: bool,
        serve: impl FnOnce(&mut Vec<u8>) -> Option<WorkCompletionStatus>,
    ) {
        if self.refused {
            return;
        }
        let position = wire::reserve_response_header(&mut self.bytes);
        match serve(&mut self.bytes) {
            Some(WorkCompletionStatus::Success)
                if implicit && self.bytes.len() == position + wire::RESPONSE_HEADER_LENGTH =>
            {
                self.bytes.truncate(position);
                self.deferred = Some(sequence);
            }
            Some(status) => {
                wire::finish_response_header(&mut self.bytes, position, sequence, status);
                self.count += 1;
                self.deferred = None;
                self.refused = status != WorkCompletionStatus::Success;
            }
            None => self.bytes.truncate(position),
        }
    }

    /// Answers the deferred WRITE, if any, with a response of its own: no later answer of the
    /// batch acknowledged it.
    fn acknowledge_deferred(&mut self) {
        if let Some(sequence) = self.deferred.take() {
            let position = wire::reserve_response_header(&mut self.bytes);
            wire::finish_response_header(
                &mut self.bytes,
                position,
                sequence,
                WorkCompletionStatus::Success,
            );
            self.count += 1;
        }
    }
}

/// The frame processing of one connection.
pub(crate) struct Engine {
    /// The local queue pair.
    pub(crate) queue_pair: Arc<QueuePairShared>,
    /// The connection's outgoing side.
    pub(crate) connection: Arc<SoftConnection>,
    /// Received bytes; frames are parsed from `start..end`.
    buffer: Vec<u8>,
    /// First unparsed byte.
    start: usize,
    /// End of received bytes.
    pub(crate) end: usize,
    /// The responses not yet queued for sending.
    answers: Answers,
    /// Payload bytes of an oversize request still to be read and dropped: the connection
    /// closes only after them, so the error response is not lost to a reset.
    discarding: u64,
    /// The largest payload accepted.
    max_payload: u32,
    /// The most response bytes held before they are written out, and the most left queued
    /// unsent before a pooled connection stops being read (`DeviceConfig::response_buffer`).
    response_bound: usize,
    /// Frames handled by the last call of `process`: a measure of load for adaptive spinning.
    pub(crate) last_batch_frames: usize,
}

impl Engine {
    pub(crate) fn new(queue_pair: Arc<QueuePairShared>, connection: Arc<SoftConnection>) -> Self {
        let max_payload = queue_pair.max_message_size();
        let response_bound = queue_pair.device().config.response_buffer.max(1);
        connection
            .device
            .gauges
            .soft_connections
            .fetch_add(1, Ordering::Relaxed);
        Self {
            queue_pair,
            connection,
            buffer: vec![0u8; INITIAL_READ_BUFFER],
            start: 0,
            end: 0,
            answers: Answers::default(),
            discarding: 0,
            max_payload,
            response_bound,
            last_batch_frames: 0,
        }
    }

    /// Whether the peer has not taken enough of our output for us to serve more: a pooled
    /// connection stops reading until its socket drains below the bound.
    pub(crate) fn output_blocked(&self) -> bool {
        self.connection.mode() == FlushMode::Pooled
            && self.connection.backlog() >= self.response_bound
    }

    /// Handles every complete frame received so far (on a pooled connection, until the output
    /// backlog reaches its bound) and sends the responses; `Err` ends the connection with its
    /// reason.
    pub(crate) fn process(&mut self) -> std::result::Result<(), String> {
        self.last_batch_frames = 0;
        // The output bound is checked when this call starts and after each intermediate send
        // (responses grow only by what this call serves, at most the bound in between), not
        // per frame: it takes the outgoing lock.
        let mut blocked = self.output_blocked();
        loop {
            if blocked {
                break;
            }
            if self.discarding > 0 {
                let dropped = self.discarding.min((self.end - self.start) as u64);
                self.start += dropped as usize;
                self.discarding -= dropped;
                if self.discarding > 0 {
                    break;
                }
            }
            match wire::decode_frame(&self.buffer[self.start..self.end], self.max_payload) {
                Ok(Some((frame, used))) => {
                    match frame {
                        Frame::Request {
                            sequence,
                            request,
                            payload,
                        } => self.answers.answer(
                            sequence,
                            request.opcode == Opcode::Write,
                            |responses| {
                                engine::serve(&self.queue_pair, &request, payload, responses)
                            },
                        ),
                        Frame::OversizeRequest {
                            sequence,
                            payload_length,
                        } => {
                            self.answers.answer(sequence, false, |_| {
                                Some(WorkCompletionStatus::RemoteInvalidRequestError)
                            });
                            self.discarding = u64::from(payload_length);
                        }
                        Frame::Response {
                            sequence,
                            status,
                            payload,
                        } => self.queue_pair.on_response(sequence, status, payload),
                        // Every request the peer ran is answered above: the rest did not run.
                        Frame::Stop => self.queue_pair.responder_stopped(),
                    }
                    self.start += used;
                    self.last_batch_frames += 1;
                    // A batch of small requests for large READs must not pile up its answers:
                    // past the bound, send them before serving more.
                    if self.answers.bytes.len() >= self.response_bound {
                        self.send_responses();
                        blocked = self.output_blocked();
                    }
                }
                Ok(None) => break,
                Err(error) => return Err(format!("protocol violation: {error}")),
            }
        }
        self.send_responses();
        if self.answers.refused && self.discarding == 0 {
            // As on rxe, a responder that NAKs a request moves its queue pair to ERROR, after
            // the error response is on its way.
            self.connection
                .device
                .gauges
                .responder_errors
                .fetch_add(1, Ordering::Relaxed);
            self.queue_pair.enter_error();
            return Err("responder error".into());
        }
        Ok(())
    }

    /// Queues the responses served so far and writes them out.
    fn send_responses(&mut self) {
        self.answers.acknowledge_deferred();
        if self.answers.bytes.is_empty() {
            return;
        }
        let count = self.answers.count;
        let responses = &self.answers.bytes;
        self.connection.append(|outgoing| {
            outgoing.extend_from_slice(responses);
            count
        });
        self.answers.bytes.clear();
        if self.answers.bytes.capacity() > KEPT_READ_BUFFER {
            // One burst of large READs must not keep megabytes per idle connection.
            self.answers.bytes.shrink_to(INITIAL_READ_BUFFER);
        }
        self.answers.count = 0;
        self.connection.flush();
    }

    /// Free space to read into, after compacting parsed bytes away, growing the buffer when
    /// one unfinished frame fills it. Never empty.
    pub(crate) fn space(&mut self) -> &mut [u8] {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buffer.len() > KEPT_READ_BUFFER {
                // A large WRITE grew it; an idle connection does not keep that.
                self.buffer.truncate(KEPT_READ_BUFFER);
                self.buffer.shrink_to_fit();
            }
        } else if self.end == self.buffer.len() {
            if self.start > 0 {
                self.buffer.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            } else {
                // One frame, unfinished, fills the buffer: a frame is at most a header and
                // `max_payload`, so doubling up to two of them always makes room.
                let largest = self.max_payload as usize * 2 + 4096;
                let grown = (self.buffer.len() * 2).min(largest.max(self.buffer.len() + 4096));
                self.buffer.resize(grown, 0);
            }
        }
        &mut self.buffer[self.end..]
    }

    /// Grows the read buffer towards `limit` after a read filled it: a busy connection then
    /// takes more per read.
    pub(crate) fn grow_read_buffer(&mut self, limit: usize) {
        if self.buffer.len() < limit {
            let grown = (self.buffer.len() * 2).min(limit);
            self.buffer.resize(grown, 0);
        }
    }

    /// Whether to give up while idle: the connection was closed locally, or the oldest
    /// outstanding request waited past the retry timeout.
    pub(crate) fn idle_check(&self) -> std::result::Result<(), String> {
        if self.connection.is_closed() {
            return Err("closed locally".into());
        }
        if self.connection.is_stopping() {
            return Err("the queue pair moved to ERROR".into());
        }
        let retry_timeout = self.queue_pair.retry_timeout();
        if self
            .queue_pair
            .oldest_outstanding_age()
            .is_some_and(|age| age > retry_timeout)
        {
            return Err(format!(
                "no response within the retry timeout {retry_timeout:?}"
            ));
        }
        Ok(())
    }

    /// Ends the connection: outstanding requests complete RETRY_EXC_ERR, then flush. A
    /// connection whose queue pair moved to ERROR first sends the stop frame, after the answers
    /// of every request it ran (best effort: what the socket does not take now is dropped, and
    /// the peer then sees a plain end of stream).
    pub(crate) fn finish(self, reason: &str) {
        tracing::debug!(qp_number = self.queue_pair.qp_number, %reason, "soft connection ended");
        if self.connection.is_stopping() && !self.connection.is_closed() {
            self.connection.send_stop();
        }
        self.connection.close();
        self.queue_pair.fail_unanswered();
        self.connection
            .device
            .gauges
            .soft_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// The engine task of one connection on a dialing-only NIC: it runs on the caller's tokio
/// runtime, so a response wakes the awaiting task without a hop through another thread.
///
/// Per wait it costs no timer and no extra system call: one tick, registered once, checks the
/// retry timeout every [`ENGINE_TICK`]; and a read that did not fill the buffer drained the
/// socket, so it clears the readiness itself instead of reading again to see `EAGAIN`.
pub(crate) async fn run_engine_task(mut engine: Engine, stream: tokio::net::TcpStream) {
    let tick = tokio::time::sleep(ENGINE_TICK);
    tokio::pin!(tick);
    let reason = loop {
        if let Err(reason) = engine.process() {
            break reason;
        }
        let mut read = 0;
        let space = engine.space();
        let room = space.len();
        let outcome = stream.try_io(tokio::io::Interest::READABLE, || {
            read = stream.try_read(space)?;
            if read > 0 && read < room {
                // Drained: the readiness is cleared, and the next edge sets it again.
                return Err(ErrorKind::WouldBlock.into());
            }
            Ok(())
        });
        match outcome {
            _ if read > 0 => {
                engine.end += read;
                continue;
            }
            Ok(()) => break "end of stream".to_string(),
            Err(error) if error.kind() == ErrorKind::WouldBlock => {}
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) => break format!("read: {error}"),
        }
        tokio::select! {
            biased;
            ready = stream.readable() => {
                if let Err(error) = ready {
                    break format!("wait for readability: {error}");
                }
            }
            () = &mut tick => {
                tick.as_mut().reset(tokio::time::Instant::now() + ENGINE_TICK);
                if let Err(reason) = engine.idle_check() {
                    break reason;
                }
            }
        }
    };
    engine.finish(&reason);
}
