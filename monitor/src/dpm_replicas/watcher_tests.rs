//! Rounds of [`Watcher`] against scripted members ([`Replicas`]), a scripted Lease
//! ([`Leadership`]) and a recording [`PrimaryPointer`]: what the watcher sends, in which
//! order, and what it refrains from. The plan's rules are tested in `plan.rs`; here, what the
//! watcher does with its answers (the note before every Promote, refusals, Promotes not sent,
//! pins read from a note, standbys), which only real dpm-nodes exercised before
//! (cli/tests/integration/dpm_auto_failover.rs).
//!
//! Time is real: the plan reads `std::time::Instant`, which tokio's paused clock does not move.
//! `failover_after` is [`AFTER`] and a test sleeps past it at most twice.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::plan::{primary_of, MemberStatus, Role, Seen};
use super::*;

const AFTER: Duration = Duration::from_millis(200);
/// `promotion_stuck_after_ms` of the watchers here.
/// Well above [`AFTER`]: a check that a round comes before it must hold on a loaded machine.
const STUCK_AFTER_PROMOTE: Duration = Duration::from_millis(3000);
const P: &str = "p:1";
const B1: &str = "b1:1";
const B2: &str = "b2:1";

/// What the watcher did to the members, the Lease and the clients, in order.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    NoteWritten(String),
    NoteRemoved,
    Promote {
        backup: String,
        others: Vec<String>,
        min_term: u64,
    },
    AddBackup {
        primary: String,
        backup: String,
    },
    PointAt(String),
}

/// How the Lease answers a write of the note.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Write {
    Done,
    /// `Ok(false)`: the Lease changed under the write.
    NotWritten,
    Fails,
}

#[derive(Debug)]
struct State {
    /// Each member's Status answer; a member not here does not answer.
    status: HashMap<String, Seen>,
    /// Each member's next Promote answers; none left: `Ok`.
    promote: HashMap<String, VecDeque<Result<(), PromoteError>>>,
    leads: bool,
    note_write: Write,
    note_removal: Write,
    note_read_fails: bool,
    /// The note the Lease holds.
    lease_note: Option<String>,
    calls: Vec<Call>,
}

/// The members, the Lease and the clients at once, so that one record orders their calls.
#[derive(Debug, Clone)]
struct World(Arc<Mutex<State>>);

impl World {
    fn new(leads: bool) -> Self {
        World(Arc::new(Mutex::new(State {
            status: HashMap::new(),
            promote: HashMap::new(),
            leads,
            note_write: Write::Done,
            note_removal: Write::Done,
            note_read_fails: false,
            lease_note: None,
            calls: Vec::new(),
        })))
    }

    fn watcher(&self) -> Watcher {
        let members = [P, B1, B2]
            .map(|a| MemberConfig {
                address: a.into(),
                pod: String::new(),
            })
            .to_vec();
        let cfg = DpmReplicasConfig {
            members,
            check_every_ms: 50,
            failover_after_ms: AFTER.as_millis() as u64,
            status_timeout_ms: 100,
            promotion_stuck_after_ms: STUCK_AFTER_PROMOTE.as_millis() as u64,
            ..DpmReplicasConfig::default()
        };
        cfg.validate(false).unwrap();
        Watcher::new(cfg, Box::new(self.clone()), Box::new(self.clone()))
            .with_replicas(Arc::new(self.clone()))
    }

    fn answers(&self, addr: &str, seen: Seen) {
        self.0.lock().status.insert(addr.into(), seen);
    }

    fn silent(&self, addr: &str) {
        self.0.lock().status.remove(addr);
    }

    fn promote_answers(&self, addr: &str, answers: Vec<Result<(), PromoteError>>) {
        self.0.lock().promote.insert(addr.into(), answers.into());
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.0.lock())
    }

    fn calls(&self) -> Vec<Call> {
        self.0.lock().calls.clone()
    }

    /// The calls made since the last `take`.
    fn take(&self) -> Vec<Call> {
        std::mem::take(&mut self.0.lock().calls)
    }

    /// p serves under term 3 with b1 and b2 in sync.
    fn steady(&self) {
        self.answers(P, primary_of(3, &[(B1, "in-sync"), (B2, "in-sync")]));
        self.answers(B1, backup(3));
        self.answers(B2, backup(3));
    }
}

#[async_trait]
impl Replicas for World {
    async fn status(&self, addr: &str, _timeout: Duration) -> Seen {
        let s = self.0.lock();
        s.status
            .get(addr)
            .cloned()
            .unwrap_or_else(|| Err("connection refused".into()))
    }

    async fn promote(
        &self,
        backup: &str,
        others: Vec<String>,
        min_term: u64,
    ) -> Result<(), PromoteError> {
        let mut s = self.0.lock();
        let answer = s
            .promote
            .get_mut(backup)
            .and_then(|a| a.pop_front())
            .unwrap_or(Ok(()));
        // A Promote that was not sent reached nobody: not recorded.
        if !matches!(answer, Err(PromoteError::NotSent(_))) {
            s.calls.push(Call::Promote {
                backup: backup.into(),
                others,
                min_term,
            });
        }
        answer
    }

