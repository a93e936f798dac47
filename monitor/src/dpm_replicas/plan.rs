//! What the replica-set watcher does next: a pure function of what each member answered this
//! round and of what the watcher remembers ([`Memory`]), so every rule below is tested without
//! processes or clocks.
//!
//! The rules (docs/decisions/0007, "Automatic failover"):
//! - **The serving primary** is a member answering as a primary with at least one backup
//!   in sync (the newest term among several). A primary is reported with a backup in sync only
//!   once that backup accepted its term and recorded its copy complete, which a restarted stale
//!   primary cannot get; so a restarted old primary that still answers "primary" before it
//!   demotes itself is never taken for the serving one. (One that never restarted, back after
//!   a partition or a pause, may still report the backups it had: see the term floor below.)
//!   The member this watcher chose (promoted, or labelled before) counts as serving as soon
//!   as it answers as a primary, whatever term a restarted old primary took meanwhile (its
//!   backups are copied meanwhile; it acknowledges once one backup accepted its term, but
//!   nothing is promoted without an observation of backups in sync). A Promote whose outcome
//!   is not known, this monitor's or the last leader's (its note), pins the observation to
//!   its target ([`Memory::promote_only`]).
//! - **A failover** needs an observation of the serving primary: which backups were in sync
//!   with it, under which term and generation. It happens once that primary has stopped
//!   answering as a primary for `failover_after`, and promotes a backup that was in sync at
//!   that observation and still answers with a complete copy of that term, of the newest
//!   generation among those. A backup in sync held every acknowledged write (barriers wait for
//!   it; a failed one blocks every acknowledgement until it is removed, which raises the
//!   generation, or copied again, which makes its copy incomplete). Any other complete copy may
//!   be older, so without such an observation (this monitor started after the primary died, or
//!   the primary was restarting) nothing is promoted: an operator decides.
//! - A primary that answers again as a primary (restarted in place on its pool, the common
//!   case on Kubernetes) is not failed over; its old observation is dropped, because its
//!   restart copies its backups anew. Unless a promotion under way replaces its term (below).
//! - What the observation cannot vouch for stops a failover: a replica holding a term after
//!   the observed primary's (that primary restarted, reached it and died again, or a
//!   promotion happened elsewhere) makes it stuck; a primary of a newer term makes it wait for
//!   that primary (a Promote whose answer was lost). A backup of the observation must hold the
//!   newest generation any replica reports (a backup removed since is older). Replicas that do
//!   not answer cannot show such traces: the rule cannot see what they hold.
//! - Without an observation nothing is promoted; once no member has answered as a primary for
//!   `failover_after`, the plan says it is stuck, for an operator. After a Promote answered OK
//!   (the observation is dropped then), and while pinned to a backup that may be promoting
//!   itself, it waits for that backup instead, stuck only once `promotion_stuck_after` passed
//!   and it does not answer as a primary. A monitor with no observation that reads the last
//!   leader's note waits for the noted backup the same way (it promotes nothing), unless that
//!   backup answers as a backup of the note's term or older (no Promote reached it).
//! - A Promote that could not be sent (no connection) is tried on the other backups in sync
//!   first, and on the same backup again once `failover_after` passed.
//! - A backup that answers that it would refuse a Promote (`not_promotable`: a verbs backup
//!   that may not pin its pool) is not asked, unless the plan is pinned to it; with no other
//!   candidate the plan is stuck, naming each and why ([`promotability`] lets the watcher
//!   say so while the primary still serves).
//! - **The term floor**: a primary of a term older than one this watcher saw serve with a
//!   backup in sync, or than a promotion it made, saw take effect, or waits for (promoted, or
//!   perhaps promoted: pinned or noted), or than one a member answering as a backup this
//!   round accepted (it refuses older primaries: [`backups_term`]; what a monitor started
//!   afresh, or a standby that missed the promotion, learns the floor from), is never the
//!   serving one, backups in sync or not: the
//!   old primary answering again after a partition healed, its view of its backups stale, does
//!   not end the wait for the promoted backup (if it died again, another backup would be
//!   promoted beside the first), nor is it served once the promoted one serves. Every start and
//!   every promotion takes a newer term, so no primary whose pool continues the history this
//!   watcher saw is below the floor (one on a new or restored pool is: reported, for an
//!   operator; so is the primary a Promote was to replace when that Promote recorded its term
//!   at the backup and then failed; and the open cases of docs/decisions/0007). See
//!   [`term_floor`].
//! - Members answering as backups that the serving primary does not list are to be added to
//!   it (the old primary, demoted after a failover, comes back that way), unless the primary
//!   lists a backup no member names (a member under another name would be attached twice).

use std::time::{Duration, Instant};

/// A member's role as it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    Backup,
}

/// What one member answered to ReplicaService.Status.
#[derive(Debug, Clone, PartialEq)]
pub struct MemberStatus {
    pub role: Role,
    pub term: u64,
    pub generation: u64,
    /// A backup's copy marker says complete.
    pub copy_complete: bool,
    /// The term of the primary that made the backup's copy.
    pub copy_term: u64,
    /// On a primary: its backups, (address, state).
    pub backups: Vec<(String, String)>,
    /// A backup with a complete copy that says it would refuse a Promote, and why (a verbs
    /// backup whose process may not pin its pool: `ReplicaStatusResponse.not_promotable`).
    pub not_promotable: Option<String>,
}

/// A member's answer this round, or why there was none.
pub type Seen = Result<MemberStatus, String>;

/// The serving primary as last observed.
#[derive(Debug, Clone, PartialEq)]
pub struct Serving {
    pub member: usize,
    pub term: u64,
    pub generation: u64,
    /// Members it reported in sync.
    pub in_sync: Vec<usize>,
}

/// A member whose Promote could not be sent ([`Memory::not_reached`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotReached {
    pub member: usize,
    /// The last try.
    pub at: Instant,
    /// From when waiting for it is reported stuck (`promotion_stuck_after` after the first
    /// try): it is still asked again, but an operator should know.
    pub stuck_at: Instant,
}

/// What the watcher carries from one round to the next.
#[derive(Debug, Default)]
pub struct Memory {
    /// The member clients were last pointed at by this watcher, or the one it (or the last
    /// leader, by its note) promoted (`None`: not known, so point again).
    pub pointed: Option<usize>,
    /// The last observation of a serving primary with backups in sync.
    pub serving: Option<Serving>,
    /// Since when that primary has not answered as a primary.
    pub down_since: Option<Instant>,
    /// Since when no member has answered as a primary at or above the term floor (for the
    /// stuck report when there is no observation to fail over from).
    pub no_primary_since: Option<Instant>,
    /// A Promote whose outcome is not known (no answer, or "being promoted already"; or the
    /// last leader's, by its note: `promotion_note`), and until when it is waited for: only
    /// that member may be promoted from this observation, and while it does not answer the
    /// plan waits for it (it may be opening its pool as the primary), stuck from that time on
    /// (`promotion_stuck_after_ms` after the pin). Cleared once a primary serves.
    pub promote_only: Option<(usize, Instant)>,
    /// Members whose Promote was refused (nothing changed there) since the last observation:
    /// not tried again from it, so another backup is. Cleared once a primary serves.
    pub refused: Vec<usize>,
    /// Members whose Promote could not be sent (no connection: nothing reached them): the
    /// other backups of the observation are tried first, and each is asked again once
    /// `failover_after` passed since its last try (a connection that failed once must not
    /// leave a set whose only backup in sync it was without a primary). Cleared once a primary
    /// serves.
    pub not_reached: Vec<NotReached>,
    /// A Promote this watcher sent that was answered (the backup promotes itself; it opens and
    /// recovers its pool before it answers as the primary, minutes for a large pool), or the
    /// last leader's noted one when this watcher holds no observation: waited for before the
    /// failover is reported stuck. Cleared once a primary serves.
    pub promoted: Option<Promoted>,
    /// The oldest term a primary may serve under, as far as this watcher has seen: raised to
    /// the term of every primary that served with a backup in sync, to the term after the one
    /// a promotion replaced once the Promote was answered OK or its backup answered as a
    /// primary, to the term after the observation's when a primary of a newer term
    /// appeared, and to the floor of a round in which the chosen primary served without a
    /// backup in sync (at most its term) ([`term_floor`]; this round's [`backups_term`] is
    /// counted there, not kept here). It only grows.
    pub term_floor: u64,
    /// Since when (at the earliest, since this watcher started) no member has served as a
    /// primary with a backup in sync, whatever the plan waits for: no backup could be
    /// promoted meanwhile, and the writes are refused or acknowledged by the primary alone.
    /// The watcher's `dinomo_monitor_dpm_no_backup_in_sync_seconds`, and its report once past
    /// `promotion_stuck_after` ([`unserved_report`]).
    pub unserved_since: Option<Instant>,
}

