//! Hand-made histories with a known verdict, a threaded recorder test, and property tests over
//! histories generated from a simulated linearizable register.

use std::collections::hash_map::Entry as Slot;
use std::collections::HashMap;
use std::sync::Mutex;

use proptest::prelude::*;

use crate::*;

fn k() -> Vec<u8> {
    b"k".to_vec()
}
fn get() -> Op {
    Op::Get { key: k() }
}
fn put(v: &str) -> Op {
    Op::Put {
        key: k(),
        value: v.into(),
    }
}
fn ins(v: &str) -> Op {
    Op::Insert {
        key: k(),
        value: v.into(),
    }
}
fn upd(v: &str) -> Op {
    Op::Update {
        key: k(),
        value: v.into(),
    }
}
fn del() -> Op {
    Op::Delete { key: k() }
}
fn val(v: &str) -> Res {
    Res::Value(Some(v.into()))
}
fn none() -> Res {
    Res::Value(None)
}

/// Invoke and complete back to back: an operation no other overlaps.
fn seq(h: &History, client: ClientId, op: Op, res: Res) -> OpId {
    let id = h.invoke(client, op);
    h.complete(id, res);
    id
}

fn rejected(h: &History) -> Counterexample {
    match check(h) {
        Err(Violation::NotLinearizable(c)) => {
            // Every rejection must render; print it so `--nocapture` shows what users see.
            println!("{c}");
            *c
        }
        other => panic!("expected a linearizability violation, got {other:?}"),
    }
}

#[test]
fn empty_history_passes() {
    let report = check(&History::new()).unwrap();
    assert_eq!(report, CheckReport::default());
}

#[test]
fn sequential_history_of_every_kind_passes() {
    let h = History::new();
    seq(&h, 1, get(), none());
    seq(&h, 1, upd("x"), Res::NotFound);
    seq(&h, 1, del(), Res::NotFound);
    seq(&h, 2, ins("a"), Res::Ok);
    seq(&h, 1, ins("b"), Res::AlreadyExists);
    seq(&h, 1, get(), val("a"));
    seq(&h, 2, upd("c"), Res::Ok);
    seq(&h, 1, get(), val("c"));
    seq(&h, 2, put("d"), Res::Ok);
    seq(&h, 1, get(), val("d"));
    seq(&h, 2, del(), Res::Ok);
    seq(&h, 1, get(), none());
    seq(&h, 2, put("e"), Res::Ok);
    seq(&h, 1, get(), val("e"));
    let report = check(&h).unwrap();
    assert_eq!((report.keys, report.ops, report.unknown_ops), (1, 14, 0));
}

#[test]
fn stale_read_after_completed_write_is_rejected() {
    let h = History::new();
    let p1 = seq(&h, 1, put("1"), Res::Ok);
    let p2 = seq(&h, 1, put("2"), Res::Ok);
    let g = seq(&h, 2, get(), val("1"));
    let c = rejected(&h);
    assert_eq!(c.key, k());
    assert_eq!(c.stuck.id, g);
    assert_eq!(c.prefix_len, 2);
    assert_eq!(c.value_after_prefix.as_deref(), Some(&b"2"[..]));
    let ids: Vec<OpId> = c.excerpt.iter().map(|e| e.id).collect();
    assert_eq!(
        ids,
        [p1, p2, g],
        "last write, the write of the value read, the read"
    );
    let text = c.to_string();
    assert!(text.contains("key b\"k\" is not linearizable"), "{text}");
    assert!(
        text.contains("> #2 client 2 [5, 6] get -> b\"1\""),
        "{text}"
    );
    assert!(
        text.contains("#1 client 1 [3, 4] put b\"2\" -> ok"),
        "{text}"
    );
}

#[test]
fn read_of_a_value_never_written_is_rejected() {
    let h = History::new();
    seq(&h, 1, put("1"), Res::Ok);
    seq(&h, 2, get(), val("zzz"));
    let c = rejected(&h);
    assert!(c
        .hint
        .as_deref()
        .unwrap()
        .contains("no operation on this key ever tried to write"));

    // Nor does a write that answered Fail count as written.
    let h = History::new();
    seq(&h, 1, put("1"), Res::Fail);
    seq(&h, 2, get(), val("1"));
    let c = rejected(&h);
    assert!(c.hint.as_deref().unwrap().contains("answered Fail"));
}

