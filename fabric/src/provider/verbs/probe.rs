//! The atomics byte-order probe, run once when a device opens.
//!
//! rdkv's table words (slots, counters) are little-endian host words that the server's CPU also
//! updates with host atomics. rxe performs RDMA atomics on the word in host order; some NICs
//! (ConnectX documents big-endian atomic targets) do not. On such a NIC a client's CAS would
//! compare against the byte-swapped word and corrupt the table, so rdkv checks before it serves:
//! two queue pairs of the device, connected to each other, FETCH_ADD 1 onto a zeroed word, and
//! the CPU reads it back. Anything but a host-order 1 refuses the device with a clear error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use crate::provider::verbs::completion::poll_completions;
use crate::provider::verbs::context::VerbsContext;
use crate::provider::verbs::memory::VerbsRegion;
use crate::provider::verbs::queue_pair::VerbsQueuePair;
use crate::provider::verbs::status::status_from_raw;
use crate::types::{AccessFlags, LocalSegment, RemoteSegment, WorkRequest};
use crate::WorkCompletionStatus;

/// How long the probe's one FETCH_ADD may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn probe_failed(context: &VerbsContext, what: String) -> Error {
    Error::VerbsDevice {
        reason: format!(
            "the RDMA atomics self-test on {} failed: {what}",
            context.name
        ),
    }
}

/// Checks that the device's RDMA atomics operate on host-order words.
///
/// # Errors
/// [`Error::VerbsDevice`] when the device's atomics use another byte order, or the self-test
/// cannot run (its error says which step failed).
pub(crate) fn check_atomic_byte_order(context: &Arc<VerbsContext>) -> Result<()> {
    let memory = Arc::new(PinnedMemory::allocate(
        4096,
        HugepagePolicy::Off,
        PinLimits::default(),
    )?);
    let region = VerbsRegion::register(
        &context.protection_domain,
        &memory,
        0,
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
    )?;
    let queue = context
        .context
        .create_cq_builder()
        .setup_cqe(16)
        .build()
        .map_err(|error| probe_failed(context, format!("ibv_create_cq: {error}")))?;
    let first = VerbsQueuePair::create(context, queue.clone(), 4, 0x1234)?;
    let second = VerbsQueuePair::create(context, queue.clone(), 4, 0x5678)?;
    first.modify_to_init()?;
    second.modify_to_init()?;
    first.connect(second.qp_number, &second.address(), PROBE_TIMEOUT)?;
    second.connect(first.qp_number, &first.address(), PROBE_TIMEOUT)?;

    let base = memory.base_address();
    let request = WorkRequest::fetch_and_add(
        1,
        LocalSegment {
            address: base + 64,
            length: 8,
            local_key: region.local_key(),
        },
        RemoteSegment {
            address: base,
            remote_key: region.remote_key(),
        },
        1,
    );
    first.post(std::iter::once((1, &request)))?;
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let mut status = None;
    while status.is_none() && Instant::now() < deadline {
        if poll_completions(&queue, |completion| {
            status = Some(status_from_raw(completion.status));
        }) == 0
        {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    first.modify_to_error();
    second.modify_to_error();
    // Drain the flushes (there are none outstanding, but the CQ must be empty before it goes).
    poll_completions(&queue, |_| {});
    match status {
        Some(WorkCompletionStatus::Success) => {}
        Some(status) => {
            return Err(probe_failed(
                context,
                format!("a FETCH_ADD between two of its queue pairs completed {status}"),
            ))
        }
        None => {
            return Err(probe_failed(
                context,
                format!("a FETCH_ADD between two of its queue pairs did not complete within {PROBE_TIMEOUT:?}"),
            ))
        }
    }
    let word = memory.load_u64(0)?;
    if word == 1 {
        return Ok(());
    }
    let reason = if word == 1u64.swap_bytes() {
        "it performs RDMA atomics on big-endian words, while rdkv's table words are host-order \
         (little-endian) words that the server's CPU updates too; serving from it would corrupt \
         the table, so it is refused (supporting it needs byte-swapped table words: not built)"
            .to_string()
    } else {
        format!("FETCH_ADD 1 onto a zeroed word left {word:#x} in memory")
    };
    Err(probe_failed(context, reason))
}
