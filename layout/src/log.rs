//! Log entries and batches: what a KN writes into its segments with one one-sided WRITE per
//! batch, and how anyone finds the valid end of a log afterwards (Tailwind-style).
//!
//! Entry: `crc u32 | op u8 | flags u8 | key_len u16 | value_len u32 | reserved u32 |
//! version u64 | key | value | zero pad to 8`. The CRC32C covers every byte after itself up to
//! the end of the value, so a KN that READs an entry through a cached shortcut can verify it
//! alone.
//!
//! Batch: `magic u32 | payload_len u32 | count u32 | reserved u32 | entries | chain u32 |
//! trailer magic u32`, where `chain = crc32c_append(previous chain, header || entries)` and the
//! first batch of a segment chains from the segment header's checksum. A batch is valid iff its
//! chain matches; scanning stops at the first batch that does not, so a torn batch (any prefix
//! of its bytes) is dropped whole and no separately written tail pointer is needed.
//!
//! Invariant relied on: a log has at most one batch WRITE in flight, so only the last batch of
//! a log can be torn.

use crate::{align8, need, u16_at, u32_at, u64_at, LayoutError, Result};

pub const ENTRY_HEADER: usize = 24;
pub const BATCH_HEADER: usize = 16;
pub const BATCH_TRAILER: usize = 8;
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"BTCH");
pub const TRAILER_MAGIC: u32 = u32::from_le_bytes(*b"HCTB");
/// Largest key a log entry can carry.
pub const MAX_KEY: usize = u16::MAX as usize;

/// What a log entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum LogOp {
    Put = 1,
    Delete = 2,
}

impl LogOp {
    fn from_u8(v: u8) -> Result<Self> {
        match v {
            1 => Ok(LogOp::Put),
            2 => Ok(LogOp::Delete),
            o => Err(LayoutError::Invalid {
                what: "log entry",
                detail: format!("unknown op {o}"),
            }),
        }
    }
}

/// A decoded entry borrowing its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryRef<'a> {
    pub op: LogOp,
    pub version: u64,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// Bytes an entry takes in the log, padding included.
pub fn entry_len(key_len: usize, value_len: usize) -> usize {
    align8(ENTRY_HEADER + key_len + value_len)
}

