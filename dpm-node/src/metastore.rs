//! Cluster metadata kept in the pool: a small map of names to bytes (cluster map, KN
//! endpoints, indirect cells, policy state), stored whole in one of two slots (A/B) so that a
//! crash during an update leaves the previous version readable.
//!
//! Every update happens under one lock, so a conditional update ([`MetaStore::update_if`],
//! the compare-and-swap that publishes the cluster map) sees no change between its check and
//! its write.
//!
//! It also keeps the monitor term (the record `dpm/monitor-term`, 8 bytes little-endian; absent
//! = 0, no term started yet): [`MetaStore::new_monitor_term`] starts the next one and
//! [`MetaStore::check_monitor_term`] admits a call of the current term. A read-write gate makes
//! the two exclusive: a new term waits for every admitted call to finish, so once it is
//! persisted no call of an older term is running or can start.

use std::collections::BTreeMap;
use std::sync::Arc;

use dinomo_layout::meta::{decode_slot, encode_slot, SLOT_HEADER};
use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::error::{DpmError, Result};
use crate::pool::Pool;

#[derive(Debug)]
struct State {
    map: BTreeMap<String, Vec<u8>>,
    seq: u64,
}

/// The metadata record of the newest monitor term (reserved: PutMetadata cannot write it).
pub const MONITOR_TERM_KEY: &str = "dpm/monitor-term";

#[derive(Debug)]
pub struct MetaStore {
    pool: Arc<Pool>,
    state: Mutex<State>,
    /// Held shared by calls admitted under a monitor term, exclusively to start a new term.
    term_gate: RwLock<()>,
}

/// A call admitted under the current monitor term; a new term waits until it is dropped.
#[derive(Debug)]
pub struct TermGuard<'a> {
    _gate: Option<RwLockReadGuard<'a, ()>>,
}

fn encode_map(map: &BTreeMap<String, Vec<u8>>) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (k, v) in map {
        b.extend_from_slice(&(k.len() as u32).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        b.extend_from_slice(&(v.len() as u32).to_le_bytes());
        b.extend_from_slice(v);
    }
    b
}

fn decode_map(mut b: &[u8]) -> Option<BTreeMap<String, Vec<u8>>> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (h, t) = b.split_at(n);
        *b = t;
        Some(h)
    }
    let u32_of = |x: &[u8]| u32::from_le_bytes(x.try_into().expect("4")) as usize;
    let n = u32_of(take(&mut b, 4)?);
    let mut map = BTreeMap::new();
    for _ in 0..n {
        let kl = u32_of(take(&mut b, 4)?);
        let k = String::from_utf8(take(&mut b, kl)?.to_vec()).ok()?;
        let vl = u32_of(take(&mut b, 4)?);
        map.insert(k, take(&mut b, vl)?.to_vec());
    }
    b.is_empty().then_some(map)
}

impl MetaStore {
    fn slot_len(pool: &Pool) -> u64 {
        pool.superblock().metadata_len / 2
    }

    fn slot_off(pool: &Pool, i: u64) -> u64 {
        pool.superblock().metadata_off + i * Self::slot_len(pool)
    }

