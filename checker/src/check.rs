//! The checker: per-key Wing–Gong/Lowe search with memoization (see the crate docs for why
//! per key is enough and how unknown outcomes are treated).
//!
//! Per key, values are interned to `u32` ids (0 = absent) so that a search state is a bitset of
//! linearized operations plus one `u32`. The search itself and its reductions are described on
//! [`search`] and [`Memo`].

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::history::{Bytes, Entry, History, Op, OpId, Outcome, Res};

/// Tuning for [`check_with`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOptions {
    /// Most search states (set of linearized operations, register value) remembered for one
    /// key before giving up with [`Violation::Undecided`]. Memory is roughly
    /// `states * (ops_on_the_key / 8 + 100)` bytes, so the default allows about 100 MB for a
    /// key with a few hundred operations. A linearizable history with little concurrency needs
    /// about one state per operation; proving a violation needs every state before it, which
    /// grows with the number of operations concurrent at each point (exponentially in the
    /// worst case) and with the number of unknown-outcome operations still pending.
    pub max_states_per_key: usize,
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            max_states_per_key: 1_000_000,
        }
    }
}

/// What was checked, when every key passed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Distinct keys.
    pub keys: usize,
    /// Operations checked (everything except [`Res::Fail`]), unknown outcomes included.
    pub ops: usize,
    /// Operations with an unknown outcome or never completed.
    pub unknown_ops: usize,
    /// Operations ignored because they answered [`Res::Fail`].
    pub failed_ops: usize,
    /// Search states explored, summed over keys.
    pub states_explored: u64,
    /// The most states any one key needed (compare with [`CheckOptions::max_states_per_key`]).
    pub max_states_one_key: usize,
}

/// Why a history was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// No linearization exists for this key.
    #[error("{0}")]
    NotLinearizable(Box<Counterexample>),
    /// The search hit [`CheckOptions::max_states_per_key`] before reaching a verdict. This is
    /// not a pass: shorten the history, reduce concurrency or unknown outcomes on one key, or
    /// raise the limit.
    #[error(
        "key {}: undecided: the search explored {explored} states (limit {limit}) over the {ops} \
         operations on this key ({unknown} with unknown outcome) without a verdict; raise \
         CheckOptions::max_states_per_key or record a shorter or less concurrent history",
        Bytes(.key)
    )]
    Undecided {
        key: Vec<u8>,
        ops: usize,
        unknown: usize,
        explored: usize,
        limit: usize,
    },
    /// The history itself is inconsistent (a response of the wrong kind, a response before its
    /// invocation): a bug in the test's recording, not in the store.
    #[error("key {}: malformed history: {reason}: {entry}", Bytes(.key))]
    Malformed {
        key: Vec<u8>,
        entry: Box<Entry>,
        reason: &'static str,
    },
}

impl Violation {
    /// The key whose sub-history was rejected.
    pub fn key(&self) -> &[u8] {
        match self {
            Violation::NotLinearizable(c) => &c.key,
            Violation::Undecided { key, .. } | Violation::Malformed { key, .. } => key,
        }
    }
}

/// A non-linearizable key, with the evidence.
///
/// The search tries every order; the one that got furthest linearized `prefix_len` operations,
/// leaving the key holding `value_after_prefix`, and then reached the response of `stuck`
/// without being able to place it (nor any other operation that could still go first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counterexample {
    pub key: Vec<u8>,
    /// Operations on this key that were checked.
    pub key_ops: usize,
    /// The operation that could not be linearized before its response.
    pub stuck: Entry,
    /// How many operations the furthest-reaching order linearized before getting stuck.
    pub prefix_len: usize,
    /// The last few operations of that order (up to 6), first to last.
    pub prefix_tail: Vec<OpId>,
    /// The key's value after that prefix (`None` = absent).
    pub value_after_prefix: Option<Vec<u8>>,
    /// The relevant operations, by invocation time: the end of that order and its last write,
    /// the operations that were still candidates when it got stuck (invoked before `stuck`
    /// responded), the latest write of the value `stuck` read (for a Get), and `stuck`.
    pub excerpt: Vec<Entry>,
    /// Candidates left out of `excerpt` to keep it short.
    pub not_shown: usize,
    /// A plain-words reading of the failure, when one is obvious.
    pub hint: Option<String>,
    pub states_explored: usize,
}

