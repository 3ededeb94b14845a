//! The `[cluster]` section: its name, fabric, secret, timeouts and connection limits, checked
//! in file order (the first error found is the one reported), and `replicas`, which needs the
//! nodes counted.

use std::path::PathBuf;
use std::time::Duration;

use rdkv_fabric::Backend;
use toml::Spanned;

use super::{
    default_unauthenticated, line_of, span_of, ClusterConfig, ConnectionLimits, Locator,
    RawCluster, SshSettings, DEFAULT_FAILURE_TIMEOUT, MAX_FAILURE_TIMEOUT, MAX_REPLACE_AFTER,
    MAX_REPLICAS, MIN_FAILURE_TIMEOUT, MIN_SECRET_LENGTH,
};
use crate::error::Result;

/// The longest `poll_spin` a cluster file may ask for.
const MAX_POLL_SPIN: Duration = Duration::from_millis(10);

/// The `[cluster]` section, checked in file order: the configuration without its nodes (and
/// one replica, until the nodes are known).
pub(super) fn parse_cluster_section(
    locator: &Locator<'_>,
    section: &Spanned<RawCluster>,
    secret_override: Option<Vec<u8>>,
) -> Result<ClusterConfig> {
    let cluster = section.get_ref();
    check_cluster_name(locator, &cluster.name)?;
    let fabric = parse_fabric(locator, &cluster.fabric)?;
    let mut warnings = Vec::new();
    let secret = match secret_override {
        Some(secret) => secret,
        None => read_secret(locator, section, &mut warnings)?,
    };
    check_secret(locator, cluster, &secret)?;
    warn_of_inline_secret(locator, cluster, &mut warnings);
    let lease_timeout = locator.duration(
        &cluster.lease_timeout,
        "cluster.lease_timeout",
        Duration::from_secs(10),
    )?;
    let failure_timeout = parse_failure_timeout(locator, cluster)?;
    let replace_after = parse_replace_after(locator, cluster, failure_timeout)?;
    let operation_deadline = locator.duration(
        &cluster.operation_deadline,
        "cluster.operation_deadline",
        Duration::from_secs(2),
    )?;
    let snapshot_interval = locator.duration(
        &cluster.snapshot_interval,
        "cluster.snapshot_interval",
        super::DEFAULT_SNAPSHOT_INTERVAL,
    )?;
    let poll_spin = locator.duration(&cluster.poll_spin, "cluster.poll_spin", Duration::ZERO)?;
    let limits = connection_limits(locator, cluster)?;
    check_poll_spin(locator, cluster, poll_spin)?;
    Ok(ClusterConfig {
        path: locator.path.to_path_buf(),
        name: cluster.name.get_ref().clone(),
        secret,
        fabric,
        lease_timeout,
        failure_timeout,
        replace_after,
        replicas: 1,
        operation_deadline,
        snapshot_interval,
        poll_spin,
        limits,
        ssh: ssh_settings(cluster),
        nodes: Vec::new(),
        warnings,
    })
}

/// `cluster.name` makes file and unit names: letters, digits, `.`, `_` and `-`, not starting
/// with `.`.
fn check_cluster_name(locator: &Locator<'_>, name: &Spanned<String>) -> Result<()> {
    let text = name.get_ref();
    let is_plain = !text.is_empty()
        && !text.starts_with('.')
        && text
            .chars()
            .all(|character| character.is_ascii_alphanumeric() || "._-".contains(character));
    if is_plain {
        return Ok(());
    }
    Err(locator.error(
        name.span(),
        "cluster.name",
        format!(
            "{text:?}: use letters, digits, '.', '_' and '-', not starting with '.' (the name makes the run directory and the systemd unit names)"
        ),
    ))
}

/// `cluster.fabric`: a backend that crosses processes.
fn parse_fabric(locator: &Locator<'_>, fabric: &Spanned<String>) -> Result<Backend> {
    match fabric.get_ref().parse::<Backend>() {
        Ok(backend) if backend.crosses_processes() => Ok(backend),
        Ok(backend) => Err(locator.error(
            fabric.span(),
            "cluster.fabric",
            format!("fabric `{backend}` works only inside one process: use \"soft\" or \"verbs\""),
        )),
        Err(error) => Err(locator.error(fabric.span(), "cluster.fabric", error.to_string())),
    }
}

