//! The memory node's memory regions for one connection, and how they follow the caller's
//! write window in the grant table (docs/decisions/0005-security.md, Decision 5).
//!
//! Per connection, all in the connection's own protection domain:
//! - one READ region over the whole pool (`REMOTE_READ`): READ reaches everything;
//! - one region per range of the key's write window: a [`WindowAccess::Write`] range (an open
//!   log segment) with `REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC` (READ for the 1-byte
//!   durability READ that follows each WRITE, on the same region, so that it too is refused
//!   once the range is deregistered), a [`WindowAccess::Atomic`] range (the cell space) with
//!   `REMOTE_ATOMIC` only. Every region that allows a remote WRITE or atomic also carries
//!   `LOCAL_WRITE`, which libibverbs demands for them (rxe too).
//!
//! Invariants:
//! - A window region exists only for a range that was in the key's window when it was
//!   registered, and is deregistered ([`Registration::prune`]) by whoever next looks at the
//!   table after the range left it: a WINDOW or RESTART request, [`super::VerbsNic::close_window`]
//!   (which closes the range in the table first, so it is a fence), the revoke watcher (every
//!   [`super::REVOKE_POLL`]). Deregistering returns once the device no longer places data
//!   through the region, so after it every WRITE there is either in place or refused.
//! - Revoking drops every region of the connection, the READ region too ([`Registration::fence`]);
//!   a fenced registration never registers again.
//! - Both happen under the registration's lock, after the table was changed, and every
//!   registration reads the table under the same lock: a region registered from a window read
//!   before a close is deregistered by that close.
//!
//! Limits: at most [`crate::grants::MAX_WINDOW_RANGES`] window regions per connection (the
//! grant table's limit), plus its READ region, so up to 65 regions and one protection domain
//! per connection. Memory regions and protection domains are finite on every device (`max_mr`
//! and `max_pd` of `ibv_devinfo -v`; a real NIC also has a translation cache that thrashes
//! well before `max_mr`), and each registration pins and translates its pages again (the
//! pool's pages are already pinned by the READ region): a syscall and a page walk per segment
//! and connection. A deployment must check that its verbs connections x 65 stay below the
//! NIC's `max_mr` (and the connections below `max_pd`).
//!
//! Weaker than the grant table: an atomic region allows CAS and FAA alike (verbs access flags
//! do not tell them apart), so "CAS only" in the cell space is enforced by the caller's check,
//! not by the device.

use std::sync::Arc;

use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::side::WindowMr;
use super::{chain, transport};
use crate::error::Result;
use crate::grants::{WindowAccess, WindowRange};
use crate::op::AccessKey;
use crate::pm::PmRegion;

/// One connected caller's memory regions.
pub(super) struct Registration {
    pub(super) key: AccessKey,
    pd: Arc<ProtectionDomain>,
    region: Arc<PmRegion>,
    read: Option<Arc<MemoryRegion>>,
    windows: Vec<(WindowRange, Arc<MemoryRegion>)>,
    fenced: bool,
}

impl Registration {
    /// Registers the READ region over all of `region` in `pd`.
    pub(super) fn new(
        key: AccessKey,
        pd: Arc<ProtectionDomain>,
        region: Arc<PmRegion>,
        device: &str,
    ) -> Result<Self> {
        let read =
            register(&pd, &region, 0, region.len(), AccessFlags::RemoteRead).map_err(|e| {
                transport(format!(
                    "registering the region ({} bytes at {}) with {device}: {e}",
                    region.len(),
                    region.path().display(),
                ))
            })?;
        Ok(Registration {
            key,
            pd,
            region,
            read: Some(read),
            windows: Vec::new(),
            fenced: false,
        })
    }

    /// The rkey of the READ region.
    pub(super) fn read_rkey(&self) -> Option<u32> {
        self.read.as_ref().map(|mr| mr.rkey())
    }

    pub(super) fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// Deregisters every region (the key was revoked); returns whether any was live.
    pub(super) fn fence(&mut self) -> bool {
        let had = self.read.is_some() || !self.windows.is_empty();
        self.windows.clear();
        self.read = None;
        self.fenced = true;
        had
    }

    /// Deregisters the window regions whose range is not in `window` (the key's window in the
    /// grant table, read after the change); returns how many.
    pub(super) fn prune(&mut self, window: &[WindowRange]) -> usize {
        let before = self.windows.len();
        self.windows.retain(|(r, _)| window.contains(r));
        before - self.windows.len()
    }

    /// Makes the window regions match `window` (prune, then register what is missing) and
    /// lists them. A range that does not lie inside the region is left out (with a warning):
    /// the grant table is the memory node's own, so that is a bug, not an attack.
    pub(super) fn sync(&mut self, window: &[WindowRange]) -> Result<Vec<WindowMr>> {
        debug_assert!(!self.fenced);
        self.prune(window);
        for r in window {
            if self.windows.iter().any(|(have, _)| have == r) {
                continue;
            }
            if r.offset
                .checked_add(r.len)
                .is_none_or(|end| end > self.region.len())
            {
                tracing::warn!(
                    slot = self.key.slot,
                    offset = r.offset,
                    len = r.len,
                    region_len = self.region.len(),
                    "a write-window range lies outside the region; not registered"
                );
                continue;
            }
            let access = match r.access {
                WindowAccess::Write => {
                    AccessFlags::RemoteWrite | AccessFlags::RemoteRead | AccessFlags::RemoteAtomic
                }
                WindowAccess::Atomic => AccessFlags::RemoteAtomic,
            };
            let mr = register(&self.pd, &self.region, r.offset, r.len, access).map_err(|e| {
                transport(format!(
                    "registering the window range of {} bytes at {} (grant slot {}): {e}",
                    r.len, r.offset, self.key.slot
                ))
            })?;
            self.windows.push((*r, mr));
        }
        Ok(self
            .windows
            .iter()
            .map(|(range, mr)| WindowMr {
                range: *range,
                rkey: mr.rkey(),
            })
            .collect())
    }
}

/// Registers `len` bytes at `offset` of `region` in `pd` with `remote` access (plus
/// `LOCAL_WRITE` when `remote` allows writes or atomics, which verbs requires).
pub(super) fn register(
    pd: &Arc<ProtectionDomain>,
    region: &Arc<PmRegion>,
    offset: u64,
    len: u64,
    remote: AccessFlags,
) -> std::result::Result<Arc<MemoryRegion>, String> {
    let access = if remote == AccessFlags::RemoteRead {
        remote
    } else {
        remote | AccessFlags::LocalWrite
    };
    let start = region.as_ptr() as usize + offset as usize;
    // SAFETY: the range lies inside the region's mapping (checked by the callers), which stays
    // valid for as long as `region` lives; every MR outlives neither: the NIC's are owned by a
    // Registration that holds a clone of `region`, and `check_registration` drops its MR
    // while it still borrows `region`.
    unsafe { pd.reg_mr(start, len as usize, access) }.map_err(|e| chain(&e))
}
