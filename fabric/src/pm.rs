//! A persistent-memory region: a file mapped MAP_SHARED, and the one way to make stores durable.
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
//! Invariants: the mapping never changes size; every access is bounds-checked by the caller
//! through [`PmRegion::check`]; 8-byte words used atomically are 8-byte aligned.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::error::{FabricError, Result};
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
    /// Creates (or truncates) `path` to `len` bytes, zero-filled, and maps it.
    pub fn create(path: &Path, len: u64, request: DurabilityRequest) -> Result<Self> {
        let err = |source| FabricError::Region {
            path: path.display().to_string(),
            source,
        };
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
        let mut region = PmRegion {
            base: NonNull::new(ptr.cast()).expect("mmap returned null"),
            len,
            durability,
            path: path.to_path_buf(),
            shadow: None,
            _file: file,
        };
        if durability == Durability::SimulatedPowerLoss {
            // What the file holds now is what the medium holds: persisted.
            region.shadow = Some(Shadow::new(&region)?);
        }
        Ok(region)
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

    /// Makes `[offset, offset + len)` durable according to the region's mode.
    pub fn persist(&self, offset: u64, len: u64) -> Result<()> {
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
