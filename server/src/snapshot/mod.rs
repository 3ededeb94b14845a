//! Snapshots: the node's committed keys and values on disk, written atomically, and loaded back
//! into the table before the node serves (`docs/operations.md`, *Persistence*).
//!
//! - `file`: the file format (version, checksums), its atomic write and its checked read.

pub mod file;
