//! The client against fake nodes on loopback: what it does with each kind of failure.

mod latency_reports;
mod pipeline;
mod wire;
mod write_outcome;
