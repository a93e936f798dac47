//! Fenced KN processes that may still write into the pool's memory (shm fabric only).
//!
//! On the shm fabric a KN maps the pool file and copies its batches in itself; fencing can
//! refuse its epoch and revoke its grant, but cannot take the mapping away. A KN stopped in the
//! middle of a copy (SIGSTOP, a long page fault, a descheduled thread) finishes that copy when
//! it runs again, whatever the segment has become meanwhile; the KN then sees its grant revoked
//! and reports the batch as outcome-unknown, but the bytes have landed. That is harmless while
//! the segment still belongs to the fenced KN (they lie past its sealed end, or are a batch no
//! one acknowledged), and destroys acknowledged data once the segment is reused by another KN.
//!
//! So a segment of a KN that has a fenced process that may still run is neither cleaned nor
//! freed (see [`crate::gc`]) until that process is gone. A process is named by its pid and its
//! start time (field 22 of `/proc/<pid>/stat`), so a reused pid is not mistaken for it; a
//! zombie (state Z) counts as gone, as it runs no code. The same process registering again
//! ends the hold: it re-registers only after noticing it was fenced, and any copy it had in
//! flight finishes within microseconds of the process running again, long before the
//! registration round trip does.
//!
//! The holds outlive a dpm-node restart: the node records each shm KN process that registers
//! in its metadata (`dpm/kn-proc/<kn>/<pid>.<start>`). A restart revokes every grant, so at
//! open each recorded process still running is watched as fenced, and the others forgotten.
//!
//! Invariant: a process is watched only if the dpm-node could see it in its own `/proc` when
//! the KN registered (same host and pid namespace, which shm needs anyway for one pool file;
//! otherwise the registration logs that it cannot watch the KN).

use std::collections::BTreeMap;

use parking_lot::Mutex;

/// One process, as this host's `/proc` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessRef {
    pub pid: u32,
    /// Clock ticks after boot at which it started.
    start: u64,
}

/// Fields of `/proc/<pid>/stat` after the command name: (state, start time).
fn stat_of(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ...: comm may hold spaces and parentheses, so parse after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    Some((f.first()?.chars().next()?, f.get(19)?.parse().ok()?))
}

impl ProcessRef {
    /// The running process `pid`, if this host's `/proc` shows one.
    pub fn of(pid: u32) -> Option<ProcessRef> {
        match stat_of(pid)? {
            ('Z' | 'X', _) => None,
            (_, start) => Some(ProcessRef { pid, start }),
        }
    }

    /// `pid.start`, as [`ProcessRef::decode`] reads it (for the dpm-node's metadata).
    pub fn encode(&self) -> String {
        format!("{}.{}", self.pid, self.start)
    }

    pub fn decode(s: &str) -> Option<ProcessRef> {
        let (pid, start) = s.split_once('.')?;
        Some(ProcessRef {
            pid: pid.parse().ok()?,
            start: start.parse().ok()?,
        })
    }

    /// Whether this very process (not a later one with its pid) may still run code.
    pub fn alive(&self) -> bool {
        ProcessRef::of(self.pid) == Some(*self)
    }
}

/// Fenced KN processes that may still write, by KN id.
#[derive(Debug, Default)]
pub struct FencedProcs {
    by_kn: Mutex<BTreeMap<u32, Vec<ProcessRef>>>,
}

impl FencedProcs {
    /// `p`, a process of KN `kn`, was fenced while it may still run.
    pub fn watch(&self, kn: u32, p: ProcessRef) {
        let mut m = self.by_kn.lock();
        let v = m.entry(kn).or_default();
        if !v.contains(&p) {
            tracing::info!(
                kn,
                pid = p.pid,
                "fenced KN process still runs: its segments are not reused until it exits"
            );
            v.push(p);
        }
    }

    /// `p` registered again as KN `kn`: it knows it was fenced, so its holds end.
    pub fn registered(&self, kn: u32, p: ProcessRef) {
        let mut m = self.by_kn.lock();
        if let Some(v) = m.get_mut(&kn) {
            v.retain(|q| *q != p);
            if v.is_empty() {
                m.remove(&kn);
            }
        }
    }

    /// Whether KN `kn`'s segments must not be reused now (a fenced process of it may still
    /// write). Forgets the processes that have exited.
    pub fn holds(&self, kn: u32) -> bool {
        let mut m = self.by_kn.lock();
        let Some(v) = m.get_mut(&kn) else {
            return false;
        };
        v.retain(|p| {
            let alive = p.alive();
            if !alive {
                tracing::info!(
                    kn,
                    pid = p.pid,
                    "fenced KN process exited: its segments may be reused"
                );
            }
            alive
        });
        if v.is_empty() {
            m.remove(&kn);
            false
        } else {
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_held_while_it_runs_and_released_when_it_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let p = ProcessRef::of(child.id()).expect("a running child is visible");
        let f = FencedProcs::default();
        assert!(!f.holds(3));
        f.watch(3, p);
        assert!(f.holds(3));
        assert!(!f.holds(4));
        child.kill().unwrap();
        // Not reaped yet: a zombie runs no code, so it no longer holds anything.
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!f.holds(3));
        child.wait().unwrap();
        assert!(!f.holds(3));
    }

    #[test]
    fn registering_again_ends_the_hold_and_a_reused_pid_is_not_the_same_process() {
        let me = ProcessRef::of(std::process::id()).unwrap();
        let f = FencedProcs::default();
        f.watch(1, me);
        assert!(f.holds(1));
        f.registered(1, me);
        assert!(!f.holds(1));
        let impostor = ProcessRef {
            pid: me.pid,
            start: me.start + 1,
        };
        assert!(!impostor.alive());
    }
}
