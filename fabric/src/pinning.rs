//! How much memory this process may pin for RDMA, and whether that is enough to serve a pool
//! over verbs.
//!
//! The kernel charges the pages of every RDMA memory registration to the registering process
//! and refuses a registration that would take the total above `RLIMIT_MEMLOCK`, unless the
//! process has `CAP_IPC_LOCK` (in its effective set). Each registration is charged on its
//! own, the same pages again: the verbs NIC registers the whole pool for READ on every KN
//! connection, plus that connection's write-window ranges (its open log segments), so a
//! memory node serving `n` KNs is charged about `n` times its pool.
//!
//! Nothing here needs an RDMA device: it reads `/proc/self/status` and `getrlimit`, so the
//! decision is tested on every machine and the node refuses a start that would fail later,
//! at a KN's registration or at a failover, with the reason.

use std::fmt;

/// `CAP_IPC_LOCK`'s bit in the capability sets of `/proc/<pid>/status` (linux/capability.h).
const CAP_IPC_LOCK: u32 = 14;

/// How much memory this process may pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinBudget {
    /// No limit applies, and why.
    Unlimited(Unlimited),
    /// At most this many bytes (the soft `RLIMIT_MEMLOCK`), all registrations together.
    Bytes(u64),
}

/// Why a process may pin without limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unlimited {
    /// It has `CAP_IPC_LOCK`.
    IpcLock,
    /// Its `RLIMIT_MEMLOCK` is unlimited.
    Rlimit,
}

impl fmt::Display for PinBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinBudget::Unlimited(Unlimited::IpcLock) => write!(f, "unlimited (CAP_IPC_LOCK)"),
            PinBudget::Unlimited(Unlimited::Rlimit) => {
                write!(f, "unlimited (RLIMIT_MEMLOCK unlimited)")
            }
            PinBudget::Bytes(n) => write!(f, "{n} bytes (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)"),
        }
    }
}

impl PinBudget {
    /// This process's budget now.
    pub fn of_this_process() -> std::io::Result<PinBudget> {
        let status = std::fs::read_to_string("/proc/self/status")?;
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit through a valid pointer.
        if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let soft = (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur);
        Ok(Self::from_parts(has_ipc_lock(&status)?, soft))
    }

    /// The budget of a process with (or without) `CAP_IPC_LOCK` and a soft `RLIMIT_MEMLOCK`
    /// of `soft_limit` bytes (`None`: unlimited).
    pub fn from_parts(ipc_lock: bool, soft_limit: Option<u64>) -> PinBudget {
        match (ipc_lock, soft_limit) {
            (true, _) => PinBudget::Unlimited(Unlimited::IpcLock),
            (false, None) => PinBudget::Unlimited(Unlimited::Rlimit),
            (false, Some(n)) => PinBudget::Bytes(n),
        }
    }

    /// How many connections this budget lets a verbs NIC serve when each pins
    /// `per_connection` bytes; `None`: no limit.
    pub fn connections(&self, per_connection: u64) -> Option<u64> {
        match self {
            PinBudget::Unlimited(_) => None,
            PinBudget::Bytes(n) => Some(n / per_connection.max(1)),
        }
    }

    /// Whether a verbs NIC may serve a pool of `pool_bytes` when each connection pins
    /// `per_connection` bytes (the pool and its write windows): the number of connections
    /// it can serve (`None`: no limit), or why none (the error names both ways out).
    pub fn check_verbs_pool(
        &self,
        pool_bytes: u64,
        per_connection: u64,
    ) -> Result<Option<u64>, String> {
        match self.connections(per_connection) {
            Some(0) => Err(format!(
                "serving a pool of {pool_bytes} bytes over verbs pins it (again for every KN \
                 connection, {per_connection} bytes each with its open segments), but this \
                 process may pin only {self}; run it as uid 0 with CAP_IPC_LOCK (containers: \
                 --user 0 --cap-add IPC_LOCK; the Helm chart does this) or raise the limit \
                 (ulimit -l unlimited, or LimitMEMLOCK=infinity in a systemd unit)"
            )),
            n => Ok(n),
        }
    }
}

/// Whether the effective capability set in a `/proc/<pid>/status` text holds `CAP_IPC_LOCK`.
fn has_ipc_lock(status: &str) -> std::io::Result<bool> {
    let bad = |why: &str| std::io::Error::other(format!("/proc/self/status: {why}"));
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .ok_or_else(|| bad("no CapEff line"))?;
    let set = u64::from_str_radix(hex.trim(), 16).map_err(|_| bad("CapEff is not hexadecimal"))?;
    Ok(set & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn cap_eff_is_read_from_the_status_text() {
        let with = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        let without = "CapEff:\t000001ffffffbfff\nCapBnd:\t000001ffffffffff\n";
        assert!(has_ipc_lock(with).unwrap());
        assert!(!has_ipc_lock(without).unwrap());
        assert!(has_ipc_lock("CapEff:\t0000000000004000\n").unwrap());
        assert!(has_ipc_lock("Name:\tx\n").is_err());
        assert!(has_ipc_lock("CapEff:\tzz\n").is_err());
    }

    #[test]
    fn the_capability_wins_over_any_limit() {
        assert_eq!(
            PinBudget::from_parts(true, Some(64 * 1024)),
            PinBudget::Unlimited(Unlimited::IpcLock)
        );
        assert_eq!(
            PinBudget::from_parts(false, None),
            PinBudget::Unlimited(Unlimited::Rlimit)
        );
        assert_eq!(PinBudget::from_parts(false, Some(8)), PinBudget::Bytes(8));
    }

    #[test]
    fn a_limit_below_one_connection_is_refused_with_both_ways_out() {
        let budget = PinBudget::Bytes(8 * MIB);
        let e = budget
            .check_verbs_pool(64 * MIB, 64 * MIB + MIB)
            .unwrap_err();
        for part in [
            "67108864 bytes",
            "8388608 bytes (RLIMIT_MEMLOCK",
            "CAP_IPC_LOCK",
            "ulimit -l",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
    }

    #[test]
    fn a_finite_limit_serves_as_many_connections_as_it_holds() {
        let per = 64 * MIB + MIB;
        assert_eq!(
            PinBudget::Bytes(3 * per + 1).check_verbs_pool(64 * MIB, per),
            Ok(Some(3))
        );
        assert_eq!(
            PinBudget::Bytes(per).check_verbs_pool(64 * MIB, per),
            Ok(Some(1))
        );
        assert_eq!(
            PinBudget::Unlimited(Unlimited::IpcLock).check_verbs_pool(64 * MIB, per),
            Ok(None)
        );
    }
}
