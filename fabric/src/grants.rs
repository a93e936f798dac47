//! The grant table: which access keys may reach a region right now, and where each may write.
//!
//! It lives in its own small mapped file beside the pool (`<pool>.grants`), so that shm clients
//! in other processes check it without asking the memory node, and the tcp NIC and the verbs
//! backend consult the same table. The memory node creates it afresh at every start
//! ([`GrantTable::create`]: grants never survive a restart, KNs register again), so a table of
//! an older format is never migrated, only revoked and replaced.
//!
//! # Format 2 (little-endian u64 words)
//!
//! | bytes | what |
//! |---|---|
//! | header, 32 | `magic "DNMGRNTS"`, `version = 2`, `capacity` (slots), `ranges` per slot (64) |
//! | slots, capacity x 32 | `state` = generation << 32, plus 1 while granted; `secret` (16 bytes); `window seq` |
//! | windows, capacity x ranges x 16 | per range `start` (bit 63: atomics only) and `end` (0: unused) |
//!
//! Format 1 (magic `"DNMGRANT"`, 16-byte slots holding a 64-bit token with 31 random bits) is
//! refused by name; [`GrantTable::create`] still revokes the grants of a format-1 file it
//! replaces, so a KN of an older build mapping it is denied at its next check.
//!
//! # Keys
//!
//! An [`AccessKey`] is `(slot, generation, secret)`. Granting bumps the slot's generation and
//! draws 128 fresh bits from the OS CSPRNG; the secret is compared in constant time. The secret
//! is written before the state word that makes the slot live (release), and a check reads the
//! state, the secret, then the state again, so it never accepts a half-written grant.
//!
//! # Write windows
//!
//! READ reaches the whole region. WRITE, CAS and FAA reach only the key's window: at most
//! [`MAX_WINDOW_RANGES`] byte ranges, each writable ([`WindowAccess::Write`]: WRITE, CAS, FAA;
//! a KN's open log segments) or atomic-only ([`WindowAccess::Atomic`]: 8-byte aligned CAS only;
//! the indirect-cell space). Anything else fails with [`FabricError::OutsideWindow`]. The
//! memory node opens a range before it tells the caller about it ([`GrantTable::open_window`])
//! and closes it ([`GrantTable::close_window`], or every range at once by revoking) holding the
//! slot exclusively, like `revoke`. Each slot's ranges are guarded by a sequence word
//! (seqlock): odd while the memory node changes them, so readers in other processes never act
//! on a half-written range.
//!
//! # What revocation and window closing guarantee (the fence)
//!
//! A fence (the DPM's FenceKn) revokes a key and then merges what the fenced writer logged, so
//! every post checked against the old key must either be in place when [`GrantTable::revoke`]
//! returns, or fail; it must never be acknowledged as applied after the revoke returned. The
//! same holds for a range leaving a window (the DPM seals the segment and merges it). Per
//! backend:
//! - tcp: the NIC holds the slot's lock shared from its key and window check to the end of the
//!   apply ([`GrantTable::hold`]); revoke and close take it exclusively. So once they return on
//!   the memory node's table instance, every post that passed the check has been applied, and
//!   no later post passes it. (Only changes through the same instance wait; the DPM and its
//!   NIC share one.)
//! - shm: the caller's own CPU applies the post, in another process that no lock here can
//!   stop. It re-checks its key and window after applying ([`GrantTable::recheck_post`], with a
//!   full fence between its stores and the re-check, and revoke's and close's stores are
//!   sequentially consistent, so either the re-check sees the change or the memory node sees
//!   the stores). A post revoked in between fails with [`FabricError::RevokedDuringPost`], one
//!   whose range left the window with [`FabricError::WindowClosedDuringPost`] (both: outcome
//!   unknown), never succeeds; but its bytes may land after the fence returned, which the
//!   merge must tolerate. The shm caller maps the pool read-write and can read every secret
//!   here: the checks stop a buggy KN, not a compromised one (shm is a single-trust-domain
//!   fabric, see docs/operations.md).
//! - verbs: revocation deregisters the caller's memory regions, and closing a range
//!   deregisters the write region of that range, after which the device refuses the caller's
//!   operations there (each connection has a READ-only region over the whole pool and one
//!   region per window range); see verbs/mod.rs for when that happens relative to the table
//!   change (the verbs NIC's own `revoke` and `close_window` are fences, a change made in the
//!   table alone is noticed within its watcher's poll).
//!
//! Callers that need a hard fence on the control path also bump the epoch the DPM checks.
//! The memory node revokes keys and closes window ranges through a [`KeyFence`]: the table
//! itself for shm and tcp, the verbs NIC for verbs (which also deregisters the caller's memory
//! regions).
//!
//! Where the table lives: `<pool>.grants` beside a pool file; for a pool on a device-DAX
//! character device (which has no directory of its own to write in),
//! `/dev/shm/dinomo-<device name>.grants` (see [`GrantTable::path_for`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use rand::TryRngCore;

