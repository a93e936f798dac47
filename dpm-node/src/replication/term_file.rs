//! `<pool>.term`: what a backup of this pool accepted ([`Accepted`]: the term and primary
//! start it follows, the replica-set generation it was told, and the oldest image it takes),
//! durable before an attach is answered. A demoted primary writes it too
//! ([`super::role_file::demote`]), and a promoted primary once its own image serves
//! ([`note_own_image`]).
//!
//! Format: one line, "TERM INSTANCE GENERATION", then "FLOOR_TERM FLOOR_INSTANCE
//! FLOOR_GENERATION" when the floor is not the accepted image itself; older builds wrote the
//! first one or two words.

use std::path::{Path, PathBuf};

use super::durable::write_durably;
use super::image::{Accepted, ImageId};
use crate::error::{DpmError, Result};

pub(super) fn term_path(pool: &Path) -> PathBuf {
    let mut p = pool.as_os_str().to_owned();
    p.push(".term");
    PathBuf::from(p)
}

/// What a backup of `pool` accepted last (`<pool>.term`: "TERM INSTANCE GENERATION", then
/// the floor's "TERM INSTANCE GENERATION" when it has one; older builds wrote the first one or
/// two words).
pub fn read_accepted(pool: &Path) -> Result<Accepted> {
    let bad = |s: &str| DpmError::BadPool {
        path: term_path(pool).display().to_string(),
        detail: format!(
            "holds {s:?}, not \"TERM INSTANCE GENERATION [FLOOR_TERM FLOOR_INSTANCE \
             FLOOR_GENERATION]\""
        ),
    };
    match std::fs::read_to_string(term_path(pool)) {
        Ok(s) => {
            let words: Vec<u64> = s
                .split_whitespace()
                .map(str::parse::<u64>)
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| bad(&s))?;
            let floor = |w: &[u64]| ImageId {
                term: w[0],
                instance: w[1],
                generation: w[2],
            };
            let (term, instance, generation, floor) = match words.as_slice() {
                [t] => (*t, 0, 0, None),
                [t, i] => (*t, *i, 0, None),
                [t, i, g] => (*t, *i, *g, None),
                [t, i, g, f @ ..] if f.len() == 3 => (*t, *i, *g, Some(floor(f))),
                _ => return Err(bad(&s)),
            };
            Ok(Accepted {
                term,
                instance,
                generation,
                floor,
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Accepted::default()),
        Err(e) => Err(e.into()),
    }
}

pub(super) fn write_accepted(pool: &Path, a: Accepted) -> Result<()> {
    let floor = a.floor.map_or(String::new(), |f| {
        format!(" {} {} {}", f.term, f.instance, f.generation)
    });
    write_durably(
        &term_path(pool),
        &format!("{} {} {}{floor}\n", a.term, a.instance, a.generation),
    )
}

/// Records, in a promoted primary's `<pool>.term`, the image it serves now (`image`: its own
/// term and start, once a backup accepted it, and the set's generation), as the start it
/// follows with no floor: started again as a backup (its recorded role deleted), it refuses
/// the images of the older primary its copy came from, as it did before its promotion. A
/// pool without the file (never a backup's) is left without one.
pub fn note_own_image(pool: &Path, image: ImageId) -> Result<()> {
    if !term_path(pool).exists() {
        return Ok(());
    }
    let accepted = read_accepted(pool)?;
    if (accepted.term, accepted.floor) == (image.term, None)
        && (accepted.instance, accepted.generation) == (image.instance, image.generation)
    {
        return Ok(());
    }
    write_accepted(
        pool,
        Accepted {
            term: image.term.max(accepted.term),
            instance: image.instance,
            generation: image.generation,
            floor: None,
        },
    )
}
