//! The process's client-side fabric: one device and protection domain per fabric, shared by
//! every connection of every `Client` in the process, and one pool of registered 64 KiB scratch
//! buffers that grows with the operations in flight and shrinks back when they end.
//!
//! Each buffer is its own pinned, registered block, so a buffer can be given back to the
//! kernel alone. The pool keeps as many idle buffers as are busy (at least
//! [`IDLE_BUFFERS_KEPT`]), so a steady load does not register and deregister, and a burst that
//! ends leaves its memory unpinned. Under a memlock limit the pool stops growing and an
//! operation waits for a buffer another one gives back (within its deadline), instead of
//! failing: ten `Client`s of a three-node cluster run under the common 8 MiB `ulimit -l`.
//! Only when nothing is in flight to wait for is the limit an error (it names the fix).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{
    lock, AccessFlags, Backend, Device, DeviceConfig, MemoryRegion, ProtectionDomain, VerbsOptions,
};
use tokio::sync::oneshot;

use super::scratch::SCRATCH_SIZE;
use super::ClientConfig;

/// Idle buffers the pool keeps at least, so a light load never registers memory per operation.
pub(crate) const IDLE_BUFFERS_KEPT: usize = 4;

/// Bytes of a connection's announce source block (one page; 16 bytes are used).
const ANNOUNCE_BLOCK_SIZE: u64 = 4096;

/// How many scratch buffers a connection's announce block may unpin to find room (one is
/// 16 blocks' worth; more are needed only when other registrations take the room first).
const MAKE_ROOM_ATTEMPTS: usize = 4;

/// Whether pinning failed at a limit that memory given back lifts.
fn at_a_memory_limit(error: &rdkv_fabric::Error) -> bool {
    matches!(
        error,
        rdkv_fabric::Error::MemlockLimit { .. } | rdkv_fabric::Error::InsufficientMemory { .. }
    )
}

/// What makes two connections' fabrics the same.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FabricKey {
    backend: Backend,
    verbs: VerbsOptions,
    poll_spin: Duration,
}

/// The fabrics in use in this process (a fabric is dropped with its last connection).
static FABRICS: Mutex<Vec<(FabricKey, Weak<ClientFabric>)>> = Mutex::new(Vec::new());

/// Buffers idle and in use.
#[derive(Debug, Default)]
struct PoolState {
    /// Idle buffers.
    idle: Vec<MemoryRegion>,
    /// Buffers taken (and buffers being registered for a taker, or handed to a waiter).
    busy: usize,
    /// Registering failed at a memory limit: takers wait in line until memory is given back.
    at_limit: bool,
    /// Takers waiting for a buffer, oldest first.
    waiters: VecDeque<oneshot::Sender<MemoryRegion>>,
}

/// A taker in line. Dropped before it got its buffer (its operation's deadline passed), it
/// leaves the line; dropped just after a buffer was handed to it, it gives the buffer back.
struct Waiting<'pool> {
    receiver: oneshot::Receiver<MemoryRegion>,
    fabric: &'pool ClientFabric,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.receiver.close();
        if let Ok(region) = self.receiver.try_recv() {
            self.fabric.give_back(ScratchBuffer { region });
        }
    }
}

/// One device and protection domain, and the scratch pool registered in it.
#[derive(Debug)]
pub(crate) struct ClientFabric {
    /// The domain every connection's queue pair and memory belong to.
    pub(crate) domain: ProtectionDomain,
    /// The pool.
    state: Mutex<PoolState>,
    /// The device (its domain holds it too; kept for clarity of ownership).
    pub(crate) device: Device,
}

/// A scratch buffer taken from the pool: a registered block of [`SCRATCH_SIZE`] bytes.
#[derive(Debug)]
pub(crate) struct ScratchBuffer {
    /// The buffer's region (it holds the pinned memory).
    pub(crate) region: MemoryRegion,
}

