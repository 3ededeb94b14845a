//! Cluster file validation: one test per error case, each checking the line and field named.

use std::path::Path;

use rdkv_cluster_file::config::{load, parse};
use rdkv_cluster_file::Error;
use rdkv_fabric::memory::limits::MemlockFigures;

const MIB: u64 = 1 << 20;

fn roomy() -> MemlockFigures {
    MemlockFigures {
        soft_limit: u64::MAX,
        hard_limit: u64::MAX,
        locked_bytes: 0,
        has_ipc_lock_capability: false,
    }
}

const NODE_1: &str = r#"
[[node]]
id = 1
control_address = "127.0.0.1:7400"
fabric_address = "127.0.0.1:7401"
index_size = "1M"
heap_size = "4M"
"#;

fn file(cluster_extra: &str, nodes: &str) -> String {
    format!("[cluster]\nname = \"test\"\nsecret = \"sixteen-byte-key\"\nfabric = \"soft\"\n{cluster_extra}{nodes}")
}

fn invalid(text: &str) -> (usize, String, String) {
    match parse(Path::new("cluster.toml"), text, roomy(), 64 * 1024 * MIB) {
        Err(Error::Invalid {
            line,
            field,
            message,
            ..
        }) => (line, field, message),
        other => panic!("expected an invalid-file error, got {other:?}"),
    }
}

#[test]
fn the_shipped_example_is_valid() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/local-3node.toml");
    let config = load(&example).expect("examples/local-3node.toml is valid on this machine");
    assert_eq!(config.nodes.len(), 3);
    assert_eq!(config.name, "local-3node");
    assert_eq!(config.replicas, 2);
    // Its inline secret warns while the file is readable by others (a fresh checkout), until
    // `chmod 600` (docs/operations.md).
    assert!(
        config
            .warnings
            .iter()
            .all(|warning| warning.contains("cluster.secret") && warning.contains("chmod 600")),
        "{:?}",
        config.warnings
    );
    assert!(config.secret.len() >= rdkv_cluster_file::config::MIN_SECRET_LENGTH);
}

#[test]
fn node_id_0_is_refused() {
    let (line, field, message) = invalid(&file("", &NODE_1.replace("id = 1", "id = 0")));
    assert_eq!((line, field.as_str()), (7, "node[0].id"));
    assert!(message.contains("node ids start at 1"), "{message}");
}

#[test]
fn a_secret_shorter_than_16_bytes_is_refused_with_how_to_make_one() {
    let text = file("", NODE_1).replace("sixteen-byte-key", "fifteen-byte-ke");
    let (line, field, message) = invalid(&text);
    assert_eq!((line, field.as_str()), (3, "cluster.secret"));
    assert!(
        message.contains("15 bytes") && message.contains("head -c 32 /dev/urandom | base64"),
        "{message}"
    );
    assert!(!message.contains('\n'), "one line: {message}");
}

