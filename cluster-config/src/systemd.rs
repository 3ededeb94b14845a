//! `rdkv-cluster systemd FILE --node N`: a systemd service unit that runs one node.
//!
//! The unit runs `rdkv-server --config FILE --node N` with the secret from a systemd
//! credential (`LoadCredential=`, read by `--secret-file %d/rdkv-secret`: the secret never
//! sits in the unit or the process's environment), `LimitMEMLOCK=` sized for the node's pinned
//! table, `Restart=on-failure`, and a stop timeout above the node's own shutdown bound.
//! `docs/operations.md` (*Running under systemd*) shows how to install it.

use std::path::Path;

use crate::config::{ClusterConfig, NodeConfig};

/// What pinned memory a node needs beyond its table (announce words, the soft NIC's
/// buffers), as headroom in `LimitMEMLOCK=`.
const MEMLOCK_HEADROOM: u64 = 16 << 20;

/// A path as one word of a unit's command line: `%` doubled (systemd's specifier escape), and
/// double-quoted with `\` and `"` escaped when it holds a space, a quote or a backslash.
fn unit_word(path: &Path) -> String {
    let text = path.display().to_string().replace('%', "%%");
    if text
        .chars()
        .any(|character| character.is_whitespace() || "\"'\\".contains(character))
    {
        format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
    } else {
        text
    }
}

/// The unit's file name for a node.
pub fn unit_name(config: &ClusterConfig, node: &NodeConfig) -> String {
    format!("rdkv-{}-node-{}.service", config.name, node.id)
}

/// The unit text. `binary` and `file` should be absolute (systemd requires an absolute
/// `ExecStart=`); `credential` is the file that holds the secret on the node's host.
pub fn unit(
    config: &ClusterConfig,
    node: &NodeConfig,
    binary: &Path,
    file: &Path,
    credential: &Path,
) -> String {
    let memlock_mebibytes = (node.index_size + node.heap_size + MEMLOCK_HEADROOM).div_ceil(1 << 20);
    format!(
        "# rdkv node {id} of cluster `{name}`, from `rdkv-cluster systemd --node {id}`.
# Install (docs/operations.md, Running under systemd): put the cluster file's secret in
# {credential} (mode 0600), then
#   cp {unit_name} /etc/systemd/system/ && systemctl daemon-reload
#   systemctl enable --now {unit_name}
[Unit]
Description=rdkv node {id} of cluster {name}
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
ExecStart={binary} --config {file} --node {id} --secret-file %d/rdkv-secret --view-state %S/rdkv/{name}/node-{id}.view{data_dir}
LoadCredential=rdkv-secret:{credential}
# The cluster view's vote and log, and the node's snapshots (/var/lib/rdkv/NAME): kept across
# restarts.
StateDirectory=rdkv/{name}
Environment=RUST_LOG=info
Restart=on-failure
RestartSec=2s
# The node bounds its connections' teardown at 10 s, then writes its final snapshot (the
# table's size at disk speed; a second per 100 MiB of heap is allowed here).
TimeoutStopSec={stop_seconds}s
# The table ({table} MiB) is pinned: index_size + heap_size, plus headroom.
LimitMEMLOCK={memlock_mebibytes}M
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
",
        id = node.id,
        name = config.name,
        file = unit_word(file),
        binary = unit_word(binary),
        credential = credential.display().to_string().replace('%', "%%"),
        unit_name = unit_name(config, node),
        table = (node.index_size + node.heap_size).div_ceil(1 << 20),
        data_dir = match &node.data_dir {
            Some(_) => String::new(),
            None => format!(" --data-dir %S/rdkv/{}/node-{}.data", config.name, node.id),
        },
        stop_seconds = 20 + node.heap_size.div_ceil(100 << 20),
    )
}

/// A unit file's sections: each name with its `(key, value)` entries, in order.
pub type UnitSections = Vec<(String, Vec<(String, String)>)>;

