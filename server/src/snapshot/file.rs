//! The snapshot file format: written to a temporary file, fsynced, renamed into place; read
//! back only whole and checked.
//!
//! A node writes every committed key and value to `data_dir/snapshot.rdkv` and loads it back at
//! start. This file owns the bytes on disk and their replacement; scanning the table and loading
//! it are the caller's (who runs this code on a blocking thread: there is no async here).
//!
//! # Replacement
//!
//! [`SnapshotWriter`] writes `snapshot.rdkv.tmp`, and [`SnapshotWriter::finish`] makes it the
//! current snapshot: it fsyncs the temporary file; hard-links the current snapshot (if any) to
//! `snapshot.previous.rdkv.tmp` and renames that over `snapshot.previous.rdkv`; renames the
//! temporary file over `snapshot.rdkv`; fsyncs the directory. Every step that changes a name is
//! a rename, so once a snapshot exists, `snapshot.rdkv` is at every moment (a `kill -9`
//! included) either the old complete file or the new complete file. A crash leaves at most a
//! stale `*.tmp` file, which the next writer truncates or replaces.
//!
//! # Layout (format version 4)
//!
//! All integers are little-endian. Checksums are `xxh3_64`. The file is a header, frames of
//! records, and a trailer.
//!
//! Header (`76 + C` bytes):
//!
//! | offset   | size | field                                                        |
//! |----------|------|--------------------------------------------------------------|
//! | 0        | 14   | magic `rdkv-snapshot\0`                                      |
//! | 14       | 4    | format version (`u32`, 4)                                    |
//! | 18       | 4    | node id (`u32`)                                              |
//! | 22       | 8    | view epoch when the snapshot began (`u64`)                   |
//! | 30       | 8    | created, milliseconds since the Unix epoch (`u64`)           |
//! | 38       | 8    | the cluster stop it was written at (`u64`, 0: none)          |
//! | 46       | 2    | cluster name length `C` (`u16`)                              |
//! | 48       | C    | cluster name, UTF-8                                          |
//! | 48 + C   | 4    | the cluster's `replicas` (`u32`, 0: not known)               |
//! | 52 + C   | 8    | the epoch the node stopped serving at (`u64`, 0: none; below) |
//! | 60 + C   | 8    | when, milliseconds since the Unix epoch (`u64`)              |
//! | 68 + C   | 8    | header checksum: `xxh3_64` of bytes `0..68 + C`              |
//!
//! The epoch the node stopped serving at is set only in a final snapshot written once every
//! connection was torn down, of a node the view had serving when it stopped (a clean leave, or
//! a lease that lapsed): the file then holds every write acknowledged of the node's keys until
//! then, and none accepted later (`docs/protocol.md`, *Reconciliation*). Format 3 lacks that field, format 2 the
//! `replicas` too; both are read.

//! Frame (`20 + L` bytes), repeated, each holding at least one record:
//!
//! | offset | size | field                                                     |
//! |--------|------|-----------------------------------------------------------|
//! | 0      | 4    | tag `FRAM`                                                |
//! | 4      | 4    | `L`, the byte length of the records (`u32`)               |
//! | 8      | 4    | record count (`u32`)                                      |
//! | 12     | 8    | frame checksum: `xxh3_64` of the `L` record bytes         |
//! | 20     | L    | the records, back to back                                 |
//!
//! A frame holds at most [`FRAME_LIMIT`] bytes of records; only a frame of one record (a record
//! larger than the limit) may be longer.
//!
//! Record (`14 + K + V` bytes):
//!
//! | offset | size | field                                           |
//! |--------|------|-------------------------------------------------|
//! | 0      | 2    | key length `K` (`u16`)                          |
//! | 2      | 4    | value length `V` (`u32`)                        |
//! | 6      | 8    | version (`u64`): the key's block version        |
//! | 14     | K    | key                                             |
//! | 14 + K | V    | value                                           |
//!
//! Format version 1, written before blocks carried versions, is the same but for the record,
//! which has no version (`6 + K + V` bytes): it is read, and its keys get version 0 (older
//! than any copy written since).
//!
//! Trailer (36 bytes), the last bytes of the file:
//!
//! | offset | size | field                                                            |
//! |--------|------|------------------------------------------------------------------|
//! | 0      | 4    | tag `TAIL`                                                       |
//! | 4      | 8    | record count of the whole file (`u64`)                           |
//! | 12     | 8    | file length, this trailer included (`u64`)                       |
//! | 20     | 8    | chained checksum: `c = header checksum`, then for each frame in  |
//! |        |      | order `c = xxh3_64(c ‖ frame checksum)` (16 bytes, both `u64`)   |
//! | 28     | 8    | trailer checksum: `xxh3_64` of bytes `0..28`                     |
//!
//! The chained checksum ties the frames to their header and to their order: a frame dropped,
//! repeated or moved is refused even though each frame is intact.
//!
//! # Reading
//!
//! [`read_snapshot`] checks everything: the magic, the version, every checksum, every length
//! against the frame and the file, every count, and that nothing follows the trailer. Lengths
//! are checked against the file's length before anything is allocated for them. Errors number
//! frames from 1 and give byte offsets from the start of the file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, Result};

/// The current snapshot, in `data_dir`.
pub const SNAPSHOT_FILE: &str = "snapshot.rdkv";
/// The snapshot before the current one, in `data_dir`.
pub const PREVIOUS_FILE: &str = "snapshot.previous.rdkv";
/// The latest snapshot, set aside when a node was started from the previous one or from none.
pub const REPLACED_FILE: &str = "snapshot.replaced.rdkv";
/// The version of the layout above, which the writer writes; a reader reads it,
/// [`FORMAT_WITHOUT_FENCE`], [`FORMAT_WITHOUT_REPLICAS`] and [`FORMAT_WITHOUT_VERSIONS`], and
/// refuses any other.
pub const FORMAT_VERSION: u32 = 4;
/// The format before the header carried the epoch the node stopped serving at.
pub const FORMAT_WITHOUT_FENCE: u32 = 3;
/// The format before the header carried the cluster's `replicas`.
pub const FORMAT_WITHOUT_REPLICAS: u32 = 2;
/// The format before records carried their key's version.
pub const FORMAT_WITHOUT_VERSIONS: u32 = 1;
/// The header's bytes after the cluster name from [`FORMAT_WITHOUT_FENCE`] on: the `replicas`.
const HEADER_REPLICAS_LENGTH: usize = 4;
/// The header's bytes after the `replicas` from [`FORMAT_VERSION`] on: the epoch at which the
/// node stopped serving, and when.
const HEADER_FENCE_LENGTH: usize = 16;
/// The most record bytes a frame holds (a single larger record gets a frame of its own).
pub const FRAME_LIMIT: usize = 64 * 1024;

/// The file being written; renamed to [`SNAPSHOT_FILE`] by [`SnapshotWriter::finish`].
const TEMPORARY_FILE: &str = "snapshot.rdkv.tmp";
/// The link to the current snapshot that is renamed over [`PREVIOUS_FILE`].
const PREVIOUS_TEMPORARY_FILE: &str = "snapshot.previous.rdkv.tmp";
/// The first bytes of every snapshot file.
const MAGIC: &[u8; 14] = b"rdkv-snapshot\0";
/// The first bytes of a frame.
const FRAME_TAG: [u8; 4] = *b"FRAM";
/// The first bytes of the trailer.
const TRAILER_TAG: [u8; 4] = *b"TAIL";
/// The header's bytes before the cluster name: magic, version, node id, epoch, time, length.
const HEADER_FIXED_LENGTH: usize = 48;
/// Tag, byte length, record count, checksum.
const FRAME_HEADER_LENGTH: usize = 20;
/// Key length, value length and version.
const RECORD_HEADER_LENGTH: usize = 14;
/// Tag, record count, file length, chained checksum, trailer checksum.
const TRAILER_LENGTH: usize = 36;
/// The write buffer in front of the temporary file, and the read buffer.
const IO_BUFFER: usize = 1024 * 1024;

