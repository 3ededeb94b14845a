//! A cluster launched from `examples/local-3node.toml` through the `rdkv-cluster` binary, on
//! ports reserved for it, for tests that need real node processes.

use std::path::{Path, PathBuf};
use std::process::Command;

use rdkv_common::ports::ReservedPorts;

use crate::process::workspace_binary;

/// The example file with every port replaced by a reserved one, written into `directory`; and
/// the reservation, which the caller holds until the cluster is stopped.
///
/// The nodes' ports must be in the file before they start (each node dials its peers, clients
/// read it), so the nodes cannot bind port 0 themselves: the ports are bound to port 0 here and
/// held ([`ReservedPorts`]), and the nodes bind them alongside the reservation. No other
/// process can take one before a node binds it, or while `rdkv-cluster restart` has a node
/// down.
pub fn generate_cluster_file(directory: &Path) -> (PathBuf, ReservedPorts) {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/local-3node.toml");
    let mut text = std::fs::read_to_string(example).expect("read the example");
    let example_ports = [
        "7400", "7401", "7402", "7410", "7411", "7412", "7420", "7421", "7422",
    ];
    let reserved = ReservedPorts::loopback(example_ports.len()).expect("reserve loopback ports");
    for (port, reserved) in example_ports.iter().zip(reserved.ports()) {
        text = text.replace(&format!(":{port}\""), &format!(":{reserved}\""));
    }
    let path = directory.join("cluster.toml");
    std::fs::write(&path, text).expect("write the cluster file");
    (path, reserved)
}

/// Runs `rdkv-cluster` with `arguments`.
pub fn rdkv_cluster(arguments: &[&str]) -> std::process::Output {
    Command::new(workspace_binary("rdkv-cluster"))
        .args(arguments)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run rdkv-cluster")
}

/// Stops the cluster even if the test fails.
pub struct Cluster {
    /// The cluster file.
    pub file: PathBuf,
    /// The run directory.
    pub run_directory: PathBuf,
    /// The ports the file names, held until the nodes are stopped (dropped after `down`, as
    /// fields drop after `drop`).
    pub ports: ReservedPorts,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = rdkv_cluster(&[
            "down",
            self.file.to_str().unwrap_or_default(),
            "--run-dir",
            self.run_directory.to_str().unwrap_or_default(),
        ]);
        let _ = std::fs::remove_dir_all(self.file.parent().unwrap_or(Path::new("/nonexistent")));
    }
}

impl Cluster {
    /// Generates a cluster file from the example in a fresh directory named after `tag` and
    /// starts the cluster detached (`rdkv-cluster up --detach`); panics with its stderr if it
    /// does not start.
    pub fn up(tag: &str) -> Self {
        Self::up_with(tag, |text| text)
    }

    /// As [`Cluster::up`], with the generated file's text changed by `edit` first.
    pub fn up_with(tag: &str, edit: impl FnOnce(String) -> String) -> Self {
        let directory = std::env::temp_dir().join(format!("rdkv-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("directory");
        let (file, ports) = generate_cluster_file(&directory);
        let text = std::fs::read_to_string(&file).expect("read the generated file");
        std::fs::write(&file, edit(text)).expect("write the edited file");
        let run_directory = directory.join("run");
        let up = rdkv_cluster(&[
            "up",
            file.to_str().expect("utf-8 path"),
            "--detach",
            "--run-dir",
            run_directory.to_str().expect("utf-8 path"),
        ]);
        // Built first, so that a failed start still stops the nodes it started (its drop runs
        // as the panic unwinds: a node that never served kept running after the test).
        let cluster = Self {
            file,
            run_directory,
            ports,
        };
        assert!(
            up.status.success(),
            "up failed: {}{}",
            String::from_utf8_lossy(&up.stdout),
            String::from_utf8_lossy(&up.stderr)
        );
        cluster
    }
}