/// A backup promoted, or perhaps promoted, that the plan waits for ([`Memory::promoted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Promoted {
    pub member: usize,
    /// From when waiting for it is reported stuck (`promotion_stuck_after` after the Promote's
    /// answer, or after the note was read).
    pub stuck_at: Instant,
    /// The term of the primary it replaces: a primary of this term or older that answers again
    /// meanwhile is not the serving one, unless a noted Promote never reached it
    /// ([`term_floor`]).
    pub from_term: u64,
    /// Known only from the last leader's note. Then the wait holds only while the member shows
    /// no sign of the Promote having failed to reach it: one answering as a backup of
    /// `from_term` or older was never promoted (the leader died between its note and its
    /// Promote), and the usual rule applies.
    pub noted: bool,
}

/// The next step.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// `primary` serves under `term`; point clients at it if `point`, and add `add` as its
    /// backups. `unknown`: backups it lists that are no member (nothing is added then: a
    /// member under another name may be one of them, and a second attach of a node revokes
    /// the first, which blocks every acknowledgement).
    Serving {
        primary: usize,
        term: u64,
        point: bool,
        add: Vec<usize>,
        unknown: Vec<String>,
    },
    /// Nothing to do yet, and why.
    Wait(String),
    /// Promote `member`, replicating to `others`, after a term no older than `min_term`.
    Promote {
        member: usize,
        others: Vec<usize>,
        min_term: u64,
        down_for: Duration,
    },
    /// The primary is gone and no backup can be promoted safely: an operator must decide.
    Stuck(String),
}

/// Members `status` reports in sync, by index into `members`.
fn in_sync(members: &[String], status: &MemberStatus) -> Vec<usize> {
    status
        .backups
        .iter()
        .filter(|(_, state)| state == "in-sync")
        .filter_map(|(addr, _)| members.iter().position(|m| m == addr))
        .collect()
}

/// The term of the primary a promotion under way replaces, if its backup may have been
/// reached: the backup this watcher promoted (the Promote answered OK), or perhaps promoted (a
/// Promote of unknown outcome, the last leader's note), unless that pinned or noted backup
/// answers as a backup of that term or older (the Promote never reached it).
fn promotion_under_way(mem: &Memory, seen: &[Seen]) -> Option<u64> {
    let (member, term, answered_ok) = match (mem.promoted, mem.promote_only, &mem.serving) {
        (Some(p), _, _) => (p.member, p.from_term, !p.noted),
        (None, Some((only, _)), Some(last)) => (only, last.term, false),
        _ => return None,
    };
    let never_reached =
        !answered_ok && matches!(&seen[member], Ok(s) if s.role == Role::Backup && s.term <= term);
    (!never_reached).then_some(term)
}

/// The oldest term a primary may serve under this round: [`Memory::term_floor`], and the term
/// after the one a promotion under way replaces ([`promotion_under_way`]; a promoted backup
/// takes a term after both its own and the replaced one, durably, before it answers).
///
/// A primary below it answering (the old primary after a partition healed or a pause ended,
/// with a backup it still reports in sync: it learns of the newer term only when it next
/// writes to that backup) is not the serving one: taking it would end the wait for the backup
/// opening its pool, and if it then died again another backup could be promoted beside the
/// first (two primaries, an outage until the backups' term checks leave one); taken after the
/// promoted one served, its stale label would send the clients to a primary that can
/// acknowledge nothing. If the backup was promoted, the old primary acknowledges nothing (its
/// grants there are revoked); if a pinned or noted backup was never reached and does not
/// answer, a primary that could serve is held back, and the failover is reported stuck after
/// `promotion_stuck_after_ms`. A restarted old primary takes a newer term and may serve (the
/// tie of that term with the promotion's is an open case, docs/decisions/0007). And this
/// round's [`backups_term`], which [`Memory::term_floor`] keeps only as far as a primary
/// served above it (a chosen primary serving without a backup in sync keeps the whole floor,
/// at most its own term): a backup that stops answering, or whose `.term` an operator
/// deleted, raises nothing beyond that from then on, as the stuck rule and a Promote's
/// `min_term` also read this round's answers only.
fn term_floor(mem: &Memory, seen: &[Seen]) -> u64 {
    let under_way = promotion_under_way(mem, seen).map_or(0, |t| t + 1);
    mem.term_floor.max(under_way).max(backups_term(seen))
}

/// The newest term a member answering as a backup accepted this round: a primary of that term
/// attached it (or, being promoted, it recorded that term itself), and it refuses every primary
/// of an older term from then on (the older one's key there is revoked, so it acknowledges
/// nothing that needs that backup, and its next attach or control call there deposes it). A
/// primary below it is stale, the backups it still reports in sync notwithstanding: its view
/// is from before. The watcher's memory of the floor cannot say so after a restart, or a lead
/// change that missed the promotion; the backups' answers do, while they answer. (A Promote
/// that recorded its term and then failed on an I/O error leaves such a backup too: the
/// primary it was to replace is then not served, though its key may still work there, until
/// an operator settles it; docs/decisions/0007.)
fn backups_term(seen: &[Seen]) -> u64 {
    seen.iter()
        .filter_map(|s| s.as_ref().ok())
        .filter(|s| s.role == Role::Backup)
        .map(|s| s.term)
        .max()
        .unwrap_or(0)
}

/// Once no member has served as a primary with a backup in sync for `stuck_after`
/// ([`Memory::unserved_since`]), what an operator must know, and what each member answered.
/// A primary that answers but never gets a backup in sync (its backups down, or every attach
/// failing) shows no other alarm: the plan waits for it.
pub fn unserved_report(
    members: &[String],
    seen: &[Seen],
    mem: &Memory,
    now: Instant,
    stuck_after: Duration,
) -> Option<String> {
    let unserved = now.duration_since(mem.unserved_since?);
    if unserved < stuck_after {
        return None;
    }
    let answers: Vec<String> = members
        .iter()
        .zip(seen)
        .map(|(m, s)| format!("{m} {}", answered(s)))
        .collect();
    let advice = match seen.iter().any(|s| primary(s).is_some()) {
        true => {
            "are its backups running, and what do their logs and the primary's say about \
             the attach?"
        }
        false => "no member answers as a primary: see helm/README.md, \"Backups\"",
    };
    Some(format!(
        "no member has served as a primary with a backup in sync for at least {} ms (since \
         this monitor started watching): no backup could be promoted if the primary died, and \
         writes are refused (no backup accepted the primary's term yet, or a counted backup \
         failed) or acknowledged by the primary alone (its backups still copying) ({}); {advice}",
        unserved.as_millis(),
        answers.join("; ")
    ))
}

/// What a member answered, in full, for [`unserved_report`].
fn answered(seen: &Seen) -> String {
    match seen {
        Ok(s) if s.role == Role::Primary => {
            let backups: Vec<String> = s
                .backups
                .iter()
                .map(|(a, st)| format!("{a} {st}"))
                .collect();
            match backups.is_empty() {
                true => format!("is a primary of term {} with no backup", s.term),
                false => format!(
                    "is a primary of term {} (backups: {})",
                    s.term,
                    backups.join(", ")
                ),
            }
        }
        Ok(s) => format!(
            "is a backup of term {} (copy {} of term {})",
            s.term,
            match s.copy_complete {
                true => "complete",
                false => "incomplete",
            },
            s.copy_term
        ),
        Err(e) => format!("does not answer ({e})"),
    }
}