    async fn add_backup(&self, primary: &str, backup: &str) -> anyhow::Result<()> {
        self.0.lock().calls.push(Call::AddBackup {
            primary: primary.into(),
            backup: backup.into(),
        });
        Ok(())
    }
}

#[async_trait]
impl Leadership for World {
    async fn leads(&self) -> bool {
        self.0.lock().leads
    }

    async fn leave_note(&self, note: Option<String>) -> anyhow::Result<bool> {
        let mut s = self.0.lock();
        let answer = match note {
            Some(_) => s.note_write,
            None => s.note_removal,
        };
        match answer {
            Write::Done => {
                s.calls.push(match &note {
                    Some(n) => Call::NoteWritten(n.clone()),
                    None => Call::NoteRemoved,
                });
                s.lease_note = note;
                Ok(true)
            }
            Write::NotWritten => Ok(false),
            Write::Fails => anyhow::bail!("the API server answers 500"),
        }
    }

    async fn note(&self) -> anyhow::Result<Option<String>> {
        let s = self.0.lock();
        if s.note_read_fails {
            anyhow::bail!("the API server answers 500");
        }
        Ok(s.lease_note.clone())
    }
}

#[async_trait]
impl PrimaryPointer for World {
    async fn point_at(&self, members: &[MemberConfig], to: usize) -> anyhow::Result<()> {
        self.0
            .lock()
            .calls
            .push(Call::PointAt(members[to].address.clone()));
        Ok(())
    }
}

/// A backup holding a complete copy made under `term`.
fn backup(term: u64) -> Seen {
    Ok(MemberStatus {
        role: Role::Backup,
        term,
        generation: 0,
        copy_complete: true,
        copy_term: term,
        backups: Vec::new(),
        not_promotable: None,
    })
}

/// A backup holding a complete copy made under `term` that says it would refuse a Promote.
fn unpromotable(term: u64) -> Seen {
    let mut seen = backup(term);
    if let Ok(s) = &mut seen {
        s.not_promotable = Some("may pin only 1048576 bytes".into());
    }
    seen
}

fn promote_of(backup: &str, others: [&str; 2]) -> Call {
    Call::Promote {
        backup: backup.into(),
        others: others.map(String::from).to_vec(),
        min_term: 3,
    }
}

/// Whose Promotes were sent, in order.
fn promoted(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Promote { backup, .. } => Some(backup.clone()),
            _ => None,
        })
        .collect()
}

fn is_note_of(call: &Call, backup: &str) -> bool {
    matches!(call, Call::NoteWritten(n) if n.starts_with(&format!("{backup} 3 ")))
}

/// The next round waits, naming `member`.
async fn waits_for(watcher: &mut Watcher, member: &str) {
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Waiting(why) if why.contains(member)),
        "{o:?}"
    );
}

/// The next round waits for `member`; once `promotion_stuck_after_ms` passed, one reports the
/// failover stuck on it.
async fn waits_then_is_stuck_on(watcher: &mut Watcher, member: &str) {
    waits_for(watcher, member).await;
    tokio::time::sleep(STUCK_AFTER_PROMOTE).await;
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Stuck(why) if why.contains(member) && why.contains("promotion_stuck_after_ms")),
        "{o:?}"
    );
}

/// The leader has seen p serve, then p stopped answering for longer than [`AFTER`]: the next
/// round fails over.
async fn leader_past_failover(w: &World) -> Watcher {
    let mut watcher = w.watcher();
    w.steady();
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    w.silent(P);
    assert!(matches!(watcher.round().await, Outcome::Waiting(_)));
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    w.take();
    watcher
}

#[tokio::test]
async fn a_serving_primary_is_pointed_at_once_and_nothing_is_promoted() {
    let w = World::new(true);
    let mut watcher = w.watcher();
    w.steady();
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    assert_eq!(w.take(), vec![Call::PointAt(P.into())]);
    // Labelled already: not patched again every round; no note was left, none removed.
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    assert_eq!(w.take(), vec![]);
}

#[tokio::test]
async fn a_silent_primary_is_failed_over_with_the_note_written_before_the_promote() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    let calls = w.take();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(is_note_of(&calls[0], B1), "{calls:?}");
    assert_eq!(calls[1], promote_of(B1, [P, B2]));
    // Pointed at once: the clients' next connection finds it as soon as it serves.
    assert_eq!(calls[2], Call::PointAt(B1.into()));
    // b1 opens its pool: it answers nothing, it is waited for, and nobody else is promoted.
    w.silent(B1);
    waits_for(&mut watcher, B1).await;
    assert_eq!(w.take(), vec![]);
    // b1 serves under its new term, b2 not in sync yet: labelled again under that term; the
    // note stays (a next leader must know p is replaced)...
    w.answers(B1, primary_of(4, &[(B2, "syncing")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::PointAt(B1.into())]);
    assert!(w.with(|s| s.lease_note.clone()).is_some());
    // ...until b2 is in sync.
    w.answers(B1, primary_of(4, &[(B2, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::NoteRemoved]);
    assert_eq!(w.with(|s| s.lease_note.clone()), None);
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![]);
}

#[tokio::test]
async fn no_promote_is_sent_in_a_round_whose_note_was_not_written() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.with(|s| s.note_write = Write::Fails);
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Failed(why) if why.contains("noting the promotion of b1:1")),
        "{o:?}"
    );
    assert_eq!(w.take(), vec![]);
    // The Lease changed under the write: another monitor may lead.
    w.with(|s| s.note_write = Write::NotWritten);
    assert_eq!(watcher.round().await, Outcome::Standby);
    assert_eq!(w.take(), vec![]);
    w.with(|s| s.note_write = Write::Done);
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    assert_eq!(promoted(&w.take()), vec![B1]);
}