use crate::error::{FabricError, Result};
use crate::op::{constant_time_eq, AccessKey, Op};
use crate::pm::{DurabilityRequest, PmRegion};

/// Magic of format 2 (and later).
const MAGIC: u64 = u64::from_le_bytes(*b"DNMGRNTS");
/// Magic of format 1, which had no version word.
const MAGIC_V1: u64 = u64::from_le_bytes(*b"DNMGRANT");
/// The format this build reads and writes.
pub const FORMAT_VERSION: u64 = 2;
const HEADER: u64 = 32;
const SLOT_SIZE: u64 = 32;
/// Ranges of one key's write window; opening one more is refused.
pub const MAX_WINDOW_RANGES: usize = 64;
/// How many times [`GrantTable::read_window`] retries a sequence that stays odd (it yields
/// the thread after the first 64): about 10 ms and more, against a change that takes a few µs.
const WINDOW_READ_SPINS: u32 = 10_000;
const RANGE_SIZE: u64 = 16;
/// Bit 63 of a range's start word: CAS only (the cell space).
const ATOMIC_ONLY: u64 = 1 << 63;
const LIVE: u64 = 1;

/// What a window range allows besides READ (which reaches everything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowAccess {
    /// WRITE, CAS and FAA (a KN's open log segment).
    Write,
    /// 8-byte aligned CAS only (the indirect-cell space).
    Atomic,
}

/// One range of a key's write window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowRange {
    pub offset: u64,
    pub len: u64,
    pub access: WindowAccess,
}

impl WindowRange {
    pub fn write(offset: u64, len: u64) -> Self {
        WindowRange {
            offset,
            len,
            access: WindowAccess::Write,
        }
    }

    pub fn atomic(offset: u64, len: u64) -> Self {
        WindowRange {
            offset,
            len,
            access: WindowAccess::Atomic,
        }
    }

    fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// How a memory node revokes a key, or closes part of its write window, so that the change is
/// a fence (see the module doc).
pub trait KeyFence: Send + Sync + std::fmt::Debug {
    /// Revokes `key`. When this returns, every operation under it either is in place or can no
    /// longer complete as done, whatever the backend.
    fn fence(&self, key: AccessKey) -> Result<()>;

    /// Removes the range starting at `offset` from `key`'s write window (a sealed segment).
    /// When this returns, every WRITE under the old window either is in place or can no longer
    /// complete as done, whatever the backend.
    fn fence_window(&self, key: AccessKey, offset: u64) -> Result<()>;
}

/// shm and tcp: the table is the fence ([`GrantTable::revoke`] and
/// [`GrantTable::close_window`] wait for the tcp NIC's posts).
impl KeyFence for GrantTable {
    fn fence(&self, key: AccessKey) -> Result<()> {
        self.revoke(key)
    }

    fn fence_window(&self, key: AccessKey, offset: u64) -> Result<()> {
        self.close_window(key, offset)
    }
}

/// Called by a backend on the posting thread after a post's key passed the check and before
/// the post is applied: the window a fence has to close. For tests, which pause a post there
/// (see [`GrantTable::set_post_hook`]).
pub type PostHook = Arc<dyn Fn(AccessKey) + Send + Sync>;

/// A post's hold on its key (see [`GrantTable::hold`]); revoking the key or closing part of
/// its window waits until it is dropped.
#[must_use = "the hold protects the post only while it lives"]
pub struct GrantHold<'a> {
    _slot: RwLockReadGuard<'a, ()>,
}

impl std::fmt::Debug for GrantHold<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrantHold")
    }
}

/// A grant table mapped from its file.
pub struct GrantTable {
    region: PmRegion,
    capacity: u32,
    /// Serialises granting (finding a free slot); checks are lock-free.
    grant_lock: Mutex<()>,
    /// One lock per slot, in this process only: posts applied by this process (the tcp NIC)
    /// hold it shared from check to apply; revoking and window changes take it exclusively.
    slot_locks: Vec<RwLock<()>>,
    /// Test hook between check and apply; `has_hook` keeps the fast path to one relaxed load.
    has_hook: AtomicBool,
    hook: RwLock<Option<PostHook>>,
}

impl std::fmt::Debug for GrantTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrantTable")
            .field("path", &self.region.path())
            .field("capacity", &self.capacity)
            .field("hook", &self.has_hook.load(Ordering::Relaxed))
            .finish()
    }
}

fn file_len(capacity: u32) -> u64 {
    HEADER + u64::from(capacity) * (SLOT_SIZE + MAX_WINDOW_RANGES as u64 * RANGE_SIZE)
}

