//! The `shm` attach protocol on a listening device's Unix-domain socket: one hello, one answer
//! that carries the memory files (`SCM_RIGHTS`), then the connection closes.
//!
//! ```text
//! Hello (requester → device), 32 bytes
//!   0  [u8; 8]  magic "RDKVSHMH"
//!   8  u16      version (1)
//!  10  u16      kind: 1 attach a queue pair, 2 refresh the memory files only
//!  12  u32      target queue pair number (the device's)
//!  16  u32      source queue pair number (the requester's)
//!  20  u32      reserved (0)
//!  24  u64      target device id
//!
//! Answer (device → requester), 32 bytes + 16 per memory file, with the descriptors
//!   0  u32      status: 0 accepted, 1 refused (one answer whatever was wrong),
//!               2 not ready (the queue pair is not connected yet: try again)
//!   4  u32      epoch slot of the attached queue pair
//!   8  u32      memory files that follow (n)
//!  12  u32      reserved (0)
//!  16  u64      key state length
//!  24  u64      epochs length
//!  32  n × (u64 memory id, u64 length)
//!  descriptors: key state (read-only), epochs, then the n memory files in order
//! ```

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// The hello's magic.
const HELLO_MAGIC: [u8; 8] = *b"RDKVSHMH";
/// The protocol version.
const VERSION: u16 = 1;
/// Hello length.
pub(crate) const HELLO_LENGTH: usize = 32;
/// Answer header length.
const ANSWER_HEADER: usize = 32;
/// The most memory files one answer carries (the kernel passes at most 253 descriptors).
pub(crate) const MAX_MEMORY_FILES: usize = 240;

/// What a hello asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HelloKind {
    /// Attach a requester queue pair to a device queue pair.
    Attach = 1,
    /// Only the current memory files (a key named a block registered after the attach).
    Refresh = 2,
}

/// A requester's hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) kind: HelloKind,
    pub(crate) target_qp: u32,
    pub(crate) source_qp: u32,
    pub(crate) target_device: u64,
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LENGTH] {
        let mut bytes = [0u8; HELLO_LENGTH];
        bytes[0..8].copy_from_slice(&HELLO_MAGIC);
        bytes[8..10].copy_from_slice(&VERSION.to_le_bytes());
        bytes[10..12].copy_from_slice(&(self.kind as u16).to_le_bytes());
        bytes[12..16].copy_from_slice(&self.target_qp.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.source_qp.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.target_device.to_le_bytes());
        bytes
    }

    /// `None` for anything that is not a version-1 hello.
    pub(crate) fn decode(bytes: &[u8; HELLO_LENGTH]) -> Option<Self> {
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        if bytes[0..8] != HELLO_MAGIC || u16_at(8) != VERSION {
            return None;
        }
        let kind = match u16_at(10) {
            1 => HelloKind::Attach,
            2 => HelloKind::Refresh,
            _ => return None,
        };
        let mut device = [0u8; 8];
        device.copy_from_slice(&bytes[24..32]);
        Some(Self {
            kind,
            target_qp: u32_at(12),
            source_qp: u32_at(16),
            target_device: u64::from_le_bytes(device),
        })
    }
}

/// An answer's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AnswerStatus {
    Accepted = 0,
    Refused = 1,
    NotReady = 2,
}

/// A device's answer, without its descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: AnswerStatus,
    pub(crate) epoch_slot: u32,
    pub(crate) keys_length: u64,
    pub(crate) epochs_length: u64,
    /// (memory id, length) of each memory file, in descriptor order.
    pub(crate) memories: Vec<(u64, u64)>,
}