impl ClientFabric {
    /// The process's fabric of `backend` with `config`'s device settings, opened on first use.
    pub(crate) fn shared(
        config: &ClientConfig,
        backend: Backend,
    ) -> rdkv_fabric::Result<Arc<Self>> {
        let key = FabricKey {
            backend,
            verbs: config.verbs.clone(),
            poll_spin: config.poll_spin,
        };
        let mut fabrics = lock(&FABRICS);
        fabrics.retain(|(_, fabric)| fabric.strong_count() > 0);
        if let Some(fabric) = fabrics
            .iter()
            .find(|(known, _)| *known == key)
            .and_then(|(_, fabric)| fabric.upgrade())
        {
            return Ok(fabric);
        }
        let device = Device::open(
            key.backend,
            None,
            &key.verbs,
            DeviceConfig {
                poll_spin: key.poll_spin,
                ..DeviceConfig::default()
            },
        )?;
        let fabric = Arc::new(Self {
            domain: device.allocate_protection_domain(),
            state: Mutex::new(PoolState::default()),
            device,
        });
        fabrics.push((key, Arc::downgrade(&fabric)));
        Ok(fabric)
    }

    /// Takes a buffer: an idle one, else a newly registered one; when the memlock limit or the
    /// machine's memory stops the pool from growing, waits in line for one to be given back
    /// (first come, first served: a buffer given back goes straight to the oldest waiter).
    ///
    /// # Errors
    /// The pinning error when the pool cannot grow and no buffer is in use to wait for.
    pub(crate) async fn take(&self) -> crate::error::Result<ScratchBuffer> {
        let waiting = {
            let mut state = lock(&self.state);
            if let Some(region) = state.idle.pop() {
                state.busy += 1;
                return Ok(ScratchBuffer { region });
            }
            if state.at_limit && state.busy > 0 {
                Some(Self::join_line(&mut state))
            } else {
                state.busy += 1;
                None
            }
        };
        let waiting = match waiting {
            Some(waiting) => waiting,
            None => match self.register(SCRATCH_SIZE) {
                Ok(region) => return Ok(ScratchBuffer { region }),
                Err(error) => {
                    let limited = at_a_memory_limit(&error);
                    let mut state = lock(&self.state);
                    state.busy -= 1;
                    if !limited || state.busy == 0 {
                        return Err(error.into());
                    }
                    tracing::debug!(%error, "scratch pool at its limit; waiting for a buffer");
                    state.at_limit = true;
                    Self::join_line(&mut state)
                }
            },
        };
        let mut waiting = Waiting {
            receiver: waiting,
            fabric: self,
        };
        match (&mut waiting.receiver).await {
            Ok(region) => Ok(ScratchBuffer { region }),
            // Never: the pool drops no waiter's sender without handing it a buffer, and it is
            // borrowed here.
            Err(_) => Err(crate::error::Error::Refused {
                reason: "the scratch pool dropped a waiting operation".into(),
            }),
        }
    }

    /// Queues a waiter; the buffer it will be handed is already counted busy.
    fn join_line(state: &mut PoolState) -> oneshot::Receiver<MemoryRegion> {
        let (sender, receiver) = oneshot::channel();
        state.waiters.push_back(sender);
        receiver
    }

    /// Gives a buffer back (every list posted through it has completed): to the oldest waiter,
    /// else to the idle list. The pool keeps at most as many idle buffers as busy ones (at
    /// least [`IDLE_BUFFERS_KEPT`]) and unpins the rest.
    pub(crate) fn give_back(&self, buffer: ScratchBuffer) {
        let mut region = buffer.region;
        let surplus = {
            let mut state = lock(&self.state);
            while let Some(waiter) = state.waiters.pop_front() {
                match waiter.send(region) {
                    // Handed over: it stays busy.
                    Ok(()) => return,
                    // That waiter gave up (its deadline passed): the next one.
                    Err(returned) => region = returned,
                }
            }
            state.busy = state.busy.saturating_sub(1);
            state.idle.push(region);
            let keep = state.busy.max(IDLE_BUFFERS_KEPT);
            if state.idle.len() > keep {
                // Memory goes back to the kernel: the pool may grow again.
                state.at_limit = false;
                state.idle.split_off(keep)
            } else {
                Vec::new()
            }
        };
        // Deregistered and unpinned outside the lock.
        drop(surplus);
    }

    /// A buffer that will never come back (a list may still be queued through it): it leaves
    /// the pool's count; its holder keeps it until the connection's queue pair is gone.
    pub(crate) fn retire(&self) {
        let mut state = lock(&self.state);
        state.busy = state.busy.saturating_sub(1);
    }

