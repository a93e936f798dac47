//! A persistent-memory region: a file or a device-DAX character device mapped MAP_SHARED, and
//! the one way to make stores durable.
//!
//! Durability modes (chosen at open, logged by the caller, never changed while mapped):
//! - `Dax`: the file is on a DAX filesystem and was mapped with MAP_SYNC, so CPU stores reach
//!   the persistence domain once their cache lines are written back: persist = CLWB (or
//!   CLFLUSHOPT, or CLFLUSH) per line + SFENCE.
//! - `Msync`: ordinary page-cache file; persist = msync(MS_SYNC) of the pages. Survives power
//!   loss, slowly.
//! - `ProcessCrash`: ordinary page-cache file (or tmpfs); persist = a store fence only. Data
//!   survives the crash of any process (the kernel owns the pages) but not of the machine.
//! - `SimulatedPowerLoss` (tests only): as `ProcessCrash`, and persist also records the lines
//!   it covers in a shadow image, from which [`PmRegion::power_loss_image`] builds what the
//!   medium may hold after a power failure (see [`crate::powerloss`]).
//!
//! Device-DAX (`/dev/daxX.Y`, `ndctl create-namespace -m devdax`): the region is the whole
//! character device, with no filesystem in between. Such a device cannot be truncated and its
//! metadata says nothing of its size, so [`DaxDevice::probe`] reads the size and the mapping
//! alignment from sysfs (`/sys/dev/char/MAJ:MIN/{size,align}`, else
//! `/sys/bus/dax/devices/NAME/...`); the region is the size rounded down to the alignment, mapped
//! at an address aligned to it (the kernel refuses a device-DAX mapping that is not). Durability
//! is `Dax` (the same CLWB + SFENCE as fsdax with MAP_SYNC: stores go straight to the medium
//! once their lines are written back) or, when asked for, `ProcessCrash`; `msync` is refused (it
//! does not write CPU caches back on a device). [`PmRegion::create`] on a device zero-fills and
//! persists all of it. Unlike fsdax files, device-DAX mappings can be registered for RDMA
//! (docs/decisions/0001-rdma-binding.md).
//!
//! Invariants: the mapping never changes size; every access is bounds-checked by the caller
//! through [`PmRegion::check`]; 8-byte words used atomically are 8-byte aligned.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::error::{FabricError, Result};
use crate::mirror::PersistMirror;
use crate::powerloss::{PersistHook, PowerLossImage, PowerLossStats, Shadow};

/// How stores to the region are made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    Dax(FlushInstr),
    Msync,
    ProcessCrash,
    /// Tests only: `ProcessCrash` plus a record of the persisted lines, for crash images. Costs
    /// a DRAM copy of the whole region and a copy of every persisted line.
    SimulatedPowerLoss,
}

impl std::fmt::Display for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Durability::Dax(i) => write!(f, "dax (MAP_SYNC, {i:?} + sfence): survives power loss"),
            Durability::Msync => write!(f, "msync (page cache + msync): survives power loss, slow"),
            Durability::ProcessCrash => write!(
                f,
                "process-crash (page cache, fence only): survives process crashes, not power loss"
            ),
            Durability::SimulatedPowerLoss => write!(
                f,
                "simulated-power-loss (page cache, persisted lines recorded): FOR TESTS ONLY, \
                 survives process crashes, not power loss"
            ),
        }
    }
}

/// The cache-line write-back instruction used in DAX mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushInstr {
    Clwb,
    Clflushopt,
    Clflush,
}

/// What the opener asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DurabilityRequest {
    /// DAX when MAP_SYNC works, otherwise `ProcessCrash`.
    #[default]
    Auto,
    /// DAX or fail.
    Dax,
    Msync,
    ProcessCrash,
    /// Tests only (see [`Durability::SimulatedPowerLoss`]).
    SimulatedPowerLoss,
}

impl std::str::FromStr for DurabilityRequest {
    type Err = FabricError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "dax" => Ok(Self::Dax),
            "msync" => Ok(Self::Msync),
            "process-crash" => Ok(Self::ProcessCrash),
            "simulated-power-loss" => Ok(Self::SimulatedPowerLoss),
            other => Err(FabricError::Config(format!(
                "unknown durability {other:?}: expected auto, dax, msync, process-crash or \
                 simulated-power-loss (tests only)"
            ))),
        }
    }
}

