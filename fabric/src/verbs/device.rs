//! The RDMA device and queue pairs: opening the device (by name, `DINOMO_RDMA_DEVICE`, else the
//! first), picking its GID, and taking an RC queue pair through its states (INIT, RTR, RTS, and
//! back through RESET when a connection restarts after an error).
//!
//! Invariants:
//! - Every queue pair gets its own protection domain ([`Device::new_qp`]): memory regions
//!   registered in it are reachable only through that QP.
//! - A QP's fields drop in the order QP, CQ, PD ([`QpParts`]).
//! - [`Device::restart_qp`] is called only when no work request of the QP is outstanding (its
//!   completions, flushed or not, have all been polled), so the CQ is empty when it returns.

use std::fmt;
use std::net::Ipv6Addr;
use std::sync::Arc;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState};
use sideway::ibverbs::AccessFlags;

use super::side::Endpoint;
use super::{chain, transport, verbs_err};
use crate::error::{FabricError, Result};

pub(super) const PORT: u8 = 1;
/// Outstanding RDMA READs/atomics per QP we ask for (capped by the devices).
const RD_ATOMIC: u8 = 16;

/// Names of the RDMA devices on this host (empty when there are none or libibverbs is absent).
pub fn device_names() -> Vec<String> {
    match DeviceList::new() {
        Ok(list) => list.iter().map(|d| d.name()).collect(),
        Err(_) => Vec::new(),
    }
}

/// The device, port and GID one side of a connection uses.
pub(super) struct Device {
    ctx: Arc<DeviceContext>,
    pub(super) name: String,
    gid_index: u8,
    pub(super) gid: Gid,
    lid: u16,
    mtu: Mtu,
    /// The most outstanding READs/atomics this device takes as responder and as initiator.
    pub(super) max_rd_atomic: u8,
    pub(super) max_init_rd_atomic: u8,
    /// The device's limits on memory regions and protection domains (`ibv_query_device`).
    pub(super) max_mr: u32,
    pub(super) max_pd: u32,
}
impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("gid_index", &self.gid_index)
            .field("gid", &Ipv6Addr::from(self.gid))
            .field("mtu", &self.mtu)
            .finish()
    }
}

impl Device {
    /// Opens the device named `wanted`, else the one `DINOMO_RDMA_DEVICE` names, else the first.
    pub(super) fn open(wanted: Option<&str>) -> Result<Self> {
        let list = DeviceList::new()
            .map_err(|e| FabricError::Config(format!("listing RDMA devices: {}", chain(&e))))?;
        let (wanted, from) = match wanted.filter(|s| !s.is_empty()) {
            Some(name) => (Some(name.to_string()), "asked for"),
            None => (
                std::env::var("DINOMO_RDMA_DEVICE")
                    .ok()
                    .filter(|s| !s.is_empty()),
                "DINOMO_RDMA_DEVICE",
            ),
        };
        let dev = match &wanted {
            Some(name) => list.iter().find(|d| d.name() == *name).ok_or_else(|| {
                let present: Vec<String> = list.iter().map(|d| d.name()).collect();
                FabricError::Config(format!(
                    "RDMA device {name:?} ({from}) not found; present: {}",
                    if present.is_empty() {
                        "none".to_string()
                    } else {
                        present.join(", ")
                    }
                ))
            })?,
            None => list
                .iter()
                .next()
                .ok_or_else(|| FabricError::Config("no RDMA device is present".into()))?,
        };
        let name = dev.name();
        let ctx = dev
            .open()
            .map_err(|e| transport(format!("opening {name}: {}", chain(&e))))?;
        drop(list);
        let port = ctx
            .query_port(PORT)
            .map_err(|e| transport(format!("{name} port {PORT}: {}", chain(&e))))?;
        let attr = ctx
            .query_device()
            .map_err(|e| transport(format!("{name}: {}", chain(&e))))?;
        let (gid_index, gid) = pick_gid(&ctx, &name)?;
        let cap = |v: i32| u8::try_from(v.clamp(1, i32::from(RD_ATOMIC))).unwrap_or(1);
        Ok(Device {
            name,
            gid_index,
            gid,
            lid: port.lid(),
            mtu: port.active_mtu(),
            max_rd_atomic: cap(attr.max_qp_rd_atom()),
            max_init_rd_atomic: cap(attr.max_qp_init_rd_atom()),
            max_mr: u32::try_from(attr.max_mr()).unwrap_or(0),
            max_pd: u32::try_from(attr.max_pd()).unwrap_or(0),
            ctx,
        })
    }

    /// A protection domain of its own.
    pub(super) fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>> {
        self.ctx
            .alloc_pd()
            .map_err(|e| verbs_err("allocating a protection domain")(&e))
    }

    /// A protection domain, a CQ and an RC QP in the INIT state. `remote_access`: the QP may
    /// be the target of remote READ, WRITE and atomics (the memory node's side; what each
    /// request may touch is then up to the memory regions).
    pub(super) fn new_qp(&self, depth: usize, remote_access: bool) -> Result<QpParts> {
        let pd = self
            .ctx
            .alloc_pd()
            .map_err(|e| verbs_err("allocating a protection domain")(&e))?;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(depth as u32)
            .build()
            .map_err(|e| verbs_err("creating a completion queue")(&e))?;
        let qp = pd
            .create_qp_builder()
            .setup_max_send_wr(depth as u32)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build()
            .map_err(|e| verbs_err("creating an RC queue pair")(&e))?;
        let mut parts = QpParts {
            qp,
            cq,
            pd,
            psn: new_psn(),
            remote_access,
        };
        self.init_qp(&mut parts)?;
        Ok(parts)
    }

