//! The pool's owner lock: at most one dpm-node process, primary or backup, serves a pool.
//!
//! Two processes on one pool would both take it for theirs: two primaries allocate the same
//! segments and merge into one index; a backup under a primary overwrites the primary's lines
//! with another primary's copy. Nothing in the pool can tell them apart, so `run` takes this
//! lock before it opens the pool and holds it while it serves; a second process is refused
//! with the path of the lock and, where it can be read, the pid of the holder.
//!
//! The lock is an advisory `flock` (exclusive, never waited for). On a file pool it is taken on
//! a lock file beside it (`<pool>.lock`), not on the pool: a backup replaces its pool file by a
//! rename when it starts a fresh copy, and `dinomo up` swaps pool files at a failover, while the
//! lock must stay with the path. On a device-DAX device it is taken on the device itself (a
//! device is never renamed). The kernel drops it when the holder exits, SIGKILL included, so a
//! crashed node never leaves a stale lock behind; the pid in the file is only a hint for the
//! error message. KV nodes mapping the pool (shm fabric) take no lock and are not refused.
//!
//! The lock file is named after the pool's path with symbolic links resolved, so a link to the
//! pool finds the same lock (a hard link or a copy does not: do not serve one pool under two
//! names). A filesystem without `flock` support leaves the pool unprotected, with a warning:
//! refusing to start there would refuse pools that worked before. On NFS the lock is the
//! server's, and a crashed client's lasts until the server's lease on it expires.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use crate::error::{DpmError, Result};

/// Held while a process serves a pool; dropping it (or exiting) releases the pool.
#[derive(Debug)]
pub struct PoolLock {
    /// `None`: the filesystem does not support locks (warned at acquire).
    _file: Option<File>,
    path: PathBuf,
}

/// `pool` with symbolic links resolved (the pool's directory's, when the pool does not exist
/// yet): two names of one pool through a link take one lock. As given when it cannot be
/// resolved (the open that follows says why).
fn resolved(pool: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(pool) {
        return p;
    }
    match (pool.parent(), pool.file_name()) {
        (Some(dir), Some(name)) => {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            std::fs::canonicalize(dir).map_or_else(|_| pool.to_path_buf(), |d| d.join(name))
        }
        _ => pool.to_path_buf(),
    }
}

/// The lock file of a file pool: `<pool>.lock`.
pub fn lock_path(pool: &Path) -> PathBuf {
    let mut p = pool.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

impl PoolLock {
    /// Takes the lock of `pool` (a file, which need not exist yet, or a device-DAX device),
    /// or says which process holds it.
    pub fn acquire(pool: &Path) -> Result<PoolLock> {
        let device = std::fs::metadata(pool)
            .map(|m| m.file_type().is_char_device())
            .unwrap_or(false);
        let path = if device {
            pool.to_path_buf()
        } else {
            lock_path(&resolved(pool))
        };
        let opened = if device {
            File::open(&path)
        } else {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
            {
                // Another user's lock file (a node run as root before): flock needs no write
                // access; only the pid hint is lost.
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => File::open(&path),
                r => r,
            }
        };
        let mut file = opened.map_err(|e| DpmError::BadPool {
            path: pool.display().to_string(),
            detail: format!("cannot open its lock {}: {e}", path.display()),
        })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let holder = if device {
                    None
                } else {
                    std::fs::read_to_string(&path)
                        .ok()
                        .and_then(|s| s.trim().parse::<u32>().ok())
                };
                return Err(DpmError::PoolInUse {
                    pool: pool.display().to_string(),
                    lock: path.display().to_string(),
                    holder: holder.map_or(String::new(), |pid| format!(" (pid {pid})")),
                });
            }
            Err(TryLockError::Error(e)) => {
                tracing::warn!(pool = %pool.display(), lock = %path.display(), error = %e, "cannot lock the pool (the filesystem does not support flock?): nothing stops a second dpm-node from serving it too");
                return Ok(PoolLock { _file: None, path });
            }
        }
        if !device {
            // The holder's pid, for the error a second process prints. A failure to write it
            // loses only that hint.
            let pid = std::process::id();
            let written = file.set_len(0).and_then(|()| {
                use std::io::Seek;
                file.seek(std::io::SeekFrom::Start(0))?;
                writeln!(file, "{pid}")
            });
            if let Err(e) = written {
                tracing::debug!(lock = %path.display(), error = %e, "cannot write the pid into the pool's lock file");
            }
        }
        Ok(PoolLock {
            _file: Some(file),
            path,
        })
    }

    /// The file the lock is taken on.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second lock of the same pool is refused while the first is held, names the lock and
    /// the holder's pid, and is granted once the first is dropped. (`flock` locks belong to
    /// open files, so two in one process conflict as two processes do.)
    #[test]
    fn a_held_pool_is_refused_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let first = PoolLock::acquire(&pool).unwrap();
        assert_eq!(first.path(), lock_path(&pool));
        let err = PoolLock::acquire(&pool).unwrap_err().to_string();
        assert!(err.contains("in use"), "{err}");
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        assert!(
            err.contains(&lock_path(&pool).display().to_string()),
            "{err}"
        );
        drop(first);
        PoolLock::acquire(&pool).unwrap();
    }

    /// A symbolic link to a served pool finds the same lock.
    #[test]
    fn a_link_to_a_held_pool_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        std::fs::write(&pool, b"x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&pool, &link).unwrap();
        let _held = PoolLock::acquire(&pool).unwrap();
        let err = PoolLock::acquire(&link).unwrap_err().to_string();
        assert!(err.contains("in use"), "{err}");
    }

    /// Another pool in the same directory is not locked by this one's lock.
    #[test]
    fn pools_are_locked_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let _a = PoolLock::acquire(&dir.path().join("a")).unwrap();
        PoolLock::acquire(&dir.path().join("b")).unwrap();
    }
}