/// Appends an encoded entry to `out`.
///
/// # Panics
/// If the key is longer than [`MAX_KEY`] or the value longer than `u32::MAX`: callers validate
/// sizes at the API boundary.
pub fn encode_entry(op: LogOp, version: u64, key: &[u8], value: &[u8], out: &mut Vec<u8>) {
    assert!(
        key.len() <= MAX_KEY,
        "key of {} bytes exceeds the log format",
        key.len()
    );
    let value_len = u32::try_from(value.len()).expect("value fits the log format");
    let start = out.len();
    out.extend_from_slice(&[0u8; 4]);
    out.push(op as u8);
    out.push(0);
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(&value_len.to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(value);
    let crc = crc32c::crc32c(&out[start + 4..]);
    out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
    out.resize(start + entry_len(key.len(), value.len()), 0);
}

/// Reads the lengths from an entry header without checking the CRC: how many bytes to fetch.
pub fn entry_len_from_header(b: &[u8]) -> Result<usize> {
    need("log entry header", b, ENTRY_HEADER)?;
    Ok(entry_len(usize::from(u16_at(b, 6)), u32_at(b, 8) as usize))
}

/// Decodes and verifies one entry at the start of `b`; returns it and its padded length.
pub fn decode_entry(b: &[u8]) -> Result<(EntryRef<'_>, usize)> {
    need("log entry", b, ENTRY_HEADER)?;
    let key_len = usize::from(u16_at(b, 6));
    let value_len = u32_at(b, 8) as usize;
    let body = ENTRY_HEADER + key_len + value_len;
    need("log entry", b, body)?;
    let stored = u32_at(b, 0);
    let computed = crc32c::crc32c(&b[4..body]);
    if stored != computed {
        return Err(LayoutError::Checksum {
            what: "log entry",
            stored,
            computed,
        });
    }
    let entry = EntryRef {
        op: LogOp::from_u8(b[4])?,
        version: u64_at(b, 16),
        key: &b[ENTRY_HEADER..ENTRY_HEADER + key_len],
        value: &b[ENTRY_HEADER + key_len..body],
    };
    Ok((entry, align8(body)))
}

/// Bytes a batch with `payload` bytes of entries takes.
pub fn batch_len(payload: usize) -> usize {
    BATCH_HEADER + payload + BATCH_TRAILER
}

/// Accumulates entries into one batch (one WRITE).
#[derive(Debug, Clone)]
pub struct BatchBuilder {
    buf: Vec<u8>,
    count: u32,
}

impl Default for BatchBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl BatchBuilder {
    pub fn new() -> Self {
        let mut buf = Vec::with_capacity(4096);
        buf.resize(BATCH_HEADER, 0);
        BatchBuilder { buf, count: 0 }
    }

    /// Adds an entry; returns its offset from the start of the batch.
    pub fn push(&mut self, op: LogOp, version: u64, key: &[u8], value: &[u8]) -> usize {
        let at = self.buf.len();
        encode_entry(op, version, key, value, &mut self.buf);
        self.count += 1;
        at
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Length the batch will have once finished.
    pub fn encoded_len(&self) -> usize {
        self.buf.len() + BATCH_TRAILER
    }

    /// Closes the batch, chaining from `prev_chain`; returns its bytes and the new chain value.
    pub fn finish(mut self, prev_chain: u32) -> (Vec<u8>, u32) {
        let payload = (self.buf.len() - BATCH_HEADER) as u32;
        self.buf[0..4].copy_from_slice(&BATCH_MAGIC.to_le_bytes());
        self.buf[4..8].copy_from_slice(&payload.to_le_bytes());
        self.buf[8..12].copy_from_slice(&self.count.to_le_bytes());
        let chain = crc32c::crc32c_append(prev_chain, &self.buf);
        self.buf.extend_from_slice(&chain.to_le_bytes());
        self.buf.extend_from_slice(&TRAILER_MAGIC.to_le_bytes());
        (self.buf, chain)
    }
}

/// One valid batch found by [`scan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedBatch<'a> {
    /// Offset of the batch inside the scanned buffer.
    pub offset: usize,
    /// Total length, header and trailer included.
    pub len: usize,
    /// Chain value after this batch.
    pub chain: u32,
    /// Entries with their offsets inside the scanned buffer.
    pub entries: Vec<(usize, EntryRef<'a>)>,
}

/// Iterates the valid batches of a log from `start` (a batch boundary) with chain value `chain`.
/// Stops at the first batch that is absent, torn or corrupted; [`Scan::end`] then gives the
/// valid end of the log.
#[derive(Debug)]
pub struct Scan<'a> {
    buf: &'a [u8],
    pos: usize,
    chain: u32,
    stop: Option<LayoutError>,
}

pub fn scan(buf: &[u8], start: usize, chain: u32) -> Scan<'_> {
    Scan {
        buf,
        pos: start,
        chain,
        stop: None,
    }
}

impl<'a> Scan<'a> {
    /// Offset just past the last valid batch seen so far.
    pub fn end(&self) -> usize {
        self.pos
    }

    /// Chain value at [`Scan::end`].
    pub fn chain(&self) -> u32 {
        self.chain
    }

    /// Why the scan stopped, when it stopped on something other than a clean end (an all-zero
    /// or absent header is a clean end; a header with a good magic but a bad chain is a torn or
    /// corrupted batch).
    pub fn stop_reason(&self) -> Option<&LayoutError> {
        self.stop.as_ref()
    }

