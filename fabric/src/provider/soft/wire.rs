//! The soft RNIC's wire format: fixed little-endian layouts, no serde.
//!
//! ```text
//! Hello (dialer → listener, once per connection), 40 bytes
//!   0  [u8; 8]  magic "RDKVSOFT"
//!   8  u16      wire version (3)
//!  10  u16      reserved (0)
//!  12  u32      target queue pair number (the listener's)
//!  16  u32      source queue pair number (the dialer's)
//!  20  u32      reserved (0)
//!  24  u64      source device id
//!  32  u64      target device id
//!
//! Hello acknowledgement (listener → dialer), 8 bytes
//!   0  u32      status: 0 accepted, 1 refused (one answer whatever was wrong)
//!   4  u32      reserved (0)
//!
//! Request frame, 48-byte header + payload (WRITE only)
//!   0  u8       frame kind = 1
//!   1  u8       opcode: 0 READ, 1 WRITE, 2 CAS, 3 FETCH_ADD
//!   2  u16      reserved (0)
//!   4  u32      rkey
//!   8  u64      sequence number (position in the requester's send queue)
//!  16  u64      remote virtual address
//!  24  u32      length (READ/WRITE bytes; 8 for atomics)
//!  28  u32      payload length (WRITE: = length; otherwise 0)
//!  32  u64      compare (CAS)
//!  40  u64      swap (CAS) or addend (FETCH_ADD)
//!  48  ...      payload
//!
//! Response frame, 16-byte header + payload
//!   0  u8       frame kind = 2
//!   1  u8       work completion status (see WorkCompletionStatus)
//!   2  u16      reserved (0)
//!   4  u32      payload length (READ: the data; atomics: 8 bytes, the original value)
//!   8  u64      sequence number of the request answered
//!  16  ...      payload
//!
//! Stop frame (version 3), 16 bytes
//!   0  u8       frame kind = 3
//!   1  [u8; 15] reserved (0)
//! ```
//! A side whose queue pair was moved to ERROR (a server's fence) sends a stop frame after the
//! answers of every request it ran, then closes: the peer completes every request still
//! outstanding NOT_EXECUTED, for certain, where a plain end of stream leaves them unknown.
//!
//! A response also acknowledges every WRITE sent before the request it answers (version 2):
//! the responder answers a successful WRITE only when no later request of the same batch is
//! answered, as an RC responder coalesces its ACKs.
//! A payload longer than the device's maximum message size is a protocol violation: the
//! connection is closed and the requester's outstanding requests complete RETRY_EXC_ERR.

use crate::provider::engine::RemoteRequest;
use crate::types::{Opcode, WorkCompletionStatus};

/// The hello's magic.
pub(crate) const HELLO_MAGIC: [u8; 8] = *b"RDKVSOFT";
/// The wire version.
pub(crate) const WIRE_VERSION: u16 = 3;
/// Hello length.
pub(crate) const HELLO_LENGTH: usize = 40;
/// Hello acknowledgement length.
pub(crate) const HELLO_ACK_LENGTH: usize = 8;
/// Request header length.
pub(crate) const REQUEST_HEADER_LENGTH: usize = 48;
/// Response header length.
pub(crate) const RESPONSE_HEADER_LENGTH: usize = 16;
/// Frame kind of a request.
const KIND_REQUEST: u8 = 1;
/// Frame kind of a response.
const KIND_RESPONSE: u8 = 2;
/// Frame kind of a stop.
const KIND_STOP: u8 = 3;
/// Stop frame length.
pub(crate) const STOP_LENGTH: usize = 16;

