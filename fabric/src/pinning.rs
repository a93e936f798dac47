//! How much memory this process may pin for RDMA.
//!
//! The kernel charges the pages of every RDMA memory registration to the registering process
//! (`ib_umem_get`: `mm->pinned_vm`, each registration on its own, the same pages again) and
//! refuses one that would take the total above the soft `RLIMIT_MEMLOCK`, unless the process
//! is `capable(CAP_IPC_LOCK)`: the capability in the *initial* user namespace. A process in
//! another user namespace (a rootless container, a pod with `hostUsers: false`) may show
//! `CAP_IPC_LOCK` in its own set and still be charged.
//!
//! Nothing here needs an RDMA device: it reads `/proc/thread-self/status`, the inode of
//! `/proc/self/ns/user` and `getrlimit`, so what a node decides from it is tested on every machine. What a verbs memory
//! node pins per connection is the node's business (dpm-node's `verbs_pins`).

use std::fmt;

/// `CAP_IPC_LOCK`'s bit in the capability sets of `/proc/<pid>/status` (linux/capability.h).
const CAP_IPC_LOCK: u32 = 14;
/// The inode of the initial user namespace's `/proc/<pid>/ns/user` (`PROC_USER_INIT_INO`,
/// include/linux/proc_ns.h): the only namespace whose capabilities the kernel's pinning check
/// (`capable()`) honours. A uid map alone cannot tell: a namespace made by a privileged parent
/// may map every uid too.
const INIT_USER_NS_INO: u64 = 0xEFFF_FFFD;

/// How much memory this process may pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinBudget {
    /// No limit applies, and why.
    Unlimited(Unlimited),
    /// At most `limit` bytes (the soft `RLIMIT_MEMLOCK`), all registrations together.
    /// `namespaced_ipc_lock`: the process holds `CAP_IPC_LOCK`, but only in a user namespace
    /// other than the initial one (a rootless container), where the kernel ignores it.
    Bytes {
        limit: u64,
        namespaced_ipc_lock: bool,
    },
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
            PinBudget::Bytes {
                limit,
                namespaced_ipc_lock: false,
            } => write!(f, "{limit} bytes (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)"),
            PinBudget::Bytes {
                limit,
                namespaced_ipc_lock: true,
            } => write!(
                f,
                "{limit} bytes (RLIMIT_MEMLOCK; its CAP_IPC_LOCK is a user namespace's, which \
                 RDMA pinning ignores: run it in the host's user namespace, or raise the hard \
                 limit from outside)"
            ),
        }
    }
}

impl PinBudget {
    /// This process's budget, after raising its soft `RLIMIT_MEMLOCK` to the hard one (which
    /// any process may do): the most it can pin without help from outside.
    pub fn of_this_process() -> std::io::Result<PinBudget> {
        // The calling thread's view: capabilities are per thread.
        let status = std::fs::read_to_string("/proc/thread-self/status")?;
        // No namespace file means a kernel without user namespaces: the initial one.
        let initial_ns = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata("/proc/self/ns/user").map_or(true, |m| m.ino() == INIT_USER_NS_INO)
        };
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
        Ok(Self::from_parts(has_ipc_lock(&status)?, initial_ns, soft))
    }

    /// The budget of a process with (or without) `CAP_IPC_LOCK`, in the initial user namespace
    /// or another, and a soft `RLIMIT_MEMLOCK` of `soft_limit` bytes (`None`: unlimited).
    pub fn from_parts(ipc_lock: bool, initial_ns: bool, soft_limit: Option<u64>) -> PinBudget {
        match (ipc_lock && initial_ns, soft_limit) {
            (true, _) => PinBudget::Unlimited(Unlimited::IpcLock),
            (false, None) => PinBudget::Unlimited(Unlimited::Rlimit),
            (false, Some(limit)) => PinBudget::Bytes {
                limit,
                namespaced_ipc_lock: ipc_lock,
            },
        }
    }

    /// How many times `bytes` fit the budget; `None`: without limit.
    pub fn fits(&self, bytes: u64) -> Option<u64> {
        match self {
            PinBudget::Unlimited(_) => None,
            PinBudget::Bytes { limit, .. } => Some(limit / bytes.max(1)),
        }
    }
}

/// Whether the effective capability set in a `/proc/<pid>/status` text holds `CAP_IPC_LOCK`.
fn has_ipc_lock(status: &str) -> std::io::Result<bool> {
    let bad = |why: &str| std::io::Error::other(format!("/proc/thread-self/status: {why}"));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(limit: u64) -> PinBudget {
        PinBudget::Bytes {
            limit,
            namespaced_ipc_lock: false,
        }
    }

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
    fn the_capability_wins_over_any_limit() {
        assert_eq!(
            PinBudget::from_parts(true, true, Some(64 * 1024)),
            PinBudget::Unlimited(Unlimited::IpcLock)
        );
        assert_eq!(
            PinBudget::from_parts(false, true, None),
            PinBudget::Unlimited(Unlimited::Rlimit)
        );
        assert_eq!(PinBudget::from_parts(false, true, Some(8)), bytes(8));
    }

    #[test]
    fn a_user_namespaces_capability_does_not_count_and_the_message_says_so() {
        let b = PinBudget::from_parts(true, false, Some(8));
        assert_eq!(
            b,
            PinBudget::Bytes {
                limit: 8,
                namespaced_ipc_lock: true
            }
        );
        assert!(b.to_string().contains("user namespace"), "{b}");
        assert_eq!(
            PinBudget::from_parts(true, false, None),
            PinBudget::Unlimited(Unlimited::Rlimit)
        );
    }

    #[test]
    fn a_finite_budget_fits_whole_multiples_only() {
        assert_eq!(bytes(3 * 100 + 99).fits(100), Some(3));
        assert_eq!(bytes(99).fits(100), Some(0));
        assert_eq!(PinBudget::Unlimited(Unlimited::Rlimit).fits(100), None);
        assert_eq!(
            bytes(8388608).to_string(),
            "8388608 bytes (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)"
        );
    }
}