impl Answer {
    /// An answer that carries nothing.
    pub(crate) fn bare(status: AnswerStatus) -> Self {
        Self {
            status,
            epoch_slot: u32::MAX,
            keys_length: 0,
            epochs_length: 0,
            memories: Vec::new(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(ANSWER_HEADER + 16 * self.memories.len());
        bytes.extend_from_slice(&(self.status as u32).to_le_bytes());
        bytes.extend_from_slice(&self.epoch_slot.to_le_bytes());
        bytes.extend_from_slice(&(self.memories.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&self.keys_length.to_le_bytes());
        bytes.extend_from_slice(&self.epochs_length.to_le_bytes());
        for (id, length) in &self.memories {
            bytes.extend_from_slice(&id.to_le_bytes());
            bytes.extend_from_slice(&length.to_le_bytes());
        }
        bytes
    }

    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let word = |at: usize| {
            bytes
                .get(at..at + 8)
                .map(|slice| {
                    let mut word = [0u8; 8];
                    word.copy_from_slice(slice);
                    u64::from_le_bytes(word)
                })
                .ok_or_else(|| "the answer is shorter than it says".to_string())
        };
        let first = word(0)?;
        let second = word(8)?;
        let status = match first as u32 {
            0 => AnswerStatus::Accepted,
            1 => AnswerStatus::Refused,
            2 => AnswerStatus::NotReady,
            other => return Err(format!("unknown answer status {other}")),
        };
        let count = second as u32 as usize;
        if count > MAX_MEMORY_FILES {
            return Err(format!(
                "{count} memory files is more than {MAX_MEMORY_FILES}"
            ));
        }
        let mut memories = Vec::with_capacity(count);
        for index in 0..count {
            let at = ANSWER_HEADER + 16 * index;
            memories.push((word(at)?, word(at + 8)?));
        }
        Ok(Self {
            status,
            epoch_slot: (first >> 32) as u32,
            keys_length: word(16)?,
            epochs_length: word(24)?,
            memories,
        })
    }
}

/// Sends `answer` with `descriptors` (none for a bare answer).
pub(crate) fn send_answer(
    stream: &UnixStream,
    answer: &Answer,
    descriptors: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let bytes = answer.encode();
    if descriptors.is_empty() {
        return (&*stream).write_all(&bytes);
    }
    let raw: Vec<RawFd> = descriptors.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let sent = sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&bytes)],
        &rights,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)?;
    // The descriptors travel with the first byte; the rest, if the socket took less, follows.
    (&*stream).write_all(&bytes[sent..])
}

/// Receives an answer and its descriptors (closed on an error).
pub(crate) fn receive_answer(stream: &UnixStream) -> Result<(Answer, Vec<OwnedFd>), String> {
    let mut bytes = vec![0u8; ANSWER_HEADER + 16 * MAX_MEMORY_FILES];
    let mut control = nix::cmsg_space!([RawFd; MAX_MEMORY_FILES + 2]);
    let (received, descriptors, truncated) = {
        let mut slices = [IoSliceMut::new(&mut bytes)];
        let message = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut slices,
            Some(&mut control),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|error| format!("receive the answer: {error}"))?;
        let mut descriptors = Vec::new();
        if let Ok(messages) = message.cmsgs() {
            for control_message in messages {
                if let ControlMessageOwned::ScmRights(raw) = control_message {
                    for fd in raw {
                        // SAFETY: the kernel just installed this descriptor in our table for
                        // this message (SCM_RIGHTS); nothing else owns it.
                        descriptors.push(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
        }
        (
            message.bytes,
            descriptors,
            message.flags.contains(MsgFlags::MSG_CTRUNC),
        )
    };
    if truncated {
        return Err("the answer's descriptors did not fit".into());
    }
    // The descriptors came with the first bytes; the rest of the answer may follow.
    let read_more = |bytes: &mut [u8]| {
        (&*stream)
            .read_exact(bytes)
            .map_err(|error| format!("receive the answer: {error}"))
    };
    let mut have = received;
    if have < ANSWER_HEADER {
        read_more(&mut bytes[have..ANSWER_HEADER])?;
        have = ANSWER_HEADER;
    }
    let count = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if count > MAX_MEMORY_FILES {
        return Err(format!(
            "{count} memory files is more than {MAX_MEMORY_FILES}"
        ));
    }
    let needed = ANSWER_HEADER + 16 * count;
    if have < needed {
        read_more(&mut bytes[have..needed])?;
    }
    let answer = Answer::decode(&bytes[..needed])?;
    Ok((answer, descriptors))
}
