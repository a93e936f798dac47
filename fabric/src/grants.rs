//! The grant table: which access keys may reach a region right now.
//!
//! It lives in its own small mapped file beside the pool (`<pool>.grants`), so that shm clients
//! in other processes check it without asking the memory node, and the tcp NIC and the verbs
//! backend consult the same table. Layout (little-endian u64 words):
//! `[magic][capacity]` then per slot `[token][generation]`. A slot is valid while its token is
//! non-zero; revoking stores 0, and the next grant of the slot bumps its generation, which is
//! the high half of the new token, so an old token can never match again.
//!
//! # What revocation guarantees (the fence)
//!
//! A fence (the DPM's FenceKn) revokes a key and then merges what the fenced writer logged, so
//! every post checked against the old key must either be in place when [`GrantTable::revoke`]
//! returns, or fail; it must never be acknowledged as applied after the revoke returned. Per
//! backend:
//! - tcp: the NIC holds the slot's lock shared from its check to the end of the apply
//!   ([`GrantTable::hold`]); revoke takes it exclusively. So once `revoke` returns on the
//!   memory node's table instance, every post that passed the check has been applied, and no
//!   later post passes it. (Only revokes through the same instance wait; the DPM and its NIC
//!   share one.)
//! - shm: the caller's own CPU applies the post, in another process that no lock here can
//!   stop. It re-checks its key after applying (with a full fence between its stores and the
//!   re-check, and revoke's swap is sequentially consistent, so either the re-check sees the
//!   revocation or the fencer sees the stores). A post revoked in between fails with
//!   [`FabricError::RevokedDuringPost`] (outcome unknown), never succeeds; but its bytes may
//!   land after the fence returned, which the merge must tolerate.
//! - verbs: revocation deregisters the caller's memory region, after which the device refuses
//!   its operations; see verbs.rs for when that happens relative to `revoke`.
//!
//! Callers that need a hard fence on the control path also bump the epoch the DPM checks.
//! The memory node revokes through a [`KeyFence`]: the table itself for shm and tcp, the verbs
//! NIC for verbs (whose revoke also deregisters the caller's memory regions).
//!
//! Where the table lives: `<pool>.grants` beside a pool file; for a pool on a device-DAX
//! character device (which has no directory of its own to write in),
//! `/dev/shm/dinomo-<device name>.grants` (see [`GrantTable::path_for`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::error::{FabricError, Result};
use crate::op::AccessKey;
use crate::pm::{DurabilityRequest, PmRegion};

const MAGIC: u64 = u64::from_le_bytes(*b"DNMGRANT");
const HEADER: u64 = 16;

/// How a memory node revokes a key so that the revocation is a fence (see the module doc).
pub trait KeyFence: Send + Sync + std::fmt::Debug {
    /// Revokes `key`. When this returns, every operation under it either is in place or can no
    /// longer complete as done, whatever the backend.
    fn fence(&self, key: AccessKey) -> Result<()>;
}

/// shm and tcp: the table is the fence ([`GrantTable::revoke`] waits for the tcp NIC's posts).
impl KeyFence for GrantTable {
    fn fence(&self, key: AccessKey) -> Result<()> {
        self.revoke(key)
    }
}

/// Called by a backend on the posting thread after a post's key passed the check and before
/// the post is applied: the window a fence has to close. For tests, which pause a post there
/// (see [`GrantTable::set_post_hook`]).
pub type PostHook = Arc<dyn Fn(AccessKey) + Send + Sync>;