#[test]
fn failed_operations_are_ignored() {
    let h = History::new();
    seq(&h, 1, put("1"), Res::Fail);
    seq(&h, 1, ins("1"), Res::Fail);
    seq(&h, 2, get(), none());
    let report = check(&h).unwrap();
    assert_eq!((report.ops, report.failed_ops), (1, 2));
}

#[test]
fn lost_acknowledged_write_followed_by_reads_is_rejected() {
    let h = History::new();
    let p = seq(&h, 1, put("0"), Res::Ok);
    let d = seq(&h, 1, del(), Res::Ok);
    let w = seq(&h, 1, put("1"), Res::Ok);
    let g = seq(&h, 2, get(), none());
    seq(&h, 3, get(), none());
    seq(&h, 2, get(), none());
    let c = rejected(&h);
    assert_eq!(c.stuck.id, g, "the first read that missed the write");
    assert_eq!(
        c.excerpt.iter().map(|e| e.id).collect::<Vec<_>>(),
        [p, d, w, g]
    );
    assert!(c.hint.as_deref().unwrap().contains("lost write"));
}

#[test]
fn two_successful_inserts_are_rejected() {
    // One after the other.
    let h = History::new();
    seq(&h, 1, ins("a"), Res::Ok);
    seq(&h, 2, ins("b"), Res::Ok);
    let c = rejected(&h);
    assert!(c.hint.as_deref().unwrap().contains("two inserts"));

    // Overlapping: still only one of them can find the key absent.
    let h = History::new();
    let a = h.invoke(1, ins("a"));
    let b = h.invoke(2, ins("b"));
    h.complete(b, Res::Ok);
    h.complete(a, Res::Ok);
    rejected(&h);

    // With a delete in between, both may succeed.
    let h = History::new();
    seq(&h, 1, ins("a"), Res::Ok);
    seq(&h, 3, del(), Res::Ok);
    seq(&h, 2, ins("b"), Res::Ok);
    check(&h).unwrap();
}

#[test]
fn overlapping_operations_linearizable_in_some_order_pass() {
    // put 1 [1..8] and put 2 [2..7] overlap; the reads inside see 2 then 1, so the only order
    // is put 2, get, put 1, get, get; the last read, after both, agrees.
    let h = History::new();
    let p1 = h.invoke(1, put("1"));
    let p2 = h.invoke(2, put("2"));
    seq(&h, 3, get(), val("2"));
    seq(&h, 3, get(), val("1"));
    h.complete(p2, Res::Ok);
    h.complete(p1, Res::Ok);
    seq(&h, 3, get(), val("1"));
    check(&h).unwrap();

    // The same, but the final read sees 2: the first two reads force put 2 before put 1, and
    // nothing can overwrite 1 with 2 afterwards.
    let h = History::new();
    let p1 = h.invoke(1, put("1"));
    let p2 = h.invoke(2, put("2"));
    seq(&h, 3, get(), val("2"));
    seq(&h, 3, get(), val("1"));
    h.complete(p2, Res::Ok);
    h.complete(p1, Res::Ok);
    seq(&h, 3, get(), val("2"));
    rejected(&h);

    // Racing inserts: the loser sees the winner's value, whoever was invoked first.
    let h = History::new();
    let a = h.invoke(1, ins("a"));
    let b = h.invoke(2, ins("b"));
    h.complete(a, Res::AlreadyExists);
    h.complete(b, Res::Ok);
    seq(&h, 1, get(), val("b"));
    check(&h).unwrap();

    // A delete overlapping a read and an update.
    let h = History::new();
    seq(&h, 1, put("a"), Res::Ok);
    let d = h.invoke(1, del());
    let g = h.invoke(2, get());
    let u = h.invoke(3, upd("u"));
    h.complete(g, none());
    h.complete(u, Res::NotFound);
    h.complete(d, Res::Ok);
    seq(&h, 2, get(), none());
    check(&h).unwrap();
}