fn region_err(path: &Path, source: std::io::Error) -> FabricError {
    FabricError::Region {
        path: path.display().to_string(),
        source,
    }
}

/// 128 bits from the OS CSPRNG.
fn fresh_secret() -> Result<[u8; 16]> {
    let mut secret = [0u8; 16];
    rand::rngs::OsRng
        .try_fill_bytes(&mut secret)
        .map_err(|e| FabricError::Config(format!("the OS random generator failed: {e}")))?;
    Ok(secret)
}

impl GrantTable {
    /// The conventional path of the grant table of a pool: `<pool>.grants`, or for a pool on a
    /// character device (device-DAX) `/dev/shm/dinomo-<device name>.grants`, since `/dev` is
    /// no place for regular files. The memory node and shm callers derive it the same way.
    pub fn path_for(pool: &Path) -> PathBuf {
        use std::os::unix::fs::FileTypeExt;
        let device = std::fs::metadata(pool).is_ok_and(|m| m.file_type().is_char_device());
        if let (true, Some(name)) = (device, pool.file_name()) {
            let mut s = std::ffi::OsString::from("dinomo-");
            s.push(name);
            s.push(".grants");
            return Path::new("/dev/shm").join(s);
        }
        let mut s = pool.as_os_str().to_owned();
        s.push(".grants");
        PathBuf::from(s)
    }

