//! The memory node's side: [`VerbsNic`] opens the RDMA device once and serves one region to
//! every caller that holds a grant, one connection (protection domain, CQ, RC QP, memory
//! regions) per caller, set up and kept up to date over the side channel (side.rs).
//!
//! Invariants:
//! - A key is checked and its READ region registered under the connection map's lock, and
//!   every revocation changes the grant table before it takes that lock: a key revoked during
//!   a handshake never ends up with a live region.
//! - Window regions are changed only under their connection's registration lock, and always
//!   from a window read under that lock (windows.rs): a close that changed the table and then
//!   pruned the connection leaves no region for the closed range.
//! - When the side channel closes (the caller went away, or the NIC is dropped) the
//!   connection's registration leaves the map and its QP, regions and PD are freed.
//! - The node's CPU runs only the side channel: READ, WRITE and atomics are the device's.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use parking_lot::Mutex;
use sideway::ibverbs::queue_pair::QueuePair;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::device::{Device, QpParts};
use super::side::{
    check_magic, need, put_denied, put_error, put_window, read_msg, read_request, write_msg,
    Endpoint, WindowMr, MAGIC, REQ_RESTART, REQ_WINDOW, ST_OK, VERSION,
};
use super::windows::Registration;
use super::{proto, transport, REVOKE_POLL};
use crate::error::{FabricError, Result};
use crate::grants::{GrantTable, KeyFence};
use crate::op::AccessKey;
use crate::pm::PmRegion;

type Reg = Arc<Mutex<Registration>>;

struct NicShared {
    dev: Device,
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
    /// Every live connection: its key (fixed for its life) and its registration.
    conns: Mutex<HashMap<u64, (AccessKey, Reg)>>,
    next_conn: AtomicU64,
}

/// What one pass over the connections changed.
#[derive(Debug, Default, Clone, Copy)]
struct Pruned {
    /// Connections whose key is no longer valid: every region deregistered.
    fenced: usize,
    /// Window regions deregistered because their range left a valid key's window.
    windows: usize,
}

impl NicShared {
    /// The registrations of `key`'s connections (`None`: of every connection).
    fn regs(&self, key: Option<AccessKey>) -> Vec<Reg> {
        self.conns
            .lock()
            .values()
            .filter(|(k, _)| key.is_none_or(|want| *k == want))
            .map(|(_, r)| r.clone())
            .collect()
    }

    /// Deregisters every region of `key`'s connections (it was revoked). Returns how many
    /// connections had live regions.
    fn fence_key(&self, key: AccessKey) -> usize {
        self.regs(Some(key))
            .iter()
            .filter(|r| r.lock().fence())
            .count()
    }

    /// Brings the regions of `regs` in line with the grant table: all of them go for a key
    /// that is no longer valid, window regions go when their range left the window. The
    /// table must have been changed before this is called (see the module doc).
    fn prune(&self, regs: &[Reg]) -> Pruned {
        let mut out = Pruned::default();
        for r in regs {
            let mut reg = r.lock();
            if reg.is_fenced() {
                continue;
            }
            let window = match self.grants.check(reg.key) {
                Ok(()) => self.grants.window(reg.key),
                Err(e) => Err(e),
            };
            match window {
                Ok(w) => out.windows += reg.prune(&w),
                Err(FabricError::AccessDenied { .. }) => {
                    reg.fence();
                    out.fenced += 1;
                }
                // A torn window (a writer died mid-change): it grants nothing.
                Err(e) => {
                    tracing::warn!(slot = reg.key.slot, error = %e, "unreadable write window: deregistering its regions");
                    out.windows += reg.prune(&[]);
                }
            }
        }
        out
    }

    /// Answers a WINDOW request: the regions of the key's current window (registering and
    /// deregistering as needed). A key no longer valid loses every region and gets
    /// [`FabricError::AccessDenied`].
    fn sync(&self, reg: &Mutex<Registration>) -> Result<Vec<WindowMr>> {
        let mut reg = reg.lock();
        let slot = reg.key.slot;
        if reg.is_fenced() {
            return Err(FabricError::AccessDenied { slot });
        }
        if let Err(e) = self.grants.check(reg.key) {
            reg.fence();
            return Err(e);
        }
        let window = self.grants.window(reg.key)?;
        reg.sync(&window)
    }
}

