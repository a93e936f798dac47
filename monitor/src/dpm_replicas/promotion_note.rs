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
//! - a note older than [`FRESH_FOR`] (its leader died long ago, or it was left behind by a
//!   leader that could not remove it) pins nothing; neither does one naming no member;
//! - the format is `<member address> <unix milliseconds>`; anything else pins nothing (and is
//!   logged by the caller).

use std::time::Duration;

/// How long a note pins a new leader's observation. A promotion answers as soon as the backup
/// has recorded its term and role; opening the pool as a primary then takes seconds, or
/// minutes for a pool of hundreds of GiB. Longer than that, the noted backup has long served
/// (and the note was removed) or failed, and an operator decides.
pub const FRESH_FOR: Duration = Duration::from_secs(10 * 60);

/// The note for a promotion of `member`, written at `unix_ms`.
pub fn encode(member: &str, unix_ms: u64) -> String {
    format!("{member} {unix_ms}")
}

/// The member a note pins, if it is well formed, names a member and is fresh at `now_unix_ms`.
/// `Err` says why a note pins nothing.
pub fn pinned(note: &str, members: &[String], now_unix_ms: u64) -> Result<usize, String> {
    let mut parts = note.split_whitespace();
    let (Some(address), Some(at), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(format!("not `<address> <unix ms>`: {note:?}"));
    };
    let at: u64 = at
        .parse()
        .map_err(|_| format!("not `<address> <unix ms>`: {note:?}"))?;
    let member = members
        .iter()
        .position(|m| m == address)
        .ok_or_else(|| format!("{address} is no member of [dpm_replicas]"))?;
    let age = Duration::from_millis(now_unix_ms.saturating_sub(at));
    if age > FRESH_FOR {
        return Err(format!(
            "written {} s ago, longer than {} s",
            age.as_secs(),
            FRESH_FOR.as_secs()
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

    #[test]
    fn a_fresh_note_pins_the_member_it_names() {
        let now = 1_800_000_000_000;
        assert_eq!(pinned(&encode("b2:1", now - 5_000), &members(), now), Ok(2));
        // A clock a little behind the writer's: not "from the future", just fresh.
        assert_eq!(pinned(&encode("b1:1", now + 2_000), &members(), now), Ok(1));
    }

    #[test]
    fn a_stale_malformed_or_foreign_note_pins_nothing() {
        let now = 1_800_000_000_000;
        let stale = now - FRESH_FOR.as_millis() as u64 - 1;
        assert!(pinned(&encode("b1:1", stale), &members(), now)
            .unwrap_err()
            .contains("ago"));
        assert!(pinned(&encode("x:1", now), &members(), now)
            .unwrap_err()
            .contains("no member"));
        for bad in ["", "b1:1", "b1:1 soon", "b1:1 1 2"] {
            assert!(pinned(bad, &members(), now).is_err(), "{bad:?}");
        }
    }
}
