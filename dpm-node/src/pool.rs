//! The PM pool: the mapped file, its validated superblock, and typed access to its areas.
//!
//! Opening never "repairs": a file that is not a Dinomo pool, is truncated, has a corrupted
//! superblock or another format version is refused with an error naming what was found.
//! Formatting writes every area's initial state and the superblock last, so a crash during
//! formatting leaves a file that is refused (no magic), never a half-formatted pool.
//!
//! The pool is a file or a device-DAX character device (`/dev/daxX.Y`). A pool on a device
//! spans the whole device (its usable length, see `dinomo_fabric::pm::DaxDevice`), whatever
//! the configured pool size; formatting zeroes the device first, as a new file is zeroes.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dinomo_fabric::pm::DaxDevice;
use dinomo_fabric::{Durability, DurabilityRequest, PmRegion};
use dinomo_layout::segment::{TableEntry, TABLE_ENTRY_SIZE};
use dinomo_layout::superblock::{Superblock, SUPERBLOCK_SIZE};

use crate::error::{DpmError, Result};

/// How to lay out a new pool.
#[derive(Debug, Clone)]
pub struct FormatOptions {
    pub pool_len: u64,
    pub segment_size: u64,
    pub metadata_len: u64,
    /// Indirect cells (replicated hot keys) the pool can hold at once.
    pub max_cells: u64,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            pool_len: 1 << 30,
            segment_size: 8 << 20,
            metadata_len: 1 << 20,
            max_cells: 4096,
        }
    }
}

/// An open pool.
#[derive(Debug)]
pub struct Pool {
    region: Arc<PmRegion>,
    sb: Superblock,
}

impl Pool {
    /// Formats a new pool at `path` (the file is created or overwritten; a device-DAX device is
    /// erased and the pool spans all of it, `opts.pool_len` notwithstanding).
    pub fn format(
        path: &Path,
        opts: &FormatOptions,
        durability: DurabilityRequest,
    ) -> Result<Self> {
        let pool_len = match DaxDevice::probe(path)? {
            Some(dev) => dev.len,
            None => opts.pool_len,
        };
        let mut sb = Superblock::plan(
            pool_len,
            opts.segment_size,
            opts.metadata_len,
            opts.max_cells,
        )
        .map_err(|source| DpmError::Layout {
            path: path.display().to_string(),
            source,
        })?;
        sb.pool_id = rand::random::<u64>() | 1;
        sb.created_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let region = Arc::new(PmRegion::create(path, pool_len, durability)?);
        // A fresh file is zero-filled: free segment-table entries, empty metadata slots, zero
        // roots, an empty chunk directory and free cells are all encoded as zeros. The index
        // is created by the index module on first open.
        region.write_durable(0, &sb.encode())?;
        Ok(Pool { region, sb })
    }

    /// Whether `path` starts with a pool's magic (a file or a device-DAX device that holds a
    /// pool, valid or not). Device-DAX devices can only be mapped, not read.
    pub fn holds_pool(path: &Path) -> Result<bool> {
        let region = match PmRegion::open(path, DurabilityRequest::ProcessCrash) {
            Ok(r) => r,
            Err(dinomo_fabric::FabricError::Config(_)) => return Ok(false), // empty file
            Err(e) => return Err(e.into()),
        };
        if region.len() < 8 {
            return Ok(false);
        }
        let mut magic = [0u8; 8];
        region.read(0, &mut magic)?;
        Ok(u64::from_le_bytes(magic) == dinomo_layout::superblock::MAGIC)
    }

    /// Opens an existing pool, refusing anything that is not a valid pool of this version.
    pub fn open(path: &Path, durability: DurabilityRequest) -> Result<Self> {
        let p = path.display().to_string();
        let device = DaxDevice::probe(path)?;
        let len = match device {
            Some(dev) => dev.len,
            None => std::fs::metadata(path)
                .map_err(|e| DpmError::BadPool {
                    path: p.clone(),
                    detail: format!("cannot stat: {e}"),
                })?
                .len(),
        };
        if len < SUPERBLOCK_SIZE {
            return Err(DpmError::BadPool {
                path: p,
                detail: format!("{len} bytes is too small to hold a superblock; not a Dinomo pool"),
            });
        }
        let region = Arc::new(PmRegion::open(path, durability)?);
        let mut head = vec![0u8; SUPERBLOCK_SIZE as usize];
        region.read(0, &mut head)?;
        let sb = Superblock::decode(&head).map_err(|source| DpmError::Layout {
            path: p.clone(),
            source,
        })?;
        if sb.pool_len != len {
            return Err(DpmError::BadPool {
                path: p,
                detail: format!(
                    "the superblock says the pool is {} bytes but the {} has {len} (truncated or \
                     extended)",
                    sb.pool_len,
                    if device.is_some() { "device" } else { "file" }
                ),
            });
        }
        Ok(Pool { region, sb })
    }

    pub fn region(&self) -> &Arc<PmRegion> {
        &self.region
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn durability(&self) -> Durability {
        self.region.durability()
    }

    /// A root word (offsets from [`Roots`]).
    pub fn root(&self, which: u64) -> &AtomicU64 {
        self.region
            .word(self.sb.roots_off + which)
            .expect("roots area validated at open")
    }

    pub fn persist_root(&self, which: u64) {
        let _ = self.region.persist(self.sb.roots_off + which, 8);
    }

    /// Pool offset of segment-table entry `id`.
    pub fn table_entry_offset(&self, id: u64) -> u64 {
        self.sb.segment_table_off + id * TABLE_ENTRY_SIZE
    }

    pub fn read_table_entry(&self, id: u64) -> Result<TableEntry> {
        let off = self.table_entry_offset(id);
        let mut w = [0u64; 4];
        for (i, x) in w.iter_mut().enumerate() {
            *x = self
                .region
                .word(off + 8 * i as u64)?
                .load(Ordering::Acquire);
        }
        TableEntry::from_words(w).map_err(|source| DpmError::Layout {
            path: self.path(),
            source,
        })
    }

    /// Stores table entry word `i` of segment `id` and persists it.
    pub fn store_table_word(&self, id: u64, i: u64, value: u64) -> Result<()> {
        let off = self.table_entry_offset(id) + 8 * i;
        self.region.word(off)?.store(value, Ordering::Release);
        self.region.persist(off, 8)?;
        Ok(())
    }

    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.region.read(offset, &mut v)?;
        Ok(v)
    }

    /// A borrowed view of `len` bytes at `offset`, for scanning segments without copying.
    ///
    /// The bytes may change underneath (a KN appending): callers verify checksums before using
    /// anything and treat what they read as untrusted.
    pub fn view(&self, offset: u64, len: u64) -> Result<&[u8]> {
        self.region.check(offset, len)?;
        // SAFETY: bounds checked; the mapping lives as long as self. Concurrent appends by KNs
        // only touch bytes past the valid end, and every consumer verifies checksums.
        Ok(unsafe {
            std::slice::from_raw_parts(self.region.as_ptr().add(offset as usize), len as usize)
        })
    }

    pub fn path(&self) -> String {
        self.region.path().display().to_string()
    }
}
