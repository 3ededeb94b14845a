//! The node's own log file (`rdkv-server --log-file PATH`, which `rdkv-cluster` passes for a
//! node it starts in the background): appended to, never truncated, so the log of a run that
//! crashed is still there after a restart; and rotated by size, with a bounded number of
//! older files, so a long-running node cannot fill the disk.
//!
//! - Each start writes a first line, `rdkv-server (pid N) started: …`, which marks where that
//!   run's lines begin (`rdkv-cluster up` in the foreground follows a restarted node's log
//!   from there).
//! - Before a line that would take the file past the rotation size, the file becomes
//!   `PATH.1` (the older ones move up to `PATH.2` …, and the oldest beyond the count kept is
//!   deleted: `file-rotate` does the renaming), and a new `PATH` begins. A line (one write:
//!   the log's writer thread writes each line whole) is never split between two files.
//! - The process's stderr can follow the file (`redirect_stderr`): what is written there
//!   without `tracing` (a panic, the last error line) lands in the current file, not in a
//!   rotated or deleted one.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use file_rotate::compression::Compression;
use file_rotate::suffix::AppendCount;
use file_rotate::{ContentLimit, FileRotate};

use crate::error::{Error, Result};

/// The rotation size when none is given: 16 MiB.
pub const DEFAULT_ROTATE_SIZE: u64 = 16 << 20;
/// The older files kept when no count is given: with the current one, at most 5 × 16 MiB.
pub const DEFAULT_KEPT_FILES: usize = 4;

/// A log file that appends and rotates by size.
pub struct RotatingLog {
    /// The current file's path (older ones are this path with `.1`, `.2`, …).
    path: PathBuf,
    /// Renames the files on rotation and deletes the oldest; its own limit is off (this
    /// writer decides when to rotate, before a line, so that no line is split).
    files: FileRotate<AppendCount>,
    /// Bytes in the current file.
    written: u64,
    /// The size past which the next line goes into a new file.
    rotate_size: u64,
    /// Whether the process's stderr is pointed at the current file after each rotation.
    redirect_stderr: bool,
}

impl RotatingLog {
    /// Opens (or creates, mode 0600) `path` for appending, keeping `kept_files` older files
    /// of at most about `rotate_size` bytes each, and writes the start line.
    ///
    /// # Errors
    /// [`Error::LogFile`] when the file cannot be opened or written, or the sizes are zero.
    pub fn open(
        path: &Path,
        rotate_size: u64,
        kept_files: usize,
        redirect_stderr: bool,
    ) -> Result<Self> {
        let failure = |reason: String| Error::LogFile {
            path: path.to_path_buf(),
            reason,
        };
        if rotate_size == 0 || kept_files == 0 {
            return Err(failure(
                "the rotation size and the count of files kept must be above 0".into(),
            ));
        }
        // Absolute, so that the file has a parent directory (file-rotate needs one).
        let path = std::path::absolute(path)
            .map_err(|error| failure(format!("resolve the path: {error}")))?;
        let file = open_append(&path).map_err(|error| {
            failure(format!(
                "open for appending: {error}; check the directory exists and this user may write there"
            ))
        })?;
        let written = file
            .metadata()
            .map_err(|error| failure(format!("inspect: {error}")))?
            .len();
        let files = FileRotate::new(
            &path,
            AppendCount::new(kept_files),
            ContentLimit::None,
            Compression::None,
            // Each new file as private as the first (file-rotate's default follows the umask).
            Some(private_file_options()),
        );
        let mut log = Self {
            path,
            files,
            written,
            rotate_size,
            redirect_stderr,
        };
        log.point_stderr_here()
            .map_err(|error| failure(format!("point stderr at it: {error}")))?;
        let start = format!(
            "rdkv-server (pid {}) started: appending to this log; it is rotated at {} bytes, with {kept_files} older files kept ({}.1 the newest)\n",
            std::process::id(),
            rotate_size,
            log.path.display()
        );
        log.write_all(start.as_bytes())
            .map_err(|error| failure(format!("write: {error}")))?;
        Ok(log)
    }

    /// The start line's prefix for process `pid`: where that run's lines begin.
    pub fn start_marker(pid: u32) -> String {
        format!("rdkv-server (pid {pid}) started: ")
    }

