//! What a stopping server still waits for.
//!
//! Every connection and every collector pass holds a [`Pass`] through the [`Gate`] while it
//! runs, and names its current step in it (`handshake: waiting for Authenticate`, `teardown:
//! draining the queue pair`, ...). A shutdown that is not done within a second logs the open
//! passes with their steps and ages, once a second, so that a node that is slow to exit says
//! why (the idea of neon's `Gate`, which names what a shutdown waits on).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkv_fabric::lock;

/// One holder: who, doing what, since when.
#[derive(Debug, Clone)]
struct Holder {
    /// `connection 7 from 127.0.0.1:5000`, `collector`.
    name: String,
    /// The current step.
    step: &'static str,
    /// When it entered the step.
    since: Instant,
}

/// The open passes of a server.
#[derive(Debug, Default)]
pub struct Gate {
    holders: Mutex<BTreeMap<u64, Holder>>,
    next: std::sync::atomic::AtomicU64,
}

impl Gate {
    /// Opens a pass for a connection.
    pub fn enter_connection(self: &Arc<Self>, connection_id: u64, peer: SocketAddr) -> Pass {
        self.enter(format!("connection {connection_id} from {peer}"))
    }

    /// Opens a pass named `name`.
    pub fn enter(self: &Arc<Self>, name: String) -> Pass {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        lock(&self.holders).insert(
            id,
            Holder {
                name,
                step: "starting",
                since: Instant::now(),
            },
        );
        Pass {
            gate: self.clone(),
            id,
        }
    }

    /// How many passes are open.
    pub fn open(&self) -> usize {
        lock(&self.holders).len()
    }

    /// One line per open pass, oldest step first: `connection 7 from …: teardown: draining
    /// the queue pair (for 1.2s)`.
    pub fn describe(&self) -> Vec<String> {
        let now = Instant::now();
        let mut holders: Vec<Holder> = lock(&self.holders).values().cloned().collect();
        holders.sort_by_key(|holder| holder.since);
        holders
            .into_iter()
            .map(|holder| {
                format!(
                    "{}: {} (for {:.1?})",
                    holder.name,
                    holder.step,
                    round(now.duration_since(holder.since))
                )
            })
            .collect()
    }
}

fn round(duration: Duration) -> Duration {
    Duration::from_millis(duration.as_millis() as u64 / 100 * 100)
}

/// An open pass; dropping it closes the pass.
#[derive(Debug)]
pub struct Pass {
    gate: Arc<Gate>,
    id: u64,
}

impl Pass {
    /// Names the step the holder is in now.
    pub fn step(&self, step: &'static str) {
        if let Some(holder) = lock(&self.gate.holders).get_mut(&self.id) {
            holder.step = step;
            holder.since = Instant::now();
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        lock(&self.gate.holders).remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_passes_are_described_with_their_steps_and_closed_on_drop() {
        let gate = Arc::new(Gate::default());
        let first = gate.enter_connection(7, "127.0.0.1:5000".parse().expect("an address"));
        first.step("teardown: draining the queue pair");
        let second = gate.enter("collector".into());
        second.step("index scan");
        assert_eq!(gate.open(), 2);
        let lines = gate.describe();
        assert!(
            lines[0].starts_with(
                "connection 7 from 127.0.0.1:5000: teardown: draining the queue pair (for "
            ),
            "{lines:?}"
        );
        assert!(lines[1].starts_with("collector: index scan"), "{lines:?}");
        drop(first);
        assert_eq!(gate.describe().len(), 1);
        drop(second);
        assert_eq!(gate.open(), 0);
    }
}
