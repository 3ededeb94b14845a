//! Where the CLI's keys and values come from: arguments as text (their UTF-8 bytes) or as hex
//! digits, a key file, or stdin. At most one input reads stdin.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context};

use crate::hex;

/// How a command's KEY is given. With neither flag, KEY's UTF-8 bytes are the key.
#[derive(Debug, clap::Args)]
pub struct KeyArgument {
    /// The key: its text, or hex digits with --key-hex, or a file with --key-file.
    #[arg(value_name = "KEY")]
    key: String,
    /// KEY is hexadecimal digits, two per byte, for binary keys: `--key-hex 00ff`.
    #[arg(long, conflicts_with = "key_file")]
    key_hex: bool,
    /// KEY is a file whose exact bytes are the key (no newline is stripped); `--key-file -`
    /// reads the key from stdin.
    #[arg(long)]
    key_file: bool,
}

impl KeyArgument {
    /// Whether the key comes from stdin.
    pub fn reads_stdin(&self) -> bool {
        self.key_file && self.key == "-"
    }

    /// The key's bytes.
    ///
    /// # Errors
    /// When the hex digits are invalid or the key file cannot be read.
    pub fn bytes(&self) -> anyhow::Result<Vec<u8>> {
        if self.key_hex {
            hex::decode(&self.key).context("read the key from --key-hex")
        } else if self.reads_stdin() {
            read_stdin().context("read the key from stdin")
        } else if self.key_file {
            std::fs::read(Path::new(&self.key))
                .with_context(|| format!("read the key from {}", self.key))
        } else {
            Ok(self.key.clone().into_bytes())
        }
    }
}

/// The bytes of a value argument: its UTF-8 bytes, or the bytes its hex digits spell.
///
/// # Errors
/// When `hex` is set and the digits are invalid.
pub fn value_bytes(argument: String, hex: bool, name: &str) -> anyhow::Result<Vec<u8>> {
    if hex {
        hex::decode(&argument).with_context(|| format!("read {name} from --value-hex"))
    } else {
        Ok(argument.into_bytes())
    }
}

/// The value of a command that reads it from stdin when the argument is absent (put, insert).
///
/// # Errors
/// When the key claims stdin too, the hex digits are invalid, or stdin cannot be read.
pub fn value_or_stdin(
    argument: Option<String>,
    hex: bool,
    key: &KeyArgument,
) -> anyhow::Result<Vec<u8>> {
    match argument {
        Some(argument) => value_bytes(argument, hex, "VALUE"),
        None if key.reads_stdin() => bail!(
            "the key and the value cannot both come from stdin: give VALUE as an argument, or \
             the key as text, with --key-hex, or in a file"
        ),
        None if hex => bail!("--value-hex needs VALUE as an argument (stdin is read as raw bytes)"),
        None => read_stdin().context("read the value from stdin"),
    }
}

/// All of stdin, exactly.
fn read_stdin() -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::io::stdin().read_to_end(&mut bytes)?;
    Ok(bytes)
}