/// How to make a good secret, for the errors that refuse one.
const MAKE_A_SECRET: &str = "make one with `head -c 32 /dev/urandom | base64 > secret && chmod 600 secret` and set secret_file = \"secret\"";

/// The secret is at least [`MIN_SECRET_LENGTH`] bytes.
fn check_secret(locator: &Locator<'_>, cluster: &RawCluster, secret: &[u8]) -> Result<()> {
    if secret.len() >= MIN_SECRET_LENGTH {
        return Ok(());
    }
    let what = match secret.len() {
        0 => "the secret is empty".to_string(),
        length => format!("the secret is {length} bytes, shorter than {MIN_SECRET_LENGTH}"),
    };
    if let (None, Some(file)) = (&cluster.secret, &cluster.secret_file) {
        // From its file: the file is what to replace.
        return Err(locator.error(
            file.span(),
            "cluster.secret_file",
            format!(
                "{what}: write a longer one into it, e.g. `head -c 32 /dev/urandom | base64 > {} && chmod 600 {}`",
                file.get_ref(),
                file.get_ref()
            ),
        ));
    }
    let span = cluster.secret.as_ref().map_or(0..0, Spanned::span);
    Err(locator.error(span, "cluster.secret", format!("{what}: {MAKE_A_SECRET}")))
}

/// A warning when the file holds its secret inline (`secret = ...`) and group or others may
/// read it (as for `secret_file`).
fn warn_of_inline_secret(locator: &Locator<'_>, cluster: &RawCluster, warnings: &mut Vec<String>) {
    use std::os::unix::fs::PermissionsExt;
    let Some(secret) = &cluster.secret else {
        return;
    };
    let Ok(metadata) = std::fs::metadata(locator.path) else {
        return;
    };
    let mode = metadata.permissions().mode();
    if mode & 0o077 != 0 {
        warnings.push(format!(
            "{}:{}: cluster.secret: the file holds the secret and is readable by group or others (mode {:o}); run `chmod 600 {}`, or move the secret to a secret_file of mode 0600",
            locator.path.display(),
            line_of(locator.text, secret.span().start),
            mode & 0o777,
            locator.path.display()
        ));
    }
}

/// A warning when keys have copies (`replicas` ≥ 2) and `failure_timeout` is not below
/// `operation_deadline`: an operation on a dead node's key waits for the view that marks the
/// node down, and would run out of time first.
pub(super) fn warn_of_late_failure_timeout(
    locator: &Locator<'_>,
    cluster: &RawCluster,
    config: &mut ClusterConfig,
) {
    let (failure_timeout, operation_deadline) = (config.failure_timeout, config.operation_deadline);
    if config.replicas < 2 || failure_timeout < operation_deadline {
        return;
    }
    let span = span_of(&cluster.failure_timeout);
    config.warnings.push(format!(
        "{}:{}: cluster.failure_timeout: {failure_timeout:?} is not below operation_deadline ({operation_deadline:?}): an operation on a dead node's key times out before the view moves the key to its next copy; lower failure_timeout or raise operation_deadline",
        locator.path.display(),
        line_of(locator.text, span.start),
    ));
}

/// The section's `secret`, or the contents of its `secret_file`: exactly one of them.
fn read_secret(
    locator: &Locator<'_>,
    section: &Spanned<RawCluster>,
    warnings: &mut Vec<String>,
) -> Result<Vec<u8>> {
    let cluster = section.get_ref();
    match (&cluster.secret, &cluster.secret_file) {
        (Some(_), Some(file)) => Err(locator.error(
            file.span(),
            "cluster.secret_file",
            "set either secret or secret_file, not both",
        )),
        (None, None) => Err(locator.error(
            section.span(),
            "cluster.secret",
            "missing: set secret or secret_file",
        )),
        (Some(secret), None) => Ok(secret.get_ref().as_bytes().to_vec()),
        (None, Some(file)) => read_secret_file(locator, file, warnings),
    }
}

