//! The responder engine: what a NIC does with one incoming one-sided request.
//!
//! Both emulated providers call [`serve`]: the soft provider from its engine threads, the
//! loopback provider inline. The `shm` requester runs the same length gate and
//! [`perform`] on the responder's shared memory, after the same checks on its shared keys. It checks the request against the protection table (see
//! [`ProtectionTable::check_remote`]) and carries it out with atomic accesses only. Server
//! application code is never called.

use crate::memory::PinnedMemory;
use crate::protection::{LocalTarget, ProtectionTable};
use crate::queue_pair::QueuePairShared;
use crate::types::{Opcode, WorkCompletionStatus, WorkRequest};

/// One incoming request, as decoded from the wire or taken from a loopback post.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteRequest {
    /// The operation.
    pub(crate) opcode: Opcode,
    /// The rkey.
    pub(crate) remote_key: u32,
    /// Remote virtual address.
    pub(crate) remote_address: u64,
    /// READ/WRITE length (8 for atomics).
    pub(crate) length: u32,
    /// CAS expected value.
    pub(crate) compare: u64,
    /// CAS new value or FETCH_ADD addend.
    pub(crate) swap_or_add: u64,
}

/// The responder side of one queue pair, as the engine needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ResponderContext {
    /// The responder queue pair's protection domain.
    pub(crate) protection_domain: u32,
    /// The responder queue pair's number.
    pub(crate) qp_number: u32,
    /// The largest READ or WRITE the responder accepts (its device's `max_message_size`).
    pub(crate) max_message_size: u32,
}

/// Executes one incoming request for `queue_pair` (the responder) under its responder gate.
/// `None` means the request is not answered (the queue pair cannot receive), as a real
/// responder drops it.
pub(crate) fn serve(
    queue_pair: &QueuePairShared,
    request: &RemoteRequest,
    write_payload: &[u8],
    response: &mut Vec<u8>,
) -> Option<WorkCompletionStatus> {
    let max_message_size = queue_pair.max_message_size();
    queue_pair.respond(|table, protection_domain, qp_number| {
        let context = ResponderContext {
            protection_domain,
            qp_number,
            max_message_size,
        };
        execute(table, context, request, write_payload, response)
    })
}

/// The wire/engine form of a work request.
pub(crate) fn remote_request(request: &WorkRequest) -> RemoteRequest {
    RemoteRequest {
        opcode: request.opcode,
        remote_key: request.remote.remote_key,
        remote_address: request.remote.address,
        length: request.local.length,
        compare: request.compare,
        swap_or_add: request.swap_or_add,
    }
}

/// Appends the WRITE payload of an in-flight entry's local buffer to `buffer` (nothing when
/// the buffer is unresolved or cannot be read).
pub(crate) fn append_write_payload(
    buffer: &mut Vec<u8>,
    local: &std::result::Result<Option<LocalTarget>, WorkCompletionStatus>,
) {
    if let Ok(Some(target)) = local {
        let start = buffer.len();
        buffer.resize(start + target.length as usize, 0);
        if target
            .entry
            .memory
            .read_into(target.memory_offset, &mut buffer[start..])
            .is_err()
        {
            buffer.truncate(start);
        }
    }
}

/// The bytes `request` touches, after the responder's length gate: `Ok(0)` for a zero-length
/// READ or WRITE, which names no memory (like rxe, it needs no valid rkey) and succeeds;
/// REM_INV_REQ_ERR for one longer than a message may be, refused before any memory is touched
/// or any response buffer grows (a window-sized READ from a peer that ignores its own limit
/// would otherwise make the responder hold the whole window in its response; rxe answers a
/// length it cannot accept with a NAK-invalid-request).
pub(crate) fn request_length(
    request: &RemoteRequest,
    max_message_size: u32,
) -> std::result::Result<u64, WorkCompletionStatus> {
    let length = if request.opcode.is_atomic() {
        // An atomic is 8 bytes; a peer that says otherwise is not a conforming requester
        // (ours checks the local segment: `ProtectionTable`).
        if request.length != 8 {
            return Err(WorkCompletionStatus::RemoteInvalidRequestError);
        }
        8
    } else {
        u64::from(request.length)
    };
    if length > u64::from(max_message_size) {
        return Err(WorkCompletionStatus::RemoteInvalidRequestError);
    }
    Ok(length)
}

/// Checks and executes `request`. READ data or the original atomic value is appended to
/// `response`; on an error nothing is appended.
pub(crate) fn execute(
    table: &ProtectionTable,
    context: ResponderContext,
    request: &RemoteRequest,
    write_payload: &[u8],
    response: &mut Vec<u8>,
) -> WorkCompletionStatus {
    let malformed = if request.opcode == Opcode::Write {
        // A WRITE carries exactly its length.
        write_payload.len() as u64 != u64::from(request.length)
    } else {
        // Only a WRITE carries data to the responder.
        !write_payload.is_empty()
    };
    if malformed {
        // Before the key's checks: a malformed request is refused as such, whatever it names.
        return WorkCompletionStatus::RemoteInvalidRequestError;
    }
    let length = match request_length(request, context.max_message_size) {
        Ok(0) => return WorkCompletionStatus::Success,
        Ok(length) => length,
        Err(status) => return status,
    };
    let (entry, offset) = match table.check_remote(
        context.protection_domain,
        context.qp_number,
        request.remote_key,
        request.remote_address,
        length,
        request.opcode,
    ) {
        Ok(found) => found,
        Err(status) => return status,
    };
    perform(
        &entry.memory,
        offset,
        request,
        length,
        write_payload,
        response,
    )
}

/// Carries out a checked request on `memory` at `offset` with atomic accesses only.
pub(crate) fn perform(
    memory: &PinnedMemory,
    offset: u64,
    request: &RemoteRequest,
    length: u64,
    write_payload: &[u8],
    response: &mut Vec<u8>,
) -> WorkCompletionStatus {
    let outcome = match request.opcode {
        Opcode::Read => {
            let start = response.len();
            response.resize(start + length as usize, 0);
            memory.read_into(offset, &mut response[start..])
        }
        Opcode::Write => {
            if write_payload.len() as u64 != length {
                return WorkCompletionStatus::RemoteInvalidRequestError;
            }
            memory.write_from(offset, write_payload)
        }
        Opcode::CompareAndSwap => memory
            .compare_exchange_u64(offset, request.compare, request.swap_or_add)
            .map(|original| response.extend_from_slice(&original.to_le_bytes())),
        Opcode::FetchAndAdd => memory
            .fetch_add_u64(offset, request.swap_or_add)
            .map(|original| response.extend_from_slice(&original.to_le_bytes())),
    };
    match outcome {
        Ok(()) => WorkCompletionStatus::Success,
        // The checks make this unreachable; report it as a responder failure, not a panic.
        Err(_) => WorkCompletionStatus::RemoteOperationError,
    }
}