impl fmt::Display for Counterexample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "key {} is not linearizable: no order of its {} operations respects both real time \
             and the register's semantics ({} search states explored).",
            Bytes(&self.key),
            self.key_ops,
            self.states_explored
        )?;
        let value = match &self.value_after_prefix {
            Some(v) => format!("{}", Bytes(v)),
            None => "absent".to_string(),
        };
        write!(
            f,
            "The furthest any order got: {} operation(s) linearized",
            self.prefix_len
        )?;
        if !self.prefix_tail.is_empty() {
            let skipped = self.prefix_len - self.prefix_tail.len();
            write!(f, " (")?;
            if skipped > 0 {
                write!(f, "{skipped} earlier, then ")?;
            }
            for (i, id) in self.prefix_tail.iter().enumerate() {
                write!(f, "{}{id}", if i > 0 { ", " } else { "" })?;
            }
            write!(f, ")")?;
        }
        writeln!(
            f,
            ", leaving the key {value}; then this operation could not take effect before its \
             response:"
        )?;
        writeln!(f, "    {}", self.stuck)?;
        writeln!(f, "Excerpt, by invocation time (`>` marks it):")?;
        for e in &self.excerpt {
            let mark = if e.id == self.stuck.id { ">" } else { " " };
            writeln!(f, "  {mark} {e}")?;
        }
        if self.not_shown > 0 {
            writeln!(
                f,
                "    ... and {} more concurrent operation(s) not shown",
                self.not_shown
            )?;
        }
        if let Some(hint) = &self.hint {
            writeln!(f, "Hint: {hint}")?;
        }
        Ok(())
    }
}

/// [`check_with`] with default options.
pub fn check(history: &History) -> Result<CheckReport, Violation> {
    check_with(history, &CheckOptions::default())
}

/// Decides whether `history` is linearizable, key by key.
///
/// Returns the first violation in key order; a key proven non-linearizable is reported in
/// preference to a key left undecided.
pub fn check_with(history: &History, options: &CheckOptions) -> Result<CheckReport, Violation> {
    check_entries(&history.entries(), options)
}

/// Like [`check_with`] on entries already taken out of a [`History`] (or built by hand, e.g. to
/// replay a history saved by a failed run). Only `op`, `invoke` and `outcome` matter to the
/// verdict; `id` and `client` label the report. Equal timestamps of different operations are
/// read as overlapping.
pub fn check_entries(entries: &[Entry], options: &CheckOptions) -> Result<CheckReport, Violation> {
    let mut by_key: BTreeMap<&[u8], Vec<&Entry>> = BTreeMap::new();
    for e in entries {
        by_key.entry(e.op.key()).or_default().push(e);
    }
    let mut report = CheckReport {
        keys: by_key.len(),
        ..CheckReport::default()
    };
    let mut undecided = None;
    for (key, key_entries) in by_key {
        let compiled = compile(key, &key_entries)?;
        report.ops += compiled.ops.len() + compiled.unknown_gets;
        report.unknown_ops += compiled.unknown;
        report.failed_ops += compiled.failed;
        let verdict = search(&compiled.ops, options.max_states_per_key);
        report.states_explored += verdict.states() as u64;
        report.max_states_one_key = report.max_states_one_key.max(verdict.states());
        match verdict {
            Verdict::Linearizable { .. } => {}
            Verdict::Undecided { states } => {
                undecided.get_or_insert(Violation::Undecided {
                    key: key.to_vec(),
                    ops: compiled.ops.len() + compiled.unknown_gets,
                    unknown: compiled.unknown,
                    explored: states,
                    limit: options.max_states_per_key,
                });
            }
            Verdict::Stuck { states, stuck } => {
                return Err(Violation::NotLinearizable(Box::new(explain(
                    key, &compiled, &stuck, states,
                ))));
            }
        }
    }
    match undecided {
        Some(v) => Err(v),
        None => Ok(report),
    }
}

// ---------------------------------------------------------------------------------------------
// Compilation: one key's entries -> compact operations.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Get,
    Put,
    Insert,
    Update,
    Delete,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Unknown,
    Ok,
    AlreadyExists,
    NotFound,
    /// A Get's answer: value id, 0 = not found.
    Value(u32),
}

