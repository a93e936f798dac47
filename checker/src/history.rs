//! The recorder: what clients did and saw, stamped with a logical clock.
//!
//! Invariant: every event (an invocation or a response) takes the next value of one global
//! atomic counter. If a response event finishes before an invocation event starts, the response
//! takes the smaller stamp, so "A completed before B was invoked" in real time implies
//! `A.complete < B.invoke` here. Concurrent events get some order, which only makes them look
//! concurrent to the checker, never sequential. Stamps are exact (no ties), cheaper than
//! `Instant::now()`, and unaffected by clock resolution.
//!
//! Clients must call [`History::invoke`] *before* sending a request and
//! [`History::complete`] *after* the response arrived: the recorded interval then contains the
//! real one, which can only make the checker more permissive.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Who issued an operation. Only used to label operations in reports; the checker does not
/// assume anything about per-client ordering beyond what the timestamps say.
pub type ClientId = u64;

/// Handle for one recorded invocation, returned by [`History::invoke`]. Only meaningful for
/// the history that returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub(crate) usize);

impl OpId {
    /// Position of the invocation in the history (0-based, in invocation order).
    pub fn index(self) -> usize {
        self.0
    }

    /// For entries built by hand (see [`crate::check_entries`]).
    pub fn from_index(index: usize) -> Self {
        Self(index)
    }
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// An operation on one key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Op {
    /// Read the value. Answered with [`Res::Value`].
    Get { key: Vec<u8> },
    /// Upsert. Answered with [`Res::Ok`].
    Put { key: Vec<u8>, value: Vec<u8> },
    /// Create only. [`Res::Ok`], or [`Res::AlreadyExists`] (no effect) if the key exists.
    Insert { key: Vec<u8>, value: Vec<u8> },
    /// Replace only. [`Res::Ok`], or [`Res::NotFound`] (no effect) if the key is absent.
    Update { key: Vec<u8>, value: Vec<u8> },
    /// Remove. [`Res::Ok`] if the key existed, [`Res::NotFound`] (no effect) if it did not.
    Delete { key: Vec<u8> },
}

impl Op {
    /// The key the operation acts on.
    pub fn key(&self) -> &[u8] {
        match self {
            Op::Get { key }
            | Op::Put { key, .. }
            | Op::Insert { key, .. }
            | Op::Update { key, .. }
            | Op::Delete { key } => key,
        }
    }

    /// The value written, for operations that write one.
    pub fn value(&self) -> Option<&[u8]> {
        match self {
            Op::Put { value, .. } | Op::Insert { value, .. } | Op::Update { value, .. } => {
                Some(value)
            }
            Op::Get { .. } | Op::Delete { .. } => None,
        }
    }
}

/// What a client was told.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Res {
    /// Result of a Get: the value, or `None` if the key was not found.
    Value(Option<Vec<u8>>),
    /// A Put, Insert, Update or Delete took effect.
    Ok,
    /// Insert of an existing key (no effect).
    AlreadyExists,
    /// Update or Delete of a missing key (no effect).
    NotFound,
    /// Definitely not applied (e.g. INVALID_ARGUMENT, or WRONG_OWNER before execution). The
    /// checker ignores such operations entirely.
    Fail,
}

/// How an operation ended, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Neither [`History::complete`] nor [`History::complete_unknown`] was called. The checker
    /// treats this exactly like [`Outcome::Unknown`].
    Pending,
    /// The client got this response at logical time `at`.
    Done { at: u64, res: Res },
    /// The client does not know whether the operation took effect (timeout, connection lost,
    /// UNAVAILABLE after the request may have been applied). It may take effect at any point
    /// after its invocation, or never.
    Unknown,
}

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub id: OpId,
    pub client: ClientId,
    pub op: Op,
    /// Logical time of the invocation.
    pub invoke: u64,
    pub outcome: Outcome,
}

impl Entry {
    /// Logical time of the response, `None` if the operation has no response (unknown or
    /// pending outcome: its interval extends to infinity).
    pub fn complete_time(&self) -> Option<u64> {
        match self.outcome {
            Outcome::Done { at, .. } => Some(at),
            Outcome::Pending | Outcome::Unknown => None,
        }
    }

    /// The response, if one was recorded.
    pub fn result(&self) -> Option<&Res> {
        match &self.outcome {
            Outcome::Done { res, .. } => Some(res),
            Outcome::Pending | Outcome::Unknown => None,
        }
    }
}

