//! Opening an RDMA device: the device by name, the port, the GID index, and the one protection
//! domain every rdkv object of the device shares.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain as SidewayDomain;

use crate::device::VerbsOptions;
use crate::error::{Error, Result};
use crate::lock;
use crate::provider::verbs::probe::check_atomic_byte_order;
use crate::types::VerbsAddress;

/// `ibv_port_state::IBV_PORT_ACTIVE`.
const PORT_ACTIVE: u32 = 4;
/// `ibv_gid_type_sysfs` value of a RoCE v2 GID.
const GID_TYPE_ROCE_V2: u32 = 1;
/// How many GID table entries the automatic choice looks at.
const GID_SCAN_LIMIT: u32 = 16;

/// An opened device with its port and GID chosen and its shared protection domain.
pub(crate) struct VerbsContext {
    /// The device name (`rxe0`, `mlx5_0`).
    pub(crate) name: String,
    /// The port used by every queue pair (from 1).
    pub(crate) port: u8,
    /// The GID index used as the source GID.
    pub(crate) gid_index: u32,
    /// The GID at that index.
    pub(crate) gid: [u8; 16],
    /// The port LID (0 on RoCE).
    pub(crate) lid: u16,
    /// The port's active MTU (`ibv_mtu`).
    pub(crate) mtu: u32,
    /// Outstanding RDMA READs and atomics a queue pair may initiate.
    pub(crate) max_read_atomic: u8,
    /// Outstanding RDMA READs and atomics a queue pair may serve.
    pub(crate) max_dest_read_atomic: u8,
    /// The device's limit on memory windows (0 when it has none).
    pub(crate) max_memory_windows: i32,
    /// The one protection domain; holds the context alive.
    pub(crate) protection_domain: Arc<SidewayDomain>,
    /// The device context.
    pub(crate) context: Arc<DeviceContext>,
}

impl std::fmt::Debug for VerbsContext {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("VerbsContext")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("gid", &std::net::Ipv6Addr::from(self.gid))
            .finish_non_exhaustive()
    }
}

fn unavailable(reason: String) -> Error {
    Error::VerbsDevice { reason }
}

/// The opened devices of this process, by their options, so every rdkv device with the same
/// options shares one context and one PD.
fn opened() -> &'static Mutex<HashMap<String, Weak<VerbsContext>>> {
    static OPENED: OnceLock<Mutex<HashMap<String, Weak<VerbsContext>>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

impl VerbsContext {
    /// The process's opened device for `options`, opening it (and running the atomics
    /// self-test) if none is alive.
    ///
    /// # Errors
    /// As [`VerbsContext::open`] and [`check_atomic_byte_order`].
    pub(crate) fn shared(options: &VerbsOptions) -> Result<Arc<Self>> {
        let key = format!("{options:?}");
        let mut opened = lock(opened());
        if let Some(context) = opened.get(&key).and_then(Weak::upgrade) {
            return Ok(context);
        }
        let context = Arc::new(Self::open(options)?);
        check_atomic_byte_order(&context)?;
        opened.retain(|_, context| context.strong_count() > 0);
        opened.insert(key, Arc::downgrade(&context));
        Ok(context)
    }

