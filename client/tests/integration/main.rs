//! The client against fake nodes on loopback: what it does with each kind of failure.

mod fakes;
mod latency_reports;
mod map_refresh;
mod pipeline;
mod wire;
mod write_outcome;