/// A unit file's `[Section]`s and their `Key=value` lines, in order, as systemd reads them
/// (comments and blank lines skipped): the check where `systemd-analyze` is missing.
///
/// # Errors
/// The first line that is neither a section, a key with a value, a comment nor blank.
pub fn parse_unit(text: &str) -> Result<UnitSections, String> {
    let mut sections: UnitSections = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'))
        {
            sections.push((name.to_string(), Vec::new()));
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(format!("line {}: `{line}` is not Key=value", number + 1));
        };
        let Some((_, entries)) = sections.last_mut() else {
            return Err(format!(
                "line {}: `{line}` comes before any [Section]",
                number + 1
            ));
        };
        let key = key.trim();
        if key.is_empty()
            || !key
                .chars()
                .all(|character| character.is_ascii_alphanumeric())
        {
            return Err(format!("line {}: `{key}` is not a key", number + 1));
        }
        entries.push((key.to_string(), value.trim().to_string()));
    }
    Ok(sections)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> ClusterConfig {
        let text = "[cluster]\nname = \"prod\"\nsecret = \"sixteen-byte-key\"\nfabric = \"soft\"\n\n[[node]]\nid = 2\ncontrol_address = \"127.0.0.1:7410\"\nfabric_address = \"127.0.0.1:7411\"\nindex_size = \"1M\"\nheap_size = \"4M\"\n";
        let figures = rdkv_fabric::memory::limits::MemlockFigures {
            soft_limit: u64::MAX,
            hard_limit: u64::MAX,
            locked_bytes: 0,
            has_ipc_lock_capability: true,
        };
        crate::config::parse(Path::new("/etc/rdkv/prod.toml"), text, figures, u64::MAX)
            .expect("valid file")
    }

    #[test]
    fn the_unit_has_the_limits_the_restart_policy_and_the_credential() {
        let config = example();
        let node = &config.nodes[0];
        let text = unit(
            &config,
            node,
            Path::new("/usr/local/bin/rdkv-server"),
            Path::new("/etc/rdkv/prod.toml"),
            Path::new("/etc/rdkv/prod.secret"),
        );
        let sections = parse_unit(&text).expect("a unit file");
        let names: Vec<&str> = sections.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["Unit", "Service", "Install"]);
        let service = &sections[1].1;
        let value = |key: &str| {
            service
                .iter()
                .find(|(name, _)| name == key)
                .map(|(_, value)| value.as_str())
        };
        assert_eq!(
            value("ExecStart"),
            Some("/usr/local/bin/rdkv-server --config /etc/rdkv/prod.toml --node 2 --secret-file %d/rdkv-secret --view-state %S/rdkv/prod/node-2.view --data-dir %S/rdkv/prod/node-2.data")
        );
        assert_eq!(value("StateDirectory"), Some("rdkv/prod"));
        assert_eq!(
            value("LoadCredential"),
            Some("rdkv-secret:/etc/rdkv/prod.secret")
        );
        assert_eq!(value("Restart"), Some("on-failure"));
        assert_eq!(value("LimitMEMLOCK"), Some("21M"));
        assert_eq!(unit_name(&config, node), "rdkv-prod-node-2.service");
    }

    #[test]
    fn odd_paths_stay_one_word_without_specifiers() {
        assert_eq!(unit_word(Path::new("/etc/rdkv/a.toml")), "/etc/rdkv/a.toml");
        assert_eq!(
            unit_word(Path::new("/srv/100%/a.toml")),
            "/srv/100%%/a.toml"
        );
        assert_eq!(
            unit_word(Path::new("/srv/my dir/a \"b\".toml")),
            "\"/srv/my dir/a \\\"b\\\".toml\""
        );
    }

    #[test]
    fn lines_that_are_not_unit_syntax_are_refused() {
        assert!(parse_unit("[Unit]\nDescription=x\n").is_ok());
        assert!(parse_unit("Description=x\n").is_err());
        assert!(parse_unit("[Unit]\nno equals sign\n").is_err());
    }
}