#[derive(Debug, Clone, Copy)]
struct COp<'a> {
    kind: Kind,
    /// Value id written (Put/Insert/Update), 0 otherwise.
    arg: u32,
    expect: Expect,
    invoke: u64,
    /// `u64::MAX` when the outcome is unknown: the interval never closes.
    ret: u64,
    entry: &'a Entry,
}

struct Compiled<'a> {
    ops: Vec<COp<'a>>,
    /// Value ids -> bytes, index 0 unused (absent).
    values: Vec<&'a [u8]>,
    /// Entries with [`Res::Fail`].
    failed: usize,
    /// Entries with unknown or missing outcome (Gets included).
    unknown: usize,
    /// Unknown-outcome Gets: no effect and no observation, so left out of the search.
    unknown_gets: usize,
    /// Every non-failed entry of the key (for excerpts).
    all: Vec<&'a Entry>,
    /// Entries with [`Res::Fail`] (for hints).
    failed_writes: Vec<&'a Entry>,
}

fn compile<'a>(key: &[u8], entries: &[&'a Entry]) -> Result<Compiled<'a>, Violation> {
    let mut ids: HashMap<&'a [u8], u32> = HashMap::new();
    let mut values: Vec<&'a [u8]> = vec![&[]];
    let mut intern = |v: &'a [u8]| -> u32 {
        *ids.entry(v).or_insert_with(|| {
            values.push(v);
            (values.len() - 1) as u32
        })
    };
    let mut out = Compiled {
        ops: Vec::with_capacity(entries.len()),
        values: Vec::new(),
        failed: 0,
        unknown: 0,
        unknown_gets: 0,
        all: Vec::with_capacity(entries.len()),
        failed_writes: Vec::new(),
    };
    for &e in entries {
        let malformed = |reason| Violation::Malformed {
            key: key.to_vec(),
            entry: Box::new(e.clone()),
            reason,
        };
        let (kind, arg) = match &e.op {
            Op::Get { .. } => (Kind::Get, 0),
            Op::Put { value, .. } => (Kind::Put, intern(value)),
            Op::Insert { value, .. } => (Kind::Insert, intern(value)),
            Op::Update { value, .. } => (Kind::Update, intern(value)),
            Op::Delete { .. } => (Kind::Delete, 0),
        };
        let (expect, ret) = match &e.outcome {
            Outcome::Pending | Outcome::Unknown => (Expect::Unknown, u64::MAX),
            Outcome::Done { res: Res::Fail, .. } => {
                out.failed += 1;
                out.failed_writes.push(e);
                continue;
            }
            Outcome::Done { at, res } => {
                if *at <= e.invoke {
                    return Err(malformed("response recorded at or before its invocation"));
                }
                let expect = match (kind, res) {
                    (Kind::Get, Res::Value(None)) => Expect::Value(0),
                    (Kind::Get, Res::Value(Some(v))) => Expect::Value(intern(v)),
                    (Kind::Get, _) => return Err(malformed("a get must be answered with a value")),
                    (_, Res::Value(_)) => {
                        return Err(malformed("only a get can be answered with a value"))
                    }
                    (_, Res::Ok) => Expect::Ok,
                    (Kind::Insert, Res::AlreadyExists) => Expect::AlreadyExists,
                    (_, Res::AlreadyExists) => {
                        return Err(malformed("only an insert can answer already-exists"))
                    }
                    (Kind::Update | Kind::Delete, Res::NotFound) => Expect::NotFound,
                    (_, Res::NotFound) => {
                        return Err(malformed("only an update or a delete can answer not-found"))
                    }
                    (_, Res::Fail) => unreachable!("handled above"),
                };
                (expect, *at)
            }
        };
        out.all.push(e);
        if expect == Expect::Unknown {
            out.unknown += 1;
            if kind == Kind::Get {
                out.unknown_gets += 1;
                continue;
            }
        }
        out.ops.push(COp {
            kind,
            arg,
            expect,
            invoke: e.invoke,
            ret,
            entry: e,
        });
    }
    out.values = values;
    Ok(out)
}

