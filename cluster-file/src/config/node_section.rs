//! The `[[node]]` sections: each node's addresses (unique across the file), table sizes, shared
//! memory, host, and whether a node started here fits this machine.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use rdkv_common::layout::{COMBINED_BUCKET_SIZE, MAX_BLOCK_SIZE, MIN_HEAP_CHUNKS};
use rdkv_fabric::memory::limits::{decide_available_memory, decide_memlock};
use rdkv_fabric::memory::{HugepagePolicy, PinLimits};
use rdkv_fabric::Backend;
use toml::Spanned;

use super::{
    span_of, Locator, MachineCheck, NodeConfig, RawFile, RawNode, ShmMode, DEFAULT_CHUNK_SIZE,
};
use crate::error::{Error, Result};

/// The largest `index_size` or `heap_size` a file may give, 64 TiB: more than any machine
/// pins, and far from the overflow of the sums and products the sizing does.
const MAX_TABLE_SIZE: u64 = 1 << 46;

/// Every `[[node]]` section, in file order: ids and addresses must be unique across them.
pub(super) fn parse_node_sections(
    locator: &Locator<'_>,
    raw: &RawFile,
    fabric: Backend,
    machine: Option<MachineCheck>,
) -> Result<Vec<NodeConfig>> {
    if raw.nodes.is_empty() {
        return Err(locator.error(
            raw.cluster.span(),
            "node",
            "no [[node]] tables: a cluster needs at least one node",
        ));
    }
    let mut nodes = Vec::new();
    let mut ids: HashMap<u32, usize> = HashMap::new();
    let mut addresses: HashMap<SocketAddr, String> = HashMap::new();
    for (index, section) in raw.nodes.iter().enumerate() {
        let node = NodeSection {
            locator,
            index,
            section,
        };
        let id = node.section.get_ref().id.get_ref();
        if *id == 0 {
            // 0 stands for "no node" where a node id is reported (the view's leader).
            return Err(node.error(
                node.section.get_ref().id.span(),
                "id",
                "0 is not a node id: node ids start at 1",
            ));
        }
        if let Some(first) = ids.insert(*id, index) {
            return Err(node.error(
                node.section.get_ref().id.span(),
                "id",
                format!("duplicate id {id} (also node[{first}])"),
            ));
        }
        nodes.push(node.parse(fabric, machine, &mut addresses)?);
    }
    Ok(nodes)
}

/// One `[[node]]` section being validated: its errors name `node[index].field`.
struct NodeSection<'a> {
    /// Builds errors that point into the file.
    locator: &'a Locator<'a>,
    /// The section's place among the file's `[[node]]` sections.
    index: usize,
    /// The section as read.
    section: &'a Spanned<RawNode>,
}

/// A node's addresses, parsed.
struct NodeAddresses {
    /// `control_address`.
    control: SocketAddr,
    /// `fabric_address`, when given.
    fabric: Option<SocketAddr>,
    /// `metrics_address`, when given.
    metrics: Option<SocketAddr>,
}

/// A node's table sizes in bytes, parsed and checked against each other.
struct NodeSizes {
    /// `index_size`.
    index: u64,
    /// `heap_size`.
    heap: u64,
    /// `chunk_size`, or its default for the heap.
    chunk: u64,
}

