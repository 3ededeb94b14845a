//! Snapshots: the node's committed keys and values on disk, written atomically, and loaded back
//! into the table before the node serves (`docs/operations.md`, *Persistence*).
//!
//! - `file`: the file format (version, checksums), its atomic write and its checked read.
//! - `state`: what the node knows of its snapshots (the last, the failures).
//! - `table_io`: reading the live table's keys safely, and loading keys into the empty table.

pub mod file;
pub mod state;
pub mod table_io;

pub use state::{LastSnapshot, SnapshotState};
