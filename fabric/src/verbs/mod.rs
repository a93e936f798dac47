//! The verbs backend: real one-sided RDMA over RC queue pairs (rdma-core through the `sideway`
//! crate), behind cargo feature `rdma`. Tested for real on Soft-RoCE (`rxe0`) inside the VM of
//! `scripts/vm-tests.sh`; see docs/decisions/0001-rdma-binding.md for why sideway.
//!
//! Files, one job each:
//! - side.rs: the side channel's messages (handshake, WINDOW, RESTART), byte by byte;
//! - device.rs: the RDMA device and queue-pair state changes;
//! - nic.rs: [`VerbsNic`], the memory-node side (connections, the revoke watcher, fencing);
//! - windows.rs: a connection's memory regions and how they follow the write window;
//! - caller.rs: [`VerbsFabric`], the caller side (window check, posting, restart).
//!
//! What it owns:
//! - [`VerbsNic`], the memory-node side. It opens the RDMA device once and listens on a TCP
//!   *side channel* (a small conversation, not the data path). For every caller that connects
//!   it checks the presented [`AccessKey`] against the [`GrantTable`], then creates a
//!   protection domain, a completion queue and an RC queue pair for that caller alone,
//!   registers the whole region READ-only as a memory region (MR) in that domain, and answers
//!   with its QP number, GID and the MR's rkey. The caller's write window gets MRs of its own
//!   (below). After that the node's CPU does nothing for the caller's operations: READ, WRITE,
//!   CAS and FAA are executed by the RDMA device. Closing the side channel ends the connection
//!   and frees its QP and MRs.
//! - [`VerbsFabric`], the caller side: one RC QP, a registered local bounce buffer, and the
//!   still-open side channel.
//!
//! # Write windows (docs/decisions/0005-security.md, Decision 5)
//!
//! A key may READ the whole region but WRITE only its open log segments and CAS only the
//! cell space (grants.rs). On verbs the device enforces that with memory regions, per
//! connection: the READ MR over the whole region (`REMOTE_READ`), and one MR per range of the
//! key's window in the grant table: `REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC` for an open
//! segment, `REMOTE_ATOMIC` for the cell space (windows.rs). A request through an rkey it does
//! not cover fails at the device with a remote access error.
//! - The caller learns the window's MRs by asking (WINDOW, side.rs) when a post has a WRITE,
//!   CAS or FAA that no MR it knows covers. The node then re-reads the key's window in the
//!   grant table, registers MRs for new ranges, deregisters those of ranges that left it, and
//!   answers `(offset, len, access, rkey)` for each. If the answer does not cover the
//!   operation either, the post is refused whole with [`FabricError::OutsideWindow`] and
//!   nothing is posted. So WRITE on the superblock, the index, another key's segment, across a
//!   window's edge or into the cell space, and FAA in the cell space, never reach the device.
//! - A range leaves the window by [`VerbsNic::close_window`] (the DPM's SealSegment, through
//!   [`KeyFence::fence_window`]): it closes the range in the grant table, then deregisters the
//!   range's MRs on every connection of the key. Deregistration is the fence: it returns once
//!   the device no longer places data through the MR, so when `close_window` returns each of
//!   the caller's WRITEs there was placed before (the merge after the seal sees it) or is
//!   refused by the device. A range closed in the grant table alone (someone else's table
//!   handle) loses its MRs when the revoke watcher next looks (within [`REVOKE_POLL`]); until
//!   then the caller's WRITEs there still land and complete, as with revocation below.
//! - What a caller sees when a close races its WRITE: the caller still holds the old rkey, so
//!   its WRITE is posted, and either it was placed before the deregistration (and its trailing
//!   durability READ, through the same MR, completed before it too: the post succeeds, and the
//!   WRITE was in place when the close returned), or the device refuses the WRITE or that READ.
//!   A refusal puts both QPs in the error state; the caller restarts them over the side channel
//!   (RESTART, which also returns the current window) and the post fails: with
//!   [`FabricError::OutsideWindow`] when the refused request was the post's first that changes
//!   memory and not a durability READ (nothing of the post was applied: the responder checks a
//!   WRITE's rkey and range at its first packet and places nothing of a WRITE it refuses, as
//!   rxe does), else with [`FabricError::WindowClosedDuringPost`] (outcome unknown: a
//!   WRITE placed just before the deregistration whose trailing READ was refused is reported
//!   as an error, never as done, as shm does). The handle goes on working with the new window.
//! - Weaker than the grant table: the device cannot tell CAS from FAA (one `REMOTE_ATOMIC`
//!   flag), so FAA in the cell space is refused by the caller's check only; a caller that
//!   bypasses this crate could FAA cells. Everything else outside the window is refused by the
//!   device itself. Limits: up to 1 + [`crate::grants::MAX_WINDOW_RANGES`] MRs and one PD per
//!   connection, against the device's finite `max_mr` and `max_pd` (windows.rs).
//!
//! # Fencing (revocation)
//!
//! [`VerbsNic::revoke`] revokes the key in the grant table and deregisters every MR of that
//! caller's connections (READ and window MRs), so its later operations fail at the device; a
//! watcher also deregisters the MRs of any connected key that was revoked in the grant table
//! by someone else (within [`REVOKE_POLL`]). Deregistering an MR returns once the device no
//! longer places data through it, so when `revoke` returns every operation of the caller
//! either was placed before (a merge after the fence sees it) or fails with a remote access
//! error; a WRITE placed just before the deregistration whose trailing READ is refused is
//! reported as an error, never as done. The caller's restart then learns that its key is
//! gone: the handle is broken for good with [`FabricError::AccessDenied`].
//!
//! A revoke made directly in the [`GrantTable`] (what the DPM's FenceKn would do without a key
//! fence) is *not* a fence here: until the watcher notices it (up to [`REVOKE_POLL`] later)
//! the caller's WRITEs still land and complete successfully, and a caller whose key passed the
//! handshake's check just before such a revoke gets a live MR the same way. Whoever fences
//! verbs callers must call [`VerbsNic::revoke`] (and close windows with
//! [`VerbsNic::close_window`]), or the same through [`KeyFence`]: the dpm-node installs its
//! NIC as the DPM's key fence, so FenceKn, a KN's re-registration and SealSegment deregister
//! the old key's (or the sealed segment's) MRs before they go on to merge.
//!
//! # Invariants
//!
//! - Each connection has its own protection domain, so an rkey is usable only through the QP it
//!   was handed to: a fenced caller cannot borrow another caller's rkey.
//! - Bounds, alignment and the window are checked on the caller's side before anything is
//!   posted, so a refused post applies nothing (caller.rs).
//! - One post = one doorbell (more than [`MAX_WR_PER_DOORBELL`] requests: several, one after
//!   the other); every request is signaled and the post waits for all of them once.
//! - CAS and FAA are the device's 8-byte atomics and complete with the old value.
//! - A failed work request other than a refusal breaks the handle for good
//!   ([`FabricError::Transport`]); a caller reconnects with a new handle.
//!
//! # What a completed WRITE means (durability)
//!
//! - The idiom: every WRITE is followed, in the same post, by a 1-byte READ of its last byte,
//!   and the post completes when that READ's response is back. An RC responder executes a QP's
//!   requests in order and a READ response is not sent before the WRITE ahead of it is placed,
//!   so a completed WRITE is *placed* at the node: visible to its CPU and to every later READ.
//! - Real RNIC: placed means handed to the node's memory system. With Intel DDIO on (the
//!   default) the NIC's writes land in the last-level cache, outside the persistence domain of
//!   an ADR platform; placed is durable only on an eADR platform (caches inside the domain) or
//!   with DDIO off for the NIC's root port (writes then go to the memory controller, which ADR
//!   drains on power loss; the READ's completion cannot pass those posted PCIe writes). And the
//!   region must be PM: a pool on device-DAX (fsdax files cannot be registered, see below).
//! - Soft-RoCE (`rdma_rxe`): the responder is the node's kernel, which copies the payload into
//!   the MR's pages with ordinary CPU stores and never writes the lines back. On rxe a completed
//!   WRITE is visible at the node but sits in its CPU caches, not necessarily in PM: it
//!   survives the crash of any process (DPM and KN alike), not a power loss (unless eADR).
//! - Not used: the RDMA FLUSH verb (`IBV_WR_FLUSH`, IBTA 1.5; rxe has it from Linux 6.2, the test
//!   VM's Debian 6.1 kernel has not; it needs MRs registered with the flush access flags),
//!   which would make the responder write placed data back to the persistence domain and so
//!   close both gaps above. Everything the DPM writes itself (merges, GC, metadata) is persisted
//!   with CLWB + SFENCE on its own mapping, whatever the fabric.
//!
//! Where the region can live: registering it pins its pages. A page-cache or tmpfs file works.
//! A file on an fsdax mount does not: the kernel refuses long-term pins of fsdax pages
//! (`EOPNOTSUPP` on the test VM's Debian 6.1 kernel), while a device-DAX mapping (`/dev/daxX.Y`)
//! registers fine. See docs/decisions/0001-rdma-binding.md.
//!
//! Environment: `DINOMO_RDMA_DEVICE` picks the device by name (default: the first one),
//! `DINOMO_RDMA_GID_INDEX` the GID index (default: a RoCE v2 GID with an IPv4 address, else
//! the first usable one). Port 1 is used.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{FabricError, Result};
#[cfg(doc)]
use crate::grants::{GrantTable, KeyFence};
#[cfg(doc)]
use crate::op::AccessKey;
use crate::pm::PmRegion;