/// What a snapshot says about where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotMeta {
    /// The cluster's name: a node must not load another cluster's data.
    pub cluster: String,
    /// The node that wrote the snapshot.
    pub node_id: u32,
    /// The view epoch when the snapshot was taken.
    pub view_epoch: u64,
    /// When the writing began, in milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The epoch of the whole cluster's stop the snapshot was written at, once the node served
    /// nothing (`crate::view`, `stop.rs`): it holds every acknowledged write of its keys.
    pub stopped_at: Option<u64>,
    /// The cluster's `replicas` when it was written (`None`: a file of a format before
    /// [`FORMAT_VERSION`]): a node resuming from it holds the copies of that many.
    pub replicas: Option<u32>,
    /// When the node stopped serving data while the view had it serving, for a final
    /// snapshot written once every connection was torn down: it holds every write
    /// acknowledged of the node's keys until then, and none accepted later (`None`: any other
    /// snapshot, or a file of a format before [`FORMAT_VERSION`]).
    pub fenced_at: Option<Fence>,
}

/// When a node stopped serving data while the view had it serving (`crate::view`'s
/// `complete.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// The view epoch it knew then.
    pub epoch: u64,
    /// Its clock then, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
}

/// A snapshot made current by [`SnapshotWriter::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenSnapshot {
    /// `data_dir/snapshot.rdkv`.
    pub path: PathBuf,
    /// How many records it holds.
    pub keys: u64,
    /// Its length in bytes.
    pub bytes: u64,
}

/// A snapshot read and checked whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedSnapshot {
    /// Its header's fields.
    pub meta: SnapshotMeta,
    /// How many records it holds.
    pub keys: u64,
    /// Its length in bytes.
    pub bytes: u64,
}

/// Writes a snapshot to `data_dir/snapshot.rdkv.tmp`, frame by frame, and makes it current in
/// [`SnapshotWriter::finish`]. Dropping a writer before `finish` removes its temporary file
/// (best effort) and leaves the current snapshot as it was.
pub struct SnapshotWriter {
    /// The directory holding the snapshots: fsynced once the renames are done.
    data_dir: PathBuf,
    /// `data_dir/snapshot.rdkv.tmp`, named in errors and removed if the writer is dropped.
    temporary_path: PathBuf,
    /// The temporary file, behind a 1 MiB buffer.
    output: BufWriter<File>,
    /// The records of the frame being filled, written out when the next record would not fit.
    frame: Vec<u8>,
    /// How many records `frame` holds.
    frame_records: u32,
    /// The most record bytes a frame holds: [`FRAME_LIMIT`], smaller in tests.
    frame_limit: usize,
    /// The format it writes: [`FORMAT_VERSION`] ([`FORMAT_WITHOUT_VERSIONS`] in tests of
    /// reading an older file).
    format: u32,
    /// The chained checksum over the frames written so far (see the layout).
    chain: u64,
    /// How many records were appended.
    records: u64,
    /// How many bytes were handed to `output` (the header and the frames written out).
    bytes_output: u64,
    /// Set once the temporary file was renamed: from then on, dropping removes nothing.
    renamed: bool,
    /// Whether `create` made `data_dir`: then `finish` also fsyncs its parent, so that the new
    /// directory's name is durable too.
    created_directory: bool,
}

impl SnapshotWriter {
    /// Creates `data_dir` (and parents) if missing, then the temporary file (truncating a
    /// leftover one from a crash), and writes the header.
    ///
    /// # Errors
    /// The directory or the file cannot be created or written, or the cluster name is longer
    /// than 65,535 bytes.
    pub fn create(data_dir: &Path, meta: &SnapshotMeta) -> Result<Self> {
        Self::create_with_frame_limit(data_dir, meta, FRAME_LIMIT)
    }

    /// A writer of the format before versions, whose records have none (tests of reading a
    /// file written by an earlier rdkv-server).
    #[cfg(test)]
    pub(crate) fn create_without_versions(data_dir: &Path, meta: &SnapshotMeta) -> Result<Self> {
        Self::create_of_format(data_dir, meta, FRAME_LIMIT, FORMAT_WITHOUT_VERSIONS)
    }

    /// [`SnapshotWriter::create`] with frames of at most `frame_limit` record bytes (tests use
    /// small frames to have many of them in a small file; the reader accepts any limit up to
    /// [`FRAME_LIMIT`]).
    fn create_with_frame_limit(
        data_dir: &Path,
        meta: &SnapshotMeta,
        frame_limit: usize,
    ) -> Result<Self> {
        Self::create_of_format(data_dir, meta, frame_limit, FORMAT_VERSION)
    }

