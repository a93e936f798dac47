//! The KN's copy of its unmerged log (DINOMO invariant: unmerged segments are cached in the KN
//! that wrote them, so no other KN ever needs them): the newest entry logged for each key, and
//! which segment holds it. A segment is dropped once the DPM reports it merged, after which
//! the index has everything it held.
//!
//! One map for all segments, so a read probes one hash table instead of one per unmerged
//! segment (up to `max_unmerged_segments` + the open ones). Invariant: the DPM merges a log's
//! segments in order, so when the segment holding a key's newest entry is merged, every older
//! entry of the key is merged too, and the key is dropped from the copy.

use std::collections::VecDeque;

use bytes::Bytes;
use hashbrown::{HashMap, HashSet};

use crate::cache::Shortcut;

/// The newest logged state of a key: a value, or a tombstone (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    pub shortcut: Shortcut,
    pub value: Option<Bytes>,
}

#[derive(Debug, Default)]
pub struct Unmerged {
    /// Segments in log order, each with the keys whose entries it got (each key once).
    segments: VecDeque<(u64, Vec<Bytes>)>,
    /// Each key's newest logged state and the segment it is in.
    newest: HashMap<Bytes, (u64, Logged)>,
}

impl Unmerged {
    /// Records an entry logged in `segment`, the newest segment or a later one.
    pub fn insert(&mut self, segment: u64, key: Bytes, logged: Logged) {
        if self.segments.back().is_none_or(|(id, _)| *id != segment) {
            self.segments.push_back((segment, Vec::new()));
        }
        let keys = &mut self.segments.back_mut().expect("pushed").1;
        match self.newest.insert(key.clone(), (segment, logged)) {
            Some((previous, _)) if previous == segment => {} // already listed
            _ => keys.push(key),
        }
    }

    /// The newest logged state of `key`, if it is in an unmerged segment.
    pub fn get(&self, key: &[u8]) -> Option<&Logged> {
        self.newest.get(key).map(|(_, logged)| logged)
    }

    /// Keeps only the segments still pending at the DPM.
    pub fn retain_pending(&mut self, pending: &HashSet<u64>) {
        let newest = &mut self.newest;
        self.segments.retain(|(id, keys)| {
            if pending.contains(id) {
                return true;
            }
            for k in keys {
                if newest.get(k).is_some_and(|(s, _)| s == id) {
                    newest.remove(k);
                }
            }
            false
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dinomo_layout::index::EntryPtr;

    fn logged(v: &str) -> Logged {
        Logged {
            shortcut: Shortcut {
                ptr: EntryPtr::new(64, 32),
                version: 1,
            },
            value: Some(Bytes::copy_from_slice(v.as_bytes())),
        }
    }

    fn value<'a>(u: &'a Unmerged, k: &str) -> Option<&'a [u8]> {
        u.get(k.as_bytes()).and_then(|l| l.value.as_deref())
    }

    /// The newest entry wins across segments, and merging a segment drops exactly the keys
    /// whose newest entry it held.
    #[test]
    fn newest_entry_wins_and_merged_segments_drop_their_keys() {
        let mut u = Unmerged::default();
        let key = |k: &str| Bytes::copy_from_slice(k.as_bytes());
        u.insert(1, key("a"), logged("a1"));
        u.insert(1, key("b"), logged("b1"));
        u.insert(1, key("a"), logged("a2"));
        u.insert(2, key("a"), logged("a3"));
        u.insert(2, key("c"), logged("c1"));
        assert_eq!(value(&u, "a"), Some(&b"a3"[..]));
        assert_eq!(value(&u, "b"), Some(&b"b1"[..]));

        // Segment 1 merged: "b" is in the index now; "a"'s newest entry is still unmerged.
        u.retain_pending(&[2].into_iter().collect());
        assert_eq!(value(&u, "a"), Some(&b"a3"[..]));
        assert_eq!(value(&u, "b"), None);
        assert_eq!(value(&u, "c"), Some(&b"c1"[..]));

        u.retain_pending(&HashSet::new());
        assert!(u.newest.is_empty() && u.segments.is_empty());
    }
}