impl NodeSection<'_> {
    /// The node's configuration, its keys checked in the order the errors should come in.
    /// `addresses` holds the addresses of the nodes before it (and gets this node's).
    fn parse(
        &self,
        fabric: Backend,
        machine: Option<MachineCheck>,
        addresses: &mut HashMap<SocketAddr, String>,
    ) -> Result<NodeConfig> {
        let node = self.section.get_ref();
        let id = *node.id.get_ref();
        let parsed = self.addresses(fabric, addresses)?;
        let sizes = self.sizes()?;
        let hugepages = match &node.hugepages {
            None => HugepagePolicy::Auto,
            Some(policy) => policy
                .get_ref()
                .parse()
                .map_err(|message: String| self.error(policy.span(), "hugepages", message))?,
        };
        let max_pinned_share = node
            .max_pinned_share
            .as_ref()
            .map_or(0.5, |share| *share.get_ref());
        let shm = self.shm()?;
        let shm_socket = self.shm_socket()?;
        let data_dir = self.data_dir()?;
        let host = self.host(parsed.control)?;
        // Only a node whose process starts here pins its table here.
        let checked =
            machine.filter(|machine| host.is_none() && machine.only.is_none_or(|only| only == id));
        if let Some(machine) = checked {
            self.check_fits(
                machine,
                sizes.index.saturating_add(sizes.heap),
                max_pinned_share,
            )?;
        }
        Ok(NodeConfig {
            id,
            host,
            control_address: parsed.control,
            fabric_address: parsed.fabric,
            device: node.device.as_ref().map(|device| device.get_ref().clone()),
            gid_index: node.gid_index.as_ref().map(|index| *index.get_ref()),
            metrics_address: parsed.metrics,
            index_size: sizes.index,
            heap_size: sizes.heap,
            chunk_size: sizes.chunk,
            hugepages,
            max_pinned_share,
            shm,
            shm_socket,
            data_dir,
        })
    }

    /// `node[index].field`.
    fn field(&self, field: &str) -> String {
        format!("node[{}].{field}", self.index)
    }

    /// An error about this node's `field`.
    fn error(
        &self,
        span: std::ops::Range<usize>,
        field: &str,
        message: impl Into<String>,
    ) -> Error {
        self.locator.error(span, self.field(field), message)
    }

    /// The node's addresses: a fabric address for the soft fabric, no port 0, none used twice
    /// in the file.
    fn addresses(
        &self,
        fabric: Backend,
        seen: &mut HashMap<SocketAddr, String>,
    ) -> Result<NodeAddresses> {
        let node = self.section.get_ref();
        let optional = |address: &Option<Spanned<String>>, field: &str| {
            address
                .as_ref()
                .map(|address| self.locator.address(address, self.field(field)))
                .transpose()
        };
        let parsed = NodeAddresses {
            control: self
                .locator
                .address(&node.control_address, self.field("control_address"))?,
            fabric: optional(&node.fabric_address, "fabric_address")?,
            metrics: optional(&node.metrics_address, "metrics_address")?,
        };
        if fabric == Backend::Soft && parsed.fabric.is_none() {
            return Err(self.error(
                self.section.span(),
                "fabric_address",
                "missing: the soft fabric needs an address per node",
            ));
        }
        let spans = [
            (
                Some(parsed.control),
                node.control_address.span(),
                "control_address",
            ),
            (
                parsed.fabric,
                span_of(&node.fabric_address),
                "fabric_address",
            ),
            (
                parsed.metrics,
                span_of(&node.metrics_address),
                "metrics_address",
            ),
        ];
        for (address, span, field) in spans {
            let Some(address) = address else { continue };
            if address.port() == 0 {
                return Err(self.error(
                    span,
                    field,
                    "port 0 is not allowed here: clients need to know the port",
                ));
            }
            if let Some(other) = seen.insert(address, self.field(field)) {
                return Err(self.error(
                    span,
                    field,
                    format!("duplicate address {address} (also {other})"),
                ));
            }
        }
        Ok(parsed)
    }

    /// The node's table sizes: an index of two combined buckets or more, chunks that hold the
    /// largest block, a heap of [`MIN_HEAP_CHUNKS`] chunks or more.
    fn sizes(&self) -> Result<NodeSizes> {
        let node = self.section.get_ref();
        let index = self
            .locator
            .size(&node.index_size, self.field("index_size"))?;
        let heap = self
            .locator
            .size(&node.heap_size, self.field("heap_size"))?;
        let chunk = node
            .chunk_size
            .as_ref()
            .map(|size| self.locator.size(size, self.field("chunk_size")))
            .transpose()?
            .unwrap_or(
                DEFAULT_CHUNK_SIZE
                    .min(heap / MIN_HEAP_CHUNKS / 4096 * 4096)
                    .max(MAX_BLOCK_SIZE.div_ceil(4096) * 4096),
            );
        for (size, value, field) in [
            (index, &node.index_size, "index_size"),
            (heap, &node.heap_size, "heap_size"),
        ] {
            if size > MAX_TABLE_SIZE {
                return Err(self.error(
                    value.span(),
                    field,
                    format!("{size} bytes is more than any machine pins: at most {MAX_TABLE_SIZE} bytes (64 TiB)"),
                ));
            }
        }
        if index < 2 * COMBINED_BUCKET_SIZE {
            return Err(self.error(
                node.index_size.span(),
                "index_size",
                format!(
                    "{index} bytes is too small: at least {} bytes (two combined buckets)",
                    2 * COMBINED_BUCKET_SIZE
                ),
            ));
        }
        if chunk < MAX_BLOCK_SIZE || chunk % 4096 != 0 {
            let span = node
                .chunk_size
                .as_ref()
                .map_or(self.section.span(), Spanned::span);
            return Err(self.error(
                span,
                "chunk_size",
                format!("{chunk} bytes: a chunk must be a multiple of 4096 and hold the largest block ({MAX_BLOCK_SIZE} bytes)"),
            ));
        }
        if heap < MIN_HEAP_CHUNKS * chunk {
            return Err(self.error(
                node.heap_size.span(),
                "heap_size",
                format!("{heap} bytes is too small: at least {MIN_HEAP_CHUNKS} chunks ({} bytes; one is the compactor's, one its reserve); raise heap_size or lower chunk_size", MIN_HEAP_CHUNKS * chunk),
            ));
        }
        Ok(NodeSizes { index, heap, chunk })
    }

    /// `shm`: `auto` (the default) or `off`.
    fn shm(&self) -> Result<ShmMode> {
        let Some(mode) = &self.section.get_ref().shm else {
            return Ok(ShmMode::Auto);
        };
        match mode.get_ref().as_str() {
            "auto" => Ok(ShmMode::Auto),
            "off" => Ok(ShmMode::Off),
            other => Err(self.error(
                mode.span(),
                "shm",
                format!("`{other}`: expected \"auto\" (clients on the node's host use shared memory) or \"off\""),
            )),
        }
    }

    /// `shm_socket`: a path, when given.
    fn shm_socket(&self) -> Result<Option<PathBuf>> {
        match &self.section.get_ref().shm_socket {
            Some(path) if path.get_ref().trim().is_empty() => Err(self.error(
                path.span(),
                "shm_socket",
                "empty: give a path for the node's Unix-domain socket, or leave it out",
            )),
            Some(path) => Ok(Some(PathBuf::from(path.get_ref()))),
            None => Ok(None),
        }
    }

    /// `data_dir`: a path, when given.
    fn data_dir(&self) -> Result<Option<PathBuf>> {
        match &self.section.get_ref().data_dir {
            Some(path) if path.get_ref().trim().is_empty() => Err(self.error(
                path.span(),
                "data_dir",
                "empty: give a directory for the node's snapshots, or leave it out",
            )),
            // Relative to the cluster file, as `secret_file` is.
            Some(path) => Ok(Some(
                self.locator
                    .path
                    .parent()
                    .unwrap_or(std::path::Path::new("."))
                    .join(path.get_ref()),
            )),
            None => Ok(None),
        }
    }

    /// The node's ssh destination: `host`, or without it the control address's IP unless that
    /// is loopback or unspecified; `None` for this machine.
    fn host(&self, control_address: SocketAddr) -> Result<Option<String>> {
        match &self.section.get_ref().host {
            Some(host) if host.get_ref().trim().is_empty() => Err(self.error(
                host.span(),
                "host",
                "empty: name an ssh destination, or leave host out for this machine",
            )),
            Some(host) => Ok((!is_this_machine(host.get_ref())).then(|| host.get_ref().clone())),
            None => {
                let ip = control_address.ip();
                Ok((!(ip.is_loopback() || ip.is_unspecified())).then(|| ip.to_string()))
            }
        }
    }

    /// The `pinned` bytes of a node started here fit this machine's memlock limit and memory.
    fn check_fits(&self, machine: MachineCheck, pinned: u64, max_pinned_share: f64) -> Result<()> {
        let too_large = |error: &dyn std::fmt::Display| {
            self.error(
                self.section.get_ref().heap_size.span(),
                "heap_size",
                format!("index_size + heap_size is too large for this machine: {error}"),
            )
        };
        decide_memlock(pinned, machine.memlock).map_err(|error| too_large(&error))?;
        decide_available_memory(
            pinned,
            machine.available_memory,
            PinLimits { max_pinned_share },
        )
        .map_err(|error| too_large(&error))?;
        Ok(())
    }
}

/// Whether a node's `host` names this machine: `localhost`, a loopback address, or this
/// machine's host name.
fn is_this_machine(host: &str) -> bool {
    if host == "localhost" {
        return true;
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .is_ok_and(|name| !name.trim().is_empty() && name.trim() == host)
}
