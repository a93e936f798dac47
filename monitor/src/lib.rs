//! The monitor (M-node, DINOMO sections 3.4-3.5 and 4): collects per-epoch statistics from the
//! KV nodes and latency reports from clients, runs the SLO policy engine (paper Table 4), and
//! carries out its decisions (add or remove a KN, replicate or de-replicate hot keys, recover
//! a failed KN) through the DPM, the KNs and an [`orchestrator`].
//!
//! Modules: [`config`] (the documented config file), [`policy`] (the pure decision function),
//! [`dpm_replicas`] (failover of the dpm-node replica set),
//! [`monitor`] (statistics, failure detection, actions), [`orchestrator`] (local processes or
//! Kubernetes), [`service`] (gRPC), [`server`] (runs it all), [`cli`].

pub mod cli;
pub mod config;
pub mod dpm_replicas;
pub mod monitor;
pub mod orchestrator;
pub mod policy;
pub mod server;
pub mod service;

pub use monitor::{Monitor, MonitorOptions};