#[test]
fn unknown_outcome_write_explains_a_later_read() {
    let h = History::new();
    seq(&h, 1, put("0"), Res::Ok);
    let w = h.invoke(1, put("1"));
    h.complete_unknown(w);
    // It may take effect late: reads see the old value, then the new one, forever after.
    seq(&h, 2, get(), val("0"));
    seq(&h, 2, get(), val("1"));
    seq(&h, 3, get(), val("1"));
    let report = check(&h).unwrap();
    assert_eq!((report.ops, report.unknown_ops), (5, 1));

    // Once observed, it cannot un-happen.
    seq(&h, 3, get(), val("0"));
    rejected(&h);

    // An operation never completed behaves the same, and so does an unknown delete.
    let h = History::new();
    seq(&h, 1, ins("0"), Res::Ok);
    let _pending = h.invoke(1, upd("1"));
    let d = h.invoke(3, del());
    h.complete_unknown(d);
    seq(&h, 2, get(), val("1"));
    seq(&h, 2, ins("2"), Res::Ok);
    seq(&h, 2, get(), val("2"));
    check(&h).unwrap();
}

#[test]
fn unknown_outcome_write_never_observed_passes() {
    let h = History::new();
    seq(&h, 1, put("1"), Res::Ok);
    let w = h.invoke(1, put("2"));
    h.complete_unknown(w);
    let g = h.invoke(9, get());
    h.complete_unknown(g);
    for client in 2..6 {
        seq(&h, client, get(), val("1"));
    }
    let report = check(&h).unwrap();
    assert_eq!((report.ops, report.unknown_ops), (7, 2));
}

#[test]
fn unknown_outcome_write_cannot_explain_an_earlier_read() {
    let h = History::new();
    seq(&h, 2, get(), val("1"));
    let w = h.invoke(1, put("1"));
    h.complete_unknown(w);
    let c = rejected(&h);
    assert!(c.hint.as_deref().unwrap().contains("read from the future"));
}

#[test]
fn keys_are_checked_independently() {
    let h = History::new();
    seq(
        &h,
        1,
        Op::Put {
            key: b"a".to_vec(),
            value: b"1".to_vec(),
        },
        Res::Ok,
    );
    seq(&h, 2, Op::Get { key: b"b".to_vec() }, none());
    seq(&h, 2, Op::Get { key: b"a".to_vec() }, val("1"));
    seq(&h, 1, Op::Delete { key: b"c".to_vec() }, Res::NotFound);
    assert_eq!(check(&h).unwrap().keys, 3);

    seq(
        &h,
        1,
        Op::Put {
            key: b"b".to_vec(),
            value: b"2".to_vec(),
        },
        Res::Ok,
    );
    seq(&h, 2, Op::Get { key: b"b".to_vec() }, none());
    match check(&h) {
        Err(v) => {
            assert_eq!(v.key(), b"b");
            assert!(v.to_string().contains("key b\"b\""), "{v}");
        }
        Ok(r) => panic!("accepted {r:?}"),
    }
}

#[test]
fn search_bound_gives_undecided_never_a_pass() {
    // 12 writes all overlapping, then reads: up to 2^12 orders of the writes to try.
    let build = |reads: &[&str]| {
        let h = History::new();
        let ids: Vec<OpId> = (0..12u64)
            .map(|i| h.invoke(i, put(&i.to_string())))
            .collect();
        for id in ids {
            h.complete(id, Res::Ok);
        }
        for r in reads {
            seq(&h, 100, get(), val(r));
        }
        h
    };
    let tiny = CheckOptions {
        max_states_per_key: 50,
    };
    let good = build(&["0"]);
    match check_with(&good, &tiny) {
        Err(Violation::Undecided {
            key,
            ops,
            unknown,
            explored,
            limit,
        }) => {
            assert_eq!((key, ops, unknown, explored, limit), (k(), 13, 0, 50, 50));
        }
        other => panic!("expected undecided, got {other:?}"),
    }
    let msg = check_with(&good, &tiny).unwrap_err().to_string();
    assert!(msg.contains("max_states_per_key"), "{msg}");
    check(&good).unwrap();

    // A violation under a tiny bound is either found or undecided, never accepted.
    let bad = build(&["0", "1"]);
    assert!(matches!(
        check_with(&bad, &tiny),
        Err(Violation::Undecided { .. })
    ));
    let c = rejected(&bad);
    assert!(
        c.states_explored > 4096,
        "exhaustive: {}",
        c.states_explored
    );
}