    fn next_batch(&mut self) -> Option<Result<ScannedBatch<'a>>> {
        let b = &self.buf[self.pos.min(self.buf.len())..];
        if b.len() < BATCH_HEADER + BATCH_TRAILER || u32_at(b, 0) != BATCH_MAGIC {
            return None;
        }
        let payload = u32_at(b, 4) as usize;
        let count = u32_at(b, 8);
        let total = match BATCH_HEADER
            .checked_add(payload)
            .and_then(|x| x.checked_add(BATCH_TRAILER))
        {
            Some(t) if t <= b.len() && payload.is_multiple_of(8) => t,
            _ => {
                return Some(Err(LayoutError::Invalid {
                    what: "log batch",
                    detail: format!("payload length {payload} does not fit the log"),
                }))
            }
        };
        let computed = crc32c::crc32c_append(self.chain, &b[..BATCH_HEADER + payload]);
        let stored = u32_at(b, BATCH_HEADER + payload);
        if stored != computed || u32_at(b, BATCH_HEADER + payload + 4) != TRAILER_MAGIC {
            return Some(Err(LayoutError::Checksum {
                what: "log batch chain",
                stored,
                computed,
            }));
        }
        // `count` is untrusted (a valid chain only proves who wrote it): never reserve more
        // than the payload can hold, at least ENTRY_HEADER bytes per entry.
        let mut entries = Vec::with_capacity((count as usize).min(payload / ENTRY_HEADER));
        let mut at = BATCH_HEADER;
        while at < BATCH_HEADER + payload {
            match decode_entry(&b[at..BATCH_HEADER + payload]) {
                Ok((e, len)) => {
                    entries.push((self.pos + at, e));
                    at += len;
                }
                Err(e) => return Some(Err(e)),
            }
        }
        if entries.len() != count as usize || at != BATCH_HEADER + payload {
            return Some(Err(LayoutError::Invalid {
                what: "log batch",
                detail: format!("header says {count} entries, found {}", entries.len()),
            }));
        }
        let batch = ScannedBatch {
            offset: self.pos,
            len: total,
            chain: computed,
            entries,
        };
        self.pos += total;
        self.chain = computed;
        Some(Ok(batch))
    }
}

impl<'a> Iterator for Scan<'a> {
    type Item = ScannedBatch<'a>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.stop.is_some() {
            return None;
        }
        match self.next_batch()? {
            Ok(b) => Some(b),
            Err(e) => {
                self.stop = Some(e);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_roundtrip_and_crc() {
        let mut v = Vec::new();
        encode_entry(LogOp::Put, 7, b"key", b"value!", &mut v);
        assert_eq!(v.len(), entry_len(3, 6));
        let (e, n) = decode_entry(&v).unwrap();
        assert_eq!(
            (e.op, e.version, e.key, e.value, n),
            (LogOp::Put, 7, &b"key"[..], &b"value!"[..], v.len())
        );
        v[ENTRY_HEADER] ^= 1;
        assert!(matches!(
            decode_entry(&v),
            Err(LayoutError::Checksum { .. })
        ));
    }

    #[test]
    fn scan_finds_end_and_drops_torn_last_batch() {
        let seed = 0xfeed;
        let mut log = vec![0u8; 4096];
        let mut chain = seed;
        let mut at = 0;
        for i in 0..3u64 {
            let mut b = BatchBuilder::new();
            b.push(LogOp::Put, i, format!("k{i}").as_bytes(), b"v");
            let (bytes, c) = b.finish(chain);
            log[at..at + bytes.len()].copy_from_slice(&bytes);
            at += bytes.len();
            chain = c;
        }
        let mut s = scan(&log, 0, seed);
        assert_eq!(s.by_ref().count(), 3);
        assert_eq!(s.end(), at);
        assert!(s.stop_reason().is_none());
        // Tear the third batch: lose its last 8 bytes.
        let third_len = batch_len(entry_len(2, 1));
        for b in &mut log[at - 8..at] {
            *b = 0;
        }
        let mut s = scan(&log, 0, seed);
        assert_eq!(s.by_ref().count(), 2);
        assert_eq!(s.end(), at - third_len);
        assert!(s.stop_reason().is_some());
    }
}