/// For messages: a member answering as a primary below the term floor, if one does.
fn below_floor_clause(members: &[String], seen: &[Seen], floor: u64) -> String {
    (0..members.len())
        .filter_map(|m| primary(&seen[m]).map(|s| (m, s.term)))
        .find(|&(_, t)| t < floor)
        .map(|(m, t)| {
            format!(
                "; {} answers as a primary of term {t}, below term {floor} (a backup was \
                 promoted, a primary served, or a backup accepted a primary, under a newer term \
                 since; or its pool is new or restored): not served",
                members[m]
            )
        })
        .unwrap_or_default()
}

fn primary(seen: &Seen) -> Option<&MemberStatus> {
    seen.as_ref().ok().filter(|s| s.role == Role::Primary)
}

/// How a member that is not serving as the primary answered, for messages.
fn how(seen: &Seen) -> String {
    match seen {
        Ok(s) if s.role == Role::Backup => "answers as a backup".into(),
        Ok(s) => format!(
            "answers as a primary of term {} with no backup in sync",
            s.term
        ),
        Err(e) => format!("does not answer ({e})"),
    }
}

/// The next step, given each member's answer (`seen[i]` is `members[i]`'s).
pub fn plan(
    members: &[String],
    seen: &[Seen],
    mem: &mut Memory,
    now: Instant,
    failover_after: Duration,
) -> Plan {
    debug_assert_eq!(members.len(), seen.len());
    if let Some(p) = mem.promoted.filter(|p| !p.noted) {
        // Answered OK: the backup took a term after the replaced one before it answered.
        mem.term_floor = mem.term_floor.max(p.from_term + 1);
    }
    let floor = term_floor(mem, seen);
    let plan = decide(members, seen, mem, now, failover_after, floor);
    with_below_floor(plan, members, seen, floor)
}

/// Every wait and stuck report names a member answering as a primary below the term floor (an
/// operator reading why nothing serves must know that one is not served, and why).
fn with_below_floor(plan: Plan, members: &[String], seen: &[Seen], floor: u64) -> Plan {
    let clause = below_floor_clause(members, seen, floor);
    if clause.is_empty() {
        return plan;
    }
    match plan {
        Plan::Wait(why) => Plan::Wait(format!("{why}{clause}")),
        Plan::Stuck(why) => Plan::Stuck(format!(
            "{why}{clause}. Only if the replica set was recreated on empty pools or restored \
             from a copy (its terms start again, below the floor), restart every monitor pod \
             (`kubectl rollout restart deployment/<release>-monitor`: they forget the terms they \
             saw; a backup that kept its `.term` still refuses, and still raises the floor to, \
             the term it accepted); otherwise that primary was replaced and must not serve"
        )),
        other => other,
    }
}

