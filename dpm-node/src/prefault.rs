//! Faulting the pool into memory in the background once it is open (config `prefault`), so
//! that the first touch of each page does not land on the request path: for a pool file, a
//! new segment's first write made the kernel allocate and zero-fill page-cache pages inside the
//! AllocateSegment call a KN waits for (docs/perf/kv-wire.md, seventh session).
//!
//! Reads only ([`dinomo_fabric::PmRegion::prefault`]): pages never written stay clean, so
//! nothing is written back for them and the kernel may reclaim them. What it does not do: a
//! later first write to a page of a file still takes a (cheaper) write fault, and a backup's
//! pool is not prefaulted (backups do not open a `Dpm`).
//!
//! Skipped, with a log line saying why, where it would do harm: a pool on tmpfs (a read fault
//! there allocates real memory, which cannot be reclaimed without swap), and a pool larger than
//! half the memory available (one pass would evict what it faulted in, and other pages).
//! Prefaulting is an optimisation: every failure is logged and leaves the rest to fault in when
//! first used.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::pool::Pool;

/// Bytes faulted in per call, between checks of the stop flag (about 40 ms on this project's VM).
const CHUNK: u64 = 16 << 20;

/// Starts the prefault thread for `pool` at `path`, unless prefaulting it would do harm (then
/// logs why and returns `None`). The thread ends when it is done or `stop` is set.
pub fn spawn(path: &Path, pool: Arc<Pool>, stop: Arc<AtomicBool>) -> Option<JoinHandle<()>> {
    let len = pool.region().len();
    if let Some(why) = reason_to_skip(path, len) {
        tracing::info!(pool = %path.display(), bytes = len, "not prefaulting the pool: {why}");
        return None;
    }
    let spawned = std::thread::Builder::new()
        .name("prefault".into())
        .spawn(move || run(&pool, len, &stop));
    match spawned {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the prefault thread; the pool faults in when first used");
            None
        }
    }
}

fn run(pool: &Pool, len: u64, stop: &AtomicBool) {
    let started = std::time::Instant::now();
    let mut done = 0;
    while done < len {
        if stop.load(Ordering::Acquire) {
            tracing::debug!(done, len, "prefaulting the pool stopped by shutdown");
            return;
        }
        let n = CHUNK.min(len - done);
        if let Err(e) = pool.region().prefault(done, n) {
            tracing::warn!(error = %e, at = done, "prefaulting the pool failed; the rest faults in when first used");
            return;
        }
        done += n;
    }
    tracing::info!(bytes = len, took = ?started.elapsed(), "pool prefaulted: its pages are in memory, allocated off the request path");
}

/// Why prefaulting a pool of `len` bytes at `path` would do harm, if it would.
fn reason_to_skip(path: &Path, len: u64) -> Option<String> {
    // /dev is devtmpfs, which statfs reports as tmpfs: a device-DAX pool is persistent memory.
    let device = matches!(dinomo_fabric::pm::DaxDevice::probe(path), Ok(Some(_)));
    if !device && on_tmpfs(path) {
        return Some(
            "it is on tmpfs, where faulting it in would make all of it resident memory at once"
                .into(),
        );
    }
    let available = memory_available()?;
    (len > available / 2).then(|| {
        format!("it is larger than half the memory available ({available} bytes), so one pass would evict what it faulted in")
    })
}

fn on_tmpfs(path: &Path) -> bool {
    const TMPFS_MAGIC: libc::c_long = 0x0102_1994;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statfs buffer we own.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut s) };
    rc == 0 && s.f_type as libc::c_long == TMPFS_MAGIC
}

/// The smaller of MemAvailable and this process's cgroup (v2) memory limit, when known.
fn memory_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = meminfo_kib(&meminfo, "MemAvailable:")? * 1024;
    let limit = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    Some(limit.map_or(available, |l| l.min(available)))
}

fn meminfo_kib(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available_from_meminfo() {
        let text = "MemTotal:       24683140 kB\nMemFree:        22733540 kB\nMemAvailable:   24078352 kB\n";
        assert_eq!(meminfo_kib(text, "MemAvailable:"), Some(24078352));
        assert_eq!(meminfo_kib(text, "SwapTotal:"), None);
    }

    #[test]
    fn a_pool_larger_than_half_the_memory_is_not_prefaulted() {
        let dir = tempfile::tempdir().unwrap();
        let available = memory_available().expect("/proc/meminfo on Linux");
        let why = reason_to_skip(dir.path(), available).expect("too large");
        assert!(
            why.contains("larger than half") || why.contains("tmpfs"),
            "{why}"
        );
        if !on_tmpfs(dir.path()) {
            assert_eq!(reason_to_skip(dir.path(), 1 << 20), None);
        }
    }

    #[test]
    fn dev_shm_is_tmpfs() {
        if Path::new("/dev/shm").exists() {
            assert!(on_tmpfs(Path::new("/dev/shm")));
            assert!(reason_to_skip(Path::new("/dev/shm"), 1 << 20)
                .unwrap()
                .contains("tmpfs"));
        }
    }
}
