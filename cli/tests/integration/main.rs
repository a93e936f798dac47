//! End-to-end tests on real processes (`dinomo dpm-node|kv-node|routing-node`, all on loopback):
//! the SDK against a multi-KN cluster, a cluster-map change under load, and a KN killed under
//! load, each with its history checked for linearizability.

mod cluster;
mod e2e;