/// [`plan`] once the term floor of this round is known.
fn decide(
    members: &[String],
    seen: &[Seen],
    mem: &mut Memory,
    now: Instant,
    failover_after: Duration,
    floor: u64,
) -> Plan {
    let servable = |s: &MemberStatus| s.term >= floor;
    let with_backups = (0..members.len())
        .filter_map(|i| primary(&seen[i]).map(|s| (i, s, in_sync(members, s))))
        .filter(|(_, s, synced)| !synced.is_empty() && servable(s))
        .max_by_key(|(i, s, _)| (s.term, std::cmp::Reverse(*i)));
    match with_backups {
        Some(_) => mem.unserved_since = None,
        None => {
            mem.unserved_since.get_or_insert(now);
        }
    }
    // The member this watcher chose (promoted, or labelled before). Not "the newest term":
    // the old primary, restarted, takes a newer term at each start until it demotes itself.
    let promoted = mem.pointed.and_then(|p| {
        primary(&seen[p])
            .filter(|s| servable(s))
            .map(|s| (p, s, Vec::new()))
    });
    if seen.iter().any(|s| primary(s).is_some_and(servable)) {
        mem.no_primary_since = None;
    } else {
        mem.no_primary_since.get_or_insert(now);
    }
    if let Some((p, status, synced)) = with_backups.or(promoted) {
        mem.down_since = None;
        mem.promote_only = None;
        mem.refused.clear();
        mem.not_reached.clear();
        mem.promoted = None;
        // A promotion under way took effect if its backup serves (as the chosen one, copying
        // its backups; or with one in sync), and a backup in sync accepted this term.
        mem.term_floor = match synced.is_empty() {
            true => floor,
            false => floor.max(status.term),
        };
        mem.serving = (!synced.is_empty()).then_some(Serving {
            member: p,
            term: status.term,
            generation: status.generation,
            in_sync: synced,
        });
        let listed = |m: usize| status.backups.iter().any(|(a, _)| *a == members[m]);
        let unknown: Vec<String> = status
            .backups
            .iter()
            .map(|(a, _)| a)
            .filter(|a| !members.contains(a))
            .cloned()
            .collect();
        let add = if unknown.is_empty() {
            (0..members.len())
                .filter(|&m| m != p && !listed(m))
                .filter(|&m| matches!(&seen[m], Ok(s) if s.role == Role::Backup))
                .collect()
        } else {
            Vec::new()
        };
        return Plan::Serving {
            primary: p,
            term: status.term,
            point: mem.pointed != Some(p),
            add,
            unknown,
        };
    }
    let Some(last) = mem.serving.clone() else {
        mem.down_since = None;
        if let Some(p) = mem.promoted {
            let m = p.member;
            // (Never reached: see `promotion_under_way`.)
            if promotion_under_way(mem, seen).is_some() {
                // Promoted, and (no primary serves) not answering as one yet: it recovers its
                // pool first. Nothing else may be promoted meanwhile (the observation is gone).
                let what = match p.noted {
                    false => "was promoted",
                    true => {
                        "is named by the last leader's promotion note (it may be promoting \
                                itself)"
                    }
                };
                let why = format!(
                    "{} {what} and {}: waiting for it to open its pool and serve, promoting no \
                     other backup",
                    members[m],
                    how(&seen[m]),
                );
                return wait_for_promoted(why, &seen[m], now, p.stuck_at);
            }
        }
        let quiet = mem.no_primary_since.map(|t| now.duration_since(t));
        let why = "no member serves as the primary with a backup in sync, and this monitor holds \
                   no observation of one that did (it started watching since, or the primary \
                   restarted, or the promoted one never had a backup in sync): nothing to fail \
                   over from";
        return match quiet {
            Some(d) if d >= failover_after => {
                let of_term = match floor {
                    0 => String::new(),
                    _ => format!(" of term {floor} or newer"),
                };
                Plan::Stuck(format!(
                    "no member has answered as a primary{of_term} for {} ms; {why}: a \
                     complete copy may still lack acknowledged writes, so an operator decides \
                     (helm/README.md, \"Backups\")",
                    d.as_millis()
                ))
            }
            _ => Plan::Wait(why.into()),
        };
    };
    let last_back = primary(&seen[last.member]);
    if last_back.is_some_and(servable) {
        // Started again on its pool: it copies its backups anew, so what was in sync no
        // longer is. (Answering again below the term floor, it is the primary that failed,
        // not restarted: the failover goes on.)
        mem.serving = None;
        mem.down_since = None;
        return Plan::Wait(format!(
            "primary {} {}: it restarted and is attaching its backups",
            members[last.member],
            how(&seen[last.member])
        ));
    }
    // A primary of a newer term that is not serving yet: someone promoted it (a Promote
    // whose answer was lost, another monitor). Wait for it; what it acknowledges is not
    // known here, so this observation can no longer pick a backup.
    if let Some((m, s)) = (0..members.len())
        .filter_map(|m| primary(&seen[m]).map(|s| (m, s)))
        .find(|(_, s)| s.term > last.term)
    {
        mem.serving = None;
        mem.down_since = None;
        // Someone promoted it from the last serving primary's term or later: that primary is
        // replaced, whatever backups it may still report in sync.
        mem.term_floor = mem.term_floor.max(last.term + 1);
        return Plan::Wait(format!(
            "{} answers as a primary of term {}, newer than the last serving primary's {}: \
             waiting for it to serve",
            members[m], s.term, last.term
        ));
    }
    let down_for = now.duration_since(*mem.down_since.get_or_insert(now));
    let why = match last_back {
        // Named with its term by `with_below_floor`.
        Some(_) => "answers as a primary below the term floor (not served); it was down".into(),
        None => how(&seen[last.member]),
    };
    if down_for < failover_after {
        return Plan::Wait(format!(
            "primary {} {why} for {} ms; failing over after {} ms",
            members[last.member],
            down_for.as_millis(),
            failover_after.as_millis()
        ));
    }
    // A replica that took a term after the last serving primary's: a primary this watcher
    // did not see served (the old one restarted and reached it, then died again; a promotion
    // elsewhere), and may have acknowledged writes the backups of the observation lack.
    let answered = || seen.iter().filter_map(|s| s.as_ref().ok());
    let pinned = mem.promote_only.map(|(m, _)| m);
    // The pinned member raised its term itself when the Promote reached it.
    if let Some(s) = (0..members.len())
        .filter(|&m| Some(m) != pinned)
        .filter_map(|m| seen[m].as_ref().ok())
        .find(|s| s.term.max(s.copy_term) > last.term)
    {
        return Plan::Stuck(format!(
            "primary {} {why} for {} ms, and a replica holds term {} after its term {}: a \
             primary this monitor did not see served since; not promoting (a backup of the \
             last observation may lack what it acknowledged). See helm/README.md, \"Backups\"",
            members[last.member],
            down_for.as_millis(),
            s.term.max(s.copy_term),
            last.term
        ));
    }
    if let Some((only, stuck_at)) = mem.promote_only {
        let why = format!(
            "{} {}; it may be promoting itself (an earlier Promote's outcome is not known): \
             waiting for it, promoting no other backup",
            members[only],
            match &seen[only] {
                Err(_) => "does not answer".to_string(),
                Ok(s) if s.role == Role::Backup =>
                    format!("answers as a backup of term {}", s.term),
                Ok(s) => format!("answers as a primary of term {}", s.term),
            }
        );
        let promoted_again = matches!(&seen[only], Ok(s) if s.term == last.term);
        if !promoted_again {
            return wait_for_promoted(why, &seen[only], now, stuck_at);
        }
    }
    let generation = newest_generation(seen, &last);
    let recently_not_reached = |m: usize| {
        mem.not_reached
            .iter()
            .any(|n| n.member == m && now.duration_since(n.at) < failover_after)
    };
    let candidate = last
        .in_sync
        .iter()
        .copied()
        .filter_map(|m| seen[m].as_ref().ok().map(|s| (m, s)))
        .filter(|(m, _)| pinned.is_none_or(|only| only == *m) && !mem.refused.contains(m))
        .filter(|(m, _)| !recently_not_reached(*m))
        // One that says it would refuse a Promote is not asked: its refusal would cost the
        // outage a round. The one the plan is pinned to is, whatever it says: it may be
        // promoting itself.
        .filter(|(m, s)| pinned == Some(*m) || s.not_promotable.is_none())
        .filter(|(_, s)| holds_the_observation(s, &last, generation))
        .max_by_key(|(m, _)| std::cmp::Reverse(*m));
    let Some((member, _)) = candidate else {
        if let Some(only) = pinned {
            // Only the pinned member may be promoted from this observation (it may be
            // promoting itself): the message is about it, not about the others in sync.
            return Plan::Stuck(pinned_stuck(
                members, seen, &last, only, &why, down_for, generation,
            ));
        }
        if let Some(n) = mem
            .not_reached
            .iter()
            .filter(|n| last.in_sync.contains(&n.member) && recently_not_reached(n.member))
            .min_by_key(|n| n.stuck_at)
        {
            let why = format!(
                "primary {} {why} for {} ms; a Promote of {} could not be sent (no \
                 connection): asking it again after {} ms unless another backup in sync can \
                 be promoted",
                members[last.member],
                down_for.as_millis(),
                members[n.member],
                failover_after.as_millis()
            );
            return match now >= n.stuck_at {
                true => Plan::Stuck(format!(
                    "{why}; no Promote reached it for longer than `promotion_stuck_after_ms`: \
                     bring the primary back, or promote a backup by hand (helm/README.md, \
                     \"Backups\")"
                )),
                false => Plan::Wait(why),
            };
        }
        let refused: Vec<&str> = last
            .in_sync
            .iter()
            .filter(|m| mem.refused.contains(m))
            .map(|&m| members[m].as_str())
            .collect();
        let cannot: Vec<String> = unpromotable(seen, &last, generation)
            .into_iter()
            .filter(|(m, _)| !mem.refused.contains(m))
            .map(|(m, why)| format!("{}: {why}", members[m]))
            .collect();
        if !refused.is_empty() || !cannot.is_empty() {
            let mut what = Vec::new();
            if !refused.is_empty() {
                what.push(format!(
                    "{} refused to be promoted (the refusals are logged)",
                    refused.join(", ")
                ));
            }
            if !cannot.is_empty() {
                what.push(format!(
                    "{} cannot be promoted ({})",
                    match cannot.len() {
                        1 => "one says it".to_string(),
                        n => format!("{n} say they"),
                    },
                    cannot.join("; ")
                ));
            }
            let raise = match cannot.is_empty() {
                true => "",
                false => {
                    " Raise the pin limit of those that cannot (docs/operations.md, \"The verbs \
                     fabric\"; each status reads it anew: one not refused yet is then \
                     promoted)."
                }
            };
            return Plan::Stuck(format!(
                "primary {} {why} for {} ms; of the backups in sync when it last served, {}, \
                 and no other answers with a complete copy of its term {}: not promoting.{raise} \
                 Bring the primary back, or promote a backup by hand (helm/README.md, \
                 \"Backups\")",
                members[last.member],
                down_for.as_millis(),
                what.join("; "),
                last.term
            ));
        }
        let names: Vec<&str> = last.in_sync.iter().map(|&m| members[m].as_str()).collect();
        return Plan::Stuck(format!(
            "primary {} {why} for {} ms, and none of the backups in sync when it last served \
             ({}) answers with a complete copy of its term {}: not promoting (any other copy may \
             lack acknowledged writes). Bring the primary back, or promote a backup by hand \
             (helm/README.md, \"Backups\")",
            members[last.member],
            down_for.as_millis(),
            names.join(", "),
            last.term
        ));
    };
    let min_term = answered().map(|s| s.term).fold(last.term, u64::max);
    Plan::Promote {
        member,
        others: (0..members.len()).filter(|&m| m != member).collect(),
        min_term,
        down_for,
    }
}

/// The newest replica-set generation any member answers with, or `last`'s: a backup removed
/// since the observation is older than the ones that stayed.
fn newest_generation(seen: &[Seen], last: &Serving) -> u64 {
    seen.iter()
        .filter_map(|s| s.as_ref().ok())
        .map(|s| s.generation)
        .fold(last.generation, u64::max)
}

/// Whether `s` answers as a backup holding every write `last` acknowledged: a complete copy
/// of its term, of the newest `generation`. (Whether it would accept a Promote is
/// `not_promotable`.)
fn holds_the_observation(s: &MemberStatus, last: &Serving, generation: u64) -> bool {
    s.role == Role::Backup
        && s.copy_complete
        && s.copy_term == last.term
        && s.generation >= generation
}

/// The backups in sync with `last` that hold the observation ([`holds_the_observation`]) but
/// say they would refuse a Promote, each with why.
fn unpromotable(seen: &[Seen], last: &Serving, generation: u64) -> Vec<(usize, String)> {
    last.in_sync
        .iter()
        .filter_map(|&m| match &seen[m] {
            Ok(s) if holds_the_observation(s, last, generation) => {
                s.not_promotable.clone().map(|why| (m, why))
            }
            _ => None,
        })
        .collect()
}

/// Whether the backups in sync with the primary last observed serving could take over from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promotability {
    /// Backups in sync with it when it was observed.
    pub in_sync: Vec<usize>,
    /// Backups in sync that a failover would promote: holding the observation, with no reason
    /// to refuse, not refused already.
    pub promotable: usize,
    /// Those that say they would refuse a Promote, and why.
    pub unpromotable: Vec<(usize, String)>,
}

/// Who could be promoted from the observation this watcher holds (`None`: it holds none), as
/// the members answer this round: for the watcher's gauge and its warning, before the primary
/// dies, that a failover would find no backup to promote.
pub fn promotability(seen: &[Seen], mem: &Memory) -> Option<Promotability> {
    let last = mem.serving.as_ref()?;
    let generation = newest_generation(seen, last);
    let promotable = last
        .in_sync
        .iter()
        .filter(|m| !mem.refused.contains(m))
        .filter(|&&m| {
            matches!(&seen[m], Ok(s) if holds_the_observation(s, last, generation)
                && s.not_promotable.is_none())
        })
        .count();
    Some(Promotability {
        in_sync: last.in_sync.clone(),
        promotable,
        unpromotable: unpromotable(seen, last, generation),
    })
}

