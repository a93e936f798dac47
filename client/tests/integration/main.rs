//! The client against fake nodes on loopback: what it does with each kind of failure.

mod write_outcome;