#[test]
fn many_unknown_outcomes_stay_tractable() {
    // 40 unknown-outcome writes, all pending for the whole history, observed one by one; then a
    // read that no subset or order of them explains. Without dominance between configurations
    // this needs about 2^40 states.
    let build = |last: &str| {
        let h = History::new();
        for i in 0..40u64 {
            let id = h.invoke(i, put(&i.to_string()));
            h.complete_unknown(id);
        }
        for i in 0..40u64 {
            seq(&h, 100, get(), val(&i.to_string()));
        }
        seq(&h, 100, get(), val(last));
        h
    };
    let report = check(&build("39")).unwrap();
    assert_eq!((report.ops, report.unknown_ops), (81, 40));
    let c = rejected(&build("3"));
    assert!(c.states_explored < 100_000, "{}", c.states_explored);
}

#[test]
fn malformed_histories_are_reported() {
    let h = History::new();
    seq(&h, 1, get(), Res::Ok);
    assert!(matches!(
        check(&h),
        Err(Violation::Malformed { reason, .. }) if reason.contains("get must be answered")
    ));
    let h = History::new();
    seq(&h, 1, put("1"), Res::AlreadyExists);
    assert!(matches!(check(&h), Err(Violation::Malformed { .. })));

    // Hand-built entries can be inconsistent in time as well.
    let entries = [Entry {
        id: OpId::from_index(0),
        client: 1,
        op: put("1"),
        invoke: 5,
        outcome: Outcome::Done {
            at: 5,
            res: Res::Ok,
        },
    }];
    let err = check_entries(&entries, &CheckOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("at or before its invocation"),
        "{err}"
    );
}

#[test]
fn equal_timestamps_in_hand_built_entries_read_as_overlapping() {
    let entry = |id, op, invoke, at, res| Entry {
        id: OpId::from_index(id),
        client: id as ClientId,
        op,
        invoke,
        outcome: Outcome::Done { at, res },
    };
    // The get starts when the put responds: they may overlap, so the get may miss it.
    let entries = [
        entry(0, put("1"), 1, 2, Res::Ok),
        entry(1, get(), 2, 3, none()),
    ];
    check_entries(&entries, &CheckOptions::default()).unwrap();
    let entries = [
        entry(0, put("1"), 1, 2, Res::Ok),
        entry(1, get(), 3, 4, none()),
    ];
    assert!(check_entries(&entries, &CheckOptions::default()).is_err());
}

#[test]
#[should_panic(expected = "completed twice")]
fn completing_twice_panics() {
    let h = History::new();
    let id = seq(&h, 1, get(), none());
    h.complete_unknown(id);
}

#[test]
fn long_values_are_shortened_in_reports() {
    let h = History::new();
    let long = "x".repeat(100);
    seq(&h, 1, put(&long), Res::Ok);
    seq(&h, 2, get(), val("\u{1}y"));
    let text = rejected(&h).to_string();
    assert!(text.contains("...(100 bytes)"), "{text}");
    assert!(text.contains("b\"\\x01y\""), "{text}");
}

/// Many threads recording against a map behind a lock (linearizable by construction).
#[test]
fn threaded_recording_of_a_linearizable_store_passes() {
    let store = Mutex::new(HashMap::<Vec<u8>, Vec<u8>>::new());
    let h = History::new();
    std::thread::scope(|s| {
        for client in 0..4u64 {
            let (h, store) = (&h, &store);
            s.spawn(move || {
                for i in 0..300u64 {
                    let key = vec![b'a' + (i % 3) as u8];
                    let value = format!("{client}.{i}").into_bytes();
                    let op = match (i + client) % 5 {
                        0 => Op::Get { key },
                        1 => Op::Put { key, value },
                        2 => Op::Insert { key, value },
                        3 => Op::Update { key, value },
                        _ => Op::Delete { key },
                    };
                    let id = h.invoke(client, op.clone());
                    let res = apply(&mut store.lock().unwrap(), &op);
                    if i % 50 == 7 {
                        h.complete_unknown(id);
                    } else {
                        h.complete(id, res);
                    }
                }
            });
        }
    });
    let report = check(&h).unwrap();
    assert_eq!((report.keys, report.ops), (3, 1200));
}