/// The sequential specification: a register whose value may be absent (0). Returns the state
/// after `op`, or `None` if `op` cannot return what it returned from `state`.
fn step(state: u32, op: &COp<'_>) -> Option<u32> {
    let present = state != 0;
    match (op.kind, op.expect) {
        (Kind::Get, Expect::Value(v)) => (state == v).then_some(state),
        (Kind::Get, _) => Some(state),
        (Kind::Put, _) => Some(op.arg),
        (Kind::Insert, Expect::Ok) => (!present).then_some(op.arg),
        (Kind::Insert, Expect::AlreadyExists) => present.then_some(state),
        (Kind::Insert, _) => Some(if present { state } else { op.arg }),
        (Kind::Update, Expect::Ok) => present.then_some(op.arg),
        (Kind::Update, Expect::NotFound) => (!present).then_some(0),
        (Kind::Update, _) => Some(if present { op.arg } else { 0 }),
        (Kind::Delete, Expect::Ok) => present.then_some(0),
        (Kind::Delete, Expect::NotFound) => (!present).then_some(0),
        (Kind::Delete, _) => Some(0),
    }
}

// ---------------------------------------------------------------------------------------------
// Search.

/// Where the furthest-reaching order got stuck.
#[derive(Debug)]
struct Stuck {
    /// Index in `ops` of the operation whose response was reached unlinearized.
    op: usize,
    prefix_len: usize,
    state: u32,
    /// The last non-Get operation of the prefix (what set or confirmed `state`).
    last_write: Option<usize>,
    /// The last few operations of the prefix, in linearization order.
    prefix_tail: Vec<usize>,
    /// Operations not linearized whose invocation precedes `op`'s response.
    candidates: Vec<usize>,
}

/// How many operations at the end of the furthest prefix a report shows.
const PREFIX_TAIL: usize = 6;

#[derive(Debug)]
enum Verdict {
    Linearizable { states: usize },
    Undecided { states: usize },
    Stuck { states: usize, stuck: Stuck },
}

impl Verdict {
    fn states(&self) -> usize {
        match self {
            Verdict::Linearizable { states }
            | Verdict::Undecided { states }
            | Verdict::Stuck { states, .. } => *states,
        }
    }
}

/// Memo of explored configurations: (linearized known-outcome ops, state) -> the minimal
/// (linearized unknown-outcome ops, unknown-outcome run length) pairs seen with it.
///
/// A configuration (K, s, U, r) — r being how many unknown-outcome operations end the current
/// order, which limits what may follow (see [`search`]) — is *dominated* by (K, s, U', r') when
/// U' ⊆ U and r' ≤ r: whatever completes the former also completes the latter, because
/// unknown-outcome operations never have a response that forces them in, so having linearized
/// fewer of them only leaves more options (and the symmetry rule of [`search`] can be restored
/// by swapping interchangeable operations). When the search ends in failure, every remembered
/// configuration has been explored and failed, so a dominated one would fail too. Plain
/// Porcupine-style memoization is the special case U = U', r = r'. Without this, each
/// unknown-outcome operation still pending could double the search.
#[derive(Debug, Default)]
struct Memo {
    map: HashMap<(Vec<u64>, u32), Vec<UnknownPart>>,
    /// Configurations inserted so far (the explored-states count and the bound).
    inserted: usize,
}

/// (linearized unknown-outcome ops, length of the unknown-outcome run ending the order)
type UnknownPart = (Vec<u64>, u8);

fn is_subset(a: &[u64], b: &[u64]) -> bool {
    a.iter().zip(b).all(|(x, y)| x & !y == 0)
}

impl Memo {
    /// Remembers the configuration; false if one already remembered dominates it.
    fn visit(&mut self, known: &mut Vec<u64>, state: u32, unknown: &[u64], run: u8) -> bool {
        // Look up without allocating: lend the bitset to the key, then take it back.
        let key = (std::mem::take(known), state);
        let fresh = match self.map.get_mut(&key) {
            Some(minimal) => {
                if minimal
                    .iter()
                    .any(|(u, r)| *r <= run && is_subset(u, unknown))
                {
                    false
                } else {
                    minimal.retain(|(u, r)| !(run <= *r && is_subset(unknown, u)));
                    minimal.push((unknown.to_vec(), run));
                    true
                }
            }
            None => {
                self.map
                    .insert((key.0.clone(), state), vec![(unknown.to_vec(), run)]);
                true
            }
        };
        *known = key.0;
        if fresh {
            self.inserted += 1;
        }
        fresh
    }
}