/// `secret_file`'s contents, trimmed; the file is found from the cluster file's directory. A
/// file readable by group or others is a warning, not an error.
fn read_secret_file(
    locator: &Locator<'_>,
    file: &Spanned<String>,
    warnings: &mut Vec<String>,
) -> Result<Vec<u8>> {
    let secret_path = locator
        .path
        .parent()
        .map(|directory| directory.join(file.get_ref()))
        .unwrap_or_else(|| PathBuf::from(file.get_ref()));
    let bytes = std::fs::read(&secret_path).map_err(|error| {
        locator.error(
            file.span(),
            "cluster.secret_file",
            format!("cannot read {}: {error}", secret_path.display()),
        )
    })?;
    if let Ok(metadata) = std::fs::metadata(&secret_path) {
        use std::os::unix::fs::PermissionsExt;
        let mode = metadata.permissions().mode();
        if mode & 0o077 != 0 {
            warnings.push(format!(
                "{}:{}: cluster.secret_file: {} is readable by group or others (mode {:o}); run `chmod 600 {}`",
                locator.path.display(),
                line_of(locator.text, file.span().start),
                secret_path.display(),
                mode & 0o777,
                secret_path.display()
            ));
        }
    }
    Ok(bytes.trim_ascii().to_vec())
}

/// `cluster.failure_timeout`, between [`MIN_FAILURE_TIMEOUT`] and [`MAX_FAILURE_TIMEOUT`].
fn parse_failure_timeout(locator: &Locator<'_>, cluster: &RawCluster) -> Result<Duration> {
    let failure_timeout = locator.duration(
        &cluster.failure_timeout,
        "cluster.failure_timeout",
        DEFAULT_FAILURE_TIMEOUT,
    )?;
    if !(MIN_FAILURE_TIMEOUT..=MAX_FAILURE_TIMEOUT).contains(&failure_timeout) {
        return Err(locator.error(
            span_of(&cluster.failure_timeout),
            "cluster.failure_timeout",
            format!(
                "{failure_timeout:?} is outside {MIN_FAILURE_TIMEOUT:?} to {MAX_FAILURE_TIMEOUT:?}: shorter would mark nodes down during a leader election (400-800 ms), longer leaves a dead node's keys unserved for that long"
            ),
        ));
    }
    Ok(failure_timeout)
}

/// `cluster.replace_after` (optional): above `failure_timeout` (a member is `down` only after
/// that long), at most [`MAX_REPLACE_AFTER`].
fn parse_replace_after(
    locator: &Locator<'_>,
    cluster: &RawCluster,
    failure_timeout: Duration,
) -> Result<Option<Duration>> {
    let Some(value) = &cluster.replace_after else {
        return Ok(None);
    };
    let replace_after = locator.duration(
        &cluster.replace_after,
        "cluster.replace_after",
        Duration::ZERO,
    )?;
    if replace_after < failure_timeout || replace_after > MAX_REPLACE_AFTER {
        return Err(locator.error(
            value.span(),
            "cluster.replace_after",
            format!(
                "{replace_after:?} is outside failure_timeout ({failure_timeout:?}) to {MAX_REPLACE_AFTER:?}: leave it out to never replace a node that is down"
            ),
        ));
    }
    Ok(Some(replace_after))
}

/// `cluster.poll_spin` (parsed) is at most [`MAX_POLL_SPIN`].
fn check_poll_spin(locator: &Locator<'_>, cluster: &RawCluster, poll_spin: Duration) -> Result<()> {
    if poll_spin <= MAX_POLL_SPIN {
        return Ok(());
    }
    Err(locator.error(
        span_of(&cluster.poll_spin),
        "cluster.poll_spin",
        format!(
            "{poll_spin:?} is more than the {MAX_POLL_SPIN:?} allowed: a longer spin only burns \
             a core; tens of microseconds is what cuts a wake-up (docs/benchmarks.md)"
        ),
    ))
}

