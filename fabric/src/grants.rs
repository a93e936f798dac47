//! The grant table: which access keys may reach a region right now.
//!
//! It lives in its own small mapped file beside the pool (`<pool>.grants`), so that shm clients
//! in other processes check it without asking the memory node, and the tcp NIC and the verbs
//! backend consult the same table. Layout (little-endian u64 words):
//! `[magic][capacity]` then per slot `[token][generation]`. A slot is valid while its token is
//! non-zero; revoking stores 0, and the next grant of the slot bumps its generation, which is
//! the high half of the new token, so an old token can never match again.
//!
//! Revocation fences future posts. A post that already passed the check may still complete (as
//! an RDMA operation already on the wire would); callers that need a hard fence also bump the
//! epoch the DPM checks on the control path.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use crate::error::{FabricError, Result};
use crate::op::AccessKey;
use crate::pm::{DurabilityRequest, PmRegion};

const MAGIC: u64 = u64::from_le_bytes(*b"DNMGRANT");
const HEADER: u64 = 16;

/// A grant table mapped from its file.
#[derive(Debug)]
pub struct GrantTable {
    region: PmRegion,
    capacity: u32,
    /// Serialises granting (finding a free slot); checks are lock-free.
    grant_lock: Mutex<()>,
}

impl GrantTable {
    /// The conventional path of the grant table of a pool file.
    pub fn path_for(pool: &Path) -> PathBuf {
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
        Ok(GrantTable {
            region,
            capacity,
            grant_lock: Mutex::new(()),
        })
    }

    /// Revokes every grant.
    pub fn revoke_all(&self) -> Result<()> {
        for slot in 0..self.capacity {
            self.region
                .word(Self::slot_offset(slot))?
                .store(0, Ordering::Release);
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
        Ok(GrantTable {
            region,
            capacity: capacity as u32,
            grant_lock: Mutex::new(()),
        })
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
    pub fn revoke(&self, key: AccessKey) -> Result<()> {
        if key.slot >= self.capacity {
            return Err(FabricError::AccessDenied { slot: key.slot });
        }
        let token = self.region.word(Self::slot_offset(key.slot))?;
        let _ = token.compare_exchange(key.token, 0, Ordering::AcqRel, Ordering::Acquire);
        Ok(())
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
}