    /// Moves the current file to `PATH.1` (and the older ones up), starts a new one.
    fn rotate(&mut self) -> io::Result<()> {
        self.files.rotate()?;
        self.written = 0;
        self.point_stderr_here()
    }

    /// Points the process's stderr at the current file, when asked to.
    fn point_stderr_here(&self) -> io::Result<()> {
        if !self.redirect_stderr {
            return Ok(());
        }
        let file = open_append(&self.path)?;
        nix::unistd::dup2_stderr(&file).map_err(io::Error::from)
    }
}

impl Write for RotatingLog {
    fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
        let length = buffer.len() as u64;
        if self.written > 0 && self.written + length > self.rotate_size {
            self.rotate()?;
        }
        // With its own limit off, file-rotate writes the whole buffer to the current file.
        let written = self.files.write(buffer)?;
        self.written += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.files.flush()
    }
}

/// Opens `path` for appending, creating it mode 0600 (a log names clients and addresses).
fn open_append(path: &Path) -> io::Result<std::fs::File> {
    private_file_options().open(path)
}

/// Appending, created 0600, never through a symbolic link (one planted at the log's path by
/// someone who may write the run directory would send the node's lines elsewhere).
fn private_file_options() -> std::fs::OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options
        .read(true)
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits());
    options
}

#[cfg(test)]
mod tests {
    use super::*;

    fn directory(name: &str) -> PathBuf {
        let directory =
            std::env::temp_dir().join(format!("rdkv-log-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).expect("a test directory");
        directory
    }

    #[test]
    fn a_second_open_appends_after_the_first_runs_lines() {
        let directory = directory("append");
        let path = directory.join("node-1.log");
        let mut first = RotatingLog::open(&path, 1 << 20, 2, false).expect("open");
        first
            .write_all(b"the first run's last line\n")
            .expect("write");
        drop(first);
        let mut second = RotatingLog::open(&path, 1 << 20, 2, false).expect("open again");
        second.write_all(b"the second run\n").expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        let first_line = text.find("the first run's last line").expect("kept");
        let second_start = text.rfind(&RotatingLog::start_marker(std::process::id()));
        assert!(
            second_start.is_some_and(|start| start > first_line),
            "{text}"
        );
        assert_eq!(text.matches(" started: appending").count(), 2, "{text}");
        let _ = std::fs::remove_dir_all(&directory);
    }

    #[test]
    fn rotation_keeps_whole_private_lines_in_a_bounded_number_of_files() {
        let directory = directory("rotate");
        let path = directory.join("node-1.log");
        let mut log = RotatingLog::open(&path, 300, 3, false).expect("open");
        // One write per line, as the log's writer thread does.
        for line in 0..200 {
            let line = format!("line {line:04} of the log, about forty bytes\n");
            log.write_all(line.as_bytes()).expect("write");
        }
        log.flush().expect("flush");
        let mut names: Vec<String> = std::fs::read_dir(&directory)
            .expect("list")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["node-1.log", "node-1.log.1", "node-1.log.2", "node-1.log.3"]
        );
        for name in &names {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(directory.join(name))
                .expect("metadata")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{name}: {mode:o}");
            let text = std::fs::read_to_string(directory.join(name)).expect("read");
            assert!(text.len() <= 300, "{name}: {} bytes", text.len());
            assert!(
                text.lines()
                    .all(|line| line.starts_with("line ") && line.ends_with("bytes")),
                "{name} holds a cut line: {text}"
            );
        }
        let newest = std::fs::read_to_string(&path).expect("read");
        assert!(
            newest.ends_with("line 0199 of the log, about forty bytes\n"),
            "{newest}"
        );
        let _ = std::fs::remove_dir_all(&directory);
    }

    #[test]
    fn a_symbolic_link_at_the_log_path_is_refused() {
        let directory = directory("link");
        let target = directory.join("elsewhere");
        let path = directory.join("node-1.log");
        std::os::unix::fs::symlink(&target, &path).expect("link");
        assert!(RotatingLog::open(&path, 300, 3, false).is_err());
        assert!(!target.exists(), "nothing written through the link");
        let _ = std::fs::remove_dir_all(&directory);
    }
}