/// The memory node's RDMA endpoint: serves one region to every caller that holds a grant.
pub struct VerbsNic {
    local_addr: SocketAddr,
    shared: Arc<NicShared>,
    accept: tokio::task::JoinHandle<()>,
    watcher: tokio::task::JoinHandle<()>,
    /// Dropped with the NIC: every connection task sees it and frees its QP and regions.
    _shutdown: watch::Sender<()>,
}

impl fmt::Debug for VerbsNic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsNic")
            .field("local_addr", &self.local_addr)
            .field("device", &self.shared.dev)
            .field("connections", &self.shared.conns.lock().len())
            .finish()
    }
}

impl VerbsNic {
    /// Opens the RDMA device (`DINOMO_RDMA_DEVICE`, else the first), binds the side channel on
    /// `addr` and starts serving `region` under the access rules of `grants`. Must run inside a
    /// tokio runtime.
    pub async fn start(
        addr: SocketAddr,
        region: Arc<PmRegion>,
        grants: Arc<GrantTable>,
    ) -> Result<Self> {
        Self::start_on(None, addr, region, grants).await
    }

    /// [`VerbsNic::start`] on the RDMA device named `device` (`None`: `DINOMO_RDMA_DEVICE`,
    /// else the first).
    pub async fn start_on(
        device: Option<&str>,
        addr: SocketAddr,
        region: Arc<PmRegion>,
        grants: Arc<GrantTable>,
    ) -> Result<Self> {
        let device = device.map(str::to_string);
        let dev = tokio::task::spawn_blocking(move || Device::open(device.as_deref()))
            .await
            .map_err(|e| transport(format!("opening the RDMA device: {e}")))??;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| transport(format!("binding the verbs side channel to {addr}: {e}")))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| transport(e.to_string()))?;
        tracing::info!(
            %local_addr,
            device = %dev.name,
            gid = %Ipv6Addr::from(dev.gid),
            max_mr = dev.max_mr,
            max_pd = dev.max_pd,
            "verbs NIC started (each connection takes one PD and up to 65 MRs)"
        );
        let shared = Arc::new(NicShared {
            dev,
            region,
            grants,
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
        });
        let (shutdown, shutdown_rx) = watch::channel(());

        let s = shared.clone();
        let accept = tokio::spawn(async move {
            loop {
                let (sock, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "verbs side channel accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = sock.set_nodelay(true);
                let (s, rx) = (s.clone(), shutdown_rx.clone());
                tokio::spawn(async move {
                    if let Err(e) = serve_conn(sock, s, rx).await {
                        tracing::debug!(%peer, error = %e, "verbs connection ended");
                    }
                });
            }
        });

        // Changes made in the grant table alone (another process, or a caller of the table
        // that does not go through this NIC): the regions follow within REVOKE_POLL.
        let s = shared.clone();
        let watcher = tokio::spawn(async move {
            let mut tick = tokio::time::interval(REVOKE_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let s = s.clone();
                let p = match tokio::task::spawn_blocking(move || s.prune(&s.regs(None))).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::error!(error = %e, "the verbs revoke watcher's pass failed");
                        continue;
                    }
                };
                if p.fenced > 0 || p.windows > 0 {
                    tracing::info!(
                        connections = p.fenced,
                        window_regions = p.windows,
                        "deregistered the MRs of keys revoked, and of ranges closed, in the grant table"
                    );
                }
            }
        });

        Ok(VerbsNic {
            local_addr,
            shared,
            accept,
            watcher,
            _shutdown: shutdown,
        })
    }

    /// The side channel's address (what callers connect to).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The RDMA device name this node serves on.
    pub fn device(&self) -> &str {
        &self.shared.dev.name
    }

    /// The device's limits: (memory regions, protection domains). Each connection takes one
    /// protection domain and up to 1 + [`crate::grants::MAX_WINDOW_RANGES`] regions.
    pub fn device_limits(&self) -> (u32, u32) {
        (self.shared.dev.max_mr, self.shared.dev.max_pd)
    }

    /// Revokes `key`: it is void in the grant table and every MR registered for it is
    /// deregistered now, so that caller's later one-sided operations fail at the device.
    pub fn revoke(&self, key: AccessKey) {
        if let Err(e) = self.shared.grants.revoke(key) {
            tracing::debug!(slot = key.slot, error = %e, "revoking a key the table does not know");
        }
        let n = self.shared.fence_key(key);
        tracing::info!(slot = key.slot, connections = n, "verbs access revoked");
    }

    /// Removes the range starting at `offset` from `key`'s write window (a sealed segment):
    /// in the grant table, then the write MRs of that range on every connection of `key`.
    /// When this returns, each of the caller's WRITEs there is in place or fails at the
    /// device (see the module doc, "Write windows").
    pub fn close_window(&self, key: AccessKey, offset: u64) -> Result<()> {
        self.shared.grants.close_window(key, offset)?;
        let p = self.shared.prune(&self.shared.regs(Some(key)));
        tracing::debug!(
            slot = key.slot,
            offset,
            window_regions = p.windows,
            "verbs window range closed"
        );
        Ok(())
    }
}