/// A mapped PM file.
#[derive(Debug)]
pub struct PmRegion {
    base: NonNull<u8>,
    len: usize,
    durability: Durability,
    path: PathBuf,
    /// The persisted lines, in `SimulatedPowerLoss` mode only.
    shadow: Option<Shadow>,
    /// Where persists are also shipped (a replicated memory node's backups), if anywhere.
    mirror: RwLock<Option<Arc<dyn PersistMirror>>>,
    /// Orders fabric posts against the mirror's records (see [`crate::mirror`]).
    gate: RwLock<()>,
    _file: File,
}

// SAFETY: the region is plain shared memory; all concurrent access goes through atomics or
// through byte copies whose races are resolved by the formats' checksums and publication order
// (documented in docs/formats.md). The pointer stays valid until drop.
unsafe impl Send for PmRegion {}
unsafe impl Sync for PmRegion {}

const MAP_SHARED_VALIDATE: libc::c_int = 0x03;
const MAP_SYNC: libc::c_int = 0x80000;

impl PmRegion {
    /// Creates (or truncates) `path` to `len` bytes, zero-filled, and maps it. On a device-DAX
    /// device `len` must be the device's [`DaxDevice::len`] (a region on a device spans all of
    /// it); every byte is then zeroed and persisted.
    pub fn create(path: &Path, len: u64, request: DurabilityRequest) -> Result<Self> {
        let err = |source| FabricError::Region {
            path: path.display().to_string(),
            source,
        };
        if let Some(dev) = DaxDevice::probe(path)? {
            if len != dev.len {
                return Err(FabricError::Config(format!(
                    "{}: a region on a device-DAX device spans the whole device ({} bytes \
                     usable), not {len} bytes",
                    path.display(),
                    dev.len
                )));
            }
            let region = Self::open(path, request)?;
            region.zero_all()?;
            return Ok(region);
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(err)?;
        file.set_len(len).map_err(err)?;
        Self::map(file, path, request)
    }

    /// Maps an existing file at its current length.
    pub fn open(path: &Path, request: DurabilityRequest) -> Result<Self> {
        let err = |source| FabricError::Region {
            path: path.display().to_string(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(err)?;
        Self::map(file, path, request)
    }

    fn map(file: File, path: &Path, request: DurabilityRequest) -> Result<Self> {
        let err = |source| FabricError::Region {
            path: path.display().to_string(),
            source,
        };
        if let Some(dev) = DaxDevice::probe(path)? {
            return Self::map_device(file, path, dev, request);
        }
        let len = file.metadata().map_err(err)?.len();
        if len == 0 || len > isize::MAX as u64 {
            return Err(FabricError::Config(format!(
                "{}: a region must have a non-zero length, found {len} bytes",
                path.display()
            )));
        }
        let len = len as usize;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let fd = file.as_raw_fd();
        let try_map = |flags| {
            // SAFETY: a fresh mapping of a file we hold open; the result is checked.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
            if p == libc::MAP_FAILED {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(p)
            }
        };
        let (ptr, durability) = match request {
            DurabilityRequest::Auto | DurabilityRequest::Dax => {
                match try_map(MAP_SHARED_VALIDATE | MAP_SYNC) {
                    Ok(p) => (p, Durability::Dax(flush_instr())),
                    Err(e) if request == DurabilityRequest::Dax => {
                        return Err(FabricError::Config(format!(
                            "{}: durability dax asked for, but MAP_SYNC failed ({e}); is the \
                             file on a filesystem mounted with -o dax?",
                            path.display()
                        )))
                    }
                    Err(_) => (
                        try_map(libc::MAP_SHARED).map_err(err)?,
                        Durability::ProcessCrash,
                    ),
                }
            }
            DurabilityRequest::Msync => {
                (try_map(libc::MAP_SHARED).map_err(err)?, Durability::Msync)
            }
            DurabilityRequest::ProcessCrash => (
                try_map(libc::MAP_SHARED).map_err(err)?,
                Durability::ProcessCrash,
            ),
            DurabilityRequest::SimulatedPowerLoss => (
                try_map(libc::MAP_SHARED).map_err(err)?,
                Durability::SimulatedPowerLoss,
            ),
        };
        Self::from_mapping(ptr, len, durability, path, file)
    }

    /// Maps a device-DAX device: all of [`DaxDevice::len`], at an address aligned to the
    /// device's alignment.
    fn map_device(
        file: File,
        path: &Path,
        dev: DaxDevice,
        request: DurabilityRequest,
    ) -> Result<Self> {
        let err = |source| FabricError::Region {
            path: path.display().to_string(),
            source,
        };
        if dev.len == 0 || dev.len > isize::MAX as u64 {
            return Err(FabricError::Config(format!(
                "{}: device-DAX device of {} bytes with alignment {} leaves {} usable bytes",
                path.display(),
                dev.size,
                dev.align,
                dev.len
            )));
        }
        let len = dev.len as usize;
        let fd = file.as_raw_fd();
        let map = |flags| map_aligned(fd, len, dev.align as usize, flags);
        let (ptr, durability) = match request {
            // Device-DAX has no filesystem metadata to keep in sync: stores reach the medium
            // once their lines are written back, with or without MAP_SYNC (tried first, as it
            // documents the intent; not every kernel accepts it on a device).
            DurabilityRequest::Auto | DurabilityRequest::Dax => {
                let p = match map(MAP_SHARED_VALIDATE | MAP_SYNC) {
                    Ok(p) => p,
                    Err(_) => map(libc::MAP_SHARED).map_err(err)?,
                };
                (p, Durability::Dax(flush_instr()))
            }
            DurabilityRequest::Msync => {
                return Err(FabricError::Config(format!(
                    "{}: durability msync does not apply to a device-DAX device (msync writes \
                     back no CPU cache lines there); use dax (or auto)",
                    path.display()
                )))
            }
            DurabilityRequest::ProcessCrash => (
                map(libc::MAP_SHARED).map_err(err)?,
                Durability::ProcessCrash,
            ),
            DurabilityRequest::SimulatedPowerLoss => (
                map(libc::MAP_SHARED).map_err(err)?,
                Durability::SimulatedPowerLoss,
            ),
        };
        Self::from_mapping(ptr, len, durability, path, file)
    }

    /// The region over a fresh mapping of `file` (both kinds: file and device), with the
    /// persisted-lines shadow in `SimulatedPowerLoss` mode: what the medium holds when it is
    /// mapped counts as persisted.
    fn from_mapping(
        ptr: *mut libc::c_void,
        len: usize,
        durability: Durability,
        path: &Path,
        file: File,
    ) -> Result<Self> {
        let mut region = PmRegion {
            base: NonNull::new(ptr.cast()).expect("mmap returned null"),
            len,
            durability,
            path: path.to_path_buf(),
            shadow: None,
            mirror: RwLock::new(None),
            gate: RwLock::new(()),
            _file: file,
        };
        if durability == Durability::SimulatedPowerLoss {
            region.shadow = Some(Shadow::new(&region)?);
        }
        Ok(region)
    }

    /// Zeroes and persists the whole region (a fresh region on a device, which cannot be
    /// truncated to get zeroes).
    fn zero_all(&self) -> Result<()> {
        const CHUNK: usize = 64 << 20;
        let mut off = 0usize;
        while off < self.len {
            let n = CHUNK.min(self.len - off);
            // SAFETY: in the mapping; no other user of a region being created.
            unsafe { std::ptr::write_bytes(self.base.as_ptr().add(off), 0, n) };
            self.persist(off as u64, n as u64)?;
            off += n;
        }
        Ok(())
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn durability(&self) -> Durability {
        self.durability
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks that `[offset, offset + len)` lies inside the region.
    pub fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(FabricError::OutOfBounds {
                offset,
                len,
                region_len: self.len as u64,
            }),
        }
    }

    /// Copies bytes out. Aligned word-sized reads are done word by word with atomic loads, so
    /// a reader never sees a torn 8-byte word (index slots rely on this).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len() as u64)?;
        // SAFETY: bounds checked above; the mapping lives as long as self.
        unsafe {
            let src = self.base.as_ptr().add(offset as usize);
            if offset.is_multiple_of(8) && out.len().is_multiple_of(8) && out.len() <= 4096 {
                for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
                    let w = AtomicU64::from_ptr(src.add(i * 8).cast()).load(Ordering::Acquire);
                    chunk.copy_from_slice(&w.to_le_bytes());
                }
            } else {
                fence(Ordering::Acquire);
                std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len());
            }
        }
        Ok(())
    }

