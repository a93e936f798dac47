//! `<pool>.copy`, the copy marker ([`CopyMarker`]): whether a backup's pool holds a finished
//! copy of its primary's (a consistent image) or a copy in progress. See the `backup` module's
//! invariants and docs/decisions/0007-dpm-replication.md.

use std::path::{Path, PathBuf};

use super::durable::{sync_dir_of, write_durably};
use crate::error::{DpmError, Result};

/// The version of the copy marker's format this build writes and reads.
const COPY_MARKER_FORMAT: u32 = 1;

/// Where the marker of `pool`'s copy is kept: `<pool>.copy`, beside the pool (and its
/// `<pool>.term`). `dinomo up` renames it with the pool when it promotes a backup.
pub fn copy_marker_path(pool: &Path) -> PathBuf {
    let mut p = pool.as_os_str().to_owned();
    p.push(".copy");
    PathBuf::from(p)
}

/// Whether a backup's copy of its primary's pool was finished (see the invariants of
/// [`super::backup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyState {
    /// An attach started the copy and it was not finished: the pool mixes copied chunks with
    /// zeroed ones, or (an incremental copy) with chunks of an older image, maybe of another
    /// primary, writes it never acknowledged included. Opened as a primary's, recovery would
    /// make it look consistent while losing data or bringing back stale data.
    Incomplete,
    /// The backup held a consistent image (it caught up with its primary) when its primary
    /// said so; it may be older than the primary's last state, never a mix.
    Complete,
}

impl CopyState {
    pub fn as_str(self) -> &'static str {
        match self {
            CopyState::Incomplete => "incomplete",
            CopyState::Complete => "complete",
        }
    }
}

/// What `<pool>.copy` says: the state of the copy made by one attach.
///
/// Format (version 1), text, one `name value` pair a line:
/// ```text
/// format 1
/// state incomplete
/// term 7
/// instance 1234567
/// copy 89
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyMarker {
    pub state: CopyState,
    /// The primary's term and instance that attached the backup and made this copy.
    pub term: u64,
    pub instance: u64,
    /// A number the backup drew for this attach: a CopyComplete call must name it, so that a
    /// late call about an earlier copy cannot mark a newer one complete.
    pub copy: u64,
}

impl CopyMarker {
    fn to_text(self) -> String {
        format!(
            "format {COPY_MARKER_FORMAT}\nstate {}\nterm {}\ninstance {}\ncopy {}\n",
            self.state.as_str(),
            self.term,
            self.instance,
            self.copy
        )
    }

    fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut fields = std::collections::HashMap::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let (name, value) = line
                .trim()
                .split_once(' ')
                .ok_or_else(|| format!("line {line:?} is not \"NAME VALUE\""))?;
            fields.insert(name, value.trim());
        }
        match fields.get("format") {
            Some(v) if *v == COPY_MARKER_FORMAT.to_string() => {}
            Some(v) => {
                return Err(format!(
                    "is format {v}; this dpm-node reads format {COPY_MARKER_FORMAT}"
                ))
            }
            None => return Err("has no \"format\" line".into()),
        }
        let number = |name: &str| -> std::result::Result<u64, String> {
            fields
                .get(name)
                .ok_or_else(|| format!("has no {name:?} line"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))
        };
        let state = match fields.get("state").copied() {
            Some("incomplete") => CopyState::Incomplete,
            Some("complete") => CopyState::Complete,
            Some(s) => return Err(format!("state {s:?}: expected incomplete or complete")),
            None => return Err("has no \"state\" line".into()),
        };
        Ok(CopyMarker {
            state,
            term: number("term")?,
            instance: number("instance")?,
            copy: number("copy")?,
        })
    }
}

/// What `<pool>.copy` says, if it exists (a pool that never was a backup's has none).
pub fn read_copy_marker(pool: &Path) -> Result<Option<CopyMarker>> {
    let path = copy_marker_path(pool);
    match std::fs::read(&path) {
        Ok(bytes) => std::str::from_utf8(&bytes)
            .map_err(|_| "is not text".to_string())
            .and_then(CopyMarker::parse)
            .map(Some)
            .map_err(|detail| DpmError::BadPool {
                path: path.display().to_string(),
                detail: format!(
                    "the copy marker {detail}; it says whether this pool holds a finished copy \
                     of a primary's pool (docs/decisions/0007-dpm-replication.md)"
                ),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

pub(super) fn write_copy_marker(pool: &Path, m: CopyMarker) -> Result<()> {
    write_durably(&copy_marker_path(pool), &m.to_text())
}

/// Removes `<pool>.copy` (durably), if it exists: done once a primary opened the pool, so that
/// the pool is a primary's own from then on (see [`crate::dpm::Dpm::open`]).
pub fn remove_copy_marker(pool: &Path) -> Result<()> {
    let path = copy_marker_path(pool);
    match std::fs::remove_file(&path) {
        Ok(()) => {
            sync_dir_of(&path);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}
