//! What a verbs NIC pins to serve this node's pool, and whether this process may pin it.
//!
//! Per verbs connection the NIC registers (fabric/src/verbs/windows.rs) the whole pool for
//! READ and, once the caller asks for it (its first WRITE or CAS), the write window of the
//! connection's key: the indirect-cell space (CAS) and the open log segment of every shard of
//! the KN (a KN's connections share its key, so each holds all of them). A KN opens one
//! connection per shard and one more for its session's health checks, which only READs
//! (kv-node/src/dpm_link.rs, session.rs). The kernel charges every registration on its own
//! against `RLIMIT_MEMLOCK` unless the process has `CAP_IPC_LOCK`
//! ([`dinomo_fabric::pinning`]), so a KN of S shards costs S x (pool + cells + S segments) +
//! pool, each range rounded out to whole pages.
//!
//! Not counted: a segment whose seal failed and waits for a retry stays in the window a little
//! longer, a KN reconnecting after a transport error may briefly hold two connections'
//! registrations, and a hardware NIC's driver may pin each connection's queue buffers too
//! (rxe's are kernel memory). The capacity this gives is an estimate, not a guarantee.

use dinomo_fabric::pinning::PinBudget;
use dinomo_layout::index::{IndexArea, CELL_SIZE};
use dinomo_layout::superblock::Superblock;

use crate::error::{DpmError, Result};

/// A KN's shards unless configured otherwise (kv-node's `shards` default).
pub const DEFAULT_KN_SHARDS: u64 = 2;

/// The registrations one KN's verbs connections make on a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinNeed {
    pool: u64,
    cells: u64,
    segment: u64,
    page: u64,
}

impl PinNeed {
    /// The need of the pool `sb` describes, on pages of `page` bytes.
    pub fn of(sb: &Superblock, page: u64) -> Self {
        PinNeed {
            pool: sb.pool_len,
            cells: IndexArea::of(sb).cells * CELL_SIZE,
            segment: sb.segment_size,
            page,
        }
    }

    /// A range of `bytes`: the pool starts on a page (it is mapped whole), a range inside it
    /// may not, and then spans one page more.
    fn pages(&self, bytes: u64) -> u64 {
        let whole = bytes.div_ceil(self.page) * self.page;
        if bytes == 0 || bytes == self.pool {
            whole
        } else {
            whole + self.page
        }
    }

    /// What one writing connection of a KN with `shards` shards pins.
    pub fn per_connection(&self, shards: u64) -> u64 {
        self.pages(self.pool) + self.pages(self.cells) + shards * self.pages(self.segment)
    }

    /// What a KN with `shards` shards pins (a connection per shard, and one more that only
    /// READs).
    pub fn per_kn(&self, shards: u64) -> u64 {
        shards * self.per_connection(shards) + self.pages(self.pool)
    }
}

/// How many KNs a finite pin budget lets the NIC serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// KNs of [`DEFAULT_KN_SHARDS`] shards.
    pub default_kns: u64,
    /// KNs of one shard.
    pub one_shard_kns: u64,
}

/// What `budget` allows for `need`: `Ok(None)` without limit, the capacity when finite, or
/// why not even a KN of one shard could register (naming both ways out).
pub fn capacity(
    budget: PinBudget,
    need: &PinNeed,
) -> std::result::Result<Option<Capacity>, String> {
    let (Some(default_kns), Some(one_shard_kns)) = (
        budget.fits(need.per_kn(DEFAULT_KN_SHARDS)),
        budget.fits(need.per_kn(1)),
    ) else {
        return Ok(None);
    };
    if one_shard_kns == 0 {
        // A capability held in a user namespace is the budget's own story (it says what to
        // do); the usual ways out would not help there.
        let ways_out = match budget {
            PinBudget::Bytes {
                namespaced_ipc_lock: true,
                ..
            } => "",
            _ => {
                "; run it as uid 0 with CAP_IPC_LOCK (containers: --user 0 --cap-add IPC_LOCK; \
                 the Helm chart's rdma.ipcLock, on by default) or raise the limit (ulimit -l \
                 unlimited, or LimitMEMLOCK=infinity in a systemd unit)"
            }
        };
        return Err(format!(
            "serving a pool of {} bytes over verbs pins it again for every KN connection (a \
             KN opens one per shard and one more): a KN of one shard pins {} bytes, of {} \
             shards {} bytes, but this process may pin only {budget}{ways_out}",
            need.pool,
            need.per_kn(1),
            DEFAULT_KN_SHARDS,
            need.per_kn(DEFAULT_KN_SHARDS),
        ));
    }
    Ok(Some(Capacity {
        default_kns,
        one_shard_kns,
    }))
}