/// The `[cluster]` section's ssh keys, defaults where absent.
fn ssh_settings(cluster: &RawCluster) -> SshSettings {
    SshSettings {
        user: cluster.ssh_user.as_ref().map(|user| user.get_ref().clone()),
        options: cluster
            .ssh_options
            .as_ref()
            .map(|options| options.get_ref().clone())
            .unwrap_or_default(),
        remote_binary: cluster.remote_binary.as_ref().map_or_else(
            || "rdkv-server".to_string(),
            |binary| binary.get_ref().clone(),
        ),
        remote_run_dir: cluster.remote_run_dir.as_ref().map_or_else(
            || format!(".rdkv/{}", cluster.name.get_ref()),
            |directory| directory.get_ref().clone(),
        ),
    }
}

/// `cluster.replicas`: 1 to [`MAX_REPLICAS`], and at most the nodes (1 when absent).
pub(super) fn parse_replicas(
    locator: &Locator<'_>,
    cluster: &RawCluster,
    node_count: usize,
) -> Result<usize> {
    let Some(replicas) = &cluster.replicas else {
        return Ok(1);
    };
    let count = *replicas.get_ref();
    let limit = MAX_REPLICAS.min(node_count);
    if count == 0 || count > limit as u64 {
        let why = if count > MAX_REPLICAS as u64 || count == 0 {
            format!("rdkv keeps 1 to {MAX_REPLICAS} copies of a key")
        } else {
            format!(
                "the file has {node_count} node(s), and each copy of a key lives on a different node"
            )
        };
        return Err(locator.error(
            replicas.span(),
            "cluster.replicas",
            format!("{count} is not between 1 and {limit}: {why}"),
        ));
    }
    Ok(count as usize)
}

/// The `[cluster]` connection limits, defaults where absent, checked against each other.
pub(super) fn connection_limits(
    locator: &Locator<'_>,
    cluster: &RawCluster,
) -> Result<ConnectionLimits> {
    let defaults = ConnectionLimits::default();
    if let Some(value) = cluster
        .max_connections
        .as_ref()
        .filter(|value| *value.get_ref() < 2)
    {
        // Before the generic check of counts (at least 1), so 0 and 1 get the same message.
        return Err(locator.error(
            value.span(),
            "cluster.max_connections",
            format!(
                "{} is too few: at least 2 (the unauthenticated budget must stay below it)",
                value.get_ref()
            ),
        ));
    }
    let max_connections = locator.count(
        &cluster.max_connections,
        "cluster.max_connections",
        defaults.max_connections,
    )?;
    let limits = ConnectionLimits {
        max_connections,
        // Unset, it follows a smaller max_connections (a quarter of it), so lowering
        // max_connections alone never trips the check below.
        max_unauthenticated: locator.count(
            &cluster.max_unauthenticated_connections,
            "cluster.max_unauthenticated_connections",
            default_unauthenticated(max_connections),
        )?,
        max_pending_per_address: locator.count(
            &cluster.max_pending_per_address,
            "cluster.max_pending_per_address",
            defaults.max_pending_per_address,
        )?,
        handshake_deadline: locator.duration(
            &cluster.handshake_deadline,
            "cluster.handshake_deadline",
            defaults.handshake_deadline,
        )?,
        fabric_engine_threads: fabric_engine_threads(locator, cluster)?,
        fabric_hello_deadline: locator.duration(
            &cluster.fabric_hello_deadline,
            "cluster.fabric_hello_deadline",
            defaults.fabric_hello_deadline,
        )?,
        fabric_max_pending_hellos: fabric_max_pending_hellos(locator, cluster)?,
        fabric_response_buffer: fabric_response_buffer(locator, cluster)?,
    };
    check_limits_against_each_other(locator, cluster, &limits)?;
    Ok(limits.clamp_per_address())
}

