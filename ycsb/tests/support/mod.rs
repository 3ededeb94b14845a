//! What the `rdkv-ycsb` command tests share: a temporary directory, and a run of the binary
//! that must succeed.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A directory removed on drop.
pub struct TestDirectory(PathBuf);

impl TestDirectory {
    /// A fresh directory for the test `name` of this process.
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("rdkv-ycsb-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create the test directory");
        Self(path)
    }

    /// The path of `name` in the directory, as a command-line argument.
    pub fn file(&self, name: &str) -> String {
        self.0
            .join(name)
            .to_str()
            .expect("a UTF-8 temporary path")
            .to_string()
    }
}

impl Drop for TestDirectory {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `rdkv-ycsb` and checks that it succeeded.
pub fn ycsb(arguments: &[&str]) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_rdkv-ycsb"))
        .args(arguments)
        .env_remove("RUST_LOG")
        .output()
        .expect("run rdkv-ycsb");
    assert!(
        output.status.success(),
        "rdkv-ycsb {}: {}\n{}",
        arguments.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}
