//! kv-node integration tests: one test binary with a module per subject.

mod api;
mod consistency;
mod failover;
mod harness;
mod map_version;
mod model;
mod prepare_expiry;
mod remote_index;
mod session;