    /// Creates a fresh table; every grant of an earlier table at `path` is revoked first (also
    /// of a format-1 table, whose callers run an older build).
    ///
    /// The new table is a new file renamed over the old one, never the old file truncated:
    /// callers may still map the old file (a KN that outlived a memory-node restart), and a
    /// truncated mapping would fault them instead of failing their next check.
    pub fn create(path: &Path, capacity: u32) -> Result<Self> {
        match GrantTable::open(path) {
            Ok(old) => old.revoke_all()?,
            Err(_) => revoke_all_v1(path),
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let region = PmRegion::create(&tmp, file_len(capacity), DurabilityRequest::ProcessCrash)?;
        region.word(8)?.store(FORMAT_VERSION, Ordering::Release);
        region
            .word(16)?
            .store(u64::from(capacity), Ordering::Release);
        region
            .word(24)?
            .store(MAX_WINDOW_RANGES as u64, Ordering::Release);
        region.word(0)?.store(MAGIC, Ordering::Release);
        std::fs::rename(&tmp, path).map_err(|e| region_err(path, e))?;
        Ok(GrantTable::new(region, capacity))
    }

    /// Revokes every grant (waiting, slot by slot, for posts holding them).
    pub fn revoke_all(&self) -> Result<()> {
        for slot in 0..self.capacity {
            let _excl = self.slot_locks[slot as usize].write();
            self.kill_slot(slot)?;
        }
        Ok(())
    }

    /// Opens a table created by the memory node (clients do this).
    pub fn open(path: &Path) -> Result<Self> {
        let region = PmRegion::open(path, DurabilityRequest::ProcessCrash)?;
        let magic = if region.len() >= HEADER {
            region.word(0)?.load(Ordering::Acquire)
        } else {
            0
        };
        if magic == MAGIC_V1 {
            return Err(FabricError::Config(format!(
                "{} is a grant table of format 1 (64-bit tokens, no write windows), written by \
                 an older dpm-node; this build reads format {FORMAT_VERSION} only: run a \
                 dpm-node and KNs of the same build (a dpm-node of this build recreates the \
                 table at start)",
                path.display()
            )));
        }
        if magic != MAGIC {
            return Err(FabricError::Config(format!(
                "{} is not a grant table",
                path.display()
            )));
        }
        let version = region.word(8)?.load(Ordering::Acquire);
        if version != FORMAT_VERSION {
            return Err(FabricError::Config(format!(
                "{} is a grant table of format {version}; this build reads format \
                 {FORMAT_VERSION} only: run a dpm-node and KNs of the same build",
                path.display()
            )));
        }
        let capacity = region.word(16)?.load(Ordering::Acquire);
        let ranges = region.word(24)?.load(Ordering::Acquire);
        let capacity = u32::try_from(capacity).map_err(|_| {
            FabricError::Config(format!("{} claims {capacity} slots", path.display()))
        })?;
        if ranges != MAX_WINDOW_RANGES as u64 || region.len() < file_len(capacity) {
            return Err(FabricError::Config(format!(
                "{} is truncated or has {ranges} window ranges per slot (expected {})",
                path.display(),
                MAX_WINDOW_RANGES
            )));
        }
        Ok(GrantTable::new(region, capacity))
    }

    fn new(region: PmRegion, capacity: u32) -> Self {
        GrantTable {
            region,
            capacity,
            grant_lock: Mutex::new(()),
            slot_locks: (0..capacity).map(|_| RwLock::new(())).collect(),
            has_hook: AtomicBool::new(false),
            hook: RwLock::new(None),
        }
    }

    /// Installs (or, with `None`, removes) the hook every post checked against this table
    /// instance runs between its check and its apply. Tests pause a post there to fence it in
    /// the middle; production code sets none.
    pub fn set_post_hook(&self, hook: Option<PostHook>) {
        let mut h = self.hook.write();
        self.has_hook.store(hook.is_some(), Ordering::Release);
        *h = hook;
    }

    /// Runs the post hook, if any (backends call this after the check, before applying).
    pub(crate) fn run_post_hook(&self, key: AccessKey) {
        if !self.has_hook.load(Ordering::Relaxed) {
            return;
        }
        let hook = self.hook.read().clone();
        if let Some(hook) = hook {
            hook(key);
        }
    }

    fn slot_offset(slot: u32) -> u64 {
        HEADER + u64::from(slot) * SLOT_SIZE
    }

    fn state(&self, slot: u32) -> Result<&AtomicU64> {
        self.region.word(Self::slot_offset(slot))
    }

    fn seq(&self, slot: u32) -> Result<&AtomicU64> {
        self.region.word(Self::slot_offset(slot) + 24)
    }

    fn range_offset(&self, slot: u32, i: usize) -> u64 {
        HEADER
            + u64::from(self.capacity) * SLOT_SIZE
            + (u64::from(slot) * MAX_WINDOW_RANGES as u64 + i as u64) * RANGE_SIZE
    }

    /// Grants a new key, with an empty write window.
    pub fn grant(&self) -> Result<AccessKey> {
        let _g = self.grant_lock.lock();
        for slot in 0..self.capacity {
            let state = self.state(slot)?;
            let s = state.load(Ordering::Acquire);
            if s & LIVE != 0 {
                continue;
            }
            let _excl = self.slot_locks[slot as usize].write();
            let generation = ((s >> 32) as u32).wrapping_add(1).max(1);
            let secret = fresh_secret()?;
            self.change_window(slot, |ranges| {
                ranges.clear();
                true
            })?;
            let base = Self::slot_offset(slot);
            self.region.word(base + 8)?.store(
                u64::from_le_bytes(secret[..8].try_into().expect("8")),
                Ordering::Release,
            );
            self.region.word(base + 16)?.store(
                u64::from_le_bytes(secret[8..].try_into().expect("8")),
                Ordering::Release,
            );
            state.store((u64::from(generation) << 32) | LIVE, Ordering::SeqCst);
            return Ok(AccessKey {
                slot,
                generation,
                secret,
            });
        }
        Err(FabricError::Config(format!(
            "all {} grant slots are in use",
            self.capacity
        )))
    }

    /// Grants a new key whose write window is `window` from the start (tools and tests; the
    /// DPM grants with [`Self::grant`] and opens ranges as it hands out segments).
    pub fn grant_with_window(&self, window: &[WindowRange]) -> Result<AccessKey> {
        let key = self.grant()?;
        for r in window {
            if let Err(e) = self.open_window(key, *r) {
                let _ = self.revoke(key);
                return Err(e);
            }
        }
        Ok(key)
    }

    /// Marks a slot not granted (keeping its generation) and empties its window. The caller
    /// holds the slot exclusively.
    fn kill_slot(&self, slot: u32) -> Result<()> {
        let state = self.state(slot)?;
        let s = state.load(Ordering::Acquire);
        if s & LIVE != 0 {
            state.store(s & !LIVE, Ordering::SeqCst);
        }
        self.change_window(slot, |ranges| {
            let had = !ranges.is_empty();
            ranges.clear();
            had
        })
    }

    /// Revokes a key; later checks of it fail and its window is emptied. Revoking an already
    /// revoked key is a no-op.
    ///
    /// Waits for the posts that hold the key through this table instance ([`Self::hold`]):
    /// when it returns, each of them has been applied and no post can pass the check any more.
    /// The store is sequentially consistent, pairing with the re-check of [`Self::recheck`].
    pub fn revoke(&self, key: AccessKey) -> Result<()> {
        if key.slot >= self.capacity {
            return Err(FabricError::AccessDenied { slot: key.slot });
        }
        let _excl = self.slot_locks[key.slot as usize].write();
        if self.check(key).is_ok() {
            self.kill_slot(key.slot)?;
        }
        Ok(())
    }

    /// Checks `key` and holds its slot until the returned guard is dropped: a [`Self::revoke`]
    /// of the key, or a [`Self::close_window`], through this instance waits for it. A backend
    /// that applies posts in this process keeps the guard from the check (key and window) to
    /// the end of the apply (and must not hold it across an await or while waiting for
    /// anything but the apply itself).
    pub fn hold(&self, key: AccessKey) -> Result<GrantHold<'_>> {
        let lock = self
            .slot_locks
            .get(key.slot as usize)
            .ok_or(FabricError::AccessDenied { slot: key.slot })?;
        let guard = lock.read();
        self.check(key)?;
        Ok(GrantHold { _slot: guard })
    }