/// The DPM fences verbs callers through this (see the module doc, "Fencing" and "Write
/// windows").
impl KeyFence for VerbsNic {
    fn fence(&self, key: AccessKey) -> Result<()> {
        self.shared.grants.revoke(key)?;
        let n = self.shared.fence_key(key);
        tracing::info!(slot = key.slot, connections = n, "verbs access revoked");
        Ok(())
    }

    fn fence_window(&self, key: AccessKey, offset: u64) -> Result<()> {
        self.close_window(key, offset)
    }
}

impl Drop for VerbsNic {
    fn drop(&mut self) {
        self.accept.abort();
        self.watcher.abort();
    }
}

/// Removes a connection's registration when its task ends, however it ends.
struct ConnGuard {
    shared: Arc<NicShared>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.conns.lock().remove(&self.id);
    }
}

async fn serve_conn(
    mut sock: TcpStream,
    shared: Arc<NicShared>,
    mut shutdown: watch::Receiver<()>,
) -> Result<()> {
    let mut hello = read_msg(&mut sock).await?;
    check_magic(&mut hello)?;
    need(&hello, 2)?;
    let version = hello.get_u16_le();
    if version != VERSION {
        let msg = format!(
            "verbs side-channel version {version} is not supported (this node speaks {VERSION}): \
             run the dpm-node and its callers from the same build"
        );
        let mut b = BytesMut::new();
        b.put_u64_le(MAGIC);
        put_error(&mut b, &msg);
        write_msg(&mut sock, &b).await?;
        return Err(proto(msg));
    }
    need(&hello, 4 + 4 + 16)?;
    let slot = hello.get_u32_le();
    let generation = hello.get_u32_le();
    let mut secret = [0u8; 16];
    hello.copy_to_slice(&mut secret);
    let key = AccessKey {
        slot,
        generation,
        secret,
    };
    let peer = Endpoint::get(&mut hello)?;

    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let s = shared.clone();
    let setup = tokio::task::spawn_blocking(move || accept_caller(&s, id, key, &peer))
        .await
        .map_err(|e| transport(format!("verbs connection setup panicked: {e}")))?;
    // From here on the registration (if any) is removed when this function returns.
    let guard = ConnGuard {
        shared: shared.clone(),
        id,
    };

    let mut reply = BytesMut::new();
    reply.put_u64_le(MAGIC);
    let (parts, reg, read_rkey, dest_rd) = match setup {
        Ok(x) => x,
        Err(e) => {
            match &e {
                FabricError::AccessDenied { slot } => put_denied(&mut reply, *slot),
                other => put_error(&mut reply, &other.to_string()),
            }
            write_msg(&mut sock, &reply).await?;
            return Err(e);
        }
    };
    reply.put_u8(ST_OK);
    shared.dev.endpoint(&parts, dest_rd).put(&mut reply);
    reply.put_u32_le(read_rkey);
    reply.put_u64_le(shared.region.as_ptr() as u64);
    reply.put_u64_le(shared.region.len());
    write_msg(&mut sock, &reply).await?;
    tracing::debug!(
        slot = key.slot,
        qpn = parts.qp.qp_number(),
        "verbs caller connected"
    );

    // Requests until the caller closes the side channel (or the NIC is dropped). The QP, CQ
    // and PD are freed when `parts` drops, the regions when the guard takes the registration
    // out of the map. The QP travels into each request's blocking task and back.
    let mut parts = Some(parts);
    let outcome = loop {
        let req = tokio::select! {
            r = read_request(&mut sock) => r,
            _ = shutdown.changed() => break Ok(()),
        };
        let mut req = match req {
            Ok(Some(r)) => r,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        if req.is_empty() {
            break Err(proto("an empty request on the verbs side channel"));
        }
        let kind = req.get_u8();
        let restart_to = match kind {
            REQ_WINDOW => None,
            REQ_RESTART => match Endpoint::get(&mut req) {
                Ok(ep) => Some(ep),
                Err(e) => break Err(e),
            },
            k => break Err(proto(format!("unknown verbs side-channel request {k}"))),
        };
        let (s, r) = (shared.clone(), reg.clone());
        let Some(mut qp) = parts.take() else {
            break Err(transport("the connection's QP is gone"));
        };
        let answer = tokio::task::spawn_blocking(move || {
            let mine = match restart_to {
                Some(peer) => restart_conn(&s, &mut qp, &peer).map(Some),
                None => Ok(None),
            };
            let answer = mine.and_then(|ep| Ok((ep, s.sync(&r)?)));
            (qp, answer)
        })
        .await;
        let answer = match answer {
            Ok((qp, a)) => {
                parts = Some(qp);
                a
            }
            Err(e) => break Err(transport(format!("verbs request task panicked: {e}"))),
        };
        let mut b = BytesMut::new();
        match answer {
            Ok((ep, window)) => {
                b.put_u8(ST_OK);
                if let Some(ep) = ep {
                    ep.put(&mut b);
                }
                put_window(&mut b, &window);
                if let Err(e) = write_msg(&mut sock, &b).await {
                    break Err(e);
                }
            }
            Err(e) => {
                match &e {
                    FabricError::AccessDenied { slot } => put_denied(&mut b, *slot),
                    other => put_error(&mut b, &other.to_string()),
                }
                let _ = write_msg(&mut sock, &b).await;
                break Err(e);
            }
        }
    };
    drop(guard);
    drop(parts);
    outcome
}

/// Restarts the node's QP of a connection towards the caller's restarted QP `peer` (after
/// the device refused one of the caller's requests, both ends are in the error state), and
/// returns the node's new endpoint.
fn restart_conn(shared: &NicShared, parts: &mut QpParts, peer: &Endpoint) -> Result<Endpoint> {
    let dev = &shared.dev;
    dev.restart_qp(parts)?;
    let dest_rd = dev.max_rd_atomic.min(peer.rd_atomic.max(1));
    dev.connect_qp(parts, peer, dest_rd, dev.max_init_rd_atomic)?;
    Ok(dev.endpoint(parts, dest_rd))
}

/// Checks the key and sets up the caller's PD, CQ, QP and READ region, atomically with respect
/// to revocations (see the module doc). Returns the QP, the registration, the READ region's
/// rkey and how many READs/atomics the caller may keep outstanding. No window region yet: the
/// caller asks for them (WINDOW) when it first writes.
fn accept_caller(
    shared: &NicShared,
    id: u64,
    key: AccessKey,
    peer: &Endpoint,
) -> Result<(QpParts, Reg, u32, u8)> {
    let dev = &shared.dev;
    let mut conns = shared.conns.lock();
    shared.grants.check(key)?;
    let mut parts = dev.new_qp(1, true)?;
    let reg = Registration::new(key, parts.pd.clone(), shared.region.clone(), &dev.name)?;
    let read_rkey = reg
        .read_rkey()
        .ok_or_else(|| transport("the READ region vanished while it was set up"))?;
    let dest_rd = dev.max_rd_atomic.min(peer.rd_atomic.max(1));
    dev.connect_qp(&mut parts, peer, dest_rd, dev.max_init_rd_atomic)?;
    let reg = Arc::new(Mutex::new(reg));
    conns.insert(id, (key, reg.clone()));
    Ok((parts, reg, read_rkey, dest_rd))
}