    /// Copies `[offset, offset + out.len())` (offset and length multiples of 8) with one atomic
    /// 8-byte load per word, whatever the length: a word stored or CASed atomically while it is
    /// read is copied old or new, never torn (a plain byte copy written meanwhile may be seen
    /// in part, as with any reader). What a copy of a live pool needs; [`PmRegion::read`] copies ranges
    /// over 4 KiB with `memcpy`. Bounds are checked once, not per word (a replica's first copy
    /// reads the whole pool through here).
    pub fn read_words(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len() as u64)?;
        if !offset.is_multiple_of(8) || !out.len().is_multiple_of(8) {
            return Err(FabricError::Misaligned { offset });
        }
        // SAFETY: in bounds (checked above) and 8-byte aligned (the mapping starts on a page);
        // the mapping outlives the borrow of self. The words are read as atomics (as `word`
        // hands them out): other threads and processes write them concurrently.
        let words: &[AtomicU64] = unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(offset as usize).cast(),
                out.len() / 8,
            )
        };
        for (word, bytes) in words.iter().zip(out.chunks_exact_mut(8)) {
            bytes.copy_from_slice(&word.load(Ordering::Acquire).to_le_bytes());
        }
        Ok(())
    }

    /// Copies bytes in, without persisting them (see [`PmRegion::persist`]).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        // SAFETY: bounds checked above.
        unsafe {
            let dst = self.base.as_ptr().add(offset as usize);
            if offset.is_multiple_of(8) && data.len().is_multiple_of(8) && data.len() <= 4096 {
                for (i, chunk) in data.chunks_exact(8).enumerate() {
                    let w = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
                    AtomicU64::from_ptr(dst.add(i * 8).cast()).store(w, Ordering::Release);
                }
            } else {
                std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
                fence(Ordering::Release);
            }
        }
        Ok(())
    }

    /// Maps `[offset, offset + len)` into this process's page tables ahead of use, without
    /// writing it: the page faults (and, for a file, the zero-filling of pages that hold no
    /// data yet) happen now instead of on the request path. Reads only: a page that was never
    /// written stays clean, so nothing is written back to the file's disk for it and the kernel
    /// may still drop it under memory pressure (it reads back as zeroes).
    /// `MADV_POPULATE_READ` (Linux 5.14); on older kernels one byte per page is read instead.
    pub fn prefault(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let start = offset & !(page - 1);
        let end = offset + len;
        if start == end {
            return Ok(());
        }
        // SAFETY: a page-aligned range inside the mapping (the mapping starts page-aligned);
        // POPULATE_READ only faults pages in.
        let rc = unsafe {
            libc::madvise(
                self.base.as_ptr().add(start as usize).cast(),
                (end - start) as usize,
                libc::MADV_POPULATE_READ,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(FabricError::Region {
                path: self.path.display().to_string(),
                source: e,
            });
        }
        let mut at = start;
        while at < end {
            // SAFETY: in the mapping (bounds checked above); an atomic load (other threads may
            // be storing to the same byte) only faults the page in.
            unsafe { AtomicU8::from_ptr(self.base.as_ptr().add(at as usize)) }
                .load(Ordering::Relaxed);
            at += page;
        }
        Ok(())
    }

    /// Writes and persists.
    pub fn write_durable(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write(offset, data)?;
        self.persist(offset, data.len() as u64)
    }

    /// The 8-byte word at `offset` as an atomic.
    pub fn word(&self, offset: u64) -> Result<&AtomicU64> {
        self.check(offset, 8)?;
        if !offset.is_multiple_of(8) {
            return Err(FabricError::Misaligned { offset });
        }
        // SAFETY: in bounds, aligned, and the mapping outlives the returned borrow.
        Ok(unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(offset as usize).cast()) })
    }

    /// Makes `[offset, offset + len)` durable according to the region's mode, and records it
    /// with the region's mirror, if one is installed (which does not wait for the replicas:
    /// see [`PmRegion::mirror_barrier`]).
    pub fn persist(&self, offset: u64, len: u64) -> Result<()> {
        self.persist_local(offset, len)?;
        let mirror = self.mirror.read().clone();
        match mirror {
            Some(m) => m.record(self, offset, len),
            None => Ok(()),
        }
    }

    /// Installs (or removes) the mirror that every later persist is recorded with.
    pub fn set_mirror(&self, mirror: Option<Arc<dyn PersistMirror>>) {
        *self.mirror.write() = mirror;
    }

    /// True when a mirror is installed.
    pub fn is_mirrored(&self) -> bool {
        self.mirror.read().is_some()
    }

    /// Resolves once every persist recorded so far is durable at the mirror's replicas that
    /// must acknowledge (at once when no mirror is installed).
    pub fn mirror_barrier(&self) -> crate::mirror::BarrierFuture {
        match self.mirror.read().clone() {
            Some(m) => m.barrier(),
            None => Box::pin(std::future::ready(Ok(()))),
        }
    }

    /// The gate that orders fabric posts against the mirror's records (see [`crate::mirror`]).
    pub fn mirror_gate(&self) -> &RwLock<()> {
        &self.gate
    }

    fn persist_local(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        match self.durability {
            Durability::Dax(instr) => {
                let start = offset & !63;
                let end = offset + len;
                let mut line = start;
                while line < end {
                    // SAFETY: the line lies in the mapping (bounds checked, start rounded down
                    // stays >= 0 and inside the same page).
                    unsafe { flush_line(instr, self.base.as_ptr().add(line as usize)) };
                    line += 64;
                }
                sfence();
                Ok(())
            }
            Durability::Msync => {
                let page = 4096u64;
                let start = offset & !(page - 1);
                let end = (offset + len).min(self.len as u64);
                // SAFETY: page-aligned range inside the mapping.
                let rc = unsafe {
                    libc::msync(
                        self.base.as_ptr().add(start as usize).cast(),
                        (end - start) as usize,
                        libc::MS_SYNC,
                    )
                };
                if rc != 0 {
                    return Err(FabricError::Region {
                        path: self.path.display().to_string(),
                        source: std::io::Error::last_os_error(),
                    });
                }
                Ok(())
            }
            Durability::ProcessCrash => {
                fence(Ordering::SeqCst);
                Ok(())
            }
            Durability::SimulatedPowerLoss => {
                fence(Ordering::SeqCst);
                let shadow = self.shadow.as_ref().expect("mapped with a shadow");
                let n = shadow.begin();
                shadow.call_hook(self, n);
                shadow.record(self, offset, len);
                fence(Ordering::SeqCst);
                Ok(())
            }
        }
    }

    fn shadow(&self, what: &str) -> Result<&Shadow> {
        self.shadow.as_ref().ok_or_else(|| {
            FabricError::Config(format!(
                "{what} needs a region mapped with durability simulated-power-loss; {} is {}",
                self.path.display(),
                self.durability
            ))
        })
    }

    /// Persists begun so far (simulated-power-loss regions; 0 for the others, which do not
    /// count).
    pub fn persist_count(&self) -> u64 {
        self.shadow.as_ref().map_or(0, Shadow::persist_count)
    }

    /// Sets (or clears) the function called at every persist with the persist's number;
    /// simulated-power-loss regions only. The hook runs on the persisting thread when the
    /// persist begins, before its lines are recorded and with no lock held: an image it takes
    /// with [`PmRegion::power_loss_image`] is a power failure right before this persist's
    /// write-back (its stores are in limbo). Its own persists do not call it again.
    pub fn set_persist_hook(&self, hook: Option<PersistHook>) -> Result<()> {
        self.shadow("a persist hook")?.set_hook(hook);
        Ok(())
    }

    /// What the medium may hold if power failed now: every line not equal to its persisted
    /// state is dropped, kept or torn, chosen by `rng_seed` (see [`crate::powerloss`]).
    /// Persists wait while the image is taken; stores do not. Simulated-power-loss regions
    /// only.
    pub fn power_loss_image(&self, rng_seed: u64) -> Result<PowerLossImage> {
        Ok(self.shadow("a power-loss image")?.image(self, rng_seed))
    }

    /// [`PmRegion::power_loss_image`] written as a new file at `path`, ready to be mapped.
    pub fn write_power_loss_image(&self, path: &Path, rng_seed: u64) -> Result<PowerLossStats> {
        let image = self.power_loss_image(rng_seed)?;
        image.write_to(path)?;
        Ok(image.stats)
    }

    /// Raw base pointer, for backends that register the whole mapping with a NIC.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }
}