#[test]
fn long_histories_are_fast() {
    // 20 000 operations on one key, in overlapping pairs.
    let h = History::new();
    for i in 0..5_000u64 {
        let v = i.to_string();
        let a = h.invoke(1, put(&v));
        let b = h.invoke(2, get());
        h.complete(a, Res::Ok);
        h.complete(b, val(&v));
        let c = h.invoke(3, get());
        let d = h.invoke(4, get());
        h.complete(d, val(&v));
        h.complete(c, val(&v));
    }
    let report = check(&h).unwrap();
    assert_eq!(report.ops, 20_000);
    assert!(report.max_states_one_key < 100_000, "{report:?}");
}

// ---------------------------------------------------------------------------------------------
// Property tests: histories of a simulated linearizable register.

/// One recorder call, in the order the simulation made it.
#[derive(Debug, Clone)]
enum Call {
    Invoke(ClientId, Op),
    Complete(usize, Res),
    Unknown(usize),
}

/// What happens to an invoked operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Applied, then the client gets the answer.
    Normal,
    /// Rejected before execution: never applied, answered Fail.
    Fail,
    /// Applied, but the answer is lost.
    AppliedUnknown,
    /// Never applied, and the client cannot tell.
    LostUnknown,
    /// The client gives up first; the request is applied later (or never) while the client
    /// moves on.
    Zombie,
}

#[derive(Debug)]
enum Client {
    Idle,
    Invoked { idx: usize, op: Op, fate: Fate },
    Applied { idx: usize, res: Option<Res> },
}

fn apply(map: &mut HashMap<Vec<u8>, Vec<u8>>, op: &Op) -> Res {
    match op.clone() {
        Op::Get { key } => Res::Value(map.get(&key).cloned()),
        Op::Put { key, value } => {
            map.insert(key, value);
            Res::Ok
        }
        Op::Insert { key, value } => match map.entry(key) {
            Slot::Occupied(_) => Res::AlreadyExists,
            Slot::Vacant(slot) => {
                slot.insert(value);
                Res::Ok
            }
        },
        Op::Update { key, value } => match map.get_mut(&key) {
            Some(v) => {
                *v = value;
                Res::Ok
            }
            None => Res::NotFound,
        },
        Op::Delete { key } => match map.remove(&key) {
            Some(_) => Res::Ok,
            None => Res::NotFound,
        },
    }
}

/// Runs the simulation: each step advances one client (invoke, then take effect atomically,
/// then respond), so other clients' steps interleave inside every interval.
fn simulate(clients: usize, keys: u8, values: u8, steps: &[(u8, u8, u8, u8)]) -> Vec<Call> {
    let mut map = HashMap::new();
    let mut state: Vec<Client> = (0..clients).map(|_| Client::Idle).collect();
    let mut zombies: Vec<Op> = Vec::new();
    let mut calls = Vec::new();
    let mut invoked = 0;
    for &(who, a, b, c) in steps {
        if !zombies.is_empty() && c % 8 == 0 {
            let op = zombies.swap_remove(b as usize % zombies.len());
            apply(&mut map, &op);
        }
        let who = who as usize % clients;
        state[who] = match std::mem::replace(&mut state[who], Client::Idle) {
            Client::Idle => {
                let key = vec![b'a' + b % keys];
                let value = vec![b'0' + c % values];
                let op = match a % 8 {
                    0..=2 => Op::Get { key },
                    3 => Op::Put { key, value },
                    4 => Op::Insert { key, value },
                    5 => Op::Update { key, value },
                    6 => Op::Delete { key },
                    _ => Op::Put { key, value },
                };
                let fate = match (a / 8) % 16 {
                    0 => Fate::Fail,
                    1 => Fate::AppliedUnknown,
                    2 => Fate::LostUnknown,
                    3 => Fate::Zombie,
                    _ => Fate::Normal,
                };
                calls.push(Call::Invoke(who as ClientId, op.clone()));
                invoked += 1;
                Client::Invoked {
                    idx: invoked - 1,
                    op,
                    fate,
                }
            }
            Client::Invoked { idx, op, fate } => match fate {
                Fate::Normal => Client::Applied {
                    idx,
                    res: Some(apply(&mut map, &op)),
                },
                Fate::Fail => Client::Applied {
                    idx,
                    res: Some(Res::Fail),
                },
                Fate::AppliedUnknown => {
                    apply(&mut map, &op);
                    Client::Applied { idx, res: None }
                }
                Fate::LostUnknown => Client::Applied { idx, res: None },
                Fate::Zombie => {
                    calls.push(Call::Unknown(idx));
                    zombies.push(op);
                    Client::Idle
                }
            },
            Client::Applied { idx, res } => {
                calls.push(match res {
                    Some(res) => Call::Complete(idx, res),
                    None => Call::Unknown(idx),
                });
                Client::Idle
            }
        };
    }
    // Clients still busy never complete (pending ops); zombies may never apply.
    calls
}

