//! Per-caller counters. Every backend counts the same things in the same way: one round trip per
//! `post` (however many operations it carries), bytes as payload bytes. So round trips per KV
//! operation measured on shm are the number the same code would need on RDMA.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::op::Op;

/// Live counters of one fabric handle.
#[derive(Debug, Default)]
pub struct FabricStats {
    round_trips: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    cas: AtomicU64,
    faa: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub round_trips: u64,
    pub reads: u64,
    pub writes: u64,
    pub cas: u64,
    pub faa: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

impl StatsSnapshot {
    pub fn ops(&self) -> u64 {
        self.reads + self.writes + self.cas + self.faa
    }

    /// Counter differences `self - earlier`.
    pub fn since(&self, earlier: &StatsSnapshot) -> StatsSnapshot {
        StatsSnapshot {
            round_trips: self.round_trips - earlier.round_trips,
            reads: self.reads - earlier.reads,
            writes: self.writes - earlier.writes,
            cas: self.cas - earlier.cas,
            faa: self.faa - earlier.faa,
            bytes_read: self.bytes_read - earlier.bytes_read,
            bytes_written: self.bytes_written - earlier.bytes_written,
        }
    }
}

impl FabricStats {
    /// Count one post of `ops` (called once per post, before it is executed).
    pub fn record_post(&self, ops: &[Op]) {
        self.round_trips.fetch_add(1, Relaxed);
        for op in ops {
            match op {
                Op::Read { len, .. } => {
                    self.reads.fetch_add(1, Relaxed);
                    self.bytes_read.fetch_add(u64::from(*len), Relaxed);
                }
                Op::Write { data, .. } => {
                    self.writes.fetch_add(1, Relaxed);
                    self.bytes_written.fetch_add(data.len() as u64, Relaxed);
                }
                Op::Cas { .. } => {
                    self.cas.fetch_add(1, Relaxed);
                }
                Op::Faa { .. } => {
                    self.faa.fetch_add(1, Relaxed);
                }
            }
        }
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            round_trips: self.round_trips.load(Relaxed),
            reads: self.reads.load(Relaxed),
            writes: self.writes.load(Relaxed),
            cas: self.cas.load(Relaxed),
            faa: self.faa.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
        }
    }
}
