//! End-to-end tests on real processes (`dinomo dpm-node|kv-node|routing-node|monitor`, all on
//! loopback): the SDK against a multi-KN cluster, a cluster-map change under load, a KN killed
//! under load, and the monitor's failover, scaling and hot-key replication under load, each with
//! its history checked for linearizability.

mod backup_admin;
mod cluster;
mod deploy;
mod dpm_auto_failover;
mod dpm_failover;
mod e2e;
mod external;
mod monitor;
mod nemesis;
mod netfault;
mod restart;
mod resume;
mod security;
