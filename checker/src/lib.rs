//! dinomo-checker: a linearizability checker for histories of key-value operations recorded by
//! tests (cluster tests, fault-injection tests, fuzzers).
//!
//! Clients record each operation with a [`History`]: [`History::invoke`] before sending the
//! request, then [`History::complete`] with the response, or [`History::complete_unknown`] when
//! they cannot tell whether it took effect (timeout, lost connection, UNAVAILABLE after the
//! request may have been applied). [`check()`] then decides whether some total order of the
//! operations exists that (1) respects real time: an operation that completed before another
//! was invoked comes first, and (2) is a legal sequential execution of a map from keys to
//! values where a key may be absent (the initial state).
//!
//! # Per key
//!
//! Linearizability is *local* (compositional; Herlihy & Wing 1990, theorem 1): a history over
//! several objects is linearizable if and only if each object's sub-history is. Every
//! operation here touches exactly one key and keys are independent registers, so the checker
//! splits the history by key and checks each sub-history alone. This turns one search
//! exponential in the concurrency of the whole history into many small ones.
//!
//! # The search
//!
//! Per key, the Wing & Gong backtracking search in Lowe's "just-in-time" form, with
//! memoization of (set of linearized operations, register value) as in Porcupine: an
//! operation is linearized only when the walk through time reaches its invocation, a response
//! reached before its operation was linearized forces a backtrack, and a configuration already
//! explored is never explored again (it failed before, or it would have ended the search).
//! Unknown outcomes get three sound reductions so that pending ones do not multiply the search:
//! a configuration is also skipped when one explored before had linearized a subset of the same
//! unknown-outcome operations (dominance); at most two unknown-outcome operations are
//! linearized in a row (any run of them reaches a register value that a sub-run of two also
//! reaches); and among pending unknown-outcome operations of the same kind and value, only the
//! earliest invoked is tried (they are interchangeable). The number of remembered
//! configurations is bounded by [`CheckOptions::max_states_per_key`]; past it the answer is
//! [`Violation::Undecided`], never a pass.
//!
//! # Outcomes
//!
//! * [`Res::Fail`] means definitely not applied: such operations are dropped.
//! * An unknown outcome (or an operation never completed) has a response time of infinity: it
//!   may be linearized at any point after its invocation, with whatever result the register
//!   gives there, or not at all. An unknown-outcome Get constrains nothing and is dropped.
//! * Delete answers [`Res::Ok`] only if the key existed and [`Res::NotFound`] otherwise, as in
//!   `kv.proto`; Update likewise; Insert answers [`Res::AlreadyExists`] if the key existed.
//!
//! A rejected history comes back as a [`Violation`] whose `Display` names the key, shows the
//! operation that could not be placed, and an excerpt of the sub-history around it (client,
//! logical invoke and response times, operation, result), so a failing test explains itself.
//!
//! # Example
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::Mutex;
//!
//! use dinomo_checker::{check, History, Op, Res};
//!
//! // Stand-in for the store under test: a map behind a lock is linearizable.
//! let store = Mutex::new(HashMap::<Vec<u8>, Vec<u8>>::new());
//! let history = History::new();
//! std::thread::scope(|s| {
//!     for client in 0..2u64 {
//!         let (history, store) = (&history, &store);
//!         s.spawn(move || {
//!             let key = b"k".to_vec();
//!             for i in 0..10 {
//!                 let value = format!("{client}-{i}").into_bytes();
//!                 let id = history.invoke(client, Op::Put { key: key.clone(), value: value.clone() });
//!                 store.lock().unwrap().insert(key.clone(), value); // the request
//!                 history.complete(id, Res::Ok);
//!
//!                 let id = history.invoke(client, Op::Get { key: key.clone() });
//!                 let seen = store.lock().unwrap().get(&key).cloned();
//!                 history.complete(id, Res::Value(seen));
//!             }
//!         });
//!     }
//! });
//! let report = check(&history).expect("a locked map is linearizable");
//! assert_eq!((report.keys, report.ops, report.unknown_ops), (1, 40, 0));
//!
//! // Sequentially, a read that misses a completed write is caught:
//! let history = History::new();
//! let put = history.invoke(1, Op::Put { key: b"k".to_vec(), value: b"1".to_vec() });
//! history.complete(put, Res::Ok);
//! let get = history.invoke(2, Op::Get { key: b"k".to_vec() });
//! history.complete(get, Res::Value(None));
//! let violation = check(&history).unwrap_err();
//! assert_eq!(violation.key(), b"k");
//! println!("{violation}");
//! ```

mod check;
mod history;

pub use check::{
    check, check_entries, check_with, CheckOptions, CheckReport, Counterexample, Violation,
};
pub use history::{ClientId, Entry, History, Op, OpId, Outcome, Res};

#[cfg(test)]
mod tests;
