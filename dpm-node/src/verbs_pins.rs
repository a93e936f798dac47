//! What a verbs NIC pins to serve this node's pool, and whether this process may pin it.
//!
//! Per verbs connection the NIC registers (fabric/src/verbs/windows.rs) the whole pool for
//! READ, and the write window of the connection's key: the indirect-cell space (CAS) and the
//! open log segment of every shard of the KN (a KN's connections share its key, so each holds
//! all of them). A KN opens one connection per shard and one more for its session's health
//! checks (kv-node/src/dpm_link.rs, session.rs). The kernel charges every registration on its
//! own against `RLIMIT_MEMLOCK` unless the process has `CAP_IPC_LOCK`
//! ([`dinomo_fabric::pinning`]), so a KN of S shards costs (S + 1) x (pool + cells + S
//! segments), each range rounded out to whole pages.
//!
//! Not counted: a segment whose seal failed and waits for a retry stays in the window a little
//! longer, and a KN reconnecting after a transport error may briefly hold two connections'
//! registrations. The capacity logged is therefore an upper bound.

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

    /// A range of `bytes` that need not start on a page boundary spans this much.
    fn pages(&self, bytes: u64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        bytes.div_ceil(self.page) * self.page + self.page
    }

    /// What one connection of a KN with `shards` shards pins.
    pub fn per_connection(&self, shards: u64) -> u64 {
        self.pool + self.pages(self.cells) + shards * self.pages(self.segment)
    }

    /// What a KN with `shards` shards pins (a connection per shard, and one more).
    pub fn per_kn(&self, shards: u64) -> u64 {
        (shards + 1) * self.per_connection(shards)
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
        return Err(format!(
            "serving a pool of {} bytes over verbs pins it again for every KN connection (a \
             KN opens one per shard and one more): a KN of one shard pins {} bytes, of {} \
             shards {} bytes, but this process may pin only {budget}; run it as uid 0 with \
             CAP_IPC_LOCK (containers: --user 0 --cap-add IPC_LOCK; the Helm chart's \
             rdma.ipcLock, on by default) or raise the limit (ulimit -l unlimited, or \
             LimitMEMLOCK=infinity in a systemd unit)",
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

/// [`capacity`] for this process and the pool `sb` describes.
pub fn check_this_process(sb: &Superblock) -> Result<Option<Capacity>> {
    let budget = PinBudget::of_this_process()
        .map_err(|e| DpmError::Config(format!("cannot read this process's memlock limit: {e}")))?;
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    };
    capacity(budget, &PinNeed::of(sb, page)).map_err(DpmError::Config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dinomo_fabric::pinning::Unlimited;

    const MIB: u64 = 1 << 20;

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
        assert_eq!(n.per_kn(1), 2 * n.per_connection(1));
        assert_eq!(n.per_kn(2), 3 * n.per_connection(2));
    }

    #[test]
    fn a_budget_below_one_kn_of_one_shard_is_refused_with_both_ways_out() {
        let n = need();
        let e = capacity(PinBudget::Bytes(n.per_kn(1) - 1), &n).unwrap_err();
        for part in [
            "67108864 bytes",
            "(RLIMIT_MEMLOCK, no CAP_IPC_LOCK)",
            "CAP_IPC_LOCK",
            "ulimit -l unlimited",
            "one per shard and one more",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
    }

    #[test]
    fn a_finite_budget_counts_kns_of_one_and_of_the_default_shards() {
        let n = need();
        assert_eq!(
            capacity(PinBudget::Bytes(n.per_kn(1)), &n),
            Ok(Some(Capacity {
                default_kns: 0,
                one_shard_kns: 1
            }))
        );
        assert_eq!(
            capacity(PinBudget::Bytes(2 * n.per_kn(2)), &n),
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