    /// [`SnapshotWriter::create_with_frame_limit`] of file format `format`.
    fn create_of_format(
        data_dir: &Path,
        meta: &SnapshotMeta,
        frame_limit: usize,
        format: u32,
    ) -> Result<Self> {
        let temporary_path = data_dir.join(TEMPORARY_FILE);
        let header = encode_header(meta, format)
            .map_err(|reason| snapshot_error(&temporary_path, reason))?;
        let created_directory = !data_dir.exists();
        // Private, as the logs are: a snapshot holds every value in the clear.
        {
            use std::os::unix::fs::DirBuilderExt;
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(data_dir)
                .map_err(|source| io_error(data_dir, "create the directory", &source))?;
        }
        let file = private_options()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temporary_path)
            .map_err(|source| io_error(&temporary_path, "create", &source))?;
        let mut writer = Self {
            data_dir: data_dir.to_path_buf(),
            temporary_path,
            output: BufWriter::with_capacity(IO_BUFFER, file),
            frame: Vec::with_capacity(frame_limit.min(FRAME_LIMIT)),
            frame_records: 0,
            frame_limit: frame_limit.clamp(1, FRAME_LIMIT),
            format,
            chain: header.checksum,
            records: 0,
            bytes_output: 0,
            renamed: false,
            created_directory,
        };
        writer.write_bytes(&header.bytes)?;
        Ok(writer)
    }

    /// Appends one record. Keys of any length up to 65,535 bytes and values up to 4 GiB are
    /// accepted (the cluster's limits are the caller's to enforce).
    ///
    /// # Errors
    /// The key or the value is too long for the format, or a full frame cannot be written.
    pub fn append(&mut self, key: &[u8], value: &[u8], version: u64) -> Result<()> {
        let versioned = self.format != FORMAT_WITHOUT_VERSIONS;
        // A record of the format before versions lacks the version's 8 bytes.
        let header_length = if versioned {
            RECORD_HEADER_LENGTH
        } else {
            RECORD_HEADER_LENGTH - 8
        };
        let record_length = header_length + key.len() + value.len();
        let (Ok(key_length), Ok(value_length), Ok(_)) = (
            u16::try_from(key.len()),
            u32::try_from(value.len()),
            u32::try_from(record_length),
        ) else {
            return Err(snapshot_error(
                &self.temporary_path,
                format!(
                    "a record with a {}-byte key and a {}-byte value does not fit the format \
                     (keys up to 65535 bytes, records up to 4 GiB)",
                    key.len(),
                    value.len()
                ),
            ));
        };
        if self.frame_records > 0 && self.frame.len() + record_length > self.frame_limit {
            self.write_frame()?;
        }
        self.frame.extend_from_slice(&key_length.to_le_bytes());
        self.frame.extend_from_slice(&value_length.to_le_bytes());
        if versioned {
            self.frame.extend_from_slice(&version.to_le_bytes());
        }
        self.frame.extend_from_slice(key);
        self.frame.extend_from_slice(value);
        self.frame_records += 1;
        self.records += 1;
        if self.frame.len() >= self.frame_limit {
            self.write_frame()?;
        }
        Ok(())
    }

    /// The bytes the file holds for what was appended so far (the header and every record in
    /// its frame; the trailer is added by `finish`). The caller paces its I/O with this.
    pub fn bytes_written(&self) -> u64 {
        let open_frame = if self.frame_records > 0 {
            FRAME_HEADER_LENGTH + self.frame.len()
        } else {
            0
        };
        self.bytes_output + open_frame as u64
    }

    /// Writes the trailer, flushes, fsyncs the file, keeps the current snapshot (if any) as
    /// [`PREVIOUS_FILE`], renames the temporary file to [`SNAPSHOT_FILE`], fsyncs the
    /// directory.
    ///
    /// # Errors
    /// A step failed; the error names it and the OS error. If the rename was not reached, the
    /// current snapshot is unchanged and the temporary file is removed.
    pub fn finish(mut self) -> Result<WrittenSnapshot> {
        if self.frame_records > 0 {
            self.write_frame()?;
        }
        let file_length = self.bytes_output + TRAILER_LENGTH as u64;
        self.write_bytes(&encode_trailer(self.records, file_length, self.chain))?;
        let temporary_path = &self.temporary_path;
        self.output
            .flush()
            .map_err(|source| io_error(temporary_path, "flush", &source))?;
        self.output
            .get_ref()
            .sync_all()
            .map_err(|source| io_error(temporary_path, "fsync", &source))?;
        let snapshot_path = self.data_dir.join(SNAPSHOT_FILE);
        keep_previous(&self.data_dir, &snapshot_path)?;
        fs::rename(&self.temporary_path, &snapshot_path).map_err(|source| {
            io_error(
                &snapshot_path,
                &format!("rename {} over it", self.temporary_path.display()),
                &source,
            )
        })?;
        self.renamed = true;
        fsync_directory(&self.data_dir)?;
        if self.created_directory {
            if let Some(parent) = self
                .data_dir
                .parent()
                .filter(|parent| !parent.as_os_str().is_empty())
            {
                fsync_directory(parent)?;
            }
        }
        Ok(WrittenSnapshot {
            path: snapshot_path,
            keys: self.records,
            bytes: file_length,
        })
    }

    /// Writes the open frame (header, then records) and starts an empty one.
    fn write_frame(&mut self) -> Result<()> {
        let checksum = xxh3_64(&self.frame);
        let length = u32::try_from(self.frame.len()).map_err(|_| {
            snapshot_error(
                &self.temporary_path,
                format!(
                    "a frame of {} bytes does not fit the format",
                    self.frame.len()
                ),
            )
        })?;
        let mut header = [0u8; FRAME_HEADER_LENGTH];
        header[0..4].copy_from_slice(&FRAME_TAG);
        header[4..8].copy_from_slice(&length.to_le_bytes());
        header[8..12].copy_from_slice(&self.frame_records.to_le_bytes());
        header[12..20].copy_from_slice(&checksum.to_le_bytes());
        let temporary_path = &self.temporary_path;
        let output = &mut self.output;
        output
            .write_all(&header)
            .and_then(|()| output.write_all(&self.frame))
            .map_err(|source| io_error(temporary_path, "write", &source))?;
        self.bytes_output += (FRAME_HEADER_LENGTH + self.frame.len()) as u64;
        self.chain = chain_checksum(self.chain, checksum);
        self.frame.clear();
        if self.frame.capacity() > 2 * self.frame_limit {
            // A record larger than a frame grew the buffer: do not keep that much memory.
            self.frame.shrink_to(self.frame_limit);
        }
        self.frame_records = 0;
        Ok(())
    }

    /// Hands `bytes` to the buffered file and counts them.
    fn write_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let temporary_path = &self.temporary_path;
        self.output
            .write_all(bytes)
            .map_err(|source| io_error(temporary_path, "write", &source))?;
        self.bytes_output += bytes.len() as u64;
        Ok(())
    }
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        if !self.renamed {
            // Best effort: a leftover is truncated by the next writer anyway.
            let _ = fs::remove_file(&self.temporary_path);
        }
    }
}

/// If a current snapshot exists, makes it [`PREVIOUS_FILE`] too, by a hard link renamed into
/// place: the current snapshot keeps its name throughout, and the previous one is replaced in
/// one step.
fn keep_previous(data_dir: &Path, snapshot_path: &Path) -> Result<()> {
    let exists = snapshot_path
        .try_exists()
        .map_err(|source| io_error(snapshot_path, "check whether it exists", &source))?;
    if !exists {
        return Ok(());
    }
    let link_path = data_dir.join(PREVIOUS_TEMPORARY_FILE);
    match fs::remove_file(&link_path) {
        Ok(()) => {}
        Err(source) if source.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(io_error(&link_path, "remove a leftover", &source)),
    }
    fs::hard_link(snapshot_path, &link_path).map_err(|source| {
        io_error(
            snapshot_path,
            &format!(
                "keep it as the previous snapshot: link {}",
                link_path.display()
            ),
            &source,
        )
    })?;
    let previous_path = data_dir.join(PREVIOUS_FILE);
    fs::rename(&link_path, &previous_path).map_err(|source| {
        io_error(
            &previous_path,
            &format!("rename {} over it", link_path.display()),
            &source,
        )
    })?;
    // When both names were one file already (a start from the previous snapshot links it as
    // the latest), the rename does nothing and leaves the link: remove it.
    match fs::remove_file(&link_path) {
        Err(source) if source.kind() != io::ErrorKind::NotFound => {
            Err(io_error(&link_path, "remove the link", &source))
        }
        _ => Ok(()),
    }
}

/// Makes the names in `directory` durable (the renames and links done in it).
fn fsync_directory(directory: &Path) -> Result<()> {
    File::open(directory)
        .and_then(|handle| handle.sync_all())
        .map_err(|source| io_error(directory, "fsync the directory", &source))
}

/// The header's bytes and their checksum (the start of the chained checksum).
struct EncodedHeader {
    /// The whole header, checksum included.
    bytes: Vec<u8>,
    /// The checksum at its end.
    checksum: u64,
}

/// Encodes the header; the error says why the meta does not fit.
fn encode_header(meta: &SnapshotMeta, format: u32) -> std::result::Result<EncodedHeader, String> {
    let cluster_length = u16::try_from(meta.cluster.len()).map_err(|_| {
        format!(
            "the cluster name is {} bytes long; the format holds at most 65535",
            meta.cluster.len()
        )
    })?;
    let mut bytes = Vec::with_capacity(HEADER_FIXED_LENGTH + meta.cluster.len() + 8);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&format.to_le_bytes());
    bytes.extend_from_slice(&meta.node_id.to_le_bytes());
    bytes.extend_from_slice(&meta.view_epoch.to_le_bytes());
    bytes.extend_from_slice(&meta.created_unix_ms.to_le_bytes());
    bytes.extend_from_slice(&meta.stopped_at.unwrap_or(0).to_le_bytes());
    bytes.extend_from_slice(&cluster_length.to_le_bytes());
    bytes.extend_from_slice(meta.cluster.as_bytes());
    if format >= FORMAT_WITHOUT_FENCE {
        bytes.extend_from_slice(&meta.replicas.unwrap_or(0).to_le_bytes());
    }
    if format >= FORMAT_VERSION {
        let fence = meta.fenced_at.unwrap_or(Fence {
            epoch: 0,
            unix_ms: 0,
        });
        bytes.extend_from_slice(&fence.epoch.to_le_bytes());
        bytes.extend_from_slice(&fence.unix_ms.to_le_bytes());
    }
    let checksum = xxh3_64(&bytes);
    bytes.extend_from_slice(&checksum.to_le_bytes());
    Ok(EncodedHeader { bytes, checksum })
}

