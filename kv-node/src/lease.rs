//! The KN's serving lease: a KN answers requests only while its last successful renewal
//! (ConfirmServing at the DPM: the map of record, given only to a KN that is not fenced and
//! was not fenced under that map) *started* less than `serve_lease` ago.
//!
//! A KN fenced while alive (declared failed on a slow heartbeat) cannot renew from the moment
//! of the fence, even after it registers again, until the next map is published; the
//! reconfiguration that fenced it waits out the longest lease ([`MAX_SERVE_LEASE`]) before it
//! publishes that map, so by then the old owner has stopped serving the moved keys.
//!
//! Why: fencing at the DPM stops a failed KN's writes, not its reads from its own caches. A KN
//! that was paused (SIGSTOP, a long GC-like stall) or cut off keeps its old map; once the
//! monitor has given its keys to another KN, answering a read from its cache would return a
//! value older than an acknowledged write. The monitor declares a KN failed only after
//! `failed_after_ms` without a heartbeat, which is longer than the lease, so by then the KN has
//! stopped serving by itself, and it serves again only after a fresh map read (which, if it
//! was removed, makes it answer WRONG_OWNER). Time is the monotonic clock, which keeps running
//! while a process is stopped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest serving lease a KN accepts; a reconfiguration that fences a live KN waits
/// this long before it publishes (dinomo_client::admin relies on it).
pub const MAX_SERVE_LEASE: Duration = Duration::from_millis(dinomo_proto::MAX_KN_SERVE_LEASE_MS);

#[derive(Debug)]
pub struct ServeLease {
    base: Instant,
    /// Nanoseconds after `base` at which the last successful map read started.
    confirmed_ns: AtomicU64,
    /// Nanoseconds after `base` of the last [`ServeLease::expire`]: only a renewal that started
    /// later counts.
    expired_ns: AtomicU64,
    duration: Duration,
}

impl ServeLease {
    /// A lease confirmed now (the KN has just registered and read the map).
    pub fn new(duration: Duration) -> Self {
        ServeLease {
            base: Instant::now(),
            confirmed_ns: AtomicU64::new(0),
            expired_ns: AtomicU64::new(0),
            duration,
        }
    }

    /// A map read that started at `started` succeeded.
    pub fn confirm(&self, started: Instant) {
        let ns = started.saturating_duration_since(self.base).as_nanos() as u64;
        self.confirmed_ns.fetch_max(ns, Ordering::AcqRel);
    }

    /// How long ago the last confirmed map read started.
    pub fn age(&self) -> Duration {
        let confirmed = self.base + Duration::from_nanos(self.confirmed_ns.load(Ordering::Acquire));
        Instant::now().saturating_duration_since(confirmed)
    }

    pub fn valid(&self) -> bool {
        self.confirmed_ns.load(Ordering::Acquire) >= self.expired_ns.load(Ordering::Acquire)
            && self.age() < self.duration
    }

    /// Ends the lease now: the KN serves again only after a renewal that starts later. Called
    /// when the KN registers with the DPM again: a KN fenced while alive must not serve (or
    /// write, under its new session) until the DPM confirms it under the next map.
    pub fn expire(&self) {
        let now = Instant::now()
            .saturating_duration_since(self.base)
            .as_nanos() as u64
            + 1;
        self.expired_ns.fetch_max(now, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_lapses_without_confirmations_and_comes_back_with_one() {
        let l = ServeLease::new(Duration::from_millis(30));
        assert!(l.valid());
        std::thread::sleep(Duration::from_millis(40));
        assert!(!l.valid(), "no confirmation for longer than the lease");
        let started = Instant::now();
        l.confirm(started);
        assert!(l.valid());
        // An older confirmation never moves the lease back.
        l.confirm(started - Duration::from_millis(20));
        assert!(l.age() < Duration::from_millis(20));
        // Expired: a renewal that started before does not count, one that starts after does.
        l.expire();
        assert!(!l.valid());
        l.confirm(started);
        assert!(!l.valid(), "a renewal from before the expiry");
        l.confirm(Instant::now());
        assert!(l.valid());
    }
}
