//! Real `rdkv-server` processes for tests: started on port 0, ready when they print their
//! ready line (no sleeping), killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// A workspace binary next to this test executable (`target/<profile>/NAME`). `cargo test
/// --workspace` builds `rdkv-server` and `rdkv-cluster` because their packages have
/// integration tests.
pub fn workspace_binary(name: &str) -> PathBuf {
    let executable = std::env::current_exe().expect("the test executable's path");
    let profile_directory = executable
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps");
    let binary = profile_directory.join(name);
    assert!(
        binary.exists(),
        "{} is missing: build it with `cargo build --workspace --bins` (cargo test --workspace does)",
        binary.display()
    );
    binary
}

/// The `rdkv-server` binary.
pub fn server_binary() -> PathBuf {
    workspace_binary("rdkv-server")
}

/// A running server process.
pub struct ServerProcess {
    /// The child.
    child: Child,
    /// Its control address.
    pub control_address: SocketAddr,
    /// Its soft NIC address.
    pub fabric_address: SocketAddr,
}

impl ServerProcess {
    /// Starts `rdkv-server` on loopback with port 0 and `extra` arguments, and waits for its
    /// ready line.
    pub fn start(secret: &str, extra: &[&str]) -> Self {
        Self::start_at(secret, "127.0.0.1:0", "127.0.0.1:0", extra)
    }

    /// Starts `rdkv-server` on the given control and fabric addresses (to restart a node where
    /// it was), with `extra` arguments, and waits for its ready line.
    pub fn start_at(secret: &str, control: &str, fabric: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(server_binary())
            .args(["--listen", control, "--fabric-listen", fabric])
            .args(extra)
            .env("RDKV_SECRET", secret)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rdkv-server");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the ready line");
        let field = |name: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(name))
                .and_then(|address| address.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in the ready line `{line}`"))
        };
        let control_address = field("control=");
        let fabric_address = field("fabric=");
        Self {
            child,
            control_address,
            fabric_address,
        }
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