/// The hello a dialer sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The listener's queue pair.
    pub(crate) target_qp_number: u32,
    /// The dialer's queue pair.
    pub(crate) source_qp_number: u32,
    /// The dialer's device.
    pub(crate) source_device_id: u64,
    /// The listener's device.
    pub(crate) target_device_id: u64,
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LENGTH] {
        let mut bytes = [0u8; HELLO_LENGTH];
        bytes[0..8].copy_from_slice(&HELLO_MAGIC);
        bytes[8..10].copy_from_slice(&WIRE_VERSION.to_le_bytes());
        bytes[12..16].copy_from_slice(&self.target_qp_number.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.source_qp_number.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.source_device_id.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.target_device_id.to_le_bytes());
        bytes
    }

    pub(crate) fn decode(bytes: &[u8; HELLO_LENGTH]) -> Option<Self> {
        if bytes[0..8] != HELLO_MAGIC || u16_at(bytes, 8) != WIRE_VERSION {
            return None;
        }
        Some(Self {
            target_qp_number: u32_at(bytes, 12),
            source_qp_number: u32_at(bytes, 16),
            source_device_id: u64_at(bytes, 24),
            target_device_id: u64_at(bytes, 32),
        })
    }
}

/// Hello acknowledgement statuses. A refusal says nothing about which field was wrong (device,
/// queue pair, magic or version): a dialer cannot use the answer to guess ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum HelloStatus {
    /// Attached.
    Accepted = 0,
    /// No such device or queue pair here, or a bad hello.
    Refused = 1,
}

impl HelloStatus {
    pub(crate) fn encode(self) -> [u8; HELLO_ACK_LENGTH] {
        let mut bytes = [0u8; HELLO_ACK_LENGTH];
        bytes[0..4].copy_from_slice(&(self as u32).to_le_bytes());
        bytes
    }

    pub(crate) fn decode(bytes: &[u8; HELLO_ACK_LENGTH]) -> Self {
        match u32_at(bytes, 0) {
            0 => Self::Accepted,
            _ => Self::Refused,
        }
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Refused => {
                "the peer refused the hello (no such device or queue pair there, or a bad hello)"
            }
        }
    }
}

/// Appends a request header; the caller appends the WRITE payload right after.
pub(crate) fn encode_request_header(
    buffer: &mut Vec<u8>,
    sequence: u64,
    request: &RemoteRequest,
    payload_length: u32,
) {
    let mut header = [0u8; REQUEST_HEADER_LENGTH];
    header[0] = KIND_REQUEST;
    header[1] = request.opcode as u8;
    header[4..8].copy_from_slice(&request.remote_key.to_le_bytes());
    header[8..16].copy_from_slice(&sequence.to_le_bytes());
    header[16..24].copy_from_slice(&request.remote_address.to_le_bytes());
    header[24..28].copy_from_slice(&request.length.to_le_bytes());
    header[28..32].copy_from_slice(&payload_length.to_le_bytes());
    header[32..40].copy_from_slice(&request.compare.to_le_bytes());
    header[40..48].copy_from_slice(&request.swap_or_add.to_le_bytes());
    buffer.extend_from_slice(&header);
}

/// Reserves a response header at the end of `buffer`; returns its position for
/// [`finish_response_header`].
pub(crate) fn reserve_response_header(buffer: &mut Vec<u8>) -> usize {
    let position = buffer.len();
    buffer.extend_from_slice(&[0u8; RESPONSE_HEADER_LENGTH]);
    position
}

/// Fills a reserved response header once the payload follows it.
pub(crate) fn finish_response_header(
    buffer: &mut [u8],
    position: usize,
    sequence: u64,
    status: WorkCompletionStatus,
) {
    let payload_length = (buffer.len() - position - RESPONSE_HEADER_LENGTH) as u32;
    let header = &mut buffer[position..position + RESPONSE_HEADER_LENGTH];
    header[0] = KIND_RESPONSE;
    header[1] = status as u8;
    header[4..8].copy_from_slice(&payload_length.to_le_bytes());
    header[8..16].copy_from_slice(&sequence.to_le_bytes());
}

/// Appends a stop frame: every request this side ran is answered before it.
pub(crate) fn encode_stop(buffer: &mut Vec<u8>) {
    let mut frame = [0u8; STOP_LENGTH];
    frame[0] = KIND_STOP;
    buffer.extend_from_slice(&frame);
}