/// Waiting for a backup promoted (or perhaps promoted) to serve: stuck from `stuck_at` on,
/// unless it answers as a primary by then (it copies its backups before it serves: minutes for
/// a large pool; a monitor that no longer points at it does not count it as serving until a
/// backup is in sync).
fn wait_for_promoted(why: String, seen: &Seen, now: Instant, stuck_at: Instant) -> Plan {
    if now >= stuck_at && primary(seen).is_none() {
        Plan::Stuck(format!(
            "{why}, for longer than `promotion_stuck_after_ms`: did it die? Bring it back, or \
             promote a backup by hand (helm/README.md, \"Backups\")"
        ))
    } else {
        Plan::Wait(why)
    }
}

/// Why a failover pinned to `only` ([`Memory::promote_only`]) cannot promote it, though it
/// answers with the observation's term.
fn pinned_stuck(
    members: &[String],
    seen: &[Seen],
    last: &Serving,
    only: usize,
    why: &str,
    down_for: Duration,
    generation: u64,
) -> String {
    let in_sync: Vec<&str> = last.in_sync.iter().map(|&m| members[m].as_str()).collect();
    let unfit = match &seen[only] {
        _ if !last.in_sync.contains(&only) => format!(
            "it was not in sync when {} last served as this monitor saw it (in sync: {}), so \
             its copy may lack acknowledged writes",
            members[last.member],
            in_sync.join(", ")
        ),
        Ok(s) if s.role == Role::Backup => {
            let state = if s.copy_complete {
                "complete"
            } else {
                "incomplete"
            };
            format!(
                "its copy is {state} of term {}, generation {} (a promotion needs a complete \
                 copy of term {}, generation {generation})",
                s.copy_term, s.generation, last.term
            )
        }
        other => how(other),
    };
    format!(
        "primary {} {why} for {} ms; {} is the only backup this failover may promote (the \
         last leader's note, or a Promote of this monitor whose outcome is not known, names \
         it: it may be promoting itself), and it is not promoted: {unfit}. Waiting for it to \
         serve; or bring the primary back, or promote a backup by hand (helm/README.md, \
         \"Backups\")",
        members[last.member],
        down_for.as_millis(),
        members[only],
    )
}