    /// Moves a QP in RESET to INIT.
    fn init_qp(&self, parts: &mut QpParts) -> Result<()> {
        let access = if parts.remote_access {
            AccessFlags::LocalWrite
                | AccessFlags::RemoteWrite
                | AccessFlags::RemoteRead
                | AccessFlags::RemoteAtomic
        } else {
            AccessFlags::LocalWrite
        };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(PORT)
            .setup_access_flags(access);
        parts
            .qp
            .modify(&attr)
            .map_err(|e| verbs_err("moving the QP to INIT")(&e))
    }

    /// Takes a QP (typically in the error state, after the device refused a request) back
    /// through RESET to INIT, with a fresh PSN, ready for [`Device::connect_qp`] again. The
    /// caller has polled every completion of the QP: nothing is outstanding.
    pub(super) fn restart_qp(&self, parts: &mut QpParts) -> Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Reset);
        parts
            .qp
            .modify(&attr)
            .map_err(|e| verbs_err("moving the QP to RESET")(&e))?;
        parts.psn = new_psn();
        self.init_qp(parts)
    }

    pub(super) fn endpoint(&self, parts: &QpParts, rd_atomic: u8) -> Endpoint {
        Endpoint {
            qpn: parts.qp.qp_number(),
            psn: parts.psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.mtu as u32 as u8,
            rd_atomic,
        }
    }

    /// Moves an INIT QP to RTR then RTS, connected to `peer`.
    pub(super) fn connect_qp(
        &self,
        parts: &mut QpParts,
        peer: &Endpoint,
        dest_rd_atomic: u8,
        init_rd_atomic: u8,
    ) -> Result<()> {
        let mtu = self.mtu.min(peer.mtu()?);
        let mut av = AddressHandleAttribute::new();
        av.setup_dest_lid(peer.lid)
            .setup_port(PORT)
            .setup_service_level(0)
            .setup_grh_src_gid_index(self.gid_index)
            .setup_grh_dest_gid(&peer.gid)
            .setup_grh_hop_limit(64);
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(dest_rd_atomic)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&av);
        parts
            .qp
            .modify(&attr)
            .map_err(|e| verbs_err("moving the QP to RTR")(&e))?;
        let mut attr = QueuePairAttribute::new();
        // timeout 16: 4.096 us * 2^16 = 268 ms per retry; generous because the test VM emulates
        // its CPU and Soft-RoCE runs in its kernel.
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(parts.psn)
            .setup_timeout(16)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(init_rd_atomic);
        parts
            .qp
            .modify(&attr)
            .map_err(|e| verbs_err("moving the QP to RTS")(&e))?;
        Ok(())
    }
}

/// Picks the GID: `DINOMO_RDMA_GID_INDEX`, else RoCE v2 with an IPv4 address, else RoCE v2,
/// else the first non-zero one.
fn pick_gid(ctx: &DeviceContext, name: &str) -> Result<(u8, Gid)> {
    if let Some(ix) = std::env::var("DINOMO_RDMA_GID_INDEX")
        .ok()
        .filter(|s| !s.is_empty())
    {
        let ix: u8 = ix.parse().map_err(|_| {
            FabricError::Config(format!(
                "DINOMO_RDMA_GID_INDEX={ix:?} is not a small integer"
            ))
        })?;
        let gid = ctx
            .query_gid(PORT, u32::from(ix))
            .map_err(|e| FabricError::Config(format!("{name} GID index {ix}: {}", chain(&e))))?;
        return Ok((ix, gid));
    }
    let table = ctx
        .query_gid_table()
        .map_err(|e| transport(format!("{name} GID table: {}", chain(&e))))?;
    let usable = |e: &&sideway::ibverbs::address::GidEntry| {
        e.port_num() == u32::from(PORT) && !e.gid().is_zero()
    };
    let v4 = |e: &&sideway::ibverbs::address::GidEntry| {
        Ipv6Addr::from(e.gid()).to_ipv4_mapped().is_some()
    };
    let v2 = |e: &&sideway::ibverbs::address::GidEntry| e.gid_type() == GidType::RoceV2;
    let entry = table
        .iter()
        .filter(usable)
        .find(|e| v2(e) && v4(e))
        .or_else(|| table.iter().filter(usable).find(v2))
        .or_else(|| table.iter().find(usable))
        .ok_or_else(|| FabricError::Config(format!("{name} has no usable GID on port {PORT}")))?;
    let ix = u8::try_from(entry.gid_index()).map_err(|_| {
        FabricError::Config(format!("{name}: GID index {} too large", entry.gid_index()))
    })?;
    Ok((ix, entry.gid()))
}

fn new_psn() -> u32 {
    rand::random::<u32>() & 0x00ff_ffff
}

/// A queue pair with its completion queue and protection domain.
pub(super) struct QpParts {
    // Field order is drop order: the QP goes before its CQ and PD.
    pub(super) qp: BasicQueuePair,
    pub(super) cq: Arc<BasicCompletionQueue>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) psn: u32,
    /// Whether the QP accepts remote requests (see [`Device::new_qp`]).
    remote_access: bool,
}
