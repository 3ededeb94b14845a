//! The `loopback` provider: the verbs model in one process. A post runs the remote queue pair's
//! responder engine in the poster's thread, in posting order, and completes the requests before
//! `post` returns. Tests use it, and it is the ceiling the other providers are measured
//! against (no transport at all).

use std::any::Any;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use dashmap::DashMap;

use crate::capabilities::Capabilities;
use crate::completion::CompletionQueueInner;
use crate::device::DeviceInner;
use crate::error::{Error, Result};
use crate::lock;
use crate::protection::LocalTarget;
use crate::provider::engine::{self, RemoteRequest};
use crate::queue_pair::{InFlight, QueuePairConfig, QueuePairShared};
use crate::seam::{DeviceProvider, ProviderFuture, QueuePairProvider, Submission};
use crate::types::{Backend, Opcode, QueuePairEndpoint, WorkCompletionStatus};

/// Process-wide registry of loopback devices, so a loopback endpoint can name its device.
fn devices() -> &'static DashMap<u64, Weak<DeviceInner>> {
    static DEVICES: OnceLock<DashMap<u64, Weak<DeviceInner>>> = OnceLock::new();
    DEVICES.get_or_init(DashMap::new)
}

/// What loopback states (`docs/fabric.md`, *Capabilities*): a post runs the peer's engine on
/// the posting thread, in order, and completes before it returns; the peer is in this process.
pub(crate) const CAPABILITIES: Capabilities = Capabilities {
    ordered_reads: true,
    binds_may_block: false,
    teardown_may_block: false,
    completes_inside_post: true,
    shares_memory: false,
    crosses_processes: false,
    responder_connects_first: false,
};

/// A loopback NIC: registered in the process-wide registry while it lives.
#[derive(Debug, Default)]
pub(crate) struct LoopbackDevice {
    /// The device's id, once started.
    id: OnceLock<u64>,
}

impl DeviceProvider for LoopbackDevice {
    fn backend(&self) -> Backend {
        Backend::Loopback
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn start(&self, device: &Arc<DeviceInner>) -> Result<()> {
        devices().insert(device.id, Arc::downgrade(device));
        let _ = self.id.set(device.id);
        Ok(())
    }

    fn create_queue_pair(
        &self,
        _device: &DeviceInner,
        _completion_queue: &CompletionQueueInner,
        _config: QueuePairConfig,
    ) -> Result<Box<dyn QueuePairProvider>> {
        Ok(Box::new(LoopbackQueuePair::default()))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for LoopbackDevice {
    fn drop(&mut self) {
        if let Some(id) = self.id.get() {
            devices().remove(id);
        }
    }
}

/// A loopback queue pair: its peer, once connected.
#[derive(Debug, Default)]
pub(crate) struct LoopbackQueuePair {
    /// The remote queue pair (weak: either side may be destroyed first).
    peer: OnceLock<Weak<QueuePairShared>>,
    /// Serialises posts so requests execute in posting order.
    order: Mutex<()>,
}

/// One request to run against the peer: its sequence, its engine form and its local buffer.
type Execution = (
    u64,
    RemoteRequest,
    std::result::Result<Option<LocalTarget>, WorkCompletionStatus>,
);

impl QueuePairProvider for LoopbackQueuePair {
    fn endpoint(&self, queue_pair: &QueuePairShared) -> QueuePairEndpoint {
        QueuePairEndpoint::Loopback {
            device_id: queue_pair.device().id,
            qp_number: queue_pair.qp_number,
        }
    }

    fn connect<'a>(
        &'a self,
        _queue_pair: &'a Arc<QueuePairShared>,
        local: &'a QueuePairEndpoint,
        remote: &'a QueuePairEndpoint,
    ) -> ProviderFuture<'a, Result<()>> {
        Box::pin(async move {
            let QueuePairEndpoint::Loopback {
                device_id,
                qp_number,
            } = remote
            else {
                return Err(Error::BackendMismatch {
                    local: local.backend(),
                    remote: remote.backend(),
                });
            };
            let peer = devices()
                .get(device_id)
                .and_then(|device| device.upgrade())
                .and_then(|device| device.queue_pair(*qp_number))
                .ok_or_else(|| Error::EndpointNotFound {
                    reason: format!("loopback queue pair {qp_number} on device {device_id:#x}"),
                })?;
            let _ = self.peer.set(Arc::downgrade(&peer));
            Ok(())
        })
    }

    fn submit(
        &self,
        queue_pair: &QueuePairShared,
        entries: &mut dyn Iterator<Item = InFlight>,
    ) -> Submission {
        let Some(peer) = self.peer.get() else {
            return Submission::NotConnected;
        };
        let _order = lock(&self.order);
        let mut to_execute = Vec::new();
        let sendable = {
            let mut enqueuer = queue_pair.enqueuer();
            for entry in entries {
                if let Some(entry) = enqueuer.push(entry) {
                    to_execute.push((
                        entry.sequence,
                        engine::remote_request(&entry.request),
                        entry.local.clone(),
                    ));
                }
            }
            enqueuer.sendable
        };
        if !sendable {
            queue_pair.enter_error();
            return Submission::Complete;
        }
        execute(queue_pair, peer, to_execute);
        queue_pair.settle_local_failures();
        Submission::Complete
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Runs requests against the peer's engine, in order, and completes them.
fn execute(queue_pair: &QueuePairShared, peer: &Weak<QueuePairShared>, requests: Vec<Execution>) {
    let mut payload = Vec::new();
    let mut response = Vec::new();
    for (sequence, request, local) in requests {
        let Some(peer) = peer.upgrade() else {
            queue_pair.fail_unanswered();
            return;
        };
        payload.clear();
        if request.opcode == Opcode::Write {
            engine::append_write_payload(&mut payload, &local);
        }
        response.clear();
        match engine::serve(&peer, &request, &payload, &mut response) {
            Some(status) => {
                queue_pair.on_response(sequence, status, &response);
                if status != WorkCompletionStatus::Success {
                    peer.enter_error();
                    return;
                }
            }
            None => {
                // The responder cannot receive: this request, and every one after it (they
                // run here, in order), did not run.
                queue_pair.responder_stopped();
                return;
            }
        }
    }
}