/// One decoded frame, borrowing its payload from the read buffer.
#[derive(Debug)]
pub(crate) enum Frame<'a> {
    /// An incoming request.
    Request {
        /// Its sequence.
        sequence: u64,
        /// The request.
        request: RemoteRequest,
        /// The WRITE payload.
        payload: &'a [u8],
    },
    /// A request whose payload is longer than this side accepts: its header only. The engine
    /// answers it REM_INV_REQ_ERR and discards the payload that follows, as rxe NAKs a length
    /// it cannot accept.
    OversizeRequest {
        /// Its sequence.
        sequence: u64,
        /// The payload bytes that follow the header.
        payload_length: u32,
    },
    /// A response to one of our requests.
    Response {
        /// The sequence answered.
        sequence: u64,
        /// The status.
        status: WorkCompletionStatus,
        /// READ data or the original atomic value.
        payload: &'a [u8],
    },
    /// The peer stopped (its queue pair moved to ERROR) after answering every request it ran.
    Stop,
}

/// Why a byte stream is not a valid frame sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Unknown opcode.
    #[error("unknown opcode {0}")]
    UnknownOpcode(u8),
    /// Payload over the maximum message size.
    #[error("payload of {length} bytes exceeds the maximum message size {max}")]
    Oversize {
        /// The announced length.
        length: u32,
        /// The limit.
        max: u32,
    },
}

