//! `rdkv`: get, put, insert, delete, compare-and-swap and stats against a cluster from its file.
//! Arguments and dispatch live here; `input` reads keys and values (text, hex, files, stdin),
//! `output` prints values and describes keys, `hex` spells bytes.
//!
//! Exit codes (also in `--help` and `docs/operations.md`): 0 done, 1 not found (get, del), not
//! swapped (cas) or present (insert), 2 error.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rdkv_client::{CasOutcome, Client, ClientBuilder, InsertOutcome};
use rdkv_common::protocol::ClientCounters;

mod hex;
mod input;
mod output;

use input::KeyArgument;
use output::{describe_key, describe_value, print_value};

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

async fn execute(client: &Client, command: Command) -> anyhow::Result<ExitCode> {
    let code = match command {
        Command::Get { key, hex } => {
            let key = key.bytes()?;
            let shown = describe_key(&key);
            match client
                .get(&key)
                .await
                .with_context(|| format!("get {shown}"))?
            {
                Some(value) => {
                    print_value(&value, hex).context("write the value to stdout")?;
                    ExitCode::SUCCESS
                }
                None => {
                    eprintln!("rdkv: {shown}: not found");
                    ExitCode::from(1)
                }
            }
        }
        Command::Put {
            key,
            value,
            value_hex,
        } => {
            let value = input::value_or_stdin(value, value_hex, &key)?;
            let key = key.bytes()?;
            client
                .put(&key, &value)
                .await
                .with_context(|| format!("put {}", describe_key(&key)))?;
            ExitCode::SUCCESS
        }
        Command::Insert {
            key,
            value,
            value_hex,
            hex,
        } => {
            let value = input::value_or_stdin(value, value_hex, &key)?;
            let key = key.bytes()?;
            let shown = describe_key(&key);
            match client
                .insert_or_get(&key, &value)
                .await
                .with_context(|| format!("insert {shown}"))?
            {
                InsertOutcome::Inserted => ExitCode::SUCCESS,
                InsertOutcome::Present(present) => {
                    eprintln!("rdkv: {shown}: present, not inserted");
                    print_value(&present, hex).context("write the value to stdout")?;
                    ExitCode::from(1)
                }
            }
        }
        Command::Del { key } => {
            let key = key.bytes()?;
            let shown = describe_key(&key);
            if client
                .delete(&key)
                .await
                .with_context(|| format!("delete {shown}"))?
            {
                ExitCode::SUCCESS
            } else {
                eprintln!("rdkv: {shown}: not found");
                ExitCode::from(1)
            }
        }
        Command::Cas {
            key,
            expected,
            new,
            value_hex,
            hex,
        } => {
            let expected = input::value_bytes(expected, value_hex, "EXPECTED")?;
            let new = input::value_bytes(new, value_hex, "NEW")?;
            let key = key.bytes()?;
            let shown = describe_key(&key);
            match client
                .compare_and_swap(&key, &expected, &new)
                .await
                .with_context(|| format!("compare-and-swap {shown}"))?
            {
                CasOutcome::Swapped => ExitCode::SUCCESS,
                CasOutcome::Mismatch(current) => {
                    match current {
                        Some(current) => eprintln!(
                            "rdkv: {shown}: not swapped; the value is {}",
                            describe_value(&current, hex)
                        ),
                        None => eprintln!("rdkv: {shown}: not swapped; the key is absent"),
                    }
                    ExitCode::from(1)
                }
            }
        }
        Command::Stats => {
            let mut total = ClientCounters::default();
            let mut down = 0;
            // Data connections first, as every other command opens them: the table then shows
            // the fabric this host's clients get from each node (a node that is down shows so
            // below).
            let _ = client.connect_all().await;
            rdkv_common::outln!(
                "{:<5} {:<6} {:>9} {:<5} {:>6} {:<18} {:>8} {:>10} {:>14} {:>12} {:>10}",
                "node",
                "state",
                "uptime",
                "via",
                "conns",
                "data conns",
                "keys",
                "heap used",
                "client ops",
                "round trips",
                "rt/op"
            );
            for (id, stats) in client.cluster_stats().await {
                match stats {
                    Ok(stats) => {
                        let counters = stats.client_counters;
                        total.add(&counters);
                        rdkv_common::outln!(
                            "{:<5} {:<6} {:>8}s {:<5} {:>6} {:<18} {:>8} {:>10} {:>14} {:>12} {:>10.2}",
                            id,
                            "up",
                            stats.uptime_seconds,
                            client
                                .connection_fabric(id)
                                .map_or_else(|| "-".to_string(), |fabric| fabric.to_string()),
                            stats.connections,
                            output::data_connections(&stats),
                            stats.keys,
                            rdkv_cluster_file::units::format_bytes(stats.heap_used_bytes),
                            counters.operations,
                            counters.round_trips,
                            counters.round_trips_per_operation()
                        );
                        if stats.heap_low() {
                            rdkv_common::outln!(
                                "      warning: heap under 10% free ({} of {}): writes may wait for reclamation; raise heap_size (docs/operations.md, Sizing the heap)",
                                rdkv_cluster_file::units::format_bytes(stats.heap_free_bytes),
                                rdkv_cluster_file::units::format_bytes(stats.heap_size_bytes)
                            );
                        }
                    }
                    Err(rdkv_client::Error::AuthenticationFailed { reason, .. }) => {
                        down += 1;
                        rdkv_common::outln!("{id:<5} {:<6} {reason}", "auth failed");
                    }
                    Err(error) => {
                        down += 1;
                        rdkv_common::outln!("{id:<5} {:<6} {error}", "down");
                    }
                }
            }
            rdkv_common::outln!(
                "cluster: {} client operations ({} GETs, {} mutations, {} failed), {:.2} round trips per operation, {:.2} per GET, {:.2} work requests per operation, {} CAS races lost, {} checksum retries",
                total.operations,
                total.gets,
                total.mutations,
                total.failures,
                total.round_trips_per_operation(),
                total.round_trips_per_get(),
                total.verbs_per_operation(),
                total.cas_failures,
                total.checksum_retries
            );
            match client.view().await {
                Ok(view) => rdkv_common::outln!("view: {}", view.summary()),
                Err(error) => rdkv_common::outln!("view: {error}"),
            }
            if down > 0 {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            }
        }
    };
    Ok(code)
}