/// `cluster.fabric_engine_threads`: at most [`MAX_ENGINE_THREADS`].
fn fabric_engine_threads(locator: &Locator<'_>, cluster: &RawCluster) -> Result<usize> {
    match &cluster.fabric_engine_threads {
        None => Ok(ConnectionLimits::default().fabric_engine_threads),
        Some(value) if *value.get_ref() > MAX_ENGINE_THREADS => Err(locator.error(
            value.span(),
            "cluster.fabric_engine_threads",
            format!("at most {MAX_ENGINE_THREADS} (0 means one per core)"),
        )),
        Some(value) => Ok(*value.get_ref() as usize),
    }
}

/// `cluster.fabric_max_pending_hellos`: 1 to [`MAX_PENDING_HELLOS`].
fn fabric_max_pending_hellos(locator: &Locator<'_>, cluster: &RawCluster) -> Result<usize> {
    let pending = locator.count(
        &cluster.fabric_max_pending_hellos,
        "cluster.fabric_max_pending_hellos",
        ConnectionLimits::default().fabric_max_pending_hellos,
    )?;
    if pending > MAX_PENDING_HELLOS {
        return Err(locator.error(
            span_of(&cluster.fabric_max_pending_hellos),
            "cluster.fabric_max_pending_hellos",
            format!("at most {MAX_PENDING_HELLOS}: each pending hello holds a socket"),
        ));
    }
    Ok(pending)
}

/// `cluster.fabric_response_buffer`: between [`MIN_RESPONSE_BUFFER`] and
/// [`MAX_RESPONSE_BUFFER`].
fn fabric_response_buffer(locator: &Locator<'_>, cluster: &RawCluster) -> Result<usize> {
    let Some(value) = &cluster.fabric_response_buffer else {
        return Ok(ConnectionLimits::default().fabric_response_buffer);
    };
    let bytes = locator.size(value, "cluster.fabric_response_buffer".into())?;
    if !(MIN_RESPONSE_BUFFER..=MAX_RESPONSE_BUFFER).contains(&bytes) {
        return Err(locator.error(
            value.span(),
            "cluster.fabric_response_buffer",
            "between 64K and 256M: at least a few answers, at most what a connection may hold",
        ));
    }
    Ok(bytes as usize)
}

/// The unauthenticated budget is below the total; the deadlines are within their bounds.
fn check_limits_against_each_other(
    locator: &Locator<'_>,
    cluster: &RawCluster,
    limits: &ConnectionLimits,
) -> Result<()> {
    if limits.max_unauthenticated >= limits.max_connections {
        let span = span_of(&cluster.max_unauthenticated_connections);
        return Err(locator.error(
            span,
            "cluster.max_unauthenticated_connections",
            format!(
                "{} must be below max_connections ({}): the unauthenticated budget is the smaller one",
                limits.max_unauthenticated, limits.max_connections
            ),
        ));
    }
    if !(Duration::from_secs(1)..=Duration::from_secs(120)).contains(&limits.handshake_deadline) {
        let span = span_of(&cluster.handshake_deadline);
        return Err(locator.error(
            span,
            "cluster.handshake_deadline",
            "between 1s and 120s: a handshake takes a few round trips",
        ));
    }
    if !(Duration::from_millis(100)..=Duration::from_secs(60))
        .contains(&limits.fabric_hello_deadline)
    {
        let span = span_of(&cluster.fabric_hello_deadline);
        return Err(locator.error(
            span,
            "cluster.fabric_hello_deadline",
            "between 100ms and 60s: a dialer sends its 40-byte hello at once",
        ));
    }
    Ok(())
}

/// The bounds of `fabric_response_buffer`.
const MIN_RESPONSE_BUFFER: u64 = 64 * 1024;
const MAX_RESPONSE_BUFFER: u64 = 256 << 20;

/// The most soft hellos a cluster file may let be pending at once.
const MAX_PENDING_HELLOS: usize = 65_536;

/// The most soft engine threads a cluster file may ask for.
const MAX_ENGINE_THREADS: u64 = 256;

impl ConnectionLimits {
    /// The per-address limit is at most the overall one.
    fn clamp_per_address(mut self) -> Self {
        self.max_pending_per_address = self.max_pending_per_address.min(self.max_unauthenticated);
        self
    }
}
