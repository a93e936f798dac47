//! kv-node integration tests: one test binary with a module per subject.

mod api;
mod failover;
mod harness;
mod model;
mod remote_index;