impl Drop for PmRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what map() mapped; no borrow of it outlives self.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// The alignment a device-DAX mapping needs when sysfs does not say (the common default).
pub const DEFAULT_DAX_ALIGN: u64 = 2 << 20;

/// A device-DAX character device, as sysfs describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaxDevice {
    /// The device's size in bytes.
    pub size: u64,
    /// The alignment of its mappings (address and length), e.g. 2 MiB.
    pub align: u64,
    /// What a region on it spans: `size` rounded down to `align`.
    pub len: u64,
}

impl DaxDevice {
    /// `Some` if `path` is a character device (it must then be device-DAX, else an error says
    /// so), `None` for anything else (a regular file, or a path that does not exist yet).
    pub fn probe(path: &Path) -> Result<Option<Self>> {
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(FabricError::Region {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        if !meta.file_type().is_char_device() {
            return Ok(None);
        }
        let (major, minor) = dev_major_minor(meta.rdev());
        let mut dirs = vec![PathBuf::from(format!("/sys/dev/char/{major}:{minor}"))];
        if let Some(name) = path.file_name() {
            dirs.push(Path::new("/sys/bus/dax/devices").join(name));
        }
        let read = |dir: &Path, attr: &str| std::fs::read_to_string(dir.join(attr)).ok();
        let Some((dir, size)) = dirs
            .iter()
            .find_map(|d| read(d, "size").map(|s| (d.clone(), s)))
        else {
            return Err(FabricError::Config(format!(
                "{} is a character device ({major}:{minor}) but not a device-DAX device: sysfs \
                 has no size for it (looked in {})",
                path.display(),
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" and ")
            )));
        };
        let size = parse_sysfs_u64(&size).ok_or_else(|| {
            FabricError::Config(format!(
                "{}: cannot parse the device size {size:?} from {}",
                path.display(),
                dir.join("size").display()
            ))
        })?;
        // `align` exists from Linux 5.10; before, device-DAX mappings were 2 MiB aligned.
        let align = match read(&dir, "align") {
            Some(a) => parse_sysfs_u64(&a)
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| {
                    FabricError::Config(format!(
                        "{}: cannot parse the alignment {a:?} from {}",
                        path.display(),
                        dir.join("align").display()
                    ))
                })?,
            None => DEFAULT_DAX_ALIGN,
        };
        Ok(Some(DaxDevice::new(size, align)))
    }