    /// The check after a post applied by a CPU no revocation can wait for (shm): is `key`
    /// still valid now that the post's stores are done? The full fence orders those stores
    /// before this load, so if this says yes, a revoke that follows sees them.
    pub fn recheck(&self, key: AccessKey) -> Result<()> {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.check(key)
    }

    /// Is `key` valid now? The secret is compared in constant time.
    pub fn check(&self, key: AccessKey) -> Result<()> {
        let denied = FabricError::AccessDenied { slot: key.slot };
        if key.slot >= self.capacity {
            return Err(denied);
        }
        let want = (u64::from(key.generation) << 32) | LIVE;
        let state = self.state(key.slot)?;
        if state.load(Ordering::Acquire) != want {
            return Err(denied);
        }
        let base = Self::slot_offset(key.slot);
        let mut stored = [0u8; 16];
        stored[..8].copy_from_slice(
            &self
                .region
                .word(base + 8)?
                .load(Ordering::Acquire)
                .to_le_bytes(),
        );
        stored[8..].copy_from_slice(
            &self
                .region
                .word(base + 16)?
                .load(Ordering::Acquire)
                .to_le_bytes(),
        );
        let same = constant_time_eq(&stored, &key.secret);
        // A regrant between the two loads of the state may have mixed secrets: refuse then.
        if !same || state.load(Ordering::Acquire) != want {
            return Err(denied);
        }
        Ok(())
    }

    /// Adds `range` to the write window of `key` (holding its slot exclusively). Refused with
    /// [`FabricError::AccessDenied`] if the key is not valid, and [`FabricError::WindowFull`]
    /// when the window has [`MAX_WINDOW_RANGES`] ranges already.
    pub fn open_window(&self, key: AccessKey, range: WindowRange) -> Result<()> {
        let lock = self
            .slot_locks
            .get(key.slot as usize)
            .ok_or(FabricError::AccessDenied { slot: key.slot })?;
        let _excl = lock.write();
        self.check(key)?;
        if range.len == 0
            || range.offset.checked_add(range.len).is_none()
            || range.offset >= ATOMIC_ONLY
        {
            return Err(FabricError::Config(format!(
                "window range {range:?} is empty or beyond the addressable region"
            )));
        }
        let mut full = false;
        self.change_window(key.slot, |ranges| {
            if ranges.len() >= MAX_WINDOW_RANGES {
                full = true;
                return false;
            }
            ranges.push(range);
            true
        })?;
        if full {
            return Err(FabricError::WindowFull {
                slot: key.slot,
                limit: MAX_WINDOW_RANGES,
            });
        }
        Ok(())
    }

    /// Removes the range starting at `offset` from the write window of `key` (no-op if the key
    /// is no longer valid or has no such range). Holds the slot exclusively, like
    /// [`Self::revoke`]: when this returns, every post that was checked against the old window
    /// through this instance has been applied, and an shm post's re-check sees the change.
    pub fn close_window(&self, key: AccessKey, offset: u64) -> Result<()> {
        let Some(lock) = self.slot_locks.get(key.slot as usize) else {
            return Ok(());
        };
        let _excl = lock.write();
        if self.check(key).is_err() {
            return Ok(());
        }
        self.change_window(key.slot, |ranges| {
            let before = ranges.len();
            ranges.retain(|r| r.offset != offset);
            ranges.len() != before
        })
    }

    /// The ranges of the window of `key` now (empty if the key is not valid).
    pub fn window(&self, key: AccessKey) -> Result<Vec<WindowRange>> {
        if self.check(key).is_err() {
            return Ok(Vec::new());
        }
        Ok(self.read_window(key.slot)?.1)
    }