#[tokio::test]
async fn a_refused_promote_forgets_its_note_and_the_other_backup_is_promoted() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(
        B1,
        vec![Err(PromoteError::Refused("copy incomplete".into()))],
    );
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Failed(why) if why.contains("refused")),
        "{o:?}"
    );
    let calls = w.take();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(is_note_of(&calls[0], B1), "{calls:?}");
    assert_eq!(calls[1..], [promote_of(B1, [P, B2]), Call::NoteRemoved]);
    assert_eq!(w.with(|s| s.lease_note.clone()), None);
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 2 });
    let calls = w.take();
    assert!(is_note_of(&calls[0], B2), "{calls:?}");
    assert_eq!(
        calls[1..],
        [promote_of(B2, [P, B1]), Call::PointAt(B2.into())]
    );
}

#[tokio::test]
async fn a_refused_backup_is_not_asked_again_from_the_same_observation() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    for b in [B1, B2] {
        w.promote_answers(b, vec![Err(PromoteError::Refused("no".into()))]);
    }
    for _ in 0..2 {
        let o = watcher.round().await;
        assert!(matches!(o, Outcome::Failed(_)), "{o:?}");
    }
    // Both refused: stuck, for an operator; neither is asked again.
    for _ in 0..2 {
        let o = watcher.round().await;
        assert!(
            matches!(&o, Outcome::Stuck(why) if why.contains("b1:1, b2:1 refused")),
            "{o:?}"
        );
    }
    assert_eq!(promoted(&w.calls()), vec![B1, B2]);
    assert_eq!(w.with(|s| s.lease_note.clone()), None);
}

#[tokio::test]
async fn a_note_whose_removal_failed_after_a_refusal_pins_nothing_and_goes_once_a_primary_serves() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(B1, vec![Err(PromoteError::Refused("no".into()))]);
    w.with(|s| s.note_removal = Write::Fails);
    let o = watcher.round().await;
    assert!(matches!(o, Outcome::Failed(_)), "{o:?}");
    assert!(w.with(|s| s.lease_note.clone()).is_some());
    // Forgotten though still on the Lease: b2 is promoted, not waited for b1.
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 2 });
    w.with(|s| s.note_removal = Write::Done);
    w.answers(B2, primary_of(4, &[(B1, "in-sync")]));
    w.take();
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 2 });
    assert_eq!(w.take(), vec![Call::PointAt(B2.into()), Call::NoteRemoved]);
}

#[tokio::test]
async fn a_promote_not_sent_to_a_backup_not_pinned_tries_the_other_backup_first() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(B1, vec![Err(PromoteError::NotSent("refused".into()))]);
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Failed(why) if why.contains("not sent")),
        "{o:?}"
    );
    let calls = w.take();
    assert!(is_note_of(&calls[0], B1), "{calls:?}");
    assert_eq!(calls[1..], [Call::NoteRemoved]);
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 2 });
    assert_eq!(promoted(&w.take()), vec![B2]);
}

#[tokio::test]
async fn a_promote_not_sent_to_a_pinned_backup_asks_it_again() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(
        B1,
        vec![
            Err(PromoteError::Unknown("DeadlineExceeded".into())),
            Err(PromoteError::NotSent("connection refused".into())),
        ],
    );
    // No answer: b1 may be promoting itself; it is pinned.
    let o = watcher.round().await;
    assert!(matches!(o, Outcome::Failed(_)), "{o:?}");
    // The call did not arrive (b1 still a backup of term 3): asked again, not sent this time.
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Failed(why) if why.contains("asking it again")),
        "{o:?}"
    );
    let calls = w.take();
    assert!(!calls.contains(&Call::NoteRemoved), "{calls:?}");
    assert!(w
        .with(|s| s.lease_note.clone())
        .is_some_and(|n| n.starts_with("b1:1 3 ")));
    // Still b1, never b2.
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    assert_eq!(promoted(&calls), vec![B1]);
    assert_eq!(promoted(&w.take()), vec![B1]);
}

