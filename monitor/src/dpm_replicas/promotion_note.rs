//! The promotion a leading monitor is about to ask for, written where the next leader reads
//! it (the Lease, [`super::Leadership::leave_note`]) before the Promote is sent.
//!
//! Why: a standby that takes over while the backup the dead leader promoted is still opening
//! its pool sees that backup answer nothing, and its own observation would let it promote
//! another backup of it: two primaries of one set (the backups' checks stop one, but the set
//! serves nothing until one wins). With the note the new leader pins its observation to the
//! noted backup ([`super::plan::Memory::promote_only`]): it waits for it and promotes no other.
//!
//! Invariants:
//! - a note is about one failover: the one from the serving primary observed under `term`. It
//!   pins a reader's observation only if that observation is of the same term (every start of
//!   a primary takes a new term) and names another member than that primary; a note of an
//!   earlier failover, never removed, pins nothing later, whatever its age. Its time is for
//!   logs only (clocks of two monitor pods need not agree). A pin never makes a monitor
//!   promote a backup it would not have: it waits for the noted one (asking it again if it
//!   answers as a backup of the observation's term and was in sync; a noted member the reader
//!   did not see in sync, its observation being a round newer than the writer's, leaves it
//!   stuck) and points the clients at it once it answers as a primary;
//! - a reader with no observation is pinned by no note (it promotes nothing from none); it
//!   only waits for the noted backup before it reports the failover stuck ([`parse`],
//!   `Memory::promoted`);
//! - the format is `<member address> <term> <unix milliseconds>`; anything else pins nothing
//!   (and the caller logs why).

use super::plan::Serving;

/// The note for a promotion of `member` from the observation of a primary of `term`, written
/// at `unix_ms`.
pub fn encode(member: &str, term: u64, unix_ms: u64) -> String {
    format!("{member} {term} {unix_ms}")
}

/// The member a note names, and the term of the failover it is about. `Err` says why it names
/// none.
pub fn parse(note: &str, members: &[String]) -> Result<(usize, u64), String> {
    let malformed = || format!("not `<address> <term> <unix ms>`: {note:?}");
    let mut parts = note.split_whitespace();
    let (Some(address), Some(term), Some(at), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(malformed());
    };
    let (Ok(term), Ok(_)) = (term.parse::<u64>(), at.parse::<u64>()) else {
        return Err(malformed());
    };
    let member = members
        .iter()
        .position(|m| m == address)
        .ok_or_else(|| format!("{address} is no member of [dpm_replicas]"))?;
    Ok((member, term))
}

/// The member a note pins in the observation `serving` (the last serving primary this monitor
/// saw, if any). `Err` says why it pins nothing.
pub fn pinned(note: &str, members: &[String], serving: Option<&Serving>) -> Result<usize, String> {
    let (member, term) = parse(note, members)?;
    let Some(serving) = serving else {
        return Err(
            "this monitor holds no observation of a serving primary (it promotes \
                    nothing from none)"
                .into(),
        );
    };
    if serving.term != term {
        return Err(format!(
            "it is about a failover from a primary of term {term}; this monitor last saw one \
             of term {} serve",
            serving.term
        ));
    }
    if member == serving.member {
        return Err(format!(
            "{} is the primary it fails over from",
            members[member]
        ));
    }
    Ok(member)
}

/// Milliseconds since the Unix epoch, by this machine's clock.
pub fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members() -> Vec<String> {
        ["p:1", "b1:1", "b2:1"].map(String::from).to_vec()
    }

    /// p served under term 3 with b1 and b2 in sync.
    fn observed() -> Serving {
        Serving {
            member: 0,
            term: 3,
            generation: 0,
            in_sync: vec![1, 2],
        }
    }

    #[test]
    fn a_note_of_the_observed_failover_pins_the_member_it_names() {
        let s = observed();
        assert_eq!(pinned(&encode("b2:1", 3, 1), &members(), Some(&s)), Ok(2));
        // Its time says nothing: a leader may die long after its Promote (a large pool).
        assert_eq!(pinned(&encode("b1:1", 3, 0), &members(), Some(&s)), Ok(1));
    }

    #[test]
    fn a_note_of_another_failover_pins_nothing() {
        let s = observed();
        // Left over from the failover of an earlier primary (term 2).
        let e = pinned(&encode("b1:1", 2, 1), &members(), Some(&s)).unwrap_err();
        assert!(e.contains("term 2"), "{e}");
        // No observation: nothing would be promoted anyway.
        assert!(pinned(&encode("b1:1", 3, 1), &members(), None).is_err());
        // The primary itself.
        let e = pinned(&encode("p:1", 3, 1), &members(), Some(&s)).unwrap_err();
        assert!(e.contains("the primary"), "{e}");
        // A member this monitor did not see in sync still pins: it holds this monitor back.
        let one = Serving {
            in_sync: vec![1],
            ..observed()
        };
        assert_eq!(pinned(&encode("b2:1", 3, 1), &members(), Some(&one)), Ok(2));
    }

    #[test]
    fn a_malformed_or_foreign_note_pins_nothing() {
        let s = observed();
        assert!(pinned(&encode("x:1", 3, 1), &members(), Some(&s))
            .unwrap_err()
            .contains("no member"));
        for bad in [
            "",
            "b1:1",
            "b1:1 3",
            "b1:1 3 soon",
            "b1:1 three 1",
            "b1:1 3 1 2",
        ] {
            assert!(pinned(bad, &members(), Some(&s)).is_err(), "{bad:?}");
        }
    }
}