    /// A device of `size` bytes whose mappings are aligned to `align` (a power of two).
    pub fn new(size: u64, align: u64) -> Self {
        DaxDevice {
            size,
            align,
            len: size & !(align - 1),
        }
    }
}

/// A decimal (or `0x` hexadecimal) number as a sysfs attribute holds it, newline and all.
pub fn parse_sysfs_u64(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

/// The major and minor numbers of a `st_rdev` (glibc's encoding).
fn dev_major_minor(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & 0xffff_f000);
    let minor = (dev & 0xff) | ((dev >> 12) & 0xffff_ff00);
    (major, minor)
}

/// Maps `len` bytes of `fd` at an address aligned to `align`: reserves `len + align` bytes of
/// address space, maps the file over an aligned part of it and gives the rest back.
fn map_aligned(
    fd: libc::c_int,
    len: usize,
    align: usize,
    flags: libc::c_int,
) -> std::io::Result<*mut libc::c_void> {
    let reserve = len
        .checked_add(align)
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
    // SAFETY: a fresh anonymous reservation; the result is checked.
    let r = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if r == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let start = (r as usize).next_multiple_of(align);
    // SAFETY: [start, start + len) lies inside the reservation, which MAP_FIXED replaces.
    let p = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags | libc::MAP_FIXED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        // SAFETY: unmapping the reservation made above.
        unsafe { libc::munmap(r, reserve) };
        return Err(e);
    }
    let (head, tail_start) = (start - r as usize, start + len);
    let tail = r as usize + reserve - tail_start;
    // SAFETY: the unused ends of our own reservation.
    unsafe {
        if head > 0 {
            libc::munmap(r, head);
        }
        if tail > 0 {
            libc::munmap(tail_start as *mut libc::c_void, tail);
        }
    }
    Ok(p)
}