    /// Rewrites a slot's ranges through `f` (which returns whether it changed them) under the
    /// slot's sequence word. The caller holds the slot exclusively (or, granting, owns it).
    fn change_window(
        &self,
        slot: u32,
        f: impl FnOnce(&mut Vec<WindowRange>) -> bool,
    ) -> Result<()> {
        // The caller is the slot's only writer, so a sequence stuck odd was left by a writer
        // that died mid-change (the file outlives processes): its ranges are torn. Start from
        // none, which only takes rights away (the KN re-registers), and rewrite the slot.
        let (stuck, mut ranges) = match self.read_window(slot) {
            Ok((_, ranges)) => (false, ranges),
            Err(FabricError::Protocol(_)) => (true, Vec::new()),
            Err(e) => return Err(e),
        };
        if !f(&mut ranges) && !stuck {
            return Ok(());
        }
        let seq = self.seq(slot)?;
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1) | 1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        for i in 0..MAX_WINDOW_RANGES {
            let off = self.range_offset(slot, i);
            let (start, end) = match ranges.get(i) {
                Some(r) => (
                    r.offset
                        | if r.access == WindowAccess::Atomic {
                            ATOMIC_ONLY
                        } else {
                            0
                        },
                    r.end(),
                ),
                None => (0, 0),
            };
            self.region.word(off)?.store(start, Ordering::Relaxed);
            self.region.word(off + 8)?.store(end, Ordering::Relaxed);
        }
        seq.store((s | 1).wrapping_add(1), Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(())
    }

    /// A consistent snapshot of a slot's ranges and the (even) sequence they were read at.
    ///
    /// A change holds the sequence odd for a few hundred stores; one that stays odd for
    /// [`WINDOW_READ_SPINS`] tries was left by a writer that died mid-change, and reading it is
    /// a protocol error (the post is refused) rather than a wait without end.
    fn read_window(&self, slot: u32) -> Result<(u64, Vec<WindowRange>)> {
        let seq = self.seq(slot)?;
        let mut spins = 0u32;
        loop {
            if spins > WINDOW_READ_SPINS {
                return Err(FabricError::Protocol(format!(
                    "the write window of grant slot {slot} is torn (its sequence stayed odd: a \
                     writer died while changing it)"
                )));
            }
            let s1 = seq.load(Ordering::Acquire);
            if s1 & 1 == 0 {
                let mut ranges = Vec::new();
                for i in 0..MAX_WINDOW_RANGES {
                    let off = self.range_offset(slot, i);
                    let end = self.region.word(off + 8)?.load(Ordering::Relaxed);
                    if end == 0 {
                        continue;
                    }
                    let start = self.region.word(off)?.load(Ordering::Relaxed);
                    let access = if start & ATOMIC_ONLY != 0 {
                        WindowAccess::Atomic
                    } else {
                        WindowAccess::Write
                    };
                    let offset = start & !ATOMIC_ONLY;
                    ranges.push(WindowRange {
                        offset,
                        len: end.saturating_sub(offset),
                        access,
                    });
                }
                std::sync::atomic::fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) == s1 {
                    return Ok((s1, ranges));
                }
            }
            spins += 1;
            if spins > 64 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Checks every WRITE, CAS and FAA of `ops` against the window of `key`'s slot and returns
    /// the window's sequence, for [`Self::recheck_post`]. The caller has checked the key.
    /// Bounds and alignment are checked before (`exec::validate`), so a bad post reports those.
    pub fn check_window(&self, key: AccessKey, ops: &[Op]) -> Result<u64> {
        if ops.iter().all(|o| matches!(o, Op::Read { .. })) {
            return self.seq(key.slot).map(|s| s.load(Ordering::Acquire) & !1);
        }
        let (seq, ranges) = self.read_window(key.slot)?;
        for op in ops {
            let (offset, len, atomic_ok) = match op {
                Op::Read { .. } => continue,
                Op::Write { offset, data } => (*offset, data.len() as u64, false),
                Op::Cas { offset, .. } => (*offset, 8, true),
                Op::Faa { offset, .. } => (*offset, 8, false),
            };
            let end = offset.saturating_add(len);
            let inside = ranges.iter().any(|r| {
                r.offset <= offset
                    && end <= r.end()
                    && (r.access == WindowAccess::Write || atomic_ok)
            });
            if !inside {
                return Err(FabricError::OutsideWindow {
                    slot: key.slot,
                    offset,
                    len,
                });
            }
        }
        Ok(seq)
    }

    /// The shm re-check after a post's stores: the key is still valid ([`Self::recheck`]) and
    /// the window has not lost a range the post wrote in (`seq` from [`Self::check_window`];
    /// if the window changed since, the post is checked against the new one).
    pub fn recheck_post(&self, key: AccessKey, ops: &[Op], seq: u64) -> Result<()> {
        if self.recheck(key).is_err() {
            return Err(FabricError::RevokedDuringPost { slot: key.slot });
        }
        if ops.iter().all(|o| matches!(o, Op::Read { .. })) {
            return Ok(());
        }
        if self.seq(key.slot)?.load(Ordering::SeqCst) == seq {
            return Ok(());
        }
        match self.check_window(key, ops) {
            Ok(_) => Ok(()),
            Err(FabricError::OutsideWindow { slot, offset, len }) => {
                Err(FabricError::WindowClosedDuringPost { slot, offset, len })
            }
            Err(e) => Err(e),
        }
    }
}

/// Revokes every grant of a format-1 table at `path` (16-byte slots `[token][generation]`,
/// valid while the token is non-zero), so KNs of an older build that still map it are denied.
/// Anything else at `path` is left alone.
fn revoke_all_v1(path: &Path) {
    let Ok(region) = PmRegion::open(path, DurabilityRequest::ProcessCrash) else {
        return;
    };
    let header = (region.len() >= 16)
        .then(|| {
            Some((
                region.word(0).ok()?.load(Ordering::Acquire),
                region.word(8).ok()?.load(Ordering::Acquire),
            ))
        })
        .flatten();
    let Some((MAGIC_V1, capacity)) = header else {
        return;
    };
    for slot in 0..capacity {
        let off = 16 + slot * 16;
        if off + 16 > region.len() {
            break;
        }
        if let Ok(w) = region.word(off) {
            w.store(0, Ordering::SeqCst);
        }
    }
    tracing::info!(path = %path.display(), "revoked the grants of a format-1 grant table before replacing it");
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn a_window_left_torn_by_a_dead_writer_is_refused_not_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pool.grants");
        let t = GrantTable::create(&p, 2).unwrap();
        let key = t
            .grant_with_window(&[WindowRange::write(4096, 4096)])
            .unwrap();
        // A writer that died between its two sequence stores.
        let seq = t.seq(key.slot).unwrap();
        seq.store(seq.load(Ordering::Relaxed) | 1, Ordering::SeqCst);
        assert!(matches!(t.window(key), Err(FabricError::Protocol(_))));
        // The next change (here the revocation of a new table's create) rewrites the slot.
        drop(t);
        let t = GrantTable::create(&p, 2).unwrap();
        let key = t.grant_with_window(&[WindowRange::write(0, 8)]).unwrap();
        assert_eq!(t.window(key).unwrap(), vec![WindowRange::write(0, 8)]);
    }