#[tokio::test]
async fn a_promote_of_unknown_outcome_is_waited_for_and_followed() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(B1, vec![Err(PromoteError::Unknown("AlreadyExists".into()))]);
    let o = watcher.round().await;
    assert!(matches!(o, Outcome::Failed(_)), "{o:?}");
    w.silent(B1);
    waits_for(&mut watcher, B1).await;
    // Past failover_after it may still be opening its pool: waited for, no alarm...
    tokio::time::sleep(AFTER).await;
    // ...stuck only after promotion_stuck_after_ms.
    waits_then_is_stuck_on(&mut watcher, B1).await;
    assert_eq!(promoted(&w.take()), vec![B1]);
    w.answers(B1, primary_of(4, &[(B2, "syncing")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::PointAt(B1.into())]);
    w.answers(B1, primary_of(4, &[(B2, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::NoteRemoved]);
}

/// A standby started after p died, so holding no observation; the Lease notes b1's promotion
/// from term 3; b2 is a backup of term 3, and so is b1 unless it `opens_its_pool` (silent).
/// Then the standby leads.
async fn leader_without_an_observation_noting_b1(w: &World, opens_its_pool: bool) -> Watcher {
    let mut watcher = w.watcher();
    w.steady();
    w.silent(P);
    if opens_its_pool {
        w.silent(B1);
    }
    w.with(|s| s.lease_note = Some("b1:1 3 1".into()));
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.leads = true);
    watcher
}

/// A standby that saw p serve; the Lease holds `note`; p and b1 stop answering and the
/// standby takes the Lease over.
async fn new_leader_with_note(w: &World, note: &str) -> Watcher {
    let mut watcher = w.watcher();
    w.steady();
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.lease_note = Some(note.into()));
    w.silent(P);
    w.silent(B1);
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.leads = true);
    watcher
}

#[tokio::test]
async fn a_new_leader_waits_for_the_backup_the_last_leader_noted() {
    let w = World::new(false);
    let mut watcher = new_leader_with_note(&w, "b1:1 3 1").await;
    let o = watcher.round().await;
    assert!(matches!(o, Outcome::Waiting(_)), "{o:?}");
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    // b2 was in sync and answers, but b1 may be opening its pool as the primary: waited
    // for, and reported stuck only after promotion_stuck_after_ms.
    waits_then_is_stuck_on(&mut watcher, B1).await;
    assert_eq!(w.take(), vec![]);
    w.answers(B1, primary_of(4, &[(P, "attaching"), (B2, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::PointAt(B1.into()), Call::NoteRemoved]);
    assert_eq!(w.with(|s| s.lease_note.clone()), None);
}

#[tokio::test]
async fn a_note_of_another_failover_pins_nothing() {
    let w = World::new(false);
    // Left over from the failover of a primary of term 2.
    let mut watcher = new_leader_with_note(&w, "b1:1 2 1").await;
    watcher.round().await;
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 2 });
    let calls = w.take();
    assert!(is_note_of(&calls[0], B2), "{calls:?}");
    assert_eq!(promoted(&calls), vec![B2]);
}

#[tokio::test]
async fn a_noted_backup_this_monitor_did_not_see_in_sync_is_stuck_on_not_replaced() {
    // This monitor's observation is a round newer than the writer's: b2 was failed since.
    let w = World::new(false);
    let mut watcher = w.watcher();
    w.steady();
    w.answers(P, primary_of(3, &[(B1, "in-sync"), (B2, "failed")]));
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.lease_note = Some("b2:1 3 1".into()));
    w.silent(P);
    watcher.round().await;
    w.with(|s| s.leads = true);
    watcher.round().await;
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    let o = watcher.round().await;
    // Neither b1 (the note pins b2) nor b2 (not seen in sync) is promoted, and the message
    // says it is b2 that is waited for.
    assert!(
        matches!(&o, Outcome::Stuck(why) if why.contains("b2:1") && why.contains("not in sync")),
        "{o:?}"
    );
    assert_eq!(w.take(), vec![]);
}

#[tokio::test]
async fn a_note_that_cannot_be_read_holds_back_only_a_promotion() {
    let w = World::new(true);
    // The last leader noted b2 (it may be promoting itself); this monitor cannot read that.
    w.with(|s| {
        s.note_read_fails = true;
        s.lease_note = Some("b2:1 3 1".into());
    });
    let mut watcher = w.watcher();
    w.steady();
    // Serving and labelling go on.
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    assert_eq!(w.take(), vec![Call::PointAt(P.into())]);
    w.silent(P);
    watcher.round().await;
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Failed(why) if why.contains("promotion note")),
        "{o:?}"
    );
    assert_eq!(w.take(), vec![]);
    // Read at last: b2 (a backup of the observation's term, so its Promote did not arrive)
    // is the one asked, not b1.
    w.with(|s| s.note_read_fails = false);
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 2 });
    assert_eq!(promoted(&w.take()), vec![B2]);
}

