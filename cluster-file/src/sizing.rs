//! The heap sizing rule (`docs/operations.md`, *Sizing the heap*): how much heap a node needs
//! for its live data, its writing connections and its write rate.
//!
//! - **2 × live bytes.** The compactor empties every settled chunk less than half live, so live
//!   blocks take at most twice their size in chunks.
//! - **(writers + 2) chunks.** Each writing connection owns the chunk it fills; the compactor
//!   owns one, and one is kept in reserve for it.
//! - **write rate × 0.25 s.** Blocks written while dead ones wait to be reclaimed: a chunk comes
//!   back about two collector intervals (50 ms) after its last block dies, plus the operations
//!   then running; 0.25 s leaves a margin of five.

/// The reclamation window the rule provisions for, in seconds.
pub const RECLAIM_WINDOW_SECONDS: f64 = 0.25;

/// A node's workload, for [`heap_size`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeapDemand {
    /// Bytes of live blocks (records × block size; a block is the value, the key and a 16-byte
    /// header, rounded up to 64 bytes).
    pub live_bytes: u64,
    /// Connections that write to the node at once (one per client process and node over
    /// `soft`; over `shm` and `verbs`, one per tokio worker of each client process).
    pub writers: u64,
    /// The node's chunk size.
    pub chunk_size: u64,
    /// Bytes of blocks written per second at the peak (updates and inserts × block size).
    pub write_bytes_per_second: f64,
}

/// The heap the rule asks for, rounded up to whole chunks.
pub fn heap_size(demand: &HeapDemand) -> u64 {
    let chunk = demand.chunk_size.max(1);
    let churn = (demand.write_bytes_per_second * RECLAIM_WINDOW_SECONDS).ceil() as u64;
    let bytes = 2 * demand.live_bytes + (demand.writers + 2) * chunk + churn;
    bytes.div_ceil(chunk) * chunk
}

/// The heap block of a record: header (16 bytes), key and value, rounded up to 64 bytes.
pub fn block_size(key_bytes: u64, value_bytes: u64) -> u64 {
    (16 + key_bytes + value_bytes).div_ceil(64) * 64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_adds_twice_the_live_data_the_writers_chunks_and_the_churn() {
        let demand = HeapDemand {
            live_bytes: 100 << 20,
            writers: 2,
            chunk_size: 1 << 20,
            write_bytes_per_second: 40.0 * 1024.0 * 1024.0,
        };
        assert_eq!(heap_size(&demand), (200 + 4 + 10) << 20);
        assert_eq!(block_size(24, 1000), 1088);
    }
}
