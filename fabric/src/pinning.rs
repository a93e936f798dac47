//! How much memory this process may pin for RDMA.
//!
//! The kernel charges the pages of every RDMA memory registration to the registering process
//! (`ib_umem_get`: `mm->pinned_vm`, each registration on its own, the same pages again) and
//! refuses one that would take the total above the soft `RLIMIT_MEMLOCK`, unless the process
//! is `capable(CAP_IPC_LOCK)`: the capability in the *initial* user namespace. A process in
//! another user namespace (a rootless container, a pod with `hostUsers: false`) may show
//! `CAP_IPC_LOCK` in its own set and still be charged.
//!
//! Nothing here needs an RDMA device: it reads `/proc/self/status`, `/proc/self/uid_map` and
//! `getrlimit`, so what a node decides from it is tested on every machine. What a verbs memory
//! node pins per connection is the node's business (dpm-node's `verbs_pins`).

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
    /// It has `CAP_IPC_LOCK` in the initial user namespace.
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
    /// This process's budget, after raising its soft `RLIMIT_MEMLOCK` to the hard one (which
    /// any process may do): the most it can pin without help from outside.
    pub fn of_this_process() -> std::io::Result<PinBudget> {
        let status = std::fs::read_to_string("/proc/self/status")?;
        // A missing uid_map means a kernel without user namespaces: the initial one.
        let initial_ns =
            std::fs::read_to_string("/proc/self/uid_map").map_or(true, |m| is_initial_user_ns(&m));
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit read and write one rlimit through valid pointers.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if limit.rlim_cur != limit.rlim_max {
                let raised = libc::rlimit {
                    rlim_cur: limit.rlim_max,
                    ..limit
                };
                if libc::setrlimit(libc::RLIMIT_MEMLOCK, &raised) == 0 {
                    limit = raised;
                }
            }
        }
        let soft = (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur);
        Ok(Self::from_parts(initial_ns && has_ipc_lock(&status)?, soft))
    }

    /// The budget of a process with (or without) `CAP_IPC_LOCK` in the initial user namespace
    /// and a soft `RLIMIT_MEMLOCK` of `soft_limit` bytes (`None`: unlimited).
    pub fn from_parts(ipc_lock: bool, soft_limit: Option<u64>) -> PinBudget {
        match (ipc_lock, soft_limit) {
            (true, _) => PinBudget::Unlimited(Unlimited::IpcLock),
            (false, None) => PinBudget::Unlimited(Unlimited::Rlimit),
            (false, Some(n)) => PinBudget::Bytes(n),
        }
    }

    /// How many times `bytes` fit the budget; `None`: without limit.
    pub fn fits(&self, bytes: u64) -> Option<u64> {
        match self {
            PinBudget::Unlimited(_) => None,
            PinBudget::Bytes(n) => Some(n / bytes.max(1)),
        }
    }
}

/// Whether the effective capability set in a `/proc/<pid>/status` text holds `CAP_IPC_LOCK`.
fn has_ipc_lock(status: &str) -> std::io::Result<bool> {
    let bad = |why: &str| std::io::Error::other(format!("/proc/self/status: {why}"));
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .ok_or_else(|| bad("no CapEff line"))?
        .trim();
    // The low 64 capabilities are the last 16 digits, however many the kernel prints.
    let low = &hex[hex.len().saturating_sub(16)..];
    let set = u64::from_str_radix(low, 16).map_err(|_| bad("CapEff is not hexadecimal"))?;
    Ok(set & (1 << CAP_IPC_LOCK) != 0)
}

/// Whether a `/proc/<pid>/uid_map` text is the initial user namespace's (the identity map of
/// every uid), the only one whose capabilities the kernel's pinning check honours.
fn is_initial_user_ns(uid_map: &str) -> bool {
    uid_map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_eff_is_read_from_the_status_text() {
        let with = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        let without = "CapEff:\t000001ffffffbfff\nCapBnd:\t000001ffffffffff\n";
        assert!(has_ipc_lock(with).unwrap());
        assert!(!has_ipc_lock(without).unwrap());
        assert!(has_ipc_lock("CapEff:\t0000000000004000\n").unwrap());
        // A kernel with more than 64 capabilities prints more digits.
        assert!(has_ipc_lock("CapEff:\t10000000000004000\n").unwrap());
        assert!(has_ipc_lock("Name:\tx\n").is_err());
        assert!(has_ipc_lock("CapEff:\tzz\n").is_err());
    }

    #[test]
    fn only_the_initial_user_namespace_counts() {
        assert!(is_initial_user_ns("         0          0 4294967295\n"));
        // Rootless containers: root inside is some unprivileged uid outside.
        assert!(!is_initial_user_ns("         0     100000      65536\n"));
        assert!(!is_initial_user_ns("         0       1000          1\n"));
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
    fn a_finite_budget_fits_whole_multiples_only() {
        assert_eq!(PinBudget::Bytes(3 * 100 + 99).fits(100), Some(3));
        assert_eq!(PinBudget::Bytes(99).fits(100), Some(0));
        assert_eq!(PinBudget::Unlimited(Unlimited::Rlimit).fits(100), None);
        assert_eq!(
            PinBudget::Bytes(8388608).to_string(),
            "8388608 bytes (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)"
        );
    }
}
