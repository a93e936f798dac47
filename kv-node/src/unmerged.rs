//! The KN's copy of its unmerged log (DINOMO invariant: unmerged segments are cached in the KN
//! that wrote them, so no other KN ever needs them). Per segment, a map from key to the newest
//! entry logged there; lookups search the newest segment first. A segment is dropped once the
//! DPM reports it merged, after which the index has everything it held.

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
    segments: VecDeque<(u64, HashMap<Bytes, Logged>)>,
}

impl Unmerged {
    pub fn insert(&mut self, segment: u64, key: Bytes, logged: Logged) {
        match self.segments.back_mut() {
            Some((id, map)) if *id == segment => {
                map.insert(key, logged);
            }
            _ => {
                let mut map = HashMap::new();
                map.insert(key, logged);
                self.segments.push_back((segment, map));
            }
        }
    }

    /// The newest logged state of `key`, if it is in an unmerged segment.
    pub fn get(&self, key: &[u8]) -> Option<&Logged> {
        self.segments.iter().rev().find_map(|(_, m)| m.get(key))
    }

    /// Keeps only the segments still pending at the DPM.
    pub fn retain_pending(&mut self, pending: &HashSet<u64>) {
        self.segments.retain(|(id, _)| pending.contains(id));
    }

    pub fn segment_ids(&self) -> Vec<u64> {
        self.segments.iter().map(|(id, _)| *id).collect()
    }

    pub fn len(&self) -> usize {
        self.segments.len()
    }

    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
}
