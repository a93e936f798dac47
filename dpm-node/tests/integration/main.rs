//! dpm-node integration tests: one test binary (link time) with a module per subject.

mod crash;
mod dax;
mod dpm;
mod fence_window;
mod pool_lock;
mod powerloss;
mod process;
mod publication;
mod replication;
mod replication_fencing;
mod replication_generation;
mod replication_one_sided;
mod replication_pipelining;
mod replication_resync;
mod service;
mod verbs;
mod write_window;
