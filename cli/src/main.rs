//! `rdkv`: get, put, delete, compare-and-swap and stats against a cluster from its file.
//!
//! Exit codes: 0 found / done, 1 not found (get, del) or not swapped (cas), 2 error.
#![forbid(unsafe_code)]

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rdkv_client::{CasOutcome, Client};
use rdkv_common::protocol::ClientCounters;

/// Talk to an rdkv cluster: values go in as arguments or on stdin and come out on stdout.
#[derive(Debug, Parser)]
#[command(
    version,
    about,
    after_help = "Exit codes: 0 found or done, 1 not found or not swapped, 2 error."
)]
struct Arguments {
    /// The cluster file.
    #[arg(long, short = 'c', env = "RDKV_CONFIG")]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the value of KEY.
    Get {
        /// The key.
        key: String,
    },
    /// Store VALUE (or stdin when VALUE is absent) under KEY.
    Put {
        /// The key.
        key: String,
        /// The value; read from stdin when absent.
        value: Option<String>,
    },
    /// Delete KEY.
    Del {
        /// The key.
        key: String,
    },
    /// Replace KEY's value with NEW only if it is EXPECTED.
    Cas {
        /// The key.
        key: String,
        /// The value required.
        expected: String,
        /// The new value.
        new: String,
    },
    /// Cluster-wide counters: per node, and the clients' one-sided work (round trips per
    /// operation).
    Stats,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    rdkv_common::process::init_logging("warn");
    let arguments = Arguments::parse();
    match run(arguments).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("rdkv: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn print_value(value: &[u8]) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(value)?;
    if std::io::stdout().is_terminal() {
        stdout.write_all(b"\n")?;
    }
    stdout.flush()
}

async fn run(arguments: Arguments) -> anyhow::Result<ExitCode> {
    let client = Client::from_file(&arguments.config)?;
    let code = match arguments.command {
        Command::Get { key } => match client.get(key.as_bytes()).await? {
            Some(value) => {
                print_value(&value)?;
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("rdkv: {key}: not found");
                ExitCode::from(1)
            }
        },
        Command::Put { key, value } => {
            let value = match value {
                Some(value) => value.into_bytes(),
                None => {
                    let mut bytes = Vec::new();
                    std::io::stdin().read_to_end(&mut bytes)?;
                    bytes
                }
            };
            client.put(key.as_bytes(), &value).await?;
            ExitCode::SUCCESS
        }
        Command::Del { key } => {
            if client.delete(key.as_bytes()).await? {
                ExitCode::SUCCESS
            } else {
                eprintln!("rdkv: {key}: not found");
                ExitCode::from(1)
            }
        }
        Command::Cas { key, expected, new } => {
            match client
                .compare_and_swap(key.as_bytes(), expected.as_bytes(), new.as_bytes())
                .await?
            {
                CasOutcome::Swapped => ExitCode::SUCCESS,
                CasOutcome::Mismatch(current) => {
                    match current {
                        Some(current) => eprintln!(
                            "rdkv: {key}: not swapped; the value is {:?}",
                            String::from_utf8_lossy(&current)
                        ),
                        None => eprintln!("rdkv: {key}: not swapped; the key is absent"),
                    }
                    ExitCode::from(1)
                }
            }
        }
        Command::Stats => {
            let mut total = ClientCounters::default();
            let mut down = 0;
            println!(
                "{:<5} {:<6} {:>9} {:>6} {:>8} {:>10} {:>14} {:>12} {:>10}",
                "node",
                "state",
                "uptime",
                "conns",
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
                        println!(
                            "{:<5} {:<6} {:>8}s {:>6} {:>8} {:>10} {:>14} {:>12} {:>10.2}",
                            id,
                            "up",
                            stats.uptime_seconds,
                            stats.connections,
                            stats.keys,
                            rdkv_cluster_file::units::format_bytes(stats.heap_used_bytes),
                            counters.operations,
                            counters.round_trips,
                            counters.round_trips_per_operation()
                        );
                        if stats.heap_low() {
                            println!(
                                "      warning: heap under 10% free ({} of {}): writes may wait for reclamation; raise heap_size (docs/operations.md, Sizing the heap)",
                                rdkv_cluster_file::units::format_bytes(stats.heap_free_bytes),
                                rdkv_cluster_file::units::format_bytes(stats.heap_size_bytes)
                            );
                        }
                    }
                    Err(error) => {
                        down += 1;
                        println!("{id:<5} {:<6} {error}", "down");
                    }
                }
            }
            println!(
                "cluster: {} client operations ({} GETs, {} mutations), {:.2} round trips per operation, {:.2} per GET, {:.2} work requests per operation, {} CAS races lost, {} checksum retries",
                total.operations,
                total.gets,
                total.mutations,
                total.round_trips_per_operation(),
                total.round_trips_per_get(),
                total.verbs_per_operation(),
                total.cas_failures,
                total.checksum_retries
            );
            if down > 0 {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            }
        }
    };
    client.close().await;
    Ok(code)
}