/// Encodes the trailer.
fn encode_trailer(records: u64, file_length: u64, chain: u64) -> [u8; TRAILER_LENGTH] {
    let mut trailer = [0u8; TRAILER_LENGTH];
    trailer[0..4].copy_from_slice(&TRAILER_TAG);
    trailer[4..12].copy_from_slice(&records.to_le_bytes());
    trailer[12..20].copy_from_slice(&file_length.to_le_bytes());
    trailer[20..28].copy_from_slice(&chain.to_le_bytes());
    let checksum = xxh3_64(&trailer[0..28]);
    trailer[28..36].copy_from_slice(&checksum.to_le_bytes());
    trailer
}

/// One step of the chained checksum: `xxh3_64(chain ‖ frame checksum)`.
fn chain_checksum(chain: u64, frame_checksum: u64) -> u64 {
    let mut pair = [0u8; 16];
    pair[0..8].copy_from_slice(&chain.to_le_bytes());
    pair[8..16].copy_from_slice(&frame_checksum.to_le_bytes());
    xxh3_64(&pair)
}

/// Reads and checks the whole file, calling `visit` for each record in order. Any damage
/// (truncation, a flipped byte anywhere, a wrong magic or format version, trailing garbage) is
/// an error.
///
/// Each frame is checked whole before its records are visited, but the file is read once: when
/// a later frame turns out damaged, the records of the earlier ones were visited already. To
/// load all or nothing, call [`verify_snapshot`] first, or discard what was visited on error.
///
/// # Errors
/// The file cannot be opened or read, or is not a whole, intact snapshot of this format
/// version. The error names the file and says what is wrong, with the frame and byte offset.
pub fn read_snapshot(
    path: &Path,
    mut visit: impl FnMut(&[u8], &[u8], u64),
) -> Result<LoadedSnapshot> {
    let mut reader = SnapshotReader::open(path)?;
    let (meta, header_checksum, format) = reader.read_header()?;
    let mut chain = header_checksum;
    let mut records = 0u64;
    let mut frame = Frame::default();
    let mut frame_number = 0u64;
    loop {
        let tag = reader.read_tag(frame_number)?;
        if tag == TRAILER_TAG {
            break;
        }
        if tag != FRAME_TAG {
            return Err(reader.damaged(format!(
                "unexpected bytes at byte {} where frame {} or the trailer should start: the \
                 file is damaged",
                reader.position - 4,
                frame_number + 1
            )));
        }
        frame_number += 1;
        let frame_checksum = reader.read_frame(frame_number, &mut frame)?;
        let pairs = split_records(&frame.body, format)
            .map_err(|reason| reader.damaged(format!("frame {frame_number}: {reason}")))?;
        if pairs.len() as u64 != u64::from(frame.records) {
            return Err(reader.damaged(format!(
                "frame {frame_number} holds {} records, its header says {}: the file is damaged",
                pairs.len(),
                frame.records
            )));
        }
        for (key, value, version) in pairs {
            visit(key, value, version);
        }
        records += u64::from(frame.records);
        chain = chain_checksum(chain, frame_checksum);
    }
    reader.read_trailer(records, chain)?;
    Ok(LoadedSnapshot {
        meta,
        keys: records,
        bytes: reader.position,
    })
}

/// Checks the whole file without visiting (reads it once).
///
/// # Errors
/// As [`read_snapshot`].
pub fn verify_snapshot(path: &Path) -> Result<LoadedSnapshot> {
    read_snapshot(path, |_, _, _| {})
}

/// A frame read off the file and checked against its checksum.
#[derive(Default)]
struct Frame {
    /// The records' bytes (reused from frame to frame).
    body: Vec<u8>,
    /// The record count its header gives.
    records: u32,
}

/// A record's key and value, borrowed from its frame, and its version.
type KeyValue<'frame> = (&'frame [u8], &'frame [u8], u64);

/// Splits a frame's records, of file format `format`, into keys, values and versions (0 in a
/// file of [`FORMAT_WITHOUT_VERSIONS`]); the error says which record is malformed.
fn split_records(body: &[u8], format: u32) -> std::result::Result<Vec<KeyValue<'_>>, String> {
    let mut pairs = Vec::new();
    let mut cursor = FieldCursor { remaining: body };
    while !cursor.remaining.is_empty() {
        let record = pairs.len() + 1;
        let offset = body.len() - cursor.remaining.len();
        let key_length = cursor.u16();
        let value_length = cursor.u32();
        let version = if format == FORMAT_WITHOUT_VERSIONS {
            Some(0)
        } else {
            cursor.u64()
        };
        let (Some(key_length), Some(value_length), Some(version)) =
            (key_length, value_length, version)
        else {
            return Err(format!(
                "record {record}'s lengths run past the end of the frame (at offset {offset} of \
                 {}): the file is damaged",
                body.len()
            ));
        };
        let key = cursor.bytes(usize::from(key_length));
        let value = key.and_then(|_| cursor.bytes(value_length as usize));
        let (Some(key), Some(value)) = (key, value) else {
            return Err(format!(
                "record {record} ({key_length}-byte key, {value_length}-byte value, at offset \
                 {offset}) runs past the end of the frame ({} bytes): the file is damaged",
                body.len()
            ));
        };
        pairs.push((key, value, version));
    }
    Ok(pairs)
}

/// Takes little-endian integers and byte strings off the front of a slice.
struct FieldCursor<'a> {
    /// What is left to take.
    remaining: &'a [u8],
}

impl<'a> FieldCursor<'a> {
    /// The next `N` bytes, if there are that many.
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.remaining.split_first_chunk::<N>()?;
        self.remaining = rest;
        Some(*head)
    }

    /// The next `length` bytes, if there are that many.
    fn bytes(&mut self, length: usize) -> Option<&'a [u8]> {
        if length > self.remaining.len() {
            return None;
        }
        let (head, rest) = self.remaining.split_at(length);
        self.remaining = rest;
        Some(head)
    }

    /// The next `u16`.
    fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    /// The next `u32`.
    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next `u64`.
    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Reads a snapshot file front to back, checking every length against the file's length
/// before reading (or allocating for) it.
struct SnapshotReader {
    /// The file, named in every error.
    path: PathBuf,
    /// The file, behind a 1 MiB buffer.
    input: BufReader<File>,
    /// The offset of the next byte to read.
    position: u64,
    /// The file's length when it was opened.
    file_length: u64,
}