/// Decodes the first frame of `bytes`: `Ok(None)` when more bytes are needed.
pub(crate) fn decode_frame(
    bytes: &[u8],
    max_payload: u32,
) -> Result<Option<(Frame<'_>, usize)>, WireError> {
    let Some(&kind) = bytes.first() else {
        return Ok(None);
    };
    match kind {
        KIND_REQUEST => {
            if bytes.len() < REQUEST_HEADER_LENGTH {
                return Ok(None);
            }
            let opcode = Opcode::from_wire(bytes[1]).ok_or(WireError::UnknownOpcode(bytes[1]))?;
            let payload_length = u32_at(bytes, 28);
            if payload_length > max_payload {
                return Ok(Some((
                    Frame::OversizeRequest {
                        sequence: u64_at(bytes, 8),
                        payload_length,
                    },
                    REQUEST_HEADER_LENGTH,
                )));
            }
            let total = REQUEST_HEADER_LENGTH + payload_length as usize;
            if bytes.len() < total {
                return Ok(None);
            }
            let request = RemoteRequest {
                opcode,
                remote_key: u32_at(bytes, 4),
                remote_address: u64_at(bytes, 16),
                length: u32_at(bytes, 24),
                compare: u64_at(bytes, 32),
                swap_or_add: u64_at(bytes, 40),
            };
            Ok(Some((
                Frame::Request {
                    sequence: u64_at(bytes, 8),
                    request,
                    payload: &bytes[REQUEST_HEADER_LENGTH..total],
                },
                total,
            )))
        }
        KIND_RESPONSE => {
            if bytes.len() < RESPONSE_HEADER_LENGTH {
                return Ok(None);
            }
            let payload_length = u32_at(bytes, 4);
            if payload_length > max_payload {
                return Err(WireError::Oversize {
                    length: payload_length,
                    max: max_payload,
                });
            }
            let total = RESPONSE_HEADER_LENGTH + payload_length as usize;
            if bytes.len() < total {
                return Ok(None);
            }
            Ok(Some((
                Frame::Response {
                    sequence: u64_at(bytes, 8),
                    status: WorkCompletionStatus::from_wire(bytes[1]),
                    payload: &bytes[RESPONSE_HEADER_LENGTH..total],
                },
                total,
            )))
        }
        KIND_STOP => {
            if bytes.len() < STOP_LENGTH {
                return Ok(None);
            }
            Ok(Some((Frame::Stop, STOP_LENGTH)))
        }
        other => Err(WireError::UnknownKind(other)),
    }
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_request() -> RemoteRequest {
        RemoteRequest {
            opcode: Opcode::CompareAndSwap,
            remote_key: 0xABCD,
            remote_address: 0x7F00_0000_1000,
            length: 8,
            compare: 1,
            swap_or_add: 2,
        }
    }

    #[test]
    fn request_round_trips_with_byte_offsets() {
        let mut buffer = Vec::new();
        encode_request_header(&mut buffer, 42, &sample_request(), 0);
        assert_eq!(buffer.len(), REQUEST_HEADER_LENGTH);
        assert_eq!(buffer[0], 1);
        assert_eq!(buffer[1], 2);
        assert_eq!(&buffer[4..8], &0xABCDu32.to_le_bytes());
        let (frame, used) = decode_frame(&buffer, 1024)
            .expect("valid")
            .expect("complete");
        assert_eq!(used, REQUEST_HEADER_LENGTH);
        match frame {
            Frame::Request {
                sequence,
                request,
                payload,
            } => {
                assert_eq!(sequence, 42);
                assert_eq!(request.remote_address, 0x7F00_0000_1000);
                assert_eq!((request.compare, request.swap_or_add), (1, 2));
                assert!(payload.is_empty());
            }
            other => panic!("decoded {other:?}"),
        }
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        let mut buffer = Vec::new();
        let mut write = sample_request();
        write.opcode = Opcode::Write;
        write.length = 5;
        encode_request_header(&mut buffer, 1, &write, 5);
        buffer.extend_from_slice(b"hello");
        for cut in 0..buffer.len() {
            assert!(decode_frame(&buffer[..cut], 1024)
                .expect("valid prefix")
                .is_none());
        }
        assert!(decode_frame(&buffer, 1024).expect("valid").is_some());
    }

    #[test]
    fn response_round_trips() {
        let mut buffer = Vec::new();
        let position = reserve_response_header(&mut buffer);
        buffer.extend_from_slice(&7u64.to_le_bytes());
        finish_response_header(
            &mut buffer,
            position,
            9,
            WorkCompletionStatus::RemoteAccessError,
        );
        let (frame, used) = decode_frame(&buffer, 1024)
            .expect("valid")
            .expect("complete");
        assert_eq!(used, 24);
        assert!(matches!(
            frame,
            Frame::Response { sequence: 9, status: WorkCompletionStatus::RemoteAccessError, payload } if payload == 7u64.to_le_bytes()
        ));
    }

    #[test]
    fn a_stop_frame_round_trips_and_waits_for_its_bytes() {
        let mut buffer = Vec::new();
        encode_stop(&mut buffer);
        assert_eq!(buffer.len(), STOP_LENGTH);
        assert!(matches!(decode_frame(&buffer[..8], 64), Ok(None)));
        assert!(matches!(
            decode_frame(&buffer, 64),
            Ok(Some((Frame::Stop, STOP_LENGTH)))
        ));
    }

    #[test]
    fn bad_frames_are_rejected() {
        assert_eq!(
            decode_frame(&[9u8; 64], 1024).unwrap_err(),
            WireError::UnknownKind(9)
        );
        let mut buffer = Vec::new();
        encode_request_header(&mut buffer, 1, &sample_request(), 4096);
        // An oversize request is answered, not a violation: its header alone is taken.
        assert!(matches!(
            decode_frame(&buffer, 1024),
            Ok(Some((
                Frame::OversizeRequest {
                    sequence: 1,
                    payload_length: 4096
                },
                REQUEST_HEADER_LENGTH
            )))
        ));
        let mut response = Vec::new();
        let position = reserve_response_header(&mut response);
        response.resize(position + RESPONSE_HEADER_LENGTH + 4096, 0);
        finish_response_header(&mut response, position, 2, WorkCompletionStatus::Success);
        assert!(matches!(
            decode_frame(&response, 1024),
            Err(WireError::Oversize {
                length: 4096,
                max: 1024
            })
        ));
        buffer[1] = 77;
        assert_eq!(
            decode_frame(&buffer, 1 << 20).unwrap_err(),
            WireError::UnknownOpcode(77)
        );
    }

    #[test]
    fn hello_round_trips_and_rejects_bad_magic() {
        let hello = Hello {
            target_qp_number: 3,
            source_qp_number: 4,
            source_device_id: 5,
            target_device_id: 6,
        };
        let mut bytes = hello.encode();
        assert_eq!(Hello::decode(&bytes), Some(hello));
        bytes[0] = b'X';
        assert_eq!(Hello::decode(&bytes), None);
        assert_eq!(
            HelloStatus::decode(&HelloStatus::Refused.encode()),
            HelloStatus::Refused
        );
    }
}