/// A post's hold on its key (see [`GrantTable::hold`]); revoking the key waits until it is
/// dropped.
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
    /// hold it shared from check to apply, revocation takes it exclusively.
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

    /// Creates a fresh table; every grant of an earlier table at `path` is revoked first.
    ///
    /// The new table is a new file renamed over the old one, never the old file truncated:
    /// callers may still map the old file (a KN that outlived a memory-node restart), and a
    /// truncated mapping would fault them instead of failing their next check.
    pub fn create(path: &Path, capacity: u32) -> Result<Self> {
        if let Ok(old) = GrantTable::open(path) {
            old.revoke_all()?;
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let len = HEADER + u64::from(capacity) * 16;
        let region = PmRegion::create(&tmp, len, DurabilityRequest::ProcessCrash)?;
        region.word(0)?.store(MAGIC, Ordering::Release);
        region
            .word(8)?
            .store(u64::from(capacity), Ordering::Release);
        std::fs::rename(&tmp, path).map_err(|source| FabricError::Region {
            path: path.display().to_string(),
            source,
        })?;
        Ok(GrantTable::new(region, capacity))
    }

    /// Revokes every grant (waiting, slot by slot, for posts holding them).
    pub fn revoke_all(&self) -> Result<()> {
        for slot in 0..self.capacity {
            let _excl = self.slot_locks[slot as usize].write();
            self.region
                .word(Self::slot_offset(slot))?
                .store(0, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Opens a table created by the memory node (clients do this).
    pub fn open(path: &Path) -> Result<Self> {
        let region = PmRegion::open(path, DurabilityRequest::ProcessCrash)?;
        if region.len() < HEADER || region.word(0)?.load(Ordering::Acquire) != MAGIC {
            return Err(FabricError::Config(format!(
                "{} is not a grant table",
                path.display()
            )));
        }
        let capacity = region.word(8)?.load(Ordering::Acquire);
        if region.len() < HEADER + capacity * 16 {
            return Err(FabricError::Config(format!(
                "{} is truncated",
                path.display()
            )));
        }
        Ok(GrantTable::new(region, capacity as u32))
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
        HEADER + u64::from(slot) * 16
    }

    /// Grants a new key.
    pub fn grant(&self) -> Result<AccessKey> {
        let _g = self.grant_lock.lock();
        for slot in 0..self.capacity {
            let off = Self::slot_offset(slot);
            let token = self.region.word(off)?;
            if token.load(Ordering::Acquire) != 0 {
                continue;
            }
            let gen_word = self.region.word(off + 8)?;
            let generation = (gen_word.load(Ordering::Acquire) as u32)
                .wrapping_add(1)
                .max(1);
            gen_word.store(u64::from(generation), Ordering::Release);
            let nonce = rand::random::<u32>() | 1;
            let t = (u64::from(generation) << 32) | u64::from(nonce);
            token.store(t, Ordering::Release);
            return Ok(AccessKey { slot, token: t });
        }
        Err(FabricError::Config(format!(
            "all {} grant slots are in use",
            self.capacity
        )))
    }

    /// Revokes a key; later checks of it fail. Revoking an already revoked key is a no-op.
    ///
    /// Waits for the posts that hold the key through this table instance ([`Self::hold`]):
    /// when it returns, each of them has been applied and no post can pass the check any more.
    /// The swap is sequentially consistent, pairing with the re-check of [`Self::recheck`].
    pub fn revoke(&self, key: AccessKey) -> Result<()> {
        if key.slot >= self.capacity {
            return Err(FabricError::AccessDenied { slot: key.slot });
        }
        let _excl = self.slot_locks[key.slot as usize].write();
        let token = self.region.word(Self::slot_offset(key.slot))?;
        let _ = token.compare_exchange(key.token, 0, Ordering::SeqCst, Ordering::SeqCst);
        Ok(())
    }

    /// Checks `key` and holds its slot until the returned guard is dropped: a [`Self::revoke`]
    /// of the key through this instance waits for it. A backend that applies posts in this
    /// process keeps the guard from the check to the end of the apply (and must not hold it
    /// across an await or while waiting for anything but the apply itself).
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

    /// Is `key` valid now?
    pub fn check(&self, key: AccessKey) -> Result<()> {
        if key.slot < self.capacity && key.token != 0 {
            let token = self.region.word(Self::slot_offset(key.slot))?;
            if token.load(Ordering::Acquire) == key.token {
                return Ok(());
            }
        }
        Err(FabricError::AccessDenied { slot: key.slot })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(c.generation() > a.generation());
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
            t.hold(AccessKey { slot: 9, token: 1 }),
            Err(FabricError::AccessDenied { slot: 9 })
        ));
    }
}
