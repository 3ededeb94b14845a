//! `rdkv`: get, put, insert, delete, compare-and-swap and stats against a cluster from its file.
//! Arguments and dispatch live here; `commands` runs the key commands and `stats` the table,
//! `input` reads keys and values (text, hex, files, stdin), `output` prints values and describes
//! keys, `hex` spells bytes.
//!
//! Exit codes (also in `--help` and `docs/operations.md`): 0 done, 1 not found (get, del), not
//! swapped (cas) or present (insert), 2 error.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rdkv_client::{Client, ClientBuilder};

mod commands;
mod hex;
mod input;
mod output;
mod stats;

use input::KeyArgument;

/// What `rdkv --help` prints after the options.
const AFTER_HELP: &str = "\
Keys and values are bytes. KEY is text (its UTF-8 bytes) unless --key-hex (hex digits, two per
byte) or --key-file (a file's exact bytes; `-`: stdin) says otherwise; --value-hex does the same
for VALUE, EXPECTED and NEW. put and insert read the value from stdin when VALUE is absent; the
key and the value cannot both come from stdin.

Output: get (and insert, when the key is present) prints the value's exact bytes, plus a newline
only when stdout is a terminal, so that a pipe receives the value and nothing else; with --hex,
a line of hex digits.

Exit codes:
  0  done: found (get), stored (put), inserted (insert), deleted (del), swapped (cas), every
     node answered (stats)
  1  not found (get, del), not swapped (cas), present (insert; its value is printed)
  2  error: usage, the cluster file, an input, an unreachable node, a timeout (the message says
     whether a write may have applied); stats: a node is down, or refused the secret (its row
     says `auth failed`)
Errors print as one line on stderr: `rdkv: what failed: why`.";

/// Talk to an rdkv cluster: values go in as arguments or on stdin and come out on stdout.
#[derive(Debug, Parser)]
#[command(version, about, after_help = AFTER_HELP)]
struct Arguments {
    /// The cluster file.
    #[arg(long, short = 'c', env = "RDKV_CONFIG")]
    config: PathBuf,
    /// The fabric: auto (a node's shm fabric when this host is the node's and it offers one,
    /// else the cluster's), shm (required), or the cluster's (soft, verbs).
    #[arg(long, default_value = "auto", env = "RDKV_FABRIC")]
    fabric: rdkv_client::FabricChoice,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the value of KEY (exit 1 when absent).
    Get {
        #[command(flatten)]
        key: KeyArgument,
        /// Print the value as hex digits and a newline.
        #[arg(long)]
        hex: bool,
    },
    /// Store VALUE (or stdin when VALUE is absent) under KEY.
    Put {
        #[command(flatten)]
        key: KeyArgument,
        /// The value; read from stdin when absent.
        value: Option<String>,
        /// VALUE is hex digits.
        #[arg(long)]
        value_hex: bool,
    },
    /// Store VALUE (or stdin) under KEY only if KEY is absent; when it is present, print its
    /// value and exit 1.
    Insert {
        #[command(flatten)]
        key: KeyArgument,
        /// The value; read from stdin when absent.
        value: Option<String>,
        /// VALUE is hex digits.
        #[arg(long)]
        value_hex: bool,
        /// Print the present value as hex digits and a newline.
        #[arg(long)]
        hex: bool,
    },
    /// Delete KEY (exit 1 when absent).
    Del {
        #[command(flatten)]
        key: KeyArgument,
    },
    /// Replace KEY's value with NEW only if it is EXPECTED (exit 1, naming the value found,
    /// when not); `insert` sets a value only if the key is absent.
    Cas {
        #[command(flatten)]
        key: KeyArgument,
        /// The value required.
        expected: String,
        /// The new value.
        new: String,
        /// EXPECTED and NEW are hex digits.
        #[arg(long)]
        value_hex: bool,
        /// Show the value found, when not swapped, as hex digits.
        #[arg(long)]
        hex: bool,
    },
    /// Cluster-wide counters: per node (with `via`, the fabric this host's clients get from
    /// it: `shm` on the node's host, else the cluster's; and its data connections per fabric),
    /// and the clients' one-sided work (round trips per operation), then the cluster view
    /// (epoch, leader, each node serving or down).
    Stats,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let _logging = rdkv_common::process::init_logging("warn");
    let arguments = Arguments::parse();
    match run(arguments).await {
        Ok(code) => code,
        Err(error) => {
            // `{:#}`: the causes on one line, and never a backtrace (even with RUST_BACKTRACE).
            eprintln!("rdkv: {error:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(arguments: Arguments) -> anyhow::Result<ExitCode> {
    let client = ClientBuilder::cluster_file(&arguments.config)
        .fabric(arguments.fabric)
        .build()?;
    let outcome = execute(&client, arguments.command).await;
    // Also after an error: the nodes hear a goodbye instead of a dropped connection.
    client.close().await;
    outcome
}

/// Runs one command: the dispatch to its function.
async fn execute(client: &Client, command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Get { key, hex } => commands::get(client, key, hex).await,
        Command::Put {
            key,
            value,
            value_hex,
        } => commands::put(client, key, value, value_hex).await,
        Command::Insert {
            key,
            value,
            value_hex,
            hex,
        } => commands::insert(client, key, value, value_hex, hex).await,
        Command::Del { key } => commands::delete(client, key).await,
        Command::Cas {
            key,
            expected,
            new,
            value_hex,
            hex,
        } => commands::compare_and_swap(client, key, expected, new, value_hex, hex).await,
        Command::Stats => Ok(stats::stats(client).await),
    }
}