#[tokio::test]
async fn a_standby_never_promotes_points_adds_or_writes_notes() {
    let w = World::new(false);
    let mut watcher = w.watcher();
    w.steady();
    // b2 is missing from p's set: a leader would add it.
    w.answers(P, primary_of(3, &[(B1, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.silent(P);
    assert_eq!(watcher.round().await, Outcome::Standby);
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    assert_eq!(watcher.round().await, Outcome::Standby);
    assert_eq!(w.calls(), vec![]);
}

#[tokio::test]
async fn a_member_missing_from_the_primarys_set_is_added_once() {
    let w = World::new(true);
    let mut watcher = w.watcher();
    w.steady();
    w.answers(P, primary_of(3, &[(B1, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    // The add runs in its own task.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let adds: Vec<Call> = w
        .calls()
        .into_iter()
        .filter(|c| matches!(c, Call::AddBackup { .. }))
        .collect();
    assert_eq!(
        adds,
        vec![Call::AddBackup {
            primary: P.into(),
            backup: B2.into()
        }]
    );
}

// Found by writing these tests: each failed before its fix (docs/decisions/0007, thirteenth
// session).

#[tokio::test]
async fn a_backup_opening_its_pool_after_its_promote_is_waited_for_not_reported_stuck() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    w.take();
    // b1 opens its pool (minutes for a large one): a normal failover in progress.
    w.silent(B1);
    waits_for(&mut watcher, B1).await;
    // Past failover_after (no primary answers) it is still waited for, not an alarm...
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    // ...until promotion_stuck_after_ms: then stuck, and still nothing else promoted.
    waits_then_is_stuck_on(&mut watcher, B1).await;
    assert!(
        !w.take().iter().any(|c| matches!(c, Call::Promote { .. })),
        "nothing else may be promoted while b1 opens its pool"
    );
}

#[tokio::test]
async fn a_promote_not_sent_to_the_only_backup_in_sync_is_sent_again() {
    let w = World::new(true);
    let mut watcher = w.watcher();
    w.steady();
    w.answers(P, primary_of(3, &[(B1, "in-sync"), (B2, "syncing")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    w.silent(P);
    watcher.round().await;
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    w.promote_answers(
        B1,
        vec![Err(PromoteError::NotSent("connect timeout".into()))],
    );
    let not_sent = std::time::Instant::now();
    let o = watcher.round().await;
    assert!(matches!(o, Outcome::Failed(_)), "{o:?}");
    // Not asked again at once (each try writes and removes a note on the Lease)...
    let o = watcher.round().await;
    // (Asserted only while the delay cannot have passed; the plan's own test checks it
    // without real time.)
    if not_sent.elapsed() < AFTER {
        assert!(
            matches!(&o, Outcome::Waiting(why) if why.contains("b1:1") && why.contains("could not be sent")),
            "{o:?}"
        );
    }
    // ...but once failover_after passed: it is the only backup in sync (asked again in the
    // round above if that one came late).
    if o != (Outcome::Promoted { member: 1 }) {
        tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
        let o = watcher.round().await;
        assert_eq!(o, Outcome::Promoted { member: 1 });
    }
    let promotes = promoted(&w.calls());
    assert!(
        !promotes.is_empty() && promotes.iter().all(|b| b == B1),
        "{promotes:?}"
    );
}

#[test]
fn a_promoted_backup_is_given_at_least_the_failover_delay() {
    let cfg = DpmReplicasConfig {
        members: [P, B1]
            .map(|a| MemberConfig {
                address: a.into(),
                pod: String::new(),
            })
            .to_vec(),
        failover_after_ms: 3000,
        promotion_stuck_after_ms: 2999,
        ..DpmReplicasConfig::default()
    };
    let e = cfg.validate(false).unwrap_err().to_string();
    assert!(e.contains("promotion_stuck_after_ms"), "{e}");
    let cfg = DpmReplicasConfig {
        promotion_stuck_after_ms: 3000,
        ..cfg
    };
    cfg.validate(false).unwrap();
}

#[tokio::test]
async fn a_promoted_backup_copying_its_backups_after_a_lead_flap_is_not_reported_stuck() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    // The Lease lost and taken back: the monitor no longer counts b1 as its chosen primary.
    w.with(|s| s.leads = false);
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.leads = true);
    // b1 serves as a primary and copies b2 (minutes for a large pool): not serving for the
    // plan until b2 is in sync, but not stuck either, however long it takes.
    w.answers(B1, primary_of(4, &[(B2, "syncing")]));
    tokio::time::sleep(STUCK_AFTER_PROMOTE + Duration::from_millis(20)).await;
    waits_for(&mut watcher, B1).await;
    w.answers(B1, primary_of(4, &[(B2, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
}

#[tokio::test]
async fn a_new_leader_without_an_observation_waits_for_the_noted_backup_before_the_alarm() {
    let w = World::new(false);
    // Started after p died: no observation. b1, promoted by the last leader, opens its pool.
    let mut watcher = leader_without_an_observation_noting_b1(&w, true).await;
    let o = watcher.round().await;
    assert!(matches!(o, Outcome::Waiting(_)), "{o:?}");
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    waits_then_is_stuck_on(&mut watcher, B1).await;
    // A note alone promotes, points and labels nothing.
    assert_eq!(w.take(), vec![]);
    // b1 answers as a primary that copies its backups: waited for (not stuck, not labelled:
    // without an observation a primary serves once a backup is in sync).
    w.answers(B1, primary_of(4, &[(P, "attaching"), (B2, "syncing")]));
    waits_for(&mut watcher, B1).await;
    assert_eq!(w.take(), vec![]);
    w.answers(B1, primary_of(4, &[(P, "attaching"), (B2, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::PointAt(B1.into()), Call::NoteRemoved]);
}

#[tokio::test]
async fn a_noted_backup_that_answers_as_a_backup_of_the_notes_term_was_never_promoted() {
    let w = World::new(false);
    // The last leader died between its note and its Promote: b1 still a backup of term 3.
    let mut watcher = leader_without_an_observation_noting_b1(&w, false).await;
    watcher.round().await;
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    // No observation and no promotion under way: the usual alarm, after failover_after.
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Stuck(why) if why.contains("no member has answered as a primary")),
        "{o:?}"
    );
}

#[test]
fn a_message_repeated_with_a_longer_wait_is_the_same_message() {
    assert_eq!(
        without_durations("primary p:7700 does not answer for 3012 ms; term 4"),
        without_durations("primary p:7700 does not answer for 9530 ms; term 4")
    );
    // What it is about still tells messages apart.
    assert_ne!(
        without_durations("b1:7700 for 10 ms"),
        without_durations("b2:7700 for 10 ms")
    );
    assert_ne!(
        without_durations("term 4 for 10 ms"),
        without_durations("term 5 for 10 ms")
    );
}

// The old primary coming back while the backup promoted from its term opens its pool
// (docs/decisions/0007, fourteenth session): each "is not served" test failed before the fix
// (p served, then b2 promoted beside b1 once p was silent again); the last one guards what the
// fix must not hold back.

/// p answers again as a primary of its old term 3, b2 still in sync with it (a partition that
/// healed, a pause that ended), b1 marked failed (it revoked p's grants when promoted).
fn old_primary_back(w: &World) {
    w.answers(P, primary_of(3, &[(B1, "failed"), (B2, "in-sync")]));
}

/// While b1 may be promoting itself, p answers again and dies again: p is not taken for the
/// serving primary (not pointed at) and b2 is not promoted beside b1; b1 serves once it
/// answers as a primary.
async fn the_old_primary_back_is_not_served_and_b2_not_promoted(w: &World, watcher: &mut Watcher) {
    w.silent(B1);
    old_primary_back(w);
    // Not taken for a primary restarted in place either (that would drop the observation the
    // pinned backup is promoted from). A new leader's first round may still count p's down
    // time: its message is then about p.
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Waiting(why) if !why.contains("restarted")),
        "{o:?}"
    );
    w.silent(P);
    watcher.round().await;
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    waits_for(watcher, B1).await;
    let calls = w.take();
    assert!(
        !calls
            .iter()
            .any(|c| matches!(c, Call::Promote { .. } | Call::PointAt(_))),
        "{calls:?}"
    );
    // b1 answers as a primary and copies b2, which p (its view stale) still reports in sync:
    // p is not served either, and the note stays on the Lease (for a new leader without an
    // observation b1 serves once b2 is in sync).
    old_primary_back(w);
    w.answers(B1, primary_of(4, &[(B2, "syncing")]));
    for _ in 0..3 {
        let o = watcher.round().await;
        assert!(
            matches!(&o, Outcome::Serving { primary: 1 })
                || matches!(&o, Outcome::Waiting(why) if why.contains("b1:1")),
            "{o:?}"
        );
    }
    let calls = w.take();
    assert!(!calls.contains(&Call::PointAt(P.into())), "{calls:?}");
    assert!(!calls.contains(&Call::NoteRemoved), "{calls:?}");
    w.answers(B1, primary_of(4, &[(B2, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert!(w.take().contains(&Call::NoteRemoved));
    assert_eq!(w.with(|s| s.lease_note.clone()), None);
}

#[tokio::test]
async fn the_old_primary_answering_again_while_the_promoted_backup_opens_its_pool_is_not_served() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    w.take();
    the_old_primary_back_is_not_served_and_b2_not_promoted(&w, &mut watcher).await;
}

#[tokio::test]
async fn the_old_primary_answering_again_during_a_promote_of_unknown_outcome_is_not_served() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(B1, vec![Err(PromoteError::Unknown("deadline".into()))]);
    assert!(matches!(watcher.round().await, Outcome::Failed(_)));
    w.take();
    the_old_primary_back_is_not_served_and_b2_not_promoted(&w, &mut watcher).await;
}

#[tokio::test]
async fn the_old_primary_answering_again_under_a_new_leaders_note_is_not_served() {
    // A standby with the observation takes over; the Lease names b1.
    let w = World::new(false);
    let mut watcher = new_leader_with_note(&w, "b1:1 3 1").await;
    the_old_primary_back_is_not_served_and_b2_not_promoted(&w, &mut watcher).await;
}

#[tokio::test]
async fn the_old_primary_answering_again_is_served_when_the_pinned_backup_was_never_promoted() {
    // The pinned backup answers as a backup of the observation's term (the Promote of unknown
    // outcome never reached it): the old primary, back with b2 in sync, serves again.
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(B1, vec![Err(PromoteError::Unknown("deadline".into()))]);
    assert!(matches!(watcher.round().await, Outcome::Failed(_)));
    w.answers(B1, backup(3));
    old_primary_back(&w);
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
}

#[tokio::test]
async fn the_old_primary_answering_again_is_not_served_by_a_leader_without_an_observation() {
    // Started after p died; the Lease names b1, which opens its pool.
    let w = World::new(false);
    let mut watcher = leader_without_an_observation_noting_b1(&w, true).await;
    the_old_primary_back_is_not_served_and_b2_not_promoted(&w, &mut watcher).await;
}

#[tokio::test]
async fn a_pinned_backup_stays_the_chosen_primary_across_a_lead_flap() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(B1, vec![Err(PromoteError::Unknown("deadline".into()))]);
    assert!(matches!(watcher.round().await, Outcome::Failed(_)));
    // The Lease lost and taken back: the note (on the Lease) is read again, and b1 is still
    // the one chosen: served, and labelled, as soon as it answers as a primary...
    w.with(|s| s.leads = false);
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.leads = true);
    old_primary_back(&w);
    w.answers(B1, primary_of(4, &[(B2, "syncing")]));
    w.take();
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::PointAt(B1.into())]);
    // ...and p, back with its stale view, is not.
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
}

#[tokio::test]
async fn the_old_primary_back_after_the_promoted_one_served_alone_and_died_is_reported_stuck() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    w.answers(B1, primary_of(4, &[(B2, "syncing")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    // b1 dies before b2 is in sync; p comes back with its stale view: not served, and (no
    // observation to fail over from) reported stuck after the delay, naming p.
    w.silent(B1);
    old_primary_back(&w);
    w.take();
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Waiting(why) if why.contains("p:1 answers as a primary of term 3, below term 4")),
        "{o:?}"
    );
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Stuck(why) if why.contains("p:1 answers as a primary of term 3, below term 4")),
        "{o:?}"
    );
    let calls = w.take();
    assert!(
        !calls
            .iter()
            .any(|c| matches!(c, Call::Promote { .. } | Call::PointAt(_))),
        "{calls:?}"
    );
}

#[tokio::test]
async fn the_old_primary_back_after_the_promoted_one_served_is_not_served_when_that_one_dies() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 1 });
    w.answers(B1, primary_of(4, &[(B2, "in-sync")]));
    w.answers(B2, backup(4));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    // b1 dies; p comes back, still reporting b2 in sync at term 3 (idle, it has not written
    // to b2 since): not served, and b2 is promoted from the observation of b1.
    w.silent(B1);
    old_primary_back(&w);
    w.take();
    let o = watcher.round().await;
    assert!(
        matches!(&o, Outcome::Waiting(why) if why.contains("b1:1")),
        "{o:?}"
    );
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 2 });
    let calls = w.take();
    assert!(!calls.contains(&Call::PointAt(P.into())), "{calls:?}");
    assert!(
        calls.contains(&Call::Promote {
            backup: B2.into(),
            others: vec![P.into(), B1.into()],
            min_term: 4,
        }),
        "{calls:?}"
    );
}

#[tokio::test]
async fn a_pin_the_lease_no_longer_notes_is_dropped_when_the_lease_is_taken_back() {
    let w = World::new(true);
    let mut watcher = leader_past_failover(&w).await;
    w.promote_answers(B1, vec![Err(PromoteError::Unknown("deadline".into()))]);
    assert!(matches!(watcher.round().await, Outcome::Failed(_)));
    // The Lease lost; another leader reached b1 (a backup of term 3: never promoted), served p
    // again and removed the note. This monitor does not reach b1.
    w.with(|s| s.leads = false);
    w.silent(B1);
    old_primary_back(&w);
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| {
        s.lease_note = None;
        s.leads = true;
    });
    w.take();
    // Taken back: no note, so no pin; p serves.
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
}