    /// Loads the newest valid slot (an unreadable slot is skipped with a warning; if neither is
    /// readable but one was written, that is corruption and is refused).
    pub fn open(pool: Arc<Pool>) -> Result<Self> {
        let mut best: Option<(u64, BTreeMap<String, Vec<u8>>)> = None;
        let mut errors = Vec::new();
        for i in 0..2 {
            let raw = pool.view(Self::slot_off(&pool, i), Self::slot_len(&pool))?;
            match decode_slot(raw) {
                Ok(None) => {}
                Ok(Some((seq, data))) => match decode_map(data) {
                    Some(map) if best.as_ref().is_none_or(|(s, _)| seq > *s) => {
                        best = Some((seq, map))
                    }
                    Some(_) => {}
                    None => errors.push(format!("slot {i}: undecodable map")),
                },
                Err(e) => errors.push(format!("slot {i}: {e}")),
            }
        }
        if best.is_none() && !errors.is_empty() && errors.len() == 2 {
            return Err(DpmError::BadPool {
                path: pool.path(),
                detail: format!("metadata unreadable: {}", errors.join("; ")),
            });
        }
        for e in &errors {
            tracing::warn!(error = %e, "a metadata slot is unreadable (an interrupted update); using the other");
        }
        let (seq, map) = best.unwrap_or_default();
        Ok(MetaStore {
            pool,
            state: Mutex::new(State { map, seq }),
            term_gate: RwLock::new(()),
        })
    }

    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.state.lock().map.get(key).cloned()
    }

    /// Entries whose names start with `prefix`.
    pub fn scan(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        self.scan_bounded(prefix, usize::MAX).0
    }

    /// Entries whose names start with `prefix`, in name order, until their names and values
    /// would pass `max_bytes`; the name of the first entry left out, if any.
    pub fn scan_bounded(
        &self,
        prefix: &str,
        max_bytes: usize,
    ) -> (Vec<(String, Vec<u8>)>, Option<String>) {
        let st = self.state.lock();
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for (k, v) in st
            .map
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
        {
            bytes = bytes.saturating_add(k.len() + v.len());
            if bytes > max_bytes {
                return (out, Some(k.clone()));
            }
            out.push((k.clone(), v.clone()));
        }
        (out, None)
    }

    /// Sets (`Some`) or removes (`None`) entries and persists the new map before returning.
    pub fn update(&self, changes: &[(&str, Option<&[u8]>)]) -> Result<()> {
        self.update_if(|_| Ok(()), changes)
    }

    /// [`MetaStore::update`] if `check` accepts the current entries (it runs under the lock,
    /// so nothing changes between the check and the write); its error is returned otherwise.
    pub fn update_if(
        &self,
        check: impl FnOnce(&BTreeMap<String, Vec<u8>>) -> Result<()>,
        changes: &[(&str, Option<&[u8]>)],
    ) -> Result<()> {
        let mut st = self.state.lock();
        check(&st.map)?;
        let mut map = st.map.clone();
        for (k, v) in changes {
            match v {
                Some(v) => map.insert((*k).to_string(), v.to_vec()),
                None => map.remove(*k),
            };
        }
        let seq = st.seq + 1;
        let image = encode_slot(seq, &encode_map(&map));
        let cap = Self::slot_len(&self.pool) as usize;
        if image.len() > cap {
            return Err(DpmError::MetadataTooLarge {
                len: image.len() - SLOT_HEADER,
                cap: cap - SLOT_HEADER,
            });
        }
        // Alternate slots: seq odd -> slot 1, even -> slot 0; the other holds the previous copy.
        let off = Self::slot_off(&self.pool, seq % 2);
        self.pool.region().write_durable(off, &image)?;
        st.map = map;
        st.seq = seq;
        Ok(())
    }

    /// The newest monitor term started (0: none yet).
    pub fn monitor_term(&self) -> Result<u64> {
        term_of(&self.state.lock().map, &self.pool)
    }

    /// Starts the next monitor term and persists it; waits for every call admitted under an
    /// older term to finish first.
    pub fn new_monitor_term(&self) -> Result<u64> {
        // Only this writes the record (PutMetadata refuses "dpm/" names), under the gate.
        let _gate = self.term_gate.write();
        let next = self.monitor_term()? + 1;
        self.update(&[(MONITOR_TERM_KEY, Some(&next.to_le_bytes()))])?;
        Ok(next)
    }

    /// Admits a call carrying monitor term `term` (`None`: a caller outside the monitor
    /// protocol, not checked) until the guard is dropped; refuses an older term than the
    /// newest started ([`DpmError::StaleMonitorTerm`]) and one never started.
    pub fn check_monitor_term(&self, term: Option<u64>) -> Result<TermGuard<'_>> {
        let Some(term) = term else {
            return Ok(TermGuard { _gate: None });
        };
        let gate = self.term_gate.read();
        let newest = self.monitor_term()?;
        if term < newest {
            return Err(DpmError::StaleMonitorTerm { term, newest });
        }
        if term > newest {
            return Err(DpmError::InvalidArgument(format!(
                "monitor term {term} was never started (the newest is {newest}); \
                 a monitor gets its term from NewMonitorTerm"
            )));
        }
        Ok(TermGuard { _gate: Some(gate) })
    }
}

fn term_of(map: &BTreeMap<String, Vec<u8>>, pool: &Pool) -> Result<u64> {
    match map.get(MONITOR_TERM_KEY) {
        None => Ok(0),
        Some(b) => b
            .as_slice()
            .try_into()
            .map(u64::from_le_bytes)
            .map_err(|_| DpmError::BadPool {
                path: pool.path(),
                detail: format!(
                    "metadata {MONITOR_TERM_KEY:?} holds {} bytes, not the 8 of a term",
                    b.len()
                ),
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_codec_roundtrip_and_garbage() {
        let mut m = BTreeMap::new();
        m.insert("a".to_string(), vec![1, 2]);
        m.insert("b/c".to_string(), vec![]);
        assert_eq!(decode_map(&encode_map(&m)), Some(m));
        assert_eq!(decode_map(&[9, 0, 0, 0]), None);
    }
}
