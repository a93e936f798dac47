//! `<pool>.role`: the role a node took at run time ([`RecordedRole`]: a backup promoted to
//! primary, or a primary deposed by a newer one), which wins over the command line at the
//! next start, and the demotion that records it.

use std::path::{Path, PathBuf};

use super::durable::write_durably;
use super::image::{Accepted, ImageId};
use super::term_file::{read_accepted, write_accepted};
use crate::error::{DpmError, Result};

/// The role a node took at run time, recorded beside its pool (`<pool>.role`, see
/// [`role_path`]): a backup promoted to primary (with the backups it replicates to), or a
/// primary deposed by a newer one. A node starts in the role its pool records, whatever its
/// command line says, so a restarted process (or pod) comes back in the role it last had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordedRole {
    Primary { backups: Vec<String> },
    Backup,
}

/// Where a node records the role it took at run time: `<pool>.role`, beside the pool (`dinomo
/// up` renames it with the pool when it promotes a backup). Deleting it makes the command
/// line decide again.
pub fn role_path(pool: &Path) -> PathBuf {
    let mut p = pool.as_os_str().to_owned();
    p.push(".role");
    PathBuf::from(p)
}

/// The role recorded beside `pool`, if any (see [`RecordedRole`]).
pub fn read_role(pool: &Path) -> Result<Option<RecordedRole>> {
    let path = role_path(pool);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let bad = |detail: String| DpmError::BadPool {
        path: path.display().to_string(),
        detail,
    };
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    match (lines.next(), lines.next(), lines.next()) {
        (Some("backup"), None, None) => Ok(Some(RecordedRole::Backup)),
        (Some("primary"), Some(list), None)
            if list.starts_with("backups") && list["backups".len()..].trim() != "" =>
        {
            Ok(Some(RecordedRole::Primary {
                backups: list["backups".len()..]
                    .split_whitespace()
                    .map(str::to_string)
                    .collect(),
            }))
        }
        _ => Err(bad(format!(
            "holds {text:?}, not \"backup\", or \"primary\" and a \"backups ADDRESS...\" line \
             naming at least one; delete it to let the command line decide the role"
        ))),
    }
}

/// Records that the primary of `pool`, whose image is `own_image`, was deposed by a replica
/// showing a newer image under `term`: its role is backup from now on, and its `.term`
/// (written first) refuses every primary of `term - 1` or older and, with its own image as the
/// floor, every primary whose image is older than its own (an older term, another start of
/// its term, an older generation of it: see [`super::image`]), so no older image is ever
/// copied over what it acknowledged. The primary that deposed it (its image at least this
/// one) attaches it. A device-DAX pool is not demoted (a backup needs a pool file, and the
/// files would be in /dev): the node just stops.
pub fn demote(pool: &Path, term: u64, own_image: ImageId) -> Result<()> {
    if dinomo_fabric::pm::DaxDevice::probe(pool)?.is_some() {
        return Err(DpmError::Config(format!(
            "{} is a device-DAX device: a backup needs a pool file, so this node is not \
             recorded as a backup; it stops",
            pool.display()
        )));
    }
    let accepted = read_accepted(pool)?;
    // Instance 0 is no primary's (instances are odd): every primary of the fence's term is
    // refused too.
    let fence = term.saturating_sub(1).max(own_image.term);
    let (term, instance) = if fence > accepted.term {
        (fence, 0)
    } else {
        (accepted.term, accepted.instance)
    };
    write_accepted(
        pool,
        Accepted {
            term,
            instance,
            generation: accepted.generation,
            floor: Some(own_image),
        },
    )?;
    write_role(pool, &RecordedRole::Backup)
}

/// Records `role` beside `pool`, durably (see [`RecordedRole`]).
pub(super) fn write_role(pool: &Path, role: &RecordedRole) -> Result<()> {
    let text = match role {
        RecordedRole::Backup => "backup\n".to_string(),
        RecordedRole::Primary { backups } => format!("primary\nbackups {}\n", backups.join(" ")),
    };
    write_durably(&role_path(pool), &text)
}