/// An answer as a primary of `term` listing `backups` (address, state): for this module's
/// tests and the watcher's.
#[cfg(test)]
pub(super) fn primary_of(term: u64, backups: &[(&str, &str)]) -> Seen {
    Ok(MemberStatus {
        role: Role::Primary,
        term,
        generation: 0,
        copy_complete: false,
        copy_term: 0,
        backups: backups
            .iter()
            .map(|(a, s)| (a.to_string(), s.to_string()))
            .collect(),
        not_promotable: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_secs(3);

    fn members() -> Vec<String> {
        ["p:1", "b1:1", "b2:1"].map(String::from).to_vec()
    }

    fn backup(term: u64, complete: bool, copy_term: u64, generation: u64) -> Seen {
        Ok(MemberStatus {
            role: Role::Backup,
            term,
            generation,
            copy_complete: complete,
            copy_term,
            backups: Vec::new(),
            not_promotable: None,
        })
    }

    /// A backup in sync with p at term 3 that says it cannot be promoted.
    fn unpromotable() -> Seen {
        let mut seen = backup(3, true, 3, 0);
        if let Ok(s) = &mut seen {
            s.not_promotable = Some("may pin only 1048576 bytes".into());
        }
        seen
    }

    fn serving(primary: usize, term: u64, point: bool, add: Vec<usize>) -> Plan {
        Plan::Serving {
            primary,
            term,
            point,
            add,
            unknown: vec![],
        }
    }

    fn silent() -> Seen {
        Err("connection refused".into())
    }

    /// p serves at term 3 with b1 and b2 in sync; the watcher has pointed at it.
    fn steady(mem: &mut Memory, now: Instant) {
        let seen = [
            primary_of(3, &[("b1:1", "in-sync"), ("b2:1", "in-sync")]),
            backup(3, true, 3, 0),
            backup(3, true, 3, 0),
        ];
        let p = plan(&members(), &seen, mem, now, AFTER);
        assert_eq!(p, serving(0, 3, true, vec![]));
        mem.pointed = Some(0);
    }

    #[test]
    fn the_serving_primary_is_pointed_at_once() {
        let mut mem = Memory::default();
        let now = Instant::now();
        steady(&mut mem, now);
        let seen = [
            primary_of(3, &[("b1:1", "in-sync"), ("b2:1", "syncing")]),
            backup(3, true, 3, 0),
            backup(3, false, 3, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, now, AFTER);
        assert_eq!(p, serving(0, 3, false, vec![]));
        assert_eq!(mem.serving.as_ref().unwrap().in_sync, vec![1]);
    }

    #[test]
    fn a_primary_without_a_backup_in_sync_is_not_taken_for_the_serving_one() {
        // At start (copies in progress), or a restarted old primary before it demotes itself.
        let mut mem = Memory::default();
        let seen = [
            primary_of(9, &[("b1:1", "syncing")]),
            backup(3, true, 3, 0),
            backup(3, true, 3, 0),
        ];
        assert!(matches!(
            plan(&members(), &seen, &mut mem, Instant::now(), AFTER),
            Plan::Wait(_)
        ));
        // A stale primary of a newer term beside the serving one: the serving one wins.
        let seen = [
            primary_of(9, &[("b1:1", "failed")]),
            primary_of(4, &[("p:1", "failed"), ("b2:1", "in-sync")]),
            backup(4, true, 4, 0),
        ];
        assert!(matches!(
            plan(&members(), &seen, &mut mem, Instant::now(), AFTER),
            Plan::Serving { primary: 1, .. }
        ));
    }

    #[test]
    fn a_dead_primary_is_failed_over_to_an_in_sync_backup_after_the_delay() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        let p = plan(
            &members(),
            &seen,
            &mut mem,
            t0 + Duration::from_secs(1),
            AFTER,
        );
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("does not answer")),
            "{p:?}"
        );
        let p = plan(
            &members(),
            &seen,
            &mut mem,
            t0 + Duration::from_secs(4),
            AFTER,
        );
        assert_eq!(
            p,
            Plan::Promote {
                member: 1,
                others: vec![0, 2],
                min_term: 3,
                down_for: Duration::from_secs(3),
            }
        );
    }

    #[test]
    fn only_a_backup_in_sync_at_the_last_observation_is_promoted() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        let seen = [
            primary_of(3, &[("b1:1", "failed"), ("b2:1", "in-sync")]),
            backup(3, true, 3, 0),
            backup(3, true, 3, 0),
        ];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        let seen = [silent(), backup(3, true, 3, 0), silent()];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        // b1 says complete but failed (its copy may be older); b2 is gone: stuck.
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(&p, Plan::Stuck(s) if s.contains("b2:1")), "{p:?}");
        // b2 answers again, as a backup with its copy: promoted.
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 2, .. }), "{p:?}");
    }

    #[test]
    fn a_copy_of_another_term_or_an_older_generation_is_not_promoted() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        mem.serving.as_mut().unwrap().generation = 2;
        let seen = [silent(), backup(3, true, 2, 2), backup(3, true, 3, 1)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Stuck(_)), "{p:?}");
        let seen = [silent(), backup(3, false, 3, 2), backup(3, true, 3, 2)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 2, .. }), "{p:?}");
    }

    #[test]
    fn the_newest_generation_wins_and_a_newer_term_stops_the_failover() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        // b1 was removed after the observation (b2 recorded generation 1): b2 is promoted.
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 1)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert_eq!(
            p,
            Plan::Promote {
                member: 2,
                others: vec![0, 1],
                min_term: 3,
                down_for: AFTER,
            }
        );
        // b1 accepted a term after the observation's (the old primary restarted, reached it
        // and died again; or b1's promotion half happened): whatever that term acknowledged
        // may be missing from b2, so nothing is promoted.
        let seen = [silent(), backup(4, false, 4, 0), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Stuck(s) if s.contains("term 4")),
            "{p:?}"
        );
    }

    #[test]
    fn a_newer_primary_someone_promoted_is_waited_for() {
        // The answer to a Promote was lost, or another monitor promoted b1.
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        let seen = [
            silent(),
            primary_of(5, &[("b2:1", "syncing")]),
            backup(3, true, 3, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(&p, Plan::Wait(w) if w.contains("term 5")), "{p:?}");
        assert_eq!(mem.serving, None, "b2 must not be promoted beside b1");
        let seen = [
            silent(),
            primary_of(5, &[("b2:1", "in-sync")]),
            backup(5, true, 5, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0 + 2 * AFTER, AFTER);
        assert_eq!(p, serving(1, 5, true, vec![]));
    }

    #[test]
    fn nothing_is_added_while_the_primary_lists_a_backup_no_member_names() {
        let mut mem = Memory::default();
        let seen = [
            primary_of(3, &[("localhost:1", "in-sync")]),
            backup(3, true, 3, 0),
            backup(3, true, 3, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, Instant::now(), AFTER);
        assert!(matches!(p, Plan::Wait(_)), "{p:?}");
        let seen = [
            primary_of(3, &[("b1:1", "in-sync"), ("localhost:1", "syncing")]),
            backup(3, true, 3, 0),
            backup(3, true, 3, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, Instant::now(), AFTER);
        assert_eq!(
            p,
            Plan::Serving {
                primary: 0,
                term: 3,
                point: true,
                add: vec![],
                unknown: vec!["localhost:1".into()],
            }
        );
    }

    #[test]
    fn a_primary_restarted_in_place_is_not_failed_over() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        mem.pointed = None; // another monitor led meanwhile: not known
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        let seen = [
            primary_of(4, &[("b1:1", "syncing"), ("b2:1", "syncing")]),
            backup(4, false, 4, 0),
            backup(4, false, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("restarted")),
            "{p:?}"
        );
        assert_eq!(mem.serving, None);
        // Killed again before a backup is in sync: its backups' copies are incomplete, and the
        // old observation is gone: nothing is promoted.
        let seen = [silent(), backup(4, false, 4, 0), backup(4, false, 4, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + 3 * AFTER, AFTER);
        assert!(matches!(p, Plan::Wait(_)), "{p:?}");
    }

    #[test]
    fn the_promoted_member_serves_at_once_and_the_old_primary_is_added_back() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        mem.pointed = Some(1);
        mem.serving = None;
        let seen = [
            silent(),
            primary_of(5, &[("b2:1", "syncing")]),
            backup(5, false, 5, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert_eq!(p, serving(1, 5, false, vec![]));
        // The old primary comes back as a backup (it demoted itself): added.
        let seen = [
            backup(5, false, 3, 0),
            primary_of(5, &[("b2:1", "in-sync")]),
            backup(5, true, 5, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert_eq!(p, serving(1, 5, false, vec![0]));
    }

    #[test]
    fn nothing_is_failed_over_without_an_observation() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(matches!(p, Plan::Wait(_)), "{p:?}");
        // Reported as stuck once no member has answered as a primary for the delay.
        for s in [3, 100] {
            let p = plan(
                &members(),
                &seen,
                &mut mem,
                t0 + Duration::from_secs(s),
                AFTER,
            );
            assert!(
                matches!(&p, Plan::Stuck(w) if w.contains("operator")),
                "{p:?}"
            );
        }
    }

    #[test]
    fn the_promoted_member_serves_beside_a_restarted_old_primary_of_a_newer_term() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        mem.pointed = Some(1);
        mem.serving = None;
        let seen = [
            primary_of(9, &[("b1:1", "failed")]),
            primary_of(5, &[("b2:1", "syncing")]),
            backup(5, false, 5, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert_eq!(p, serving(1, 5, false, vec![]));
    }

    #[test]
    fn a_promote_of_unknown_outcome_pins_the_observation_to_its_target() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        // The watcher promoted b1 and got no answer.
        mem.promote_only = Some((1, t0 + 2 * AFTER));
        mem.pointed = Some(1);
        // b1 opens its pool as the primary: it answers nothing; b2 is not promoted.
        let seen = [silent(), silent(), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(&p, Plan::Wait(w) if w.contains("b1:1")), "{p:?}");
        // b1 raised its term (the Promote reached it): still a wait, not a newer-term alarm.
        let seen = [silent(), backup(4, true, 3, 0), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(&p, Plan::Wait(w) if w.contains("b1:1")), "{p:?}");
        // ... for as long as the delay: then reported stuck, still promoting nobody else.
        let p = plan(&members(), &seen, &mut mem, t0 + 2 * AFTER, AFTER);
        assert!(matches!(&p, Plan::Stuck(w) if w.contains("b1:1")), "{p:?}");
        // b1 still a backup (the call never arrived): promoted again, b1 only.
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 1, .. }), "{p:?}");
        // b1 serves: the pin is cleared.
        let seen = [
            silent(),
            primary_of(5, &[("p:1", "attaching"), ("b2:1", "syncing")]),
            backup(5, false, 5, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert_eq!(p, serving(1, 5, false, vec![]));
        assert_eq!(mem.promote_only, None);
    }

    #[test]
    fn a_refused_promotion_tries_another_backup_of_the_observation() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        // b1's Promote was refused (its marker names another copy, say).
        mem.refused.push(1);
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 2, .. }), "{p:?}");
    }

    #[test]
    fn a_backup_that_says_it_cannot_be_promoted_is_not_asked() {
        // Its Promote would be refused: asking it first would cost the outage a round.
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        let seen = [silent(), unpromotable(), backup(3, true, 3, 0)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 2, .. }), "{p:?}");
        // None of them can be: stuck, each named with its reason.
        let seen = [silent(), unpromotable(), unpromotable()];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Stuck(w) if w.contains("2 say they cannot be promoted")
                && w.contains("b1:1: may pin only 1048576 bytes")
                && w.contains("b2:1: may pin only 1048576 bytes")),
            "{p:?}"
        );
        // One refused (for another reason), the other cannot be: both said.
        mem.refused.push(1);
        let seen = [silent(), backup(3, true, 3, 0), unpromotable()];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Stuck(w) if w.contains("b1:1 refused to be promoted")
                && w.contains("one says it cannot be promoted (b2:1: may pin only")),
            "{p:?}"
        );
        mem.refused.clear();
        // A backup the plan is pinned to (its Promote's outcome not known) is still waited
        // for and asked: whether it promotes itself is not up to its status.
        mem.promote_only = Some((1, t0 + 10 * AFTER));
        let seen = [silent(), unpromotable(), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 1, .. }), "{p:?}");
    }

    #[test]
    fn promotability_counts_the_backups_in_sync_that_could_take_over() {
        let mut mem = Memory::default();
        assert_eq!(promotability(&[silent(), silent(), silent()], &mem), None);
        steady(&mut mem, Instant::now());
        let p = primary_of(3, &[("b1:1", "in-sync"), ("b2:1", "in-sync")]);
        let seen = [p.clone(), unpromotable(), backup(3, true, 3, 0)];
        let why = "may pin only 1048576 bytes".to_string();
        assert_eq!(
            promotability(&seen, &mem),
            Some(Promotability {
                in_sync: vec![1, 2],
                promotable: 1,
                unpromotable: vec![(1, why.clone())],
            })
        );
        // b2 copying again, silent, or refused already: it counts neither way.
        for b2 in [backup(3, false, 3, 0), silent(), backup(3, true, 3, 0)] {
            if b2 == backup(3, true, 3, 0) {
                mem.refused.push(2);
            }
            let seen = [p.clone(), unpromotable(), b2];
            assert_eq!(
                promotability(&seen, &mem),
                Some(Promotability {
                    in_sync: vec![1, 2],
                    promotable: 0,
                    unpromotable: vec![(1, why.clone())],
                })
            );
        }
        mem.refused.clear();
        // b1 of an older generation than b2's (removed from the set since): it would not be
        // promoted whatever its limit, so it is not named.
        let mut newer = backup(3, true, 3, 1);
        if let Ok(s) = &mut newer {
            s.not_promotable = Some(why.clone());
        }
        let seen = [p.clone(), unpromotable(), newer];
        assert_eq!(
            promotability(&seen, &mem),
            Some(Promotability {
                in_sync: vec![1, 2],
                promotable: 0,
                unpromotable: vec![(2, why.clone())],
            })
        );
    }

    #[test]
    fn a_pin_on_a_member_not_seen_in_sync_is_stuck_on_that_member() {
        // The last leader's note names b2, which this monitor last saw failed, not in sync
        // (its observation is newer than the writer's): b2 is not promoted, nor is b1 (the
        // pin), and the message says it waits for b2 and why.
        let mut mem = Memory::default();
        let t0 = Instant::now();
        let seen = [
            primary_of(3, &[("b1:1", "in-sync"), ("b2:1", "failed")]),
            backup(3, true, 3, 0),
            backup(3, true, 3, 0),
        ];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        mem.promote_only = Some((2, t0));
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        let Plan::Stuck(why) = &p else {
            panic!("{p:?}")
        };
        assert!(
            why.contains("b2:1 is the only backup") && why.contains("not in sync"),
            "{why}"
        );
        // Pinned to b1, in sync, whose copy is now incomplete: named, with its copy's state.
        mem.promote_only = Some((1, t0));
        let seen = [silent(), backup(3, false, 3, 0), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Stuck(w) if w.contains("b1:1 is the only backup") && w.contains("incomplete")),
            "{p:?}"
        );
    }

    #[test]
    fn a_backup_not_reached_is_tried_after_the_others_and_again_after_the_delay() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        let seen = [silent(), backup(3, true, 3, 0), backup(3, true, 3, 0)];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        let t1 = t0 + AFTER;
        // b1's Promote could not be sent: b2 is promoted first.
        mem.not_reached.push(NotReached {
            member: 1,
            at: t1,
            stuck_at: t1 + 2 * AFTER,
        });
        let p = plan(&members(), &seen, &mut mem, t1, AFTER);
        assert!(matches!(p, Plan::Promote { member: 2, .. }), "{p:?}");
        // b2 refused: b1 is waited for until the delay passed since its try, then asked again.
        mem.refused.push(2);
        let p = plan(&members(), &seen, &mut mem, t1 + AFTER / 2, AFTER);
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("b1:1") && w.contains("could not be sent")),
            "{p:?}"
        );
        let p = plan(&members(), &seen, &mut mem, t1 + AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 1, .. }), "{p:?}");
        // Not sent again, and past its stuck time: still asked again later, but reported.
        mem.not_reached[0].at = t1 + 2 * AFTER;
        let p = plan(&members(), &seen, &mut mem, t1 + 2 * AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Stuck(w) if w.contains("b1:1") && w.contains("promotion_stuck_after_ms")),
            "{p:?}"
        );
        let p = plan(&members(), &seen, &mut mem, t1 + 3 * AFTER, AFTER);
        assert!(matches!(p, Plan::Promote { member: 1, .. }), "{p:?}");
        // A primary serves: forgotten.
        let seen = [
            silent(),
            primary_of(4, &[("b2:1", "in-sync")]),
            backup(4, true, 4, 0),
        ];
        plan(&members(), &seen, &mut mem, t1 + AFTER, AFTER);
        assert!(mem.not_reached.is_empty() && mem.refused.is_empty());
    }

    #[test]
    fn a_promoted_backup_is_waited_for_until_its_stuck_time_unless_it_answers_as_a_primary() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        // Promoted (answered): the observation is dropped, the promotion remembered.
        mem.promoted = Some(Promoted {
            member: 1,
            stuck_at: t0 + 10 * AFTER,
            from_term: 3,
            noted: false,
        });
        let seen = [silent(), silent(), backup(3, true, 3, 0)];
        // Long past failover_after, nothing else is promoted and it is no alarm yet.
        let p = plan(&members(), &seen, &mut mem, t0 + 5 * AFTER, AFTER);
        assert!(matches!(&p, Plan::Wait(w) if w.contains("b1:1")), "{p:?}");
        let p = plan(&members(), &seen, &mut mem, t0 + 10 * AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Stuck(w) if w.contains("b1:1") && w.contains("promotion_stuck_after_ms")),
            "{p:?}"
        );
        // Answering as a primary that copies its backups (not pointed at: not serving yet).
        let seen = [
            silent(),
            primary_of(4, &[("b2:1", "syncing")]),
            backup(4, false, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0 + 20 * AFTER, AFTER);
        assert!(matches!(&p, Plan::Wait(w) if w.contains("b1:1")), "{p:?}");
        // In sync: serving, and the promotion is forgotten.
        let seen = [
            silent(),
            primary_of(4, &[("b2:1", "in-sync")]),
            backup(4, true, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0 + 20 * AFTER, AFTER);
        assert_eq!(p, serving(1, 4, true, vec![]));
        assert_eq!(mem.promoted, None);
    }

    /// b1 served under `term` with b2 in sync; it stops answering and p comes back with its
    /// stale view (term 3, b2 in sync): p is not served (the wait names it), and b2 is
    /// promoted from the observation of b1 once the delay passed.
    fn b1_dies_and_b2_not_p_takes_over(mem: &mut Memory, t0: Instant, term: u64) {
        let seen = [stale_old_primary(), silent(), backup(term, true, term, 0)];
        let p = plan(&members(), &seen, mem, t0, AFTER);
        let below = format!("p:1 answers as a primary of term 3, below term {term}");
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("b1:1") && w.contains(&below)),
            "{p:?}"
        );
        let p = plan(&members(), &seen, mem, t0 + AFTER, AFTER);
        assert!(
            matches!(p, Plan::Promote { member: 2, min_term, .. } if min_term == term),
            "{p:?}"
        );
    }

    /// p (term 3) back with a stale view: b2 still in sync, b1 failed.
    fn stale_old_primary() -> Seen {
        primary_of(3, &[("b1:1", "failed"), ("b2:1", "in-sync")])
    }

    #[test]
    fn the_old_primary_back_during_a_pinned_promotion_is_not_served_and_the_observation_stays() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        plan(
            &members(),
            &[silent(), silent(), backup(3, true, 3, 0)],
            &mut mem,
            t0,
            AFTER,
        );
        mem.promote_only = Some((1, t0 + 10 * AFTER));
        mem.pointed = Some(1);
        let seen = [stale_old_primary(), silent(), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0 + 2 * AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("b1:1") && w.contains("p:1 answers as a primary of term 3, below term 4")),
            "{p:?}"
        );
        assert_eq!(mem.serving.as_ref().map(|s| s.member), Some(0));
        // Within the failover delay the message is about p, still not served.
        let mut early = Memory::default();
        steady(&mut early, t0);
        plan(
            &members(),
            &[silent(), silent(), backup(3, true, 3, 0)],
            &mut early,
            t0,
            AFTER,
        );
        early.promote_only = Some((1, t0 + 10 * AFTER));
        let p = plan(&members(), &seen, &mut early, t0 + AFTER / 2, AFTER);
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("p:1 answers as a primary below the term floor")),
            "{p:?}"
        );
        // The pinned backup answers as a backup of the observation's term: the Promote never
        // reached it, and p serves again.
        let seen = [
            stale_old_primary(),
            backup(3, true, 3, 0),
            backup(3, true, 3, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0 + 2 * AFTER, AFTER);
        assert_eq!(p, serving(0, 3, true, vec![]));
    }

    #[test]
    fn the_old_primary_stays_replaced_until_the_promoted_one_has_a_backup_in_sync() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        mem.promoted = Some(Promoted {
            member: 1,
            stuck_at: t0 + 10 * AFTER,
            from_term: 3,
            noted: false,
        });
        mem.pointed = Some(1);
        let copying = primary_of(4, &[("b2:1", "syncing")]);
        // Opening its pool: p, back, is named in the wait.
        let seen = [stale_old_primary(), silent(), backup(3, true, 3, 0)];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("b1:1") && w.contains("p:1 answers as a primary of term 3, below term 4")),
            "{p:?}"
        );
        // b1 answers as a primary and copies b2: it serves (the chosen one), p does not, in
        // this round and the next.
        let seen = [stale_old_primary(), copying.clone(), backup(4, false, 4, 0)];
        for _ in 0..2 {
            let p = plan(&members(), &seen, &mut mem, t0, AFTER);
            assert!(matches!(p, Plan::Serving { primary: 1, .. }), "{p:?}");
            assert_eq!(mem.term_floor, 4);
        }
        // A lead change forgets the chosen primary: p is still not served.
        mem.pointed = None;
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(matches!(p, Plan::Wait(_)), "{p:?}");
        // b2 in sync with b1: served, and the old term forgotten.
        let seen = [
            stale_old_primary(),
            primary_of(4, &[("b2:1", "in-sync")]),
            backup(4, true, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(matches!(p, Plan::Serving { primary: 1, .. }), "{p:?}");
        assert_eq!(mem.term_floor, 4);
        // b1 stops answering: p, still reporting b2 in sync, is not served.
        b1_dies_and_b2_not_p_takes_over(&mut mem, t0, 4);
    }

    #[test]
    fn a_primary_of_a_newer_term_than_the_replaced_one_serves_during_the_wait() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        mem.promoted = Some(Promoted {
            member: 1,
            stuck_at: t0 + 10 * AFTER,
            from_term: 3,
            noted: false,
        });
        // p restarted (a new term) and got b2 in sync before b1 served: it holds everything
        // it acknowledged, and serves (the tie with b1's term is the backups' to settle).
        let seen = [
            primary_of(4, &[("b2:1", "in-sync")]),
            silent(),
            backup(4, true, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert_eq!(p, serving(0, 4, true, vec![]));
        assert_eq!(mem.promoted, None);
    }

    #[test]
    fn a_primary_of_a_newer_term_seen_replaces_the_observed_one() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        mem.pointed = None;
        // b1 answers as a primary of term 4 nobody here promoted (a lost answer, an operator).
        let seen = [
            silent(),
            primary_of(4, &[("b2:1", "syncing")]),
            backup(4, false, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(matches!(&p, Plan::Wait(w) if w.contains("newer")), "{p:?}");
        assert_eq!(mem.term_floor, 4);
        // p back with its stale view is not served.
        let seen = [
            stale_old_primary(),
            primary_of(4, &[("b2:1", "syncing")]),
            backup(4, false, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(matches!(p, Plan::Wait(_)), "{p:?}");
    }

    #[test]
    fn a_primary_seen_serving_under_a_newer_term_raises_the_floor() {
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        // b1 serves under term 5 with b2 in sync (promoted by another monitor: this one was a
        // standby, or started after).
        let seen = [
            silent(),
            primary_of(5, &[("b2:1", "in-sync")]),
            backup(5, true, 5, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(matches!(p, Plan::Serving { primary: 1, .. }), "{p:?}");
        assert_eq!(mem.term_floor, 5);
        // b1 dies; p comes back still reporting b2 in sync at term 3: not served.
        b1_dies_and_b2_not_p_takes_over(&mut mem, t0, 5);
    }

    /// b1 was promoted from p's term 3 and serves with b2 in sync (b2 accepted term 4), out of
    /// this monitor's reach; p is back with its stale view (term 3, b2 in sync).
    fn b1_serves_out_of_reach_and_p_is_back() -> [Seen; 3] {
        [stale_old_primary(), silent(), backup(4, true, 4, 0)]
    }

    #[test]
    fn a_monitor_started_afresh_does_not_serve_a_primary_below_a_backups_term() {
        // No memory at all (a monitor pod started since the promotion): b2's own answer says
        // a primary of term 4 attached it, so p, below it, is not served.
        let mut mem = Memory::default();
        let t0 = Instant::now();
        let p = plan(
            &members(),
            &b1_serves_out_of_reach_and_p_is_back(),
            &mut mem,
            t0,
            AFTER,
        );
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("p:1 answers as a primary of term 3, below term 4")),
            "{p:?}"
        );
        assert_eq!(term_floor(&mem, &b1_serves_out_of_reach_and_p_is_back()), 4);
        // Counted for the round, not kept: nothing served.
        assert_eq!(mem.term_floor, 0);
        assert_eq!(mem.pointed, None);
        // b1 reachable again: it serves.
        let seen = [
            stale_old_primary(),
            primary_of(4, &[("b2:1", "in-sync")]),
            backup(4, true, 4, 0),
        ];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert_eq!(p, serving(1, 4, true, vec![]));
    }

    #[test]
    fn a_standby_that_missed_the_promotion_does_not_serve_the_old_primary() {
        // This monitor last saw p serve (term 3) and none of the rounds since: it takes over
        // while b1 serves out of its reach. p is not served, and nothing is promoted from the
        // old observation (b2 holds a newer term: stuck, for an operator).
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        mem.pointed = None;
        let seen = b1_serves_out_of_reach_and_p_is_back();
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(
            matches!(&p, Plan::Wait(w) if w.contains("below term 4")),
            "{p:?}"
        );
        let p = plan(&members(), &seen, &mut mem, t0 + 2 * AFTER, AFTER);
        assert!(
            matches!(&p, Plan::Stuck(w) if w.contains("holds term 4")),
            "{p:?}"
        );
        assert_eq!(mem.pointed, None);
    }

    #[test]
    fn a_backup_that_no_longer_answers_raises_nothing() {
        // b2 answered once as a backup of term 6 and went silent: the floor is not kept, so
        // the failover from p's observation goes on (as the stuck rule, which reads this
        // round's answers, lets it), and the backup it promotes serves.
        let mut mem = Memory::default();
        let t0 = Instant::now();
        steady(&mut mem, t0);
        let seen = [silent(), backup(3, true, 3, 0), backup(6, false, 6, 0)];
        let p = plan(&members(), &seen, &mut mem, t0, AFTER);
        assert!(matches!(p, Plan::Wait(_)), "{p:?}");
        let seen = [silent(), backup(3, true, 3, 0), silent()];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(
            matches!(
                p,
                Plan::Promote {
                    member: 1,
                    min_term: 3,
                    ..
                }
            ),
            "{p:?}"
        );
        mem.promoted = Some(Promoted {
            member: 1,
            stuck_at: t0 + 10 * AFTER,
            from_term: 3,
            noted: false,
        });
        mem.pointed = Some(1);
        mem.serving = None;
        let seen = [silent(), primary_of(5, &[("b2:1", "attaching")]), silent()];
        let p = plan(&members(), &seen, &mut mem, t0 + AFTER, AFTER);
        assert!(matches!(p, Plan::Serving { primary: 1, .. }), "{p:?}");
    }

    #[test]
    fn a_primary_that_never_gets_a_backup_in_sync_is_reported_after_the_stuck_delay() {
        let stuck_after = 10 * AFTER;
        let mut mem = Memory::default();
        let t0 = Instant::now();
        // Restarted, its backups down: it answers as a primary, attaching them forever.
        let seen = [
            primary_of(4, &[("b1:1", "attaching"), ("b2:1", "attaching")]),
            silent(),
            silent(),
        ];
        plan(&members(), &seen, &mut mem, t0, AFTER);
        assert_eq!(
            unserved_report(&members(), &seen, &mem, t0, stuck_after),
            None
        );
        let p = plan(&members(), &seen, &mut mem, t0 + stuck_after, AFTER);
        // The plan still waits (nothing to fail over from); the report says why.
        assert!(matches!(p, Plan::Wait(_)), "{p:?}");
        let report = unserved_report(&members(), &seen, &mem, t0 + stuck_after, stuck_after);
        let report = report.expect("reported");
        assert!(
            report.contains("p:1 is a primary of term 4 (backups: b1:1 attaching, b2:1 attaching)")
                && report.contains("b1:1 does not answer"),
            "{report}"
        );
        // Served by the member this watcher chose without a backup in sync: still reported.
        mem.pointed = Some(0);
        plan(&members(), &seen, &mut mem, t0 + stuck_after, AFTER);
        assert!(unserved_report(&members(), &seen, &mem, t0 + stuck_after, stuck_after).is_some());
        // A backup in sync: not reported any more.
        let seen = [
            primary_of(4, &[("b1:1", "in-sync"), ("b2:1", "attaching")]),
            backup(4, true, 4, 0),
            silent(),
        ];
        plan(&members(), &seen, &mut mem, t0 + stuck_after, AFTER);
        assert_eq!(mem.unserved_since, None);
        assert_eq!(
            unserved_report(&members(), &seen, &mem, t0 + 2 * stuck_after, stuck_after),
            None
        );
    }
}