#[test]
fn an_inline_secret_in_a_file_readable_by_others_is_a_warning() {
    use std::os::unix::fs::PermissionsExt;
    let directory = std::env::temp_dir().join(format!("rdkv-inline-secret-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let cluster = directory.join("cluster.toml");
    std::fs::write(&cluster, file("", NODE_1)).expect("write");
    std::fs::set_permissions(&cluster, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let warnings = load(&cluster).expect("valid, with a warning").warnings;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("cluster.secret") && warnings[0].contains("chmod 600"),
        "{}",
        warnings[0]
    );
    std::fs::set_permissions(&cluster, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    assert!(load(&cluster).expect("valid").warnings.is_empty());
    let _ = std::fs::remove_dir_all(&directory);
}

#[test]
fn a_failure_timeout_not_below_the_operation_deadline_is_a_warning() {
    let second = NODE_1
        .replace("id = 1", "id = 2")
        .replace("7400", "7500")
        .replace("7401", "7501");
    let nodes = format!("{NODE_1}{second}");
    let late = "replicas = 2\nfailure_timeout = \"3s\"\noperation_deadline = \"3s\"\n";
    let config = parse(
        Path::new("cluster.toml"),
        &file(late, &nodes),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid, with a warning");
    let warning = config
        .warnings
        .iter()
        .find(|warning| warning.contains("cluster.failure_timeout"));
    assert!(
        warning.is_some_and(|warning| warning.contains("lower failure_timeout")),
        "{:?}",
        config.warnings
    );
    let in_time = late.replace("failure_timeout = \"3s\"", "failure_timeout = \"2s\"");
    let config = parse(
        Path::new("cluster.toml"),
        &file(&in_time, &nodes),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert!(
        !config
            .warnings
            .iter()
            .any(|warning| warning.contains("failure_timeout")),
        "{:?}",
        config.warnings
    );
}

#[test]
fn duplicate_ids_are_refused() {
    let second = NODE_1.replace("7400", "7500").replace("7401", "7501");
    let (line, field, message) = invalid(&file("", &format!("{NODE_1}{second}")));
    assert_eq!(field, "node[1].id");
    assert_eq!(line, 14);
    assert!(message.contains("duplicate id 1"), "{message}");
}

#[test]
fn duplicate_addresses_are_refused() {
    let second = NODE_1.replace("id = 1", "id = 2").replace("7401", "7501");
    let (line, field, message) = invalid(&file("", &format!("{NODE_1}{second}")));
    assert_eq!(field, "node[1].control_address");
    assert_eq!(line, 15);
    assert!(
        message.contains("duplicate address 127.0.0.1:7400"),
        "{message}"
    );
}

#[test]
fn an_index_too_small_for_one_bucket_pair_is_refused() {
    let (line, field, message) = invalid(&file(
        "",
        &NODE_1.replace("index_size = \"1M\"", "index_size = 64"),
    ));
    assert_eq!((line, field.as_str()), (10, "node[0].index_size"));
    assert!(message.contains("too small"), "{message}");
}

#[test]
fn a_size_past_what_any_machine_pins_is_refused_at_its_line() {
    let (line, field, message) = invalid(&file(
        "",
        &NODE_1.replace("index_size = \"1M\"", "index_size = 18446744073709551615"),
    ));
    assert_eq!((line, field.as_str()), (10, "node[0].index_size"));
    assert!(
        message.contains("at most 70368744177664 bytes"),
        "{message}"
    );
    let (_, field, message) = invalid(&file(
        "",
        &NODE_1.replace("heap_size = \"4M\"", "heap_size = \"100000000G\""),
    ));
    assert_eq!(field, "node[0].heap_size");
    assert!(message.contains("more than any machine pins"), "{message}");
}

#[test]
fn a_heap_of_fewer_than_four_chunks_is_refused() {
    let (line, field, message) = invalid(&file(
        "",
        &NODE_1.replace(
            "heap_size = \"4M\"",
            "heap_size = \"4M\"\nchunk_size = \"2M\"",
        ),
    ));
    assert_eq!((line, field.as_str()), (11, "node[0].heap_size"));
    assert!(message.contains("at least 4 chunks"), "{message}");
    assert!(message.contains("lower chunk_size"), "{message}");
}

#[test]
fn sizes_over_the_memlock_limit_name_the_fix() {
    let tight = MemlockFigures {
        soft_limit: 8 * MIB,
        hard_limit: 8 * MIB,
        locked_bytes: 0,
        has_ipc_lock_capability: false,
    };
    let text = file(
        "",
        &NODE_1.replace("heap_size = \"4M\"", "heap_size = \"64M\""),
    );
    let error =
        parse(Path::new("cluster.toml"), &text, tight, 64 * 1024 * MIB).expect_err("over memlock");
    let message = error.to_string();
    assert!(
        message.starts_with("cluster.toml:11: node[0].heap_size:"),
        "{message}"
    );
    assert!(message.contains("ulimit -l"), "{message}");
}

#[test]
fn sizes_over_the_ram_share_are_refused() {
    let text = file("", NODE_1);
    let error =
        parse(Path::new("cluster.toml"), &text, roomy(), 6 * MIB).expect_err("over the RAM share");
    assert!(error.to_string().contains("MemAvailable"), "{error}");
}

#[test]
fn an_unknown_fabric_is_refused() {
    let text = file("", NODE_1).replace("fabric = \"soft\"", "fabric = \"carrier-pigeon\"");
    let (line, field, message) = invalid(&text);
    assert_eq!((line, field.as_str()), (4, "cluster.fabric"));
    assert!(
        message.contains("unknown fabric `carrier-pigeon`: expected soft, loopback, verbs or shm"),
        "{message}"
    );
}

#[test]
fn the_loopback_fabric_is_refused_for_nodes() {
    let text = file("", NODE_1).replace("fabric = \"soft\"", "fabric = \"loopback\"");
    let (line, field, message) = invalid(&text);
    assert_eq!((line, field.as_str()), (4, "cluster.fabric"));
    assert!(
        message.contains("works only inside one process: use \"soft\" or \"verbs\""),
        "{message}"
    );
}

#[test]
fn a_missing_secret_file_is_refused() {
    let text = file("", NODE_1).replace(
        "secret = \"sixteen-byte-key\"",
        "secret_file = \"/nonexistent/rdkv-secret\"",
    );
    let (line, field, message) = invalid(&text);
    assert_eq!((line, field.as_str()), (3, "cluster.secret_file"));
    assert!(
        message.contains("cannot read /nonexistent/rdkv-secret"),
        "{message}"
    );
}

#[test]
fn a_secret_file_readable_by_others_is_a_warning() {
    use std::os::unix::fs::PermissionsExt;
    let directory = std::env::temp_dir().join(format!("rdkv-validation-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let secret = directory.join("secret");
    std::fs::write(&secret, "from-a-file-of-32-random-bytes\n").expect("write");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let cluster = directory.join("cluster.toml");
    std::fs::write(
        &cluster,
        file("", NODE_1).replace("secret = \"sixteen-byte-key\"", "secret_file = \"secret\""),
    )
    .expect("write");
    let config = load(&cluster).expect("valid, with a warning");
    assert_eq!(config.secret, b"from-a-file-of-32-random-bytes");
    assert_eq!(config.warnings.len(), 1);
    assert!(
        config.warnings[0].contains("chmod 600"),
        "{}",
        config.warnings[0]
    );
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    assert!(load(&cluster).expect("valid").warnings.is_empty());
    let _ = std::fs::remove_dir_all(&directory);
}

#[test]
fn unknown_keys_are_refused() {
    let text = file(
        "",
        &NODE_1.replace(
            "heap_size = \"4M\"",
            "heap_size = \"4M\"\nheap_sise = \"8M\"",
        ),
    );
    let (line, _, message) = invalid(&text);
    assert_eq!(line, 12);
    assert!(message.contains("heap_sise"), "{message}");
}

#[test]
fn port_zero_and_bad_addresses_are_refused() {
    let (_, field, message) = invalid(&file("", &NODE_1.replace("127.0.0.1:7401", "127.0.0.1:0")));
    assert_eq!(field, "node[0].fabric_address");
    assert!(message.contains("port 0"), "{message}");
    let (_, field, _) = invalid(&file("", &NODE_1.replace("127.0.0.1:7400", "localhost")));
    assert_eq!(field, "node[0].control_address");
}

#[test]
fn poll_spin_is_parsed_and_bounded() {
    let config = parse(
        Path::new("cluster.toml"),
        &file("poll_spin = \"30us\"\n", NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(config.poll_spin, std::time::Duration::from_micros(30));
    let default = parse(
        Path::new("cluster.toml"),
        &file("", NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(
        default.poll_spin,
        std::time::Duration::ZERO,
        "never spins by default"
    );
    let (line, field, message) = invalid(&file("poll_spin = \"1s\"\n", NODE_1));
    assert_eq!((line, field.as_str()), (5, "cluster.poll_spin"));
    assert!(message.contains("burns"), "{message}");
}

#[test]
fn a_two_node_cluster_is_warned_that_it_cannot_fail_over() {
    let second = NODE_1.replace("id = 1", "id = 2").replace(":740", ":741");
    let two = parse(
        Path::new("cluster.toml"),
        &file("", &format!("{NODE_1}{second}")),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(two.nodes.len(), 2);
    assert!(
        two.warnings
            .iter()
            .any(|warning| warning.contains("majority")),
        "{:?}",
        two.warnings
    );
}

#[test]
fn failure_timeout_is_parsed_and_bounded() {
    let config = parse(
        Path::new("cluster.toml"),
        &file("failure_timeout = \"5s\"\n", NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(config.failure_timeout, std::time::Duration::from_secs(5));
    let default = parse(
        Path::new("cluster.toml"),
        &file("", NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(default.failure_timeout, std::time::Duration::from_secs(2));
    for too_short_or_long in ["500ms", "2m"] {
        let (line, field, message) = invalid(&file(
            &format!("failure_timeout = \"{too_short_or_long}\"\n"),
            NODE_1,
        ));
        assert_eq!((line, field.as_str()), (5, "cluster.failure_timeout"));
        assert!(message.contains("election"), "{message}");
    }
}

#[test]
fn replicas_are_parsed_and_bounded_by_three_and_the_nodes() {
    let parsed = |extra: &str, nodes: &str| {
        parse(
            Path::new("cluster.toml"),
            &file(extra, nodes),
            roomy(),
            64 * 1024 * MIB,
        )
    };
    let second = NODE_1
        .replace("id = 1", "id = 2")
        .replace("7400", "7500")
        .replace("7401", "7501");
    let two = format!("{NODE_1}{second}");
    assert_eq!(parsed("", NODE_1).expect("valid").replicas, 1);
    assert_eq!(parsed("replicas = 2\n", &two).expect("valid").replicas, 2);
    let (line, field, message) = invalid(&file("replicas = 3\n", &two));
    assert_eq!((line, field.as_str()), (5, "cluster.replicas"));
    assert!(message.contains("between 1 and 2"), "{message}");
    assert!(message.contains("2 node(s)"), "{message}");
    for out_of_range in ["0", "4"] {
        let (_, field, message) = invalid(&file(&format!("replicas = {out_of_range}\n"), &two));
        assert_eq!(field, "cluster.replicas");
        assert!(message.contains("1 to 3 copies"), "{message}");
    }
}

#[test]
fn the_shipped_verbs_example_is_valid() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/verbs-1node.toml");
    let config = load(&example).expect("examples/verbs-1node.toml is valid on this machine");
    assert_eq!(config.fabric, rdkv_fabric::Backend::Verbs);
    assert_eq!(config.nodes[0].device.as_deref(), Some("rxe0"));
}

#[test]
fn only_nodes_started_here_are_checked_against_this_machine() {
    let tight = MemlockFigures {
        soft_limit: 8 * MIB,
        hard_limit: 8 * MIB,
        locked_bytes: 0,
        has_ipc_lock_capability: false,
    };
    // A remote node's table is pinned on its own host.
    let remote = file(
        "",
        &NODE_1
            .replace("heap_size = \"4M\"", "heap_size = \"64M\"")
            .replace("id = 1\n", "id = 1\nhost = \"db2.example\"\n"),
    );
    let config = parse(Path::new("cluster.toml"), &remote, tight, 64 * 1024 * MIB)
        .expect("a remote node is not checked here");
    assert_eq!(config.nodes[0].host.as_deref(), Some("db2.example"));

    // A client, `status` or `down` pins no table: `load` does not check; starting does.
    let directory = std::env::temp_dir().join(format!("rdkv-validation-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let path = directory.join("huge.toml");
    let huge = file(
        "",
        &NODE_1.replace("heap_size = \"4M\"", "heap_size = \"1024G\""),
    );
    std::fs::write(&path, huge).expect("write");
    load(&path).expect("a client may use a cluster of big nodes");
    let error = rdkv_cluster_file::load_to_start(&path, None, Some(1))
        .expect_err("a 1 TiB table does not fit here");
    assert!(error.to_string().contains("node[0].heap_size"), "{error}");
    let _ = std::fs::remove_dir_all(&directory);
}

#[test]
fn a_cluster_name_that_is_not_a_plain_word_is_refused() {
    for name in ["my cluster", "../../tmp/x", "x\\n[Service]", ".hidden", ""] {
        let text = file("", NODE_1).replace("name = \"test\"", &format!("name = \"{name}\""));
        let (line, field, message) = invalid(&text);
        assert_eq!(
            (line, field.as_str()),
            (2, "cluster.name"),
            "{name}: {message}"
        );
        assert!(message.contains("letters, digits"), "{message}");
    }
}

#[test]
fn connection_limits_have_defaults_and_are_checked_against_each_other() {
    let config = parse(
        Path::new("cluster.toml"),
        &file("", NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(config.limits.max_connections, 1024);
    assert_eq!(config.limits.max_unauthenticated, 256);
    assert_eq!(config.limits.max_pending_per_address, 64);
    assert_eq!(
        config.limits.handshake_deadline,
        std::time::Duration::from_secs(10)
    );
    let set = "max_connections = 100\nmax_unauthenticated_connections = 20\nmax_pending_per_address = 50\nhandshake_deadline = \"3s\"\n";
    let config = parse(
        Path::new("cluster.toml"),
        &file(set, NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(config.limits.max_connections, 100);
    assert_eq!(config.limits.max_unauthenticated, 20);
    assert_eq!(
        config.limits.max_pending_per_address, 20,
        "at most the overall limit"
    );
    assert_eq!(
        config.limits.handshake_deadline,
        std::time::Duration::from_secs(3)
    );

    let (line, field, message) = invalid(&file(
        "max_connections = 100\nmax_unauthenticated_connections = 100\n",
        NODE_1,
    ));
    assert_eq!(
        (line, field.as_str()),
        (6, "cluster.max_unauthenticated_connections")
    );
    assert!(message.contains("below max_connections"), "{message}");
    // Lowering max_connections alone is enough: the unauthenticated budget follows it.
    let config = parse(
        Path::new("cluster.toml"),
        &file("max_connections = 100\n", NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(config.limits.max_unauthenticated, 25);
    assert_eq!(config.limits.max_pending_per_address, 25);
    for too_few in ["0", "1"] {
        let (_, field, message) = invalid(&file(&format!("max_connections = {too_few}\n"), NODE_1));
        assert_eq!(field, "cluster.max_connections");
        assert!(message.contains("at least 2"), "{message}");
    }
    let (_, field, _) = invalid(&file("max_pending_per_address = 0\n", NODE_1));
    assert_eq!(field, "cluster.max_pending_per_address");
    let (_, field, message) = invalid(&file("handshake_deadline = \"10min\"\n", NODE_1));
    assert_eq!(field, "cluster.handshake_deadline", "{message}");
}

#[test]
fn fabric_port_limits_have_defaults_and_bounds() {
    let config = parse(
        Path::new("cluster.toml"),
        &file("", NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(config.limits.fabric_engine_threads, 0, "one per core");
    assert_eq!(
        config.limits.fabric_hello_deadline,
        std::time::Duration::from_secs(5)
    );
    assert_eq!(config.limits.fabric_max_pending_hellos, 64);
    assert_eq!(config.limits.fabric_response_buffer, 4 << 20);
    let set = "fabric_engine_threads = 4\nfabric_hello_deadline = \"500ms\"\nfabric_max_pending_hellos = 16\nfabric_response_buffer = \"1M\"\n";
    let config = parse(
        Path::new("cluster.toml"),
        &file(set, NODE_1),
        roomy(),
        64 * 1024 * MIB,
    )
    .expect("valid");
    assert_eq!(config.limits.fabric_engine_threads, 4);
    assert_eq!(
        config.limits.fabric_hello_deadline,
        std::time::Duration::from_millis(500)
    );
    assert_eq!(config.limits.fabric_max_pending_hellos, 16);
    assert_eq!(config.limits.fabric_response_buffer, 1 << 20);
    let (_, field, message) = invalid(&file("fabric_response_buffer = \"1K\"\n", NODE_1));
    assert_eq!(field, "cluster.fabric_response_buffer", "{message}");
    let (_, field, message) = invalid(&file("fabric_engine_threads = 1000\n", NODE_1));
    assert_eq!(field, "cluster.fabric_engine_threads", "{message}");
    let (_, field, message) = invalid(&file("fabric_hello_deadline = \"2min\"\n", NODE_1));
    assert_eq!(field, "cluster.fabric_hello_deadline", "{message}");
    let (_, field, _) = invalid(&file("fabric_max_pending_hellos = 0\n", NODE_1));
    assert_eq!(field, "cluster.fabric_max_pending_hellos");
    let (_, field, _) = invalid(&file("fabric_max_pending_hellos = 1000000000\n", NODE_1));
    assert_eq!(field, "cluster.fabric_max_pending_hellos");
}

#[test]
fn replace_after_is_off_by_default_parsed_and_bounded() {
    let second = NODE_1
        .replace("id = 1", "id = 2")
        .replace("7400", "7500")
        .replace("7401", "7501");
    let nodes = format!("{NODE_1}{second}");
    let parsed = |extra: &str| {
        parse(
            Path::new("cluster.toml"),
            &file(extra, &nodes),
            roomy(),
            64 * 1024 * MIB,
        )
        .expect("valid")
    };
    assert_eq!(parsed("replicas = 2\n").replace_after, None);
    let config = parsed("replicas = 2\nreplace_after = \"10m\"\n");
    assert_eq!(
        config.replace_after,
        Some(std::time::Duration::from_secs(600))
    );
    assert!(
        !config
            .warnings
            .iter()
            .any(|warning| warning.contains("replace_after")),
        "{:?}",
        config.warnings
    );
    let one_copy = parsed("replace_after = \"10m\"\n");
    assert!(
        one_copy
            .warnings
            .iter()
            .any(|warning| warning.contains("cluster.replace_after: ignored with replicas = 1")),
        "{:?}",
        one_copy.warnings
    );
    for (value, says) in [
        ("soon", "duration"),
        ("500ms", "outside failure_timeout"),
        ("20000m", "outside failure_timeout"),
    ] {
        let (line, field, message) = invalid(&file(
            &format!("replicas = 2\nreplace_after = \"{value}\"\n"),
            &nodes,
        ));
        assert_eq!(
            (line, field.as_str()),
            (6, "cluster.replace_after"),
            "{value}"
        );
        assert!(message.contains(says), "{value}: {message}");
        assert_eq!(message.lines().count(), 1, "{message}");
    }
}