    #[test]
    fn grant_check_revoke_regrant() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g");
        let t = GrantTable::create(&p, 2).unwrap();
        let a = t.grant().unwrap();
        let b = t.grant().unwrap();
        assert!(t.grant().is_err(), "capacity is 2");
        t.check(a).unwrap();
        t.revoke(a).unwrap();
        assert!(t.check(a).is_err());
        let c = t.grant().unwrap();
        assert_eq!(c.slot, a.slot);
        assert!(c.generation > a.generation);
        assert_ne!(c.secret, a.secret, "every grant draws a fresh secret");
        assert!(
            t.check(a).is_err(),
            "an old token never matches a regranted slot"
        );
        let other = GrantTable::open(&p).unwrap();
        other.check(b).unwrap();
        other.check(c).unwrap();
        // Re-creating the table (a memory-node restart) revokes the grants callers still map.
        let _fresh = GrantTable::create(&p, 2).unwrap();
        assert!(other.check(b).is_err() && other.check(c).is_err());
    }

    #[test]
    fn grant_tables_of_files_sit_beside_them_and_of_devices_in_dev_shm() {
        assert_eq!(
            GrantTable::path_for(Path::new("/data/dinomo.pool")),
            PathBuf::from("/data/dinomo.pool.grants")
        );
        // /dev/null stands in for a device-DAX device: any character device.
        assert_eq!(
            GrantTable::path_for(Path::new("/dev/null")),
            PathBuf::from("/dev/shm/dinomo-null.grants")
        );
    }

    #[test]
    fn revoke_waits_for_holds_of_its_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let t = GrantTable::create(&dir.path().join("g"), 2).unwrap();
        let (a, b) = (t.grant().unwrap(), t.grant().unwrap());
        let hold_a = t.hold(a).unwrap();
        let hold_b = t.hold(b).unwrap();
        std::thread::scope(|s| {
            let revoking = s.spawn(|| t.revoke(a).unwrap());
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(
                !revoking.is_finished(),
                "a revoke waits for the post holding its key"
            );
            drop(hold_a);
            revoking.join().unwrap();
        });
        assert!(t.hold(a).is_err() && t.recheck(a).is_err());
        // Another slot's hold does not delay the revoke, and survives it.
        t.recheck(b).unwrap();
        drop(hold_b);
        assert!(matches!(
            t.hold(AccessKey {
                slot: 9,
                generation: 1,
                secret: [0; 16]
            }),
            Err(FabricError::AccessDenied { slot: 9 })
        ));
    }

    #[test]
    fn a_wrong_secret_or_generation_is_denied() {
        let dir = tempfile::tempdir().unwrap();
        let t = GrantTable::create(&dir.path().join("g"), 2).unwrap();
        let a = t.grant().unwrap();
        for i in 0..16 {
            let mut bad = a;
            bad.secret[i] ^= 1;
            assert!(t.check(bad).is_err(), "secret byte {i} differs");
        }
        let mut old = a;
        old.generation -= 1;
        assert!(t.check(old).is_err());
        t.check(a).unwrap();
        assert!(constant_time_eq(b"abc", b"abc") && !constant_time_eq(b"abc", b"abd"));
        assert!(
            format!("{a:?}").contains("redacted"),
            "Debug hides the secret"
        );
    }

    #[test]
    fn windows_open_check_close_and_limit() {
        let dir = tempfile::tempdir().unwrap();
        let t = GrantTable::create(&dir.path().join("g"), 2).unwrap();
        let a = t.grant().unwrap();
        let b = t.grant().unwrap();
        let w = |offset: u64, len: usize| Op::Write {
            offset,
            data: Bytes::from(vec![0u8; len]),
        };
        let cas = |offset| Op::Cas {
            offset,
            expected: 0,
            new: 1,
        };
        let faa = |offset| Op::Faa { offset, add: 1 };
        assert!(matches!(
            t.check_window(a, &[w(4096, 8)]),
            Err(FabricError::OutsideWindow {
                offset: 4096,
                len: 8,
                ..
            })
        ));
        t.open_window(a, WindowRange::write(4096, 4096)).unwrap();
        t.open_window(a, WindowRange::atomic(1 << 20, 64)).unwrap();
        t.check_window(a, &[w(4096, 4096), w(8184, 8), cas(4096), faa(4096)])
            .unwrap();
        t.check_window(a, &[cas(1 << 20), Op::Read { offset: 0, len: 8 }])
            .unwrap();
        assert!(
            t.check_window(a, &[w(8190, 8)]).is_err(),
            "straddles the end"
        );
        assert!(
            t.check_window(a, &[w(1 << 20, 8)]).is_err(),
            "cells: CAS only"
        );
        assert!(
            t.check_window(a, &[faa(1 << 20)]).is_err(),
            "cells: CAS only"
        );
        assert!(t.check_window(a, &[cas((1 << 20) + 64)]).is_err());
        assert!(
            t.check_window(b, &[w(4096, 8)]).is_err(),
            "another key's window"
        );
        assert_eq!(t.window(a).unwrap().len(), 2);
        // Closing: posts checked before see a changed sequence, and the new window refuses.
        let seq = t.check_window(a, &[w(4096, 8)]).unwrap();
        t.close_window(a, 4096).unwrap();
        assert!(matches!(
            t.recheck_post(a, &[w(4096, 8)], seq),
            Err(FabricError::WindowClosedDuringPost { .. })
        ));
        assert!(t.check_window(a, &[w(4096, 8)]).is_err());
        t.recheck_post(a, &[cas(1 << 20)], seq).unwrap();
        // 64 ranges at most.
        for i in 1..=MAX_WINDOW_RANGES as u64 {
            t.open_window(b, WindowRange::write(i << 16, 4096)).unwrap();
        }
        assert!(matches!(
            t.open_window(b, WindowRange::write(1 << 40, 8)),
            Err(FabricError::WindowFull { limit: 64, .. })
        ));
        // Another process's view (its own mapping) agrees.
        let other = GrantTable::open(&dir.path().join("g")).unwrap();
        assert_eq!(other.window(b).unwrap().len(), MAX_WINDOW_RANGES);
        other.check_window(a, &[cas(1 << 20)]).unwrap();
        // Revoking empties the window; a regrant of the slot starts empty.
        t.revoke(b).unwrap();
        assert!(t.window(b).unwrap().is_empty());
        let c = t.grant().unwrap();
        assert_eq!(c.slot, b.slot);
        assert!(t.window(c).unwrap().is_empty());
        assert!(t.check_window(c, &[w(1 << 16, 8)]).is_err());
    }

    #[test]
    fn format_1_tables_are_refused_by_name_and_revoked_when_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g");
        {
            let r = PmRegion::create(&p, 16 + 2 * 16, DurabilityRequest::ProcessCrash).unwrap();
            r.word(0).unwrap().store(MAGIC_V1, Ordering::Release);
            r.word(8).unwrap().store(2, Ordering::Release);
            r.word(16).unwrap().store((1 << 32) | 77, Ordering::Release);
        }
        let e = GrantTable::open(&p).unwrap_err().to_string();
        assert!(e.contains("format 1") && e.contains("format 2"), "{e}");
        let old = PmRegion::open(&p, DurabilityRequest::ProcessCrash).unwrap();
        let _t = GrantTable::create(&p, 2).unwrap();
        assert_eq!(
            old.word(16).unwrap().load(Ordering::Acquire),
            0,
            "the old table's token was revoked for KNs still mapping it"
        );
    }
}