const HEAD: usize = 0;
const NIL: usize = usize::MAX;

#[derive(Debug, Clone, Copy)]
struct Event {
    op: usize,
    call: bool,
}

/// Lowe's just-in-time linearization (an improvement of Wing & Gong's search) with memoization
/// of configurations as in Porcupine, extended with dominance for unknown outcomes ([`Memo`]).
///
/// Events (calls and returns) sit in a doubly linked list in time order. The candidates to
/// linearize next are the calls before the first return still listed (an operation whose
/// response came before another's invocation must go first). A candidate is linearized if the
/// model accepts its result and the configuration it leads to is new; it is then lifted out of
/// the list and the scan restarts. Reaching the first return means no candidate works: undo
/// the last linearization and try the next candidate after it. Success = every known-outcome
/// operation linearized (unknown ones left over are simply omitted); nothing left to undo = no
/// linearization exists. Unknown outcomes have their return at +infinity, so they never force
/// a backtrack; they are tried after the known-outcome candidates, so the first visit of a
/// configuration tends to use as few of them as possible and later visits are dominated.
///
/// One more reduction, specific to this register: at most two unknown-outcome operations are
/// linearized in a row (between two known-outcome ones, or before the first). Any run of them
/// takes the register from some value to another that a sub-run of at most two also reaches:
/// absent needs one delete; a value v needs the put of v, or the insert of v (after a delete if
/// the key was present), or the update to v (after a put or insert if it was absent). The
/// operations left out of the run stay available later or are omitted, and real time cannot
/// object because an unknown-outcome operation never has to precede anything. Without this,
/// every subset of the pending unknown-outcome operations could be tried at every step.
///
/// And a symmetry: unknown-outcome operations of the same kind with the same value are
/// interchangeable once all of them have been invoked, so only the earliest-invoked one not yet
/// linearized is ever tried (any linearization can swap which of them it uses at each point).
/// The linearized ones of each class are then always its first k, which keeps the number of
/// distinct configurations down when many such operations are pending.
fn search(ops: &[COp<'_>], max_states: usize) -> Verdict {
    let n = ops.len();
    let is_unknown = |i: usize| ops[i].ret == u64::MAX;
    let mut known_left = (0..n).filter(|&i| !is_unknown(i)).count();
    if known_left == 0 {
        return Verdict::Linearizable { states: 0 };
    }
    // Unknown-outcome operations of the same kind writing the same value are interchangeable
    // once invoked; only the earliest-invoked one not yet linearized is tried (see below).
    let mut class_pred = vec![usize::MAX; n];
    {
        let mut last_of_class: HashMap<(Kind, u32), usize> = HashMap::new();
        let mut by_invoke: Vec<usize> = (0..n).filter(|&i| is_unknown(i)).collect();
        by_invoke.sort_by_key(|&i| ops[i].invoke);
        for i in by_invoke {
            if let Some(p) = last_of_class.insert((ops[i].kind, ops[i].arg), i) {
                class_pred[i] = p;
            }
        }
    }
    // Separate bit numbering for known- and unknown-outcome operations.
    let mut bit = vec![0usize; n];
    let (mut nk, mut nu) = (0, 0);
    for (i, b) in bit.iter_mut().enumerate() {
        let counter = if is_unknown(i) { &mut nu } else { &mut nk };
        *b = *counter;
        *counter += 1;
    }

    // Node 0 is the head sentinel; events are nodes 1..=2n; NIL marks the end.
    // (time, 0 = call / 1 = return, op). Recorded stamps are unique except u64::MAX (returns
    // only); hand-built entries may tie, and then calls go first: simultaneous = concurrent,
    // the permissive reading.
    let mut order: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * n);
    for (i, o) in ops.iter().enumerate() {
        order.push((o.invoke, 0, i));
        order.push((o.ret, 1, i));
    }
    order.sort_unstable();
    let mut events = vec![Event { op: 0, call: false }; 2 * n + 1];
    let mut call_node = vec![0; n];
    let mut ret_node = vec![0; n];
    let mut next = vec![NIL; 2 * n + 1];
    let mut prev = vec![NIL; 2 * n + 1];
    for (pos, &(_, kind, op)) in order.iter().enumerate() {
        let node = pos + 1;
        let call = kind == 0;
        events[node] = Event { op, call };
        if call {
            call_node[op] = node;
        } else {
            ret_node[op] = node;
        }
        prev[node] = node - 1;
        next[node - 1] = node;
    }
    let unlink = |next: &mut [usize], prev: &mut [usize], x: usize| {
        let (p, nx) = (prev[x], next[x]);
        next[p] = nx;
        if nx != NIL {
            prev[nx] = p;
        }
    };
    let relink = |next: &mut [usize], prev: &mut [usize], x: usize| {
        let (p, nx) = (prev[x], next[x]);
        next[p] = x;
        if nx != NIL {
            prev[nx] = x;
        }
    };

    let mut known = vec![0u64; nk.div_ceil(64)];
    let mut unknown = vec![0u64; nu.div_ceil(64)];
    let flip = |known: &mut [u64], unknown: &mut [u64], op: usize| {
        let set = if is_unknown(op) { unknown } else { known };
        set[bit[op] / 64] ^= 1 << (bit[op] % 64);
    };
    let mut memo = Memo::default();
    memo.visit(&mut known, 0, &unknown, 0);
    // (operation linearized, state before it)
    let mut stack: Vec<(usize, u32)> = Vec::new();
    let mut state = 0u32;
    let mut best: Option<Stuck> = None;
    // The scan: `entry` walks the list; in the first phase it tries known-outcome candidates,
    // in the second unknown-outcome ones.
    let mut entry = next[HEAD];
    let mut unknown_phase = false;

    loop {
        debug_assert!(entry != NIL, "a known return always ends a scan");
        let Event { op, call } = events[entry];
        if call {
            // How many unknown-outcome operations end the order so far; at most two in a row
            // (see the doc comment).
            let run = || {
                stack
                    .iter()
                    .rev()
                    .take(2)
                    .take_while(|&&(i, _)| is_unknown(i))
                    .count() as u8
            };
            let chain_full = || run() >= 2;
            let first_of_class = || {
                let p = class_pred[op];
                p == usize::MAX || unknown[bit[p] / 64] & (1 << (bit[p] % 64)) != 0
            };
            if is_unknown(op) == unknown_phase
                && !(unknown_phase && (chain_full() || !first_of_class()))
            {
                if let Some(new_state) = step(state, &ops[op]) {
                    flip(&mut known, &mut unknown, op);
                    let new_run = if is_unknown(op) { run() + 1 } else { 0 };
                    if memo.visit(&mut known, new_state, &unknown, new_run) {
                        if memo.inserted > max_states {
                            return Verdict::Undecided { states: max_states };
                        }
                        stack.push((op, state));
                        state = new_state;
                        unlink(&mut next, &mut prev, call_node[op]);
                        unlink(&mut next, &mut prev, ret_node[op]);
                        if !is_unknown(op) {
                            known_left -= 1;
                            if known_left == 0 {
                                return Verdict::Linearizable {
                                    states: memo.inserted,
                                };
                            }
                        }
                        entry = next[HEAD];
                        unknown_phase = false;
                        continue;
                    }
                    flip(&mut known, &mut unknown, op);
                }
            }
            entry = next[entry];
            continue;
        }
        debug_assert!(
            !is_unknown(op),
            "unknown returns sort after every known one"
        );
        if !unknown_phase {
            unknown_phase = true;
            entry = next[HEAD];
            continue;
        }
        // No candidate can go before this response.
        if best.as_ref().is_none_or(|b| stack.len() > b.prefix_len) {
            let mut candidates = Vec::new();
            let mut x = next[HEAD];
            while x != entry {
                if events[x].call {
                    candidates.push(events[x].op);
                }
                x = next[x];
            }
            best = Some(Stuck {
                op,
                prefix_len: stack.len(),
                state,
                last_write: stack
                    .iter()
                    .rev()
                    .map(|&(i, _)| i)
                    .find(|&i| ops[i].kind != Kind::Get),
                prefix_tail: stack[stack.len().saturating_sub(PREFIX_TAIL)..]
                    .iter()
                    .map(|&(i, _)| i)
                    .collect(),
                candidates,
            });
        }
        let Some((undo, prev_state)) = stack.pop() else {
            return Verdict::Stuck {
                states: memo.inserted,
                stuck: best.expect("recorded just above"),
            };
        };
        state = prev_state;
        flip(&mut known, &mut unknown, undo);
        relink(&mut next, &mut prev, ret_node[undo]);
        relink(&mut next, &mut prev, call_node[undo]);
        if !is_unknown(undo) {
            known_left += 1;
        }
        entry = next[call_node[undo]];
        unknown_phase = is_unknown(undo);
    }
}