mod caller;
mod device;
mod nic;
mod side;
mod windows;

pub use caller::VerbsFabric;
pub use device::device_names;
pub use nic::VerbsNic;

/// Registers the first `bytes` of `region` (all of it, at most) for remote writes on the RDMA
/// device `device` (`None`: `DINOMO_RDMA_DEVICE`, else the first), as the NIC does for every
/// KN that connects, and releases them; returns the device's name. For a node to find out now
/// what would stop it from serving KNs later: no such device, a locked-memory limit below
/// `bytes`, or a kernel that does not let RDMA pin pages of the region's file (files on DAX
/// filesystems; from Linux 6.5 on, files of filesystems that track dirty pages, such as ext4
/// without DAX: one page finds that).
pub fn check_registration(
    device: Option<&str>,
    region: &Arc<PmRegion>,
    bytes: u64,
) -> Result<String> {
    let bytes = bytes.min(region.len());
    let opening = |e: FabricError| FabricError::Config(format!("opening the RDMA device: {e}"));
    let dev = device::Device::open(device).map_err(opening)?;
    let pd = dev.alloc_pd().map_err(opening)?;
    windows::register(
        &pd,
        region,
        0,
        bytes,
        sideway::ibverbs::AccessFlags::RemoteWrite,
    )
    .map_err(|e| {
        FabricError::Config(format!(
            "the RDMA device {} cannot register {} ({bytes} bytes) for remote writes: {e}",
            dev.name,
            region.path().display(),
        ))
    })?;
    Ok(dev.name)
}

/// The most work requests rung with one doorbell (also the send-queue depth).
pub const MAX_WR_PER_DOORBELL: usize = 256;
/// How often the node looks for keys revoked, and window ranges closed, in the grant table
/// behind its back.
pub const REVOKE_POLL: Duration = Duration::from_millis(100);
/// A post whose completions take longer than this breaks the handle.
pub const POST_TIMEOUT: Duration = Duration::from_secs(30);

fn transport(msg: impl Into<String>) -> FabricError {
    FabricError::Transport(msg.into())
}

fn proto(msg: impl Into<String>) -> FabricError {
    FabricError::Protocol(msg.into())
}

/// An error and its sources in one line (sideway's errors keep the errno in the source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

fn verbs_err(what: &str) -> impl FnOnce(&dyn std::error::Error) -> FabricError + '_ {
    move |e| transport(format!("{what}: {}", chain(e)))
}
