//! `rdkv-cluster`: start, stop and inspect an rdkv cluster on this machine from its cluster file.
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use rdkv_cluster_config::launcher::{self, say};

/// Start, stop and inspect an rdkv cluster on this machine from its cluster file.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Arguments {
    /// Where pid and log files go (default: .rdkv/<cluster name> in the current directory).
    #[arg(long, global = true)]
    run_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Start every node, wait until each is ready, print the nodes, then forward their logs
    /// until Ctrl-C (which stops the nodes in order).
    Up {
        /// The cluster file.
        file: PathBuf,
        /// Leave the nodes running in the background, logging to the run directory.
        #[arg(long)]
        detach: bool,
    },
    /// Stop every node started from the run directory, in order.
    Down {
        /// The cluster file.
        file: PathBuf,
    },
    /// One row per node: up or down, uptime, connections, queue pairs, keys, memory.
    Status {
        /// The cluster file.
        file: PathBuf,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let arguments = Arguments::parse();
    let file = match &arguments.command {
        Action::Up { file, .. } | Action::Down { file } | Action::Status { file } => file.clone(),
    };
    let config = rdkv_cluster_config::load(&file)?;
    for warning in &config.warnings {
        eprintln!("warning: {warning}");
    }
    let run_directory = arguments
        .run_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(".rdkv").join(&config.name));
    match arguments.command {
        Action::Up { detach, .. } => {
            let mut nodes = launcher::start(&config, &run_directory, detach)?;
            let rows: Vec<Vec<String>> = nodes
                .iter()
                .map(|node| {
                    let field = |name: &str| {
                        node.ready
                            .ready_line
                            .split_whitespace()
                            .find_map(|part| part.strip_prefix(name))
                            .unwrap_or("-")
                            .to_string()
                    };
                    vec![
                        node.ready.id.to_string(),
                        node.ready.pid.to_string(),
                        field("control="),
                        field("fabric="),
                        field("metrics="),
                        "ready".into(),
                    ]
                })
                .collect();
            say(&format!(
                "cluster `{}` is up ({} nodes, fabric {:?}):",
                config.name,
                nodes.len(),
                config.fabric
            ));
            say(&launcher::table(
                &["node", "pid", "control", "fabric", "metrics", "state"],
                &rows,
            ));
            if detach {
                say(&format!(
                    "detached; logs and pid files in {}. Stop with `rdkv-cluster down {}`.",
                    run_directory.display(),
                    file.display()
                ));
                return Ok(());
            }
            say("forwarding node logs; Ctrl-C stops the cluster");
            for node in &mut nodes {
                if let Some(stderr) = node.child.stderr.take() {
                    let id = node.ready.id;
                    std::thread::spawn(move || {
                        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                            eprintln!("[node {id}] {line}");
                        }
                    });
                }
            }
            rdkv_common::process::shutdown_signal().await;
            say("stopping the cluster");
            for node in &mut nodes {
                launcher::stop_child(node, &run_directory);
                say(&format!("node {}: stopped", node.ready.id));
            }
        }
        Action::Down { .. } => {
            for line in launcher::stop(&config, &run_directory)? {
                say(&line);
            }
        }
        Action::Status { .. } => {
            let statuses = launcher::status(&config).await;
            say(&launcher::status_table(&statuses));
        }
    }
    Ok(())
}