/// [`capacity`] for this process and the pool `sb` describes (`Ok(None)` too when the budget
/// cannot be read: the registrations then say what they find).
pub fn check_this_process(sb: &Superblock) -> Result<Option<Capacity>> {
    let budget = match PinBudget::of_this_process() {
        Ok(b) => b,
        Err(e) => {
            // Once: a backup's status asks on every call.
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| tracing::warn!(error = %e, "cannot read this process's memlock limit; not checking what it may pin for RDMA"));
            return Ok(None);
        }
    };
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    };
    capacity(budget, &PinNeed::of(sb, page)).map_err(DpmError::Config)
}

/// Logs what [`check_this_process`] found, as a warning when it limits the KNs served:
/// `what` says whose budget it is ("this process", "once promoted, this backup").
pub fn log_capacity(what: &str, capacity: Option<Capacity>) {
    match capacity {
        None => tracing::info!("checked: {what} may pin the pool for every KN connection"),
        Some(c) => tracing::warn!(
            kns_of_default_shards = c.default_kns,
            kns_of_one_shard = c.one_shard_kns,
            "{what} may pin the pool for about {} KNs of {} shards ({} of one shard): every \
             KN connection pins it again, and a KN beyond that cannot register; give the \
             process CAP_IPC_LOCK or ulimit -l unlimited",
            c.default_kns,
            DEFAULT_KN_SHARDS,
            c.one_shard_kns
        ),
    }
}

/// [`check_this_process`] for the pool in the file (or device) `pool`, read from its
/// superblock: `Err` says why a verbs NIC of this process could not serve it for even one KN.
pub fn check_pool(pool: &std::path::Path) -> std::result::Result<Option<Capacity>, String> {
    use dinomo_layout::superblock::SUPERBLOCK_SIZE;
    use std::io::Read;
    let mut head = vec![0u8; SUPERBLOCK_SIZE as usize];
    std::fs::File::open(pool)
        .and_then(|mut f| f.read_exact(&mut head))
        .map_err(|e| format!("its pool {} cannot be read: {e}", pool.display()))?;
    let sb = Superblock::decode(&head)
        .map_err(|e| format!("its pool {} holds no superblock: {e}", pool.display()))?;
    check_this_process(&sb).map_err(|e| e.to_string())
}

/// [`check_pool`], logging the capacity as `what` ([`log_capacity`]) when it serves some.
pub fn refusal_for_pool(pool: &std::path::Path, what: &str) -> Option<String> {
    match check_pool(pool) {
        Err(why) => Some(why),
        Ok(c) => {
            log_capacity(what, c);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dinomo_fabric::pinning::Unlimited;

    const MIB: u64 = 1 << 20;

    fn bytes(limit: u64) -> PinBudget {
        PinBudget::Bytes {
            limit,
            namespaced_ipc_lock: false,
        }
    }

    /// The VM test's pool: 64 MiB, 128 KiB segments, 4096 cells (256 KiB).
    fn need() -> PinNeed {
        let sb = Superblock::plan(64 * MIB, 128 << 10, MIB, 4096).unwrap();
        PinNeed::of(&sb, 4096)
    }

    #[test]
    fn a_connection_pins_the_pool_the_cells_and_every_open_segment_of_its_kn() {
        let n = need();
        let cells = (256 << 10) + 4096;
        let segment = (128 << 10) + 4096;
        assert_eq!(n.per_connection(1), 64 * MIB + cells + segment);
        assert_eq!(n.per_connection(2), 64 * MIB + cells + 2 * segment);
        // The session's connection only READs: the pool alone.
        assert_eq!(n.per_kn(1), n.per_connection(1) + 64 * MIB);
        assert_eq!(n.per_kn(2), 2 * n.per_connection(2) + 64 * MIB);
    }

    #[test]
    fn a_budget_below_one_kn_of_one_shard_is_refused_with_both_ways_out() {
        let n = need();
        let e = capacity(bytes(n.per_kn(1) - 1), &n).unwrap_err();
        for part in [
            "67108864 bytes",
            "(RLIMIT_MEMLOCK, no CAP_IPC_LOCK)",
            "--cap-add IPC_LOCK",
            "ulimit -l unlimited",
            "one per shard and one more",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        // A capability held in a user namespace: only the way out that works there.
        let namespaced = PinBudget::Bytes {
            limit: n.per_kn(1) - 1,
            namespaced_ipc_lock: true,
        };
        let e = capacity(namespaced, &n).unwrap_err();
        assert!(e.contains("host's user namespace"), "{e}");
        assert!(!e.contains("--cap-add"), "{e}");
    }

    #[test]
    fn a_finite_budget_counts_kns_of_one_and_of_the_default_shards() {
        let n = need();
        assert_eq!(
            capacity(bytes(n.per_kn(1)), &n),
            Ok(Some(Capacity {
                default_kns: 0,
                one_shard_kns: 1
            }))
        );
        assert_eq!(
            capacity(bytes(2 * n.per_kn(2)), &n),
            Ok(Some(Capacity {
                default_kns: 2,
                one_shard_kns: 2 * n.per_kn(2) / n.per_kn(1)
            }))
        );
        assert_eq!(
            capacity(PinBudget::Unlimited(Unlimited::IpcLock), &n),
            Ok(None)
        );
    }
}