impl SnapshotReader {
    /// Opens the file and takes its length.
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| io_error(path, "open", &source))?;
        let file_length = file
            .metadata()
            .map_err(|source| io_error(path, "read its metadata", &source))?
            .len();
        Ok(Self {
            path: path.to_path_buf(),
            input: BufReader::with_capacity(IO_BUFFER, file),
            position: 0,
            file_length,
        })
    }

    /// Reads and checks the header: the magic and the version first (a header of another
    /// version may be laid out differently), then the fields and their checksum.
    fn read_header(&mut self) -> Result<(SnapshotMeta, u64, u32)> {
        let magic: [u8; MAGIC.len()] = self.read_array("the header")?;
        if &magic != MAGIC {
            return Err(self
                .damaged("not an rdkv snapshot: the file does not start with the snapshot magic"));
        }
        let version_bytes: [u8; 4] = self.read_array("the header")?;
        let version = u32::from_le_bytes(version_bytes);
        if !(FORMAT_WITHOUT_VERSIONS..=FORMAT_VERSION).contains(&version) {
            return Err(self.damaged(format!(
                "format version {version}, this rdkv-server reads versions \
                 {FORMAT_WITHOUT_VERSIONS} to {FORMAT_VERSION}: {} \
                 rdkv-server wrote it, or the file is damaged",
                if version > FORMAT_VERSION {
                    "a newer"
                } else {
                    "an older"
                }
            )));
        }
        let fields: [u8; HEADER_FIXED_LENGTH - MAGIC.len() - 4] = self.read_array("the header")?;
        let mut cursor = FieldCursor { remaining: &fields };
        let (
            Some(node_id),
            Some(view_epoch),
            Some(created_unix_ms),
            Some(stopped_at),
            Some(cluster_length),
        ) = (
            cursor.u32(),
            cursor.u64(),
            cursor.u64(),
            cursor.u64(),
            cursor.u16(),
        )
        else {
            return Err(self.damaged("the header's fields could not be decoded"));
        };
        let mut cluster = vec![0u8; usize::from(cluster_length)];
        self.read_into(&mut cluster, "the header's cluster name")?;
        let replicas: Option<[u8; HEADER_REPLICAS_LENGTH]> = if version >= FORMAT_WITHOUT_FENCE {
            Some(self.read_array("the header's replicas")?)
        } else {
            None
        };
        let fenced_at: Option<[u8; HEADER_FENCE_LENGTH]> = if version >= FORMAT_VERSION {
            Some(self.read_array("the header's fence epoch")?)
        } else {
            None
        };
        let stored_checksum = u64::from_le_bytes(self.read_array("the header's checksum")?);
        let mut header = Vec::with_capacity(HEADER_FIXED_LENGTH + cluster.len());
        header.extend_from_slice(&magic);
        header.extend_from_slice(&version_bytes);
        header.extend_from_slice(&fields);
        header.extend_from_slice(&cluster);
        header.extend_from_slice(replicas.as_ref().map_or(&[][..], |bytes| &bytes[..]));
        header.extend_from_slice(fenced_at.as_ref().map_or(&[][..], |bytes| &bytes[..]));
        if xxh3_64(&header) != stored_checksum {
            return Err(self.damaged("the header's checksum does not match: the file is damaged"));
        }
        let cluster = String::from_utf8(cluster)
            .map_err(|_| self.damaged("the cluster name in the header is not UTF-8"))?;
        let meta = SnapshotMeta {
            cluster,
            node_id,
            view_epoch,
            created_unix_ms,
            stopped_at: (stopped_at != 0).then_some(stopped_at),
            replicas: replicas
                .map(u32::from_le_bytes)
                .filter(|replicas| *replicas != 0),
            fenced_at: fenced_at.and_then(|bytes| {
                let (mut epoch, mut unix_ms) = ([0u8; 8], [0u8; 8]);
                epoch.copy_from_slice(&bytes[..8]);
                unix_ms.copy_from_slice(&bytes[8..]);
                let epoch = u64::from_le_bytes(epoch);
                (epoch != 0).then_some(Fence {
                    epoch,
                    unix_ms: u64::from_le_bytes(unix_ms),
                })
            }),
        };
        Ok((meta, stored_checksum, version))
    }

    /// Reads the tag that starts the next frame or the trailer (`frames_read` frames were read).
    fn read_tag(&mut self, frames_read: u64) -> Result<[u8; 4]> {
        if self.position == self.file_length {
            return Err(self.damaged(format!(
                "truncated: the file ends at byte {} after frame {frames_read}, with no trailer \
                 (the write did not finish)",
                self.position
            )));
        }
        self.read_array(&format!(
            "the header of frame {} or the trailer",
            frames_read + 1
        ))
    }

    /// Reads the rest of frame `number` (after its tag) into `frame`, checks its length and
    /// checksum, and returns the checksum.
    fn read_frame(&mut self, number: u64, frame: &mut Frame) -> Result<u64> {
        let frame_start = self.position - 4;
        let header: [u8; FRAME_HEADER_LENGTH - 4] =
            self.read_array(&format!("frame {number}'s header"))?;
        let mut cursor = FieldCursor { remaining: &header };
        let (Some(length), Some(records), Some(checksum)) =
            (cursor.u32(), cursor.u32(), cursor.u64())
        else {
            return Err(self.damaged(format!("frame {number}'s header could not be decoded")));
        };
        let length = length as usize;
        if records == 0 || length == 0 || (length > FRAME_LIMIT && records != 1) {
            return Err(self.damaged(format!(
                "frame {number} (at byte {frame_start}) says it holds {records} records in \
                 {length} bytes; a frame holds at least one record, and more than one only \
                 within {FRAME_LIMIT} bytes: the file is damaged"
            )));
        }
        self.ensure_available(length as u64, &format!("frame {number}"), frame_start)?;
        frame.body.clear();
        frame.records = records;
        let read = (&mut self.input)
            .take(length as u64)
            .read_to_end(&mut frame.body)
            .map_err(|source| io_error(&self.path, &format!("read frame {number}"), &source))?;
        if read != length {
            return Err(self.damaged(format!(
                "truncated: the file shrank while it was read, inside frame {number} at byte {}",
                self.position + read as u64
            )));
        }
        self.position += length as u64;
        if xxh3_64(&frame.body) != checksum {
            return Err(self.damaged(format!(
                "frame {number}'s checksum does not match (bytes {frame_start}..{}): the file \
                 is damaged",
                self.position
            )));
        }
        Ok(checksum)
    }

    /// Reads the rest of the trailer (after its tag) and checks it against what the frames
    /// held, and that nothing follows it.
    fn read_trailer(&mut self, records: u64, chain: u64) -> Result<()> {
        let trailer_start = self.position - 4;
        let rest: [u8; TRAILER_LENGTH - 4] = self.read_array("the trailer")?;
        let mut trailer = [0u8; TRAILER_LENGTH];
        trailer[0..4].copy_from_slice(&TRAILER_TAG);
        trailer[4..].copy_from_slice(&rest);
        let mut cursor = FieldCursor {
            remaining: &trailer[4..],
        };
        let fields = (cursor.u64(), cursor.u64(), cursor.u64(), cursor.u64());
        let (Some(stored_records), Some(stored_length), Some(stored_chain), Some(checksum)) =
            fields
        else {
            return Err(self.damaged("the trailer could not be decoded"));
        };
        if xxh3_64(&trailer[0..28]) != checksum {
            return Err(self.damaged(format!(
                "the trailer's checksum does not match (at byte {trailer_start}): the file is \
                 damaged"
            )));
        }
        let mut probe = [0u8; 1];
        let beyond = self
            .input
            .read(&mut probe)
            .map_err(|source| io_error(&self.path, "read after the trailer", &source))?;
        if self.position != self.file_length || beyond != 0 {
            return Err(self.damaged(format!(
                "{} bytes after the trailer (which ends at byte {}): the file is damaged or was \
                 appended to",
                self.file_length.saturating_sub(self.position).max(1),
                self.position
            )));
        }
        if stored_length != self.position || stored_records != records {
            return Err(self.damaged(format!(
                "the trailer says {stored_records} records in {stored_length} bytes, the file \
                 holds {records} records in {} bytes: the file is damaged",
                self.position
            )));
        }
        if stored_chain != chain {
            return Err(self.damaged(
                "the frames' chained checksum does not match the trailer's: a frame is missing, \
                 repeated or out of order",
            ));
        }
        Ok(())
    }

    /// Reads exactly `N` bytes, part of `what`.
    fn read_array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut bytes = [0u8; N];
        self.read_into(&mut bytes, what)?;
        Ok(bytes)
    }

    /// Fills `buffer` from the file; `what` names the part for a truncation error.
    fn read_into(&mut self, buffer: &mut [u8], what: &str) -> Result<()> {
        self.ensure_available(buffer.len() as u64, what, self.position)?;
        self.input.read_exact(buffer).map_err(|source| {
            if source.kind() == io::ErrorKind::UnexpectedEof {
                self.damaged(format!(
                    "truncated: the file shrank while it was read, inside {what} at byte {}",
                    self.position
                ))
            } else {
                io_error(
                    &self.path,
                    &format!("read at byte {}", self.position),
                    &source,
                )
            }
        })?;
        self.position += buffer.len() as u64;
        Ok(())
    }

    /// Checks that the file holds `length` more bytes, which belong to `what` (which starts at
    /// byte `what_start`).
    fn ensure_available(&self, length: u64, what: &str, what_start: u64) -> Result<()> {
        let end = self.position.saturating_add(length);
        if end > self.file_length {
            return Err(self.damaged(format!(
                "truncated: the file ends at byte {}, inside {what} (bytes {what_start}..{end})",
                self.file_length
            )));
        }
        Ok(())
    }

    /// An error naming this file.
    fn damaged(&self, reason: impl Into<String>) -> Error {
        snapshot_error(&self.path, reason)
    }
}

