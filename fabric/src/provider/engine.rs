//! The responder engine: what a NIC does with one incoming one-sided request.
//!
//! Both backends call [`execute`]: the soft backend from its engine threads, the loopback
//! backend inline. It checks the request against the protection table (see
//! [`ProtectionTable::check_remote`]) and carries it out with atomic accesses only. Server
//! application code is never called.

use crate::protection::ProtectionTable;
use crate::types::{Opcode, WorkCompletionStatus};

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
    let length = if request.opcode.is_atomic() {
        8
    } else {
        u64::from(request.length)
    };
    // A zero-length READ or WRITE names no memory; like rxe, it needs no valid rkey.
    if length == 0 {
        return WorkCompletionStatus::Success;
    }
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
    let memory = &entry.memory;
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
        // The checks above make this unreachable; report it as a responder failure, not a panic.
        Err(_) => WorkCompletionStatus::RemoteOperationError,
    }
}