/// Thread-safe recorder of invocations and responses. Share it by reference or in an `Arc`
/// between client tasks; the check runs on a snapshot ([`History::entries`]).
#[derive(Debug, Default)]
pub struct History {
    clock: AtomicU64,
    entries: Mutex<Vec<Entry>>,
}

impl History {
    pub fn new() -> Self {
        Self::default()
    }

    fn tick(&self) -> u64 {
        // SeqCst: one total order of all events, consistent with each thread's program order
        // and with any synchronisation between clients (including through the store).
        self.clock.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        // A client that panicked while holding the lock left the vector consistent (every
        // mutation below is a single push or assignment), so keep recording.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that `client` is about to issue `op`. Call it before sending the request.
    pub fn invoke(&self, client: ClientId, op: Op) -> OpId {
        let mut entries = self.lock();
        // Tick under the lock so that entry indices follow invocation order.
        let invoke = self.tick();
        let id = OpId(entries.len());
        entries.push(Entry {
            id,
            client,
            op,
            invoke,
            outcome: Outcome::Pending,
        });
        id
    }

    /// Records the response to `id`. Call it after the response arrived.
    ///
    /// # Panics
    /// If `id` was not returned by this history's [`History::invoke`], or the operation was
    /// already completed: both are bugs in the test, and a silently wrong history would make
    /// the verdict meaningless.
    pub fn complete(&self, id: OpId, res: Res) {
        self.finish(id, |at| Outcome::Done { at, res });
    }

    /// Records that the outcome of `id` is unknown: it may have taken effect at any time after
    /// its invocation, or never. Panics like [`History::complete`].
    pub fn complete_unknown(&self, id: OpId) {
        self.finish(id, |_| Outcome::Unknown);
    }

    fn finish(&self, id: OpId, outcome: impl FnOnce(u64) -> Outcome) {
        let at = self.tick();
        let mut entries = self.lock();
        let n = entries.len();
        let entry = entries
            .get_mut(id.0)
            .unwrap_or_else(|| panic!("{id} is not an operation of this history ({n} recorded)"));
        assert!(
            entry.outcome == Outcome::Pending,
            "{id} completed twice (already {:?})",
            entry.outcome
        );
        entry.outcome = outcome(at);
    }

    /// A snapshot of every recorded operation, in invocation order.
    pub fn entries(&self) -> Vec<Entry> {
        self.lock().clone()
    }

    /// Number of recorded invocations.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Renders bytes as `b"..."` with escapes, shortening long values.
pub(crate) struct Bytes<'a>(pub &'a [u8]);

impl fmt::Display for Bytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 32;
        if self.0.len() <= SHOWN + 8 {
            write!(f, "b\"{}\"", self.0.escape_ascii())
        } else {
            write!(
                f,
                "b\"{}\"...({} bytes)",
                self.0[..SHOWN].escape_ascii(),
                self.0.len()
            )
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Get { .. } => write!(f, "get"),
            Op::Put { value, .. } => write!(f, "put {}", Bytes(value)),
            Op::Insert { value, .. } => write!(f, "insert {}", Bytes(value)),
            Op::Update { value, .. } => write!(f, "update {}", Bytes(value)),
            Op::Delete { .. } => write!(f, "delete"),
        }
    }
}

impl fmt::Display for Res {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Res::Value(Some(v)) => write!(f, "{}", Bytes(v)),
            Res::Value(None) => write!(f, "not found"),
            Res::Ok => write!(f, "ok"),
            Res::AlreadyExists => write!(f, "already exists"),
            Res::NotFound => write!(f, "not found"),
            Res::Fail => write!(f, "failed"),
        }
    }
}

/// One line per operation: `#id client C [invoke, complete] op -> result`. The key is left out:
/// reports are per key and name it once.
impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} client {} ", self.id, self.client)?;
        match &self.outcome {
            Outcome::Done { at, res } => {
                write!(f, "[{}, {}] {} -> {}", self.invoke, at, self.op, res)
            }
            Outcome::Unknown => write!(f, "[{}, inf) {} -> unknown outcome", self.invoke, self.op),
            Outcome::Pending => write!(f, "[{}, inf) {} -> never completed", self.invoke, self.op),
        }
    }
}