/// The error for `path`.
fn snapshot_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::Snapshot {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The error for an OS error at `step` on `path`.
fn io_error(path: &Path, step: &str, source: &io::Error) -> Error {
    snapshot_error(path, format!("{step}: {source}"))
}

/// Options that create a file readable and writable by its owner alone (0600).
fn private_options() -> OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = OpenOptions::new();
    options.mode(0o600);
    options
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A directory under the system's temporary directory, unique to one test, removed on drop.
    struct TestDirectory {
        /// The directory (not created: the writer creates it).
        path: PathBuf,
    }

    impl TestDirectory {
        fn new(label: &str) -> Self {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let path = std::env::temp_dir().join(format!(
                "rdkv-snapshot-{label}-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&path);
            Self { path }
        }
    }

    impl Drop for TestDirectory {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.path);
        }
    }

    type Records = Vec<(Vec<u8>, Vec<u8>)>;

    /// The version the tests give a record: from its lengths and first bytes, so that records
    /// differ.
    fn version_of(key: &[u8], value: &[u8]) -> u64 {
        let first = |bytes: &[u8]| u64::from(bytes.first().copied().unwrap_or(0));
        (key.len() as u64) << 48 | (value.len() as u64) << 16 | first(key) << 8 | first(value)
    }

    fn meta(view_epoch: u64) -> SnapshotMeta {
        SnapshotMeta {
            cluster: "test-cluster".into(),
            node_id: 7,
            view_epoch,
            created_unix_ms: 1_700_000_000_123,
            stopped_at: Some(view_epoch + 1),
            replicas: Some(2),
            fenced_at: Some(Fence {
                epoch: view_epoch,
                unix_ms: 1_700_000_000_456,
            }),
        }
    }

    /// `count` small records: keys of 5 to 12 bytes, values of 0 to 30 bytes.
    fn small_records(count: usize) -> Records {
        (0..count)
            .map(|index| {
                let key = format!("k{index}-{}", "x".repeat(index % 8)).into_bytes();
                let value = vec![index as u8; (index * 7) % 31];
                (key, value)
            })
            .collect()
    }

    fn write(data_dir: &Path, meta: &SnapshotMeta, records: &Records, frame_limit: usize) {
        let mut writer =
            SnapshotWriter::create_with_frame_limit(data_dir, meta, frame_limit).expect("create");
        for (key, value) in records {
            writer
                .append(key, value, version_of(key, value))
                .expect("append");
        }
        let bytes_before_trailer = writer.bytes_written();
        let written = writer.finish().expect("finish");
        assert_eq!(written.keys, records.len() as u64);
        assert_eq!(written.bytes, bytes_before_trailer + TRAILER_LENGTH as u64);
        let length = fs::metadata(&written.path).expect("metadata").len();
        assert_eq!(written.bytes, length);
    }

    fn read_all(path: &Path) -> Result<(LoadedSnapshot, Records)> {
        let mut visited = Vec::new();
        let loaded = read_snapshot(path, |key, value, version| {
            assert_eq!(
                version,
                version_of(key, value),
                "each record keeps its version"
            );
            visited.push((key.to_vec(), value.to_vec()));
        })?;
        Ok((loaded, visited))
    }

    fn assert_round_trip(label: &str, records: &Records) {
        let directory = TestDirectory::new(label);
        write(&directory.path, &meta(3), records, FRAME_LIMIT);
        let path = directory.path.join(SNAPSHOT_FILE);
        let (loaded, visited) = read_all(&path).expect("read");
        assert_eq!(loaded.meta, meta(3));
        assert_eq!(loaded.keys, records.len() as u64);
        assert_eq!(loaded.bytes, fs::metadata(&path).expect("metadata").len());
        assert!(
            visited == *records,
            "the records differ or are out of order"
        );
        assert_eq!(verify_snapshot(&path).expect("verify"), loaded);
        assert!(!directory.path.join(TEMPORARY_FILE).exists());
        assert!(!directory.path.join(PREVIOUS_FILE).exists());
    }

    /// A refusal names the file, on one line.
    fn assert_refused(path: &Path, bytes: &[u8], context: &str) -> String {
        fs::write(path, bytes).expect("write the damaged file");
        let error = verify_snapshot(path).expect_err(context);
        let message = error.to_string();
        assert!(
            message.starts_with(&format!("snapshot {}: ", path.display())),
            "{context}: {message}"
        );
        assert!(!message.contains('\n'), "{context}: {message}");
        message
    }

    #[test]
    fn an_empty_snapshot_round_trips() {
        assert_round_trip("empty", &Vec::new());
    }

    /// A snapshot holds every value in the clear: its file and a directory it creates are
    /// its owner's alone (a new user read one as `nobody`: 0644 in a 0755 directory).
    #[test]
    fn a_snapshot_and_the_directory_it_creates_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let directory = TestDirectory::new("private");
        let data_dir = directory.path.join("data");
        write(
            &data_dir,
            &meta(3),
            &vec![(b"key".to_vec(), b"secret".to_vec())],
            FRAME_LIMIT,
        );
        let mode = |path: &Path| fs::metadata(path).expect("metadata").permissions().mode() & 0o777;
        assert_eq!(mode(&data_dir), 0o700);
        assert_eq!(mode(&data_dir.join(SNAPSHOT_FILE)), 0o600);
    }

    #[test]
    fn one_record_round_trips() {
        assert_round_trip("one", &vec![(b"key".to_vec(), b"value".to_vec())]);
    }

    #[test]
    fn ten_thousand_records_of_mixed_sizes_round_trip_in_order() {
        let records: Records = (0..10_000usize)
            .map(|index| {
                let key_length = match index % 4 {
                    0 => 256,
                    1 => 1,
                    _ => 1 + (index * 37) % 256,
                };
                let value_length = match index % 100 {
                    0 => 16_048,
                    1 => 0,
                    _ => (index * 53) % 300,
                };
                let mut key = format!("{index}").into_bytes();
                key.resize(key_length, b'.');
                let value = (0..value_length).map(|at| (at + index) as u8).collect();
                (key, value)
            })
            .collect();
        assert_round_trip("ten-thousand", &records);
    }

    #[test]
    fn a_record_larger_than_a_frame_gets_a_frame_of_its_own_and_round_trips() {
        let mut records = small_records(5);
        records.insert(2, (b"large".to_vec(), vec![0xab; 3 * FRAME_LIMIT + 5]));
        records.push((Vec::new(), Vec::new()));
        assert_round_trip("large", &records);
    }

    #[test]
    fn bytes_written_grows_with_each_record() {
        let directory = TestDirectory::new("bytes-written");
        let mut writer = SnapshotWriter::create(&directory.path, &meta(1)).expect("create");
        let header = writer.bytes_written();
        assert_eq!(
            header,
            (HEADER_FIXED_LENGTH
                + "test-cluster".len()
                + HEADER_REPLICAS_LENGTH
                + HEADER_FENCE_LENGTH
                + 8) as u64
        );
        writer.append(b"a", b"bc", 1).expect("append");
        let first = (FRAME_HEADER_LENGTH + RECORD_HEADER_LENGTH + 3) as u64;
        assert_eq!(writer.bytes_written(), header + first);
        writer.append(b"d", b"", 2).expect("append");
        let second = (RECORD_HEADER_LENGTH + 1) as u64;
        assert_eq!(writer.bytes_written(), header + first + second);
    }

    #[test]
    fn a_key_too_long_for_the_format_is_refused() {
        let directory = TestDirectory::new("long-key");
        let mut writer = SnapshotWriter::create(&directory.path, &meta(1)).expect("create");
        let error = writer
            .append(&vec![b'k'; 65_536], b"v", 0)
            .expect_err("a key over 65535 bytes");
        assert!(error.to_string().contains("65536-byte key"), "{error}");
        writer
            .append(&vec![b'k'; 65_535], b"v", 0)
            .expect("the longest key");
    }

    #[test]
    fn a_file_truncated_at_any_length_is_refused_naming_the_file() {
        let directory = TestDirectory::new("truncated");
        write(&directory.path, &meta(1), &small_records(20), 100);
        let whole = fs::read(directory.path.join(SNAPSHOT_FILE)).expect("read");
        let damaged = directory.path.join("damaged.rdkv");
        for length in 0..whole.len() {
            let context = format!("truncated to {length} of {} bytes", whole.len());
            let message = assert_refused(&damaged, &whole[..length], &context);
            assert!(message.contains("truncated"), "{context}: {message}");
        }
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let directory = TestDirectory::new("flipped");
        write(&directory.path, &meta(1), &small_records(20), 100);
        let whole = fs::read(directory.path.join(SNAPSHOT_FILE)).expect("read");
        let damaged = directory.path.join("damaged.rdkv");
        for offset in 0..whole.len() {
            let mut bytes = whole.clone();
            bytes[offset] ^= 0x01;
            assert_refused(&damaged, &bytes, &format!("byte {offset} flipped"));
        }
    }

    #[test]
    fn bytes_after_the_trailer_are_refused() {
        let directory = TestDirectory::new("trailing");
        write(&directory.path, &meta(1), &small_records(3), FRAME_LIMIT);
        let mut bytes = fs::read(directory.path.join(SNAPSHOT_FILE)).expect("read");
        bytes.extend_from_slice(b"garbage");
        let damaged = directory.path.join("damaged.rdkv");
        let message = assert_refused(&damaged, &bytes, "trailing garbage");
        assert!(message.contains("7 bytes after the trailer"), "{message}");
    }

    #[test]
    fn frames_swapped_in_place_are_refused_by_the_chained_checksum() {
        let directory = TestDirectory::new("swapped");
        let records: Records = (0..6u8)
            .map(|index| (vec![index; 4], vec![index; 10]))
            .collect();
        // Two 28-byte records per frame: three frames of 76 bytes each.
        write(&directory.path, &meta(1), &records, 56);
        let mut bytes = fs::read(directory.path.join(SNAPSHOT_FILE)).expect("read");
        let header = HEADER_FIXED_LENGTH
            + "test-cluster".len()
            + HEADER_REPLICAS_LENGTH
            + HEADER_FENCE_LENGTH
            + 8;
        let frame = FRAME_HEADER_LENGTH + 56;
        assert_eq!(bytes.len(), header + 3 * frame + TRAILER_LENGTH);
        let (first, second) = bytes[header..header + 2 * frame].split_at_mut(frame);
        first.swap_with_slice(second);
        let damaged = directory.path.join("damaged.rdkv");
        let message = assert_refused(&damaged, &bytes, "frames swapped");
        assert!(message.contains("chained checksum"), "{message}");
    }

    #[test]
    fn a_frame_length_past_the_end_or_over_the_limit_is_refused() {
        let directory = TestDirectory::new("frame-length");
        write(&directory.path, &meta(1), &Vec::new(), FRAME_LIMIT);
        let whole = fs::read(directory.path.join(SNAPSHOT_FILE)).expect("read");
        let header = &whole[..whole.len() - TRAILER_LENGTH];
        let damaged = directory.path.join("damaged.rdkv");
        let frame_header = |length: u32, records: u32| {
            let mut bytes = header.to_vec();
            bytes.extend_from_slice(&FRAME_TAG);
            bytes.extend_from_slice(&length.to_le_bytes());
            bytes.extend_from_slice(&records.to_le_bytes());
            bytes.extend_from_slice(&0u64.to_le_bytes());
            bytes.extend_from_slice(&[0u8; 64]);
            bytes
        };
        let message = assert_refused(&damaged, &frame_header(u32::MAX, 1), "a 4 GiB frame");
        assert!(message.contains("truncated"), "{message}");
        assert!(message.contains("inside frame 1"), "{message}");
        let over_limit = (FRAME_LIMIT + 1) as u32;
        let message = assert_refused(&damaged, &frame_header(over_limit, 2), "a large frame");
        assert!(message.contains("more than one only within"), "{message}");
    }

    /// A file of format 2, written before the header carried `replicas`, is read: its
    /// records as they are, its `replicas` unknown.
    #[test]
    fn a_file_of_the_format_before_replicas_is_read_with_replicas_unknown() {
        let directory = TestDirectory::new("format-2");
        let records = small_records(30);
        let mut writer = SnapshotWriter::create_of_format(
            &directory.path,
            &meta(2),
            FRAME_LIMIT,
            FORMAT_WITHOUT_REPLICAS,
        )
        .expect("create");
        for (key, value) in &records {
            writer.append(key, value, 99).expect("append");
        }
        writer.finish().expect("finish");
        let mut versions = Vec::new();
        let loaded = read_snapshot(&directory.path.join(SNAPSHOT_FILE), |_, _, version| {
            versions.push(version);
        })
        .expect("a format 2 file reads");
        assert_eq!(loaded.keys, 30);
        assert!(versions.iter().all(|version| *version == 99));
        assert_eq!(
            loaded.meta,
            SnapshotMeta {
                replicas: None,
                fenced_at: None,
                ..meta(2)
            }
        );
        let current = TestDirectory::new("format-4");
        write(&current.path, &meta(2), &records, FRAME_LIMIT);
        let loaded = verify_snapshot(&current.path.join(SNAPSHOT_FILE)).expect("format 4");
        assert_eq!(loaded.meta.replicas, Some(2));
    }

    /// A file of format 3, written before the header carried the epoch its node stopped
    /// serving at, is read with that epoch unknown (it then decides over no other copy), and
    /// a file of format 4 keeps it.
    #[test]
    fn a_file_of_the_format_before_the_fence_epoch_is_read_with_it_unknown() {
        let directory = TestDirectory::new("format-3");
        let records = small_records(20);
        let mut writer = SnapshotWriter::create_of_format(
            &directory.path,
            &meta(5),
            FRAME_LIMIT,
            FORMAT_WITHOUT_FENCE,
        )
        .expect("create");
        for (key, value) in &records {
            writer.append(key, value, 7).expect("append");
        }
        writer.finish().expect("finish");
        let loaded = verify_snapshot(&directory.path.join(SNAPSHOT_FILE)).expect("format 3");
        assert_eq!(loaded.keys, 20);
        assert_eq!(
            loaded.meta,
            SnapshotMeta {
                fenced_at: None,
                ..meta(5)
            }
        );
        let current = TestDirectory::new("format-4-fence");
        write(&current.path, &meta(5), &records, FRAME_LIMIT);
        let loaded = verify_snapshot(&current.path.join(SNAPSHOT_FILE)).expect("format 4");
        assert_eq!(loaded.meta.fenced_at.map(|fence| fence.epoch), Some(5));
        let unfenced = TestDirectory::new("format-4-unfenced");
        let plain = SnapshotMeta {
            fenced_at: None,
            ..meta(5)
        };
        write(&unfenced.path, &plain, &records, FRAME_LIMIT);
        let loaded = verify_snapshot(&unfenced.path.join(SNAPSHOT_FILE)).expect("format 4");
        assert_eq!(loaded.meta, plain);
    }

    /// A file of format 1, written before records carried versions, is read: its keys have
    /// version 0.
    #[test]
    fn a_file_of_the_format_before_versions_is_read_with_version_0() {
        let directory = TestDirectory::new("format-1");
        let records = small_records(300);
        let mut writer =
            SnapshotWriter::create_without_versions(&directory.path, &meta(2)).expect("create");
        for (key, value) in &records {
            writer.append(key, value, 99).expect("append");
        }
        writer.finish().expect("finish");
        let mut visited = Vec::new();
        let loaded = read_snapshot(
            &directory.path.join(SNAPSHOT_FILE),
            |key, value, version| {
                visited.push((key.to_vec(), value.to_vec(), version));
            },
        )
        .expect("a format 1 file reads");
        assert_eq!(loaded.keys, 300);
        assert!(visited.iter().zip(&records).all(
            |((key, value, version), (wanted_key, wanted_value))| {
                key == wanted_key && value == wanted_value && *version == 0
            }
        ));
    }

    #[test]
    fn a_wrong_format_version_is_refused_naming_both_versions() {
        let directory = TestDirectory::new("version");
        write(&directory.path, &meta(1), &small_records(2), FRAME_LIMIT);
        let mut bytes = fs::read(directory.path.join(SNAPSHOT_FILE)).expect("read");
        bytes[MAGIC.len()..MAGIC.len() + 4].copy_from_slice(&5u32.to_le_bytes());
        let damaged = directory.path.join("damaged.rdkv");
        let message = assert_refused(&damaged, &bytes, "version 5");
        assert!(message.contains("format version 5"), "{message}");
        assert!(message.contains("reads versions 1 to 4"), "{message}");
        assert!(message.contains("newer"), "{message}");
        let message = assert_refused(&damaged, b"not a snapshot file at all", "wrong magic");
        assert!(message.contains("not an rdkv snapshot"), "{message}");
    }

    #[test]
    fn finish_keeps_the_old_snapshot_as_previous_and_both_read_back() {
        let directory = TestDirectory::new("previous");
        let data_dir = directory.path.join("nested").join("data");
        let (old, new) = (small_records(4), small_records(9));
        write(&data_dir, &meta(1), &old, FRAME_LIMIT);
        write(&data_dir, &meta(2), &new, FRAME_LIMIT);
        let (current, current_records) = read_all(&data_dir.join(SNAPSHOT_FILE)).expect("read");
        assert_eq!((current.meta, current_records), (meta(2), new.clone()));
        let (previous, previous_records) = read_all(&data_dir.join(PREVIOUS_FILE)).expect("read");
        assert_eq!((previous.meta, previous_records), (meta(1), old));
        // A third snapshot pushes the second one down and the first one out.
        write(&data_dir, &meta(3), &Vec::new(), FRAME_LIMIT);
        let previous = verify_snapshot(&data_dir.join(PREVIOUS_FILE)).expect("verify");
        assert_eq!(previous.meta, meta(2));
        let current = verify_snapshot(&data_dir.join(SNAPSHOT_FILE)).expect("verify");
        assert_eq!((current.meta, current.keys), (meta(3), 0));
        assert!(!data_dir.join(PREVIOUS_TEMPORARY_FILE).exists());
    }

    #[test]
    fn a_leftover_temporary_file_does_not_disturb_reading_and_is_overwritten() {
        let directory = TestDirectory::new("leftover");
        let records = small_records(5);
        write(&directory.path, &meta(1), &records, FRAME_LIMIT);
        // A crash mid-write leaves a partial temporary file, longer than the next one.
        let leftover = directory.path.join(TEMPORARY_FILE);
        fs::write(&leftover, vec![0x5a; 100_000]).expect("write the leftover");
        let (loaded, visited) = read_all(&directory.path.join(SNAPSHOT_FILE)).expect("read");
        assert_eq!((loaded.meta, visited), (meta(1), records));

        let mut writer = SnapshotWriter::create(&directory.path, &meta(2)).expect("create");
        assert_eq!(fs::metadata(&leftover).expect("metadata").len(), 0);
        writer
            .append(b"after", b"the crash", version_of(b"after", b"the crash"))
            .expect("append");
        writer.finish().expect("finish");
        let (loaded, visited) = read_all(&directory.path.join(SNAPSHOT_FILE)).expect("read");
        assert_eq!(loaded.meta, meta(2));
        assert_eq!(visited, vec![(b"after".to_vec(), b"the crash".to_vec())]);
        assert!(!leftover.exists());
    }

    #[test]
    fn dropping_an_unfinished_writer_removes_its_temporary_file_and_keeps_the_snapshot() {
        let directory = TestDirectory::new("dropped");
        let records = small_records(5);
        write(&directory.path, &meta(1), &records, FRAME_LIMIT);
        let mut writer = SnapshotWriter::create(&directory.path, &meta(2)).expect("create");
        for index in 0..10_000u32 {
            writer
                .append(&index.to_le_bytes(), b"abandoned", 0)
                .expect("append");
        }
        assert!(directory.path.join(TEMPORARY_FILE).exists());
        drop(writer);
        assert!(!directory.path.join(TEMPORARY_FILE).exists());
        let (loaded, visited) = read_all(&directory.path.join(SNAPSHOT_FILE)).expect("read");
        assert_eq!((loaded.meta, visited), (meta(1), records));
        assert!(!directory.path.join(PREVIOUS_FILE).exists());
    }
}