#[tokio::test]
async fn a_noted_wait_the_lease_no_longer_notes_is_dropped_when_the_lease_is_taken_back() {
    // Started after p died; the Lease names b1.
    let w = World::new(false);
    let mut watcher = leader_without_an_observation_noting_b1(&w, true).await;
    waits_for(&mut watcher, B1).await;
    // Lost; another leader ended that failover (b1 never promoted, p served again with b2 in
    // sync) and removed the note; taken back, this monitor still does not reach b1.
    w.with(|s| s.leads = false);
    old_primary_back(&w);
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| {
        s.lease_note = None;
        s.leads = true;
    });
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
}

#[tokio::test]
async fn no_backup_in_sync_for_the_stuck_delay_is_logged_once_per_episode() {
    let w = World::new(true);
    let mut watcher = w.watcher();
    // Its backups down: p answers as a primary, attaching them, and acknowledges nothing.
    w.answers(P, primary_of(4, &[(B1, "attaching"), (B2, "attaching")]));
    assert!(matches!(watcher.round().await, Outcome::Waiting(_)));
    assert_eq!(watcher.unserved_reports, 0);
    tokio::time::sleep(STUCK_AFTER_PROMOTE).await;
    watcher.round().await;
    watcher.round().await;
    assert_eq!(watcher.unserved_reports, 1);
    // b1 back and in sync: served; the next episode is logged again.
    w.answers(P, primary_of(4, &[(B1, "in-sync"), (B2, "attaching")]));
    w.answers(B1, backup(4));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    w.answers(P, primary_of(4, &[(B1, "failed"), (B2, "attaching")]));
    watcher.round().await;
    tokio::time::sleep(STUCK_AFTER_PROMOTE).await;
    watcher.round().await;
    assert_eq!(watcher.unserved_reports, 2);
    // Lost and taken back within the episode: the new leader logs it too.
    w.with(|s| s.leads = false);
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.leads = true);
    watcher.round().await;
    assert_eq!(watcher.unserved_reports, 3);
}