fn replay(calls: &[Call]) -> History {
    let h = History::new();
    let mut ids = Vec::new();
    for call in calls {
        match call {
            Call::Invoke(client, op) => ids.push(h.invoke(*client, op.clone())),
            Call::Complete(idx, res) => h.complete(ids[*idx], res.clone()),
            Call::Unknown(idx) => h.complete_unknown(ids[*idx]),
        }
    }
    h
}

/// Get results that no linearization can produce, as (index of the Get, new result). For each
/// known-result Get: a value no operation invoked before the Get responded writes (a value
/// written only later, or a fresh one); and "not found" when a write completed before the Get
/// was invoked and no delete on the key was invoked before it responded.
fn impossible_reads(entries: &[Entry]) -> Vec<(usize, Res)> {
    let mut out = Vec::new();
    for (gi, g) in entries.iter().enumerate() {
        let (
            Op::Get { key },
            Outcome::Done {
                at: g_ret,
                res: Res::Value(_),
            },
        ) = (&g.op, &g.outcome)
        else {
            continue;
        };
        let same_key = || {
            entries
                .iter()
                .filter(move |e| e.op.key() == key && e.result() != Some(&Res::Fail))
        };
        let future = same_key()
            .filter(|e| e.invoke > *g_ret)
            .filter_map(|e| e.op.value())
            .find(|v| !same_key().any(|w| w.invoke < *g_ret && w.op.value() == Some(*v)));
        let value = future.map_or(b"never written".to_vec(), <[u8]>::to_vec);
        out.push((gi, Res::Value(Some(value))));

        let written_before = same_key().any(|e| {
            matches!(e.op, Op::Put { .. } | Op::Insert { .. } | Op::Update { .. })
                && matches!(e.outcome, Outcome::Done { at, res: Res::Ok } if at < g.invoke)
        });
        let deleted = same_key().any(|e| matches!(e.op, Op::Delete { .. }) && e.invoke < *g_ret);
        if written_before && !deleted {
            out.push((gi, Res::Value(None)));
        }
    }
    out
}

/// (clients, keys, distinct values, scheduler steps) for [`simulate`].
type SimParams = (usize, u8, u8, Vec<(u8, u8, u8, u8)>);