// ---------------------------------------------------------------------------------------------
// Explanation.

/// Most operations shown in an excerpt.
const EXCERPT_MAX: usize = 24;

fn explain(key: &[u8], c: &Compiled<'_>, s: &Stuck, states: usize) -> Counterexample {
    let stuck = c.ops[s.op].entry;
    let value = |id: u32| (id != 0).then(|| c.values[id as usize].to_vec());

    // Must-haves first, then candidates closest in time to the stuck operation.
    let mut picked: Vec<&Entry> = vec![stuck];
    if let Some(w) = s.last_write {
        picked.push(c.ops[w].entry);
    }
    picked.extend(s.prefix_tail.iter().map(|&i| c.ops[i].entry));
    let mut hint = None;
    let stuck_ret = c.ops[s.op].ret;
    if let Res::Value(Some(read)) = stuck.result().expect("a stuck op has a response") {
        // Latest write of the value read, among operations invoked before the get responded.
        let writes_of_read = |e: &Entry| e.op.value() == Some(read.as_slice());
        match c
            .all
            .iter()
            .filter(|e| writes_of_read(e))
            .filter(|e| e.invoke < stuck_ret)
            .max_by_key(|e| e.invoke)
        {
            Some(w) => picked.push(w),
            None if c.failed_writes.iter().any(|e| writes_of_read(e))
                && !c.all.iter().any(|e| writes_of_read(e)) =>
            {
                hint = Some(format!(
                    "the get returned {}, which only operations that answered Fail (definitely \
                     not applied) tried to write",
                    Bytes(read)
                ))
            }
            None if c.all.iter().any(|e| writes_of_read(e)) => {
                hint = Some(format!(
                    "the get returned {}, which is only written by operations invoked after \
                     the get responded (a read from the future)",
                    Bytes(read)
                ))
            }
            None => {
                hint = Some(format!(
                    "the get returned {}, which no operation on this key ever tried to write",
                    Bytes(read)
                ))
            }
        }
    }
    let mut candidates: Vec<&Entry> = s.candidates.iter().map(|&i| c.ops[i].entry).collect();
    candidates.sort_by_key(|e| std::cmp::Reverse(e.invoke));
    let mut not_shown = 0;
    for e in candidates {
        if picked.iter().any(|p| p.id == e.id) {
            continue;
        }
        if picked.len() < EXCERPT_MAX {
            picked.push(e);
        } else {
            not_shown += 1;
        }
    }
    picked.sort_by_key(|e| e.invoke);
    picked.dedup_by_key(|e| e.id);

    if hint.is_none() {
        hint = obvious_reading(c.ops[s.op], value(s.state).as_deref());
    }

    Counterexample {
        key: key.to_vec(),
        key_ops: c.ops.len() + c.unknown_gets,
        stuck: stuck.clone(),
        prefix_len: s.prefix_len,
        prefix_tail: s.prefix_tail.iter().map(|&i| c.ops[i].entry.id).collect(),
        value_after_prefix: value(s.state),
        excerpt: picked.into_iter().cloned().collect(),
        not_shown,
        hint,
        states_explored: states,
    }
}

fn obvious_reading(op: COp<'_>, state: Option<&[u8]>) -> Option<String> {
    let hint = match (op.kind, op.expect, state) {
        (Kind::Insert, Expect::Ok, Some(_)) => {
            "the insert succeeded although the key already existed in every order that got this \
             far (two inserts both succeeding?)"
        }
        (Kind::Get, Expect::Value(0), Some(_)) => {
            "the get found nothing although a write had taken effect and no delete could come \
             in between (a lost write?)"
        }
        (Kind::Get, Expect::Value(_), _) => {
            "the get returned a value the key did not hold at that point of the furthest order, \
             and no pending write could change that in time (a stale read or a lost write?)"
        }
        _ => return None,
    };
    Some(hint.to_string())
}