    /// Opens the device `options` names (or the first one), checks that the port is active and
    /// picks the GID.
    ///
    /// # Errors
    /// [`Error::VerbsDevice`] naming what is missing and how to fix it.
    pub(crate) fn open(options: &VerbsOptions) -> Result<Self> {
        let devices = DeviceList::new().map_err(|error| {
            let cause = std::error::Error::source(&error)
                .map(ToString::to_string)
                .unwrap_or_default();
            // The raw errno: EOPNOTSUPP when libibverbs.so.1 could not be loaded, ENOSYS when
            // the kernel has no RDMA subsystem.
            let errno = match &error.0 {
                GetDeviceListErrorKind::Ibverbs(source) => source.raw_os_error(),
                _ => None,
            };
            let fix = match errno {
                Some(libc::ENOSYS) => {
                    "the kernel has no RDMA support (/sys/class/infiniband is missing): load the \
                     NIC's driver, or Soft-RoCE with `modprobe rdma_rxe && rdma link add rxe0 \
                     type rxe netdev <interface>`"
                }
                _ => {
                    "install the verbs library and providers with `apt-get install libibverbs1 \
                     ibverbs-providers`"
                }
            };
            unavailable(format!(
                "cannot list RDMA devices ({error}: {cause}); {fix}"
            ))
        })?;
        let names: Vec<String> = devices.iter().map(|device| device.name()).collect();
        if names.is_empty() {
            return Err(unavailable(
                "no RDMA device found (`ibv_devices` lists none): load the NIC's driver, or create \
                 a Soft-RoCE device with `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev \
                 <interface>`"
                    .into(),
            ));
        }
        let index = match &options.device {
            Some(wanted) => names
                .iter()
                .position(|name| name == wanted)
                .ok_or_else(|| {
                    unavailable(format!(
                        "no RDMA device named {wanted:?}; this machine has {}",
                        names.join(", ")
                    ))
                })?,
            None => 0,
        };
        let name = names[index].clone();
        let device = devices
            .get(index)
            .ok_or_else(|| unavailable(format!("device {name} vanished while opening it")))?;
        let context = device
            .open()
            .map_err(|error| unavailable(format!("cannot open {name}: {error}")))?;
        let port = options.port.unwrap_or(1);
        let port_attributes = context
            .query_port(port)
            .map_err(|error| unavailable(format!("cannot query port {port} of {name}: {error}")))?;
        if port_attributes.attr.state != PORT_ACTIVE {
            return Err(unavailable(format!(
                "port {port} of {name} is not ACTIVE (state {}): check the link with \
                 `ibv_devinfo -d {name}` and `rdma link show`",
                port_attributes.attr.state
            )));
        }
        let (gid_index, gid) = choose_gid(&context, &name, port, options.gid_index)?;
        let device_attributes = context
            .query_device()
            .map_err(|error| unavailable(format!("cannot query {name}: {error}")))?;
        let clamp = |value: i32| value.clamp(1, 16) as u8;
        let protection_domain = context.alloc_pd().map_err(|error| {
            unavailable(format!(
                "cannot allocate a protection domain on {name}: {error}"
            ))
        })?;
        let opened = Self {
            name,
            port,
            gid_index,
            gid,
            lid: port_attributes.attr.lid,
            mtu: port_attributes.attr.active_mtu,
            max_read_atomic: clamp(device_attributes.max_qp_init_rd_atom()),
            max_dest_read_atomic: clamp(device_attributes.max_qp_rd_atom()),
            max_memory_windows: device_attributes.max_mw(),
            protection_domain,
            context,
        };
        tracing::info!(
            device = %opened.name,
            port,
            gid_index,
            gid = %std::net::Ipv6Addr::from(gid),
            mtu = opened.mtu,
            max_memory_windows = opened.max_memory_windows,
            "opened RDMA device"
        );
        Ok(opened)
    }

    /// This port's address with a starting PSN.
    pub(crate) fn address(&self, psn: u32) -> VerbsAddress {
        VerbsAddress {
            gid: self.gid,
            lid: self.lid,
            psn,
            mtu: self.mtu,
        }
    }
}

/// The configured GID index, or the first RoCE v2 GID holding an IPv4-mapped address, or the
/// first non-zero GID.
fn choose_gid(
    context: &DeviceContext,
    name: &str,
    port: u8,
    configured: Option<u32>,
) -> Result<(u32, [u8; 16])> {
    if let Some(index) = configured {
        if index > u32::from(u8::MAX) {
            return Err(unavailable(format!(
                "GID index {index} is out of range: an address vector holds indexes 0–255"
            )));
        }
        let gid = context.query_gid(port, index).map_err(|error| {
            unavailable(format!(
                "cannot read GID index {index} of {name} port {port} ({error}); list the valid \
                 ones with `ibv_devinfo -v -d {name}` or `show_gids`"
            ))
        })?;
        if gid.raw == [0u8; 16] {
            return Err(unavailable(format!(
                "GID index {index} of {name} port {port} is empty; list the valid ones with \
                 `ibv_devinfo -v -d {name}` or `show_gids`"
            )));
        }
        return Ok((index, gid.raw));
    }
    let mut first_valid = None;
    for index in 0..GID_SCAN_LIMIT {
        let Ok(gid) = context.query_gid(port, index) else {
            break;
        };
        if gid.raw == [0u8; 16] {
            continue;
        }
        first_valid.get_or_insert((index, gid.raw));
        let ipv4_mapped = gid.raw[..10] == [0u8; 10] && gid.raw[10..12] == [0xff, 0xff];
        let roce_v2 = context.query_gid_type(port, index).ok() == Some(GID_TYPE_ROCE_V2);
        if ipv4_mapped && roce_v2 {
            return Ok((index, gid.raw));
        }
    }
    first_valid.ok_or_else(|| {
        unavailable(format!(
            "{name} port {port} has no GID: give its network interface an IP address (RoCE) or \
             check the subnet manager (InfiniBand)"
        ))
    })
}