/// The best write-back instruction this CPU has (cpuid leaf 7: EBX bit 24 CLWB, 23 CLFLUSHOPT).
pub fn flush_instr() -> FlushInstr {
    #[cfg(target_arch = "x86_64")]
    {
        let leaf0 = std::arch::x86_64::__cpuid(0);
        if leaf0.eax >= 7 {
            let l7 = std::arch::x86_64::__cpuid_count(7, 0);
            if l7.ebx & (1 << 24) != 0 {
                return FlushInstr::Clwb;
            }
            if l7.ebx & (1 << 23) != 0 {
                return FlushInstr::Clflushopt;
            }
        }
    }
    FlushInstr::Clflush
}

/// Writes back one cache line.
///
/// # Safety
/// `p` must point into mapped memory.
#[inline]
unsafe fn flush_line(instr: FlushInstr, p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller guarantees p is mapped; the instruction was detected by cpuid.
    unsafe {
        match instr {
            FlushInstr::Clwb => {
                std::arch::asm!("clwb [{}]", in(reg) p, options(nostack, preserves_flags))
            }
            FlushInstr::Clflushopt => {
                std::arch::asm!("clflushopt [{}]", in(reg) p, options(nostack, preserves_flags))
            }
            FlushInstr::Clflush => std::arch::x86_64::_mm_clflush(p),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (instr, p);
        fence(Ordering::SeqCst);
    }
}

#[inline]
fn sfence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
    #[cfg(not(target_arch = "x86_64"))]
    fence(Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_write_read_persist_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.pm");
        {
            let r = PmRegion::create(&p, 1 << 16, DurabilityRequest::Auto).unwrap();
            r.write_durable(100, b"hello").unwrap();
            r.word(64).unwrap().store(7, Ordering::SeqCst);
            r.persist(64, 8).unwrap();
            assert!(r.write(1 << 16, b"x").is_err());
            assert!(matches!(r.word(3), Err(FabricError::Misaligned { .. })));
        }
        let r = PmRegion::open(&p, DurabilityRequest::Msync).unwrap();
        assert_eq!(r.durability(), Durability::Msync);
        let mut b = [0u8; 5];
        r.read(100, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert_eq!(r.word(64).unwrap().load(Ordering::SeqCst), 7);
        r.persist(0, 1 << 16).unwrap();
    }

    #[test]
    fn read_words_copies_what_was_written_and_refuses_bad_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let r =
            PmRegion::create(&dir.path().join("r.pm"), 1 << 16, DurabilityRequest::Auto).unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 1) as u8).collect();
        r.write(4096, &data).unwrap();
        r.word(4096 + 8 * 5)
            .unwrap()
            .store(u64::MAX, Ordering::Release);
        let mut out = vec![0u8; data.len()];
        r.read_words(4096, &mut out).unwrap();
        let mut want = data.clone();
        want[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(out, want);
        // The last word of the region, and nothing past it.
        let mut last = [0u8; 8];
        r.read_words((1 << 16) - 8, &mut last).unwrap();
        assert!(matches!(
            r.read_words((1 << 16) - 8, &mut [0u8; 16]),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.read_words(u64::MAX - 7, &mut last),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.read_words(4, &mut last),
            Err(FabricError::Misaligned { offset: 4 })
        ));
        assert!(matches!(
            r.read_words(8, &mut [0u8; 12]),
            Err(FabricError::Misaligned { offset: 8 })
        ));
    }

    /// Pages of `r` in `[offset, offset + len)` that are resident (mincore).
    fn resident_pages(r: &PmRegion, offset: u64, len: u64) -> usize {
        let pages = len.div_ceil(4096) as usize;
        let mut v = vec![0u8; pages];
        // SAFETY: a page-aligned range inside the mapping and a vector of one byte per page.
        let rc = unsafe {
            libc::mincore(
                r.base.as_ptr().add(offset as usize).cast(),
                len as usize,
                v.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn prefault_brings_pages_in_and_keeps_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.pm");
        let len = 64u64 << 20;
        let r = PmRegion::create(&p, len, DurabilityRequest::ProcessCrash).unwrap();
        // A fresh sparse file: nothing of it is resident yet.
        assert_eq!(resident_pages(&r, 16 << 20, 1 << 20), 0);
        r.prefault(16 << 20, 1 << 20).unwrap();
        assert_eq!(resident_pages(&r, 16 << 20, 1 << 20), 256);
        r.write_durable(40 << 20, b"kept").unwrap();
        r.prefault(0, len).unwrap();
        assert_eq!(resident_pages(&r, 0, len), (len / 4096) as usize);
        let mut b = [0u8; 4];
        r.read(40 << 20, &mut b).unwrap();
        assert_eq!(&b, b"kept");
        r.read(16 << 20, &mut b).unwrap();
        assert_eq!(b, [0; 4], "a prefaulted hole reads as zeroes");
        assert!(matches!(
            r.prefault(len - 4096, 8192),
            Err(FabricError::OutOfBounds { .. })
        ));
        r.prefault(len, 0).unwrap();
    }

    #[test]
    fn sysfs_numbers_and_device_numbers() {
        assert_eq!(parse_sysfs_u64("268435456\n"), Some(256 << 20));
        assert_eq!(parse_sysfs_u64(" 2097152 "), Some(2 << 20));
        assert_eq!(parse_sysfs_u64("0x200000\n"), Some(2 << 20));
        assert_eq!(parse_sysfs_u64(""), None);
        assert_eq!(parse_sysfs_u64("12 MiB"), None);
        // glibc's makedev.
        let makedev = |major: u64, minor: u64| {
            ((major & 0xfff) << 8)
                | ((major & 0xffff_f000) << 32)
                | (minor & 0xff)
                | ((minor & 0xffff_ff00) << 12)
        };
        assert_eq!(dev_major_minor((251 << 8) | 3), (251, 3));
        for (major, minor) in [(252, 0), (4096, 263), (0xffff_ffff, 0xffff_ffff)] {
            assert_eq!(dev_major_minor(makedev(major, minor)), (major, minor));
        }
        let d = DaxDevice::new((256 << 20) + 4096, 2 << 20);
        assert_eq!(d.len, 256 << 20);
        assert_eq!(DaxDevice::new(1 << 20, 2 << 20).len, 0);
    }

    #[test]
    fn only_character_devices_are_device_dax_and_others_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.pm");
        assert_eq!(DaxDevice::probe(&p).unwrap(), None, "absent");
        std::fs::write(&p, b"x").unwrap();
        assert_eq!(DaxDevice::probe(&p).unwrap(), None, "a regular file");
        // /dev/null is a character device without a device-DAX size in sysfs.
        let e = DaxDevice::probe(Path::new("/dev/null")).unwrap_err();
        assert!(e.to_string().contains("not a device-DAX device"), "{e}");
        assert!(PmRegion::open(Path::new("/dev/null"), DurabilityRequest::Auto).is_err());
    }

    #[test]
    fn aligned_mappings_are_aligned_and_usable() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.pm");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        f.set_len(4 << 20).unwrap();
        let ptr = map_aligned(f.as_raw_fd(), 4 << 20, 2 << 20, libc::MAP_SHARED).unwrap();
        assert_eq!(ptr as usize % (2 << 20), 0);
        // SAFETY: a 4 MiB mapping of our own file.
        unsafe {
            *(ptr as *mut u8).add((4 << 20) - 1) = 7;
            libc::munmap(ptr, 4 << 20);
        }
        let mut b = [0u8; 1];
        PmRegion::open(&p, DurabilityRequest::ProcessCrash)
            .unwrap()
            .read((4 << 20) - 1, &mut b)
            .unwrap();
        assert_eq!(b[0], 7);
    }

    /// Inside the VM of `scripts/vm-tests.sh --devdax` (`DINOMO_DAX_DEVICE=/dev/dax0.0`): a
    /// region on the real device. Elsewhere it says it is skipped.
    #[test]
    fn device_dax_region_when_there_is_one() {
        let Some(dev) = std::env::var_os("DINOMO_DAX_DEVICE") else {
            println!("SKIPPED: DINOMO_DAX_DEVICE is not set (no device-DAX outside the test VM)");
            return;
        };
        let path = Path::new(&dev);
        let d = DaxDevice::probe(path).unwrap().expect("a character device");
        assert!(d.len > 0 && d.len.is_multiple_of(d.align), "{d:?}");
        {
            let r = PmRegion::create(path, d.len, DurabilityRequest::Auto).unwrap();
            assert!(
                matches!(r.durability(), Durability::Dax(_)),
                "{}",
                r.durability()
            );
            assert_eq!(r.as_ptr() as u64 % d.align, 0);
            let mut b = [1u8; 64];
            r.read(d.len - 64, &mut b).unwrap();
            assert_eq!(b, [0u8; 64], "create zeroes the device");
            r.write_durable(d.len - 8, b"devdax!!").unwrap();
            assert!(PmRegion::create(path, d.len - d.align, DurabilityRequest::Auto).is_err());
            assert!(PmRegion::open(path, DurabilityRequest::Msync).is_err());
        }
        let r = PmRegion::open(path, DurabilityRequest::Dax).unwrap();
        let mut b = [0u8; 8];
        r.read(d.len - 8, &mut b).unwrap();
        assert_eq!(&b, b"devdax!!");
        println!(
            "device-DAX {}: {d:?}, durability {}",
            path.display(),
            r.durability()
        );
    }

    #[test]
    fn dax_request_on_plain_file_is_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.pm");
        // On a DAX mount (inside the test VM) this succeeds; elsewhere it must fail clearly.
        match PmRegion::create(&p, 4096, DurabilityRequest::Dax) {
            Ok(r) => assert!(matches!(r.durability(), Durability::Dax(_))),
            Err(e) => assert!(e.to_string().contains("MAP_SYNC"), "{e}"),
        }
    }
}