    /// A connection's announce source block. When the memlock limit (or the machine's memory)
    /// stops it, the pool has grown to the limit: it makes room by taking a scratch buffer
    /// (waiting in line, within the operation's deadline, when every buffer is in use) and
    /// unpinning it, then registers again. A connection opened while the pool is at the limit
    /// (a lane reconnecting after its node restarted, or after a lease refusal) so waits for
    /// memory instead of failing its operation.
    ///
    /// # Errors
    /// The pinning error when nothing is in use to make room from, or when other registrations
    /// took the room [`MAKE_ROOM_ATTEMPTS`] times.
    pub(crate) async fn announce_block(&self) -> crate::error::Result<MemoryRegion> {
        for _ in 0..MAKE_ROOM_ATTEMPTS {
            match self.register(ANNOUNCE_BLOCK_SIZE) {
                Ok(region) => return Ok(region),
                Err(error) if at_a_memory_limit(&error) => {
                    tracing::debug!(%error, "at the memlock limit; unpinning a scratch buffer for a connection");
                    let room = self.take().await?;
                    self.unpin(room);
                }
                Err(error) => return Err(error.into()),
            }
        }
        Ok(self.register(ANNOUNCE_BLOCK_SIZE)?)
    }

    /// Unpins a taken buffer for memory that something else needs: it leaves the pool, which
    /// stays at its limit (takers keep waiting for buffers given back).
    fn unpin(&self, buffer: ScratchBuffer) {
        {
            let mut state = lock(&self.state);
            state.busy = state.busy.saturating_sub(1);
            state.at_limit = true;
        }
        // Deregistered and unpinned outside the lock.
        drop(buffer.region);
    }

    /// Pins and registers `length` bytes for local writes.
    fn register(&self, length: u64) -> rdkv_fabric::Result<MemoryRegion> {
        let memory = Arc::new(PinnedMemory::allocate(
            length,
            HugepagePolicy::Off,
            PinLimits::default(),
        )?);
        self.domain.register_all(&memory, AccessFlags::LOCAL_WRITE)
    }

    /// Buffers idle and busy now.
    #[cfg(test)]
    pub(crate) fn buffers(&self) -> (usize, usize) {
        let state = lock(&self.state);
        (state.idle.len(), state.busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn config() -> ClientConfig {
        ClientConfig::new(
            SocketAddr::from(([127, 0, 0, 1], 1)),
            Backend::Loopback,
            b"secret",
        )
    }

    #[test]
    fn connections_of_one_process_share_one_fabric() {
        let first = ClientFabric::shared(&config(), Backend::Loopback).expect("open");
        let second = ClientFabric::shared(&config(), Backend::Loopback).expect("open");
        assert!(Arc::ptr_eq(&first, &second));
        let mut other = config();
        other.poll_spin = Duration::from_micros(5);
        let third = ClientFabric::shared(&other, Backend::Loopback).expect("open");
        assert!(!Arc::ptr_eq(&first, &third), "another device configuration");
    }

    #[tokio::test]
    async fn the_pool_grows_with_the_buffers_in_use_and_shrinks_back() {
        let mut own = config();
        // A configuration no other test uses: this pool is this test's alone.
        own.poll_spin = Duration::from_micros(77);
        let fabric = ClientFabric::shared(&own, Backend::Loopback).expect("open");
        let pinned_before = rdkv_fabric::memory::pinned_bytes();
        let mut taken = Vec::new();
        for _ in 0..40 {
            taken.push(fabric.take().await.expect("a buffer"));
        }
        assert_eq!(fabric.buffers(), (0, 40));
        assert!(rdkv_fabric::memory::pinned_bytes() >= pinned_before + 40 * SCRATCH_SIZE);
        for buffer in taken.drain(..) {
            fabric.give_back(buffer);
        }
        assert_eq!(
            fabric.buffers(),
            (IDLE_BUFFERS_KEPT, 0),
            "idle buffers beyond what is busy are unpinned"
        );
        // A steady load reuses buffers instead of registering new ones.
        for _ in 0..100 {
            let buffer = fabric.take().await.expect("a buffer");
            fabric.give_back(buffer);
        }
        assert_eq!(fabric.buffers(), (IDLE_BUFFERS_KEPT, 0));
    }
}