#[tokio::test]
async fn a_watcher_started_afresh_labels_no_primary_below_a_backups_term() {
    // b1, promoted from p's term 3, serves with b2 in sync out of this monitor's reach; p is
    // back from a partition with its stale view. A monitor pod started since (no memory, no
    // note: the leader removed it once b2 was in sync) learns the newer term from b2.
    let w = World::new(true);
    let mut watcher = w.watcher();
    w.answers(P, primary_of(3, &[(B1, "failed"), (B2, "in-sync")]));
    w.answers(B2, backup(4));
    for _ in 0..2 {
        assert!(matches!(watcher.round().await, Outcome::Waiting(_)));
    }
    assert_eq!(w.take(), vec![]);
    // b1 reachable again: labelled.
    w.answers(B1, primary_of(4, &[(B2, "in-sync")]));
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 1 });
    assert_eq!(w.take(), vec![Call::PointAt(B1.into())]);
}

/// Which backups the watcher last said cannot be promoted, and whether that was all in sync.
fn said(watcher: &Watcher) -> (Vec<usize>, bool) {
    let (members, none_could) = &watcher.unpromotable_said;
    (members.iter().map(|(m, _)| *m).collect(), *none_could)
}

#[tokio::test]
async fn a_silent_backup_keeps_its_verdict_only_while_it_is_in_sync() {
    let w = World::new(true);
    let mut watcher = w.watcher();
    w.steady();
    w.answers(B1, unpromotable(3));
    watcher.round().await;
    assert_eq!(said(&watcher), (vec![1], false));
    // b1 dies and the primary drops it; b2 then says it cannot be promoted either: that is
    // every backup in sync now (an error), b1 not counted.
    w.silent(B1);
    w.answers(P, primary_of(3, &[(B1, "failed"), (B2, "in-sync")]));
    w.answers(B2, unpromotable(3));
    watcher.round().await;
    assert_eq!(said(&watcher), (vec![2], true));
    // b1 back in sync and silent for a round: still not counted (its verdict was dropped).
    w.steady();
    w.silent(B1);
    w.answers(B2, unpromotable(3));
    watcher.round().await;
    assert_eq!(said(&watcher), (vec![2], false));
}