fn history_strategy() -> impl Strategy<Value = SimParams> {
    (
        2usize..=5,
        1u8..=3,
        1u8..=4,
        proptest::collection::vec(any::<(u8, u8, u8, u8)>(), 0..400),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn simulated_linearizable_histories_pass(
        (clients, keys, values, steps) in history_strategy()
    ) {
        let h = replay(&simulate(clients, keys, values, &steps));
        if let Err(v) = check(&h) {
            prop_assert!(false, "rejected a linearizable history:\n{v}");
        }
    }

    #[test]
    fn one_impossible_read_is_rejected(
        (clients, keys, values, steps) in history_strategy(),
        pick in any::<prop::sample::Index>(),
    ) {
        let mut calls = simulate(clients, keys, values, &steps);
        let entries = replay(&calls).entries();
        let candidates = impossible_reads(&entries);
        prop_assume!(!candidates.is_empty());
        let (get_idx, bad) = candidates[pick.index(candidates.len())].clone();
        for call in &mut calls {
            if let Call::Complete(idx, res) = call {
                if *idx == get_idx {
                    *res = bad.clone();
                }
            }
        }
        match check(&replay(&calls)) {
            Err(Violation::NotLinearizable(c)) => {
                prop_assert_eq!(&c.key, entries[get_idx].op.key());
            }
            other => prop_assert!(false, "mutated read #{} to {:?}: got {:?}", get_idx, bad, other),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cross-check against a brute-force search on small, possibly wrong, histories.

/// The sequential register, written independently of the checker: the result `op` gets from
/// `state`, and the state after.
fn spec(state: &Option<Vec<u8>>, op: &Op) -> (Res, Option<Vec<u8>>) {
    let mut map = HashMap::new();
    if let Some(v) = state {
        map.insert(op.key().to_vec(), v.clone());
    }
    let res = apply(&mut map, op);
    (res, map.remove(op.key()))
}

/// Plain Wing & Gong: try every operation that real time allows next, no memo, no reductions.
fn brute_force(entries: &[&Entry]) -> bool {
    fn rec(ops: &[&Entry], used: &mut Vec<bool>, state: &Option<Vec<u8>>) -> bool {
        let done = |i: usize| used[i] || ops[i].complete_time().is_none();
        if (0..ops.len()).all(done) {
            return true;
        }
        for i in 0..ops.len() {
            let blocked = (0..ops.len()).any(|j| {
                !used[j] && j != i && ops[j].complete_time().is_some_and(|t| t < ops[i].invoke)
            });
            if used[i] || blocked {
                continue;
            }
            let (res, next) = spec(state, &ops[i].op);
            if ops[i].result().is_some_and(|r| *r != res) {
                continue;
            }
            used[i] = true;
            if rec(ops, used, &next) {
                return true;
            }
            used[i] = false;
        }
        false
    }
    let ops: Vec<&Entry> = entries
        .iter()
        .copied()
        .filter(|e| e.result() != Some(&Res::Fail))
        .collect();
    rec(&ops, &mut vec![false; ops.len()], &None)
}

/// A result of the right kind for `op`, picked by `x`.
fn some_result(op: &Op, x: u8) -> Option<Res> {
    if x.is_multiple_of(5) {
        return None;
    }
    Some(match op {
        Op::Get { .. } if x.is_multiple_of(3) => Res::Value(None),
        Op::Get { .. } => Res::Value(Some(vec![b'0' + x % 3])),
        Op::Put { .. } => Res::Ok,
        Op::Insert { .. } if x.is_multiple_of(2) => Res::AlreadyExists,
        Op::Update { .. } | Op::Delete { .. } if x.is_multiple_of(2) => Res::NotFound,
        _ => Res::Ok,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn agrees_with_brute_force_on_small_histories(
        (clients, keys, values, steps) in (2usize..=4, 1u8..=2, 1u8..=3,
            proptest::collection::vec(any::<(u8, u8, u8, u8)>(), 0..28)),
        corruptions in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    ) {
        let mut calls = simulate(clients, keys, values, &steps);
        // Corrupt a few results (keeping them of the right kind) so both verdicts occur.
        let invoked: Vec<Op> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Invoke(_, op) => Some(op.clone()),
                _ => None,
            })
            .collect();
        let mut finished: Vec<usize> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Complete(i, _) | Call::Unknown(i) => Some(*i),
                Call::Invoke(..) => None,
            })
            .collect();
        finished.sort_unstable();
        for (pick, x) in &corruptions {
            if finished.is_empty() {
                break;
            }
            let target = finished[pick.index(finished.len())];
            for c in &mut calls {
                match c {
                    Call::Complete(i, _) | Call::Unknown(i) if *i == target => {
                        *c = match some_result(&invoked[target], *x) {
                            Some(res) => Call::Complete(target, res),
                            None => Call::Unknown(target),
                        };
                    }
                    _ => {}
                }
            }
        }
        let entries = replay(&calls).entries();
        let mut by_key: HashMap<&[u8], Vec<&Entry>> = HashMap::new();
        for e in &entries {
            by_key.entry(e.op.key()).or_default().push(e);
        }
        // The brute force is factorial: keep it to small sub-histories.
        if by_key.values().any(|es| es.len() > 10) {
            return Ok(());
        }
        let expected = by_key.values().all(|es| brute_force(es));
        match check_entries(&entries, &CheckOptions::default()) {
            Ok(_) => prop_assert!(expected, "accepted a non-linearizable history: {entries:#?}"),
            Err(Violation::NotLinearizable(c)) => {
                prop_assert!(!expected, "rejected a linearizable history:\n{c}");
            }
            Err(other) => prop_assert!(false, "{other}"),
        }
    }
}
