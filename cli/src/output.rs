//! What the CLI prints: stored values on stdout (raw bytes or hex), and keys and values in
//! messages on stderr.

use std::io::{IsTerminal, Write};

use crate::hex;

/// Writes a stored value to stdout. Raw bytes are written exactly, followed by a newline only
/// when stdout is a terminal (so a pipe or file receives the value and nothing else); with
/// `as_hex`, the hex digits are a line of text, always newline-terminated.
///
/// # Errors
/// When stdout cannot be written (a closed pipe).
pub fn print_value(value: &[u8], as_hex: bool) -> std::io::Result<()> {
    let written = write_value(value, as_hex);
    // A reader that closed the pipe (`rdkv get KEY | head -c 1`) wanted no more: exit 0
    // quietly, as every other output of the CLI does (`rdkv_common::process::write_stdout`).
    if let Err(error) = &written {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            rdkv_common::process::exit_now(0);
        }
    }
    written
}

/// Writes `value` (hex with `as_hex`) to stdout, a newline after it on a terminal.
fn write_value(value: &[u8], as_hex: bool) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    if as_hex {
        writeln!(stdout, "{}", hex::encode(value))?;
    } else {
        stdout.write_all(value)?;
        if std::io::stdout().is_terminal() {
            stdout.write_all(b"\n")?;
        }
    }
    stdout.flush()
}

/// A key for a message: its text when it is printable UTF-8, else `0x` and its hex digits
/// (which `--key-hex` accepts back).
pub fn describe_key(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(text) if !text.is_empty() && !text.chars().any(char::is_control) => text.to_string(),
        _ => format!("0x{}", hex::encode(key)),
    }
}

/// A value for a message: quoted text (lossy, escaped), or its hex digits with `as_hex`.
pub fn describe_value(value: &[u8], as_hex: bool) -> String {
    if as_hex {
        format!("{} (hex)", hex::encode(value))
    } else {
        format!("{:?}", String::from_utf8_lossy(value))
    }
}

/// A node's data connections by fabric, for `rdkv stats`: `soft 2, shm 1` (the main fabric,
/// then the node's `shm` fabric when any client uses it).
pub fn data_connections(stats: &rdkv_common::protocol::ServerStats) -> String {
    let main = stats
        .fabric
        .map_or_else(|| "fabric".to_string(), |fabric| fabric.to_string());
    let mut text = format!("{main} {}", stats.data_connections);
    if stats.shm_data_connections > 0 {
        text.push_str(&format!(", shm {}", stats.shm_data_connections));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_show_as_text_when_printable_else_as_hex() {
        assert_eq!(describe_key(b"user:1"), "user:1");
        assert_eq!(describe_key(&[0x00, 0xff]), "0x00ff");
        assert_eq!(describe_key(b"line\n"), "0x6c696e650a");
    }
}