#[tokio::test]
async fn a_backup_that_cannot_be_promoted_is_reported_while_the_primary_serves_and_not_asked() {
    let w = World::new(true);
    let mut watcher = w.watcher();
    w.steady();
    assert_eq!(watcher.round().await, Outcome::Serving { primary: 0 });
    assert_eq!(watcher.unpromotable_reports, 0, "nothing to say");
    w.answers(B1, unpromotable(3));
    watcher.round().await;
    assert_eq!(watcher.unpromotable_reports, 1);
    assert_eq!(said(&watcher), (vec![1], false), "a warning");
    watcher.round().await;
    assert_eq!(watcher.unpromotable_reports, 1, "logged once per change");
    // b1 misses a status: it keeps its verdict, nothing is logged again.
    w.silent(B1);
    watcher.round().await;
    w.answers(B1, unpromotable(3));
    watcher.round().await;
    assert_eq!(watcher.unpromotable_reports, 1);
    // b2 too: no failover possible, said before the primary dies (an error).
    w.answers(B2, unpromotable(3));
    watcher.round().await;
    assert_eq!(watcher.unpromotable_reports, 2);
    assert_eq!(said(&watcher), (vec![1, 2], true), "an error");
    // A new leader says it again.
    w.with(|s| s.leads = false);
    assert_eq!(watcher.round().await, Outcome::Standby);
    w.with(|s| s.leads = true);
    watcher.round().await;
    assert_eq!(watcher.unpromotable_reports, 3);
    // Their limits raised (each status reads it anew): said once, and once only.
    w.steady();
    watcher.round().await;
    watcher.round().await;
    assert_eq!(watcher.unpromotable_reports, 4);
    assert_eq!(said(&watcher), (vec![], false));
    // b1 again; then p dies: nothing more is logged about it (the plan says what a failover
    // finds), b2 is promoted in the first failover round, and b1 is never asked.
    w.answers(B1, unpromotable(3));
    watcher.round().await;
    assert_eq!(watcher.unpromotable_reports, 5);
    w.silent(P);
    w.answers(B2, unpromotable(3));
    assert!(matches!(watcher.round().await, Outcome::Waiting(_)));
    assert_eq!(watcher.unpromotable_reports, 5);
    w.answers(B2, backup(3));
    tokio::time::sleep(AFTER + Duration::from_millis(20)).await;
    assert_eq!(watcher.round().await, Outcome::Promoted { member: 2 });
    assert_eq!(promoted(&w.calls()), vec![B2]);
}
